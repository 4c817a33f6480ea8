//! TLS for the production gRPC endpoint (15012): a TCP listener whose
//! connections are TLS-terminated with the CA-issued serving certificate
//! and handed to tonic as a stream.
//!
//! A client certificate is optional; when one was presented (and verified
//! against the mesh's roots by rustls) its SPIFFE identity travels with the
//! connection ([`TlsPeer`]) so the services can authenticate the caller by
//! it. A connection is *unauthenticated* from its accept until a request on
//! it authenticates ([`mark_authenticated`], called by
//! `ca::authenticate_grpc`): its TLS handshake must finish within
//! [`HANDSHAKE_TIMEOUT`] and its first authenticated request come within
//! [`AUTH_DEADLINE`] after that, or it is closed. A source address may have
//! at most [`MAX_HANDSHAKES_PER_SOURCE`] unauthenticated connections and the
//! listener [`MAX_HANDSHAKES`] in all: a flood of idle connections — silent
//! TCP, a stalled handshake, or a finished handshake with nothing after it —
//! cannot grow without bound. When the listener is full, a newcomer from a
//! source holding fewer than the busiest source evicts that source's oldest
//! unauthenticated connection, so a flood from many addresses cannot lock
//! out a proxy that connects once.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::debug;

/// A client that has not finished its TLS handshake by then is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection with no authenticated request this long after its
/// handshake is closed (a proxy sends its first xDS or CA request at once).
pub const AUTH_DEADLINE: Duration = Duration::from_secs(10);
/// Unauthenticated connections (handshaking, or handshaken and not yet
/// authenticated) from one source IP; more are closed at once.
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 64;
/// Unauthenticated connections on the listener; more are closed at once.
pub const MAX_HANDSHAKES: usize = 4096;

/// The listener's bounds (tests shorten them).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub handshake_timeout: Duration,
    pub auth_deadline: Duration,
    pub per_source: usize,
    pub total: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            handshake_timeout: HANDSHAKE_TIMEOUT,
            auth_deadline: AUTH_DEADLINE,
            per_source: MAX_HANDSHAKES_PER_SOURCE,
            total: MAX_HANDSHAKES,
        }
    }
}

/// Whether a request on the connection has authenticated; until one has,
/// the connection holds its place among the unauthenticated ones. Shared by
/// the connection and every request's [`TlsPeer`].
#[derive(Clone, Default)]
pub struct ConnAuth(Arc<ConnAuthState>);

#[derive(Default)]
struct ConnAuthState {
    authenticated: AtomicBool,
    slot: Mutex<Option<Admitted>>,
}

impl ConnAuth {
    fn holding(slot: Admitted) -> Self {
        let auth = Self::default();
        *auth.slot() = Some(slot);
        auth
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Admitted>> {
        self.0.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request on the connection authenticated: no deadline any more, and
    /// its place among the unauthenticated connections is free.
    pub fn mark(&self) {
        if !self.0.authenticated.swap(true, Ordering::AcqRel) {
            drop(self.slot().take());
        }
    }

    pub fn is_authenticated(&self) -> bool {
        self.0.authenticated.load(Ordering::Acquire)
    }
}

impl std::fmt::Debug for ConnAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnAuth")
            .field("authenticated", &self.is_authenticated())
            .finish()
    }
}

/// Who is on the other end of a TLS connection, as the services see it in
/// the request's extensions.
#[derive(Debug, Clone)]
pub struct TlsPeer {
    pub tcp: TcpConnectInfo,
    /// The SPIFFE identity of a verified client certificate.
    pub identity: Option<crate::ca::SpiffeId>,
    /// Whether a request on the connection has authenticated.
    pub auth: ConnAuth,
}

/// A TLS connection as tonic sees it. Reading fails with `TimedOut` once
/// its authentication deadline passed without an authenticated request, so
/// the server closes it.
pub struct TlsConnection {
    inner: TlsStream<TcpStream>,
    info: TlsPeer,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// While unauthenticated: set when the listener evicts it.
    eviction: Option<Arc<Eviction>>,
}

impl Connected for TlsConnection {
    type ConnectInfo = TlsPeer;

    fn connect_info(&self) -> TlsPeer {
        self.info.clone()
    }
}

/// The client address of a request on either gRPC listener.
pub fn remote_addr<T>(req: &tonic::Request<T>) -> Option<SocketAddr> {
    req.remote_addr()
        .or_else(|| req.extensions().get::<TlsPeer>()?.tcp.remote_addr)
}

/// Records that `req` authenticated: its connection (on the TLS listener)
/// no longer has a deadline nor counts as unauthenticated.
pub fn mark_authenticated<T>(req: &tonic::Request<T>) {
    if let Some(peer) = req.extensions().get::<TlsPeer>() {
        peer.auth.mark();
    }
}

/// The verified client-certificate identity of a request on the TLS listener.
pub fn peer_identity<T>(req: &tonic::Request<T>) -> Option<&crate::ca::SpiffeId> {
    req.extensions().get::<TlsPeer>()?.identity.as_ref()
}

/// Unauthenticated connections, per source IP (oldest first) and in all.
#[derive(Default)]
struct InFlight {
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    by_source: HashMap<IpAddr, VecDeque<(u64, Arc<Eviction>)>>,
    total: usize,
    next_id: u64,
}

/// Set when the listener closes an unauthenticated connection to make room
/// for one from a source holding fewer.
#[derive(Default)]
struct Eviction {
    evicted: AtomicBool,
    waker: AtomicWaker,
}

impl Eviction {
    fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Whether evicted; else wakes `cx` when it is.
    fn poll_evicted(&self, cx: &mut Context<'_>) -> bool {
        self.waker.register(cx.waker());
        self.evicted.load(Ordering::Acquire)
    }
}

/// One admitted connection; releases its place when dropped.
struct Admitted {
    table: Arc<InFlight>,
    ip: IpAddr,
    id: u64,
    eviction: Arc<Eviction>,
}

/// What [`InFlight::admit`] decided.
enum Admission {
    Admitted(Admitted),
    /// Admitted after evicting the oldest connection of `from`.
    Evicted(Admitted, IpAddr),
    Refused,
}

impl InFlight {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Admits a connection from `ip` unless its source is at
    /// `limits.per_source`. When the listener is at `limits.total`, makes
    /// room by evicting the oldest connection of the source holding the
    /// most — only if that source holds more than `ip` does — so a flood
    /// from many addresses cannot lock out a source that holds few (a
    /// proxy connecting once).
    fn admit(self: &Arc<Self>, ip: IpAddr, limits: &Limits) -> Admission {
        let mut t = self.lock();
        let held = t.by_source.get(&ip).map_or(0, VecDeque::len);
        if held >= limits.per_source {
            return Admission::Refused;
        }
        let mut evicted = None;
        if t.total >= limits.total {
            let busiest = t
                .by_source
                .iter()
                .map(|(ip, q)| (*ip, q.len()))
                .max_by_key(|(_, n)| *n);
            match busiest {
                Some((victim, n)) if n > held => {
                    if let Some(q) = t.by_source.get_mut(&victim) {
                        if let Some((_, e)) = q.pop_front() {
                            e.evict();
                        }
                        if q.is_empty() {
                            t.by_source.remove(&victim);
                        }
                    }
                    t.total = t.total.saturating_sub(1);
                    evicted = Some(victim);
                }
                _ => return Admission::Refused,
            }
        }
        let id = t.next_id;
        t.next_id += 1;
        let eviction = Arc::new(Eviction::default());
        t.by_source
            .entry(ip)
            .or_default()
            .push_back((id, eviction.clone()));
        t.total += 1;
        let admitted = Admitted {
            table: self.clone(),
            ip,
            id,
            eviction,
        };
        match evicted {
            Some(from) => Admission::Evicted(admitted, from),
            None => Admission::Admitted(admitted),
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut t = self.table.lock();
        let Some(q) = t.by_source.get_mut(&self.ip) else {
            return;
        };
        // Absent when it was evicted (already uncounted).
        if let Some(pos) = q.iter().position(|(id, _)| *id == self.id) {
            q.remove(pos);
            let empty = q.is_empty();
            if empty {
                t.by_source.remove(&self.ip);
            }
            t.total = t.total.saturating_sub(1);
        }
    }
}

impl AsyncRead for TlsConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.deadline.is_some() {
            if self.info.auth.is_authenticated() {
                self.deadline = None;
                self.eviction = None;
            } else if self.eviction.as_ref().is_some_and(|e| e.poll_evicted(cx)) {
                debug!(peer = ?self.info.tcp.remote_addr, "unauthenticated gRPC TLS connection evicted to make room for another source");
                return Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "evicted: too many unauthenticated connections",
                )));
            } else if let Some(d) = self.deadline.as_mut()
                && d.as_mut().poll(cx).is_ready()
            {
                debug!(peer = ?self.info.tcp.remote_addr, "no authenticated request on the gRPC TLS connection in time; closing it");
                return Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no authenticated request in time",
                )));
            }
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Accepts on `listener`, handshakes each connection in its own task (a slow
/// or broken client delays nobody) and yields the finished ones until
/// `shutdown` turns true; with the default [`Limits`].
pub fn incoming(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    shutdown: watch::Receiver<bool>,
) -> ReceiverStream<std::io::Result<TlsConnection>> {
    incoming_with(listener, config, shutdown, Limits::default())
}

/// [`incoming`] with the given bounds.
pub fn incoming_with(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    mut shutdown: watch::Receiver<bool>,
    limits: Limits,
) -> ReceiverStream<std::io::Result<TlsConnection>> {
    let (tx, rx) = mpsc::channel(64);
    let acceptor = TlsAcceptor::from(config);
    let local_addr = listener.local_addr().ok();
    let in_flight = Arc::new(InFlight::default());
    tokio::spawn(async move {
        let mut refused: u64 = 0;
        let mut evicted: u64 = 0;
        loop {
            let accepted = tokio::select! {
                r = listener.accept() => r,
                _ = shutdown.wait_for(|s| *s) => return,
            };
            let (tcp, peer) = match accepted {
                Ok(c) => c,
                Err(e) => {
                    debug!("TLS gRPC listener accept failed: {e}");
                    // E.g. out of file descriptors: do not spin.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            let admitted = match in_flight.admit(peer.ip(), &limits) {
                Admission::Admitted(a) => a,
                Admission::Evicted(a, from) => {
                    evicted += 1;
                    if evicted.is_power_of_two() {
                        tracing::warn!(%peer, %from, evicted, "too many unauthenticated TLS connections in all; closed the oldest of the source holding the most to admit this one");
                    }
                    a
                }
                Admission::Refused => {
                    refused += 1;
                    if refused.is_power_of_two() {
                        tracing::warn!(%peer, refused, "too many unauthenticated TLS connections from this source (or in all); closing new ones until some authenticate or time out");
                    }
                    continue;
                }
            };
            tokio::spawn(async move {
                let eviction = admitted.eviction.clone();
                let handshake =
                    tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp));
                let evicted = std::future::poll_fn(|cx| {
                    if eviction.poll_evicted(cx) {
                        Poll::Ready(())
                    } else {
                        Poll::Pending
                    }
                });
                let done = tokio::select! {
                    r = handshake => r,
                    () = evicted => {
                        debug!(%peer, "TLS handshake on the gRPC port evicted to make room for another source");
                        return;
                    }
                };
                match done {
                    Ok(Ok(inner)) => {
                        let identity = inner
                            .get_ref()
                            .1
                            .peer_certificates()
                            .and_then(|c| c.first())
                            .and_then(|leaf| crate::ca::spiffe_id_of(leaf).ok());
                        let info = TlsPeer {
                            tcp: TcpConnectInfo {
                                local_addr,
                                remote_addr: Some(peer),
                            },
                            identity,
                            // Holds the place until a request authenticates.
                            auth: ConnAuth::holding(admitted),
                        };
                        let deadline = Box::pin(tokio::time::sleep(limits.auth_deadline));
                        let conn = TlsConnection {
                            inner,
                            info,
                            deadline: Some(deadline),
                            eviction: Some(eviction),
                        };
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Ok(Err(e)) => debug!(%peer, "TLS handshake on the gRPC port failed: {e}"),
                    Err(_) => debug!(%peer, "TLS handshake on the gRPC port timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

#[cfg(test)]
#[path = "tls_listener_tests.rs"]
mod tests;
