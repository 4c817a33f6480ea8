//! `ambitctl local status` tells the truth on a live local cluster (the
//! real binaries as processes, pods wired by the CNI reference plugins
//! chained with `ambit-cni`): enrollment after a namespace is relabelled
//! to `none` and back, application connections that share one pooled HBONE
//! tunnel, and ztunnel's admin index. Each test has its own cluster name
//! and state dir and tears it down, also when it fails.
//!
//! Needs root, `ip`, `iptables`, the CNI reference plugins and the
//! workspace's binaries (`cargo build --workspace`); prints SKIP and passes
//! otherwise.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ambit_inpod::PodNetns;
use ambit_tests::enrollbed;
use ambitctl::local::status::{Connection, Mesh, Status};
use ambitctl::local::{self, DownOnDrop, LocalCluster, UpOptions};

const CLIENT_IP: &str = "10.20.1.10";
const SERVER: &str = "10.20.2.10:8080";

/// `mesh` (ambient unless `mesh_mode` says otherwise): `client` on node-a,
/// `server` (`ambit-demo --http 8080`) on node-b.
fn namespaces(mesh_mode: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: mesh\n  labels:\n    istio.io/dataplane-mode: {mesh_mode}\n"
    )
}

const PODS: &str = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: server\n  namespace: mesh\n  \
    annotations: {ambit.dev/demo-app: \"--http 8080\"}\nspec:\n  nodeName: node-b\nstatus:\n  podIP: 10.20.2.10\n---\n\
    apiVersion: v1\nkind: Pod\nmetadata:\n  name: client\n  namespace: mesh\nspec:\n  nodeName: node-a\nstatus:\n  podIP: 10.20.1.10\n";

fn up(test: &str, config: &Path, bins: PathBuf, state: &tempfile::TempDir) -> DownOnDrop {
    std::fs::write(config.join("namespaces.yaml"), namespaces("ambient")).unwrap();
    std::fs::write(config.join("pods.yaml"), PODS).unwrap();
    let name = format!("t{:06x}", rand::random::<u32>() & 0xff_ffff);
    let mut opts = UpOptions::new(config, bins);
    opts.name = name;
    opts.state_dir = Some(state.path().join("state"));
    let started = Instant::now();
    let cluster = local::up(&opts).unwrap_or_else(|e| panic!("{test}: local up failed: {e}"));
    println!("{test}: up took {:?}", started.elapsed());
    cluster.down_on_drop()
}

/// Polls `status` until `done` holds, up to `limit`; returns the status
/// that satisfied it and how long it took. Fails with the last table.
fn until(
    c: &LocalCluster,
    what: &str,
    limit: Duration,
    mut done: impl FnMut(&Status) -> bool,
) -> (Status, Duration) {
    let start = Instant::now();
    loop {
        let s = c.status();
        if done(&s) {
            return (s, start.elapsed());
        }
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}:\n{}",
            c.render_status()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn mesh_pods(s: &Status) -> Vec<&ambitctl::local::status::PodStatus> {
    s.pods.iter().filter(|p| p.namespace == "mesh").collect()
}

#[test]
fn status_follows_a_namespace_relabelled_to_none_and_back() {
    let test = "status_follows_a_namespace_relabelled_to_none_and_back";
    let Some(bins) = enrollbed::local_bin_dir(test) else {
        return;
    };
    let config = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let guard = up(test, config.path(), bins, &state);
    let c: &LocalCluster = &guard;
    let call = [
        "ambit-demo",
        "--call",
        &format!("http://{SERVER}/"),
        "--once",
    ];
    // The directory the mesh serves (a working copy when `up` made one).
    let ns_file = c.config_dir().join("namespaces.yaml");
    // Every MESH verdict seen while polling.
    let mut seen: BTreeSet<String> = BTreeSet::new();
    fn note(seen: &mut BTreeSet<String>, s: &Status) {
        for p in mesh_pods(s) {
            seen.insert(format!("{:?}", p.mesh));
        }
    }

    // 1. Up: both enrolled, every source agrees, the ztunnels tunnel to them.
    let (s, _) = until(c, "both pods enrolled", Duration::from_secs(20), |s| {
        mesh_pods(s).iter().all(|p| p.mesh == Mesh::Enrolled)
    });
    for p in mesh_pods(&s) {
        assert!(p.ambient && p.in_config, "{p:?}");
        assert_eq!(p.dataplane_mode, "ambient");
        assert_eq!(p.enrolled, Some(true));
        assert_eq!(p.ztunnels.len(), 2, "both ztunnels answered: {p:?}");
        assert!(
            p.ztunnels.values().all(|v| v.as_deref() == Some("HBONE")),
            "{p:?}"
        );
    }

    // 2. Relabel to none: the pods leave the mesh and status says so, with
    //    no contradiction once it settles.
    ambit_tests::write_atomic(&ns_file, &namespaces("none")).unwrap();
    let (s, took) = until(
        c,
        "both pods out of the mesh",
        Duration::from_secs(20),
        |s| {
            note(&mut seen, s);
            mesh_pods(s).iter().all(|p| p.mesh == Mesh::NotEnrolled)
        },
    );
    println!("relabel to none: status settled in {took:?}; seen {seen:?}");
    for p in mesh_pods(&s) {
        assert!(!p.ambient, "{p:?}");
        assert_eq!(p.dataplane_mode, "none", "{p:?}");
        assert_eq!(p.enrolled, Some(false), "the agent released it: {p:?}");
        assert!(
            p.ztunnels.values().all(|v| v.as_deref() == Some("TCP")),
            "{p:?}"
        );
    }
    let text = c.render_status();
    for absent in ["labels say ambient", "DISAGREE", "NOT ENROLLED"] {
        assert!(!text.contains(absent), "{absent:?} in:\n{text}");
    }
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("mesh/")).collect();
    assert_eq!(rows.len(), 2, "{text}");
    for l in rows {
        assert_eq!(l.split_whitespace().nth(3), Some("no"), "{text}");
    }
    // Reality agrees: the call goes straight to the server, no ztunnel
    // carries it (one that did would list it from its accept on).
    let out = c.exec("mesh/client", &call).unwrap();
    assert!(out.status.success(), "{out:?}");
    let s = c.status();
    assert!(
        !s.connections
            .iter()
            .any(|x| x.src_addr.starts_with(CLIENT_IP)),
        "{}",
        c.render_status()
    );

    // 3. Back to ambient: enrolled again, every source agrees.
    ambit_tests::write_atomic(&ns_file, &namespaces("ambient")).unwrap();
    let (s, took) = until(
        c,
        "both pods enrolled again",
        Duration::from_secs(20),
        |s| {
            note(&mut seen, s);
            mesh_pods(s).iter().all(|p| p.mesh == Mesh::Enrolled)
        },
    );
    println!("relabel to ambient: status settled in {took:?}; seen {seen:?}");
    for p in mesh_pods(&s) {
        assert!(p.ambient && p.enrolled == Some(true), "{p:?}");
        assert!(
            p.ztunnels.values().all(|v| v.as_deref() == Some("HBONE")),
            "{p:?}"
        );
    }
    let text = c.render_status();
    assert!(
        !text.contains("DISAGREE") && !text.contains("NOT ENROLLED"),
        "{text}"
    );
    // Only the three live verdicts ever showed, never the old contradiction.
    let allowed = ["Enrolled", "NotEnrolled", "Disagree"].map(String::from);
    assert!(seen.iter().all(|m| allowed.contains(m)), "{seen:?}");
    // And the mesh carries mTLS again (a fresh pod's certificate may take
    // a moment).
    let deadline = Instant::now() + Duration::from_secs(15);
    while !c.exec("mesh/client", &call).unwrap().status.success() {
        assert!(Instant::now() < deadline, "{}", c.render_status());
        std::thread::sleep(Duration::from_millis(300));
    }
    until(
        c,
        "an mTLS connection to the server",
        Duration::from_secs(10),
        |s| {
            s.connections
                .iter()
                .any(|x| x.mtls && x.dst_addr == SERVER && x.report("node-b", "inbound").is_some())
        },
    );
    guard.down().unwrap();
}

/// A TCP connection made from inside `pod`'s network namespace.
fn connect_from_pod(c: &LocalCluster, pod: &str, to: SocketAddr) -> TcpStream {
    let netns = &c.pod(pod).unwrap().netns;
    let ns = PodNetns::open(Path::new("/var/run/netns").join(netns)).unwrap();
    let s = ns
        .run_in(move || TcpStream::connect_timeout(&to, Duration::from_secs(5)))
        .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// The row of the application connection from `src`.
fn row<'s>(s: &'s Status, src: &str) -> Option<&'s Connection> {
    s.connections.iter().find(|x| x.src_addr == src)
}

#[test]
fn pooled_hbone_connections_show_as_separate_application_connections() {
    let test = "pooled_hbone_connections_show_as_separate_application_connections";
    let Some(bins) = enrollbed::local_bin_dir(test) else {
        return;
    };
    let config = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let guard = up(test, config.path(), bins, &state);
    let c: &LocalCluster = &guard;
    let server: SocketAddr = SERVER.parse().unwrap();

    // Three connections of the client app at once, to the same server: the
    // pool spreads them over two HBONE connections (one per ztunnel worker),
    // so two of them share one.
    let mut apps: Vec<TcpStream> = (0..3)
        .map(|_| connect_from_pod(c, "mesh/client", server))
        .collect();
    let srcs: Vec<String> = apps
        .iter()
        .map(|a| a.local_addr().unwrap().to_string())
        .collect();
    assert!(srcs[0] != srcs[1] && srcs[1] != srcs[2] && srcs[0] != srcs[2]);
    let (s, took) = until(
        c,
        "all connections open in status",
        Duration::from_secs(10),
        |s| {
            srcs.iter().all(|src| {
                row(s, src)
                    .is_some_and(|x| x.open && x.mtls && x.report("node-b", "inbound").is_some())
            })
        },
    );
    println!("all open connections listed after {took:?}");
    let rows: Vec<&Connection> = srcs.iter().map(|src| row(&s, src).unwrap()).collect();
    for r in &rows {
        assert_eq!(r.src_workload, "mesh/client", "{r:?}");
        assert_eq!(r.dst_workload, "mesh/server", "{r:?}");
        assert_eq!(r.dst_addr, SERVER);
        assert_eq!(
            r.src_identity.as_deref(),
            Some("spiffe://cluster.local/ns/mesh/sa/default")
        );
        assert!(r.report("node-a", "outbound").is_some(), "{r:?}");
        assert_eq!(r.reported_by.len(), 2, "one report per ztunnel: {r:?}");
    }
    let tunnels: Vec<SocketAddr> = rows
        .iter()
        .map(|r| {
            r.report("node-b", "inbound")
                .and_then(|x| x.hbone_peer)
                .unwrap()
        })
        .collect();
    let mut distinct = tunnels.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        2,
        "three app connections over two pooled HBONE connections: {tunnels:?}"
    );
    for t in &distinct {
        assert_eq!(t.ip().to_string(), CLIENT_IP);
        // A tunnel's port is not shown as any app's.
        assert!(!srcs.contains(&t.to_string()), "{t} in {srcs:?}");
    }
    let text = c.render_status();
    for want in &srcs {
        assert_eq!(
            text.matches(want.as_str()).count(),
            1,
            "{want} once in:\n{text}"
        );
    }
    println!("{text}");

    // All answer, then close: closed rows, bytes counted, no failure.
    for s in apps.iter_mut() {
        s.write_all(b"GET / HTTP/1.1\r\nHost: server\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    }
    drop(apps);
    until(
        c,
        "all connections closed and counted",
        Duration::from_secs(10),
        |s| {
            srcs.iter().all(|src| {
                row(s, src).is_some_and(|x| {
                    !x.open
                        && x.response_flags == "-"
                        && x.reported_by.iter().all(|r| !r.open)
                        && x.report("node-a", "outbound")
                            .is_some_and(|r| r.bytes_received.unwrap_or(0) > 0)
                })
            })
        },
    );
    guard.down().unwrap();
}

/// `GET path` on `addr`: status and body.
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

#[test]
fn ztunnel_admin_root_lists_its_endpoints() {
    let test = "ztunnel_admin_root_lists_its_endpoints";
    let Some(bins) = enrollbed::local_bin_dir(test) else {
        return;
    };
    let config = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let guard = up(test, config.path(), bins, &state);
    let c: &LocalCluster = &guard;
    for n in c.nodes() {
        let (status, index) = get(n.admin_addr, "/");
        assert_eq!(status, 200, "{index}");
        println!("{}'s ztunnel admin /:\n{index}", n.name);
        for path in ["/config_dump", "/connections", "/logging", "/quitquitquit"] {
            assert!(index.contains(path), "{path} missing from:\n{index}");
        }
        // What the index lists is there.
        for path in ["/config_dump", "/connections", "/logging"] {
            let (status, body) = get(n.admin_addr, path);
            assert!(status == 200 || status == 501, "{path}: {status} {body}");
        }
        let (status, body) = get(n.admin_addr, "/connections");
        assert_eq!(status, 200);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(v["open"].is_array() && v["recent"].is_array(), "{v}");
        let (status, body) = get(n.admin_addr, "/no/such/thing");
        assert_eq!(status, 404);
        assert!(body.contains("GET / lists"), "{body}");
        let (status, index) = get(n.stats_addr, "/");
        assert_eq!(status, 200);
        assert!(index.contains("/metrics"), "{index}");
        let (status, index) = get(n.readiness_addr, "/");
        assert_eq!(status, 200);
        assert!(index.contains("/healthz/ready"), "{index}");
    }
    guard.down().unwrap();
}
