//! `gateway.networking.k8s.io` Gateway: listeners of a gateway or a
//! waypoint.

use serde::Deserialize;

use crate::objects::{LabelSelector, Labels, ObjectMeta, nullable, port_number};

/// Label of a waypoint Gateway saying which traffic it handles.
pub const LABEL_WAYPOINT_FOR: &str = "istio.io/waypoint-for";
/// Gateway classes that make a Gateway a waypoint.
pub const WAYPOINT_GATEWAY_CLASSES: [&str; 2] = ["istio-waypoint", "ambit-waypoint"];
/// Annotation turning a waypoint's request telemetry off (`"false"`).
pub const ANNOTATION_REQUEST_TELEMETRY: &str = "ambit.io/request-telemetry";

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Gateway {
    /// Labels and annotations matter: `istio.io/waypoint-for`, ...
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: GatewaySpec,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GatewaySpec {
    #[serde(deserialize_with = "nullable")]
    pub gateway_class_name: String,
    #[serde(deserialize_with = "nullable")]
    pub listeners: Vec<Listener>,
    /// Requested addresses.
    #[serde(deserialize_with = "nullable")]
    pub addresses: Vec<GatewayAddress>,
    /// Labels and annotations for the resources that run the gateway.
    pub infrastructure: Option<GatewayInfrastructure>,
}

/// One listener: a port, a protocol and which routes may attach.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Listener {
    pub name: String,
    #[serde(default)]
    pub hostname: Option<String>,
    #[serde(deserialize_with = "port_number")]
    pub port: u16,
    /// `HTTP`, `HTTPS`, `TLS`, `TCP`, `UDP`, `HBONE` (waypoints), or a
    /// domain-prefixed custom protocol.
    pub protocol: String,
    /// Decoded only.
    #[serde(default)]
    pub tls: Option<GatewayTlsConfig>,
    /// Decoded only.
    #[serde(default)]
    pub allowed_routes: Option<AllowedRoutes>,
}

/// TLS of a listener (decoded only).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GatewayTlsConfig {
    /// `Terminate` or `Passthrough`.
    pub mode: Option<String>,
    #[serde(deserialize_with = "nullable")]
    pub certificate_refs: Vec<SecretObjectReference>,
    #[serde(deserialize_with = "nullable")]
    pub options: Labels,
}

/// A certificate's Secret (or other object).
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SecretObjectReference {
    pub group: Option<String>,
    pub kind: Option<String>,
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    pub namespace: Option<String>,
}

/// Which routes may attach to a listener (decoded only).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct AllowedRoutes {
    pub namespaces: Option<RouteNamespaces>,
    #[serde(deserialize_with = "nullable")]
    pub kinds: Vec<RouteGroupKind>,
}

/// The namespaces routes may attach from.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RouteNamespaces {
    /// `Same` when absent.
    pub from: Option<FromNamespaces>,
    pub selector: Option<LabelSelector>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum FromNamespaces {
    All,
    Same,
    Selector,
}

/// A route kind (group defaults to `gateway.networking.k8s.io`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RouteGroupKind {
    pub group: Option<String>,
    #[serde(deserialize_with = "nullable")]
    pub kind: String,
}

/// A requested address (`IPAddress`, `Hostname` or a custom type).
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GatewayAddress {
    /// `IPAddress` when absent.
    #[serde(rename = "type")]
    pub type_: Option<String>,
    #[serde(deserialize_with = "nullable")]
    pub value: String,
}

/// Metadata for what runs the gateway.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GatewayInfrastructure {
    #[serde(deserialize_with = "nullable")]
    pub labels: Labels,
    #[serde(deserialize_with = "nullable")]
    pub annotations: Labels,
}

/// Which traffic a waypoint handles (label `istio.io/waypoint-for`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaypointFor {
    /// Traffic to services (the default).
    Service,
    /// Traffic to workloads addressed directly.
    Workload,
    All,
    None,
}

impl WaypointFor {
    /// Reads the label value; `None` for a value Istio does not define.
    pub fn from_label(value: Option<&str>) -> Option<WaypointFor> {
        match value {
            None | Some("service") => Some(WaypointFor::Service),
            Some("workload") => Some(WaypointFor::Workload),
            Some("all") => Some(WaypointFor::All),
            Some("none") => Some(WaypointFor::None),
            Some(_) => None,
        }
    }
}

impl Gateway {
    /// True for a waypoint: class `istio-waypoint` or `ambit-waypoint`.
    pub fn is_waypoint(&self) -> bool {
        WAYPOINT_GATEWAY_CLASSES.contains(&self.spec.gateway_class_name.as_str())
    }

    /// Whether the waypoint records per-request metrics and access logs:
    /// on unless annotated `ambit.io/request-telemetry: "false"` (for
    /// measuring their cost, or a waypoint that must not log requests).
    pub fn request_telemetry(&self) -> bool {
        self.metadata
            .annotations
            .get(ANNOTATION_REQUEST_TELEMETRY)
            .is_none_or(|v| !v.eq_ignore_ascii_case("false"))
    }

    /// What the waypoint handles, from its `istio.io/waypoint-for` label
    /// (the Gateway's, or else its `infrastructure.labels`'); `None` when
    /// the value is unknown.
    pub fn waypoint_for(&self) -> Option<WaypointFor> {
        let label = self.metadata.labels.get(LABEL_WAYPOINT_FOR).or_else(|| {
            self.spec
                .infrastructure
                .as_ref()
                .and_then(|i| i.labels.get(LABEL_WAYPOINT_FOR))
        });
        WaypointFor::from_label(label.map(String::as_str))
    }

    /// The listener called `name`.
    pub fn listener(&self, name: &str) -> Option<&Listener> {
        self.spec.listeners.iter().find(|l| l.name == name)
    }
}
