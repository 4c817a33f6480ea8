//! The outbound end of HBONE: one mTLS + HTTP/2 connection to a peer's
//! :15008, carrying many concurrent `CONNECT` streams.
//!
//! [`HboneClient::connect`] does the handshakes; the returned
//! [`HboneConnection`] is cheap to clone and opens streams with
//! [`HboneConnection::connect_stream`]. A task per connection drives the
//! HTTP/2 I/O; it ends when the peer closes or every handle and stream is
//! dropped. [`HboneConnection::is_usable`] says whether new streams may be
//! opened on it (for the pool to come, see the module docs of `hbone`).
//!
//! Nothing waits on the peer unbounded ([`ClientTimeouts`]): the TLS and
//! HTTP/2 handshakes, a free stream slot and the CONNECT response each have
//! a deadline, and the connection task sends an HTTP/2 PING every
//! [`ClientTimeouts::keepalive_interval`]; a peer that does not answer one
//! within [`ClientTimeouts::keepalive_timeout`] gets the connection closed
//! and marked broken, so the pool never hands it out again. TCP keepalive
//! covers a peer that vanished while the connection was idle.

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

/// Default bound on the peer's answer to a `CONNECT`.
pub const CONNECT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default bound on waiting for a free stream slot on a connection.
pub const STREAM_SLOT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time between HTTP/2 PINGs on a connection (Istio's ztunnel: 10 s).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Default bound on the PING's answer before the connection is dropped
/// (Istio's ztunnel: 20 s).
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Idle time before the kernel's first TCP keepalive probe.
pub const TCP_KEEPALIVE_TIME: Duration = Duration::from_secs(60);
/// Time between TCP keepalive probes; 3 unanswered ones drop the socket.
pub const TCP_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// Every bound on waiting for an HBONE peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientTimeouts {
    /// TLS + HTTP/2 handshakes.
    pub handshake: Duration,
    /// The peer's answer to a `CONNECT`.
    pub connect_response: Duration,
    /// A free stream slot (the peer's concurrency limit reached).
    pub stream_slot: Duration,
    /// Time between HTTP/2 PINGs.
    pub keepalive_interval: Duration,
    /// Bound on a PING's answer; past it the connection is closed.
    pub keepalive_timeout: Duration,
}

impl Default for ClientTimeouts {
    fn default() -> Self {
        Self {
            handshake: HANDSHAKE_TIMEOUT,
            connect_response: CONNECT_RESPONSE_TIMEOUT,
            stream_slot: STREAM_SLOT_TIMEOUT,
            keepalive_interval: KEEPALIVE_INTERVAL,
            keepalive_timeout: KEEPALIVE_TIMEOUT,
        }
    }
}

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
    #[error(
        "TLS/HTTP/2 handshake with HBONE peer {peer} did not complete within {timeout:?}; the \
         peer accepted TCP but does not answer (is its ztunnel hung, or is :15008 not HBONE?)"
    )]
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
    /// No stream slot came free on the connection in time.
    #[error(
        "no stream slot on the HBONE connection to {peer} within {timeout:?} for CONNECT {target}; \
         the peer's stream limit is reached"
    )]
    StreamSlotTimeout {
        /// The peer's address.
        peer: SocketAddr,
        /// The requested destination.
        target: SocketAddr,
        /// The bound that expired.
        timeout: Duration,
    },
    /// The peer did not answer the CONNECT in time.
    #[error(
        "HBONE peer {peer} did not answer CONNECT {target} within {timeout:?}; the connection is \
         dropped from the pool"
    )]
    ResponseTimeout {
        /// The peer's address.
        peer: SocketAddr,
        /// The requested destination.
        target: SocketAddr,
        /// The bound that expired.
        timeout: Duration,
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
    /// handshakes over a connected socket, with the default
    /// [`ClientTimeouts`].
    pub async fn connect(
        tcp: TcpStream,
        config: Arc<rustls::ClientConfig>,
    ) -> Result<HboneConnection, ClientError> {
        Self::connect_with(tcp, config, ClientTimeouts::default()).await
    }

    /// [`HboneClient::connect`] with another handshake bound.
    pub async fn connect_with_timeout(
        tcp: TcpStream,
        config: Arc<rustls::ClientConfig>,
        handshake_timeout: Duration,
    ) -> Result<HboneConnection, ClientError> {
        let timeouts = ClientTimeouts {
            handshake: handshake_timeout,
            ..ClientTimeouts::default()
        };
        Self::connect_with(tcp, config, timeouts).await
    }

    /// [`HboneClient::connect`] with the given bounds.
    pub async fn connect_with(
        tcp: TcpStream,
        config: Arc<rustls::ClientConfig>,
        timeouts: ClientTimeouts,
    ) -> Result<HboneConnection, ClientError> {
        let handshake_timeout = timeouts.handshake;
        let peer = tcp.peer_addr().map_err(ClientError::PeerAddr)?;
        let _ = tcp.set_nodelay(true);
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(TCP_KEEPALIVE_TIME)
            .with_interval(TCP_KEEPALIVE_INTERVAL)
            .with_retries(3);
        if let Err(e) = socket2::SockRef::from(&tcp).set_tcp_keepalive(&keepalive) {
            tracing::debug!(%peer, error = %e, "cannot set TCP keepalive on the HBONE connection");
        }
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

        let (send_request, mut connection) = tokio::time::timeout_at(
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
        let ping_pong = connection.ping_pong();
        tokio::spawn(async move {
            let silent = keepalive_pings(
                ping_pong,
                timeouts.keepalive_interval,
                timeouts.keepalive_timeout,
            );
            tokio::select! {
                ended = &mut connection => if let Err(e) = ended {
                    tracing::debug!(%peer, identity = %driver_identity, error = %e, "HBONE connection ended with an error");
                },
                why = silent => {
                    // Dropping the connection closes the socket; its streams fail.
                    driver_state.broken.store(true, Ordering::Release);
                    tracing::warn!(%peer, identity = %driver_identity, "closing the HBONE connection: {why}");
                }
            }
            driver_state.closed.store(true, Ordering::Release);
        });
        Ok(HboneConnection {
            send_request,
            peer,
            identity,
            state,
            timeouts,
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

/// Sends a PING every `interval` while the connection lives; returns why
/// the peer is considered gone (no answer within `timeout`, or the PING
/// failed). Never returns when PINGs cannot be sent at all.
async fn keepalive_pings(
    ping_pong: Option<h2::PingPong>,
    interval: Duration,
    timeout: Duration,
) -> String {
    let Some(mut ping_pong) = ping_pong else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(interval).await;
        match tokio::time::timeout(timeout, ping_pong.ping(h2::Ping::opaque())).await {
            Ok(Ok(_pong)) => {}
            Ok(Err(e)) => return format!("HTTP/2 PING failed: {e}"),
            Err(_) => {
                return format!(
                    "the peer did not answer an HTTP/2 PING within {timeout:?} (silent or hung peer)"
                );
            }
        }
    }
}

/// An established HBONE connection. Clones share it.
#[derive(Clone)]
pub struct HboneConnection {
    send_request: SendRequest<Bytes>,
    peer: SocketAddr,
    identity: Identity,
    state: Arc<ConnectionState>,
    timeouts: ClientTimeouts,
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
    /// the peer's concurrency limit is reached, at most
    /// [`ClientTimeouts::stream_slot`]; waits for the answer at most
    /// [`ClientTimeouts::connect_response`], after which the connection is
    /// marked broken (a peer that does not answer gets no new streams).
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
        let slot_timeout = self.timeouts.stream_slot;
        let mut send_request =
            tokio::time::timeout(slot_timeout, self.send_request.clone().ready())
                .await
                .map_err(|_| ClientError::StreamSlotTimeout {
                    peer: self.peer,
                    target,
                    timeout: slot_timeout,
                })?
                .map_err(failed)?;

        let mut request = Request::new(());
        *request.method_mut() = Method::CONNECT;
        *request.uri_mut() = Uri::builder()
            .authority(target.to_string())
            .build()
            .unwrap_or_default();
        *request.headers_mut() = headers;

        let (response, send) = send_request.send_request(request, false).map_err(failed)?;
        let response_timeout = self.timeouts.connect_response;
        let response = match tokio::time::timeout(response_timeout, response).await {
            Ok(answered) => answered.map_err(failed)?,
            Err(_) => {
                self.state.broken.store(true, Ordering::Release);
                return Err(ClientError::ResponseTimeout {
                    peer: self.peer,
                    target,
                    timeout: response_timeout,
                });
            }
        };
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
