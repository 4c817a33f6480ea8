//! Where an outbound connection goes.
//!
//! * A service VIP whose Service names a waypoint goes to that waypoint
//!   (one of its healthy pods, round robin), over HBONE with the VIP:port
//!   as the CONNECT authority: the waypoint, not ztunnel, picks the
//!   endpoint. Otherwise one healthy endpoint is picked (round robin) and
//!   the service port mapped to the endpoint's target port.
//! * A pod IP whose Workload names a waypoint goes to that waypoint the
//!   same way (authority pod IP:port); otherwise to that workload.
//! * A connection from the waypoint itself is never sent back to it.
//! * Anything else passes through to where it was addressed.
//!
//! A waypoint that cannot be found or has no healthy pod is an error
//! ([`Resolved::NoWaypoint`]): traffic bound to a waypoint is never sent
//! around it (its L7 policy would be bypassed).

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::state::{
    GatewayAddress, GatewayDestination, HealthStatus, NetworkAddress, Service, StateSnapshot,
    TunnelProtocol, Workload,
};

/// HBONE port of a waypoint whose address does not name one (Istio's).
pub const DEFAULT_WAYPOINT_PORT: u16 = 15008;

/// The outcome of [`resolve`].
#[derive(Debug, Clone)]
pub enum Resolved {
    /// A mesh workload, reached over HBONE at `addr` (its IP and the target
    /// port; the tunnel goes to the IP's HBONE port).
    Hbone {
        workload: Arc<Workload>,
        addr: SocketAddr,
        service: Option<Arc<Service>>,
    },
    /// A workload outside the mesh, or an address xDS does not know: plain
    /// TCP to `addr`.
    Direct {
        workload: Option<Arc<Workload>>,
        addr: SocketAddr,
        service: Option<Arc<Service>>,
    },
    /// A service VIP with no healthy endpoint serving `port`.
    NoEndpoint { service: Arc<Service>, port: u16 },
    /// The destination is bound to a waypoint: HBONE to the waypoint pod
    /// at `addr` (its IP and HBONE port), CONNECT authority `target` (the
    /// original destination), the peer verified as the waypoint's identity.
    Waypoint {
        waypoint: Arc<Workload>,
        addr: SocketAddr,
        target: SocketAddr,
        /// The service the client addressed, if a VIP.
        service: Option<Arc<Service>>,
        /// The workload the client addressed, if a pod IP.
        workload: Option<Arc<Workload>>,
    },
    /// The destination is bound to a waypoint that cannot be reached.
    NoWaypoint {
        gateway: GatewayAddress,
        target: SocketAddr,
        service: Option<Arc<Service>>,
        workload: Option<Arc<Workload>>,
        why: WaypointMissing,
    },
}

/// Why a waypoint could not be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaypointMissing {
    /// xDS knows no service or workload at the waypoint's address.
    Unknown,
    /// Its service has no healthy pod with an address on our network.
    NoHealthyPod,
}

impl fmt::Display for WaypointMissing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WaypointMissing::Unknown => "no such service or workload is known to ztunnel",
            WaypointMissing::NoHealthyPod => "it has no healthy pod on this network",
        })
    }
}

/// Shows where a waypoint is (`namespace/hostname` or `network/ip`).
pub fn gateway_name(g: &GatewayAddress) -> String {
    match &g.destination {
        GatewayDestination::Hostname {
            namespace,
            hostname,
        } => format!("{namespace}/{hostname}"),
        GatewayDestination::Address(a) => a.to_string(),
    }
}

/// Resolves `dst` in `snap` on `network` for a connection from `src` (the
/// source workload, when known); `round_robin` is the cursor that spreads
/// picks over endpoints and waypoint pods.
pub fn resolve(
    snap: &StateSnapshot,
    network: &str,
    src: Option<&Workload>,
    dst: SocketAddr,
    round_robin: &AtomicUsize,
) -> Resolved {
    let ip = dst.ip().to_canonical();
    let target = SocketAddr::new(ip, dst.port());
    if let Some(service) = snap.service_by_vip(network, ip) {
        if let Some(gw) = service.waypoint.clone() {
            let bound = Bound {
                target,
                service: Some(service.clone()),
                workload: None,
            };
            if let Some(r) = via_waypoint(snap, network, src, gw, bound, round_robin) {
                return r;
            }
        }
        return pick_endpoint(snap, network, service, dst.port(), round_robin);
    }
    match snap.workload_by_ip(network, ip) {
        Some(w) => {
            if let Some(gw) = w.waypoint.clone() {
                let bound = Bound {
                    target,
                    service: None,
                    workload: Some(w.clone()),
                };
                if let Some(r) = via_waypoint(snap, network, src, gw, bound, round_robin) {
                    return r;
                }
            }
            to_workload(w, target, None)
        }
        None => Resolved::Direct {
            workload: None,
            addr: dst,
            service: None,
        },
    }
}

/// A destination bound to a waypoint: the original destination and what
/// it is.
struct Bound {
    target: SocketAddr,
    service: Option<Arc<Service>>,
    workload: Option<Arc<Workload>>,
}

/// The waypoint route for a bound destination, or `None` when the source
/// is one of the waypoint's own pods (its traffic goes on directly, never
/// back into the waypoint).
fn via_waypoint(
    snap: &StateSnapshot,
    network: &str,
    src: Option<&Workload>,
    gateway: GatewayAddress,
    bound: Bound,
    round_robin: &AtomicUsize,
) -> Option<Resolved> {
    if src.is_some_and(|s| is_pod_of(snap, s, &gateway)) {
        return None;
    }
    let Bound {
        target,
        service,
        workload,
    } = bound;
    let mut pods = match waypoint_pods(snap, network, &gateway) {
        Ok(pods) => pods,
        Err(why) => {
            return Some(Resolved::NoWaypoint {
                gateway,
                target,
                service,
                workload,
                why,
            });
        }
    };
    let k = round_robin.fetch_add(1, Ordering::Relaxed) % pods.len();
    let (waypoint, ip) = pods.swap_remove(k);
    let port = match gateway.hbone_mtls_port {
        0 => DEFAULT_WAYPOINT_PORT,
        p => p,
    };
    Some(Resolved::Waypoint {
        waypoint,
        addr: SocketAddr::new(ip, port),
        target,
        service,
        workload,
    })
}

/// The waypoint pods of a gateway address: the healthy endpoints of its
/// service (by hostname, or by VIP), or the workload at its IP; never
/// empty.
fn waypoint_pods(
    snap: &StateSnapshot,
    network: &str,
    gateway: &GatewayAddress,
) -> Result<Vec<(Arc<Workload>, IpAddr)>, WaypointMissing> {
    let service = match &gateway.destination {
        GatewayDestination::Hostname {
            namespace,
            hostname,
        } => Some(
            snap.service_by_hostname(&format!("{namespace}/{hostname}"))
                .ok_or(WaypointMissing::Unknown)?,
        ),
        GatewayDestination::Address(a) => snap.service_by_vip(&a.network, a.ip),
    };
    let usable = |w: &Workload| w.status == HealthStatus::Healthy && &*w.network == network;
    let Some(service) = service else {
        let GatewayDestination::Address(a) = &gateway.destination else {
            return Err(WaypointMissing::Unknown);
        };
        let w = snap
            .workload_by_addr(&NetworkAddress::new(a.network.clone(), a.ip))
            .ok_or(WaypointMissing::Unknown)?;
        if !usable(&w) {
            return Err(WaypointMissing::NoHealthyPod);
        }
        return Ok(vec![(w, a.ip)]);
    };
    let pods: Vec<(Arc<Workload>, IpAddr)> = snap
        .endpoint_set(&service.key())
        .into_iter()
        .flat_map(|set| set.values())
        .filter_map(|ep| {
            let w = snap.workload_by_uid(&ep.workload_uid)?;
            let ip = *w.ips.first()?;
            usable(&w).then_some((w, ip))
        })
        .collect();
    if pods.is_empty() {
        return Err(WaypointMissing::NoHealthyPod);
    }
    Ok(pods)
}

/// Whether `w` is one of the pods of the waypoint at `gateway` (healthy or
/// not): a member of its service, or the workload at its address.
fn is_pod_of(snap: &StateSnapshot, w: &Workload, gateway: &GatewayAddress) -> bool {
    match &gateway.destination {
        GatewayDestination::Hostname {
            namespace,
            hostname,
        } => w.services.contains_key(&format!("{namespace}/{hostname}")),
        GatewayDestination::Address(a) => match snap.service_by_vip(&a.network, a.ip) {
            Some(svc) => w.services.contains_key(&svc.key()),
            None => w.network == a.network && w.ips.contains(&a.ip),
        },
    }
}

/// Whether `src` is a pod of a waypoint `dst` is bound to (its own, or
/// one of its services'): how an inbound connection shows that it came
/// through the destination's waypoint.
pub fn is_waypoint_of(snap: &StateSnapshot, src: &Workload, dst: &Workload) -> bool {
    let services = dst
        .services
        .keys()
        .filter_map(|k| snap.service_by_hostname(k))
        .filter_map(|s| s.waypoint.clone());
    dst.waypoint
        .clone()
        .into_iter()
        .chain(services)
        .any(|gw| is_pod_of(snap, src, &gw))
}

fn to_workload(w: Arc<Workload>, addr: SocketAddr, service: Option<Arc<Service>>) -> Resolved {
    if w.protocol == TunnelProtocol::Hbone {
        Resolved::Hbone {
            workload: w,
            addr,
            service,
        }
    } else {
        Resolved::Direct {
            workload: Some(w),
            addr,
            service,
        }
    }
}

fn pick_endpoint(
    snap: &StateSnapshot,
    network: &str,
    service: Arc<Service>,
    port: u16,
    round_robin: &AtomicUsize,
) -> Resolved {
    let Some(mapping) = service.ports.iter().find(|p| p.service_port == port) else {
        return Resolved::NoEndpoint { service, port };
    };
    let svc_target = if mapping.target_port == 0 {
        port
    } else {
        mapping.target_port
    };
    let Some(endpoints) = snap.endpoint_set(&service.key()) else {
        return Resolved::NoEndpoint { service, port };
    };
    // (workload, its address on our network, target port)
    let usable = || {
        endpoints.values().filter_map(|ep| {
            let w = snap.workload_by_uid(&ep.workload_uid)?;
            if w.status != HealthStatus::Healthy || &*w.network != network {
                return None;
            }
            let ip: IpAddr = *w.ips.first()?;
            let target = ep
                .ports
                .iter()
                .find(|p| p.service_port == port && p.target_port != 0)
                .map_or(svc_target, |p| p.target_port);
            Some((w, SocketAddr::new(ip, target)))
        })
    };
    let n = usable().count();
    if n == 0 {
        return Resolved::NoEndpoint { service, port };
    }
    let k = round_robin.fetch_add(1, Ordering::Relaxed) % n;
    match usable().nth(k) {
        Some((w, addr)) => to_workload(w, addr, Some(service)),
        None => Resolved::NoEndpoint { service, port },
    }
}

#[cfg(test)]
#[path = "resolve_tests.rs"]
mod tests;
