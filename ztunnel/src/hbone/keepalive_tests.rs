#![allow(clippy::unwrap_used, clippy::expect_used)]

//! Regression tests (issue 14): HBONE never hangs on a silent peer. A peer
//! that accepts TCP and never answers fails the dial within the handshake
//! bound; a peer that goes silent after the handshake is caught by the
//! HTTP/2 PING and dropped from the pool; a CONNECT that gets no answer
//! fails within its bound, and other traffic keeps flowing meanwhile.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hyper::http::{HeaderMap, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::timeout;

use super::*;
use crate::copy::{CopyConfig, copy_bidirectional};
use crate::identity::{Identity, WorkloadCertificate};
use crate::test_support::{TestCa, echo_server, id, roundtrip};

/// Longest any test here may wait before calling a hang a failure.
const HANG: Duration = Duration::from_secs(10);

/// An HBONE server that connects every CONNECT to its authority.
async fn hbone_server(ca: &TestCa, identity: &Identity) -> (SocketAddr, JoinHandle<()>) {
    let server = HboneServer::new(Arc::new(
        server_config(&ca.issue(identity), &ca.bundle()).unwrap(),
    ));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let server = server.clone();
            tokio::spawn(async move {
                let _ = server
                    .serve(
                        tcp,
                        |_| Ok(()),
                        |req, pending: PendingConnect| async move {
                            let Ok(app) = TcpStream::connect(req.authority).await else {
                                pending.refuse(StatusCode::SERVICE_UNAVAILABLE);
                                return;
                            };
                            let Ok(stream) = pending.accept() else { return };
                            let _ = copy_bidirectional(stream, app, &CopyConfig::default()).await;
                        },
                    )
                    .await;
            });
        }
    });
    (addr, task)
}

/// A TCP relay in front of `upstream` whose existing connections can be
/// frozen: they stay open but nothing crosses them any more, as with a
/// peer that hung or a path that silently drops packets.
struct Relay {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    flags: Arc<std::sync::Mutex<Vec<Arc<AtomicBool>>>>,
    task: JoinHandle<()>,
}

impl Relay {
    async fn start(upstream: SocketAddr) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let flags: Arc<std::sync::Mutex<Vec<Arc<AtomicBool>>>> = Arc::default();
        let (count, all) = (accepted.clone(), flags.clone());
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = l.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let frozen = Arc::new(AtomicBool::new(false));
                all.lock().unwrap().push(frozen.clone());
                tokio::spawn(async move {
                    let Ok(up) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    let a = tokio::spawn(pump(dr, uw, frozen.clone()));
                    let b = tokio::spawn(pump(ur, dw, frozen));
                    let _ = tokio::join!(a, b);
                });
            }
        });
        Self {
            addr,
            accepted,
            flags,
            task,
        }
    }

    /// Freezes every connection made so far; later ones still flow.
    fn freeze(&self) {
        for f in self.flags.lock().unwrap().iter() {
            f.store(true, Ordering::SeqCst);
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    frozen: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.load(Ordering::SeqCst) {
            // Hold both sockets open and forward nothing, ever.
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

struct Setup {
    ca: TestCa,
    client: WorkloadCertificate,
    server_id: Identity,
    echo: SocketAddr,
}

impl Setup {
    async fn new() -> Self {
        let ca = TestCa::new("keepalive test");
        let client = ca.issue(&id("client"));
        Self {
            ca,
            client,
            server_id: id("server"),
            echo: echo_server().await,
        }
    }

    fn key(&self, dst: SocketAddr) -> PoolKey {
        PoolKey {
            src: self.client.identity.clone(),
            dst: self.server_id.clone(),
            dst_ip: dst.ip(),
            src_ip: None,
        }
    }

    /// A stream to the echo app through `dst` (HBONE at that address).
    async fn stream(
        &self,
        pool: &HbonePool,
        dst: SocketAddr,
        key: &PoolKey,
    ) -> Result<PooledStream, PoolError> {
        let bundle = self.ca.bundle();
        let expected = self.server_id.clone();
        let client = &self.client;
        timeout(
            HANG,
            pool.stream(
                key.clone(),
                dst,
                &TcpDialer,
                move || client_config(client, &bundle, expected.clone()).map(Arc::new),
                self.echo,
                HeaderMap::new(),
            ),
        )
        .await
        .expect("the pool must not hang on a silent peer")
    }
}

fn pool_with(timeouts: ClientTimeouts) -> HbonePool {
    HbonePool::new(PoolConfig {
        timeouts,
        ..PoolConfig::default()
    })
}

async fn echo_ok(stream: PooledStream) {
    let data: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
    assert_eq!(roundtrip(stream, data.clone()).await, data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_accepts_tcp_and_never_answers_fails_within_the_handshake_bound() {
    let s = Setup::new().await;
    // Accepts and holds every connection, never says a word.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = silent.accept().await {
            held.push(tcp);
        }
    });
    let (good, _server) = hbone_server(&s.ca, &s.server_id).await;
    let pool = pool_with(ClientTimeouts {
        handshake: Duration::from_millis(500),
        ..ClientTimeouts::default()
    });

    // Another client's traffic to a healthy peer runs alongside.
    let healthy = async {
        let started = Instant::now();
        for _ in 0..5 {
            let key = PoolKey {
                src_ip: Some("127.0.0.2".parse().unwrap()),
                ..s.key(good)
            };
            echo_ok(s.stream(&pool, good, &key).await.unwrap()).await;
        }
        started.elapsed()
    };
    let started = Instant::now();
    let silent_key = s.key(silent_addr);
    let (failed, healthy_took) = tokio::join!(s.stream(&pool, silent_addr, &silent_key), healthy);
    let took = started.elapsed();
    let err = failed.expect_err("a silent peer must fail the dial");
    assert!(
        matches!(err, PoolError::Client(ClientError::HandshakeTimeout { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("does not answer"), "{err}");
    assert!(
        took < Duration::from_millis(1500),
        "the failure took {took:?} with a 500 ms bound"
    );
    assert!(
        healthy_took < Duration::from_secs(2),
        "traffic to a healthy peer was held up: {healthy_took:?}"
    );
    holder.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_whose_peer_goes_silent_is_dropped_by_the_ping() {
    let s = Setup::new().await;
    let (server, _task) = hbone_server(&s.ca, &s.server_id).await;
    let relay = Relay::start(server).await;
    let pool = pool_with(ClientTimeouts {
        keepalive_interval: Duration::from_millis(100),
        keepalive_timeout: Duration::from_millis(300),
        ..ClientTimeouts::default()
    });
    let key = s.key(relay.addr);
    echo_ok(s.stream(&pool, relay.addr, &key).await.unwrap()).await;
    assert_eq!(pool.stats().key(&key).connections, 1);

    // A stream left open on it, then the peer goes silent.
    let mut open = s.stream(&pool, relay.addr, &key).await.unwrap();
    relay.freeze();
    let frozen_at = Instant::now();
    timeout(HANG, async {
        loop {
            pool.reap();
            if pool.stats().key(&key).connections == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the silent connection must leave the pool");
    let detected = frozen_at.elapsed();
    assert!(
        detected < Duration::from_millis(1500),
        "PING every 100 ms with a 300 ms bound took {detected:?} to notice"
    );
    // The stream on it fails instead of hanging.
    let mut buf = [0u8; 1];
    let read = timeout(HANG, open.read(&mut buf)).await.expect("no hang");
    assert!(
        matches!(read, Err(_) | Ok(0)),
        "the stream of a dropped connection ends: {read:?}"
    );
    // New traffic gets a fresh connection and flows.
    echo_ok(s.stream(&pool, relay.addr, &key).await.unwrap()).await;
    assert_eq!(relay.accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_connect_times_out_and_the_pool_redials() {
    let s = Setup::new().await;
    let (server, _task) = hbone_server(&s.ca, &s.server_id).await;
    let relay = Relay::start(server).await;
    // PINGs too slow to help: the CONNECT bound alone must catch it.
    let pool = pool_with(ClientTimeouts {
        connect_response: Duration::from_millis(400),
        keepalive_interval: Duration::from_secs(60),
        ..ClientTimeouts::default()
    });
    let key = s.key(relay.addr);
    echo_ok(s.stream(&pool, relay.addr, &key).await.unwrap()).await;
    relay.freeze();

    let started = Instant::now();
    let stream = s.stream(&pool, relay.addr, &key).await;
    let took = started.elapsed();
    echo_ok(stream.expect("the retry on a fresh connection works")).await;
    assert!(
        took < Duration::from_millis(1500),
        "a 400 ms CONNECT bound took {took:?}"
    );
    assert_eq!(relay.accepted.load(Ordering::SeqCst), 2, "one redial");

    // Straight on a connection: the error names the bound.
    let tcp = TcpStream::connect(relay.addr).await.unwrap();
    let cfg = Arc::new(client_config(&s.client, &s.ca.bundle(), s.server_id.clone()).unwrap());
    let timeouts = ClientTimeouts {
        connect_response: Duration::from_millis(300),
        keepalive_interval: Duration::from_secs(60),
        ..ClientTimeouts::default()
    };
    let conn = HboneClient::connect_with(tcp, cfg, timeouts).await.unwrap();
    relay.freeze();
    let err = timeout(HANG, conn.connect_stream(s.echo, HeaderMap::new()))
        .await
        .expect("no hang")
        .expect_err("no answer");
    assert!(matches!(err, ClientError::ResponseTimeout { .. }), "{err}");
    assert!(
        !conn.is_usable(),
        "a connection that did not answer is not reused"
    );
}
