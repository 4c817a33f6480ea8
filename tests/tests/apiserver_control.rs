//! The control plane in Kubernetes mode against a real kube-apiserver (the
//! kit in `../shared/kube`), running as its own ServiceAccount with only
//! the RBAC Ambit ships:
//!
//! - Ready on every Gateway API channel a cluster may have (standard
//!   v1.6.1: TCPRoute at `v1`; experimental: `v1` and `v1alpha2`; v1.2.1:
//!   none) and with no Gateway API at all (the install brings Istio's
//!   CRDs), with the node agent's view beside it — and the
//!   audit log shows no `403` for either;
//! - a CRD installed while it runs is watched within seconds;
//! - two replicas: one Lease holder, the CA root Secret created once, the
//!   Lease handed over on a clean stop and after a kill;
//! - ztunnel as deployed (TLS to 15012, a TokenRequest token bound to its
//!   pod, audience `istio-ca`) gets its node's config and certificates for
//!   its node's pods only; forged and wrong-audience tokens are refused.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use ambit_config::Kind;
use ambit_control::ControlPlane;
use ambit_tests::eventually;
use ambit_tests::kubeapi::{Crds, KubeApiServer, client_from};
use ambit_tests::kubebed::{Observer, wait_synced};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(20);

/// A control plane replica as ServiceAccount `ambit-system/ambit-control`.
async fn control_plane(kube: &KubeApiServer, dir: &Path, replica: &str) -> ControlPlane {
    let cfg = kube.control_config(dir, replica).await.unwrap();
    ControlPlane::start(cfg).await.unwrap()
}

/// Audit events of `user` answered with `code`.
fn answered(kube: &KubeApiServer, user: &str, code: i64) -> Vec<String> {
    kube.audit_events()
        .unwrap()
        .into_iter()
        .filter(|e| e["user"]["username"] == user && e["responseStatus"]["code"] == code)
        .map(|e| format!("{} {}", e["verb"], e["requestURI"]))
        .collect()
}

async fn ready_as_its_own_service_account(crds: Crds, tcp_route: Option<&str>) {
    let kube = KubeApiServer::start_audited(crds).await.unwrap();
    kube.install_ambit().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let cp = control_plane(&kube, dir.path(), "a").await;
    wait_synced(&cp, LIMIT).await.unwrap();
    let took = start.elapsed();
    let states = cp.kube_source().unwrap().states();
    let tcp = &states[&Kind::TcpRoute];
    match tcp_route {
        Some(av) => assert_eq!(tcp, &format!("synced at {av}"), "{states:#?}"),
        None => assert!(tcp.starts_with("absent"), "{states:#?}"),
    }
    // Without Istio's CRDs, the install brought Ambit's.
    let istio = &states[&Kind::AuthorizationPolicy];
    assert_eq!(istio, "synced at security.istio.io/v1", "{states:#?}");
    let gateway = &states[&Kind::Gateway];
    if crds == Crds::None {
        assert!(gateway.starts_with("absent"), "{states:#?}");
    } else {
        assert_eq!(
            gateway, "synced at gateway.networking.k8s.io/v1",
            "{states:#?}"
        );
    }
    let (code, body) = ambit_tests::http(cp.monitoring_addr(), "GET", "/ready")
        .await
        .unwrap();
    assert_eq!(code, 200, "{body}");
    println!("{crds:?}: ready in {took:?}");

    // The node agent's view, as its own ServiceAccount.
    let kc = kube
        .kubeconfig_for(
            "ambit-system",
            "ambit-node-agent",
            &dir.path().join("agent.kubeconfig"),
        )
        .await
        .unwrap();
    let view = tokio::time::timeout(
        LIMIT,
        ambit_cni::agent::kube::spawn_kube_view(client_from(&kc).await.unwrap(), "node-1"),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(view.borrow().namespaces.contains_key("ambit-system"));
    // Give the leader's writers a moment to run their first calls.
    eventually(LIMIT, "the leader's root ConfigMap", || async {
        cp.is_leader().then_some(())
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    for sa in ["ambit-control", "ambit-node-agent"] {
        let user = format!("system:serviceaccount:ambit-system:{sa}");
        let forbidden = answered(&kube, &user, 403);
        assert!(forbidden.is_empty(), "{sa} was refused: {forbidden:#?}");
        assert!(
            !answered(&kube, &user, 200).is_empty(),
            "{sa}'s requests are in the audit log"
        );
    }
    cp.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_on_the_standard_channel_with_tcproute_at_v1() {
    ready_as_its_own_service_account(Crds::Standard, Some("gateway.networking.k8s.io/v1")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_on_the_experimental_channel_with_tcproute_at_v1() {
    // Experimental v1.6.1 serves TCPRoute at v1 (preferred) and v1alpha2.
    ready_as_its_own_service_account(Crds::Experimental, Some("gateway.networking.k8s.io/v1"))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_on_gateway_api_v1_2_1_without_tcproute() {
    ready_as_its_own_service_account(Crds::V1_2_1, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_without_istio_or_gateway_api_crds() {
    ready_as_its_own_service_account(Crds::None, None).await;
}

/// Istio's CRDs arrive while the control plane runs: their kinds are
/// watched within seconds and a policy reaches ztunnel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crd_installed_later_is_watched_within_seconds() {
    let kube = KubeApiServer::start(Crds::None).await.unwrap();
    kube.install_ambit().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let uid = kube
        .running_pod(
            "ambit-system",
            "ztunnel-a",
            "ztunnel",
            "node-1",
            "10.244.0.2",
            json!({"app": "ztunnel"}),
        )
        .await
        .unwrap();
    let cp = control_plane(&kube, dir.path(), "a").await;
    wait_synced(&cp, LIMIT).await.unwrap();
    let token = kube
        .token(
            "ambit-system",
            "ztunnel",
            Some("istio-ca"),
            Some(("ztunnel-a", &uid)),
        )
        .await
        .unwrap();
    let mut obs =
        Observer::connect_with_token(cp.xds_addr(), ambit_proto::AUTHORIZATION_TYPE_URL, &token)
            .await
            .unwrap();

    kube.apply_kit_crds("istio.json").await.unwrap();
    let established = Instant::now();
    let source = cp.kube_source().unwrap();
    eventually(LIMIT, "AuthorizationPolicy watched", || async {
        source.states()[&Kind::AuthorizationPolicy]
            .starts_with("synced")
            .then_some(())
    })
    .await
    .unwrap();
    let noticed = established.elapsed();
    kube.apply(&json!({
        "apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
        "metadata": {"name": "deny-all", "namespace": "shop"},
        "spec": {"action": "DENY", "rules": [{}]},
    }))
    .await
    .unwrap_err(); // no namespace shop yet: the real server says so
    kube.apply(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}}))
        .await
        .unwrap();
    kube.apply(&json!({
        "apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
        "metadata": {"name": "deny-all", "namespace": "shop"},
        "spec": {"action": "DENY", "rules": [{}]},
    }))
    .await
    .unwrap();
    obs.until(LIMIT, "the new policy", |held| {
        held.contains("shop/deny-all")
    })
    .await
    .unwrap();
    println!("CRDs established → watched in {noticed:?}");
    assert!(
        noticed < Duration::from_secs(5),
        "picked up within seconds: {noticed:?}"
    );
    cp.shutdown().await;
}

/// Asks the CA at `addr` for a certificate of `identity` with `token`, as
/// a ztunnel does for a pod of its node (impersonation).
async fn certify(
    addr: std::net::SocketAddr,
    token: &str,
    identity: &str,
) -> Result<Vec<String>, tonic::Status> {
    use ambit_control::ca::{generate_csr, impersonation_metadata};
    use ambit_proto::auth::IstioCertificateRequest;
    use ambit_proto::auth::istio_certificate_service_client::IstioCertificateServiceClient;
    let mut c = IstioCertificateServiceClient::connect(format!("http://{addr}"))
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut req = tonic::Request::new(IstioCertificateRequest {
        csr: generate_csr(&[identity], &[]).unwrap().csr_pem,
        validity_duration: 3600,
        metadata: Some(impersonation_metadata(identity)),
    });
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    req.set_timeout(LIMIT);
    c.create_certificate(req)
        .await
        .map(|r| r.into_inner().cert_chain)
}

fn lease_holder(lease: &Value) -> String {
    lease["spec"]["holderIdentity"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

async fn lease(kube: &KubeApiServer) -> Value {
    let (api, name) = ambit_tests::kubeapi::api_of(
        &kube.client().await.unwrap(),
        &json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": "ambit-control", "namespace": "ambit-system"}}),
    )
    .unwrap();
    api.get_opt(&name)
        .await
        .unwrap()
        .map(|o| serde_json::to_value(o).unwrap())
        .unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_one_leader_one_ca_root_and_hand_over_on_stop_and_on_kill() {
    let kube = KubeApiServer::start_audited(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let a = control_plane(&kube, dir.path(), "a").await;
    let b = control_plane(&kube, dir.path(), "b").await;
    wait_synced(&a, LIMIT).await.unwrap();
    wait_synced(&b, LIMIT).await.unwrap();
    eventually(LIMIT, "one leader", || async {
        (a.is_leader() != b.is_leader()).then_some(())
    })
    .await
    .unwrap();
    let (leader, follower, first) = if a.is_leader() {
        (a, b, "a")
    } else {
        (b, a, "b")
    };
    assert_eq!(lease_holder(&lease(&kube).await), first);
    // The root ConfigMap the leader keeps, with the CA both replicas use.
    eventually(LIMIT, "istio-ca-root-cert", || async {
        let client = kube.client().await.ok()?;
        let api: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
            kube::Api::namespaced(client, "ambit-system");
        api.get_opt("istio-ca-root-cert").await.ok()?
    })
    .await
    .unwrap();
    let creates: Vec<Value> = kube
        .audit_events()
        .unwrap()
        .into_iter()
        .filter(|e| {
            e["verb"] == "create"
                && e["objectRef"]["resource"] == "secrets"
                && e["responseStatus"]["code"] == 201
        })
        .collect();
    assert_eq!(
        creates.len(),
        1,
        "the CA root is created once: {creates:#?}"
    );

    // A clean stop releases the Lease: the other replica leads at once.
    let stop = Instant::now();
    leader.shutdown().await;
    eventually(LIMIT, "hand-over after a stop", || async {
        follower.is_leader().then_some(())
    })
    .await
    .unwrap();
    let after_stop = stop.elapsed();
    let second = if first == "a" { "b" } else { "a" };
    assert_eq!(lease_holder(&lease(&kube).await), second);

    // A killed leader keeps the Lease until it expires (2 s in tests).
    let c = control_plane(&kube, dir.path(), "c").await;
    wait_synced(&c, LIMIT).await.unwrap();
    let kill = Instant::now();
    follower.kill().await;
    eventually(LIMIT, "hand-over after a kill", || async {
        c.is_leader().then_some(())
    })
    .await
    .unwrap();
    let after_kill = kill.elapsed();
    assert_eq!(lease_holder(&lease(&kube).await), "c");
    println!("Lease hand-over: {after_stop:?} after a stop, {after_kill:?} after a kill");
    assert!(after_stop < Duration::from_secs(2), "{after_stop:?}");
    assert!(after_kill >= Duration::from_secs(1), "{after_kill:?}");
    c.shutdown().await;
}

/// ztunnel as the DaemonSet runs it, on a real API server: TLS to 15012
/// verified with the root in ConfigMap istio-ca-root-cert and a token from
/// the TokenRequest API bound to its pod (audience istio-ca).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ztunnel_with_a_bound_token_gets_its_config_over_tls_and_forged_tokens_are_refused() {
    let kube = KubeApiServer::start(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    kube.apply(&json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "shop", "labels": {"istio.io/dataplane-mode": "ambient"}}}))
        .await
        .unwrap();
    kube.apply(&json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "web", "namespace": "shop"}}))
        .await
        .unwrap();
    kube.running_pod(
        "shop",
        "web-0",
        "web",
        "node-1",
        "10.244.0.5",
        json!({"app": "web"}),
    )
    .await
    .unwrap();
    let uid = kube
        .running_pod(
            "ambit-system",
            "ztunnel-a",
            "ztunnel",
            "node-1",
            "10.244.0.2",
            json!({"app": "ztunnel"}),
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&kube, dir.path(), "a").await;
    wait_synced(&cp, LIMIT).await.unwrap();
    let root_pem = eventually(LIMIT, "root ConfigMap", || async {
        let client = kube.client().await.ok()?;
        let api: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
            kube::Api::namespaced(client, "ambit-system");
        api.get_opt("istio-ca-root-cert")
            .await
            .ok()??
            .data?
            .get("root-cert.pem")
            .cloned()
    })
    .await
    .unwrap();
    let root = dir.path().join("root-cert.pem");
    std::fs::write(&root, root_pem).unwrap();

    // Refused: a token for another audience, and a forged one.
    let wrong_audience = kube
        .token("ambit-system", "ztunnel", None, Some(("ztunnel-a", &uid)))
        .await
        .unwrap();
    let good = kube
        .token(
            "ambit-system",
            "ztunnel",
            Some("istio-ca"),
            Some(("ztunnel-a", &uid)),
        )
        .await
        .unwrap();
    // The good token's claims, re-signed by nobody: one signature byte
    // changed (not the last character, whose low bits are padding).
    let mut forged: Vec<char> = good.chars().collect();
    let at = forged.len() - 10;
    forged[at] = if forged[at] == 'A' { 'B' } else { 'A' };
    let forged: String = forged.into_iter().collect();
    for (what, token) in [("wrong audience", &wrong_audience), ("forged", &forged)] {
        let err =
            match Observer::connect_with_token(cp.xds_addr(), ambit_proto::ADDRESS_TYPE_URL, token)
                .await
            {
                Ok(mut obs) => obs.next(LIMIT).await.unwrap_err().to_string(),
                Err(e) => e.to_string(),
            };
        assert!(
            err.contains("valid authentication credentials") && err.contains("refused"),
            "{what}: {err}"
        );
    }

    // The CA signs, for ztunnel's bound token, the identities of its own
    // node's pods only.
    kube.apply(&json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "db", "namespace": "shop"}}))
        .await
        .unwrap();
    kube.running_pod(
        "shop",
        "db-0",
        "db",
        "node-2",
        "10.244.1.5",
        json!({"app": "db"}),
    )
    .await
    .unwrap();
    let own = "spiffe://cluster.local/ns/shop/sa/web";
    let other_node = "spiffe://cluster.local/ns/shop/sa/db";
    let chain = eventually(LIMIT, "a certificate for a pod of node-1", || async {
        certify(cp.xds_addr(), &good, own).await.ok()
    })
    .await
    .unwrap();
    assert!(!chain.is_empty());
    let refused = certify(cp.xds_addr(), &good, other_node).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused}");
    let refused = certify(cp.xds_addr(), &wrong_audience, own)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused}");

    let token = dir.path().join("istio-token");
    std::fs::write(&token, &good).unwrap();
    let mut z = ambit_ztunnel::Config::new("node-1", format!("https://{}", cp.xds_tls_addr()))
        .with_ephemeral_ports();
    z.token_file = Some(token);
    z.root_cert = Some(root);
    z.zds_path = dir.path().join("zds.sock");
    let zt = ambit_ztunnel::start(z).await.unwrap();
    tokio::time::timeout(LIMIT, zt.wait_ready())
        .await
        .expect("ztunnel ready over TLS with a bound token");
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
