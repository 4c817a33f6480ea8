//! A pool of outbound HBONE connections, keyed by [`PoolKey`] (source
//! identity, destination identity, destination IP), each shared by many
//! `CONNECT` streams.
//!
//! * [`HbonePool::stream`] reuses the usable connection of the key with the
//!   fewest active streams (below [`PoolConfig::max_streams_per_conn`]), or
//!   dials a new one. While a key has fewer than
//!   [`PoolConfig::spread_connections`] connections, a stream that would
//!   share a busy connection gets a new one instead (falling back to the busy
//!   one if that dial fails): each connection is one TLS session driven by
//!   one task, so parallel flows to a peer spread over the worker threads.
//!   Concurrent requests that find no free connection for a key coalesce:
//!   a per-key async mutex is held only around the dial, and whoever waited
//!   on it looks at the pool again before dialing itself. A waiter whose key
//!   saw a dial fail while it waited fails fast with
//!   [`PoolError::PeerUnavailable`] instead of dialing again.
//! * A stream slot is reserved (under a short std mutex) before the
//!   `CONNECT` is sent and released when the returned [`PooledStream`] is
//!   dropped, so the per-connection limit holds even under bursts.
//! * Connections whose [`HboneConnection::is_usable`] is false are never
//!   handed out and are dropped from the pool. If a stream fails on a
//!   *reused* connection that turns out to be broken (the peer went away
//!   before we noticed), the request is retried once on a fresh dial.
//! * A reaper task (started with the first connection, ends with the pool)
//!   closes connections that have had no active stream for
//!   [`PoolConfig::idle_timeout`]: dropping the pool's handle ends the
//!   connection once no stream uses it.
//!
//! No lock is held across an await except the per-key dial mutex.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper::http::HeaderMap;
use rustls::ClientConfig;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::client::{ClientError, ClientTimeouts, HboneClient, HboneConnection};
use super::stream::H2Stream;
use super::tls::TlsError;
use crate::copy::ChunkIo;
use crate::identity::Identity;

/// Default most concurrent streams per pooled connection.
pub const DEFAULT_MAX_STREAMS_PER_CONN: usize = 100;
/// Default number of connections per key that parallel streams spread over
/// (ztunnel runs two worker threads).
pub const DEFAULT_SPREAD_CONNECTIONS: usize = 2;
/// How long a key stops spreading after a spreading dial failed.
const SPREAD_PAUSE: Duration = Duration::from_secs(30);
/// Default time an unused connection stays in the pool.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default bound on the TCP connect of a dial (TLS and HTTP/2 handshakes
/// have their own bound, [`super::HANDSHAKE_TIMEOUT`]).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What pooled connections are shared by: streams with equal keys may use
/// the same connection, streams with different keys never do.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    /// The identity whose certificate the connection presents.
    pub src: Identity,
    /// The identity the peer must prove.
    pub dst: Identity,
    /// The peer's IP (its :15008 is dialed).
    pub dst_ip: IpAddr,
    /// The source address the connection is dialed from (the source pod's
    /// IP): the peer sees it as the client's address, so two pods never
    /// share a connection even when they share an identity. `None` when
    /// the dialer does not pin a source.
    pub src_ip: Option<IpAddr>,
}

/// Boxed future of a [`Dialer`].
pub type DialFuture = Pin<Box<dyn Future<Output = io::Result<TcpStream>> + Send>>;

/// Makes the TCP connection under a new pooled HBONE connection: the seam
/// that lets the data path dial from inside a pod's network namespace (with
/// ztunnel's mark) and tests dial from the current one.
pub trait Dialer: Send + Sync {
    /// Connects to `dst`.
    fn dial(&self, dst: SocketAddr) -> DialFuture;
}

/// Dials from the current network namespace, unmarked.
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpDialer;

impl Dialer for TcpDialer {
    fn dial(&self, dst: SocketAddr) -> DialFuture {
        Box::pin(TcpStream::connect(dst))
    }
}

/// Tuning of an [`HbonePool`].
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Most active streams on one connection before another is dialed.
    pub max_streams_per_conn: usize,
    /// Connections per key that concurrent streams spread over before any
    /// connection carries two streams; 1 turns spreading off.
    pub spread_connections: usize,
    /// How long a connection with no active stream is kept.
    pub idle_timeout: Duration,
    /// Bound on the TCP connect of a dial.
    pub connect_timeout: Duration,
    /// Handshake, stream-slot and CONNECT-response bounds and the HTTP/2
    /// keepalive of every connection.
    pub timeouts: ClientTimeouts,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            max_streams_per_conn: DEFAULT_MAX_STREAMS_PER_CONN,
            spread_connections: DEFAULT_SPREAD_CONNECTIONS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            timeouts: ClientTimeouts::default(),
        }
    }
}

/// Errors of [`HbonePool::stream`].
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The address to dial is not the key's destination IP.
    #[error("HBONE dial address {dst} does not match the pool key's destination IP {key_ip}")]
    AddressMismatch {
        /// The address asked for.
        dst: SocketAddr,
        /// The key's IP.
        key_ip: IpAddr,
    },
    /// The TLS config for a new connection could not be built.
    #[error("cannot build the TLS config for HBONE peer {dst}: {source}")]
    Config {
        /// The peer's address.
        dst: SocketAddr,
        /// Why.
        #[source]
        source: TlsError,
    },
    /// The TCP connect failed.
    #[error("TCP connect to HBONE peer {dst} failed: {source}")]
    Connect {
        /// The peer's address.
        dst: SocketAddr,
        /// The socket error.
        #[source]
        source: io::Error,
    },
    /// The TCP connect took too long.
    #[error("TCP connect to HBONE peer {dst} did not complete within {timeout:?}")]
    ConnectTimeout {
        /// The peer's address.
        dst: SocketAddr,
        /// The bound that expired.
        timeout: Duration,
    },
    /// The peer proved another identity than the key's destination (the
    /// TLS config did not pin `key.dst`).
    #[error("HBONE peer {dst} is {actual}, but the pool key expects {expected}")]
    PeerIdentity {
        /// The peer's address.
        dst: SocketAddr,
        /// The key's destination identity.
        expected: Identity,
        /// What the peer proved.
        actual: Identity,
    },
    /// Another request's dial for the same key failed while this one waited.
    #[error("a concurrent dial to HBONE peer {dst} just failed; not retrying at once")]
    PeerUnavailable {
        /// The peer's address.
        dst: SocketAddr,
    },
    /// The handshakes or the `CONNECT` failed.
    #[error(transparent)]
    Client(#[from] ClientError),
}

/// Per-key counts, see [`HbonePool::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyStats {
    /// Pooled connections.
    pub connections: usize,
    /// Streams open on them.
    pub active_streams: usize,
}

/// A snapshot of the pool.
#[derive(Debug, Clone, Default)]
pub struct PoolStats {
    /// Keys with at least one pooled connection.
    pub keys: HashMap<PoolKey, KeyStats>,
}

impl PoolStats {
    /// Counts for `key` (zero if it has no connection).
    pub fn key(&self, key: &PoolKey) -> KeyStats {
        self.keys.get(key).copied().unwrap_or_default()
    }

    /// Pooled connections over all keys.
    pub fn connections(&self) -> usize {
        self.keys.values().map(|k| k.connections).sum()
    }

    /// Active streams over all keys.
    pub fn active_streams(&self) -> usize {
        self.keys.values().map(|k| k.active_streams).sum()
    }
}

/// One pooled connection and its stream count.
struct Slot {
    id: u64,
    conn: HboneConnection,
    active: AtomicUsize,
    /// When the last stream ended (or the connection was made).
    last_active: Mutex<Instant>,
}

impl Slot {
    fn idle_for(&self, now: Instant) -> Option<Duration> {
        if self.active.load(Ordering::SeqCst) != 0 {
            return None;
        }
        Some(now.saturating_duration_since(*lock(&self.last_active)))
    }
}

#[derive(Default)]
struct KeyEntry {
    conns: Vec<Arc<Slot>>,
    /// Held only while dialing, so concurrent first requests coalesce.
    dial: Arc<tokio::sync::Mutex<()>>,
    /// Dials of this key that failed so far.
    failed_dials: u64,
    /// No spreading dials before this (one failed).
    spread_paused_until: Option<Instant>,
}

struct Inner {
    config: PoolConfig,
    keys: Mutex<HashMap<PoolKey, KeyEntry>>,
    next_id: AtomicU64,
    reaper_started: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A stream slot on a pooled connection, released on drop.
struct Lease {
    slot: Arc<Slot>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Stamp first, then release: the reaper sees a fresh stamp whenever
        // it sees the count reach zero.
        *lock(&self.slot.last_active) = Instant::now();
        self.slot.active.fetch_sub(1, Ordering::SeqCst);
    }
}

enum Reserve {
    Got(Lease),
    /// No free slot: dial under this lock; `failed_dials` as seen now.
    Dial(Arc<tokio::sync::Mutex<()>>, u64),
    /// Every connection is busy and the key may spread: dial another under
    /// this lock; `failed_dials` as seen now.
    Spread(Arc<tokio::sync::Mutex<()>>, u64),
}

/// A `CONNECT` stream from the pool: an [`H2Stream`] that frees its slot
/// on its connection when dropped.
pub struct PooledStream {
    stream: H2Stream,
    _lease: Lease,
}

impl std::fmt::Debug for PooledStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledStream")
            .field("stream", &self.stream)
            .field("connection", &self._lease.slot.id)
            .finish()
    }
}

impl PooledStream {
    /// The underlying stream, e.g. to [`H2Stream::reset`] it.
    pub fn get_mut(&mut self) -> &mut H2Stream {
        &mut self.stream
    }
}

impl AsyncRead for PooledStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for PooledStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl ChunkIo for PooledStream {
    fn poll_read_chunk(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
        want: usize,
    ) -> Poll<io::Result<Bytes>> {
        self.stream.poll_read_chunk(cx, buf, want)
    }

    fn poll_write_chunk(
        &mut self,
        cx: &mut Context<'_>,
        chunk: &mut Bytes,
    ) -> Poll<io::Result<usize>> {
        self.stream.poll_write_chunk(cx, chunk)
    }
}

/// Outbound HBONE connections shared by streams. Clones share the pool.
#[derive(Clone)]
pub struct HbonePool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for HbonePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HbonePool")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl Default for HbonePool {
    fn default() -> Self {
        Self::new(PoolConfig::default())
    }
}

impl HbonePool {
    /// An empty pool. A `max_streams_per_conn` of 0 is taken as 1.
    pub fn new(mut config: PoolConfig) -> Self {
        config.max_streams_per_conn = config.max_streams_per_conn.max(1);
        Self {
            inner: Arc::new(Inner {
                config,
                keys: Mutex::new(HashMap::new()),
                next_id: AtomicU64::new(0),
                reaper_started: AtomicBool::new(false),
            }),
        }
    }

    /// Opens `CONNECT target` (with `headers`) on a connection of `key`,
    /// dialing `dst` (the peer's ip:15008, `dst.ip()` must be
    /// `key.dst_ip`) if no pooled connection has a free slot. `make_config`
    /// is called only when dialing; its config must pin `key.dst`.
    pub async fn stream<F>(
        &self,
        key: PoolKey,
        dst: SocketAddr,
        dialer: &dyn Dialer,
        mut make_config: F,
        target: SocketAddr,
        mut headers: HeaderMap,
    ) -> Result<PooledStream, PoolError>
    where
        F: FnMut() -> Result<Arc<ClientConfig>, TlsError>,
    {
        if dst.ip() != key.dst_ip {
            return Err(PoolError::AddressMismatch {
                dst,
                key_ip: key.dst_ip,
            });
        }
        let mut may_retry = true;
        loop {
            let (lease, reused) = self.checkout(&key, dst, dialer, &mut make_config).await?;
            let retry_possible = reused && may_retry;
            let h = if retry_possible {
                headers.clone()
            } else {
                std::mem::take(&mut headers)
            };
            let conn = lease.slot.conn.clone();
            match conn.connect_stream(target, h).await {
                Ok(stream) => {
                    return Ok(PooledStream {
                        stream,
                        _lease: lease,
                    });
                }
                Err(e) => {
                    let id = lease.slot.id;
                    drop(lease);
                    if conn.is_usable() {
                        return Err(e.into());
                    }
                    self.remove(&key, id);
                    if !retry_possible {
                        return Err(e.into());
                    }
                    tracing::debug!(%dst, error = %e, "pooled HBONE connection broke; redialing");
                    may_retry = false;
                }
            }
        }
    }

    /// Counts per key, for tests and debugging.
    pub fn stats(&self) -> PoolStats {
        let keys = lock(&self.inner.keys);
        PoolStats {
            keys: keys
                .iter()
                .filter(|(_, e)| !e.conns.is_empty())
                .map(|(k, e)| {
                    let stats = KeyStats {
                        connections: e.conns.len(),
                        active_streams: e
                            .conns
                            .iter()
                            .map(|s| s.active.load(Ordering::SeqCst))
                            .sum(),
                    };
                    (k.clone(), stats)
                })
                .collect(),
        }
    }

    /// Drops idle and broken connections now (the reaper does this
    /// periodically).
    pub fn reap(&self) {
        self.inner.reap();
    }

    /// A free slot on a usable connection of `key`, or a fresh connection.
    /// The bool says whether the connection was already pooled.
    async fn checkout<F>(
        &self,
        key: &PoolKey,
        dst: SocketAddr,
        dialer: &dyn Dialer,
        make_config: &mut F,
    ) -> Result<(Lease, bool), PoolError>
    where
        F: FnMut() -> Result<Arc<ClientConfig>, TlsError>,
    {
        let (dial, failed_before) = match self.try_reserve(key, true) {
            Reserve::Got(lease) => return Ok((lease, true)),
            Reserve::Dial(dial, failed) | Reserve::Spread(dial, failed) => (dial, failed),
        };
        let _dialing = dial.lock().await;
        let spreading = match self.try_reserve(key, true) {
            Reserve::Got(lease) => return Ok((lease, true)),
            Reserve::Dial(_, failed) if failed != failed_before => {
                return Err(PoolError::PeerUnavailable { dst });
            }
            Reserve::Dial(..) => false,
            Reserve::Spread(..) => true,
        };
        match self.dial(key, dst, dialer, make_config).await {
            Ok(conn) => Ok((self.insert(key, conn), false)),
            Err(e) if spreading => {
                // The busy connections still work: use one, and stop
                // spreading this key for a while.
                tracing::debug!(%dst, error = %e, "extra HBONE connection failed; sharing a busy one");
                lock(&self.inner.keys)
                    .entry(key.clone())
                    .or_default()
                    .spread_paused_until = Some(Instant::now() + SPREAD_PAUSE);
                match self.try_reserve(key, false) {
                    Reserve::Got(lease) => Ok((lease, true)),
                    _ => Err(e),
                }
            }
            Err(e) => {
                lock(&self.inner.keys)
                    .entry(key.clone())
                    .or_default()
                    .failed_dials += 1;
                Err(e)
            }
        }
    }

    /// Reserves a slot on the least busy usable connection of `key`, or
    /// says to dial; with `spread`, says to dial another connection rather
    /// than share a busy one while the key may spread.
    fn try_reserve(&self, key: &PoolKey, spread: bool) -> Reserve {
        let mut broken = Vec::new();
        let reserve = {
            let mut keys = lock(&self.inner.keys);
            let entry = keys.entry(key.clone()).or_default();
            let mut i = 0;
            while i < entry.conns.len() {
                if entry.conns[i].conn.is_usable() {
                    i += 1;
                } else {
                    broken.push(entry.conns.swap_remove(i));
                }
            }
            let max = self.inner.config.max_streams_per_conn;
            let may_spread = spread
                && entry.conns.len() < self.inner.config.spread_connections
                && entry
                    .spread_paused_until
                    .is_none_or(|t| Instant::now() >= t);
            let least = entry
                .conns
                .iter()
                .map(|s| (s.active.load(Ordering::SeqCst), s))
                .filter(|(active, _)| *active < max)
                .min_by_key(|(active, _)| *active);
            match least {
                Some((active, _)) if active > 0 && may_spread => {
                    Reserve::Spread(entry.dial.clone(), entry.failed_dials)
                }
                Some((_, slot)) => {
                    slot.active.fetch_add(1, Ordering::SeqCst);
                    Reserve::Got(Lease { slot: slot.clone() })
                }
                None => Reserve::Dial(entry.dial.clone(), entry.failed_dials),
            }
        };
        // Connections are closed outside the lock.
        drop(broken);
        reserve
    }

    async fn dial<F>(
        &self,
        key: &PoolKey,
        dst: SocketAddr,
        dialer: &dyn Dialer,
        make_config: &mut F,
    ) -> Result<HboneConnection, PoolError>
    where
        F: FnMut() -> Result<Arc<ClientConfig>, TlsError>,
    {
        let config = make_config().map_err(|source| PoolError::Config { dst, source })?;
        let timeout = self.inner.config.connect_timeout;
        let tcp = tokio::time::timeout(timeout, dialer.dial(dst))
            .await
            .map_err(|_| PoolError::ConnectTimeout { dst, timeout })?
            .map_err(|source| PoolError::Connect { dst, source })?;
        let conn = HboneClient::connect_with(tcp, config, self.inner.config.timeouts).await?;
        if conn.peer_identity() != &key.dst {
            return Err(PoolError::PeerIdentity {
                dst,
                expected: key.dst.clone(),
                actual: conn.peer_identity().clone(),
            });
        }
        tracing::debug!(%dst, src = %key.src, dst_identity = %key.dst, "new pooled HBONE connection");
        Ok(conn)
    }

    /// Pools `conn` with one slot already taken by the returned lease.
    fn insert(&self, key: &PoolKey, conn: HboneConnection) -> Lease {
        let slot = Arc::new(Slot {
            id: self.inner.next_id.fetch_add(1, Ordering::Relaxed),
            conn,
            active: AtomicUsize::new(1),
            last_active: Mutex::new(Instant::now()),
        });
        lock(&self.inner.keys)
            .entry(key.clone())
            .or_default()
            .conns
            .push(slot.clone());
        self.start_reaper();
        Lease { slot }
    }

    fn remove(&self, key: &PoolKey, id: u64) {
        let removed = {
            let mut keys = lock(&self.inner.keys);
            keys.get_mut(key).and_then(|entry| {
                let i = entry.conns.iter().position(|s| s.id == id)?;
                Some(entry.conns.swap_remove(i))
            })
        };
        drop(removed);
    }

    /// Starts the idle reaper once; it holds the pool weakly and ends with it.
    fn start_reaper(&self) {
        if self.inner.reaper_started.swap(true, Ordering::AcqRel) {
            return;
        }
        let period = (self.inner.config.idle_timeout / 4)
            .clamp(Duration::from_millis(10), Duration::from_secs(5));
        let inner = Arc::downgrade(&self.inner);
        tokio::spawn(reap_loop(inner, period));
    }
}

async fn reap_loop(inner: Weak<Inner>, period: Duration) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        inner.reap();
    }
}

impl Inner {
    fn reap(&self) {
        let now = Instant::now();
        let idle_timeout = self.config.idle_timeout;
        let mut removed = Vec::new();
        {
            let mut keys = lock(&self.keys);
            keys.retain(|_, entry| {
                let mut i = 0;
                while i < entry.conns.len() {
                    let slot = &entry.conns[i];
                    let idle = slot.idle_for(now).is_some_and(|d| d >= idle_timeout);
                    if idle || !slot.conn.is_usable() {
                        removed.push(entry.conns.swap_remove(i));
                    } else {
                        i += 1;
                    }
                }
                // Keep an entry while anyone holds or waits on its dial lock.
                !entry.conns.is_empty() || Arc::strong_count(&entry.dial) > 1
            });
        }
        if !removed.is_empty() {
            tracing::debug!(
                connections = removed.len(),
                "closing idle or broken HBONE connections"
            );
        }
        drop(removed);
    }
}

impl HbonePool {
    /// Drops the pool's handle on every connection whose source identity
    /// `gone` says has left (e.g. its last pod left the node), so no idle
    /// connection keeps presenting it; streams still running keep their
    /// connection until they end. Returns how many connections were dropped.
    pub fn evict_sources(&self, gone: impl Fn(&Identity) -> bool) -> usize {
        let removed: Vec<KeyEntry> = {
            let mut keys = lock(&self.inner.keys);
            let stale: Vec<PoolKey> = keys.keys().filter(|k| gone(&k.src)).cloned().collect();
            stale.iter().filter_map(|k| keys.remove(k)).collect()
        };
        // Dropped outside the lock.
        removed.iter().map(|e| e.conns.len()).sum()
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
