//! A sidecar pod and ambient pods in one mesh, both ways, with real Envoy:
//! the sidecar pod's capture (`ambit-agent redirect`), its agent and Envoy
//! (kind `sidecar`, configured by the sidecar generator) run in its netns.
//!
//! ```text
//!  node-0                                        node-1
//!  legacy-0: app ─▶ :15001 Envoy ══HBONE══════▶ ztunnel ─▶ web-0 (ambient)
//!  legacy-0: app ◀─ Envoy :15008 ◀══HBONE═══════ ztunnel ◀─ client (ambient)
//! ```
//!
//! Needs root (CI runs it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use ambit_tests::eventually;
use ambit_tests::httpapp::{self, HttpApp};
use ambit_tests::meshbed::{MeshBed, PodSpec, metric_sum};
use ambit_tests::netbed::{self, Capture};
use anyhow::{Context, Result, ensure};

const NS: &str = "shop";
const WEB: &str = "10.96.0.30";
const LEGACY: &str = "10.96.0.31";
const LLM: &str = "10.96.0.32";
const LEGACY_HTTP: &str = "10.96.0.33";
const APP_PORT: u16 = 8080;
/// The sidecar pod's HTTP app (behind `legacy-http`).
const HTTP_PORT: u16 = 8081;
const LLM_HOST: &str = "llm.shop.svc.cluster.local";
const LEGACY_ID: &str = "spiffe://cluster.local/ns/shop/sa/legacy";
const CLIENT_ID: &str = "spiffe://cluster.local/ns/shop/sa/client";

fn vip(ip: &str) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), 80)
}

fn service(name: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {NS}\nspec:\n  \
         clusterIP: {ip}\n  selector: {{app: {name}}}\n  ports:\n  \
         - {{name: tcp-echo, port: 80, targetPort: {APP_PORT}}}\n---\n"
    )
}

/// Sends a unique marker through `from` → `dst` and back; checks that no
/// node saw it in plaintext.
async fn echo_in_mtls(bed: &MeshBed, from: &str, dst: SocketAddr, what: &str) -> Result<()> {
    let marker = format!("{what}-marker-{:08x}", rand::random::<u32>());
    let caps = [
        Capture::start(bed.cluster.node_netns(0))?,
        Capture::start(bed.cluster.node_netns(1))?,
    ];
    let echoed = bed
        .echo_once(from, dst, marker.as_bytes())
        .await
        .with_context(|| format!("{what}: no echo"))?;
    ensure!(echoed == marker.as_bytes(), "{what}: echo differs");
    for (node, cap) in caps.into_iter().enumerate() {
        let frames = cap.frames();
        let seen = cap.seen(marker.as_bytes());
        ensure!(frames > 0, "{what}: node-{node} captured nothing");
        ensure!(
            !seen,
            "{what}: the payload crossed node-{node} in plaintext"
        );
    }
    println!("{what}: echoed, and never in plaintext between the nodes");
    Ok(())
}

/// The `llm` service (HTTP) with subsets v1/v2 split 80/20.
fn llm_canary() -> String {
    format!(
        "apiVersion: v1
kind: Service
metadata: {{name: llm, namespace: {NS}}}
spec:
  clusterIP: {LLM}
  selector: {{app: llm}}
  ports: [{{name: http-api, port: 80, targetPort: {APP_PORT}}}]
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {{name: llm, namespace: {NS}}}
spec:
  host: llm
  subsets:
  - {{name: v1, labels: {{version: v1}}}}
  - {{name: v2, labels: {{version: v2}}}}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{name: llm, namespace: {NS}}}
spec:
  hosts: [llm]
  http:
  - route:
    - {{destination: {{host: llm, subset: v1}}, weight: 80}}
    - {{destination: {{host: llm, subset: v2}}, weight: 20}}
---
"
    )
}

/// The 80/20 canary holds for a sidecar client: its own Envoy routes (the
/// waypoint's translation) and reaches both ambient versions over HBONE;
/// its `istio_requests_total{reporter="source"}` counts each version's
/// replies exactly, naming the sidecar pod as the source.
async fn canary_from_the_sidecar(bed: &MeshBed) -> Result<()> {
    const N: usize = 2000;
    let source = [
        ("reporter", "source"),
        ("source_workload", "legacy-0"),
        ("source_workload_namespace", NS),
        ("source_principal", LEGACY_ID),
        ("destination_service", LLM_HOST),
        ("destination_service_name", "llm"),
        ("response_code", "200"),
    ];
    let before = sidecar_metrics(bed).await?;
    let t = std::time::Instant::now();
    let replies = httpapp::many(bed.pod("legacy-0"), vip(LLM), N, 8, "/", &[]).await;
    let (by, failures) = httpapp::tally(&replies);
    ensure!(failures.is_empty(), "{failures:?}");
    let count = |who: &str| by.get(&format!("{who} 200")).copied().unwrap_or(0);
    let (v1, v2) = (count("llm-v1"), count("llm-v2"));
    ensure!(v1 + v2 == N, "{by:?}");
    let p2 = 100.0 * v2 as f64 / N as f64;
    println!(
        "80/20 from the sidecar: {N} requests in {:?}: v1 {v1}, v2 {v2} ({p2:.2} %)",
        t.elapsed()
    );
    ensure!((p2 - 20.0).abs() <= 3.0, "v2 got {p2:.2} %, want 20 ± 3");
    let after = settled(bed, &source, &before, N).await?;
    for (version, served) in [("v1", v1), ("v2", v2)] {
        let workload = format!("llm-{version}");
        let mut labels = source.to_vec();
        labels.push(("destination_version", version));
        labels.push(("destination_workload", &workload));
        let counted = metric_sum(&after, "istio_requests_total", &labels)
            - metric_sum(&before, "istio_requests_total", &labels);
        println!("reporter=source: {version} counted {counted}, served {served}");
        ensure!(
            counted == served as f64,
            "{version}: istio_requests_total{{reporter=\"source\"}} rose by {counted}, the app served {served}"
        );
    }
    Ok(())
}

/// HTTP from an ambient pod to the sidecar pod's app: the sidecar counts
/// every request with `reporter="destination"`, naming itself as the
/// destination and the caller by the identity its HBONE tunnel proved.
async fn destination_metrics(bed: &MeshBed) -> Result<()> {
    const N: usize = 200;
    let dst = [
        ("reporter", "destination"),
        ("destination_workload", "legacy-0"),
        ("destination_principal", LEGACY_ID),
        ("destination_service", "legacy-http.shop.svc.cluster.local"),
        ("source_principal", CLIENT_ID),
        ("connection_security_policy", "mutual_tls"),
        ("response_code", "200"),
    ];
    let before = sidecar_metrics(bed).await?;
    let dst_vip = SocketAddr::new(LEGACY_HTTP.parse()?, 80);
    let replies = httpapp::many(bed.pod("client"), dst_vip, N, 4, "/", &[]).await;
    let (by, failures) = httpapp::tally(&replies);
    ensure!(failures.is_empty(), "{failures:?}");
    ensure!(by.get("legacy-http 200") == Some(&N), "{by:?}");
    settled(bed, &dst, &before, N).await?;
    println!("reporter=destination: {N} requests from the ambient client counted");
    Ok(())
}

/// The sidecar's merged metrics (agent + Envoy) from 15020.
async fn sidecar_metrics(bed: &MeshBed) -> Result<String> {
    let (status, body) = bed
        .waypoint("legacy-0")
        .get("metrics", "/stats/prometheus")
        .await?;
    ensure!(status == 200, "the sidecar's 15020 answered {status}");
    Ok(body)
}

/// Metrics once `istio_requests_total` with `labels` rose by `n` since
/// `before` (a request is counted as it completes, just after its reply).
async fn settled(bed: &MeshBed, labels: &[(&str, &str)], before: &str, n: usize) -> Result<String> {
    let base = metric_sum(before, "istio_requests_total", labels);
    let last = std::cell::Cell::new(0.0);
    let got = eventually(
        Duration::from_secs(5),
        "the requests to be counted",
        || async {
            let text = sidecar_metrics(bed).await.ok()?;
            last.set(metric_sum(&text, "istio_requests_total", labels) - base);
            (last.get() == n as f64).then_some(text)
        },
    )
    .await;
    got.with_context(|| {
        format!(
            "istio_requests_total{labels:?} rose by {}, want {n}",
            last.get()
        )
    })
}

/// The sidecar's Envoy carried both: out through 15001 and the web
/// cluster (HBONE to web's identity), in through 15008 to the app.
async fn through_the_sidecars_envoy(bed: &MeshBed) -> Result<()> {
    let sidecar = bed.waypoint("legacy-0");
    for stat in [
        "listener.0.0.0.0_15001.downstream_cx_total",
        "tcp.outbound|80||web.shop.svc.cluster.local.downstream_cx_total",
        "listener.envoy_internal_connect_originate;spiffe_cluster.local/ns/shop/sa/web.downstream_cx_total",
        "listener.0.0.0.0_15008.downstream_cx_total",
        "tcp.InboundPassthroughCluster.downstream_cx_total",
    ] {
        let n = sidecar.stat(stat).await?;
        ensure!(n >= 1, "Envoy's {stat} is {n}");
    }
    Ok(())
}

/// A client outside the mesh reaches the sidecar pod in plaintext while
/// its PeerAuthentication is PERMISSIVE (the default), and is refused once
/// it is STRICT.
async fn strict_refuses_plaintext(bed: &MeshBed) -> Result<()> {
    let app = bed.pod("legacy-0").addr(APP_PORT);
    let msg = b"plaintext-from-outside";
    let echoed = bed.echo_once("outsider", app, msg).await?;
    ensure!(echoed == msg, "PERMISSIVE: the plaintext echo differs");
    bed.write_config(
        "strict.yaml",
        &format!(
            "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: \
             {{name: default, namespace: {NS}}}\nspec: {{mtls: {{mode: STRICT}}}}\n"
        ),
    )?;
    let t = std::time::Instant::now();
    eventually(
        Duration::from_secs(15),
        "STRICT refuses plaintext",
        || async {
            bed.echo_once("outsider", app, msg)
                .await
                .is_err()
                .then_some(())
        },
    )
    .await?;
    println!(
        "STRICT: plaintext refused {:?} after the policy was written",
        t.elapsed()
    );
    // Mesh traffic still flows.
    let echoed = bed
        .echo_once("client", vip(LEGACY), b"mesh-still-flows")
        .await?;
    ensure!(
        echoed == b"mesh-still-flows",
        "STRICT: the mesh echo differs"
    );
    Ok(())
}

/// Kill the sidecar (agent and Envoy, as a crashed container) and start
/// it again: its app's outbound fails while it is down (the capture stays,
/// nothing bypasses the proxy) and works again once it is ready, with no
/// manual step.
async fn restart_reconverges(bed: &mut MeshBed) -> Result<()> {
    bed.waypoint_mut("legacy-0").kill().await?;
    let down = bed.echo_once("legacy-0", vip(WEB), b"while-down").await;
    ensure!(down.is_err(), "the app reached web with its sidecar down");
    let t = std::time::Instant::now();
    bed.waypoint_mut("legacy-0").start_again().await?;
    let ready = bed
        .waypoint("legacy-0")
        .wait_ready(Duration::from_secs(30))
        .await?;
    let first = eventually(
        Duration::from_secs(20),
        "traffic after the restart",
        || async {
            let echo = bed.echo_once("legacy-0", vip(WEB), b"after-restart").await;
            echo.ok()
                .filter(|e| e == b"after-restart")
                .map(|_| t.elapsed())
        },
    )
    .await?;
    println!("sidecar restart: ready after {ready:?}, first echo {first:?} after the start");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_pod_and_ambient_pods_reach_each_other_over_hbone() {
    if !netbed::can_run("a_sidecar_pod_and_ambient_pods_reach_each_other_over_hbone") {
        return;
    }
    let pods = [
        PodSpec::sidecar("legacy-0", NS, 0, "legacy"),
        PodSpec::mesh("web-0", NS, 1, "web"),
        PodSpec::mesh("client", NS, 1, "client"),
        PodSpec::plain("outsider", "elsewhere", 1, "outsider"),
        PodSpec::mesh("llm-v1", NS, 1, "llm"),
        PodSpec::mesh("llm-v2", NS, 1, "llm").version("v2"),
    ];
    let mut bed = MeshBed::new(2, &pods).unwrap();
    let yaml = service("web", WEB)
        + &service("legacy", LEGACY)
        + &llm_canary()
        + &format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: legacy-http, namespace: {NS}}}\n\
             spec:\n  clusterIP: {LEGACY_HTTP}\n  selector: {{app: legacy}}\n  \
             ports: [{{name: http-api, port: 80, targetPort: {HTTP_PORT}}}]\n---\n"
        );
    bed.start(&yaml).await.unwrap();
    let _web = netbed::echo_server(bed.pod("web-0"), APP_PORT)
        .await
        .unwrap();
    let _legacy = netbed::echo_server(bed.pod("legacy-0"), APP_PORT)
        .await
        .unwrap();
    let _llm = [
        HttpApp::start(bed.pod("llm-v1"), APP_PORT, "llm-v1").unwrap(),
        HttpApp::start(bed.pod("llm-v2"), APP_PORT, "llm-v2").unwrap(),
        HttpApp::start(bed.pod("legacy-0"), HTTP_PORT, "legacy-http").unwrap(),
    ];
    bed.start_sidecar("legacy-0").await.unwrap();

    let result = async {
        echo_in_mtls(&bed, "legacy-0", vip(WEB), "sidecar -> ambient").await?;
        echo_in_mtls(&bed, "client", vip(LEGACY), "ambient -> sidecar").await?;
        through_the_sidecars_envoy(&bed).await?;
        canary_from_the_sidecar(&bed).await?;
        destination_metrics(&bed).await?;
        strict_refuses_plaintext(&bed).await?;
        restart_reconverges(&mut bed).await?;
        Ok::<(), anyhow::Error>(())
    }
    .await;
    if let Err(e) = result {
        panic!(
            "{e:#}\n--- sidecar agent and Envoy log ---\n{}",
            bed.waypoint("legacy-0").log()
        );
    }
}
