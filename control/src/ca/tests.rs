//! Unit tests of the CA: store persistence and plugged-in chains, CSR
//! validation, issued certificate contents, real rustls mTLS between issued
//! identities, token file authentication, pod location and authorization.

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ambit_proto::auth::IstioCertificateRequest;
use ambit_proto::auth::istio_certificate_service_server::IstioCertificateService;
use ambit_proto::workload::{Address, Workload, address};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use tokio::sync::watch;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::store::{ROOT_CERT_FILE, ROOT_KEY_FILE, TRUST_BUNDLE_FILE};
use super::verify::spiffe_id_of;
use super::*;
use crate::model::{Snapshot, XdsResource};

pub(super) const LIMIT: Duration = Duration::from_secs(10);
pub(super) const TD: &str = "cluster.local";

pub(super) fn signer(store: &Arc<CaStore>) -> Signer {
    Signer::new(store.clone(), SignerOptions::default())
}

pub(super) fn new_store(dir: &Path) -> Arc<CaStore> {
    Arc::new(CaStore::load_or_create(dir, None).unwrap())
}

/// Issues `ns/sa` through the signer; returns (chain, key PEM).
pub(super) fn issue(s: &Signer, ns: &str, sa: &str, ttl: i64) -> (Vec<String>, String) {
    let id = SpiffeId::new(TD, ns, sa).to_string();
    let csr = generate_csr(&[&id], &[]).unwrap();
    let req = s.parse_csr(&csr.csr_pem).unwrap();
    let chain = s.issue(&req, s.granted_ttl(ttl).unwrap()).unwrap();
    (chain, csr.key_pem)
}

pub(super) fn der(pem: &str) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}

#[test]
fn spiffe_ids_parse_strictly() {
    let id = SpiffeId::parse("spiffe://cluster.local/ns/default/sa/bookinfo-reviews").unwrap();
    assert_eq!(
        id,
        SpiffeId::new("cluster.local", "default", "bookinfo-reviews")
    );
    assert_eq!(
        id.to_string(),
        "spiffe://cluster.local/ns/default/sa/bookinfo-reviews"
    );
    for bad in [
        "https://cluster.local/ns/a/sa/b",
        "spiffe://cluster.local/ns/a/sa/b/extra",
        "spiffe://cluster.local/ns//sa/b",
        "spiffe://cluster.local/namespace/a/sa/b",
        "spiffe://cluster.local/ns/a/sa/b?x=1",
        "spiffe://cluster.local/ns/a",
    ] {
        assert!(SpiffeId::parse(bad).is_none(), "{bad} parsed");
    }
}

#[test]
fn generated_root_is_persisted_privately_and_reused_after_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let store = new_store(&dir);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join(ROOT_KEY_FILE)), 0o600);
    // Nothing but the two files (no temporary left behind).
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, [ROOT_CERT_FILE, ROOT_KEY_FILE]);

    let root = store.trust_bundle_pem()[0].clone();
    let root_der = der(&root);
    let (_, cert) = X509Certificate::from_der(&root_der).unwrap();
    assert!(cert.is_ca());
    assert_eq!(cert.subject().to_string(), "O=ambit, CN=ambit root CA");
    let ku = cert.key_usage().unwrap().unwrap().value;
    assert!(ku.key_cert_sign() && ku.crl_sign());
    let life = cert.validity().not_after.timestamp() - cert.validity().not_before.timestamp();
    assert!(life > 9 * 365 * 24 * 3600, "root lifetime {life}s");

    let (old_chain, _) = issue(&signer(&store), "default", "a", 3600);
    drop(store);

    let again = new_store(&dir);
    assert_eq!(again.trust_bundle_pem(), std::slice::from_ref(&root));
    assert_eq!(again.chain_pem(), [root]);
    // A certificate issued before the restart verifies against the bundle
    // after it, and a new one chains to the same root.
    let id = verify_identity_chain(&old_chain, again.trust_bundle_pem()).unwrap();
    assert_eq!(id, SpiffeId::new(TD, "default", "a"));
    let (new_chain, _) = issue(&signer(&again), "default", "b", 3600);
    assert_eq!(new_chain.last(), old_chain.last());
}

#[test]
fn incomplete_material_is_refused_not_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    new_store(tmp.path());
    let key = std::fs::read(tmp.path().join(ROOT_KEY_FILE)).unwrap();
    std::fs::remove_file(tmp.path().join(ROOT_CERT_FILE)).unwrap();
    let err = CaStore::load_or_create(tmp.path(), None).unwrap_err();
    assert!(matches!(err, CaError::Incomplete { .. }), "{err}");
    assert!(
        err.to_string().contains("restore the missing file"),
        "{err}"
    );
    assert_eq!(std::fs::read(tmp.path().join(ROOT_KEY_FILE)).unwrap(), key);
}

#[test]
fn trust_bundle_file_adds_roots_for_rotation() {
    let tmp = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let next_root = new_store(other.path()).trust_bundle_pem()[0].clone();
    let current = new_store(tmp.path()).trust_bundle_pem()[0].clone();
    std::fs::write(
        tmp.path().join(TRUST_BUNDLE_FILE),
        format!("{next_root}{current}"),
    )
    .unwrap();
    let store = new_store(tmp.path());
    assert_eq!(store.trust_bundle_pem(), [current, next_root]);
    assert_eq!(store.trust_anchors_der().len(), 2);
    // A certificate from the next root verifies against the combined bundle.
    let (chain, _) = issue(&signer(&new_store(other.path())), "ns", "sa", 60);
    verify_identity_chain(&chain, store.trust_bundle_pem()).unwrap();
}

/// An organisation root and an intermediate under it, as PEM.
pub(super) struct Org {
    pub(super) root_pem: String,
    pub(super) inter_pem: String,
    pub(super) inter_key: KeyPair,
}

pub(super) fn org_ca() -> Org {
    let ca_params = |cn: &str| {
        let mut p = CertificateParams::default();
        p.distinguished_name
            .push(DnType::OrganizationName, "example org");
        p.distinguished_name.push(DnType::CommonName, cn);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        p
    };
    let root_key = KeyPair::generate().unwrap();
    let root_params = ca_params("org root");
    let root = root_params.self_signed(&root_key).unwrap();
    let root_issuer = rcgen::Issuer::new(root_params, root_key);
    let inter_key = KeyPair::generate().unwrap();
    let inter = ca_params("mesh intermediate")
        .signed_by(&inter_key, &root_issuer)
        .unwrap();
    Org {
        root_pem: root.pem(),
        inter_pem: inter.pem(),
        inter_key,
    }
}

pub(super) fn write_plugged(dir: &Path, org: &Org, chain: &str) {
    std::fs::write(dir.join("ca-cert.pem"), &org.inter_pem).unwrap();
    std::fs::write(dir.join("ca-key.pem"), org.inter_key.serialize_pem()).unwrap();
    std::fs::write(dir.join("root-cert.pem"), &org.root_pem).unwrap();
    std::fs::write(dir.join("cert-chain.pem"), chain).unwrap();
}

#[test]
fn plugged_intermediate_chain_is_leaf_intermediate_root() {
    let org = org_ca();
    for chain_file in [
        format!("{}{}", org.inter_pem, org.root_pem),
        org.inter_pem.clone(),
        String::new(),
    ] {
        let data = tempfile::tempdir().unwrap();
        let plugged = tempfile::tempdir().unwrap();
        write_plugged(plugged.path(), &org, &chain_file);
        if chain_file.is_empty() {
            std::fs::remove_file(plugged.path().join("cert-chain.pem")).unwrap();
        }
        let store = Arc::new(CaStore::load_or_create(data.path(), Some(plugged.path())).unwrap());
        assert_eq!(
            store.trust_bundle_pem(),
            std::slice::from_ref(&org.root_pem)
        );
        let (chain, _) = issue(&signer(&store), "prod", "api", 600);
        assert_eq!(chain.len(), 3, "{chain_file:?}");
        assert_eq!(chain[1], org.inter_pem);
        assert_eq!(chain[2], org.root_pem);
        let leaf_der = der(&chain[0]);
        let (_, leaf) = X509Certificate::from_der(&leaf_der).unwrap();
        assert!(
            leaf.issuer().to_string().contains("CN=mesh intermediate"),
            "{}",
            leaf.issuer()
        );
        let id = verify_identity_chain(&chain, std::slice::from_ref(&org.root_pem)).unwrap();
        assert_eq!(id, SpiffeId::new(TD, "prod", "api"));
        // No generated root next to a plugged-in CA.
        assert!(!data.path().join(ROOT_KEY_FILE).exists());
    }
}

#[test]
fn plugged_ca_errors_name_the_file() {
    let org = org_ca();
    let plugged = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    write_plugged(plugged.path(), &org, &org.inter_pem);
    // Wrong key.
    std::fs::write(
        plugged.path().join("ca-key.pem"),
        KeyPair::generate().unwrap().serialize_pem(),
    )
    .unwrap();
    let err = CaStore::load_or_create(data.path(), Some(plugged.path())).unwrap_err();
    assert!(matches!(err, CaError::KeyMismatch { .. }), "{err}");
    // Chain not signed by the root given.
    write_plugged(plugged.path(), &org, &org.inter_pem);
    let other = org_ca();
    std::fs::write(plugged.path().join("root-cert.pem"), &other.root_pem).unwrap();
    let err = CaStore::load_or_create(data.path(), Some(plugged.path())).unwrap_err();
    assert!(matches!(err, CaError::ChainBroken { .. }), "{err}");
    // Missing file.
    std::fs::remove_file(plugged.path().join("ca-cert.pem")).unwrap();
    let err = CaStore::load_or_create(data.path(), Some(plugged.path())).unwrap_err();
    assert!(err.to_string().contains("ca-cert.pem"), "{err}");
}

#[test]
fn issued_certificate_has_spiffe_san_usages_and_backdated_validity() {
    let tmp = tempfile::tempdir().unwrap();
    let store = new_store(tmp.path());
    let s = signer(&store);
    let (chain, _) = issue(&s, "default", "web", 3600);
    assert_eq!(chain.len(), 2);
    assert_eq!(chain[1], store.trust_bundle_pem()[0]);
    let leaf_der = der(&chain[0]);
    let (_, leaf) = X509Certificate::from_der(&leaf_der).unwrap();
    assert_eq!(
        spiffe_id_of(&der(&chain[0])).unwrap().to_string(),
        "spiffe://cluster.local/ns/default/sa/web"
    );
    assert!(!leaf.is_ca());
    let ku = leaf.key_usage().unwrap().unwrap().value;
    assert!(ku.digital_signature() && ku.key_encipherment() && !ku.key_cert_sign());
    let eku = leaf.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.server_auth && eku.client_auth);
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let nb = leaf.validity().not_before.timestamp();
    let na = leaf.validity().not_after.timestamp();
    assert!(
        (now - 310..=now - 290).contains(&nb),
        "not_before {nb} vs now {now}"
    );
    assert!(
        (now + 3590..=now + 3610).contains(&na),
        "not_after {na} vs now {now}"
    );
    // Serials are random and distinct.
    let (chain2, _) = issue(&s, "default", "web", 3600);
    let leaf2_der = der(&chain2[0]);
    let (_, leaf2) = X509Certificate::from_der(&leaf2_der).unwrap();
    assert_ne!(leaf.raw_serial(), leaf2.raw_serial());
}

#[test]
fn ttl_is_defaulted_and_capped() {
    let tmp = tempfile::tempdir().unwrap();
    let store = new_store(tmp.path());
    let s = Signer::new(
        store,
        SignerOptions {
            trust_domain: TD.into(),
            default_ttl: Duration::from_secs(600),
            max_ttl: Duration::from_secs(3600),
        },
    );
    assert_eq!(s.granted_ttl(0).unwrap(), Duration::from_secs(600));
    assert_eq!(s.granted_ttl(60).unwrap(), Duration::from_secs(60));
    assert_eq!(
        s.granted_ttl(90 * 24 * 3600).unwrap(),
        Duration::from_secs(3600)
    );
    let err = s.granted_ttl(-5).unwrap_err();
    assert!(err.to_string().contains("negative"), "{err}");
}

#[test]
fn bad_csrs_are_refused_with_reasons() {
    let tmp = tempfile::tempdir().unwrap();
    let s = signer(&new_store(tmp.path()));
    let id = "spiffe://cluster.local/ns/a/sa/b";
    let csr = |uris: &[&str], dns: &[&str]| generate_csr(uris, dns).unwrap().csr_pem;
    let cases: Vec<(String, &str)> = vec![
        (csr(&[id, "spiffe://cluster.local/ns/a/sa/c"], &[]), "exactly one URI SAN"),
        (csr(&[], &[]), "exactly one URI SAN"),
        (csr(&["spiffe://evil.example/ns/a/sa/b"], &[]), "trust domain `evil.example`"),
        (csr(&["https://example.com/x"], &[]), "not a SPIFFE identity"),
        (csr(&[id], &["a.example.com"]), "non-URI SAN"),
        ("this is not a csr".into(), "not a PEM"),
        (
            "-----BEGIN CERTIFICATE REQUEST-----\naGVsbG8gd29ybGQ=\n-----END CERTIFICATE REQUEST-----\n".into(),
            "could not be parsed",
        ),
    ];
    for (pem, want) in cases {
        let err = s.parse_csr(&pem).unwrap_err();
        assert!(err.to_string().contains(want), "{err} lacks {want:?}");
        assert!(err.is_invalid_argument());
    }
    // A CSR whose signature does not match: flip a byte of the signature.
    let good = csr(&[id], &[]);
    let mut bytes = rustls_pki_types::CertificateSigningRequestDer::from_pem_slice(good.as_bytes())
        .unwrap()
        .as_ref()
        .to_vec();
    let n = bytes.len();
    bytes[n - 3] ^= 0x55;
    let tampered = format!(
        "-----BEGIN CERTIFICATE REQUEST-----\n{}\n-----END CERTIFICATE REQUEST-----\n",
        base64(&bytes)
    );
    let err = s.parse_csr(&tampered).unwrap_err();
    assert!(
        matches!(err, SignError::BadSignature(_) | SignError::Malformed(_)),
        "{err}"
    );
}

fn base64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in data.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= c.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[tokio::test]
async fn node_token_file_authenticates_and_reloads() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("node-tokens");
    let auth = NodeTokenFile::new(&path);
    let err = auth.authenticate("t1").await.unwrap_err();
    assert!(matches!(err, AuthError::Rejected(_)), "{err}");
    std::fs::write(
        &path,
        "# local mesh\nt1 node-1\n\nt2   node-2 # second\nbroken line here\n",
    )
    .unwrap();
    assert_eq!(
        auth.authenticate("t1").await.unwrap(),
        Caller::Node {
            name: "node-1".into()
        }
    );
    assert_eq!(
        auth.authenticate("t2").await.unwrap(),
        Caller::Node {
            name: "node-2".into()
        }
    );
    assert!(auth.authenticate("t1x").await.is_err());
    assert!(auth.authenticate("t").await.is_err());
    // Rewritten (atomically, as the tooling does): new tokens take effect.
    let tmpfile = tmp.path().join("node-tokens.new");
    std::fs::write(&tmpfile, "t3 node-3\n").unwrap();
    std::fs::rename(&tmpfile, &path).unwrap();
    assert!(auth.authenticate("t1").await.is_err());
    assert_eq!(
        auth.authenticate("t3").await.unwrap(),
        Caller::Node {
            name: "node-3".into()
        }
    );
    let err = Unconfigured.authenticate("x").await.unwrap_err();
    assert!(
        err.to_string()
            .contains("no token authentication is configured")
    );
}

#[test]
fn bearer_header_parsing() {
    use super::auth::bearer_token;
    assert_eq!(bearer_token(Some("Bearer abc")).unwrap(), "abc");
    assert_eq!(bearer_token(Some("bearer  abc ")).unwrap(), "abc");
    assert!(matches!(bearer_token(None), Err(AuthError::MissingToken)));
    assert!(matches!(
        bearer_token(Some("Basic abc")),
        Err(AuthError::Malformed)
    ));
    assert!(matches!(
        bearer_token(Some("Bearer ")),
        Err(AuthError::Malformed)
    ));
}

fn workload_resource(uid: &str, ns: &str, sa: &str, node: &str) -> XdsResource {
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

fn snapshot(seq: u64, items: Vec<XdsResource>) -> Arc<Snapshot> {
    let prev = Snapshot {
        seq: seq - 1,
        ..Default::default()
    };
    Arc::new(Snapshot::following(
        &prev,
        vec![crate::model::ResourceFamily::mesh(
            ambit_proto::ADDRESS_TYPE_URL,
            items,
        )],
    ))
}

#[test]
fn snapshot_locator_maps_identities_to_nodes_and_follows_snapshots() {
    let (tx, rx) = watch::channel(snapshot(
        1,
        vec![
            workload_resource("p1", "shop", "backend", "node-1"),
            workload_resource("p2", "shop", "backend", "node-2"),
            workload_resource("p3", "shop", "", "node-3"),
            workload_resource("p4", "shop", "nowhere", ""),
        ],
    ));
    let loc = SnapshotPodLocator::new(rx);
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(
        loc.nodes_of_identity("shop", "backend"),
        set(&["node-1", "node-2"])
    );
    assert_eq!(loc.nodes_of_identity("shop", "default"), set(&["node-3"]));
    assert!(loc.nodes_of_identity("shop", "nowhere").is_empty());
    assert!(loc.nodes_of_identity("other", "backend").is_empty());
    tx.send(snapshot(
        2,
        vec![workload_resource("p9", "other", "backend", "node-9")],
    ))
    .unwrap();
    assert!(loc.nodes_of_identity("shop", "backend").is_empty());
    assert_eq!(loc.nodes_of_identity("other", "backend"), set(&["node-9"]));
}

/// Authenticates `wl:<ns>:<sa>[:<node>]` tokens as workloads and node tokens
/// through a real [`NodeTokenFile`].
struct TestAuth(NodeTokenFile);

impl TokenAuthenticator for TestAuth {
    fn authenticate<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Caller, AuthError>> {
        if let Some(rest) = token.strip_prefix("wl:") {
            let p: Vec<&str> = rest.split(':').collect();
            let caller = Caller::Workload {
                namespace: p[0].into(),
                service_account: p[1].into(),
                node: p.get(2).map(|s| s.to_string()),
            };
            return Box::pin(async move { Ok(caller) });
        }
        self.0.authenticate(token)
    }
}

pub(super) fn service(store: Arc<CaStore>, locator: StaticPodLocator, dir: &Path) -> CaService {
    service_with_metrics(store, locator, dir).0
}

fn service_with_metrics(
    store: Arc<CaStore>,
    locator: StaticPodLocator,
    dir: &Path,
) -> (CaService, prometheus_client::registry::Registry) {
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, "tok-1 node-1\ntok-2 node-2\n").unwrap();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = CaMetrics::register(&mut registry);
    let svc = CaService::new(
        store,
        CaServiceOptions::default(),
        Arc::new(TestAuth(NodeTokenFile::new(&tokens))),
        Arc::new(locator),
        metrics,
    );
    (svc, registry)
}

async fn call(
    svc: &CaService,
    token: &str,
    id: &str,
    impersonate: Option<&str>,
) -> Result<Vec<String>, tonic::Status> {
    let csr = generate_csr(&[id], &[]).unwrap();
    let mut req = tonic::Request::new(IstioCertificateRequest {
        csr: csr.csr_pem,
        validity_duration: 3600,
        metadata: impersonate.map(impersonation_metadata),
    });
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    svc.create_certificate(req)
        .await
        .map(|r| r.into_inner().cert_chain)
}

#[tokio::test]
async fn authorization_rules() {
    let tmp = tempfile::tempdir().unwrap();
    let store = new_store(tmp.path());
    let loc = StaticPodLocator::new([
        ("shop", "backend", "node-1"),
        ("shop", "frontend", "node-2"),
    ]);
    let (svc, registry) = service_with_metrics(store, loc, tmp.path());
    let backend = "spiffe://cluster.local/ns/shop/sa/backend";
    let frontend = "spiffe://cluster.local/ns/shop/sa/frontend";
    use tonic::Code;

    // A workload gets its own identity, not another one.
    assert!(call(&svc, "wl:shop:backend", backend, None).await.is_ok());
    let e = call(&svc, "wl:shop:backend", frontend, None)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(
        e.message().contains("may only get its own identity"),
        "{e:?}"
    );
    // A node token gets identities of pods on its node only.
    assert!(call(&svc, "tok-1", backend, Some(backend)).await.is_ok());
    let e = call(&svc, "tok-1", frontend, Some(frontend))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(
        e.message().contains("node node-1") && e.message().contains("node-2"),
        "{e:?}"
    );
    // The ztunnel service account with a known node acts as that node.
    assert!(
        call(
            &svc,
            "wl:ambit-system:ztunnel:node-2",
            frontend,
            Some(frontend)
        )
        .await
        .is_ok()
    );
    let e = call(&svc, "wl:ambit-system:ztunnel:node-2", backend, None)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = call(&svc, "wl:ambit-system:ztunnel", backend, None)
        .await
        .unwrap_err();
    assert!(e.message().contains("does not say which node"), "{e:?}");
    // ImpersonatedIdentity must match the CSR.
    let e = call(&svc, "tok-1", backend, Some(frontend))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("ImpersonatedIdentity"), "{e:?}");
    // Unknown token.
    let e = call(&svc, "tok-9", backend, None).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    // Counted by outcome and reason, under Istio's names.
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for want in [
        "citadel_server_csr_count_total 9",
        "citadel_server_success_cert_issuance_count_total 3",
        "citadel_server_authentication_failure_count_total 1",
        "citadel_server_csr_sign_err_count_total{reason=\"authorization\"} 5",
        "citadel_server_csr_sign_err_count_total{reason=\"authentication\"} 1",
    ] {
        assert!(text.contains(want), "{want} not in\n{text}");
    }
}
