//! The sidecar translator: the full upstream Envoy configuration of every
//! pod that runs an Envoy sidecar (legacy, non-ambient workloads), with
//! Istio's sidecar listener, cluster and route names.
//!
//! Two scopes per sidecar, merged by the sidecar generator:
//!
//! * `sidecar/<namespace>` — outbound, built once per namespace that has a
//!   sidecar pod: what every sidecar of the namespace may reach (services of
//!   its namespace and the root namespaces, or what the namespace's Istio
//!   `Sidecar` lists in `egress[].hosts`).
//! * `sidecar/<namespace>/<pod>` — inbound, per sidecar pod: its ports with
//!   their PeerAuthentication mode and AuthorizationPolicy.
//!
//! ```text
//!  app ──(iptables)──▶ virtualOutbound :15001 (use_original_dst)
//!                      │ one chain per service VIP:port: HTTP → HCM, RDS "<port>"
//!                      │ (a virtual host per service, the waypoint's routes);
//!                      │ TCP → tcp_proxy; anything else → PassthroughCluster
//!                      ▼ outbound|<port>|<subset>|<host> (EDS), per endpoint:
//!                        ambient pod → connect_originate;<identity> ══HBONE══▶ its ztunnel
//!                        sidecar pod → mTLS, ALPN istio-peer-exchange/istio,
//!                                      SNI outbound_.<port>_.<subset>_.<host>
//!                        outside the mesh → plaintext
//!                        a waypoint-bound service → connect_originate;<waypoint id>
//!                          ══HBONE (CONNECT <VIP:port>)══▶ the waypoint
//!
//!  peer ──▶ virtualInbound :15006 (original_dst, tls_inspector)
//!           │ one chain set per pod port: STRICT → mTLS required; PERMISSIVE →
//!           │ TLS or plaintext; DISABLE → plaintext; then the pod's RBAC
//!           ▼ InboundPassthroughCluster (ORIGINAL_DST, from 127.0.0.6) ──▶ app
//!  ztunnel ══HBONE══▶ connect_terminate :15008 ─▶ main_internal (the pod's
//!           ports, plaintext chains with the same RBAC) ─▶ InboundPassthroughCluster
//! ```
//!
//! Routing, clusters and traffic policy come from the waypoint's
//! translation (`waypoint::plan::{bound_service, route_service}`,
//! `waypoint::routes::service_routes`, `waypoint::policy`): one translation
//! of VirtualService/HTTPRoute/DestinationRule, two consumers.

use std::net::IpAddr;

mod inbound;
mod outbound;
mod plan;
mod telemetry;
#[cfg(test)]
mod tests;

use ambit_config::objects::Pod;

use super::snapshot::ResourceFamily;
use super::waypoint::authz::ServiceRbac;
use super::waypoint::{
    BoundEndpoint, BoundService, CLUSTER_TYPE, ENDPOINT_TYPE, Finding, LISTENER_TYPE, Protocol,
    ROUTE_TYPE,
};

pub(crate) use plan::plan;

/// The outbound listener's name and port.
pub const VIRTUAL_OUTBOUND: &str = "virtualOutbound";
pub const OUTBOUND_PORT: u16 = 15001;
/// The inbound listener's name and port.
pub const VIRTUAL_INBOUND: &str = "virtualInbound";
pub const INBOUND_PORT: u16 = 15006;
/// Where unknown destinations go (ORIGINAL_DST).
pub const PASSTHROUGH_CLUSTER: &str = "PassthroughCluster";
/// Where unknown destinations go when only registered hosts may be reached.
pub const BLACKHOLE_CLUSTER: &str = "BlackHoleCluster";
/// How inbound traffic reaches the app (ORIGINAL_DST from 127.0.0.6).
pub const INBOUND_PASSTHROUGH_CLUSTER: &str = "InboundPassthroughCluster";
/// The source address inbound traffic reaches the app from.
pub const INBOUND_SOURCE: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 6));

/// The annotation sidecar injection writes on a pod.
pub const STATUS_ANNOTATION: &str = "sidecar.istio.io/status";
/// The injected Envoy's container name.
pub const PROXY_CONTAINER: &str = "istio-proxy";

/// Whether `pod` runs an Envoy sidecar: injection marked it, or it has the
/// proxy container. A gateway's pod (a waypoint's among them, whose Envoy
/// container has the same name) is no sidecar.
pub fn runs_sidecar(pod: &Pod) -> bool {
    if pod
        .metadata
        .labels
        .contains_key(super::index::LABEL_GATEWAY_NAME)
    {
        return false;
    }
    pod.metadata.annotations.contains_key(STATUS_ANNOTATION)
        || pod
            .spec
            .containers
            .iter()
            .any(|c| c.name == PROXY_CONTAINER)
}

/// The scope of the outbound resources every sidecar of `namespace` shares.
pub fn namespace_scope(namespace: &str) -> String {
    format!("sidecar/{namespace}")
}

/// The scope of one sidecar pod's inbound resources. The pod's service
/// account is part of it: a proxy is served a pod's inbound side (its
/// policies, its ports) only when its credentials are that service
/// account's (the xDS server checks the `SERVICE_ACCOUNT` a node claims).
pub fn pod_scope(namespace: &str, pod: &str, service_account: &str) -> String {
    format!("sidecar/{namespace}/{pod}/{service_account}")
}

/// What the sidecars of one namespace may reach.
#[derive(Debug, Clone, PartialEq)]
pub struct NamespacePlan {
    pub namespace: String,
    /// Services visible to the namespace (`bound`: they get an outbound
    /// filter chain and virtual host), then services only their rules send
    /// traffic to (clusters only).
    pub services: Vec<BoundService>,
    /// Services bound to a waypoint (by hostname) and the waypoint's pods:
    /// their traffic goes to the waypoint over HBONE, asking for the
    /// service's `VIP:port`, so the waypoint's routes and policies apply.
    pub waypoints: std::collections::BTreeMap<String, Vec<BoundEndpoint>>,
    /// Unknown destinations pass through (`ALLOW_ANY`, Istio's default);
    /// otherwise they are refused (`REGISTRY_ONLY`).
    pub allow_any: bool,
    /// Config mistakes found while planning.
    pub findings: Vec<Finding>,
}

/// The mTLS mode of an inbound port, from PeerAuthentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerMode {
    /// mTLS required.
    Strict,
    /// mTLS or plaintext (the default).
    Permissive,
    /// Plaintext only.
    Disable,
}

/// One inbound port of a sidecar pod.
#[derive(Debug, Clone, PartialEq)]
pub struct InboundPort {
    pub port: u16,
    pub protocol: Protocol,
    pub mode: PeerMode,
    /// The pod's AuthorizationPolicy for this port.
    pub rbac: ServiceRbac,
    /// The service whose target port this is (the first of the pod's
    /// services when several are), which the inbound request metrics name.
    pub service: Option<InboundService>,
}

/// A service as the inbound request metrics name it.
#[derive(Debug, Clone, PartialEq)]
pub struct InboundService {
    pub hostname: String,
    pub name: String,
    pub namespace: String,
}

/// One sidecar pod's inbound side.
#[derive(Debug, Clone, PartialEq)]
pub struct PodPlan {
    pub namespace: String,
    pub name: String,
    pub service_account: String,
    pub ips: Vec<IpAddr>,
    /// Declared ports (containers, services' target ports, policy ports).
    pub ports: Vec<InboundPort>,
    /// Every other port: the pod's mode and the policies that name no port.
    pub other_ports: InboundPort,
}

/// The resource families of one namespace's outbound side.
pub fn namespace_families(plan: &NamespacePlan) -> Vec<ResourceFamily> {
    let scope = namespace_scope(&plan.namespace);
    let family = |type_url, resources| ResourceFamily {
        scope: scope.clone(),
        type_url,
        resources,
    };
    vec![
        family(CLUSTER_TYPE, outbound::clusters(plan)),
        family(ENDPOINT_TYPE, outbound::endpoints(plan)),
        family(LISTENER_TYPE, outbound::listeners(plan)),
        family(ROUTE_TYPE, outbound::routes(plan)),
    ]
}

/// The resource families of one sidecar pod's inbound side (every type
/// present, empty ones too, so the generator can tell "nothing" from
/// "gone").
pub fn pod_families(plan: &PodPlan, trust_domain: &str) -> Vec<ResourceFamily> {
    let scope = pod_scope(&plan.namespace, &plan.name, &plan.service_account);
    let family = |type_url, resources| ResourceFamily {
        scope: scope.clone(),
        type_url,
        resources,
    };
    vec![
        family(CLUSTER_TYPE, inbound::clusters()),
        family(ENDPOINT_TYPE, Vec::new()),
        family(LISTENER_TYPE, inbound::listeners(plan, trust_domain)),
        family(ROUTE_TYPE, Vec::new()),
    ]
}
