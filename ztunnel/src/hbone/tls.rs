//! mTLS for HBONE: TLS 1.3 only, ALPN `h2`, the `ring` provider, both sides
//! present a workload certificate and verify the other against the trust
//! bundle.
//!
//! Peers are addressed by IP and carry no DNS names, so the client does not
//! check the server name; it checks instead that the server's leaf names
//! exactly the SPIFFE identity the caller expects (what xDS says the
//! destination must be). The server accepts any client chained to the
//! bundle; [`peer_identity`] tells who it is, for authorization.

use std::str::FromStr;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig};
use x509_parser::extensions::GeneralName;

use crate::identity::{Identity, TrustBundle, WorkloadCertificate};

/// The ALPN protocol HBONE negotiates.
pub const ALPN_H2: &[u8] = b"h2";

/// Errors building TLS configs or verifying a peer's identity.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TlsError {
    /// The trust bundle holds no usable root, so no peer could be verified.
    #[error(
        "the trust bundle has no usable root certificate; is --root-cert set, or has the CA answered yet?"
    )]
    EmptyTrustBundle,
    /// rustls refused the verifier configuration.
    #[error("cannot build the client-certificate verifier: {0}")]
    Verifier(String),
    /// rustls refused our certificate or key.
    #[error("rustls cannot use the certificate of {identity}: {reason}")]
    Certificate {
        /// Whose certificate.
        identity: String,
        /// The rustls error.
        reason: String,
    },
    /// The peer's certificate is valid but names another workload.
    #[error(
        "peer identity mismatch: expected {expected}, but the peer's certificate names {actual:?}; \
         check that xDS and the destination's certificate agree on its service account"
    )]
    PeerIdentityMismatch {
        /// The SPIFFE id we required.
        expected: String,
        /// The URI SANs the peer's leaf carries.
        actual: Vec<String>,
    },
    /// The peer's leaf could not be read.
    #[error("cannot read the peer's certificate: {0}")]
    UnreadablePeerCertificate(String),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn root_store(roots: &TrustBundle) -> Result<Arc<RootCertStore>, TlsError> {
    let store = roots.root_store();
    if store.is_empty() {
        return Err(TlsError::EmptyTrustBundle);
    }
    Ok(Arc::new(store))
}

fn cert_err(cert: &WorkloadCertificate) -> impl Fn(rustls::Error) -> TlsError + '_ {
    move |e| TlsError::Certificate {
        identity: cert.identity.to_string(),
        reason: e.to_string(),
    }
}

/// Server side of HBONE: presents `cert`, requires a client certificate
/// chained to `roots`, TLS 1.3 and ALPN `h2`.
pub fn server_config(
    cert: &WorkloadCertificate,
    roots: &TrustBundle,
) -> Result<ServerConfig, TlsError> {
    let provider = provider();
    let verifier =
        WebPkiClientVerifier::builder_with_provider(root_store(roots)?, provider.clone())
            .build()
            .map_err(|e| TlsError::Verifier(e.to_string()))?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(cert_err(cert))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(cert.presented_chain(), cert.private_key())
        .map_err(cert_err(cert))?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    // HBONE connections are pooled and long-lived; session tickets would cost
    // every handshake two encrypted records and buy little (resumption saved
    // ~15% of a new connection in benches/README.md).
    config.send_tls13_tickets = 0;
    Ok(config)
}

/// Client side of HBONE: presents `cert`, verifies the server's chain
/// against `roots` and requires its leaf to name exactly `expected_peer`.
/// The server name given to the handshake (an IP) is not checked.
pub fn client_config(
    cert: &WorkloadCertificate,
    roots: &TrustBundle,
    expected_peer: Identity,
) -> Result<ClientConfig, TlsError> {
    let provider = provider();
    let verifier = Arc::new(SpiffeServerVerifier {
        roots: root_store(roots)?,
        algorithms: provider.signature_verification_algorithms,
        expected: expected_peer,
    });
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(cert_err(cert))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(cert.presented_chain(), cert.private_key())
        .map_err(cert_err(cert))?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(config)
}

/// The SPIFFE identity in the peer's leaf certificate (its single URI SAN),
/// once the handshake has completed.
pub fn peer_identity(conn: &rustls::CommonState) -> Option<Identity> {
    let leaf = conn.peer_certificates()?.first()?;
    match uri_sans(leaf).ok()?.as_slice() {
        [one] => Identity::from_str(one).ok(),
        _ => None,
    }
}

/// The URI SANs of a certificate.
fn uri_sans(der: &CertificateDer<'_>) -> Result<Vec<String>, TlsError> {
    let bad = |e: String| TlsError::UnreadablePeerCertificate(e);
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| bad(e.to_string()))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| bad(format!("bad subjectAltName extension: {e}")))?;
    Ok(san
        .map(|ext| {
            ext.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    GeneralName::URI(u) => Some((*u).to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default())
}

/// Verifies a server the way `WebPkiServerVerifier` does (chain to a
/// trusted root, validity, server-auth usage, handshake signatures) except
/// for the DNS name, and requires the leaf's only URI SAN to be `expected`.
#[derive(Debug)]
struct SpiffeServerVerifier {
    roots: Arc<RootCertStore>,
    algorithms: WebPkiSupportedAlgorithms,
    expected: Identity,
}

impl ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.algorithms.all,
        )?;
        let other = |e: TlsError| {
            rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(
                Arc::new(e),
            )))
        };
        let uris = uri_sans(end_entity).map_err(other)?;
        let expected = self.expected.to_string();
        if uris != [expected.as_str()] {
            return Err(other(TlsError::PeerIdentityMismatch {
                expected,
                actual: uris,
            }));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// Finds our [`TlsError`] inside a failed handshake's I/O error (rustls
/// wraps verifier errors), so callers can report it precisely.
pub(crate) fn verification_error(err: &std::io::Error) -> Option<TlsError> {
    let rustls_err = err.get_ref()?.downcast_ref::<rustls::Error>()?;
    match rustls_err {
        rustls::Error::InvalidCertificate(CertificateError::Other(other)) => {
            other.0.downcast_ref::<TlsError>().cloned()
        }
        _ => None,
    }
}
