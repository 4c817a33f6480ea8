//! Outbound (:15001 in the pod): the app's redirected connections. The
//! original destination comes from `SO_ORIGINAL_DST`; [`super::resolve`]
//! decides where it goes; mesh workloads are reached over pooled HBONE
//! with the source pod's certificate, everything else over plain TCP from
//! inside the pod.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ambit_inpod::{NetnsSockets, SocketOptions};
use hyper::http::{HeaderMap, HeaderValue};
use tokio::net::{TcpListener, TcpStream};
use tracing::Instrument;

use super::connection::{
    Opening, accept_loop, copy_until_drained, deferred, finish, open_then_copy, original_dst,
};
use super::metrics::{ConnectionOpen, ConnectionResult, Reporter, SecurityPolicy, ServiceInfo};
use super::resolve::gateway_name;
use super::{
    PodContext, ProxyContext, ProxyError, Resolved, peer_info, resolve, workload_identity,
};
use crate::hbone::{DialFuture, Dialer, PoolKey, PooledStream};
use crate::state::{Service, Workload};

/// Serves the pod's outbound listener until the pod drains.
pub async fn serve(listener: TcpListener, pod: Arc<PodContext>, ctx: Arc<ProxyContext>) {
    let local = listener.local_addr().ok();
    let p = pod.clone();
    accept_loop(listener, p, "outbound", move |stream, peer| {
        let (ctx, pod) = (ctx.clone(), pod.clone());
        deferred(move || handle(ctx, pod, stream, peer, local))
    })
    .await;
}

/// Dials HBONE peers from inside the source pod, marked.
struct PodDialer {
    sockets: NetnsSockets,
    mark: u32,
}

impl Dialer for PodDialer {
    fn dial(&self, dst: SocketAddr) -> DialFuture {
        let sockets = self.sockets.clone();
        let opts = SocketOptions {
            mark: Some(self.mark),
            ..SocketOptions::default()
        };
        Box::pin(async move { sockets.connect(dst, &opts).await })
    }
}

/// One redirected connection: set up by [`prepare`] (plain code, when the
/// task first runs: see [`deferred`]), then carried by [`run`]; `None` when
/// its original destination cannot be read (logged). An async fn that set
/// the connection up itself would keep its setup values (moved into `run`
/// or not) in its own state for the connection's whole life (rustc's async
/// layout).
fn handle(
    ctx: Arc<ProxyContext>,
    pod: Arc<PodContext>,
    downstream: TcpStream,
    src: SocketAddr,
    listener: Option<SocketAddr>,
) -> Option<impl Future<Output = ()> + Send + 'static> {
    let guard = pod.guard();
    let (result, setup) = prepare(&ctx, &pod, &downstream, src)?;
    let span = result.span().clone();
    let open = open_upstream(ctx.clone(), pod.clone(), setup, listener);
    Some(run(ctx, pod, guard, downstream, open, result).instrument(span))
}

/// What [`prepare`] decided about where a connection goes.
struct Setup {
    resolved: Resolved,
    src: SocketAddr,
    src_w: Option<Arc<Workload>>,
    src_id: crate::identity::Identity,
    trace_id: Option<u128>,
}

/// Resolves where the connection goes and opens its record (metrics,
/// span, `/connections`); `None` (logged) when its original destination
/// cannot be read.
fn prepare(
    ctx: &ProxyContext,
    pod: &PodContext,
    downstream: &TcpStream,
    src: SocketAddr,
) -> Option<(ConnectionResult, Setup)> {
    let dst = match original_dst(downstream) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(pod = %pod, %src, error = %ProxyError::OriginalDst(e), "outbound connection dropped");
            return None;
        }
    };
    let snap = ctx.state.load();
    let src_w = snap.workload_by_ip(&ctx.network, src.ip().to_canonical());
    let own = src_w.as_deref().filter(|w| pod.matches_workload(w));
    let src_id = own
        .map(workload_identity)
        .unwrap_or_else(|| pod.identity(ctx, &snap));
    let resolved = resolve(&snap, &ctx.network, own, dst, &ctx.round_robin);
    drop(snap);
    // Who the proxy connects to (the peer mTLS verifies), where, and
    // through which waypoint.
    let (peer_w, service, mtls, upstream, waypoint) = match &resolved {
        Resolved::Hbone {
            workload,
            service,
            addr,
        } => (
            Some(workload.clone()),
            service.clone(),
            true,
            Some(SocketAddr::new(addr.ip(), ctx.cfg.hbone_port)),
            None,
        ),
        Resolved::Direct {
            workload,
            service,
            addr,
        } => (
            workload.clone(),
            service.clone(),
            false,
            (*addr != dst).then_some(*addr),
            None,
        ),
        Resolved::NoEndpoint { service, .. } => (None, Some(service.clone()), false, None, None),
        Resolved::Waypoint {
            waypoint,
            addr,
            service,
            ..
        } => (
            Some(waypoint.clone()),
            service.clone(),
            true,
            Some(*addr),
            Some(format!("{}/{}", waypoint.namespace, waypoint.name)),
        ),
        Resolved::NoWaypoint {
            workload,
            service,
            gateway,
            ..
        } => (
            workload.clone(),
            service.clone(),
            false,
            None,
            Some(gateway_name(gateway)),
        ),
    };
    let dst_id = peer_w.as_deref().filter(|_| mtls).map(workload_identity);
    // The CONNECT's trace id: the peer's inbound record carries it too.
    let trace_id = matches!(resolved, Resolved::Hbone { .. } | Resolved::Waypoint { .. })
        .then(|| rand::random::<u128>().max(1));
    let open = ConnectionOpen {
        reporter: Reporter::Source,
        src,
        dst,
        source: peer_info(src_w.as_deref(), Some(&src_id)),
        destination: peer_info(peer_w.as_deref(), dst_id.as_ref()),
        destination_service: service.as_deref().map(service_info),
        security: if mtls {
            SecurityPolicy::MutualTls
        } else {
            SecurityPolicy::None
        },
        upstream,
        waypoint,
        trace_id,
        hbone_peer: None,
    };
    let setup = Setup {
        resolved,
        src,
        src_w,
        src_id,
        trace_id,
    };
    Some((ConnectionResult::new(open, &ctx.metrics), setup))
}

/// Where a connection's upstream was opened: a socket dialled from the pod
/// (plain TCP) or a CONNECT stream on a pooled HBONE connection.
enum Upstream {
    Tcp(TcpStream),
    Hbone(PooledStream),
}

/// Opens a connection's upstream: the resolution, identities, CONNECT
/// headers, certificate fetch and pool checkout live only in its box.
type OpenUpstream = Opening<'static, Upstream>;

/// Opens the upstream `resolved` names (see [`OpenUpstream`]).
fn open_upstream(
    ctx: Arc<ProxyContext>,
    pod: Arc<PodContext>,
    conn: Setup,
    listener: Option<SocketAddr>,
) -> OpenUpstream {
    Box::pin(async move {
        let (ctx, pod) = (&*ctx, &*pod);
        let src = conn.src;
        match conn.resolved {
            Resolved::NoEndpoint { service, port } => Err(ProxyError::NoHealthyEndpoint {
                service: service.hostname.clone(),
                port,
            }),
            Resolved::Direct { addr, .. } => {
                if is_loop(addr, listener, ctx) {
                    Err(ProxyError::Loop(addr))
                } else {
                    Ok(Upstream::Tcp(pod.connect(ctx, addr, None).await?))
                }
            }
            Resolved::Hbone { addr, workload, .. } => {
                let headers = headers(src.ip(), conn.src_w.as_deref(), conn.trace_id);
                let peer = SocketAddr::new(addr.ip(), ctx.cfg.hbone_port);
                let id = workload_identity(&workload);
                open_hbone(ctx, pod, src, &conn.src_id, id, peer, addr, headers).await
            }
            // The waypoint decides where the connection goes: the tunnel
            // carries the original destination as its authority, and the
            // peer must prove the waypoint's identity.
            Resolved::Waypoint {
                waypoint,
                addr,
                target,
                ..
            } => {
                let headers = headers(src.ip(), conn.src_w.as_deref(), conn.trace_id);
                let id = workload_identity(&waypoint);
                open_hbone(ctx, pod, src, &conn.src_id, id, addr, target, headers).await
            }
            Resolved::NoWaypoint {
                gateway,
                target,
                why,
                ..
            } => Err(ProxyError::NoWaypoint {
                waypoint: gateway_name(&gateway),
                target,
                why,
            }),
        }
    })
}

/// Opens the upstream, copies until the connection ends, then records how
/// it ended. An `async move` block, not an `async fn` (which would keep
/// each argument twice for the connection's life): the captured values are
/// used in place.
#[allow(clippy::manual_async_fn)] // an async fn would hold its arguments twice
fn run(
    ctx: Arc<ProxyContext>,
    pod: Arc<PodContext>,
    guard: super::pod::ConnGuard,
    mut downstream: TcpStream,
    open: OpenUpstream,
    result: ConnectionResult,
) -> impl Future<Output = ()> + Send + 'static {
    async move {
        // The pod's guard lives as long as the connection.
        let _running = &guard;
        let outcome = open_then_copy(open, |up| copy_to(&ctx, &pod, &mut downstream, up)).await;
        // A failure before the first byte closes the app's connection with a
        // reset, so it learns at once that its destination could not be
        // reached (as a direct connect would have told it) — after the outcome
        // is recorded (access log, metrics).
        let refused =
            matches!(&outcome, Err(e) if !matches!(e, ProxyError::Copy(_) | ProxyError::Drained));
        if refused {
            let _ = socket2::SockRef::from(&downstream).set_linger(Some(std::time::Duration::ZERO));
        }
        finish(result, outcome);
        drop(downstream);
    }
}

/// The copy between the app's socket and its opened upstream.
fn copy_to<'a>(
    ctx: &'a ProxyContext,
    pod: &'a PodContext,
    downstream: &'a mut TcpStream,
    upstream: Upstream,
) -> impl Future<Output = Result<(u64, u64), ProxyError>> + 'a {
    use futures::future::Either;
    let cfg = &ctx.cfg.copy;
    match upstream {
        Upstream::Tcp(s) => Either::Left(copy_until_drained(pod, downstream, s, cfg, None)),
        Upstream::Hbone(s) => Either::Right(copy_until_drained(pod, downstream, s, cfg, None)),
    }
}

fn is_loop(addr: SocketAddr, listener: Option<SocketAddr>, ctx: &ProxyContext) -> bool {
    let ports = [
        ctx.cfg.outbound_port,
        ctx.cfg.inbound_plaintext_port,
        ctx.cfg.hbone_port,
    ];
    addr.ip().is_loopback()
        || addr.ip().is_unspecified()
        || (ports.contains(&addr.port()) && listener.is_some_and(|l| l.port() == addr.port()))
}

/// A CONNECT stream to `peer` (a pod's or a waypoint's HBONE address)
/// verified as `dst_id`, with `target` as the authority, on a pooled HBONE
/// connection (runs inside [`OpenUpstream`]'s box).
#[allow(clippy::too_many_arguments)]
async fn open_hbone(
    ctx: &ProxyContext,
    pod: &PodContext,
    src: SocketAddr,
    src_id: &crate::identity::Identity,
    dst_id: crate::identity::Identity,
    peer: SocketAddr,
    target: SocketAddr,
    headers: HeaderMap,
) -> Result<Upstream, ProxyError> {
    let cert = ctx.certificate(src_id).await?;
    let key = PoolKey {
        src: src_id.clone(),
        dst: dst_id.clone(),
        dst_ip: peer.ip(),
        src_ip: Some(src.ip()),
    };
    let dialer = PodDialer {
        sockets: pod.sockets.clone(),
        mark: ctx.cfg.mark,
    };
    let stream = ctx
        .pool
        .stream(
            key,
            peer,
            &dialer,
            || ctx.client_config(&cert, &dst_id),
            target,
            headers,
        )
        .await
        .map_err(|source| ProxyError::Hbone { target, source })?;
    Ok(Upstream::Hbone(stream))
}

fn service_info(s: &Service) -> ServiceInfo {
    ServiceInfo {
        hostname: s.hostname.clone(),
        name: s.name.clone(),
        namespace: s.namespace.clone(),
    }
}

/// `baggage`, `forwarded` and `traceparent` (with `trace_id`, else a
/// random one) of a CONNECT.
fn headers(src_ip: IpAddr, src: Option<&Workload>, trace_id: Option<u128>) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(3);
    if let Some(w) = src {
        let mut baggage = format!(
            "k8s.cluster.name={},k8s.namespace.name={}",
            w.cluster_id, w.namespace
        );
        if !w.workload_name.is_empty() {
            baggage.push_str(",k8s.deployment.name=");
            baggage.push_str(&w.workload_name);
        }
        if !w.canonical_name.is_empty() {
            baggage.push_str(",service.name=");
            baggage.push_str(&w.canonical_name);
        }
        if !w.canonical_revision.is_empty() {
            baggage.push_str(",service.version=");
            baggage.push_str(&w.canonical_revision);
        }
        if let Ok(v) = HeaderValue::from_str(&baggage) {
            h.insert("baggage", v);
        }
    }
    let forwarded = match src_ip {
        IpAddr::V4(ip) => format!("for={ip}"),
        IpAddr::V6(ip) => format!("for=\"[{ip}]\""),
    };
    if let Ok(v) = HeaderValue::from_str(&forwarded) {
        h.insert("forwarded", v);
    }
    let trace: u128 = trace_id.unwrap_or_else(|| rand::random::<u128>().max(1));
    let span: u64 = rand::random::<u64>().max(1);
    if let Ok(v) = HeaderValue::from_str(&format!("00-{trace:032x}-{span:016x}-01")) {
        h.insert("traceparent", v);
    }
    h
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn connect_carries_baggage_forwarded_and_traceparent() {
        let w = Workload {
            uid: "Kubernetes//Pod/ai/client-0".into(),
            name: "client-0".into(),
            namespace: "ai".into(),
            ips: vec![],
            hostname: String::new(),
            network: "".into(),
            protocol: crate::state::TunnelProtocol::Hbone,
            trust_domain: String::new(),
            service_account: "client".into(),
            waypoint: None,
            network_gateway: None,
            node: "node-1".into(),
            canonical_name: "client".into(),
            canonical_revision: "v2".into(),
            workload_type: Default::default(),
            workload_name: "client".into(),
            native_tunnel: false,
            services: Default::default(),
            authorization_policies: vec![],
            status: crate::state::HealthStatus::Healthy,
            cluster_id: "Kubernetes".into(),
            locality: None,
            host_network: false,
            capacity: 1,
        };
        let h = headers("10.1.2.3".parse().unwrap(), Some(&w), Some(0xab));
        assert_eq!(
            h["baggage"],
            "k8s.cluster.name=Kubernetes,k8s.namespace.name=ai,k8s.deployment.name=client,service.name=client,service.version=v2"
        );
        assert_eq!(h["forwarded"], "for=10.1.2.3");
        let tp = h["traceparent"].to_str().unwrap();
        let parts: Vec<&str> = tp.split('-').collect();
        assert_eq!(parts.len(), 4, "{tp}");
        assert_eq!(
            (parts[0], parts[1].len(), parts[2].len(), parts[3]),
            ("00", 32, 16, "01")
        );
        assert_eq!(parts[1], format!("{:032x}", 0xab));
        let v6 = headers("fd00::1".parse().unwrap(), None, None);
        assert_eq!(v6["forwarded"], "for=\"[fd00::1]\"");
        assert!(v6.get("baggage").is_none());
    }
}

#[cfg(test)]
#[allow(unreachable_code, clippy::diverging_sub_expression)]
mod task_size {
    use tokio::net::TcpStream;

    use crate::hbone::PooledStream;

    /// A connection's task is as large as its future for the connection's
    /// whole life (benches/README.md, "Data plane against the floor", levers
    /// (k) and (m)): an `async fn` wrapper or setup state kept across the
    /// copy adds hundreds of bytes to every open connection. 720 bytes today
    /// for the task and 544 for its boxed copy (a debug build; release sizes
    /// are within a few percent).
    #[test]
    fn an_outbound_connection_task_stays_small() {
        let size = crate::test_support::future_size(&|| {
            super::deferred(|| super::handle(todo!(), todo!(), todo!(), todo!(), todo!()))
        });
        assert!(size <= 896, "outbound connection task: {size} bytes");
        let copy = crate::test_support::future_size(&|| {
            crate::copy::copy_bidirectional::<&mut TcpStream, PooledStream>(
                todo!(),
                todo!(),
                todo!(),
            )
        });
        assert!(copy <= 544, "outbound copy: {copy} bytes");
    }
}
