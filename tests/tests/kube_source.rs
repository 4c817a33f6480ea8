//! Faults a real API server cannot be made to show on demand, against the
//! in-process fake API server (kube's real client and watcher over HTTP):
//! the control plane's watches after `410 Gone` (a relist that loses and
//! duplicates nothing) and after a dropped connection (resumed from the
//! resourceVersion a bookmark kept current, no relist), and the node
//! agent's view relisting after `410 Gone` with nothing stale left; plus
//! the ignored RSS measurement with 10,000 pods. Everything a real server
//! can show is tested against one (`apiserver_*.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use ambit_tests::fakeapi::FakeApiServer;
use ambit_tests::kubebed::{
    Observer, control_plane, load_yaml, namespace, pod, pod_uid, wait_synced,
};
use ambit_tests::{eventually, get, http, workspace_root};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(10);

async fn fake_with_mesh() -> FakeApiServer {
    let fake = FakeApiServer::start().await.unwrap();
    let dir = workspace_root().join("tests/fixtures/mesh");
    for f in [
        "namespaces.yaml",
        "inference.yaml",
        "vector.yaml",
        "legacy.yaml",
    ] {
        load_yaml(&fake, &dir.join(f)).unwrap();
    }
    fake
}

fn fake_pods(fake: &FakeApiServer) -> BTreeSet<String> {
    fake.list("v1", "Pod")
        .iter()
        .map(|p| {
            pod_uid(
                p["metadata"]["namespace"].as_str().unwrap(),
                p["metadata"]["name"].as_str().unwrap(),
            )
        })
        .collect()
}

fn held_pods(held: &BTreeSet<String>) -> BTreeSet<String> {
    held.iter()
        .filter(|n| n.contains("//Pod/"))
        .cloned()
        .collect()
}

fn list_calls(fake: &FakeApiServer, resource: &str) -> usize {
    fake.calls()
        .iter()
        .filter(|c| c.verb == "list" && c.resource == resource)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relist_after_410_gone_loses_and_duplicates_nothing() {
    let fake = fake_with_mesh().await;
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&fake, dir.path(), "a").await.unwrap();
    wait_synced(&cp, LIMIT).await.unwrap();
    let mut obs = Observer::connect(cp.xds_addr(), ambit_proto::ADDRESS_TYPE_URL)
        .await
        .unwrap();
    obs.next(LIMIT).await.unwrap();
    let lists_before = list_calls(&fake, "pods");

    // The API server goes away; while it is away objects change and its
    // watch history is compacted.
    fake.set_failing(Some(503));
    fake.drop_watches();
    fake.apply(pod("legacy", "gap-0", "10.10.1.77", "node-1", json!({})))
        .unwrap();
    fake.delete("v1", "Pod", "legacy", "legacy-client").unwrap();
    let mut moved = fake.get("v1", "Pod", "vector", "vector-db-1").unwrap();
    moved["status"]["podIP"] = json!("10.10.2.99");
    moved["status"]["podIPs"] = json!([{"ip": "10.10.2.99"}]);
    fake.apply(moved).unwrap();
    fake.compact();
    fake.set_failing(None);

    let want = fake_pods(&fake);
    obs.until(LIMIT, "the relisted state", |h| held_pods(h) == want)
        .await
        .unwrap();
    assert!(
        list_calls(&fake, "pods") > lists_before,
        "the pod watch listed again after 410 Gone"
    );
    // The moved pod carries its new IP, once.
    let resources: Value = serde_json::from_str(
        &get(cp.monitoring_addr(), "/debug/resources?type=address")
            .await
            .unwrap(),
    )
    .unwrap();
    let names: Vec<&str> = resources
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    let unique: BTreeSet<&str> = names.iter().copied().collect();
    assert_eq!(
        unique.len(),
        names.len(),
        "no duplicate resource: {names:?}"
    );
    let vdb = resources
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == pod_uid("vector", "vector-db-1"))
        .unwrap();
    assert!(
        vdb["aliases"].to_string().contains("10.10.2.99"),
        "the update made while away arrived: {vdb}"
    );
    cp.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_watch_resumes_from_its_resource_version_and_bookmarks_keep_it_current() {
    let fake = fake_with_mesh().await;
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&fake, dir.path(), "a").await.unwrap();
    wait_synced(&cp, LIMIT).await.unwrap();
    let mut obs = Observer::connect(cp.xds_addr(), ambit_proto::ADDRESS_TYPE_URL)
        .await
        .unwrap();
    obs.next(LIMIT).await.unwrap();
    let lists = list_calls(&fake, "pods");

    // A dropped connection: the watch resumes, nothing is listed again.
    fake.drop_watches();
    let uid = pod_uid("legacy", "after-drop");
    fake.apply(pod(
        "legacy",
        "after-drop",
        "10.10.1.78",
        "node-1",
        json!({}),
    ))
    .unwrap();
    obs.until(LIMIT, "pod created after the drop", |h| h.contains(&uid))
        .await
        .unwrap();
    assert_eq!(list_calls(&fake, "pods"), lists, "resumed, not relisted");

    // Other kinds move the resourceVersion on; a bookmark tells the pod
    // watch, so after a compaction and a drop it still resumes.
    fake.apply(namespace("elsewhere", json!({}))).unwrap();
    fake.apply(namespace("elsewhere-2", json!({}))).unwrap();
    let rv = fake.resource_version();
    fake.send_bookmarks();
    fake.drop_watches();
    fake.compact();
    eventually(LIMIT, "the pod watch to resume", || async {
        (fake.watch_count("pods") == 1).then_some(())
    })
    .await
    .unwrap();
    let resumed_from: Vec<String> = fake
        .calls()
        .iter()
        .filter(|c| c.verb == "watch" && c.resource == "pods")
        .map(|c| c.resource_version.clone())
        .collect();
    assert_eq!(
        resumed_from.last().map(String::as_str),
        Some(rv.to_string().as_str()),
        "the watch resumed from the bookmark's resourceVersion: {resumed_from:?}"
    );
    assert_eq!(
        list_calls(&fake, "pods"),
        lists,
        "no relist thanks to the bookmark"
    );
    cp.shutdown().await;
}

/// The node agent's view relists after `410 Gone`: changes made while its
/// watch was down are all there, nothing stale stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_agent_view_relists_after_410_gone_and_keeps_nothing_stale() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.apply(namespace(
        "shop",
        json!({"istio.io/dataplane-mode": "ambient"}),
    ))
    .unwrap();
    fake.apply(namespace("other", json!({}))).unwrap();
    fake.apply(pod("shop", "a", "10.1.0.2", "node-1", json!({})))
        .unwrap();
    fake.apply(pod("other", "c", "10.1.0.3", "node-1", json!({})))
        .unwrap();
    let client = fake
        .client("ambit-node-agent/node-1", "agent-node-1")
        .unwrap();
    let v = tokio::time::timeout(
        LIMIT,
        ambit_cni::agent::kube::spawn_kube_view(client, "node-1"),
    )
    .await
    .expect("the view lists within the limit")
    .unwrap();
    let pods_of =
        |v: &tokio::sync::watch::Receiver<std::sync::Arc<ambit_cni::agent::view::MeshView>>| {
            v.borrow()
                .pods
                .keys()
                .map(|(ns, n)| format!("{ns}/{n}"))
                .collect::<BTreeSet<String>>()
        };
    assert_eq!(
        pods_of(&v),
        BTreeSet::from(["other/c".to_string(), "shop/a".to_string()])
    );
    let lists = list_calls(&fake, "pods");

    fake.drop_watches();
    fake.delete("v1", "Pod", "other", "c").unwrap();
    fake.apply(pod("shop", "d", "10.1.0.4", "node-1", json!({})))
        .unwrap();
    fake.apply(pod("shop", "e", "10.1.1.4", "node-2", json!({})))
        .unwrap();
    fake.compact();
    let want = BTreeSet::from(["shop/a".to_string(), "shop/d".to_string()]);
    eventually(LIMIT, "relisted", || {
        let now = pods_of(&v);
        let want = want.clone();
        async move { (now == want).then_some(()) }
    })
    .await
    .unwrap();
    assert!(
        list_calls(&fake, "pods") > lists,
        "the pod watch listed again after 410 Gone"
    );
}

/// The control plane's resident memory with 10,000 pods (and a Service per
/// 10 pods) watched from the API server: the built `ambit-control` runs as
/// its own process so its RSS is its own. Run with `--ignored --nocapture`
/// after `cargo build -p ambit-control` (a release build is smaller).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement: prints the RSS with 10,000 pods"]
async fn rss_with_10k_pods() {
    let exe = ambit_tests::workspace_root().join("target/debug/ambit-control");
    assert!(exe.exists(), "build it first: cargo build -p ambit-control");
    let fake = FakeApiServer::start().await.unwrap();
    for n in 0..100 {
        fake.apply(namespace(
            &format!("ns-{n}"),
            json!({"istio.io/dataplane-mode": "ambient"}),
        ))
        .unwrap();
    }
    for i in 0..10_000u32 {
        let ns = format!("ns-{}", i % 100);
        let ip = format!("10.{}.{}.{}", 64 + i / 65536, (i / 256) % 256, i % 256);
        fake.apply(pod(
            &ns,
            &format!("p-{i}"),
            &ip,
            &format!("node-{}", i % 50),
            json!({"app": format!("a{}", i / 10)}),
        ))
        .unwrap();
        if i % 10 == 0 {
            fake.apply(json!({"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": format!("s-{}", i / 10), "namespace": ns},
                "spec": {"clusterIP": format!("10.96.{}.{}", (i / 10) / 256, (i / 10) % 256),
                         "selector": {"app": format!("a{}", i / 10)},
                         "ports": [{"port": 80, "targetPort": 8080}]}}))
                .unwrap();
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = fake
        .kubeconfig(dir.path(), "ambit-control/rss", "rss-token")
        .unwrap();
    let mon = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mon_addr = mon.local_addr().unwrap();
    drop(mon);
    let mut child = tokio::process::Command::new(exe)
        .args(["--kubeconfig"])
        .arg(&kubeconfig)
        .args(["--data-dir"])
        .arg(dir.path())
        .args([
            "--xds-plaintext-addr",
            "127.0.0.1:0",
            "--xds-tls-addr",
            "127.0.0.1:0",
        ])
        .args([
            "--monitoring-addr",
            &mon_addr.to_string(),
            "--pod-name",
            "rss",
        ])
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let start = std::time::Instant::now();
    eventually(Duration::from_secs(120), "ready with 10k pods", || async {
        matches!(http(mon_addr, "GET", "/ready").await, Ok((200, _))).then_some(())
    })
    .await
    .unwrap();
    let ready = start.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |k: &str| {
        status
            .lines()
            .find(|l| l.starts_with(k))
            .map(|l| l.trim_start_matches(k).trim().to_string())
            .unwrap_or_default()
    };
    eprintln!(
        "10,000 pods, 1,000 services: ready in {ready:?}; VmRSS {} (peak VmHWM {})",
        field("VmRSS:"),
        field("VmHWM:")
    );
    let _ = child.kill().await;
}
