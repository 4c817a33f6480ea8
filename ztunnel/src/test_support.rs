//! Test support shared by the ztunnel's unit tests: an in-test CA that
//! issues workload certificates like the mesh CA does, and a TCP echo server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use futures::future::BoxFuture;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use time::OffsetDateTime;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::identity::{CaClient, CaClientError, Identity, TrustBundle, WorkloadCertificate};

/// `spiffe://cluster.local/ns/default/sa/<sa>`.
pub(crate) fn id(sa: &str) -> Identity {
    Identity::new("cluster.local", "default", sa)
}

/// An in-test CA: a self-signed root and its key.
pub(crate) struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    root_pem: String,
}

impl TestCa {
    pub(crate) fn new(name: &str) -> Self {
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

    pub(crate) fn bundle(&self) -> TrustBundle {
        TrustBundle {
            roots: vec![CertificateDer::from_pem_slice(self.root_pem.as_bytes()).unwrap()],
        }
    }

    /// A workload certificate for `identity`, signed like the mesh CA does
    /// (one URI SAN, server and client auth).
    pub(crate) fn issue(&self, identity: &Identity) -> WorkloadCertificate {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = CertificateParams::default();
        params.subject_alt_names = vec![SanType::URI(identity.to_string().try_into().unwrap())];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::from_secs(300);
        params.not_after = now + Duration::from_secs(3600);
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let leaf = params.signed_by(&key, &self.issuer).unwrap();
        WorkloadCertificate::from_chain(identity, &key, vec![leaf.pem(), self.root_pem.clone()])
            .unwrap()
    }
}

impl TestCa {
    /// Signs a CSR like the mesh CA: the CSR's SAN, `ttl` from now,
    /// backdated 5 min; returns leaf then root (PEM).
    pub(crate) fn sign_csr(&self, csr_pem: &str, ttl: Duration) -> Vec<String> {
        let mut csr = CertificateSigningRequestParams::from_pem(csr_pem).unwrap();
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

/// A [`CaClient`] backed by a [`TestCa`]; `ttl`, when set, overrides the
/// lifetime asked for (short ones make renewals happen within a test).
pub(crate) struct TestCaClient {
    pub(crate) ca: TestCa,
    pub(crate) ttl: Option<Duration>,
}

impl CaClient for TestCaClient {
    fn sign<'a>(
        &'a self,
        _identity: &'a Identity,
        csr_pem: String,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, CaClientError>> {
        let chain = self.ca.sign_csr(&csr_pem, self.ttl.unwrap_or(ttl));
        Box::pin(async move { Ok(chain) })
    }
}

/// A TCP echo server on 127.0.0.1 (echoes, then half-closes on EOF).
pub(crate) async fn echo_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            tokio::spawn(async move {
                let (mut r, mut w) = s.into_split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    addr
}

/// A connected TCP pair on 127.0.0.1: (connecting end, accepted end).
pub(crate) async fn loopback_pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (c, s) = tokio::join!(tokio::net::TcpStream::connect(addr), l.accept());
    (c.unwrap(), s.unwrap().0)
}

/// Writes `data` to `stream`, half-closes it, and returns everything read
/// back until EOF (at most 30 s).
pub(crate) async fn roundtrip<S: AsyncRead + AsyncWrite + Send + 'static>(
    stream: S,
    data: Vec<u8>,
) -> Vec<u8> {
    let (mut r, mut w) = tokio::io::split(stream);
    let writer = tokio::spawn(async move {
        w.write_all(&data).await.unwrap();
        w.shutdown().await.unwrap();
    });
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), r.read_to_end(&mut got))
        .await
        .expect("echo not complete within 30 s")
        .unwrap();
    writer.await.unwrap();
    got
}

/// The size of the future `make` would return, without calling it: how
/// much a task running it holds for its whole life.
pub fn future_size<F: std::future::Future>(_make: &dyn Fn() -> F) -> usize {
    std::mem::size_of::<F>()
}
