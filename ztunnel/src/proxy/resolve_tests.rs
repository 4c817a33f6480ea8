#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;

use ambit_proto::workload as xds;

use super::*;
use crate::state::Address;

const SVC: &str = "default/web.default.svc.cluster.local";

fn ip_bytes(s: &str) -> Vec<u8> {
    match s.parse::<IpAddr>().unwrap() {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn workload(name: &str, ip: &str, hbone: bool, healthy: bool, target: u32) -> Address {
    let mut services = HashMap::new();
    services.insert(
        SVC.to_string(),
        xds::PortList {
            ports: vec![xds::Port {
                service_port: 80,
                target_port: target,
            }],
        },
    );
    let w = xds::Workload {
        uid: format!("Kubernetes//Pod/default/{name}"),
        name: name.into(),
        namespace: "default".into(),
        addresses: vec![ip_bytes(ip)],
        tunnel_protocol: if hbone {
            xds::TunnelProtocol::Hbone as i32
        } else {
            xds::TunnelProtocol::None as i32
        },
        status: if healthy {
            xds::WorkloadStatus::Healthy as i32
        } else {
            xds::WorkloadStatus::Unhealthy as i32
        },
        services,
        ..Default::default()
    };
    Address::Workload(Box::new(Workload::try_from(&w).unwrap()))
}

fn snapshot(workloads: Vec<Address>) -> StateSnapshot {
    let mut s = StateSnapshot::default();
    let svc = xds::Service {
        name: "web".into(),
        namespace: "default".into(),
        hostname: "web.default.svc.cluster.local".into(),
        addresses: vec![xds::NetworkAddress {
            network: String::new(),
            address: ip_bytes("10.96.0.1"),
        }],
        ports: vec![xds::Port {
            service_port: 80,
            target_port: 8080,
        }],
        ..Default::default()
    };
    s.apply_address(
        SVC,
        "v1",
        Address::Service(Box::new(Service::try_from(&svc).unwrap())),
    );
    for (i, w) in workloads.into_iter().enumerate() {
        s.apply_address(&format!("w{i}"), "v1", w);
    }
    s
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

#[test]
fn vip_round_robins_over_healthy_endpoints_with_port_mapping() {
    let snap = snapshot(vec![
        workload("a", "10.0.0.1", true, true, 0),
        workload("b", "10.0.0.2", true, true, 9090),
        workload("sick", "10.0.0.3", true, false, 0),
    ]);
    let round_robin = AtomicUsize::new(0);
    let mut seen = HashSet::new();
    for _ in 0..10 {
        match resolve(&snap, "", None, addr("10.96.0.1:80"), &round_robin) {
            Resolved::Hbone {
                workload,
                addr,
                service,
            } => {
                assert_eq!(service.unwrap().name, "web");
                // The service maps 80→8080; b overrides it with 9090.
                let want = if workload.name == "b" { 9090 } else { 8080 };
                assert_eq!(addr.port(), want, "{}", workload.name);
                assert_eq!(addr.ip(), workload.ips[0]);
                seen.insert(workload.name.clone());
            }
            other => panic!("expected an HBONE endpoint, got {other:?}"),
        }
    }
    assert_eq!(seen, HashSet::from(["a".to_string(), "b".to_string()]));
}

#[test]
fn vip_without_a_usable_endpoint_or_port_is_no_endpoint() {
    let snap = snapshot(vec![workload("sick", "10.0.0.3", true, false, 0)]);
    let round_robin = AtomicUsize::new(0);
    assert!(matches!(
        resolve(&snap, "", None, addr("10.96.0.1:80"), &round_robin),
        Resolved::NoEndpoint { port: 80, .. }
    ));
    let snap = snapshot(vec![workload("a", "10.0.0.1", true, true, 0)]);
    assert!(matches!(
        resolve(&snap, "", None, addr("10.96.0.1:443"), &round_robin),
        Resolved::NoEndpoint { port: 443, .. }
    ));
}

#[test]
fn pod_ips_go_to_their_workload_and_unknown_addresses_pass_through() {
    let snap = snapshot(vec![
        workload("mesh", "10.0.0.1", true, true, 0),
        workload("plain", "10.0.0.2", false, true, 0),
    ]);
    let round_robin = AtomicUsize::new(0);
    match resolve(&snap, "", None, addr("10.0.0.1:7000"), &round_robin) {
        Resolved::Hbone {
            workload,
            addr: a,
            service,
        } => {
            assert_eq!(workload.name, "mesh");
            assert_eq!(a, addr("10.0.0.1:7000"));
            assert!(service.is_none());
        }
        other => panic!("{other:?}"),
    }
    match resolve(&snap, "", None, addr("10.0.0.2:7000"), &round_robin) {
        Resolved::Direct {
            workload, addr: a, ..
        } => {
            assert_eq!(workload.unwrap().name, "plain");
            assert_eq!(a, addr("10.0.0.2:7000"));
        }
        other => panic!("{other:?}"),
    }
    match resolve(&snap, "", None, addr("192.0.2.1:443"), &round_robin) {
        Resolved::Direct {
            workload, addr: a, ..
        } => {
            assert!(workload.is_none());
            assert_eq!(a, addr("192.0.2.1:443"));
        }
        other => panic!("{other:?}"),
    }
}

// ---- waypoints ----

const WP_SVC: &str = "default/waypoint.default.svc.cluster.local";

fn gateway(hostname: &str) -> xds::GatewayAddress {
    xds::GatewayAddress {
        destination: Some(xds::gateway_address::Destination::Hostname(
            xds::NamespacedHostname {
                namespace: "default".into(),
                hostname: hostname.into(),
            },
        )),
        hbone_mtls_port: 15008,
    }
}

/// A workload backing `services` (key → (service port, target port)).
fn member(
    name: &str,
    ip: &str,
    healthy: bool,
    services: &[(&str, u32, u32)],
    waypoint: Option<xds::GatewayAddress>,
) -> Address {
    let services = services
        .iter()
        .map(|(k, sp, tp)| {
            (
                k.to_string(),
                xds::PortList {
                    ports: vec![xds::Port {
                        service_port: *sp,
                        target_port: *tp,
                    }],
                },
            )
        })
        .collect();
    let w = xds::Workload {
        uid: format!("Kubernetes//Pod/default/{name}"),
        name: name.into(),
        namespace: "default".into(),
        service_account: name.into(),
        addresses: vec![ip_bytes(ip)],
        tunnel_protocol: xds::TunnelProtocol::Hbone as i32,
        status: if healthy {
            xds::WorkloadStatus::Healthy as i32
        } else {
            xds::WorkloadStatus::Unhealthy as i32
        },
        services,
        waypoint,
        ..Default::default()
    };
    Address::Workload(Box::new(Workload::try_from(&w).unwrap()))
}

/// Service `web` (VIP 10.96.0.1, bound to the waypoint unless `bound` is
/// false) with endpoint `a`; the waypoint's headless service with `pods`;
/// pod `db` (10.0.0.9) bound to the waypoint by itself.
fn waypoint_mesh(bound: bool, pods: Vec<Address>) -> StateSnapshot {
    let mut s = StateSnapshot::default();
    let web = xds::Service {
        name: "web".into(),
        namespace: "default".into(),
        hostname: "web.default.svc.cluster.local".into(),
        addresses: vec![xds::NetworkAddress {
            network: String::new(),
            address: ip_bytes("10.96.0.1"),
        }],
        ports: vec![xds::Port {
            service_port: 80,
            target_port: 8080,
        }],
        waypoint: bound.then(|| gateway("waypoint.default.svc.cluster.local")),
        ..Default::default()
    };
    let wp = xds::Service {
        name: "waypoint".into(),
        namespace: "default".into(),
        hostname: "waypoint.default.svc.cluster.local".into(),
        ports: vec![xds::Port {
            service_port: 15008,
            target_port: 15008,
        }],
        ..Default::default()
    };
    for (k, svc) in [(SVC, web), (WP_SVC, wp)] {
        s.apply_address(
            k,
            "v1",
            Address::Service(Box::new(Service::try_from(&svc).unwrap())),
        );
    }
    let mut all = vec![
        member("a", "10.0.0.1", true, &[(SVC, 80, 8080)], None),
        member(
            "db",
            "10.0.0.9",
            true,
            &[],
            Some(gateway("waypoint.default.svc.cluster.local")),
        ),
    ];
    all.extend(pods);
    for (i, w) in all.into_iter().enumerate() {
        s.apply_address(&format!("w{i}"), "v1", w);
    }
    s
}

fn wp_pod(name: &str, ip: &str, healthy: bool) -> Address {
    member(name, ip, healthy, &[(WP_SVC, 15008, 15008)], None)
}

#[test]
fn a_vip_bound_to_a_waypoint_goes_to_its_healthy_pods_with_the_vip_as_authority() {
    let snap = waypoint_mesh(
        true,
        vec![
            wp_pod("wp-0", "10.0.0.20", true),
            wp_pod("wp-1", "10.0.0.21", true),
            wp_pod("wp-sick", "10.0.0.22", false),
        ],
    );
    let rr = AtomicUsize::new(0);
    let mut seen = HashSet::new();
    for _ in 0..6 {
        match resolve(&snap, "", None, addr("10.96.0.1:80"), &rr) {
            Resolved::Waypoint {
                waypoint,
                addr: a,
                target,
                service,
                workload,
            } => {
                assert_eq!(a, SocketAddr::new(waypoint.ips[0], 15008));
                assert_eq!(target, addr("10.96.0.1:80"), "the authority is the VIP");
                assert_eq!(service.unwrap().name, "web");
                assert!(workload.is_none());
                seen.insert(waypoint.name.clone());
            }
            other => panic!("expected the waypoint, got {other:?}"),
        }
    }
    assert_eq!(
        seen,
        HashSet::from(["wp-0".to_string(), "wp-1".to_string()])
    );
    // A port the service does not declare still goes to the waypoint,
    // which decides.
    assert!(matches!(
        resolve(&snap, "", None, addr("10.96.0.1:9999"), &rr),
        Resolved::Waypoint { .. }
    ));
}

#[test]
fn a_pod_bound_to_a_waypoint_goes_to_it_with_its_ip_as_authority() {
    let snap = waypoint_mesh(false, vec![wp_pod("wp-0", "10.0.0.20", true)]);
    let rr = AtomicUsize::new(0);
    match resolve(&snap, "", None, addr("10.0.0.9:5432"), &rr) {
        Resolved::Waypoint {
            waypoint,
            addr: a,
            target,
            workload,
            service,
        } => {
            assert_eq!(waypoint.name, "wp-0");
            assert_eq!(a, addr("10.0.0.20:15008"));
            assert_eq!(target, addr("10.0.0.9:5432"));
            assert_eq!(workload.unwrap().name, "db");
            assert!(service.is_none());
        }
        other => panic!("{other:?}"),
    }
    // The service is not bound here: its VIP goes to an endpoint.
    assert!(matches!(
        resolve(&snap, "", None, addr("10.96.0.1:80"), &rr),
        Resolved::Hbone { .. }
    ));
}

#[test]
fn the_waypoint_itself_is_never_sent_back_to_the_waypoint() {
    let snap = waypoint_mesh(true, vec![wp_pod("wp-0", "10.0.0.20", true)]);
    let rr = AtomicUsize::new(0);
    let wp = snap
        .workload_by_ip("", "10.0.0.20".parse().unwrap())
        .unwrap();
    match resolve(&snap, "", Some(&wp), addr("10.96.0.1:80"), &rr) {
        Resolved::Hbone { workload, addr, .. } => {
            assert_eq!(workload.name, "a");
            assert_eq!(addr, "10.0.0.1:8080".parse().unwrap());
        }
        other => panic!("{other:?}"),
    }
    match resolve(&snap, "", Some(&wp), addr("10.0.0.9:5432"), &rr) {
        Resolved::Hbone { workload, .. } => assert_eq!(workload.name, "db"),
        other => panic!("{other:?}"),
    }
    // Even while it is not ready.
    let snap = waypoint_mesh(
        true,
        vec![
            wp_pod("wp-0", "10.0.0.20", true),
            wp_pod("wp-1", "10.0.0.21", false),
        ],
    );
    let wp1 = snap
        .workload_by_ip("", "10.0.0.21".parse().unwrap())
        .unwrap();
    assert!(matches!(
        resolve(&snap, "", Some(&wp1), addr("10.96.0.1:80"), &rr),
        Resolved::Hbone { .. }
    ));
    // Any other source goes through it.
    let a = snap
        .workload_by_ip("", "10.0.0.1".parse().unwrap())
        .unwrap();
    assert!(matches!(
        resolve(&snap, "", Some(&a), addr("10.96.0.1:80"), &rr),
        Resolved::Waypoint { .. }
    ));
}

#[test]
fn a_waypoint_without_a_healthy_pod_or_unknown_fails_instead_of_bypassing() {
    let rr = AtomicUsize::new(0);
    let snap = waypoint_mesh(true, vec![wp_pod("wp-sick", "10.0.0.22", false)]);
    match resolve(&snap, "", None, addr("10.96.0.1:80"), &rr) {
        Resolved::NoWaypoint {
            why,
            target,
            service,
            ..
        } => {
            assert_eq!(why, WaypointMissing::NoHealthyPod);
            assert_eq!(target, addr("10.96.0.1:80"));
            assert_eq!(service.unwrap().name, "web");
        }
        other => panic!("{other:?}"),
    }
    // A waypoint hostname no service has.
    let mut snap = waypoint_mesh(true, vec![]);
    snap.remove_resource(crate::state::ResourceType::Address, WP_SVC);
    match resolve(&snap, "", None, addr("10.0.0.9:5432"), &rr) {
        Resolved::NoWaypoint { why, workload, .. } => {
            assert_eq!(why, WaypointMissing::Unknown);
            assert_eq!(workload.unwrap().name, "db");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_waypoint_by_address_is_the_workload_there() {
    let mut snap = waypoint_mesh(false, vec![wp_pod("wp-0", "10.0.0.20", true)]);
    let by_ip = xds::GatewayAddress {
        destination: Some(xds::gateway_address::Destination::Address(
            xds::NetworkAddress {
                network: String::new(),
                address: ip_bytes("10.0.0.20"),
            },
        )),
        hbone_mtls_port: 0,
    };
    snap.apply_address("w1", "v2", member("db", "10.0.0.9", true, &[], Some(by_ip)));
    let rr = AtomicUsize::new(0);
    match resolve(&snap, "", None, addr("10.0.0.9:5432"), &rr) {
        Resolved::Waypoint {
            waypoint, addr: a, ..
        } => {
            assert_eq!(waypoint.name, "wp-0");
            assert_eq!(a, addr("10.0.0.20:15008"), "port 0 means 15008");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn inbound_recognises_traffic_from_the_destinations_waypoint() {
    let snap = waypoint_mesh(true, vec![wp_pod("wp-0", "10.0.0.20", true)]);
    let w = |ip: &str| snap.workload_by_ip("", ip.parse().unwrap()).unwrap();
    // a backs the bound service web; db is bound itself.
    assert!(is_waypoint_of(&snap, &w("10.0.0.20"), &w("10.0.0.1")));
    assert!(is_waypoint_of(&snap, &w("10.0.0.20"), &w("10.0.0.9")));
    // Not from the waypoint.
    assert!(!is_waypoint_of(&snap, &w("10.0.0.9"), &w("10.0.0.1")));
}
