//! The injection patch: JSON Patch `add` operations on a pod, and a small
//! applier for exactly those operations (`ambitctl kube-inject`, tests).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, Pod, ResourceRequirements, SecurityContext,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Value, json};

use super::proxy::{
    ProxyKind, ProxySpec, ROOT_VOLUME, STATE_VOLUME, TOKEN_VOLUME, label_list, proxy_container,
    proxy_volumes, workload_name,
};
use super::{INIT_CONTAINER, InjectSettings, PROXY_CONTAINER, Redirection, STATUS_ANNOTATION};

/// Why a patch could not be built or applied.
#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    #[error("building the injected containers failed: {0}")]
    Serialize(#[from] serde_json::Error),
    #[error("JSON Patch operation {index} ({op}) is not supported: only `add` is")]
    UnsupportedOp { index: usize, op: String },
    #[error("JSON Patch operation {index}: path {path:?} does not exist in the object")]
    BadPath { index: usize, path: String },
    #[error("the JSON Patch is not an array of operations with `op`, `path` and `value`")]
    Malformed,
}

/// Ports the proxy serves that inbound redirection must not capture:
/// HBONE, the agent's metrics and its readiness.
const PROXY_INBOUND_PORTS: &str = "15008,15020,15021";

/// The `add` operations that give `pod` a sidecar under `settings`. The
/// caller decides first ([`super::decide`]); this only builds.
pub fn injection_patch(pod: &Pod, settings: &InjectSettings) -> Result<Vec<Value>, PatchError> {
    let mut ops = Vec::new();
    let init = match settings.redirection {
        Redirection::InitContainer => vec![init_container(settings)],
        Redirection::NodeAgent => Vec::new(),
    };
    let spec = pod.spec.as_ref();
    let has_inits = spec.and_then(|s| s.init_containers.as_ref()).is_some();
    append(&mut ops, "/spec/initContainers", has_inits, &init)?;
    // The pod's labels at injection time become the proxy's node metadata.
    let proxy = ProxySpec {
        kind: ProxyKind::Sidecar,
        labels: pod
            .metadata
            .labels
            .as_ref()
            .map(label_list)
            .unwrap_or_default(),
        workload_name: workload_name(pod),
        settings,
    };
    append(
        &mut ops,
        "/spec/containers",
        true,
        &[proxy_container(&proxy)],
    )?;
    let has_volumes = spec.and_then(|s| s.volumes.as_ref()).is_some();
    append(&mut ops, "/spec/volumes", has_volumes, &proxy_volumes())?;

    let status = json!({
        "initContainers": init.iter().map(|c| c.name.clone()).collect::<Vec<_>>(),
        "containers": [PROXY_CONTAINER],
        "volumes": [TOKEN_VOLUME, ROOT_VOLUME, STATE_VOLUME],
        "imagePullSecrets": null,
        "revision": "default",
    });
    let mut annotations = BTreeMap::from([(STATUS_ANNOTATION.to_string(), status.to_string())]);
    if let Some(first) = spec.and_then(|s| s.containers.first()) {
        // `kubectl logs`/`exec` keep going to the application by default.
        annotations.insert(
            "kubectl.kubernetes.io/default-container".to_string(),
            first.name.clone(),
        );
    }
    // tlsMode: peers' Envoys reach the pod over mTLS; tunnel: ztunnels and
    // Envoys reach it over HBONE on its Envoy's 15008 (Istio's labels).
    let labels = BTreeMap::from([
        ("security.istio.io/tlsMode".to_string(), "istio".to_string()),
        ("networking.istio.io/tunnel".to_string(), "http".to_string()),
    ]);
    let meta = &pod.metadata;
    merge_map(
        &mut ops,
        "/metadata/annotations",
        meta.annotations.as_ref(),
        annotations,
    );
    merge_map(&mut ops, "/metadata/labels", meta.labels.as_ref(), labels);
    Ok(ops)
}

/// Adds `items` to the array at `path`: one op per item when the array
/// exists, else one op creating it.
fn append<T: serde::Serialize>(
    ops: &mut Vec<Value>,
    path: &str,
    exists: bool,
    items: &[T],
) -> Result<(), PatchError> {
    if items.is_empty() {
        return Ok(());
    }
    if exists {
        for item in items {
            ops.push(add(&format!("{path}/-"), serde_json::to_value(item)?));
        }
    } else {
        ops.push(add(path, serde_json::to_value(items)?));
    }
    Ok(())
}

/// Sets the keys of `wanted` in the string map at `path`, keeping the
/// pod's other entries and its own values for keys it already has.
fn merge_map(
    ops: &mut Vec<Value>,
    path: &str,
    current: Option<&BTreeMap<String, String>>,
    wanted: BTreeMap<String, String>,
) {
    match current {
        None => ops.push(add(path, json!(wanted))),
        Some(have) => {
            for (k, v) in wanted {
                let ours = k == STATUS_ANNOTATION;
                if ours || !have.contains_key(&k) {
                    ops.push(add(&format!("{path}/{}", escape(&k)), Value::String(v)));
                }
            }
        }
    }
}

fn add(path: &str, value: Value) -> Value {
    json!({"op": "add", "path": path, "value": value})
}

/// A JSON Pointer reference token (RFC 6901): `~` → `~0`, `/` → `~1`.
fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

fn init_container(s: &InjectSettings) -> Container {
    let uid = s.proxy_uid.to_string();
    Container {
        name: INIT_CONTAINER.to_string(),
        image: Some(s.proxy_image.clone()),
        command: Some(vec!["ambit-agent".to_string()]),
        args: Some(
            [
                "redirect",
                "--proxy-uid",
                &uid,
                "--outbound-port",
                "15001",
                "--inbound-port",
                "15006",
                "--exclude-inbound-ports",
                PROXY_INBOUND_PORTS,
            ]
            .map(String::from)
            .to_vec(),
        ),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), Quantity("10m".to_string())),
                ("memory".to_string(), Quantity("16Mi".to_string())),
            ])),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            run_as_user: Some(0),
            run_as_non_root: Some(false),
            allow_privilege_escalation: Some(false),
            privileged: Some(false),
            capabilities: Some(Capabilities {
                add: Some(vec!["NET_ADMIN".to_string(), "NET_RAW".to_string()]),
                drop: Some(vec!["ALL".to_string()]),
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Applies `add` operations (what [`injection_patch`] makes) to `doc`.
pub fn apply_patch(doc: &mut Value, ops: &[Value]) -> Result<(), PatchError> {
    for (index, op) in ops.iter().enumerate() {
        let (Some(kind), Some(path), Some(value)) = (
            op.get("op").and_then(Value::as_str),
            op.get("path").and_then(Value::as_str),
            op.get("value"),
        ) else {
            return Err(PatchError::Malformed);
        };
        if kind != "add" {
            return Err(PatchError::UnsupportedOp {
                index,
                op: kind.to_string(),
            });
        }
        let bad = || PatchError::BadPath {
            index,
            path: path.to_string(),
        };
        let tokens: Vec<String> = path.split('/').skip(1).map(unescape).collect();
        let (last, parents) = tokens.split_last().ok_or_else(bad)?;
        let mut target = &mut *doc;
        for t in parents {
            target = match target {
                Value::Object(m) => m.get_mut(t.as_str()).ok_or_else(bad)?,
                Value::Array(a) => t
                    .parse::<usize>()
                    .ok()
                    .and_then(|i| a.get_mut(i))
                    .ok_or_else(bad)?,
                _ => return Err(bad()),
            };
        }
        match target {
            Value::Object(m) => {
                m.insert(last.clone(), value.clone());
            }
            Value::Array(a) if last == "-" => a.push(value.clone()),
            Value::Array(a) => match last.parse::<usize>() {
                Ok(i) if i <= a.len() => a.insert(i, value.clone()),
                _ => return Err(bad()),
            },
            _ => return Err(bad()),
        }
    }
    Ok(())
}
