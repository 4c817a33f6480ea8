//! HBONE: TCP tunnelled as HTTP/2 `CONNECT` streams over mutual TLS
//! (SPEC §4), the building blocks of the data path.
//!
//! ```text
//!  outbound                                             inbound (pod :15008)
//!  HboneClient::connect(tcp, client_config(src cert, bundle, dst identity))
//!    └─ HboneConnection ── TLS 1.3 + ALPN h2 ──▶ HboneServer::serve(tcp, authorize, handler)
//!         connect_stream(ip:port, headers)  ───CONNECT──▶  ConnectRequest ─authorize─▶ handler
//!                                                          connects the app, then 200 (or 503)
//!         H2Stream ◀════════════ bytes (copy::copy_bidirectional) ════════════▶ H2Stream
//! ```
//!
//! * [`tls`]: rustls configs. The client pins the peer's SPIFFE identity,
//!   the server requires a client certificate; both chain to the bundle.
//! * [`server`]: one accepted TCP connection → TLS → h2, many streams; only
//!   `CONNECT ip:port` passes, and an authorization callback decides
//!   whether the address and the caller are acceptable.
//! * [`client`]: one connection to a peer's :15008, many concurrent streams.
//! * [`pool`]: the outbound connections the proxies share, keyed by
//!   [`PoolKey`] (source and destination identity, destination IP, source
//!   pod IP), with a per-connection stream limit, coalesced dials, one retry
//!   on a fresh connection when a reused one turns out broken, and an idle
//!   reaper; it dials through a [`Dialer`] (from inside the source pod on
//!   the data path).
//! * [`H2Stream`]: a stream as `AsyncRead + AsyncWrite`, flow-controlled.
//!
//! Windows are large ([`STREAM_WINDOW`], [`CONNECTION_WINDOW`]) so one
//! stream can fill a fast link despite HTTP/2 flow control. The in-pod
//! listeners, metrics and drain that use these pieces live in
//! [`crate::proxy`] and [`crate::inpod`].
#![forbid(unsafe_code)]

pub mod client;
pub mod pool;
pub mod server;
mod stream;
pub mod tls;

#[cfg(test)]
mod keepalive_tests;
#[cfg(test)]
mod tests;

pub use client::{ClientError, ClientTimeouts, HboneClient, HboneConnection};
pub use pool::{
    DialFuture, Dialer, HbonePool, PoolConfig, PoolError, PoolKey, PooledStream, TcpDialer,
};
pub use server::{ConnectRequest, HboneServer, PendingConnect, ServerError, check_connect};
pub use stream::H2Stream;
pub use tls::{TlsError, client_config, peer_identity, server_config};

use std::time::Duration;

/// Initial HTTP/2 flow-control window of each stream (bytes).
pub const STREAM_WINDOW: u32 = 4 * 1024 * 1024;
/// HTTP/2 flow-control window of a whole connection (bytes).
pub const CONNECTION_WINDOW: u32 = 16 * 1024 * 1024;
/// Largest HTTP/2 frame we accept (bytes); big frames mean fewer headers
/// per byte on bulk transfers.
pub const MAX_FRAME_SIZE: u32 = 1024 * 1024;
/// Most bytes h2 buffers per stream before a writer must wait.
pub const MAX_SEND_BUFFER: usize = 1024 * 1024;
/// Default bound on TLS + HTTP/2 handshakes.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
