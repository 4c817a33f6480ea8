//! Data-plane benchmark (issue 4): one node, one ztunnel doing both ends.
//! Enrolled pods `client` and `server` (plus one more enrolled client pod
//! per new-connection run, see `bed::CONN_CLIENTS`) and two plain ones
//! (`plain-client`, `plain-server`) on the same node bridge; every figure
//! is measured through the mesh (client → :15001 → HBONE over mTLS to the
//! server pod's :15008 → app) and beside it, in the same run, between the
//! plain pods over the same veth/bridge path.
//!
//! 1. bulk throughput, 1 and 4 streams of 256 KiB writes into a sink;
//! 2. request/response latency, 1 KiB echo on one persistent connection, at
//!    1,000 and 5,000 requests/s (open loop) and closed loop;
//! 3. new connections: (a) app-level connect + 1-byte echo + close,
//!    sequential and 8 at a time; (b) new HBONE connections straight to the
//!    server pod's :15008 (TCP + TLS 1.3 + HTTP/2 + CONNECT + 1-byte echo)
//!    with the client pod's certificate, beside plain TCP + 1-byte echo;
//! 4. ztunnel CPU per phase and RSS (idle after enrollment, after each
//!    phase, peak).
//!
//! The ztunnel runs in a child process (this binary re-executed with
//! `AMBIT_BENCH_ROLE=ztunnel`, see `dataplane/child.rs`), so its CPU and
//! RSS are its own; this process is the control plane, the node agent, the
//! apps and the load generator. Needs root, `ip` and `iptables` (prints
//! SKIP otherwise). Run: `cargo bench -p ambit-benches --bench dataplane`.
//! Durations: `SECS` (bulk and latency phases, default 5), `CONN_SECS`
//! (new-connection phases, default 3). `ZT_LOG` sets the child's log filter
//! (default `info`, as the binary: one access-log line per connection end).
//! `ONLY=bulk,latency,conn,hbone` runs a subset (e.g. to profile one);
//! `POD_PORT_RANGE` (pods' ephemeral ports, default `16000 65000`) and
//! `INBOUND_TRANSPARENT=false` (passed to the ztunnel) are for experiments.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "dataplane/bed.rs"]
mod bed;
#[path = "dataplane/child.rs"]
mod child;
#[path = "dataplane/load.rs"]
mod load;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use ambit_tests::netbed::{self, PodNet};
use ambit_ztunnel::hbone::client_config;
use ambit_ztunnel::identity::{CertificateManager, Identity};
use anyhow::{Context, Result, bail};

use bed::{Bed, ECHO_PORT, MESH_NS, SINK_PORT};
use load::{Bulk, Conns, Dial, Latency, Mem, Meter, Usage, mem};

fn env_secs(name: &str, default: f64) -> Duration {
    let v = std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(default);
    Duration::from_secs_f64(v)
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn mem_cell(m: &Mem) -> String {
    format!(
        "{} (anon {}, file {})",
        mib(m.rss),
        mib(m.anon),
        mib(m.file)
    )
}

/// Runs a blocking load generator off the runtime's workers (they serve
/// the apps).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await?
}

fn check(what: &str, c: &Conns) -> Result<()> {
    if c.samples.is_empty() {
        bail!(
            "{what}: no connection succeeded ({} errors; first: {})",
            c.errors,
            c.first_error.as_deref().unwrap_or("-")
        );
    }
    if c.errors > 0 {
        println!(
            "  ! {what}: {} of {} connections failed; first: {}",
            c.errors,
            c.errors + c.samples.len(),
            c.first_error.as_deref().unwrap_or("-")
        );
    }
    Ok(())
}

/// Per-phase ztunnel cost, printed at the end.
struct CpuRow {
    phase: String,
    usage: Usage,
    per: String,
}

fn main() -> Result<()> {
    if std::env::var("AMBIT_BENCH_ROLE").as_deref() == Ok(child::ROLE) {
        return child::run();
    }
    if std::env::args().any(|a| a == "--list") {
        return Ok(()); // `cargo test --benches` discovery
    }
    if !netbed::can_run("dataplane bench") {
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run())
}

async fn run() -> Result<()> {
    let secs = env_secs("SECS", 5.0);
    let conn_secs = env_secs("CONN_SECS", 3.0);
    let only = std::env::var("ONLY").ok();
    let want = |phase: &str| {
        only.as_deref()
            .is_none_or(|o| o.split(',').any(|p| p.trim() == phase))
    };
    let t_all = std::time::Instant::now();
    let busy = load::machine_busy_secs();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let busy = load::machine_busy_secs() - busy;
    println!(
        "machine before the bench: {:.0} % of a core busy (2 cores: the bench wants them idle)",
        busy * 100.0
    );
    let bed = Bed::start().await?;
    let zt = bed.zt.pid;
    let mesh_sink = Arc::new(AtomicU64::new(0));
    let plain_sink = Arc::new(AtomicU64::new(0));
    let _servers = [
        bed::sink(&bed.server, SINK_PORT, mesh_sink.clone())?,
        bed::sink(&bed.plain_server, SINK_PORT, plain_sink.clone())?,
        bed::echo(&bed.server, ECHO_PORT)?,
        bed::echo(&bed.plain_server, ECHO_PORT)?,
    ];
    println!(
        "one node, one ztunnel (child pid {zt}) doing both ends; pods client {} / server {} \
         (enrolled), plain-client {} / plain-server {}; {} s per bulk/latency run, {} s per \
         connection run",
        bed.client.ip,
        bed.server.ip,
        bed.plain_client.ip,
        bed.plain_server.ip,
        secs.as_secs_f64(),
        conn_secs.as_secs_f64()
    );

    // Idle: every pod enrolled, certificates held, no traffic yet.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = Meter::start(zt);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle = idle.stop();
    let rss_idle = mem(zt);
    println!(
        "ztunnel idle ({} pods enrolled, 2 identities, before any traffic): RSS {}, CPU {:.0} ms/s",
        2 + bed::CONN_CLIENTS.len(),
        mem_cell(&rss_idle),
        idle.zt_cpu / idle.secs * 1e3
    );
    let mut rss = vec![("idle, pods enrolled".to_string(), rss_idle)];
    let mut cpu = Vec::new();

    let mesh_echo = bed.server.addr(ECHO_PORT);
    let plain_echo = bed.plain_server.addr(ECHO_PORT);
    // First connections through the mesh: TLS configs, the pooled HBONE
    // connection, first buffers.
    {
        let (client, dst) = (bed.client.clone(), mesh_echo);
        let w = blocking(move || load::conns_app(&client, dst, 1, Duration::ZERO, Some(50), zt))
            .await?;
        check("warm-up", &w)?;
    }

    // 1. Bulk throughput.
    if want("bulk") {
        println!("\n## Bulk throughput (256 KiB writes into a sink)\n");
        println!(
            "| streams | no mesh (pod → pod, veth + bridge) | loopback (inside one pod) | mesh (HBONE) | mesh / no mesh | ztunnel CPU | ztunnel CPU per GB | no-mesh CPU per GB (apps + kernel) |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for streams in [1, 4] {
            let base = load::bulk(
                &bed.plain_client,
                bed.plain_server.addr(SINK_PORT),
                &plain_sink,
                streams,
                secs,
                zt,
            )
            .await?;
            let lo = load::bulk(
                &bed.plain_server,
                SocketAddr::from(([127, 0, 0, 1], SINK_PORT)),
                &plain_sink,
                streams,
                secs,
                zt,
            )
            .await?;
            let mesh = load::bulk(
                &bed.client,
                bed.server.addr(SINK_PORT),
                &mesh_sink,
                streams,
                secs,
                zt,
            )
            .await?;
            let gb = |b: &Bulk| b.bytes as f64 / 1e9;
            println!(
                "| {streams} | {:.2} Gbit/s | {:.2} Gbit/s | **{:.2} Gbit/s** | {:.0} % | {:.2} s in {:.1} s ({:.0} % of a core) | {:.2} s | {:.2} s |",
                base.gbps(),
                lo.gbps(),
                mesh.gbps(),
                mesh.gbps() / base.gbps() * 100.0,
                mesh.usage.zt_cpu,
                mesh.usage.secs,
                mesh.usage.zt_cpu / mesh.usage.secs * 100.0,
                mesh.usage.zt_cpu / gb(&mesh),
                (base.usage.own_cpu + base.usage.other_cpu) / gb(&base),
            );
            cpu.push(bulk_row(streams, &mesh));
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        rss.push(("after bulk".into(), mem(zt)));
    }

    // 2. Request/response latency.
    if want("latency") {
        println!(
            "\n## Request/response latency (1 KiB → 1 KiB echo, one persistent connection; µs)\n"
        );
        println!(
            "| load | no mesh p50 / p99 / p99.9 | mesh p50 / p99 / p99.9 | mesh − no mesh p50 / p99 / p99.9 | ztunnel CPU per 1,000 req |"
        );
        println!("|---|---|---|---|---|");
        let plain_conn = {
            let (p, d) = (bed.plain_client.clone(), plain_echo);
            blocking(move || load::connect_blocking(&p, d)).await?
        };
        let mesh_conn = {
            let (p, d) = (bed.client.clone(), mesh_echo);
            blocking(move || load::connect_blocking(&p, d)).await?
        };
        let plain_conn = Arc::new(plain_conn);
        let mesh_conn = Arc::new(mesh_conn);
        for rate in [Some(1000.0), Some(5000.0), None] {
            let mut runs: Vec<Latency> = Vec::new();
            for conn in [&plain_conn, &mesh_conn] {
                let conn = conn.clone();
                let l = blocking(move || {
                    load::rr_warmup(&conn, 500)?;
                    match rate {
                        Some(r) => load::rr_open(&conn, r, secs, zt),
                        None => load::rr_closed(&conn, secs, zt),
                    }
                })
                .await?;
                runs.push(l);
            }
            let (base, mesh) = (&runs[0], &runs[1]);
            let label = match rate {
                Some(r) => format!("{r:.0} req/s"),
                None => format!(
                    "closed loop (no mesh {:.0} req/s, mesh {:.0} req/s)",
                    base.rps(),
                    mesh.rps()
                ),
            };
            let trip = |l: &Latency| {
                format!(
                    "{:.0} / {:.0} / {:.0}",
                    l.pct(0.5),
                    l.pct(0.99),
                    l.pct(0.999)
                )
            };
            let per_k = mesh.usage.zt_cpu / (mesh.samples.len() as f64 / 1e3) * 1e3;
            println!(
                "| {label} | {} | **{}** | +{:.0} / +{:.0} / +{:.0} | {per_k:.1} ms |",
                trip(base),
                trip(mesh),
                mesh.pct(0.5) - base.pct(0.5),
                mesh.pct(0.99) - base.pct(0.99),
                mesh.pct(0.999) - base.pct(0.999),
            );
            if let Some(r) = rate
                && (mesh.rps() < r * 0.97 || base.rps() < r * 0.97)
            {
                println!(
                    "  ! rate not held: no mesh {:.0} req/s, mesh {:.0} req/s",
                    base.rps(),
                    mesh.rps()
                );
            }
            cpu.push(CpuRow {
                phase: format!("latency, {label}"),
                usage: mesh.usage,
                per: format!("{per_k:.1} ms per 1,000 requests"),
            });
        }
        drop((plain_conn, mesh_conn));
        rss.push(("after latency".into(), mem(zt)));
    }

    // 3a. App-level new connections.
    if want("conn") || want("hbone") {
        println!(
            "\n## New connections (µs per connection = mean time from connect to the 1-byte echo)\n"
        );
        println!(
            "| test | no mesh | mesh | mesh − no mesh per connection | ztunnel CPU per connection |"
        );
        println!("|---|---|---|---|---|");
        let mut tw = Vec::new();
        for (workers, client) in [(1, &bed.conn_clients[0]), (8, &bed.conn_clients[1])]
            .into_iter()
            .filter(|_| want("conn"))
        {
            let mut runs = Vec::new();
            for (pod, dst) in [(&bed.plain_client, plain_echo), (client, mesh_echo)] {
                let pod = pod.clone();
                let c = blocking(move || {
                    load::conns_app(&pod, dst, workers, Duration::ZERO, Some(100), zt)?;
                    load::conns_app(&pod, dst, workers, conn_secs, None, zt)
                })
                .await?;
                runs.push(c);
            }
            let label = if workers == 1 {
                "app connect + 1-byte echo + close, sequential".to_string()
            } else {
                format!("app connect + 1-byte echo + close, {workers} at a time")
            };
            conn_row(&label, &runs[0], &runs[1], &mut cpu)?;
            tw.push((client.name.clone(), load::time_wait(&bed.server)?));
            tokio::time::sleep(Duration::from_millis(300)).await;
        }

        // 3b. New HBONE connections straight to the server pod's :15008.
        if want("hbone") {
            let (tls_full, tls_resume) = hbone_tls(&bed).await?;
            let peer = SocketAddr::new(bed.server.ip.into(), 15008);
            for (label, workers, tls, client) in [
                (
                    "new HBONE connection (TLS 1.3 full handshake + h2 + CONNECT + 1-byte echo), sequential",
                    1,
                    &tls_full,
                    &bed.conn_clients[2],
                ),
                (
                    "new HBONE connection, full handshake, 8 at a time",
                    8,
                    &tls_full,
                    &bed.conn_clients[3],
                ),
                (
                    "new HBONE connection, TLS session resumed, sequential",
                    1,
                    &tls_resume,
                    &bed.conn_clients[4],
                ),
            ] {
                let base = tokio_conns(
                    &bed.plain_client,
                    Dial::Plain,
                    plain_echo,
                    workers,
                    conn_secs,
                    zt,
                )
                .await?;
                let dial = Dial::Hbone {
                    peer,
                    tls: tls.clone(),
                };
                let mesh = tokio_conns(client, dial, mesh_echo, workers, conn_secs, zt).await?;
                conn_row(label, &base, &mesh, &mut cpu)?;
                tw.push((client.name.clone(), load::time_wait(&bed.server)?));
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            println!(
                "\n(no mesh for the HBONE rows: plain TCP connect + 1-byte echo + orderly close from the \
         same tokio client; client-side TLS runs in the bench process on the same 2 cores)"
            );
        }
        let tw: Vec<String> = tw.iter().map(|(c, n)| format!("{n} after {c}")).collect();
        println!(
            "(each mesh run from its own client pod; TIME_WAIT sockets in the server pod: {})",
            tw.join(", ")
        );
        rss.push(("after new connections".into(), mem(zt)));
    }

    // 4. CPU and memory.
    println!("\n## ztunnel CPU per phase (mesh runs only)\n");
    println!(
        "| phase | ztunnel CPU | bench process CPU (load + apps) | rest of the machine | ztunnel cost |"
    );
    println!("|---|---|---|---|---|");
    for r in &cpu {
        println!(
            "| {} | {:.2} s in {:.1} s ({:.0} %) | {:.2} s | {:.2} s | {} |",
            r.phase,
            r.usage.zt_cpu,
            r.usage.secs,
            r.usage.zt_cpu / r.usage.secs * 100.0,
            r.usage.own_cpu,
            r.usage.other_cpu,
            r.per
        );
    }
    let busiest = cpu
        .iter()
        .map(|r| r.usage.other_cpu / r.usage.secs)
        .fold(0.0, f64::max);
    if busiest > 0.25 {
        println!(
            "\n! other work used up to {:.0} % of a core during a phase: the figures are \
             disturbed, rerun on an idle machine",
            busiest * 100.0
        );
    }
    let end = mem(zt);
    println!("\n## ztunnel memory\n");
    println!("| when | RSS |");
    println!("|---|---|");
    for (when, m) in &rss {
        println!("| {when} | {} |", mem_cell(m));
    }
    println!("| at the end | {} |", mem_cell(&end));
    println!("| peak (VmHWM) | {} |", mib(end.hwm));
    let log = std::fs::metadata(&bed.zt.log).map(|m| m.len()).unwrap_or(0);
    println!(
        "\nztunnel log: {:.1} MiB written; total bench time {:.0} s",
        log as f64 / (1 << 20) as f64,
        t_all.elapsed().as_secs_f64()
    );
    bed.shutdown().await;
    Ok(())
}

fn bulk_row(streams: usize, mesh: &Bulk) -> CpuRow {
    CpuRow {
        phase: format!("bulk, {streams} stream(s)"),
        usage: mesh.usage,
        per: format!(
            "{:.2} s per GB",
            mesh.usage.zt_cpu / (mesh.bytes as f64 / 1e9)
        ),
    }
}

fn conn_row(label: &str, base: &Conns, mesh: &Conns, cpu: &mut Vec<CpuRow>) -> Result<()> {
    check(&format!("{label} (no mesh)"), base)?;
    check(&format!("{label} (mesh)"), mesh)?;
    let per_conn = mesh.usage.zt_cpu / mesh.samples.len() as f64 * 1e6;
    let cell = |c: &Conns| {
        format!(
            "{:.0}/s, {:.0} µs (p99 {:.0})",
            c.per_sec(),
            c.mean_us(),
            load::percentile(&c.samples, 0.99)
        )
    };
    println!(
        "| {label} | {} | **{}** | +{:.0} µs | {per_conn:.0} µs |",
        cell(base),
        cell(mesh),
        mesh.mean_us() - base.mean_us()
    );
    cpu.push(CpuRow {
        phase: label.to_string(),
        usage: mesh.usage,
        per: format!("{per_conn:.0} µs per connection"),
    });
    Ok(())
}

async fn tokio_conns(
    pod: &PodNet,
    dial: Dial,
    echo: SocketAddr,
    workers: usize,
    dur: Duration,
    zt: u32,
) -> Result<Conns> {
    let warm = load::conns_tokio(pod, dial.clone(), echo, workers, dur, Some(20), zt).await?;
    check("warm-up", &warm)?;
    load::conns_tokio(pod, dial, echo, workers, dur, None, zt).await
}

/// Client TLS configs presenting the client pod's certificate (issued by the
/// control plane's CA for a node-0 token) and pinning the server's
/// identity: one with session resumption off (every handshake full), one
/// with rustls' default client session cache.
async fn hbone_tls(bed: &Bed) -> Result<(Arc<rustls::ClientConfig>, Arc<rustls::ClientConfig>)> {
    let mut cfg = ambit_ztunnel::Config::new("node-0", bed.xds.clone());
    cfg.token_file = Some(bed.token_file.clone());
    cfg.root_cert = Some(bed.root_cert.clone());
    let certs = CertificateManager::from_config(&cfg)?;
    let client = Identity::new("cluster.local", MESH_NS, "client");
    let server = Identity::new("cluster.local", MESH_NS, "server");
    let cert = tokio::time::timeout(bed::WAIT, certs.fetch(&client))
        .await
        .context("client certificate")??;
    let bundle = certs.trust_bundle().borrow().clone();
    let resume = client_config(&cert, &bundle, server.clone())?;
    let mut full = client_config(&cert, &bundle, server)?;
    full.resumption = rustls::client::Resumption::disabled();
    Ok((Arc::new(full), Arc::new(resume)))
}
