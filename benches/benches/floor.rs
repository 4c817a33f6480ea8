//! Data plane against the floor of a userspace proxy, on the two-node bed
//! of `ambitctl local up` (as `mesh.rs`): four paths side by side in one
//! run, from a client pod on node-1 to a server pod on node-2.
//!
//! * **no mesh**: `plain/client` → `plain/server`, one TCP hop;
//! * **floor**: the same pods through a plaintext relay pair — a relay in
//!   the client pod (the app connects to it), a peer relay in the server
//!   pod, which connects to the app: three TCP hops, as through ztunnel;
//! * **floor + TLS**: the same relay pair with TLS 1.3 (rustls, ring,
//!   mutual authentication) between the relays, one TLS session per
//!   connection, no HTTP/2;
//! * **ztunnel**: `mesh/client` → `mesh/server` through both ztunnels
//!   (outbound capture → HBONE → inbound delivery);
//! * **passthrough** (only when `PATHS` names it): `mesh/client` →
//!   `plain/server`, captured and relayed in plaintext by node-1's ztunnel
//!   (two TCP hops; `splice(2)` unless the ztunnels run with `SPLICE=false`).
//!
//! ```sh
//! cargo build --release --workspace --bins
//! cargo bench -p ambit-benches --bench floor   # root; QUICK=1 for the short form
//! ```
//!
//! Knobs: `SECS` (5; each latency phase), `BULK_SECS` (min(SECS, 5)),
//! `CONN_SECS` (3), `REPS` (3; rotated path order), `RATES` (1000,5000),
//! `IDLE_CONNS` (2000), `IDLE_HOLD_SECS` (1; how long they are held before
//! RSS is read), `PATHS` (subset of no-mesh,floor,floor-tls,ztunnel,passthrough),
//! `BINS` (directory of the mesh binaries; default target/release),
//! `PERF_DIR` + `PERF_PATHS` (default ztunnel): `perf record -g` of those
//! paths' proxies during bulk 1 and the closed loop of the first rep.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ambit_tests::netbed::{self, PodNet};
use ambitctl::local::{self, LocalCluster, Role, UpOptions};
use anyhow::{Context, Result};
use tokio::io::AsyncReadExt;

#[allow(dead_code)]
#[path = "dataplane/load.rs"]
mod load;
#[path = "floor/measure.rs"]
mod measure;
#[path = "floor/relay.rs"]
mod relay;
#[path = "floor/report.rs"]
mod report;
#[path = "floor/tls.rs"]
mod tls;

use measure::{Knobs, Path, Profile, Usage};
use relay::Relay;
use report::Record;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const CONFIG: &str = include_str!("floor/pods.yaml");
const ECHO_PORT: u16 = 7000;
const SINK_PORT: u16 = 7001;
/// Floor relays: client side listens on 71x0 (sink) / 71x1 (echo), server
/// side on 72x0 / 72x1; x = 0 plaintext, 1 TLS.
const FLOOR_PORTS: [u16; 2] = [7100, 7110];
/// The paths; the first four run by default, `passthrough` (ztunnel's
/// plaintext path to a pod outside the mesh) when `PATHS` names it.
const NAMES: [&str; 5] = ["no-mesh", "floor", "floor-tls", "ztunnel", "passthrough"];
const HEADINGS: [&str; 5] = [
    "no mesh",
    "floor",
    "floor + TLS",
    "ztunnel (HBONE)",
    "ztunnel passthrough",
];

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn knobs() -> Knobs {
    let quick = std::env::var("QUICK").is_ok_and(|v| v == "1");
    let secs = Duration::from_secs(env_u64("SECS", if quick { 2 } else { 5 }));
    let rates = std::env::var("RATES")
        .unwrap_or_else(|_| (if quick { "1000" } else { "1000,5000" }).into())
        .split(',')
        .filter_map(|r| r.trim().parse().ok())
        .collect();
    let perf_paths = std::env::var("PERF_PATHS").unwrap_or_else(|_| "ztunnel".into());
    Knobs {
        secs,
        bulk_secs: Duration::from_secs(env_u64("BULK_SECS", secs.as_secs().min(5))),
        conn_secs: Duration::from_secs(env_u64("CONN_SECS", if quick { 2 } else { 3 })),
        rates,
        idle_conns: env_u64("IDLE_CONNS", if quick { 500 } else { 2000 }) as usize,
        idle_hold: Duration::from_secs(env_u64("IDLE_HOLD_SECS", 1)),
        perf_dir: std::env::var_os("PERF_DIR").map(PathBuf::from),
        perf_paths: perf_paths.split(',').map(str::to_string).collect(),
    }
}

fn pod(c: &LocalCluster, key: &str) -> Result<PodNet> {
    let p = c.pod(key)?;
    let node = if p.node.ends_with('1') { 0 } else { 1 };
    Ok(PodNet {
        name: p.name.clone(),
        netns: p.netns.clone(),
        ip: p.ip,
        ip6: None,
        node,
    })
}

fn ztunnel_pids(c: &LocalCluster) -> Vec<u32> {
    c.state
        .processes
        .iter()
        .filter(|p| p.role == Role::Ztunnel)
        .map(|p| p.pid)
        .collect()
}

fn bins_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("BINS") {
        return Ok(PathBuf::from(d));
    }
    let exe = std::env::current_exe()?;
    Ok(exe
        .parent()
        .and_then(|d| d.parent())
        .context("locating target/release")?
        .to_path_buf())
}

/// A sink counting bytes into `bytes`, in the pod.
fn sink(pod: &PodNet, port: u16, bytes: Arc<AtomicU64>) -> Result<tokio::task::JoinHandle<()>> {
    let l = netbed::listen(pod, port)?;
    Ok(tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let bytes = bytes.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 256 * 1024];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    bytes.fetch_add(n as u64, Ordering::Relaxed);
                }
            });
        }
    }))
}

/// The floor relay pair number `i` (0 plaintext, 1 TLS) between the plain
/// pods: (client-side relay, server-side relay).
fn relay_pair(
    i: usize,
    client: &PodNet,
    server: &PodNet,
    certs: &std::path::Path,
) -> Result<[Relay; 2]> {
    let base = FLOOR_PORTS[i];
    let a = |off: u16| SocketAddr::new(client.ip.into(), base + off);
    let b = |off: u16| SocketAddr::new(server.ip.into(), base + 100 + off);
    let app = |port: u16| SocketAddr::new(server.ip.into(), port);
    let (ta, tb) = if i == 0 {
        ("none", "none")
    } else {
        ("client", "server")
    };
    // Server side first, so the client side's first dial finds it.
    let rb = Relay::spawn(
        &server.path(),
        &[(b(0), app(SINK_PORT)), (b(1), app(ECHO_PORT))],
        tb,
        certs,
    )?;
    let ra = Relay::spawn(&client.path(), &[(a(0), b(0)), (a(1), b(1))], ta, certs)?;
    Ok([ra, rb])
}

fn utc_now() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M:%S UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn header(k: &Knobs, reps: usize) {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "floor bench, {}; {cpus} CPUs, loadavg {}; SECS={} BULK_SECS={} CONN_SECS={} \
         REPS={reps} RATES={:?} IDLE_CONNS={}",
        utc_now(),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
        k.secs.as_secs(),
        k.bulk_secs.as_secs(),
        k.conn_secs.as_secs(),
        k.rates,
        k.idle_conns
    );
}

fn main() -> Result<()> {
    if std::env::var("AMBIT_BENCH_ROLE").as_deref() == Ok(relay::ROLE) {
        return relay::run();
    }
    if !netbed::can_run("floor bench") {
        return Ok(());
    }
    relay::raise_nofile();
    let bins = bins_dir()?;
    let missing: Vec<_> = local::BINARIES
        .iter()
        .filter(|b| !bins.join(b).exists())
        .collect();
    if !missing.is_empty() {
        println!(
            "SKIP floor bench: build the binaries first (cargo build --release --workspace --bins); missing {missing:?}"
        );
        return Ok(());
    }
    let k = knobs();
    let reps = env_u64("REPS", 3).max(1) as usize;
    header(&k, reps);

    let config = tempfile::tempdir()?;
    std::fs::write(config.path().join("bench.yaml"), CONFIG)?;
    let state = tempfile::tempdir()?;
    let mut opts = UpOptions::new(config.path(), &bins);
    opts.name = format!("fl{:05x}", rand::random::<u32>() & 0xfffff);
    let state_dir = state.path().join("state");
    println!(
        "cluster {} (if this run is killed: ambitctl local down --state-dir {})",
        opts.name,
        state_dir.display()
    );
    opts.state_dir = Some(state_dir);
    let cluster = local::up(&opts).context("local up")?.down_on_drop();
    let result = run(&cluster, &k, reps);
    let down = cluster.down().context("local down");
    result?;
    down?;
    Ok(())
}

/// Everything between `local up` and `down`; relays and servers stop when
/// it returns, on every path.
fn run(cluster: &LocalCluster, k: &Knobs, reps: usize) -> Result<()> {
    let plain = [pod(cluster, "plain/client")?, pod(cluster, "plain/server")?];
    let mesh = [pod(cluster, "mesh/client")?, pod(cluster, "mesh/server")?];
    for p in plain.iter().chain(&mesh) {
        netbed::sysctl(&p.netns, "net/ipv4/ip_local_port_range", "16000 65000")?;
        netbed::sysctl(&p.netns, "net/ipv4/tcp_tw_reuse", "1")?;
    }
    let certs = tempfile::tempdir()?;
    tls::write_certs(certs.path())?;
    let floor = relay_pair(0, &plain[0], &plain[1], certs.path())?;
    let floor_tls = relay_pair(1, &plain[0], &plain[1], certs.path())?;
    let zts = ztunnel_pids(cluster);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let _guard = rt.enter();
    let plain_bytes = Arc::new(AtomicU64::new(0));
    let mesh_bytes = Arc::new(AtomicU64::new(0));
    let _servers = (
        sink(&plain[1], SINK_PORT, plain_bytes.clone())?,
        sink(&mesh[1], SINK_PORT, mesh_bytes.clone())?,
        rt.block_on(netbed::echo_server(&plain[1], ECHO_PORT))?,
        rt.block_on(netbed::echo_server(&mesh[1], ECHO_PORT))?,
    );
    let floor_path = |i: usize, name, pids: &[Relay; 2]| Path {
        name,
        client: plain[0].clone(),
        sink: SocketAddr::new(plain[0].ip.into(), FLOOR_PORTS[i]),
        echo: SocketAddr::new(plain[0].ip.into(), FLOOR_PORTS[i] + 1),
        sink_bytes: plain_bytes.clone(),
        pids: pids.iter().map(|r| r.pid).collect(),
    };
    // From `client` straight to `server`'s sink and echo (through
    // whatever captures the client's traffic).
    let direct = |name, client: &PodNet, server: &PodNet, bytes: &Arc<AtomicU64>, pids| Path {
        name,
        client: client.clone(),
        sink: server.addr(SINK_PORT),
        echo: server.addr(ECHO_PORT),
        sink_bytes: bytes.clone(),
        pids,
    };
    let all = [
        direct(NAMES[0], &plain[0], &plain[1], &plain_bytes, vec![]),
        floor_path(0, NAMES[1], &floor),
        floor_path(1, NAMES[2], &floor_tls),
        direct(NAMES[3], &mesh[0], &mesh[1], &mesh_bytes, zts.clone()),
        // The mesh client to the plain server: captured, then relayed by
        // node-1's ztunnel in plaintext (two TCP hops, no HBONE).
        direct(NAMES[4], &mesh[0], &plain[1], &plain_bytes, zts),
    ];
    let chosen = std::env::var("PATHS").unwrap_or_else(|_| NAMES[..4].join(","));
    let paths: Vec<&Path> = all
        .iter()
        .filter(|p| chosen.split(',').any(|c| c == p.name))
        .collect();
    for p in &paths {
        rt.block_on(measure::probe(p))?;
    }
    let mut recs: Vec<Record> = paths.iter().map(|_| Record::default()).collect();
    let mut machine = Record::default();
    idle_phase(&rt, &paths, k, &mut recs)?;
    for rep in 0..reps {
        rep_phases(&rt, &paths, k, rep, &mut recs, &mut machine)?;
    }
    report_all(&paths, &recs, &machine, k, reps);
    Ok(())
}

/// The tables: medians side by side, the goals (all four paths run), the
/// ratios to floor + TLS.
fn report_all(paths: &[&Path], recs: &[Record], machine: &Record, k: &Knobs, reps: usize) {
    println!(
        "\nfinished {}; medians of {reps} reps (min–max); rest of the machine (not the proxies, \
         not this process): median {:.3}, max {:.3} vCPU over all phases",
        utc_now(),
        machine.median("other"),
        machine.max("other"),
    );
    let names: Vec<&str> = paths
        .iter()
        .map(|p| HEADINGS[NAMES.iter().position(|n| *n == p.name).unwrap_or(0)])
        .collect();
    let refs: Vec<&Record> = recs.iter().collect();
    report::table(&names, &refs);
    let find = |n: &str| paths.iter().position(|p| p.name == n).map(|i| &recs[i]);
    if let (Some(n), Some(f), Some(t), Some(z)) = (
        find("no-mesh"),
        find("floor"),
        find("floor-tls"),
        find("ztunnel"),
    ) {
        let rate = k.rates.first().copied().unwrap_or(1000.0);
        report::goals(n, f, t, z, rate);
    }
    if let (Some(t), Some(z)) = (find("floor-tls"), find("ztunnel")) {
        report::ratios("ztunnel / floor+TLS", t, z);
    }
    if let (Some(f), Some(p)) = (find("floor"), find("passthrough")) {
        report::ratios("passthrough / floor", f, p);
    }
}

/// Idle RSS of each proxy, then `IDLE_CONNS` idle connections through
/// each path (before any load, so freed memory is not reused).
fn idle_phase(
    rt: &tokio::runtime::Runtime,
    paths: &[&Path],
    k: &Knobs,
    recs: &mut [Record],
) -> Result<()> {
    let mut measured: Vec<u32> = Vec::new();
    for (p, rec) in paths.iter().zip(recs.iter_mut()) {
        if p.pids.is_empty() {
            continue;
        }
        // The passthrough path rides the ztunnels the HBONE path measured
        // just before (their idle connections still open): its figures
        // would not be its own.
        if p.pids.iter().all(|pid| measured.contains(pid)) {
            println!(
                "{}: idle figures skipped (proxies already measured)",
                p.name
            );
            continue;
        }
        measured.extend(&p.pids);
        let mems: Vec<load::Mem> = p.pids.iter().map(|pid| load::mem(*pid)).collect();
        let largest = mems.iter().map(|m| m.rss).max().unwrap_or(0) as f64 / 1024.0;
        let anon = mems.iter().map(|m| m.anon).max().unwrap_or(0) as f64 / 1024.0;
        rec.add("idle RSS: MiB (largest end)", largest);
        rec.add("idle RSS: anon MiB (largest end)", anon);
        let (kib, took) = rt.block_on(measure::idle_conns(p, k.idle_conns, k.idle_hold))?;
        let per = kib / k.idle_conns as f64;
        println!(
            "{}: idle RSS {largest:.1} MiB (anon {anon:.1}); {} idle conns opened in {took:.1} s, +{per:.2} KiB each (both ends)",
            p.name, k.idle_conns
        );
        rec.add("idle conn: KiB per connection (both ends)", per);
    }
    Ok(())
}

/// One repetition: every phase, each on every path, the path order rotated
/// by `rep` so no path always runs first or last.
fn rep_phases(
    rt: &tokio::runtime::Runtime,
    paths: &[&Path],
    k: &Knobs,
    rep: usize,
    recs: &mut [Record],
    machine: &mut Record,
) -> Result<()> {
    let mut phases: Vec<String> = vec!["bulk1".into(), "bulk4".into()];
    phases.extend(k.rates.iter().map(|r| format!("rate{r:.0}")));
    phases.extend(["closed".into(), "conns".into()]);
    for phase in &phases {
        for j in 0..paths.len() {
            let i = (j + rep) % paths.len();
            let (p, rec) = (paths[i], &mut recs[i]);
            let profile = if rep == 0 && (phase == "bulk1" || phase == "closed") {
                Some(Profile::start(k, p, phase)?)
            } else {
                None
            };
            let u = one_phase(rt, p, k, phase, rec)?;
            drop(profile);
            machine.add("other", u.other_vcpu());
            println!(
                "rep {rep} {phase:>9} {:>9}: proxies {:.2} vCPU, this process {:.2}, rest of machine {:.3} [{}]",
                p.name,
                u.proxy_cpu / u.secs,
                u.own_cpu / u.secs,
                u.other_vcpu(),
                u.top_others
            );
        }
    }
    Ok(())
}

fn one_phase(
    rt: &tokio::runtime::Runtime,
    p: &Path,
    k: &Knobs,
    phase: &str,
    rec: &mut Record,
) -> Result<Usage> {
    match phase {
        "bulk1" => measure::run_bulk(rt, p, k, 1, rec),
        "bulk4" => measure::run_bulk(rt, p, k, 4, rec),
        "closed" => measure::run_closed(p, k, rec),
        "conns" => measure::run_conns(p, k, rec),
        rate => {
            let r: f64 = rate.trim_start_matches("rate").parse()?;
            measure::run_rate(p, r, k, rec)
        }
    }
}
