//! `ambitctl kube-inject` as a user runs it: the built binary on a file and
//! on standard input; its output is YAML that parses into typed objects.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::process::{Command, Stdio};

use k8s_openapi::api::apps::v1::Deployment;
use serde_json::Value;

const DEPLOYMENT: &str = "\
apiVersion: apps/v1
kind: Deployment
metadata: {name: embed, namespace: ai}
spec:
  selector: {matchLabels: {app: embed}}
  template:
    metadata: {labels: {app: embed}}
    spec:
      containers: [{name: embed, image: embed:2}]
---
apiVersion: v1
kind: Pod
metadata: {name: tools, namespace: ai, annotations: {sidecar.istio.io/inject: \"false\"}}
spec:
  containers: [{name: tools, image: busybox}]
";

fn ambitctl() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ambitctl"))
}

fn deployment_containers(stdout: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(stdout).expect("UTF-8 output");
    let docs: Vec<Value> = serde_saphyr::from_multiple(text).expect("YAML output");
    let d: Deployment = serde_json::from_value(docs[0].clone()).expect("a typed Deployment");
    d.spec
        .unwrap()
        .template
        .spec
        .unwrap()
        .containers
        .into_iter()
        .map(|c| c.name)
        .collect()
}

#[test]
fn injects_a_file_and_standard_input_and_names_what_it_skips() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("app.yaml");
    std::fs::write(&file, DEPLOYMENT).unwrap();

    let out = ambitctl()
        .args(["kube-inject", "-f"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(deployment_containers(&out.stdout), ["embed", "istio-proxy"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Pod tools: not injected"), "{stderr}");

    let mut child = ambitctl()
        .args(["kube-inject", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(DEPLOYMENT.as_bytes())
        .unwrap();
    let piped = child.wait_with_output().unwrap();
    assert!(piped.status.success());
    assert_eq!(
        piped.stdout, out.stdout,
        "stdin and file give the same output"
    );

    let missing = ambitctl()
        .args(["kube-inject", "-f", "/nonexistent/app.yaml"])
        .output()
        .unwrap();
    assert!(!missing.status.success());
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(err.contains("/nonexistent/app.yaml"), "{err}");
}
