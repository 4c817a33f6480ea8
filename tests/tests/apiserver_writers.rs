//! What the control plane writes, and whom it believes, on a real
//! kube-apiserver (the kit in `../shared/kube`), each replica running as
//! ServiceAccount `ambit-system/ambit-control` with the RBAC Ambit ships:
//!
//! - a plugged-in CA (Secret `cacerts`) signs and is what ztunnels trust;
//!   no root is generated;
//! - two replicas: the generated root is Istio's `istio-ca-secret`, both
//!   sign with it and nobody rewrites it; only the leader writes waypoint
//!   Gateway status, once per generation, `observedGeneration` following
//!   edits — the audit log tells the replicas apart by their token's
//!   credential id, and shows the follower writing nothing while the
//!   Gateway was stale and nobody led, until it held the Lease;
//! - TokenReview: a workload's token gets its own identity only (also when
//!   it asks as ztunnel does, impersonating) and is no ztunnel on xDS;
//!   ztunnel of node-2 gets nothing for a pod of node-1; a token whose pod
//!   was deleted is refused, also once a pod of the same name is back;
//!   every review is made as the control plane;
//! - a VirtualService Ambit rejects but the CRD schema lets through gets
//!   `Reconciled=False` saying why, and `True` once fixed; an object never
//!   rejected is never written.
//!
//! Shown elsewhere on a real server (`apiserver_control.rs`): one Lease
//! holder and the hand-over, the root Secret created once, ztunnel over
//! TLS with a bound token, forged and wrong-audience tokens refused,
//! ztunnel of node-1 refused a pod of node-2.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use ambit_control::ControlPlane;
use ambit_control::ca::{generate_csr, generate_root, impersonation_metadata};
use ambit_proto::auth::IstioCertificateRequest;
use ambit_proto::auth::istio_certificate_service_client::IstioCertificateServiceClient;
use ambit_tests::eventually;
use ambit_tests::kubeapi::{Crds, KubeApiServer, api_of};
use ambit_tests::kubebed::{Observer, pod_uid, wait_synced};
use base64::Engine;
use serde_json::{Value, json};
use tonic::Code;

const LIMIT: Duration = Duration::from_secs(20);
const CONTROL_USER: &str = "system:serviceaccount:ambit-system:ambit-control";
const WEB_ID: &str = "spiffe://cluster.local/ns/shop/sa/web";

/// A replica and the credential id its API requests carry in the audit
/// log (`JTI=<its token's jti>`): every replica has its own token.
async fn replica(kube: &KubeApiServer, dir: &Path, name: &str) -> (ControlPlane, String) {
    let cfg = kube.control_config(dir, name).await.unwrap();
    let kubeconfig = std::fs::read_to_string(cfg.kubeconfig.as_ref().unwrap()).unwrap();
    let token = kubeconfig
        .split("token: \"")
        .nth(1)
        .and_then(|t| t.split('"').next())
        .unwrap();
    let claims = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token.split('.').nth(1).unwrap())
        .unwrap();
    let claims: Value = serde_json::from_slice(&claims).unwrap();
    let jti = claims["jti"].as_str().expect("the token has a jti");
    (
        ControlPlane::start(cfg).await.unwrap(),
        format!("JTI={jti}"),
    )
}

async fn wait_leader(cp: &ControlPlane) {
    eventually(LIMIT, "a leader", || async { cp.is_leader().then_some(()) })
        .await
        .unwrap();
}

async fn namespace_with(kube: &KubeApiServer, ns: &str, service_accounts: &[&str]) {
    kube.apply(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}))
        .await
        .unwrap();
    for sa in service_accounts {
        kube.apply(&json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": sa, "namespace": ns}}))
            .await
            .unwrap();
    }
}

/// Asks `addr`'s CA for a certificate of `identity` with `token`; as a
/// ztunnel does for a pod of its node when `impersonate`.
async fn certify(
    addr: SocketAddr,
    token: &str,
    identity: &str,
    impersonate: bool,
) -> Result<Vec<String>, tonic::Status> {
    let mut c = tokio::time::timeout(
        LIMIT,
        IstioCertificateServiceClient::connect(format!("http://{addr}")),
    )
    .await
    .unwrap()
    .unwrap();
    let mut req = tonic::Request::new(IstioCertificateRequest {
        csr: generate_csr(&[identity], &[]).unwrap().csr_pem,
        validity_duration: 3600,
        metadata: impersonate.then(|| impersonation_metadata(identity)),
    });
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    req.set_timeout(LIMIT);
    tokio::time::timeout(LIMIT, c.create_certificate(req))
        .await
        .unwrap()
        .map(|r| r.into_inner().cert_chain)
}

/// The first certificate of a PEM text, as DER (comparable).
fn first_der(pem: &str) -> Vec<u8> {
    let body: String = pem
        .lines()
        .skip_while(|l| !l.starts_with("-----BEGIN CERTIFICATE"))
        .skip(1)
        .take_while(|l| !l.starts_with("-----END"))
        .collect();
    base64::engine::general_purpose::STANDARD
        .decode(body)
        .unwrap()
}

fn secret_ref(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Secret",
           "metadata": {"name": name, "namespace": "ambit-system"}})
}

fn secret_key(secret: &Value, key: &str) -> String {
    let b64 = secret["data"][key].as_str().unwrap_or_default();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap();
    String::from_utf8(bytes).unwrap()
}

/// The trust bundle the leader publishes for ztunnels.
async fn published_root(kube: &KubeApiServer) -> String {
    let cm = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "istio-ca-root-cert", "namespace": "ambit-system"}});
    eventually(LIMIT, "ConfigMap istio-ca-root-cert", || async {
        let cm = kube.get(&cm).await.ok()??;
        cm["data"]["root-cert.pem"].as_str().map(str::to_string)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugged_in_cacerts_secret_wins_and_no_root_is_generated() {
    let kube = KubeApiServer::start(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    let (cert, key) = generate_root().unwrap();
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let mut cacerts = secret_ref("cacerts");
    cacerts["data"] = json!({
        "ca-cert.pem": b64(&cert), "ca-key.pem": b64(&key),
        "root-cert.pem": b64(&cert), "cert-chain.pem": b64(&cert),
    });
    kube.apply(&cacerts).await.unwrap();
    namespace_with(&kube, "shop", &["web"]).await;
    let token = kube
        .token("shop", "web", Some("istio-ca"), None)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (cp, _) = replica(&kube, dir.path(), "a").await;
    wait_synced(&cp, LIMIT).await.unwrap();
    wait_leader(&cp).await;

    let chain = certify(cp.xds_addr(), &token, WEB_ID, false).await.unwrap();
    assert_eq!(
        first_der(chain.last().unwrap()),
        first_der(&cert),
        "signed by the plugged-in CA"
    );
    // What ztunnels trust is the plugged-in root; the leader, having
    // published it, generated no other.
    assert_eq!(first_der(&published_root(&kube).await), first_der(&cert));
    let generated = kube.get(&secret_ref("istio-ca-secret")).await.unwrap();
    assert!(generated.is_none(), "no root generated: {generated:?}");
    cp.shutdown().await;
}

/// A waypoint Gateway; `from` changes its spec (and so its generation).
fn waypoint(from: &str) -> Value {
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"name": "waypoint", "namespace": "shop"},
        "spec": {
            "gatewayClassName": "istio-waypoint",
            "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE",
                           "allowedRoutes": {"namespaces": {"from": from}}}],
        },
    })
}

/// The controller-manager's part, which a bare API server lacks: once the
/// waypoint's Deployment exists, its one replica is ready.
async fn deployment_ready(kube: &KubeApiServer) {
    let deployment = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "waypoint", "namespace": "shop"}});
    let generation = eventually(LIMIT, "the waypoint's Deployment", || async {
        kube.get(&deployment).await.ok()??["metadata"]["generation"].as_i64()
    })
    .await
    .unwrap();
    let (api, _) = api_of(&kube.client().await.unwrap(), &deployment).unwrap();
    api.patch_status(
        "waypoint",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&json!({"status": {"observedGeneration": generation,
            "replicas": 1, "readyReplicas": 1, "availableReplicas": 1, "updatedReplicas": 1}})),
    )
    .await
    .unwrap();
}

/// Waits until the waypoint's status says Accepted and Programmed for
/// `generation`; returns the status.
async fn status_for_generation(kube: &KubeApiServer, generation: i64) -> Value {
    deployment_ready(kube).await;
    eventually(
        LIMIT,
        &format!("status of generation {generation}"),
        || async {
            let gw = kube.get(&waypoint("All")).await.ok()??;
            assert_eq!(gw["metadata"]["generation"], generation, "the edits so far");
            let conditions = gw["status"]["conditions"].as_array()?;
            let current = |t: &str| {
                conditions.iter().any(|c| {
                    c["type"] == t && c["status"] == "True" && c["observedGeneration"] == generation
                })
            };
            (current("Accepted") && current("Programmed")).then(|| gw["status"].clone())
        },
    )
    .await
    .unwrap()
}

/// `(credential id, received at)` of each successful request matching
/// `resource`, `subresource` and `verb`, in the audit log's order.
fn audited(
    kube: &KubeApiServer,
    resource: &str,
    subresource: &str,
    verb: &str,
) -> Vec<(String, String)> {
    kube.audit_events()
        .unwrap()
        .into_iter()
        .filter(|e| {
            e["objectRef"]["resource"] == resource
                && e["objectRef"]["subresource"].as_str().unwrap_or_default() == subresource
                && e["verb"] == verb
                && e["responseStatus"]["code"]
                    .as_i64()
                    .is_some_and(|c| c < 300)
        })
        .map(|e| {
            let credential = e["user"]["extra"]["authentication.kubernetes.io/credential-id"][0]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let at = e["requestReceivedTimestamp"].as_str().unwrap().to_string();
            (credential, at)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_sign_with_one_istio_root_and_only_the_leader_writes_gateway_status() {
    let kube = KubeApiServer::start_audited(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    namespace_with(&kube, "shop", &["web"]).await;
    kube.apply(&waypoint("All")).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (a, a_id) = replica(&kube, dir.path(), "a").await;
    let (b, b_id) = replica(&kube, dir.path(), "b").await;
    wait_synced(&a, LIMIT).await.unwrap();
    wait_synced(&b, LIMIT).await.unwrap();
    eventually(LIMIT, "one leader", || async {
        (a.is_leader() != b.is_leader()).then_some(())
    })
    .await
    .unwrap();
    let ((leader, leader_id), (follower, follower_id, follower_name)) = if a.is_leader() {
        ((a, a_id), (b, b_id, "b"))
    } else {
        ((b, b_id), (a, a_id, "a"))
    };

    // The generated root: Istio's Secret with Istio's keys; both replicas
    // sign with it, and it is what ztunnels trust.
    let root = kube
        .get(&secret_ref("istio-ca-secret"))
        .await
        .unwrap()
        .expect("the leader created istio-ca-secret");
    assert_eq!(root["type"], "istio.io/ca-root");
    let mut keys: Vec<&String> = root["data"].as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "ca-cert.pem",
            "ca-key.pem",
            "cert-chain.pem",
            "key.pem",
            "root-cert.pem"
        ],
        "Istio's istio-ca-secret key names"
    );
    let root_der = first_der(&secret_key(&root, "ca-cert.pem"));
    let token = kube
        .token("shop", "web", Some("istio-ca"), None)
        .await
        .unwrap();
    for cp in [&leader, &follower] {
        let chain = certify(cp.xds_addr(), &token, WEB_ID, false).await.unwrap();
        assert_eq!(first_der(chain.last().unwrap()), root_der);
    }
    assert_eq!(first_der(&published_root(&kube).await), root_der);

    // Status follows the Gateway's generation.
    let status = status_for_generation(&kube, 1).await;
    assert_eq!(status["addresses"][0]["type"], "IPAddress", "{status}");
    assert_eq!(
        status["addresses"][1]["value"], "waypoint.shop.svc.cluster.local",
        "{status}"
    );
    kube.apply(&waypoint("Same")).await.unwrap();
    status_for_generation(&kube, 2).await;

    // The leader dies and the Gateway changes while nobody leads (the
    // Lease runs 2 s): only once the follower holds the Lease is the new
    // generation's status written.
    leader.kill().await;
    kube.apply(&waypoint("All")).await.unwrap();
    wait_leader(&follower).await;
    status_for_generation(&kube, 3).await;
    let lease = kube
        .get(
            &json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "ambit-control", "namespace": "ambit-system"}}),
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(lease["spec"]["holderIdentity"], follower_name);
    assert_eq!(lease["spec"]["leaseTransitions"], 1, "{lease:#}");

    let writes = audited(&kube, "gateways", "status", "patch");
    let by = |id: &str| writes.iter().filter(|(w, _)| w == id).count();
    assert!(
        writes.iter().all(|(id, _)| id.starts_with("JTI=")),
        "the audit log names each replica's credential: {writes:#?}"
    );
    // Per generation: Programmed False until the Deployment is ready, then
    // True — never a write that changes nothing.
    assert!(by(&leader_id) >= 2, "{writes:#?}");
    assert!(by(&follower_id) >= 1, "{writes:#?}");
    assert_eq!(
        writes.len(),
        by(&leader_id) + by(&follower_id),
        "no other writer: {writes:#?}"
    );
    let edited_at = audited(&kube, "gateways", "", "patch")
        .last()
        .unwrap()
        .1
        .clone();
    let took_lease_at = audited(&kube, "leases", "", "update")
        .into_iter()
        .find(|(id, _)| *id == follower_id)
        .expect("the follower took the Lease")
        .1;
    let wrote_at = &writes.iter().find(|(id, _)| *id == follower_id).unwrap().1;
    assert!(
        edited_at < took_lease_at && took_lease_at < *wrote_at,
        "edited at {edited_at}, the follower led at {took_lease_at} and wrote at {wrote_at}"
    );

    println!(
        "Gateway edited at {edited_at} with no leader; the follower led at {took_lease_at}, wrote status at {wrote_at}"
    );

    // Nobody rewrote the root.
    let now = kube
        .get(&secret_ref("istio-ca-secret"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        now["metadata"]["resourceVersion"],
        root["metadata"]["resourceVersion"]
    );
    for verb in ["update", "patch"] {
        let rewrites = audited(&kube, "secrets", "", verb);
        assert!(rewrites.is_empty(), "{verb}: {rewrites:#?}");
    }
    follower.shutdown().await;
}

/// The message of a refused xDS stream opened with `token`.
async fn xds_refusal(addr: SocketAddr, token: &str) -> String {
    match Observer::connect_with_token(addr, ambit_proto::ADDRESS_TYPE_URL, token).await {
        Err(e) => e.to_string(),
        Ok(mut obs) => obs.next(LIMIT).await.unwrap_err().to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_review_a_workload_gets_its_own_identity_only_and_a_deleted_pods_token_is_refused() {
    let kube = KubeApiServer::start_audited(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    namespace_with(&kube, "shop", &["web"]).await;
    let web_uid = kube
        .running_pod(
            "shop",
            "web-0",
            "web",
            "node-1",
            "10.244.0.5",
            json!({"app": "web"}),
        )
        .await
        .unwrap();
    let node_2 = kube
        .ztunnel_pod("ztunnel-b", "node-2", "10.244.1.2")
        .await
        .unwrap();
    // ztunnel-c's pod will be deleted: three tokens bound to it, each
    // presented first at a different moment (accepted answers are cached).
    let zt_c = kube
        .running_pod(
            "ambit-system",
            "ztunnel-c",
            "ztunnel",
            "node-3",
            "10.244.2.2",
            json!({"app": "ztunnel"}),
        )
        .await
        .unwrap();
    let mut zt_c_tokens = Vec::new();
    for _ in 0..3 {
        let t = kube
            .token(
                "ambit-system",
                "ztunnel",
                Some("istio-ca"),
                Some(("ztunnel-c", &zt_c)),
            )
            .await
            .unwrap();
        zt_c_tokens.push(t);
    }
    let web = kube
        .token("shop", "web", Some("istio-ca"), Some(("web-0", &web_uid)))
        .await
        .unwrap();
    let web_api_audience = kube
        .token("shop", "web", None, Some(("web-0", &web_uid)))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (cp, _) = replica(&kube, dir.path(), "a").await;
    wait_synced(&cp, LIMIT).await.unwrap();
    let addr = cp.xds_addr();

    // A workload: its own identity, nothing else — also not when it asks
    // as ztunnel does, impersonating — and not the workload API.
    certify(addr, &web, WEB_ID, false).await.unwrap();
    for impersonate in [false, true] {
        let e = certify(
            addr,
            &web,
            "spiffe://cluster.local/ns/shop/sa/db",
            impersonate,
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        assert!(
            e.message().contains("shop/web"),
            "names the caller: {}",
            e.message()
        );
    }
    let refused = xds_refusal(addr, &web).await;
    assert!(refused.contains("ztunnel"), "{refused}");
    let e = certify(addr, &web_api_audience, WEB_ID, false)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert!(
        e.message().contains("istio-ca"),
        "says which audience: {}",
        e.message()
    );

    // ztunnel of node-2, for a pod of node-1.
    let e = certify(addr, &node_2, WEB_ID, true).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("node-2"), "{}", e.message());

    // ztunnel-c is served while its pod runs ...
    let mut zt_c_stream =
        Observer::connect_with_token(addr, ambit_proto::ADDRESS_TYPE_URL, &zt_c_tokens[0])
            .await
            .unwrap();
    zt_c_stream.next(LIMIT).await.unwrap();
    // ... and its pod is deleted: once the control plane saw it go, a
    // token bound to it is refused.
    let mut watcher = Observer::connect_with_token(addr, ambit_proto::ADDRESS_TYPE_URL, &node_2)
        .await
        .unwrap();
    let gone = pod_uid("ambit-system", "ztunnel-c");
    watcher
        .until(LIMIT, "ztunnel-c listed", |h| h.contains(&gone))
        .await
        .unwrap();
    kube.delete_pod("ambit-system", "ztunnel-c").await.unwrap();
    watcher
        .until(LIMIT, "ztunnel-c gone", |h| !h.contains(&gone))
        .await
        .unwrap();
    let own_id = "spiffe://cluster.local/ns/ambit-system/sa/ztunnel";
    let refused = eventually(LIMIT, "the deleted pod's token refused", || async {
        certify(addr, &zt_c_tokens[1], own_id, false)
            .await
            .err()
            .filter(|e| e.code() == Code::Unauthenticated)
    })
    .await
    .unwrap();
    assert!(
        refused.message().contains("invalidated"),
        "{}",
        refused.message()
    );
    // A pod of the same name is back: the token names the old one.
    kube.running_pod(
        "ambit-system",
        "ztunnel-c",
        "ztunnel",
        "node-3",
        "10.244.2.2",
        json!({"app": "ztunnel"}),
    )
    .await
    .unwrap();
    let e = certify(addr, &zt_c_tokens[2], own_id, false)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    let refused = xds_refusal(addr, &zt_c_tokens[2]).await;
    assert!(refused.contains("refused"), "{refused}");

    // Every review was asked as the control plane.
    let reviews: Vec<Value> = kube
        .audit_events()
        .unwrap()
        .into_iter()
        .filter(|e| e["objectRef"]["resource"] == "tokenreviews")
        .collect();
    assert!(!reviews.is_empty());
    for r in &reviews {
        assert_eq!(r["user"]["username"], CONTROL_USER, "{r:#}");
        assert_eq!(
            (r["verb"].as_str(), r["responseStatus"]["code"].as_i64()),
            (Some("create"), Some(201)),
            "{r:#}"
        );
    }
    cp.shutdown().await;
}

fn virtual_service(name: &str, weights: &[u32]) -> Value {
    let route: Vec<Value> = weights
        .iter()
        .enumerate()
        .map(|(i, w)| json!({"destination": {"host": format!("web-{i}")}, "weight": w}))
        .collect();
    json!({
        "apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {"hosts": [name], "http": [{"route": route}]},
    })
}

/// The `Reconciled` condition of VirtualService `shop/<name>`.
async fn reconciled(kube: &KubeApiServer, name: &str) -> Option<Value> {
    let vs = kube.get(&virtual_service(name, &[])).await.ok()??;
    vs["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Reconciled")
        .cloned()
}

async fn config_errors(cp: &ControlPlane) -> Vec<Value> {
    let body = ambit_tests::get(cp.monitoring_addr(), "/debug/config_errors")
        .await
        .unwrap();
    serde_json::from_str(&body).unwrap()
}

/// Weights that do not add up to 100: Istio rejects them, its CRD schema
/// does not, so the API server stores what the control plane rejects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_virtual_service_is_reconciled_false_saying_why_and_true_once_fixed() {
    let kube = KubeApiServer::start(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    namespace_with(&kube, "shop", &[]).await;
    kube.apply(&virtual_service("web", &[80, 20]))
        .await
        .unwrap();
    kube.apply(&virtual_service("other", &[100])).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (cp, _) = replica(&kube, dir.path(), "a").await;
    wait_synced(&cp, LIMIT).await.unwrap();
    wait_leader(&cp).await;

    kube.apply(&virtual_service("web", &[80, 30]))
        .await
        .unwrap();
    let c = eventually(LIMIT, "Reconciled=False", || async {
        reconciled(&kube, "web")
            .await
            .filter(|c| c["status"] == "False")
    })
    .await
    .unwrap();
    let message = c["message"].as_str().unwrap();
    assert!(
        message.contains("sum to 110"),
        "says what is wrong: {message}"
    );
    assert!(
        message.contains("last accepted version keeps serving"),
        "{message}"
    );
    assert_eq!(c["reason"], "Invalid");
    let errors = config_errors(&cp).await;
    assert!(
        errors.iter().any(|e| e["kind"] == "VirtualService"
            && e["namespace"] == "shop"
            && e["name"] == "web"),
        "{errors:#?}"
    );

    kube.apply(&virtual_service("web", &[70, 30]))
        .await
        .unwrap();
    eventually(LIMIT, "Reconciled=True", || async {
        reconciled(&kube, "web")
            .await
            .filter(|c| c["status"] == "True")
    })
    .await
    .unwrap();
    assert_eq!(config_errors(&cp).await, Vec::<Value>::new());
    // Never rejected, never written.
    let other = kube
        .get(&virtual_service("other", &[]))
        .await
        .unwrap()
        .unwrap();
    assert!(other["status"].get("conditions").is_none(), "{other:#}");
    cp.shutdown().await;
}
