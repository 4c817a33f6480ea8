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
        match resolve(&snap, "", addr("10.96.0.1:80"), &round_robin) {
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
        resolve(&snap, "", addr("10.96.0.1:80"), &round_robin),
        Resolved::NoEndpoint { port: 80, .. }
    ));
    let snap = snapshot(vec![workload("a", "10.0.0.1", true, true, 0)]);
    assert!(matches!(
        resolve(&snap, "", addr("10.96.0.1:443"), &round_robin),
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
    match resolve(&snap, "", addr("10.0.0.1:7000"), &round_robin) {
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
    match resolve(&snap, "", addr("10.0.0.2:7000"), &round_robin) {
        Resolved::Direct {
            workload, addr: a, ..
        } => {
            assert_eq!(workload.unwrap().name, "plain");
            assert_eq!(a, addr("10.0.0.2:7000"));
        }
        other => panic!("{other:?}"),
    }
    match resolve(&snap, "", addr("192.0.2.1:443"), &round_robin) {
        Resolved::Direct {
            workload, addr: a, ..
        } => {
            assert!(workload.is_none());
            assert_eq!(a, addr("192.0.2.1:443"));
        }
        other => panic!("{other:?}"),
    }
}
