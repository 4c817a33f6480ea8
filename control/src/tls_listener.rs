//! TLS for the production gRPC endpoint (15012): a TCP listener whose
//! connections are TLS-terminated with the CA-issued serving certificate
//! and handed to tonic as a stream.
//!
//! A client certificate is optional; when one was presented (and verified
//! against the mesh's roots by rustls) its SPIFFE identity travels with the
//! connection ([`TlsPeer`]) so the services can authenticate the caller by
//! it. A source address may have at most [`MAX_HANDSHAKES_PER_SOURCE`]
//! handshakes in flight and the listener [`MAX_HANDSHAKES`] in all: a flood
//! of idle connections from one host cannot starve the others.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tracing::debug;

/// A client that has not finished its TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in flight from one source IP; more are closed at once.
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 64;
/// Handshakes in flight on the listener; more are closed at once.
pub const MAX_HANDSHAKES: usize = 4096;

/// Who is on the other end of a TLS connection, as the services see it in
/// the request's extensions.
#[derive(Debug, Clone)]
pub struct TlsPeer {
    pub tcp: TcpConnectInfo,
    /// The SPIFFE identity of a verified client certificate.
    pub identity: Option<crate::ca::SpiffeId>,
}

/// A TLS connection as tonic sees it.
pub struct TlsConnection {
    inner: TlsStream<TcpStream>,
    info: TlsPeer,
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

    fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<Admitted> {
        let mut map = self.lock();
        let total: usize = map.values().sum();
        let n = map.entry(ip).or_default();
        if *n >= MAX_HANDSHAKES_PER_SOURCE || total >= MAX_HANDSHAKES {
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
/// `shutdown` turns true.
pub fn incoming(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    mut shutdown: watch::Receiver<bool>,
) -> ReceiverStream<std::io::Result<TlsConnection>> {
    let (tx, rx) = mpsc::channel(64);
    let acceptor = TlsAcceptor::from(config);
    let local_addr = listener.local_addr().ok();
    let in_flight = Arc::new(InFlight::default());
    tokio::spawn(async move {
        let mut refused: u64 = 0;
        loop {
            let (tcp, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        debug!("TLS gRPC listener accept failed: {e}");
                        continue;
                    }
                },
                _ = shutdown.wait_for(|s| *s) => return,
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            let Some(admitted) = in_flight.admit(peer.ip()) else {
                refused += 1;
                if refused.is_power_of_two() {
                    tracing::warn!(%peer, refused, "too many TLS handshakes in flight from this source (or in all); closing new connections until they finish");
                }
                continue;
            };
            tokio::spawn(async move {
                let _admitted = admitted;
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
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
                        };
                        let _ = tx.send(Ok(TlsConnection { inner, info })).await;
                    }
                    Ok(Err(e)) => debug!(%peer, "TLS handshake on the gRPC port failed: {e}"),
                    Err(_) => debug!(%peer, "TLS handshake on the gRPC port timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}
