//! d. Soak: mixed traffic through both ztunnels for `--duration` (default
//! 30 min) while the served config changes every `--churn` seconds, with
//! the RSS of both ztunnels and the control plane sampled every 10 s.
//!
//! Traffic (all `mesh/client` → `mesh/server`'s echo, 64-byte messages,
//! every failure counted, a failed connection is re-made):
//! * 20 long-lived connections, one round trip each per second;
//! * one request/response connection at 100 requests/s;
//! * 20 new connections/s (connect, one round trip, close).
//!
//! Churn, in turn: an ALLOW AuthorizationPolicy on the server (allowing the
//! client's identity, so traffic stays allowed; live connections are
//! re-checked) added or removed; the server pod's `version` label changed
//! (a new canonical revision: a new workload version); a Service selecting
//! the server added or removed. Each is pushed to both ztunnels (the
//! control plane's `pilot_xds_pushes_total` is reported).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ambit_inpod::{NetnsSockets, SocketOptions};
use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

use crate::Opts;
use crate::bed::{self, Bed, NS, mib};
use crate::dpload::Mem;
use crate::rate;

/// RSS sampling period.
const SAMPLE: Duration = Duration::from_secs(10);
const LONG_LIVED: usize = 20;
const RR_PER_SEC: u64 = 100;
const NEW_PER_SEC: u64 = 20;
/// Bound on one operation.
const OP: Duration = Duration::from_secs(5);

const POLICY: &str = "\
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: allow-client, namespace: mesh}
spec:
  selector: {matchLabels: {app: server}}
  action: ALLOW
  rules:
  - from:
    - source: {principals: [cluster.local/ns/mesh/sa/client]}
";

const SERVICE: &str = "\
apiVersion: v1
kind: Service
metadata: {name: churn, namespace: mesh}
spec:
  clusterIP: 10.96.0.50
  selector: {app: server}
  ports: [{name: tcp, port: 80, targetPort: 7000}]
";

fn extra(policy: bool, service: bool) -> String {
    let mut y = String::new();
    if policy {
        y.push_str(POLICY);
    }
    if service {
        if !y.is_empty() {
            y.push_str("---\n");
        }
        y.push_str(SERVICE);
    }
    y
}

/// Successes and failures of one kind of traffic.
#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
    first_error: Mutex<Option<String>>,
}

impl Tally {
    fn record(&self, r: &Result<()>) {
        match r {
            Ok(()) => {
                self.ok.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut f) = self.first_error.lock() {
                    f.get_or_insert_with(|| format!("{e:#}"));
                }
            }
        }
    }

    fn cell(&self) -> String {
        let first = self
            .first_error
            .lock()
            .ok()
            .and_then(|f| f.clone())
            .map(|e| format!(" (first: {e})"))
            .unwrap_or_default();
        format!(
            "{} ok, **{} failed**{first}",
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed)
        )
    }
}

async fn round_trip(s: &mut TcpStream) -> Result<()> {
    tokio::time::timeout(OP, async {
        let req = [0x42u8; 64];
        s.write_all(&req).await?;
        let mut resp = [0u8; 64];
        s.read_exact(&mut resp).await?;
        anyhow::Ok(())
    })
    .await
    .map_err(|_| anyhow::anyhow!("round trip timed out"))?
}

async fn connect(sockets: &NetnsSockets, dst: SocketAddr) -> Result<TcpStream> {
    let s = tokio::time::timeout(OP, sockets.connect(dst, &SocketOptions::default()))
        .await
        .map_err(|_| anyhow::anyhow!("connect timed out"))??;
    s.set_nodelay(true)?;
    Ok(s)
}

/// A connection doing one round trip per `period` until `stop`.
async fn persistent(
    sockets: NetnsSockets,
    dst: SocketAddr,
    period: Duration,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
) {
    let mut conn: Option<TcpStream> = None;
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let r = async {
            if conn.is_none() {
                conn = Some(connect(&sockets, dst).await?);
            }
            match conn.as_mut() {
                Some(s) => round_trip(s).await,
                None => Ok(()),
            }
        }
        .await;
        if r.is_err() {
            conn = None;
        }
        tally.record(&r);
    }
}

/// Least-squares slope of `(minutes, KiB)`, KiB per minute.
pub fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return f64::NAN;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx == 0.0 { f64::NAN } else { sxy / sxx }
}

pub async fn run(bins: &std::path::Path, opts: &Opts) -> Result<()> {
    let bed = Bed::start(bins, &extra(false, false)).await?;
    let r = run_on(&bed, opts).await;
    bed.down().await?;
    r
}

async fn run_on(bed: &Bed, opts: &Opts) -> Result<()> {
    let dur = opts.duration.unwrap_or(Duration::from_secs(30 * 60));
    let _echo = bed.echo().await?;
    let dst = bed.echo_addr();
    let sockets = NetnsSockets::spawn(&bed.client.open()?)?;
    for _ in 0..20 {
        rate::once(&sockets, dst).await?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    println!(
        "soak for {:.0} s, config change every {:.1} s; machine: {}",
        dur.as_secs_f64(),
        opts.churn.as_secs_f64(),
        bed::machine_state().await
    );
    let stop = Arc::new(AtomicBool::new(false));
    let (long, rr, new) = (
        Arc::new(Tally::default()),
        Arc::new(Tally::default()),
        Arc::new(Tally::default()),
    );
    let mut tasks = JoinSet::new();
    for i in 0..LONG_LIVED {
        let (s, t, st) = (sockets.clone(), long.clone(), stop.clone());
        tasks.spawn(async move {
            // Spread the long-lived connections' round trips over the second.
            tokio::time::sleep(Duration::from_millis(1000 / LONG_LIVED as u64 * i as u64)).await;
            persistent(s, dst, Duration::from_secs(1), t, st).await;
        });
    }
    {
        let (s, t, st) = (sockets.clone(), rr.clone(), stop.clone());
        let period = Duration::from_micros(1_000_000 / RR_PER_SEC);
        tasks.spawn(persistent(s, dst, period, t, st));
    }
    {
        let (s, t, st) = (sockets.clone(), new.clone(), stop.clone());
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / NEW_PER_SEC));
            let mut conns = JoinSet::new();
            while !st.load(Ordering::Relaxed) {
                tick.tick().await;
                let (s, t) = (s.clone(), t.clone());
                conns.spawn(async move {
                    let r = match tokio::time::timeout(OP, rate::once(&s, dst)).await {
                        Ok(r) => r,
                        Err(_) => Err(anyhow::anyhow!("new connection timed out")),
                    };
                    t.record(&r);
                });
                while conns.try_join_next().is_some() {}
            }
            while conns.join_next().await.is_some() {}
        });
    }

    let pushes0 = bed.pushes().await?;
    let start = Instant::now();
    let mut samples: Vec<(f64, [Mem; 3])> = vec![(0.0, bed.mem())];
    let mut next_sample = start + SAMPLE;
    let mut next_churn = start + opts.churn;
    let (mut policy, mut service) = (false, false);
    let mut changes = 0u64;
    let mut churn_errors = 0u64;
    println!(
        "\n| min | src ztunnel RSS / anon MiB | dst ztunnel RSS / anon MiB | control RSS / anon MiB | long-lived ok/failed | req/resp ok/failed | new conns ok/failed | config changes |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    while start.elapsed() < dur {
        let now = Instant::now();
        if now >= next_churn {
            let r = match changes % 3 {
                0 => {
                    policy = !policy;
                    bed.write_config("extra.yaml", &extra(policy, service))
                }
                1 => bed.set_server_version(&format!("v{changes}")),
                _ => {
                    service = !service;
                    bed.write_config("extra.yaml", &extra(policy, service))
                }
            };
            if let Err(e) = r {
                churn_errors += 1;
                println!("  ! config change {changes} failed: {e:#}");
            }
            changes += 1;
            next_churn += opts.churn;
        }
        if now >= next_sample {
            let m = bed.mem();
            let t = start.elapsed().as_secs_f64() / 60.0;
            let c = |t: &Tally| {
                format!(
                    "{}/{}",
                    t.ok.load(Ordering::Relaxed),
                    t.failed.load(Ordering::Relaxed)
                )
            };
            println!(
                "| {t:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {} | {} | {} | {changes} |",
                mib(m[0].rss),
                mib(m[0].anon),
                mib(m[1].rss),
                mib(m[1].anon),
                mib(m[2].rss),
                mib(m[2].anon),
                c(&long),
                c(&rr),
                c(&new)
            );
            samples.push((t, m));
            next_sample += SAMPLE;
        }
        let wake = next_sample.min(next_churn);
        tokio::time::sleep_until(wake.into()).await;
    }
    stop.store(true, Ordering::Relaxed);
    while tasks.join_next().await.is_some() {}
    let secs = start.elapsed().as_secs_f64();
    let pushes = bed.pushes().await? - pushes0;

    println!(
        "\n{:.0} s, {changes} config changes ({churn_errors} failed to write), {pushes:.0} xDS responses pushed, machine after: {}",
        secs,
        bed::machine_state().await
    );
    println!("\n| traffic | result |");
    println!("|---|---|");
    println!(
        "| {LONG_LIVED} long-lived connections, 1 round trip/s each | {} |",
        long.cell()
    );
    println!(
        "| 1 connection, {RR_PER_SEC} req/resp per s | {} |",
        rr.cell()
    );
    println!(
        "| {NEW_PER_SEC} new connections/s (connect, round trip, close) | {} |",
        new.cell()
    );
    println!(
        "\n| process | RSS start → end (MiB) | peak (VmHWM) | RSS slope, whole run | RSS slope, second half | anon slope, second half |"
    );
    println!("|---|---|---|---|---|---|");
    let half = samples.last().map_or(0.0, |s| s.0) / 2.0;
    for (i, name) in [
        "ztunnel node-1 (source)",
        "ztunnel node-2 (destination)",
        "ambit-control",
    ]
    .iter()
    .enumerate()
    {
        let all: Vec<(f64, f64)> = samples.iter().map(|(t, m)| (*t, m[i].rss as f64)).collect();
        let late: Vec<(f64, f64)> = all.iter().copied().filter(|p| p.0 >= half).collect();
        let late_anon: Vec<(f64, f64)> = samples
            .iter()
            .filter(|(t, _)| *t >= half)
            .map(|(t, m)| (*t, m[i].anon as f64))
            .collect();
        let first = samples.first().map(|s| s.1[i]).unwrap_or_default();
        let last = samples.last().map(|s| s.1[i]).unwrap_or_default();
        println!(
            "| {name} | {:.1} → {:.1} | {:.1} | **{:+.1} KiB/min** | {:+.1} KiB/min | {:+.1} KiB/min |",
            mib(first.rss),
            mib(last.rss),
            mib(last.hwm),
            slope(&all),
            slope(&late),
            slope(&late_anon)
        );
    }
    println!("(namespace {NS}; RSS sampled every {} s)", SAMPLE.as_secs());
    Ok(())
}
