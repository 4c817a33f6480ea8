//! Waypoint benchmark (issues 15 and 16): HTTP/1.1 keep-alive requests with
//! a 1 KiB response, closed loop over `CONNS` connections for `SECS`
//! seconds per path, all in one run on one bed:
//!
//! 1. **no mesh**: a plain client pod to a plain server pod's IP;
//! 2. **L4 mesh**: client → ztunnel ══HBONE══▶ ztunnel → server (service
//!    `direct`, no waypoint);
//! 3. **waypoint, bare**: through waypoint `wp-bare` (Envoy routing only:
//!    request telemetry off, no L7 policy);
//! 4. **waypoint, full**: through waypoint `wp-full` (an ALLOW
//!    AuthorizationPolicy with method and path rules, Istio request metrics
//!    and the JSON access log on).
//!
//! For each: requests/s, p50/p99 latency, and for the waypoints Envoy's and
//! the agent's CPU per 1,000 requests and RSS (from /proc). The difference
//! between 3 and 4 is the cost of observability and policy. Needs root,
//! `ip`, `iptables` and Envoy 1.40 (`ENVOY_BIN` or `envoy` on PATH).
//! Run: `cargo bench -p ambit-benches --bench waypoint` (`SECS`, `CONNS`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use ambit_tests::httpapp::{Behavior, Client, HttpApp};
use ambit_tests::meshbed::{MeshBed, PodSpec};
use ambit_tests::netbed::{self, PodNet};
use anyhow::{Context, Result};
use hyper::Method;

const NS: &str = "bench";
const APP_PORT: u16 = 8080;
const BODY: usize = 1024;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn pods() -> Vec<PodSpec> {
    vec![
        PodSpec::mesh("client", NS, 0, "client"),
        PodSpec::plain("plain-client", NS, 0, "plain-client"),
        PodSpec::waypoint("wp-full-0", NS, 1, "wp-full"),
        PodSpec::waypoint("wp-bare-0", NS, 1, "wp-bare"),
        PodSpec::mesh("server", NS, 1, "server"),
        PodSpec::plain("plain-server", NS, 1, "plain-server"),
    ]
}

fn yaml() -> String {
    let mut y = String::new();
    for (gw, telemetry) in [("wp-full", "true"), ("wp-bare", "false")] {
        y.push_str(&format!(
            "apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata:
  name: {gw}
  namespace: {NS}
  annotations: {{ambit.io/request-telemetry: \"{telemetry}\"}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{{name: mesh, port: 15008, protocol: HBONE}}]
---
"
        ));
    }
    for (name, ip, waypoint) in [
        ("direct", "10.96.0.30", None),
        ("full", "10.96.0.31", Some("wp-full")),
        ("bare", "10.96.0.32", Some("wp-bare")),
    ] {
        let labels = waypoint
            .map(|w| format!("  labels: {{istio.io/use-waypoint: {w}}}\n"))
            .unwrap_or_default();
        y.push_str(&format!(
            "apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: {NS}
{labels}spec:
  clusterIP: {ip}
  selector: {{app: server}}
  ports: [{{name: http-api, port: 80, targetPort: {APP_PORT}}}]
---
"
        ));
    }
    y.push_str(&format!(
        "apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: full-callers, namespace: {NS}}}
spec:
  targetRefs: [{{kind: Service, group: \"\", name: full}}]
  action: ALLOW
  rules:
  - from: [{{source: {{principals: [cluster.local/ns/{NS}/sa/client]}}}}]
    to: [{{operation: {{methods: [GET, POST], paths: [\"/v1/*\"]}}}}]
"
    ));
    y
}

/// What one path did.
struct Run {
    requests: usize,
    errors: usize,
    secs: f64,
    latencies: Vec<Duration>,
}

impl Run {
    fn rps(&self) -> f64 {
        self.requests as f64 / self.secs
    }
    fn pct(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.latencies.len() as f64 - 1.0) * p).round() as usize;
        self.latencies[i.min(self.latencies.len() - 1)]
    }
}

/// `conns` keep-alive connections sending GETs back to back for `secs`.
async fn closed_loop(from: &PodNet, dst: SocketAddr, conns: usize, secs: u64) -> Result<Run> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let start = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..conns {
        let pod = from.clone();
        set.spawn(async move {
            let mut c = Client::connect(&pod, dst).await?;
            let mut lat = Vec::new();
            let mut errors = 0;
            while Instant::now() < deadline {
                match c.send(Method::GET, "/v1/completions", &[]).await {
                    Ok(r) if r.status == 200 => lat.push(r.latency),
                    _ => {
                        errors += 1;
                        c = Client::connect(&pod, dst).await?;
                    }
                }
            }
            Ok::<_, anyhow::Error>((lat, errors))
        });
    }
    let mut run = Run {
        requests: 0,
        errors: 0,
        secs: 0.0,
        latencies: Vec::new(),
    };
    while let Some(r) = set.join_next().await {
        let (lat, errors) = r??;
        run.requests += lat.len();
        run.errors += errors;
        run.latencies.extend(lat);
    }
    run.secs = start.elapsed().as_secs_f64();
    run.latencies.sort();
    Ok(run)
}

/// CPU ticks (utime + stime) and RSS (KiB) of every process in `netns`
/// named `comm`.
fn usage_in_netns(netns: &std::path::Path, comm: &str) -> (u64, u64) {
    let Ok(ns) = std::fs::metadata(netns) else {
        return (0, 0);
    };
    let mut ticks = 0;
    let mut rss = 0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let p = entry.path();
        let same_ns = std::fs::metadata(p.join("ns/net")).is_ok_and(|m| m.ino() == ns.ino());
        let name = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        if !same_ns || name.trim() != comm {
            continue;
        }
        if let Ok(stat) = std::fs::read_to_string(p.join("stat")) {
            let f: Vec<&str> = stat
                .rsplit_once(')')
                .map(|(_, r)| r.split_whitespace().collect())
                .unwrap_or_default();
            ticks += f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            ticks += f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        }
        if let Ok(status) = std::fs::read_to_string(p.join("status")) {
            rss += status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    (ticks, rss)
}

fn main() -> Result<()> {
    if !netbed::can_run("waypoint bench") {
        println!("SKIP: the waypoint bench needs root, ip and iptables");
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(bench())
}

async fn bench() -> Result<()> {
    let secs = env_or("SECS", 5);
    let conns = env_or("CONNS", 4) as usize;
    let mut bed = MeshBed::new(2, &pods())?;
    bed.start(&yaml()).await?;
    let server = HttpApp::start(bed.pod("server"), APP_PORT, "server")?;
    let plain = HttpApp::start(bed.pod("plain-server"), APP_PORT, "plain-server")?;
    server.set(Behavior::Sized(BODY));
    plain.set(Behavior::Sized(BODY));
    for wp in ["wp-full-0", "wp-bare-0"] {
        bed.start_waypoint(wp).await?;
    }
    let vip = |ip: &str| SocketAddr::new(ip.parse().unwrap(), 80);
    let plain_dst = SocketAddr::new(bed.ip("plain-server").into(), APP_PORT);
    // Warm every path until it answers.
    for (from, dst) in [
        ("plain-client", plain_dst),
        ("client", vip("10.96.0.30")),
        ("client", vip("10.96.0.31")),
        ("client", vip("10.96.0.32")),
    ] {
        ambit_tests::eventually(Duration::from_secs(30), "a first 200", || async {
            let mut c = Client::connect(bed.pod(from), dst).await.ok()?;
            c.send(Method::GET, "/v1/completions", &[])
                .await
                .ok()
                .filter(|r| r.status == 200)
        })
        .await
        .with_context(|| format!("{from} -> {dst}"))?;
    }
    println!(
        "waypoint bench: HTTP/1.1 keep-alive GET, {BODY} B responses, {conns} connections closed loop, {secs} s per path"
    );
    println!(
        "| path | req/s | p50 | p99 | errors | Envoy CPU ms / 1k req | agent CPU ms / 1k req | Envoy RSS | agent RSS |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    // Linux reports process CPU in USER_HZ ticks, 100 a second.
    let tick_ms = 10.0;
    for (label, from, dst, wp) in [
        ("no mesh", "plain-client", plain_dst, None),
        ("L4 mesh (ztunnel only)", "client", vip("10.96.0.30"), None),
        (
            "waypoint, bare (no policy, telemetry off)",
            "client",
            vip("10.96.0.32"),
            Some("wp-bare-0"),
        ),
        (
            "waypoint, full (L7 ALLOW policy + metrics + access log)",
            "client",
            vip("10.96.0.31"),
            Some("wp-full-0"),
        ),
    ] {
        let netns = wp.map(|w| bed.pod(w).path());
        let before = netns
            .as_ref()
            .map(|n| (usage_in_netns(n, "envoy"), usage_in_netns(n, "ambit-agent")));
        let run = closed_loop(bed.pod(from), dst, conns, secs).await?;
        let after = netns
            .as_ref()
            .map(|n| (usage_in_netns(n, "envoy"), usage_in_netns(n, "ambit-agent")));
        let per_k = |b: u64, a: u64| {
            (a.saturating_sub(b)) as f64 * tick_ms / (run.requests as f64 / 1000.0)
        };
        let cells = match (before, after) {
            (Some(((eb, _), (ab, _))), Some(((ea, er), (aa, ar)))) => format!(
                "{:.1} | {:.2} | {} MiB | {} MiB",
                per_k(eb, ea),
                per_k(ab, aa),
                er / 1024,
                ar / 1024
            ),
            _ => "- | - | - | -".to_string(),
        };
        println!(
            "| {label} | {:.0} | {:.2} ms | {:.2} ms | {} | {cells} |",
            run.rps(),
            run.pct(0.50).as_secs_f64() * 1e3,
            run.pct(0.99).as_secs_f64() * 1e3,
            run.errors,
        );
    }
    bed.shutdown().await;
    Ok(())
}
