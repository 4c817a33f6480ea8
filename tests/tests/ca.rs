//! The CA over real gRPC: a tonic server on loopback serving
//! `IstioCertificateService` with the local node-tokens authenticator and
//! the snapshot-backed pod locator, called with the generated client.
//! Covers node authorization, every refusal (each with a clear reason and
//! the server still serving afterwards), TTL capping, concurrent requests,
//! and a restart that keeps the root.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ambit_control::ca::{
    CaMetrics, CaService, CaServiceOptions, CaStore, NodeTokenFile, SignerOptions,
    SnapshotPodLocator, generate_csr, impersonation_metadata, leaf_info, verify_identity_chain,
};
use ambit_control::model::{ResourceFamily, Snapshot, XdsResource};
use ambit_proto::auth::IstioCertificateRequest;
use ambit_proto::auth::istio_certificate_service_client::IstioCertificateServiceClient;
use ambit_proto::workload::{Address, Workload, address};
use tokio::sync::{oneshot, watch};
use tonic::Code;
use tonic::transport::Channel;

const LIMIT: Duration = Duration::from_secs(10);
const MAX_TTL: Duration = Duration::from_secs(2 * 3600);
const BACKEND: &str = "spiffe://cluster.local/ns/shop/sa/backend";
const FRONTEND: &str = "spiffe://cluster.local/ns/shop/sa/frontend";

fn workload(uid: &str, ns: &str, sa: &str, node: &str) -> XdsResource {
    let w = Workload {
        uid: uid.into(),
        name: uid.into(),
        namespace: ns.into(),
        service_account: sa.into(),
        node: node.into(),
        ..Default::default()
    };
    let addr = Address {
        r#type: Some(address::Type::Workload(w)),
    };
    XdsResource::new(ambit_proto::ADDRESS_TYPE_URL, uid.into(), vec![], &addr)
}

/// A running CA server; stops when dropped.
struct Ca {
    addr: SocketAddr,
    store: Arc<CaStore>,
    _stop: oneshot::Sender<()>,
    _snapshots: watch::Sender<Arc<Snapshot>>,
}

async fn start(data_dir: &Path) -> Ca {
    let tokens = data_dir.join("node-tokens");
    std::fs::write(
        &tokens,
        "# written by the local mesh tooling\ntok-node-1 node-1\ntok-node-2 node-2\n",
    )
    .unwrap();
    let snap = Snapshot::following(
        &Snapshot::default(),
        vec![ResourceFamily::mesh(
            ambit_proto::ADDRESS_TYPE_URL,
            vec![
                workload("shop/backend-0", "shop", "backend", "node-1"),
                workload("shop/frontend-0", "shop", "frontend", "node-2"),
            ],
        )],
    );
    let (snap_tx, snap_rx) = watch::channel(Arc::new(snap));
    let store = Arc::new(CaStore::load_or_create(&data_dir.join("ca"), None).unwrap());
    let svc = CaService::new(
        store.clone(),
        CaServiceOptions {
            signer: SignerOptions {
                max_ttl: MAX_TTL,
                ..Default::default()
            },
            ..Default::default()
        },
        Arc::new(NodeTokenFile::new(&tokens)),
        Arc::new(SnapshotPodLocator::new(snap_rx)),
        CaMetrics::default(), // unregistered: nothing scrapes it here
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc.into_server())
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                async {
                    let _ = stop_rx.await;
                },
            ),
    );
    Ca {
        addr,
        store,
        _stop: stop_tx,
        _snapshots: snap_tx,
    }
}

async fn client(addr: SocketAddr) -> IstioCertificateServiceClient<Channel> {
    tokio::time::timeout(
        LIMIT,
        IstioCertificateServiceClient::connect(format!("http://{addr}")),
    )
    .await
    .unwrap()
    .unwrap()
}

/// Sends a CSR; `token` None sends no authorization header.
async fn request(
    c: &mut IstioCertificateServiceClient<Channel>,
    token: Option<&str>,
    csr: String,
    ttl: i64,
    impersonate: Option<&str>,
) -> Result<Vec<String>, tonic::Status> {
    let mut req = tonic::Request::new(IstioCertificateRequest {
        csr,
        validity_duration: ttl,
        metadata: impersonate.map(impersonation_metadata),
    });
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    req.set_timeout(LIMIT);
    tokio::time::timeout(LIMIT, c.create_certificate(req))
        .await
        .unwrap()
        .map(|r| r.into_inner().cert_chain)
}

fn csr(uris: &[&str]) -> String {
    generate_csr(uris, &[]).unwrap().csr_pem
}

#[tokio::test]
async fn node_gets_identities_of_its_own_pods_only() {
    let tmp = tempfile::tempdir().unwrap();
    let ca = start(tmp.path()).await;
    let mut c = client(ca.addr).await;

    let chain = request(
        &mut c,
        Some("tok-node-1"),
        csr(&[BACKEND]),
        3600,
        Some(BACKEND),
    )
    .await
    .unwrap();
    assert_eq!(chain.len(), 2, "leaf then root");
    assert_eq!(chain.last().unwrap(), &ca.store.trust_bundle_pem()[0]);
    let id = verify_identity_chain(&chain, ca.store.trust_bundle_pem()).unwrap();
    assert_eq!(id.to_string(), BACKEND);

    // node-1 asking for the identity of a pod scheduled on node-2.
    let e = request(
        &mut c,
        Some("tok-node-1"),
        csr(&[FRONTEND]),
        3600,
        Some(FRONTEND),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(
        e.message().contains("node node-1") && e.message().contains("node-2"),
        "{e:?}"
    );
    // ... while node-2 gets it.
    request(
        &mut c,
        Some("tok-node-2"),
        csr(&[FRONTEND]),
        3600,
        Some(FRONTEND),
    )
    .await
    .unwrap();
    // An identity with no pod anywhere.
    let ghost = "spiffe://cluster.local/ns/shop/sa/ghost";
    let e = request(&mut c, Some("tok-node-1"), csr(&[ghost]), 3600, Some(ghost))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("none known"), "{e:?}");
}

#[tokio::test]
async fn every_bad_request_is_refused_with_a_reason_and_the_server_keeps_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let ca = start(tmp.path()).await;
    let mut c = client(ca.addr).await;
    let good = || csr(&[BACKEND]);
    let cases: Vec<(Option<&str>, String, i64, Code, &str)> = vec![
        (None, good(), 3600, Code::Unauthenticated, "no credentials: send `authorization: Bearer <token>`"),
        (Some("forged-token-of-node-1"), good(), 3600, Code::Unauthenticated, "was refused"),
        (Some("tok-node-3"), good(), 3600, Code::Unauthenticated, "node tokens file"),
        (Some("tok-node-1"), csr(&[BACKEND, FRONTEND]), 3600, Code::InvalidArgument, "exactly one URI SAN with the SPIFFE identity, it has 2"),
        (
            Some("tok-node-1"),
            csr(&["spiffe://other.domain/ns/shop/sa/backend"]),
            3600,
            Code::InvalidArgument,
            "only for trust domain `cluster.local`",
        ),
        (Some("tok-node-1"), csr(&["https://shop.example/backend"]), 3600, Code::InvalidArgument, "not a SPIFFE identity"),
        (Some("tok-node-1"), "garbage \u{0}\u{1} bytes".into(), 3600, Code::InvalidArgument, "not a PEM"),
        (
            Some("tok-node-1"),
            "-----BEGIN CERTIFICATE REQUEST-----\nZ2FyYmFnZQ==\n-----END CERTIFICATE REQUEST-----\n".into(),
            3600,
            Code::InvalidArgument,
            "could not be parsed",
        ),
        (Some("tok-node-1"), good(), -1, Code::InvalidArgument, "negative"),
    ];
    for (token, csr_pem, ttl, code, reason) in cases {
        let e = request(&mut c, token, csr_pem, ttl, None)
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{e:?}");
        assert!(
            e.message().contains(reason),
            "{:?} lacks {reason:?}",
            e.message()
        );
        // The server is unaffected: a good request still succeeds.
        request(&mut c, Some("tok-node-1"), good(), 3600, Some(BACKEND))
            .await
            .unwrap();
    }
    // A forged header scheme.
    let mut req = tonic::Request::new(IstioCertificateRequest {
        csr: good(),
        validity_duration: 60,
        metadata: None,
    });
    req.metadata_mut()
        .insert("authorization", "Basic dG9rLW5vZGUtMQ==".parse().unwrap());
    let e = c.create_certificate(req).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    // ImpersonatedIdentity naming another identity than the CSR.
    let e = request(&mut c, Some("tok-node-1"), good(), 3600, Some(FRONTEND))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("ImpersonatedIdentity"), "{e:?}");
}

#[tokio::test]
async fn ttl_above_the_cap_is_capped_and_zero_means_default() {
    let tmp = tempfile::tempdir().unwrap();
    let ca = start(tmp.path()).await;
    let mut c = client(ca.addr).await;
    let lifetime = |chain: &[String]| {
        let info = leaf_info(&chain[0]).unwrap();
        info.not_after.duration_since(SystemTime::now()).unwrap()
    };
    let chain = request(
        &mut c,
        Some("tok-node-1"),
        csr(&[BACKEND]),
        90 * 24 * 3600,
        None,
    )
    .await
    .unwrap();
    let got = lifetime(&chain);
    assert!(
        got <= MAX_TTL && got > MAX_TTL - Duration::from_secs(60),
        "capped lifetime {got:?}"
    );
    let chain = request(&mut c, Some("tok-node-1"), csr(&[BACKEND]), 600, None)
        .await
        .unwrap();
    let got = lifetime(&chain);
    assert!(
        got <= Duration::from_secs(600) && got > Duration::from_secs(540),
        "{got:?}"
    );
    let chain = request(&mut c, Some("tok-node-1"), csr(&[BACKEND]), 0, None)
        .await
        .unwrap();
    // The default (24 h) is above this server's cap (2 h), so it is capped too.
    assert!(lifetime(&chain) > MAX_TTL - Duration::from_secs(60));
    let info = leaf_info(&chain[0]).unwrap();
    let backdate = SystemTime::now().duration_since(info.not_before).unwrap();
    assert!(
        backdate >= Duration::from_secs(280) && backdate <= Duration::from_secs(320),
        "{backdate:?}"
    );
}

#[tokio::test]
async fn concurrent_requests_are_all_served() {
    let tmp = tempfile::tempdir().unwrap();
    let ca = start(tmp.path()).await;
    let c = client(ca.addr).await;
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..64 {
        let mut c = c.clone();
        tasks.spawn(async move {
            let (token, id) = if i % 2 == 0 {
                ("tok-node-1", BACKEND)
            } else {
                ("tok-node-2", FRONTEND)
            };
            request(&mut c, Some(token), csr(&[id]), 3600, Some(id))
                .await
                .map(|chain| (id, chain))
        });
    }
    let mut serials = std::collections::HashSet::new();
    while let Some(r) = tokio::time::timeout(LIMIT, tasks.join_next())
        .await
        .unwrap()
    {
        let (id, chain) = r.unwrap().unwrap();
        let got = verify_identity_chain(&chain, ca.store.trust_bundle_pem()).unwrap();
        assert_eq!(got.to_string(), id);
        assert!(serials.insert(leaf_info(&chain[0]).unwrap().serial));
    }
    assert_eq!(serials.len(), 64);
}

#[tokio::test]
async fn restart_keeps_the_root_and_old_certificates_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let (old_chain, old_root) = {
        let ca = start(tmp.path()).await;
        let mut c = client(ca.addr).await;
        let chain = request(
            &mut c,
            Some("tok-node-1"),
            csr(&[BACKEND]),
            3600,
            Some(BACKEND),
        )
        .await
        .unwrap();
        (chain, ca.store.trust_bundle_pem()[0].clone())
    };
    let ca = start(tmp.path()).await;
    assert_eq!(ca.store.trust_bundle_pem(), std::slice::from_ref(&old_root));
    let id = verify_identity_chain(&old_chain, ca.store.trust_bundle_pem()).unwrap();
    assert_eq!(id.to_string(), BACKEND);
    let mut c = client(ca.addr).await;
    let chain = request(
        &mut c,
        Some("tok-node-2"),
        csr(&[FRONTEND]),
        3600,
        Some(FRONTEND),
    )
    .await
    .unwrap();
    assert_eq!(chain.last().unwrap(), &old_root);
}
