//! Telemetry settings: Istio's mesh configuration (the `mesh` key of the
//! `istio` ConfigMap in a root namespace) and the `telemetry.istio.io`
//! `Telemetry` kind — as far as the mesh uses them, which is tracing: which
//! OpenTelemetry collector a waypoint sends its spans to and how many
//! requests it samples. Re-exported by [`crate::objects`].
//!
//! Fields the mesh does not use are accepted and ignored, so an Istio
//! user's files decode unchanged.

use serde::Deserialize;

use crate::istio::PolicyTargetReference;
use crate::objects::{LabelSelector, ObjectMeta, nullable};

/// The ConfigMap that holds the mesh configuration: `istio` (Istio's name)
/// in a root namespace. Other ConfigMaps are not part of the model.
pub const MESH_CONFIG_MAP: &str = "istio";
/// The key of that ConfigMap holding the mesh configuration YAML.
pub const MESH_CONFIG_KEY: &str = "mesh";

/// The `istio` ConfigMap: its `data`, and the mesh configuration decoded
/// from `data.mesh` (set by decoding; the default when the key is absent).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct MeshConfigMap {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub data: std::collections::BTreeMap<String, String>,
    #[serde(skip)]
    pub mesh: MeshConfig,
}

/// Istio's `MeshConfig`, the part the mesh reads.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct MeshConfig {
    /// Istio's switch for tracing by proxies configured without the
    /// Telemetry API; `false` turns the mesh-wide default providers off.
    pub enable_tracing: Option<bool>,
    #[serde(deserialize_with = "nullable")]
    pub extension_providers: Vec<MeshExtensionProvider>,
    #[serde(deserialize_with = "nullable")]
    pub default_providers: DefaultProviders,
    #[serde(deserialize_with = "nullable")]
    pub default_config: ProxyConfigDefaults,
}

/// A named telemetry backend. Only `opentelemetry` is modelled; a provider
/// of another type decodes with `opentelemetry: None` and is reported
/// where a Telemetry selects it.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct MeshExtensionProvider {
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    pub opentelemetry: Option<OpenTelemetryProvider>,
}

/// An OTLP collector: `service` is a hostname (`otel.observability.svc.cluster.local`,
/// or `namespace/hostname`), `port` its OTLP/gRPC port.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct OpenTelemetryProvider {
    #[serde(deserialize_with = "nullable")]
    pub service: String,
    #[serde(deserialize_with = "crate::objects::port_number")]
    pub port: u16,
    /// Longest tag value Envoy records (Istio's `maxTagLength`).
    pub max_tag_length: Option<u32>,
    /// OTLP/HTTP instead of gRPC; not supported by the mesh (reported).
    pub http: Option<serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct DefaultProviders {
    /// Providers used for tracing when no Telemetry names any.
    #[serde(deserialize_with = "nullable")]
    pub tracing: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProxyConfigDefaults {
    pub tracing: Option<ProxyTracing>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProxyTracing {
    /// Percentage of requests sampled (Istio's default: 1).
    pub sampling: Option<f64>,
}

/// `telemetry.istio.io` Telemetry.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Telemetry {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: TelemetrySpec,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TelemetrySpec {
    pub selector: Option<LabelSelector>,
    pub target_ref: Option<PolicyTargetReference>,
    #[serde(deserialize_with = "nullable")]
    pub target_refs: Vec<PolicyTargetReference>,
    #[serde(deserialize_with = "nullable")]
    pub tracing: Vec<TracingSettings>,
}

impl TelemetrySpec {
    /// Every target reference (`targetRef` and `targetRefs`).
    pub fn targets(&self) -> impl Iterator<Item = &PolicyTargetReference> {
        self.target_ref.iter().chain(&self.target_refs)
    }

    /// True when the resource applies to a whole namespace (no selector,
    /// no target).
    pub fn is_namespace_wide(&self) -> bool {
        self.selector
            .as_ref()
            .is_none_or(|s| s.match_labels.is_empty())
            && self.targets().next().is_none()
    }
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TracingSettings {
    #[serde(deserialize_with = "nullable")]
    pub providers: Vec<ProviderRef>,
    /// 0–100 (checked while decoding).
    pub random_sampling_percentage: Option<f64>,
    /// Spans are not reported (the trace context still propagates).
    pub disable_span_reporting: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ProviderRef {
    #[serde(deserialize_with = "nullable")]
    pub name: String,
}
