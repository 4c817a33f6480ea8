//! Tracing at a waypoint: which OpenTelemetry collector its Envoy sends
//! request spans to, and how many requests it samples — Istio's Telemetry
//! API over the mesh configuration's extension providers. Off unless a
//! provider is selected.
//!
//! Selection for waypoint `ns/name`, most specific last, each level
//! overriding the fields it sets (providers, `randomSamplingPercentage`,
//! `disableSpanReporting`) of its first `tracing` entry:
//!
//! 1. a namespace-wide Telemetry in a root namespace (mesh default),
//! 2. a namespace-wide Telemetry in `ns`,
//! 3. a Telemetry in `ns` whose `targetRefs` name the waypoint's Gateway.
//!
//! Several Telemetries at one level: the first by name wins. With no
//! provider selected by any, the mesh configuration's
//! `defaultProviders.tracing` applies (unless `enableTracing: false`).
//! Sampling falls back to `defaultConfig.tracing.sampling`, then to Istio's
//! 1 %. The provider must be an `opentelemetry` one (OTLP/gRPC); Envoy
//! takes one tracer per connection manager, so only the first is used.
//!
//! The spans go to a cluster of their own (`tracing|<port>||<host>`) whose
//! endpoints are the collector service's: through their ztunnel over HBONE
//! when the collector is in the mesh, else in plaintext (the waypoint's own
//! traffic is not captured).

use std::net::SocketAddr;

use ambit_config::objects::{
    MESH_CONFIG_MAP, MeshConfig, OpenTelemetryProvider, ROOT_NAMESPACES, Telemetry,
    TracingSettings,
};
use envoy_types::pb::envoy::config::core::v3::{
    GrpcService,
    grpc_service::{EnvoyGrpc, TargetSpecifier},
};
use envoy_types::pb::envoy::config::trace::v3::{
    OpenTelemetryConfig,
    tracing::{Http as TracerConfig, http::ConfigType},
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::Tracing;
use envoy_types::pb::envoy::r#type::v3::Percent;

use super::envoy::{any, duration, u32_value};
use super::{BoundEndpoint, Finding, WaypointPlan};
use crate::model::store::Store;

/// Istio's sampling percentage when nothing sets one.
const DEFAULT_SAMPLING: f64 = 1.0;
/// How long one span export may take.
const EXPORT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The tracer of one waypoint.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingPlan {
    /// The collector's hostname and OTLP/gRPC port.
    pub host: String,
    pub port: u16,
    /// Percentage of requests sampled when the caller sent no decision.
    pub sampling: f64,
    pub max_tag_length: Option<u32>,
    /// Collector endpoints in the mesh (reached over HBONE) ...
    pub mesh_endpoints: Vec<BoundEndpoint>,
    /// ... and outside it (plaintext); used only when there are no mesh ones.
    pub plain_endpoints: Vec<SocketAddr>,
}

impl TracingPlan {
    /// The cluster the spans are exported to.
    pub fn cluster(&self) -> String {
        format!("tracing|{}||{}", self.port, self.host)
    }
}

/// What the planner needs from the service catalog: a hostname's
/// endpoints, in the mesh and outside it (`None`: no such service).
pub(super) type ResolveHost<'a> =
    dyn Fn(&str, u16) -> Option<(Vec<BoundEndpoint>, Vec<SocketAddr>)> + 'a;

/// The tracer of `plan`'s waypoint, if one is configured; mistakes become
/// findings (tracing stays off or uses what is valid).
pub(super) fn plan_tracing(
    store: &Store,
    plan: &WaypointPlan,
    resolve: &ResolveHost<'_>,
    findings: &mut Vec<Finding>,
) -> Option<TracingPlan> {
    let no_mesh_config = MeshConfig::default();
    let mesh = mesh_config(store).unwrap_or(&no_mesh_config);
    let (settings, source) = effective_settings(store, plan);
    if settings.disable_span_reporting == Some(true) {
        return None;
    }
    let providers: Vec<String> = if !settings.providers.is_empty() {
        settings.providers.iter().map(|p| p.name.clone()).collect()
    } else if mesh.enable_tracing != Some(false) {
        mesh.default_providers.tracing.clone()
    } else {
        Vec::new()
    };
    let first = providers.first()?;
    let mut finding = |reason: String| findings.push(Finding::waypoint(plan, reason));
    if providers.len() > 1 {
        finding(format!(
            "{source} selects {} tracing providers; Envoy takes one tracer, so only {first:?} is used",
            providers.len()
        ));
    }
    let Some(otel) = provider(mesh, first) else {
        finding(format!(
            "{source} selects tracing provider {first:?}, which is no opentelemetry provider in the mesh config's extensionProviders; no spans are exported — define it (opentelemetry: {{service, port}}) in the istio ConfigMap"
        ));
        return None;
    };
    if otel.http.is_some() {
        finding(format!(
            "tracing provider {first:?} asks for OTLP/HTTP, which waypoints do not export; spans go over OTLP/gRPC to port {} instead",
            otel.port
        ));
    }
    let host = otel
        .service
        .split_once('/')
        .map_or(otel.service.as_str(), |(_, h)| h)
        .to_string();
    let (mesh_endpoints, plain_endpoints) = resolve(&host, otel.port).unwrap_or_else(|| {
        finding(format!(
            "tracing provider {first:?} names collector {host}, which is no Service of the mesh; spans are dropped until it exists — check the hostname (name.namespace.svc.cluster.local)"
        ));
        (Vec::new(), Vec::new())
    });
    Some(TracingPlan {
        host,
        port: otel.port,
        sampling: settings
            .random_sampling_percentage
            .or_else(|| mesh.default_config.tracing.as_ref()?.sampling)
            .unwrap_or(DEFAULT_SAMPLING),
        max_tag_length: otel.max_tag_length,
        mesh_endpoints,
        plain_endpoints,
    })
}

/// The mesh configuration: the `istio` ConfigMap of the first root
/// namespace holding one.
fn mesh_config(store: &Store) -> Option<&MeshConfig> {
    ROOT_NAMESPACES.iter().find_map(|ns| {
        let objs = store.space(ns)?;
        objs.mesh_configs.get(MESH_CONFIG_MAP).map(|m| &m.mesh)
    })
}

fn provider<'m>(mesh: &'m MeshConfig, name: &str) -> Option<&'m OpenTelemetryProvider> {
    mesh.extension_providers
        .iter()
        .find(|p| p.name == name)?
        .opentelemetry
        .as_ref()
}

/// The merged tracing settings for the waypoint and a description of the
/// Telemetry resources they came from.
fn effective_settings(store: &Store, plan: &WaypointPlan) -> (TracingSettings, String) {
    let targets_waypoint = |t: &Telemetry| {
        t.spec.targets().any(|r| {
            r.kind == "Gateway"
                && r.name == plan.name
                && (r.namespace.is_empty() || r.namespace == plan.namespace)
        })
    };
    let first_in = |ns: &str, pick: &dyn Fn(&Telemetry) -> bool| -> Option<&Telemetry> {
        store
            .space(ns)
            .and_then(|objs| objs.telemetries.values().find(|t| pick(t)))
    };
    let wide = |t: &Telemetry| t.spec.is_namespace_wide();
    let levels: Vec<&Telemetry> = ROOT_NAMESPACES
        .iter()
        .find_map(|ns| first_in(ns, &wide))
        .into_iter()
        .chain(
            first_in(&plan.namespace, &wide)
                .filter(|_| !ROOT_NAMESPACES.contains(&plan.namespace.as_str())),
        )
        .chain(first_in(&plan.namespace, &targets_waypoint))
        .collect();
    let mut merged = TracingSettings::default();
    let mut names = Vec::new();
    for t in levels {
        let Some(s) = t.spec.tracing.first() else {
            continue;
        };
        names.push(format!(
            "Telemetry {}/{}",
            t.metadata.namespace, t.metadata.name
        ));
        if !s.providers.is_empty() {
            merged.providers.clone_from(&s.providers);
        }
        if s.random_sampling_percentage.is_some() {
            merged.random_sampling_percentage = s.random_sampling_percentage;
        }
        if s.disable_span_reporting.is_some() {
            merged.disable_span_reporting = s.disable_span_reporting;
        }
    }
    let source = if names.is_empty() {
        "the mesh config's defaultProviders".to_string()
    } else {
        names.join(" + ")
    };
    (merged, source)
}

/// The connection manager's tracing: OpenTelemetry over gRPC to the
/// collector cluster, as service `<waypoint>.<namespace>`.
pub fn hcm_tracing(plan: &WaypointPlan, t: &TracingPlan) -> Tracing {
    let otel = OpenTelemetryConfig {
        grpc_service: Some(GrpcService {
            target_specifier: Some(TargetSpecifier::EnvoyGrpc(EnvoyGrpc {
                cluster_name: t.cluster(),
                authority: format!("{}:{}", t.host, t.port),
                ..Default::default()
            })),
            timeout: Some(duration(EXPORT_TIMEOUT)),
            ..Default::default()
        }),
        service_name: format!("{}.{}", plan.name, plan.namespace),
        ..Default::default()
    };
    Tracing {
        random_sampling: Some(Percent { value: t.sampling }),
        max_path_tag_length: t.max_tag_length.map(u32_value),
        provider: Some(TracerConfig {
            name: "envoy.tracers.opentelemetry".to_string(),
            config_type: Some(ConfigType::TypedConfig(any(&otel))),
        }),
        ..Default::default()
    }
}
