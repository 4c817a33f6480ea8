//! The sidecar injection webhook as the API server meets it: HTTPS with the
//! CA-issued certificate for `ambit-control.ambit-system.svc`, an
//! `admission.k8s.io/v1` AdmissionReview posted to `/inject`, a base64 JSON
//! Patch back. The client is curl (a TLS and HTTP stack we did not write),
//! trusting only the mesh root, as the API server trusts the `caBundle`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use ambit_control::{ControlConfig, ControlPlane};
use base64::Engine as _;
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(10);
const HOST: &str = "ambit-control.ambit-system.svc";

/// `curl` to the webhook by its service name, resolved to `addr`; returns
/// the HTTP status and the body.
async fn curl(addr: SocketAddr, root: &Path, method: &str, body: &[u8]) -> (u16, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("body");
    std::fs::write(&file, body).unwrap();
    let url = format!("https://{HOST}:{}/inject", addr.port());
    let mut cmd = std::process::Command::new("curl");
    cmd.args(["-sS", "--max-time", "5", "-X", method])
        .arg("--cacert")
        .arg(root)
        .arg("--resolve")
        .arg(format!("{HOST}:{}:127.0.0.1", addr.port()))
        .args([
            "-H",
            "Content-Type: application/json",
            "-w",
            "\n%{http_code}",
        ])
        .arg("--data-binary")
        .arg(format!("@{}", file.display()))
        .arg(url);
    // curl bounds itself (--max-time); it runs off the async workers.
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .expect("curl task")
        .expect("curl runs (the test needs curl on PATH)");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (body, code) = text.rsplit_once('\n').expect("status line");
    (code.trim().parse().expect("HTTP status"), body.to_string())
}

fn review(pod: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "b1b1e5a0-0000-4000-8000-000000000001",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "ai",
            "operation": "CREATE",
            "object": pod,
        }
    }))
    .unwrap()
}

#[tokio::test]
async fn the_webhook_injects_over_https_with_the_ca_issued_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config");
    std::fs::create_dir_all(&config).unwrap();
    let data = dir.path().join("data");
    let mut cfg = ControlConfig::for_tests(config, data.clone());
    cfg.injection_webhook_addr = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    // The service name is among the production defaults; the test config
    // starts from loopback names only.
    cfg.tls_names.push(HOST.to_string());
    let cp = ControlPlane::start(cfg)
        .await
        .expect("control plane starts");
    tokio::time::timeout(T, cp.wait_synced())
        .await
        .expect("synced in time")
        .expect("synced");
    let addr = cp.webhook_addr().expect("the webhook is served");
    let root = data.join("ca").join("root-cert.pem");
    assert!(root.exists(), "the mesh root is at {}", root.display());

    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "embed-", "namespace": "ai", "labels": {"app": "embed"}},
        "spec": {"serviceAccountName": "embed", "containers": [{"name": "embed", "image": "embed:1"}]},
    });
    let (status, body) = curl(addr, &root, "POST", &review(pod.clone())).await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).expect("JSON answer");
    let resp = &answer["response"];
    assert_eq!(resp["uid"], "b1b1e5a0-0000-4000-8000-000000000001");
    assert_eq!(resp["allowed"], true);
    assert_eq!(resp["patchType"], "JSONPatch");
    let patch = base64::engine::general_purpose::STANDARD
        .decode(resp["patch"].as_str().expect("a patch"))
        .expect("base64");
    let ops: Vec<Value> = serde_json::from_slice(&patch).expect("JSON Patch");
    let mut patched = pod;
    ambit_control::inject::apply_patch(&mut patched, &ops).expect("the patch applies");
    let typed: Pod = serde_json::from_value(patched.clone()).expect("still a valid Pod");
    let names: Vec<String> = typed
        .spec
        .unwrap()
        .containers
        .into_iter()
        .map(|c| c.name)
        .collect();
    assert_eq!(names, ["embed", "istio-proxy"]);

    // Posting the injected pod again adds nothing.
    let (status, body) = curl(addr, &root, "POST", &review(patched)).await;
    assert_eq!(status, 200);
    let again: Value = serde_json::from_str(&body).unwrap();
    assert!(again["response"].get("patch").is_none(), "{body}");

    // What is not an AdmissionReview, and other methods, are refused.
    let (status, _) = curl(addr, &root, "POST", b"not json").await;
    assert_eq!(status, 400);
    let (status, _) = curl(addr, &root, "PUT", b"{}").await;
    assert_eq!(status, 405);
    // A body past the 8 MiB bound is refused, not buffered.
    let huge = vec![b' '; 9 << 20];
    let (status, _) = curl(addr, &root, "POST", &huge).await;
    assert_eq!(status, 413);
}
