//! Waypoint benchmark (issues 15 and 16): keep-alive GETs with a 1 KiB
//! response over HTTP/1.1 and over h2c (HTTP/2 prior knowledge), all in one
//! run on one bed, on six paths to the same server app:
//!
//! 1. **no mesh**: a plain client pod to a plain server pod's IP;
//! 2. **L4 mesh**: client → ztunnel ══HBONE══▶ ztunnel → server (service
//!    `direct`, no waypoint);
//! 3. **waypoint, bare**: through waypoint `wp-bare` (Envoy routing only:
//!    request telemetry off, no L7 policy);
//! 4. **waypoint, full**: through waypoint `wp-full` (an ALLOW
//!    AuthorizationPolicy with method and path rules, Istio request metrics
//!    and the JSON access log on);
//! 5. **sidecar → ambient**: a sidecar pod's Envoy (its outbound routes,
//!    request metrics) ══HBONE══▶ ztunnel → the server (service `direct`);
//! 6. **sidecar → sidecar**: sidecar Envoy ══mTLS══▶ the server's sidecar
//!    Envoy (inbound chain, metrics) → its app (service `sc`).
//!
//! Each path and protocol runs closed loop (`CONNS` requesters back to
//! back: the path's ceiling) and open loop at each of `RATES` requests a
//! second (latency from each request's scheduled send time, so queueing
//! counts). Per run: achieved requests/s, p50/p99, errors, and for the
//! waypoints Envoy's and the agent's vCPU per 1,000 requests/s and RSS
//! (from /proc). HTTP/2 goes to each service's `http2` port
//! (`appProtocol: http2`), one connection carrying the requesters' streams.
//! Needs root, `ip`, `iptables` and Envoy 1.40 (`ENVOY_BIN` or `envoy` on
//! PATH), and the agent built: `cargo build --profile bench -p
//! ambit-ztunnel --bin ambit-agent`.
//! Run: `cargo bench -p ambit-benches --bench waypoint` (`SECS`, default
//! 5; `CONNS`, 4; `RATES`, 1000,5000; `OPEN_CONNS`, 16; `PROTOS`,
//! http1,http2).

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "waypoint/load.rs"]
mod load;
#[path = "waypoint/usage.rs"]
mod usage;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use ambit_tests::httpapp::{Behavior, HttpApp};
use ambit_tests::meshbed::{MeshBed, PodSpec};
use ambit_tests::netbed;
use anyhow::{Context, Result};

use load::{Proto, Run, Target};
use usage::{Meter, Usage};

const NS: &str = "bench";
const APP_PORT: u16 = 8080;
/// The services' HTTP/1.1 and HTTP/2 ports.
const HTTP_PORT: u16 = 80;
const H2_PORT: u16 = 81;
const BODY: usize = 1024;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What to run, from the environment.
struct Settings {
    dur: Duration,
    conns: usize,
    open_conns: usize,
    rates: Vec<f64>,
    protos: Vec<Proto>,
}

impl Settings {
    fn from_env() -> Result<Settings> {
        let list = |name: &str, default: &str| -> Vec<String> {
            std::env::var(name)
                .unwrap_or_else(|_| default.to_string())
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        };
        let rates = list("RATES", "1000,5000")
            .iter()
            .map(|r| r.parse::<f64>().with_context(|| format!("RATES: {r:?}")))
            .collect::<Result<Vec<_>>>()?;
        let protos = list("PROTOS", "http1,http2")
            .iter()
            .map(|p| match p.as_str() {
                "http1" => Ok(Proto::Http1),
                "http2" => Ok(Proto::Http2),
                _ => anyhow::bail!("PROTOS: {p:?} is neither http1 nor http2"),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Settings {
            dur: Duration::from_secs(env_or("SECS", 5)),
            conns: env_or("CONNS", 4).max(1) as usize,
            open_conns: env_or("OPEN_CONNS", 16).max(1) as usize,
            rates,
            protos,
        })
    }
}

/// One of the paths.
struct Path {
    label: &'static str,
    from: &'static str,
    /// The service VIP, or `None` for the plain server's pod IP.
    vip: Option<Ipv4Addr>,
    /// The proxy pods (waypoint, sidecars) whose Envoy and agent are metered.
    metered: &'static [&'static str],
}

const PATHS: [Path; 6] = [
    Path {
        label: "no mesh",
        from: "plain-client",
        vip: None,
        metered: &[],
    },
    Path {
        label: "L4 mesh (ztunnel only)",
        from: "client",
        vip: Some(Ipv4Addr::new(10, 96, 0, 30)),
        metered: &[],
    },
    Path {
        label: "waypoint, bare",
        from: "client",
        vip: Some(Ipv4Addr::new(10, 96, 0, 32)),
        metered: &["wp-bare-0"],
    },
    Path {
        label: "waypoint, full",
        from: "client",
        vip: Some(Ipv4Addr::new(10, 96, 0, 31)),
        metered: &["wp-full-0"],
    },
    Path {
        label: "sidecar → ambient",
        from: "sc-client",
        vip: Some(Ipv4Addr::new(10, 96, 0, 30)),
        metered: &["sc-client"],
    },
    Path {
        label: "sidecar → sidecar",
        from: "sc-client",
        vip: Some(Ipv4Addr::new(10, 96, 0, 33)),
        metered: &["sc-client", "sc-server"],
    },
];

impl Path {
    fn target(&self, bed: &MeshBed, proto: Proto) -> Target {
        let dst = match self.vip {
            Some(vip) => {
                let port = match proto {
                    Proto::Http1 => HTTP_PORT,
                    Proto::Http2 => H2_PORT,
                };
                SocketAddr::new(IpAddr::V4(vip), port)
            }
            None => SocketAddr::new(bed.ip("plain-server").into(), APP_PORT),
        };
        Target {
            pod: bed.pod(self.from).clone(),
            dst,
            proto,
        }
    }

    fn meter(&self, bed: &MeshBed) -> Meter {
        Meter::new(self.metered.iter().map(|p| bed.pod(p).path()).collect())
    }
}

fn pods() -> Vec<PodSpec> {
    vec![
        PodSpec::mesh("client", NS, 0, "client"),
        PodSpec::plain("plain-client", NS, 0, "plain-client"),
        PodSpec::waypoint("wp-full-0", NS, 1, "wp-full"),
        PodSpec::waypoint("wp-bare-0", NS, 1, "wp-bare"),
        PodSpec::mesh("server", NS, 1, "server"),
        PodSpec::plain("plain-server", NS, 1, "plain-server"),
        PodSpec::sidecar("sc-client", NS, 0, "sc-client"),
        PodSpec::sidecar("sc-server", NS, 1, "sc-server"),
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
    for (name, ip, waypoint, app) in [
        ("direct", "10.96.0.30", None, "server"),
        ("full", "10.96.0.31", Some("wp-full"), "server"),
        ("bare", "10.96.0.32", Some("wp-bare"), "server"),
        ("sc", "10.96.0.33", None, "sc-server"),
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
  selector: {{app: {app}}}
  ports:
  - {{name: http-api, port: {HTTP_PORT}, targetPort: {APP_PORT}}}
  - {{name: http2-api, port: {H2_PORT}, appProtocol: http2, targetPort: {APP_PORT}}}
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
    let settings = Settings::from_env()?;
    let mut bed = MeshBed::new(2, &pods())?;
    bed.start(&yaml()).await?;
    let server = HttpApp::start(bed.pod("server"), APP_PORT, "server")?;
    let plain = HttpApp::start(bed.pod("plain-server"), APP_PORT, "plain-server")?;
    let sidecar_server = HttpApp::start(bed.pod("sc-server"), APP_PORT, "sc-server")?;
    for app in [&server, &plain, &sidecar_server] {
        app.set(Behavior::Sized(BODY));
    }
    for wp in ["wp-full-0", "wp-bare-0"] {
        bed.start_waypoint(wp).await?;
    }
    for sc in ["sc-client", "sc-server"] {
        bed.start_sidecar(sc).await?;
    }
    for path in &PATHS {
        for &proto in &settings.protos {
            let t = path.target(&bed, proto);
            ambit_tests::eventually(Duration::from_secs(30), "a first 200", || async {
                load::probe(&t).await.ok().filter(|s| *s == 200)
            })
            .await
            .with_context(|| format!("{} {} -> {}", proto.label(), path.from, t.dst))?;
        }
    }
    closed_loops(&bed, &settings).await?;
    fixed_rates(&bed, &settings).await?;
    bed.shutdown().await;
    Ok(())
}

/// Each path's ceiling: `conns` requesters back to back.
async fn closed_loops(bed: &MeshBed, s: &Settings) -> Result<()> {
    println!(
        "\n## Closed loop: {} requesters back to back, {BODY} B responses, {:?} per run\n",
        s.conns, s.dur
    );
    println!(
        "| protocol | path | req/s | p50 | p99 | errors | Envoy vCPU / 1k req/s | agent vCPU / 1k req/s | Envoy RSS | agent RSS |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for &proto in &s.protos {
        for path in &PATHS {
            let t = path.target(bed, proto);
            let run = load::closed_loop(&t, s.conns, s.dur, &path.meter(bed)).await?;
            println!(
                "| {} | {} | {:.0} | {} |",
                proto.label(),
                path.label,
                run.rps(),
                cells(&run)
            );
        }
    }
    Ok(())
}

/// Each path at each fixed rate.
async fn fixed_rates(bed: &MeshBed, s: &Settings) -> Result<()> {
    println!(
        "\n## Fixed rates (open loop, up to {} requests in flight, latency from the scheduled send), {BODY} B responses, {:?} per run\n",
        s.open_conns, s.dur
    );
    println!(
        "| rate | protocol | path | achieved req/s | p50 | p99 | errors | Envoy vCPU / 1k req/s | agent vCPU / 1k req/s | Envoy RSS | agent RSS |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for &rate in &s.rates {
        for &proto in &s.protos {
            for path in &PATHS {
                let t = path.target(bed, proto);
                let run = load::open_loop(&t, rate, s.open_conns, s.dur, &path.meter(bed)).await?;
                println!(
                    "| {rate:.0} | {} | {} | {:.0} | {} |",
                    proto.label(),
                    path.label,
                    run.rps(),
                    cells(&run)
                );
            }
        }
    }
    Ok(())
}

/// p50, p99, errors and the waypoint's usage cells of a row.
fn cells(run: &Run) -> String {
    let usage = match run.usage {
        Some(u) => format!(
            "{:.3} | {:.4} | {:.0} MiB | {:.0} MiB",
            Usage::per_k_rps(u.envoy_cpu_secs, run.requests),
            Usage::per_k_rps(u.agent_cpu_secs, run.requests),
            u.envoy_rss_mib,
            u.agent_rss_mib
        ),
        None => "- | - | - | -".to_string(),
    };
    format!(
        "{:.2} ms | {:.2} ms | {} | {usage}",
        run.pct_ms(0.50),
        run.pct_ms(0.99),
        run.errors
    )
}
