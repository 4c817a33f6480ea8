//! Steady traffic for fault tests: long-lived connections that echo a
//! message every [`Traffic::PERIOD`] and a stream of fresh connections,
//! every operation bounded, every failure counted with its reason. A fault
//! test starts it, injects the fault, and checks that nothing was lost.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ambit_inpod::{PodNetns, SocketOptions};
use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// Bound on one connect or one echo round trip.
pub const OP: Duration = Duration::from_secs(3);

/// What one kind of traffic saw.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    /// Successful round trips.
    pub ok: u64,
    /// Failed operations (a long-lived connection counts once: it is lost).
    pub failed: u64,
    /// The first few failures, with when they happened.
    pub errors: Vec<String>,
}

impl Tally {
    fn fail(&mut self, what: String) {
        self.failed += 1;
        if self.errors.len() < 5 {
            self.errors.push(what);
        }
    }
}

/// Running traffic from one pod to one destination.
pub struct Traffic {
    stop: watch::Sender<bool>,
    long: Arc<Mutex<Tally>>,
    fresh: Arc<Mutex<Tally>>,
    tasks: Vec<JoinHandle<()>>,
    started: tokio::time::Instant,
}

/// Connects from inside `ns` (as the pod's app would: captured by its
/// redirection), bounded by [`OP`].
pub async fn connect(ns: &PodNetns, dst: SocketAddr) -> Result<TcpStream> {
    tokio::time::timeout(OP, ns.connect_from(dst, &SocketOptions::default()))
        .await
        .with_context(|| format!("connect to {dst}: no answer within {OP:?}"))?
        .with_context(|| format!("connect to {dst}"))
}

/// One echo round trip of `msg`, bounded by [`OP`].
pub async fn round_trip(s: &mut TcpStream, msg: &[u8]) -> Result<()> {
    let mut got = vec![0u8; msg.len()];
    tokio::time::timeout(OP, async {
        s.write_all(msg).await?;
        s.read_exact(&mut got).await?;
        Ok::<_, std::io::Error>(())
    })
    .await
    .with_context(|| format!("echo: no answer within {OP:?}"))?
    .context("echo")?;
    if got != msg {
        bail!("echo came back altered");
    }
    Ok(())
}

/// A fresh connection, one echo, closed.
pub async fn echo_once(ns: &PodNetns, dst: SocketAddr) -> Result<()> {
    let mut s = connect(ns, dst).await?;
    round_trip(&mut s, b"fresh-connection").await
}

impl Traffic {
    /// Time between round trips on each long-lived connection.
    pub const PERIOD: Duration = Duration::from_millis(100);

    /// Opens `long` connections from `ns` to `dst` (failing if one cannot
    /// be made) and starts a fresh connection every `fresh_every`.
    pub async fn start(
        ns: PodNetns,
        dst: SocketAddr,
        long: usize,
        fresh_every: Duration,
    ) -> Result<Self> {
        let (stop, stopped) = watch::channel(false);
        let started = tokio::time::Instant::now();
        let long_tally = Arc::new(Mutex::new(Tally::default()));
        let fresh_tally = Arc::new(Mutex::new(Tally::default()));
        let mut tasks = Vec::new();
        for i in 0..long {
            let mut s = connect(&ns, dst).await?;
            round_trip(&mut s, b"hello").await?;
            let (tally, mut stopped) = (long_tally.clone(), stopped.clone());
            tasks.push(tokio::spawn(async move {
                let msg = format!("long-lived-{i}");
                loop {
                    if *stopped.borrow() {
                        return;
                    }
                    match round_trip(&mut s, msg.as_bytes()).await {
                        Ok(()) => lock(&tally).ok += 1,
                        Err(e) => {
                            lock(&tally).fail(format!(
                                "long-lived connection {i} lost after {:?}: {e:#}",
                                started.elapsed()
                            ));
                            return;
                        }
                    }
                    tokio::select! {
                        _ = stopped.changed() => {}
                        () = tokio::time::sleep(Self::PERIOD) => {}
                    }
                }
            }));
        }
        let (tally, mut stopped) = (fresh_tally.clone(), stopped);
        tasks.push(tokio::spawn(async move {
            loop {
                if *stopped.borrow() {
                    return;
                }
                match echo_once(&ns, dst).await {
                    Ok(()) => lock(&tally).ok += 1,
                    Err(e) => lock(&tally)
                        .fail(format!("new connection at {:?}: {e:#}", started.elapsed())),
                }
                tokio::select! {
                    _ = stopped.changed() => {}
                    () = tokio::time::sleep(fresh_every) => {}
                }
            }
        }));
        Ok(Self {
            stop,
            long: long_tally,
            fresh: fresh_tally,
            tasks,
            started,
        })
    }

    /// What the traffic saw so far: (long-lived, fresh).
    pub fn tally(&self) -> (Tally, Tally) {
        (lock(&self.long).clone(), lock(&self.fresh).clone())
    }

    /// Waits (bounded by `limit`) until, from now on, every long-lived
    /// connection made `rounds` more round trips and `rounds` more fresh
    /// connections went through: the traffic demonstrably flows after a
    /// fault. Returns how long that took.
    pub async fn flows_on(&self, rounds: u64, limit: Duration) -> Result<Duration> {
        let started = tokio::time::Instant::now();
        let (l0, f0) = self.tally();
        let long = (self.tasks.len() as u64).saturating_sub(1);
        loop {
            let (l, f) = self.tally();
            if l.failed + f.failed > l0.failed + f0.failed {
                bail!("traffic failed meanwhile: {:?} {:?}", l.errors, f.errors);
            }
            if l.ok >= l0.ok + rounds * long && f.ok >= f0.ok + rounds {
                return Ok(started.elapsed());
            }
            if started.elapsed() > limit {
                bail!("traffic did not flow on within {limit:?}: long {l:?}, fresh {f:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops it and returns (long-lived, fresh).
    pub async fn finish(self) -> (Tally, Tally) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = tokio::time::timeout(OP * 2, t).await;
        }
        let (l, f) = (lock(&self.long).clone(), lock(&self.fresh).clone());
        tracing::info!(
            ran = ?self.started.elapsed(),
            long_ok = l.ok,
            long_failed = l.failed,
            fresh_ok = f.ok,
            fresh_failed = f.failed,
            "traffic finished"
        );
        (l, f)
    }
}

fn lock(m: &Mutex<Tally>) -> std::sync::MutexGuard<'_, Tally> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// An echo server on `0.0.0.0:port` inside `ns`, driven by the current
/// runtime; aborted (with its connections) when the handle is dropped.
pub struct EchoServer {
    task: JoinHandle<()>,
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl EchoServer {
    pub fn start(ns: &PodNetns, port: u16) -> Result<Self> {
        let std = ns
            .bind_listener(SocketAddr::from(([0, 0, 0, 0], port)), false)
            .with_context(|| format!("echo server on :{port}"))?;
        let listener = TcpListener::from_std(std)?;
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => if let Ok((mut s, _)) = accepted {
                        conns.spawn(async move {
                            let (mut r, mut w) = s.split();
                            let _ = tokio::io::copy(&mut r, &mut w).await;
                        });
                    },
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(Self { task })
    }
}
