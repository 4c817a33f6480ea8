//! The waypoint bench's load: keep-alive GETs over HTTP/1.1 or h2c (prior
//! knowledge) from inside a pod, closed loop (as fast as the path answers)
//! or open loop at a fixed rate (each request has a scheduled send time and
//! its latency counts from then, so time spent queued behind a slow answer
//! counts too — no coordinated omission).
//!
//! `workers` requesters run at once: with HTTP/1.1 each has its own
//! connection; with HTTP/2 they share one connection, one stream each.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ambit_tests::netbed::{self, PodNet};
use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::{Mutex, mpsc};
use tokio::task::{JoinHandle, JoinSet};

use crate::usage::{Meter, Usage};

/// Bound on one request (and on a connect).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an open-loop run may take past its schedule to drain what is
/// queued; requests still unsent then count as errors.
const DRAIN_GRACE: Duration = Duration::from_secs(2);
const PATH: &str = "/v1/completions";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Http1,
    Http2,
}

impl Proto {
    pub fn label(self) -> &'static str {
        match self {
            Proto::Http1 => "HTTP/1.1",
            Proto::Http2 => "HTTP/2 (h2c)",
        }
    }
}

/// Where requests go: from `pod` to `dst` in `proto`.
#[derive(Clone)]
pub struct Target {
    pub pod: PodNet,
    pub dst: SocketAddr,
    pub proto: Proto,
}

/// One requester's handle on its connection; the connection's driver task
/// stops when the last handle of it drops.
struct Sender {
    send: Send,
    _driver: Arc<Driver>,
}

enum Send {
    H1(http1::SendRequest<Empty<Bytes>>),
    H2(http2::SendRequest<Empty<Bytes>>),
}

struct Driver(JoinHandle<()>);

impl Drop for Driver {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Sender {
    async fn connect(t: &Target) -> Result<Sender> {
        let stream = tokio::time::timeout(REQUEST_TIMEOUT, netbed::connect(&t.pod, t.dst))
            .await
            .with_context(|| format!("connecting to {}: timed out", t.dst))??;
        stream.set_nodelay(true)?;
        let io = TokioIo::new(stream);
        let handshake = async {
            Ok::<_, hyper::Error>(match t.proto {
                Proto::Http1 => {
                    let (s, conn) = http1::handshake(io).await?;
                    let driver = Driver(tokio::spawn(async move {
                        let _ = conn.await;
                    }));
                    Sender {
                        send: Send::H1(s),
                        _driver: Arc::new(driver),
                    }
                }
                Proto::Http2 => {
                    let (s, conn) = http2::handshake(TokioExecutor::new(), io).await?;
                    let driver = Driver(tokio::spawn(async move {
                        let _ = conn.await;
                    }));
                    Sender {
                        send: Send::H2(s),
                        _driver: Arc::new(driver),
                    }
                }
            })
        };
        tokio::time::timeout(REQUEST_TIMEOUT, handshake)
            .await
            .context("handshake timed out")?
            .with_context(|| format!("{} handshake with {}", t.proto.label(), t.dst))
    }

    /// Another requester on the same connection (HTTP/2 only).
    fn share(&self) -> Option<Sender> {
        match &self.send {
            Send::H1(_) => None,
            Send::H2(s) => Some(Sender {
                send: Send::H2(s.clone()),
                _driver: self._driver.clone(),
            }),
        }
    }

    fn is_closed(&self) -> bool {
        match &self.send {
            Send::H1(s) => s.is_closed(),
            Send::H2(s) => s.is_closed(),
        }
    }

    /// One GET; its status.
    async fn get(&mut self, dst: SocketAddr) -> Result<u16> {
        let fut = async {
            let resp = match &mut self.send {
                Send::H1(s) => {
                    let req = hyper::Request::get(PATH)
                        .header(hyper::header::HOST, dst.to_string())
                        .body(Empty::new())?;
                    s.ready().await?;
                    s.send_request(req).await?
                }
                Send::H2(s) => {
                    let req = hyper::Request::get(format!("http://{dst}{PATH}"))
                        .version(hyper::Version::HTTP_2)
                        .body(Empty::new())?;
                    s.ready().await?;
                    s.send_request(req).await?
                }
            };
            let status = resp.status().as_u16();
            resp.into_body().collect().await?;
            Ok::<_, anyhow::Error>(status)
        };
        tokio::time::timeout(REQUEST_TIMEOUT, fut)
            .await
            .context("no answer in time")?
    }
}

/// `workers` requesters to `t`.
async fn senders(t: &Target, workers: usize) -> Result<Vec<Sender>> {
    let mut out: Vec<Sender> = Vec::with_capacity(workers);
    for _ in 0..workers {
        let shared = out.first().and_then(Sender::share);
        out.push(match shared {
            Some(s) => s,
            None => Sender::connect(t).await?,
        });
    }
    Ok(out)
}

/// One GET that answered 200, or an error (a broken connection is
/// replaced before the next request).
async fn request(sender: &mut Sender, t: &Target) -> bool {
    match sender.get(t.dst).await {
        Ok(200) => true,
        _ => {
            if sender.is_closed()
                && let Ok(s) = Sender::connect(t).await
            {
                *sender = s;
            }
            false
        }
    }
}

/// What one run did.
pub struct Run {
    pub requests: usize,
    pub errors: usize,
    pub secs: f64,
    /// Sorted.
    pub latencies: Vec<Duration>,
    /// The waypoint's Envoy and agent over the run, when metered.
    pub usage: Option<Usage>,
}

impl Run {
    pub fn rps(&self) -> f64 {
        self.requests as f64 / self.secs
    }

    pub fn pct_ms(&self, p: f64) -> f64 {
        if self.latencies.is_empty() {
            return 0.0;
        }
        let i = ((self.latencies.len() as f64 - 1.0) * p).round() as usize;
        self.latencies[i.min(self.latencies.len() - 1)].as_secs_f64() * 1e3
    }

    fn collect(parts: Vec<(Vec<Duration>, usize)>, unsent: usize, secs: f64) -> Run {
        let mut run = Run {
            requests: 0,
            errors: unsent,
            secs,
            latencies: Vec::new(),
            usage: None,
        };
        for (lat, errors) in parts {
            run.requests += lat.len();
            run.errors += errors;
            run.latencies.extend(lat);
        }
        run.latencies.sort_unstable();
        run
    }
}

async fn join_all(mut set: JoinSet<(Vec<Duration>, usize)>) -> Result<Vec<(Vec<Duration>, usize)>> {
    let mut parts = Vec::new();
    while let Some(r) = set.join_next().await {
        parts.push(r.context("a requester failed")?);
    }
    Ok(parts)
}

/// `workers` requesters sending back to back for `dur`.
pub async fn closed_loop(t: &Target, workers: usize, dur: Duration, meter: &Meter) -> Result<Run> {
    let senders = senders(t, workers).await?;
    let before = meter.sample();
    let start = Instant::now();
    let deadline = start + dur;
    let mut set = JoinSet::new();
    for mut sender in senders {
        let t = t.clone();
        set.spawn(async move {
            let (mut lat, mut errors) = (Vec::new(), 0);
            while Instant::now() < deadline {
                let sent = Instant::now();
                if request(&mut sender, &t).await {
                    lat.push(sent.elapsed());
                } else {
                    errors += 1;
                }
            }
            (lat, errors)
        });
    }
    let parts = join_all(set).await?;
    let mut run = Run::collect(parts, 0, start.elapsed().as_secs_f64());
    run.usage = Meter::usage(before, meter.sample());
    Ok(run)
}

/// `rate` requests a second for `dur`, each sent by the first free one of
/// `workers` requesters at or after its scheduled time; latency from the
/// scheduled time.
pub async fn open_loop(
    t: &Target,
    rate: f64,
    workers: usize,
    dur: Duration,
    meter: &Meter,
) -> Result<Run> {
    let senders = senders(t, workers).await?;
    let (tx, rx) = mpsc::unbounded_channel::<Instant>();
    let rx = Arc::new(Mutex::new(rx));
    let before = meter.sample();
    let start = Instant::now();
    let give_up = start + dur + DRAIN_GRACE;
    let pacer = std::thread::Builder::new()
        .name("wp-pacer".into())
        .spawn(move || pace(tx, start, rate, dur))?;
    let mut set = JoinSet::new();
    for mut sender in senders {
        let (t, rx) = (t.clone(), rx.clone());
        set.spawn(async move {
            let (mut lat, mut errors) = (Vec::new(), 0);
            loop {
                let Some(scheduled) = rx.lock().await.recv().await else {
                    break;
                };
                if Instant::now() > give_up {
                    errors += 1;
                    break;
                }
                if request(&mut sender, &t).await {
                    lat.push(scheduled.elapsed());
                } else {
                    errors += 1;
                }
            }
            (lat, errors)
        });
    }
    let parts = join_all(set).await?;
    let secs = start.elapsed().as_secs_f64();
    let after = meter.sample();
    pacer
        .join()
        .map_err(|_| anyhow::anyhow!("the pacer thread panicked"))?;
    // What the requesters left in the queue when they gave up.
    let mut unsent = 0;
    while rx.lock().await.try_recv().is_ok() {
        unsent += 1;
    }
    let mut run = Run::collect(parts, unsent, secs.max(dur.as_secs_f64()));
    run.usage = Meter::usage(before, after);
    Ok(run)
}

/// Puts each scheduled send time on `tx` at that time, from `start` for
/// `dur` at `rate` a second; a thread with fine timer slack, so sends are
/// within microseconds of their schedule (tokio's timer has 1 ms ticks).
fn pace(tx: mpsc::UnboundedSender<Instant>, start: Instant, rate: f64, dur: Duration) {
    let _ = nix::sys::prctl::set_timerslack(1_000);
    let interval = Duration::from_secs_f64(1.0 / rate);
    let mut next = start;
    while next.duration_since(start) < dur {
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        }
        if tx.send(next).is_err() {
            return;
        }
        next += interval;
    }
}

/// One GET on a new connection: its status (to wait until a path answers).
pub async fn probe(t: &Target) -> Result<u16> {
    Sender::connect(t).await?.get(t.dst).await
}
