//! A sidecar pod in a namespace whose services use a waypoint, with real
//! Envoy at the sidecar and at the waypoint: traffic both ways goes
//! through the waypoint, so its L7 policy holds for sidecar callers too.
//!
//! ```text
//!  node-0                                         node-1
//!  legacy-0: app ─▶ :15001 Envoy ══HBONE (CONNECT llm VIP)══▶ waypoint-0 ══HBONE══▶ ztunnel ─▶ llm-v1
//!  client ─▶ ztunnel ══HBONE══▶ waypoint-0 ══HBONE══▶ legacy-0: Envoy :15008 ─▶ app
//! ```
//!
//! Needs root (CI runs it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use ambit_tests::eventually;
use ambit_tests::httpapp::{Client, HttpApp};
use ambit_tests::meshbed::{MeshBed, PodSpec, metric_sum};
use ambit_tests::netbed;
use anyhow::{Result, ensure};

const NS: &str = "shop";
const LLM: &str = "10.96.0.40";
const LEGACY: &str = "10.96.0.41";
const APP_PORT: u16 = 8080;
const LEGACY_ID: &str = "spiffe://cluster.local/ns/shop/sa/legacy";
const WAYPOINT_ID: &str = "spiffe://cluster.local/ns/shop/sa/waypoint";

fn vip(ip: &str) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), 80)
}

fn mesh_yaml() -> String {
    let service = |name: &str, ip: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {NS}\n  \
             labels: {{istio.io/use-waypoint: waypoint}}\nspec:\n  clusterIP: {ip}\n  \
             selector: {{app: {name}}}\n  ports: [{{name: http-api, port: 80, targetPort: {APP_PORT}}}]\n---\n"
        )
    };
    format!(
        "apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: waypoint, namespace: {NS}}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{{name: mesh, port: 15008, protocol: HBONE}}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: no-admin, namespace: {NS}}}
spec:
  targetRefs: [{{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}}]
  action: DENY
  rules:
  - to: [{{operation: {{paths: [\"/admin*\"]}}}}]
---
{}{}",
        service("llm", LLM),
        service("legacy", LEGACY)
    )
}

/// GET `path` from pod `from` to `dst`: the status and which app answered.
async fn get(
    bed: &MeshBed,
    from: &str,
    dst: SocketAddr,
    path: &str,
) -> Result<(u16, Option<String>)> {
    let mut c = Client::connect(bed.pod(from), dst).await?;
    let r = c.get(path, &[]).await?;
    Ok((r.status, r.served_by))
}

/// `from` → `dst`: `/` reaches the app, `/admin` is refused by the
/// waypoint's policy.
async fn through_the_waypoint(bed: &MeshBed, from: &str, dst: SocketAddr, app: &str) -> Result<()> {
    let first = eventually(Duration::from_secs(20), "the first reply", || async {
        get(bed, from, dst, "/")
            .await
            .ok()
            .filter(|(s, _)| *s == 200)
    })
    .await?;
    ensure!(
        first.1.as_deref() == Some(app),
        "{from} -> {dst}: answered by {:?}",
        first.1
    );
    let (status, by) = get(bed, from, dst, "/admin/reset").await?;
    ensure!(
        status == 403 && by.is_none(),
        "{from} -> {dst} /admin/reset: {status} from {by:?}; the waypoint's DENY did not apply"
    );
    println!("{from} -> {app}: 200 on /, 403 on /admin from the waypoint");
    Ok(())
}

async fn metrics(bed: &MeshBed, pod: &str) -> Result<String> {
    let (status, body) = bed
        .waypoint(pod)
        .get("metrics", "/stats/prometheus")
        .await?;
    ensure!(status == 200, "{pod}'s 15020 answered {status}");
    Ok(body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_traffic_goes_through_the_services_waypoint_both_ways() {
    if !netbed::can_run("sidecar_traffic_goes_through_the_services_waypoint_both_ways") {
        return;
    }
    let pods = [
        PodSpec::sidecar("legacy-0", NS, 0, "legacy"),
        PodSpec::mesh("client", NS, 0, "client"),
        PodSpec::waypoint("waypoint-0", NS, 1, "waypoint"),
        PodSpec::mesh("llm-v1", NS, 1, "llm"),
    ];
    let mut bed = MeshBed::new(2, &pods).unwrap();
    bed.start(&mesh_yaml()).await.unwrap();
    let _apps = [
        HttpApp::start(bed.pod("llm-v1"), APP_PORT, "llm-v1").unwrap(),
        HttpApp::start(bed.pod("legacy-0"), APP_PORT, "legacy").unwrap(),
    ];
    bed.start_waypoint("waypoint-0").await.unwrap();
    bed.start_sidecar("legacy-0").await.unwrap();

    let result = async {
        through_the_waypoint(&bed, "legacy-0", vip(LLM), "llm-v1").await?;
        through_the_waypoint(&bed, "client", vip(LEGACY), "legacy").await?;
        // The waypoint saw the sidecar's requests as the sidecar's identity;
        // the sidecar saw the waypoint's as the waypoint's.
        let at_waypoint = metrics(&bed, "waypoint-0").await?;
        let from_sidecar = metric_sum(
            &at_waypoint,
            "istio_requests_total",
            &[("reporter", "waypoint"), ("source_principal", LEGACY_ID)],
        );
        ensure!(
            from_sidecar >= 2.0,
            "the waypoint counted {from_sidecar} requests from the sidecar"
        );
        let at_sidecar = metrics(&bed, "legacy-0").await?;
        let via_waypoint = metric_sum(
            &at_sidecar,
            "istio_requests_total",
            &[
                ("reporter", "destination"),
                ("source_principal", WAYPOINT_ID),
            ],
        );
        ensure!(
            via_waypoint >= 1.0,
            "the sidecar counted {via_waypoint} requests from the waypoint"
        );
        Ok::<(), anyhow::Error>(())
    }
    .await;
    if let Err(e) = result {
        panic!(
            "{e:#}\n--- sidecar ---\n{}\n--- waypoint ---\n{}",
            bed.waypoint("legacy-0").log(),
            bed.waypoint("waypoint-0").log()
        );
    }
    bed.shutdown().await;
}
