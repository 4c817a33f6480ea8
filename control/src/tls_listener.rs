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
//! cannot grow without bound nor starve the others.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

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

/// Handshakes in flight, per source IP and in all.
#[derive(Default)]
struct InFlight {
    by_source: Mutex<HashMap<IpAddr, usize>>,
}

/// One admitted handshake; releases its place when dropped.
struct Admitted {
    table: Arc<InFlight>,
    ip: IpAddr,
}

impl InFlight {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, usize>> {
        self.by_source.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn admit(self: &Arc<Self>, ip: IpAddr, limits: &Limits) -> Option<Admitted> {
        let mut map = self.lock();
        let total: usize = map.values().sum();
        let n = map.entry(ip).or_default();
        if *n >= limits.per_source || total >= limits.total {
            return None;
        }
        *n += 1;
        Some(Admitted {
            table: self.clone(),
            ip,
        })
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut map = self.table.lock();
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
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
            let Some(admitted) = in_flight.admit(peer.ip(), &limits) else {
                refused += 1;
                if refused.is_power_of_two() {
                    tracing::warn!(%peer, refused, "too many TLS handshakes in flight from this source (or in all); closing new connections until they finish");
                }
                continue;
            };
            tokio::spawn(async move {
                match tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp)).await {
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
