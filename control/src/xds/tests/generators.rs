//! Generators end to end over gRPC: a proxy kind is served only its own
//! types and scope, pushes follow the generator's type order, and adding a
//! type is a generator plus its registration (this test registers one the
//! server has never heard of).

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::listener::v3::Listener;

use super::*;
use crate::model::snapshot::Snapshot;

const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

/// Serves each router its own scope (named by its pod), clusters before
/// listeners.
#[derive(Debug)]
struct ScopedRouterGenerator;

const ROUTER_TYPES: &[TypeSpec] = &[
    TypeSpec {
        type_url: CLUSTER,
        label: "cluster",
        resend_with: None,
    },
    TypeSpec {
        type_url: LISTENER,
        label: "listener",
        resend_with: None,
    },
];

impl Generator for ScopedRouterGenerator {
    fn kind(&self) -> ProxyKind {
        ProxyKind::Waypoint
    }
    fn types(&self) -> &'static [TypeSpec] {
        ROUTER_TYPES
    }
    fn generate(&self, proxy: &ProxyNode, snap: &Snapshot, type_url: &str) -> Served {
        Served::from_snapshot(snap, &proxy.pod_name, type_url)
    }
}

fn cluster(name: &str, timeout_s: i64) -> XdsResource {
    let c = Cluster {
        name: name.into(),
        connect_timeout: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: timeout_s,
            nanos: 0,
        }),
        ..Default::default()
    };
    XdsResource::new(CLUSTER, name.into(), vec![], &c)
}

fn listener(name: &str, port_hint: u32) -> XdsResource {
    let l = Listener {
        name: name.into(),
        stat_prefix: format!("p{port_hint}"),
        ..Default::default()
    };
    XdsResource::new(LISTENER, name.into(), vec![], &l)
}

fn scoped(scope: &str, type_url: &'static str, items: Vec<XdsResource>) -> ResourceFamily {
    ResourceFamily {
        scope: scope.into(),
        type_url,
        resources: items,
    }
}

fn router_node(pod: &str) -> Option<Node> {
    Some(Node {
        id: format!("router~10.0.0.9~{pod}.ns~ns.svc.cluster.local"),
        ..Default::default()
    })
}

fn request(node: Option<Node>, type_url: &str) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node,
        type_url: type_url.into(),
        ..Default::default()
    }
}

fn generators() -> Generators {
    let mut g = Generators::standard();
    g.register(Arc::new(ScopedRouterGenerator));
    g
}

fn families(a_clusters: Vec<XdsResource>, a_listeners: Vec<XdsResource>) -> Vec<ResourceFamily> {
    vec![
        ResourceFamily::mesh(
            ambit_proto::ADDRESS_TYPE_URL,
            vec![workload("c//Pod/ns/a", [10, 0, 0, 1], "sa")],
        ),
        scoped("wp-a", CLUSTER, a_clusters),
        scoped("wp-a", LISTENER, a_listeners),
        scoped("wp-b", CLUSTER, vec![cluster("outbound|80||b", 1)]),
    ]
}

#[tokio::test]
async fn each_router_gets_its_own_scope_and_ztunnels_get_no_router_types() {
    let mut h = harness_with(Vec::new(), generators()).await;
    h.publisher
        .publish_families(families(vec![cluster("outbound|80||a", 1)], Vec::new()));

    let mut a = DeltaClient::open_as(
        &mut h,
        request(router_node("wp-a"), CLUSTER),
        WAYPOINT_TOKEN,
    )
    .await;
    let first = a.recv().await;
    assert_eq!(first.type_url, CLUSTER);
    assert_eq!(names(&first), ["outbound|80||a"]);
    let mut b = DeltaClient::open_as(
        &mut h,
        request(router_node("wp-b"), CLUSTER),
        WAYPOINT_TOKEN,
    )
    .await;
    assert_eq!(names(&b.recv().await), ["outbound|80||b"]);

    // A router is not served the workload API, a ztunnel no clusters:
    // the request is ignored and the stream stays usable.
    a.tx.send(request(None, ambit_proto::ADDRESS_TYPE_URL))
        .await
        .unwrap();
    a.quiet(Duration::from_millis(200)).await;
    let mut z = DeltaClient::open(&mut h, request(node(), CLUSTER)).await;
    z.quiet(Duration::from_millis(200)).await;
    z.tx.send(wildcard()).await.unwrap();
    assert_eq!(names(&z.recv().await), ["c//Pod/ns/a"]);

    let proxies = h.registry.proxies();
    let kinds: Vec<&str> = proxies.iter().map(|p| p.kind).collect();
    assert_eq!(kinds, ["waypoint", "waypoint", "ztunnel"]);
}

#[tokio::test]
async fn pushes_follow_the_generators_type_order_and_only_changed_scopes_push() {
    let mut h = harness_with(Vec::new(), generators()).await;
    h.publisher.publish_families(families(
        vec![cluster("outbound|80||a", 1)],
        vec![listener("a", 1)],
    ));
    // Subscribe listeners first; the order of pushes after a change must
    // still be clusters, then listeners.
    let mut a = DeltaClient::open_as(
        &mut h,
        request(router_node("wp-a"), LISTENER),
        WAYPOINT_TOKEN,
    )
    .await;
    let l = a.recv().await;
    assert_eq!(l.type_url, LISTENER);
    a.ack(&l).await;
    a.tx.send(request(None, CLUSTER)).await.unwrap();
    let c = a.recv().await;
    assert_eq!(c.type_url, CLUSTER);
    a.ack(&c).await;
    let mut b = DeltaClient::open_as(
        &mut h,
        request(router_node("wp-b"), CLUSTER),
        WAYPOINT_TOKEN,
    )
    .await;
    let bc = b.recv().await;
    b.ack(&bc).await;

    h.publisher.publish_families(families(
        vec![cluster("outbound|80||a", 2), cluster("outbound|81||a", 1)],
        vec![listener("a", 2)],
    ));
    let first = a.recv().await;
    let second = a.recv().await;
    assert_eq!(
        (first.type_url.as_str(), second.type_url.as_str()),
        (CLUSTER, LISTENER)
    );
    assert_eq!(names(&first), ["outbound|80||a", "outbound|81||a"]);
    assert_eq!(names(&second), ["a"]);
    // wp-b's scope did not change: nothing for it.
    b.quiet(Duration::from_millis(200)).await;
}

#[tokio::test]
async fn a_vanished_scope_is_removed_from_its_router() {
    let mut h = harness_with(Vec::new(), generators()).await;
    h.publisher.publish_families(families(
        vec![cluster("outbound|80||a", 1)],
        vec![listener("a", 1)],
    ));
    let mut a = DeltaClient::open_as(
        &mut h,
        request(router_node("wp-a"), CLUSTER),
        WAYPOINT_TOKEN,
    )
    .await;
    let c = a.recv().await;
    a.ack(&c).await;

    // The waypoint was deleted: its scope is gone from the snapshot.
    h.publisher.publish_families(vec![ResourceFamily::mesh(
        ambit_proto::ADDRESS_TYPE_URL,
        Vec::new(),
    )]);
    let gone = a.recv().await;
    assert!(gone.resources.is_empty());
    assert_eq!(gone.removed_resources, ["outbound|80||a"]);
}
