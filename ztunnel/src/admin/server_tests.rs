//! The node-local HTTP servers cannot be made to hold unbounded connections
//! or request heads (issue 13): real sockets on 127.0.0.1.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::timeout;

use super::*;
use crate::drain::{self, DrainTrigger};
use crate::metrics::Metrics;
use crate::state::new_state;

const WAIT: Duration = Duration::from_secs(10);

fn context() -> Arc<AdminContext> {
    let (quit, _) = watch::channel(false);
    let (_, ready) = watch::channel(true);
    Arc::new(AdminContext {
        state: new_state().1,
        metrics: Arc::new(Metrics::new()),
        ready,
        log: None,
        quit,
        certificates: None,
    })
}

/// A readiness listener with `limits`; the trigger stops it when dropped.
async fn start(limits: HttpLimits) -> (SocketAddr, DrainTrigger) {
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let (trigger, watcher) = drain::channel();
    tokio::spawn(serve_with(
        tcp,
        Listener::Readiness,
        context(),
        watcher,
        limits,
    ));
    (addr, trigger)
}

/// Sends `head` and returns the status code of the answer, or the error
/// that ended the connection.
async fn status_of(addr: SocketAddr, head: &[u8]) -> io::Result<u16> {
    let mut s = TcpStream::connect(addr).await?;
    // The server may answer (and close) before the whole head is sent.
    let _ = s.write_all(head).await;
    let mut buf = Vec::new();
    let _ = timeout(WAIT, s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf);
    text.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| io::Error::other(format!("no status in {text:?}")))
}

/// Whether the server closed `s` (EOF or reset) within `within`.
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut b = [0u8; 64];
    match timeout(within, s.read(&mut b)).await {
        Ok(Ok(0)) | Ok(Err(_)) => true,
        Ok(Ok(_)) | Err(_) => false,
    }
}

const READY: &[u8] = b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

#[tokio::test]
async fn an_oversized_request_head_gets_431_with_the_default_limits() {
    let (addr, _stop) = start(HttpLimits::default()).await;
    assert_eq!(status_of(addr, READY).await.unwrap(), 200);
    let big = format!(
        "GET /healthz/ready HTTP/1.1\r\nHost: x\r\nX-Padding: {}\r\n\r\n",
        "a".repeat(200 * 1024)
    );
    assert_eq!(status_of(addr, big.as_bytes()).await.unwrap(), 431);
    let many: String = (0..200).map(|i| format!("X-H{i}: v\r\n")).collect();
    let many = format!("GET /healthz/ready HTTP/1.1\r\nHost: x\r\n{many}\r\n");
    assert_eq!(status_of(addr, many.as_bytes()).await.unwrap(), 431);
    // The listener keeps serving.
    assert_eq!(status_of(addr, READY).await.unwrap(), 200);
}

/// Collects log lines written while a test runs on this thread.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl io::Write for Lines {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Lines {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

// A current-thread runtime: every task logs through the subscriber set here.
#[tokio::test]
async fn connections_over_the_cap_are_closed_at_once_and_logged() {
    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _log = tracing::subscriber::set_default(subscriber);

    let limits = HttpLimits {
        max_connections: 4,
        ..HttpLimits::default()
    };
    let (addr, _stop) = start(limits).await;
    // Four idle connections take every slot.
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    // Make sure the server has accepted them (a request on a fifth would
    // race them otherwise): each answers a kept-alive request.
    for s in &mut idle {
        s.write_all(b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut b = [0u8; 12];
        timeout(WAIT, s.read_exact(&mut b)).await.unwrap().unwrap();
        assert_eq!(&b, b"HTTP/1.1 200");
    }
    let mut extra = TcpStream::connect(addr).await.unwrap();
    assert!(
        closed_within(&mut extra, WAIT).await,
        "a connection over the cap is closed"
    );
    let log = lines.text();
    assert!(
        log.contains("connection refused: the readiness listener already serves 4 connections"),
        "{log}"
    );
    // A freed slot serves again.
    drop(idle.pop());
    let served = timeout(WAIT, async {
        loop {
            if let Ok(200) = status_of(addr, READY).await {
                return;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(served.is_ok(), "a freed slot serves a new connection");
}

#[tokio::test]
async fn an_idle_connection_is_closed_after_the_header_read_timeout() {
    let limits = HttpLimits {
        header_read_timeout: Duration::from_millis(300),
        ..HttpLimits::default()
    };
    let (addr, _stop) = start(limits).await;
    // Never sends a byte.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    assert!(
        closed_within(&mut silent, WAIT).await,
        "silent connection closed"
    );
    // Sends half a head, then stalls (slowloris).
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    assert!(closed_within(&mut slow, WAIT).await, "stalled head closed");
    // Kept alive after a request, then idle.
    let mut kept = TcpStream::connect(addr).await.unwrap();
    kept.write_all(b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut b = [0u8; 12];
    timeout(WAIT, kept.read_exact(&mut b))
        .await
        .unwrap()
        .unwrap();
    let mut rest = Vec::new();
    let closed = timeout(WAIT, kept.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "idle kept-alive connection closed");
}
