//! Envoy's bootstrap, rendered as JSON from a small typed tree of our own.
//!
//! `envoy-types` messages are prost structs without a JSON mapping (and the
//! `Any`-typed fields would need a type registry), so the bootstrap is a
//! handful of serde structs whose field names are the proto3 JSON names of
//! Envoy's v3 API (`envoy.config.bootstrap.v3.Bootstrap`); `Any` fields are
//! [`Typed`] (`"@type"` plus the message's fields). The result loads in
//! Envoy 1.40 with no unknown-field warnings (`envoy --mode validate`, see
//! the agent tests).
//!
//! ```text
//! node            id router~IP~POD.NS~NS.svc.cluster.local | sidecar~…, metadata (Istio's keys)
//! admin           127.0.0.1:<admin-port>
//! dynamic         ADS over DELTA_GRPC to xds-grpc; CDS and LDS from ADS
//! static clusters sds-grpc   unix socket of the agent, HTTP/2
//!                 xds-grpc   control plane :15012, HTTP/2, TLS: client cert "default"
//!                            and server validation "ROOTCA" (both SDS), SAN = host
//!                 prometheus_stats  the admin listener, for 15090
//! static listener envoy-prometheus :<envoy-prometheus-port> /stats/prometheus → admin
//! extensions      envoy.bootstrap.internal_listener; overload manager connection limit
//! ```

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;

use serde::Serialize;
use serde_json::Value;

use super::config::{AgentConfig, XdsTarget};
use super::secrets::{DEFAULT_SECRET, ROOT_SECRET};

/// Name of the static cluster reaching the agent's SDS socket.
pub const SDS_CLUSTER: &str = "sds-grpc";
/// Name of the static cluster reaching the control plane.
pub const XDS_CLUSTER: &str = "xds-grpc";
/// Name of the static cluster that points the 15090 listener at the admin.
pub const PROMETHEUS_CLUSTER: &str = "prometheus_stats";
/// Name of the static listener serving Envoy's own Prometheus stats.
pub const PROMETHEUS_LISTENER: &str = "envoy-prometheus";
/// Downstream connections Envoy accepts at most, over all listeners.
pub const MAX_DOWNSTREAM_CONNECTIONS: u64 = 100_000;

/// The ports Envoy listens on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvoyPorts {
    /// Admin, on 127.0.0.1.
    pub admin: u16,
    /// `/stats/prometheus`, on every address.
    pub prometheus: u16,
}

/// An `Any`: `@type` and the message's own fields.
#[derive(Debug, Serialize)]
pub struct Typed<T> {
    #[serde(rename = "@type")]
    type_url: &'static str,
    #[serde(flatten)]
    body: T,
}

fn typed<T>(type_url: &'static str, body: T) -> Typed<T> {
    Typed { type_url, body }
}

#[derive(Debug, Serialize)]
struct Bootstrap {
    node: Node,
    admin: Admin,
    dynamic_resources: DynamicResources,
    static_resources: StaticResources,
    bootstrap_extensions: Vec<Extension<Value>>,
    overload_manager: OverloadManager,
    layered_runtime: LayeredRuntime,
    /// How often histograms are merged for the admin to read (counters are
    /// always current): Istio's request-duration and size histograms on
    /// 15020 lag at most this much.
    stats_flush_interval: &'static str,
    stats_config: Value,
}

/// Istio's buckets for its request and response size histograms (the
/// duration histogram's are Envoy's defaults, which are Istio's too).
fn stats_config() -> Value {
    let sizes = [
        1u64,
        10,
        100,
        1_000,
        10_000,
        100_000,
        1_000_000,
        10_000_000,
        100_000_000,
        1_000_000_000,
    ];
    let bytes = |name: &str| serde_json::json!({"match": {"exact": name}, "buckets": sizes});
    serde_json::json!({
        "histogram_bucket_settings": [bytes("istio.request_bytes"), bytes("istio.response_bytes")]
    })
}

#[derive(Debug, Serialize)]
struct Node {
    id: String,
    cluster: String,
    /// `google.protobuf.Struct`: string values, `LABELS` a nested struct.
    metadata: BTreeMap<&'static str, Value>,
}

#[derive(Debug, Serialize)]
struct Admin {
    address: Address,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "snake_case")]
enum Address {
    SocketAddress(SocketAddress),
    Pipe { path: String },
}

#[derive(Debug, Serialize)]
struct SocketAddress {
    address: String,
    port_value: u16,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    ipv4_compat: bool,
}

fn socket(address: impl Into<String>, port_value: u16) -> Address {
    Address::SocketAddress(SocketAddress {
        address: address.into(),
        port_value,
        ipv4_compat: false,
    })
}

#[derive(Debug, Serialize)]
struct DynamicResources {
    ads_config: ApiConfigSource,
    cds_config: ConfigSource,
    lds_config: ConfigSource,
}

#[derive(Debug, Serialize)]
struct ApiConfigSource {
    api_type: &'static str,
    transport_api_version: &'static str,
    set_node_on_first_message_only: bool,
    grpc_services: Vec<GrpcService>,
}

#[derive(Debug, Serialize)]
struct GrpcService {
    envoy_grpc: EnvoyGrpc,
}

#[derive(Debug, Serialize)]
struct EnvoyGrpc {
    cluster_name: &'static str,
}

fn grpc_source(api_type: &'static str, cluster_name: &'static str) -> ApiConfigSource {
    ApiConfigSource {
        api_type,
        transport_api_version: "V3",
        set_node_on_first_message_only: true,
        grpc_services: vec![GrpcService {
            envoy_grpc: EnvoyGrpc { cluster_name },
        }],
    }
}

#[derive(Debug, Serialize)]
struct ConfigSource {
    #[serde(skip_serializing_if = "Option::is_none")]
    ads: Option<Empty>,
    #[serde(skip_serializing_if = "Option::is_none")]
    api_config_source: Option<ApiConfigSource>,
    resource_api_version: &'static str,
}

#[derive(Debug, Serialize)]
struct Empty {}

fn from_ads() -> ConfigSource {
    ConfigSource {
        ads: Some(Empty {}),
        api_config_source: None,
        resource_api_version: "V3",
    }
}

fn from_sds() -> ConfigSource {
    ConfigSource {
        ads: None,
        api_config_source: Some(grpc_source("GRPC", SDS_CLUSTER)),
        resource_api_version: "V3",
    }
}

#[derive(Debug, Serialize)]
struct StaticResources {
    clusters: Vec<Cluster>,
    listeners: Vec<Listener>,
}

#[derive(Debug, Serialize)]
struct Cluster {
    name: &'static str,
    #[serde(rename = "type")]
    discovery: &'static str,
    connect_timeout: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    dns_lookup_family: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    typed_extension_protocol_options: Option<BTreeMap<&'static str, Typed<Value>>>,
    load_assignment: LoadAssignment,
    #[serde(skip_serializing_if = "Option::is_none")]
    transport_socket: Option<Extension<Typed<UpstreamTlsContext>>>,
}

#[derive(Debug, Serialize)]
struct LoadAssignment {
    cluster_name: &'static str,
    endpoints: Vec<LocalityEndpoints>,
}

#[derive(Debug, Serialize)]
struct LocalityEndpoints {
    lb_endpoints: Vec<LbEndpoint>,
}

#[derive(Debug, Serialize)]
struct LbEndpoint {
    endpoint: Endpoint,
}

#[derive(Debug, Serialize)]
struct Endpoint {
    address: Address,
}

fn one_endpoint(cluster_name: &'static str, address: Address) -> LoadAssignment {
    LoadAssignment {
        cluster_name,
        endpoints: vec![LocalityEndpoints {
            lb_endpoints: vec![LbEndpoint {
                endpoint: Endpoint { address },
            }],
        }],
    }
}

/// `envoy.extensions.upstreams.http.v3.HttpProtocolOptions` forcing HTTP/2
/// (gRPC), with keepalive pings when `keepalive` is set.
fn http2_options(keepalive: bool) -> BTreeMap<&'static str, Typed<Value>> {
    let h2 = if keepalive {
        serde_json::json!({"connection_keepalive": {"interval": "30s", "timeout": "10s"}})
    } else {
        serde_json::json!({})
    };
    BTreeMap::from([(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        typed(
            "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            serde_json::json!({"explicit_http_config": {"http2_protocol_options": h2}}),
        ),
    )])
}

#[derive(Debug, Serialize)]
struct Extension<T> {
    name: &'static str,
    typed_config: T,
}

#[derive(Debug, Serialize)]
struct UpstreamTlsContext {
    #[serde(skip_serializing_if = "Option::is_none")]
    sni: Option<String>,
    common_tls_context: CommonTlsContext,
}

#[derive(Debug, Serialize)]
struct CommonTlsContext {
    alpn_protocols: Vec<&'static str>,
    tls_certificate_sds_secret_configs: Vec<SdsSecretConfig>,
    combined_validation_context: CombinedValidationContext,
}

#[derive(Debug, Serialize)]
struct SdsSecretConfig {
    name: &'static str,
    sds_config: ConfigSource,
}

#[derive(Debug, Serialize)]
struct CombinedValidationContext {
    default_validation_context: DefaultValidation,
    validation_context_sds_secret_config: SdsSecretConfig,
}

#[derive(Debug, Serialize)]
struct DefaultValidation {
    match_typed_subject_alt_names: Vec<SanMatcher>,
}

#[derive(Debug, Serialize)]
struct SanMatcher {
    san_type: &'static str,
    matcher: Exact,
}

#[derive(Debug, Serialize)]
struct Exact {
    exact: String,
}

#[derive(Debug, Serialize)]
struct Listener {
    name: &'static str,
    address: Address,
    filter_chains: Vec<Value>,
}

#[derive(Debug, Serialize)]
struct OverloadManager {
    resource_monitors: Vec<Extension<Value>>,
}

#[derive(Debug, Serialize)]
struct LayeredRuntime {
    layers: Vec<Value>,
}

/// The `xds-grpc` cluster: the control plane's TLS endpoint, the workload
/// certificate as client certificate, the server checked against `ROOTCA`
/// and the address's host.
fn xds_cluster(target: &XdsTarget) -> Cluster {
    let (discovery, dns_lookup_family, sni, san) = match target.ip {
        // No SNI for an IP literal (RFC 6066); the certificate must carry
        // the IP as an IP SAN.
        Some(ip) => ("STATIC", None, None, ("IP_ADDRESS", ip.to_string())),
        None => (
            "STRICT_DNS",
            Some("V4_PREFERRED"),
            Some(target.host.clone()),
            ("DNS", target.host.clone()),
        ),
    };
    let tls = UpstreamTlsContext {
        sni,
        common_tls_context: CommonTlsContext {
            alpn_protocols: vec!["h2"],
            tls_certificate_sds_secret_configs: vec![SdsSecretConfig {
                name: DEFAULT_SECRET,
                sds_config: from_sds(),
            }],
            combined_validation_context: CombinedValidationContext {
                default_validation_context: DefaultValidation {
                    match_typed_subject_alt_names: vec![SanMatcher {
                        san_type: san.0,
                        matcher: Exact { exact: san.1 },
                    }],
                },
                validation_context_sds_secret_config: SdsSecretConfig {
                    name: ROOT_SECRET,
                    sds_config: from_sds(),
                },
            },
        },
    };
    Cluster {
        name: XDS_CLUSTER,
        discovery,
        connect_timeout: "5s",
        dns_lookup_family,
        typed_extension_protocol_options: Some(http2_options(true)),
        load_assignment: one_endpoint(XDS_CLUSTER, socket(target.host.clone(), target.port)),
        transport_socket: Some(Extension {
            name: "envoy.transport_sockets.tls",
            typed_config: typed(
                "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                tls,
            ),
        }),
    }
}

/// The 15090 listener: `/stats/prometheus` routed to the admin.
fn prometheus_listener(any: &str, port: u16, v6: bool) -> Listener {
    let hcm = serde_json::json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "stats",
        "route_config": {"virtual_hosts": [{
            "name": "backend",
            "domains": ["*"],
            "routes": [{"match": {"path": "/stats/prometheus"}, "route": {"cluster": PROMETHEUS_CLUSTER}}]
        }]},
        "http_filters": [{
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
        }]
    });
    Listener {
        name: PROMETHEUS_LISTENER,
        address: Address::SocketAddress(SocketAddress {
            address: any.into(),
            port_value: port,
            ipv4_compat: v6,
        }),
        filter_chains: vec![serde_json::json!({"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": hcm
        }]})],
    }
}

/// Istio's node metadata: string values, `LABELS` a nested struct.
fn metadata(config: &AgentConfig) -> BTreeMap<&'static str, Value> {
    let ips: Vec<String> = config.pod_ip.iter().map(IpAddr::to_string).collect();
    let labels: serde_json::Map<String, Value> = config
        .label_map()
        .into_iter()
        .map(|(k, v)| (k, Value::String(v)))
        .collect();
    BTreeMap::from([
        ("NAMESPACE", Value::String(config.namespace.clone())),
        ("NAME", Value::String(config.pod_name.clone())),
        ("NODE_NAME", Value::String(config.node_name.clone())),
        (
            "SERVICE_ACCOUNT",
            Value::String(config.service_account.clone()),
        ),
        ("CLUSTER_ID", Value::String(config.cluster_id.clone())),
        ("INSTANCE_IPS", Value::String(ips.join(","))),
        ("LABELS", Value::Object(labels)),
    ])
}

/// The bootstrap for `config`, as a JSON value.
pub fn render(
    config: &AgentConfig,
    target: &XdsTarget,
    ports: EnvoyPorts,
    sds_socket: &Path,
) -> Value {
    let v6 = config.pod_ip.iter().any(IpAddr::is_ipv6);
    let any = if v6 { "::" } else { "0.0.0.0" };
    let bootstrap = Bootstrap {
        node: Node {
            id: config.node_id(),
            cluster: config.service_cluster(),
            metadata: metadata(config),
        },
        admin: Admin {
            address: socket("127.0.0.1", ports.admin),
        },
        dynamic_resources: DynamicResources {
            ads_config: grpc_source("DELTA_GRPC", XDS_CLUSTER),
            cds_config: from_ads(),
            lds_config: from_ads(),
        },
        static_resources: StaticResources {
            clusters: vec![
                Cluster {
                    name: SDS_CLUSTER,
                    discovery: "STATIC",
                    connect_timeout: "1s",
                    dns_lookup_family: None,
                    typed_extension_protocol_options: Some(http2_options(false)),
                    load_assignment: one_endpoint(
                        SDS_CLUSTER,
                        Address::Pipe {
                            path: sds_socket.to_string_lossy().into_owned(),
                        },
                    ),
                    transport_socket: None,
                },
                xds_cluster(target),
                Cluster {
                    name: PROMETHEUS_CLUSTER,
                    discovery: "STATIC",
                    connect_timeout: "1s",
                    dns_lookup_family: None,
                    typed_extension_protocol_options: None,
                    load_assignment: one_endpoint(
                        PROMETHEUS_CLUSTER,
                        socket("127.0.0.1", ports.admin),
                    ),
                    transport_socket: None,
                },
            ],
            listeners: vec![prometheus_listener(any, ports.prometheus, v6)],
        },
        bootstrap_extensions: vec![Extension {
            name: "envoy.bootstrap.internal_listener",
            typed_config: serde_json::json!({
                "@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"
            }),
        }],
        // The runtime key `overload.global_downstream_max_connections` is
        // ignored by Envoy 1.40 (it warns that no limit is configured); the
        // limit is this resource monitor.
        overload_manager: OverloadManager {
            resource_monitors: vec![Extension {
                name: "envoy.resource_monitors.global_downstream_max_connections",
                typed_config: serde_json::json!({
                    "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                    "max_active_downstream_connections": MAX_DOWNSTREAM_CONNECTIONS
                }),
            }],
        },
        layered_runtime: LayeredRuntime {
            layers: vec![
                // Bounds on what route regexes the control plane sends may cost.
                serde_json::json!({"name": "global", "static_layer": {
                    "re2.max_program_size.error_level": 32768,
                    "re2.max_program_size.warn_level": 1024
                }}),
                serde_json::json!({"name": "admin", "admin_layer": {}}),
            ],
        },
        stats_flush_interval: "1s",
        stats_config: stats_config(),
    };
    // Serializing plain structs, string keys and JSON values cannot fail.
    serde_json::to_value(&bootstrap).unwrap_or(Value::Null)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::agent::config::{EnvoyKind, xds_target};

    fn config() -> AgentConfig {
        let mut c = AgentConfig::new(
            EnvoyKind::Waypoint,
            "shop",
            "wp",
            "wp-0",
            "10.1.0.7".parse().unwrap(),
            "https://istiod.istio-system.svc:15012",
        );
        c.node_name = "node-1".into();
        c.labels = vec![("gateway.networking.k8s.io/gateway-name".into(), "wp".into())];
        c
    }

    fn render_for(c: &AgentConfig) -> Value {
        let target = xds_target(&c.xds_address).unwrap();
        render(
            c,
            &target,
            EnvoyPorts {
                admin: 15000,
                prometheus: 15090,
            },
            Path::new("/run/a/sds.sock"),
        )
    }

    fn cluster<'a>(b: &'a Value, name: &str) -> &'a Value {
        b["static_resources"]["clusters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap()
    }

    #[test]
    fn node_and_ads() {
        let b = render_for(&config());
        assert_eq!(
            b["node"]["id"],
            "router~10.1.0.7~wp-0.shop~shop.svc.cluster.local"
        );
        assert_eq!(b["node"]["cluster"], "wp.shop");
        let m = &b["node"]["metadata"];
        assert_eq!(m["NAMESPACE"], "shop");
        assert_eq!(m["SERVICE_ACCOUNT"], "wp");
        assert_eq!(m["INSTANCE_IPS"], "10.1.0.7");
        assert_eq!(m["LABELS"]["gateway.networking.k8s.io/gateway-name"], "wp");
        let ads = &b["dynamic_resources"]["ads_config"];
        assert_eq!(ads["api_type"], "DELTA_GRPC");
        assert_eq!(ads["set_node_on_first_message_only"], true);
        assert_eq!(
            ads["grpc_services"][0]["envoy_grpc"]["cluster_name"],
            XDS_CLUSTER
        );
        assert!(b["dynamic_resources"]["cds_config"]["ads"].is_object());
        assert_eq!(
            b["admin"]["address"]["socket_address"]["address"],
            "127.0.0.1"
        );
    }

    #[test]
    fn xds_cluster_uses_sds_client_cert_and_host_san() {
        let b = render_for(&config());
        let x = cluster(&b, XDS_CLUSTER);
        assert_eq!(x["type"], "STRICT_DNS");
        let tls = &x["transport_socket"]["typed_config"];
        assert_eq!(tls["sni"], "istiod.istio-system.svc");
        let ctx = &tls["common_tls_context"];
        assert_eq!(
            ctx["tls_certificate_sds_secret_configs"][0]["name"],
            "default"
        );
        let v = &ctx["combined_validation_context"];
        assert_eq!(v["validation_context_sds_secret_config"]["name"], "ROOTCA");
        assert_eq!(
            v["default_validation_context"]["match_typed_subject_alt_names"][0]["matcher"]["exact"],
            "istiod.istio-system.svc"
        );
        let sds = cluster(&b, SDS_CLUSTER);
        assert_eq!(
            sds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["pipe"]
                ["path"],
            "/run/a/sds.sock"
        );
    }

    #[test]
    fn ip_control_plane_is_static_without_sni() {
        let mut c = config();
        c.xds_address = "https://10.0.0.2:15012".into();
        let b = render_for(&c);
        let x = cluster(&b, XDS_CLUSTER);
        assert_eq!(x["type"], "STATIC");
        assert!(x.get("dns_lookup_family").is_none());
        let tls = &x["transport_socket"]["typed_config"];
        assert!(tls.get("sni").is_none());
        assert_eq!(
            tls["common_tls_context"]["combined_validation_context"]["default_validation_context"]
                ["match_typed_subject_alt_names"][0]["san_type"],
            "IP_ADDRESS"
        );
    }

    #[test]
    fn ipv6_pods_listen_on_both_families() {
        let mut c = config();
        c.pod_ip = vec!["fd00::7".parse().unwrap()];
        let b = render_for(&c);
        let l = &b["static_resources"]["listeners"][0]["address"]["socket_address"];
        assert_eq!(l["address"], "::");
        assert_eq!(l["ipv4_compat"], true);
    }
}
