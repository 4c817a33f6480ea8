//! L4 authorization benchmark: cost of one policy evaluation in ztunnel with
//! 10,000 workloads and 1,000 policies in the mesh, and the cost of building
//! the per-generation policy index.
//!
//! Run: `cargo bench -p ambit-benches --bench rbac`.
//! Sizes: `WORKLOADS` (10000), `POLICIES` (1000), `ITERS` (1000000),
//! `HOT` policies in the worst-case namespace (300).
//!
//! The mesh: 50 namespaces of equal size; in `istio-system` one GLOBAL DENY
//! (a source IP block); per namespace a NAMESPACE
//! ALLOW (same-namespace peers or the ingress principal) and a NAMESPACE
//! DENY (port 9999); one namespace (`hot`) with `HOT` more NAMESPACE
//! policies (two thirds ALLOW by a principal that never matches, one third
//! DENY by port); the rest WORKLOAD_SELECTOR policies, each naming 10
//! workloads of its namespace in windows that overlap by half, so most
//! selected workloads name two (ALLOW by principal prefix and port, or DENY
//! by a `not_namespaces` list).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use ambit_proto::security::{Action, Scope};
use ambit_proto::workload as xds;
use ambit_ztunnel::rbac::{ConnectionAttrs, Decision, PeerIdentity, PolicyCache, PolicyIndex};
use ambit_ztunnel::state::{
    Authorization, IpNet, NetworkAddress, RbacMatch, StringMatch, Workload, new_state,
};

const NAMESPACES: usize = 50;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn ns_name(i: usize) -> String {
    if i == 0 {
        "hot".to_string()
    } else {
        format!("ns-{i}")
    }
}

fn wl_ip(i: usize) -> Ipv4Addr {
    let i = u32::try_from(i).unwrap();
    Ipv4Addr::from(0x0a00_0000 + i + 1)
}

fn policy(ns: &str, name: String, scope: Scope, action: Action, m: RbacMatch) -> Authorization {
    Authorization {
        name,
        namespace: ns.to_string(),
        scope,
        action,
        rules: vec![vec![vec![m]]],
    }
}

fn exact(s: String) -> StringMatch {
    StringMatch::Exact(s)
}

/// Workloads (with the selector policies they name) and policies.
fn mesh(workloads: usize, policies: usize, hot: usize) -> (Vec<Workload>, Vec<Authorization>) {
    let mut pols = Vec::with_capacity(policies);
    pols.push(policy(
        "istio-system",
        "deny-blocked-range".into(),
        Scope::Global,
        Action::Deny,
        RbacMatch {
            source_ips: vec![IpNet {
                ip: IpAddr::from([192, 168, 0, 0]),
                prefix_len: 16,
            }],
            ..RbacMatch::default()
        },
    ));
    for n in 0..NAMESPACES {
        let ns = ns_name(n);
        pols.push(policy(
            &ns,
            "allow-same-ns".into(),
            Scope::Namespace,
            Action::Allow,
            RbacMatch {
                namespaces: vec![exact(ns.clone())],
                principals: vec![],
                ..RbacMatch::default()
            },
        ));
        pols.push(policy(
            &ns,
            "deny-debug-port".into(),
            Scope::Namespace,
            Action::Deny,
            RbacMatch {
                destination_ports: vec![9999],
                ..RbacMatch::default()
            },
        ));
    }
    for h in 0..hot {
        let (action, m) = if h % 3 == 2 {
            let m = RbacMatch {
                destination_ports: vec![10_000 + u16::try_from(h).unwrap()],
                ..RbacMatch::default()
            };
            (Action::Deny, m)
        } else {
            let m = RbacMatch {
                principals: vec![exact(format!("cluster.local/ns/elsewhere/sa/sa-{h}"))],
                destination_ports: vec![8080],
                ..RbacMatch::default()
            };
            (Action::Allow, m)
        };
        pols.push(policy(
            "hot",
            format!("hot-{h}"),
            Scope::Namespace,
            action,
            m,
        ));
    }

    let per_ns = workloads.div_ceil(NAMESPACES);
    let mut named: Vec<Vec<String>> = vec![Vec::new(); workloads];
    let mut s = 0usize;
    while pols.len() < policies {
        let n = 1 + s % (NAMESPACES - 1);
        let ns = ns_name(n);
        let name = format!("sel-{s}");
        let (action, m) = if s % 4 == 3 {
            let m = RbacMatch {
                not_namespaces: vec![exact(ns.clone()), exact("ingress".into())],
                destination_ports: vec![5432],
                ..RbacMatch::default()
            };
            (Action::Deny, m)
        } else {
            let m = RbacMatch {
                principals: vec![StringMatch::Prefix(format!("cluster.local/ns/{ns}/"))],
                destination_ports: vec![8080, 8443],
                ..RbacMatch::default()
            };
            (Action::Allow, m)
        };
        // Ten workloads of namespace n, spread over it.
        let round = s / (NAMESPACES - 1);
        for k in 0..10 {
            let local = (round * 5 + k) % per_ns;
            let idx = local * NAMESPACES + n;
            if idx < workloads {
                named[idx].push(format!("{ns}/{name}"));
            }
        }
        pols.push(policy(&ns, name, Scope::WorkloadSelector, action, m));
        s += 1;
    }

    let wls = (0..workloads)
        .map(|i| {
            let ns = ns_name(i % NAMESPACES);
            Workload::try_from(&xds::Workload {
                uid: format!("Kubernetes//Pod/{ns}/pod-{i}"),
                name: format!("pod-{i}"),
                namespace: ns,
                addresses: vec![wl_ip(i).octets().to_vec()],
                tunnel_protocol: xds::TunnelProtocol::Hbone as i32,
                trust_domain: "cluster.local".into(),
                service_account: format!("sa-{}", i % 7),
                authorization_policies: std::mem::take(&mut named[i]),
                ..Default::default()
            })
            .unwrap()
        })
        .collect();
    (wls, pols)
}

fn conn(src: usize, src_ns: &str, dst: usize, port: u16) -> ConnectionAttrs {
    let id = PeerIdentity::from_spiffe(&format!(
        "spiffe://cluster.local/ns/{src_ns}/sa/sa-{}",
        src % 7
    ))
    .unwrap();
    ConnectionAttrs::mtls(wl_ip(src).into(), id, wl_ip(dst).into(), port)
}

/// Mean ns per evaluation over `iters` evaluations cycling through `cases`.
fn per_eval(
    iters: usize,
    cases: &[(&Workload, ConnectionAttrs)],
    mut f: impl FnMut(&Workload, &ConnectionAttrs) -> Decision,
) -> f64 {
    let mut allowed = 0usize;
    let start = Instant::now();
    for i in 0..iters {
        let (w, c) = &cases[i % cases.len()];
        if f(black_box(w), black_box(c)).is_allowed() {
            allowed += 1;
        }
    }
    let took = start.elapsed();
    black_box(allowed);
    took.as_nanos() as f64 / iters as f64
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let n_workloads = env_usize("WORKLOADS", 10_000);
    let n_policies = env_usize("POLICIES", 1_000);
    let iters = env_usize("ITERS", 1_000_000);
    let hot = env_usize("HOT", 300);

    let (wls, pols) = mesh(n_workloads, n_policies, hot);
    let (mut writer, reader) = new_state();
    let mut next = writer.begin();
    for w in &wls {
        next.insert_workload(w.clone());
    }
    for p in &pols {
        next.insert_authorization(p.clone());
    }
    writer.publish(next);
    let snap = reader.load();
    let selector_refs: usize = wls.iter().map(|w| w.authorization_policies.len()).sum();
    println!(
        "mesh: {} workloads, {} policies ({} in namespace `hot`), {} selector references",
        snap.workload_count(),
        snap.authorization_count(),
        hot + 2,
        selector_refs
    );

    // Index build.
    let builds: Vec<Duration> = (0..21)
        .map(|_| {
            let t = Instant::now();
            black_box(PolicyIndex::build(black_box(&snap)));
            t.elapsed()
        })
        .collect();
    let build = median(builds);
    let cache = PolicyCache::new();
    let t = Instant::now();
    let index = cache.index(&snap);
    let first = t.elapsed();
    let mut next = writer.begin();
    next.insert_workload(wls[1].clone());
    writer.publish(next);
    let snap2 = reader.load();
    let t = Instant::now();
    cache.index(&snap2);
    let reuse = t.elapsed();
    let snap = snap2;
    let index2 = cache.index(&snap);
    assert_eq!(index.len(), index2.len());
    let index = index2;

    // Common case: a workload of an ordinary namespace with a couple of
    // selector policies, reached from its own namespace (allowed) and on a
    // port a selector DENY covers from another namespace (denied).
    let common: Vec<usize> = (0..n_workloads)
        .filter(|i| i % NAMESPACES != 0 && wls[*i].authorization_policies.len() >= 2)
        .take(64)
        .collect();
    assert!(
        !common.is_empty(),
        "no workload names two selector policies"
    );
    let allowed_cases: Vec<(&Workload, ConnectionAttrs)> = common
        .iter()
        .map(|&i| {
            let ns = ns_name(i % NAMESPACES);
            (&wls[i], conn(i + NAMESPACES, &ns, i, 8080))
        })
        .collect();
    let denied_cases: Vec<(&Workload, ConnectionAttrs)> = common
        .iter()
        .map(|&i| (&wls[i], conn(i + 1, "ns-other", i, 9999)))
        .collect();
    let plaintext_cases: Vec<(&Workload, ConnectionAttrs)> = common
        .iter()
        .map(|&i| {
            let c = ConnectionAttrs::plaintext(wl_ip(i + 1).into(), wl_ip(i).into(), 8080);
            (&wls[i], c)
        })
        .collect();
    let applicable = {
        let w = allowed_cases[0].0;
        index.applicable(w).count()
    };
    assert!(
        allowed_cases
            .iter()
            .all(|(w, c)| index.evaluate(w, c).is_allowed())
    );
    assert!(
        denied_cases
            .iter()
            .all(|(w, c)| !index.evaluate(w, c).is_allowed())
    );

    // Worst case: a workload of `hot`, whose namespace holds HOT + 2
    // policies; the connection (from another namespace) matches no DENY and
    // no ALLOW, so every applicable policy is checked before the denial.
    let hot_cases: Vec<(&Workload, ConnectionAttrs)> = (0..n_workloads)
        .filter(|i| i % NAMESPACES == 0)
        .take(64)
        .map(|i| (&wls[i], conn(i + 1, "ns-3", i, 8080)))
        .collect();
    let hot_applicable = index.applicable(hot_cases[0].0).count();
    assert!(
        hot_cases
            .iter()
            .all(|(w, c)| !index.evaluate(w, c).is_allowed())
    );

    // Warm up, then measure.
    per_eval(iters / 10, &allowed_cases, |w, c| index.evaluate(w, c));
    let common_allow = per_eval(iters, &allowed_cases, |w, c| index.evaluate(w, c));
    let common_deny = per_eval(iters, &denied_cases, |w, c| index.evaluate(w, c));
    let common_plain = per_eval(iters, &plaintext_cases, |w, c| index.evaluate(w, c));
    let worst = per_eval(iters, &hot_cases, |w, c| index.evaluate(w, c));
    // What a connection handler pays: find the destination workload by IP
    // in the snapshot, then the cached index of that generation, then
    // evaluate.
    let network = snap.workload_by_uid(&wls[0].uid).unwrap().network.clone();
    let handler = per_eval(iters, &allowed_cases, |_, c| {
        let w = snap
            .workload_by_addr(&NetworkAddress::new(network.clone(), c.dst_ip))
            .unwrap();
        cache.evaluate(&snap, &w, c)
    });

    println!(
        "index build, {} policies: {:.1} µs (median of 21); first cache fill {:.1} µs; \
              workload-only generation (tables reused) {:.1} µs",
        index.len(),
        us(build),
        us(first),
        us(reuse)
    );
    println!("evaluations per figure: {iters}");
    println!(
        "common case ({applicable} applicable policies), mTLS allowed:   {common_allow:>7.1} ns/eval"
    );
    println!("common case, denied by a selector DENY:             {common_deny:>7.1} ns/eval");
    println!(
        "common case, plaintext (denied, no ALLOW matches):          {common_plain:>7.1} ns/eval"
    );
    println!(
        "worst case (`hot`, {hot_applicable} applicable policies, all checked): {worst:>7.1} ns/eval"
    );
    println!("handler path (workload_by_addr + cache + evaluate):   {handler:>7.1} ns/eval");
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
