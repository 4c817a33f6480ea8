//! The demo mesh end to end on the code of `ambitctl local up`
//! (`ambitctl::local`): the real binaries as processes, nodes and pods
//! as network namespaces wired by the CNI reference plugins chained with
//! `ambit-cni`, a node agent and a ztunnel per node, the demo apps in the
//! pods. Each test has its own cluster name and state dir (safe in
//! parallel) and tears it down, also when it fails.
//!
//! Needs root, `ip`, `iptables`, the CNI reference plugins and the
//! workspace's binaries (`cargo test --workspace` builds them); prints SKIP
//! and passes otherwise.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ambit_tests::enrollbed;
use ambit_tests::{copy_fixture, workspace_root};
use ambitctl::local::{self, DownOnDrop, LocalCluster, UpOptions};

fn up(
    test: &str,
    config: &std::path::Path,
    bins: PathBuf,
    state: &tempfile::TempDir,
    working_copy: bool,
) -> DownOnDrop {
    let name = format!("t{:06x}", rand::random::<u32>() & 0xff_ffff);
    let mut opts = UpOptions::new(config, bins);
    opts.name = name;
    opts.state_dir = Some(state.path().join("state"));
    opts.working_copy = working_copy;
    let cluster = local::up(&opts).unwrap_or_else(|e| panic!("{test}: local up failed: {e}"));
    cluster.down_on_drop()
}

fn exec(c: &LocalCluster, pod: &str, args: &[&str]) -> (bool, String) {
    let out = c.exec(pod, args).unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

fn eventually(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn demo_platform_is_mtls_across_nodes_and_refuses_legacy_plaintext() {
    let test = "demo_platform_is_mtls_across_nodes_and_refuses_legacy_plaintext";
    let Some(bins) = enrollbed::local_bin_dir(test) else {
        return;
    };
    let config = copy_fixture(&workspace_root().join("deploy/local/demo")).unwrap();
    let state = tempfile::tempdir().unwrap();
    let guard = up(test, config.path(), bins, &state, false);
    let c: &LocalCluster = &guard;

    // Every ai-inference pod is enrolled, the legacy ones are not.
    let status = c.status();
    for p in &status.pods {
        let want = p.namespace == "ai-inference";
        assert_eq!(p.enrolled, Some(want), "{}/{}", p.namespace, p.name);
    }

    // One request through the whole chain, via Service IPs.
    let (ok, out) = exec(
        c,
        "ai-inference/orchestrator-0",
        &["ambit-demo", "--call", "http://10.96.0.10/ask", "--once"],
    );
    assert!(ok, "{out}");
    for hop in ["embedding-", "vector-db-0", "llm-v"] {
        assert!(out.contains(hop), "the chain reaches {hop}: {out}");
    }

    // The legacy client, outside the mesh, is refused by STRICT mTLS.
    let (ok, out) = exec(
        c,
        "legacy/legacy-client",
        &[
            "ambit-demo",
            "--call",
            "http://10.10.1.10:8080/ask",
            "--once",
        ],
    );
    assert!(!ok, "plaintext into STRICT ai-inference must fail: {out}");

    // Status shows both: cross-node mTLS, and the DENY.
    eventually(
        "status to show the traffic",
        Duration::from_secs(20),
        || {
            let s = c.status();
            let cross = s.connections.iter().any(|x| {
                x.mtls
                    && x.report("node-1", "outbound").is_some()
                    && x.report("node-2", "inbound").is_some()
                    && x.src_addr.starts_with("10.10.1.")
            });
            let denied = s.connections.iter().any(|x| {
                !x.mtls && x.response_flags == "DENY" && x.src_workload.contains("legacy-client")
            });
            cross && denied
        },
    );
    guard.down().unwrap();
}

#[test]
fn labelling_a_namespace_enrolls_its_running_pods() {
    let test = "labelling_a_namespace_enrolls_its_running_pods";
    let Some(bins) = enrollbed::local_bin_dir(test) else {
        return;
    };
    let config = copy_fixture(&workspace_root().join("deploy/local/demo")).unwrap();
    let state = tempfile::tempdir().unwrap();
    // As `ambitctl local up` runs it: the mesh serves a working copy in the
    // state dir, so the edit below never touches the directory given to up.
    let guard = up(test, config.path(), bins, &state, true);
    let c: &LocalCluster = &guard;
    let call = [
        "ambit-demo",
        "--call",
        "http://10.10.1.10:8080/ask",
        "--once",
    ];
    assert!(!exec(c, "legacy/legacy-client", &call).0);

    // legacy becomes ambient: its running pods are enrolled (no restart) and
    // the client now reaches the STRICT orchestrator over mTLS.
    assert_eq!(c.source_dir(), Some(config.path()));
    assert!(
        c.config_dir().starts_with(state.path()),
        "{}",
        c.config_dir().display()
    );
    let original = std::fs::read_to_string(config.path().join("namespaces.yaml")).unwrap();
    let ns = c.config_dir().join("namespaces.yaml");
    let text = std::fs::read_to_string(&ns).unwrap().replace(
        "metadata:\n  name: legacy\n",
        "metadata:\n  name: legacy\n  labels:\n    istio.io/dataplane-mode: ambient\n",
    );
    ambit_tests::write_atomic(&ns, &text).unwrap();
    eventually(
        "legacy pods to be enrolled",
        Duration::from_secs(20),
        || {
            c.status()
                .pods
                .iter()
                .filter(|p| p.namespace == "legacy")
                .all(|p| p.enrolled == Some(true))
        },
    );
    eventually(
        "the legacy client to get through",
        Duration::from_secs(20),
        || exec(c, "legacy/legacy-client", &call).0,
    );
    assert_eq!(
        std::fs::read_to_string(config.path().join("namespaces.yaml")).unwrap(),
        original,
        "the directory given to `up` was edited"
    );
    // `local down --keep-config DIR` saves the edited copy, then removes all.
    let kept = state.path().join("kept");
    let mut down = local::DownOptions::new(c.name());
    down.state_dir = Some(c.state_dir().to_path_buf());
    down.keep_config = Some(kept.clone());
    let report = local::down(&down).unwrap();
    assert_eq!(report.config_kept.as_deref(), Some(kept.as_path()));
    assert!(report.state_dir_removed);
    assert_eq!(
        std::fs::read_to_string(kept.join("namespaces.yaml")).unwrap(),
        text
    );
    guard.down().unwrap();
}
