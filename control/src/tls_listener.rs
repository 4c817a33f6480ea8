//! TLS for the production gRPC endpoint (15012): a TCP listener whose
//! connections are TLS-terminated with the CA-issued serving certificate
//! and handed to tonic as a stream.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

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

/// A TLS connection as tonic sees it.
pub struct TlsConnection {
    inner: TlsStream<TcpStream>,
    info: TcpConnectInfo,
}

impl Connected for TlsConnection {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.info.clone()
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
    tokio::spawn(async move {
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
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(inner)) => {
                        let info = TcpConnectInfo {
                            local_addr,
                            remote_addr: Some(peer),
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
