//! Fields the kind's schema does not have (AMB0001) and misspelled
//! `istio.io` labels (AMB0002).
//!
//! The decoders ignore unknown keys, so `subsets` misspelled `subset` or a
//! `labels:` indented one level too deep silently does nothing. The raw
//! document is decoded a second time into the same typed struct the
//! control plane uses, through `serde_ignored`, which reports every key the
//! struct ignored. Istio and Gateway API kinds are modelled field for field,
//! so everything they ignore is reported (minus [`VALID_UNMODELLED`]);
//! core kinds are modelled only in part, so for them only top-level and
//! `metadata` keys are checked.

use ambit_config::objects::{
    AuthorizationPolicy, DestinationRule, EndpointSlice, Gateway, GrpcRoute, HttpRoute, Kind,
    MeshConfigMap, Namespace, Node, PeerAuthentication, Pod, Service, ServiceEntry, Sidecar,
    TcpRoute, Telemetry, VirtualService, WorkloadEntry,
};
use serde::de::DeserializeOwned;

use super::super::Mesh;
use super::super::message::{Message, UNKNOWN_FIELD, UNKNOWN_ISTIO_LABEL};

/// Standard `metadata` keys the typed structs do not read.
const METADATA_KEYS: &[&str] = &[
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "managedFields",
    "finalizers",
    "generateName",
    "selfLink",
    "deletionGracePeriodSeconds",
    "deletionTimestamp",
    "uid",
    "ownerReferences",
];

/// Top-level keys a core kind's Kubernetes schema has (beyond apiVersion,
/// kind, metadata and status) that the typed struct may not read: the API
/// server always sends them (a Namespace's and a Node's `spec`).
fn core_top_level(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::Namespace | Kind::Node | Kind::Pod | Kind::Service | Kind::Telemetry => &["spec"],
        Kind::EndpointSlice => &["addressType", "endpoints", "ports"],
        Kind::MeshConfig => &["data", "binaryData", "immutable"],
        _ => &[],
    }
}

/// Istio/Gateway API fields that exist in their schemas but that Ambit
/// does not model (by their last path segment): not mistakes.
const VALID_UNMODELLED: &[&str] = &[
    "statPrefix",
    "proxyProtocol",
    "tunnel",
    "warmup",
    "unmatchedPreflights",
    "retryIgnorePreviousHosts",
    "backoff",
    "sessionPersistence",
    "requestMirrorPolicies",
];

enum Seg {
    Key(String),
    Index(usize),
}

fn segments(p: &serde_ignored::Path<'_>, out: &mut Vec<Seg>) {
    use serde_ignored::Path;
    match p {
        Path::Root => {}
        Path::Seq { parent, index } => {
            segments(parent, out);
            out.push(Seg::Index(*index));
        }
        Path::Map { parent, key } => {
            segments(parent, out);
            out.push(Seg::Key(key.clone()));
        }
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => segments(parent, out),
    }
}

/// `spec.http[0].route`.
fn render(segs: &[Seg]) -> String {
    let mut s = String::new();
    for seg in segs {
        match seg {
            Seg::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            Seg::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

fn ignored<T: DeserializeOwned>(raw: &serde_json::Value) -> Vec<Vec<Seg>> {
    let mut paths = Vec::new();
    // A document the decoder accepted may still fail here (a YAML scalar
    // typed differently in JSON): the keys found before that still count.
    let _ = serde_ignored::deserialize(raw, |p| {
        let mut segs = Vec::new();
        segments(&p, &mut segs);
        paths.push(segs);
    })
    .map(|_: T| ());
    paths
}

fn ignored_paths(kind: Kind, raw: &serde_json::Value) -> Vec<Vec<Seg>> {
    match kind {
        Kind::Namespace => ignored::<Namespace>(raw),
        Kind::Pod => ignored::<Pod>(raw),
        Kind::Service => ignored::<Service>(raw),
        Kind::EndpointSlice => ignored::<EndpointSlice>(raw),
        Kind::Node => ignored::<Node>(raw),
        Kind::ServiceEntry => ignored::<ServiceEntry>(raw),
        Kind::WorkloadEntry => ignored::<WorkloadEntry>(raw),
        Kind::PeerAuthentication => ignored::<PeerAuthentication>(raw),
        Kind::AuthorizationPolicy => ignored::<AuthorizationPolicy>(raw),
        Kind::VirtualService => ignored::<VirtualService>(raw),
        Kind::DestinationRule => ignored::<DestinationRule>(raw),
        Kind::Sidecar => ignored::<Sidecar>(raw),
        Kind::Gateway => ignored::<Gateway>(raw),
        Kind::HttpRoute => ignored::<HttpRoute>(raw),
        Kind::GrpcRoute => ignored::<GrpcRoute>(raw),
        Kind::TcpRoute => ignored::<TcpRoute>(raw),
        Kind::Telemetry => ignored::<Telemetry>(raw),
        Kind::MeshConfig => ignored::<MeshConfigMap>(raw),
    }
}

/// Kinds with many valid fields the model does not read (Telemetry's
/// metrics and access logging, a ConfigMap's other keys): only unknown
/// top-level keys are reported.
fn is_core(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Namespace
            | Kind::Pod
            | Kind::Service
            | Kind::EndpointSlice
            | Kind::Node
            | Kind::Telemetry
            | Kind::MeshConfig
    )
}

/// Whether an ignored path is a mistake worth reporting.
fn reportable(kind: Kind, segs: &[Seg]) -> bool {
    let key = |i: usize| match segs.get(i) {
        Some(Seg::Key(k)) => Some(k.as_str()),
        _ => None,
    };
    match (key(0), key(1)) {
        (Some("apiVersion" | "kind" | "status"), _) => return false,
        (Some("metadata"), Some(k)) if METADATA_KEYS.contains(&k) => return false,
        (Some("metadata"), _) => return segs.len() == 2,
        _ => {}
    }
    if is_core(kind) {
        return segs.len() == 1 && key(0).is_none_or(|k| !core_top_level(kind).contains(&k));
    }
    !matches!(segs.last(), Some(Seg::Key(k)) if VALID_UNMODELLED.contains(&k.as_str()))
}

/// AMB0001 for every document of a modelled kind.
pub(super) fn unknown_fields(mesh: &Mesh, out: &mut Vec<Message>) {
    for (obj, doc) in mesh.with_docs() {
        let Some(raw) = &doc.raw else {
            continue;
        };
        let kind = obj.kind();
        for segs in ignored_paths(kind, raw) {
            if !reportable(kind, &segs) {
                continue;
            }
            let path = render(&segs);
            let last = match segs.last() {
                Some(Seg::Key(k)) => k.as_str(),
                _ => "",
            };
            let hint = match segs.len() {
                1 => "a top-level key must be apiVersion, kind, metadata, spec or status".to_string(),
                _ => "check its spelling and indentation — a key one level too deep or too shallow lands here".to_string(),
            };
            out.push(mesh.msg_at(
                UNKNOWN_FIELD,
                &obj.key(),
                last,
                format!(
                    "unknown field {path}: the {kind} schema has no such field, so it is ignored and has no effect; {hint}"
                ),
            ));
        }
    }
}

/// Known `istio.io` (and related) label keys, with their valid values
/// (`None`: any value).
const KNOWN_LABELS: &[(&str, Option<&[&str]>)] = &[
    ("istio.io/dataplane-mode", Some(&["ambient", "none"])),
    ("istio.io/use-waypoint", None),
    ("istio.io/use-waypoint-namespace", None),
    (
        "istio.io/waypoint-for",
        Some(&["service", "workload", "all", "none"]),
    ),
    ("istio.io/ingress-use-waypoint", Some(&["true", "false"])),
    ("istio.io/rev", None),
    ("istio.io/tag", None),
    ("istio.io/gateway-name", None),
    ("istio-injection", Some(&["enabled", "disabled"])),
    ("sidecar.istio.io/inject", Some(&["true", "false"])),
    ("service.istio.io/canonical-name", None),
    ("service.istio.io/canonical-revision", None),
    ("topology.istio.io/network", None),
    ("topology.istio.io/cluster", None),
    ("topology.istio.io/subzone", None),
    ("networking.istio.io/gatewayPort", None),
    ("security.istio.io/tlsMode", Some(&["istio", "disabled"])),
    ("gateway.istio.io/managed", None),
];

/// Levenshtein distance (short strings only).
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The known name closest to `s` within `max` edits.
fn closest<'a>(s: &str, names: impl Iterator<Item = &'a str>, max: usize) -> Option<&'a str> {
    names
        .map(|n| (distance(s, n), n))
        .filter(|(d, _)| *d <= max)
        .min()
        .map(|(_, n)| n)
}

/// What is wrong with one label, if anything.
fn check_label(key: &str, value: &str) -> Option<String> {
    if let Some((_, values)) = KNOWN_LABELS.iter().find(|(k, _)| *k == key) {
        let values = (*values)?;
        if values.contains(&value) {
            return None;
        }
        let hint = closest(value, values.iter().copied(), 3)
            .map(|v| format!("did you mean {v:?}? "))
            .unwrap_or_default();
        return Some(format!(
            "label {key}={value:?} has a value the mesh does not know, so it acts as if unset; {hint}use one of: {}",
            values.join(", ")
        ));
    }
    let istioish =
        key.contains("istio.io/") || key.contains("istio-io") || key.contains("istio.io.");
    let names = || KNOWN_LABELS.iter().map(|(k, _)| *k);
    if istioish {
        let hint = closest(key, names(), 4)
            .map(|k| format!("did you mean {k}? "))
            .unwrap_or_default();
        return Some(format!(
            "label {key} is not a label the mesh reads, so it has no effect; {hint}check the spelling against the istio.io labels"
        ));
    }
    // The prefix left out: `dataplane-mode: ambient`.
    let bare = names().find(|k| k.rsplit_once('/').is_some_and(|(_, n)| n == key))?;
    Some(format!(
        "label {key} has no effect: the mesh reads {bare} — add the prefix"
    ))
}

/// AMB0002 over the labels of every accepted object.
pub(super) fn istio_labels(mesh: &Mesh, out: &mut Vec<Message>) {
    for obj in &mesh.objects {
        for (k, v) in &obj.metadata().labels {
            if let Some(text) = check_label(k, v) {
                out.push(mesh.msg_at(UNKNOWN_ISTIO_LABEL, &obj.key(), k, text));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert!(check_label("istio.io/dataplane-mode", "ambient").is_none());
        assert!(check_label("app", "x").is_none());
        let m = check_label("istio.io/dataplane-mod", "ambient").unwrap_or_default();
        assert!(m.contains("did you mean istio.io/dataplane-mode"), "{m}");
        let m = check_label("istio.io/dataplane-mode", "ambiant").unwrap_or_default();
        assert!(m.contains("did you mean \"ambient\""), "{m}");
        let m = check_label("dataplane-mode", "ambient").unwrap_or_default();
        assert!(m.contains("istio.io/dataplane-mode"), "{m}");
    }

    #[test]
    fn objects_as_the_api_server_sends_them_have_no_unknown_fields() {
        let key = |k: &str| Seg::Key(k.to_string());
        // A Namespace and a Node from a real cluster carry `spec`, and
        // metadata the typed struct does not read.
        for kind in [Kind::Namespace, Kind::Node] {
            let ns = serde_json::json!({
                "apiVersion": "v1", "kind": kind.as_str(),
                "metadata": {"name": "x", "uid": "u", "resourceVersion": "1",
                             "creationTimestamp": "2026-01-01T00:00:00Z",
                             "managedFields": [], "ownerReferences": []},
                "spec": {"finalizers": ["kubernetes"], "podCIDR": "10.244.0.0/24"},
                "status": {"phase": "Active"},
            });
            let found: Vec<String> = ignored_paths(kind, &ns)
                .into_iter()
                .filter(|p| reportable(kind, p))
                .map(|p| render(&p))
                .collect();
            assert!(found.is_empty(), "{kind}: {found:?}");
        }
        assert!(reportable(Kind::Namespace, &[key("sepc")]));
        assert!(!reportable(Kind::Namespace, &[key("spec")]));
        assert!(reportable(Kind::Pod, &[key("data")]));
    }
}
