//! Inbound: HBONE on :15008 (mTLS with the pod's certificate, `CONNECT`
//! only to this pod's addresses) and plaintext on :15006 (redirected
//! connections from outside the mesh). Both check authorization — which
//! also carries PeerAuthentication STRICT as a deny of identity-less
//! connections — and deliver to the app from inside the pod, from the
//! original client's IP when transparent delivery is on.
//!
//! A CONNECT is answered only once the app's port is connected: `200`
//! then, `503` when the connect fails (refused, unreachable, timed out) —
//! Istio's ztunnel's answer — so the client never gets a tunnel to a port
//! nobody listens on. Refusals before that: 400 (ztunnel's own port), 403
//! (not this pod's address), 401 (policy).
//!
//! Destinations bound to a waypoint get no special treatment, as in
//! Istio's ztunnel: a connection that did not come through the waypoint is
//! not refused for that (only L4 policy decides), and one the waypoint
//! relays is authorized with the waypoint's identity as its source. The
//! access log names the waypoint when the source pod is one of the
//! destination's.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::http::StatusCode;
use tokio::net::{TcpListener, TcpStream};
use tracing::Instrument;

use super::connection::{
    Opening, accept_loop, copy_until_drained, deferred, finish, open_then_copy, original_dst,
};
use super::metrics::{ConnectionOpen, ConnectionResult, Reporter, SecurityPolicy};
use super::recent::trace_id_of;
use super::resolve::is_waypoint_of;
use super::{PodContext, ProxyContext, ProxyError, peer_info, workload_identity};
use crate::hbone::{ConnectRequest, H2Stream, HboneServer, PendingConnect};
use crate::identity::Identity;
use crate::rbac::{ConnectionAttrs, Decision, PeerIdentity};
use crate::state::{StateSnapshot, Workload};

/// Serves the pod's HBONE listener until the pod drains.
pub async fn serve_hbone(listener: TcpListener, pod: Arc<PodContext>, ctx: Arc<ProxyContext>) {
    let p = pod.clone();
    accept_loop(listener, p, "inbound-hbone", move |tcp, peer| {
        hbone_connection(ctx.clone(), pod.clone(), tcp, peer)
    })
    .await;
}

/// Serves the pod's inbound plaintext listener until the pod drains.
pub async fn serve_plaintext(listener: TcpListener, pod: Arc<PodContext>, ctx: Arc<ProxyContext>) {
    let p = pod.clone();
    accept_loop(listener, p, "inbound-plaintext", move |tcp, peer| {
        let (ctx, pod) = (ctx.clone(), pod.clone());
        deferred(move || plaintext(ctx, pod, tcp, peer))
    })
    .await;
}

/// One HBONE connection (TLS + HTTP/2, many CONNECT streams).
async fn hbone_connection(
    ctx: Arc<ProxyContext>,
    pod: Arc<PodContext>,
    tcp: TcpStream,
    peer: SocketAddr,
) {
    let _guard = pod.guard();
    let config = match pod.server_config(&ctx).await {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(pod = %pod, %peer, error = %e, "inbound HBONE connection refused: no certificate to present");
            return;
        }
    };
    let server = HboneServer::new(config);
    let authorize = |req: &ConnectRequest| authorize(&ctx, &pod, req);
    let handler = |req: ConnectRequest, pending: PendingConnect| {
        let (ctx, pod) = (ctx.clone(), pod.clone());
        deferred(move || Some(hbone_stream(ctx, pod, req, pending)))
    };
    let serve = server.serve_until(tcp, authorize, handler, pod.drain.signaled());
    tokio::pin!(serve);
    let outcome = tokio::select! {
        r = &mut serve => Some(r),
        _ = pod.drain.signaled() => {
            tokio::time::timeout(pod.drain.deadline(), &mut serve).await.ok()
        }
    };
    if let Some(Err(e)) = outcome {
        tracing::debug!(pod = %pod, %peer, error = %e, "inbound HBONE connection ended");
    }
}

/// ztunnel's node-level ports (admin 15000, metrics 15020, readiness
/// 15021). Never a destination inside a pod: a CONNECT or a redirected
/// connection to one is refused like one to the in-pod ports, so no peer
/// can aim a tunnel at a ztunnel port wherever it listens.
pub const NODE_PORTS: [u16; 3] = [15000, 15020, 15021];

/// Whether `port` is one of ztunnel's own (in-pod or node) ports.
fn is_own_port(ctx: &ProxyContext, port: u16) -> bool {
    [
        ctx.cfg.outbound_port,
        ctx.cfg.inbound_plaintext_port,
        ctx.cfg.hbone_port,
    ]
    .contains(&port)
        || NODE_PORTS.contains(&port)
}

/// What an inbound HBONE stream says about its connection: the peer's
/// identity, the trace id of its `traceparent`, and the pooled
/// connection's client address.
struct HbonePeer<'a> {
    identity: &'a Identity,
    trace_id: Option<u128>,
    addr: SocketAddr,
}

impl<'a> HbonePeer<'a> {
    fn of(req: &'a ConnectRequest) -> Self {
        Self {
            identity: &req.peer_identity,
            trace_id: req
                .headers
                .get("traceparent")
                .and_then(|v| v.to_str().ok())
                .and_then(trace_id_of),
            addr: req.peer_addr,
        }
    }
}

/// What the metrics know of an inbound connection (`hbone`: how it came,
/// `None` for plaintext).
fn inbound_open(
    ctx: &ProxyContext,
    pod: &PodContext,
    snap: &StateSnapshot,
    src: SocketAddr,
    dst: SocketAddr,
    dst_w: Option<&Workload>,
    hbone: Option<&HbonePeer<'_>>,
) -> ConnectionOpen {
    let peer = hbone.map(|h| h.identity);
    let src_w = snap.workload_by_ip(&ctx.network, src.ip().to_canonical());
    let dst_id = dst_w
        .map(workload_identity)
        .unwrap_or_else(|| pod.identity(ctx, snap));
    // Traffic the destination's waypoint forwards: its pod is the source
    // (and its identity the peer's, which policy sees as the source).
    let waypoint = match (src_w.as_deref(), dst_w) {
        (Some(s), Some(d)) if peer.is_some() && is_waypoint_of(snap, s, d) => {
            Some(format!("{}/{}", s.namespace, s.name))
        }
        _ => None,
    };
    ConnectionOpen {
        reporter: Reporter::Destination,
        src,
        dst,
        source: peer_info(src_w.as_deref(), peer),
        destination: peer_info(dst_w, Some(&dst_id)),
        destination_service: None,
        security: if peer.is_some() {
            SecurityPolicy::MutualTls
        } else {
            SecurityPolicy::None
        },
        upstream: None,
        waypoint,
        trace_id: hbone.and_then(|h| h.trace_id),
        hbone_peer: hbone.map(|h| h.addr),
    }
}

/// The check before a CONNECT is answered: an address of this pod, not one
/// of ztunnel's ports, and allowed by policy. Refusals are counted.
fn authorize(ctx: &ProxyContext, pod: &PodContext, req: &ConnectRequest) -> Result<(), StatusCode> {
    let dst = req.authority;
    let snap = ctx.state.load();
    let refuse = |w: Option<&Workload>, e: ProxyError, status: StatusCode| {
        let open = inbound_open(
            ctx,
            pod,
            &snap,
            req.peer_addr,
            dst,
            w,
            Some(&HbonePeer::of(req)),
        );
        finish(ConnectionResult::new(open, &ctx.metrics), Err(e));
        Err(status)
    };
    if is_own_port(ctx, dst.port()) {
        return refuse(None, ProxyError::Loop(dst), StatusCode::BAD_REQUEST);
    }
    let Some(w) = pod.workload_at(ctx, &snap, dst.ip()) else {
        let e = ProxyError::NotThisPod {
            addr: dst,
            pod: pod.to_string(),
        };
        return refuse(None, e, StatusCode::FORBIDDEN);
    };
    let attrs = ConnectionAttrs::mtls(
        req.peer_addr.ip(),
        PeerIdentity::new(&req.peer_identity),
        dst.ip(),
        dst.port(),
    );
    match ctx.policies.evaluate(&snap, &w, &attrs) {
        Decision::Allow => Ok(()),
        Decision::Deny { policy } => {
            let e = ProxyError::Denied {
                policy: policy.to_string(),
            };
            refuse(Some(&w), e, StatusCode::UNAUTHORIZED)
        }
    }
}

/// One authorized CONNECT stream (connect to the app, then answer 200 and
/// copy, or answer 503): its record opened by [`open_stream`] (plain code,
/// when the stream's task first runs: see [`deferred`]; it consumes the
/// request), then delivered by [`deliver_stream`]. An async fn that opened
/// the record itself would keep the setup's values in its own state for the
/// stream's whole life (rustc's async layout).
fn hbone_stream(
    ctx: Arc<ProxyContext>,
    pod: Arc<PodContext>,
    req: ConnectRequest,
    pending: PendingConnect,
) -> impl Future<Output = ()> + Send + 'static {
    let guard = pod.guard();
    let (result, attrs, dst) = open_stream(&ctx, &pod, req);
    let span = result.span().clone();
    deliver_stream(ctx, pod, guard, pending, attrs, dst, result).instrument(span)
}

/// Opens a CONNECT stream's record (metrics, span, `/connections`) and
/// the attributes policy is checked against; consumes the request.
fn open_stream(
    ctx: &ProxyContext,
    pod: &PodContext,
    req: ConnectRequest,
) -> (ConnectionResult, ConnectionAttrs, SocketAddr) {
    let dst = req.authority;
    let snap = ctx.state.load();
    let dst_w = pod.workload_at(ctx, &snap, dst.ip());
    let open = inbound_open(
        ctx,
        pod,
        &snap,
        req.peer_addr,
        dst,
        dst_w.as_deref(),
        Some(&HbonePeer::of(&req)),
    );
    drop(snap);
    let attrs = ConnectionAttrs::mtls(
        req.peer_addr.ip(),
        PeerIdentity::new(&req.peer_identity),
        dst.ip(),
        dst.port(),
    );
    (ConnectionResult::new(open, &ctx.metrics), attrs, dst)
}

/// Connects to the app, answers the CONNECT and copies until the stream
/// ends, registered as a live connection; records how it ended.
/// An `async move` block, not an `async fn` (which would keep each
/// argument twice for the stream's life): the captured values are used in
/// place, and what only the setup needs is in [`open_app_stream`]'s box.
#[allow(clippy::manual_async_fn)] // an async fn would hold its arguments twice
fn deliver_stream(
    ctx: Arc<ProxyContext>,
    pod: Arc<PodContext>,
    guard: super::pod::ConnGuard,
    pending: PendingConnect,
    attrs: ConnectionAttrs,
    dst: SocketAddr,
    result: ConnectionResult,
) -> impl Future<Output = ()> + Send + 'static {
    let (registration, revoked) = register(&ctx, &pod, attrs.clone());
    let open = open_app_stream(ctx.clone(), pod.clone(), attrs, dst, pending);
    async move {
        // The pod's guard and the live registration last as long as the stream.
        let _running = (&guard, &registration);
        let outcome = open_then_copy(open, |(stream, app)| {
            copy_until_drained(&pod, stream, app, &ctx.cfg.copy, Some(revoked))
        })
        .await;
        finish(result, outcome);
    }
}

/// Connects to the app, then answers the CONNECT: 200 and the stream, or
/// 503 when the app cannot be reached (an [`Opening`]: the connect's state
/// and the pending answer are freed once the stream is open).
fn open_app_stream(
    ctx: Arc<ProxyContext>,
    pod: Arc<PodContext>,
    attrs: ConnectionAttrs,
    dst: SocketAddr,
    pending: PendingConnect,
) -> Opening<'static, (H2Stream, TcpStream)> {
    Box::pin(async move {
        match connect_app(&ctx, &pod, &attrs, dst).await {
            Ok(app) => match pending.accept() {
                Ok(stream) => Ok((stream, app)),
                Err(e) => Err(ProxyError::ClientReset(e)),
            },
            Err(e) => {
                pending.refuse(StatusCode::SERVICE_UNAVAILABLE);
                Err(e)
            }
        }
    })
}

/// Registers a live connection so a policy change that denies `attrs`
/// closes it.
fn register(
    ctx: &ProxyContext,
    pod: &PodContext,
    attrs: ConnectionAttrs,
) -> (super::live::Registration, super::live::Revoked) {
    ctx.live
        .register(attrs, pod.namespace_arc(), pod.name_arc())
}

/// Connects to the app from inside the pod, from the client's IP when
/// delivery is transparent.
async fn connect_app(
    ctx: &ProxyContext,
    pod: &PodContext,
    attrs: &ConnectionAttrs,
    dst: SocketAddr,
) -> Result<TcpStream, ProxyError> {
    let from = ctx
        .cfg
        .inbound_transparent
        .then(|| attrs.src_ip.to_canonical());
    pod.connect(ctx, dst, from).await
}

/// A plaintext connection the pod accepts: what [`plaintext`] delivers.
struct Accepted {
    result: ConnectionResult,
    tcp: TcpStream,
    attrs: ConnectionAttrs,
    dst: SocketAddr,
}

/// One redirected plaintext connection: checked and recorded by
/// [`accept_plaintext`] (plain code, when the task first runs: see
/// [`deferred`]), then delivered; `None` when it was refused or its
/// destination cannot be read (recorded or logged). An `async move` block
/// that uses what it captured in place: an async fn would keep the setup's
/// values twice for the connection's life.
fn plaintext(
    ctx: Arc<ProxyContext>,
    pod: Arc<PodContext>,
    tcp: TcpStream,
    src: SocketAddr,
) -> Option<impl Future<Output = ()> + Send + 'static> {
    let guard = pod.guard();
    let Accepted {
        result,
        mut tcp,
        attrs,
        dst,
    } = accept_plaintext(&ctx, &pod, tcp, src)?;
    let span = result.span().clone();
    let (registration, revoked) = register(&ctx, &pod, attrs.clone());
    let (c, p) = (ctx.clone(), pod.clone());
    let open: Opening<'static, TcpStream> =
        Box::pin(async move { connect_app(&c, &p, &attrs, dst).await });
    let delivery = async move {
        // The pod's guard and the live registration last as long as the
        // connection.
        let _running = (&guard, &registration);
        let outcome = open_then_copy(open, |app| {
            copy_until_drained(&pod, &mut tcp, app, &ctx.cfg.copy, Some(revoked))
        })
        .await;
        finish(result, outcome);
    };
    Some(delivery.instrument(span))
}

/// Checks a plaintext connection (its destination, the pod's policy) and
/// opens its record; a refused one is closed with a reset and recorded
/// here (`None`), as is one whose destination cannot be read (logged).
fn accept_plaintext(
    ctx: &ProxyContext,
    pod: &PodContext,
    tcp: TcpStream,
    src: SocketAddr,
) -> Option<Accepted> {
    let dst = match original_dst(&tcp) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(pod = %pod, %src, error = %ProxyError::OriginalDst(e), "inbound connection dropped");
            return None;
        }
    };
    let snap = ctx.state.load();
    let dst_w = pod.workload_at(ctx, &snap, dst.ip());
    let open = inbound_open(ctx, pod, &snap, src, dst, dst_w.as_deref(), None);
    let attrs = ConnectionAttrs::plaintext(src.ip(), dst.ip(), dst.port());
    let refused = if is_own_port(ctx, dst.port()) {
        Some(ProxyError::Loop(dst))
    } else {
        match &dst_w {
            None => Some(ProxyError::NotThisPod {
                addr: dst,
                pod: pod.to_string(),
            }),
            Some(w) => match ctx.policies.evaluate(&snap, w, &attrs) {
                Decision::Allow => None,
                Decision::Deny { policy } => Some(ProxyError::Denied {
                    policy: policy.to_string(),
                }),
            },
        }
    };
    drop(snap);
    let result = ConnectionResult::new(open, &ctx.metrics);
    if let Some(e) = refused {
        // A reset tells the client at once that it was refused.
        let _ = socket2::SockRef::from(&tcp).set_linger(Some(Duration::ZERO));
        drop(tcp);
        // The record's line is logged inside its span, as for a delivered one.
        let span = result.span().clone();
        span.in_scope(|| finish(result, Err(e)));
        return None;
    }
    Some(Accepted {
        result,
        tcp,
        attrs,
        dst,
    })
}

#[cfg(test)]
#[allow(unreachable_code, clippy::diverging_sub_expression)]
mod task_size {
    /// As for outbound (`outbound::task_size`): 696 bytes per HBONE stream
    /// and 744 per plaintext connection today, each plus its boxed copy (a
    /// debug build).
    #[test]
    fn inbound_connection_tasks_stay_small() {
        let stream = crate::test_support::future_size(&|| {
            super::deferred(|| Some(super::hbone_stream(todo!(), todo!(), todo!(), todo!())))
        });
        assert!(stream <= 896, "inbound HBONE stream task: {stream} bytes");
        let plaintext = crate::test_support::future_size(&|| {
            super::deferred(|| super::plaintext(todo!(), todo!(), todo!(), todo!()))
        });
        assert!(
            plaintext <= 896,
            "inbound plaintext task: {plaintext} bytes"
        );
    }
}
