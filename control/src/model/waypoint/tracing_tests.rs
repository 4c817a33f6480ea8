//! Tracing selection at a waypoint: Telemetry over the mesh config's
//! providers, the Envoy tracer and the collector's cluster it yields.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::trace::v3::{OpenTelemetryConfig, tracing::http::ConfigType};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, http_connection_manager::Tracing,
};
use prost::Message;

use super::listeners::MAIN_INTERNAL;
use super::{CLUSTER_TYPE, LISTENER_TYPE, scope};
use crate::model::{ModelOptions, Snapshot, Store, build_snapshot};

/// An OTLP collector outside the mesh, its Service, and the mesh config
/// naming it as provider `otel`.
fn collector(mesh: &str) -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: otel-0, namespace: observability, labels: {{app: otel}}}}
spec: {{nodeName: node-0}}
status: {{podIP: 10.10.0.50}}
---
apiVersion: v1
kind: Service
metadata: {{name: otel, namespace: observability}}
spec:
  clusterIP: 10.96.0.50
  selector: {{app: otel}}
  ports: [{{name: grpc-otlp, port: 4317, targetPort: 4317}}]
---
apiVersion: v1
kind: ConfigMap
metadata: {{name: istio, namespace: istio-system}}
data:
  mesh: |
    extensionProviders:
    - name: otel
      opentelemetry: {{service: otel.observability.svc.cluster.local, port: 4317}}
{mesh}
"
    )
}

fn telemetry(ns: &str, name: &str, body: &str) -> String {
    format!(
        "---\napiVersion: telemetry.istio.io/v1\nkind: Telemetry\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n{body}\n"
    )
}

fn snapshot(extra: &str) -> Snapshot {
    let base = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/waypoint/base.yaml"),
    )
    .unwrap();
    let text = format!("{base}\n---\n{extra}");
    let (objects, errors) = ambit_config::parse_documents(Path::new("t.yaml"), &text);
    assert!(errors.is_empty(), "{errors:#?}");
    build_snapshot(
        &Store::from_objects(objects),
        &Snapshot::default(),
        &ModelOptions::default(),
    )
}

/// The tracer of the llm service's connection manager.
fn llm_tracing(snap: &Snapshot) -> Option<Tracing> {
    let set = snap.set(&scope("shop", "waypoint"), LISTENER_TYPE).unwrap();
    let l = Listener::decode(set.resources.by_name[MAIN_INTERNAL].body.value.as_slice()).unwrap();
    let chain = l
        .filter_chains
        .iter()
        .find(|c| c.name == "llm.shop.svc.cluster.local:80")
        .unwrap();
    let envoy_types::pb::envoy::config::listener::v3::filter::ConfigType::TypedConfig(any) =
        chain.filters[0].config_type.clone().unwrap()
    else {
        panic!("no typed config")
    };
    HttpConnectionManager::decode(any.value.as_slice())
        .unwrap()
        .tracing
}

fn cluster(snap: &Snapshot, name: &str) -> Option<Cluster> {
    let set = snap.set(&scope("shop", "waypoint"), CLUSTER_TYPE).unwrap();
    let c = set.resources.by_name.get(name)?;
    Some(Cluster::decode(c.body.value.as_slice()).unwrap())
}

const OTEL_CLUSTER: &str = "tracing|4317||otel.observability.svc.cluster.local";

#[test]
fn tracing_is_off_until_a_provider_is_selected() {
    let snap = snapshot(&collector(""));
    assert!(llm_tracing(&snap).is_none());
    assert!(cluster(&snap, OTEL_CLUSTER).is_none());
    assert!(snap.errors.is_empty(), "{:#?}", snap.errors);
}

#[test]
fn a_mesh_wide_telemetry_sends_spans_to_the_collector() {
    let t = telemetry(
        "istio-system",
        "mesh-default",
        "  tracing: [{providers: [{name: otel}], randomSamplingPercentage: 100}]",
    );
    let snap = snapshot(&format!("{}{t}", collector("")));
    let tracing = llm_tracing(&snap).expect("a tracer");
    assert_eq!(tracing.random_sampling.unwrap().value, 100.0);
    let provider = tracing.provider.unwrap();
    assert_eq!(provider.name, "envoy.tracers.opentelemetry");
    let Some(ConfigType::TypedConfig(any)) = provider.config_type else {
        panic!("no tracer config")
    };
    let otel = OpenTelemetryConfig::decode(any.value.as_slice()).unwrap();
    assert_eq!(otel.service_name, "waypoint.shop");
    let dbg = format!("{:?}", otel.grpc_service);
    assert!(dbg.contains(OTEL_CLUSTER), "{dbg}");
    // The collector is outside the mesh: plaintext to its pod.
    let c = cluster(&snap, OTEL_CLUSTER).expect("the collector's cluster");
    let dbg = format!("{:?}", c.load_assignment.unwrap());
    assert!(dbg.contains("10.10.0.50") && dbg.contains("4317"), "{dbg}");
    assert!(snap.errors.is_empty(), "{:#?}", snap.errors);
}

#[test]
fn the_waypoints_own_telemetry_overrides_the_namespace_and_the_mesh() {
    let mesh = telemetry(
        "istio-system",
        "mesh-default",
        "  tracing: [{providers: [{name: otel}], randomSamplingPercentage: 5}]",
    );
    let ns = telemetry("shop", "ns", "  tracing: [{randomSamplingPercentage: 20}]");
    let own = telemetry(
        "shop",
        "waypoint",
        "  targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}]\n  tracing: [{randomSamplingPercentage: 50}]",
    );
    let snap = snapshot(&format!("{}{mesh}{ns}", collector("")));
    assert_eq!(
        llm_tracing(&snap).unwrap().random_sampling.unwrap().value,
        20.0
    );
    let snap = snapshot(&format!("{}{mesh}{ns}{own}", collector("")));
    assert_eq!(
        llm_tracing(&snap).unwrap().random_sampling.unwrap().value,
        50.0
    );
    // disableSpanReporting turns it off for this waypoint.
    let off = telemetry(
        "shop",
        "waypoint",
        "  targetRefs: [{kind: Gateway, name: waypoint}]\n  tracing: [{disableSpanReporting: true}]",
    );
    let snap = snapshot(&format!("{}{mesh}{off}", collector("")));
    assert!(llm_tracing(&snap).is_none());
}

#[test]
fn mesh_config_default_providers_and_sampling_apply_without_telemetry() {
    let mesh =
        "    defaultProviders: {tracing: [otel]}\n    defaultConfig: {tracing: {sampling: 12.5}}";
    let snap = snapshot(&collector(mesh));
    assert_eq!(
        llm_tracing(&snap).unwrap().random_sampling.unwrap().value,
        12.5
    );
    // Istio's 1 % when nothing sets a percentage.
    let snap = snapshot(&collector("    defaultProviders: {tracing: [otel]}"));
    assert_eq!(
        llm_tracing(&snap).unwrap().random_sampling.unwrap().value,
        1.0
    );
    // enableTracing: false turns the defaults off.
    let snap = snapshot(&collector(
        "    enableTracing: false\n    defaultProviders: {tracing: [otel]}",
    ));
    assert!(llm_tracing(&snap).is_none());
}

#[test]
fn an_unknown_provider_is_reported_and_traces_nothing() {
    let t = telemetry(
        "istio-system",
        "mesh-default",
        "  tracing: [{providers: [{name: zipkin}]}]",
    );
    let snap = snapshot(&format!("{}{t}", collector("")));
    assert!(llm_tracing(&snap).is_none());
    let reasons: Vec<&str> = snap.errors.iter().map(|e| e.reason.as_str()).collect();
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("\"zipkin\"") && r.contains("extensionProviders")),
        "{reasons:#?}"
    );
}

#[test]
fn a_collector_in_the_mesh_is_reached_over_hbone() {
    let t = telemetry(
        "istio-system",
        "mesh-default",
        "  tracing: [{providers: [{name: otel}]}]",
    );
    let enrolled = "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: observability, labels: {istio.io/dataplane-mode: ambient}}\n";
    let snap = snapshot(&format!("{}{t}{enrolled}", collector("")));
    let c = cluster(&snap, OTEL_CLUSTER).expect("the collector's cluster");
    let dbg = format!("{c:?}");
    assert!(dbg.contains("internal_upstream"), "{dbg}");
    assert!(
        dbg.contains("connect_originate;spiffe://cluster.local/ns/observability/sa/default"),
        "{dbg}"
    );
    // ... and the HBONE-originating cluster for its identity exists.
    assert!(
        cluster(
            &snap,
            "connect_originate;spiffe://cluster.local/ns/observability/sa/default"
        )
        .is_some()
    );
}
