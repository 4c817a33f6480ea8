//! One measurement of one path: the load generators of `dataplane/load.rs`
//! driven from the path's client pod, with the CPU of the path's proxy
//! processes (both ends), of this process (apps and load generators) and of
//! the rest of the machine over the same window.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ambit_inpod::{NetnsSockets, SocketOptions};
use ambit_tests::netbed::{self, PodNet};
use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;

use super::load;
use super::report::Record;

/// Bound on every single network wait of the bench's own clients.
pub const WAIT: Duration = Duration::from_secs(5);

/// One of the four paths, from its client pod to the server apps.
pub struct Path {
    pub name: &'static str,
    pub client: PodNet,
    /// Where the client sends bulk (ends in the server pod's sink).
    pub sink: SocketAddr,
    /// Where the client sends requests (ends in the server pod's echo).
    pub echo: SocketAddr,
    /// The server pod's sink counter.
    pub sink_bytes: Arc<AtomicU64>,
    /// The proxy processes of the path (both ends); none for no mesh.
    pub pids: Vec<u32>,
}

/// CPU over a window: the path's proxies, this process, the rest.
#[derive(Debug, Clone, Default)]
pub struct Usage {
    pub secs: f64,
    pub proxy_cpu: f64,
    pub own_cpu: f64,
    pub other_cpu: f64,
    /// The other processes that used the most CPU: `comm cpu-s`.
    pub top_others: String,
}

impl Usage {
    /// CPU of everything else on the machine, in vCPUs.
    pub fn other_vcpu(&self) -> f64 {
        self.other_cpu / self.secs
    }
}

pub struct Meter {
    pids: Vec<u32>,
    t: Instant,
    proxy: f64,
    own: f64,
    busy: f64,
    irq: [f64; 3],
    all: HashMap<u32, (String, f64)>,
}

/// CPU seconds of every process on the machine, with its name.
fn all_processes() -> HashMap<u32, (String, f64)> {
    let mut all = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return all;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        all.insert(pid, (comm.trim().to_string(), load::cpu_secs(pid)));
    }
    all
}

/// Machine-wide irq, softirq and steal seconds so far (`/proc/stat`).
fn irq_steal() -> [f64; 3] {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let at = |i: usize| f.get(i).copied().unwrap_or(0.0) / 100.0;
    [at(5), at(6), at(7)]
}

/// The three other processes that used most CPU since `before`.
fn top_others(before: &HashMap<u32, (String, f64)>, skip: &[u32]) -> String {
    let mut d: Vec<(f64, String)> = all_processes()
        .into_iter()
        .filter(|(pid, _)| !skip.contains(pid))
        .map(|(pid, (comm, cpu))| {
            let was = before.get(&pid).map_or(0.0, |(_, c)| *c);
            (cpu - was, comm)
        })
        .filter(|(d, _)| *d >= 0.02)
        .collect();
    d.sort_by(|a, b| b.0.total_cmp(&a.0));
    d.iter()
        .take(3)
        .map(|(c, n)| format!("{n} {c:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn cpu(pids: &[u32]) -> f64 {
    pids.iter().map(|p| load::cpu_secs(*p)).sum()
}

impl Meter {
    pub fn start(pids: &[u32]) -> Meter {
        Meter {
            pids: pids.to_vec(),
            t: Instant::now(),
            proxy: cpu(pids),
            own: load::cpu_secs(std::process::id()),
            busy: load::machine_busy_secs(),
            irq: irq_steal(),
            all: all_processes(),
        }
    }

    pub fn stop(&self) -> Usage {
        let proxy_cpu = cpu(&self.pids) - self.proxy;
        let own_cpu = load::cpu_secs(std::process::id()) - self.own;
        let busy = load::machine_busy_secs() - self.busy;
        let mut skip = self.pids.clone();
        skip.push(std::process::id());
        let irq = irq_steal();
        let mut top = ["irq", "softirq", "steal"]
            .iter()
            .zip(irq.iter().zip(self.irq))
            .filter(|(_, (now, was))| *now - *was >= 0.02)
            .map(|(n, (now, was))| format!("{n} {:.2}", now - was))
            .collect::<Vec<_>>();
        top.push(top_others(&self.all, &skip));
        Usage {
            top_others: top.join(", "),
            secs: self.t.elapsed().as_secs_f64(),
            proxy_cpu,
            own_cpu,
            other_cpu: (busy - proxy_cpu - own_cpu).max(0.0),
        }
    }
}

/// The bench's knobs.
pub struct Knobs {
    pub secs: Duration,
    pub bulk_secs: Duration,
    pub conn_secs: Duration,
    pub rates: Vec<f64>,
    pub idle_conns: usize,
    /// How long the idle connections are held before their RSS is read
    /// (`IDLE_HOLD_SECS`: longer to take a heap snapshot meanwhile).
    pub idle_hold: Duration,
    /// `PERF_DIR`: record `perf` profiles of these paths' proxies there.
    pub perf_dir: Option<PathBuf>,
    pub perf_paths: Vec<String>,
}

/// `streams` writers into the path's sink; bytes and CPU over `dur` after
/// a warm-up (as `load::bulk`, with the meter over all proxies).
async fn bulk(p: &Path, streams: usize, dur: Duration) -> Result<(u64, Usage)> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = JoinSet::new();
    for _ in 0..streams {
        let mut s = tokio::time::timeout(WAIT, netbed::connect(&p.client, p.sink))
            .await
            .context("bulk connect timed out")??;
        let stop = stop.clone();
        writers.spawn(async move {
            let chunk = vec![0x5au8; load::CHUNK];
            while !stop.load(Ordering::Relaxed) {
                tokio::time::timeout(WAIT, s.write_all(&chunk))
                    .await
                    .context("bulk write stalled")??;
            }
            anyhow::Ok(())
        });
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    let b0 = p.sink_bytes.load(Ordering::Relaxed);
    let meter = Meter::start(&p.pids);
    tokio::time::sleep(dur).await;
    let bytes = p.sink_bytes.load(Ordering::Relaxed) - b0;
    let usage = meter.stop();
    stop.store(true, Ordering::Relaxed);
    if let Some(done) = writers.try_join_next() {
        done?.context("a bulk writer failed")?;
        bail!("a bulk writer stopped early");
    }
    writers.abort_all();
    while writers.join_next().await.is_some() {}
    Ok((bytes, usage))
}

/// Records bulk with `streams` streams: Gbit/s and proxy CPU-s per GB.
pub fn run_bulk(
    rt: &tokio::runtime::Runtime,
    p: &Path,
    k: &Knobs,
    streams: usize,
    rec: &mut Record,
) -> Result<Usage> {
    let (bytes, u) = rt.block_on(bulk(p, streams, k.bulk_secs))?;
    let gb = bytes as f64 / 1e9;
    rec.add(&format!("bulk {streams}: Gbit/s"), gb * 8.0 / u.secs);
    if !p.pids.is_empty() {
        rec.add(
            &format!("bulk {streams}: proxy CPU-s per GB"),
            u.proxy_cpu / gb,
        );
        rec.add(&format!("bulk {streams}: proxy vCPU"), u.proxy_cpu / u.secs);
    }
    Ok(u)
}

/// Records p50/p99 at `rate` req/s of 1 KiB and the proxies' vCPU per
/// 1,000 req/s.
pub fn run_rate(p: &Path, rate: f64, k: &Knobs, rec: &mut Record) -> Result<Usage> {
    let s = load::connect_blocking(&p.client, p.echo)?;
    load::rr_warmup(&s, 1000)?;
    let meter = Meter::start(&p.pids);
    let lat = load::rr_open(&s, rate, k.secs, std::process::id())?;
    let u = meter.stop();
    rec.add(&format!("rr {rate:.0}/s: p50 µs"), lat.pct(0.5));
    rec.add(&format!("rr {rate:.0}/s: p99 µs"), lat.pct(0.99));
    if !p.pids.is_empty() {
        let vcpu = u.proxy_cpu / u.secs;
        rec.add(
            &format!("rr {rate:.0}/s: proxy vCPU per 1k rps"),
            vcpu / (lat.rps() / 1000.0),
        );
    }
    Ok(u)
}

/// Records the closed-loop rate of 1 KiB request/response.
pub fn run_closed(p: &Path, k: &Knobs, rec: &mut Record) -> Result<Usage> {
    let s = load::connect_blocking(&p.client, p.echo)?;
    load::rr_warmup(&s, 1000)?;
    let meter = Meter::start(&p.pids);
    let lat = load::rr_closed(&s, k.secs, std::process::id())?;
    let u = meter.stop();
    rec.add("rr closed loop: req/s", lat.rps());
    rec.add("rr closed loop: p50 µs", lat.pct(0.5));
    if !p.pids.is_empty() {
        rec.add("rr closed loop: proxy vCPU", u.proxy_cpu / u.secs);
    }
    Ok(u)
}

/// Records new connections per second, 8 at a time (connect, 1-byte echo,
/// close) and the proxies' CPU-ms per 1,000 connections.
pub fn run_conns(p: &Path, k: &Knobs, rec: &mut Record) -> Result<Usage> {
    let me = std::process::id();
    load::conns_app(&p.client, p.echo, 8, k.conn_secs, Some(20), me)?;
    let meter = Meter::start(&p.pids);
    let c = load::conns_app(&p.client, p.echo, 8, k.conn_secs, None, me)?;
    let u = meter.stop();
    if c.errors > 0 {
        println!(
            "  {}: {} failed connections, first: {}",
            p.name,
            c.errors,
            c.first_error.as_deref().unwrap_or("?")
        );
    }
    let n = c.samples.len() as f64;
    rec.add("new conns: per s", n / u.secs);
    if !p.pids.is_empty() {
        rec.add(
            "new conns: proxy CPU-ms per 1k",
            u.proxy_cpu * 1e3 / (n / 1000.0),
        );
    }
    Ok(u)
}

/// One connection through the path, proven end to end by a 1-byte echo.
async fn open_one(sockets: &NetnsSockets, dst: SocketAddr) -> Result<tokio::net::TcpStream> {
    let mut s = sockets.connect(dst, &SocketOptions::default()).await?;
    s.write_all(b"x").await?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await?;
    Ok(s)
}

/// Opens `n` connections to the echo through the path, keeps them idle,
/// and returns the proxies' RSS growth (KiB, summed over both ends) and
/// the time it took; the connections close when this returns.
pub async fn idle_conns(p: &Path, n: usize, hold: Duration) -> Result<(f64, f64)> {
    let sockets = NetnsSockets::spawn(&p.client.open()?)?;
    let rss = |pids: &[u32]| pids.iter().map(|p| load::mem(*p).rss).sum::<u64>() as f64;
    let before = rss(&p.pids);
    let t = Instant::now();
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let s = tokio::time::timeout(WAIT, open_one(&sockets, p.echo))
            .await
            .with_context(|| format!("idle connection {i} timed out"))?
            .with_context(|| format!("idle connection {i}"))?;
        held.push(s);
    }
    let took = t.elapsed().as_secs_f64();
    tokio::time::sleep(hold).await;
    let after = rss(&p.pids);
    drop(held);
    tokio::time::sleep(Duration::from_millis(500)).await;
    Ok((after - before, took))
}

/// Waits until a 1-byte echo goes through the path (the mesh's pods may
/// need a moment after `local up`).
pub async fn probe(p: &Path) -> Result<()> {
    let sockets = NetnsSockets::spawn(&p.client.open()?)?;
    let start = Instant::now();
    loop {
        let r = tokio::time::timeout(WAIT, open_one(&sockets, p.echo)).await;
        match r {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) if start.elapsed() > Duration::from_secs(20) => {
                return Err(e).with_context(|| format!("path {} never carried an echo", p.name));
            }
            Err(_) if start.elapsed() > Duration::from_secs(20) => {
                bail!("path {}: the echo timed out", p.name)
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// `perf record -g` on a path's proxies while a phase runs (`PERF_DIR`).
pub struct Profile(Option<Child>);

impl Profile {
    pub fn start(k: &Knobs, p: &Path, phase: &str) -> Result<Profile> {
        let Some(dir) = &k.perf_dir else {
            return Ok(Profile(None));
        };
        if p.pids.is_empty() || !k.perf_paths.iter().any(|n| n == p.name) {
            return Ok(Profile(None));
        }
        let pids: Vec<String> = p.pids.iter().map(|p| p.to_string()).collect();
        let out = dir.join(format!("{}-{phase}.data", p.name));
        let child = Command::new("perf")
            .args(["record", "-g", "-q", "-o"])
            .arg(&out)
            .args(["-p", &pids.join(",")])
            .stdin(Stdio::null())
            .spawn()
            .context("starting perf record")?;
        std::thread::sleep(Duration::from_millis(300));
        Ok(Profile(Some(child)))
    }
}

impl Drop for Profile {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let pid = nix::unistd::Pid::from_raw(c.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
