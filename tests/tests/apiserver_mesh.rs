//! The mesh's config from a real kube-apiserver (the kit in
//! `../shared/kube`) to a connected ztunnel:
//!
//! - the first response holds every pod the API server lists and their
//!   services; a new pod, a pod opting out (only it is sent again) and a
//!   deleted pod each reach ztunnel within a second;
//! - `/ready` is 503, naming the kinds it waits for, while the API server
//!   is down at start, and 200 once every watch listed;
//! - a namespace label, a new pod (its status written through the status
//!   subresource, as the kubelet does) and an AuthorizationPolicy edit
//!   reach a ztunnel's xDS stream in milliseconds;
//! - the API server killed for a while and started again: the next change
//!   arrives within 2 s of it being back (the watches retry at once when
//!   discovery sees it answer, not at the end of their backoff);
//! - the mesh config is the ConfigMap `istio` of a root namespace and
//!   Telemetry selects a waypoint's tracer: a bad mesh config is rejected
//!   naming the ConfigMap, a fixed one gives the waypoint its collector,
//!   deleting the Telemetry takes it away;
//! - `ambitctl analyze --cluster` reads the demo platform applied to the
//!   cluster as it reads the same YAML as files, on the standard and the
//!   v1.2.1 Gateway API channels, exits 0 on a clean cluster and non-zero
//!   on a broken one, and reports no false finding on core kinds;
//! - a policy Istio would reject is rejected with its field path
//!   everywhere a user looks, the last good version serving.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use ambit_control::ControlPlane;
use ambit_tests::kubeapi::{Crds, KubeApiServer};
use ambit_tests::kubebed::{Observer, pod_uid, wait_synced, yaml_docs};
use ambit_tests::{eventually, get, http, workspace_root};
use ambitctl::analyze::{self, Cluster, Files, Report, Source};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(20);
/// Each pod change must reach ztunnel within this long.
const PROPAGATION: Duration = Duration::from_secs(1);

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
    // The shipped retry cap, not the tests' 1 s: the recovery under test
    // must not come from a short backoff.
    let mut cfg = kube.control_config(dir, "a").await.unwrap();
    cfg.kube_retry_max_ms = 4_000;
    ControlPlane::start(cfg).await.unwrap()
}

/// Reads responses until one sends `name`; returns how long it took.
async fn until_sent(obs: &mut Observer, name: &str) -> Duration {
    let start = Instant::now();
    loop {
        let left = LIMIT.checked_sub(start.elapsed()).expect(name);
        let (sent, removed) = obs.next(left).await.unwrap();
        assert!(
            removed.is_empty(),
            "while waiting for {name}, removed {removed:?}"
        );
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
    // Nothing was taken from the ztunnel meanwhile: a restarting API server
    // lists its CRD groups a moment late, and that is not a deletion.
    assert!(
        policies.held.contains("shop/deny-9000"),
        "the policy stayed: {:?}",
        policies.held
    );
    // Nor later, once discovery lists them again (a quiet stream times out).
    if let Ok((_, removed)) = policies.next(Duration::from_secs(3)).await {
        assert!(removed.is_empty(), "removed later: {removed:?}");
    }
    cp.shutdown().await;
}

fn findings(report: &Report) -> BTreeSet<(String, String)> {
    report
        .messages
        .iter()
        .map(|m| (m.code.to_string(), m.resource.to_string()))
        .collect()
}

/// Every document of the YAML files of `dir`.
fn docs_of(dir: &Path) -> Vec<Value> {
    let mut docs = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            docs.extend(yaml_docs(&path).unwrap());
        }
    }
    docs
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
    let docs = docs_of(&demo);
    kube.apply_as_a_cluster(&docs).await.unwrap();
    let loaded = docs.len();
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

fn held_pods(held: &BTreeSet<String>) -> BTreeSet<String> {
    held.iter()
        .filter(|n| n.contains("//Pod/"))
        .cloned()
        .collect()
}

/// Every pod the API server holds, as ztunnel names their workloads.
async fn listed_pods(kube: &KubeApiServer) -> BTreeSet<String> {
    let api: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::all(kube.client().await.unwrap());
    api.list(&Default::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| {
            pod_uid(
                p.metadata.namespace.as_deref().unwrap(),
                p.metadata.name.as_deref().unwrap(),
            )
        })
        .collect()
}

fn pod_ref(ns: &str, name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns}})
}

/// The demo platform of `tests/fixtures/mesh` in the cluster before the
/// control plane starts: ztunnel's first response holds every pod the API
/// server lists and their services; then a pod created, opting out and
/// deleted reaches it within a second each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_initial_list_and_each_pod_change_reach_ztunnel_within_a_second() {
    let kube = KubeApiServer::start(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    let token = kube
        .ztunnel_pod("ztunnel-a", "node-1", "10.244.0.2")
        .await
        .unwrap();
    let fixtures = workspace_root().join("tests/fixtures/mesh");
    let docs: Vec<Value> = [
        "namespaces.yaml",
        "inference.yaml",
        "vector.yaml",
        "legacy.yaml",
    ]
    .iter()
    .flat_map(|f| yaml_docs(&fixtures.join(f)).unwrap())
    .collect();
    kube.apply_as_a_cluster(&docs).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&kube, dir.path()).await;
    wait_synced(&cp, LIMIT).await.unwrap();
    assert_eq!(
        get(cp.monitoring_addr(), "/ready").await.unwrap(),
        "ready\n"
    );

    let mut obs =
        Observer::connect_with_token(cp.xds_addr(), ambit_proto::ADDRESS_TYPE_URL, &token)
            .await
            .unwrap();
    obs.next(LIMIT).await.unwrap();
    let listed = listed_pods(&kube).await;
    assert!(
        listed.len() > 10,
        "the fixtures' pods and ztunnel's: {listed:?}"
    );
    assert_eq!(held_pods(&obs.held), listed, "the first response");
    assert!(
        obs.held
            .iter()
            .any(|n| n.contains("llm.ai-inference.svc.cluster.local")),
        "services too: {:?}",
        obs.held
    );

    // Created: the workload appears once the kubelet wrote the pod's IP.
    let uid = pod_uid("ai-inference", "new-0");
    kube.running_pod(
        "ai-inference",
        "new-0",
        "orchestrator",
        "node-1",
        "10.10.1.99",
        json!({"app": "new"}),
    )
    .await
    .unwrap();
    let created = obs
        .until(PROPAGATION, "created pod", |h| h.contains(&uid))
        .await
        .unwrap();

    // The pod opts out: its workload, and only it, is sent again.
    let t = Instant::now();
    kube.patch(
        &pod_ref("ai-inference", "new-0"),
        &json!({"metadata": {"labels": {"istio.io/dataplane-mode": "none"}}}),
    )
    .await
    .unwrap();
    let (sent, _) = obs.next(PROPAGATION).await.unwrap();
    assert_eq!(sent, vec![uid.clone()], "only the updated pod is sent");
    let updated = t.elapsed();

    // Deleted: removed from ztunnel.
    kube.delete_pod("ai-inference", "new-0").await.unwrap();
    let deleted = obs
        .until(PROPAGATION, "deleted pod", |h| !h.contains(&uid))
        .await
        .unwrap();
    println!(
        "{} pods listed; to ztunnel: create {created:?}, opt-out {updated:?}, delete {deleted:?}",
        listed.len()
    );
    cp.shutdown().await;
}

/// Started while the API server is down, the control plane says what it
/// waits for and is ready once every watch listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_only_after_every_watch_listed_once() {
    let kube = KubeApiServer::start(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = kube.control_config(dir.path(), "a").await.unwrap();
    cfg.kube_retry_max_ms = 4_000;
    kube.stop_apiserver().unwrap();
    let cp = ControlPlane::start(cfg).await.unwrap();
    let (status, body) = http(cp.monitoring_addr(), "GET", "/ready").await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("Pod"), "names what it waits for: {body}");

    let restart = Instant::now();
    kube.restart_apiserver().await.unwrap();
    wait_synced(&cp, LIMIT).await.unwrap();
    let ready = eventually(LIMIT, "/ready 200", || async {
        let (code, body) = http(cp.monitoring_addr(), "GET", "/ready").await.ok()?;
        (code == 200).then_some(body)
    })
    .await
    .unwrap();
    assert_eq!(ready, "ready\n");
    println!(
        "ready {:?} after the API server was started again (it answers /readyz within that); before: {}",
        restart.elapsed(),
        body.trim()
    );
    cp.shutdown().await;
}

/// `/debug/config_errors` once it holds an entry whose reason contains
/// `needle`, or is empty when `needle` is `None`.
async fn config_errors(cp: &ControlPlane, what: &str, needle: Option<&str>) -> Vec<Value> {
    eventually(LIMIT, what, || async {
        let body = get(cp.monitoring_addr(), "/debug/config_errors")
            .await
            .ok()?;
        let errors: Vec<Value> = serde_json::from_str(&body).ok()?;
        let done = match needle {
            Some(n) => errors
                .iter()
                .any(|e| e["reason"].as_str().is_some_and(|r| r.contains(n))),
            None => errors.is_empty(),
        };
        done.then_some(errors)
    })
    .await
    .unwrap()
}

/// The clusters of waypoint `shop/waypoint` (empty until it has a scope).
async fn waypoint_clusters(cp: &ControlPlane) -> String {
    get(
        cp.monitoring_addr(),
        "/debug/resources?type=cluster&scope=waypoint/shop/waypoint",
    )
    .await
    .unwrap_or_default()
}

/// The mesh config comes from the ConfigMap `istio` of a root namespace
/// (other ConfigMaps are not the mesh's), Telemetry from its CRD, both
/// watched: what a user sees is the waypoint's tracer and the errors
/// naming what is wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mesh_config_map_and_telemetry_are_watched() {
    let kube = KubeApiServer::start(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    for ns in ["istio-system", "shop", "observability"] {
        kube.apply(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}))
            .await
            .unwrap();
    }
    kube.apply(&json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "otel", "namespace": "observability"},
        "spec": {"selector": {"app": "otel"}, "ports": [{"name": "grpc-otlp", "port": 4317}]}}))
        .await
        .unwrap();
    kube.apply(
        &json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"name": "waypoint", "namespace": "shop"},
        "spec": {"gatewayClassName": "istio-waypoint",
                 "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]}}),
    )
    .await
    .unwrap();
    let config_map = |name: &str, mesh: &str| {
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": name, "namespace": "istio-system"},
               "data": {"mesh": mesh}})
    };
    let broken = "extensionProviders: [{name: otel, opentelemetry: {service: otel}}]";
    kube.apply(&config_map("unrelated", broken)).await.unwrap();
    let telemetry = json!({"apiVersion": "telemetry.istio.io/v1", "kind": "Telemetry",
        "metadata": {"name": "mesh-default", "namespace": "istio-system"},
        "spec": {"tracing": [{"providers": [{"name": "otel"}], "randomSamplingPercentage": 100}]}});
    kube.apply(&telemetry).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&kube, dir.path()).await;
    wait_synced(&cp, LIMIT).await.unwrap();

    // The Telemetry selects provider otel, which no mesh config defines
    // yet: the unrelated ConfigMap, broken as it is, is not read.
    let errors = config_errors(&cp, "the unknown provider reported", Some("\"otel\"")).await;
    assert!(
        errors.iter().all(|e| e["name"] != "unrelated"),
        "{errors:#?}"
    );

    kube.apply(&config_map("istio", broken)).await.unwrap();
    let errors = config_errors(&cp, "the bad mesh config", Some("service and port")).await;
    let e = errors
        .iter()
        .find(|e| e["kind"] == "ConfigMap")
        .unwrap_or_else(|| panic!("{errors:#?}"));
    assert_eq!(
        (e["namespace"].as_str(), e["name"].as_str()),
        (Some("istio-system"), Some("istio")),
        "{errors:#?}"
    );

    let fixed = "extensionProviders: [{name: otel, opentelemetry: {service: otel.observability.svc.cluster.local, port: 4317}}]";
    kube.apply(&config_map("istio", fixed)).await.unwrap();
    config_errors(&cp, "the errors to clear", None).await;
    let tracer = "tracing|4317||otel.observability.svc.cluster.local";
    eventually(LIMIT, "the waypoint's tracing cluster", || async {
        waypoint_clusters(&cp).await.contains(tracer).then_some(())
    })
    .await
    .unwrap();

    // Telemetry deleted: the waypoint traces no more.
    let (api, name) =
        ambit_tests::kubeapi::api_of(&kube.client().await.unwrap(), &telemetry).unwrap();
    api.delete(&name, &Default::default()).await.unwrap();
    eventually(LIMIT, "the tracing cluster gone", || async {
        let clusters = waypoint_clusters(&cp).await;
        (clusters.contains("main_internal") && !clusters.contains(tracer)).then_some(())
    })
    .await
    .unwrap();
    cp.shutdown().await;
}
