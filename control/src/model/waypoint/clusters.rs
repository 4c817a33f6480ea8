//! A waypoint's clusters and endpoints: the internal hop to
//! `main_internal`, one HBONE-originating cluster per peer identity, and one
//! EDS cluster per service port whose endpoints are internal addresses
//! carrying the real destination as metadata.

use std::collections::HashMap;
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::{
    Cluster,
    cluster::{
        ClusterDiscoveryType, DiscoveryType, EdsClusterConfig, LbConfig, LbPolicy,
        OriginalDstLbConfig,
    },
};
use envoy_types::pb::envoy::config::core::v3::{
    Address, EnvoyInternalAddress, HealthStatus, Http2ProtocolOptions,
    HttpProtocolOptions as CommonHttpOptions, Metadata, SocketAddress, TransportSocket, address,
    envoy_internal_address::AddressNameSpecifier, socket_address::PortSpecifier,
    transport_socket::ConfigType,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint::HostIdentifier,
};
use envoy_types::pb::envoy::extensions::transport_sockets::internal_upstream::v3::{
    InternalUpstreamTransport, internal_upstream_transport::MetadataValueSource,
};
use envoy_types::pb::envoy::extensions::transport_sockets::raw_buffer::v3::RawBuffer;
use envoy_types::pb::envoy::extensions::upstreams::http::v3::{
    HttpProtocolOptions,
    http_protocol_options::{
        ExplicitHttpConfig, UpstreamProtocolOptions, UseDownstreamHttpConfig,
        explicit_http_config::ProtocolConfig,
    },
};
use envoy_types::pb::envoy::r#type::metadata::v3::{
    MetadataKey, MetadataKind,
    metadata_key::{PathSegment, path_segment::Segment},
    metadata_kind,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind as ValueKind};

use super::envoy::{any, duration, hbone_client_tls, stable_map, u32_value};
use super::listeners::{MAIN_INTERNAL, originate_name};
use super::tracing::TracingPlan;
use super::{
    BoundEndpoint, BoundService, CLUSTER_TYPE, ENDPOINT_TYPE, HBONE_PORT, WaypointPlan,
    cluster_name, policy, telemetry,
};
use crate::model::snapshot::XdsResource;

/// Metadata namespace carrying where a tunnel goes.
pub(crate) const TUNNEL: &str = "tunnel";
/// ... its keys: the CONNECT authority (the endpoint's real `ip:port`) and
/// the peer dialled on its HBONE port (the endpoint itself, or the
/// waypoint in front of a service).
const DESTINATION: &str = "destination";
const ADDRESS: &str = "address";
/// Connect timeout of the HBONE hop to an endpoint's ztunnel.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Typed protocol options key of upstream HTTP options.
const HTTP_OPTIONS: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

/// Every cluster of the waypoint.
pub fn clusters(plan: &WaypointPlan) -> Vec<XdsResource> {
    let mut out = vec![main_internal()];
    out.extend(plan.peer_identities().into_iter().map(originate));
    for svc in &plan.services {
        for port in &svc.ports {
            for v in policy::variants(svc.destination_rule.as_ref(), port.port) {
                out.push(service_cluster(
                    cluster_name(port.port, &v.subset, &svc.hostname),
                    port.protocol.is_http(),
                    &v.policy,
                    internal_upstream(&[TUNNEL]),
                ));
            }
        }
    }
    out.extend(plan.tracing.as_ref().map(collector));
    out.into_iter()
        .map(|c| XdsResource::new(CLUSTER_TYPE, c.name.clone(), Vec::new(), &c))
        .collect()
}

/// The span collector's cluster: HTTP/2 (OTLP/gRPC), its mesh endpoints
/// through their ztunnel, else its plaintext ones.
fn collector(t: &TracingPlan) -> Cluster {
    let name = t.cluster();
    let (lb_endpoints, transport) = if t.mesh_endpoints.is_empty() {
        let plain = t
            .plain_endpoints
            .iter()
            .map(|a| LbEndpoint {
                host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
                    address: Some(socket_address(*a)),
                    ..Default::default()
                })),
                ..Default::default()
            })
            .collect();
        (plain, raw_buffer())
    } else {
        let tunnelled = t
            .mesh_endpoints
            .iter()
            .filter_map(|e| Some(tunnel_endpoint(e, e.target_port(t.port)?)))
            .collect();
        (tunnelled, internal_upstream(&[TUNNEL]))
    };
    Cluster {
        name: name.clone(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32)),
        connect_timeout: Some(duration(CONNECT_TIMEOUT)),
        load_assignment: Some(ClusterLoadAssignment {
            cluster_name: name,
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints,
                ..Default::default()
            }],
            ..Default::default()
        }),
        transport_socket: Some(transport),
        typed_extension_protocol_options: HashMap::from([(
            HTTP_OPTIONS.to_string(),
            any(&http2_options()),
        )]),
        ..Default::default()
    }
}

pub(crate) fn socket_address(a: std::net::SocketAddr) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: a.ip().to_string(),
            port_specifier: Some(PortSpecifier::PortValue(a.port().into())),
            ..Default::default()
        })),
    }
}

pub(crate) fn http2_options() -> HttpProtocolOptions {
    HttpProtocolOptions {
        upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
            ExplicitHttpConfig {
                protocol_config: Some(ProtocolConfig::Http2ProtocolOptions(
                    Http2ProtocolOptions::default(),
                )),
            },
        )),
        ..Default::default()
    }
}

/// Every service cluster's endpoints.
pub fn endpoints(plan: &WaypointPlan) -> Vec<XdsResource> {
    let mut out = Vec::new();
    for svc in &plan.services {
        for port in &svc.ports {
            for v in policy::variants(svc.destination_rule.as_ref(), port.port) {
                let name = cluster_name(port.port, &v.subset, &svc.hostname);
                let lb_endpoints = variant_endpoints(svc, port.port, &v)
                    .map(|(e, target)| tunnel_endpoint(e, target))
                    .collect();
                out.push(load_assignment(name, lb_endpoints));
            }
        }
    }
    out
}

/// The endpoints of `svc` in cluster variant `v` (its subset's labels) on
/// service port `port`, with their target port.
pub(crate) fn variant_endpoints<'a>(
    svc: &'a BoundService,
    port: u16,
    v: &'a policy::ClusterVariant,
) -> impl Iterator<Item = (&'a BoundEndpoint, u16)> + 'a {
    svc.endpoints
        .iter()
        .filter(|e| {
            v.selector
                .iter()
                .all(|(k, val)| e.labels.get(k) == Some(val))
        })
        .filter_map(move |e| Some((e, e.target_port(port)?)))
}

/// The EDS resource of cluster `name`: one locality holding `lb_endpoints`.
pub(crate) fn load_assignment(name: String, lb_endpoints: Vec<LbEndpoint>) -> XdsResource {
    let cla = ClusterLoadAssignment {
        cluster_name: name.clone(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints,
            ..Default::default()
        }],
        ..Default::default()
    };
    XdsResource::new(ENDPOINT_TYPE, name, Vec::new(), &cla)
}

fn internal_address(listener: String, endpoint_id: String) -> Address {
    Address {
        address: Some(address::Address::EnvoyInternalAddress(
            EnvoyInternalAddress {
                address_name_specifier: Some(AddressNameSpecifier::ServerListenerName(listener)),
                endpoint_id,
            },
        )),
    }
}

/// An endpoint reached through the CONNECT-originating internal listener
/// of its identity, with its real `ip:port` as `tunnel` metadata and who it
/// is as [`telemetry::ENDPOINT_METADATA`] (read by the request metrics).
pub(crate) fn tunnel_endpoint(e: &BoundEndpoint, port: u16) -> LbEndpoint {
    let destination = std::net::SocketAddr::new(e.ip, port);
    tunnel_via(e, destination, destination)
}

/// An endpoint reached through `peer`'s CONNECT-originating listener: the
/// tunnel is dialled to `peer`'s address (on its HBONE port) and asks for
/// `authority`. A sidecar sends a waypoint-bound service's traffic to the
/// waypoint this way, asking for the service's `VIP:port`.
pub(crate) fn tunnel_via(
    peer: &BoundEndpoint,
    dial: std::net::SocketAddr,
    authority: std::net::SocketAddr,
) -> LbEndpoint {
    let text = |v: &str| Value {
        kind: Some(ValueKind::StringValue(v.to_string())),
    };
    let tunnel = Struct {
        fields: stable_map([
            (DESTINATION.to_string(), text(&authority.to_string())),
            (ADDRESS.to_string(), text(&dial.to_string())),
        ]),
    };
    let w = &peer.workload;
    let who = Struct {
        fields: stable_map(
            [
                ("workload", w.name.as_str()),
                ("namespace", w.namespace.as_str()),
                ("app", w.app.as_str()),
                ("version", w.version.as_str()),
                ("principal", peer.identity.as_str()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), text(v))),
        ),
    };
    LbEndpoint {
        host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
            // Unique per peer and authority: several waypoint pods behind
            // one service VIP are several hosts.
            address: Some(internal_address(
                originate_name(&peer.identity),
                if dial == authority {
                    authority.to_string()
                } else {
                    format!("{authority}@{dial}")
                },
            )),
            ..Default::default()
        })),
        metadata: Some(Metadata {
            filter_metadata: stable_map([
                (TUNNEL.to_string(), tunnel),
                (telemetry::ENDPOINT_METADATA.to_string(), who),
            ]),
            ..Default::default()
        }),
        health_status: if peer.healthy {
            HealthStatus::Healthy
        } else {
            HealthStatus::Unhealthy
        } as i32,
        ..Default::default()
    }
}

pub(crate) fn raw_buffer() -> TransportSocket {
    TransportSocket {
        name: "envoy.transport_sockets.raw_buffer".to_string(),
        config_type: Some(ConfigType::TypedConfig(any(&RawBuffer::default()))),
    }
}

/// Hands a connection to an internal listener, passing `passthrough` host
/// metadata namespaces along (and every shared filter state).
pub(crate) fn internal_upstream(passthrough: &[&str]) -> TransportSocket {
    let cfg = InternalUpstreamTransport {
        passthrough_metadata: passthrough
            .iter()
            .map(|name| MetadataValueSource {
                kind: Some(MetadataKind {
                    kind: Some(metadata_kind::Kind::Host(metadata_kind::Host {})),
                }),
                name: name.to_string(),
            })
            .collect(),
        transport_socket: Some(raw_buffer()),
    };
    TransportSocket {
        name: "envoy.transport_sockets.internal_upstream".to_string(),
        config_type: Some(ConfigType::TypedConfig(any(&cfg))),
    }
}

/// The hop from HBONE termination to `main_internal`.
pub(crate) fn main_internal() -> Cluster {
    Cluster {
        name: MAIN_INTERNAL.to_string(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Static as i32)),
        connect_timeout: Some(duration(CONNECT_TIMEOUT)),
        load_assignment: Some(ClusterLoadAssignment {
            cluster_name: MAIN_INTERNAL.to_string(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: vec![LbEndpoint {
                    host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
                        address: Some(internal_address(MAIN_INTERNAL.to_string(), String::new())),
                        ..Default::default()
                    })),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }),
        transport_socket: Some(internal_upstream(&[])),
        ..Default::default()
    }
}

/// HBONE to peers of one identity: the destination comes from the tunnel
/// metadata, the port is 15008, and the peer certificate must carry exactly
/// `identity`.
pub(crate) fn originate(identity: &str) -> Cluster {
    let http2 = http2_options();
    Cluster {
        name: originate_name(identity),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(
            DiscoveryType::OriginalDst as i32,
        )),
        lb_policy: LbPolicy::ClusterProvided as i32,
        lb_config: Some(LbConfig::OriginalDstLbConfig(OriginalDstLbConfig {
            metadata_key: Some(MetadataKey {
                key: TUNNEL.to_string(),
                path: vec![PathSegment {
                    segment: Some(Segment::Key(ADDRESS.to_string())),
                }],
            }),
            upstream_port_override: Some(u32_value(HBONE_PORT.into())),
            ..Default::default()
        })),
        connect_timeout: Some(duration(CONNECT_TIMEOUT)),
        transport_socket: Some(hbone_client_tls(identity)),
        typed_extension_protocol_options: HashMap::from([(HTTP_OPTIONS.to_string(), any(&http2))]),
        ..Default::default()
    }
}

/// A service port's cluster: endpoints from EDS, reached over `transport`
/// (a waypoint's: an internal address of the endpoint identity's
/// CONNECT-originating listener). HTTP ports speak to the endpoint in the
/// client's protocol.
pub(crate) fn service_cluster(
    name: String,
    http: bool,
    policy: &policy::EffectivePolicy,
    transport: TransportSocket,
) -> Cluster {
    let mut cluster = Cluster {
        name: name.clone(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(EdsClusterConfig {
            eds_config: Some(super::envoy::ads()),
            service_name: name,
        }),
        connect_timeout: Some(duration(CONNECT_TIMEOUT)),
        transport_socket: Some(transport),
        ..Default::default()
    };
    let mut common = CommonHttpOptions::default();
    policy::apply(&mut cluster, http.then_some(&mut common), policy);
    if http {
        let downstream = HttpProtocolOptions {
            common_http_protocol_options: Some(common)
                .filter(|c| *c != CommonHttpOptions::default()),
            upstream_protocol_options: Some(UpstreamProtocolOptions::UseDownstreamProtocolConfig(
                UseDownstreamHttpConfig::default(),
            )),
            ..Default::default()
        };
        cluster
            .typed_extension_protocol_options
            .insert(HTTP_OPTIONS.to_string(), any(&downstream));
    }
    cluster
}
