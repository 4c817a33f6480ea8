//! The control plane's writers and authentication in Kubernetes mode,
//! against the in-process fake API server: leader election through one
//! Lease (hand-over when the leader is killed or shuts down), the CA root
//! Secret created once by the leader with Istio's keys and never
//! overwritten, a plugged-in `cacerts` Secret, TokenReview (allow, deny,
//! wrong audience, ztunnel impersonation checked against the pods' nodes)
//! and waypoint Gateway status written by the leader only.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ambit_control::ControlPlane;
use ambit_control::ca::{generate_csr, generate_root, impersonation_metadata};
use ambit_proto::auth::IstioCertificateRequest;
use ambit_proto::auth::istio_certificate_service_client::IstioCertificateServiceClient;
use ambit_tests::eventually;
use ambit_tests::fakeapi::FakeApiServer;
use ambit_tests::kubebed::{
    Observer, control_plane, namespace, pod, sa_token, wait_synced, ztunnel_token,
};
use base64::Engine;
use serde_json::{Value, json};
use tonic::Code;

const LIMIT: Duration = Duration::from_secs(10);
const LEASE: (&str, &str, &str, &str) = (
    "coordination.k8s.io/v1",
    "Lease",
    "ambit-system",
    "ambit-control",
);

fn lease_holder(fake: &FakeApiServer) -> Option<String> {
    let (v, k, ns, n) = LEASE;
    fake.get(v, k, ns, n)
        .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string))
}

fn secret(fake: &FakeApiServer, name: &str) -> Option<Value> {
    fake.get("v1", "Secret", "ambit-system", name)
}

fn secret_key(s: &Value, key: &str) -> String {
    let b64 = s["data"][key].as_str().unwrap_or_default();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap();
    String::from_utf8(bytes).unwrap()
}

/// The first certificate of a PEM text, re-encoded (comparable).
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

async fn wait_leader(cp: &ControlPlane, what: &str) -> Duration {
    let start = Instant::now();
    eventually(LIMIT, what, || async { cp.is_leader().then_some(()) })
        .await
        .unwrap();
    start.elapsed()
}

/// Asks `addr`'s CA for a certificate of `identity` with `token`.
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

fn secret_calls(fake: &FakeApiServer, verb: &str) -> usize {
    fake.calls()
        .iter()
        .filter(|c| c.resource == "secrets" && c.verb == verb)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_creates_the_ca_secret_once_and_hands_over_when_killed_or_stopped() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.set_token_review("web", sa_token("shop", "web", None, &["istio-ca"]));
    let dir = tempfile::tempdir().unwrap();

    let a = control_plane(&fake, dir.path(), "a").await.unwrap();
    wait_leader(&a, "replica a leads").await;
    assert_eq!(lease_holder(&fake).as_deref(), Some("a"));
    wait_synced(&a, LIMIT).await.unwrap();
    let root = secret(&fake, "istio-ca-secret").expect("the leader created the root Secret");
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
    let cm = eventually(
        LIMIT,
        "the leader publishes the root for ztunnels",
        || async { fake.get("v1", "ConfigMap", "ambit-system", "istio-ca-root-cert") },
    )
    .await
    .unwrap();
    assert_eq!(
        first_der(cm["data"]["root-cert.pem"].as_str().unwrap()),
        root_der
    );
    let root_rv = root["metadata"]["resourceVersion"].clone();

    let b = control_plane(&fake, dir.path(), "b").await.unwrap();
    wait_synced(&b, LIMIT).await.unwrap();
    assert!(!b.is_leader(), "one leader at a time");
    // Every replica signs, with the one root.
    for cp in [&a, &b] {
        let chain = certify(
            cp.xds_addr(),
            "web",
            "spiffe://cluster.local/ns/shop/sa/web",
            false,
        )
        .await
        .unwrap();
        assert_eq!(
            first_der(chain.last().unwrap()),
            root_der,
            "chains to the Secret's root"
        );
    }

    // The leader crashes: the follower takes over once the Lease expires
    // (2 s in tests).
    a.kill().await;
    let took = wait_leader(&b, "replica b takes over after a was killed").await;
    eprintln!("hand-over after the leader was killed: {took:?}");
    assert_eq!(lease_holder(&fake).as_deref(), Some("b"));
    let (v, k, ns, n) = LEASE;
    let lease = fake.get(v, k, ns, n).unwrap();
    assert_eq!(lease["spec"]["leaseTransitions"], 1);

    // A new replica reads the same root; nothing rewrote the Secret.
    let c = control_plane(&fake, dir.path(), "c").await.unwrap();
    wait_synced(&c, LIMIT).await.unwrap();
    let chain = certify(
        c.xds_addr(),
        "web",
        "spiffe://cluster.local/ns/shop/sa/web",
        false,
    )
    .await
    .unwrap();
    assert_eq!(first_der(chain.last().unwrap()), root_der);
    let now = secret(&fake, "istio-ca-secret").unwrap();
    assert_eq!(
        now["metadata"]["resourceVersion"], root_rv,
        "never overwritten"
    );
    assert_eq!(secret_calls(&fake, "create"), 1, "created once");
    assert_eq!(
        secret_calls(&fake, "update") + secret_calls(&fake, "patch"),
        0
    );

    // A leader shutting down releases the Lease: the next replica leads
    // without waiting for it to expire.
    b.shutdown().await;
    let took = wait_leader(&c, "replica c takes over after b shut down").await;
    eprintln!("hand-over after the leader shut down: {took:?}");
    assert!(
        took < Duration::from_secs(2),
        "released, not expired: {took:?}"
    );
    assert_eq!(lease_holder(&fake).as_deref(), Some("c"));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugged_in_cacerts_secret_wins_and_no_root_is_generated() {
    let fake = FakeApiServer::start().await.unwrap();
    let (cert, key) = generate_root().unwrap();
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    fake.apply(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "cacerts", "namespace": "ambit-system"},
        "data": {
            "ca-cert.pem": b64(&cert), "ca-key.pem": b64(&key),
            "root-cert.pem": b64(&cert), "cert-chain.pem": b64(&cert),
        },
    }))
    .unwrap();
    fake.set_token_review("web", sa_token("shop", "web", None, &["istio-ca"]));
    let dir = tempfile::tempdir().unwrap();
    let a = control_plane(&fake, dir.path(), "a").await.unwrap();
    wait_leader(&a, "replica a leads").await;
    let chain = certify(
        a.xds_addr(),
        "web",
        "spiffe://cluster.local/ns/shop/sa/web",
        false,
    )
    .await
    .unwrap();
    assert_eq!(first_der(chain.last().unwrap()), first_der(&cert));
    assert!(secret(&fake, "istio-ca-secret").is_none());
    assert_eq!(secret_calls(&fake, "create"), 0);
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_review_allows_denies_checks_audience_and_ztunnel_nodes() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.apply(namespace(
        "shop",
        json!({"istio.io/dataplane-mode": "ambient"}),
    ))
    .unwrap();
    fake.apply(namespace("ambit-system", json!({}))).unwrap();
    fake.apply(pod(
        "shop",
        "web-0",
        "10.1.0.5",
        "node-1",
        json!({"app": "web"}),
    ))
    .unwrap();
    for (p, node, ip) in [
        ("ztunnel-a", "node-1", "10.1.0.2"),
        ("ztunnel-b", "node-2", "10.1.1.2"),
    ] {
        fake.apply(pod("ambit-system", p, ip, node, json!({"app": "ztunnel"})))
            .unwrap();
    }
    fake.set_token_review("zt-1", ztunnel_token("ztunnel-a"));
    fake.set_token_review("zt-2", ztunnel_token("ztunnel-b"));
    fake.set_token_review(
        "web",
        sa_token("shop", "default", Some("web-0"), &["istio-ca"]),
    );
    fake.set_token_review(
        "web-api-audience",
        sa_token(
            "shop",
            "default",
            Some("web-0"),
            &["https://kubernetes.default.svc"],
        ),
    );
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&fake, dir.path(), "a").await.unwrap();
    wait_synced(&cp, LIMIT).await.unwrap();
    let web_id = "spiffe://cluster.local/ns/shop/sa/default";
    let addr = cp.xds_addr();

    // A workload for its own identity; ztunnel on the pod's node for it.
    certify(addr, "web", web_id, false).await.unwrap();
    certify(addr, "zt-1", web_id, true).await.unwrap();
    // ztunnel of another node: the pod does not run there.
    let e = certify(addr, "zt-2", web_id, true).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("node-2"), "{}", e.message());
    // A workload for another identity.
    let e = certify(
        addr,
        "web",
        "spiffe://cluster.local/ns/shop/sa/admin",
        false,
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // The wrong audience and an unknown token are not authenticated.
    let e = certify(addr, "web-api-audience", web_id, false)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert!(
        e.message().contains("istio-ca"),
        "says which audience: {}",
        e.message()
    );
    let e = certify(addr, "forged", web_id, false).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");

    // xDS: ztunnel's token is served as a ztunnel, a workload's is not.
    let mut obs = Observer::connect_with_token(addr, ambit_proto::ADDRESS_TYPE_URL, "zt-1")
        .await
        .unwrap();
    obs.next(LIMIT).await.unwrap();
    let refused =
        match Observer::connect_with_token(addr, ambit_proto::ADDRESS_TYPE_URL, "web").await {
            Err(e) => e.to_string(),
            Ok(mut o) => o.next(LIMIT).await.unwrap_err().to_string(),
        };
    assert!(refused.contains("ztunnel"), "{refused}");

    // Every review asked the API server with the control plane's identity.
    let reviews = fake
        .calls()
        .into_iter()
        .filter(|c| c.resource == "tokenreviews")
        .collect::<Vec<_>>();
    assert!(!reviews.is_empty());
    assert!(
        reviews
            .iter()
            .all(|c| c.verb == "create" && c.identity == "ambit-control/a")
    );
    cp.shutdown().await;
}

fn waypoint_gateway() -> Value {
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {"name": "waypoint", "namespace": "shop", "generation": 1},
        "spec": {
            "gatewayClassName": "istio-waypoint",
            "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}],
        },
    })
}

fn programmed(fake: &FakeApiServer) -> Option<Value> {
    let gw = fake.get(
        "gateway.networking.k8s.io/v1",
        "Gateway",
        "shop",
        "waypoint",
    )?;
    gw["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Programmed" && c["status"] == "True")
        .cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_writes_waypoint_gateway_status() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.apply(namespace("shop", json!({}))).unwrap();
    fake.apply(waypoint_gateway()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let a = control_plane(&fake, dir.path(), "a").await.unwrap();
    wait_leader(&a, "replica a leads").await;
    let b = control_plane(&fake, dir.path(), "b").await.unwrap();
    wait_synced(&b, LIMIT).await.unwrap();
    eventually(LIMIT, "Programmed=True written", || async {
        programmed(&fake)
    })
    .await
    .unwrap();
    let gw = fake
        .get(
            "gateway.networking.k8s.io/v1",
            "Gateway",
            "shop",
            "waypoint",
        )
        .unwrap();
    assert_eq!(
        gw["status"]["addresses"][0]["value"],
        "waypoint.shop.svc.cluster.local"
    );
    let writers = |fake: &FakeApiServer| {
        fake.calls()
            .into_iter()
            .filter(|c| c.resource == "gateways" && c.subresource == "status")
            .map(|c| c.identity)
            .collect::<std::collections::BTreeSet<_>>()
    };
    assert_eq!(writers(&fake), ["ambit-control/a".to_string()].into());

    // The new leader writes what it finds missing.
    a.kill().await;
    wait_leader(&b, "replica b takes over").await;
    fake.apply(waypoint_gateway()).unwrap(); // status gone
    eventually(LIMIT, "Programmed=True written again", || async {
        programmed(&fake)
    })
    .await
    .unwrap();
    assert!(writers(&fake).contains("ambit-control/b"));
    b.shutdown().await;
}

fn reconciled(fake: &FakeApiServer) -> Option<(String, String)> {
    let vs = fake.get("networking.istio.io/v1", "VirtualService", "shop", "web")?;
    let c = vs["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Reconciled")?
        .clone();
    Some((
        c["status"].as_str()?.to_string(),
        c["message"].as_str()?.to_string(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_reports_a_rejected_virtualservice_in_its_status_and_clears_it_when_fixed() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.apply(namespace("shop", json!({}))).unwrap();
    let good = json!({
        "apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"hosts": ["web"], "http": [{"route": [{"destination": {"host": "web"}}]}]},
    });
    fake.apply(good.clone()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let a = control_plane(&fake, dir.path(), "a").await.unwrap();
    wait_leader(&a, "replica a leads").await;
    wait_synced(&a, LIMIT).await.unwrap();

    let mut bad = good.clone();
    bad["spec"]["http"][0]["timeout"] = json!("forever");
    fake.apply(bad).unwrap();
    let (status, message) = eventually(LIMIT, "Reconciled=False", || async {
        reconciled(&fake).filter(|(s, _)| s == "False")
    })
    .await
    .unwrap();
    assert_eq!(status, "False");
    assert!(message.contains("timeout"), "says what is wrong: {message}");

    fake.apply(good).unwrap();
    eventually(LIMIT, "Reconciled=True", || async {
        reconciled(&fake).filter(|(s, _)| s == "True")
    })
    .await
    .unwrap();
    a.shutdown().await;
}

/// ztunnel as the DaemonSet runs it: TLS to 15012 verified with the root
/// the leader published in ConfigMap istio-ca-root-cert, a projected token
/// the control plane reviews (audience istio-ca); it becomes ready and
/// holds the cluster's pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ztunnel_as_deployed_gets_its_config_over_tls_with_a_reviewed_token() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.apply(namespace(
        "shop",
        json!({"istio.io/dataplane-mode": "ambient"}),
    ))
    .unwrap();
    fake.apply(pod(
        "shop",
        "web-0",
        "10.1.0.5",
        "node-1",
        json!({"app": "web"}),
    ))
    .unwrap();
    fake.apply(pod(
        "ambit-system",
        "ztunnel-a",
        "10.1.0.2",
        "node-1",
        json!({"app": "ztunnel"}),
    ))
    .unwrap();
    fake.set_token_review("projected-zt-token", ztunnel_token("ztunnel-a"));
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&fake, dir.path(), "a").await.unwrap();
    wait_synced(&cp, LIMIT).await.unwrap();
    let cm = eventually(LIMIT, "root ConfigMap", || async {
        fake.get("v1", "ConfigMap", "ambit-system", "istio-ca-root-cert")
    })
    .await
    .unwrap();
    // The DaemonSet's volumes: the ConfigMap and the projected token.
    let root = dir.path().join("root-cert.pem");
    std::fs::write(&root, cm["data"]["root-cert.pem"].as_str().unwrap()).unwrap();
    let token = dir.path().join("istio-token");
    std::fs::write(&token, "projected-zt-token").unwrap();
    let mut z = ambit_ztunnel::Config::new("node-1", format!("https://{}", cp.xds_tls_addr()))
        .with_ephemeral_ports();
    z.token_file = Some(token);
    z.root_cert = Some(root);
    z.zds_path = dir.path().join("zds.sock");
    let zt = ambit_ztunnel::start(z).await.unwrap();
    tokio::time::timeout(LIMIT, zt.wait_ready())
        .await
        .expect("ztunnel ready over TLS with a reviewed token");
    let dump = eventually(LIMIT, "the pod in ztunnel's config", || async {
        let d = ambit_tests::get(zt.admin_addr(), "/config_dump")
            .await
            .ok()?;
        d.contains("web-0").then_some(d)
    })
    .await
    .unwrap();
    assert!(dump.contains("ztunnel-a"));
    zt.shutdown().await;
    cp.shutdown().await;
}
