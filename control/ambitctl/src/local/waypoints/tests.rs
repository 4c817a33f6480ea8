#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use super::routes::{Scrape, denial_rows, route_rows};
use super::*;
use crate::config::parse_documents;
use crate::local::state::{NodeState, Phase};
use crate::proxy_config::RouteRow as EnvoyRoute;

const GATEWAYS: &str = "\
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: waypoint, namespace: ai}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{name: mesh, port: 15008, protocol: HBONE}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: wp2, namespace: ai}
spec:
  gatewayClassName: ambit-waypoint
  listeners: [{name: http, port: 80, protocol: HTTP}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: ingress, namespace: ai}
spec:
  gatewayClassName: istio
  listeners: [{name: http, port: 80, protocol: HTTP}]
";

fn key(ns: &str, name: &str) -> GatewayKey {
    GatewayKey {
        namespace: ns.into(),
        name: name.into(),
    }
}

#[test]
fn waypoint_gateways_need_an_hbone_listener() {
    let (objects, errors) = parse_documents(std::path::Path::new("gw.yaml"), GATEWAYS);
    assert!(errors.is_empty(), "{errors:?}");
    let w = wanted(objects.iter());
    assert_eq!(w.len(), 2, "the istio-class ingress is no waypoint: {w:?}");
    assert_eq!(w.get(&key("ai", "waypoint")), Some(&Ok(())));
    let why = w.get(&key("ai", "wp2")).unwrap().clone().unwrap_err();
    assert!(why.contains("15008") && why.contains("HBONE"), "{why}");
}

fn node(name: &str, third: u8) -> NodeState {
    let p = PathBuf::from("/x");
    let a = SocketAddr::from(([127, 0, 0, 1], 1));
    NodeState {
        name: name.into(),
        netns: format!("c-{name}"),
        lan_ip: Ipv4Addr::new(172, 31, 0, third),
        subnet: format!("10.10.{third}.0/24"),
        gateway: Ipv4Addr::new(10, 10, third, 1),
        dir: p.clone(),
        conflist: p.clone(),
        cni_socket: p.clone(),
        zds_socket: p.clone(),
        agent_dir: p.clone(),
        token_file: p,
        admin_addr: a,
        stats_addr: a,
        readiness_addr: a,
    }
}

fn pod(ns: &str, name: &str, node: &str, ip: Ipv4Addr) -> PodState {
    PodState {
        namespace: ns.into(),
        name: name.into(),
        node: node.into(),
        netns: format!("c-{ns}-{name}"),
        ip,
        uid: "u".into(),
        container_id: "c".into(),
        service_account: name.into(),
        ambient: false,
        sidecar: false,
        app: None,
        cni_result: None,
    }
}

fn state() -> State {
    State {
        name: "c".into(),
        state_dir: "/s".into(),
        config_dir: "/c".into(),
        source_dir: None,
        bin_dir: "/b".into(),
        phase: Phase::Ready,
        started_at: 0,
        control: None,
        netns: Vec::new(),
        processes: Vec::new(),
        nodes: vec![node("node-1", 1), node("node-2", 2)],
        pods: vec![
            pod("ai", "a", "node-1", Ipv4Addr::new(10, 10, 1, 10)),
            pod("ai", "b", "node-1", Ipv4Addr::new(10, 10, 1, 200)),
            pod("ai", "c", "node-2", Ipv4Addr::new(10, 10, 2, 10)),
        ],
        envoy: None,
    }
}

#[test]
fn placement_takes_the_emptiest_node_and_a_free_address() {
    let s = state();
    let mut table = WaypointTable::default();
    let (n, ip) = place(&s, &table, &key("ai", "waypoint")).unwrap();
    assert_eq!((n.as_str(), ip), ("node-2", Ipv4Addr::new(10, 10, 2, 200)));
    // With a waypoint on node-2 the nodes tie at two pods: the first wins,
    // and its .200 is taken by a config pod.
    table.waypoints.push(WaypointRecord {
        gateway: key("ai", "waypoint"),
        pod: pod("ai", "waypoint-0", &n, ip),
        phase: WaypointPhase::Running,
        agent_pid: None,
        log: "/l".into(),
        manifest: "/m".into(),
        restarts: 0,
        error: None,
    });
    let (n, ip) = place(&s, &table, &key("ai", "other")).unwrap();
    assert_eq!((n.as_str(), ip), ("node-1", Ipv4Addr::new(10, 10, 1, 201)));
    // A stopped pod's address is not handed out again while others are free.
    table.waypoints.clear();
    table.release(Ipv4Addr::new(10, 10, 2, 200));
    let (n, ip) = place(&s, &table, &key("ai", "waypoint")).unwrap();
    assert_eq!((n.as_str(), ip), ("node-2", Ipv4Addr::new(10, 10, 2, 201)));
}

#[test]
fn the_manifest_is_a_pod_the_mesh_reads_as_a_waypoint_pod() {
    let p = pod("ai", "waypoint-0", "node-2", Ipv4Addr::new(10, 10, 2, 200));
    let text = manifest(&key("ai", "waypoint"), &p);
    let (objects, errors) = parse_documents(std::path::Path::new("m.yaml"), &text);
    assert!(errors.is_empty(), "{errors:?}\n{text}");
    let Some(Object::Pod(pod)) = objects.first() else {
        panic!("not a pod: {objects:?}");
    };
    assert_eq!(pod.metadata.labels[LABEL_GATEWAY_NAME], "waypoint");
    assert_eq!(pod.metadata.labels[LABEL_DATAPLANE_MODE], "none");
    assert_eq!(pod.service_account(), "waypoint-0");
    assert_eq!(pod.spec.node_name, "node-2");
    let empty = crate::config::Labels::new();
    let ambient =
        crate::config::Labels::from([(LABEL_DATAPLANE_MODE.to_string(), "ambient".to_string())]);
    assert!(!crate::config::is_enrolled(&ambient, &pod.metadata.labels));
    assert!(!crate::config::is_enrolled(&empty, &pod.metadata.labels));
}

fn route(cluster: &str, weight: &str) -> EnvoyRoute {
    let parts: Vec<&str> = cluster.split('|').collect();
    EnvoyRoute {
        route_config: "80".into(),
        virtual_host: "llm.ai.svc.cluster.local:80 (llm.ai.svc.cluster.local)".into(),
        match_: "prefix /".into(),
        cluster: cluster.into(),
        destination: format!("{}:{}", parts[3], parts[1]),
        subset: parts[2].into(),
        weight: weight.into(),
    }
}

#[test]
fn route_rows_count_per_subset_from_envoy_cluster_stats() {
    let scrape = Scrape {
        routes: vec![
            route("outbound|80|v1|llm.ai.svc.cluster.local", "80"),
            route("outbound|80|v2|llm.ai.svc.cluster.local", "20"),
        ],
        cluster_stats: "\
cluster.outbound|80|v1|llm.ai.svc.cluster.local.upstream_rq_total: 800
cluster.outbound|80|v1|llm.ai.svc.cluster.local.upstream_rq_2xx: 799
cluster.outbound|80|v1|llm.ai.svc.cluster.local.upstream_rq_5xx: 1
cluster.outbound|80|v1|llm.ai.svc.cluster.local.upstream_rq_retry: 1
cluster.outbound|80|v2|llm.ai.svc.cluster.local.upstream_rq_total: 200
cluster.outbound|80|v2|llm.ai.svc.cluster.local.upstream_rq_2xx: 200
cluster.outbound|80|v2|llm.ai.svc.cluster.local.upstream_rq_timeout: 3
"
        .into(),
        prometheus: "envoy_cluster_upstream_rq_total{envoy_cluster_name=\"x\"} 5\n".into(),
    };
    let rows = route_rows(&scrape);
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (
            rows[0].subset.as_str(),
            rows[0].weight.as_str(),
            rows[0].requests
        ),
        ("v1", "80", 800)
    );
    assert_eq!(
        (rows[0].ok_2xx, rows[0].error_5xx, rows[0].retries),
        (799, 1, 1)
    );
    assert_eq!((rows[1].subset.as_str(), rows[1].requests), ("v2", 200));
    assert_eq!(rows[1].source, "envoy cluster stats");
}

#[test]
fn route_rows_prefer_istio_request_metrics_when_they_carry_versions() {
    let scrape = Scrape {
        routes: vec![
            route("outbound|80|v1|llm.ai.svc.cluster.local", "100"),
            route("outbound|80|v2|llm.ai.svc.cluster.local", "0"),
        ],
        cluster_stats: "cluster.outbound|80|v1|llm.ai.svc.cluster.local.upstream_rq_total: 1\n"
            .into(),
        prometheus: "\
# TYPE istio_requests_total counter
istio_requests_total{reporter=\"waypoint\",destination_service=\"llm.ai.svc.cluster.local\",destination_version=\"v1\",response_code=\"200\"} 7
istio_requests_total{reporter=\"waypoint\",destination_service=\"llm.ai.svc.cluster.local\",destination_version=\"v1\",response_code=\"503\"} 2
istio_requests_total{reporter=\"waypoint\",destination_service=\"llm.ai.svc.cluster.local\",destination_version=\"v2\",response_code=\"200\"} 3
"
        .into(),
    };
    let rows = route_rows(&scrape);
    assert_eq!(rows[0].source, "istio_requests_total");
    assert_eq!(
        (rows[0].requests, rows[0].ok_2xx, rows[0].error_5xx),
        (9, 7, 2)
    );
    assert_eq!(rows[1].requests, 3);
    // A subset not named like a version is counted by Envoy's cluster stats.
    let mut scrape = scrape;
    scrape
        .routes
        .push(route("outbound|80|canary|llm.ai.svc.cluster.local", "0"));
    scrape
        .cluster_stats
        .push_str("cluster.outbound|80|canary|llm.ai.svc.cluster.local.upstream_rq_total: 4\n");
    let rows = route_rows(&scrape);
    assert_eq!(
        (rows[2].requests, rows[2].source.as_str()),
        (4, "envoy cluster stats")
    );
}

#[test]
fn route_rows_carry_percentiles_and_denials_name_the_policy() {
    let svc = "destination_service=\"llm.ai.svc.cluster.local\",destination_version=\"v1\"";
    let scrape = Scrape {
        routes: vec![route("outbound|80|v1|llm.ai.svc.cluster.local", "100")],
        cluster_stats: String::new(),
        prometheus: format!(
            "istio_requests_total{{{svc},response_code=\"200\"}} 100
istio_request_duration_milliseconds_bucket{{{svc},le=\"1\"}} 40
istio_request_duration_milliseconds_bucket{{{svc},le=\"5\"}} 90
istio_request_duration_milliseconds_bucket{{{svc},le=\"10\"}} 100
istio_request_duration_milliseconds_bucket{{{svc},le=\"+Inf\"}} 100
ambit_requests_denied_total{{reporter=\"waypoint\",policy=\"ai/only-orchestrator\",source_principal=\"spiffe://cluster.local/ns/ai/sa/batch\",destination_service=\"llm.ai.svc.cluster.local\"}} 4
ambit_requests_denied_total{{reporter=\"waypoint\",policy=\"none\",source_principal=\"unknown\",destination_service=\"llm.ai.svc.cluster.local\"}} 1
"
        ),
    };
    let rows = route_rows(&scrape);
    // p50: rank 50 falls in (1, 5] with 50 of it: 1 + 4 × 10/50 = 1.8 ms;
    // p99: rank 99 in (5, 10]: 5 + 5 × 9/10 = 9.5 ms.
    let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9);
    assert!(close(rows[0].p50_ms, 1.8), "{:?}", rows[0].p50_ms);
    assert!(close(rows[0].p99_ms, 9.5), "{:?}", rows[0].p99_ms);
    let denials = denial_rows(&scrape.prometheus);
    assert_eq!(denials.len(), 2);
    assert_eq!(
        (denials[0].policy.as_str(), denials[0].requests),
        ("ai/only-orchestrator", 4)
    );
    assert_eq!(
        denials[0].source_principal,
        "spiffe://cluster.local/ns/ai/sa/batch"
    );
    assert_eq!(
        (denials[1].policy.as_str(), denials[1].requests),
        ("none", 1)
    );
}
