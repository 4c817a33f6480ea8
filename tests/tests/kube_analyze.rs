//! `ambitctl analyze --cluster` against the in-process fake API server:
//! the demo platform loaded into the "cluster" gets the same findings as
//! the same YAML analyzed as files, and a mistake applied to the cluster is
//! reported on its resource.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use ambit_tests::fakeapi::FakeApiServer;
use ambit_tests::kubebed::load_yaml;
use ambitctl::analyze::{self, Cluster, Files, Report, Source};
use serde_json::json;

fn findings(report: &Report) -> BTreeSet<(String, String)> {
    report
        .messages
        .iter()
        .map(|m| (m.code.to_string(), m.resource.to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn analyze_reads_the_cluster_as_it_reads_files() {
    let demo = ambit_tests::workspace_root().join("deploy/local/demo");
    let fake = FakeApiServer::start().await.unwrap();
    let mut loaded = 0;
    for entry in std::fs::read_dir(&demo).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            loaded += load_yaml(&fake, &path).unwrap();
        }
    }
    assert!(loaded > 10, "the demo has {loaded} objects");
    println!("analyze: {loaded} demo objects loaded into the fake API server");
    let client = fake.client("ambitctl", "admin-token").unwrap();

    let cluster = Cluster::list(client.clone(), "fake".into()).await.unwrap();
    let from_cluster = analyze::analyze(&[&cluster as &dyn Source], &[]).unwrap();
    let files = Files::new([demo.clone()]);
    let from_files = analyze::analyze(&[&files as &dyn Source], &[]).unwrap();
    println!(
        "analyze: {} documents from the cluster, {} messages; from files {} messages",
        cluster.documents().unwrap().len(),
        from_cluster.messages.len(),
        from_files.messages.len()
    );
    assert_eq!(
        cluster.documents().unwrap().len(),
        loaded,
        "every object listed"
    );
    assert_eq!(findings(&from_cluster), findings(&from_files));
    assert!(
        from_cluster
            .worst()
            .is_none_or(|s| s < analyze::Severity::Error)
    );

    // The seed's mistake, applied to the cluster: a route to a subset no
    // DestinationRule defines.
    fake.apply(json!({
        "apiVersion": "networking.istio.io/v1",
        "kind": "VirtualService",
        "metadata": {"name": "llm-typo", "namespace": "ai-inference"},
        "spec": {"hosts": ["llm"], "http": [{"route": [{"destination": {"host": "llm", "subset": "v3"}}]}]},
    }))
    .unwrap();
    let cluster = Cluster::list(client, "fake".into()).await.unwrap();
    let report = analyze::analyze(&[&cluster as &dyn Source], &[]).unwrap();
    let hit = report
        .messages
        .iter()
        .find(|m| m.resource.to_string().contains("llm-typo") && m.message.contains("v3"));
    println!("analyze: the typo is reported as {hit:?}");
    let hit = hit.expect("the undefined subset is reported");
    assert_eq!(hit.code.to_string(), "IST0101", "{hit:?}");
}
