//! The control plane in Kubernetes mode against the in-process fake API
//! server (kube's real client and watcher over HTTP): the initial list and
//! the watch reach a ztunnel as xDS within a second; a relist after
//! `410 Gone` loses and duplicates nothing; a dropped watch resumes from
//! its resourceVersion (bookmarks keep it current); an absent CRD does not
//! hold readiness; a rejected object keeps its last good version.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::time::Duration;

use ambit_config::Kind;
use ambit_tests::fakeapi::{FakeApiServer, ResourceDef, standard_resources};
use ambit_tests::kubebed::{
    Observer, control_plane, load_yaml, namespace, pod, pod_uid, wait_synced, yaml_docs,
};
use ambit_tests::{eventually, get, http, workspace_root};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(10);
/// Each change must reach the ztunnel within this long.
const PROPAGATION: Duration = Duration::from_secs(1);

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

/// Waits for `/debug/config_errors` to list something; the list.
async fn config_errors(cp: &ambit_control::app::ControlPlane) -> Value {
    eventually(LIMIT, "a rejection in /debug/config_errors", || async {
        let body = get(cp.monitoring_addr(), "/debug/config_errors")
            .await
            .ok()?;
        let v: Value = serde_json::from_str(&body).ok()?;
        (!v.as_array()?.is_empty()).then_some(v)
    })
    .await
    .unwrap()
}

/// Waits for `/debug/config_errors` to be empty again.
async fn config_errors_cleared(cp: &ambit_control::app::ControlPlane) {
    eventually(LIMIT, "the config errors to clear", || async {
        let body = get(cp.monitoring_addr(), "/debug/config_errors")
            .await
            .ok()?;
        (body.trim() == "[]").then_some(())
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_list_and_watch_reach_ztunnels_within_a_second() {
    let fake = fake_with_mesh().await;
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&fake, dir.path(), "a").await.unwrap();
    wait_synced(&cp, LIMIT).await.unwrap();
    assert_eq!(
        get(cp.monitoring_addr(), "/ready").await.unwrap(),
        "ready\n"
    );

    let mut obs = Observer::connect(cp.xds_addr(), ambit_proto::ADDRESS_TYPE_URL)
        .await
        .unwrap();
    obs.next(LIMIT).await.unwrap();
    assert_eq!(held_pods(&obs.held), fake_pods(&fake), "the initial list");
    assert!(
        obs.held
            .iter()
            .any(|n| n.contains("llm.ai-inference.svc.cluster.local")),
        "services too: {:?}",
        obs.held
    );

    // Create.
    let uid = pod_uid("ai-inference", "new-0");
    fake.apply(pod(
        "ai-inference",
        "new-0",
        "10.10.1.99",
        "node-1",
        json!({"app": "new"}),
    ))
    .unwrap();
    let took = obs
        .until(PROPAGATION, "created pod", |h| h.contains(&uid))
        .await
        .unwrap();
    eprintln!("create reached the ztunnel in {took:?}");

    // Update: the pod opts out; its workload is pushed again.
    let mut p = fake.get("v1", "Pod", "ai-inference", "new-0").unwrap();
    p["metadata"]["labels"]["istio.io/dataplane-mode"] = json!("none");
    fake.apply(p).unwrap();
    let (sent, _) = obs.next(PROPAGATION).await.unwrap();
    assert_eq!(sent, vec![uid.clone()], "only the updated pod is pushed");

    // Delete.
    fake.delete("v1", "Pod", "ai-inference", "new-0").unwrap();
    let took = obs
        .until(PROPAGATION, "deleted pod", |h| !h.contains(&uid))
        .await
        .unwrap();
    eprintln!("delete reached the ztunnel in {took:?}");
    cp.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_only_after_every_watch_listed_once() {
    let fake = fake_with_mesh().await;
    fake.set_failing(Some(503));
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&fake, dir.path(), "a").await.unwrap();
    let (status, body) = http(cp.monitoring_addr(), "GET", "/ready").await.unwrap();
    assert_eq!(status, 503);
    assert!(body.contains("Pod"), "names what it waits for: {body}");
    fake.set_failing(None);
    wait_synced(&cp, LIMIT).await.unwrap();
    assert_eq!(
        get(cp.monitoring_addr(), "/ready").await.unwrap(),
        "ready\n"
    );
    cp.shutdown().await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absent_crd_does_not_hold_readiness_and_is_watched_once_installed() {
    let security: Vec<ResourceDef> = standard_resources()
        .into_iter()
        .filter(|r| r.group == "security.istio.io")
        .collect();
    let fake = FakeApiServer::start_with(
        standard_resources()
            .into_iter()
            .filter(|r| r.group != "security.istio.io")
            .collect(),
    )
    .await
    .unwrap();
    for doc in yaml_docs(&workspace_root().join("tests/fixtures/mesh/namespaces.yaml")).unwrap() {
        if doc["kind"] == "Namespace" {
            fake.apply(doc).unwrap();
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&fake, dir.path(), "a").await.unwrap();
    wait_synced(&cp, LIMIT).await.unwrap();
    let states = cp.kube_source().unwrap().states();
    assert!(
        states[&Kind::AuthorizationPolicy].contains("absent"),
        "{states:?}"
    );
    assert_eq!(
        get(cp.monitoring_addr(), "/ready").await.unwrap(),
        "ready\n"
    );

    // The CRD is installed later: its objects are served without a restart.
    for def in security {
        fake.register(def);
    }
    fake.apply(json!({
        "apiVersion": "security.istio.io/v1",
        "kind": "AuthorizationPolicy",
        "metadata": {"name": "deny-all", "namespace": "legacy"},
        "spec": {"action": "DENY", "rules": [{}]},
    }))
    .unwrap();
    let mut obs = Observer::connect(cp.xds_addr(), ambit_proto::AUTHORIZATION_TYPE_URL)
        .await
        .unwrap();
    obs.until(LIMIT, "the policy of the new CRD", |h| {
        h.iter().any(|n| n.contains("deny-all"))
    })
    .await
    .unwrap();

    // The CRD is deleted: its objects go with it.
    fake.unregister("security.istio.io/v1", "AuthorizationPolicy");
    fake.drop_watches();
    obs.until(LIMIT, "the policy gone with its CRD", |h| {
        !h.iter().any(|n| n.contains("deny-all"))
    })
    .await
    .unwrap();
    cp.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_object_keeps_its_last_good_version_and_names_itself() {
    let fake = fake_with_mesh().await;
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&fake, dir.path(), "a").await.unwrap();
    wait_synced(&cp, LIMIT).await.unwrap();
    let mut obs = Observer::connect(cp.xds_addr(), ambit_proto::ADDRESS_TYPE_URL)
        .await
        .unwrap();
    obs.next(LIMIT).await.unwrap();
    let svc = obs
        .held
        .iter()
        .find(|n| n.contains("legacy-web.legacy.svc"))
        .cloned()
        .expect("the legacy-web service");

    let mut bad = fake.get("v1", "Service", "legacy", "legacy-web").unwrap();
    bad["spec"]["ports"] = json!([{"port": "eighty"}]);
    fake.apply(bad).unwrap();
    let errors = config_errors(&cp).await;
    let e = &errors[0];
    assert_eq!(
        (
            e["kind"].as_str(),
            e["namespace"].as_str(),
            e["name"].as_str()
        ),
        (Some("Service"), Some("legacy"), Some("legacy-web")),
        "{errors}"
    );
    assert!(
        e["reason"]
            .as_str()
            .unwrap()
            .contains("last accepted version keeps serving"),
        "{e}"
    );
    assert!(obs.held.contains(&svc), "the service is still served");

    // Fixed: the error clears.
    let mut good = fake.get("v1", "Service", "legacy", "legacy-web").unwrap();
    good["spec"]["ports"] = json!([{"port": 80}]);
    fake.apply(good).unwrap();
    config_errors_cleared(&cp).await;
    assert!(obs.held.contains(&svc));
    cp.shutdown().await;
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

/// The mesh configuration comes from the ConfigMap `istio` of a root
/// namespace (watched by name; other ConfigMaps are not the mesh's), and
/// Telemetry from its CRD: a bad mesh config is rejected naming the
/// ConfigMap, and a fixed one clears the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mesh_config_map_and_telemetry_are_watched() {
    let fake = fake_with_mesh().await;
    let config_map = |name: &str, mesh: &str| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": name, "namespace": "istio-system"},
               "data": {"mesh": mesh}})
    };
    let broken = "extensionProviders: [{name: otel, opentelemetry: {service: otel}}]";
    fake.apply(config_map("unrelated", broken)).unwrap();
    fake.apply(
        json!({"apiVersion": "telemetry.istio.io/v1", "kind": "Telemetry",
        "metadata": {"name": "mesh-default", "namespace": "istio-system"},
        "spec": {"tracing": [{"providers": [{"name": "otel"}], "randomSamplingPercentage": 100}]}}),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&fake, dir.path(), "a").await.unwrap();
    wait_synced(&cp, LIMIT).await.unwrap();
    assert!(list_calls(&fake, "telemetries") >= 1, "Telemetry is listed");
    // Only `istio` is the mesh config: the other one, broken as it is, is no error.
    let body = get(cp.monitoring_addr(), "/debug/config_errors")
        .await
        .unwrap();
    assert_eq!(body.trim(), "[]", "{body}");

    fake.apply(config_map("istio", broken)).unwrap();
    let errors = config_errors(&cp).await;
    let e = &errors[0];
    assert_eq!(
        (
            e["kind"].as_str(),
            e["namespace"].as_str(),
            e["name"].as_str()
        ),
        (Some("ConfigMap"), Some("istio-system"), Some("istio")),
        "{errors}"
    );
    assert!(
        e["reason"].as_str().unwrap().contains("service and port"),
        "{e}"
    );
    let fixed = "extensionProviders: [{name: otel, opentelemetry: {service: otel.observability.svc.cluster.local, port: 4317}}]";
    fake.apply(config_map("istio", fixed)).unwrap();
    config_errors_cleared(&cp).await;
    cp.shutdown().await;
}
