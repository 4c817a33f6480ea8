//! b. New connections at a fixed rate (open loop): each scheduled
//! connection from `mesh/client` through both ztunnels to `mesh/server`'s
//! echo connects, sends 64 bytes, reads the echo, closes (orderly: our FIN,
//! then the server's). Latency is from the scheduled start, so a generator
//! or a mesh that falls behind shows up in it. Reports the achieved rate,
//! failures (5 s bound per connection) and percentiles per target rate.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ambit_inpod::{NetnsSockets, SocketOptions};
use anyhow::{Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::Opts;
use crate::bed::{self, Bed, pcts};
use crate::dpload::{self, cpu_secs};

/// Request and response size.
const MSG: usize = 64;
/// Bound on one connection, connect to close.
const LIMIT: Duration = Duration::from_secs(5);
/// Beyond this many in flight the generator skips (counted as failures);
/// lower when the file limit is (each connection in flight is a socket).
const MAX_IN_FLIGHT: usize = 30_000;

fn max_in_flight() -> usize {
    let soft = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(MAX_IN_FLIGHT as u64, |(soft, _)| soft);
    (soft as usize)
        .saturating_sub(2_000)
        .clamp(1_000, MAX_IN_FLIGHT)
}

/// One connection: connect, 64-byte echo, orderly close.
pub async fn once(sockets: &NetnsSockets, dst: SocketAddr) -> Result<()> {
    let mut s = sockets.connect(dst, &SocketOptions::default()).await?;
    s.set_nodelay(true)?;
    let req = [0x42u8; MSG];
    s.write_all(&req).await?;
    let mut resp = [0u8; MSG];
    s.read_exact(&mut resp).await?;
    s.shutdown().await?;
    let mut b = [0u8; 1];
    if s.read(&mut b).await? != 0 {
        bail!("echo sent more than asked");
    }
    Ok(())
}

/// Short name of an error, for counting by kind.
pub fn kind(e: &anyhow::Error) -> String {
    let s = format!("{e:#}");
    for k in [
        "timed out",
        "Connection refused",
        "Connection reset",
        "early eof",
        "Broken pipe",
        "Cannot assign requested address",
        "skipped",
    ] {
        if s.contains(k) {
            return k.to_string();
        }
    }
    s.chars().take(80).collect()
}

/// What an open-loop run gave.
#[derive(Default)]
pub struct Run {
    pub target: f64,
    /// The schedule's length.
    pub window: f64,
    /// Until the last connection ended.
    pub secs: f64,
    pub scheduled: u64,
    pub ok: Vec<u64>,
    pub errors: BTreeMap<String, u64>,
    pub first_error: Option<String>,
    pub zt_cpu: [f64; 2],
    pub control_cpu: f64,
    pub own_cpu: f64,
    pub machine_busy: f64,
}

impl Run {
    pub fn failed(&self) -> u64 {
        self.errors.values().sum()
    }
}

/// `rate` connections per second for `dur`, scheduled on a 1 ms grid.
pub async fn open_loop(
    bed: &Bed,
    sockets: &NetnsSockets,
    dst: SocketAddr,
    rate: f64,
    dur: Duration,
) -> Result<Run> {
    let total = (rate * dur.as_secs_f64()).round() as u64;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Result<()>, u64)>();
    let in_flight = Arc::new(AtomicUsize::new(0));
    let cap = max_in_flight();
    let cpu0 = [cpu_secs(bed.zt_src), cpu_secs(bed.zt_dst)];
    let ctl0 = cpu_secs(bed.control);
    let own0 = cpu_secs(std::process::id());
    let busy0 = dpload::machine_busy_secs();
    let start = Instant::now();
    let mut issued = 0u64;
    let mut skipped = 0u64;
    while issued < total {
        let due = ((start.elapsed().as_secs_f64() * rate) as u64 + 1).min(total);
        while issued < due {
            let sched = start + Duration::from_secs_f64(issued as f64 / rate);
            issued += 1;
            if in_flight.load(Ordering::Relaxed) >= cap {
                skipped += 1;
                continue;
            }
            in_flight.fetch_add(1, Ordering::Relaxed);
            let (tx, sockets, in_flight) = (tx.clone(), sockets.clone(), in_flight.clone());
            tokio::spawn(async move {
                let r = match tokio::time::timeout(LIMIT, once(&sockets, dst)).await {
                    Ok(r) => r,
                    Err(_) => Err(anyhow::anyhow!("timed out after {LIMIT:?}")),
                };
                in_flight.fetch_sub(1, Ordering::Relaxed);
                let _ = tx.send((r, sched.elapsed().as_nanos() as u64));
            });
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    drop(tx);
    let mut run = Run {
        target: rate,
        window: dur.as_secs_f64(),
        scheduled: total,
        ..Run::default()
    };
    while let Some((r, ns)) = rx.recv().await {
        match r {
            Ok(()) => run.ok.push(ns),
            Err(e) => {
                *run.errors.entry(kind(&e)).or_default() += 1;
                run.first_error.get_or_insert_with(|| format!("{e:#}"));
            }
        }
    }
    if skipped > 0 {
        run.errors
            .insert("skipped: too many in flight".into(), skipped);
    }
    run.secs = start.elapsed().as_secs_f64();
    run.zt_cpu = [
        cpu_secs(bed.zt_src) - cpu0[0],
        cpu_secs(bed.zt_dst) - cpu0[1],
    ];
    run.control_cpu = cpu_secs(bed.control) - ctl0;
    run.own_cpu = cpu_secs(std::process::id()) - own0;
    run.machine_busy = dpload::machine_busy_secs() - busy0;
    run.ok.sort_unstable();
    Ok(run)
}

pub async fn run(bins: &std::path::Path, opts: &Opts) -> Result<()> {
    let bed = Bed::start(bins, "").await?;
    let r = run_on(&bed, opts).await;
    bed.down().await?;
    r
}

async fn run_on(bed: &Bed, opts: &Opts) -> Result<()> {
    let dur = opts.duration.unwrap_or(Duration::from_secs(60));
    let _echo = bed.echo().await?;
    let dst = bed.echo_addr();
    let sockets = NetnsSockets::spawn(&bed.client.open()?)?;
    for _ in 0..200 {
        once(&sockets, dst).await?;
    }
    let mut runs = Vec::new();
    for &rate in &opts.rates {
        println!(
            "{rate:.0} new connections/s for {:.0} s ... (machine: {})",
            dur.as_secs_f64(),
            bed::machine_state().await
        );
        let r = open_loop(bed, &sockets, dst, rate, dur).await?;
        let (_, tw) = bed::sockets(&bed.client).await?;
        println!(
            "  {} ok, {} failed {:?}{}; {:.0}/s completed; client pod TIME_WAIT {tw}",
            r.ok.len(),
            r.failed(),
            r.errors,
            r.first_error
                .as_ref()
                .map(|e| format!(" (first: {e})"))
                .unwrap_or_default(),
            r.ok.len() as f64 / r.window
        );
        runs.push(r);
        // Let the TIME_WAITs of the run age out of conntrack (10 s, see
        // bed::tune_pod) and the ztunnels settle.
        tokio::time::sleep(Duration::from_secs(12)).await;
    }
    let m = bed.mem();
    println!(
        "\n(completed/s: successful connections over the schedule's length; CPU over the run until the last connection ended)\n| target rate | duration | completed/s | failed | latency from schedule p50 / p90 / p99 / max | ztunnel CPU src + dst (cores) | ztunnel CPU per connection | control / bench process / machine (cores) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in &runs {
        let zt = r.zt_cpu[0] + r.zt_cpu[1];
        println!(
            "| {:.0}/s | {:.0} s | **{:.0}/s** | **{}** of {} | {} | {:.2} + {:.2} | {:.0} µs | {:.2} / {:.2} / {:.2} |",
            r.target,
            r.window,
            r.ok.len() as f64 / r.window,
            r.failed(),
            r.scheduled,
            pcts(&r.ok),
            r.zt_cpu[0] / r.secs,
            r.zt_cpu[1] / r.secs,
            zt / (r.ok.len().max(1) as f64) * 1e6,
            r.control_cpu / r.secs,
            r.own_cpu / r.secs,
            r.machine_busy / r.secs,
        );
    }
    println!(
        "\nztunnel RSS after: source {} (peak {:.1} MiB), destination {} (peak {:.1} MiB)",
        bed::mem_cell(&m[0]),
        bed::mib(m[0].hwm),
        bed::mem_cell(&m[1]),
        bed::mib(m[1].hwm)
    );
    let best = runs
        .iter()
        .filter(|r| r.failed() == 0)
        .map(|r| r.target)
        .fold(0.0, f64::max);
    println!("highest target rate with zero failures: {best:.0}/s");
    Ok(())
}
