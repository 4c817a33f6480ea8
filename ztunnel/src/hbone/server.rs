//! The inbound end of HBONE: one accepted TCP connection → mTLS → HTTP/2,
//! many `CONNECT` streams.
//!
//! Per stream: anything but `CONNECT` gets 405, a `:authority` that is not
//! `ip:port` gets 400, then the caller's authorization callback decides
//! (e.g. 401/403 for an address that is not the pod's — never an open
//! proxy). An authorized stream is handed, unanswered, to the caller's
//! handler on its own task as a [`PendingConnect`]: the handler connects to
//! the destination first and only then answers `200` ([`PendingConnect::accept`])
//! or a failure status such as 503 ([`PendingConnect::refuse`]), as Istio's
//! ztunnel does — a client never sees 200 for a port nobody listens on.
//!
//! What one client can make a connection hold is bounded, as Istio's
//! ztunnel bounds it: [`MAX_CONCURRENT_STREAMS`] open streams (h2 refuses
//! more with `REFUSED_STREAM`; a conforming client queues them),
//! [`MAX_HEADER_LIST_SIZE`] of headers per request (h2 answers a larger
//! one with 431 on that stream only), [`super::MAX_FRAME_SIZE`] per frame,
//! and a few resets before h2 answers a reset flood with GOAWAY. Buffered
//! request bodies are bounded by the connection window
//! ([`super::CONNECTION_WINDOW`]).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use h2::RecvStream;
use h2::server::SendResponse;
use hyper::http::{HeaderMap, Method, Response, StatusCode, Uri};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;

use super::stream::H2Stream;
use super::tls::peer_identity;
use super::{CONNECTION_WINDOW, HANDSHAKE_TIMEOUT, MAX_FRAME_SIZE, MAX_SEND_BUFFER, STREAM_WINDOW};
use crate::identity::Identity;

/// Most streams one client may have open on one connection at a time
/// (HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`); Istio's ztunnel uses 100 too,
/// and the outbound pool never opens more per connection.
pub const MAX_CONCURRENT_STREAMS: u32 = 100;
/// Largest decoded header list of one request (`SETTINGS_MAX_HEADER_LIST_SIZE`,
/// 64 KiB as in Istio's ztunnel); a CONNECT carries a few hundred bytes.
pub const MAX_HEADER_LIST_SIZE: u32 = 64 * 1024;
/// Streams the client may open and reset before they are accepted; past
/// that h2 closes the connection with GOAWAY (the "rapid reset" defence).
pub const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// Streams reset by the client that are remembered at once (so late frames
/// on them are ignored rather than treated as errors).
pub const MAX_CONCURRENT_RESET_STREAMS: usize = 10;
/// Streams this server may reset for the client's protocol errors (e.g.
/// over the stream limit, oversized headers) before it closes the whole
/// connection with GOAWAY `ENHANCE_YOUR_CALM`.
pub const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;

/// Errors of one inbound HBONE connection.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The accepted socket has no peer address (it is already closed).
    #[error("the accepted HBONE connection is already closed: {0}")]
    PeerAddr(#[source] io::Error),
    /// The TLS handshake failed (bad or missing client certificate, wrong
    /// CA, not TLS 1.3, ...).
    #[error(
        "TLS handshake with {peer} failed: {source}; HBONE clients must use TLS 1.3 and present a certificate issued by this mesh's CA"
    )]
    Tls {
        /// The client's address.
        peer: SocketAddr,
        /// The TLS error.
        #[source]
        source: io::Error,
    },
    /// The client took too long to complete the TLS and HTTP/2 handshakes.
    #[error("handshake with {peer} did not complete within {timeout:?}")]
    HandshakeTimeout {
        /// The client's address.
        peer: SocketAddr,
        /// The bound that expired.
        timeout: Duration,
    },
    /// The client's certificate chains to the bundle but names no SPIFFE
    /// identity.
    #[error(
        "the client certificate of {peer} carries no single spiffe:// URI SAN, so its identity is unknown; refusing it"
    )]
    NoPeerIdentity {
        /// The client's address.
        peer: SocketAddr,
    },
    /// The HTTP/2 handshake failed (the client does not speak HTTP/2).
    #[error("HTTP/2 handshake with {peer} ({identity}) failed: {source}")]
    H2Handshake {
        /// The client's address.
        peer: SocketAddr,
        /// The client's identity.
        identity: Identity,
        /// The h2 error.
        #[source]
        source: h2::Error,
    },
    /// The HTTP/2 connection failed after the handshake.
    #[error("HBONE connection from {peer} ({identity}) failed: {source}")]
    Connection {
        /// The client's address.
        peer: SocketAddr,
        /// The client's identity.
        identity: Identity,
        /// The h2 error.
        #[source]
        source: h2::Error,
    },
}

/// A `CONNECT` request that passed the protocol checks, as shown to the
/// authorization callback and handed to the handler.
#[derive(Debug, Clone)]
pub struct ConnectRequest {
    /// The client's SPIFFE identity, from its verified certificate.
    pub peer_identity: Identity,
    /// The client's TCP address (the remote ztunnel).
    pub peer_addr: SocketAddr,
    /// Where the client wants to go (`:authority`).
    pub authority: SocketAddr,
    /// The request headers (`baggage`, `forwarded`, `traceparent`, ...).
    pub headers: HeaderMap,
}

/// An authorized `CONNECT` stream waiting for its answer. Dropping it
/// unanswered resets the stream.
pub struct PendingConnect {
    respond: SendResponse<Bytes>,
    body: RecvStream,
}

impl std::fmt::Debug for PendingConnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingConnect")
            .field("stream", &self.respond.stream_id())
            .finish_non_exhaustive()
    }
}

impl PendingConnect {
    /// Answers `200` and returns the tunnel. Fails when the client already
    /// reset the stream or the connection is gone.
    pub fn accept(mut self) -> Result<H2Stream, h2::Error> {
        let send = self
            .respond
            .send_response(response(StatusCode::OK), false)?;
        Ok(H2Stream::new(send, self.body))
    }

    /// Answers `status` and ends the stream.
    pub fn refuse(mut self, status: StatusCode) {
        if let Err(e) = self.respond.send_response(response(status), true) {
            tracing::debug!(%status, error = %e, "HBONE stream gone before its refusal was sent");
        }
    }
}

/// Serves HBONE on accepted TCP connections.
#[derive(Clone)]
pub struct HboneServer {
    acceptor: TlsAcceptor,
    handshake_timeout: Duration,
}

impl std::fmt::Debug for HboneServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HboneServer")
            .field("handshake_timeout", &self.handshake_timeout)
            .finish_non_exhaustive()
    }
}

impl HboneServer {
    /// A server using `config` (see [`super::server_config`]).
    pub fn new(config: Arc<rustls::ServerConfig>) -> Self {
        Self {
            acceptor: TlsAcceptor::from(config),
            handshake_timeout: HANDSHAKE_TIMEOUT,
        }
    }

    /// Bounds the TLS + HTTP/2 handshakes (default [`HANDSHAKE_TIMEOUT`]).
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// Serves one accepted connection until the client closes it.
    ///
    /// For every valid `CONNECT`, `authorize` is asked first; `Err(status)`
    /// refuses the stream with that status. For authorized streams
    /// `handler(request, pending)` is spawned as its own task; it answers
    /// with [`PendingConnect::accept`] once the destination is connected,
    /// or [`PendingConnect::refuse`]. Streams still running when this
    /// returns keep their tasks but lose their transport.
    pub async fn serve<A, H, F>(
        &self,
        tcp: TcpStream,
        authorize: A,
        handler: H,
    ) -> Result<(), ServerError>
    where
        A: Fn(&ConnectRequest) -> Result<(), StatusCode>,
        H: Fn(ConnectRequest, PendingConnect) -> F,
        F: Future<Output = ()> + Send + 'static,
    {
        self.serve_until(tcp, authorize, handler, std::future::pending())
            .await
    }

    /// [`HboneServer::serve`] that, once `drain` resolves, sends GOAWAY:
    /// the client opens no new stream here (its pool dials elsewhere or
    /// fails fast) while the streams already open run to their end.
    pub async fn serve_until<A, H, F, D>(
        &self,
        tcp: TcpStream,
        authorize: A,
        handler: H,
        drain: D,
    ) -> Result<(), ServerError>
    where
        A: Fn(&ConnectRequest) -> Result<(), StatusCode>,
        H: Fn(ConnectRequest, PendingConnect) -> F,
        F: Future<Output = ()> + Send + 'static,
        D: Future<Output = ()>,
    {
        let peer = tcp.peer_addr().map_err(ServerError::PeerAddr)?;
        // Tunnels carry interactive traffic too; h2 batches writes itself.
        let _ = tcp.set_nodelay(true);
        let deadline = Instant::now() + self.handshake_timeout;
        let timed_out = |_| ServerError::HandshakeTimeout {
            peer,
            timeout: self.handshake_timeout,
        };

        let tls = tokio::time::timeout_at(deadline, self.acceptor.accept(tcp))
            .await
            .map_err(timed_out)?
            .map_err(|source| ServerError::Tls { peer, source })?;
        let identity =
            peer_identity(tls.get_ref().1).ok_or(ServerError::NoPeerIdentity { peer })?;

        let mut conn = tokio::time::timeout_at(
            deadline,
            h2::server::Builder::new()
                .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
                .max_header_list_size(MAX_HEADER_LIST_SIZE)
                .max_pending_accept_reset_streams(MAX_PENDING_ACCEPT_RESET_STREAMS)
                .max_concurrent_reset_streams(MAX_CONCURRENT_RESET_STREAMS)
                .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
                .initial_window_size(STREAM_WINDOW)
                .initial_connection_window_size(CONNECTION_WINDOW)
                .max_frame_size(MAX_FRAME_SIZE)
                .max_send_buffer_size(MAX_SEND_BUFFER)
                .handshake::<_, Bytes>(tls),
        )
        .await
        .map_err(timed_out)?
        .map_err(|source| ServerError::H2Handshake {
            peer,
            identity: identity.clone(),
            source,
        })?;
        tracing::debug!(%peer, %identity, "HBONE connection established");

        tokio::pin!(drain);
        let mut draining = false;
        loop {
            let next = tokio::select! {
                next = conn.accept() => next,
                () = &mut drain, if !draining => {
                    draining = true;
                    tracing::debug!(%peer, %identity, "draining: GOAWAY sent to the HBONE client");
                    conn.graceful_shutdown();
                    continue;
                }
            };
            let Some(next) = next else { break };
            let (request, mut respond) = match next {
                Ok(r) => r,
                Err(source)
                    if source.is_go_away() && source.reason() == Some(h2::Reason::NO_ERROR) =>
                {
                    break;
                }
                Err(source) => {
                    return Err(ServerError::Connection {
                        peer,
                        identity,
                        source,
                    });
                }
            };
            let (parts, body) = request.into_parts();
            let decided = check_connect(&parts.method, &parts.uri).and_then(|authority| {
                let request = ConnectRequest {
                    peer_identity: identity.clone(),
                    peer_addr: peer,
                    authority,
                    headers: parts.headers,
                };
                authorize(&request).map(|()| request)
            });
            match decided {
                Err(status) => {
                    tracing::debug!(%peer, %identity, method = %parts.method, uri = %parts.uri, %status, "HBONE request refused");
                    let _ = respond.send_response(response(status), true);
                }
                Ok(request) => {
                    tokio::spawn(handler(request, PendingConnect { respond, body }));
                }
            }
        }
        tracing::debug!(%peer, %identity, "HBONE connection closed");
        Ok(())
    }
}

/// The protocol check of one HBONE request head, before authorization:
/// only `CONNECT` with `:authority` = `ip:port` passes (405 for another
/// method, 400 for an authority that is not a socket address). Pure, so
/// it can be driven with untrusted heads (the `hbone_connect` fuzz target).
pub fn check_connect(method: &Method, uri: &Uri) -> Result<SocketAddr, StatusCode> {
    if method != Method::CONNECT {
        return Err(StatusCode::METHOD_NOT_ALLOWED);
    }
    uri.authority()
        .and_then(|a| a.as_str().parse::<SocketAddr>().ok())
        .ok_or(StatusCode::BAD_REQUEST)
}

fn response(status: StatusCode) -> Response<()> {
    let mut r = Response::new(());
    *r.status_mut() = status;
    r
}

#[cfg(test)]
#[path = "server_limits_tests.rs"]
mod limits_tests;

#[cfg(test)]
mod check_tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn connect(authority: &str) -> Result<SocketAddr, StatusCode> {
        let uri = Uri::builder().authority(authority).build().unwrap();
        check_connect(&Method::CONNECT, &uri)
    }

    #[test]
    fn only_connect_to_a_socket_address_passes() {
        assert_eq!(
            connect("10.0.0.1:8080"),
            Ok("10.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(connect("[fd00::1]:80"), Ok("[fd00::1]:80".parse().unwrap()));
        // A host name, a missing port or user info: 400.
        for bad in ["example.com:80", "10.0.0.1", "user@10.0.0.1:80"] {
            assert_eq!(connect(bad), Err(StatusCode::BAD_REQUEST), "{bad}");
        }
        let path_only: Uri = "/x".parse().unwrap();
        assert_eq!(
            check_connect(&Method::CONNECT, &path_only),
            Err(StatusCode::BAD_REQUEST)
        );
        let get: Uri = "http://10.0.0.1:80/".parse().unwrap();
        assert_eq!(
            check_connect(&Method::GET, &get),
            Err(StatusCode::METHOD_NOT_ALLOWED)
        );
    }
}
