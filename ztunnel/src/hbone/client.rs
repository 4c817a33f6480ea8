//! The outbound end of HBONE: one mTLS + HTTP/2 connection to a peer's
//! :15008, carrying many concurrent `CONNECT` streams.
//!
//! [`HboneClient::connect`] does the handshakes; the returned
//! [`HboneConnection`] is cheap to clone and opens streams with
//! [`HboneConnection::connect_stream`]. A task per connection drives the
//! HTTP/2 I/O; it ends when the peer closes or every handle and stream is
//! dropped. [`HboneConnection::is_usable`] says whether new streams may be
//! opened on it (for the pool to come, see the module docs of `hbone`).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use hyper::http::{HeaderMap, Method, Request, StatusCode, Uri};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

use super::stream::H2Stream;
use super::tls::{ALPN_H2, TlsError, peer_identity, verification_error};
use super::{CONNECTION_WINDOW, HANDSHAKE_TIMEOUT, MAX_FRAME_SIZE, MAX_SEND_BUFFER, STREAM_WINDOW};
use crate::identity::Identity;

/// Errors of outbound HBONE connections and streams.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The socket is not connected.
    #[error("the TCP connection for HBONE is not connected: {0}")]
    PeerAddr(#[source] io::Error),
    /// The peer's certificate is valid but for the wrong workload.
    #[error("refusing HBONE peer {peer}: {source}")]
    PeerIdentity {
        /// The peer's address.
        peer: SocketAddr,
        /// What the verifier found.
        #[source]
        source: TlsError,
    },
    /// The TLS handshake failed for another reason (unknown CA, expired
    /// certificate, no client certificate accepted, not TLS 1.3, ...).
    #[error(
        "TLS handshake with HBONE peer {peer} failed: {source}; check that both sides trust the same mesh root"
    )]
    Tls {
        /// The peer's address.
        peer: SocketAddr,
        /// The TLS error.
        #[source]
        source: io::Error,
    },
    /// The peer did not agree to HTTP/2 (ALPN `h2`).
    #[error("HBONE peer {peer} did not negotiate ALPN h2; is port 15008 really an HBONE endpoint?")]
    NoH2 {
        /// The peer's address.
        peer: SocketAddr,
    },
    /// The handshakes took too long.
    #[error("handshake with HBONE peer {peer} did not complete within {timeout:?}")]
    HandshakeTimeout {
        /// The peer's address.
        peer: SocketAddr,
        /// The bound that expired.
        timeout: Duration,
    },
    /// The HTTP/2 handshake failed.
    #[error("HTTP/2 handshake with HBONE peer {peer} failed: {source}")]
    H2Handshake {
        /// The peer's address.
        peer: SocketAddr,
        /// The h2 error.
        #[source]
        source: h2::Error,
    },
    /// Opening the stream or reading its response failed.
    #[error("CONNECT {target} through HBONE peer {peer} failed: {source}")]
    Stream {
        /// The peer's address.
        peer: SocketAddr,
        /// The requested destination.
        target: SocketAddr,
        /// The h2 error.
        #[source]
        source: h2::Error,
    },
    /// The peer answered the CONNECT with something other than 200.
    #[error("HBONE peer {peer} ({identity}) refused CONNECT {target} with {status}{hint}")]
    Status {
        /// The peer's address.
        peer: SocketAddr,
        /// The peer's identity.
        identity: Identity,
        /// The requested destination.
        target: SocketAddr,
        /// The status the peer sent.
        status: StatusCode,
        /// A hint for operators, derived from the status.
        hint: &'static str,
    },
}

impl ClientError {
    /// The status the peer refused a CONNECT with, if that is the error.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            ClientError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// Opens HBONE connections.
#[derive(Debug, Clone, Copy)]
pub struct HboneClient;

impl HboneClient {
    /// TLS (with `config`, see [`super::client_config`]) and HTTP/2
    /// handshakes over a connected socket, bounded by
    /// [`HANDSHAKE_TIMEOUT`].
    pub async fn connect(
        tcp: TcpStream,
        config: Arc<rustls::ClientConfig>,
    ) -> Result<HboneConnection, ClientError> {
        Self::connect_with_timeout(tcp, config, HANDSHAKE_TIMEOUT).await
    }

    /// [`HboneClient::connect`] with another handshake bound.
    pub async fn connect_with_timeout(
        tcp: TcpStream,
        config: Arc<rustls::ClientConfig>,
        handshake_timeout: Duration,
    ) -> Result<HboneConnection, ClientError> {
        let peer = tcp.peer_addr().map_err(ClientError::PeerAddr)?;
        let _ = tcp.set_nodelay(true);
        let deadline = Instant::now() + handshake_timeout;
        let timed_out = |_| ClientError::HandshakeTimeout {
            peer,
            timeout: handshake_timeout,
        };

        // Peers are addressed by IP; the verifier checks the SPIFFE id instead.
        let server_name = ServerName::IpAddress(peer.ip().into());
        let tls = tokio::time::timeout_at(
            deadline,
            TlsConnector::from(config).connect(server_name, tcp),
        )
        .await
        .map_err(timed_out)?
        .map_err(|source| match verification_error(&source) {
            Some(tls) => ClientError::PeerIdentity { peer, source: tls },
            None => ClientError::Tls { peer, source },
        })?;
        let session = tls.get_ref().1;
        if session.alpn_protocol() != Some(ALPN_H2) {
            return Err(ClientError::NoH2 { peer });
        }
        // The verifier guarantees one SPIFFE URI SAN; this only reads it.
        let identity = peer_identity(session).ok_or_else(|| ClientError::PeerIdentity {
            peer,
            source: TlsError::UnreadablePeerCertificate("no SPIFFE identity".into()),
        })?;

        let (send_request, connection) = tokio::time::timeout_at(
            deadline,
            h2::client::Builder::new()
                .initial_window_size(STREAM_WINDOW)
                .initial_connection_window_size(CONNECTION_WINDOW)
                .max_frame_size(MAX_FRAME_SIZE)
                .max_send_buffer_size(MAX_SEND_BUFFER)
                .enable_push(false)
                .handshake::<_, Bytes>(tls),
        )
        .await
        .map_err(timed_out)?
        .map_err(|source| ClientError::H2Handshake { peer, source })?;

        let state = Arc::new(ConnectionState::default());
        let driver_state = state.clone();
        let driver_identity = identity.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%peer, identity = %driver_identity, error = %e, "HBONE connection ended with an error");
            }
            driver_state.closed.store(true, Ordering::Release);
        });
        Ok(HboneConnection {
            send_request,
            peer,
            identity,
            state,
        })
    }
}

#[derive(Debug, Default)]
struct ConnectionState {
    /// The connection task has ended: no more I/O.
    closed: AtomicBool,
    /// A stream failed in a way that rules out new ones (GOAWAY, refused
    /// stream, connection error).
    broken: AtomicBool,
}

/// An established HBONE connection. Clones share it.
#[derive(Clone)]
pub struct HboneConnection {
    send_request: SendRequest<Bytes>,
    peer: SocketAddr,
    identity: Identity,
    state: Arc<ConnectionState>,
}

impl std::fmt::Debug for HboneConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HboneConnection")
            .field("peer", &self.peer)
            .field("identity", &self.identity.to_string())
            .field("usable", &self.is_usable())
            .finish_non_exhaustive()
    }
}

impl HboneConnection {
    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The peer's verified SPIFFE identity.
    pub fn peer_identity(&self) -> &Identity {
        &self.identity
    }

    /// Whether new streams may still be opened: the connection is open and
    /// no stream has seen a GOAWAY, a refusal or a connection error.
    pub fn is_usable(&self) -> bool {
        !self.state.closed.load(Ordering::Acquire) && !self.state.broken.load(Ordering::Acquire)
    }

    /// Opens a `CONNECT target` stream with extra `headers` (`baggage`,
    /// `forwarded`, `traceparent`) and waits for the peer's answer. Anything
    /// but 200 is [`ClientError::Status`]. Waits for a free stream slot if
    /// the peer's concurrency limit is reached.
    pub async fn connect_stream(
        &self,
        target: SocketAddr,
        headers: HeaderMap,
    ) -> Result<H2Stream, ClientError> {
        let failed = |source: h2::Error| {
            if source.is_go_away()
                || source.is_io()
                || source.reason() == Some(h2::Reason::REFUSED_STREAM)
            {
                self.state.broken.store(true, Ordering::Release);
            }
            ClientError::Stream {
                peer: self.peer,
                target,
                source,
            }
        };
        let mut send_request = self.send_request.clone().ready().await.map_err(failed)?;

        let mut request = Request::new(());
        *request.method_mut() = Method::CONNECT;
        *request.uri_mut() = Uri::builder()
            .authority(target.to_string())
            .build()
            .unwrap_or_default();
        *request.headers_mut() = headers;

        let (response, send) = send_request.send_request(request, false).map_err(failed)?;
        let response = response.await.map_err(failed)?;
        let status = response.status();
        if status != StatusCode::OK {
            return Err(ClientError::Status {
                peer: self.peer,
                identity: self.identity.clone(),
                target,
                status,
                hint: status_hint(status),
            });
        }
        Ok(H2Stream::new(send, response.into_body()))
    }
}

fn status_hint(status: StatusCode) -> &'static str {
    match status {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
            "; the destination refused this source or address (authorization policy, or the address is not a pod behind that ztunnel)"
        }
        StatusCode::METHOD_NOT_ALLOWED | StatusCode::BAD_REQUEST => {
            "; the peer does not accept this request as HBONE CONNECT"
        }
        _ => "",
    }
}
