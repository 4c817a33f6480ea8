//! `ambitctl install` / `uninstall` against the in-process fake API server:
//! server-side apply of every manifest (twice: idempotent), Istio's own
//! CRDs left alone, and uninstall cleaning the nodes' CNI configuration
//! through the node-agent DaemonSet before deleting everything.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use ambit_tests::fakeapi::FakeApiServer;
use ambitctl::install::{self, Values};
use serde_json::{Value, json};

fn exists(fake: &FakeApiServer, doc: &Value) -> bool {
    fake.get(
        doc["apiVersion"].as_str().unwrap(),
        doc["kind"].as_str().unwrap(),
        doc["metadata"]["namespace"].as_str().unwrap_or(""),
        doc["metadata"]["name"].as_str().unwrap(),
    )
    .is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_applies_every_manifest_and_uninstall_cleans_nodes_then_removes_them() {
    let fake = FakeApiServer::start().await.unwrap();
    // Istio is installed: its VirtualService CRD is not ours to replace.
    fake.apply(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "virtualservices.networking.istio.io", "labels": {"app": "istio-pilot"}},
        "spec": {"group": "networking.istio.io"},
    }))
    .unwrap();
    let client = fake.client("ambitctl", "admin-token").unwrap();
    let docs = install::render(&Values::parse(&["tag=test".into()]).unwrap()).unwrap();

    let report = install::apply(&client, &docs).await.unwrap();
    assert!(
        report
            .iter()
            .any(|l| l.starts_with("skipped CustomResourceDefinition virtualservices")),
        "{report:#?}"
    );
    for d in &docs {
        assert!(
            exists(&fake, d),
            "{} {} applied",
            d["kind"],
            d["metadata"]["name"]
        );
    }
    let istio_crd = fake
        .get(
            "apiextensions.k8s.io/v1",
            "CustomResourceDefinition",
            "",
            "virtualservices.networking.istio.io",
        )
        .unwrap();
    assert_eq!(
        istio_crd["metadata"]["labels"]["app"], "istio-pilot",
        "left alone"
    );
    let dep = fake
        .get("apps/v1", "Deployment", "ambit-system", "ambit-control")
        .unwrap();
    assert_eq!(
        dep["spec"]["template"]["spec"]["containers"][0]["image"],
        "ghcr.io/ambit-mesh/ambit-control:test"
    );
    // Server-side apply, and again: idempotent.
    install::apply(&client, &docs).await.unwrap();
    let patches = fake
        .calls()
        .into_iter()
        .filter(|c| c.identity == "ambitctl" && c.verb == "patch")
        .count();
    assert_eq!(
        patches,
        2 * (docs.len() - 1),
        "every object but the skipped CRD, twice"
    );

    // A kubelet stand-in: once the node agent runs as the cleaner, its one
    // node's pod becomes ready.
    let kubelet = {
        let f = FakeApiServer::client(&fake, "kubelet", "kubelet-token").unwrap();
        tokio::spawn(async move {
            let api: kube::Api<kube::api::DynamicObject> = kube::Api::namespaced_with(
                f,
                "ambit-system",
                &kube::discovery::ApiResource::erase::<k8s_openapi::api::apps::v1::DaemonSet>(&()),
            );
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let Ok(ds) = api.get("ambit-node-agent").await else {
                    continue;
                };
                let args = &ds.data["spec"]["template"]["spec"]["containers"][0]["args"];
                if args
                    .as_array()
                    .is_some_and(|a| a.contains(&json!("--uninstall")))
                {
                    let g = ds.metadata.generation.unwrap_or(0);
                    let status = json!({"status": {"observedGeneration": g,
                        "desiredNumberScheduled": 1, "updatedNumberScheduled": 1, "numberReady": 1,
                        "currentNumberScheduled": 1, "numberMisscheduled": 0}});
                    let _ = api
                        .patch_status(
                            "ambit-node-agent",
                            &kube::api::PatchParams::default(),
                            &kube::api::Patch::Merge(&status),
                        )
                        .await;
                    return;
                }
            }
        })
    };
    let report = install::uninstall(&client, &docs, Duration::from_secs(10), false)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), kubelet)
        .await
        .unwrap()
        .unwrap();
    assert!(
        report[0].starts_with("removed ambit-cni from the CNI configuration of 1 node"),
        "{report:#?}"
    );
    for d in &docs {
        let crd = d["kind"] == "CustomResourceDefinition";
        assert_eq!(
            exists(&fake, d),
            crd,
            "{} {}",
            d["kind"],
            d["metadata"]["name"]
        );
    }
}
