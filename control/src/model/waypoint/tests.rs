//! The waypoint translation from YAML: what a waypoint serves, the
//! workload API around it, and the findings operators see.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use ambit_proto::workload::{Address, TunnelProtocol, address};
use prost::Message;

use super::*;
use crate::model::{ModelOptions, Snapshot, Store, build_snapshot};

fn base() -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/waypoint/base.yaml"),
    )
    .unwrap()
}

const WAYPOINT_POD: &str = "
apiVersion: v1
kind: Pod
metadata:
  name: waypoint-0
  namespace: shop
  labels:
    gateway.networking.k8s.io/gateway-name: waypoint
    istio.io/dataplane-mode: none
spec:
  nodeName: node-1
  serviceAccountName: waypoint
status:
  podIP: 10.10.1.5
";

fn snapshot(extra: &str) -> Snapshot {
    let text = format!("{}\n---\n{WAYPOINT_POD}\n---\n{extra}", base());
    let (objects, errors) = ambit_config::parse_documents(Path::new("t.yaml"), &text);
    assert!(errors.is_empty(), "{errors:#?}");
    build_snapshot(
        &Store::from_objects(objects),
        &Snapshot::default(),
        &ModelOptions::default(),
    )
}

fn address(snap: &Snapshot, name: &str) -> address::Type {
    let set = snap.mesh(ambit_proto::ADDRESS_TYPE_URL);
    let res = set
        .by_name
        .get(name)
        .unwrap_or_else(|| panic!("no address {name}: {:?}", set.by_name.keys()));
    Address::decode(res.body.value.as_slice())
        .unwrap()
        .r#type
        .unwrap()
}

#[test]
fn a_waypoint_gets_a_service_and_its_pods_speak_hbone() {
    let snap = snapshot("");
    // No Service named after the Gateway in the config: one is synthesized
    // so ztunnels can find the waypoint by hostname.
    let address::Type::Service(svc) = address(&snap, "shop/waypoint.shop.svc.cluster.local") else {
        panic!("not a service")
    };
    assert_eq!(svc.ports[0].service_port, 15008);
    // The waypoint pod is not captured but speaks HBONE itself.
    let address::Type::Workload(w) = address(&snap, "Kubernetes//Pod/shop/waypoint-0") else {
        panic!("not a workload")
    };
    assert_eq!(w.tunnel_protocol, TunnelProtocol::Hbone as i32);
    assert!(w.waypoint.is_none(), "a waypoint never uses a waypoint");
    assert!(
        w.services
            .contains_key("shop/waypoint.shop.svc.cluster.local")
    );
    // Services of the namespace point at it.
    let address::Type::Service(llm) = address(&snap, "shop/llm.shop.svc.cluster.local") else {
        panic!("not a service")
    };
    assert!(llm.waypoint.is_some());
}

#[test]
fn the_waypoint_scope_holds_every_bound_service() {
    let snap = snapshot("");
    let scope = scope("shop", "waypoint");
    let routes = snap.set(&scope, ROUTE_TYPE).unwrap();
    let mut names: Vec<&String> = routes.resources.by_name.keys().collect();
    names.sort();
    assert_eq!(
        names,
        [
            "embed.shop.svc.cluster.local:8080",
            "llm-v1.shop.svc.cluster.local:80",
            "llm-v2.shop.svc.cluster.local:80",
            "llm.shop.svc.cluster.local:80",
        ]
    );
    let clusters = snap.set(&scope, CLUSTER_TYPE).unwrap();
    assert!(
        clusters
            .resources
            .by_name
            .contains_key("outbound|9000||embed.shop.svc.cluster.local")
    );
    assert!(snap.errors.is_empty(), "{:#?}", snap.errors);
}

#[test]
fn an_undefined_subset_and_two_virtual_services_are_reported() {
    let vs = |name: &str| {
        format!(
            "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {{name: {name}, namespace: shop}}\nspec:\n  hosts: [llm]\n  http:\n  - route:\n    - destination: {{host: llm, subset: v2}}\n"
        )
    };
    let snap = snapshot(&format!("{}---\n{}", vs("a"), vs("b")));
    let reasons: Vec<&str> = snap.errors.iter().map(|e| e.reason.as_str()).collect();
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("subset \"v2\"") && r.contains("every endpoint")),
        "{reasons:#?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("2 VirtualServices claim host llm.shop.svc.cluster.local")),
        "{reasons:#?}"
    );
    // The route still works: it falls back to the service's default cluster.
    let routes = snap.set(&scope("shop", "waypoint"), ROUTE_TYPE).unwrap();
    let rc = &routes.resources.by_name["llm.shop.svc.cluster.local:80"];
    let decoded = envoy_types::pb::envoy::config::route::v3::RouteConfiguration::decode(
        rc.body.value.as_slice(),
    )
    .unwrap();
    let dbg = format!("{decoded:?}");
    assert!(
        dbg.contains("outbound|80||llm.shop.svc.cluster.local"),
        "{dbg}"
    );
    assert!(!dbg.contains("outbound|80|v2|"), "{dbg}");
}

#[test]
fn protocols_are_inferred_as_istio_does() {
    let cases = [
        (Some("http"), "tcp-x", Protocol::Http),
        (Some("kubernetes.io/h2c"), "", Protocol::Http2),
        (Some("grpc"), "", Protocol::Grpc),
        (Some("tcp"), "http", Protocol::Tcp),
        (None, "http-web", Protocol::Http),
        (None, "http2", Protocol::Http2),
        (None, "grpc-api", Protocol::Grpc),
        (None, "web", Protocol::Tcp),
        (None, "", Protocol::Tcp),
    ];
    for (app, name, want) in cases {
        assert_eq!(Protocol::infer(app, name), want, "{app:?} {name}");
    }
}

/// A waypoint for workloads: a pod bound to it gets a `main_internal`
/// filter chain matching its IP on any port and a CONNECT-originating
/// listener and cluster for its identity; a service bound to it is not
/// served (nor named in its Service), and the pods of the service-only
/// waypoint's namespace do not name that one.
#[test]
fn a_workload_waypoint_serves_its_pods_by_ip() {
    let extra = "
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata:
  name: wl
  namespace: shop
  labels: {istio.io/waypoint-for: workload}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{name: mesh, port: 15008, protocol: HBONE}]
---
apiVersion: v1
kind: Pod
metadata:
  name: db-0
  namespace: shop
  labels: {app: db, istio.io/use-waypoint: wl}
spec: {nodeName: node-1, serviceAccountName: db}
status: {podIP: 10.10.1.30}
---
apiVersion: v1
kind: Service
metadata:
  name: db
  namespace: shop
  labels: {istio.io/use-waypoint: wl}
spec:
  clusterIP: 10.96.0.30
  selector: {app: db}
  ports: [{name: tcp, port: 5432}]
";
    let snap = snapshot(extra);
    let address::Type::Workload(db) = address(&snap, "Kubernetes//Pod/shop/db-0") else {
        panic!("not a workload")
    };
    let host = |g: &Option<ambit_proto::workload::GatewayAddress>| match g
        .as_ref()
        .and_then(|g| g.destination.clone())
    {
        Some(ambit_proto::workload::gateway_address::Destination::Hostname(h)) => h.hostname,
        _ => String::new(),
    };
    assert_eq!(host(&db.waypoint), "wl.shop.svc.cluster.local");
    let address::Type::Service(db_svc) = address(&snap, "shop/db.shop.svc.cluster.local") else {
        panic!("not a service")
    };
    assert!(db_svc.waypoint.is_none(), "wl handles no service traffic");
    // The namespace's pods are bound to the service-only waypoint: no name.
    let address::Type::Workload(llm) = address(&snap, "Kubernetes//Pod/shop/llm-v1-0") else {
        panic!("not a workload")
    };
    assert!(llm.waypoint.is_none(), "{:?}", llm.waypoint);

    let scope = scope("shop", "wl");
    let listeners = snap.set(&scope, LISTENER_TYPE).unwrap();
    let main = &listeners.resources.by_name["main_internal"];
    let main =
        envoy_types::pb::envoy::config::listener::v3::Listener::decode(main.body.value.as_slice())
            .unwrap();
    let names: Vec<&str> = main.filter_chains.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["workload:shop/db-0"]);
    let m = main.filter_chains[0].filter_chain_match.as_ref().unwrap();
    assert_eq!(m.prefix_ranges[0].address_prefix, "10.10.1.30");
    assert!(m.destination_port.is_none(), "any port");
    let db_id = "spiffe://cluster.local/ns/shop/sa/db";
    assert!(
        listeners
            .resources
            .by_name
            .contains_key(&format!("connect_originate;{db_id}"))
    );
    let clusters = snap.set(&scope, CLUSTER_TYPE).unwrap();
    assert!(
        clusters
            .resources
            .by_name
            .contains_key(&format!("connect_originate;{db_id}"))
    );
    assert!(
        snap.set(&scope, ROUTE_TYPE)
            .is_none_or(|s| s.resources.by_name.is_empty())
    );
}

/// A waypoint Gateway handles service traffic, workload traffic or both
/// (`istio.io/waypoint-for`); an object bound to one that does not handle
/// its kind of traffic names no waypoint (Istio's rule), one bound to a
/// Gateway the config does not define still names it (fail closed).
#[test]
fn a_waypoints_scope_decides_who_names_it() {
    use crate::model::workloads_tests::{build, ns, pod, svc, uid, waypoint_host};
    let gateway = |name: &str, scope: &str| {
        format!(
            "---\napiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata:\n  name: {name}\n  namespace: a\n  labels: {{istio.io/waypoint-for: {scope}}}\nspec:\n  gatewayClassName: istio-waypoint\n  listeners:\n  - {{name: mesh, port: 15008, protocol: HBONE}}\n"
        )
    };
    let host = |n: &str| Some(("a".to_string(), format!("{n}.a.svc.cluster.local"), 15008));
    for (scope, pod_has, svc_has) in [
        ("service", false, true),
        ("workload", true, false),
        ("all", true, true),
        ("none", false, false),
    ] {
        let yaml = ns("a", "istio.io/use-waypoint: wp")
            + &gateway("wp", scope)
            + &pod("a", "p", "10.0.0.1", "app: x")
            + &svc("a", "s", "10.96.0.1", "app: x", "80");
        let out = build(&yaml);
        assert_eq!(
            waypoint_host(&out.workloads[&uid("a", "p")].waypoint),
            if pod_has { host("wp") } else { None },
            "waypoint-for {scope}: pod"
        );
        assert_eq!(
            waypoint_host(&out.services["a/s.a.svc.cluster.local"].waypoint),
            if svc_has { host("wp") } else { None },
            "waypoint-for {scope}: service"
        );
    }
    // No Gateway `ghost` in the config: both still name it.
    let yaml = ns("a", "istio.io/use-waypoint: ghost")
        + &pod("a", "p", "10.0.0.1", "app: x")
        + &svc("a", "s", "10.96.0.1", "app: x", "80");
    let out = build(&yaml);
    assert_eq!(
        waypoint_host(&out.workloads[&uid("a", "p")].waypoint),
        host("ghost")
    );
    assert_eq!(
        waypoint_host(&out.services["a/s.a.svc.cluster.local"].waypoint),
        host("ghost")
    );
}
