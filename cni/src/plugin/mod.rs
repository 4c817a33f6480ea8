//! `ambit-cni`: the chained CNI plugin the container runtime execs after the
//! interface plugin (e.g. `bridge` + `host-local`). CNI spec 1.0.0; configs
//! with `cniVersion` 0.3.0, 0.3.1, 0.4.0, 1.0.0 and 1.1.0 are accepted.
//!
//! It never touches the pod's network itself: for a Kubernetes pod it reports
//! the invocation to the node agent ([`crate::protocol`]) and the agent
//! decides whether the pod is enrolled and sets it up before answering.
//!
//! | command | what happens | success output |
//! |---------|--------------|----------------|
//! | ADD     | needs `prevResult`; pod from `CNI_ARGS`, IPs from `prevResult.ips[].address`; asks the agent (`agent_timeout_ms`); no `K8S_POD_*` → not asked | `prevResult`, its `cniVersion` set to the config's |
//! | DEL     | tells the agent best-effort (at most 2 s); succeeds whatever the agent says or whether it runs; idempotent | nothing |
//! | CHECK   | needs `prevResult`; asks the agent; fails if it says not ok | nothing |
//! | VERSION | stdin ignored | `{"cniVersion":"1.0.0","supportedVersions":[...]}` |
//! | STATUS  | succeeds if the agent's socket accepts a connection, else code 50 | nothing |
//! | GC      | nothing to collect (the agent reconciles) | nothing |
//!
//! Run without `CNI_COMMAND`, or with `--help` / `--version` at a terminal,
//! it prints what it is and where its config goes ([`usage`]) and exits 0.
//!
//! Failures are the spec's error JSON on stdout
//! (`{"cniVersion","code","msg","details"}`) with exit status 1: 1 for a
//! missing or unsupported `cniVersion`; 2 for an unknown key in the `ambit`
//! section (or one of its keys written at the top level); 4 for a missing or
//! unknown `CNI_COMMAND`, a missing `CNI_CONTAINERID`/`CNI_NETNS`/`CNI_IFNAME`
//! or a malformed `CNI_ARGS`; 5 when stdin cannot be read; 6 when stdin is
//! not a JSON object (empty, not JSON, a non-string `cniVersion`); 7 for a
//! valid JSON object that is not a valid configuration (missing `name`,
//! `type` or, for ADD and CHECK, `prevResult`; wrong types; a `prevResult`
//! IP that is not CIDR); 11 when the agent is unreachable, times out or asks
//! to retry; 50 from STATUS; 999 when the agent refuses the pod or answers
//! garbage.
//!
//! # Configuration
//!
//! Unknown top-level keys are ignored as the spec requires (runtimes add
//! `runtimeConfig`, `args`, `capabilities`, ...). Our own options live in one
//! object, whose unknown keys are rejected with code 2 so a typo does not
//! silently change behaviour:
//!
//! ```json
//! { "cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "ambit-cni",
//!   "ambit": {
//!     "agent_socket": "/var/run/ambit/cni.sock",
//!     "agent_timeout_ms": 5000,
//!     "allow_without_agent": false,
//!     "log_file": "/var/log/ambit-cni.log" } }
//! ```
//!
//! - `agent_socket` (default [`crate::protocol::DEFAULT_AGENT_SOCKET`]).
//! - `agent_timeout_ms` (default 5000, 1..=600000): connect + write + read
//!   budget for ADD, CHECK and STATUS; the agent may install rules and wait
//!   for ztunnel's ack before answering.
//! - `allow_without_agent` (default false): when the agent is unreachable or
//!   does not answer in time, ADD and CHECK fail with code 11 so no pod runs
//!   outside the mesh; true lets them succeed with a warning on stderr (the
//!   pod starts unenrolled; the agent enrolls it when it comes back) and
//!   makes STATUS succeed. An explicit refusal from the agent always fails.
//! - `log_file`: one JSON line appended per invocation (command, container,
//!   pod, result, warnings); an invocation whose configuration cannot be
//!   read is not logged (the path is in the configuration), its error JSON
//!   still goes to the runtime.

pub mod agent;
pub mod config;
pub mod error;
#[cfg(test)]
mod tests;
pub mod usage;

use std::collections::BTreeMap;
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Map, Value, json};

pub use agent::{Agent, AgentError, UnixAgent};
pub use config::{AmbitOptions, NetConf, OUR_VERSION, SUPPORTED_VERSIONS};
pub use error::PluginError;

use crate::protocol::{Command, PodRef, Reply, Request};

/// Longest DEL waits for the agent: DEL is best-effort and must not stall
/// pod deletion.
pub const DEL_TIMEOUT: Duration = Duration::from_secs(2);

/// The `CNI_*` environment of one invocation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Env {
    pub command: Option<String>,
    pub container_id: Option<String>,
    pub netns: Option<String>,
    pub ifname: Option<String>,
    pub args: Option<String>,
    pub path: Option<String>,
    /// Variables that are set but not UTF-8.
    pub not_unicode: Vec<String>,
}

impl Env {
    /// The process environment.
    pub fn from_process() -> Self {
        let mut not_unicode = Vec::new();
        let mut get = |name: &str| match std::env::var(name) {
            Ok(v) => Some(v),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(_)) => {
                not_unicode.push(name.to_string());
                None
            }
        };
        Self {
            command: get("CNI_COMMAND"),
            container_id: get("CNI_CONTAINERID"),
            netns: get("CNI_NETNS"),
            ifname: get("CNI_IFNAME"),
            args: get("CNI_ARGS"),
            path: get("CNI_PATH"),
            not_unicode,
        }
    }
}

/// What the invocation prints, exits with and logs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    pub stdout: Vec<u8>,
    /// Warnings for the runtime's log.
    pub stderr: Vec<u8>,
    pub exit_code: i32,
    /// The line for `log_file` (without newline), when one is configured.
    pub log: Option<String>,
    pub log_file: Option<PathBuf>,
}

impl Outcome {
    /// Write stdout, stderr and the log line; the process's exit code.
    pub fn emit(self) -> i32 {
        let mut stdout = std::io::stdout().lock();
        let _ = stdout.write_all(&self.stdout).and_then(|()| stdout.flush());
        let mut stderr = std::io::stderr().lock();
        let _ = stderr.write_all(&self.stderr);
        if let (Some(line), Some(path)) = (&self.log, &self.log_file)
            && let Err(e) = append_line(path, line)
        {
            let _ = writeln!(
                stderr,
                "ambit-cni: warning: cannot append to log file {}: {e}",
                path.display()
            );
        }
        self.exit_code
    }
}

fn append_line(path: &Path, line: &str) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    // One write so concurrent invocations do not interleave within a line.
    f.write_all(format!("{line}\n").as_bytes())
}

/// The binary: read the environment and stdin, run, print, exit code.
/// Run by a person (`--help`, `--version`, or no `CNI_COMMAND`), it prints
/// the usage text instead ([`usage::for_person`]).
pub fn main() -> i32 {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    if let Some(text) = usage::for_person(
        &args,
        std::env::var_os("CNI_COMMAND").is_some(),
        std::io::stdout().is_terminal(),
    ) {
        return text.emit();
    }
    let env = Env::from_process();
    let is_version = env.command.as_deref() == Some("VERSION");
    let mut stdin = Vec::new();
    // VERSION ignores stdin, but drains what the runtime writes (so its
    // write never fails); a terminal is not read so `CNI_COMMAND=VERSION
    // ambit-cni` does not wait for input.
    let read = if is_version && std::io::stdin().is_terminal() {
        Ok(0)
    } else {
        std::io::stdin()
            .lock()
            .take(config::MAX_STDIN as u64 + 1)
            .read_to_end(&mut stdin)
    };
    let outcome = match read {
        Ok(_) => run(&env, &stdin),
        Err(_) if is_version => run(&env, b""),
        Err(e) => failure(OUR_VERSION, &PluginError::Io(format!("reading stdin: {e}"))),
    };
    outcome.emit()
}

/// One invocation against the real node agent.
pub fn run(env: &Env, stdin: &[u8]) -> Outcome {
    run_with(env, stdin, &UnixAgent)
}

/// One invocation against `agent`.
pub fn run_with(env: &Env, stdin: &[u8], agent: &dyn Agent) -> Outcome {
    let mut inv = Invocation {
        version: OUR_VERSION.to_string(),
        command: env.command.clone().unwrap_or_default(),
        container_id: env.container_id.clone().unwrap_or_default(),
        ..Invocation::default()
    };
    let result = dispatch(env, stdin, agent, &mut inv);
    inv.finish(result)
}

/// The error outcome for `err`, nothing else known.
pub fn failure(version: &str, err: &PluginError) -> Outcome {
    Outcome {
        stdout: error::ErrorJson::new(version, err).to_bytes(),
        exit_code: 1,
        ..Outcome::default()
    }
}

/// The VERSION answer.
pub fn version_json() -> Vec<u8> {
    let mut out = json!({ "cniVersion": OUR_VERSION, "supportedVersions": SUPPORTED_VERSIONS })
        .to_string()
        .into_bytes();
    out.push(b'\n');
    out
}

/// What one invocation learned, for the error JSON, stderr and the log.
#[derive(Debug, Default)]
struct Invocation {
    /// The `cniVersion` errors are reported in.
    version: String,
    command: String,
    container_id: String,
    log_file: Option<PathBuf>,
    pod: Option<PodRef>,
    enrolled: Option<bool>,
    warnings: Vec<String>,
}

impl Invocation {
    fn warn(&mut self, msg: String) {
        self.warnings.push(msg);
    }

    fn finish(self, result: Result<Vec<u8>, PluginError>) -> Outcome {
        let mut stderr = Vec::new();
        for w in &self.warnings {
            let _ = writeln!(stderr, "ambit-cni: warning: {w}");
        }
        let (stdout, exit_code, status) = match &result {
            Ok(out) => (out.clone(), 0, json!({ "result": "ok" })),
            Err(e) => (
                error::ErrorJson::new(&self.version, e).to_bytes(),
                1,
                json!({ "result": "error", "code": e.code(), "msg": e.to_string() }),
            ),
        };
        let log = self.log_file.is_some().then(|| {
            let ts_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0);
            let mut line = json!({
                "ts_unix_ms": ts_ms,
                "command": self.command,
                "container_id": self.container_id,
                "pod": self.pod.as_ref().map(|p| format!("{}/{}", p.namespace, p.name)),
                "enrolled": self.enrolled,
                "warnings": self.warnings,
            });
            if let (Value::Object(line), Value::Object(status)) = (&mut line, status) {
                line.extend(status);
            }
            line.to_string()
        });
        Outcome {
            stdout,
            stderr,
            exit_code,
            log,
            log_file: self.log_file,
        }
    }
}

fn dispatch(
    env: &Env,
    stdin: &[u8],
    agent: &dyn Agent,
    inv: &mut Invocation,
) -> Result<Vec<u8>, PluginError> {
    if !env.not_unicode.is_empty() {
        return Err(PluginError::InvalidEnv(format!(
            "{} not valid UTF-8",
            env.not_unicode.join(", ")
        )));
    }
    let command = match env.command.as_deref() {
        None => return Err(PluginError::InvalidEnv("CNI_COMMAND is not set".into())),
        Some("") => return Err(PluginError::InvalidEnv("CNI_COMMAND is empty".into())),
        Some(c) => c,
    };
    if command == "VERSION" {
        return Ok(version_json());
    }
    if !matches!(command, "ADD" | "DEL" | "CHECK" | "STATUS" | "GC") {
        return Err(PluginError::InvalidEnv(format!(
            "unknown CNI_COMMAND \"{command}\" (expected ADD, DEL, CHECK, VERSION, STATUS or GC)"
        )));
    }
    let raw = config::decode(stdin)?;
    let version = config::version(&raw)?;
    inv.version.clone_from(&version);
    let conf = config::parse(raw, version)?;
    inv.log_file.clone_from(&conf.ambit.log_file);
    match command {
        "ADD" => cmd_add(env, &conf, agent, inv),
        "CHECK" => cmd_check(env, &conf, agent, inv),
        "DEL" => cmd_del(env, &conf, agent, inv),
        "STATUS" => cmd_status(&conf, agent, inv),
        _ => Ok(Vec::new()), // GC: the agent reconciles on its own.
    }
}

fn require<'a>(value: &'a Option<String>, name: &str) -> Result<&'a str, PluginError> {
    match value.as_deref() {
        Some(v) if !v.is_empty() => Ok(v),
        _ => Err(PluginError::InvalidEnv(format!("{name} is not set"))),
    }
}

fn prev_result<'a>(
    conf: &'a NetConf,
    command: &str,
) -> Result<&'a Map<String, Value>, PluginError> {
    conf.prev_result.as_ref().ok_or_else(|| {
        PluginError::InvalidConfig(format!(
            "\"prevResult\" is missing; {command} needs the result of the plugins before \
             ambit-cni in the chain"
        ))
    })
}

/// `prevResult` as ADD's result, in the configuration's version.
fn result_json(prev: &Map<String, Value>, cni_version: &str) -> Vec<u8> {
    let mut result = prev.clone();
    result.insert("cniVersion".into(), Value::String(cni_version.to_string()));
    let mut out = Value::Object(result).to_string().into_bytes();
    out.push(b'\n');
    out
}

/// The agent request of an ADD or CHECK (strict about the environment).
fn pod_request(
    command: Command,
    env: &Env,
    prev: &Map<String, Value>,
) -> Result<Option<Request>, PluginError> {
    let container_id = require(&env.container_id, "CNI_CONTAINERID")?;
    let netns = require(&env.netns, "CNI_NETNS")?;
    let ifname = require(&env.ifname, "CNI_IFNAME")?;
    let args = config::parse_cni_args(env.args.as_deref().unwrap_or(""))?;
    let ips = config::prev_result_ips(prev)?;
    Ok(config::pod_ref(&args)?.map(|pod| Request {
        command,
        container_id: container_id.to_string(),
        netns: PathBuf::from(netns),
        ifname: ifname.to_string(),
        pod,
        ips,
    }))
}

/// The agent's answer to ADD or CHECK as a result; `what` names the command.
fn ask_agent(
    conf: &NetConf,
    agent: &dyn Agent,
    request: &Request,
    inv: &mut Invocation,
    what: &str,
) -> Result<(), PluginError> {
    let socket = &conf.ambit.agent_socket;
    let timeout = Duration::from_millis(conf.ambit.agent_timeout_ms);
    match agent.request(socket, request, timeout) {
        Ok(reply) if reply.ok => {
            inv.enrolled = Some(reply.enrolled);
            Ok(())
        }
        Ok(reply) => Err(reply_error(reply)),
        Err(AgentError::BadReply(m)) => Err(PluginError::AgentProtocol(m)),
        Err(e) if conf.ambit.allow_without_agent => {
            inv.warn(format!(
                "the ambit node agent at {} is not available ({e}); {what} of pod {}/{} \
                 succeeds WITHOUT mesh enrollment because allow_without_agent is set",
                socket.display(),
                request.pod.namespace,
                request.pod.name
            ));
            Ok(())
        }
        Err(e) => Err(PluginError::AgentUnavailable {
            socket: socket.clone(),
            cause: e.to_string(),
        }),
    }
}

fn reply_error(reply: Reply) -> PluginError {
    let msg = reply.error.unwrap_or_else(|| "no reason given".to_string());
    if reply.retry {
        PluginError::AgentRetry(msg)
    } else {
        PluginError::AgentRefused(msg)
    }
}

fn cmd_add(
    env: &Env,
    conf: &NetConf,
    agent: &dyn Agent,
    inv: &mut Invocation,
) -> Result<Vec<u8>, PluginError> {
    let prev = prev_result(conf, "ADD")?;
    let output = result_json(prev, &conf.cni_version);
    let Some(request) = pod_request(Command::Add, env, prev)? else {
        // Not a Kubernetes pod: nothing for the mesh to do.
        return Ok(output);
    };
    inv.pod = Some(request.pod.clone());
    ask_agent(conf, agent, &request, inv, "ADD")?;
    Ok(output)
}

fn cmd_check(
    env: &Env,
    conf: &NetConf,
    agent: &dyn Agent,
    inv: &mut Invocation,
) -> Result<Vec<u8>, PluginError> {
    let prev = prev_result(conf, "CHECK")?;
    let Some(request) = pod_request(Command::Check, env, prev)? else {
        return Ok(Vec::new());
    };
    inv.pod = Some(request.pod.clone());
    ask_agent(conf, agent, &request, inv, "CHECK")?;
    Ok(Vec::new())
}

/// DEL never fails because of the agent or of what it is told about: a
/// failing DEL blocks the pod's deletion for good.
fn cmd_del(
    env: &Env,
    conf: &NetConf,
    agent: &dyn Agent,
    inv: &mut Invocation,
) -> Result<Vec<u8>, PluginError> {
    let container_id = require(&env.container_id, "CNI_CONTAINERID")?;
    let args: BTreeMap<String, String> =
        config::parse_cni_args_lenient(env.args.as_deref().unwrap_or(""));
    let pod = match config::pod_ref(&args) {
        Ok(Some(pod)) => pod,
        Ok(None) => return Ok(Vec::new()),
        Err(e) => {
            inv.warn(format!("DEL: {e}; the agent is not told"));
            return Ok(Vec::new());
        }
    };
    inv.pod = Some(pod.clone());
    let ips = conf
        .prev_result
        .as_ref()
        .and_then(|p| config::prev_result_ips(p).ok())
        .unwrap_or_default();
    let request = Request {
        command: Command::Del,
        container_id: container_id.to_string(),
        netns: PathBuf::from(env.netns.as_deref().unwrap_or("")),
        ifname: env.ifname.clone().unwrap_or_default(),
        pod,
        ips,
    };
    let timeout = Duration::from_millis(conf.ambit.agent_timeout_ms).min(DEL_TIMEOUT);
    let socket = &conf.ambit.agent_socket;
    let problem = match agent.request(socket, &request, timeout) {
        Ok(reply) if reply.ok => None,
        Ok(reply) => Some(reply_error(reply).to_string()),
        Err(e) => Some(format!(
            "the ambit node agent at {} is not available ({e})",
            socket.display()
        )),
    };
    if let Some(problem) = problem {
        inv.warn(format!(
            "DEL of pod {}/{}: {problem}; DEL succeeds anyway, the agent reconciles",
            request.pod.namespace, request.pod.name
        ));
    }
    Ok(Vec::new())
}

fn cmd_status(
    conf: &NetConf,
    agent: &dyn Agent,
    inv: &mut Invocation,
) -> Result<Vec<u8>, PluginError> {
    let socket = &conf.ambit.agent_socket;
    let timeout = Duration::from_millis(conf.ambit.agent_timeout_ms);
    match agent.probe(socket, timeout) {
        Ok(()) => Ok(Vec::new()),
        Err(e) if conf.ambit.allow_without_agent => {
            inv.warn(format!(
                "the ambit node agent at {} is not available ({e}); pods start unenrolled \
                 because allow_without_agent is set",
                socket.display()
            ));
            Ok(Vec::new())
        }
        Err(e) => Err(PluginError::NotAvailable {
            socket: socket.clone(),
            cause: e.to_string(),
        }),
    }
}
