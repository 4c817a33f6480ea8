#![allow(clippy::unwrap_used)]
use ambit_proto::workload as xds;
use ambit_ztunnel::state::{Workload, new_state};
use std::collections::HashMap;
use std::time::Instant;
#[test]
fn perf() {
    let (mut w, _r) = new_state();
    let mk = |i: u32| {
        let mut services = HashMap::new();
        services.insert(
            format!("ns/svc{}.ns.svc.cluster.local", i % 1000),
            xds::PortList {
                ports: vec![xds::Port {
                    service_port: 80,
                    target_port: 8080,
                }],
            },
        );
        Workload::try_from(&xds::Workload {
            uid: format!("Kubernetes//Pod/ns/pod-{i}"),
            name: format!("pod-{i}"),
            namespace: "ns".into(),
            addresses: vec![(0x0a000000u32 + i).to_be_bytes().to_vec()],
            services,
            ..Default::default()
        })
        .unwrap()
    };
    let t = Instant::now();
    let mut next = w.begin();
    for i in 0..10_000 {
        next.insert_workload(mk(i));
    }
    w.publish(next);
    println!("initial 10k: {:?}", t.elapsed());
    let t = Instant::now();
    for i in 0..100 {
        let mut next = w.begin();
        next.insert_workload(mk(i));
        w.publish(next);
    }
    println!(
        "per single-workload update publish: {:?}",
        t.elapsed() / 100
    );
}
