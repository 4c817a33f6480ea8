//! Turning one YAML document, JSON bytes or a JSON value into an [`Object`],
//! with errors that say what is wrong, where, and what to do.
//!
//! The file source calls [`decode_yaml_document`] per document, the
//! Kubernetes source will call [`decode_json`] on the API server's bytes (or
//! [`decode_json_value`] on a parsed value) — no detour through YAML. Each
//! never panics and returns `Ok(None)` for empty documents and for kinds the
//! mesh does not use (ConfigMap, Deployment, ...), which are only logged at
//! debug level.
//!
//! Every format goes the same two steps: the identity (`apiVersion`, `kind`,
//! `metadata`) is read first (`head.rs`), so a rejected document still names
//! its object; then the document is deserialized into the kind's struct
//! with the failing field's path in the message (`spec.ports[0].port`).
//!
//! Decoding checks the schema and what serde cannot express (IP syntax of
//! string fields, required names, and for the security kinds everything
//! Istio's validation refuses — `policy.rs`); warnings about what the
//! control plane will not enforce are the control plane's business.

use serde::Deserialize;
use serde::de::DeserializeOwned;
use tracing::debug;

use crate::limits::MAX_DOCUMENT_BYTES;
use crate::objects::{Kind, MESH_CONFIG_MAP, Object, ObjectKey, ROOT_NAMESPACES};

mod head;
mod policy;
mod validate;
mod yaml;

use head::{Field, Head};

#[cfg(test)]
mod gateway_api_tests;
#[cfg(test)]
mod istio_traffic_tests;
#[cfg(test)]
mod policy_validation_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod traffic_rejection_tests;

/// Why a document was rejected. Every message ends with what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    #[error("YAML syntax error: {0}; fix the syntax (indentation, quoting, a missing ':')")]
    Syntax(String),
    #[error("JSON syntax error: {0}; send one complete JSON object")]
    JsonSyntax(String),
    #[error(
        "rejected before parsing further: {0}; no Kubernetes object needs that — check how the file was written or generated"
    )]
    Limit(String),
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

/// `networking.istio.io` kinds we know but do not model (accepted and
/// ignored). `Gateway` here is Istio's ingress/egress gateway kind, not the
/// Gateway API's [`Kind::Gateway`].
const NETWORKING_ISTIO_KINDS_IGNORED: &[&str] =
    &["Gateway", "WorkloadGroup", "EnvoyFilter", "ProxyConfig"];
/// `security.istio.io` kinds we know but do not model.
const SECURITY_ISTIO_KINDS_IGNORED: &[&str] = &["RequestAuthentication"];

/// The kinds of an Istio API group that are accepted and ignored, and the
/// kinds the group supports (for messages); `None` for other groups, whose
/// unmodelled kinds are all ignored.
fn istio_group_kinds(group: &str) -> Option<(&'static [&'static str], &'static str)> {
    match group {
        "networking.istio.io" => Some((
            NETWORKING_ISTIO_KINDS_IGNORED,
            "ServiceEntry, WorkloadEntry, VirtualService, DestinationRule, Sidecar, Gateway, WorkloadGroup, EnvoyFilter, ProxyConfig",
        )),
        "security.istio.io" => Some((
            SECURITY_ISTIO_KINDS_IGNORED,
            "AuthorizationPolicy, PeerAuthentication, RequestAuthentication",
        )),
        _ => None,
    }
}

/// Decodes one YAML document. `line_offset` is the number of lines that
/// precede `text` in its file, so that line numbers in messages are the
/// file's (0 when `text` stands alone).
pub fn decode_yaml_document(
    text: &str,
    line_offset: usize,
) -> Result<Option<Object>, Box<DecodeFailure>> {
    let reject = |error| {
        let (kind, namespace, name) = scan_identity(prefix(text, 64 * 1024));
        Box::new(DecodeFailure {
            key: None,
            kind,
            namespace,
            name,
            error,
        })
    };
    if text.len() > MAX_DOCUMENT_BYTES {
        return Err(reject(DecodeError::Limit(too_large(text.len()))));
    }
    let head: Head = match yaml::from_yaml(text, line_offset) {
        Ok(h) => h,
        Err(e) if e.limit => return Err(reject(DecodeError::Limit(e.message))),
        Err(e) => return Err(reject(DecodeError::Syntax(e.message))),
    };
    decode_with(head, &YamlText { text, line_offset })
}

/// Decodes one object from JSON bytes (as the API server sends them).
pub fn decode_json(bytes: &[u8]) -> Result<Option<Object>, Box<DecodeFailure>> {
    if bytes.len() > MAX_DOCUMENT_BYTES {
        return Err(fail(
            None,
            "",
            "",
            "",
            DecodeError::Limit(too_large(bytes.len())),
        ));
    }
    let head: Head = serde_json::from_slice(bytes)
        .map_err(|e| fail(None, "", "", "", DecodeError::JsonSyntax(e.to_string())))?;
    decode_with(head, &JsonBytes(bytes))
}

/// Decodes one object from an already parsed JSON value.
pub fn decode_json_value(value: &serde_json::Value) -> Result<Option<Object>, Box<DecodeFailure>> {
    let head = Head::deserialize(value)
        .map_err(|e| fail(None, "", "", "", DecodeError::Invalid(e.to_string())))?;
    decode_with(head, &JsonValue(value))
}

fn too_large(len: usize) -> String {
    format!(
        "the document is {len} bytes, more than the limit of {MAX_DOCUMENT_BYTES} bytes (the document-size limit)"
    )
}

/// At most the first `max` bytes of `text`, cut at a character boundary.
fn prefix(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A document in some format, deserializable into any kind's struct; the
/// error is the message with the failing field's path.
trait Document {
    fn parse<T: DeserializeOwned>(&self) -> Result<T, String>;
}

struct YamlText<'t> {
    text: &'t str,
    line_offset: usize,
}

impl Document for YamlText<'_> {
    fn parse<T: DeserializeOwned>(&self) -> Result<T, String> {
        yaml::from_yaml(self.text, self.line_offset).map_err(|e| match e.path {
            Some(p) => format!("{p}: {}", e.message),
            None => e.message,
        })
    }
}

struct JsonBytes<'b>(&'b [u8]);

impl Document for JsonBytes<'_> {
    fn parse<T: DeserializeOwned>(&self) -> Result<T, String> {
        let mut de = serde_json::Deserializer::from_slice(self.0);
        serde_path_to_error::deserialize(&mut de).map_err(|e| e.to_string())
    }
}

struct JsonValue<'v>(&'v serde_json::Value);

impl Document for JsonValue<'_> {
    fn parse<T: DeserializeOwned>(&self) -> Result<T, String> {
        serde_path_to_error::deserialize(self.0).map_err(|e| e.to_string())
    }
}

fn decode_with(head: Head, doc: &impl Document) -> Result<Option<Object>, Box<DecodeFailure>> {
    match check_head(head)? {
        None => Ok(None),
        Some(key) => typed(doc, key).map(Some),
    }
}

/// Checks apiVersion/kind/metadata are acceptable and returns the key when
/// the document is a modelled object.
fn check_head(head: Head) -> Result<Option<ObjectKey>, Box<DecodeFailure>> {
    let (api_version, kind, name, namespace) = match head {
        Head::Empty => return Ok(None),
        Head::NotAnObject(what) => {
            return Err(fail(None, "", "", "", DecodeError::NotAnObject(what)));
        }
        Head::Object {
            api_version,
            kind,
            name,
            namespace,
        } => (api_version, kind, name, namespace),
    };
    let get = |f: Field, field: &'static str| match f {
        Field::Missing => Ok(None),
        Field::Str(s) => Ok(Some(s)),
        Field::NotAString => Err(DecodeError::NotAString { field }),
    };
    let name = get(name, "metadata.name");
    let namespace = get(namespace, "metadata.namespace");
    let kind = get(kind, "kind");
    let api_version = get(api_version, "apiVersion");
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
    let group = api_version.rsplit_once('/').map_or("", |(g, _)| g);
    let ignored = || {
        debug!(kind = %kind_str, %api_version, name = %name_s, "ignoring a kind the mesh model does not use");
        Ok(None)
    };
    // Checked before the modelled kinds: Istio's Gateway shares its name
    // with the Gateway API's.
    if istio_group_kinds(group).is_some_and(|(ignored, _)| ignored.contains(&kind_str.as_str())) {
        return ignored();
    }
    let Some(kind) = Kind::from_kind_str(&kind_str) else {
        let Some((_, supported)) = istio_group_kinds(group) else {
            return ignored();
        };
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
    // Of the ConfigMaps, only the mesh configuration is modelled.
    if kind == Kind::MeshConfig
        && (name != MESH_CONFIG_MAP || !ROOT_NAMESPACES.contains(&namespace.as_str()))
    {
        return ignored();
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

/// Deserializes the document into its kind's struct.
fn parse_kind(doc: &impl Document, kind: Kind) -> Result<Object, String> {
    Ok(match kind {
        Kind::Namespace => Object::Namespace(doc.parse()?),
        Kind::Pod => Object::Pod(doc.parse()?),
        Kind::Service => Object::Service(doc.parse()?),
        Kind::EndpointSlice => Object::EndpointSlice(doc.parse()?),
        Kind::ServiceEntry => Object::ServiceEntry(Box::new(doc.parse()?)),
        Kind::WorkloadEntry => Object::WorkloadEntry(doc.parse()?),
        Kind::PeerAuthentication => Object::PeerAuthentication(doc.parse()?),
        Kind::AuthorizationPolicy => Object::AuthorizationPolicy(doc.parse()?),
        Kind::VirtualService => Object::VirtualService(Box::new(doc.parse()?)),
        Kind::DestinationRule => Object::DestinationRule(Box::new(doc.parse()?)),
        Kind::Sidecar => Object::Sidecar(Box::new(doc.parse()?)),
        Kind::Gateway => Object::Gateway(Box::new(doc.parse()?)),
        Kind::HttpRoute => Object::HttpRoute(Box::new(doc.parse()?)),
        Kind::GrpcRoute => Object::GrpcRoute(Box::new(doc.parse()?)),
        Kind::TcpRoute => Object::TcpRoute(Box::new(doc.parse()?)),
        Kind::Node => Object::Node(doc.parse()?),
        Kind::Telemetry => Object::Telemetry(Box::new(doc.parse()?)),
        Kind::MeshConfig => Object::MeshConfig(Box::new(doc.parse()?)),
    })
}

fn typed(doc: &impl Document, key: ObjectKey) -> Result<Object, Box<DecodeFailure>> {
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
    let mut obj =
        parse_kind(doc, kind).map_err(|e| reject(&key, DecodeError::Schema(e, kind.as_str())))?;
    obj.metadata_mut().namespace.clone_from(&key.namespace);
    validate::validate(&mut obj).map_err(|e| reject(&key, DecodeError::Invalid(e)))?;
    Ok(obj)
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
