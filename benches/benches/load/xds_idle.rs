//! c. A flood of idle connections to the control plane's TLS xDS port
//! (15012 in a cluster; the bed's `--xds-tls-addr`) while a real `ztunnel`
//! process starts and syncs. Each flood holds `--conns` connection slots
//! from `--sources` source addresses (127.1.x.y; the ztunnels connect from
//! 127.0.0.1) and re-opens a slot 1 s after the server closed it, so the
//! flood is sustained, not a one-off burst. Kinds:
//!
//! * `tcp`: connect and send nothing;
//! * `tls-stalled`: send a TLS 1.3 ClientHello, then nothing (the server has
//!   answered and waits for the client's Finished);
//! * `tls-idle`: complete the TLS handshake (no client certificate, as
//!   anyone may), then send nothing (no HTTP/2 preface).
//!
//! Reports the time from starting the ztunnel to its first full sync
//! (`/healthz/ready`), the connections the server holds, and ambit-control's
//! RSS, against a baseline without flood in the same run.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rustls::pki_types::ServerName;
use rustls::pki_types::pem::PemObject;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;
use tokio::task::JoinSet;

use crate::Opts;
use crate::bed::{self, Bed, mem_cell};
use crate::dpload::{self, Mem};

/// Longest wait for the ztunnel's first sync.
const SYNC_LIMIT: Duration = Duration::from_secs(60);
/// A closed slot is re-opened after this long.
const REOPEN: Duration = Duration::from_secs(1);
/// Slots started per second while the flood ramps up.
const RAMP_PER_SEC: f64 = 5_000.0;

/// Counters of one flood.
#[derive(Default)]
struct Stats {
    /// Connected and not yet closed by the server.
    open: AtomicUsize,
    connects: AtomicU64,
    connect_errors: AtomicU64,
    closed_by_server: AtomicU64,
    /// `tls-idle`: handshakes completed.
    handshakes: AtomicU64,
    handshake_errors: AtomicU64,
}

impl Stats {
    fn line(&self) -> String {
        format!(
            "{} open now; {} connects, {} closed by the server, {} connect errors, {} handshakes done / {} failed",
            self.open.load(Ordering::Relaxed),
            self.connects.load(Ordering::Relaxed),
            self.closed_by_server.load(Ordering::Relaxed),
            self.connect_errors.load(Ordering::Relaxed),
            self.handshakes.load(Ordering::Relaxed),
            self.handshake_errors.load(Ordering::Relaxed),
        )
    }
}

#[derive(Clone)]
enum Kind {
    Tcp,
    Stalled(Arc<Vec<u8>>),
    Idle(tokio_rustls::TlsConnector),
}

/// The mesh root as trust anchor, ALPN h2, no client certificate.
fn tls_config(root: &Path) -> Result<Arc<rustls::ClientConfig>> {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_file_iter(root)? {
        roots.add(c?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

/// One ClientHello, sent verbatim by every stalled slot (the server does
/// its part of the handshake for each).
fn client_hello(cfg: Arc<rustls::ClientConfig>) -> Result<Vec<u8>> {
    let mut conn = rustls::ClientConnection::new(cfg, ServerName::try_from("localhost")?)?;
    let mut out = Vec::new();
    while conn.wants_write() {
        conn.write_tls(&mut out)?;
    }
    Ok(out)
}

fn source(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 1, (i / 250) as u8, (i % 250 + 1) as u8)
}

async fn slot(dst: SocketAddr, src: Ipv4Addr, kind: Kind, stats: Arc<Stats>) {
    loop {
        let sock = TcpSocket::new_v4().and_then(|s| {
            s.bind(SocketAddr::V4(SocketAddrV4::new(src, 0)))?;
            Ok(s)
        });
        let conn = match sock {
            Ok(s) => s.connect(dst).await,
            Err(e) => Err(e),
        };
        match conn {
            Ok(mut s) => {
                stats.connects.fetch_add(1, Ordering::Relaxed);
                stats.open.fetch_add(1, Ordering::Relaxed);
                let mut buf = vec![0u8; 4096];
                match &kind {
                    Kind::Tcp => while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {},
                    Kind::Stalled(hello) => {
                        if s.write_all(hello).await.is_ok() {
                            while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                        }
                    }
                    Kind::Idle(connector) => {
                        let name = ServerName::try_from("localhost").map(|n| n.to_owned());
                        match name {
                            Ok(name) => match connector.connect(name, s).await {
                                Ok(mut tls) => {
                                    stats.handshakes.fetch_add(1, Ordering::Relaxed);
                                    while matches!(tls.read(&mut buf).await, Ok(n) if n > 0) {}
                                }
                                Err(_) => {
                                    stats.handshake_errors.fetch_add(1, Ordering::Relaxed);
                                }
                            },
                            Err(_) => return,
                        }
                    }
                }
                stats.open.fetch_sub(1, Ordering::Relaxed);
                stats.closed_by_server.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                stats.connect_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        tokio::time::sleep(REOPEN).await;
    }
}

/// A free loopback port.
fn free_addr() -> Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

/// Starts a `ztunnel` process for node-1 (no pods: `--zds-path ""`) and
/// times it to its first full xDS sync; `None` when not within
/// [`SYNC_LIMIT`]. The process is stopped either way.
async fn ztunnel_sync(bed: &Bed, log: &Path) -> Result<Option<Duration>> {
    let ready = free_addr()?;
    let xds = format!("https://{}", bed.xds_tls);
    let mut child = tokio::process::Command::new(bed.bins.join("ztunnel"))
        .args(["--xds-address", &xds, "--ca-address", &xds])
        .args(["--node-name", "node-1", "--zds-path", ""])
        .arg("--token-file")
        .arg(&bed.token_node1)
        .arg("--root-cert")
        .arg(&bed.root_cert)
        .args(["--admin-addr", &free_addr()?.to_string()])
        .args(["--stats-addr", &free_addr()?.to_string()])
        .args(["--readiness-addr", &ready.to_string()])
        .env("RUST_LOG", "info")
        .env("MIMALLOC_ALLOW_THP", "0")
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(log)?)
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting ztunnel")?;
    let t = Instant::now();
    let mut synced = None;
    while t.elapsed() < SYNC_LIMIT {
        if let Ok(Some(status)) = child.try_wait() {
            bail!("ztunnel exited: {status} (log {})", log.display());
        }
        let ok = tokio::time::timeout(
            Duration::from_secs(1),
            ambit_tests::http(ready, "GET", "/healthz/ready"),
        )
        .await
        .is_ok_and(|r| r.is_ok_and(|(s, _)| s == 200));
        if ok {
            synced = Some(t.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if let Some(pid) = child.id() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    if tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .is_err()
    {
        child.kill().await?;
    }
    Ok(synced)
}

fn ms(d: Option<Duration>) -> String {
    match d {
        Some(d) => format!("{:.0} ms", d.as_secs_f64() * 1e3),
        None => format!("**not synced in {} s**", SYNC_LIMIT.as_secs()),
    }
}

pub async fn run(bins: &Path, opts: &Opts) -> Result<()> {
    let bed = Bed::start(bins, "").await?;
    let r = run_on(&bed, opts).await;
    bed.down().await?;
    r
}

struct Row {
    what: String,
    sync: Option<Duration>,
    held: String,
    before: Mem,
    during: Mem,
    cpu: f64,
}

async fn run_on(bed: &Bed, opts: &Opts) -> Result<()> {
    let logs = tempfile::tempdir()?;
    let tls = tls_config(&bed.root_cert)?;
    let hello = Arc::new(client_hello(tls.clone())?);
    let mut rows = Vec::new();
    let base_mem = dpload::mem(bed.control);
    let base = ztunnel_sync(bed, &logs.path().join("base.log")).await?;
    println!(
        "baseline: ztunnel synced in {}; control {}",
        ms(base),
        mem_cell(&base_mem)
    );
    rows.push(Row {
        what: "no flood".into(),
        sync: base,
        held: "-".into(),
        before: base_mem,
        during: dpload::mem(bed.control),
        cpu: 0.0,
    });
    for kind_name in &opts.kinds {
        for &sources in &opts.sources {
            let kind = match kind_name.as_str() {
                "tcp" => Kind::Tcp,
                "tls-stalled" => Kind::Stalled(hello.clone()),
                "tls-idle" => Kind::Idle(tokio_rustls::TlsConnector::from(tls.clone())),
                k => bail!("unknown flood kind {k:?}: tcp, tls-stalled or tls-idle"),
            };
            let what = format!(
                "{} × {kind_name} from {sources} source address{}",
                opts.conns,
                if sources == 1 { "" } else { "es" }
            );
            println!("\n{what} (machine: {})", bed::machine_state().await);
            let before = dpload::mem(bed.control);
            let cpu0 = dpload::cpu_secs(bed.control);
            let stats = Arc::new(Stats::default());
            let mut slots = JoinSet::new();
            let ramp = Instant::now();
            for i in 0..opts.conns {
                let at = ramp + Duration::from_secs_f64(i as f64 / RAMP_PER_SEC);
                let (kind, stats, src) = (kind.clone(), stats.clone(), source(i % sources.max(1)));
                let dst = bed.xds_tls;
                slots.spawn(async move {
                    tokio::time::sleep_until(at.into()).await;
                    slot(dst, src, kind, stats).await;
                });
            }
            let ramp_secs = opts.conns as f64 / RAMP_PER_SEC;
            tokio::time::sleep(Duration::from_secs_f64(ramp_secs) + opts.hold).await;
            let during = dpload::mem(bed.control);
            let held = stats.open.load(Ordering::Relaxed);
            println!(
                "  after the ramp and {:.0} s: {}; control {}",
                opts.hold.as_secs_f64(),
                stats.line(),
                mem_cell(&during)
            );
            let log = logs.path().join(format!("{kind_name}-{sources}.log"));
            let sync = ztunnel_sync(bed, &log).await?;
            let peak = dpload::mem(bed.control);
            let cpu = dpload::cpu_secs(bed.control) - cpu0;
            let secs = ramp.elapsed().as_secs_f64();
            println!(
                "  ztunnel synced in {} during the flood; {}; control {} (peak {:.1} MiB), {:.2} cores over the flood",
                ms(sync),
                stats.line(),
                mem_cell(&peak),
                bed::mib(peak.hwm),
                cpu / secs
            );
            if sync.is_none() {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(5).collect();
                println!("  ztunnel log tail: {tail:?}");
            }
            slots.abort_all();
            while slots.join_next().await.is_some() {}
            rows.push(Row {
                what,
                sync,
                held: format!(
                    "{held} (of {} connects in {:.0} s)",
                    stats.connects.load(Ordering::Relaxed),
                    secs
                ),
                before,
                during,
                cpu: cpu / secs,
            });
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
    }
    println!(
        "\n| flood | held by the server (of slots' connects) | ztunnel start → first full sync | control RSS before → during | control CPU during the flood |"
    );
    println!("|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | **{}** | {} → {} | {:.2} cores |",
            r.what,
            r.held,
            ms(r.sync),
            mem_cell(&r.before),
            mem_cell(&r.during),
            r.cpu
        );
    }
    Ok(())
}
