//! The proxy container — `ambit-agent`, which runs Envoy — as every pod that
//! has one gets it: an injected sidecar and a waypoint Deployment's pod in
//! Kubernetes, and (through [`agent_env`]) a waypoint pod in local mode.
//! One source, so local mode keeps proving what Kubernetes runs.
//!
//! The agent reads every setting from its environment (each flag has one),
//! so the container is its image, `--kind`, [`agent_env`], the ports, the
//! readiness probe on 15021, resources, a locked-down security context and
//! three volumes ([`proxy_volumes`]): the projected ServiceAccount token
//! (audience `istio-ca`), the mesh root (ConfigMap `istio-ca-root-cert`) and
//! a memory-backed state directory (SDS socket, bootstrap).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvVar,
    EnvVarSource, HTTPGetAction, ObjectFieldSelector, Pod, Probe, ProjectedVolumeSource,
    ResourceRequirements, SecurityContext, ServiceAccountTokenProjection, Volume, VolumeMount,
    VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{InjectSettings, PROXY_CONTAINER};

pub(super) const TOKEN_VOLUME: &str = "ambit-token";
pub(super) const ROOT_VOLUME: &str = "ambit-ca";
pub(super) const STATE_VOLUME: &str = "ambit-state";
const TOKEN_DIR: &str = "/var/run/secrets/tokens";
const ROOT_DIR: &str = "/var/run/secrets/istio";
const STATE_DIR: &str = "/var/run/ambit-agent";
/// The agent's readiness (`/healthz/ready`).
pub const STATUS_PORT: u16 = 15021;
/// The agent's merged metrics (`/stats/prometheus`).
pub const METRICS_PORT: u16 = 15020;
/// Where Envoy terminates HBONE.
pub const HBONE_PORT: u16 = 15008;

/// What the proxy is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyKind {
    Sidecar,
    Waypoint,
}

impl ProxyKind {
    /// The agent's `--kind`.
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyKind::Sidecar => "sidecar",
            ProxyKind::Waypoint => "waypoint",
        }
    }
}

/// One proxy's own values.
#[derive(Debug, Clone)]
pub struct ProxySpec<'a> {
    pub kind: ProxyKind,
    /// The pod's labels (`key=value`), the proxy's node metadata: workload
    /// name, version, canonical service for telemetry.
    pub labels: Vec<String>,
    /// The workload the proxy's request metrics name.
    pub workload_name: String,
    pub settings: &'a InjectSettings,
}

/// A value of the agent's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvValue {
    Literal(String),
    /// A field of the pod (`metadata.name`, `status.podIP`, ...), as the
    /// downward API gives it.
    PodField(&'static str),
}

/// The agent's environment (each entry is one of its flags).
pub fn agent_env(p: &ProxySpec<'_>) -> Vec<(&'static str, EnvValue)> {
    let lit = |v: String| EnvValue::Literal(v);
    let s = p.settings;
    vec![
        ("KIND", lit(p.kind.as_str().to_string())),
        ("NAMESPACE", EnvValue::PodField("metadata.namespace")),
        ("POD_NAME", EnvValue::PodField("metadata.name")),
        ("POD_IP", EnvValue::PodField("status.podIP")),
        (
            "SERVICE_ACCOUNT",
            EnvValue::PodField("spec.serviceAccountName"),
        ),
        ("NODE_NAME", EnvValue::PodField("spec.nodeName")),
        ("LABELS", lit(p.labels.join(","))),
        ("WORKLOAD_NAME", lit(p.workload_name.clone())),
        ("XDS_ADDRESS", lit(s.xds_address.clone())),
        ("TRUST_DOMAIN", lit(s.trust_domain.clone())),
        ("CLUSTER_ID", lit(s.cluster_id.clone())),
        ("TOKEN_FILE", lit(format!("{TOKEN_DIR}/istio-token"))),
        ("ROOT_CERT", lit(format!("{ROOT_DIR}/root-cert.pem"))),
        ("STATE_DIR", lit(STATE_DIR.to_string())),
    ]
}

/// The pod's labels as the agent's `LABELS` list (label values cannot
/// hold commas, so the list is unambiguous).
pub fn label_list(labels: &BTreeMap<String, String>) -> Vec<String> {
    labels.iter().map(|(k, v)| format!("{k}={v}")).collect()
}

fn env_var(name: &str, value: &EnvValue) -> EnvVar {
    match value {
        EnvValue::Literal(v) => EnvVar {
            name: name.to_string(),
            value: Some(v.clone()),
            ..Default::default()
        },
        EnvValue::PodField(field) => EnvVar {
            name: name.to_string(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: field.to_string(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
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

fn port(name: &str, number: u16) -> ContainerPort {
    ContainerPort {
        name: Some(name.to_string()),
        container_port: i32::from(number),
        protocol: Some("TCP".to_string()),
        ..Default::default()
    }
}

/// The proxy container (`istio-proxy`, Istio's name).
pub fn proxy_container(p: &ProxySpec<'_>) -> Container {
    let s = p.settings;
    let mut ports = vec![port("http-monitoring", METRICS_PORT)];
    if p.kind == ProxyKind::Waypoint {
        ports.insert(0, port("mesh", HBONE_PORT));
        ports.push(port("status-port", STATUS_PORT));
    }
    let env = agent_env(p)
        .iter()
        // `--kind` is the container's argument, as operators read it.
        .filter(|(name, _)| *name != "KIND")
        .map(|(name, value)| env_var(name, value))
        .collect();
    Container {
        name: PROXY_CONTAINER.to_string(),
        image: Some(s.proxy_image.clone()),
        args: Some(vec!["--kind".to_string(), p.kind.as_str().to_string()]),
        env: Some(env),
        ports: Some(ports),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/healthz/ready".to_string()),
                port: IntOrString::Int(i32::from(STATUS_PORT)),
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

/// The proxy's volumes.
pub fn proxy_volumes() -> Vec<Volume> {
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

/// The workload a pod belongs to, as its request metrics name it: a
/// ReplicaSet owner less its pod-template-hash (the Deployment), another
/// controller's name, else the pod's name or, before the API server names
/// it, its `generateName` prefix.
pub fn workload_name(pod: &Pod) -> String {
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
