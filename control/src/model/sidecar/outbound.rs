//! A namespace's outbound side: `virtualOutbound` on 15001, route
//! configurations named by port (`"80"`) with a virtual host per service,
//! `outbound|<port>|<subset>|<host>` EDS clusters whose endpoints are each
//! reached in their own way (HBONE, mTLS, plaintext; Envoy picks the
//! transport socket from the endpoint's metadata), the passthrough and the
//! HBONE-originating listeners and clusters the waypoint uses.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::{IpAddr, SocketAddr};

use envoy_types::pb::envoy::config::cluster::v3::{
    Cluster,
    cluster::{ClusterDiscoveryType, DiscoveryType, LbPolicy, TransportSocketMatch},
};
use envoy_types::pb::envoy::config::core::v3::{
    HealthStatus, Metadata, TransportSocket, transport_socket::ConfigType as SocketConfig,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    Endpoint, LbEndpoint, lb_endpoint::HostIdentifier,
};
use envoy_types::pb::envoy::config::listener::v3::{
    Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter, listener_filter,
};
use envoy_types::pb::envoy::config::route::v3::{
    Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, route::Action,
    route_action::ClusterSpecifier, route_match::PathSpecifier,
};
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::HttpFault;
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, Rds,
    http_connection_manager::{CodecType, RouteSpecifier},
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    TcpProxy, tcp_proxy::ClusterSpecifier as TcpCluster,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, CommonTlsContext, SubjectAltNameMatcher, UpstreamTlsContext,
    common_tls_context::{CombinedCertificateValidationContext, ValidationContextType},
    subject_alt_name_matcher::SanType,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, string_matcher::MatchPattern};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind as ValueKind};

use super::telemetry::{self, SERVICE_KEYS};
use super::{
    BLACKHOLE_CLUSTER, NamespacePlan, OUTBOUND_PORT, PASSTHROUGH_CLUSTER, VIRTUAL_OUTBOUND,
};
use crate::model::snapshot::XdsResource;
use crate::model::waypoint::clusters::{
    CONNECT_TIMEOUT, TUNNEL, internal_upstream, load_assignment, originate, raw_buffer,
    service_cluster, socket_address as endpoint_address, tunnel_endpoint, tunnel_via,
    variant_endpoints,
};
use crate::model::waypoint::envoy::{
    SECRET_CERTIFICATE, SECRET_ROOTS, ads, any, bool_value, duration, sds, stable_map, u32_value,
};
use crate::model::waypoint::listeners::{
    connect_originate, host_range, http_filter, named_filter, socket_address,
};
use crate::model::waypoint::policy::{self, ClusterVariant};
use crate::model::waypoint::routes::{FAULT_FILTER, domains, service_routes};
use crate::model::waypoint::telemetry::ENDPOINT_METADATA;
use crate::model::waypoint::{
    BoundEndpoint, BoundService, CLUSTER_TYPE, HBONE_PORT, LISTENER_TYPE, Protocol, ROUTE_TYPE,
    Transport, cluster_name,
};

/// Endpoint metadata namespace Envoy picks a transport socket match by.
const SOCKET_MATCH: &str = "envoy.transport_socket_match";
/// ... its key, and the values: a sidecar peer (mTLS) or an ambient one (HBONE).
const TLS_MODE: &str = "tlsMode";
const TLS_MODE_MTLS: &str = "istio";
const TLS_MODE_HBONE: &str = "hbone";
/// The ALPN a sidecar offers a sidecar peer.
const PEER_ALPN: [&str; 2] = ["istio-peer-exchange", "istio"];

/// Every cluster of the namespace's sidecars.
pub fn clusters(plan: &NamespacePlan) -> Vec<XdsResource> {
    let mut out = vec![passthrough(), blackhole()];
    out.extend(hbone_identities(plan).into_iter().map(originate));
    for svc in &plan.services {
        for port in &svc.ports {
            for v in policy::variants(svc.destination_rule.as_ref(), port.port) {
                out.push(service_cluster_with_peers(
                    svc,
                    port.port,
                    port.protocol.is_http(),
                    &v,
                ));
            }
        }
    }
    out.into_iter()
        .map(|c| XdsResource::new(CLUSTER_TYPE, c.name.clone(), Vec::new(), &c))
        .collect()
}

/// The identities of the ambient endpoints and of the waypoints (one
/// HBONE-originating listener and cluster each).
fn hbone_identities(plan: &NamespacePlan) -> BTreeSet<&str> {
    let direct = plan
        .services
        .iter()
        .filter(|s| !plan.waypoints.contains_key(&s.hostname))
        .flat_map(|s| &s.endpoints)
        .filter(|e| e.transport == Transport::Hbone);
    direct
        .chain(plan.waypoints.values().flatten())
        .map(|e| e.identity.as_str())
        .collect()
}

/// A service cluster: plaintext by default, HBONE or mTLS for the
/// endpoints whose metadata asks for it.
fn service_cluster_with_peers(
    svc: &BoundService,
    port: u16,
    http: bool,
    v: &ClusterVariant,
) -> Cluster {
    let name = cluster_name(port, &v.subset, &svc.hostname);
    let mut cluster = service_cluster(name, http, &v.policy, raw_buffer());
    let peers: BTreeSet<&str> = variant_endpoints(svc, port, v)
        .filter(|(e, _)| e.transport == Transport::Mtls)
        .map(|(e, _)| e.identity.as_str())
        .collect();
    let sni = format!("outbound_.{port}_.{}_.{}", v.subset, svc.hostname);
    cluster.transport_socket_matches = vec![
        socket_match(TLS_MODE_HBONE, internal_upstream(&[TUNNEL])),
        socket_match(TLS_MODE_MTLS, peer_tls(&sni, &peers)),
    ];
    cluster
}

fn text(v: &str) -> Value {
    Value {
        kind: Some(ValueKind::StringValue(v.to_string())),
    }
}

fn socket_match(mode: &str, socket: TransportSocket) -> TransportSocketMatch {
    TransportSocketMatch {
        name: format!("{TLS_MODE}-{mode}"),
        r#match: Some(Struct {
            fields: stable_map([(TLS_MODE.to_string(), text(mode))]),
        }),
        transport_socket: Some(socket),
    }
}

/// mTLS to a sidecar peer, as Istio's sidecars speak it: our certificate,
/// the peer's chained to the mesh roots and one of `peers`' identities.
fn peer_tls(sni: &str, peers: &BTreeSet<&str>) -> TransportSocket {
    let sans = peers
        .iter()
        .map(|id| SubjectAltNameMatcher {
            san_type: SanType::Uri as i32,
            matcher: Some(StringMatcher {
                match_pattern: Some(MatchPattern::Exact(id.to_string())),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    let ctx = UpstreamTlsContext {
        sni: sni.to_string(),
        common_tls_context: Some(CommonTlsContext {
            alpn_protocols: PEER_ALPN.iter().map(|s| s.to_string()).collect(),
            tls_certificate_sds_secret_configs: vec![sds(SECRET_CERTIFICATE)],
            validation_context_type: Some(ValidationContextType::CombinedValidationContext(
                CombinedCertificateValidationContext {
                    default_validation_context: Some(CertificateValidationContext {
                        match_typed_subject_alt_names: sans,
                        ..Default::default()
                    }),
                    validation_context_sds_secret_config: Some(sds(SECRET_ROOTS)),
                    ..Default::default()
                },
            )),
            ..Default::default()
        }),
        ..Default::default()
    };
    TransportSocket {
        name: "envoy.transport_sockets.tls".to_string(),
        config_type: Some(SocketConfig::TypedConfig(any(&ctx))),
    }
}

/// Unknown destinations: the original destination, as addressed.
fn passthrough() -> Cluster {
    Cluster {
        name: PASSTHROUGH_CLUSTER.to_string(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(
            DiscoveryType::OriginalDst as i32,
        )),
        lb_policy: LbPolicy::ClusterProvided as i32,
        connect_timeout: Some(duration(CONNECT_TIMEOUT)),
        ..Default::default()
    }
}

/// Refused destinations: a cluster without endpoints.
fn blackhole() -> Cluster {
    Cluster {
        name: BLACKHOLE_CLUSTER.to_string(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32)),
        connect_timeout: Some(duration(CONNECT_TIMEOUT)),
        ..Default::default()
    }
}

/// Every service cluster's endpoints.
pub fn endpoints(plan: &NamespacePlan) -> Vec<XdsResource> {
    let mut out = Vec::new();
    for svc in &plan.services {
        for port in &svc.ports {
            if let Some(waypoint) = plan.waypoints.get(&svc.hostname) {
                let name = cluster_name(port.port, "", &svc.hostname);
                let lb_endpoints = waypoint
                    .iter()
                    .map(|wp| via_waypoint(svc, wp, port.port))
                    .collect();
                out.push(load_assignment(name, lb_endpoints));
                continue;
            }
            for v in policy::variants(svc.destination_rule.as_ref(), port.port) {
                let name = cluster_name(port.port, &v.subset, &svc.hostname);
                let lb_endpoints = variant_endpoints(svc, port.port, &v)
                    .map(|(e, target)| lb_endpoint(svc, e, target))
                    .collect();
                out.push(load_assignment(name, lb_endpoints));
            }
        }
    }
    out
}

/// One endpoint, marked with how it is reached and with who it is (the
/// request metrics read it).
fn lb_endpoint(svc: &BoundService, e: &BoundEndpoint, target: u16) -> LbEndpoint {
    let mode = match e.transport {
        Transport::Hbone => Some(TLS_MODE_HBONE),
        Transport::Mtls => Some(TLS_MODE_MTLS),
        Transport::Plaintext => None,
    };
    let mut lb = if e.transport == Transport::Hbone {
        tunnel_endpoint(e, target)
    } else {
        LbEndpoint {
            host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
                address: Some(endpoint_address(std::net::SocketAddr::new(e.ip, target))),
                ..Default::default()
            })),
            health_status: if e.healthy {
                HealthStatus::Healthy
            } else {
                HealthStatus::Unhealthy
            } as i32,
            ..Default::default()
        }
    };
    mark(&mut lb, who(svc, e), mode);
    lb
}

/// Sets who an endpoint is (for the request metrics) and how it is
/// reached (the transport socket match), keeping its other metadata.
fn mark(lb: &mut LbEndpoint, who: Struct, mode: Option<&str>) {
    let md = lb.metadata.get_or_insert_with(Metadata::default);
    let mut fields: Vec<(String, Struct)> = std::mem::take(&mut md.filter_metadata)
        .into_iter()
        .filter(|(k, _)| k != ENDPOINT_METADATA)
        .collect();
    fields.push((ENDPOINT_METADATA.to_string(), who));
    if let Some(mode) = mode {
        fields.push((
            SOCKET_MATCH.to_string(),
            Struct {
                fields: stable_map([(TLS_MODE.to_string(), text(mode))]),
            },
        ));
    }
    md.filter_metadata = stable_map(fields);
}

/// A waypoint pod standing in for a service port: HBONE to the waypoint,
/// asking for the service's first VIP and the port (what a ztunnel asks a
/// waypoint for).
fn via_waypoint(svc: &BoundService, wp: &BoundEndpoint, port: u16) -> LbEndpoint {
    let vip = svc.vips.first().copied().unwrap_or(wp.ip);
    let mut lb = tunnel_via(
        wp,
        SocketAddr::new(wp.ip, HBONE_PORT),
        SocketAddr::new(vip, port),
    );
    mark(&mut lb, who(svc, wp), Some(TLS_MODE_HBONE));
    lb
}

/// The workload behind an endpoint and the service it was chosen for.
fn who(svc: &BoundService, e: &BoundEndpoint) -> Struct {
    let w = &e.workload;
    let [service, service_name, service_namespace] = SERVICE_KEYS;
    let fields = [
        ("workload", w.name.as_str()),
        ("namespace", w.namespace.as_str()),
        ("app", w.app.as_str()),
        ("version", w.version.as_str()),
        ("principal", e.identity.as_str()),
        (service, svc.hostname.as_str()),
        (service_name, svc.name.as_str()),
        (service_namespace, svc.namespace.as_str()),
    ];
    Struct {
        fields: stable_map(fields.into_iter().map(|(k, v)| (k.to_string(), text(v)))),
    }
}

/// `virtualOutbound` and the HBONE-originating internal listeners.
pub fn listeners(plan: &NamespacePlan) -> Vec<XdsResource> {
    let mut out = vec![virtual_outbound(plan)];
    out.extend(hbone_identities(plan).into_iter().map(connect_originate));
    out.into_iter()
        .map(|l| XdsResource::new(LISTENER_TYPE, l.name.clone(), Vec::new(), &l))
        .collect()
}

fn tcp_proxy(cluster: &str) -> Filter {
    let tcp = TcpProxy {
        stat_prefix: cluster.to_string(),
        cluster_specifier: Some(TcpCluster::Cluster(cluster.to_string())),
        ..Default::default()
    };
    named_filter("envoy.filters.network.tcp_proxy", &tcp)
}

/// The route configuration an HTTP port's chains read (Istio names them
/// by port).
pub fn route_config_name(port: u16) -> String {
    port.to_string()
}

/// An HTTP port's connection manager; every request counted with
/// `reporter="source"`.
fn outbound_hcm(port: u16, protocol: Protocol) -> Filter {
    let hcm = HttpConnectionManager {
        stat_prefix: format!("outbound_0.0.0.0_{port}"),
        codec_type: CodecType::Auto as i32,
        route_specifier: Some(RouteSpecifier::Rds(Rds {
            config_source: Some(ads()),
            route_config_name: route_config_name(port),
        })),
        http_filters: vec![
            http_filter(FAULT_FILTER, &HttpFault::default()),
            http_filter("envoy.filters.http.router", &Router::default()),
        ],
        access_log: telemetry::outbound_logs(protocol),
        ..Default::default()
    };
    named_filter("envoy.filters.network.http_connection_manager", &hcm)
}

/// 0.0.0.0:15001: the original destination (restored by the listener
/// filter) picks a chain per visible service VIP:port; anything else
/// passes through (or is refused under `REGISTRY_ONLY`).
fn virtual_outbound(plan: &NamespacePlan) -> Listener {
    let mut chains = Vec::new();
    let mut taken: HashSet<(IpAddr, u16)> = HashSet::new();
    for svc in plan.services.iter().filter(|s| s.bound) {
        for port in &svc.ports {
            // A VIP:port claimed twice keeps its first service.
            let vips: Vec<IpAddr> = svc
                .vips
                .iter()
                .copied()
                .filter(|ip| taken.insert((*ip, port.port)))
                .collect();
            if vips.is_empty() {
                continue;
            }
            let filter = if port.protocol.is_http() {
                outbound_hcm(port.port, port.protocol)
            } else {
                tcp_proxy(&cluster_name(port.port, "", &svc.hostname))
            };
            chains.push(FilterChain {
                name: format!("{}:{}", svc.hostname, port.port),
                filter_chain_match: Some(FilterChainMatch {
                    destination_port: Some(u32_value(port.port.into())),
                    prefix_ranges: vips.into_iter().map(host_range).collect(),
                    ..Default::default()
                }),
                filters: vec![filter],
                ..Default::default()
            });
        }
    }
    let fallback = if plan.allow_any {
        PASSTHROUGH_CLUSTER
    } else {
        BLACKHOLE_CLUSTER
    };
    Listener {
        name: VIRTUAL_OUTBOUND.to_string(),
        address: Some(socket_address(IpAddr::from([0, 0, 0, 0]), OUTBOUND_PORT)),
        use_original_dst: Some(bool_value(true)),
        listener_filters: vec![ListenerFilter {
            name: "envoy.filters.listener.original_dst".to_string(),
            config_type: Some(listener_filter::ConfigType::TypedConfig(any(
                &OriginalDst::default(),
            ))),
            ..Default::default()
        }],
        filter_chains: chains,
        default_filter_chain: Some(FilterChain {
            name: fallback.to_string(),
            filters: vec![tcp_proxy(fallback)],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// One route configuration per HTTP port of the visible services, a
/// virtual host per service (own namespace first: a short name means the
/// caller's namespace), and a catch-all for unknown hosts.
pub fn routes(plan: &NamespacePlan) -> Vec<XdsResource> {
    let mut by_port: BTreeMap<u16, Vec<&BoundService>> = BTreeMap::new();
    for svc in plan
        .services
        .iter()
        .filter(|s| s.bound && !s.vips.is_empty())
    {
        for port in svc.ports.iter().filter(|p| p.protocol.is_http()) {
            by_port.entry(port.port).or_default().push(svc);
        }
    }
    let mut out = Vec::new();
    for (port, mut services) in by_port {
        services.sort_by_key(|s| (s.namespace != plan.namespace, s.hostname.clone()));
        let mut used: HashSet<String> = HashSet::new();
        let mut virtual_hosts: Vec<VirtualHost> = services
            .iter()
            .map(|svc| {
                let names = domains(svc, port)
                    .into_iter()
                    .filter(|d| used.insert(d.clone()))
                    .collect();
                VirtualHost {
                    name: format!("{}:{port}", svc.hostname),
                    domains: names,
                    routes: service_routes(svc, port, &plan.services),
                    ..Default::default()
                }
            })
            .collect();
        virtual_hosts.push(catch_all(plan.allow_any));
        let rc = RouteConfiguration {
            name: route_config_name(port),
            virtual_hosts,
            validate_clusters: Some(bool_value(false)),
            ..Default::default()
        };
        out.push(XdsResource::new(
            ROUTE_TYPE,
            rc.name.clone(),
            Vec::new(),
            &rc,
        ));
    }
    out
}

/// Requests for hosts no service claims: passed through (`allow_any`) or
/// refused with 502.
fn catch_all(allow_any: bool) -> VirtualHost {
    let name = if allow_any { "allow_any" } else { "block_all" };
    let cluster = if allow_any {
        PASSTHROUGH_CLUSTER
    } else {
        BLACKHOLE_CLUSTER
    };
    VirtualHost {
        name: name.to_string(),
        domains: vec!["*".to_string()],
        routes: vec![Route {
            name: name.to_string(),
            r#match: Some(RouteMatch {
                path_specifier: Some(PathSpecifier::Prefix("/".to_string())),
                ..Default::default()
            }),
            action: Some(Action::Route(RouteAction {
                cluster_specifier: Some(ClusterSpecifier::Cluster(cluster.to_string())),
                timeout: Some(duration(std::time::Duration::ZERO)),
                ..Default::default()
            })),
            ..Default::default()
        }],
        ..Default::default()
    }
}
