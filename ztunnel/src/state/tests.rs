#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::net::IpAddr;

use ambit_proto::security as xsec;
use ambit_proto::workload as xds;

use super::*;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn ip_bytes(s: &str) -> Vec<u8> {
    match ip(s) {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn proto_workload(uid: &str, ips: &[&str], services: &[(&str, u32, u32)]) -> xds::Workload {
    let mut svc: HashMap<String, xds::PortList> = HashMap::new();
    for (key, sp, tp) in services {
        svc.entry(key.to_string())
            .or_default()
            .ports
            .push(xds::Port {
                service_port: *sp,
                target_port: *tp,
            });
    }
    xds::Workload {
        uid: uid.to_string(),
        name: uid.rsplit('/').next().unwrap().to_string(),
        namespace: "default".into(),
        addresses: ips.iter().map(|s| ip_bytes(s)).collect(),
        tunnel_protocol: xds::TunnelProtocol::Hbone as i32,
        services: svc,
        ..Default::default()
    }
}

fn workload(uid: &str, ips: &[&str], services: &[(&str, u32, u32)]) -> Workload {
    Workload::try_from(&proto_workload(uid, ips, services)).unwrap()
}

fn service(ns: &str, host: &str, vips: &[&str]) -> Service {
    Service::try_from(&xds::Service {
        name: host.split('.').next().unwrap().to_string(),
        namespace: ns.to_string(),
        hostname: host.to_string(),
        addresses: vips
            .iter()
            .map(|v| xds::NetworkAddress {
                network: String::new(),
                address: ip_bytes(v),
            })
            .collect(),
        ports: vec![xds::Port {
            service_port: 80,
            target_port: 8080,
        }],
        ..Default::default()
    })
    .unwrap()
}

const SVC: &str = "default/web.default.svc.cluster.local";
const HOST: &str = "web.default.svc.cluster.local";

#[test]
fn workload_indexes_follow_add_update_remove() {
    let mut s = StateSnapshot::default();
    s.insert_workload(workload("w1", &["10.0.0.1"], &[(SVC, 80, 8080)]));
    assert_eq!(&*s.workload_by_ip("", ip("10.0.0.1")).unwrap().uid, "w1");
    assert!(s.workload_by_uid("w1").is_some());
    assert!(s.workload_by_ip("other-net", ip("10.0.0.1")).is_none());

    // Changing IP drops the old address index entry.
    s.insert_workload(workload("w1", &["10.0.0.2"], &[(SVC, 80, 8080)]));
    assert!(s.workload_by_ip("", ip("10.0.0.1")).is_none());
    assert_eq!(&*s.workload_by_ip("", ip("10.0.0.2")).unwrap().uid, "w1");
    assert_eq!(s.workload_count(), 1);

    let removed = s.remove_workload("w1").unwrap();
    assert_eq!(&*removed.uid, "w1");
    assert!(s.workload_by_uid("w1").is_none());
    assert!(s.workload_by_ip("", ip("10.0.0.2")).is_none());
    assert!(s.remove_workload("w1").is_none());
}

#[test]
fn address_taken_over_by_another_workload_survives_old_removal() {
    let mut s = StateSnapshot::default();
    s.insert_workload(workload("old", &["10.0.0.1"], &[]));
    s.insert_workload(workload("new", &["10.0.0.1"], &[]));
    s.remove_workload("old");
    assert_eq!(&*s.workload_by_ip("", ip("10.0.0.1")).unwrap().uid, "new");
}

#[test]
fn endpoints_follow_workload_services() {
    let mut s = StateSnapshot::default();
    s.insert_service(service("default", HOST, &["10.96.0.10"]));
    s.insert_workload(workload("w1", &["10.0.0.1"], &[(SVC, 80, 8080)]));
    s.insert_workload(workload("w2", &["10.0.0.2"], &[(SVC, 80, 9090)]));

    let eps = s.endpoints(SVC).unwrap();
    assert_eq!(eps.len(), 2);
    assert_eq!(
        eps["w2"].ports,
        vec![PortMapping {
            service_port: 80,
            target_port: 9090
        }]
    );
    assert_eq!(&*eps["w1"].service, SVC);

    // w1 leaves the service: it leaves the endpoints.
    s.insert_workload(workload("w1", &["10.0.0.1"], &[]));
    let eps = s.endpoints(SVC).unwrap();
    assert_eq!(eps.len(), 1);
    assert!(eps.contains_key("w2"));

    // Port change of w2 is reflected.
    s.insert_workload(workload("w2", &["10.0.0.2"], &[(SVC, 80, 7070)]));
    assert_eq!(s.endpoints(SVC).unwrap()["w2"].ports[0].target_port, 7070);

    // Last endpoint removed: no set left.
    s.remove_workload("w2");
    assert!(s.endpoints(SVC).is_none());
}

#[test]
fn service_indexes_and_removal() {
    let mut s = StateSnapshot::default();
    s.insert_service(service("default", HOST, &["10.96.0.10"]));
    s.insert_workload(workload("w1", &["10.0.0.1"], &[(SVC, 80, 8080)]));
    assert_eq!(
        s.service_by_vip("", ip("10.96.0.10")).unwrap().hostname,
        HOST
    );
    assert!(s.service_by_hostname(SVC).is_some());

    // VIP change drops the old VIP.
    s.insert_service(service("default", HOST, &["10.96.0.11"]));
    assert!(s.service_by_vip("", ip("10.96.0.10")).is_none());
    assert!(s.service_by_vip("", ip("10.96.0.11")).is_some());

    // Removing the service removes its VIPs and its endpoints entry.
    s.remove_service(SVC).unwrap();
    assert!(s.service_by_hostname(SVC).is_none());
    assert!(s.service_by_vip("", ip("10.96.0.11")).is_none());
    assert!(s.endpoints(SVC).is_none());

    // Re-adding it brings back the endpoints its workloads still claim.
    s.insert_service(service("default", HOST, &["10.96.0.11"]));
    assert_eq!(s.endpoints(SVC).unwrap().len(), 1);
}

#[test]
fn workloads_before_their_service_are_staged() {
    let mut s = StateSnapshot::default();
    s.insert_workload(workload("w1", &["10.0.0.1"], &[(SVC, 80, 8080)]));
    assert!(s.endpoints(SVC).is_none());
    s.insert_service(service("default", HOST, &["10.96.0.10"]));
    assert_eq!(s.endpoints(SVC).unwrap().len(), 1);
}

#[test]
fn xds_names_track_versions_and_kind_changes() {
    let mut s = StateSnapshot::default();
    s.apply_address(
        "w1",
        "v1",
        Address::Workload(Box::new(workload("w1", &["10.0.0.1"], &[]))),
    );
    s.apply_address(
        SVC,
        "v1",
        Address::Service(Box::new(service("default", HOST, &["10.96.0.10"]))),
    );
    let versions = s.resource_versions(ResourceType::Address);
    assert_eq!(versions.len(), 2);
    assert_eq!(versions["w1"], "v1");

    s.apply_address(
        "w1",
        "v2",
        Address::Workload(Box::new(workload("w1", &["10.0.0.3"], &[]))),
    );
    assert_eq!(s.resource_versions(ResourceType::Address)["w1"], "v2");
    assert!(s.workload_by_ip("", ip("10.0.0.1")).is_none());

    assert!(s.remove_resource(ResourceType::Address, SVC));
    assert!(s.service_by_hostname(SVC).is_none());
    assert!(!s.remove_resource(ResourceType::Address, SVC));

    // A name that now carries a different uid drops the old workload.
    s.apply_address(
        "w1",
        "v3",
        Address::Workload(Box::new(workload("w1-renamed", &["10.0.0.4"], &[]))),
    );
    assert!(s.workload_by_uid("w1").is_none());
    assert!(s.workload_by_uid("w1-renamed").is_some());
}

#[test]
fn authorizations_by_key() {
    let mut s = StateSnapshot::default();
    let a = Authorization::try_from(&xsec::Authorization {
        name: "deny-all".into(),
        namespace: "prod".into(),
        scope: xsec::Scope::Namespace as i32,
        action: xsec::Action::Deny as i32,
        rules: vec![],
    })
    .unwrap();
    s.apply_authorization("prod/deny-all", "1", a);
    assert_eq!(
        s.authorization("prod/deny-all").unwrap().action,
        xsec::Action::Deny
    );
    assert!(s.remove_resource(ResourceType::Authorization, "prod/deny-all"));
    assert!(s.authorization("prod/deny-all").is_none());
    assert_eq!(s.authorization_count(), 0);
}

#[test]
fn conversion_rejects_bad_input() {
    let mut w = proto_workload("w", &["10.0.0.1"], &[]);
    w.addresses.push(vec![1, 2, 3]);
    let err = Workload::try_from(&w).unwrap_err();
    assert!(matches!(err, StateError::InvalidIp { len: 3, .. }), "{err}");
    assert!(err.to_string().contains("3 bytes"));

    let w = proto_workload("", &["10.0.0.1"], &[]);
    assert!(matches!(
        Workload::try_from(&w),
        Err(StateError::MissingField { field: "uid", .. })
    ));

    let w = proto_workload("w", &[], &[(SVC, 70000, 80)]);
    assert!(matches!(
        Workload::try_from(&w),
        Err(StateError::InvalidPort { port: 70000, .. })
    ));

    let mut w = proto_workload("w", &[], &[]);
    w.tunnel_protocol = 42;
    assert!(matches!(
        Workload::try_from(&w),
        Err(StateError::UnknownEnum { value: 42, .. })
    ));

    assert_eq!(
        Address::try_from(&xds::Address { r#type: None }),
        Err(StateError::EmptyAddress)
    );

    let bad_cidr = xsec::Authorization {
        name: "p".into(),
        namespace: "ns".into(),
        rules: vec![xsec::Rule {
            clauses: vec![xsec::Clause {
                matches: vec![xsec::Match {
                    source_ips: vec![xsec::Address {
                        address: ip_bytes("10.0.0.0"),
                        length: 33,
                    }],
                    ..Default::default()
                }],
            }],
        }],
        ..Default::default()
    };
    assert!(matches!(
        Authorization::try_from(&bad_cidr),
        Err(StateError::InvalidPrefix { len: 33, .. })
    ));
}

#[test]
fn publish_shares_untouched_indexes() {
    let (mut writer, reader) = new_state();
    let mut next = writer.begin();
    next.insert_workload(workload("w1", &["10.0.0.1"], &[]));
    next.insert_service(service("default", HOST, &["10.96.0.10"]));
    let first = writer.publish(next);
    assert_eq!(first.generation(), 1);
    assert_eq!(reader.load().generation(), 1);
    assert_eq!(*reader.generation().borrow(), 1);

    let mut next = writer.begin();
    next.insert_workload(workload("w2", &["10.0.0.2"], &[]));
    let second = writer.publish(next);
    // Services were not touched: the index is shared, not copied.
    assert!(first.services.ptr_eq(&second.services));
    assert!(first.services_by_vip.ptr_eq(&second.services_by_vip));
    assert!(!first.workloads.ptr_eq(&second.workloads));
    // The old snapshot is unchanged.
    assert_eq!(first.workload_count(), 1);
    assert_eq!(second.workload_count(), 2);
}

#[tokio::test]
async fn reader_wait_for_sees_later_publish() {
    let (mut writer, reader) = new_state();
    let waiter = tokio::spawn({
        let reader = reader.clone();
        async move { reader.wait_for(|s| s.workload_count() == 1).await }
    });
    let mut next = writer.begin();
    next.insert_workload(workload("w1", &["10.0.0.1"], &[]));
    writer.publish(next);
    let snap = tokio::time::timeout(std::time::Duration::from_secs(2), waiter)
        .await
        .expect("wait_for timed out")
        .unwrap()
        .unwrap();
    assert_eq!(snap.workload_count(), 1);
}

/// True if `b` (a later version of `a`) shares all but at most `copied` of
/// `a`'s shards.
fn all_but<K, V>(a: &ShardedMap<K, V>, b: &ShardedMap<K, V>, copied: usize) -> bool {
    a.shard_count() == b.shard_count() && a.shared_shards(b) + copied >= a.shard_count()
}

/// The reason the indexes are sharded: with 10,000 workloads behind 1,000
/// services, publishing a one-workload change copies one shard of each index
/// it touches and shares everything else with the previous snapshot, which
/// stays as it was. (Structure only; timings are measured outside tests.)
#[test]
fn one_workload_update_at_scale_copies_only_touched_shards() {
    const WORKLOADS: usize = 10_000;
    const SERVICES: usize = 1_000;
    let svc_key = |i: usize| format!("ns/svc{i}.ns.svc.cluster.local");
    let wl = |i: usize, ip_offset: u32, port: u32| {
        let ip = std::net::Ipv4Addr::from(0x0a00_0000 + i as u32 + ip_offset).to_string();
        let key = svc_key(i % SERVICES);
        Address::Workload(Box::new(workload(
            &format!("Kubernetes//Pod/ns/pod-{i}"),
            &[ip.as_str()],
            &[(key.as_str(), 80, port)],
        )))
    };

    let (mut writer, _reader) = new_state();
    let mut next = writer.begin();
    for i in 0..SERVICES {
        let vip = std::net::Ipv4Addr::from(0x0a60_0000 + i as u32).to_string();
        let host = format!("svc{i}.ns.svc.cluster.local");
        next.apply_address(
            &svc_key(i),
            "v1",
            Address::Service(Box::new(service("ns", &host, &[vip.as_str()]))),
        );
    }
    for i in 0..WORKLOADS {
        next.apply_address(&format!("Kubernetes//Pod/ns/pod-{i}"), "v1", wl(i, 0, 8080));
    }
    let before = writer.publish(next);
    assert_eq!(before.workload_count(), WORKLOADS);
    assert_eq!(before.service_count(), SERVICES);
    assert!(before.workloads.shard_count() >= 64);
    assert!(before.address_resources.shard_count() >= 64);

    // Same services, new IP: workloads, addresses and resource versions change.
    let name = "Kubernetes//Pod/ns/pod-42";
    let mut next = writer.begin();
    next.apply_address(name, "v2", wl(42, 1_000_000, 8080));
    let after = writer.publish(next);

    assert!(all_but(&before.workloads, &after.workloads, 1));
    assert!(all_but(
        &before.address_resources,
        &after.address_resources,
        1
    ));
    // The old address is dropped and the new one added: at most two shards.
    assert!(all_but(
        &before.workloads_by_addr,
        &after.workloads_by_addr,
        2
    ));
    assert!(!before.workloads.ptr_eq(&after.workloads));
    assert!(before.services.ptr_eq(&after.services));
    assert!(before.policies.ptr_eq(&after.policies));
    assert!(before.services_by_vip.ptr_eq(&after.services_by_vip));
    assert!(before.endpoints.ptr_eq(&after.endpoints));
    assert!(
        before
            .authorization_resources
            .ptr_eq(&after.authorization_resources)
    );

    // Old snapshot unchanged, new one updated.
    assert_eq!(
        &*before.workload_by_ip("", ip("10.0.0.42")).unwrap().uid,
        name
    );
    assert!(after.workload_by_ip("", ip("10.0.0.42")).is_none());
    assert!(after.workload_by_ip("", ip("10.15.66.106")).is_some());
    assert_eq!(before.resource_versions(ResourceType::Address)[name], "v1");
    assert_eq!(after.resource_versions(ResourceType::Address)[name], "v2");
    assert_eq!(
        after.resource_versions(ResourceType::Address).len(),
        WORKLOADS + SERVICES
    );

    // A port change moves the endpoint: one shard of the endpoint index and
    // a copy of that one service's endpoint set; other sets stay shared.
    let mut next = writer.begin();
    next.apply_address(name, "v3", wl(42, 1_000_000, 9090));
    let moved = writer.publish(next);
    assert!(all_but(&after.endpoints, &moved.endpoints, 1));
    let svc = svc_key(42);
    assert_eq!(
        moved.endpoint_set(&svc).unwrap()[name].ports[0].target_port,
        9090
    );
    assert_eq!(
        after.endpoint_set(&svc).unwrap()[name].ports[0].target_port,
        8080
    );
    let other = svc_key(43);
    assert!(Arc::ptr_eq(
        &after.endpoints(&other).unwrap(),
        &moved.endpoints(&other).unwrap()
    ));
}
