#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::Arc;

use ambit_proto::security as xsec;
use ambit_proto::workload as xds;
use http_body_util::BodyExt;
use hyper::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::*;
use crate::state::{self, new_state};

const SVC: &str = "default/web.default.svc.cluster.local";

fn hand_built_state() -> StateReader {
    let (mut writer, reader) = new_state();
    let mut next = writer.begin();
    let mut services = HashMap::new();
    services.insert(
        SVC.to_string(),
        xds::PortList {
            ports: vec![xds::Port {
                service_port: 80,
                target_port: 8080,
            }],
        },
    );
    let w = xds::Workload {
        uid: "Kubernetes//Pod/default/web-1".into(),
        name: "web-1".into(),
        namespace: "default".into(),
        addresses: vec![vec![10, 0, 0, 7]],
        tunnel_protocol: xds::TunnelProtocol::Hbone as i32,
        trust_domain: "cluster.local".into(),
        service_account: "web".into(),
        node: "node-a".into(),
        canonical_name: "web".into(),
        canonical_revision: "v1".into(),
        workload_type: xds::WorkloadType::Pod as i32,
        workload_name: "web".into(),
        cluster_id: "Kubernetes".into(),
        services,
        authorization_policies: vec!["default/allow-web".into()],
        waypoint: Some(xds::GatewayAddress {
            destination: Some(xds::gateway_address::Destination::Hostname(
                xds::NamespacedHostname {
                    namespace: "default".into(),
                    hostname: "waypoint.default.svc.cluster.local".into(),
                },
            )),
            hbone_mtls_port: 15008,
        }),
        ..Default::default()
    };
    next.insert_workload(state::Workload::try_from(&w).unwrap());
    let s = xds::Service {
        name: "web".into(),
        namespace: "default".into(),
        hostname: "web.default.svc.cluster.local".into(),
        addresses: vec![xds::NetworkAddress {
            network: String::new(),
            address: vec![10, 96, 0, 10],
        }],
        ports: vec![xds::Port {
            service_port: 80,
            target_port: 8080,
        }],
        ..Default::default()
    };
    next.insert_service(state::Service::try_from(&s).unwrap());
    let p = xsec::Authorization {
        name: "allow-web".into(),
        namespace: "default".into(),
        scope: xsec::Scope::WorkloadSelector as i32,
        action: xsec::Action::Allow as i32,
        rules: vec![xsec::Rule {
            clauses: vec![xsec::Clause {
                matches: vec![xsec::Match {
                    namespaces: vec![xsec::StringMatch {
                        match_type: Some(xsec::string_match::MatchType::Exact("client".into())),
                    }],
                    source_ips: vec![xsec::Address {
                        address: vec![10, 0, 0, 0],
                        length: 8,
                    }],
                    destination_ports: vec![8080],
                    ..Default::default()
                }],
            }],
        }],
    };
    next.insert_authorization(state::Authorization::try_from(&p).unwrap());
    writer.publish(next);
    reader
}

fn context(ready: bool) -> (AdminContext, watch::Receiver<bool>) {
    let (quit_tx, quit_rx) = watch::channel(false);
    let (_ready_tx, ready_rx) = watch::channel(ready);
    (
        AdminContext {
            state: hand_built_state(),
            metrics: Arc::new(Metrics::new()),
            ready: ready_rx,
            unserved: watch::channel(Default::default()).1,
            log: None,
            quit: quit_tx,
            certificates: None,
        },
        quit_rx,
    )
}

async fn body(resp: Response<Body>) -> String {
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn config_dump_has_istio_shape() {
    let (ctx, _quit) = context(true);
    let resp = route(Listener::Admin, &ctx, &Method::GET, "/config_dump", None);
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()[CONTENT_TYPE], "application/json");
    let v: Value = serde_json::from_str(&body(resp).await).unwrap();

    let mut keys: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
    keys.sort();
    assert_eq!(keys, ["certificates", "policies", "services", "workloads"]);
    assert_eq!(v["certificates"], json!([]));

    let w = &v["workloads"][0];
    assert_eq!(w["uid"], "Kubernetes//Pod/default/web-1");
    assert_eq!(w["name"], "web-1");
    assert_eq!(w["namespace"], "default");
    assert_eq!(w["workloadIps"], json!(["10.0.0.7"]));
    assert_eq!(w["serviceAccount"], "web");
    assert_eq!(w["node"], "node-a");
    assert_eq!(w["network"], "");
    assert_eq!(w["protocol"], "HBONE");
    assert_eq!(w["canonicalName"], "web");
    assert_eq!(w["canonicalRevision"], "v1");
    assert_eq!(w["workloadType"], "pod");
    assert_eq!(w["workloadName"], "web");
    assert_eq!(w["status"], "Healthy");
    assert_eq!(w["clusterId"], "Kubernetes");
    assert_eq!(w["trustDomain"], "cluster.local");
    assert_eq!(w["services"], json!({ SVC: { "80": 8080 } }));
    assert_eq!(
        w["waypoint"],
        json!({"destination": "default/waypoint.default.svc.cluster.local", "hboneMtlsPort": 15008})
    );
    assert_eq!(w["authorizationPolicies"], json!(["default/allow-web"]));

    let s = &v["services"][0];
    assert_eq!(s["name"], "web");
    assert_eq!(s["namespace"], "default");
    assert_eq!(s["hostname"], "web.default.svc.cluster.local");
    assert_eq!(s["vips"], json!(["/10.96.0.10"]));
    assert_eq!(s["ports"], json!({"80": 8080}));
    assert_eq!(
        s["endpoints"],
        json!({"Kubernetes//Pod/default/web-1": {
            "workloadUid": "Kubernetes//Pod/default/web-1",
            "service": SVC,
            "port": {"80": 8080}
        }})
    );
    assert!(s.get("waypoint").is_none());

    let p = &v["policies"][0];
    assert_eq!(p["name"], "allow-web");
    assert_eq!(p["namespace"], "default");
    assert_eq!(p["scope"], "WorkloadSelector");
    assert_eq!(p["action"], "Allow");
    let m = &p["rules"][0][0][0];
    assert_eq!(m["namespaces"], json!([{"Exact": "client"}]));
    assert_eq!(m["sourceIps"], json!(["10.0.0.0/8"]));
    assert_eq!(m["destinationPorts"], json!([8080]));
}

#[tokio::test]
async fn unknown_paths_and_wrong_methods() {
    let (ctx, _quit) = context(true);
    let r = route(Listener::Admin, &ctx, &Method::GET, "/nope", None);
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let text = body(r).await;
    assert!(
        text.contains("/nope") && text.contains("GET / lists"),
        "{text}"
    );
    let r = route(Listener::Admin, &ctx, &Method::POST, "/config_dump", None);
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.headers()[ALLOW], "GET");
    let r = route(Listener::Admin, &ctx, &Method::GET, "/quitquitquit", None);
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    // Paths are per listener: /metrics is not on the admin port.
    let r = route(Listener::Admin, &ctx, &Method::GET, "/metrics", None);
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let r = route(Listener::Stats, &ctx, &Method::DELETE, "/metrics", None);
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    let r = route(
        Listener::Readiness,
        &ctx,
        &Method::POST,
        "/healthz/ready",
        None,
    );
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn readiness_follows_the_flag() {
    let (ctx, _quit) = context(false);
    let r = route(
        Listener::Readiness,
        &ctx,
        &Method::GET,
        "/healthz/ready",
        None,
    );
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let (ctx, _quit) = context(true);
    let r = route(
        Listener::Readiness,
        &ctx,
        &Method::GET,
        "/healthz/ready",
        None,
    );
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(body(r).await, "ready\n");
}

#[tokio::test]
async fn readiness_lists_pods_enrolled_but_not_served() {
    let (mut ctx, _quit) = context(true);
    let (tx, rx) = watch::channel(crate::inpod::UnservedSet::new());
    ctx.unserved = rx;
    tx.send_modify(|u| {
        u.insert(
            "shop/web-0 (uid u1)".into(),
            "cannot open listeners: address in use".into(),
        );
    });
    let r = route(
        Listener::Readiness,
        &ctx,
        &Method::GET,
        "/healthz/ready",
        None,
    );
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let text = body(r).await;
    assert!(text.contains("shop/web-0 (uid u1)"), "{text}");
    assert!(text.contains("not served"), "{text}");
    tx.send_modify(|u| u.clear());
    let r = route(
        Listener::Readiness,
        &ctx,
        &Method::GET,
        "/healthz/ready",
        None,
    );
    assert_eq!(r.status(), StatusCode::OK);
}

#[tokio::test]
async fn quitquitquit_signals() {
    let (ctx, quit) = context(true);
    let r = route(Listener::Admin, &ctx, &Method::POST, "/quitquitquit", None);
    assert_eq!(r.status(), StatusCode::OK);
    assert!(*quit.borrow());
}

#[tokio::test]
async fn metrics_are_served() {
    let (ctx, _quit) = context(true);
    ctx.metrics.xds.connected.set(1);
    let r = route(Listener::Stats, &ctx, &Method::GET, "/metrics", None);
    assert_eq!(r.status(), StatusCode::OK);
    let text = body(r).await;
    assert!(text.contains("ztunnel_xds_connected 1"), "{text}");
}

#[tokio::test]
async fn logging_through_a_reload_handle() {
    use tracing_subscriber::layer::SubscriberExt;
    let (layer, handle) = tracing_subscriber::reload::Layer::new(EnvFilter::new("info"));
    // The subscriber must stay alive for the handle to work; it is never
    // installed globally.
    let _subscriber = tracing_subscriber::registry().with(layer);
    let (mut ctx, _quit) = context(true);
    let r = route(Listener::Admin, &ctx, &Method::GET, "/logging", None);
    assert_eq!(r.status(), StatusCode::NOT_IMPLEMENTED);

    ctx.log = Some(LogControl::new(handle));
    let r = route(Listener::Admin, &ctx, &Method::GET, "/logging", None);
    assert_eq!(body(r).await, "current log filter: info\n");
    let r = route(
        Listener::Admin,
        &ctx,
        &Method::POST,
        "/logging",
        Some("level=debug%2Cambit_ztunnel%3A%3Axds%3Dtrace"),
    );
    assert_eq!(r.status(), StatusCode::OK);
    let text = body(r).await;
    assert!(text.contains("ambit_ztunnel::xds=trace"), "{text}");
    let r = route(
        Listener::Admin,
        &ctx,
        &Method::POST,
        "/logging",
        Some("level=not%20a%20filter%3D%3D"),
    );
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let r = route(Listener::Admin, &ctx, &Method::POST, "/logging", None);
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
}

#[test]
fn percent_decoding() {
    assert_eq!(percent_decode("a%2Cb+c%3d"), "a,b c=");
    assert_eq!(percent_decode("bad%zz%"), "bad%zz%");
    assert_eq!(
        query_param(Some("x=1&level=warn"), "level").as_deref(),
        Some("warn")
    );
    assert_eq!(query_param(Some("x=1"), "level"), None);
}

#[tokio::test]
async fn each_listener_lists_its_endpoints_at_root_and_each_listed_one_is_served() {
    let (ctx, _quit) = context(true);
    for listener in [Listener::Admin, Listener::Stats, Listener::Readiness] {
        let r = route(listener, &ctx, &Method::GET, "/", None);
        assert_eq!(r.status(), StatusCode::OK);
        let text = body(r).await;
        for e in index::endpoints(listener) {
            assert!(text.contains(e.path) && text.contains(e.what), "{text}");
            // Listed means routed: never a 404 (the first listed method
            // is a safe one for every endpoint but /quitquitquit).
            if e.path == "/quitquitquit" {
                let r = route(listener, &ctx, &Method::GET, e.path, None);
                assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
                continue;
            }
            let r = route(listener, &ctx, &Method::GET, e.path, None);
            assert_ne!(r.status(), StatusCode::NOT_FOUND, "{}", e.path);
        }
        // The index names the other listeners' endpoints too.
        let others = ["/config_dump", "/metrics", "/healthz/ready"];
        assert!(others.iter().all(|p| text.contains(p)), "{text}");
        let r = route(listener, &ctx, &Method::POST, "/", None);
        assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    }
    let admin = body(route(Listener::Admin, &ctx, &Method::GET, "/", None)).await;
    assert!(
        admin.contains("/connections") && admin.contains("/logging"),
        "{admin}"
    );
}

#[tokio::test]
async fn connections_are_served_as_json() {
    use crate::proxy::metrics::{
        ConnectionOpen, ConnectionResult, PeerInfo, Reporter, SecurityPolicy,
    };
    let (ctx, _quit) = context(true);
    let open = |port: u16| ConnectionOpen {
        reporter: Reporter::Source,
        src: format!("10.0.0.1:{port}").parse().unwrap(),
        dst: "10.0.0.7:8080".parse().unwrap(),
        source: PeerInfo {
            name: "client-0".into(),
            namespace: "default".into(),
            principal: "spiffe://cluster.local/ns/default/sa/client".into(),
            ..PeerInfo::default()
        },
        destination: PeerInfo {
            name: "web-1".into(),
            namespace: "default".into(),
            ..PeerInfo::default()
        },
        destination_service: None,
        security: SecurityPolicy::MutualTls,
        upstream: Some("10.0.0.7:15008".parse().unwrap()),
        waypoint: None,
        trace_id: Some(42),
        hbone_peer: None,
    };
    let done = ConnectionResult::new(open(40001), &ctx.metrics.tcp);
    done.record_sent(10);
    done.finish();
    let _live = ConnectionResult::new(open(40002), &ctx.metrics.tcp);
    let r = route(Listener::Admin, &ctx, &Method::GET, "/connections", None);
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()[CONTENT_TYPE], "application/json");
    let v: Value = serde_json::from_str(&body(r).await).unwrap();
    assert_eq!(v["closed_total"], 1);
    assert_eq!(v["open"][0]["src"]["port"], 40002);
    assert_eq!(v["open"][0]["state"], "open");
    let c = &v["recent"][0];
    assert_eq!(c["src"]["port"], 40001);
    assert_eq!(c["src"]["workload"], "client-0");
    assert_eq!(
        c["src"]["identity"],
        "spiffe://cluster.local/ns/default/sa/client"
    );
    assert_eq!(c["dst"]["ip"], "10.0.0.7");
    assert_eq!(c["upstream"], "10.0.0.7:15008");
    assert_eq!(c["bytes_sent"], 10);
    assert_eq!(c["trace_id"], "0000000000000000000000000000002a");
    assert_eq!(c["response_flags"], "-");
    let r = route(Listener::Admin, &ctx, &Method::POST, "/connections", None);
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    let r = route(Listener::Stats, &ctx, &Method::GET, "/connections", None);
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
}
