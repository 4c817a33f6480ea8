//! What every proxied connection goes through, inbound or outbound: the
//! accept loop of a pod's listener, the copy that respects the pod's drain
//! and policy revocation, the original destination of a redirected
//! connection, and recording its outcome (metrics + one access-log line).

use std::future::poll_fn;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::net::TcpStream;

use super::metrics::ConnectionResult;
use super::{PodContext, ProxyError, live};
use crate::copy::{ChunkIo, CopyConfig, copy_bidirectional};

/// Copies both ways until done; once the pod drains, gives the connection
/// the drain's deadline more, then closes it. A revoked connection (a policy
/// change denies it) is closed at once.
///
/// Sized for a connection's life: the copy is boxed when this is called,
/// so the streams live only inside it (an async block capturing them would
/// keep their moved-from slots too), and the revocation is polled in place.
#[allow(clippy::manual_async_fn)] // an async fn would hold its arguments twice
pub(super) fn copy_until_drained<'a, A, B>(
    pod: &'a PodContext,
    a: A,
    b: B,
    cfg: &'a CopyConfig,
    revoked: Option<live::Revoked>,
) -> impl Future<Output = Result<(u64, u64), ProxyError>> + 'a
where
    A: ChunkIo + 'a,
    B: ChunkIo + 'a,
{
    let mut copy = Box::pin(copy_bidirectional(a, b, cfg));
    let mut revoked = revoked;
    async move {
        // Ready with the denying policy once revoked; a dropped sender
        // means "no longer tracked", not "revoked".
        let mut revocation = poll_fn(|cx| match revoked.as_mut() {
            Some(rx) => match Pin::new(rx).poll(cx) {
                Poll::Ready(Ok(policy)) => Poll::Ready(policy),
                Poll::Ready(Err(_)) => {
                    revoked = None;
                    Poll::Pending
                }
                Poll::Pending => Poll::Pending,
            },
            None => Poll::Pending,
        });
        tokio::select! {
            r = &mut copy => return r.map_err(ProxyError::from),
            policy = &mut revocation => return Err(ProxyError::Revoked { policy }),
            _ = pod.drain.signaled() => {}
        }
        tokio::select! {
            r = tokio::time::timeout(pod.drain.deadline(), copy) => match r {
                Ok(r) => r.map_err(ProxyError::from),
                Err(_) => Err(ProxyError::Drained),
            },
            policy = revocation => Err(ProxyError::Revoked { policy }),
        }
    }
}

/// A connection's opening (dial, handshake, pool checkout, app connect),
/// boxed: what only the opening needs is freed once it completes instead
/// of sizing the connection's task for its whole life.
pub(super) type Opening<'a, T> = Pin<Box<dyn Future<Output = Result<T, ProxyError>> + Send + 'a>>;

/// Waits for `open`, then runs `copy` on what it opened. (`?` consumes the
/// opened value whole, so it is not kept beside the copy; an `async move`
/// block, not an `async fn`, so nothing is held twice.)
#[allow(clippy::manual_async_fn)] // an async fn would hold its arguments twice
pub(super) fn open_then_copy<'a, T, C, F>(
    open: Opening<'a, T>,
    copy: C,
) -> impl Future<Output = Result<(u64, u64), ProxyError>> + 'a
where
    T: 'a,
    C: FnOnce(T) -> F + 'a,
    F: Future<Output = Result<(u64, u64), ProxyError>> + 'a,
{
    async move {
        let opened = open.await?;
        copy(opened).await
    }
}

/// A connection's task: runs `setup` (plain code: resolution, policy, the
/// connection's record) when the task first runs, then the future it
/// returns, in place of it; nothing more when it returns `None` (a
/// connection it refused or could not set up, already recorded or logged).
/// The task is as large as the larger of the two, not both (an `async`
/// wrapper would keep `setup`'s inputs beside the connection's future for
/// its whole life), and a panic in `setup` stays in this connection's task,
/// off the accept loop.
pub(super) fn deferred<S, F>(setup: S) -> impl Future<Output = ()> + Send + 'static
where
    S: FnOnce() -> Option<F> + Send + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    use futures::FutureExt;
    futures::future::lazy(move |_| futures::future::OptionFuture::from(setup()))
        .flatten()
        .map(drop)
}

/// Accepts until the pod drains; `handle` runs each connection as a task.
pub(super) async fn accept_loop<F, Fut>(
    listener: tokio::net::TcpListener,
    pod: Arc<PodContext>,
    role: &str,
    handle: F,
) where
    F: Fn(tokio::net::TcpStream, SocketAddr) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    loop {
        let accepted = tokio::select! {
            _ = pod.drain.signaled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                tokio::spawn(handle(stream, peer));
            }
            Err(e) => {
                tracing::warn!(pod = %pod, role, error = %e, "accept failed");
                // E.g. out of fds: do not spin.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// The original destination of a connection redirected by iptables.
pub(super) fn original_dst(stream: &TcpStream) -> std::io::Result<SocketAddr> {
    use nix::sys::socket::{SockaddrIn, SockaddrIn6, getsockopt, sockopt};
    let local = stream.local_addr()?;
    if local.is_ipv4() {
        let raw = getsockopt(stream, sockopt::OriginalDst).map_err(std::io::Error::from)?;
        Ok(SocketAddr::V4(SockaddrIn::from(raw).into()))
    } else {
        let raw = getsockopt(stream, sockopt::Ip6tOriginalDst).map_err(std::io::Error::from)?;
        Ok(SocketAddr::V6(SockaddrIn6::from(raw).into()))
    }
}

/// Records the outcome of a connection.
pub(super) fn finish(result: ConnectionResult, outcome: Result<(u64, u64), ProxyError>) {
    match outcome {
        Ok((from_client, to_client)) => {
            result.record_received(from_client);
            result.record_sent(to_client);
            result.finish();
        }
        Err(e) => {
            if let ProxyError::Copy(c) = &e {
                let (from_client, to_client) = c.copied();
                result.record_received(from_client);
                result.record_sent(to_client);
            }
            match &e {
                // The access-log line names the policy in its error.
                ProxyError::Denied { policy } | ProxyError::Revoked { policy } => {
                    result.deny(policy, &e)
                }
                _ => result.fail(e.flags(), &e),
            }
        }
    }
}
