//! The floor: the simplest userspace relay, run as its own process (this
//! bench binary re-executed with `AMBIT_BENCH_ROLE=floor-relay`) so its CPU
//! and RSS are its own. Shaped like ztunnel's process: tokio multi-thread
//! runtime with 2 workers, mimalloc (the bench's global allocator), no
//! transparent huge pages (as local mode starts ztunnel).
//!
//! Per accepted connection: connect to the target, optionally wrap one side
//! in TLS 1.3 (rustls, ring provider, mutual authentication, no resumption),
//! then copy both ways with 64 KiB buffers until both sides are done. No
//! HTTP/2, no pooling, no metrics, no logs.
//!
//! Environment of the child: `RELAY_NETNS` (netns file the whole process
//! enters before any thread exists), `RELAY_MAP` (`listen=target,...`),
//! `RELAY_TLS` (`none`, `client`: TLS towards the target, `server`: TLS from
//! the accepted side), `RELAY_CERTS` (directory of [`super::tls`]'s files).
//! Prints `READY` once listening; stops when stdin closes or on SIGTERM.

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::signal::unix::{SignalKind, signal};

use super::tls::{self, Side};

/// Value of `AMBIT_BENCH_ROLE` that selects this role.
pub const ROLE: &str = "floor-relay";
/// Copy buffer, each direction.
const BUF: usize = 64 * 1024;
/// Bound on the relay's connect and TLS handshake.
const DIAL: Duration = Duration::from_secs(5);

fn var(name: &str) -> Result<String> {
    std::env::var(name).with_context(|| format!("floor relay: {name} is not set"))
}

fn parse_map(map: &str) -> Result<Vec<(SocketAddr, SocketAddr)>> {
    map.split(',')
        .map(|pair| {
            let (l, t) = pair.split_once('=').context("RELAY_MAP: listen=target")?;
            Ok((l.parse()?, t.parse()?))
        })
        .collect()
}

/// The child's main.
pub fn run() -> Result<()> {
    raise_nofile();
    let ns = std::fs::File::open(var("RELAY_NETNS")?)?;
    // Still single-threaded: every thread made from here on is in the pod.
    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
        .context("floor relay: entering the pod's netns")?;
    let map = parse_map(&var("RELAY_MAP")?)?;
    let side = tls::load(&var("RELAY_TLS")?, Path::new(&var("RELAY_CERTS")?))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = runtime.block_on(serve(map, side));
    // The stdin reader may still block; do not wait for it.
    runtime.shutdown_background();
    result
}

/// Soft RLIMIT_NOFILE to the hard limit (thousands of idle connections).
pub fn raise_nofile() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

async fn serve(map: Vec<(SocketAddr, SocketAddr)>, side: Side) -> Result<()> {
    for (listen, target) in map {
        let l = TcpListener::bind(listen)
            .await
            .with_context(|| format!("floor relay: binding {listen}"))?;
        tokio::spawn(accept_loop(l, target, side.clone()));
    }
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "READY")?;
        out.flush()?;
    }
    let stdin_closed = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        let mut stdin = std::io::stdin().lock();
        while stdin.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            line.clear();
        }
    });
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = stdin_closed => {}
        _ = term.recv() => {}
    }
    Ok(())
}

async fn accept_loop(l: TcpListener, target: SocketAddr, side: Side) {
    loop {
        match l.accept().await {
            Ok((s, _)) => {
                let side = side.clone();
                tokio::spawn(async move {
                    if let Err(e) = relay_one(s, target, side).await {
                        eprintln!("floor relay: {e:#}");
                    }
                });
            }
            Err(e) => {
                eprintln!("floor relay: accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn relay_one(inbound: TcpStream, target: SocketAddr, side: Side) -> Result<()> {
    inbound.set_nodelay(true)?;
    match side {
        Side::Plain => pump(inbound, dial(target).await?).await,
        Side::Client(cfg) => {
            let name = rustls_pki_types::ServerName::try_from(tls::SERVER_NAME)?;
            let out = dial(target).await?;
            let connect = tokio_rustls::TlsConnector::from(cfg).connect(name, out);
            let out = tokio::time::timeout(DIAL, connect)
                .await
                .context("TLS handshake timed out")??;
            pump(inbound, out).await
        }
        Side::Server(cfg) => {
            let accept = tokio_rustls::TlsAcceptor::from(cfg).accept(inbound);
            let inbound = tokio::time::timeout(DIAL, accept)
                .await
                .context("TLS handshake timed out")??;
            pump(inbound, dial(target).await?).await
        }
    }
}

async fn dial(target: SocketAddr) -> Result<TcpStream> {
    let s = tokio::time::timeout(DIAL, TcpStream::connect(target))
        .await
        .with_context(|| format!("connecting to {target} timed out"))??;
    s.set_nodelay(true)?;
    Ok(s)
}

async fn pump<A, B>(mut a: A, mut b: B) -> Result<()>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    tokio::io::copy_bidirectional_with_sizes(&mut a, &mut b, BUF, BUF).await?;
    Ok(())
}

/// A relay child, seen from the bench; asked to stop (stdin closed) and
/// reaped on drop, killed if it does not stop within 5 s.
pub struct Relay {
    child: Child,
    stdin: Option<ChildStdin>,
    pub pid: u32,
}

impl Relay {
    /// Starts a relay in the netns at `netns`, serving `map`.
    pub fn spawn(
        netns: &Path,
        map: &[(SocketAddr, SocketAddr)],
        tls: &str,
        certs: &Path,
    ) -> Result<Relay> {
        let map: Vec<String> = map.iter().map(|(l, t)| format!("{l}={t}")).collect();
        let mut child = Command::new(std::env::current_exe()?)
            .env("AMBIT_BENCH_ROLE", ROLE)
            .env("RELAY_NETNS", netns)
            .env("RELAY_MAP", map.join(","))
            .env("RELAY_TLS", tls)
            .env("RELAY_CERTS", certs)
            .env("MIMALLOC_ALLOW_THP", "0")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a floor relay")?;
        let stdout = child.stdout.take().context("relay stdout")?;
        let stdin = child.stdin.take();
        let relay = Relay {
            pid: child.id(),
            child,
            stdin,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = tx.send(BufReader::new(stdout).read_line(&mut line).map(|_| line));
        });
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .context("the floor relay did not report READY within 20 s")??;
        if line.trim() != "READY" {
            bail!("the floor relay failed to start (see its stderr above); it said {line:?}");
        }
        Ok(relay)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
