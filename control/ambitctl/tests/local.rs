//! `ambitctl local`: planning from YAML (no root needed) and whole clusters
//! end to end (root, `ip`, `iptables`, the CNI reference plugins and the
//! workspace's binaries — `cargo build --workspace` — else SKIP).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::Ipv4Addr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ambitctl::local::status::opened_by_policy;
use ambitctl::local::{
    self, DownOptions, LocalCluster, LocalError, UpOptions, app_ports, check_name, plan_documents,
};

fn plan(yaml: &str) -> Result<local::Plan, LocalError> {
    plan_documents(
        Path::new("/cfg"),
        &[(PathBuf::from("/cfg/all.yaml"), yaml.to_string())],
    )
}

fn pod(ns: &str, name: &str, node: &str, ip: &str, extra: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {ns}\n{extra}spec:\n  nodeName: {node}\nstatus:\n  podIP: {ip}\n---\n"
    )
}

const NAMESPACES: &str = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: mesh\n  labels: {istio.io/dataplane-mode: ambient}\n---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: plain\n---\n";

// ---------------------------------------------------------------- plan

#[test]
fn plan_has_sorted_nodes_with_their_subnets_and_lan_addresses() {
    let yaml = [
        NAMESPACES,
        &pod(
            "mesh",
            "server",
            "node-b",
            "10.20.2.10",
            "  annotations: {ambit.dev/demo-app: \"--http 8080  --tcp 7000\"}\n",
        ),
        &pod("mesh", "client", "node-a", "10.20.1.10", ""),
        &pod(
            "mesh",
            "optout",
            "node-a",
            "10.20.1.11",
            "  labels: {istio.io/dataplane-mode: none}\n",
        ),
        &pod("plain", "outsider", "node-a", "10.20.1.20", ""),
    ]
    .concat();
    let p = plan(&yaml).unwrap();
    let nodes: Vec<_> = p
        .nodes
        .iter()
        .map(|n| (n.name.as_str(), n.lan_ip, n.subnet_cidr(), n.gateway))
        .collect();
    assert_eq!(
        nodes,
        [
            (
                "node-a",
                Ipv4Addr::new(172, 31, 0, 1),
                "10.20.1.0/24".to_string(),
                Ipv4Addr::new(10, 20, 1, 1)
            ),
            (
                "node-b",
                Ipv4Addr::new(172, 31, 0, 2),
                "10.20.2.0/24".to_string(),
                Ipv4Addr::new(10, 20, 2, 1)
            ),
        ]
    );
    let pods: Vec<_> = p
        .pods
        .iter()
        .map(|p| (p.key(), p.node.as_str(), p.ambient))
        .collect();
    assert_eq!(
        pods,
        [
            ("mesh/client".to_string(), "node-a", true),
            ("mesh/optout".to_string(), "node-a", false),
            ("mesh/server".to_string(), "node-b", true),
            ("plain/outsider".to_string(), "node-a", false),
        ]
    );
    let server = p.pods.iter().find(|p| p.name == "server").unwrap();
    assert_eq!(
        server.app.as_deref(),
        Some(&["--http", "8080", "--tcp", "7000"].map(String::from)[..])
    );
    assert_eq!(server.service_account, "default");
    assert_eq!(app_ports(server.app.as_ref().unwrap()), [8080, 7000]);
}

fn plan_error(yaml: &str) -> String {
    match plan(yaml) {
        Ok(p) => panic!("expected an error, got {p:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_pod_without_pod_ip_is_named_in_the_error() {
    let yaml = "apiVersion: v1\nkind: Pod\nmetadata: {name: lost, namespace: mesh}\nspec: {nodeName: node-a}\n";
    let e = plan_error(yaml);
    assert!(
        e.contains("mesh/lost") && e.contains("no status.podIP"),
        "{e}"
    );
    assert!(e.contains("/cfg/all.yaml"), "{e}");
}

#[test]
fn a_pod_without_node_name_is_an_error() {
    let yaml =
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: n}\nstatus: {podIP: 10.1.1.5}\n";
    let e = plan_error(yaml);
    assert!(e.contains("n/p") && e.contains("spec.nodeName"), "{e}");
}

#[test]
fn a_node_whose_pods_span_two_subnets_is_an_error() {
    let yaml = [
        pod("a", "one", "node-a", "10.1.1.5", ""),
        pod("a", "two", "node-a", "10.1.2.5", ""),
    ]
    .concat();
    let e = plan_error(&yaml);
    assert!(
        e.contains("node-a") && e.contains("10.1.1.0/24") && e.contains("10.1.2.0/24"),
        "{e}"
    );
}

#[test]
fn two_nodes_sharing_a_subnet_is_an_error() {
    let yaml = [
        pod("a", "one", "node-a", "10.1.1.5", ""),
        pod("a", "two", "node-b", "10.1.1.6", ""),
    ]
    .concat();
    let e = plan_error(&yaml);
    assert!(
        e.contains("node-a") && e.contains("node-b") && e.contains("10.1.1.0/24"),
        "{e}"
    );
}

#[test]
fn duplicate_gateway_lan_and_ipv6_addresses_are_errors() {
    let dup = [
        pod("a", "one", "n", "10.1.1.5", ""),
        pod("a", "two", "n", "10.1.1.5", ""),
    ]
    .concat();
    assert!(plan_error(&dup).contains("both have podIP 10.1.1.5"));
    assert!(plan_error(&pod("a", "gw", "n", "10.1.1.1", "")).contains(".1 (the node's gateway)"));
    assert!(plan_error(&pod("a", "lan", "n", "172.31.0.9", "")).contains("lan"));
    assert!(plan_error(&pod("a", "six", "n", "fd00::5", "")).contains("IPv6"));
}

#[test]
fn config_errors_and_empty_configs_are_reported() {
    let e = plan_error(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: x, namespace: y}\nspec: {nodeName: [1]}\n",
    );
    assert!(e.contains("has errors") && e.contains("Pod/y/x"), "{e}");
    let e = plan_error(NAMESPACES);
    assert!(e.contains("no pods"), "{e}");
}

#[test]
fn the_shipped_demo_plans() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/local/demo");
    let p = local::plan_dir(&dir).unwrap();
    assert!(p.nodes.len() >= 2, "{p:?}");
    assert!(p.pods.iter().any(|p| p.ambient) && p.pods.iter().any(|p| !p.ambient));
    // billing/billing-0 asks for a sidecar (its namespace); no other pod does.
    let sidecars: Vec<String> = p
        .pods
        .iter()
        .filter(|p| p.sidecar)
        .map(|p| p.key())
        .collect();
    assert_eq!(sidecars, ["billing/billing-0"]);
}

#[test]
fn cluster_names_cannot_prefix_each_other() {
    for ok in ["ambit", "t1a2b3c", "a"] {
        check_name(ok).unwrap();
    }
    for bad in ["", "Ambit", "a-b", "1abc", "a/b", "abcdefghijklmnopq"] {
        assert!(check_name(bad).is_err(), "{bad}");
    }
}

#[test]
fn connection_totals_are_read_from_parsed_metrics() {
    let metrics = "# TYPE istio_tcp_connections_opened counter\n\
        istio_tcp_connections_opened_total{reporter=\"source\",connection_security_policy=\"mutual_tls\"} 3\n\
        istio_tcp_connections_opened_total{reporter=\"destination\",connection_security_policy=\"mutual_tls\"} 2\n\
        istio_tcp_connections_opened_total{reporter=\"destination\",connection_security_policy=\"none\"} 1\n\
        istio_tcp_connections_closed_total{connection_security_policy=\"none\"} 9\n";
    let m = opened_by_policy(metrics);
    assert_eq!(m.get("mutual_tls"), Some(&5));
    assert_eq!(m.get("none"), Some(&1));
    assert_eq!(m.len(), 2);
}

// ---------------------------------------------------------------- end to end

/// The directory of the workspace's binaries, if this test can run here.
fn bin_dir(test: &str) -> Option<PathBuf> {
    let uid = std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid());
    if uid != 0 {
        println!("SKIP {test}: needs root (uid {uid})");
        return None;
    }
    let dir = Path::new(env!("CARGO_BIN_EXE_ambitctl"))
        .parent()?
        .to_path_buf();
    match local::prerequisites(&dir) {
        Ok(()) => Some(dir),
        Err(e) => {
            println!("SKIP {test}: {e} (the binaries of other crates: `cargo build --workspace`)");
            None
        }
    }
}

fn name() -> String {
    format!("t{:06x}", rand::random::<u32>() & 0xff_ffff)
}

const CLUSTER: &str =
    "mesh/server: --http 8080 on node-b; mesh/client and plain/outsider on node-a";

fn write_config(dir: &Path, server_args: &str) {
    let yaml = [
        NAMESPACES,
        &pod(
            "mesh",
            "server",
            "node-b",
            "10.20.2.10",
            &format!("  annotations: {{ambit.dev/demo-app: \"{server_args}\"}}\n"),
        ),
        &pod("mesh", "client", "node-a", "10.20.1.10", ""),
        &pod("plain", "outsider", "node-a", "10.20.1.20", ""),
    ]
    .concat();
    std::fs::write(dir.join("all.yaml"), yaml).unwrap();
}

/// Whether anything of cluster `name` (state in `state`) is left.
fn assert_gone(name: &str, state: &Path, pids: &[u32]) {
    let prefix = format!("{name}-");
    let left: Vec<String> = std::fs::read_dir("/var/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "netns left: {left:?}");
    for pid in pids {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state_char = stat
            .rsplit_once(')')
            .map(|(_, r)| r.trim_start().chars().next());
        assert!(
            matches!(state_char, None | Some(Some('Z' | 'X'))),
            "process {pid} still runs: {stat}"
        );
    }
    assert!(!state.exists(), "{} still exists", state.display());
}

/// Runs `args` in `pod` until it succeeds (a fresh pod's certificate may
/// still be on its way), up to 15 s.
fn exec_ok(c: &LocalCluster, pod: &str, args: &[&str]) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let out = c.exec(pod, args).unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            return stdout;
        }
        assert!(
            Instant::now() < deadline,
            "{args:?} in {pod} failed: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn up_exec_status_down_end_to_end() {
    let Some(bin) = bin_dir("up_exec_status_down_end_to_end") else {
        return;
    };
    let cfg = tempfile::tempdir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write_config(cfg.path(), "--http 8080");
    let name = name();
    let state = tmp.path().join("state");
    let mut opts = UpOptions::new(cfg.path(), &bin);
    opts.name = name.clone();
    opts.state_dir = Some(state.clone());
    let started = Instant::now();
    let mut cluster = local::up(&opts).unwrap().down_on_drop();
    println!("up ({CLUSTER}) took {:?}", started.elapsed());
    let pids: Vec<u32> = cluster.state.processes.iter().map(|p| p.pid).collect();
    assert_eq!(
        pids.len(),
        7,
        "control + 2 agents + 2 ztunnels + 1 app + the waypoint controller"
    );

    let s = cluster.status();
    assert!(s.healthy(), "{}", cluster.render_status());
    let enrolled = |k: &str| s.pod(k).and_then(|p| p.enrolled);
    assert_eq!(enrolled("mesh/server"), Some(true));
    assert_eq!(enrolled("mesh/client"), Some(true));
    assert_eq!(enrolled("plain/outsider"), Some(false));
    assert_eq!(s.pod("mesh/server").unwrap().app_running, Some(true));

    let out = exec_ok(
        &cluster,
        "mesh/client",
        &["ambit-demo", "--call", "http://10.20.2.10:8080/", "--once"],
    );
    assert!(out.contains("\"status\": 200"), "{out}");
    // Outside the mesh, no STRICT: plaintext gets through.
    exec_ok(
        &cluster,
        "plain/outsider",
        &["ambit-demo", "--call", "http://10.20.2.10:8080/", "--once"],
    );

    // The access logs say which was which; the metrics count mTLS.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = cluster.status();
        let to_server = |mtls: bool| {
            s.connections.iter().any(|c| {
                c.mtls == mtls && c.dst_workload == "mesh/server" && c.dst_addr.ends_with(":8080")
            })
        };
        let counted = s.nodes.iter().any(|n| {
            n.connections_opened
                .get("mutual_tls")
                .is_some_and(|v| *v > 0)
        });
        if to_server(true) && to_server(false) && counted {
            let text = cluster.render_status();
            assert!(
                text.contains("mTLS") && text.contains("plaintext"),
                "{text}"
            );
            println!("{text}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no mTLS + plaintext connections to the server in the status:\n{}",
            cluster.render_status()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // A pod deleted as a runtime does (CNI DEL): its node agent forgets it.
    let outsider = cluster.pod("plain/outsider").unwrap().clone();
    cluster.delete_pod("plain/outsider").unwrap();
    assert!(!Path::new("/var/run/netns").join(&outsider.netns).exists());
    let table = cluster
        .nodes()
        .iter()
        .find(|n| n.name == "node-a")
        .unwrap()
        .agent_dir
        .join("pods.json");
    let table = std::fs::read_to_string(table).unwrap();
    assert!(
        !table.contains("outsider") && table.contains("client"),
        "{table}"
    );
    assert_eq!(cluster.status().pods.len(), 2);

    // No such pod: the error lists the pods.
    let e = cluster
        .exec("mesh/nope", &["true"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("mesh/client"), "{e}");

    // Issue 14: what `local exec … &` left running in a pod goes with the
    // pod, even when it ignores SIGTERM, and `down` returns once it is gone.
    let mut stray = cluster
        .command(
            "mesh/client",
            &["sh", "-c", "trap '' TERM; while :; do sleep 1; done"],
        )
        .unwrap()
        .stdin(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let report = cluster.down().unwrap();
    println!("down took {:?}:\n{}", started.elapsed(), report.render());
    assert!(
        stray.try_wait().unwrap().is_some(),
        "a process left in a pod's netns survived `down`: {report:?}"
    );
    assert!(
        report
            .stopped
            .iter()
            .any(|s| s.contains("in netns") && s.contains("-mesh-client")),
        "{report:?}"
    );
    assert_eq!(
        report.stopped.len(),
        9,
        "7 of the cluster (the waypoint controller too), sh and sleep: {report:?}"
    );
    assert_eq!(
        report.netns_removed.len(),
        5,
        "lan, 2 nodes, 2 pods: {report:?}"
    );
    assert_gone(&name, &state, &pids);
    let mut again = DownOptions::new(&name);
    again.state_dir = Some(state.clone());
    let report = local::down(&again).unwrap();
    assert!(report.was_empty(), "{report:?}");
}

#[test]
fn down_cleans_up_after_a_crash_without_state_file() {
    let Some(bin) = bin_dir("down_cleans_up_after_a_crash_without_state_file") else {
        return;
    };
    let cfg = tempfile::tempdir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write_config(cfg.path(), "--http 8080");
    let name = name();
    let state = tmp.path().join("state");
    let mut opts = UpOptions::new(cfg.path(), &bin);
    opts.name = name.clone();
    opts.state_dir = Some(state.clone());
    let cluster = local::up(&opts).unwrap();
    let pids: Vec<u32> = cluster.state.processes.iter().map(|p| p.pid).collect();
    // A second `up` of the same cluster refuses and touches nothing.
    let e = local::up(&opts).unwrap_err();
    assert!(matches!(e, LocalError::Exists { .. }), "{e}");
    // A leftover the state file does not list (one of the mesh's binaries
    // naming the state dir, without the environment marker), and a user's
    // `tail -f` of a log, which `down` must leave alone.
    let fake = tmp.path().join("ztunnel");
    std::fs::copy("/bin/sh", &fake).unwrap();
    let mut leftover = Command::new(&fake)
        .args(["-c", "sleep 60; true"])
        .arg(state.join("nodes"))
        .spawn()
        .unwrap();
    let mut tail = Command::new("tail")
        .arg("-f")
        .arg(state.join("logs/control.log"))
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::fs::write(state.join("state.json"), "{ truncated").unwrap();
    assert!(matches!(
        LocalCluster::open(&name, Some(&state)),
        Err(LocalError::BadState { .. })
    ));
    let mut down = DownOptions::new(&name);
    down.state_dir = Some(state.clone());
    let report = local::down(&down).unwrap();
    // The 7 of the cluster (the waypoint controller among them) and the leftover.
    assert_eq!(report.stopped.len(), 8, "found by /proc scan: {report:?}");
    assert!(leftover.try_wait().unwrap().is_some(), "{report:?}");
    assert!(tail.try_wait().unwrap().is_none(), "down killed a tail -f");
    tail.kill().unwrap();
    tail.wait().unwrap();
    assert_eq!(report.netns_removed.len(), 6, "{report:?}");
    assert!(report.notes.iter().any(|n| n.contains("unreadable")));
    assert_gone(&name, &state, &pids);
    drop(cluster);
}

#[test]
fn a_failed_up_removes_what_it_made() {
    let Some(bin) = bin_dir("a_failed_up_removes_what_it_made") else {
        return;
    };
    let cfg = tempfile::tempdir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write_config(cfg.path(), "--http 8080 --no-such-flag");
    let name = name();
    let state = tmp.path().join("state");
    let mut opts = UpOptions::new(cfg.path(), &bin);
    opts.name = name.clone();
    opts.state_dir = Some(state.clone());
    let e = local::up(&opts).unwrap_err().to_string();
    assert!(
        e.contains("mesh/server") && e.contains("--no-such-flag") && e.contains("was removed"),
        "{e}"
    );
    assert_gone(&name, &state, &[]);
}

#[test]
fn the_cli_drives_a_cluster() {
    let Some(bin) = bin_dir("the_cli_drives_a_cluster") else {
        return;
    };
    let cfg = tempfile::tempdir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write_config(cfg.path(), "--http 8080");
    let name = name();
    let state = tmp.path().join("state");
    let ctl = |args: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_ambitctl"));
        c.arg("local").args(args);
        c.args(["--name", &name, "--state-dir"]).arg(&state);
        c
    };
    let up = ctl(&[
        "up",
        cfg.path().to_str().unwrap(),
        "--bin-dir",
        bin.to_str().unwrap(),
    ])
    .output()
    .unwrap();
    let text = String::from_utf8_lossy(&up.stdout);
    // From here on, whatever happens, remove the cluster.
    let _cleanup = scopeguard(|| {
        let _ = ctl(&["down"]).output();
    });
    assert!(
        up.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&up.stderr)
    );
    for want in [
        "is up: 2 nodes, 3 pods",
        "mesh/server",
        "enrolled",
        "local exec",
        "local down",
    ] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
    let json = ctl(&["status", "-o", "json"]).output().unwrap();
    assert!(json.status.success());
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["nodes"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["control"]["ready"], true, "{v}");
    // exec: inherited stdio, CMD's exit status.
    let mut exec = ctl(&["exec"]);
    exec.args([
        "mesh/client",
        "--",
        "sh",
        "-c",
        "echo $POD_NAMESPACE/$POD_NAME; exit 3",
    ]);
    let out = exec.output().unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "mesh/client");
    let down = ctl(&["down"]).output().unwrap();
    let text = String::from_utf8_lossy(&down.stdout);
    assert!(down.status.success() && text.contains("is gone"), "{text}");
    let again = ctl(&["down"]).output().unwrap();
    assert!(again.status.success());
    assert!(String::from_utf8_lossy(&again.stdout).contains("Nothing to remove"));
    assert_gone(&name, &state, &[]);
}

/// Runs `f` on drop.
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}
