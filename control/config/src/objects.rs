//! Ambit's lean typed model of the Kubernetes and Istio objects it reads.
//!
//! Only the fields the mesh needs are modelled; everything else in a document
//! is ignored. The structs deserialize straight from Kubernetes YAML/JSON with
//! serde (field names as in the API), so a bad field type is reported with its
//! path (`spec.ports[0].port`). Semantic checks that serde cannot express
//! (IP syntax of string fields, a required name, ...) live in `decode.rs`.
//! The Istio security and service-registry kinds live in `istio.rs`, the
//! traffic kinds in [`crate::networking`] and [`crate::gateway_api`], the
//! Node in `node.rs`; the kinds are re-exported here.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};

pub use crate::gateway_api::{Gateway, GrpcRoute, HttpRoute, TcpRoute};
pub use crate::istio::*;
pub use crate::networking::{DestinationRule, Sidecar, VirtualService};
pub use crate::node::*;
pub use crate::telemetry::*;

/// Label that enrolls a namespace or pod in ambient mode (`ambient`) or opts a
/// pod out (`none`).
pub const LABEL_DATAPLANE_MODE: &str = "istio.io/dataplane-mode";
/// Label naming the waypoint an object's traffic goes through.
pub const LABEL_USE_WAYPOINT: &str = "istio.io/use-waypoint";
/// Label naming the namespace of that waypoint (defaults to the object's).
pub const LABEL_USE_WAYPOINT_NAMESPACE: &str = "istio.io/use-waypoint-namespace";
/// Label on an EndpointSlice naming its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";

/// The kinds of object the model understands. A kind is named by its
/// Kubernetes `kind` and its API group together: [`Kind::Gateway`] is the
/// Gateway API's (`gateway.networking.k8s.io`); Istio's `networking.istio.io`
/// Gateway is a different kind that is not modelled (decoding ignores it).
/// Serialized as the `kind` string ([`Kind::as_str`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Kind {
    Namespace,
    Pod,
    Service,
    EndpointSlice,
    ServiceEntry,
    WorkloadEntry,
    PeerAuthentication,
    AuthorizationPolicy,
    VirtualService,
    DestinationRule,
    Sidecar,
    /// The Gateway API Gateway (not Istio's `networking.istio.io` one).
    Gateway,
    #[serde(rename = "HTTPRoute")]
    HttpRoute,
    #[serde(rename = "GRPCRoute")]
    GrpcRoute,
    #[serde(rename = "TCPRoute")]
    TcpRoute,
    Node,
    /// `telemetry.istio.io` Telemetry.
    Telemetry,
    /// The mesh configuration: the ConfigMap `istio` in a root namespace
    /// (other ConfigMaps are not modelled).
    #[serde(rename = "ConfigMap")]
    MeshConfig,
}

impl Kind {
    pub const ALL: [Kind; 18] = [
        Kind::Namespace,
        Kind::Pod,
        Kind::Service,
        Kind::EndpointSlice,
        Kind::ServiceEntry,
        Kind::WorkloadEntry,
        Kind::PeerAuthentication,
        Kind::AuthorizationPolicy,
        Kind::VirtualService,
        Kind::DestinationRule,
        Kind::Sidecar,
        Kind::Gateway,
        Kind::HttpRoute,
        Kind::GrpcRoute,
        Kind::TcpRoute,
        Kind::Node,
        Kind::Telemetry,
        Kind::MeshConfig,
    ];

    /// The Kubernetes `kind` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Namespace => "Namespace",
            Kind::Pod => "Pod",
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::ServiceEntry => "ServiceEntry",
            Kind::WorkloadEntry => "WorkloadEntry",
            Kind::PeerAuthentication => "PeerAuthentication",
            Kind::AuthorizationPolicy => "AuthorizationPolicy",
            Kind::VirtualService => "VirtualService",
            Kind::DestinationRule => "DestinationRule",
            Kind::Sidecar => "Sidecar",
            Kind::Gateway => "Gateway",
            Kind::HttpRoute => "HTTPRoute",
            Kind::GrpcRoute => "GRPCRoute",
            Kind::TcpRoute => "TCPRoute",
            Kind::Node => "Node",
            Kind::Telemetry => "Telemetry",
            Kind::MeshConfig => "ConfigMap",
        }
    }

    /// Parses a Kubernetes `kind` string, whatever its group (`Gateway` is
    /// [`Kind::Gateway`]); see [`Self::from_group_kind`].
    pub fn from_kind_str(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The kind named `kind` in API `group` (`""` for core).
    pub fn from_group_kind(group: &str, kind: &str) -> Option<Kind> {
        Kind::from_kind_str(kind).filter(|k| k.group() == group)
    }

    /// The API group (`""` for core).
    pub fn group(self) -> &'static str {
        let api_version = self.api_versions()[0];
        api_version.rsplit_once('/').map_or("", |(g, _)| g)
    }

    /// False only for cluster-scoped kinds.
    pub fn is_namespaced(self) -> bool {
        !matches!(self, Kind::Namespace | Kind::Node)
    }

    /// The `apiVersion` spellings accepted for this kind.
    pub fn api_versions(self) -> &'static [&'static str] {
        match self {
            Kind::Namespace | Kind::Pod | Kind::Service | Kind::Node => &["v1"],
            Kind::EndpointSlice => &["discovery.k8s.io/v1", "discovery.k8s.io/v1beta1"],
            Kind::ServiceEntry
            | Kind::WorkloadEntry
            | Kind::VirtualService
            | Kind::DestinationRule
            | Kind::Sidecar => &[
                "networking.istio.io/v1",
                "networking.istio.io/v1beta1",
                "networking.istio.io/v1alpha3",
            ],
            Kind::PeerAuthentication | Kind::AuthorizationPolicy => {
                &["security.istio.io/v1", "security.istio.io/v1beta1"]
            }
            Kind::Gateway | Kind::HttpRoute => &[
                "gateway.networking.k8s.io/v1",
                "gateway.networking.k8s.io/v1beta1",
            ],
            Kind::GrpcRoute => &[
                "gateway.networking.k8s.io/v1",
                "gateway.networking.k8s.io/v1alpha2",
            ],
            // Standard channel v1.5+: `v1`; experimental and older: `v1alpha2`.
            Kind::TcpRoute => &[
                "gateway.networking.k8s.io/v1",
                "gateway.networking.k8s.io/v1alpha2",
            ],
            Kind::Telemetry => &["telemetry.istio.io/v1", "telemetry.istio.io/v1alpha1"],
            Kind::MeshConfig => &["v1"],
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Identity of an object: `kind/namespace/name` (namespace empty for
/// cluster-scoped kinds).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ObjectKey {
    pub kind: Kind,
    pub namespace: String,
    pub name: String,
}

impl ObjectKey {
    pub fn new(kind: Kind, namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            kind,
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.kind, self.namespace, self.name)
    }
}

/// One object of any supported kind.
#[derive(Debug, Clone, PartialEq)]
pub enum Object {
    Namespace(Namespace),
    Pod(Pod),
    Service(Service),
    EndpointSlice(EndpointSlice),
    ServiceEntry(Box<ServiceEntry>),
    WorkloadEntry(WorkloadEntry),
    PeerAuthentication(PeerAuthentication),
    AuthorizationPolicy(AuthorizationPolicy),
    VirtualService(Box<VirtualService>),
    DestinationRule(Box<DestinationRule>),
    Sidecar(Box<Sidecar>),
    Gateway(Box<Gateway>),
    HttpRoute(Box<HttpRoute>),
    GrpcRoute(Box<GrpcRoute>),
    TcpRoute(Box<TcpRoute>),
    Node(Node),
    Telemetry(Box<Telemetry>),
    MeshConfig(Box<MeshConfigMap>),
}

impl Object {
    pub fn kind(&self) -> Kind {
        match self {
            Object::Namespace(_) => Kind::Namespace,
            Object::Pod(_) => Kind::Pod,
            Object::Service(_) => Kind::Service,
            Object::EndpointSlice(_) => Kind::EndpointSlice,
            Object::ServiceEntry(_) => Kind::ServiceEntry,
            Object::WorkloadEntry(_) => Kind::WorkloadEntry,
            Object::PeerAuthentication(_) => Kind::PeerAuthentication,
            Object::AuthorizationPolicy(_) => Kind::AuthorizationPolicy,
            Object::VirtualService(_) => Kind::VirtualService,
            Object::DestinationRule(_) => Kind::DestinationRule,
            Object::Sidecar(_) => Kind::Sidecar,
            Object::Gateway(_) => Kind::Gateway,
            Object::HttpRoute(_) => Kind::HttpRoute,
            Object::GrpcRoute(_) => Kind::GrpcRoute,
            Object::TcpRoute(_) => Kind::TcpRoute,
            Object::Node(_) => Kind::Node,
            Object::Telemetry(_) => Kind::Telemetry,
            Object::MeshConfig(_) => Kind::MeshConfig,
        }
    }

    pub fn metadata(&self) -> &ObjectMeta {
        match self {
            Object::Namespace(o) => &o.metadata,
            Object::Pod(o) => &o.metadata,
            Object::Service(o) => &o.metadata,
            Object::EndpointSlice(o) => &o.metadata,
            Object::ServiceEntry(o) => &o.metadata,
            Object::WorkloadEntry(o) => &o.metadata,
            Object::PeerAuthentication(o) => &o.metadata,
            Object::AuthorizationPolicy(o) => &o.metadata,
            Object::VirtualService(o) => &o.metadata,
            Object::DestinationRule(o) => &o.metadata,
            Object::Sidecar(o) => &o.metadata,
            Object::Gateway(o) => &o.metadata,
            Object::HttpRoute(o) => &o.metadata,
            Object::GrpcRoute(o) => &o.metadata,
            Object::TcpRoute(o) => &o.metadata,
            Object::Node(o) => &o.metadata,
            Object::Telemetry(o) => &o.metadata,
            Object::MeshConfig(o) => &o.metadata,
        }
    }

    pub(crate) fn metadata_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Object::Namespace(o) => &mut o.metadata,
            Object::Pod(o) => &mut o.metadata,
            Object::Service(o) => &mut o.metadata,
            Object::EndpointSlice(o) => &mut o.metadata,
            Object::ServiceEntry(o) => &mut o.metadata,
            Object::WorkloadEntry(o) => &mut o.metadata,
            Object::PeerAuthentication(o) => &mut o.metadata,
            Object::AuthorizationPolicy(o) => &mut o.metadata,
            Object::VirtualService(o) => &mut o.metadata,
            Object::DestinationRule(o) => &mut o.metadata,
            Object::Sidecar(o) => &mut o.metadata,
            Object::Gateway(o) => &mut o.metadata,
            Object::HttpRoute(o) => &mut o.metadata,
            Object::GrpcRoute(o) => &mut o.metadata,
            Object::TcpRoute(o) => &mut o.metadata,
            Object::Node(o) => &mut o.metadata,
            Object::Telemetry(o) => &mut o.metadata,
            Object::MeshConfig(o) => &mut o.metadata,
        }
    }

    pub fn key(&self) -> ObjectKey {
        let m = self.metadata();
        ObjectKey::new(self.kind(), m.namespace.clone(), m.name.clone())
    }
}

/// Deserializes `null` as the type's default (the API server writes
/// `endpoints: null`, people write `labels: ~` or an empty `spec:`). Every
/// non-optional field whose type has a default uses it.
pub(crate) fn nullable<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

pub type Labels = BTreeMap<String, String>;

/// The namespaces whose mesh-wide objects (PeerAuthentication,
/// Telemetry, the mesh configuration) apply to the whole mesh: Istio's
/// and Ambit's.
pub const ROOT_NAMESPACES: [&str; 2] = ["istio-system", "ambit-system"];

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ObjectMeta {
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "nullable")]
    pub namespace: String,
    #[serde(deserialize_with = "nullable")]
    pub uid: String,
    #[serde(deserialize_with = "nullable")]
    pub labels: Labels,
    #[serde(deserialize_with = "nullable")]
    pub annotations: Labels,
    #[serde(deserialize_with = "nullable")]
    pub owner_references: Vec<OwnerReference>,
    pub deletion_timestamp: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct OwnerReference {
    pub kind: String,
    pub name: String,
    pub controller: Option<bool>,
}

/// A label selector (`matchLabels` only; `matchExpressions` are not used by
/// the Istio APIs we read).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LabelSelector {
    #[serde(deserialize_with = "nullable")]
    pub match_labels: Labels,
}

/// True when every `selector` label is present with the same value.
pub fn selector_matches(selector: &Labels, labels: &Labels) -> bool {
    selector
        .iter()
        .all(|(k, v)| labels.get(k).is_some_and(|x| x == v))
}

// ---------------------------------------------------------------- core/v1

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Namespace {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Pod {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: PodSpec,
    #[serde(deserialize_with = "nullable")]
    pub status: PodStatus,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PodSpec {
    #[serde(deserialize_with = "nullable")]
    pub node_name: String,
    /// Defaults to `default` (set by decoding when absent).
    #[serde(deserialize_with = "nullable")]
    pub service_account_name: String,
    /// Deprecated alias of `serviceAccountName`.
    #[serde(deserialize_with = "nullable")]
    pub service_account: String,
    #[serde(deserialize_with = "nullable")]
    pub host_network: bool,
    #[serde(deserialize_with = "nullable")]
    pub containers: Vec<Container>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Container {
    pub name: String,
    #[serde(deserialize_with = "nullable")]
    pub ports: Vec<ContainerPort>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ContainerPort {
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "port_number")]
    pub container_port: u16,
    #[serde(deserialize_with = "nullable")]
    pub protocol: String,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PodStatus {
    #[serde(deserialize_with = "nullable")]
    pub phase: String,
    #[serde(rename = "podIP", deserialize_with = "optional_ip")]
    pub pod_ip: Option<IpAddr>,
    #[serde(rename = "podIPs", deserialize_with = "nullable")]
    pub pod_ips: Vec<PodIp>,
    #[serde(deserialize_with = "nullable")]
    pub conditions: Vec<PodCondition>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PodIp {
    #[serde(deserialize_with = "ip")]
    pub ip: IpAddr,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PodCondition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
}

impl Pod {
    /// All pod IPs, `podIPs` first, without duplicates.
    pub fn ips(&self) -> Vec<IpAddr> {
        let mut out: Vec<IpAddr> = Vec::with_capacity(self.status.pod_ips.len().max(1));
        for ip in self
            .status
            .pod_ips
            .iter()
            .map(|p| p.ip)
            .chain(self.status.pod_ip)
        {
            if !out.contains(&ip) {
                out.push(ip);
            }
        }
        out
    }

    /// The service account (`default` when unset).
    pub fn service_account(&self) -> &str {
        if !self.spec.service_account_name.is_empty() {
            &self.spec.service_account_name
        } else if !self.spec.service_account.is_empty() {
            &self.spec.service_account
        } else {
            "default"
        }
    }

    /// Succeeded or Failed: the pod is gone and its IP may be reused.
    pub fn is_terminal(&self) -> bool {
        matches!(self.status.phase.as_str(), "Succeeded" | "Failed")
    }

    /// Running (or phase not given) and Ready (or condition not given) and
    /// not being deleted.
    pub fn is_healthy(&self) -> bool {
        let running = self.status.phase.is_empty() || self.status.phase == "Running";
        let ready = self
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .is_none_or(|c| c.status == "True");
        running && ready && self.metadata.deletion_timestamp.is_none()
    }

    /// Resolves a named container port.
    pub fn container_port(&self, name: &str) -> Option<u16> {
        self.spec
            .containers
            .iter()
            .flat_map(|c| c.ports.iter())
            .find(|p| p.name == name)
            .map(|p| p.container_port)
    }
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Service {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: ServiceSpec,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServiceSpec {
    #[serde(rename = "type", deserialize_with = "nullable")]
    pub type_: String,
    /// As written: an IP, `None` (headless) or empty.
    #[serde(rename = "clusterIP", deserialize_with = "nullable")]
    pub cluster_ip: String,
    #[serde(rename = "clusterIPs", deserialize_with = "nullable")]
    pub cluster_ips: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub ports: Vec<ServicePort>,
    /// `None` and empty both mean "no selector".
    pub selector: Option<Labels>,
    /// Parsed virtual IPs (set by decoding; empty when headless).
    #[serde(skip)]
    pub vips: Vec<IpAddr>,
}

impl Service {
    pub fn is_headless(&self) -> bool {
        self.spec.cluster_ip == "None"
    }
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServicePort {
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "port_number")]
    pub port: u16,
    pub target_port: Option<TargetPort>,
    #[serde(deserialize_with = "nullable")]
    pub protocol: String,
    /// `appProtocol` (e.g. `http`, `kubernetes.io/h2c`): wins over the
    /// port name when the mesh infers the application protocol.
    pub app_protocol: Option<String>,
}

/// A Service `targetPort`: a number or the name of a container port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetPort {
    Number(u16),
    Name(String),
}

impl<'de> Deserialize<'de> for TargetPort {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = TargetPort;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a port number (1-65535) or a port name (lowercase letters, digits, '-', at most 15 characters)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<TargetPort, E> {
                check_port(v as i64)
                    .map(TargetPort::Number)
                    .map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<TargetPort, E> {
                check_port(v).map(TargetPort::Number).map_err(E::custom)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<TargetPort, E> {
                if let Ok(n) = v.parse::<i64>() {
                    return check_port(n).map(TargetPort::Number).map_err(E::custom);
                }
                if is_port_name(v) {
                    Ok(TargetPort::Name(v.to_string()))
                } else {
                    Err(E::custom(format!(
                        "{v:?} is neither a port number (1-65535) nor a valid port name (lowercase letters, digits and '-', at most 15 characters, at least one letter)"
                    )))
                }
            }
        }
        d.deserialize_any(V)
    }
}

pub(crate) fn check_port(v: i64) -> Result<u16, String> {
    if (1..=65535).contains(&v) {
        Ok(v as u16)
    } else {
        Err(format!("port {v} is out of range; use 1-65535"))
    }
}

/// An IANA_SVC_NAME as Kubernetes validates port names.
pub fn is_port_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 15
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && s.bytes().any(|b| b.is_ascii_lowercase())
        && !s.starts_with('-')
        && !s.ends_with('-')
        && !s.contains("--")
}

/// Deserializes a port number 1-65535 (not a string).
pub(crate) fn port_number<'de, D: Deserializer<'de>>(d: D) -> Result<u16, D::Error> {
    struct V;
    impl Visitor<'_> for V {
        type Value = u16;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a port number (1-65535)")
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u16, E> {
            check_port(v.min(i64::MAX as u64) as i64).map_err(E::custom)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<u16, E> {
            check_port(v).map_err(E::custom)
        }
    }
    d.deserialize_any(V)
}

pub(crate) fn optional_port_number<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<u16>, D::Error> {
    #[derive(Deserialize)]
    struct W(#[serde(deserialize_with = "port_number")] u16);
    Ok(Option::<W>::deserialize(d)?.map(|w| w.0))
}

/// A visitor that parses a string (or a plain scalar number) with `parse`,
/// so errors are raised inside the deserializer and carry the field path.
struct ParseStr<F>(F, &'static str);

impl<T, F: FnOnce(&str) -> Result<T, String>> Visitor<'_> for ParseStr<F> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.1)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        (self.0)(v).map_err(E::custom)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
        (self.0)(&v.to_string()).map_err(E::custom)
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
        (self.0)(&v.to_string()).map_err(E::custom)
    }
}

/// Deserializes a string field with `parse`.
pub(crate) fn parse_str<'de, D, T>(
    d: D,
    expecting: &'static str,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
{
    d.deserialize_str(ParseStr(parse, expecting))
}

/// Like [`parse_str`], for a field that may be written as a string or as a
/// number in any format (a JSON number too: the API server keeps what a
/// schema-less CRD was given).
pub(crate) fn parse_scalar<'de, D, T>(
    d: D,
    expecting: &'static str,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
{
    d.deserialize_any(ParseStr(parse, expecting))
}

fn parse_ip(s: &str) -> Result<Option<IpAddr>, String> {
    if s.is_empty() {
        return Ok(None);
    }
    s.parse()
        .map(Some)
        .map_err(|_| format!("{s:?} is not a valid IP address"))
}

/// Deserializes an IP address; empty string and null mean absent.
fn optional_ip<'de, D: Deserializer<'de>>(d: D) -> Result<Option<IpAddr>, D::Error> {
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Option<IpAddr>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an IP address")
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            parse_str(d, "an IP address", parse_ip)
        }
    }
    d.deserialize_option(V)
}

fn ip<'de, D: Deserializer<'de>>(d: D) -> Result<IpAddr, D::Error> {
    parse_str(d, "an IP address", |s| {
        parse_ip(s)?.ok_or_else(|| "the IP address is empty".to_string())
    })
}

// ------------------------------------------------------ discovery.k8s.io/v1

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct EndpointSlice {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub address_type: String,
    #[serde(deserialize_with = "nullable")]
    pub endpoints: Vec<Endpoint>,
    #[serde(deserialize_with = "nullable")]
    pub ports: Vec<EndpointPort>,
}

impl EndpointSlice {
    /// The Service this slice belongs to (label `kubernetes.io/service-name`).
    pub fn service_name(&self) -> Option<&str> {
        self.metadata
            .labels
            .get(LABEL_SERVICE_NAME)
            .map(String::as_str)
    }
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Endpoint {
    #[serde(deserialize_with = "nullable")]
    pub addresses: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub conditions: EndpointConditions,
    pub target_ref: Option<ObjectReference>,
    #[serde(deserialize_with = "nullable")]
    pub node_name: String,
    /// Parsed `addresses` (set by decoding; empty for FQDN slices).
    #[serde(skip)]
    pub ips: Vec<IpAddr>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct EndpointConditions {
    pub ready: Option<bool>,
    pub serving: Option<bool>,
    pub terminating: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ObjectReference {
    #[serde(deserialize_with = "nullable")]
    pub kind: String,
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "nullable")]
    pub namespace: String,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct EndpointPort {
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "optional_port_number")]
    pub port: Option<u16>,
    #[serde(deserialize_with = "nullable")]
    pub protocol: String,
}
