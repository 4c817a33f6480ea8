//! Turning one YAML (or JSON) document into an [`Object`], with errors that
//! say what is wrong, where, and what to do.
//!
//! Sources call [`decode_yaml_document`] per document; it never panics and
//! returns `Ok(None)` for empty documents and for kinds the mesh does not use
//! (ConfigMap, Deployment, ...), which are only logged at debug level.
//!
//! Decoding checks the schema and what serde cannot express (IP syntax of
//! string fields, required names, `when` condition values); warnings about
//! what the control plane will not enforce are the control plane's business.

use std::net::IpAddr;

use serde::de::DeserializeOwned;
use serde_yaml::Value;
use tracing::debug;

use crate::objects::{AuthorizationPolicy, Cidr, Kind, Object, ObjectKey};

#[cfg(test)]
mod tests;

/// Why a document was rejected. Every message ends with what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    #[error("YAML syntax error: {0}; fix the syntax (indentation, quoting, a missing ':')")]
    Syntax(String),
    #[error(
        "the document is not a mapping (found {0}); each document must be one Kubernetes object with apiVersion, kind and metadata"
    )]
    NotAnObject(&'static str),
    #[error("missing {0}; every object needs apiVersion, kind and metadata.name")]
    MissingField(&'static str),
    #[error("{field} must be a string; quote the value")]
    NotAString { field: &'static str },
    #[error("apiVersion {api_version:?} is not supported for {kind}; use one of: {expected}")]
    UnsupportedApiVersion {
        kind: String,
        api_version: String,
        expected: String,
    },
    #[error(
        "unknown kind {kind:?} in API group {group}; check the spelling (supported: {supported})"
    )]
    UnknownKind {
        kind: String,
        group: String,
        supported: &'static str,
    },
    #[error("{0}; fix the field so it matches the {1} schema")]
    Schema(String, &'static str),
    #[error("{0}")]
    Invalid(String),
}

/// A rejected document: the error plus whatever identity could be read.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeFailure {
    /// Reliable key (read from a syntactically valid document of a modelled
    /// kind): the object with this key keeps its last good version.
    pub key: Option<ObjectKey>,
    /// Best-effort identity for messages (may come from a line scan when the
    /// YAML does not parse).
    pub kind: String,
    pub namespace: String,
    pub name: String,
    pub error: DecodeError,
}

/// Istio kinds we know but do not model yet (accepted and ignored).
const ISTIO_KINDS_IGNORED: &[&str] = &[
    "VirtualService",
    "DestinationRule",
    "Gateway",
    "WorkloadGroup",
    "Sidecar",
    "EnvoyFilter",
    "ProxyConfig",
    "RequestAuthentication",
    "Telemetry",
    "WasmPlugin",
];

/// Decodes one YAML document. `line_offset` is the number of lines that
/// precede `text` in its file, so that line numbers in messages are the
/// file's (0 when `text` stands alone).
pub fn decode_yaml_document(
    text: &str,
    line_offset: usize,
) -> Result<Option<Object>, Box<DecodeFailure>> {
    let value: Value = match serde_yaml::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            let (kind, namespace, name) = scan_identity(text);
            return Err(Box::new(DecodeFailure {
                key: None,
                kind,
                namespace,
                name,
                error: DecodeError::Syntax(message(&e, line_offset)),
            }));
        }
    };
    match read_head(&value)? {
        None => Ok(None),
        Some(key) => typed_from_str(text, line_offset, key).map(Some),
    }
}

/// Decodes an already parsed document (e.g. JSON from the API server
/// converted with `serde_yaml::to_value`).
pub fn decode_value(value: Value) -> Result<Option<Object>, Box<DecodeFailure>> {
    match read_head(&value)? {
        None => Ok(None),
        Some(key) => typed_from_value(value, key).map(Some),
    }
}

/// Reads apiVersion/kind/metadata, checks they are acceptable and returns the
/// kind and key when the document is a modelled object.
fn read_head(value: &Value) -> Result<Option<ObjectKey>, Box<DecodeFailure>> {
    let map = match value {
        Value::Null => return Ok(None),
        Value::Mapping(m) => m,
        other => {
            return Err(fail(
                None,
                "",
                "",
                "",
                DecodeError::NotAnObject(type_name(other)),
            ));
        }
    };
    let get_str = |m: &serde_yaml::Mapping, field: &'static str, k: &str| match m.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(DecodeError::NotAString { field }),
    };
    let meta = map.get("metadata");
    let name = meta
        .and_then(Value::as_mapping)
        .map(|m| get_str(m, "metadata.name", "name"))
        .transpose()
        .map(Option::flatten);
    let namespace = meta
        .and_then(Value::as_mapping)
        .map(|m| get_str(m, "metadata.namespace", "namespace"))
        .transpose()
        .map(Option::flatten);
    let kind = get_str(map, "kind", "kind");
    let api_version = get_str(map, "apiVersion", "apiVersion");
    let shown = |r: &Result<Option<String>, DecodeError>| {
        r.as_ref().ok().cloned().flatten().unwrap_or_default()
    };
    let (kind_s, name_s, ns_s) = (shown(&kind), shown(&name), shown(&namespace));
    let f = |key: Option<ObjectKey>, ns: &str, e| fail(key, &kind_s, ns, &name_s, e);
    let kind_str = kind.map_err(|e| f(None, &ns_s, e))?;
    let api_version = api_version.map_err(|e| f(None, &ns_s, e))?;
    let Some(kind_str) = kind_str else {
        return Err(f(None, &ns_s, DecodeError::MissingField("kind")));
    };
    let Some(api_version) = api_version else {
        return Err(f(None, &ns_s, DecodeError::MissingField("apiVersion")));
    };
    let Some(kind) = Kind::from_kind_str(&kind_str) else {
        let group = api_version.rsplit_once('/').map(|(g, _)| g).unwrap_or("");
        let (known, supported) = match group {
            "networking.istio.io" => (
                ISTIO_KINDS_IGNORED.contains(&kind_str.as_str()),
                "ServiceEntry, WorkloadEntry, VirtualService, DestinationRule, Gateway, Sidecar, WorkloadGroup",
            ),
            "security.istio.io" => (
                ISTIO_KINDS_IGNORED.contains(&kind_str.as_str()),
                "AuthorizationPolicy, PeerAuthentication, RequestAuthentication",
            ),
            _ => (true, ""),
        };
        if known {
            debug!(kind = %kind_str, %api_version, name = %name_s, "ignoring a kind the mesh model does not use");
            return Ok(None);
        }
        return Err(f(
            None,
            &ns_s,
            DecodeError::UnknownKind {
                kind: kind_str.clone(),
                group: group.to_string(),
                supported,
            },
        ));
    };
    let namespace = match namespace.map_err(|e| f(None, &ns_s, e))? {
        _ if !kind.is_namespaced() => String::new(),
        Some(ns) if !ns.is_empty() => ns,
        _ => "default".to_string(),
    };
    let name = name
        .map_err(|e| f(None, &namespace, e))?
        .unwrap_or_default();
    if name.is_empty() {
        return Err(f(
            None,
            &namespace,
            DecodeError::MissingField("metadata.name"),
        ));
    }
    let key = ObjectKey::new(kind, namespace.clone(), name);
    if !kind.api_versions().contains(&api_version.as_str()) {
        return Err(f(
            Some(key),
            &namespace,
            DecodeError::UnsupportedApiVersion {
                kind: kind_str.clone(),
                api_version,
                expected: kind.api_versions().join(", "),
            },
        ));
    }
    Ok(Some(key))
}

fn fail(
    key: Option<ObjectKey>,
    kind: &str,
    ns: &str,
    name: &str,
    error: DecodeError,
) -> Box<DecodeFailure> {
    Box::new(DecodeFailure {
        key,
        kind: kind.to_string(),
        namespace: ns.to_string(),
        name: name.to_string(),
        error,
    })
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "nothing",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

fn typed_from_str(text: &str, offset: usize, key: ObjectKey) -> Result<Object, Box<DecodeFailure>> {
    typed(key, |k| match k {
        Kind::Namespace => parse_str(text, offset).map(Object::Namespace),
        Kind::Pod => parse_str(text, offset).map(Object::Pod),
        Kind::Service => parse_str(text, offset).map(Object::Service),
        Kind::EndpointSlice => parse_str(text, offset).map(Object::EndpointSlice),
        Kind::ServiceEntry => parse_str(text, offset).map(|o| Object::ServiceEntry(Box::new(o))),
        Kind::WorkloadEntry => parse_str(text, offset).map(Object::WorkloadEntry),
        Kind::PeerAuthentication => parse_str(text, offset).map(Object::PeerAuthentication),
        Kind::AuthorizationPolicy => parse_str(text, offset).map(Object::AuthorizationPolicy),
    })
}

fn typed_from_value(v: Value, key: ObjectKey) -> Result<Object, Box<DecodeFailure>> {
    typed(key, move |k| match k {
        Kind::Namespace => parse_value(v).map(Object::Namespace),
        Kind::Pod => parse_value(v).map(Object::Pod),
        Kind::Service => parse_value(v).map(Object::Service),
        Kind::EndpointSlice => parse_value(v).map(Object::EndpointSlice),
        Kind::ServiceEntry => parse_value(v).map(|o| Object::ServiceEntry(Box::new(o))),
        Kind::WorkloadEntry => parse_value(v).map(Object::WorkloadEntry),
        Kind::PeerAuthentication => parse_value(v).map(Object::PeerAuthentication),
        Kind::AuthorizationPolicy => parse_value(v).map(Object::AuthorizationPolicy),
    })
}

fn parse_str<T: DeserializeOwned>(text: &str, offset: usize) -> Result<T, String> {
    serde_yaml::from_str(text).map_err(|e| message(&e, offset))
}

/// The error's message with its line number shifted by `offset`.
fn message(e: &serde_yaml::Error, offset: usize) -> String {
    let s = e.to_string();
    match e.location() {
        Some(loc) if offset > 0 => {
            let at = format!("at line {} column {}", loc.line(), loc.column());
            let fixed = format!("at line {} column {}", loc.line() + offset, loc.column());
            s.replacen(&at, &fixed, 1)
        }
        _ => s,
    }
}

fn parse_value<T: DeserializeOwned>(v: Value) -> Result<T, String> {
    serde_yaml::from_value(v).map_err(|e| e.to_string())
}

fn typed(
    key: ObjectKey,
    parse: impl FnOnce(Kind) -> Result<Object, String>,
) -> Result<Object, Box<DecodeFailure>> {
    let reject = |key: &ObjectKey, e: DecodeError| {
        fail(
            Some(key.clone()),
            key.kind.as_str(),
            &key.namespace,
            &key.name,
            e,
        )
    };
    let kind = key.kind;
    let mut obj = parse(kind).map_err(|e| reject(&key, DecodeError::Schema(e, kind.as_str())))?;
    {
        let m = obj.metadata_mut();
        m.namespace.clone_from(&key.namespace);
    }
    validate(&mut obj).map_err(|e| reject(&key, DecodeError::Invalid(e)))?;
    Ok(obj)
}

/// Checks what serde cannot and fills derived fields.
fn validate(obj: &mut Object) -> Result<(), String> {
    match obj {
        Object::Service(s) => {
            let mut vips = Vec::new();
            let mut all: Vec<&str> = Vec::new();
            if !s.spec.cluster_ip.is_empty() {
                all.push(&s.spec.cluster_ip);
            }
            all.extend(s.spec.cluster_ips.iter().map(String::as_str));
            for (i, ip) in all.into_iter().enumerate() {
                if ip == "None" || ip.is_empty() {
                    continue;
                }
                let parsed: IpAddr = ip.parse().map_err(|_| {
                    let field = if i == 0 && !s.spec.cluster_ip.is_empty() {
                        "spec.clusterIP".to_string()
                    } else {
                        "spec.clusterIPs".to_string()
                    };
                    format!("{field}: {ip:?} is not a valid IP address; use an IP, \"None\" for a headless service, or leave it out")
                })?;
                if !vips.contains(&parsed) {
                    vips.push(parsed);
                }
            }
            if s.is_headless() {
                vips.clear();
            }
            s.spec.vips = vips;
            for (i, p) in s.spec.ports.iter().enumerate() {
                if p.port == 0 {
                    return Err(format!(
                        "spec.ports[{i}].port is missing; every service port needs a number (1-65535)"
                    ));
                }
            }
            if s.spec.ports.len() > 1 && s.spec.ports.iter().any(|p| p.name.is_empty()) {
                return Err("spec.ports: every port needs a name when a Service has more than one port; add `name:` to each".to_string());
            }
        }
        Object::EndpointSlice(es) => {
            let fqdn = es.address_type == "FQDN";
            for (i, ep) in es.endpoints.iter_mut().enumerate() {
                ep.ips.clear();
                if fqdn {
                    continue;
                }
                for a in &ep.addresses {
                    let ip: IpAddr = a.parse().map_err(|_| {
                        format!("endpoints[{i}].addresses: {a:?} is not a valid IP address; use an IP (or addressType: FQDN for host names)")
                    })?;
                    ep.ips.push(ip);
                }
            }
        }
        Object::ServiceEntry(se) => {
            if se.spec.hosts.is_empty() {
                return Err(
                    "spec.hosts is empty; a ServiceEntry needs at least one host".to_string(),
                );
            }
            if se.spec.workload_selector.is_some() && !se.spec.endpoints.is_empty() {
                return Err(
                    "spec.workloadSelector and spec.endpoints are both set; use only one of them"
                        .to_string(),
                );
            }
            let mut vips = Vec::new();
            for a in &se.spec.addresses {
                let c: Cidr = a
                    .parse()
                    .map_err(|e| format!("spec.addresses: {e}; list virtual IPs or CIDRs"))?;
                if c.is_host() {
                    vips.push(c.addr);
                } else {
                    debug!(address = %a, "ServiceEntry CIDR address is not a single VIP; it is not used as a service address");
                }
            }
            se.spec.vips = vips;
            for (i, p) in se.spec.ports.iter().enumerate() {
                if p.number == 0 {
                    return Err(format!(
                        "spec.ports[{i}].number is missing; every ServiceEntry port needs a number (1-65535)"
                    ));
                }
            }
        }
        Object::Pod(p) => {
            for (i, c) in p.spec.containers.iter().enumerate() {
                for (j, cp) in c.ports.iter().enumerate() {
                    if cp.container_port == 0 {
                        return Err(format!(
                            "spec.containers[{i}].ports[{j}].containerPort is missing; add the port number"
                        ));
                    }
                }
            }
        }
        Object::AuthorizationPolicy(ap) => validate_policy(ap)?,
        Object::Namespace(_) | Object::WorkloadEntry(_) | Object::PeerAuthentication(_) => {}
    }
    Ok(())
}

fn validate_policy(ap: &AuthorizationPolicy) -> Result<(), String> {
    for (i, r) in ap.spec.rules.iter().enumerate() {
        for (j, c) in r.when.iter().enumerate() {
            let at = format!("spec.rules[{i}].when[{j}]");
            let values = c.values.iter().chain(&c.not_values);
            match c.key.as_str() {
                "" => {
                    return Err(format!(
                        "{at}.key is missing; name the attribute, e.g. source.ip"
                    ));
                }
                "source.ip" | "destination.ip" => {
                    for v in values {
                        v.parse::<Cidr>()
                            .map_err(|e| format!("{at}: {e}; use IPs or CIDRs as values"))?;
                    }
                }
                "destination.port" => {
                    for v in values {
                        if v.trim().parse::<u16>().ok().filter(|p| *p != 0).is_none() {
                            return Err(format!(
                                "{at}: {v:?} is not a port number; use numbers 1-65535 as values"
                            ));
                        }
                    }
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// Best-effort `kind`, `metadata.namespace`, `metadata.name` from the raw
/// text of a document that is not valid YAML, for error messages only.
fn scan_identity(text: &str) -> (String, String, String) {
    let (mut kind, mut ns, mut name) = (String::new(), String::new(), String::new());
    let mut in_meta = false;
    let mut meta_indent: Option<usize> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let indent = line.len() - trimmed.len();
        let value = |prefix: &str| {
            trimmed.strip_prefix(prefix).map(|v| {
                v.split(" #")
                    .next()
                    .unwrap_or("")
                    .trim()
                    .trim_matches(['"', '\''])
                    .to_string()
            })
        };
        if indent == 0 {
            in_meta = trimmed.starts_with("metadata:");
            meta_indent = None;
            if let Some(v) = value("kind:") {
                kind = v;
            }
            continue;
        }
        if in_meta {
            let level = *meta_indent.get_or_insert(indent);
            if indent != level {
                continue;
            }
            if let Some(v) = value("name:") {
                name = v;
            } else if let Some(v) = value("namespace:") {
                ns = v;
            }
        }
    }
    (kind, ns, name)
}
