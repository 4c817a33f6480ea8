//! Real rustls handshakes with CA-issued certificates: mTLS between two
//! workload identities (both chains and SPIFFE IDs checked), refusal of a
//! foreign CA, and the control plane's serving certificate.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::tests::{LIMIT, TD, der, issue, new_store, org_ca, service, signer, write_plugged};
use super::verify::spiffe_id_of;
use super::*;

/// Server-side check of an mTLS peer: webpki chain validation against the
/// trust bundle, no DNS name (SPIFFE certificates carry only a URI).
#[derive(Debug)]
struct SpiffeServerVerifier {
    roots: RootCertStore,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(pems: &[String]) -> RootCertStore {
    let mut r = RootCertStore::empty();
    for p in pems {
        r.add(der(p)).unwrap();
    }
    r
}

fn certs_and_key(
    chain: &[String],
    key_pem: &str,
) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
    (
        chain.iter().map(|p| der(p)).collect(),
        PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).unwrap(),
    )
}

/// Runs one TLS 1.3 mTLS handshake over an in-memory duplex: the server
/// presents `server`, the client `client`, each trusting `trust`. Returns the
/// SPIFFE ids each side saw of the other, or the first error.
async fn mtls(
    server: (&[String], &str),
    client: (&[String], &str),
    trust: &[String],
) -> Result<(SpiffeId, SpiffeId), String> {
    let (scerts, skey) = certs_and_key(server.0, server.1);
    let (ccerts, ckey) = certs_and_key(client.0, client.1);
    let client_verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots(trust)), provider())
            .build()
            .unwrap();
    let scfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_client_cert_verifier(client_verifier)
        .with_single_cert(scerts, skey)
        .unwrap();
    let ccfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(SpiffeServerVerifier {
            roots: roots(trust),
            provider: provider(),
        }))
        .with_client_auth_cert(ccerts, ckey)
        .unwrap();
    let (a, b) = tokio::io::duplex(64 * 1024);
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(scfg));
    let connector = tokio_rustls::TlsConnector::from(Arc::new(ccfg));
    let srv = async move {
        let mut s = acceptor
            .accept(a)
            .await
            .map_err(|e| format!("server: {e}"))?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf)
            .await
            .map_err(|e| format!("server read: {e}"))?;
        s.write_all(b"pong")
            .await
            .map_err(|e| format!("server write: {e}"))?;
        s.flush().await.map_err(|e| format!("server flush: {e}"))?;
        let peer = s.get_ref().1.peer_certificates().ok_or("no client cert")?[0].clone();
        spiffe_id_of(&peer).map_err(|e| e.to_string())
    };
    let cli = async move {
        let name = ServerName::try_from("workload.invalid").unwrap();
        let mut c = connector
            .connect(name, b)
            .await
            .map_err(|e| format!("client: {e}"))?;
        c.write_all(b"ping")
            .await
            .map_err(|e| format!("client write: {e}"))?;
        c.flush().await.map_err(|e| format!("client flush: {e}"))?;
        let mut buf = [0u8; 4];
        c.read_exact(&mut buf)
            .await
            .map_err(|e| format!("client read: {e}"))?;
        let peer = c.get_ref().1.peer_certificates().ok_or("no server cert")?[0].clone();
        spiffe_id_of(&peer).map_err(|e| e.to_string())
    };
    let (s, c) = tokio::time::timeout(LIMIT, async { tokio::join!(srv, cli) })
        .await
        .map_err(|_| "timeout".to_string())?;
    match (s, c) {
        (Ok(s), Ok(c)) => Ok((s, c)),
        (Err(e), Ok(_)) | (Ok(_), Err(e)) => Err(e),
        (Err(s), Err(c)) => Err(format!("{s}; {c}")),
    }
}

#[tokio::test]
async fn mtls_between_issued_identities_validates_chains_and_spiffe_ids() {
    let tmp = tempfile::tempdir().unwrap();
    let store = new_store(tmp.path());
    let s = signer(&store);
    let (srv_chain, srv_key) = issue(&s, "shop", "backend", 600);
    let (cli_chain, cli_key) = issue(&s, "shop", "frontend", 600);
    let trust = store.trust_bundle_pem().to_vec();
    let (client_seen_by_server, server_seen_by_client) =
        mtls((&srv_chain, &srv_key), (&cli_chain, &cli_key), &trust)
            .await
            .unwrap();
    assert_eq!(client_seen_by_server, SpiffeId::new(TD, "shop", "frontend"));
    assert_eq!(server_seen_by_client, SpiffeId::new(TD, "shop", "backend"));

    // The same through a plugged-in intermediate: the chain's intermediate
    // is sent by each side and only the org root is trusted.
    let org = org_ca();
    let plugged = tempfile::tempdir().unwrap();
    write_plugged(plugged.path(), &org, &org.inter_pem);
    let ostore = Arc::new(CaStore::load_or_create(tmp.path(), Some(plugged.path())).unwrap());
    let os = signer(&ostore);
    let (a, ak) = issue(&os, "x", "a", 600);
    let (b, bk) = issue(&os, "x", "b", 600);
    let (seen_b, seen_a) = mtls((&a, &ak), (&b, &bk), std::slice::from_ref(&org.root_pem))
        .await
        .unwrap();
    assert_eq!(
        (
            seen_b.service_account.as_str(),
            seen_a.service_account.as_str()
        ),
        ("b", "a")
    );
}

#[tokio::test]
async fn certificate_from_another_ca_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let other_dir = tempfile::tempdir().unwrap();
    let store = new_store(tmp.path());
    let other = new_store(other_dir.path());
    let (good, good_key) = issue(&signer(&store), "shop", "backend", 600);
    let (rogue, rogue_key) = issue(&signer(&other), "shop", "frontend", 600);
    let trust = store.trust_bundle_pem().to_vec();
    // Rogue client: the server refuses it.
    let err = mtls((&good, &good_key), (&rogue, &rogue_key), &trust)
        .await
        .unwrap_err();
    // Both roots are named `O=ambit, CN=ambit root CA`, so webpki finds the
    // wrong root by name and the signature check fails.
    assert!(err.contains("server: invalid peer certificate"), "{err}");
    // Rogue server: the client refuses it.
    let err = mtls((&rogue, &rogue_key), (&good, &good_key), &trust)
        .await
        .unwrap_err();
    assert!(err.contains("client: invalid peer certificate"), "{err}");
    assert!(verify_identity_chain(&rogue, &trust).is_err());
    // A CA with a different name: unknown issuer.
    let org = org_ca();
    let err = mtls((&good, &good_key), (&good, &good_key), &[org.root_pem])
        .await
        .unwrap_err();
    assert!(err.contains("UnknownIssuer"), "{err}");
}

#[tokio::test]
async fn server_tls_config_serves_a_ca_issued_certificate_for_the_names() {
    let tmp = tempfile::tempdir().unwrap();
    let store = new_store(tmp.path());
    let svc = service(store.clone(), StaticPodLocator::default(), tmp.path());
    let cfg = svc
        .server_tls_config(&["ambit-control.ambit-system.svc".into(), "127.0.0.1".into()])
        .unwrap();
    assert_eq!(cfg.alpn_protocols, vec![b"h2".to_vec()]);
    let ccfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots(store.trust_bundle_pem()))
        .with_no_client_auth();
    let (a, b) = tokio::io::duplex(64 * 1024);
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let connector = tokio_rustls::TlsConnector::from(Arc::new(ccfg));
    let name = ServerName::try_from("ambit-control.ambit-system.svc").unwrap();
    let (s, c) = tokio::time::timeout(LIMIT, async {
        tokio::join!(acceptor.accept(a), async {
            let mut c = connector.connect(name, b).await?;
            c.write_all(b"x").await?;
            c.flush().await?;
            Ok::<_, std::io::Error>(c)
        })
    })
    .await
    .unwrap();
    s.unwrap();
    c.unwrap();
}
