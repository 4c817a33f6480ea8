#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use futures::future::BoxFuture;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use time::OffsetDateTime;
use tokio::sync::watch;
use tokio::time::{Instant, timeout};
use x509_parser::extensions::GeneralName;

use super::*;

const WAIT: Duration = Duration::from_secs(60);

fn id(sa: &str) -> Identity {
    Identity::new("cluster.local", "default", sa)
}

/// An in-test CA: a self-signed root and its key.
struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    root_pem: String,
}

impl TestCa {
    fn new(name: &str) -> Self {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{name} root"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let root = params.self_signed(&key).unwrap();
        Self {
            issuer: Issuer::new(params, key),
            root_pem: root.pem(),
        }
    }

    fn root_der(&self) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(self.root_pem.as_bytes()).unwrap()
    }

    /// Signs like the control plane's CA: checks one URI SAN, backdates
    /// not-before, returns leaf then root.
    fn sign(&self, csr_pem: &str, ttl: Duration, san_override: Option<&str>) -> Vec<String> {
        let mut csr = CertificateSigningRequestParams::from_pem(csr_pem).unwrap();
        assert_eq!(csr.params.subject_alt_names.len(), 1, "exactly one SAN");
        assert!(matches!(csr.params.subject_alt_names[0], SanType::URI(_)));
        if let Some(san) = san_override {
            csr.params.subject_alt_names = vec![SanType::URI(san.try_into().unwrap())];
        }
        let now = OffsetDateTime::now_utc();
        csr.params.not_before = now - Duration::from_secs(300);
        csr.params.not_after = now + ttl;
        csr.params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        csr.params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let leaf = csr.signed_by(&self.issuer).unwrap();
        vec![leaf.pem(), self.root_pem.clone()]
    }
}

/// A fake [`CaClient`] with counters and switches.
struct FakeCa {
    ca: ArcSwap<TestCa>,
    /// Overrides the requested TTL.
    ttl: Option<Duration>,
    /// Time each signing takes (paused-clock friendly).
    delay: Duration,
    fail: AtomicBool,
    /// Sign for another identity than the CSR names.
    wrong_san: AtomicBool,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// Every call: (identity, when, succeeded). Also published as a count.
    calls: Mutex<Vec<(Identity, Instant, bool)>>,
    calls_tx: watch::Sender<usize>,
    /// Calls started so far.
    started_tx: watch::Sender<usize>,
}

impl FakeCa {
    fn new(ttl: Option<Duration>, delay: Duration) -> Arc<Self> {
        Arc::new(Self {
            ca: ArcSwap::from_pointee(TestCa::new("test")),
            ttl,
            delay,
            fail: AtomicBool::new(false),
            wrong_san: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            calls: Mutex::new(Vec::new()),
            calls_tx: watch::channel(0).0,
            started_tx: watch::channel(0).0,
        })
    }

    fn calls(&self) -> usize {
        self.calls.lock().unwrap().len()
    }

    fn calls_for(&self, who: &Identity) -> usize {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(i, _, _)| i == who)
            .count()
    }

    fn call_log(&self) -> Vec<(Identity, Instant, bool)> {
        self.calls.lock().unwrap().clone()
    }

    /// Waits until `pred(calls)` holds (bounded).
    async fn wait_calls(&self, pred: impl Fn(&[(Identity, Instant, bool)]) -> bool) {
        let mut rx = self.calls_tx.subscribe();
        timeout(WAIT, async {
            loop {
                if pred(&self.call_log()) {
                    return;
                }
                rx.changed().await.unwrap();
            }
        })
        .await
        .expect("condition on CA calls not reached in time");
    }
}

impl CaClient for FakeCa {
    fn sign<'a>(
        &'a self,
        identity: &'a Identity,
        csr_pem: String,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, CaClientError>> {
        Box::pin(async move {
            self.started_tx.send_modify(|n| *n += 1);
            let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.max_in_flight.fetch_max(now, Ordering::SeqCst);
            if !self.delay.is_zero() {
                tokio::time::sleep(self.delay).await;
            }
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            let ok = !self.fail.load(Ordering::SeqCst);
            let result = if ok {
                let san = self
                    .wrong_san
                    .load(Ordering::SeqCst)
                    .then_some("spiffe://cluster.local/ns/default/sa/someone-else");
                Ok(self.ca.load().sign(&csr_pem, self.ttl.unwrap_or(ttl), san))
            } else {
                Err(CaClientError::Status {
                    code: "Unavailable".into(),
                    message: "CA is down".into(),
                })
            };
            let n = {
                let mut calls = self.calls.lock().unwrap();
                calls.push((identity.clone(), Instant::now(), ok));
                calls.len()
            };
            self.calls_tx.send_replace(n);
            result
        })
    }
}

fn manager(fake: &Arc<FakeCa>) -> CertificateManager {
    CertificateManager::new(IdentityConfig::default(), fake.clone()).unwrap()
}

#[test]
fn identity_display_and_parse() {
    let i = id("reviews");
    let s = i.to_string();
    assert_eq!(s, "spiffe://cluster.local/ns/default/sa/reviews");
    assert_eq!(s.parse::<Identity>().unwrap(), i);
    for bad in [
        "http://cluster.local/ns/a/sa/b",
        "spiffe://cluster.local/ns/a/sa",
        "spiffe://cluster.local/ns/a/sa/b/c",
        "spiffe://cluster.local/namespace/a/sa/b",
        "spiffe:///ns/a/sa/b",
        "spiffe://td/ns/a b/sa/b",
    ] {
        let err = bad.parse::<Identity>().unwrap_err();
        assert!(
            err.to_string().contains("expected spiffe://"),
            "{bad}: {err}"
        );
    }
    assert_eq!(
        serde_json::to_string(&i).unwrap(),
        "\"spiffe://cluster.local/ns/default/sa/reviews\""
    );
}

#[tokio::test]
async fn fetched_certificate_names_identity_matches_key_and_chains_to_root() {
    let fake = FakeCa::new(None, Duration::ZERO);
    let mgr = manager(&fake);
    let who = id("reviews");
    let cert = timeout(WAIT, mgr.fetch(&who)).await.unwrap().unwrap();

    assert_eq!(cert.identity, who);
    assert_eq!(cert.chain_der.len(), 2, "leaf then root");
    assert_eq!(cert.chain_pem.len(), 2);
    let (_, leaf) = x509_parser::parse_x509_certificate(&cert.chain_der[0]).unwrap();
    let (_, root) = x509_parser::parse_x509_certificate(&cert.chain_der[1]).unwrap();
    let sans: Vec<_> = leaf
        .subject_alternative_name()
        .unwrap()
        .unwrap()
        .value
        .general_names
        .clone();
    assert_eq!(sans.len(), 1);
    assert!(matches!(sans[0], GeneralName::URI(u) if u == who.to_string()));
    leaf.verify_signature(Some(root.public_key())).unwrap();
    root.verify_signature(None).unwrap();
    assert_eq!(cert.chain_der[1], fake.ca.load().root_der());
    assert_eq!(cert.root(), Some(&fake.ca.load().root_der()));
    assert_eq!(cert.presented_chain().len(), 1);

    // The private key is the leaf's key.
    let key = KeyPair::try_from(&cert.private_key()).unwrap();
    assert_eq!(
        leaf.public_key().subject_public_key.data.as_ref(),
        key.public_key_raw()
    );
    let ck = cert.certified_key().unwrap();
    ck.keys_match().unwrap();

    assert_eq!(cert.serial_hex(), hex(leaf.raw_serial()));
    assert!(cert.is_valid());
    assert!(cert.time_to_expiry() > Duration::from_secs(23 * 3600));
    // Debug never prints the key.
    assert!(!format!("{cert:?}").contains("key"));

    // Cached: a second fetch makes no CA call.
    let again = mgr.fetch(&who).await.unwrap();
    assert!(Arc::ptr_eq(&cert, &again));
    assert_eq!(fake.calls(), 1);
    assert_eq!(mgr.metrics().requests("ok"), 1);
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(start_paused = true)]
async fn concurrent_fetches_of_one_identity_make_one_ca_call() {
    let fake = FakeCa::new(None, Duration::from_millis(200));
    let mgr = manager(&fake);
    let who = id("ratings");
    let fetches = (0..50).map(|_| mgr.fetch(&who));
    let certs = timeout(WAIT, futures::future::join_all(fetches))
        .await
        .unwrap();
    let first = certs[0].as_ref().unwrap().clone();
    for c in &certs {
        assert!(Arc::ptr_eq(c.as_ref().unwrap(), &first));
    }
    assert_eq!(fake.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn ca_concurrency_is_bounded() {
    let fake = FakeCa::new(None, Duration::from_millis(100));
    let mgr = manager(&fake);
    let ids: Vec<Identity> = (0..30).map(|i| id(&format!("sa{i}"))).collect();
    mgr.prefetch(ids.clone());
    let fetches = ids.iter().map(|i| mgr.fetch(i));
    for r in timeout(WAIT, futures::future::join_all(fetches))
        .await
        .unwrap()
    {
        r.unwrap();
    }
    assert_eq!(fake.calls(), 30);
    assert_eq!(fake.max_in_flight.load(Ordering::SeqCst), 8);
    assert_eq!(mgr.identities(), {
        let mut s = ids.clone();
        s.sort();
        s
    });
}

#[tokio::test(start_paused = true)]
async fn short_lived_certificate_is_renewed_before_expiry() {
    let fake = FakeCa::new(Some(Duration::from_secs(10)), Duration::ZERO);
    let mgr = manager(&fake);
    let who = id("short");
    let t0 = Instant::now();
    let first = timeout(WAIT, mgr.fetch(&who)).await.unwrap().unwrap();
    assert!(first.time_to_expiry() <= Duration::from_secs(10));

    fake.wait_calls(|c| c.len() >= 2).await;
    let renewed_at = fake.call_log()[1].1 - t0;
    // Half the remaining lifetime, ±10 %.
    assert!(
        renewed_at >= Duration::from_millis(4000) && renewed_at <= Duration::from_millis(5600),
        "renewed after {renewed_at:?}"
    );
    let second = mgr.fetch(&who).await.unwrap();
    assert_ne!(first.serial, second.serial);
    assert!(
        first.is_valid(),
        "renewed while the old one was still valid"
    );

    // And again, from the new certificate's lifetime.
    fake.wait_calls(|c| c.len() >= 3).await;
    assert_eq!(mgr.metrics().requests("ok"), 3);
}

#[tokio::test(start_paused = true)]
async fn ca_outage_during_renewal_keeps_old_certificate_and_recovers() {
    let fake = FakeCa::new(Some(Duration::from_secs(10)), Duration::ZERO);
    let mgr = manager(&fake);
    let who = id("outage");
    let t0 = Instant::now();
    let first = timeout(WAIT, mgr.fetch(&who)).await.unwrap().unwrap();
    fake.fail.store(true, Ordering::SeqCst);

    // Renewal fails, then retries back off: ~0.5, 1, 2 s apart (±10 %).
    fake.wait_calls(|c| c.len() >= 4).await;
    let log = fake.call_log();
    assert!(log[1..].iter().all(|(_, _, ok)| !ok));
    let gaps: Vec<Duration> = log.windows(2).skip(1).map(|w| w[1].1 - w[0].1).collect();
    assert!(
        gaps[0] >= Duration::from_millis(450) && gaps[0] <= Duration::from_millis(550),
        "{gaps:?}"
    );
    assert!(
        gaps[1] >= Duration::from_millis(900) && gaps[1] <= Duration::from_millis(1100),
        "{gaps:?}"
    );
    assert!(Instant::now() - t0 < Duration::from_secs(9));

    // The old certificate keeps serving; the dump says why renewal lags.
    let served = mgr.fetch(&who).await.unwrap();
    assert!(Arc::ptr_eq(&served, &first));
    let dump = CertificateDump::list(&mgr.view());
    assert_eq!(dump[0].state, "Available");
    assert!(
        dump[0]
            .last_error
            .as_deref()
            .unwrap()
            .contains("CA is down")
    );
    assert!(mgr.metrics().requests("error") >= 3);

    // The outage outlasts the certificate: it is no longer served.
    fake.wait_calls(|c| {
        c.last()
            .is_some_and(|(_, at, _)| *at - t0 > Duration::from_secs(11))
    })
    .await;
    let err = mgr.fetch(&who).await.unwrap_err();
    assert!(matches!(err, IdentityError::Unavailable { .. }), "{err}");
    assert!(err.to_string().contains("CA is down"), "{err}");
    assert!(
        CertificateDump::list(&mgr.view())[0]
            .state
            .starts_with("Unavailable: ")
    );
    // The backoff is capped.
    let log = fake.call_log();
    let gaps: Vec<Duration> = log.windows(2).skip(1).map(|w| w[1].1 - w[0].1).collect();
    assert!(gaps.iter().all(|g| *g <= Duration::from_millis(33_000)));

    // The CA returns: the next retry succeeds.
    fake.fail.store(false, Ordering::SeqCst);
    let n = fake.calls();
    fake.wait_calls(|c| c.len() > n).await;
    let renewed = timeout(WAIT, mgr.fetch(&who)).await.unwrap().unwrap();
    assert_ne!(renewed.serial, first.serial);
    assert!(renewed.is_valid());
    assert_eq!(CertificateDump::list(&mgr.view())[0].state, "Available");
    assert_eq!(CertificateDump::list(&mgr.view())[0].last_error, None);
}

#[tokio::test(start_paused = true)]
async fn first_fetch_fails_fast_when_ca_is_down_then_recovers() {
    let fake = FakeCa::new(None, Duration::ZERO);
    fake.fail.store(true, Ordering::SeqCst);
    let mgr = manager(&fake);
    let who = id("down");
    let err = timeout(WAIT, mgr.fetch(&who)).await.unwrap().unwrap_err();
    assert!(err.to_string().contains("CA is down"), "{err}");
    assert!(
        CertificateDump::list(&mgr.view())[0]
            .state
            .starts_with("Unavailable: ")
    );
    fake.fail.store(false, Ordering::SeqCst);
    fake.wait_calls(|c| c.iter().any(|(_, _, ok)| *ok)).await;
    timeout(WAIT, mgr.fetch(&who)).await.unwrap().unwrap();
}

#[tokio::test]
async fn chain_for_another_identity_is_refused() {
    let fake = FakeCa::new(None, Duration::ZERO);
    fake.wrong_san.store(true, Ordering::SeqCst);
    let mgr = manager(&fake);
    let err = timeout(WAIT, mgr.fetch(&id("victim")))
        .await
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("someone-else"), "{err}");
    assert_eq!(mgr.metrics().requests("error"), 1);
}

#[tokio::test]
async fn trust_bundle_picks_up_a_new_root() {
    let extra = TestCa::new("extra");
    let dir = tempfile::tempdir().unwrap();
    let root_file = dir.path().join("root-cert.pem");
    std::fs::write(&root_file, &extra.root_pem).unwrap();

    let fake = FakeCa::new(None, Duration::ZERO);
    let cfg = IdentityConfig {
        root_cert: Some(root_file),
        ..IdentityConfig::default()
    };
    let mgr = CertificateManager::new(cfg, fake.clone()).unwrap();
    let mut bundle = mgr.trust_bundle();
    assert_eq!(bundle.borrow_and_update().roots, vec![extra.root_der()]);

    let root1 = fake.ca.load().root_der();
    mgr.fetch(&id("a")).await.unwrap();
    timeout(WAIT, bundle.changed()).await.unwrap().unwrap();
    assert_eq!(
        bundle.borrow_and_update().roots,
        vec![extra.root_der(), root1.clone()]
    );

    // The CA rotates its root: both roots are trusted while certificates of
    // both are in use.
    fake.ca.store(Arc::new(TestCa::new("rotated")));
    let root2 = fake.ca.load().root_der();
    mgr.fetch(&id("b")).await.unwrap();
    timeout(WAIT, bundle.changed()).await.unwrap().unwrap();
    let roots = bundle.borrow_and_update().roots.clone();
    assert_eq!(roots.len(), 3);
    assert_eq!(roots[0], extra.root_der());
    assert!(roots.contains(&root1) && roots.contains(&root2));
    assert_eq!(bundle.borrow().root_store().len(), 3);

    // The last certificate under the old root goes: the old root goes too.
    mgr.forget(&id("a"));
    timeout(WAIT, bundle.changed()).await.unwrap().unwrap();
    assert_eq!(bundle.borrow().roots, vec![extra.root_der(), root2]);
}

#[tokio::test]
async fn unreadable_root_cert_file_is_an_error() {
    let cfg = IdentityConfig {
        root_cert: Some("/nonexistent/root-cert.pem".into()),
        ..IdentityConfig::default()
    };
    let err = CertificateManager::new(cfg, FakeCa::new(None, Duration::ZERO)).unwrap_err();
    assert!(
        err.to_string().contains("/nonexistent/root-cert.pem"),
        "{err}"
    );
}

#[tokio::test]
async fn from_config_uses_ca_address_and_root_cert() {
    let mut config = crate::config::Config::new("node-1", "http://127.0.0.1:15010");
    let mgr = CertificateManager::from_config(&config).unwrap();
    assert!(mgr.trust_bundle().borrow().is_empty());
    config.ca_address = Some("not a url".into());
    let err = CertificateManager::from_config(&config).unwrap_err();
    assert!(err.to_string().contains("invalid CA address"), "{err}");
    config.ca_address = None;
    config.root_cert = Some("/nonexistent/root.pem".into());
    assert!(matches!(
        CertificateManager::from_config(&config),
        Err(IdentityError::RootCertFile { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn forget_stops_renewal() {
    let fake = FakeCa::new(Some(Duration::from_secs(10)), Duration::ZERO);
    let mgr = manager(&fake);
    let gone = id("gone");
    let stays = id("stays");
    mgr.fetch(&gone).await.unwrap();
    mgr.forget(&gone);
    // Commands are handled in order: once `stays` is served, `gone` is forgotten.
    mgr.fetch(&stays).await.unwrap();
    assert_eq!(mgr.identities(), vec![stays.clone()]);
    // Let `stays` renew a few times; `gone` never calls the CA again.
    fake.wait_calls(|c| c.len() >= 5).await;
    assert_eq!(fake.calls_for(&gone), 1);
    assert_eq!(CertificateDump::list(&mgr.view()).len(), 1);
}

#[tokio::test]
async fn forget_while_waiting_fails_the_fetch() {
    let fake = FakeCa::new(None, Duration::from_secs(3600));
    let mgr = manager(&fake);
    let who = id("leaving");
    let waiting = tokio::spawn({
        let mgr = mgr.clone();
        let who = who.clone();
        async move { mgr.fetch(&who).await }
    });
    fake.wait_started(1).await;
    assert_eq!(CertificateDump::list(&mgr.view())[0].state, "Initializing");
    mgr.forget(&who);
    let err = timeout(WAIT, waiting).await.unwrap().unwrap().unwrap_err();
    assert!(matches!(err, IdentityError::Forgotten { .. }), "{err}");
}

impl FakeCa {
    /// Waits until `n` CA calls have started (bounded).
    async fn wait_started(&self, n: usize) {
        let mut rx = self.started_tx.subscribe();
        timeout(WAIT, rx.wait_for(|s| *s >= n))
            .await
            .expect("CA calls did not start in time")
            .unwrap();
    }
}

#[tokio::test]
async fn metrics_and_dump_render() {
    let fake = FakeCa::new(None, Duration::ZERO);
    let mgr = manager(&fake);
    let mut registry = prometheus_client::registry::Registry::default();
    mgr.register_metrics(&mut registry);
    let who = id("productpage");
    let cert = mgr.fetch(&who).await.unwrap();

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for want in [
        "ztunnel_ca_requests_total{result=\"ok\"} 1",
        "ztunnel_ca_requests_total{result=\"error\"} 0",
        "ztunnel_ca_request_duration_seconds_count 1",
        "ztunnel_certificate_expiry_seconds{identity=\"spiffe://cluster.local/ns/default/sa/productpage\"} 86",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }

    let dump = CertificateDump::list(&mgr.view());
    assert_eq!(dump.len(), 1);
    let d = &dump[0];
    assert_eq!(d.identity, who.to_string());
    assert_eq!(d.state, "Available");
    assert_eq!(d.serial.as_deref(), Some(cert.serial_hex().as_str()));
    assert_eq!(d.chain, vec!["".to_string(), "CN=test root".to_string()]);
    let json = serde_json::to_value(&dump).unwrap();
    let nb = json[0]["notBefore"].as_str().unwrap();
    let na = json[0]["notAfter"].as_str().unwrap();
    assert!(nb.ends_with('Z') && na.ends_with('Z'), "{nb} {na}");
    assert!(nb < na);
    assert_eq!(json[0]["state"], "Available");

    mgr.forget(&who);
    mgr.fetch(&id("other")).await.unwrap(); // commands are ordered
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(!text.contains("sa/productpage"), "{text}");
}

mod grpc {
    use std::net::SocketAddr;

    use ambit_proto::auth::istio_certificate_service_server::{
        IstioCertificateService, IstioCertificateServiceServer,
    };
    use ambit_proto::auth::{IstioCertificateRequest, IstioCertificateResponse};
    use tokio_stream::wrappers::TcpListenerStream;
    use tonic::{Request, Response, Status};

    use super::*;

    /// What the server saw: (authorization header, ImpersonatedIdentity, ttl).
    type Seen = Arc<Mutex<Vec<(Option<String>, Option<String>, i64)>>>;

    struct Server {
        ca: TestCa,
        seen: Seen,
    }

    #[tonic::async_trait]
    impl IstioCertificateService for Server {
        async fn create_certificate(
            &self,
            request: Request<IstioCertificateRequest>,
        ) -> Result<Response<IstioCertificateResponse>, Status> {
            let auth = request
                .metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let req = request.into_inner();
            let impersonated = req
                .metadata
                .as_ref()
                .and_then(|m| m.fields.get(IMPERSONATED_IDENTITY))
                .and_then(|v| match &v.kind {
                    Some(prost_types::value::Kind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                });
            self.seen
                .lock()
                .unwrap()
                .push((auth.clone(), impersonated, req.validity_duration));
            if auth.as_deref() != Some("Bearer node-token-2") {
                return Err(Status::unauthenticated("unknown token"));
            }
            let ttl = Duration::from_secs(u64::try_from(req.validity_duration).unwrap());
            Ok(Response::new(IstioCertificateResponse {
                cert_chain: self.ca.sign(&req.csr, ttl, None),
            }))
        }
    }

    async fn serve(seen: Seen) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let svc = IstioCertificateServiceServer::new(Server {
            ca: TestCa::new("grpc"),
            seen,
        });
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        addr
    }

    #[tokio::test]
    async fn grpc_client_sends_token_and_impersonated_identity() {
        let seen = Seen::default();
        let addr = serve(seen.clone()).await;
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "node-token-1\n").unwrap();
        let client = GrpcCaClient::new(&format!("http://{addr}"), Some(token.clone())).unwrap();
        let cfg = IdentityConfig {
            cert_ttl: Duration::from_secs(3600),
            ..IdentityConfig::default()
        };
        let mgr = CertificateManager::new(cfg, Arc::new(client)).unwrap();

        // A stale token is refused with the server's reason.
        let who = id("details");
        let err = timeout(WAIT, mgr.fetch(&who)).await.unwrap().unwrap_err();
        assert!(err.to_string().contains("unknown token"), "{err}");
        mgr.forget(&who);

        // The token file is re-read on every request.
        std::fs::write(&token, "node-token-2\n").unwrap();
        let who2 = id("details-v2");
        let cert = timeout(WAIT, mgr.fetch(&who2)).await.unwrap().unwrap();
        assert_eq!(cert.identity, who2);
        assert_eq!(cert.chain_der.len(), 2);

        let seen = seen.lock().unwrap().clone();
        assert_eq!(
            seen[0],
            (
                Some("Bearer node-token-1".to_string()),
                Some(who.to_string()),
                3600
            )
        );
        assert_eq!(
            seen.last().unwrap(),
            &(
                Some("Bearer node-token-2".to_string()),
                Some(who2.to_string()),
                3600
            )
        );
    }

    #[tokio::test]
    async fn grpc_client_rejects_bad_address_and_reports_unreachable_ca() {
        let err = GrpcCaClient::new("not a url", None).unwrap_err();
        assert!(err.to_string().contains("invalid CA address"), "{err}");

        // Nothing listens on this port (bound, then closed).
        let addr = {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            l.local_addr().unwrap()
        };
        let client = GrpcCaClient::new(&format!("http://{addr}"), None).unwrap();
        let err = timeout(
            WAIT,
            client.sign(&id("x"), "csr".into(), Duration::from_secs(60)),
        )
        .await
        .unwrap()
        .unwrap_err();
        assert!(matches!(err, CaClientError::Status { .. }), "{err}");
    }
}
