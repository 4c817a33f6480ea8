//! Parsing what the runtime hands the plugin: the network configuration on
//! stdin, `CNI_ARGS`, and the pod IPs in `prevResult`.

use crate::protocol::json_kind;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use serde::Deserialize;
use serde_json::{Map, Value};

use super::error::PluginError;
use crate::protocol::{DEFAULT_AGENT_SOCKET, PodRef};

/// The CNI versions this plugin speaks (answered to VERSION).
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

/// The version we report in VERSION and in errors when the configuration's
/// own version is unknown.
pub const OUR_VERSION: &str = "1.0.0";

/// Keys of the `ambit` section.
pub const AMBIT_KEYS: &[&str] = &[
    "agent_socket",
    "agent_timeout_ms",
    "allow_without_agent",
    "log_file",
];

/// Largest accepted stdin (a configuration with a big `prevResult` is a few KiB).
pub const MAX_STDIN: usize = 4 * 1024 * 1024;

/// Default `agent_timeout_ms`.
pub const DEFAULT_TIMEOUT_MS: u64 = 5000;
/// Largest `agent_timeout_ms`: beyond this the runtime's own timeout wins anyway.
pub const MAX_TIMEOUT_MS: u64 = 600_000;

/// Our options: the `ambit` object of the plugin configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AmbitOptions {
    /// The node agent's unix socket.
    #[serde(default = "default_socket")]
    pub agent_socket: PathBuf,
    /// Budget for connect + write + read of one agent exchange (ADD, CHECK).
    #[serde(default = "default_timeout")]
    pub agent_timeout_ms: u64,
    /// Let ADD and CHECK succeed (pod unenrolled, warning on stderr) when the
    /// agent is unreachable, instead of failing with code 11.
    #[serde(default)]
    pub allow_without_agent: bool,
    /// Append one JSON line per invocation to this file.
    #[serde(default)]
    pub log_file: Option<PathBuf>,
}

fn default_socket() -> PathBuf {
    PathBuf::from(DEFAULT_AGENT_SOCKET)
}

fn default_timeout() -> u64 {
    DEFAULT_TIMEOUT_MS
}

impl Default for AmbitOptions {
    fn default() -> Self {
        Self {
            agent_socket: default_socket(),
            agent_timeout_ms: DEFAULT_TIMEOUT_MS,
            allow_without_agent: false,
            log_file: None,
        }
    }
}

/// A parsed plugin configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct NetConf {
    pub cni_version: String,
    pub name: String,
    pub plugin_type: String,
    /// `prevResult`, when present and not null.
    pub prev_result: Option<Map<String, Value>>,
    pub ambit: AmbitOptions,
}

/// stdin → a JSON object (code 6 otherwise).
pub fn decode(stdin: &[u8]) -> Result<Map<String, Value>, PluginError> {
    if stdin.len() > MAX_STDIN {
        return Err(PluginError::Decode(format!(
            "{} bytes on stdin, more than the {MAX_STDIN} accepted",
            stdin.len()
        )));
    }
    if stdin.iter().all(u8::is_ascii_whitespace) {
        return Err(PluginError::Decode("stdin is empty".into()));
    }
    match serde_json::from_slice::<Value>(stdin) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(PluginError::Decode(format!(
            "expected a JSON object, got {}",
            json_kind(&other)
        ))),
        Err(e) => Err(PluginError::Decode(e.to_string())),
    }
}

/// The configuration's `cniVersion`, if it is one we speak.
///
/// Missing is incompatible (the spec requires it; libcni's skeleton reads a
/// missing version as 0.1.0, which nobody speaks any more).
pub fn version(conf: &Map<String, Value>) -> Result<String, PluginError> {
    match conf.get("cniVersion") {
        None | Some(Value::Null) => Err(PluginError::IncompatibleVersion(
            "the configuration has no \"cniVersion\"".into(),
        )),
        Some(Value::String(v)) if SUPPORTED_VERSIONS.contains(&v.as_str()) => Ok(v.clone()),
        Some(Value::String(v)) => Err(PluginError::IncompatibleVersion(format!(
            "cniVersion \"{v}\" is not supported"
        ))),
        Some(other) => Err(PluginError::Decode(format!(
            "\"cniVersion\" must be a string, got {}",
            json_kind(other)
        ))),
    }
}

/// The whole configuration, its version already checked by [`version`].
pub fn parse(mut conf: Map<String, Value>, cni_version: String) -> Result<NetConf, PluginError> {
    let name = required_string(&conf, "name")?;
    let plugin_type = required_string(&conf, "type")?;
    // Our options at the top level would be silently ignored: say so.
    let misplaced: Vec<&str> = AMBIT_KEYS
        .iter()
        .copied()
        .filter(|k| conf.contains_key(*k))
        .collect();
    if !misplaced.is_empty() {
        return Err(PluginError::UnsupportedField(format!(
            "{} must be inside the \"ambit\" object, not at the top level",
            quoted(&misplaced)
        )));
    }
    let ambit = match conf.remove("ambit") {
        None | Some(Value::Null) => AmbitOptions::default(),
        Some(Value::Object(map)) => ambit_options(map)?,
        Some(other) => {
            return Err(PluginError::InvalidConfig(format!(
                "\"ambit\" must be an object, got {}",
                json_kind(&other)
            )));
        }
    };
    let prev_result = match conf.remove("prevResult") {
        None | Some(Value::Null) => None,
        Some(Value::Object(map)) => Some(map),
        Some(other) => {
            return Err(PluginError::InvalidConfig(format!(
                "\"prevResult\" must be an object, got {}",
                json_kind(&other)
            )));
        }
    };
    Ok(NetConf {
        cni_version,
        name,
        plugin_type,
        prev_result,
        ambit,
    })
}

fn ambit_options(map: Map<String, Value>) -> Result<AmbitOptions, PluginError> {
    let unknown: Vec<&str> = map
        .keys()
        .map(String::as_str)
        .filter(|k| !AMBIT_KEYS.contains(k))
        .collect();
    if !unknown.is_empty() {
        return Err(PluginError::UnsupportedField(format!(
            "unknown key(s) {} in \"ambit\"",
            quoted(&unknown)
        )));
    }
    let opts: AmbitOptions = serde_json::from_value(Value::Object(map))
        .map_err(|e| PluginError::InvalidConfig(format!("in \"ambit\": {e}")))?;
    if opts.agent_socket.as_os_str().is_empty() {
        return Err(PluginError::InvalidConfig(
            "\"ambit.agent_socket\" is empty".into(),
        ));
    }
    if opts.agent_timeout_ms == 0 || opts.agent_timeout_ms > MAX_TIMEOUT_MS {
        return Err(PluginError::InvalidConfig(format!(
            "\"ambit.agent_timeout_ms\" is {}, must be 1..={MAX_TIMEOUT_MS}",
            opts.agent_timeout_ms
        )));
    }
    if opts
        .log_file
        .as_ref()
        .is_some_and(|p| p.as_os_str().is_empty())
    {
        return Err(PluginError::InvalidConfig(
            "\"ambit.log_file\" is empty".into(),
        ));
    }
    Ok(opts)
}

fn required_string(conf: &Map<String, Value>, key: &str) -> Result<String, PluginError> {
    match conf.get(key) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::String(_)) => Err(PluginError::InvalidConfig(format!("\"{key}\" is empty"))),
        None | Some(Value::Null) => {
            Err(PluginError::InvalidConfig(format!("\"{key}\" is missing")))
        }
        Some(other) => Err(PluginError::InvalidConfig(format!(
            "\"{key}\" must be a string, got {}",
            json_kind(other)
        ))),
    }
}

/// The pod IPs: `prevResult.ips[].address` (CIDR, e.g. `10.1.2.3/24`),
/// in order, without duplicates.
pub fn prev_result_ips(prev: &Map<String, Value>) -> Result<Vec<IpAddr>, PluginError> {
    let ips = match prev.get("ips") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(ips)) => ips,
        Some(other) => {
            return Err(PluginError::InvalidConfig(format!(
                "\"prevResult.ips\" must be an array, got {}",
                json_kind(other)
            )));
        }
    };
    let mut out = Vec::new();
    for (i, entry) in ips.iter().enumerate() {
        let address = match entry.get("address") {
            Some(Value::String(a)) => a,
            _ => {
                return Err(PluginError::InvalidConfig(format!(
                    "\"prevResult.ips[{i}].address\" is missing or not a string"
                )));
            }
        };
        let ip = parse_cidr_ip(address).ok_or_else(|| {
            PluginError::InvalidConfig(format!(
                "\"prevResult.ips[{i}].address\" is \"{address}\", not an address in CIDR form"
            ))
        })?;
        if !out.contains(&ip) {
            out.push(ip);
        }
    }
    Ok(out)
}

/// `10.1.2.3/24` → 10.1.2.3 (a bare address is accepted too).
pub fn parse_cidr_ip(s: &str) -> Option<IpAddr> {
    let (ip, len) = match s.split_once('/') {
        Some((ip, len)) => (ip, Some(len)),
        None => (s, None),
    };
    let ip: IpAddr = ip.parse().ok()?;
    if let Some(len) = len {
        let len: u8 = len.parse().ok()?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        if len > max {
            return None;
        }
    }
    Some(ip)
}

/// `CNI_ARGS`: `KEY=VALUE` pairs separated by `;`. Strict: a pair without
/// `=` or with an empty key is an error (ADD and CHECK must not miss the pod
/// because of a malformed variable). Empty segments are skipped.
pub fn parse_cni_args(args: &str) -> Result<BTreeMap<String, String>, PluginError> {
    let mut out = BTreeMap::new();
    for pair in args.split(';') {
        if pair.trim().is_empty() {
            continue;
        }
        match pair.split_once('=') {
            Some((k, v)) if !k.trim().is_empty() => {
                out.insert(k.trim().to_string(), v.trim().to_string());
            }
            _ => {
                return Err(PluginError::InvalidEnv(format!(
                    "CNI_ARGS has \"{pair}\", not KEY=VALUE"
                )));
            }
        }
    }
    Ok(out)
}

/// Lenient `CNI_ARGS` parsing for DEL: malformed pairs are skipped.
pub fn parse_cni_args_lenient(args: &str) -> BTreeMap<String, String> {
    args.split(';')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(k, _)| !k.trim().is_empty())
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

/// The Kubernetes pod named by `CNI_ARGS`: `Ok(None)` when there is neither
/// `K8S_POD_NAME` nor `K8S_POD_NAMESPACE` (not a Kubernetes pod), an error
/// when only one of them is there.
pub fn pod_ref(args: &BTreeMap<String, String>) -> Result<Option<PodRef>, PluginError> {
    let get = |k: &str| args.get(k).filter(|v| !v.is_empty()).cloned();
    match (get("K8S_POD_NAME"), get("K8S_POD_NAMESPACE")) {
        (None, None) => Ok(None),
        (Some(name), Some(namespace)) => Ok(Some(PodRef {
            name,
            namespace,
            uid: get("K8S_POD_UID").unwrap_or_default(),
        })),
        (Some(_), None) => Err(PluginError::InvalidEnv(
            "CNI_ARGS has K8S_POD_NAME but no K8S_POD_NAMESPACE".into(),
        )),
        (None, Some(_)) => Err(PluginError::InvalidEnv(
            "CNI_ARGS has K8S_POD_NAMESPACE but no K8S_POD_NAME".into(),
        )),
    }
}

fn quoted(keys: &[&str]) -> String {
    keys.iter()
        .map(|k| format!("\"{k}\""))
        .collect::<Vec<_>>()
        .join(", ")
}
