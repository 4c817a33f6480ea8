//! The bounds of the HBONE server (issue 13): what one client can make one
//! connection hold. Real TLS + HTTP/2 on 127.0.0.1 with certificates from
//! an in-test CA; the client is our own [`HboneClient`] (h2 underneath), a
//! conforming peer, so it queues streams past the server's limit.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hyper::http::{HeaderMap, HeaderValue, StatusCode};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::timeout;

use super::*;
use crate::hbone::{ClientError, HboneClient, HboneConnection, client_config, server_config};
use crate::test_support::{TestCa, id};

const WAIT: Duration = Duration::from_secs(30);

/// Streams the handler holds at once, the most ever seen, and how many it
/// was handed in all.
#[derive(Default)]
struct Counts {
    open: AtomicUsize,
    max: AtomicUsize,
    total: AtomicUsize,
    authorized: AtomicUsize,
}

/// A server whose handler holds every stream until `release` turns true,
/// counting them; CONNECT is authorized to any address.
async fn holding_server(
    ca: &TestCa,
    release: watch::Receiver<bool>,
) -> (SocketAddr, Arc<Counts>, watch::Receiver<usize>) {
    let cert = ca.issue(&id("server"));
    let server = HboneServer::new(Arc::new(server_config(&cert, &ca.bundle()).unwrap()));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let counts = Arc::new(Counts::default());
    let (open_tx, open_rx) = watch::channel(0usize);
    let open_tx = Arc::new(open_tx);
    let c = counts.clone();
    tokio::spawn(async move {
        let mut conns = JoinSet::new();
        while let Ok((tcp, _)) = l.accept().await {
            let server = server.clone();
            let (c, release, open_tx) = (c.clone(), release.clone(), open_tx.clone());
            conns.spawn(async move {
                let authorize = |_: &ConnectRequest| {
                    c.authorized.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                };
                let handler = |_req: ConnectRequest, stream: H2Stream| {
                    let (c, mut release, open_tx) = (c.clone(), release.clone(), open_tx.clone());
                    let now = c.open.fetch_add(1, Ordering::SeqCst) + 1;
                    c.max.fetch_max(now, Ordering::SeqCst);
                    c.total.fetch_add(1, Ordering::SeqCst);
                    open_tx.send_replace(now);
                    async move {
                        let _ = release.wait_for(|r| *r).await;
                        // Counted out before the stream ends: the client
                        // cannot reuse its slot before this.
                        let now = c.open.fetch_sub(1, Ordering::SeqCst) - 1;
                        open_tx.send_replace(now);
                        drop(stream);
                    }
                };
                let _ = server.serve(tcp, authorize, handler).await;
            });
        }
    });
    (addr, counts, open_rx)
}

async fn connect(ca: &TestCa, addr: SocketAddr) -> HboneConnection {
    let cert = ca.issue(&id("client"));
    let cfg = Arc::new(client_config(&cert, &ca.bundle(), id("server")).unwrap());
    let tcp = TcpStream::connect(addr).await.unwrap();
    timeout(WAIT, HboneClient::connect(tcp, cfg))
        .await
        .unwrap()
        .unwrap()
}

/// Resident set size of this process, in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_streams_on_one_connection_never_exceed_the_stream_limit() {
    let ca = TestCa::new("mesh");
    let (release_tx, release) = watch::channel(false);
    let (addr, counts, mut open) = holding_server(&ca, release).await;
    let conn = connect(&ca, addr).await;
    let target: SocketAddr = "10.0.0.1:80".parse().unwrap();
    let before = rss_kib();

    const STREAMS: usize = 1000;
    let mut clients = JoinSet::new();
    // One stream first: once it is answered, the client has the server's
    // SETTINGS (before them h2 assumes no limit and the server would have
    // to refuse the excess, which the raw flood in tests/security.rs covers).
    let first = timeout(WAIT, conn.connect_stream(target, HeaderMap::new()))
        .await
        .unwrap()
        .unwrap();
    clients.spawn(async move {
        let mut s = first;
        let _ = s.read_to_end(&mut Vec::new()).await;
        Ok::<_, ClientError>(())
    });
    for _ in 1..STREAMS {
        let conn = conn.clone();
        clients.spawn(async move {
            let mut s = conn.connect_stream(target, HeaderMap::new()).await?;
            // Held by the server until released; then it ends.
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink).await;
            Ok::<_, ClientError>(())
        });
    }
    // The server fills up to its limit, and no further while held.
    timeout(
        WAIT,
        open.wait_for(|n| *n >= MAX_CONCURRENT_STREAMS as usize),
    )
    .await
    .expect("the server reached its stream limit in time")
    .unwrap();
    let peak = rss_kib();
    // Give a misbehaving server every chance to take more.
    for _ in 0..20 {
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        counts.open.load(Ordering::SeqCst),
        MAX_CONCURRENT_STREAMS as usize,
        "exactly the limit is open while the rest wait"
    );
    release_tx.send_replace(true);
    while let Some(r) = timeout(WAIT, clients.join_next())
        .await
        .expect("all streams served")
    {
        r.unwrap()
            .unwrap_or_else(|e| panic!("a queued stream failed: {e}"));
    }
    let max = counts.max.load(Ordering::SeqCst);
    assert!(
        max <= MAX_CONCURRENT_STREAMS as usize,
        "the server held {max} streams of one connection at once"
    );
    assert_eq!(
        counts.total.load(Ordering::SeqCst),
        STREAMS,
        "every stream served in turn"
    );
    assert!(conn.is_usable(), "a conforming client is never refused");
    println!(
        "stream flood: {STREAMS} streams, at most {max} open at once; RSS {before} KiB -> {peak} KiB \
         at the limit (+{} KiB, client and server in one process)",
        peak.saturating_sub(before)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_are_refused_on_their_stream_only() {
    let ca = TestCa::new("mesh");
    let (_release_tx, release) = watch::channel(false);
    let (addr, counts, _open) = holding_server(&ca, release).await;
    let conn = connect(&ca, addr).await;
    let target: SocketAddr = "10.0.0.1:80".parse().unwrap();

    let held = timeout(WAIT, conn.connect_stream(target, HeaderMap::new()))
        .await
        .unwrap()
        .expect("an ordinary CONNECT is accepted");
    let mut big = HeaderMap::new();
    big.insert(
        "x-padding",
        HeaderValue::from_str(&"a".repeat(200 * 1024)).unwrap(),
    );
    let err = timeout(WAIT, conn.connect_stream(target, big))
        .await
        .unwrap()
        .expect_err("200 KiB of headers must be refused");
    match &err {
        ClientError::Status { status, .. } => {
            assert_eq!(
                *status,
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "{err}"
            )
        }
        other => panic!("expected 431, got {other}"),
    }
    assert_eq!(
        counts.authorized.load(Ordering::SeqCst),
        1,
        "the oversized request never reached authorization"
    );
    // The connection and its other stream are untouched.
    assert!(conn.is_usable());
    let again = timeout(WAIT, conn.connect_stream(target, HeaderMap::new()))
        .await
        .unwrap();
    assert!(again.is_ok(), "a new stream still opens: {again:?}");
    assert_eq!(counts.open.load(Ordering::SeqCst), 2);
    drop(held);
}
