//! TLS for the floor + TLS relay pair: a self-made CA (rcgen) and one ECDSA
//! P-256 leaf per side, as the mesh CA issues; rustls with the ring
//! provider (ztunnel's, `ztunnel/src/hbone/tls.rs`), TLS 1.3 only, mutual
//! authentication, no session resumption (ztunnel sends no tickets on
//! HBONE), default cipher suites and key exchange groups.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// DNS name in both leaves; the client relay checks it.
pub const SERVER_NAME: &str = "floor.relay.bench";

/// What a relay does with TLS.
#[derive(Clone)]
pub enum Side {
    Plain,
    /// TLS towards the target.
    Client(Arc<ClientConfig>),
    /// TLS on the accepted connection.
    Server(Arc<ServerConfig>),
}

/// Writes `ca.pem` and `{client,server}.{pem,key}` into `dir`.
pub fn write_certs(dir: &Path) -> Result<()> {
    let ca_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name
        .push(DnType::CommonName, "floor bench root");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let root = ca.self_signed(&ca_key)?;
    std::fs::write(dir.join("ca.pem"), root.pem())?;
    let issuer = Issuer::new(ca, ca_key);
    for side in ["client", "server"] {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut params = CertificateParams::new(vec![SERVER_NAME.to_string()])?;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let leaf = params.signed_by(&key, &issuer)?;
        std::fs::write(dir.join(format!("{side}.pem")), leaf.pem())?;
        std::fs::write(dir.join(format!("{side}.key")), key.serialize_pem())?;
    }
    Ok(())
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The relay's TLS side from `RELAY_TLS` and the files in `dir`.
pub fn load(mode: &str, dir: &Path) -> Result<Side> {
    if mode == "none" {
        return Ok(Side::Plain);
    }
    let mut roots = RootCertStore::empty();
    roots.add(CertificateDer::from_pem_file(dir.join("ca.pem"))?)?;
    let chain = |side: &str| -> Result<_> {
        let certs = CertificateDer::pem_file_iter(dir.join(format!("{side}.pem")))?
            .collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_file(dir.join(format!("{side}.key")))?;
        Ok((certs, key))
    };
    let tls13 = &[&rustls::version::TLS13];
    match mode {
        "client" => {
            let (certs, key) = chain("client")?;
            let mut c = ClientConfig::builder_with_provider(provider())
                .with_protocol_versions(tls13)?
                .with_root_certificates(roots)
                .with_client_auth_cert(certs, key)?;
            c.resumption = rustls::client::Resumption::disabled();
            Ok(Side::Client(Arc::new(c)))
        }
        "server" => {
            let (certs, key) = chain("server")?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .context("client verifier")?;
            let mut s = ServerConfig::builder_with_provider(provider())
                .with_protocol_versions(tls13)?
                .with_client_cert_verifier(verifier)
                .with_single_cert(certs, key)?;
            s.send_tls13_tickets = 0;
            Ok(Side::Server(Arc::new(s)))
        }
        other => bail!("RELAY_TLS: none, client or server, not {other:?}"),
    }
}
