//! A sidecar pod's inbound side: `virtualInbound` on 15006 (per port, the
//! PeerAuthentication mode picks the chains, the pod's AuthorizationPolicy
//! guards them), HBONE termination on 15008 for ambient callers (the
//! waypoint's `connect_terminate`, into an internal listener with the
//! same per-port policy), and `InboundPassthroughCluster` to the app.

use std::net::IpAddr;

use envoy_types::pb::envoy::config::cluster::v3::{
    Cluster,
    cluster::{ClusterDiscoveryType, DiscoveryType, LbPolicy},
};
use envoy_types::pb::envoy::config::core::v3::{
    BindConfig, SocketAddress, TransportSocket, socket_address::PortSpecifier,
    transport_socket::ConfigType as SocketConfig,
};
use envoy_types::pb::envoy::config::listener::v3::{
    Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter,
    listener::{InternalListenerConfig, ListenerSpecifier},
    listener_filter,
};
use envoy_types::pb::envoy::config::rbac::v3::{Principal, Rbac as RbacRules, principal};
use envoy_types::pb::envoy::config::route::v3::{
    Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, route::Action,
    route_action::ClusterSpecifier, route_match::PathSpecifier,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::listener::tls_inspector::v3::TlsInspector;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager,
    http_connection_manager::{CodecType, RouteSpecifier},
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    TcpProxy, tcp_proxy::ClusterSpecifier as TcpCluster,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, CommonTlsContext, DownstreamTlsContext, SubjectAltNameMatcher,
    common_tls_context::{CombinedCertificateValidationContext, ValidationContextType},
    subject_alt_name_matcher::SanType,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    StringMatcher, filter_state_matcher, string_matcher::MatchPattern,
};

use super::telemetry::{self, Caller};
use super::{
    INBOUND_PASSTHROUGH_CLUSTER, INBOUND_PORT, INBOUND_SOURCE, InboundPort, PeerMode, PodPlan,
    VIRTUAL_INBOUND,
};
use crate::model::snapshot::XdsResource;
use crate::model::waypoint::authz::{
    HTTP_RBAC_FILTERS, PEER_PRINCIPAL, ServiceRbac, http_base_filter, network_filters,
    per_route_configs,
};
use crate::model::waypoint::clusters::{CONNECT_TIMEOUT, main_internal as main_internal_cluster};
use crate::model::waypoint::envoy::{
    SECRET_CERTIFICATE, SECRET_ROOTS, any, bool_value, duration, sds, stable_map, u32_value,
};
use crate::model::waypoint::listeners::{
    MAIN_INTERNAL, connect_terminate, host_range, http_filter, named_filter, socket_address,
};
use crate::model::waypoint::{CLUSTER_TYPE, LISTENER_TYPE};

/// The pod's inbound clusters.
pub fn clusters() -> Vec<XdsResource> {
    [inbound_passthrough(), main_internal_cluster()]
        .into_iter()
        .map(|c| XdsResource::new(CLUSTER_TYPE, c.name.clone(), Vec::new(), &c))
        .collect()
}

/// To the app at the original destination, from 127.0.0.6 (so the app's
/// own outbound capture can tell these connections apart).
fn inbound_passthrough() -> Cluster {
    Cluster {
        name: INBOUND_PASSTHROUGH_CLUSTER.to_string(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(
            DiscoveryType::OriginalDst as i32,
        )),
        lb_policy: LbPolicy::ClusterProvided as i32,
        connect_timeout: Some(duration(CONNECT_TIMEOUT)),
        upstream_bind_config: Some(BindConfig {
            source_address: Some(SocketAddress {
                address: INBOUND_SOURCE.to_string(),
                port_specifier: Some(PortSpecifier::PortValue(0)),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `virtualInbound`, HBONE termination and its internal listener.
pub fn listeners(plan: &PodPlan, trust_domain: &str) -> Vec<XdsResource> {
    [
        virtual_inbound(plan, trust_domain),
        connect_terminate(trust_domain),
        hbone_inbound(plan),
    ]
    .into_iter()
    .map(|l| XdsResource::new(LISTENER_TYPE, l.name.clone(), Vec::new(), &l))
    .collect()
}

fn listener_filter<M: prost::Message + prost::Name>(name: &str, config: &M) -> ListenerFilter {
    ListenerFilter {
        name: name.to_string(),
        config_type: Some(listener_filter::ConfigType::TypedConfig(any(config))),
        ..Default::default()
    }
}

/// 0.0.0.0:15006: per declared port the chains its mode asks for, then
/// the same for every other port.
fn virtual_inbound(plan: &PodPlan, trust_domain: &str) -> Listener {
    let mut chains: Vec<FilterChain> = plan
        .ports
        .iter()
        .flat_map(|p| mode_chains(p, Some(p.port), trust_domain))
        .collect();
    chains.extend(mode_chains(&plan.other_ports, None, trust_domain));
    Listener {
        name: VIRTUAL_INBOUND.to_string(),
        address: Some(socket_address(IpAddr::from([0, 0, 0, 0]), INBOUND_PORT)),
        listener_filters: vec![
            listener_filter(
                "envoy.filters.listener.original_dst",
                &OriginalDst::default(),
            ),
            listener_filter(
                "envoy.filters.listener.tls_inspector",
                &TlsInspector::default(),
            ),
        ],
        filter_chains: chains,
        ..Default::default()
    }
}

/// STRICT: one chain whose TLS handshake a plaintext client fails;
/// PERMISSIVE: a TLS chain and a plaintext one (the TLS inspector
/// decides); DISABLE: plaintext only.
fn mode_chains(p: &InboundPort, port: Option<u16>, trust_domain: &str) -> Vec<FilterChain> {
    let chain = |transport: Option<&str>, tls: bool| {
        let label = if tls { "tls" } else { "plaintext" };
        FilterChain {
            name: format!("inbound|{}||{label}", p.port),
            filter_chain_match: Some(FilterChainMatch {
                destination_port: port.map(|n| u32_value(n.into())),
                transport_protocol: transport.unwrap_or_default().to_string(),
                ..Default::default()
            }),
            filters: app_filters(p, if tls { Caller::Tls } else { Caller::Plaintext }),
            transport_socket: tls.then(|| server_tls(trust_domain)),
            ..Default::default()
        }
    };
    match p.mode {
        PeerMode::Strict => vec![chain(None, true)],
        PeerMode::Permissive => vec![chain(Some("tls"), true), chain(Some("raw_buffer"), false)],
        PeerMode::Disable => vec![chain(None, false)],
    }
}

/// Our certificate; the client's must chain to the mesh roots and carry a
/// SPIFFE ID of the trust domain.
fn server_tls(trust_domain: &str) -> TransportSocket {
    let ctx = DownstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_certificate_sds_secret_configs: vec![sds(SECRET_CERTIFICATE)],
            validation_context_type: Some(ValidationContextType::CombinedValidationContext(
                CombinedCertificateValidationContext {
                    default_validation_context: Some(CertificateValidationContext {
                        match_typed_subject_alt_names: vec![SubjectAltNameMatcher {
                            san_type: SanType::Uri as i32,
                            matcher: Some(StringMatcher {
                                match_pattern: Some(MatchPattern::Prefix(format!(
                                    "spiffe://{trust_domain}/"
                                ))),
                                ..Default::default()
                            }),
                            ..Default::default()
                        }],
                        ..Default::default()
                    }),
                    validation_context_sds_secret_config: Some(sds(SECRET_ROOTS)),
                    ..Default::default()
                },
            )),
            ..Default::default()
        }),
        require_client_certificate: Some(bool_value(true)),
        ..Default::default()
    };
    TransportSocket {
        name: "envoy.transport_sockets.tls".to_string(),
        config_type: Some(SocketConfig::TypedConfig(any(&ctx))),
    }
}

/// The pod's policy, then the app. On a TLS chain the caller is the
/// certificate's identity (the waypoint's builder reads it from the
/// filter state HBONE termination sets; here it comes from the TLS
/// connection itself).
fn app_filters(p: &InboundPort, caller: Caller) -> Vec<Filter> {
    let mut rbac = p.rbac.clone();
    if caller == Caller::Tls {
        for rules in [&mut rbac.allow, &mut rbac.deny, &mut rbac.audit]
            .into_iter()
            .flatten()
        {
            peer_from_tls(rules);
        }
    }
    if p.protocol.is_http() {
        vec![inbound_hcm(p, &rbac, caller)]
    } else {
        let stat = format!("inbound|{}||", p.port);
        let mut filters: Vec<Filter> = network_filters(&rbac, &stat)
            .iter()
            .map(|(name, config)| named_filter(name, config))
            .collect();
        let tcp = TcpProxy {
            stat_prefix: INBOUND_PASSTHROUGH_CLUSTER.to_string(),
            cluster_specifier: Some(TcpCluster::Cluster(INBOUND_PASSTHROUGH_CLUSTER.to_string())),
            ..Default::default()
        };
        filters.push(named_filter("envoy.filters.network.tcp_proxy", &tcp));
        filters
    }
}

/// Rewrites the caller-identity matches of `rules` from the HBONE filter
/// state to the TLS peer certificate (URI SAN).
fn peer_from_tls(rules: &mut RbacRules) {
    let mut names: Vec<String> = rules.policies.keys().cloned().collect();
    names.sort();
    for name in names {
        if let Some(policy) = rules.policies.get_mut(&name) {
            policy.principals.iter_mut().for_each(tls_principal);
        }
    }
}

fn tls_principal(p: &mut Principal) {
    use principal::Identifier as Id;
    match &mut p.identifier {
        Some(Id::AndIds(set)) | Some(Id::OrIds(set)) => set.ids.iter_mut().for_each(tls_principal),
        Some(Id::NotId(inner)) => tls_principal(inner),
        Some(Id::FilterState(fs)) if fs.key == PEER_PRINCIPAL => {
            let matcher = match fs.matcher.take() {
                Some(filter_state_matcher::Matcher::StringMatch(m)) => Some(m),
                _ => None,
            };
            p.identifier = Some(Id::Authenticated(principal::Authenticated {
                principal_name: matcher,
            }));
        }
        _ => {}
    }
}

/// An HTTP port: the RBAC filters (rules per virtual host), then the app;
/// every request counted with `reporter="destination"`.
fn inbound_hcm(p: &InboundPort, rbac: &ServiceRbac, caller: Caller) -> Filter {
    let port = p.port;
    let mut http_filters: Vec<_> = HTTP_RBAC_FILTERS
        .iter()
        .map(|(name, _)| http_filter(name, &http_base_filter()))
        .collect();
    http_filters.push(http_filter("envoy.filters.http.router", &Router::default()));
    let name = format!("inbound|{port}||");
    let route = RouteConfiguration {
        name: name.clone(),
        virtual_hosts: vec![VirtualHost {
            name: format!("inbound|http|{port}"),
            domains: vec!["*".to_string()],
            routes: vec![Route {
                name: "default".to_string(),
                r#match: Some(RouteMatch {
                    path_specifier: Some(PathSpecifier::Prefix("/".to_string())),
                    ..Default::default()
                }),
                action: Some(Action::Route(RouteAction {
                    cluster_specifier: Some(ClusterSpecifier::Cluster(
                        INBOUND_PASSTHROUGH_CLUSTER.to_string(),
                    )),
                    timeout: Some(duration(std::time::Duration::ZERO)),
                    ..Default::default()
                })),
                ..Default::default()
            }],
            typed_per_filter_config: stable_map(per_route_configs(rbac)),
            ..Default::default()
        }],
        ..Default::default()
    };
    let hcm = HttpConnectionManager {
        stat_prefix: name,
        codec_type: CodecType::Auto as i32,
        route_specifier: Some(RouteSpecifier::RouteConfig(route)),
        http_filters,
        access_log: telemetry::inbound_logs(p, caller),
        ..Default::default()
    };
    named_filter("envoy.filters.network.http_connection_manager", &hcm)
}

/// The internal listener HBONE termination hands tunnels to: only the
/// pod's own addresses (never an open proxy), per declared port then any
/// other, plaintext (the tunnel was mTLS), the caller's identity in the
/// filter state.
fn hbone_inbound(plan: &PodPlan) -> Listener {
    let ranges: Vec<_> = plan.ips.iter().map(|ip| host_range(*ip)).collect();
    let chain = |p: &InboundPort, port: Option<u16>| FilterChain {
        name: format!("inbound|{}||hbone", p.port),
        filter_chain_match: Some(FilterChainMatch {
            destination_port: port.map(|n| u32_value(n.into())),
            prefix_ranges: ranges.clone(),
            ..Default::default()
        }),
        filters: app_filters(p, Caller::Hbone),
        ..Default::default()
    };
    let mut chains: Vec<FilterChain> = plan.ports.iter().map(|p| chain(p, Some(p.port))).collect();
    chains.push(chain(&plan.other_ports, None));
    Listener {
        name: MAIN_INTERNAL.to_string(),
        listener_specifier: Some(ListenerSpecifier::InternalListener(
            InternalListenerConfig {},
        )),
        listener_filters: vec![listener_filter(
            "envoy.filters.listener.original_dst",
            &OriginalDst::default(),
        )],
        filter_chains: chains,
        ..Default::default()
    }
}
