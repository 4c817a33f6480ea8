//! End to end through a real waypoint: a client pod calls service VIPs
//! bound to a waypoint (`istio.io/use-waypoint`); its ztunnel opens HBONE
//! to the waypoint pod — upstream Envoy 1.40 run by `ambit-agent` inside a
//! pod netns, with the waypoint's identity from the mesh CA — which routes
//! by the control plane's VirtualService translation and opens HBONE to
//! the chosen endpoint's ztunnel.
//!
//! ```text
//!  node-0                                   node-1
//!  client ─▶ ztunnel ══HBONE (VIP:80)══▶ waypoint-0 (agent + Envoy)
//!                                          │ ══HBONE (pod:8080)══▶ ztunnel ─▶ llm-v2, flaky-b, slow-0, db-0
//!  llm-v1, flaky-a ◀─ ztunnel ◀══HBONE═════┘
//!  wl-waypoint-0 (waypoint-for: workload) ◀══ traffic to db-0's pod IP
//! ```
//!
//! One bed serves every check, in order; each prints what it measured.
//! The waypoint restart comes last (it disturbs the others).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ambit_tests::httpapp::{self, Behavior, HttpApp, Reply};
use ambit_tests::meshbed::{MeshBed, PodSpec, metric_sum};
use ambit_tests::netbed::{self, App, Capture};
use anyhow::{Context, Result, ensure};

const NS: &str = "shop";
const LLM: &str = "10.96.0.20";
const FLAKY: &str = "10.96.0.21";
const SLOW: &str = "10.96.0.22";
const FAULTY: &str = "10.96.0.23";
const APP_PORT: u16 = 8080;
const DB_PORT: u16 = 5432;
const WAYPOINT_ID: &str = "spiffe://cluster.local/ns/shop/sa/waypoint";

fn vip(ip: &str) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), 80)
}

fn pods() -> Vec<PodSpec> {
    vec![
        PodSpec::mesh("client", NS, 0, "client"),
        PodSpec::waypoint("waypoint-0", NS, 1, "waypoint"),
        PodSpec::waypoint("wl-waypoint-0", NS, 0, "wl-waypoint"),
        PodSpec::mesh("llm-v1", NS, 0, "llm"),
        PodSpec::mesh("llm-v2", NS, 1, "llm").version("v2"),
        PodSpec::mesh("flaky-a", NS, 0, "flaky"),
        PodSpec::mesh("flaky-b", NS, 1, "flaky"),
        PodSpec::mesh("slow-0", NS, 1, "slow"),
        PodSpec::mesh("db-0", NS, 1, "db").label("istio.io/use-waypoint", "wl-waypoint"),
    ]
}

fn service(name: &str, ip: &str, app: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {NS}\n  labels: {{istio.io/use-waypoint: waypoint}}\nspec:\n  clusterIP: {ip}\n  selector: {{app: {app}}}\n  ports:\n  - {{name: http-api, port: 80, targetPort: {APP_PORT}}}\n---\n"
    )
}

/// Everything but the `llm` VirtualService (its own file, edited by the
/// test).
fn mesh_yaml() -> String {
    let mut y = String::new();
    for (name, scope) in [("waypoint", "service"), ("wl-waypoint", "workload")] {
        y.push_str(&format!(
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata:\n  name: {name}\n  namespace: {NS}\n  labels: {{istio.io/waypoint-for: {scope}}}\nspec:\n  gatewayClassName: istio-waypoint\n  listeners:\n  - {{name: mesh, port: 15008, protocol: HBONE}}\n---\n"
        ));
    }
    y.push_str(&service("llm", LLM, "llm"));
    y.push_str(&service("flaky", FLAKY, "flaky"));
    y.push_str(&service("slow", SLOW, "slow"));
    y.push_str(&service("faulty", FAULTY, "llm"));
    y.push_str(&format!(
        "apiVersion: networking.istio.io/v1
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
metadata: {{name: flaky, namespace: {NS}}}
spec:
  hosts: [flaky]
  http:
  - route: [{{destination: {{host: flaky}}}}]
    retries: {{attempts: 2, retryOn: 5xx}}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{name: slow, namespace: {NS}}}
spec:
  hosts: [slow]
  http:
  - match: [{{headers: {{x-case: {{exact: per-try}}}}}}]
    route: [{{destination: {{host: slow}}}}]
    timeout: 5s
    retries: {{attempts: 1, perTryTimeout: 400ms, retryOn: 5xx}}
  - route: [{{destination: {{host: slow}}}}]
    timeout: 1s
    retries: {{attempts: 0}}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{name: faulty, namespace: {NS}}}
spec:
  hosts: [faulty]
  http:
  - route: [{{destination: {{host: faulty}}}}]
    fault:
      delay: {{percentage: {{value: 25}}, fixedDelay: 200ms}}
      abort: {{percentage: {{value: 10}}, httpStatus: 418}}
---
# The llm pods take traffic only from the waypoint (the L4 policy that
# stops clients from going around it): ztunnel evaluates it with the
# waypoint's identity as the source.
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: llm-only-via-waypoint, namespace: {NS}}}
spec:
  selector: {{matchLabels: {{app: llm}}}}
  action: ALLOW
  rules:
  - from: [{{source: {{principals: [cluster.local/ns/{NS}/sa/waypoint]}}}}]
---
"
    ));
    y
}

/// The `llm` VirtualService: premium users to v2, the rest split.
fn vs_llm(v1: u32, v2: u32) -> String {
    format!(
        "apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{name: llm, namespace: {NS}}}
spec:
  hosts: [llm]
  http:
  - match: [{{headers: {{x-user-tier: {{exact: premium}}}}}}]
    route: [{{destination: {{host: llm, subset: v2}}}}]
  - route:
    - {{destination: {{host: llm, subset: v1}}, weight: {v1}}}
    - {{destination: {{host: llm, subset: v2}}, weight: {v2}}}
"
    )
}

/// The apps of the bed's pods.
struct Apps {
    http: BTreeMap<&'static str, HttpApp>,
    _db: App,
}

impl Apps {
    async fn start(bed: &MeshBed) -> Result<Apps> {
        let mut http = BTreeMap::new();
        for name in ["llm-v1", "llm-v2", "flaky-a", "flaky-b", "slow-0"] {
            http.insert(name, HttpApp::start(bed.pod(name), APP_PORT, name)?);
        }
        Ok(Apps {
            http,
            _db: bed.echo("db-0", DB_PORT).await?,
        })
    }

    fn get(&self, name: &str) -> &HttpApp {
        &self.http[name]
    }
}

fn served(replies: &[Result<Reply>], who: &str, status: u16) -> usize {
    replies
        .iter()
        .filter(|r| {
            r.as_ref()
                .is_ok_and(|r| r.status == status && r.served_by.as_deref() == Some(who))
        })
        .count()
}

fn failures(replies: &[Result<Reply>]) -> Vec<String> {
    httpapp::tally(replies).1
}

/// A cluster stat of the waypoint `waypoint-0`.
async fn cluster_stat(bed: &MeshBed, cluster: &str, stat: &str) -> Result<u64> {
    bed.waypoint("waypoint-0")
        .stat(&format!("cluster.{cluster}.{stat}"))
        .await
}

fn cluster(subset: &str, host: &str) -> String {
    format!("outbound|80|{subset}|{host}.{NS}.svc.cluster.local")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn traffic_to_waypoint_bound_destinations_goes_through_a_real_waypoint() {
    if !netbed::can_run("traffic_to_waypoint_bound_destinations_goes_through_a_real_waypoint") {
        return;
    }
    let started = Instant::now();
    let mut bed = MeshBed::new(2, &pods()).unwrap();
    bed.write_config("vs-llm.yaml", &vs_llm(80, 20)).unwrap();
    bed.start(&mesh_yaml()).await.unwrap();
    let apps = Apps::start(&bed).await.unwrap();
    let outcome = run(&mut bed, &apps).await;
    if let Err(e) = outcome {
        for name in ["waypoint-0", "wl-waypoint-0"] {
            if let Some(log) = bed.waypoint_log(name) {
                eprintln!("---- {name}: agent and Envoy log ----\n{log}");
            }
        }
        panic!("{e:#}");
    }
    println!("waypoint e2e: total runtime {:?}", started.elapsed());
    bed.shutdown().await;
}

async fn run(bed: &mut MeshBed, apps: &Apps) -> Result<()> {
    for name in ["waypoint-0", "wl-waypoint-0"] {
        let t = Instant::now();
        bed.start_waypoint(name).await?;
        println!("{name}: agent + Envoy ready in {:?}", t.elapsed());
    }
    passes_the_waypoint(bed, apps).await?;
    mtls_on_every_hop(bed).await?;
    split_80_20(bed).await?;
    header_match(bed).await?;
    edit_takes_effect_without_failures(bed).await?;
    retry_turns_503_into_200(bed, apps).await?;
    timeouts_fire_on_time(bed, apps).await?;
    faults_hit_their_percentages(bed).await?;
    going_around_the_waypoint_is_denied(bed).await?;
    workload_waypoint(bed).await?;
    restart_reconverges(bed).await?;
    no_waypoint_pod_fails_closed(bed, apps).await?;
    Ok(())
}

/// The first requests: Envoy's service cluster counts them, the app sees
/// them, the client's ztunnel reports the waypoint as the peer of the
/// service's connections, and the server's ztunnel sees the waypoint's
/// identity as the source.
async fn passes_the_waypoint(bed: &MeshBed, apps: &Apps) -> Result<()> {
    let client = bed.pod("client");
    // Config converges asynchronously (EDS): wait for the first 200.
    ambit_tests::eventually(
        Duration::from_secs(20),
        "a first request via the waypoint",
        || async {
            let mut c = None;
            let r =
                httpapp::once(&mut c, client, vip(LLM), "/", &[("x-user-tier", "premium")]).await;
            r.ok().filter(|r| r.status == 200)
        },
    )
    .await?;
    let v2 = cluster("v2", "llm");
    let before_stat = cluster_stat(bed, &v2, "upstream_rq_200").await?;
    let before_hits = apps.get("llm-v2").hits();
    let replies = httpapp::many(client, vip(LLM), 20, 2, "/", &[("x-user-tier", "premium")]).await;
    ensure!(failures(&replies).is_empty(), "{:?}", failures(&replies));
    let stat = cluster_stat(bed, &v2, "upstream_rq_200").await? - before_stat;
    let hits = apps.get("llm-v2").hits() - before_hits;
    println!(
        "passes the waypoint: 20 requests; Envoy {v2} upstream_rq_200 +{stat}; llm-v2 saw {hits}"
    );
    ensure!(
        stat == 20 && hits == 20,
        "Envoy counted {stat}, the app saw {hits}, of 20"
    );

    let m = bed.metrics(0).await?;
    let out = metric_sum(
        &m,
        "istio_tcp_connections_opened_total",
        &[
            ("reporter", "source"),
            ("destination_service", "llm.shop.svc.cluster.local"),
            ("destination_principal", WAYPOINT_ID),
        ],
    );
    let m1 = bed.metrics(1).await?;
    let inbound = metric_sum(
        &m1,
        "istio_tcp_connections_opened_total",
        &[
            ("reporter", "destination"),
            ("source_principal", WAYPOINT_ID),
            ("destination_workload", "llm-v2"),
        ],
    );
    println!(
        "passes the waypoint: client ztunnel opened {out} connection(s) to llm via the waypoint; llm-v2's ztunnel accepted {inbound} from the waypoint's identity"
    );
    ensure!(
        out >= 1.0 && inbound >= 1.0,
        "ztunnel metrics do not show the waypoint hop"
    );
    Ok(())
}

/// No plaintext HTTP on either node (every link of client → waypoint →
/// server, across the lan and within node-1's bridge).
async fn mtls_on_every_hop(bed: &MeshBed) -> Result<()> {
    let marker = format!("/mtls-marker-{:08x}", rand::random::<u32>());
    let caps = [
        Capture::start(bed.cluster.node_netns(0))?,
        Capture::start(bed.cluster.node_netns(1))?,
    ];
    let client = bed.pod("client");
    let mut replies = httpapp::many(client, vip(LLM), 20, 1, &marker, &[]).await;
    replies.extend(
        httpapp::many(
            client,
            vip(LLM),
            20,
            1,
            &marker,
            &[("x-user-tier", "premium")],
        )
        .await,
    );
    ensure!(failures(&replies).is_empty(), "{:?}", failures(&replies));
    let v1 = served(&replies, "llm-v1", 200);
    let [c0, c1] = caps;
    let (n0, n1) = (c0.frames(), c1.frames());
    let (d0, d1) = (c0.stop(), c1.stop());
    for (node, data) in [(0, &d0), (1, &d1)] {
        for needle in [marker.as_bytes(), b"HTTP/1.1", b"x-served-by"] {
            ensure!(
                !netbed::contains(data, needle),
                "plaintext {:?} seen on node-{node}",
                String::from_utf8_lossy(needle)
            );
        }
    }
    println!(
        "mTLS: 40 requests (llm-v1 on node-0 served {v1}, llm-v2 on node-1 {}); captured {n0} frames / {} bytes on node-0, {n1} / {} on node-1; no marker, no HTTP/1.1 in clear",
        40 - v1,
        d0.len(),
        d1.len()
    );
    ensure!(
        v1 > 0 && d0.len() > 40 * 100 && d1.len() > 40 * 100,
        "too little traffic captured"
    );
    Ok(())
}

async fn split_80_20(bed: &MeshBed) -> Result<()> {
    const N: usize = 4000;
    let t = Instant::now();
    let replies = httpapp::many(bed.pod("client"), vip(LLM), N, 16, "/", &[]).await;
    let took = t.elapsed();
    ensure!(failures(&replies).is_empty(), "{:?}", failures(&replies));
    let (v1, v2) = (
        served(&replies, "llm-v1", 200),
        served(&replies, "llm-v2", 200),
    );
    let p2 = 100.0 * v2 as f64 / N as f64;
    println!(
        "80/20 split: {N} requests in {took:?}: v1 {v1} ({:.2} %), v2 {v2} ({p2:.2} %)",
        100.0 * v1 as f64 / N as f64
    );
    ensure!(v1 + v2 == N, "{:?}", httpapp::tally(&replies).0);
    ensure!((p2 - 20.0).abs() <= 3.0, "v2 got {p2:.2} %, want 20 ± 3");
    Ok(())
}

async fn header_match(bed: &MeshBed) -> Result<()> {
    let replies = httpapp::many(
        bed.pod("client"),
        vip(LLM),
        200,
        4,
        "/",
        &[("x-user-tier", "premium")],
    )
    .await;
    let v2 = served(&replies, "llm-v2", 200);
    let other = httpapp::many(
        bed.pod("client"),
        vip(LLM),
        200,
        4,
        "/",
        &[("x-user-tier", "free")],
    )
    .await;
    let free_v2 = served(&other, "llm-v2", 200);
    println!(
        "header match: x-user-tier: premium → v2 {v2}/200; x-user-tier: free → v2 {free_v2}/200 (split)"
    );
    ensure!(v2 == 200, "{:?}", httpapp::tally(&replies));
    ensure!(
        failures(&other).is_empty() && free_v2 < 100,
        "{:?}",
        httpapp::tally(&other)
    );
    Ok(())
}

/// A steady request stream over 8 keep-alive connections while the split
/// becomes 100/0: the last v2 answer comes within 1 s of the write, and no
/// request fails.
async fn edit_takes_effect_without_failures(bed: &MeshBed) -> Result<()> {
    let client = bed.pod("client").clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let client = client.clone();
        let stop = stop.clone();
        tasks.spawn(async move {
            let mut out = Vec::new();
            let mut c = None;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                out.push(httpapp::once(&mut c, &client, vip(LLM), "/", &[]).await);
            }
            out
        });
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let written = Instant::now();
    bed.write_config("vs-llm.yaml", &vs_llm(100, 0))?;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut replies = Vec::new();
    while let Some(r) = tasks.join_next().await {
        replies.extend(r?);
    }
    let fails = failures(&replies);
    let bad_status = replies
        .iter()
        .filter(|r| r.as_ref().is_ok_and(|r| r.status != 200))
        .count();
    let last_v2 = replies
        .iter()
        .flatten()
        .filter(|r| r.served_by.as_deref() == Some("llm-v2"))
        .map(|r| r.sent + r.latency)
        .max();
    let converged = last_v2.map(|t| t.saturating_duration_since(written));
    let after = replies
        .iter()
        .flatten()
        .filter(|r| r.sent > written + Duration::from_secs(1))
        .count();
    println!(
        "VirtualService edit 80/20 → 100/0: {} requests during the edit, {} failed, {bad_status} non-200; last v2 answer {converged:?} after the write; {after} requests after +1 s, all v1",
        replies.len(),
        fails.len()
    );
    ensure!(fails.is_empty() && bad_status == 0, "{fails:?}");
    let converged = converged.context("no v2 answer at all before the edit")?;
    ensure!(
        converged < Duration::from_secs(1),
        "v2 still answered {converged:?} after the write"
    );
    ensure!(after > 0, "no traffic after the edit");
    Ok(())
}

async fn retry_turns_503_into_200(bed: &MeshBed, apps: &Apps) -> Result<()> {
    apps.get("flaky-b").set(Behavior::Status(503));
    let c = cluster("", "flaky");
    let retries0 = cluster_stat(bed, &c, "upstream_rq_retry").await?;
    let b0 = apps.get("flaky-b").hits();
    let replies = httpapp::many(bed.pod("client"), vip(FLAKY), 100, 1, "/", &[]).await;
    let retries = cluster_stat(bed, &c, "upstream_rq_retry").await? - retries0;
    let success = cluster_stat(bed, &c, "upstream_rq_retry_success").await?;
    let b = apps.get("flaky-b").hits() - b0;
    let ok = served(&replies, "flaky-a", 200);
    println!(
        "retry: 100 requests, flaky-b answered 503 to {b}; client got 200 from flaky-a {ok}/100; Envoy upstream_rq_retry +{retries} (retry_success {success})"
    );
    apps.get("flaky-b").set(Behavior::Ok);
    ensure!(ok == 100, "{:?}", httpapp::tally(&replies));
    ensure!(b > 0 && retries >= b, "503s {b}, retries {retries}");
    Ok(())
}

async fn timeouts_fire_on_time(bed: &MeshBed, apps: &Apps) -> Result<()> {
    let slow = apps.get("slow-0");
    slow.set(Behavior::Delay(Duration::from_secs(3)));
    let client = bed.pod("client");
    // Route timeout 1 s (no retries).
    let replies = httpapp::many(client, vip(SLOW), 4, 4, "/", &[]).await;
    let lat: Vec<Duration> = replies.iter().flatten().map(|r| r.latency).collect();
    println!(
        "timeout 1s: {:?} with statuses {:?}",
        lat,
        httpapp::tally(&replies).0
    );
    ensure!(lat.len() == 4, "{:?}", failures(&replies));
    for r in replies.iter().flatten() {
        ensure!(r.status == 504, "status {}", r.status);
        let ms = r.latency.as_millis();
        ensure!(
            (800..=1200).contains(&ms),
            "route timeout fired after {ms} ms, want 1000 ± 20 %"
        );
    }
    // perTryTimeout 400 ms, one retry: two attempts, 504 after ~800 ms.
    let c = cluster("", "slow");
    let per_try0 = cluster_stat(bed, &c, "upstream_rq_per_try_timeout").await?;
    let mut gaps = Vec::new();
    let mut totals = Vec::new();
    for _ in 0..3 {
        slow.clear_arrivals();
        let mut conn = None;
        let r = httpapp::once(&mut conn, client, vip(SLOW), "/", &[("x-case", "per-try")]).await?;
        ensure!(r.status == 504, "per-try: status {}", r.status);
        let arrivals = slow.arrivals();
        ensure!(
            arrivals.len() == 2,
            "per-try: {} attempts reached slow-0",
            arrivals.len()
        );
        gaps.push(arrivals[1] - arrivals[0]);
        totals.push(r.latency);
    }
    let per_try = cluster_stat(bed, &c, "upstream_rq_per_try_timeout").await? - per_try0;
    println!(
        "perTryTimeout 400ms × 2 attempts: attempt gaps {gaps:?}, client 504 after {totals:?}; Envoy upstream_rq_per_try_timeout +{per_try}"
    );
    slow.set(Behavior::Ok);
    for g in &gaps {
        // The second attempt starts after the per-try timeout plus Envoy's
        // retry back-off (0–25 ms at first).
        let ms = g.as_millis();
        ensure!(
            (320..=505).contains(&ms),
            "attempt gap {ms} ms, want 400 ± 20 % (+ back-off)"
        );
    }
    for t in &totals {
        let ms = t.as_millis();
        ensure!(
            (640..=985).contains(&ms),
            "per-try total {ms} ms, want 800 ± 20 % (+ back-off)"
        );
    }
    ensure!(per_try == 6, "per-try timeouts counted {per_try}, want 6");
    Ok(())
}

async fn faults_hit_their_percentages(bed: &MeshBed) -> Result<()> {
    const N: usize = 2000;
    let prefix = format!("http.faulty.{NS}.svc.cluster.local_80.fault");
    let wp = bed.waypoint("waypoint-0");
    let d0 = wp.stat(&format!("{prefix}.delays_injected")).await?;
    let a0 = wp.stat(&format!("{prefix}.aborts_injected")).await?;
    let t = Instant::now();
    let replies = httpapp::many(bed.pod("client"), vip(FAULTY), N, 32, "/", &[]).await;
    let took = t.elapsed();
    ensure!(failures(&replies).is_empty(), "{:?}", failures(&replies));
    let aborted = replies.iter().flatten().filter(|r| r.status == 418).count();
    let slow = replies
        .iter()
        .flatten()
        .filter(|r| r.latency >= Duration::from_millis(195))
        .count();
    let delays = wp.stat(&format!("{prefix}.delays_injected")).await? - d0;
    let aborts = wp.stat(&format!("{prefix}.aborts_injected")).await? - a0;
    let pct = |n: usize| 100.0 * n as f64 / N as f64;
    println!(
        "faults over {N} requests in {took:?}: abort 418 {aborted} ({:.2} %, Envoy {aborts}), delayed ≥ 200 ms {slow} ({:.2} %, Envoy {delays})",
        pct(aborted),
        pct(slow)
    );
    // Binomial: sd 0.67 pts at 10 %, 0.97 at 25 %; bounds > 4 sd.
    ensure!(
        (pct(aborted) - 10.0).abs() <= 3.0,
        "abort rate {:.2} %",
        pct(aborted)
    );
    ensure!(
        (pct(slow) - 25.0).abs() <= 4.0,
        "delay rate {:.2} %",
        pct(slow)
    );
    ensure!(
        aborts as usize == aborted,
        "Envoy aborts {aborts} vs 418s {aborted}"
    );
    ensure!(
        (delays as usize).abs_diff(slow) <= N / 100,
        "Envoy delays {delays} vs slow {slow}"
    );
    Ok(())
}

/// Istio's inbound rule: ztunnel does not refuse traffic that skipped the
/// waypoint; the L4 policy does, evaluated with the peer's identity — the
/// waypoint's for traffic through it (allowed), the client's for traffic
/// straight to a pod (denied here).
async fn going_around_the_waypoint_is_denied(bed: &MeshBed) -> Result<()> {
    let direct = SocketAddr::new(bed.ip("llm-v1").into(), APP_PORT);
    let denials0 = metric_sum(
        &bed.metrics(0).await?,
        "ambit_authorization_denials_total",
        &[],
    );
    let mut c = None;
    let r = httpapp::once(&mut c, bed.pod("client"), direct, "/", &[]).await;
    let denials = metric_sum(
        &bed.metrics(0).await?,
        "ambit_authorization_denials_total",
        &[],
    ) - denials0;
    println!(
        "around the waypoint: client → llm-v1 pod IP directly: {}; denials counted +{denials}",
        match &r {
            Ok(r) => format!("answered {}", r.status),
            Err(e) => format!("refused ({e:#})"),
        }
    );
    ensure!(
        r.is_err() && denials >= 1.0,
        "a direct call got through the ALLOW-only-waypoint policy"
    );
    Ok(())
}

/// A pod bound to a waypoint for workloads: traffic to its pod IP goes
/// through that waypoint's Envoy (its tcp_proxy chain counts it).
async fn workload_waypoint(bed: &MeshBed) -> Result<()> {
    let stat = format!("tcp.workload_{NS}_db-0.downstream_cx_total");
    let wp = bed.waypoint("wl-waypoint-0");
    let before = wp.stat(&stat).await?;
    let dst = SocketAddr::new(bed.ip("db-0").into(), DB_PORT);
    for i in 0..5 {
        let msg = format!("row {i}");
        let got = bed.echo_once("client", dst, msg.as_bytes()).await?;
        ensure!(
            got == msg.as_bytes(),
            "echo through the workload waypoint altered"
        );
    }
    let after = wp.stat(&stat).await?;
    println!(
        "workload waypoint: 5 connections to db-0's pod IP; wl-waypoint Envoy {stat} +{}",
        after - before
    );
    ensure!(
        after - before == 5,
        "wl-waypoint counted {} of 5",
        after - before
    );
    Ok(())
}

/// Kill the waypoint (agent and Envoy) and start it again: no manual step,
/// traffic flows through it once it is ready; meanwhile requests fail
/// rather than bypass it.
async fn restart_reconverges(bed: &mut MeshBed) -> Result<()> {
    let client = bed.pod("client").clone();
    bed.waypoint_mut("waypoint-0").kill().await?;
    let mut c = None;
    let down = httpapp::once(&mut c, &client, vip(LLM), "/", &[]).await;
    ensure!(
        down.is_err(),
        "a request succeeded while the waypoint was down: {down:?}"
    );
    let t = Instant::now();
    bed.waypoint_mut("waypoint-0").start_again().await?;
    let ready = bed
        .waypoint("waypoint-0")
        .wait_ready(Duration::from_secs(30))
        .await?;
    let first = ambit_tests::eventually(
        Duration::from_secs(20),
        "traffic after the restart",
        || async {
            let mut c = None;
            httpapp::once(&mut c, &client, vip(LLM), "/", &[])
                .await
                .ok()
                .filter(|r| r.status == 200)
                .map(|_| t.elapsed())
        },
    )
    .await?;
    let replies = httpapp::many(&client, vip(LLM), 100, 4, "/", &[]).await;
    let counted = cluster_stat(bed, &cluster("v1", "llm"), "upstream_rq_200").await?;
    println!(
        "waypoint restart: while down the request failed ({}); ready {ready:?} after the start, first 200 after {first:?}; then 100/100 ok, the new Envoy counted {counted} on v1",
        down.err().map(|e| format!("{e:#}")).unwrap_or_default()
    );
    ensure!(failures(&replies).is_empty(), "{:?}", failures(&replies));
    ensure!(counted >= 100, "the new Envoy counted {counted}");
    Ok(())
}

/// The waypoint's pod leaves the mesh (its workload is gone from xDS):
/// connections to the bound service are reset and recorded with the
/// reason, and nothing reaches the service's pods around the waypoint.
async fn no_waypoint_pod_fails_closed(bed: &mut MeshBed, apps: &Apps) -> Result<()> {
    let client = bed.pod("client").clone();
    bed.remove_from_config("waypoint-0")?;
    let hits = || apps.get("llm-v1").hits() + apps.get("llm-v2").hits();
    let t = Instant::now();
    ambit_tests::eventually(
        Duration::from_secs(10),
        "requests failing without a waypoint pod",
        || async {
            let mut c = None;
            httpapp::once(&mut c, &client, vip(LLM), "/", &[])
                .await
                .err()
        },
    )
    .await?;
    let noticed = t.elapsed();
    let closed = |m: &str| {
        metric_sum(
            m,
            "istio_tcp_connections_closed_total",
            &[
                ("destination_service", "llm.shop.svc.cluster.local"),
                ("response_flags", "CONNECT"),
            ],
        )
    };
    let before = closed(&bed.metrics(0).await?);
    let hits0 = hits();
    let replies = httpapp::many(&client, vip(LLM), 20, 2, "/", &[]).await;
    let failed = failures(&replies).len();
    let recorded = closed(&bed.metrics(0).await?) - before;
    println!(
        "no waypoint pod: requests fail {noticed:?} after the pod left the config; then {failed}/20 failed (reset), {recorded} recorded with CONNECT, llm pods saw {} (no bypass)",
        hits() - hits0
    );
    ensure!(
        failed == 20 && recorded >= 20.0 && hits() == hits0,
        "{:?}",
        httpapp::tally(&replies)
    );
    Ok(())
}
