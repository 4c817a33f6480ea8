//! The injection patch: JSON Patch `add` operations on a pod, and a small
//! applier for exactly those operations (`ambitctl kube-inject`, tests).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvVar,
    EnvVarSource, HTTPGetAction, ObjectFieldSelector, Pod, Probe, ProjectedVolumeSource,
    ResourceRequirements, SecurityContext, ServiceAccountTokenProjection, Volume, VolumeMount,
    VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::{Value, json};

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

const TOKEN_VOLUME: &str = "ambit-token";
const ROOT_VOLUME: &str = "ambit-ca";
const STATE_VOLUME: &str = "ambit-state";
const TOKEN_DIR: &str = "/var/run/secrets/tokens";
const ROOT_DIR: &str = "/var/run/secrets/istio";
const STATE_DIR: &str = "/var/run/ambit-agent";
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
    append(
        &mut ops,
        "/spec/containers",
        true,
        &[proxy_container(pod, settings)],
    )?;
    let has_volumes = spec.and_then(|s| s.volumes.as_ref()).is_some();
    append(&mut ops, "/spec/volumes", has_volumes, &volumes())?;

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

fn field_env(name: &str, field: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: field.to_string(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.into()),
        ..Default::default()
    }
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.to_string(),
        mount_path: path.to_string(),
        read_only: Some(read_only),
        ..Default::default()
    }
}

/// The workload a pod belongs to, as its request metrics name it: a
/// ReplicaSet owner less its pod-template-hash (the Deployment), another
/// controller's name, else the pod's name or, before the API server names
/// it, its `generateName` prefix.
fn workload_name(pod: &Pod) -> String {
    let m = &pod.metadata;
    let hash = m.labels.as_ref().and_then(|l| l.get("pod-template-hash"));
    let owners = m.owner_references.as_deref().unwrap_or_default();
    let owner = owners
        .iter()
        .find(|o| o.controller == Some(true))
        .or(owners.first());
    if let Some(o) = owner {
        let deployment = hash
            .filter(|_| o.kind == "ReplicaSet")
            .and_then(|h| o.name.strip_suffix(h.as_str())?.strip_suffix('-'));
        return deployment.unwrap_or(&o.name).to_string();
    }
    match (&m.name, &m.generate_name) {
        (Some(name), _) if !name.is_empty() => name.clone(),
        (_, Some(prefix)) => prefix.trim_end_matches('-').to_string(),
        _ => String::new(),
    }
}

fn proxy_container(pod: &Pod, s: &InjectSettings) -> Container {
    // The pod's labels at injection time become the proxy's node metadata
    // (workload name, version, canonical service for telemetry). Label
    // values cannot hold commas, so the list is unambiguous.
    let labels: Vec<String> = pod
        .metadata
        .labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    Container {
        name: PROXY_CONTAINER.to_string(),
        image: Some(s.proxy_image.clone()),
        args: Some(vec!["--kind".to_string(), "sidecar".to_string()]),
        env: Some(vec![
            field_env("NAMESPACE", "metadata.namespace"),
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_IP", "status.podIP"),
            field_env("SERVICE_ACCOUNT", "spec.serviceAccountName"),
            field_env("NODE_NAME", "spec.nodeName"),
            env("LABELS", labels.join(",")),
            env("WORKLOAD_NAME", workload_name(pod)),
            env("XDS_ADDRESS", s.xds_address.clone()),
            env("TRUST_DOMAIN", s.trust_domain.clone()),
            env("CLUSTER_ID", s.cluster_id.clone()),
            env("TOKEN_FILE", format!("{TOKEN_DIR}/istio-token")),
            env("ROOT_CERT", format!("{ROOT_DIR}/root-cert.pem")),
            env("STATE_DIR", STATE_DIR),
        ]),
        ports: Some(vec![ContainerPort {
            name: Some("http-monitoring".to_string()),
            container_port: 15020,
            protocol: Some("TCP".to_string()),
            ..Default::default()
        }]),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/healthz/ready".to_string()),
                port: IntOrString::Int(15021),
                ..Default::default()
            }),
            initial_delay_seconds: Some(1),
            period_seconds: Some(2),
            failure_threshold: Some(30),
            timeout_seconds: Some(3),
            ..Default::default()
        }),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), Quantity("100m".to_string())),
                ("memory".to_string(), Quantity("128Mi".to_string())),
            ])),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            run_as_user: Some(s.proxy_uid),
            run_as_group: Some(s.proxy_uid),
            run_as_non_root: Some(true),
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            privileged: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_string()]),
                ..Default::default()
            }),
            ..Default::default()
        }),
        volume_mounts: Some(vec![
            mount(TOKEN_VOLUME, TOKEN_DIR, true),
            mount(ROOT_VOLUME, ROOT_DIR, true),
            mount(STATE_VOLUME, STATE_DIR, false),
        ]),
        ..Default::default()
    }
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

fn volumes() -> Vec<Volume> {
    vec![
        Volume {
            name: TOKEN_VOLUME.to_string(),
            projected: Some(ProjectedVolumeSource {
                sources: Some(vec![VolumeProjection {
                    service_account_token: Some(ServiceAccountTokenProjection {
                        audience: Some("istio-ca".to_string()),
                        expiration_seconds: Some(43200),
                        path: "istio-token".to_string(),
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        },
        Volume {
            name: ROOT_VOLUME.to_string(),
            config_map: Some(ConfigMapVolumeSource {
                name: "istio-ca-root-cert".to_string(),
                ..Default::default()
            }),
            ..Default::default()
        },
        Volume {
            name: STATE_VOLUME.to_string(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".to_string()),
                ..Default::default()
            }),
            ..Default::default()
        },
    ]
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
