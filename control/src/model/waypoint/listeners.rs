//! A waypoint's listeners: HBONE termination on 15008, the internal
//! listener that dispatches by original destination to one filter chain per
//! service port, and one internal CONNECT-originating listener per peer
//! identity.

use std::net::IpAddr;

use envoy_types::pb::envoy::config::core::v3::{
    Address, CidrRange, SocketAddress, SubstitutionFormatString, address,
    data_source::Specifier as DataSpecifier, socket_address::PortSpecifier,
    substitution_format_string::Format,
};
use envoy_types::pb::envoy::config::core::v3::{DataSource, Http2ProtocolOptions};
use envoy_types::pb::envoy::config::listener::v3::{
    Filter, FilterChain, FilterChainMatch, Listener, ListenerFilter,
    filter::ConfigType,
    listener::{InternalListenerConfig, ListenerSpecifier},
    listener_filter,
};
use envoy_types::pb::envoy::config::route::v3::{
    Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost,
    route::Action,
    route_action::{ClusterSpecifier, UpgradeConfig, upgrade_config::ConnectConfig},
    route_match::{ConnectMatcher, PathSpecifier},
};
use envoy_types::pb::envoy::extensions::filters::common::set_filter_state::v3::{
    FilterStateValue, filter_state_value,
};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::http::set_filter_state::v3::Config as SetFilterState;
use envoy_types::pb::envoy::extensions::filters::listener::original_dst::v3::OriginalDst;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, HttpFilter, Rds,
    http_connection_manager::{CodecType, RouteSpecifier},
    http_filter,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    TcpProxy,
    tcp_proxy::{ClusterSpecifier as TcpCluster, TunnelingConfig},
};

use super::authz::{HTTP_RBAC_FILTERS, PEER_PRINCIPAL, http_base_filter, network_filters};
use super::envoy::{ads, any, hbone_server_tls, u32_value};
use super::routes::{FAULT_FILTER, route_name};
use super::telemetry::{self, PEER_BAGGAGE};
use super::{
    BoundPort, BoundService, BoundWorkload, HBONE_PORT, LISTENER_TYPE, WaypointPlan, cluster_name,
};
use crate::model::snapshot::XdsResource;
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::HttpFault;

/// The HBONE-terminating listener.
pub const CONNECT_TERMINATE: &str = "connect_terminate";
/// The internal listener (and its cluster) traffic is dispatched on.
pub const MAIN_INTERNAL: &str = "main_internal";
/// Prefix of the per-identity CONNECT-originating listeners and clusters.
pub const CONNECT_ORIGINATE: &str = "connect_originate";
/// Filter-state key the original-destination listener filter reads on an
/// internal listener (upstream Envoy's well-known key).
const ORIGINAL_DST_LOCAL: &str = "envoy.filters.listener.original_dst.local_ip";
/// ... and the original source.
const ORIGINAL_DST_REMOTE: &str = "envoy.filters.listener.original_dst.remote_ip";
/// Envoy's generic string filter-state object.
pub(crate) const STRING_OBJECT: &str = "envoy.string";

/// The internal listener (and cluster) that tunnels to peers of `identity`.
pub fn originate_name(identity: &str) -> String {
    format!("{CONNECT_ORIGINATE};{identity}")
}

/// Every listener of the waypoint, sorted by name.
pub fn listeners(plan: &WaypointPlan, trust_domain: &str) -> Vec<XdsResource> {
    let mut out = vec![connect_terminate(trust_domain), main_internal(plan)];
    out.extend(plan.peer_identities().into_iter().map(connect_originate));
    out.into_iter()
        .map(|l| XdsResource::new(LISTENER_TYPE, l.name.clone(), Vec::new(), &l))
        .collect()
}

pub(crate) fn named_filter<M: prost::Message + prost::Name>(name: &str, config: &M) -> Filter {
    Filter {
        name: name.to_string(),
        config_type: Some(ConfigType::TypedConfig(any(config))),
    }
}

pub(crate) fn http_filter<M: prost::Message + prost::Name>(name: &str, config: &M) -> HttpFilter {
    HttpFilter {
        name: name.to_string(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(config))),
        ..Default::default()
    }
}

fn format_string(text: &str) -> SubstitutionFormatString {
    SubstitutionFormatString {
        format: Some(Format::TextFormatSource(DataSource {
            specifier: Some(DataSpecifier::InlineString(text.to_string())),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Shares a filter-state value, computed per request, with the upstream
/// (internal) connection. `factory` names the object type (empty: the key
/// is a well-known one naming its own type).
pub(crate) fn shared_state(key: &str, factory: &str, format: &str) -> FilterStateValue {
    FilterStateValue {
        key: Some(filter_state_value::Key::ObjectKey(key.to_string())),
        factory_key: factory.to_string(),
        skip_if_empty: !factory.is_empty(),
        value: Some(filter_state_value::Value::FormatString(format_string(
            format,
        ))),
        shared_with_upstream: filter_state_value::SharedWithUpstream::Once as i32,
        ..Default::default()
    }
}

/// 0.0.0.0:15008: mTLS from any mesh identity, HTTP/2 CONNECT only; the
/// tunnel's payload goes to `main_internal` with the CONNECT authority as
/// its original destination.
pub(crate) fn connect_terminate(trust_domain: &str) -> Listener {
    let route = RouteConfiguration {
        name: CONNECT_TERMINATE.to_string(),
        virtual_hosts: vec![VirtualHost {
            name: "connect".to_string(),
            domains: vec!["*".to_string()],
            routes: vec![Route {
                r#match: Some(RouteMatch {
                    path_specifier: Some(PathSpecifier::ConnectMatcher(ConnectMatcher {})),
                    ..Default::default()
                }),
                action: Some(Action::Route(RouteAction {
                    cluster_specifier: Some(ClusterSpecifier::Cluster(MAIN_INTERNAL.to_string())),
                    upgrade_configs: vec![UpgradeConfig {
                        upgrade_type: "CONNECT".to_string(),
                        connect_config: Some(ConnectConfig::default()),
                        ..Default::default()
                    }],
                    ..Default::default()
                })),
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    let set_state = SetFilterState {
        on_request_headers: vec![
            shared_state(ORIGINAL_DST_LOCAL, "", "%REQ(:AUTHORITY)%"),
            shared_state(ORIGINAL_DST_REMOTE, "", "%DOWNSTREAM_REMOTE_ADDRESS%"),
            // Who is calling, for RBAC, metrics and logs on the service's
            // chain: the SPIFFE ID of the HBONE client certificate and the
            // baggage its ztunnel sent.
            shared_state(PEER_PRINCIPAL, STRING_OBJECT, "%DOWNSTREAM_PEER_URI_SAN%"),
            shared_state(PEER_BAGGAGE, STRING_OBJECT, "%REQ(baggage)%"),
        ],
        ..Default::default()
    };
    let hcm = HttpConnectionManager {
        stat_prefix: CONNECT_TERMINATE.to_string(),
        codec_type: CodecType::Http2 as i32,
        route_specifier: Some(RouteSpecifier::RouteConfig(route)),
        http_filters: vec![
            http_filter("envoy.filters.http.set_filter_state", &set_state),
            http_filter("envoy.filters.http.router", &Router::default()),
        ],
        http2_protocol_options: Some(Http2ProtocolOptions {
            allow_connect: true,
            // As Istio's ztunnel: at most 100 tunnels per connection.
            max_concurrent_streams: Some(u32_value(100)),
            ..Default::default()
        }),
        upgrade_configs: vec![
            envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::UpgradeConfig {
                upgrade_type: "CONNECT".to_string(),
                ..Default::default()
            },
        ],
        ..Default::default()
    };
    Listener {
        name: CONNECT_TERMINATE.to_string(),
        address: Some(socket_address(IpAddr::from([0, 0, 0, 0]), HBONE_PORT)),
        filter_chains: vec![FilterChain {
            name: CONNECT_TERMINATE.to_string(),
            filters: vec![named_filter(
                "envoy.filters.network.http_connection_manager",
                &hcm,
            )],
            transport_socket: Some(hbone_server_tls(trust_domain)),
            ..Default::default()
        }],
        ..Default::default()
    }
}

pub(crate) fn socket_address(ip: IpAddr, port: u16) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: ip.to_string(),
            port_specifier: Some(PortSpecifier::PortValue(port.into())),
            ..Default::default()
        })),
    }
}

pub(crate) fn host_range(ip: IpAddr) -> CidrRange {
    CidrRange {
        address_prefix: ip.to_string(),
        prefix_len: Some(u32_value(if ip.is_ipv4() { 32 } else { 128 })),
    }
}

/// The internal listener: the original destination (VIP:port from the
/// CONNECT authority) picks one filter chain per service port.
fn main_internal(plan: &WaypointPlan) -> Listener {
    let mut chains = Vec::new();
    for svc in plan.services.iter().filter(|s| s.bound) {
        if svc.vips.is_empty() {
            continue;
        }
        for port in &svc.ports {
            let filters = if port.protocol.is_http() {
                vec![service_hcm(plan, svc, port)]
            } else {
                service_tcp(svc, port.port)
            };
            chains.push(FilterChain {
                name: format!("{}:{}", svc.hostname, port.port),
                filter_chain_match: Some(FilterChainMatch {
                    destination_port: Some(u32_value(port.port.into())),
                    prefix_ranges: svc.vips.iter().map(|ip| host_range(*ip)).collect(),
                    ..Default::default()
                }),
                filters,
                ..Default::default()
            });
        }
    }
    chains.extend(plan.workloads.iter().map(workload_chain));
    Listener {
        name: MAIN_INTERNAL.to_string(),
        listener_specifier: Some(ListenerSpecifier::InternalListener(
            InternalListenerConfig {},
        )),
        listener_filters: vec![ListenerFilter {
            name: "envoy.filters.listener.original_dst".to_string(),
            config_type: Some(listener_filter::ConfigType::TypedConfig(any(
                &OriginalDst::default(),
            ))),
            ..Default::default()
        }],
        filter_chains: chains,
        ..Default::default()
    }
}

/// An HTTP service port: authorization (the RBAC filters get their rules
/// per virtual host over RDS), faults (configured per route), routing, and
/// per-request telemetry.
fn service_hcm(plan: &WaypointPlan, svc: &BoundService, port: &BoundPort) -> Filter {
    let mut http_filters: Vec<HttpFilter> = HTTP_RBAC_FILTERS
        .iter()
        .map(|(name, _)| http_filter(name, &http_base_filter()))
        .collect();
    http_filters.push(http_filter(FAULT_FILTER, &HttpFault::default()));
    http_filters.push(http_filter("envoy.filters.http.router", &Router::default()));
    let hcm = HttpConnectionManager {
        stat_prefix: format!("{}_{}", svc.hostname, port.port),
        codec_type: CodecType::Auto as i32,
        route_specifier: Some(RouteSpecifier::Rds(Rds {
            config_source: Some(ads()),
            route_config_name: route_name(&svc.hostname, port.port),
        })),
        http_filters,
        access_log: if plan.telemetry {
            telemetry::access_logs(svc, port)
        } else {
            Vec::new()
        },
        tracing: plan
            .tracing
            .as_ref()
            .map(|t| super::tracing::hcm_tracing(plan, t)),
        ..Default::default()
    };
    named_filter("envoy.filters.network.http_connection_manager", &hcm)
}

/// A TCP service port: authorization (network RBAC), then the service.
fn service_tcp(svc: &BoundService, port: u16) -> Vec<Filter> {
    let cluster = cluster_name(port, "", &svc.hostname);
    let mut filters: Vec<Filter> = svc
        .rbac
        .get(&port)
        .map(|rbac| network_filters(rbac, &cluster))
        .unwrap_or_default()
        .iter()
        .map(|(name, config)| named_filter(name, config))
        .collect();
    let tcp = TcpProxy {
        stat_prefix: cluster.clone(),
        cluster_specifier: Some(TcpCluster::Cluster(cluster)),
        ..Default::default()
    };
    filters.push(named_filter("envoy.filters.network.tcp_proxy", &tcp));
    filters
}

/// Traffic addressed to a bound workload's IPs, on any port: tunnelled at
/// L4 to that same address through the workload's ztunnel (CONNECT
/// authority = the original destination; the ORIGINAL_DST cluster dials
/// its IP on 15008, there being no tunnel metadata to read).
fn workload_chain(w: &BoundWorkload) -> FilterChain {
    let tcp = TcpProxy {
        stat_prefix: workload_stat_prefix(&w.namespace, &w.name),
        cluster_specifier: Some(TcpCluster::Cluster(originate_name(&w.identity))),
        tunneling_config: Some(TunnelingConfig {
            hostname: "%DOWNSTREAM_LOCAL_ADDRESS%".to_string(),
            ..Default::default()
        }),
        ..Default::default()
    };
    FilterChain {
        name: format!("workload:{}/{}", w.namespace, w.name),
        filter_chain_match: Some(FilterChainMatch {
            prefix_ranges: w.ips.iter().map(|ip| host_range(*ip)).collect(),
            ..Default::default()
        }),
        filters: vec![named_filter("envoy.filters.network.tcp_proxy", &tcp)],
        ..Default::default()
    }
}

/// The `tcp_proxy` stat prefix of a bound workload's chain
/// (`tcp.<prefix>.downstream_cx_total` counts its connections).
pub fn workload_stat_prefix(namespace: &str, name: &str) -> String {
    format!("workload_{namespace}_{name}")
}

/// An internal listener that opens an HBONE tunnel (HTTP/2 CONNECT to the
/// endpoint named in the connection's `tunnel.destination` metadata) through
/// the cluster that requires the peer to be `identity`.
pub(crate) fn connect_originate(identity: &str) -> Listener {
    let name = originate_name(identity);
    let tcp = TcpProxy {
        stat_prefix: CONNECT_ORIGINATE.to_string(),
        cluster_specifier: Some(TcpCluster::Cluster(name.clone())),
        tunneling_config: Some(TunnelingConfig {
            hostname: "%DYNAMIC_METADATA(tunnel:destination)%".to_string(),
            ..Default::default()
        }),
        ..Default::default()
    };
    Listener {
        name: name.clone(),
        listener_specifier: Some(ListenerSpecifier::InternalListener(
            InternalListenerConfig {},
        )),
        filter_chains: vec![FilterChain {
            name,
            filters: vec![named_filter("envoy.filters.network.tcp_proxy", &tcp)],
            ..Default::default()
        }],
        ..Default::default()
    }
}
