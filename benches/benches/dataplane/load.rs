//! Load generators. Every one is run twice by the bench, once from an
//! enrolled pod through the mesh and once between the plain pods, with the
//! same code.
//!
//! * bulk: tokio tasks writing 256 KiB chunks into the sink;
//! * request/response and app-level new connections: plain blocking
//!   threads whose sockets are made inside the pod's netns (threads spawned
//!   by a thread that entered a netns stay in it), so the load generator
//!   costs a few syscalls per operation and no runtime hop;
//! * new HBONE connections: tokio, rustls and h2 as ztunnel's own client,
//!   sockets made by a long-lived thread in the client pod's netns.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ambit_inpod::{NetnsSockets, SocketOptions, ZTUNNEL_MARK};
use ambit_tests::netbed::{self, PodNet};
use ambit_ztunnel::hbone::HboneClient;
use anyhow::{Context, Result, bail};
use hyper::http::HeaderMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;

/// Bulk write size.
pub const CHUNK: usize = 256 * 1024;
/// Request and response size of the latency test.
pub const MSG: usize = 1024;
/// Bulk streams run this long before the measured window opens.
const BULK_WARMUP: Duration = Duration::from_millis(700);

/// CPU seconds (user + system) used so far by process `pid` (all threads).
pub fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15; `rest` starts at field 3.
    (ticks(11) + ticks(12)) / 100.0
}

/// Memory of a process, KiB.
#[derive(Debug, Clone, Copy, Default)]
pub struct Mem {
    /// VmRSS.
    pub rss: u64,
    /// VmHWM: the peak RSS.
    pub hwm: u64,
    /// RssAnon: heap, stacks (what the ztunnel itself allocated).
    pub anon: u64,
    /// RssFile: mapped pages of the executable and libraries. The bench
    /// binary also holds the control plane and the load generator, so
    /// this part is larger than the `ztunnel` binary's.
    pub file: u64,
}

/// Memory of `pid` from `/proc/<pid>/status`.
pub fn mem(pid: u32) -> Mem {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0)
    };
    Mem {
        rss: field("VmRSS:"),
        hwm: field("VmHWM:"),
        anon: field("RssAnon:"),
        file: field("RssFile:"),
    }
}

/// TCP sockets in TIME_WAIT in `pod`'s netns (`sockstat`'s `tw`).
pub fn time_wait(pod: &PodNet) -> Result<u64> {
    let sockstat = pod
        .open()?
        .run_in(|| std::fs::read_to_string("/proc/thread-self/net/sockstat"))?;
    sockstat
        .lines()
        .find_map(|l| {
            let rest = l.strip_prefix("TCP:")?;
            let mut words = rest.split_whitespace();
            while let Some(w) = words.next() {
                if w == "tw" {
                    return words.next()?.parse().ok();
                }
            }
            None
        })
        .context("no TCP line in sockstat")
}

/// Busy CPU seconds of the whole machine so far (all CPUs; user, nice,
/// system, irq, softirq, steal).
pub fn machine_busy_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<f64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let at = |i: usize| f.get(i).copied().unwrap_or(0.0);
    (at(0) + at(1) + at(2) + at(5) + at(6) + at(7)) / 100.0
}

/// Wall time and the CPU of the ztunnel, of this process and of the rest
/// of the machine (kernel softirq work not charged to a process, and
/// anything else running) over a window.
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub secs: f64,
    pub zt_cpu: f64,
    pub own_cpu: f64,
    pub other_cpu: f64,
}

/// Opens a measurement window.
#[derive(Debug, Clone, Copy)]
pub struct Meter {
    zt: u32,
    t: Instant,
    zt_cpu: f64,
    own_cpu: f64,
    busy: f64,
}

impl Meter {
    pub fn start(zt: u32) -> Self {
        Self {
            zt,
            t: Instant::now(),
            zt_cpu: cpu_secs(zt),
            own_cpu: cpu_secs(std::process::id()),
            busy: machine_busy_secs(),
        }
    }

    pub fn stop(&self) -> Usage {
        let zt_cpu = cpu_secs(self.zt) - self.zt_cpu;
        let own_cpu = cpu_secs(std::process::id()) - self.own_cpu;
        let busy = machine_busy_secs() - self.busy;
        Usage {
            secs: self.t.elapsed().as_secs_f64(),
            zt_cpu,
            own_cpu,
            other_cpu: (busy - zt_cpu - own_cpu).max(0.0),
        }
    }
}

/// Bytes the sink took in a measured window.
#[derive(Debug, Clone, Copy)]
pub struct Bulk {
    pub bytes: u64,
    pub usage: Usage,
}

impl Bulk {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.usage.secs / 1e9
    }
}

/// `streams` connections from `from` to `dst` (a sink counting into
/// `sink`), each writing [`CHUNK`]s as fast as it can; measured for `dur`
/// after a warm-up.
pub async fn bulk(
    from: &PodNet,
    dst: SocketAddr,
    sink: &AtomicU64,
    streams: usize,
    dur: Duration,
    zt: u32,
) -> Result<Bulk> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = JoinSet::new();
    for _ in 0..streams {
        let mut s = netbed::connect(from, dst).await?;
        let stop = stop.clone();
        writers.spawn(async move {
            let chunk = vec![0x5au8; CHUNK];
            while !stop.load(Ordering::Relaxed) {
                s.write_all(&chunk).await?;
            }
            anyhow::Ok(())
        });
    }
    tokio::time::sleep(BULK_WARMUP).await;
    let b0 = sink.load(Ordering::Relaxed);
    let meter = Meter::start(zt);
    tokio::time::sleep(dur).await;
    let bytes = sink.load(Ordering::Relaxed) - b0;
    let usage = meter.stop();
    stop.store(true, Ordering::Relaxed);
    if let Some(done) = writers.try_join_next() {
        done?.context("a bulk writer failed")?;
        bail!("a bulk writer stopped early");
    }
    writers.abort_all();
    while writers.join_next().await.is_some() {}
    Ok(Bulk { bytes, usage })
}

/// Latency samples (ns) of a request/response run.
#[derive(Debug, Clone, Default)]
pub struct Latency {
    pub samples: Vec<u64>,
    pub usage: Usage,
}

impl Latency {
    pub fn rps(&self) -> f64 {
        self.samples.len() as f64 / self.usage.secs
    }

    /// Percentile `p` (0–1) in µs.
    pub fn pct(&self, p: f64) -> f64 {
        percentile(&self.samples, p)
    }
}

/// Percentile `p` (0–1) of sorted ns samples, in µs.
pub fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1e3
}

/// A blocking connection made inside `pod`'s netns.
pub fn connect_blocking(pod: &PodNet, dst: SocketAddr) -> Result<TcpStream> {
    let s = pod.open()?.run_in(move || {
        let s = TcpStream::connect_timeout(&dst, Duration::from_secs(5))?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(s)
    })?;
    Ok(s)
}

/// `n` request/response round trips, unmeasured.
pub fn rr_warmup(s: &TcpStream, n: usize) -> Result<()> {
    let mut s = s;
    let req = [0x42u8; MSG];
    let mut resp = [0u8; MSG];
    for _ in 0..n {
        s.write_all(&req)?;
        s.read_exact(&mut resp)?;
    }
    Ok(())
}

/// Closed loop: the next request leaves when the previous reply is in.
pub fn rr_closed(s: &TcpStream, dur: Duration, zt: u32) -> Result<Latency> {
    let mut s = s;
    let req = [0x42u8; MSG];
    let mut resp = [0u8; MSG];
    let mut samples = Vec::with_capacity(200_000);
    let meter = Meter::start(zt);
    let end = Instant::now() + dur;
    loop {
        let t = Instant::now();
        if t >= end {
            break;
        }
        s.write_all(&req)?;
        s.read_exact(&mut resp)?;
        samples.push(t.elapsed().as_nanos() as u64);
    }
    let usage = meter.stop();
    samples.sort_unstable();
    Ok(Latency { samples, usage })
}

/// Open loop at `rate` requests per second for `dur`: a sender thread
/// writes on schedule whatever the replies do (several may be in flight),
/// a receiver thread reads replies in order; latency from the moment each
/// request was written.
pub fn rr_open(s: &TcpStream, rate: f64, dur: Duration, zt: u32) -> Result<Latency> {
    let mut tx_sock = s.try_clone()?;
    let mut rx_sock = s.try_clone()?;
    let (tx, rx) = std::sync::mpsc::channel::<Instant>();
    let interval = Duration::from_secs_f64(1.0 / rate);
    let meter = Meter::start(zt);
    let samples = std::thread::scope(|scope| -> Result<Vec<u64>> {
        let receiver = scope.spawn(move || -> std::io::Result<Vec<u64>> {
            let mut resp = [0u8; MSG];
            let mut samples = Vec::with_capacity(200_000);
            while let Ok(sent) = rx.recv() {
                rx_sock.read_exact(&mut resp)?;
                samples.push(sent.elapsed().as_nanos() as u64);
            }
            Ok(samples)
        });
        // Sleeps end within ~1 µs of the schedule instead of the default 50 µs.
        let _ = nix::sys::prctl::set_timerslack(1_000);
        let req = [0x42u8; MSG];
        let start = Instant::now();
        let mut next = start;
        let mut sent = Ok(());
        while next.duration_since(start) < dur {
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
            if tx.send(Instant::now()).is_err() {
                break; // the receiver failed; its error is reported below
            }
            if let Err(e) = tx_sock.write_all(&req) {
                sent = Err(e);
                break;
            }
            next += interval;
        }
        drop(tx);
        let samples = receiver
            .join()
            .map_err(|_| anyhow::anyhow!("receiver panicked"))??;
        sent?;
        Ok(samples)
    })?;
    let usage = meter.stop();
    let mut samples = samples;
    samples.sort_unstable();
    Ok(Latency { samples, usage })
}

/// New connections, each timed from `connect` to its end.
#[derive(Debug, Clone, Default)]
pub struct Conns {
    pub samples: Vec<u64>,
    pub errors: usize,
    pub first_error: Option<String>,
    pub usage: Usage,
}

impl Conns {
    pub fn per_sec(&self) -> f64 {
        self.samples.len() as f64 / self.usage.secs
    }

    pub fn mean_us(&self) -> f64 {
        let n = self.samples.len().max(1) as f64;
        self.samples.iter().sum::<u64>() as f64 / n / 1e3
    }

    fn merge(&mut self, other: Conns) {
        self.samples.extend(other.samples);
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    fn record(&mut self, t: Instant, r: Result<()>) {
        match r {
            Ok(()) => self.samples.push(t.elapsed().as_nanos() as u64),
            Err(e) => {
                self.errors += 1;
                if self.first_error.is_none() {
                    self.first_error = Some(format!("{e:#}"));
                }
            }
        }
    }
}

/// App-level: connect, write 1 byte, read the 1-byte echo, close — on
/// `workers` threads inside `pod`'s netns, for `dur` (or `count`
/// connections per worker when given, for warm-ups).
pub fn conns_app(
    pod: &PodNet,
    dst: SocketAddr,
    workers: usize,
    dur: Duration,
    count: Option<usize>,
    zt: u32,
) -> Result<Conns> {
    let netns = pod.open()?;
    let meter = Meter::start(zt);
    let mut all = netns.run_in(move || {
        let end = Instant::now() + dur;
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..workers)
                .map(|_| {
                    scope.spawn(move || {
                        let mut c = Conns::default();
                        let mut i = 0;
                        while count.map_or(Instant::now() < end, |n| i < n) {
                            i += 1;
                            let t = Instant::now();
                            c.record(t, app_once(dst));
                        }
                        c
                    })
                })
                .collect();
            let mut all = Conns::default();
            for w in workers {
                all.merge(
                    w.join()
                        .map_err(|_| std::io::Error::other("worker panicked"))?,
                );
            }
            Ok(all)
        })
    })?;
    all.usage = meter.stop();
    all.samples.sort_unstable();
    Ok(all)
}

fn app_once(dst: SocketAddr) -> Result<()> {
    let mut s = TcpStream::connect_timeout(&dst, Duration::from_secs(5))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"x")?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    Ok(())
}

/// How each connection of [`conns_tokio`] is made.
#[derive(Clone)]
pub enum Dial {
    /// Plain TCP to the echo address.
    Plain,
    /// TLS 1.3 + HTTP/2 to `peer` (a pod's :15008, socket marked so the
    /// redirection lets it through), then `CONNECT` the echo address.
    Hbone {
        peer: SocketAddr,
        tls: Arc<rustls::ClientConfig>,
    },
}

/// One connection: dial, 1-byte echo, orderly close (shut our side, read
/// the peer's EOF), all timed.
async fn tokio_once(sockets: &NetnsSockets, dial: &Dial, echo: SocketAddr) -> Result<()> {
    let mut b = [0u8; 1];
    match dial {
        Dial::Plain => {
            let mut s = sockets.connect(echo, &SocketOptions::default()).await?;
            s.set_nodelay(true)?;
            s.write_all(b"x").await?;
            s.read_exact(&mut b).await?;
            s.shutdown().await?;
            if s.read(&mut b).await? != 0 {
                bail!("echo sent more than one byte");
            }
        }
        Dial::Hbone { peer, tls } => {
            let opts = SocketOptions {
                mark: Some(ZTUNNEL_MARK),
                ..SocketOptions::default()
            };
            let tcp = sockets.connect(*peer, &opts).await?;
            let conn = HboneClient::connect(tcp, tls.clone()).await?;
            let mut s = conn.connect_stream(echo, HeaderMap::new()).await?;
            s.write_all(b"x").await?;
            s.read_exact(&mut b).await?;
            s.shutdown().await?;
            if s.read(&mut b).await? != 0 {
                bail!("echo sent more than one byte");
            }
        }
    }
    Ok(())
}

/// New connections from tokio tasks, `workers` at a time, for `dur` (or
/// `count` per worker).
pub async fn conns_tokio(
    pod: &PodNet,
    dial: Dial,
    echo: SocketAddr,
    workers: usize,
    dur: Duration,
    count: Option<usize>,
    zt: u32,
) -> Result<Conns> {
    let sockets = NetnsSockets::spawn(&pod.open()?)?;
    let meter = Meter::start(zt);
    let end = Instant::now() + dur;
    let mut tasks = JoinSet::new();
    for _ in 0..workers {
        let sockets = sockets.clone();
        let dial = dial.clone();
        tasks.spawn(async move {
            let mut c = Conns::default();
            let mut i = 0;
            while count.map_or(Instant::now() < end, |n| i < n) {
                i += 1;
                let t = Instant::now();
                let r =
                    tokio::time::timeout(Duration::from_secs(5), tokio_once(&sockets, &dial, echo))
                        .await
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("timed out after 5 s")));
                c.record(t, r);
            }
            c
        });
    }
    let mut all = Conns::default();
    while let Some(c) = tasks.join_next().await {
        all.merge(c?);
    }
    all.usage = meter.stop();
    all.samples.sort_unstable();
    Ok(all)
}
