//! Where an outbound connection goes: a service VIP picks one healthy
//! endpoint (round robin) and maps the port; a workload IP goes to that
//! workload; anything else passes through to where it was addressed.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::state::{HealthStatus, Service, StateSnapshot, TunnelProtocol, Workload};

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
}

/// Resolves `dst` in `snap` on `network`; `round_robin` is the cursor that spreads picks over endpoints.
pub fn resolve(
    snap: &StateSnapshot,
    network: &str,
    dst: SocketAddr,
    round_robin: &AtomicUsize,
) -> Resolved {
    let ip = dst.ip().to_canonical();
    if let Some(service) = snap.service_by_vip(network, ip) {
        return pick_endpoint(snap, network, service, dst.port(), round_robin);
    }
    match snap.workload_by_ip(network, ip) {
        Some(w) => to_workload(w, SocketAddr::new(ip, dst.port()), None),
        None => Resolved::Direct {
            workload: None,
            addr: dst,
            service: None,
        },
    }
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
