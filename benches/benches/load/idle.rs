//! a. Many idle connections: `--conns` app connections from `mesh/client`
//! through both ztunnels to `mesh/server`'s echo (each proven end to end by
//! a 1-byte echo, then held idle), and the same number of direct HBONE
//! connections (TCP + TLS 1.3 + HTTP/2, no stream) to the server pod's
//! 15008, held idle. Reports each ztunnel's RSS before, while held and
//! after they close, and the bytes per idle connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ambit_inpod::{NetnsSockets, SocketOptions, ZTUNNEL_MARK};
use ambit_tests::netbed::PodNet;
use ambit_ztunnel::hbone::{HboneClient, HboneConnection};
use anyhow::{Context, Result, bail};
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::Opts;
use crate::bed::{self, Bed, ECHO_PORT, mem_cell};
use crate::dpload::Mem;

/// Connections being opened at once.
const CONCURRENCY: usize = 64;
/// Bound on one connection's setup or check.
const OP: Duration = Duration::from_secs(10);

/// Results of opening many connections.
pub struct Opened<T> {
    pub conns: Vec<T>,
    pub failed: usize,
    pub first_error: Option<String>,
    pub secs: f64,
}

impl<T> Opened<T> {
    fn from(results: Vec<Result<T>>, secs: f64) -> Self {
        let mut o = Opened {
            conns: Vec::new(),
            failed: 0,
            first_error: None,
            secs,
        };
        for r in results {
            match r {
                Ok(c) => o.conns.push(c),
                Err(e) => {
                    o.failed += 1;
                    o.first_error.get_or_insert_with(|| format!("{e:#}"));
                }
            }
        }
        o
    }

    pub fn summary(&self) -> String {
        format!(
            "{} open, {} failed in {:.1} s{}",
            self.conns.len(),
            self.failed,
            self.secs,
            self.first_error
                .as_ref()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default()
        )
    }
}

/// One app connection through the mesh, proven by a 1-byte echo.
pub async fn app_conn(sockets: &NetnsSockets, dst: SocketAddr) -> Result<TcpStream> {
    tokio::time::timeout(OP, async {
        let mut s = sockets.connect(dst, &SocketOptions::default()).await?;
        s.set_nodelay(true)?;
        s.write_all(b"x").await?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b).await.context("no echo")?;
        anyhow::Ok(s)
    })
    .await
    .context("timed out")?
}

/// `n` app connections, [`CONCURRENCY`] at a time.
pub async fn open_app(sockets: &NetnsSockets, dst: SocketAddr, n: usize) -> Opened<TcpStream> {
    let t = Instant::now();
    let results: Vec<Result<TcpStream>> = futures::stream::iter(0..n)
        .map(|_| app_conn(sockets, dst))
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    Opened::from(results, t.elapsed().as_secs_f64())
}

/// How many of `conns` still echo a byte.
async fn alive(conns: &mut [TcpStream]) -> usize {
    futures::stream::iter(conns.iter_mut())
        .map(|s| async move {
            tokio::time::timeout(OP, async {
                s.write_all(b"y").await?;
                let mut b = [0u8; 1];
                s.read_exact(&mut b).await?;
                std::io::Result::Ok(())
            })
            .await
            .is_ok_and(|r| r.is_ok())
        })
        .buffer_unordered(256)
        .filter(|ok| std::future::ready(*ok))
        .count()
        .await
}

/// Established TCP sockets in `pod`'s netns whose local port is `port`.
pub async fn established_on(pod: &PodNet, port: u16) -> Result<usize> {
    let tcp = bed::read_in(pod, "/proc/thread-self/net/tcp").await?;
    let want = format!(":{port:04X}");
    Ok(tcp
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(1).is_some_and(|a| a.ends_with(&want)) && f.get(3) == Some(&"01")
        })
        .count())
}

/// Bytes per connection of an RSS rise.
fn per_conn(before: u64, after: u64, n: usize) -> String {
    if n == 0 {
        return "-".into();
    }
    let d = after as f64 - before as f64;
    format!("{:.1} KiB", d / n as f64)
}

fn row(what: &str, before: &Mem, held: &Mem, closed: &Mem, n: usize) {
    println!(
        "| {what} | {} | {} | {} | **{}** (anon {}) |",
        mem_cell(before),
        mem_cell(held),
        mem_cell(closed),
        per_conn(before.rss, held.rss, n),
        per_conn(before.anon, held.anon, n),
    );
}

pub async fn run(bins: &std::path::Path, opts: &Opts) -> Result<()> {
    let bed = Bed::start(bins, "").await?;
    let r = run_on(&bed, opts).await;
    bed.down().await?;
    r
}

async fn run_on(bed: &Bed, opts: &Opts) -> Result<()> {
    let n = opts.conns;
    let _echo = bed.echo().await?;
    let dst = bed.echo_addr();
    let sockets = NetnsSockets::spawn(&bed.client.open()?)?;
    // The first connection: certificates, the HBONE pool, first buffers.
    for _ in 0..3 {
        drop(app_conn(&sockets, dst).await?);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = bed.mem();
    println!(
        "before: source ztunnel {}, destination ztunnel {}, control {}",
        mem_cell(&before[0]),
        mem_cell(&before[1]),
        mem_cell(&before[2])
    );

    // App connections through the mesh.
    let mut app = open_app(&sockets, dst, n).await;
    println!(
        "{n} app connections mesh/client → mesh/server:{ECHO_PORT}: {}",
        app.summary()
    );
    if app.conns.is_empty() {
        bail!("no app connection opened");
    }
    tokio::time::sleep(opts.hold).await;
    let held = bed.mem();
    let hbone = established_on(&bed.server, 15008).await?;
    let t = Instant::now();
    let ok = alive(&mut app.conns).await;
    println!(
        "after {:.0} s idle: {ok} of {} still echo (checked in {:.1} s); {hbone} HBONE connections \
         node-1 → node-2 carry them; peak RSS (VmHWM) source {:.1} / destination {:.1} MiB",
        opts.hold.as_secs_f64(),
        app.conns.len(),
        t.elapsed().as_secs_f64(),
        bed::mib(held[0].hwm),
        bed::mib(held[1].hwm)
    );
    let opened = app.conns.len();
    drop(app);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let closed = bed.mem();

    // Direct HBONE connections to the server pod's 15008, no stream.
    let tls = bed.hbone_tls().await?;
    let peer = SocketAddr::new(bed.server.ip.into(), 15008);
    let before_d = bed.mem();
    let direct = open_hbone(&sockets, peer, tls, n).await;
    println!(
        "{n} direct HBONE connections (TCP + TLS 1.3 + h2, no stream) mesh/client → {peer}: {}",
        direct.summary()
    );
    tokio::time::sleep(opts.hold).await;
    let held_d = bed.mem();
    let usable = direct.conns.iter().filter(|c| c.is_usable()).count();
    let est = established_on(&bed.server, 15008).await?;
    println!(
        "after {:.0} s idle: {usable} of {} still usable, {est} established on the server pod's 15008",
        opts.hold.as_secs_f64(),
        direct.conns.len()
    );
    let opened_d = direct.conns.len();
    drop(direct);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let closed_d = bed.mem();

    println!(
        "\n| idle connections | RSS before | RSS held | RSS 5 s after closing | per connection (RSS) |"
    );
    println!("|---|---|---|---|---|");
    row(
        &format!("{opened} app conns via HBONE: source ztunnel (node-1)"),
        &before[0],
        &held[0],
        &closed[0],
        opened,
    );
    row(
        &format!("{opened} app conns via HBONE: destination ztunnel (node-2)"),
        &before[1],
        &held[1],
        &closed[1],
        opened,
    );
    row(
        &format!("{opened_d} direct HBONE conns to 15008: destination ztunnel"),
        &before_d[1],
        &held_d[1],
        &closed_d[1],
        opened_d,
    );
    println!(
        "control plane: {} → {}",
        mem_cell(&before[2]),
        mem_cell(&closed_d[2])
    );
    Ok(())
}

/// `n` HBONE connections to `peer` from the client pod (socket marked so
/// the pod's capture lets it through), [`CONCURRENCY`] / 4 at a time.
async fn open_hbone(
    sockets: &NetnsSockets,
    peer: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    n: usize,
) -> Opened<HboneConnection> {
    let t = Instant::now();
    let opts = SocketOptions {
        mark: Some(ZTUNNEL_MARK),
        ..SocketOptions::default()
    };
    let results: Vec<Result<HboneConnection>> = futures::stream::iter(0..n)
        .map(|_| {
            let tls = tls.clone();
            async move {
                tokio::time::timeout(OP, async {
                    let tcp = sockets.connect(peer, &opts).await?;
                    anyhow::Ok(HboneClient::connect(tcp, tls).await?)
                })
                .await
                .context("timed out")?
            }
        })
        .buffer_unordered(CONCURRENCY / 4)
        .collect()
        .await;
    Opened::from(results, t.elapsed().as_secs_f64())
}
