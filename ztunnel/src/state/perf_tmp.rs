//! THROWAWAY timing harness (not committed): run with
//! `cargo test --release -p ambit-ztunnel --lib perf_tmp -- --ignored --nocapture`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ambit_proto::workload as xds;

use super::*;

const W: u32 = 10_000;
const S: u32 = 1_000;

fn svc_key(i: u32) -> String {
    format!("ns{}/svc{i}.ns{}.svc.cluster.local", i % 50, i % 50)
}

fn mk_workload(i: u32, ip_off: u32, port: u32) -> Address {
    let mut services = HashMap::new();
    services.insert(
        svc_key(i % S),
        xds::PortList {
            ports: vec![xds::Port {
                service_port: 80,
                target_port: port,
            }],
        },
    );
    let w = Workload::try_from(&xds::Workload {
        uid: format!("Kubernetes//Pod/ns{}/pod-{i}", i % 50),
        name: format!("pod-{i}"),
        namespace: format!("ns{}", i % 50),
        addresses: vec![(0x0a00_0000u32 + i + ip_off).to_be_bytes().to_vec()],
        services,
        trust_domain: "cluster.local".into(),
        service_account: "default".into(),
        node: format!("node-{}", i % 100),
        ..Default::default()
    })
    .unwrap();
    Address::Workload(Box::new(w))
}

fn mk_service(i: u32) -> Address {
    let s = Service::try_from(&xds::Service {
        name: format!("svc{i}"),
        namespace: format!("ns{}", i % 50),
        hostname: format!("svc{i}.ns{}.svc.cluster.local", i % 50),
        addresses: vec![xds::NetworkAddress {
            network: String::new(),
            address: (0x0a60_0000u32 + i).to_be_bytes().to_vec(),
        }],
        ports: vec![xds::Port {
            service_port: 80,
            target_port: 8080,
        }],
        ..Default::default()
    })
    .unwrap();
    Address::Service(Box::new(s))
}

fn wname(i: u32) -> String {
    format!("Kubernetes//Pod/ns{}/pod-{i}", i % 50)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[test]
#[ignore]
fn perf_tmp() {
    // Pre-build inputs so conversion is not timed.
    let mut bulk_times = Vec::new();
    let mut writer_keep = None;
    for _ in 0..7 {
        let svcs: Vec<_> = (0..S).map(|i| (svc_key(i), mk_service(i))).collect();
        let wls: Vec<_> = (0..W).map(|i| (wname(i), mk_workload(i, 0, 8080))).collect();
        let (mut writer, reader) = new_state();
        let t = Instant::now();
        let mut next = writer.begin();
        for (n, a) in svcs {
            next.apply_address(&n, "v1", a);
        }
        for (n, a) in wls {
            next.apply_address(&n, "v1", a);
        }
        writer.publish(next);
        bulk_times.push(t.elapsed());
        assert_eq!(reader.load().workload_count(), W as usize);
        writer_keep = Some((writer, reader));
    }
    println!("bulk 10k workloads + 1k services (median of 7): {:?}  all: {:?}", median(bulk_times.clone()), bulk_times);
    let (mut writer, reader) = writer_keep.unwrap();

    // Single-workload update (new IP, same services) + publish.
    let n = 2000u32;
    let inputs: Vec<_> = (0..n).map(|i| (wname(i * 5), mk_workload(i * 5, 1_000_000, 8080))).collect();
    let mut times = Vec::with_capacity(n as usize);
    let t_all = Instant::now();
    for (name, a) in inputs {
        let _held = reader.load(); // a reader holding the previous snapshot
        let t = Instant::now();
        let mut next = writer.begin();
        next.apply_address(&name, "v2", a);
        writer.publish(next);
        times.push(t.elapsed());
    }
    let total = t_all.elapsed();
    println!("single-workload update+publish (IP change): median {:?}, mean {:?}", median(times.clone()), total / n);

    // Single-workload update that moves an endpoint between services.
    let inputs: Vec<_> = (0..n).map(|i| (wname(i * 5 + 1), mk_workload(i * 5 + 1, 0, 9090))).collect();
    let mut times = Vec::with_capacity(n as usize);
    for (name, a) in inputs {
        let _held = reader.load();
        let t = Instant::now();
        let mut next = writer.begin();
        next.apply_address(&name, "v3", a);
        writer.publish(next);
        times.push(t.elapsed());
    }
    println!("single-workload update+publish (endpoint port change): median {:?}", median(times));

    // Remove + re-add one workload.
    let mut times = Vec::new();
    for i in 0..500u32 {
        let name = wname(i * 7 + 3);
        let a = mk_workload(i * 7 + 3, 0, 8080);
        let t = Instant::now();
        let mut next = writer.begin();
        next.remove_resource(ResourceType::Address, &name);
        writer.publish(next);
        let mut next = writer.begin();
        next.apply_address(&name, "v4", a);
        writer.publish(next);
        times.push(t.elapsed() / 2);
    }
    println!("single-workload remove or add + publish: median {:?}", median(times));

    // Lookups.
    let snap = reader.load();
    let t = Instant::now();
    let mut hits = 0usize;
    for i in 0..W {
        if snap.workload_by_uid(&wname(i)).is_some() {
            hits += 1;
        }
    }
    println!("workload_by_uid x10k (incl. key format): {:?} hits={hits}", t.elapsed());
    let t = Instant::now();
    let rv = snap.resource_versions(ResourceType::Address);
    println!("resource_versions (reconnect) {} entries: {:?}", rv.len(), t.elapsed());
    assert_eq!(rv.len(), (W + S) as usize);
}

fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

#[test]
#[ignore]
fn perf_tmp_bulk() {
    let iters: usize = std::env::var("BULK_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(25);
    let mut times = Vec::new();
    let mut cpu = Vec::new();
    for _ in 0..iters {
        let svcs: Vec<_> = (0..S).map(|i| (svc_key(i), mk_service(i))).collect();
        let wls: Vec<_> = (0..W).map(|i| (wname(i), mk_workload(i, 0, 8080))).collect();
        let (mut writer, reader) = new_state();
        let c = cpu_ns();
        let t = Instant::now();
        let mut next = writer.begin();
        for (n, a) in svcs {
            next.apply_address(&n, "v1", a);
        }
        for (n, a) in wls {
            next.apply_address(&n, "v1", a);
        }
        writer.publish(next);
        times.push(t.elapsed());
        cpu.push(Duration::from_nanos(cpu_ns() - c));
        assert_eq!(reader.load().workload_count(), W as usize);
        drop((writer, reader));
    }
    times.sort();
    cpu.sort();
    println!("bulk x{iters}: wall min {:?} median {:?}; cpu min {:?} median {:?}", times[0], times[times.len() / 2], cpu[0], cpu[cpu.len() / 2]);
}

#[test]
#[ignore]
fn perf_tmp_update() {
    let svcs: Vec<_> = (0..S).map(|i| (svc_key(i), mk_service(i))).collect();
    let wls: Vec<_> = (0..W).map(|i| (wname(i), mk_workload(i, 0, 8080))).collect();
    let (mut writer, reader) = new_state();
    let mut next = writer.begin();
    for (n, a) in svcs {
        next.apply_address(&n, "v1", a);
    }
    for (n, a) in wls {
        next.apply_address(&n, "v1", a);
    }
    writer.publish(next);
    let n = 3000u32;
    let inputs: Vec<_> = (0..n).map(|i| (wname(i * 3), mk_workload(i * 3, 1_000_000, 8080))).collect();
    let mut wall = Vec::new();
    let mut cpu = Vec::new();
    for (name, a) in inputs {
        let _held = reader.load();
        let c = cpu_ns();
        let t = Instant::now();
        let mut next = writer.begin();
        next.apply_address(&name, "v2", a);
        writer.publish(next);
        wall.push(t.elapsed());
        cpu.push(cpu_ns() - c);
    }
    wall.sort();
    cpu.sort();
    let mean_cpu = cpu.iter().sum::<u64>() / cpu.len() as u64;
    println!("update x{n}: wall median {:?} p90 {:?}; cpu median {:?} mean {:?}", wall[wall.len() / 2], wall[wall.len() * 9 / 10], Duration::from_nanos(cpu[cpu.len() / 2]), Duration::from_nanos(mean_cpu));
}

#[test]
#[ignore]
fn perf_tmp_micro() {
    let keys: Vec<Arc<str>> = (0..10_000u32).map(|i| Arc::from(wname(i))).collect();
    for round in 0..5 {
        let t = Instant::now();
        let mut m: ShardedMap<Arc<str>, u32> = ShardedMap::new();
        for (i, k) in keys.iter().enumerate() {
            m.insert(k.clone(), i as u32);
        }
        let sharded = t.elapsed();
        let t = Instant::now();
        let mut h: Arc<HashMap<Arc<str>, u32>> = Arc::default();
        for (i, k) in keys.iter().enumerate() {
            Arc::make_mut(&mut h).insert(k.clone(), i as u32);
        }
        let plain = t.elapsed();
        let t = Instant::now();
        let mut hits = 0;
        for k in &keys {
            hits += m.get(&**k).is_some() as usize;
        }
        let sget = t.elapsed();
        let t = Instant::now();
        for k in &keys {
            hits += h.get(&**k).is_some() as usize;
        }
        let pget = t.elapsed();
        println!(
            "round {round}: insert 10k sharded {sharded:?} plain {plain:?}; get sharded {sget:?} plain {pget:?} {hits}"
        );
        drop((m, h));
    }
}
