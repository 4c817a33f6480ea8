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
    // App connections, then direct HBONE connections, each on a fresh bed
    // so each starts from an idle ztunnel.
    let bed = Bed::start(bins, "").await?;
    let app = app_conns(&bed, opts).await;
    bed.down().await?;
    let app = app?;
    let direct = if opts.direct {
        let bed = Bed::start(bins, "").await?;
        let direct = direct_conns(&bed, opts).await;
        bed.down().await?;
        Some(direct?)
    } else {
        None
    };

    println!(
        "\n| idle connections | RSS before | RSS held | RSS 5 s after closing | per connection (RSS) |"
    );
    println!("|---|---|---|---|---|");
    for (what, i) in [
        ("source ztunnel (node-1)", 0),
        ("destination ztunnel (node-2)", 1),
    ] {
        row(
            &format!("{} app conns via HBONE: {what}", app.opened),
            &app.before[i],
            &app.held[i],
            &app.closed[i],
            app.opened,
        );
    }
    if let Some(direct) = &direct {
        row(
            &format!(
                "{} direct HBONE conns to 15008: destination ztunnel",
                direct.opened
            ),
            &direct.before[1],
            &direct.held[1],
            &direct.closed[1],
            direct.opened,
        );
    }
    println!(
        "\n{} rounds of {} app connections on the same ztunnels (each opened, held, closed):\n",
        app.rounds.len(),
        app.opened
    );
    println!(
        "| round | source held | source 5 s after closing | destination held | destination 5 s after closing |"
    );
    println!("|---|---|---|---|---|");
    for (i, (held, closed)) in app.rounds.iter().enumerate() {
        println!(
            "| {} | {} | {} | {} | {} |",
            i + 1,
            mem_cell(&held[0]),
            mem_cell(&closed[0]),
            mem_cell(&held[1]),
            mem_cell(&closed[1]),
        );
    }
    if let Some((_, last)) = app.rounds.last() {
        println!(
            "after the last round: source {} → {}, destination {} → {} (growth = not reused); \
             after settling {:.0} s more: source {}, destination {}",
            mem_cell(&app.closed[0]),
            mem_cell(&last[0]),
            mem_cell(&app.closed[1]),
            mem_cell(&last[1]),
            opts.settle.as_secs_f64(),
            mem_cell(&app.settled[0]),
            mem_cell(&app.settled[1]),
        );
    }
    println!(
        "control plane: {} → {}",
        mem_cell(&app.before[2]),
        mem_cell(&app.settled[2])
    );
    Ok(())
}

/// Memory around one kind of idle connections.
struct Held {
    opened: usize,
    before: [Mem; 3],
    /// While the first round is held, and 5 s after it closed.
    held: [Mem; 3],
    closed: [Mem; 3],
    /// Held and closed, per round on the same ztunnels.
    rounds: Vec<([Mem; 3], [Mem; 3])>,
    /// After the last round and `--settle`.
    settled: [Mem; 3],
}

async fn app_conns(bed: &Bed, opts: &Opts) -> Result<Held> {
    let n = opts.conns;
    let _echo = bed.echo().await?;
    let dst = bed.echo_addr();
    let sockets = NetnsSockets::spawn(&bed.client.open()?)?;
    // The first connections: certificates, the HBONE pool, first buffers.
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
    let mut rounds = Vec::new();
    let mut opened = 0;
    for round in 1..=opts.rounds {
        let mut app = open_app(&sockets, dst, n).await;
        println!(
            "round {round}: {n} app connections mesh/client → mesh/server:{ECHO_PORT}: {}",
            app.summary()
        );
        if app.conns.is_empty() {
            bail!("no app connection opened");
        }
        tokio::time::sleep(opts.hold).await;
        let m = bed.mem();
        let hbone = established_on(&bed.server, 15008).await?;
        let t = Instant::now();
        let ok = alive(&mut app.conns).await;
        println!(
            "  after {:.0} s idle: {ok} of {} still echo (checked in {:.1} s); {hbone} HBONE \
             connections node-1 → node-2 carry them; RSS source {} / destination {}",
            opts.hold.as_secs_f64(),
            app.conns.len(),
            t.elapsed().as_secs_f64(),
            mem_cell(&m[0]),
            mem_cell(&m[1])
        );
        let count = app.conns.len();
        drop(app);
        tokio::time::sleep(Duration::from_secs(5)).await;
        let c = bed.mem();
        println!(
            "  5 s after closing: RSS source {} / destination {}",
            mem_cell(&c[0]),
            mem_cell(&c[1])
        );
        opened = opened.max(count);
        rounds.push((m, c));
        if round == opts.rounds {
            // Does it come back once the pooled HBONE connections idle out?
            let t = Instant::now();
            while t.elapsed() < opts.settle {
                tokio::time::sleep(Duration::from_secs(15)).await;
                let m = bed.mem();
                let hbone = established_on(&bed.server, 15008).await?;
                let (src_open, src_closed) = bed.zt_connections("node-1").await?;
                let (dst_open, dst_closed) = bed.zt_connections("node-2").await?;
                let (client_tcp, _) = bed::sockets(&bed.client).await?;
                let (server_tcp, _) = bed::sockets(&bed.server).await?;
                println!(
                    "  {:.0} s after closing: RSS source {} / destination {}; {hbone} HBONE \
                     connections; ztunnel connections opened/closed source {src_open}/{src_closed}, \
                     destination {dst_open}/{dst_closed}; TCP sockets in use client pod {client_tcp}, \
                     server pod {server_tcp}",
                    t.elapsed().as_secs_f64() + 5.0,
                    mem_cell(&m[0]),
                    mem_cell(&m[1])
                );
            }
        }
    }
    let (held, closed) = rounds[0];
    let settled = bed.mem();
    Ok(Held {
        opened,
        before,
        held,
        closed,
        rounds,
        settled,
    })
}

async fn direct_conns(bed: &Bed, opts: &Opts) -> Result<Held> {
    let n = opts.conns;
    let sockets = NetnsSockets::spawn(&bed.client.open()?)?;
    let tls = bed.hbone_tls().await?;
    let peer = SocketAddr::new(bed.server.ip.into(), 15008);
    // One first, unmeasured (TLS configs, first buffers).
    drop(open_hbone(&sockets, peer, tls.clone(), 1).await);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = bed.mem();
    let direct = open_hbone(&sockets, peer, tls, n).await;
    println!(
        "{n} direct HBONE connections (TCP + TLS 1.3 + h2, no stream) mesh/client → {peer}: {}",
        direct.summary()
    );
    tokio::time::sleep(opts.hold).await;
    let held = bed.mem();
    let usable = direct.conns.iter().filter(|c| c.is_usable()).count();
    let est = established_on(&bed.server, 15008).await?;
    println!(
        "  after {:.0} s idle: {usable} of {} still usable, {est} established on the server pod's 15008",
        opts.hold.as_secs_f64(),
        direct.conns.len()
    );
    let opened = direct.conns.len();
    drop(direct);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let closed = bed.mem();
    Ok(Held {
        opened,
        before,
        held,
        closed,
        rounds: Vec::new(),
        settled: closed,
    })
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
