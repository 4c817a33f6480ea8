//! The control plane and a ztunnel in one process over loopback: the
//! ztunnel's view of the mesh matches the YAML, edits to the YAML arrive
//! within a second as exactly the changed resources, and a bad edit is
//! rejected with its file and object while everything keeps serving.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ambit_control::{ControlConfig, ControlPlane};
use ambit_tests::{copy_fixture, get, workspace_root, write_atomic};
use ambit_ztunnel::Config as ZtunnelConfig;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse,
};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

const LIMIT: Duration = Duration::from_secs(10);
/// Each change must reach the ztunnel within this long of the file write.
const PROPAGATION: Duration = Duration::from_secs(1);

/// The node bootstrap token of node-1 (ztunnel and the observer).
const NODE_TOKEN: &str = "node-1-bootstrap-token";

/// A raw Delta ADS client that records exactly what the server sends.
struct Observer {
    tx: mpsc::Sender<DeltaDiscoveryRequest>,
    rx: tonic::Streaming<DeltaDiscoveryResponse>,
}

impl Observer {
    async fn connect(addr: std::net::SocketAddr) -> Self {
        let mut client = AggregatedDiscoveryServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap()
            .max_decoding_message_size(64 << 20);
        let (tx, rx) = mpsc::channel(8);
        tx.send(DeltaDiscoveryRequest {
            node: Some(Node {
                id: "ztunnel~0.0.0.0~observer.test~test.svc.cluster.local".into(),
                ..Default::default()
            }),
            type_url: ambit_proto::ADDRESS_TYPE_URL.into(),
            ..Default::default()
        })
        .await
        .unwrap();
        let mut req = tonic::Request::new(ReceiverStream::new(rx));
        req.metadata_mut().insert(
            "authorization",
            format!("Bearer {NODE_TOKEN}").parse().unwrap(),
        );
        let rx = client
            .delta_aggregated_resources(req)
            .await
            .unwrap()
            .into_inner();
        Self { tx, rx }
    }

    /// Receives one response and ACKs it; returns (sorted names, sorted removed).
    async fn next(&mut self) -> (Vec<String>, Vec<String>) {
        let resp = tokio::time::timeout(LIMIT, self.rx.next())
            .await
            .expect("no xDS response in time")
            .expect("xDS stream ended")
            .expect("xDS stream failed");
        self.tx
            .send(DeltaDiscoveryRequest {
                type_url: resp.type_url.clone(),
                response_nonce: resp.nonce.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        let mut names: Vec<String> = resp.resources.iter().map(|r| r.name.clone()).collect();
        let mut removed = resp.removed_resources.clone();
        names.sort();
        removed.sort();
        (names, removed)
    }

    async fn assert_quiet(&mut self, d: Duration) {
        if let Ok(r) = tokio::time::timeout(d, self.rx.next()).await {
            panic!("expected no xDS push, got {r:?}");
        }
    }
}

fn by_key<'a>(items: &'a Value, key: &str) -> BTreeMap<String, &'a Value> {
    items
        .as_array()
        .expect("array")
        .iter()
        .map(|v| (v[key].as_str().expect("key").to_string(), v))
        .collect()
}

fn pod(ns: &str, name: &str) -> String {
    format!("Kubernetes//Pod/{ns}/{name}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ztunnel_holds_the_mesh_and_follows_edits() {
    let dir = copy_fixture(&workspace_root().join("tests/fixtures/mesh")).unwrap();
    let data = tempfile::tempdir().unwrap();
    let tokens = data.path().join("node-tokens");
    std::fs::write(&tokens, format!("{NODE_TOKEN} node-1\n")).unwrap();
    let token_file = data.path().join("token");
    std::fs::write(&token_file, NODE_TOKEN).unwrap();
    let mut cfg = ControlConfig::for_tests(dir.path().to_path_buf(), data.path().join("cp"));
    cfg.node_tokens_file = Some(tokens);
    let cp = ControlPlane::start(cfg).await.unwrap();
    let mut zcfg =
        ZtunnelConfig::new("node-1", format!("http://{}", cp.xds_addr())).with_ephemeral_ports();
    zcfg.token_file = Some(token_file);
    let zt = ambit_ztunnel::start(zcfg).await.unwrap();
    tokio::time::timeout(LIMIT, zt.wait_ready())
        .await
        .expect("ztunnel not ready in time");
    let ready = get(zt.readiness_addr(), "/healthz/ready").await.unwrap();
    assert!(ready.contains("ready"));

    // --- The initial view, through /config_dump.
    let dump: Value =
        serde_json::from_str(&get(zt.admin_addr(), "/config_dump").await.unwrap()).unwrap();
    for key in ["workloads", "services", "policies", "certificates"] {
        assert!(dump.get(key).is_some(), "config_dump lacks {key}");
    }
    let workloads = by_key(&dump["workloads"], "uid");
    let pods: Vec<&String> = workloads.keys().filter(|k| k.contains("//Pod/")).collect();
    assert_eq!(pods.len(), 10, "pods in config_dump: {pods:?}");
    for (ns, name, protocol) in [
        ("ai-inference", "orchestrator-0", "HBONE"),
        ("ai-inference", "llm-v2-0", "HBONE"),
        ("vector", "vector-db-1", "HBONE"),
        ("vector", "reindex-job", "TCP"), // opted out by its own label
        ("legacy", "legacy-client", "TCP"),
        ("legacy", "legacy-web", "TCP"),
    ] {
        let w = workloads[&pod(ns, name)];
        assert_eq!(w["protocol"], protocol, "{ns}/{name}");
    }
    let vdb = workloads[&pod("vector", "vector-db-0")];
    assert_eq!(
        vdb["workloadIps"],
        serde_json::json!(["10.10.1.30", "fd00:10:10:1::30"])
    );
    assert_eq!(vdb["serviceAccount"], "vector-db");
    assert_eq!(vdb["node"], "node-1");
    assert_eq!(vdb["canonicalName"], "vector-db");
    assert_eq!(vdb["canonicalRevision"], "1.9");
    // Named target port `http` resolves per pod: v1 listens on 8000, v2 on 8001.
    let llm_key = "ai-inference/llm.ai-inference.svc.cluster.local";
    assert_eq!(
        workloads[&pod("ai-inference", "llm-v1-0")]["services"][llm_key]["80"],
        8000
    );
    assert_eq!(
        workloads[&pod("ai-inference", "llm-v2-0")]["services"][llm_key]["80"],
        8001
    );

    let services = by_key(&dump["services"], "hostname");
    assert_eq!(services.len(), 6, "services: {:?}", services.keys());
    let llm = services["llm.ai-inference.svc.cluster.local"];
    assert_eq!(llm["vips"], serde_json::json!(["/10.96.0.20"]));
    assert_eq!(llm["endpoints"].as_object().unwrap().len(), 2);
    let emb = services["embedding.ai-inference.svc.cluster.local"];
    assert_eq!(emb["endpoints"].as_object().unwrap().len(), 2);
    let se = services["api.hosted-llm.example.com"];
    assert_eq!(se["vips"], serde_json::json!(["/240.0.0.10"]));
    assert_eq!(se["ports"]["443"], 443);
    assert_eq!(
        services["vector-db.vector.svc.cluster.local"]["ports"]["6333"],
        6333
    );

    // --- Edits. An observer sees exactly what the server sends.
    let mut obs = Observer::connect(cp.xds_addr()).await;
    let (initial, _) = obs.next().await;
    assert_eq!(
        initial.len(),
        17,
        "10 pods + 1 ServiceEntry endpoint + 5 services + 1 ServiceEntry"
    );
    let state = zt.state_reader();

    // 1. Delete a pod.
    let inference = dir.path().join("inference.yaml");
    let text = std::fs::read_to_string(&inference).unwrap();
    let start = text.find("  name: llm-v2-0").unwrap();
    let doc_start = text[..start].rfind("---").unwrap();
    let doc_end = start + text[start..].find("---").unwrap();
    let without_v2 = format!("{}{}", &text[..doc_start], &text[doc_end..]);
    let t0 = Instant::now();
    write_atomic(&inference, &without_v2).unwrap();
    let gone = pod("ai-inference", "llm-v2-0");
    tokio::time::timeout(
        LIMIT,
        state.wait_for(|s| s.workload_by_uid(&gone).is_none()),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(
        t0.elapsed() < PROPAGATION,
        "pod deletion took {:?}",
        t0.elapsed()
    );
    assert_eq!(obs.next().await, (vec![], vec![gone.clone()]));
    let s = state.load();
    let llm_eps = s.endpoint_set(llm_key).map(|e| e.len()).unwrap_or_default();
    assert_eq!(llm_eps, 1, "llm keeps only v1 as endpoint");

    // 2. Take the `vector` namespace out of ambient: its enrolled pods switch to TCP.
    let ns_file = dir.path().join("namespaces.yaml");
    let ns_text = std::fs::read_to_string(&ns_file).unwrap();
    let relabelled = ns_text.replacen(
        "  name: vector\n  labels:\n    istio.io/dataplane-mode: ambient\n",
        "  name: vector\n  labels:\n    team: search\n",
        1,
    );
    assert_ne!(relabelled, ns_text);
    let t0 = Instant::now();
    write_atomic(&ns_file, &relabelled).unwrap();
    let vdb0 = pod("vector", "vector-db-0");
    let vdb1 = pod("vector", "vector-db-1");
    tokio::time::timeout(
        LIMIT,
        state.wait_for(|s| {
            [&vdb0, &vdb1].iter().all(|u| {
                s.workload_by_uid(u)
                    .is_some_and(|w| w.protocol == ambit_ztunnel::state::TunnelProtocol::Tcp)
            })
        }),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(
        t0.elapsed() < PROPAGATION,
        "relabel took {:?}",
        t0.elapsed()
    );
    assert_eq!(obs.next().await, (vec![vdb0.clone(), vdb1.clone()], vec![]));

    // 3. Add a service selecting the embedding pods.
    let t0 = Instant::now();
    write_atomic(
        &dir.path().join("reranker.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: reranker\n  namespace: ai-inference\n\
         spec:\n  clusterIP: 10.96.0.50\n  selector: {app: embedding}\n  ports:\n  - {port: 7000, targetPort: 9000}\n",
    )
    .unwrap();
    let rr = "ai-inference/reranker.ai-inference.svc.cluster.local";
    tokio::time::timeout(
        LIMIT,
        state.wait_for(|s| s.endpoint_set(rr).is_some_and(|e| e.len() == 2)),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(
        t0.elapsed() < PROPAGATION,
        "new service took {:?}",
        t0.elapsed()
    );
    assert_eq!(
        obs.next().await,
        (
            vec![
                pod("ai-inference", "embedding-0"),
                pod("ai-inference", "embedding-1"),
                rr.to_string(),
            ],
            vec![]
        )
    );

    // 4. A bad edit to an existing object: rejected with file, line and
    //    object; the last good version keeps serving and nothing is pushed.
    let current = std::fs::read_to_string(&inference).unwrap();
    let broken = current.replacen(
        "  - {name: http, port: 80, targetPort: http}",
        "  - {name: http, port: eighty, targetPort: http}",
        1,
    );
    assert_ne!(broken, current);
    write_atomic(&inference, &broken).unwrap();
    let errors = ambit_tests::eventually(LIMIT, "config error reported", || async {
        let body = get(cp.monitoring_addr(), "/debug/config_errors")
            .await
            .ok()?;
        let v: Value = serde_json::from_str(&body).ok()?;
        let arr = v.as_array()?.clone();
        (!arr.is_empty()).then_some(arr)
    })
    .await
    .unwrap();
    assert_eq!(errors.len(), 1, "{errors:?}");
    let e = &errors[0];
    assert!(
        e["file"].as_str().unwrap().ends_with("inference.yaml"),
        "{e}"
    );
    assert_eq!(e["kind"], "Service");
    assert_eq!(e["namespace"], "ai-inference");
    assert_eq!(e["name"], "llm");
    assert!(e["line"].as_u64().unwrap() > 1, "{e}");
    obs.assert_quiet(Duration::from_millis(500)).await;
    assert!(state.load().service_by_hostname(llm_key).is_some());

    // The control plane saw the ztunnel and the observer.
    let conns: Value = serde_json::from_str(
        &get(cp.monitoring_addr(), "/debug/connections")
            .await
            .unwrap(),
    )
    .unwrap();
    let ids: Vec<&str> = conns
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["node_id"].as_str())
        .collect();
    assert!(ids.iter().any(|i| i.contains("ztunnel-node-1")), "{ids:?}");

    zt.shutdown().await;
    cp.shutdown().await;
}
