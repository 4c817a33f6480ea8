//! The sidecar translation from YAML: listener and cluster shapes, the
//! routes it shares with the waypoint, mTLS modes and visibility scoping.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, lb_endpoint};
use envoy_types::pb::envoy::config::listener::v3::{FilterChain, Listener, filter};
use envoy_types::pb::envoy::config::route::v3::{RouteConfiguration, route, route_action};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager, http_connection_manager::RouteSpecifier,
};
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    TcpProxy, tcp_proxy::ClusterSpecifier as TcpCluster,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::DownstreamTlsContext;
use envoy_types::pb::google::protobuf::value::Kind as ValueKind;
use prost::Message;

use super::*;
use crate::model::snapshot::Snapshot;
use crate::model::waypoint;
use crate::model::{ModelOptions, Store, build_snapshot};

fn fixture(name: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(name),
    )
    .unwrap()
}

/// The waypoint and sidecar fixtures plus `extra`, with the `shop`
/// namespace's services not bound to its waypoint: the sidecars route them
/// themselves (what these tests are about).
fn snapshot(extra: &str) -> Snapshot {
    build(
        &fixture("waypoint/base.yaml").replace("    istio.io/use-waypoint: waypoint\n", ""),
        extra,
    )
}

/// The same with `shop`'s services bound to its waypoint.
fn snapshot_with_waypoint(extra: &str) -> Snapshot {
    build(&fixture("waypoint/base.yaml"), extra)
}

fn build(waypoint_base: &str, extra: &str) -> Snapshot {
    let text = format!(
        "{waypoint_base}\n---\n{}\n---\n{extra}",
        fixture("sidecar/base.yaml")
    );
    let (objects, errors) = ambit_config::parse_documents(Path::new("t.yaml"), &text);
    assert!(errors.is_empty(), "{errors:#?}");
    build_snapshot(
        &Store::from_objects(objects),
        &Snapshot::default(),
        &ModelOptions::default(),
    )
}

fn get<M: Message + Default>(snap: &Snapshot, scope: &str, type_url: &str, name: &str) -> M {
    let set = snap
        .set(scope, type_url)
        .unwrap_or_else(|| panic!("no {type_url} in {scope}"));
    let res = set
        .resources
        .by_name
        .get(name)
        .unwrap_or_else(|| panic!("no {name} in {scope}: {:?}", set.resources.by_name.keys()));
    M::decode(res.body.value.as_slice()).unwrap()
}

fn names(snap: &Snapshot, scope: &str, type_url: &str) -> Vec<String> {
    let mut out: Vec<String> = snap
        .set(scope, type_url)
        .map(|s| s.resources.by_name.keys().cloned().collect())
        .unwrap_or_default();
    out.sort();
    out
}

fn chain<'a>(l: &'a Listener, name: &str) -> &'a FilterChain {
    l.filter_chains
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| {
            let all: Vec<_> = l.filter_chains.iter().map(|c| &c.name).collect();
            panic!("no chain {name} in {}: {all:?}", l.name)
        })
}

fn typed<M: Message + Default>(c: &FilterChain, filter: &str) -> Option<M> {
    let f = c.filters.iter().find(|f| f.name == filter)?;
    match &f.config_type {
        Some(filter::ConfigType::TypedConfig(a)) => Some(M::decode(a.value.as_slice()).unwrap()),
        _ => None,
    }
}

const HCM: &str = "envoy.filters.network.http_connection_manager";
const TCP: &str = "envoy.filters.network.tcp_proxy";
const LLM: &str = "llm.shop.svc.cluster.local";

#[test]
fn outbound_listener_has_a_chain_per_service_port_and_a_passthrough() {
    let snap = snapshot("");
    let ns = namespace_scope("shop");
    let l: Listener = get(&snap, &ns, waypoint::LISTENER_TYPE, VIRTUAL_OUTBOUND);
    assert_eq!(l.use_original_dst.map(|b| b.value), Some(true));
    let port = |l: &Listener| match l.address.as_ref().and_then(|a| a.address.as_ref()) {
        Some(envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress(s)) => {
            s.port_specifier.clone()
        }
        _ => None,
    };
    assert_eq!(
        port(&l),
        Some(
            envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier::PortValue(
                15001
            )
        )
    );
    // HTTP: the VIP:port chain reads the port's route configuration.
    let http = chain(&l, &format!("{LLM}:80"));
    let m = http.filter_chain_match.as_ref().unwrap();
    assert_eq!(m.destination_port.map(|p| p.value), Some(80));
    assert_eq!(m.prefix_ranges[0].address_prefix, "10.96.0.20");
    let hcm: HttpConnectionManager = typed(http, HCM).unwrap();
    let Some(RouteSpecifier::Rds(rds)) = hcm.route_specifier else {
        panic!("not RDS")
    };
    assert_eq!(rds.route_config_name, "80");
    // TCP: straight to the service cluster.
    let tcp: TcpProxy = typed(chain(&l, "embed.shop.svc.cluster.local:9000"), TCP).unwrap();
    assert_eq!(
        tcp.cluster_specifier,
        Some(TcpCluster::Cluster(
            "outbound|9000||embed.shop.svc.cluster.local".into()
        ))
    );
    let fallback: TcpProxy = typed(l.default_filter_chain.as_ref().unwrap(), TCP).unwrap();
    assert_eq!(
        fallback.cluster_specifier,
        Some(TcpCluster::Cluster(PASSTHROUGH_CLUSTER.into()))
    );
    let clusters = names(&snap, &ns, waypoint::CLUSTER_TYPE);
    for c in [
        PASSTHROUGH_CLUSTER,
        "outbound|80||llm.shop.svc.cluster.local",
        "outbound|8080||embed.shop.svc.cluster.local",
        "connect_originate;spiffe://cluster.local/ns/shop/sa/llm",
    ] {
        assert!(clusters.contains(&c.to_string()), "{c}: {clusters:?}");
    }
    let pass: Cluster = get(&snap, &ns, waypoint::CLUSTER_TYPE, PASSTHROUGH_CLUSTER);
    assert_eq!(
        pass.cluster_discovery_type,
        Some(
            envoy_types::pb::envoy::config::cluster::v3::cluster::ClusterDiscoveryType::Type(
                envoy_types::pb::envoy::config::cluster::v3::cluster::DiscoveryType::OriginalDst
                    as i32
            )
        )
    );
}

/// The vhost routes of every service both proxies route, for every shape
/// of the waypoint corpus: one translation, two consumers.
#[test]
fn routes_equal_the_waypoints_for_every_corpus_shape() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/waypoint/corpus");
    let mut shapes: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    shapes.sort();
    let mut compared = 0;
    for path in shapes {
        let shape = std::fs::read_to_string(&path).unwrap();
        let bound = snapshot_with_waypoint(&shape);
        let snap = snapshot(&shape);
        let wp = waypoint::scope("shop", "waypoint");
        let ns = namespace_scope("shop");
        for name in names(&bound, &wp, waypoint::ROUTE_TYPE) {
            let Some((host, port)) = name.rsplit_once(':') else {
                continue;
            };
            let theirs: RouteConfiguration = get(&bound, &wp, waypoint::ROUTE_TYPE, &name);
            let ours: RouteConfiguration = get(&snap, &ns, waypoint::ROUTE_TYPE, port);
            let vh = ours
                .virtual_hosts
                .iter()
                .find(|v| v.name == format!("{host}:{port}"))
                .unwrap_or_else(|| panic!("{}: no vhost {name}", path.display()));
            assert_eq!(
                vh.routes,
                theirs.virtual_hosts[0].routes,
                "{}: {name}",
                path.display()
            );
            compared += 1;
        }
    }
    assert!(compared >= 40, "compared {compared} route sets");
}

#[test]
fn canary_weights_reach_the_sidecar_route() {
    let snap = snapshot(&fixture("waypoint/corpus/01-canary-80-20.yaml"));
    let rc: RouteConfiguration = get(&snap, &namespace_scope("shop"), waypoint::ROUTE_TYPE, "80");
    let vh = rc
        .virtual_hosts
        .iter()
        .find(|v| v.name == format!("{LLM}:80"))
        .unwrap();
    assert!(vh.domains.contains(&"llm".to_string()), "{:?}", vh.domains);
    let Some(route::Action::Route(action)) = &vh.routes[0].action else {
        panic!("not a route")
    };
    let Some(route_action::ClusterSpecifier::WeightedClusters(w)) = &action.cluster_specifier
    else {
        panic!("not weighted")
    };
    let got: Vec<(String, u32)> = w
        .clusters
        .iter()
        .map(|c| (c.name.clone(), c.weight.unwrap().value))
        .collect();
    assert_eq!(
        got,
        vec![
            (format!("outbound|80|v1|{LLM}"), 80),
            (format!("outbound|80|v2|{LLM}"), 20)
        ]
    );
    // The subset clusters exist, with their endpoints.
    let cla: ClusterLoadAssignment = get(
        &snap,
        &namespace_scope("shop"),
        waypoint::ENDPOINT_TYPE,
        &format!("outbound|80|v2|{LLM}"),
    );
    assert_eq!(cla.endpoints[0].lb_endpoints.len(), 1);
    // A catch-all virtual host passes unknown hosts through.
    assert_eq!(rc.virtual_hosts.last().unwrap().domains, vec!["*"]);
}

/// How an endpoint's transport was chosen, from its metadata.
fn tls_mode(e: &envoy_types::pb::envoy::config::endpoint::v3::LbEndpoint) -> Option<String> {
    let md = e.metadata.as_ref()?;
    let s = md.filter_metadata.get("envoy.transport_socket_match")?;
    match s.fields.get("tlsMode")?.kind.as_ref()? {
        envoy_types::pb::google::protobuf::value::Kind::StringValue(v) => Some(v.clone()),
        _ => None,
    }
}

#[test]
fn endpoints_are_reached_over_hbone_mtls_or_plaintext() {
    let snap = snapshot("");
    let legacy = namespace_scope("legacy");
    // Ambient llm pods (seen from shop): HBONE through the internal listener.
    let cla: ClusterLoadAssignment = get(
        &snap,
        &namespace_scope("shop"),
        waypoint::ENDPOINT_TYPE,
        &format!("outbound|80||{LLM}"),
    );
    let e = &cla.endpoints[0].lb_endpoints[0];
    assert_eq!(tls_mode(e).as_deref(), Some("hbone"));
    // A sidecar pod: mTLS with Istio's SNI and ALPN.
    let cla: ClusterLoadAssignment = get(
        &snap,
        &legacy,
        waypoint::ENDPOINT_TYPE,
        "outbound|8080||client.legacy.svc.cluster.local",
    );
    assert_eq!(
        tls_mode(&cla.endpoints[0].lb_endpoints[0]).as_deref(),
        Some("istio")
    );
    let c: Cluster = get(
        &snap,
        &legacy,
        waypoint::CLUSTER_TYPE,
        "outbound|8080||client.legacy.svc.cluster.local",
    );
    let tls = c
        .transport_socket_matches
        .iter()
        .find(|m| m.name == "tlsMode-istio")
        .unwrap();
    let Some(envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
        a,
    )) = &tls.transport_socket.as_ref().unwrap().config_type
    else {
        panic!("no tls config")
    };
    let ctx =
        envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::UpstreamTlsContext::decode(
            a.value.as_slice(),
        )
        .unwrap();
    assert_eq!(ctx.sni, "outbound_.8080_._.client.legacy.svc.cluster.local");
    assert_eq!(
        ctx.common_tls_context.unwrap().alpn_protocols,
        vec!["istio-peer-exchange", "istio"]
    );
    // Outside the mesh: plaintext, a plain socket address.
    let cla: ClusterLoadAssignment = get(
        &snap,
        &legacy,
        waypoint::ENDPOINT_TYPE,
        "outbound|5432||db.legacy.svc.cluster.local",
    );
    let e = &cla.endpoints[0].lb_endpoints[0];
    assert_eq!(tls_mode(e), None);
    assert!(matches!(
        e.host_identifier,
        Some(lb_endpoint::HostIdentifier::Endpoint(_))
    ));
}

/// A fixture pod's inbound scope (its service account is its app's name).
fn own_scope(ns: &str, pod: &str) -> String {
    let sa = pod.split('-').next().unwrap_or(pod);
    pod_scope(ns, pod, sa)
}

fn inbound(snap: &Snapshot, ns: &str, pod: &str) -> Listener {
    get(
        snap,
        &own_scope(ns, pod),
        waypoint::LISTENER_TYPE,
        VIRTUAL_INBOUND,
    )
}

fn transport(c: &FilterChain) -> &str {
    &c.filter_chain_match.as_ref().unwrap().transport_protocol
}

#[test]
fn inbound_chains_follow_the_peer_authentication_mode() {
    // Default PERMISSIVE: TLS or plaintext per port.
    let snap = snapshot("");
    let l = inbound(&snap, "legacy", "client-0");
    assert_eq!(transport(chain(&l, "inbound|8080||tls")), "tls");
    assert_eq!(
        transport(chain(&l, "inbound|8080||plaintext")),
        "raw_buffer"
    );
    let listeners = names(
        &snap,
        &own_scope("legacy", "client-0"),
        waypoint::LISTENER_TYPE,
    );
    assert_eq!(
        listeners,
        vec!["connect_terminate", "main_internal", VIRTUAL_INBOUND]
    );
    let clusters = names(
        &snap,
        &own_scope("legacy", "client-0"),
        waypoint::CLUSTER_TYPE,
    );
    assert!(clusters.contains(&INBOUND_PASSTHROUGH_CLUSTER.to_string()));

    // STRICT: one chain, TLS with a client certificate required.
    let snap = snapshot(
        "
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: legacy}
spec:
  selector: {matchLabels: {app: client}}
  mtls: {mode: STRICT}
  portLevelMtls:
    9090: {mode: DISABLE}
",
    );
    let l = inbound(&snap, "legacy", "client-0");
    let strict: Vec<_> = l
        .filter_chains
        .iter()
        .filter(|c| c.name.starts_with("inbound|8080|"))
        .collect();
    assert_eq!(strict.len(), 1);
    assert_eq!(transport(strict[0]), "");
    let Some(envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType::TypedConfig(
        a,
    )) = &strict[0].transport_socket.as_ref().unwrap().config_type
    else {
        panic!("no tls")
    };
    let ctx = DownstreamTlsContext::decode(a.value.as_slice()).unwrap();
    assert_eq!(ctx.require_client_certificate.map(|b| b.value), Some(true));
    // The DISABLE port: plaintext only.
    let plain = chain(&l, "inbound|9090||plaintext");
    assert!(plain.transport_socket.is_none());
    assert_eq!(transport(plain), "");
}

#[test]
fn the_pods_authorization_policy_guards_its_inbound_chains() {
    let snap = snapshot(
        "
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: only-shop, namespace: legacy}
spec:
  selector: {matchLabels: {app: client}}
  action: ALLOW
  rules:
  - from: [{source: {principals: [cluster.local/ns/shop/sa/llm]}}]
    to: [{operation: {ports: ['9090']}}]
",
    );
    let l = inbound(&snap, "legacy", "client-0");
    let rbac: NetworkRbac = typed(chain(&l, "inbound|9090||tls"), "ambit.tcp_rbac.allow").unwrap();
    let policy = rbac.rules.unwrap().policies.into_values().next().unwrap();
    // Over mTLS the caller is the certificate's identity.
    let text = format!("{:?}", policy.principals);
    assert!(text.contains("Authenticated"), "{text}");
    assert!(!text.contains("FilterState"), "{text}");
    // Over HBONE it is the tunnel's (the waypoint's filter state).
    let hbone: Listener = get(
        &snap,
        &own_scope("legacy", "client-0"),
        waypoint::LISTENER_TYPE,
        "main_internal",
    );
    let rbac: NetworkRbac =
        typed(chain(&hbone, "inbound|9090||hbone"), "ambit.tcp_rbac.allow").unwrap();
    let text = format!("{:?}", rbac.rules.unwrap().policies);
    assert!(text.contains("io.ambit.peer_principal"), "{text}");
}

#[test]
fn sidecars_see_their_namespace_and_the_root_by_default() {
    let snap = snapshot("");
    let legacy = namespace_scope("legacy");
    let clusters = names(&snap, &legacy, waypoint::CLUSTER_TYPE);
    assert!(
        clusters
            .iter()
            .any(|c| c.ends_with("|client.legacy.svc.cluster.local"))
    );
    assert!(
        clusters
            .iter()
            .any(|c| c.ends_with("|istiod.istio-system.svc.cluster.local"))
    );
    assert!(
        !clusters
            .iter()
            .any(|c| c.ends_with(".shop.svc.cluster.local")),
        "{clusters:?}"
    );
    // Inbound sets only for sidecar pods (a container named istio-proxy
    // counts), outbound only for namespaces with one.
    assert!(
        snap.set(&own_scope("legacy", "client-0"), waypoint::LISTENER_TYPE)
            .is_some()
    );
    assert!(
        snap.set(&own_scope("legacy", "db-0"), waypoint::LISTENER_TYPE)
            .is_none()
    );
    assert!(
        snap.set(&own_scope("shop", "llm-v1-0"), waypoint::LISTENER_TYPE)
            .is_none()
    );
    assert!(
        snap.set(&namespace_scope("istio-system"), waypoint::LISTENER_TYPE)
            .is_none()
    );
    // A waypoint pod's Envoy container is named like a sidecar's: no sidecar.
    let snap = snapshot(
        "
apiVersion: v1
kind: Pod
metadata:
  name: waypoint-0
  namespace: shop
  labels: {gateway.networking.k8s.io/gateway-name: waypoint, istio.io/dataplane-mode: none}
spec:
  nodeName: node-1
  serviceAccountName: waypoint
  containers: [{name: istio-proxy}]
status: {podIP: 10.10.1.5}
",
    );
    assert!(
        snap.set(&own_scope("shop", "waypoint-0"), waypoint::LISTENER_TYPE)
            .is_none()
    );
}

#[test]
fn a_sidecar_resource_narrows_or_widens_what_is_seen() {
    let snap = snapshot(
        "
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: legacy}
spec:
  egress:
  - hosts: ['./*', 'shop/llm.shop.svc.cluster.local']
  outboundTrafficPolicy: {mode: REGISTRY_ONLY}
",
    );
    let legacy = namespace_scope("legacy");
    let clusters = names(&snap, &legacy, waypoint::CLUSTER_TYPE);
    assert!(
        clusters.contains(&format!("outbound|80||{LLM}")),
        "{clusters:?}"
    );
    assert!(
        !clusters
            .iter()
            .any(|c| c.ends_with("|embed.shop.svc.cluster.local"))
    );
    assert!(
        !clusters
            .iter()
            .any(|c| c.ends_with("|istiod.istio-system.svc.cluster.local"))
    );
    assert!(
        clusters
            .iter()
            .any(|c| c.ends_with("|client.legacy.svc.cluster.local"))
    );
    let l: Listener = get(&snap, &legacy, waypoint::LISTENER_TYPE, VIRTUAL_OUTBOUND);
    let fallback: TcpProxy = typed(l.default_filter_chain.as_ref().unwrap(), TCP).unwrap();
    assert_eq!(
        fallback.cluster_specifier,
        Some(TcpCluster::Cluster(BLACKHOLE_CLUSTER.into()))
    );
    // A mesh-wide one in the root namespace applies where none is local.
    let snap = snapshot(
        "
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: istio-system}
spec:
  egress:
  - hosts: ['*/embed.shop.svc.cluster.local']
",
    );
    let clusters = names(&snap, &legacy, waypoint::CLUSTER_TYPE);
    assert!(
        clusters
            .iter()
            .any(|c| c.ends_with("|embed.shop.svc.cluster.local"))
    );
    assert!(
        !clusters
            .iter()
            .any(|c| c.ends_with("|client.legacy.svc.cluster.local"))
    );
}

#[test]
fn egress_hosts_match_istio_forms() {
    use ambit_config::networking::NamespacedHost;
    let h = |s: &str| s.parse::<NamespacedHost>().unwrap();
    let m = |s: &str, svc_ns: &str, host: &str| plan::host_matches(&h(s), "legacy", svc_ns, host);
    assert!(m("./*", "legacy", "a.legacy.svc.cluster.local"));
    assert!(!m("./*", "shop", "a.shop.svc.cluster.local"));
    assert!(m(
        "*/a.shop.svc.cluster.local",
        "shop",
        "a.shop.svc.cluster.local"
    ));
    assert!(m(
        "istio-system/*",
        "istio-system",
        "istiod.istio-system.svc.cluster.local"
    ));
    assert!(m(
        "shop/*.shop.svc.cluster.local",
        "shop",
        "b.shop.svc.cluster.local"
    ));
    assert!(!m("~/*", "legacy", "a.legacy.svc.cluster.local"));
}

/// The stats access logger's tags of an HCM's request counter, by name.
fn request_tags(hcm: &HttpConnectionManager) -> std::collections::BTreeMap<String, String> {
    use envoy_types::pb::envoy::config::accesslog::v3::access_log::ConfigType;
    use envoy_types::pb::envoy::extensions::access_loggers::stats::v3::Config as StatsLog;
    let logs: Vec<StatsLog> = hcm
        .access_log
        .iter()
        .filter(|l| l.name == "envoy.access_loggers.stats")
        .filter_map(|l| match &l.config_type {
            Some(ConfigType::TypedConfig(a)) => Some(StatsLog::decode(a.value.as_slice()).unwrap()),
            _ => None,
        })
        .collect();
    for tag in logs.iter().flat_map(|l| {
        let counters = l.counters.iter().filter_map(|c| c.stat.as_ref());
        let histograms = l.histograms.iter().filter_map(|h| h.stat.as_ref());
        counters.chain(histograms).flat_map(|s| &s.tags)
    }) {
        assert!(
            !tag.value_format.is_empty(),
            "Envoy refuses an empty tag: {tag:?}"
        );
    }
    let counter = logs
        .iter()
        .flat_map(|l| &l.counters)
        .filter_map(|c| c.stat.as_ref())
        .find(|s| s.name == "requests_total")
        .expect("requests_total is counted");
    counter
        .tags
        .iter()
        .map(|t| (t.name.clone(), t.value_format.clone()))
        .collect()
}

#[test]
fn http_chains_count_requests_as_source_and_destination() {
    let snap = snapshot("");
    let out: Listener = get(
        &snap,
        &namespace_scope("legacy"),
        waypoint::LISTENER_TYPE,
        VIRTUAL_OUTBOUND,
    );
    let hcm: HttpConnectionManager =
        typed(chain(&out, "client.legacy.svc.cluster.local:8080"), HCM).unwrap();
    let tags = request_tags(&hcm);
    assert_eq!(tags["reporter"], "source");
    assert_eq!(
        tags["destination_service"],
        "%UPSTREAM_METADATA(ambit:service)%"
    );
    assert!(
        !tags.contains_key("source_workload"),
        "the agent adds the pod's own labels"
    );
    // The endpoints carry what those tags read.
    let cla: ClusterLoadAssignment = get(
        &snap,
        &namespace_scope("legacy"),
        waypoint::ENDPOINT_TYPE,
        "outbound|8080||client.legacy.svc.cluster.local",
    );
    let md = cla.endpoints[0].lb_endpoints[0].metadata.as_ref().unwrap();
    let who = &md.filter_metadata["ambit"].fields;
    let text = |k: &str| match &who[k].kind {
        Some(ValueKind::StringValue(s)) => s.clone(),
        other => panic!("{k}: {other:?}"),
    };
    assert_eq!(text("service"), "client.legacy.svc.cluster.local");
    assert_eq!(text("service_namespace"), "legacy");
    assert_eq!(
        text("principal"),
        "spiffe://cluster.local/ns/legacy/sa/client"
    );

    let inbound = inbound(&snap, "legacy", "client-0");
    let tls = request_tags(&typed(chain(&inbound, "inbound|8080||tls"), HCM).unwrap());
    assert_eq!(
        tags_of(&tls),
        ("destination", "%DOWNSTREAM_PEER_URI_SAN%", "mutual_tls")
    );
    assert_eq!(
        tls["destination_service"],
        "client.legacy.svc.cluster.local"
    );
    let plain = request_tags(&typed(chain(&inbound, "inbound|8080||plaintext"), HCM).unwrap());
    assert_eq!(tags_of(&plain), ("destination", "-", "none"));
}

fn tags_of(t: &std::collections::BTreeMap<String, String>) -> (&str, &str, &str) {
    (
        t["reporter"].as_str(),
        t["source_principal"].as_str(),
        t["connection_security_policy"].as_str(),
    )
}

/// A sidecar sends a waypoint-bound service's traffic to the waypoint over
/// HBONE, asking for the service's VIP:port, and leaves routing to it; with
/// no waypoint pod the service has no endpoints (never the pods directly,
/// which would skip the waypoint's policy).
#[test]
fn a_waypoint_bound_service_goes_through_its_waypoint() {
    const WAYPOINT_POD: &str = "
apiVersion: v1
kind: Pod
metadata:
  name: waypoint-0
  namespace: shop
  labels: {gateway.networking.k8s.io/gateway-name: waypoint, istio.io/dataplane-mode: none}
spec: {nodeName: node-1, serviceAccountName: waypoint}
status: {podIP: 10.10.1.50}
";
    let snap = snapshot_with_waypoint(&format!(
        "{WAYPOINT_POD}\n---\n{}",
        fixture("waypoint/corpus/01-canary-80-20.yaml")
    ));
    let ns = namespace_scope("shop");
    let cla: ClusterLoadAssignment = get(
        &snap,
        &ns,
        waypoint::ENDPOINT_TYPE,
        "outbound|80||llm.shop.svc.cluster.local",
    );
    let eps = &cla.endpoints[0].lb_endpoints;
    assert_eq!(eps.len(), 1, "one waypoint pod: {eps:?}");
    let Some(lb_endpoint::HostIdentifier::Endpoint(e)) = &eps[0].host_identifier else {
        panic!("no endpoint")
    };
    let internal = format!("{:?}", e.address);
    assert!(
        internal.contains("connect_originate;spiffe://cluster.local/ns/shop/sa/waypoint"),
        "{internal}"
    );
    let tunnel = &eps[0].metadata.as_ref().unwrap().filter_metadata["tunnel"].fields;
    let text = |k: &str| match &tunnel[k].kind {
        Some(ValueKind::StringValue(s)) => s.clone(),
        other => panic!("{k}: {other:?}"),
    };
    assert_eq!(
        text("destination"),
        "10.96.0.20:80",
        "CONNECT asks for the VIP"
    );
    assert_eq!(
        text("address"),
        "10.10.1.50:15008",
        "dialled at the waypoint"
    );
    assert_eq!(tls_mode(&eps[0]).as_deref(), Some("hbone"));
    // No subset clusters, one plain route: the waypoint splits.
    let clusters = names(&snap, &ns, waypoint::CLUSTER_TYPE);
    assert!(
        !clusters
            .iter()
            .any(|c| c.starts_with("outbound|80|v1|llm.")),
        "{clusters:?}"
    );
    assert!(
        clusters
            .contains(&"connect_originate;spiffe://cluster.local/ns/shop/sa/waypoint".to_string())
    );
    let rc: RouteConfiguration = get(&snap, &ns, waypoint::ROUTE_TYPE, "80");
    let vh = rc
        .virtual_hosts
        .iter()
        .find(|v| v.name == format!("{LLM}:80"))
        .unwrap();
    let Some(route::Action::Route(action)) = &vh.routes[0].action else {
        panic!("not a route")
    };
    assert_eq!(
        action.cluster_specifier,
        Some(route_action::ClusterSpecifier::Cluster(
            "outbound|80||llm.shop.svc.cluster.local".into()
        ))
    );
    // Without a waypoint pod: no endpoints at all.
    let snap = snapshot_with_waypoint("");
    let cla: ClusterLoadAssignment = get(
        &snap,
        &ns,
        waypoint::ENDPOINT_TYPE,
        "outbound|80||llm.shop.svc.cluster.local",
    );
    assert!(
        cla.endpoints.iter().all(|l| l.lb_endpoints.is_empty()),
        "{cla:?}"
    );
}
