//! The mesh's config from a real kube-apiserver (the kit in
//! `../shared/kube`) to a connected ztunnel:
//!
//! - a namespace label, a new pod (its status written through the status
//!   subresource, as the kubelet does) and an AuthorizationPolicy edit
//!   reach a ztunnel's xDS stream in milliseconds;
//! - the API server killed for a while and started again: the next change
//!   arrives within 2 s of it being back (the watches retry at once when
//!   discovery sees it answer, not at the end of their backoff);
//! - `ambitctl analyze --cluster` reads the demo platform applied to the
//!   cluster as it reads the same YAML as files, on the standard and the
//!   v1.2.1 Gateway API channels, exits 0 on a clean cluster and non-zero
//!   on a broken one, and reports no false finding on core kinds.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use ambit_control::{ControlConfig, ControlPlane};
use ambit_tests::kubeapi::{Crds, KubeApiServer};
use ambit_tests::kubebed::{Observer, pod_uid, wait_synced, yaml_docs};
use ambitctl::analyze::{self, Cluster, Files, Report, Source};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(20);

/// How long the API server stays down (`AMBIT_KUBE_OUTAGE_SECS`, 30).
fn outage() -> Duration {
    Duration::from_secs(
        std::env::var("AMBIT_KUBE_OUTAGE_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(30),
    )
}

async fn control_plane(kube: &KubeApiServer, dir: &Path) -> ControlPlane {
    let kc = kube
        .kubeconfig_for("ambit-system", "ambit-control", &dir.join("cp.kubeconfig"))
        .await
        .unwrap();
    // The shipped retry cap, not the tests' 1 s: the recovery under test
    // must not come from a short backoff.
    let mut cfg = ControlConfig::for_kube_tests(kc, dir.join("data"), "a");
    cfg.kube_retry_max_ms = 4_000;
    ControlPlane::start(cfg).await.unwrap()
}

/// Reads responses until one sends `name`; returns how long it took.
async fn until_sent(obs: &mut Observer, name: &str) -> Duration {
    let start = Instant::now();
    loop {
        let left = LIMIT.checked_sub(start.elapsed()).expect(name);
        let (sent, _) = obs.next(left).await.unwrap();
        if sent.iter().any(|n| n == name) {
            return start.elapsed();
        }
    }
}

fn policy(name: &str, port: &str) -> Value {
    json!({
        "apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, "action": "DENY",
                 "rules": [{"to": [{"operation": {"ports": [port]}}]}]},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_reach_ztunnel_and_recover_within_2s_of_an_api_server_restart() {
    let kube = KubeApiServer::start(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    let zt = kube
        .running_pod(
            "ambit-system",
            "ztunnel-a",
            "ztunnel",
            "node-1",
            "10.244.0.2",
            json!({"app": "ztunnel"}),
        )
        .await
        .unwrap();
    kube.apply(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}}))
        .await
        .unwrap();
    kube.apply(&json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "web", "namespace": "shop"}}))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&kube, dir.path()).await;
    wait_synced(&cp, LIMIT).await.unwrap();
    let token = kube
        .token(
            "ambit-system",
            "ztunnel",
            Some("istio-ca"),
            Some(("ztunnel-a", &zt)),
        )
        .await
        .unwrap();
    let mut addresses =
        Observer::connect_with_token(cp.xds_addr(), ambit_proto::ADDRESS_TYPE_URL, &token)
            .await
            .unwrap();
    let mut policies =
        Observer::connect_with_token(cp.xds_addr(), ambit_proto::AUTHORIZATION_TYPE_URL, &token)
            .await
            .unwrap();
    addresses
        .until(LIMIT, "the initial state", |h| {
            h.contains(&pod_uid("ambit-system", "ztunnel-a"))
        })
        .await
        .unwrap();

    // A new pod, once the kubelet wrote its IP.
    let web = pod_uid("shop", "web-0");
    let t = Instant::now();
    kube.running_pod(
        "shop",
        "web-0",
        "web",
        "node-1",
        "10.244.0.5",
        json!({"app": "web"}),
    )
    .await
    .unwrap();
    until_sent(&mut addresses, &web).await;
    let pod_took = t.elapsed();
    // The namespace enrolled: the pod's workload is sent again (HBONE).
    let t = Instant::now();
    kube.apply(&json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "shop", "labels": {"istio.io/dataplane-mode": "ambient"}}}))
        .await
        .unwrap();
    until_sent(&mut addresses, &web).await;
    let label_took = t.elapsed();
    // A policy, then an edit of it.
    let t = Instant::now();
    kube.apply(&policy("deny-9000", "9000")).await.unwrap();
    until_sent(&mut policies, "shop/deny-9000").await;
    let create_took = t.elapsed();
    let t = Instant::now();
    kube.apply(&policy("deny-9000", "9001")).await.unwrap();
    until_sent(&mut policies, "shop/deny-9000").await;
    let edit_took = t.elapsed();
    println!(
        "API write -> ztunnel: pod {pod_took:?}, namespace label {label_took:?}, policy {create_took:?}, policy edit {edit_took:?}"
    );
    for took in [label_took, create_took, edit_took] {
        assert!(took < Duration::from_secs(1), "{took:?}");
    }

    // The API server goes away and comes back.
    kube.stop_apiserver().unwrap();
    tokio::time::sleep(outage()).await;
    kube.restart_apiserver().await.unwrap();
    let back = Instant::now();
    kube.apply(&policy("after-restart", "9002")).await.unwrap();
    until_sent(&mut policies, "shop/after-restart").await;
    let recovered = back.elapsed();
    println!(
        "after {:?} without the API server, the first change reached ztunnel {recovered:?} after it was back",
        outage()
    );
    assert!(recovered < Duration::from_secs(2), "{recovered:?}");
    cp.shutdown().await;
}

fn findings(report: &Report) -> BTreeSet<(String, String)> {
    report
        .messages
        .iter()
        .map(|m| (m.code.to_string(), m.resource.to_string()))
        .collect()
}

/// Applies the demo platform as a user would: Namespaces first, each
/// pod's ServiceAccount, pods with an image, then their status as the
/// kubelet writes it.
async fn apply_demo(kube: &KubeApiServer, demo: &Path) -> usize {
    let mut docs = Vec::new();
    for entry in std::fs::read_dir(demo).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            docs.extend(yaml_docs(&path).unwrap());
        }
    }
    docs.sort_by_key(|d| d["kind"] != "Namespace");
    for d in &docs {
        if d["kind"] != "Pod" {
            kube.apply(d).await.unwrap();
            continue;
        }
        let ns = d["metadata"]["namespace"].as_str().unwrap();
        let name = d["metadata"]["name"].as_str().unwrap();
        let sa = d["spec"]["serviceAccountName"]
            .as_str()
            .unwrap_or("default");
        // `default` too: the ServiceAccount controller that would make it
        // does not run on a bare API server.
        kube.apply(&json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": sa, "namespace": ns}}))
            .await
            .unwrap();
        let mut pod = d.clone();
        let status = pod.as_object_mut().unwrap().remove("status");
        // The local demo leaves out what only a container runtime needs.
        if pod["spec"]["containers"]
            .as_array()
            .is_none_or(Vec::is_empty)
        {
            pod["spec"]["containers"] = json!([{"name": "app"}]);
        }
        for c in pod["spec"]["containers"].as_array_mut().unwrap() {
            c["image"] = json!("example.test/demo:1");
        }
        kube.apply(&pod).await.unwrap();
        if let Some(status) = status {
            let (api, _) =
                ambit_tests::kubeapi::api_of(&kube.client().await.unwrap(), &pod).unwrap();
            api.patch_status(
                name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&json!({"status": status})),
            )
            .await
            .unwrap();
        }
    }
    docs.len()
}

/// The `ambitctl` binary beside this test's.
fn ambitctl() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("ambitctl")
}

async fn analyze_cluster(crds: Crds) {
    let kube = KubeApiServer::start(crds).await.unwrap();
    let client = kube.client().await.unwrap();
    let kubeconfig = kube.kubeconfig.clone();
    let run = move || {
        let out = std::process::Command::new(ambitctl())
            .args(["analyze", "--kubeconfig"])
            .arg(&kubeconfig)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    // A clean cluster: nothing to say, exit 0.
    let (code, text) = tokio::task::spawn_blocking(run.clone()).await.unwrap();
    assert_eq!(code, Some(0), "{text}");
    assert!(!text.contains("AMB0001"), "{text}");

    let demo = ambit_tests::workspace_root().join("deploy/local/demo");
    let loaded = apply_demo(&kube, &demo).await;
    let cluster = Cluster::list(client.clone(), kube.server.clone())
        .await
        .unwrap();
    let from_cluster = analyze::analyze(&[&cluster as &dyn Source], &[]).unwrap();
    let files = Files::new([demo]);
    let from_files = analyze::analyze(&[&files as &dyn Source], &[]).unwrap();
    println!(
        "{crds:?}: {loaded} demo objects applied; {} listed back ({} absent kinds), {} findings",
        cluster.documents().unwrap().len(),
        cluster.absent.len(),
        from_cluster.messages.len()
    );
    assert_eq!(findings(&from_cluster), findings(&from_files));
    let (code, text) = tokio::task::spawn_blocking(run.clone()).await.unwrap();
    assert_eq!(code, Some(0), "{text}");

    // The seed's mistake applied to the cluster: a route to a subset no
    // DestinationRule defines.
    kube.apply(&json!({
        "apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
        "metadata": {"name": "llm-typo", "namespace": "ai-inference"},
        "spec": {"hosts": ["llm"], "http": [{"route": [{"destination": {"host": "llm", "subset": "v3"}}]}]},
    }))
    .await
    .unwrap();
    let (code, text) = tokio::task::spawn_blocking(run).await.unwrap();
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.lines()
            .any(|l| l.contains("IST0101") && l.contains("llm-typo")),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn analyze_reads_a_standard_channel_cluster_as_it_reads_files() {
    analyze_cluster(Crds::Standard).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn analyze_reads_a_gateway_api_v1_2_1_cluster_as_it_reads_files() {
    analyze_cluster(Crds::V1_2_1).await;
}

/// An AuthorizationPolicy that Istio's CRD schema accepts but Istio
/// rejects (an unknown `when` key, a port given by name): rejected with its
/// field path in `/debug/config_errors`, as `Reconciled=False` on the
/// object, by `analyze`, and the last good version keeps serving — never a
/// silently different policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_istio_would_reject_is_rejected_with_its_field_path_everywhere() {
    let kube = KubeApiServer::start(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    kube.apply(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}}))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&kube, dir.path()).await;
    wait_synced(&cp, LIMIT).await.unwrap();
    kube.apply(&policy("guard", "9000")).await.unwrap();
    let good = |body: &str| body.trim() == "[]";
    ambit_tests::eventually(LIMIT, "the good policy accepted", || async {
        let b = ambit_tests::get(cp.monitoring_addr(), "/debug/config_errors")
            .await
            .ok()?;
        good(&b).then_some(())
    })
    .await
    .unwrap();

    // The CRD schema lets both through: the API server stores them.
    for (spec, path) in [
        (
            json!({"selector": {"matchLabels": {"app": "web"}}, "action": "ALLOW",
                   "rules": [{"when": [{"key": "source.nmespace", "values": ["shop"]}]}]}),
            "spec.rules[0].when[0].key",
        ),
        (
            json!({"selector": {"matchLabels": {"app": "web"}}, "action": "DENY",
                   "rules": [{"to": [{"operation": {"ports": ["http"]}}]}]}),
            "spec.rules[0].to[0].operation.ports",
        ),
    ] {
        kube.apply(
            &json!({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
            "metadata": {"name": "guard", "namespace": "shop"}, "spec": spec}),
        )
        .await
        .unwrap();
        let errors = ambit_tests::eventually(LIMIT, "the rejection", || async {
            let b = ambit_tests::get(cp.monitoring_addr(), "/debug/config_errors")
                .await
                .ok()?;
            b.contains(path).then_some(b)
        })
        .await
        .unwrap();
        assert!(
            errors.contains("last accepted version keeps serving"),
            "{errors}"
        );
        // The leader writes the reason on the object.
        let status = ambit_tests::eventually(LIMIT, "Reconciled=False", || async {
            let (api, _) =
                ambit_tests::kubeapi::api_of(&kube.client().await.ok()?, &policy("guard", "1"))
                    .ok()?;
            let obj = api.get("guard").await.ok()?;
            let c = obj.data["status"]["conditions"]
                .as_array()?
                .first()?
                .clone();
            (c["status"] == "False" && c["message"].as_str()?.contains(path)).then_some(c)
        })
        .await
        .unwrap();
        assert_eq!(status["type"], "Reconciled", "{status}");
        // And analyze names it too.
        let client = kube.client().await.unwrap();
        let cluster = Cluster::list(client, kube.server.clone()).await.unwrap();
        let report = analyze::analyze(&[&cluster as &dyn Source], &[]).unwrap();
        assert!(
            report
                .messages
                .iter()
                .any(|m| m.resource.to_string().contains("guard") && m.message.contains(path)),
            "{:#?}",
            report.messages
        );
    }
    // The last good version still serves: the DENY on port 9000.
    let snap = cp.snapshots().borrow().clone();
    let held = snap.mesh(ambit_proto::AUTHORIZATION_TYPE_URL);
    assert!(
        held.by_name.contains_key("shop/guard"),
        "the last good policy serves"
    );
    cp.shutdown().await;
}
