//! The waypoint translator: for every waypoint (a Gateway API `Gateway` of
//! class `istio-waypoint`/`ambit-waypoint`), the full Envoy configuration
//! of upstream Envoy — listeners, clusters, endpoints and routes — in the
//! snapshot scope `waypoint/<namespace>/<name>`.
//!
//! The shape of one waypoint's Envoy (only upstream filters):
//!
//! ```text
//!  ztunnel ══HBONE══▶ connect_terminate :15008  (mTLS, any mesh identity; HTTP/2 CONNECT
//!                     │                           :authority = service VIP:port)
//!                     │ set_filter_state: original_dst.local_ip = :authority
//!                     ▼ cluster main_internal (internal address)
//!                     main_internal (internal listener, original_dst restores VIP:port)
//!                     │ one filter chain per service port: HTTP → HCM + RDS routes,
//!                     │ other → tcp_proxy
//!                     ▼ cluster outbound|port|subset|host (EDS; endpoints are internal
//!                     │ addresses with metadata tunnel.destination = pod ip:target port)
//!                     connect_originate;<identity> (internal listener, tcp_proxy tunnelling
//!                     │ CONNECT %DYNAMIC_METADATA(tunnel:destination)%)
//!                     ▼ cluster connect_originate;<identity> (ORIGINAL_DST from that
//!                       metadata, port 15008, mTLS requiring exactly <identity>)
//!                       ══HBONE══▶ the endpoint's ztunnel
//! ```
//!
//! A waypoint for workloads (`istio.io/waypoint-for: workload|all`) also
//! gets, in `main_internal`, one filter chain per bound workload matching
//! its IPs on any port: a `tcp_proxy` tunnelling straight to
//! `connect_originate;<identity>` with the original destination (pod
//! IP:port) as CONNECT authority — the ORIGINAL_DST cluster falls back to
//! the restored local address when there is no tunnel metadata. Workload
//! traffic is handled at L4 (no HTTP routing).
//!
//! Planning (which services and endpoints a waypoint serves) is separate
//! from building Envoy messages, so the builders are pure functions of a
//! [`WaypointPlan`].

use std::net::IpAddr;

pub mod authz;
pub(crate) mod clusters;
pub(crate) mod envoy;
pub(crate) mod listeners;
pub(crate) mod plan;
pub(crate) mod policy;
pub(crate) mod routes;
pub mod rules;
pub(crate) mod telemetry;
#[cfg(test)]
mod tests;
pub mod tracing;
#[cfg(test)]
mod tracing_tests;

use super::snapshot::ResourceFamily;

pub use envoy::{SDS_CLUSTER, SECRET_CERTIFICATE, SECRET_ROOTS};
pub(crate) use plan::plan;

/// Envoy's type URLs, in ADS push order.
pub const CLUSTER_TYPE: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const ENDPOINT_TYPE: &str =
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub const LISTENER_TYPE: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const ROUTE_TYPE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";

/// The HBONE port a waypoint terminates on and endpoints are reached at.
pub const HBONE_PORT: u16 = 15008;

/// The snapshot scope of one waypoint's resources.
pub fn scope(namespace: &str, name: &str) -> String {
    format!("waypoint/{namespace}/{name}")
}

/// What one waypoint serves.
#[derive(Debug, Clone, PartialEq)]
pub struct WaypointPlan {
    pub namespace: String,
    pub name: String,
    /// Services bound to the waypoint, and the services their rules send
    /// traffic to.
    pub services: Vec<BoundService>,
    /// Workloads bound to the waypoint (one handling workload traffic):
    /// traffic addressed to their IPs arrives here.
    pub workloads: Vec<BoundWorkload>,
    /// Config mistakes found while planning, for `/debug/config_errors`.
    pub findings: Vec<Finding>,
    /// Per-request metrics and access logs (the Gateway's
    /// `ambit.io/request-telemetry`, on by default).
    pub telemetry: bool,
    /// Where request spans go (Telemetry API + mesh config; off by default).
    pub tracing: Option<tracing::TracingPlan>,
}

/// A config mistake the translation found (the object still serves as
/// described in `reason`).
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    pub kind: String,
    pub namespace: String,
    pub name: String,
    pub reason: String,
}

impl Finding {
    /// A finding about the waypoint itself.
    pub fn waypoint(plan: &WaypointPlan, reason: String) -> Finding {
        Finding {
            kind: "Gateway".into(),
            namespace: plan.namespace.clone(),
            name: plan.name.clone(),
            reason,
        }
    }
}

impl WaypointPlan {
    /// The identities of every peer the waypoint tunnels to (one
    /// CONNECT-originating listener and cluster each).
    pub fn peer_identities(&self) -> std::collections::BTreeSet<&str> {
        self.services
            .iter()
            .flat_map(|s| s.endpoints.iter().map(|e| e.identity.as_str()))
            .chain(self.workloads.iter().map(|w| w.identity.as_str()))
            .chain(
                self.tracing
                    .iter()
                    .flat_map(|t| t.mesh_endpoints.iter().map(|e| e.identity.as_str())),
            )
            .collect()
    }
}

/// A workload bound to a waypoint that handles workload traffic: what is
/// addressed to its IPs goes, at L4, to the same address through its
/// ztunnel.
#[derive(Debug, Clone, PartialEq)]
pub struct BoundWorkload {
    pub namespace: String,
    pub name: String,
    pub ips: Vec<IpAddr>,
    /// Its SPIFFE identity, which its ztunnel presents on HBONE.
    pub identity: String,
}

/// A service the waypoint handles traffic for, or sends traffic to.
#[derive(Debug, Clone, PartialEq)]
pub struct BoundService {
    pub namespace: String,
    pub name: String,
    /// `name.namespace.svc.cluster.local` (or a ServiceEntry host).
    pub hostname: String,
    pub vips: Vec<IpAddr>,
    pub ports: Vec<BoundPort>,
    pub endpoints: Vec<BoundEndpoint>,
    /// Traffic addressed to this service arrives at the waypoint (it gets a
    /// filter chain); otherwise it is only a destination of some rule.
    pub bound: bool,
    /// Routing rules per HTTP port (none: everything to the service).
    pub rules: std::collections::BTreeMap<u16, Vec<rules::RouteRule>>,
    /// Subsets and traffic policy.
    pub destination_rule: Option<ambit_config::networking::DestinationRule>,
    /// L7 authorization per service port (ports without policies absent).
    pub rbac: std::collections::BTreeMap<u16, authz::ServiceRbac>,
}

/// One port of a bound service.
#[derive(Debug, Clone, PartialEq)]
pub struct BoundPort {
    pub port: u16,
    pub name: String,
    pub protocol: Protocol,
}

/// The application protocol of a port, as Istio infers it from
/// `appProtocol` (first) or the port name's prefix (`http-web`). Waypoints
/// do not sniff: anything undeclared is TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http,
    Http2,
    Grpc,
    Tcp,
}

impl Protocol {
    /// Infers the protocol of a service port.
    pub fn infer(app_protocol: Option<&str>, port_name: &str) -> Protocol {
        let from = |s: &str| -> Option<Protocol> {
            match s.to_ascii_lowercase().as_str() {
                "http" => Some(Protocol::Http),
                "http2" | "kubernetes.io/h2c" | "h2c" => Some(Protocol::Http2),
                "grpc" | "grpc-web" => Some(Protocol::Grpc),
                "" => None,
                _ => Some(Protocol::Tcp),
            }
        };
        if let Some(p) = app_protocol.and_then(from) {
            return p;
        }
        let prefix = port_name.split('-').next().unwrap_or("");
        match prefix.to_ascii_lowercase().as_str() {
            "http" => Protocol::Http,
            "http2" | "h2c" => Protocol::Http2,
            "grpc" | "grpc-web" => Protocol::Grpc,
            _ => Protocol::Tcp,
        }
    }

    /// Handled by an HTTP connection manager (routes, retries, ...).
    pub fn is_http(self) -> bool {
        self != Protocol::Tcp
    }
}

/// One endpoint of a bound service.
#[derive(Debug, Clone, PartialEq)]
pub struct BoundEndpoint {
    pub ip: IpAddr,
    /// (service port, target port) pairs this endpoint serves.
    pub ports: Vec<(u16, u16)>,
    /// The workload's SPIFFE identity, which its ztunnel presents on HBONE.
    pub identity: String,
    /// Workload labels (DestinationRule subsets select by them).
    pub labels: ambit_config::objects::Labels,
    /// Who it is, for request metrics.
    pub workload: EndpointWorkload,
    pub healthy: bool,
    /// How it is reached (a waypoint only serves [`Transport::Hbone`] ones).
    pub transport: Transport,
}

/// How a proxy reaches an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// An ambient pod: HBONE to its ztunnel.
    Hbone,
    /// A sidecar pod: mTLS straight to its Envoy (Istio's sidecar ALPN/SNI).
    Mtls,
    /// Outside the mesh: plaintext.
    Plaintext,
}

/// The workload behind an endpoint, as request metrics name it
/// (`destination_workload`, `_namespace`, `destination_app`,
/// `destination_version`); carried in the endpoint's metadata.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EndpointWorkload {
    pub name: String,
    pub namespace: String,
    pub app: String,
    pub version: String,
}

impl BoundEndpoint {
    /// The target port for `service_port`, if this endpoint serves it.
    pub fn target_port(&self, service_port: u16) -> Option<u16> {
        self.ports
            .iter()
            .find(|(s, _)| *s == service_port)
            .map(|(_, t)| *t)
    }
}

/// `outbound|<port>|<subset>|<hostname>`, Istio's cluster naming.
pub fn cluster_name(port: u16, subset: &str, hostname: &str) -> String {
    format!("outbound|{port}|{subset}|{hostname}")
}

/// The resource families of one waypoint (its scope, the four Envoy types).
pub fn families(plan: &WaypointPlan, trust_domain: &str) -> Vec<ResourceFamily> {
    let scope = scope(&plan.namespace, &plan.name);
    let family = |type_url, resources| ResourceFamily {
        scope: scope.clone(),
        type_url,
        resources,
    };
    vec![
        family(CLUSTER_TYPE, clusters::clusters(plan)),
        family(ENDPOINT_TYPE, clusters::endpoints(plan)),
        family(LISTENER_TYPE, listeners::listeners(plan, trust_domain)),
        family(ROUTE_TYPE, routes::routes(plan)),
    ]
}
