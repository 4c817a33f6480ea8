//! Identity end to end: the control plane's CA (local mode, node bootstrap
//! tokens) and a ztunnel's certificate manager over loopback, xDS and CA both
//! on the TLS endpoint (15012) verified against the mesh root. The ztunnel
//! prefetches a certificate for every enrolled pod on its node and only for
//! those; each chains to the CA's persisted root and names the pod's
//! SPIFFE identity.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use ambit_control::{ControlConfig, ControlPlane};
use ambit_tests::{copy_fixture, get, workspace_root};
use ambit_ztunnel::identity::Identity;
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ztunnel_gets_certificates_for_its_enrolled_pods_only() {
    let dir = copy_fixture(&workspace_root().join("tests/fixtures/mesh")).unwrap();
    let data = tempfile::tempdir().unwrap();
    let tokens = data.path().join("node-tokens");
    std::fs::write(
        &tokens,
        "# token node\nnode1-secret node-1\nnode2-secret node-2\n",
    )
    .unwrap();
    let mut cfg = ControlConfig::for_tests(dir.path().to_path_buf(), data.path().join("cp"));
    cfg.node_tokens_file = Some(tokens);
    let cp = ControlPlane::start(cfg).await.unwrap();

    let token_file = data.path().join("ztunnel-token");
    std::fs::write(&token_file, "node1-secret\n").unwrap();
    let root_file = data.path().join("cp/ca/root-cert.pem");
    let mut zcfg = ambit_ztunnel::Config::new("node-1", format!("https://{}", cp.xds_tls_addr()))
        .with_ephemeral_ports();
    zcfg.token_file = Some(token_file);
    zcfg.root_cert = Some(root_file);
    let zt = ambit_ztunnel::start(zcfg).await.unwrap();
    tokio::time::timeout(LIMIT, zt.wait_ready()).await.unwrap();

    let root = std::fs::read_to_string(data.path().join("cp/ca/root-cert.pem")).unwrap();
    // Enrolled pods on node-1: orchestrator-0, embedding-0 (ai-inference), vector-db-0 (vector).
    let expected = [
        ("ai-inference", "orchestrator"),
        ("ai-inference", "embedding"),
        ("vector", "vector-db"),
    ];
    for (ns, sa) in expected {
        let id = Identity::new("cluster.local", ns, sa);
        let cert = tokio::time::timeout(LIMIT, zt.certificates().fetch(&id))
            .await
            .expect("certificate in time")
            .unwrap_or_else(|e| panic!("{id}: {e}"));
        let spiffe =
            ambit_control::ca::verify_identity_chain(&cert.chain_pem, std::slice::from_ref(&root))
                .unwrap_or_else(|e| panic!("{id}: chain does not verify: {e}"));
        assert_eq!(spiffe.to_string(), id.to_string());
    }

    // Exactly those identities: not the opted-out job, not legacy pods, not node-2's.
    let mut held: Vec<String> = zt
        .certificates()
        .identities()
        .iter()
        .map(|i| i.to_string())
        .collect();
    held.sort();
    assert_eq!(
        held,
        [
            "spiffe://cluster.local/ns/ai-inference/sa/embedding",
            "spiffe://cluster.local/ns/ai-inference/sa/orchestrator",
            "spiffe://cluster.local/ns/vector/sa/vector-db",
        ]
    );

    // /config_dump shows them.
    let dump: Value =
        serde_json::from_str(&get(zt.admin_addr(), "/config_dump").await.unwrap()).unwrap();
    let certs = dump["certificates"].as_array().unwrap();
    assert_eq!(certs.len(), 3, "{certs:?}");
    assert!(certs.iter().all(|c| c["state"] == "Available"), "{certs:?}");

    // node-1's token cannot obtain the identity of a pod that runs only on node-2.
    let llm = Identity::new("cluster.local", "ai-inference", "llm");
    let err = tokio::time::timeout(LIMIT, zt.certificates().fetch(&llm))
        .await
        .unwrap()
        .expect_err("llm runs only on node-2");
    assert!(err.to_string().contains("node-2"), "{err}");

    zt.shutdown().await;
    cp.shutdown().await;
}
