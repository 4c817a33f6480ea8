use std::collections::BTreeMap;
use std::path::PathBuf;

use base64::Engine as _;
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

use super::webhook::review;
use super::*;

fn testdata(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("src/inject/testdata")
        .join(name)
}

fn read_yaml(name: &str) -> Value {
    let text = std::fs::read_to_string(testdata(name)).expect("test file");
    serde_saphyr::from_str(&text).expect("test YAML")
}

fn pod_of(v: &Value) -> Pod {
    serde_json::from_value(v.clone()).expect("a typed Pod")
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn pod_with(labels_: &[(&str, &str)], annotations: &[(&str, &str)], host_network: bool) -> Pod {
    let mut v = json!({
        "metadata": {"name": "p", "labels": labels(labels_), "annotations": labels(annotations)},
        "spec": {"containers": [{"name": "app"}], "hostNetwork": host_network},
    });
    if annotations.is_empty() {
        v["metadata"]
            .as_object_mut()
            .map(|m| m.remove("annotations"));
    }
    pod_of(&v)
}

/// Injects `file`'s pod the way the webhook and kube-inject do and returns it.
fn inject(file: &str) -> Value {
    let mut doc = read_yaml(file);
    let pod = pod_of(&doc);
    let ops = injection_patch(&pod, &InjectSettings::default()).expect("patch");
    apply_patch(&mut doc, &ops).expect("the patch applies");
    doc
}

/// Compares with the golden file, or writes it when `UPDATE_GOLDEN=1`.
fn assert_golden(got: &Value, file: &str) {
    let path = testdata(file);
    if std::env::var("UPDATE_GOLDEN").as_deref() == Ok("1") {
        let text = serde_saphyr::to_string(got).expect("YAML");
        std::fs::write(&path, text).expect("write golden");
    }
    let want: Value = read_yaml(file);
    assert_eq!(
        got, &want,
        "{file} differs; if the change is intended, rerun with UPDATE_GOLDEN=1 and review the diff"
    );
}

#[test]
fn decisions_follow_the_namespace_the_pod_and_the_exclusions() {
    let enabled = labels(&[(NAMESPACE_LABEL, "enabled")]);
    let disabled = labels(&[(NAMESPACE_LABEL, "disabled")]);
    let ambient = labels(&[(DATAPLANE_MODE, "ambient")]);
    let none = BTreeMap::new();
    let plain = pod_with(&[], &[], false);
    let wants = pod_with(&[], &[(POD_INJECT, "true")], false);
    let wants_by_label = pod_with(&[(POD_INJECT, "true")], &[], false);
    let refuses = pod_with(&[], &[(POD_INJECT, "false")], false);
    let host = pod_with(&[], &[(POD_INJECT, "true")], true);
    let injected = pod_with(&[], &[(STATUS_ANNOTATION, "{}")], false);
    let ambient_pod = pod_with(&[(DATAPLANE_MODE, "ambient")], &[], false);
    use SkipReason::*;
    let cases = [
        (&plain, &enabled, Decision::Inject),
        (&plain, &none, Decision::Skip(NotSelected)),
        (&wants, &none, Decision::Inject),
        (&wants_by_label, &none, Decision::Inject),
        (&refuses, &enabled, Decision::Skip(OptedOut)),
        (&wants, &disabled, Decision::Skip(NamespaceDisabled)),
        (&wants, &ambient, Decision::Skip(Ambient)),
        (&ambient_pod, &enabled, Decision::Skip(Ambient)),
        (&host, &enabled, Decision::Skip(HostNetwork)),
        (&injected, &enabled, Decision::Skip(AlreadyInjected)),
    ];
    for (i, (pod, ns, want)) in cases.into_iter().enumerate() {
        assert_eq!(decide(pod, ns), want, "case {i}");
    }
    let mut with_proxy = plain.clone();
    if let Some(spec) = with_proxy.spec.as_mut() {
        spec.containers.push(k8s_openapi::api::core::v1::Container {
            name: PROXY_CONTAINER.to_string(),
            ..Default::default()
        });
    }
    assert_eq!(
        decide(&with_proxy, &enabled),
        Decision::Skip(AlreadyInjected)
    );
}

#[test]
fn a_plain_pod_gets_the_proxy_the_redirection_and_the_status() {
    let doc = inject("plain-pod.yaml");
    assert_golden(&doc, "plain-pod.injected.yaml");
    let pod = pod_of(&doc);
    let spec = pod.spec.as_ref().expect("spec");
    let names: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["server", PROXY_CONTAINER], "the app stays first");
    let inits: Vec<&str> = spec
        .init_containers
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(inits, [INIT_CONTAINER]);
    let proxy = &spec.containers[1];
    let probe = proxy
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("probe");
    assert_eq!(probe.path.as_deref(), Some("/healthz/ready"));
    let sc = proxy.security_context.as_ref().expect("security context");
    assert_eq!(
        sc.run_as_user,
        Some(1337),
        "Envoy's uid is the one redirection exempts"
    );
    let env: BTreeMap<&str, Option<&str>> = proxy
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.as_str(), e.value.as_deref()))
        .collect();
    assert_eq!(env.get("LABELS"), Some(&Some("app=llm,version=v1")));
    let meta = &pod.metadata;
    let annotations = meta.annotations.as_ref().expect("annotations");
    let status: Value = serde_json::from_str(&annotations[STATUS_ANNOTATION]).expect("status JSON");
    assert_eq!(status["containers"], json!([PROXY_CONTAINER]));
    assert_eq!(
        annotations["kubectl.kubernetes.io/default-container"],
        "server"
    );
    let labels = meta.labels.as_ref().expect("labels");
    assert_eq!(labels["security.istio.io/tlsMode"], "istio");
    assert_eq!(
        labels["networking.istio.io/tunnel"], "http",
        "peers reach the sidecar over HBONE"
    );
}

#[test]
fn a_busy_pod_keeps_what_it_had() {
    let doc = inject("busy-pod.yaml");
    assert_golden(&doc, "busy-pod.injected.yaml");
    let pod = pod_of(&doc);
    let spec = pod.spec.as_ref().expect("spec");
    let inits: Vec<&str> = spec
        .init_containers
        .iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(inits, ["schema", INIT_CONTAINER]);
    let volumes: Vec<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(volumes, ["data", "ambit-token", "ambit-ca", "ambit-state"]);
    let annotations = pod.metadata.annotations.as_ref().expect("annotations");
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(
        annotations["kubectl.kubernetes.io/default-container"], "db",
        "the pod's own choice is kept"
    );
}

#[test]
fn injecting_again_changes_nothing() {
    for file in ["plain-pod.yaml", "busy-pod.yaml"] {
        let once = inject(file);
        let pod = pod_of(&once);
        let selected = labels(&[(NAMESPACE_LABEL, "enabled")]);
        assert_eq!(
            decide(&pod, &selected),
            Decision::Skip(SkipReason::AlreadyInjected),
            "{file}"
        );
    }
}

#[test]
fn node_agent_redirection_adds_no_init_container() {
    let doc = read_yaml("plain-pod.yaml");
    let settings = InjectSettings {
        redirection: Redirection::NodeAgent,
        ..Default::default()
    };
    let ops = injection_patch(&pod_of(&doc), &settings).expect("patch");
    let mut out = doc.clone();
    apply_patch(&mut out, &ops).expect("applies");
    let pod = pod_of(&out);
    assert!(
        pod.spec
            .as_ref()
            .and_then(|s| s.init_containers.as_ref())
            .is_none()
    );
    let status: Value = serde_json::from_str(
        &pod.metadata.annotations.as_ref().expect("annotations")[STATUS_ANNOTATION],
    )
    .expect("status");
    assert_eq!(status["initContainers"], json!([]));
}

fn admission_review(object: Value, operation: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "ai",
            "operation": operation,
            "object": object,
        }
    }))
    .expect("JSON")
}

#[test]
fn the_webhook_answers_with_the_same_patch_base64_encoded() {
    let doc = read_yaml("plain-pod.yaml");
    let answer = review(
        &admission_review(doc.clone(), "CREATE"),
        &InjectSettings::default(),
    )
    .expect("answered");
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answer["kind"], "AdmissionReview");
    let resp = &answer["response"];
    assert_eq!(resp["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
    assert_eq!(resp["allowed"], true);
    assert_eq!(resp["patchType"], "JSONPatch");
    let patch = base64::engine::general_purpose::STANDARD
        .decode(resp["patch"].as_str().expect("patch"))
        .expect("base64");
    let ops: Vec<Value> = serde_json::from_slice(&patch).expect("JSON Patch");
    let mut patched = doc;
    apply_patch(&mut patched, &ops).expect("applies");
    assert_eq!(patched, inject("plain-pod.yaml"));
}

#[test]
fn the_webhook_allows_without_a_patch_what_it_leaves_alone() {
    let doc = read_yaml("plain-pod.yaml");
    let settings = InjectSettings::default();
    let update = review(&admission_review(doc, "UPDATE"), &settings).expect("answered");
    assert_eq!(update["response"]["allowed"], true);
    assert!(update["response"].get("patch").is_none());
    let injected = review(
        &admission_review(inject("plain-pod.yaml"), "CREATE"),
        &settings,
    )
    .expect("answered");
    assert!(
        injected["response"].get("patch").is_none(),
        "re-injection adds nothing"
    );
    let opted_out = json!({
        "metadata": {"name": "p", "annotations": {POD_INJECT: "false"}},
        "spec": {"containers": [{"name": "app"}]},
    });
    let answer = review(&admission_review(opted_out, "CREATE"), &settings).expect("answered");
    assert!(answer["response"].get("patch").is_none());
}

#[test]
fn the_webhook_refuses_a_pod_it_cannot_read_and_rejects_a_non_review() {
    let bad = json!({"metadata": {"name": 7}, "spec": {"containers": "none"}});
    let answer =
        review(&admission_review(bad, "CREATE"), &InjectSettings::default()).expect("answered");
    assert_eq!(answer["response"]["allowed"], false);
    let message = answer["response"]["status"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(message.contains("cannot be read"), "{message}");
    assert!(review(b"{not json", &InjectSettings::default()).is_err());
    assert!(review(b"{}", &InjectSettings::default()).is_err());
}

#[test]
fn the_patch_applier_refuses_what_it_does_not_do() {
    let mut doc = json!({"a": [1]});
    let remove = [json!({"op": "remove", "path": "/a"})];
    assert!(matches!(
        apply_patch(&mut doc, &remove),
        Err(PatchError::Malformed | PatchError::UnsupportedOp { .. })
    ));
    let missing = [json!({"op": "add", "path": "/b/c", "value": 1})];
    assert!(matches!(
        apply_patch(&mut doc, &missing),
        Err(PatchError::BadPath { .. })
    ));
    let escaped = [json!({"op": "add", "path": "/x~1y~0z", "value": 2})];
    apply_patch(&mut doc, &escaped).expect("applies");
    assert_eq!(doc["x/y~z"], 2);
}

#[test]
fn the_proxy_is_told_which_workload_it_serves() {
    let name_of = |metadata: Value| {
        let pod = pod_of(&json!({"metadata": metadata, "spec": {"containers": [{"name": "app"}]}}));
        let ops = injection_patch(&pod, &InjectSettings::default()).expect("patch");
        let proxy = ops
            .iter()
            .find(|op| op["value"]["name"] == PROXY_CONTAINER)
            .map(|op| op["value"].clone())
            .or_else(|| {
                ops.iter()
                    .filter_map(|op| op["value"].as_array())
                    .flatten()
                    .find(|c| c["name"] == PROXY_CONTAINER)
                    .cloned()
            })
            .expect("the proxy container is added");
        proxy["env"]
            .as_array()
            .and_then(|env| env.iter().find(|e| e["name"] == "WORKLOAD_NAME"))
            .map(|e| e["value"].as_str().unwrap_or_default().to_string())
            .expect("WORKLOAD_NAME is set")
    };
    // A Deployment's pod as the ReplicaSet creates it: no name yet.
    let deployment = json!({
        "generateName": "llm-v2-5d8f7c6b9-",
        "labels": {"app": "llm", "pod-template-hash": "5d8f7c6b9"},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "llm-v2-5d8f7c6b9", "uid": "u", "controller": true}],
    });
    assert_eq!(name_of(deployment), "llm-v2");
    let stateful = json!({
        "name": "vector-db-0",
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "vector-db", "uid": "u", "controller": true}],
    });
    assert_eq!(name_of(stateful), "vector-db");
    assert_eq!(name_of(json!({"name": "lonely"})), "lonely");
    assert_eq!(name_of(json!({"generateName": "job-"})), "job");
}
