//! Serving the node-local HTTP listeners (admin, stats, readiness) with
//! bounds on what one client can make them hold: a cap on connections
//! served at once per listener (more are closed at accept, with a warning
//! at most every [`REFUSAL_LOG_INTERVAL`]), a bounded request head (hyper
//! answers 431 beyond [`HttpLimits::max_buf_size`]), a deadline for a
//! request head that also closes idle kept-alive connections, and a
//! maximum connection age after which the connection is closed gracefully.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use hyper::Request;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::{debug, warn};

use super::{AdminContext, Listener, route};
use crate::drain::DrainWatcher;

/// Refused connections are logged at most this often (with a count).
pub(crate) const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// What one client can make a node-local HTTP listener hold.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HttpLimits {
    /// Connections served at once by one listener; further ones are closed
    /// as soon as they are accepted.
    pub max_connections: usize,
    /// Time allowed to send a request head; a kept-alive connection that
    /// sends no new request within it is closed too.
    pub header_read_timeout: Duration,
    /// hyper's read buffer, hence the largest request head (431 beyond).
    pub max_buf_size: usize,
    /// Most header fields in one request (431 beyond).
    pub max_headers: usize,
    /// A connection older than this finishes its current request and is
    /// closed (so a client cannot keep one busy forever).
    pub max_connection_age: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_connections: 64,
            header_read_timeout: Duration::from_secs(10),
            // Requests here are a request line and a few headers.
            max_buf_size: 16 * 1024,
            max_headers: 64,
            max_connection_age: Duration::from_secs(300),
        }
    }
}

/// Counts refused connections and says so at most once per interval.
struct RefusalLog {
    listener: Listener,
    limit: usize,
    since_last: u64,
    last: Option<Instant>,
}

impl RefusalLog {
    fn refused(&mut self, peer: SocketAddr) {
        self.since_last += 1;
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < REFUSAL_LOG_INTERVAL)
        {
            return;
        }
        warn!(
            listener = self.listener.name(),
            %peer,
            limit = self.limit,
            refused = self.since_last,
            "connection refused: the {} listener already serves {} connections (its limit); \
             a client is holding connections open or polling too often",
            self.listener.name(),
            self.limit
        );
        self.since_last = 0;
        self.last = Some(now);
    }
}

/// Accepts and serves connections on `tcp` with the default [`HttpLimits`]
/// until `drain` fires.
pub(crate) async fn serve(
    tcp: TcpListener,
    listener: Listener,
    ctx: Arc<AdminContext>,
    drain: DrainWatcher,
) {
    serve_with(tcp, listener, ctx, drain, HttpLimits::default()).await;
}

/// [`serve`] with explicit limits.
pub(crate) async fn serve_with(
    tcp: TcpListener,
    listener: Listener,
    ctx: Arc<AdminContext>,
    drain: DrainWatcher,
    limits: HttpLimits,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut refusals = RefusalLog {
        listener,
        limit: limits.max_connections,
        since_last: 0,
        last: None,
    };
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_buf_size.max(8192))
        .max_headers(limits.max_headers);
    loop {
        let accepted = tokio::select! {
            biased;
            _ = drain.signaled() => break,
            accepted = tcp.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: back off a little
                // instead of spinning.
                warn!(listener = listener.name(), error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            refusals.refused(peer);
            drop(stream);
            continue;
        };
        let ctx = ctx.clone();
        let drain = drain.clone();
        let builder = builder.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                let resp = route(
                    listener,
                    &ctx,
                    req.method(),
                    req.uri().path(),
                    req.uri().query(),
                );
                async move { Ok::<_, Infallible>(resp) }
            });
            let mut conn = pin!(builder.serve_connection(TokioIo::new(stream), svc));
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = drain.signaled() => {}
                _ = tokio::time::sleep(limits.max_connection_age) => {
                    debug!(listener = listener.name(), %peer, "closing a connection at its maximum age");
                }
            }
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(drain.deadline(), conn).await;
        });
    }
    debug!(listener = listener.name(), "listener stopped");
}

#[cfg(test)]
#[path = "server_tests.rs"]
mod tests;
