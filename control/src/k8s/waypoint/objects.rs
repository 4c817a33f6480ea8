//! What runs a waypoint Gateway, as Istio's gateway deployment controller
//! makes it (same names and labels, so `kubectl` habits and dashboards carry
//! over): a ServiceAccount, a Deployment and a ClusterIP Service, each named
//! after the Gateway and owned by it (deleting the Gateway deletes them).
//!
//! ```text
//! ServiceAccount <gw>         the waypoint's identity: spiffe://<td>/ns/<ns>/sa/<gw>
//! Deployment     <gw>         pods labelled gateway.networking.k8s.io/gateway-name: <gw>,
//!                             istio.io/dataplane-mode: none (never captured: Envoy speaks
//!                             HBONE itself); one container, the proxy (inject::proxy);
//!                             replicas left to the API server's default (1) or an HPA,
//!                             unless the Gateway's ambit.dev/waypoint-replicas annotation
//!                             says; surge-first rolling updates; spread across nodes
//! Service        <gw>         ClusterIP: mesh 15008 (HBONE), status-port 15021,
//!                             http-monitoring 15020 and the Gateway's other listeners
//! ```
//!
//! Each object carries [`SPEC_HASH`], a hash of what this controller
//! applies, so a reconcile that would change nothing writes nothing.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};

use ambit_config::gateway_api::Gateway;
use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Affinity, PodAffinityTerm, PodAntiAffinity, PodSpec, PodTemplateSpec, Service, ServiceAccount,
    ServicePort, ServiceSpec, WeightedPodAffinityTerm,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::Value;

use crate::inject::InjectSettings;
use crate::inject::proxy::{
    HBONE_PORT, METRICS_PORT, ProxyKind, ProxySpec, STATUS_PORT, label_list, proxy_container,
    proxy_volumes,
};

/// Label naming a pod's or object's waypoint Gateway.
pub const LABEL_GATEWAY_NAME: &str = "gateway.networking.k8s.io/gateway-name";
/// Istio's older spelling of it.
pub const LABEL_ISTIO_GATEWAY_NAME: &str = "istio.io/gateway-name";
/// Label marking what the gateway controller manages (Istio's value).
pub const LABEL_MANAGED: &str = "gateway.istio.io/managed";
pub const MANAGED_VALUE: &str = "istio.io-mesh-controller";
/// Annotation holding the hash of what was applied.
pub const SPEC_HASH: &str = "ambit.dev/spec-hash";
/// Gateway annotation setting the waypoint's replicas.
pub const REPLICAS_ANNOTATION: &str = "ambit.dev/waypoint-replicas";

/// The Gateway as the objects need it.
#[derive(Debug, Clone)]
pub struct GatewayRef<'a> {
    /// `gateway.networking.k8s.io/<version>`, as the API server serves it.
    pub api_version: &'a str,
    /// Decoded, with its metadata's uid (the owner references name it).
    pub gateway: &'a Gateway,
}

impl GatewayRef<'_> {
    fn name(&self) -> &str {
        &self.gateway.metadata.name
    }

    fn namespace(&self) -> &str {
        &self.gateway.metadata.namespace
    }
}

/// The three objects, each as the JSON document server-side apply takes.
#[derive(Debug, Clone, PartialEq)]
pub struct WaypointObjects {
    pub service_account: Value,
    pub deployment: Value,
    pub service: Value,
}

/// Labels every object of the waypoint carries.
fn common_labels(gw: &GatewayRef<'_>) -> BTreeMap<String, String> {
    let mut labels = gw
        .gateway
        .spec
        .infrastructure
        .as_ref()
        .map(|i| i.labels.clone())
        .unwrap_or_default();
    labels.insert(LABEL_GATEWAY_NAME.into(), gw.name().into());
    labels.insert(LABEL_ISTIO_GATEWAY_NAME.into(), gw.name().into());
    labels.insert(LABEL_MANAGED.into(), MANAGED_VALUE.into());
    labels
}

/// The labels of a waypoint Gateway's pods, in Kubernetes and in local
/// mode alike: `extra` (the Gateway's infrastructure labels) and ours.
pub fn waypoint_pod_labels(
    gateway_name: &str,
    extra: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut common = extra.clone();
    common.insert(LABEL_ISTIO_GATEWAY_NAME.into(), gateway_name.into());
    common.insert(LABEL_MANAGED.into(), MANAGED_VALUE.into());
    pod_labels(gateway_name, &common)
}

/// The waypoint pods' labels: the objects' labels and the pods' own.
fn pod_labels(gateway_name: &str, common: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut labels = common.clone();
    labels.insert(LABEL_GATEWAY_NAME.into(), gateway_name.into());
    labels.insert("istio.io/dataplane-mode".into(), "none".into());
    labels.insert("sidecar.istio.io/inject".into(), "false".into());
    labels.insert(
        "service.istio.io/canonical-name".into(),
        gateway_name.into(),
    );
    labels.insert(
        "service.istio.io/canonical-revision".into(),
        "latest".into(),
    );
    labels
}

/// The proxy of a waypoint Gateway's pods: the one spec local mode and
/// Kubernetes both run.
pub fn waypoint_proxy<'s>(
    gateway_name: &str,
    pod_labels: &BTreeMap<String, String>,
    settings: &'s InjectSettings,
) -> ProxySpec<'s> {
    ProxySpec {
        kind: ProxyKind::Waypoint,
        labels: label_list(pod_labels),
        workload_name: gateway_name.to_string(),
        settings,
    }
}

fn meta(gw: &GatewayRef<'_>, labels: &BTreeMap<String, String>) -> ObjectMeta {
    let annotations = gw
        .gateway
        .spec
        .infrastructure
        .as_ref()
        .map(|i| i.annotations.clone())
        .filter(|a| !a.is_empty());
    ObjectMeta {
        name: Some(gw.name().to_string()),
        namespace: Some(gw.namespace().to_string()),
        labels: Some(labels.clone()),
        annotations,
        owner_references: Some(vec![OwnerReference {
            api_version: gw.api_version.to_string(),
            kind: "Gateway".to_string(),
            name: gw.name().to_string(),
            uid: gw.gateway.metadata.uid.clone(),
            controller: Some(true),
            ..Default::default()
        }]),
        ..Default::default()
    }
}

/// Replicas the Gateway asks for (`ambit.dev/waypoint-replicas`), if any.
fn replicas(gw: &Gateway) -> Option<i32> {
    gw.metadata
        .annotations
        .get(REPLICAS_ANNOTATION)
        .and_then(|v| v.trim().parse().ok())
        .filter(|n| *n >= 0)
}

fn service_port(name: &str, port: u16, app_protocol: Option<&str>) -> ServicePort {
    ServicePort {
        name: Some(name.to_string()),
        port: i32::from(port),
        target_port: Some(IntOrString::Int(i32::from(port))),
        protocol: Some("TCP".to_string()),
        app_protocol: app_protocol.map(str::to_string),
        ..Default::default()
    }
}

/// `value` as a JSON document with `apiVersion`/`kind` and the hash of its
/// content in [`SPEC_HASH`].
fn document(api_version: &str, kind: &str, value: impl serde::Serialize) -> Value {
    let mut doc = serde_json::to_value(value).unwrap_or(Value::Null);
    doc["apiVersion"] = Value::String(api_version.into());
    doc["kind"] = Value::String(kind.into());
    let hash = content_hash(&doc);
    if let Some(meta) = doc.get_mut("metadata").and_then(Value::as_object_mut) {
        let annotations = meta
            .entry("annotations")
            .or_insert_with(|| Value::Object(Default::default()));
        annotations[SPEC_HASH] = Value::String(hash);
    }
    doc
}

/// A stable hash of a JSON document (object keys are ordered).
fn content_hash(doc: &Value) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    doc.to_string().hash(&mut h);
    format!("{:016x}", h.finish())
}

/// The hash an applied document carries.
pub fn spec_hash(doc: &Value) -> Option<&str> {
    doc["metadata"]["annotations"][SPEC_HASH].as_str()
}

/// What runs `gw`.
pub fn waypoint_objects(gw: &GatewayRef<'_>, settings: &InjectSettings) -> WaypointObjects {
    let name = gw.name();
    let labels = common_labels(gw);
    let pods = pod_labels(name, &labels);
    let selector = BTreeMap::from([(LABEL_GATEWAY_NAME.to_string(), name.to_string())]);

    let service_account = ServiceAccount {
        metadata: meta(gw, &labels),
        ..Default::default()
    };

    let mut container = proxy_container(&waypoint_proxy(name, &pods, settings));
    container.image = Some(settings.proxy_image.clone());
    let spread = WeightedPodAffinityTerm {
        weight: 100,
        pod_affinity_term: PodAffinityTerm {
            topology_key: "kubernetes.io/hostname".to_string(),
            label_selector: Some(LabelSelector {
                match_labels: Some(selector.clone()),
                ..Default::default()
            }),
            ..Default::default()
        },
    };
    let deployment = Deployment {
        metadata: meta(gw, &labels),
        spec: Some(DeploymentSpec {
            replicas: replicas(gw.gateway),
            selector: LabelSelector {
                match_labels: Some(selector.clone()),
                ..Default::default()
            },
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".to_string()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(1)),
                    max_unavailable: Some(IntOrString::Int(0)),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pods),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(name.to_string()),
                    termination_grace_period_seconds: Some(30),
                    containers: vec![container],
                    volumes: Some(proxy_volumes()),
                    affinity: Some(Affinity {
                        pod_anti_affinity: Some(PodAntiAffinity {
                            preferred_during_scheduling_ignored_during_execution: Some(vec![
                                spread,
                            ]),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    };

    let mut ports = vec![
        service_port("mesh", HBONE_PORT, Some("all")),
        service_port("status-port", STATUS_PORT, None),
        service_port("http-monitoring", METRICS_PORT, None),
    ];
    for l in &gw.gateway.spec.listeners {
        if ports.iter().any(|p| p.port == i32::from(l.port)) {
            continue;
        }
        ports.push(service_port(&l.name, l.port, None));
    }
    let service = Service {
        metadata: meta(gw, &labels),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_string()),
            selector: Some(selector),
            ports: Some(ports),
            ..Default::default()
        }),
        ..Default::default()
    };
    WaypointObjects {
        service_account: document("v1", "ServiceAccount", service_account),
        deployment: document("apps/v1", "Deployment", deployment),
        service: document("v1", "Service", service),
    }
}

/// Why a waypoint Gateway cannot be run, for its `Accepted=False`.
pub fn refusal(gw: &Gateway) -> Option<String> {
    let hbone = gw
        .spec
        .listeners
        .iter()
        .any(|l| l.port == HBONE_PORT && l.protocol == "HBONE");
    (!hbone).then(|| {
        format!(
            "a waypoint needs a listener {{port: {HBONE_PORT}, protocol: HBONE}}; add it (its other listeners may stay)"
        )
    })
}

#[cfg(test)]
mod tests;
