#![allow(clippy::unwrap_used, clippy::expect_used)]

//! The HBONE pool against real HBONE servers on 127.0.0.1, with
//! certificates from an in-test CA (helpers follow `hbone/tests.rs`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hyper::http::HeaderMap;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::timeout;

use super::*;
use crate::copy::{CopyConfig, copy_bidirectional};
use crate::hbone::{HboneServer, ServerError, client_config, server_config};
use crate::identity::{Identity, TrustBundle, WorkloadCertificate};
use crate::test_support::{TestCa, echo_server, id, roundtrip};

const WAIT: Duration = Duration::from_secs(30);

/// An HBONE server standing in for a pod's :15008: accepts every CONNECT
/// and copies it to its authority; counts accepted TCP connections and
/// reports each connection's end.
struct TestServer {
    addr: SocketAddr,
    accepts: Arc<AtomicUsize>,
    closed: mpsc::UnboundedReceiver<Result<(), ServerError>>,
    task: JoinHandle<()>,
}

impl TestServer {
    /// Stops accepting and closes every connection.
    async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

async fn start_server(
    cert: &WorkloadCertificate,
    bundle: &TrustBundle,
    bind: SocketAddr,
) -> TestServer {
    let server = HboneServer::new(Arc::new(server_config(cert, bundle).unwrap()))
        .with_handshake_timeout(Duration::from_secs(5));
    let l = TcpListener::bind(bind).await.unwrap();
    let addr = l.local_addr().unwrap();
    let accepts = Arc::new(AtomicUsize::new(0));
    let (closed_tx, closed) = mpsc::unbounded_channel();
    let count = accepts.clone();
    let task = tokio::spawn(async move {
        let mut conns = JoinSet::new();
        loop {
            let Ok((tcp, _)) = l.accept().await else {
                return;
            };
            count.fetch_add(1, Ordering::SeqCst);
            let server = server.clone();
            let closed_tx = closed_tx.clone();
            conns.spawn(async move {
                let outcome = server
                    .serve(
                        tcp,
                        |_| Ok(()),
                        |req, pending: crate::hbone::PendingConnect| async move {
                            let Ok(app) = TcpStream::connect(req.authority).await else {
                                pending.refuse(hyper::http::StatusCode::SERVICE_UNAVAILABLE);
                                return;
                            };
                            let Ok(stream) = pending.accept() else { return };
                            let _ = copy_bidirectional(stream, app, &CopyConfig::default()).await;
                        },
                    )
                    .await;
                let _ = closed_tx.send(outcome);
            });
        }
    });
    TestServer {
        addr,
        accepts,
        closed,
        task,
    }
}

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A CA, an echo app, and a client workload.
struct Mesh {
    ca: TestCa,
    echo: SocketAddr,
    client: WorkloadCertificate,
}

impl Mesh {
    async fn new() -> Self {
        let ca = TestCa::new("pool test");
        let client = ca.issue(&id("client"));
        Self {
            echo: echo_server().await,
            client,
            ca,
        }
    }

    async fn server(&self, identity: &Identity, bind: SocketAddr) -> TestServer {
        start_server(&self.ca.issue(identity), &self.ca.bundle(), bind).await
    }

    fn key(&self, dst: &Identity, server: &TestServer) -> PoolKey {
        PoolKey {
            src: self.client.identity.clone(),
            dst: dst.clone(),
            dst_ip: server.addr.ip(),
            src_ip: None,
        }
    }

    /// A stream from the pool for `key` to the echo app through `dst`.
    async fn stream_with(
        &self,
        pool: &HbonePool,
        cert: &WorkloadCertificate,
        key: &PoolKey,
        dst: SocketAddr,
    ) -> Result<PooledStream, PoolError> {
        self.stream_via(pool, &TcpDialer, cert, key, dst).await
    }

    /// [`Mesh::stream_with`], dialing new connections with `dialer`.
    async fn stream_via(
        &self,
        pool: &HbonePool,
        dialer: &dyn Dialer,
        cert: &WorkloadCertificate,
        key: &PoolKey,
        dst: SocketAddr,
    ) -> Result<PooledStream, PoolError> {
        let bundle = self.ca.bundle();
        let expected = key.dst.clone();
        timeout(
            WAIT,
            pool.stream(
                key.clone(),
                dst,
                dialer,
                || client_config(cert, &bundle, expected.clone()).map(Arc::new),
                self.echo,
                HeaderMap::new(),
            ),
        )
        .await
        .unwrap()
    }

    async fn stream(&self, pool: &HbonePool, key: &PoolKey, dst: SocketAddr) -> PooledStream {
        self.stream_with(pool, &self.client, key, dst)
            .await
            .unwrap()
    }
}

async fn echo_ok(stream: PooledStream, seed: u8) {
    let data: Vec<u8> = (0..10_000).map(|i| (i as u8).wrapping_mul(seed)).collect();
    assert_eq!(roundtrip(stream, data.clone()).await, data);
}

/// Polls `cond` every 10 ms until it holds, failing after `WAIT`.
async fn eventually(mut cond: impl FnMut() -> bool) {
    timeout(WAIT, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("condition not reached in time");
}

#[tokio::test]
async fn sequential_streams_reuse_one_connection() {
    let m = Mesh::new().await;
    let server_id = id("server");
    let server = m.server(&server_id, any_port()).await;
    let key = m.key(&server_id, &server);
    let pool = HbonePool::default();

    let s = m.stream(&pool, &key, server.addr).await;
    assert_eq!(pool.stats().key(&key).active_streams, 1);
    echo_ok(s, 3).await;
    assert_eq!(pool.stats().key(&key).active_streams, 0);

    echo_ok(m.stream(&pool, &key, server.addr).await, 5).await;
    assert_eq!(server.accepts.load(Ordering::SeqCst), 1);
    assert_eq!(
        pool.stats().key(&key),
        KeyStats {
            connections: 1,
            active_streams: 0
        }
    );
}

#[tokio::test]
async fn concurrent_streams_respect_the_per_connection_limit() {
    let m = Mesh::new().await;
    let server_id = id("server");
    let server = m.server(&server_id, any_port()).await;
    let key = m.key(&server_id, &server);
    let pool = HbonePool::new(PoolConfig {
        max_streams_per_conn: 8,
        ..PoolConfig::default()
    });

    let streams =
        futures::future::join_all((0..20).map(|_| m.stream(&pool, &key, server.addr))).await;
    assert_eq!(
        pool.stats().key(&key),
        KeyStats {
            connections: 3,
            active_streams: 20
        }
    );
    assert_eq!(server.accepts.load(Ordering::SeqCst), 3);

    futures::future::join_all(
        streams
            .into_iter()
            .enumerate()
            .map(|(i, s)| echo_ok(s, i as u8 + 1)),
    )
    .await;
    assert_eq!(pool.stats().key(&key).active_streams, 0);
    assert_eq!(server.accepts.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn different_identities_get_separate_connections() {
    let m = Mesh::new().await;
    let (a_id, b_id) = (id("server-a"), id("server-b"));
    let a = m.server(&a_id, any_port()).await;
    let b = m.server(&b_id, any_port()).await;
    let pool = HbonePool::default();

    let key_a = m.key(&a_id, &a);
    let key_b = m.key(&b_id, &b);
    // Same IP, different destination identity: never shared.
    assert_eq!(key_a.dst_ip, key_b.dst_ip);
    let sa = m.stream(&pool, &key_a, a.addr).await;
    let sb = m.stream(&pool, &key_b, b.addr).await;

    // Same destination, different source identity: never shared either.
    let other_src = m.ca.issue(&id("other-client"));
    let key_a2 = PoolKey {
        src: other_src.identity.clone(),
        ..key_a.clone()
    };
    let sa2 = m
        .stream_with(&pool, &other_src, &key_a2, a.addr)
        .await
        .unwrap();

    let stats = pool.stats();
    assert_eq!(stats.connections(), 3);
    assert_eq!(stats.active_streams(), 3);
    for key in [&key_a, &key_b, &key_a2] {
        assert_eq!(stats.key(key).connections, 1);
    }
    assert_eq!(a.accepts.load(Ordering::SeqCst), 2);
    assert_eq!(b.accepts.load(Ordering::SeqCst), 1);

    echo_ok(sa, 1).await;
    echo_ok(sb, 2).await;
    echo_ok(sa2, 3).await;
}

#[tokio::test]
async fn a_connection_whose_server_went_away_is_not_reused() {
    let m = Mesh::new().await;
    let server_id = id("server");
    let server = m.server(&server_id, any_port()).await;
    let addr = server.addr;
    let key = m.key(&server_id, &server);
    let pool = HbonePool::default();

    echo_ok(m.stream(&pool, &key, addr).await, 7).await;
    assert_eq!(pool.stats().key(&key).connections, 1);

    server.stop().await;
    // Nobody listens now: the dial fails, no connection is handed out.
    let err = m
        .stream_with(&pool, &m.client, &key, addr)
        .await
        .unwrap_err();
    assert!(
        matches!(err, PoolError::Connect { .. }),
        "unexpected error: {err}"
    );

    let restarted = m.server(&server_id, addr).await;
    echo_ok(m.stream(&pool, &key, addr).await, 9).await;
    assert_eq!(restarted.accepts.load(Ordering::SeqCst), 1);
    assert_eq!(pool.stats().key(&key).connections, 1);
}

#[tokio::test]
async fn a_broken_pooled_connection_is_replaced_on_the_next_stream() {
    let m = Mesh::new().await;
    let server_id = id("server");
    let server = m.server(&server_id, any_port()).await;
    let addr = server.addr;
    let key = m.key(&server_id, &server);
    let pool = HbonePool::default();

    echo_ok(m.stream(&pool, &key, addr).await, 7).await;
    server.stop().await;
    let restarted = m.server(&server_id, addr).await;

    // Whether or not the pool noticed the close yet, the stream succeeds on
    // a new connection to the restarted server.
    echo_ok(m.stream(&pool, &key, addr).await, 9).await;
    assert_eq!(restarted.accepts.load(Ordering::SeqCst), 1);
    assert_eq!(pool.stats().key(&key).connections, 1);
}

#[tokio::test]
async fn idle_connections_are_closed_after_the_idle_timeout() {
    let m = Mesh::new().await;
    let server_id = id("server");
    let mut server = m.server(&server_id, any_port()).await;
    let key = m.key(&server_id, &server);
    let pool = HbonePool::new(PoolConfig {
        idle_timeout: Duration::from_millis(200),
        ..PoolConfig::default()
    });

    // An active stream keeps its connection beyond the idle timeout.
    let s = m.stream(&pool, &key, server.addr).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(pool.stats().key(&key).connections, 1);
    echo_ok(s, 11).await;

    // Once idle, the reaper drops it and the server sees the close.
    eventually(|| pool.stats().connections() == 0).await;
    let outcome = timeout(WAIT, server.closed.recv()).await.unwrap().unwrap();
    assert!(outcome.is_ok(), "{outcome:?}");

    // The next stream dials again.
    echo_ok(m.stream(&pool, &key, server.addr).await, 13).await;
    assert_eq!(server.accepts.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn dial_address_must_match_the_key() {
    let m = Mesh::new().await;
    let server_id = id("server");
    let server = m.server(&server_id, any_port()).await;
    let mut key = m.key(&server_id, &server);
    key.dst_ip = "127.0.0.2".parse().unwrap();
    let err = m
        .stream_with(&HbonePool::default(), &m.client, &key, server.addr)
        .await
        .unwrap_err();
    assert!(matches!(err, PoolError::AddressMismatch { .. }), "{err}");
    assert_eq!(server.accepts.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn two_concurrent_streams_spread_over_two_connections() {
    let m = Mesh::new().await;
    let server_id = id("server");
    let server = m.server(&server_id, any_port()).await;
    let key = m.key(&server_id, &server);
    let pool = HbonePool::default();

    // The second concurrent stream gets its own connection (its own TLS
    // session, so its own worker thread); the third shares the less busy one.
    let s1 = m.stream(&pool, &key, server.addr).await;
    let s2 = m.stream(&pool, &key, server.addr).await;
    assert_eq!(server.accepts.load(Ordering::SeqCst), 2);
    let s3 = m.stream(&pool, &key, server.addr).await;
    assert_eq!(
        pool.stats().key(&key),
        KeyStats {
            connections: 2,
            active_streams: 3
        }
    );
    assert_eq!(server.accepts.load(Ordering::SeqCst), 2);
    futures::future::join3(echo_ok(s1, 1), echo_ok(s2, 2), echo_ok(s3, 3)).await;

    // With spreading off, concurrent streams share one connection.
    let unspread = HbonePool::new(PoolConfig {
        spread_connections: 1,
        ..PoolConfig::default()
    });
    let other = m.server(&server_id, any_port()).await;
    let other_key = m.key(&server_id, &other);
    let a = m.stream(&unspread, &other_key, other.addr).await;
    let b = m.stream(&unspread, &other_key, other.addr).await;
    assert_eq!(unspread.stats().key(&other_key).connections, 1);
    futures::future::join(echo_ok(a, 4), echo_ok(b, 5)).await;
    assert_eq!(other.accepts.load(Ordering::SeqCst), 1);
}

/// Dials the first time, refuses every later dial.
struct OneDial(AtomicUsize);

impl Dialer for OneDial {
    fn dial(&self, dst: SocketAddr) -> DialFuture {
        let first = self.0.fetch_add(1, Ordering::SeqCst) == 0;
        Box::pin(async move {
            if first {
                TcpStream::connect(dst).await
            } else {
                Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionRefused,
                    "test refuses later dials",
                ))
            }
        })
    }
}

#[tokio::test]
async fn a_failed_spreading_dial_shares_the_busy_connection() {
    let m = Mesh::new().await;
    let server_id = id("server");
    let server = m.server(&server_id, any_port()).await;
    let key = m.key(&server_id, &server);
    let pool = HbonePool::default();
    let dialer = OneDial(AtomicUsize::new(0));
    let stream = || m.stream_via(&pool, &dialer, &m.client, &key, server.addr);

    let s1 = stream().await.unwrap();
    // The extra connection cannot be dialed: the stream shares the first
    // one instead of failing, and the key stops trying for a while.
    let s2 = stream().await.unwrap();
    let s3 = stream().await.unwrap();
    assert_eq!(dialer.0.load(Ordering::SeqCst), 2);
    assert_eq!(
        pool.stats().key(&key),
        KeyStats {
            connections: 1,
            active_streams: 3
        }
    );
    futures::future::join3(echo_ok(s1, 1), echo_ok(s2, 2), echo_ok(s3, 3)).await;
}
