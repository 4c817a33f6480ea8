//! Chain verification of issued workload certificates against a trust
//! bundle (webpki through rustls, ring provider), returning the SPIFFE ID.

use rustls::RootCertStore;
use rustls::client::verify_server_cert_signed_by_trust_anchor;
use rustls::server::ParsedCertificate;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, UnixTime};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

use super::SpiffeId;

/// Why a certificate chain is not a valid workload identity.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("the certificate chain is empty")]
    Empty,
    #[error("certificate {index} of the chain is not valid PEM/DER: {reason}")]
    BadCertificate { index: usize, reason: String },
    #[error("the trust bundle holds no usable root: {0}")]
    BadRoots(String),
    #[error("the chain does not verify against the trust bundle: {0}")]
    Untrusted(String),
    #[error("the leaf certificate must carry exactly one SPIFFE URI SAN, it carries {0:?}")]
    NoSpiffeId(Vec<String>),
}

/// Verifies `chain` (PEM, leaf first) against `roots` (PEM) now, and returns
/// the leaf's SPIFFE identity.
pub fn verify_identity_chain(chain: &[String], roots: &[String]) -> Result<SpiffeId, VerifyError> {
    let ders = chain
        .iter()
        .enumerate()
        .map(|(index, p)| {
            CertificateDer::from_pem_slice(p.as_bytes()).map_err(|e| VerifyError::BadCertificate {
                index,
                reason: e.to_string(),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (leaf, intermediates) = ders.split_first().ok_or(VerifyError::Empty)?;
    let mut store = RootCertStore::empty();
    for r in roots {
        let der = CertificateDer::from_pem_slice(r.as_bytes())
            .map_err(|e| VerifyError::BadRoots(e.to_string()))?;
        store
            .add(der)
            .map_err(|e| VerifyError::BadRoots(e.to_string()))?;
    }
    let parsed = ParsedCertificate::try_from(leaf).map_err(|e| VerifyError::BadCertificate {
        index: 0,
        reason: e.to_string(),
    })?;
    let algs = rustls::crypto::ring::default_provider().signature_verification_algorithms;
    verify_server_cert_signed_by_trust_anchor(
        &parsed,
        &store,
        intermediates,
        UnixTime::now(),
        algs.all,
    )
    .map_err(|e| VerifyError::Untrusted(e.to_string()))?;
    spiffe_id_of(leaf)
}

/// The single SPIFFE URI SAN of a DER certificate.
pub fn spiffe_id_of(der: &CertificateDer<'_>) -> Result<SpiffeId, VerifyError> {
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| VerifyError::BadCertificate {
        index: 0,
        reason: e.to_string(),
    })?;
    let uris: Vec<String> = match cert.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                GeneralName::URI(u) => Some(u.to_string()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    match uris.as_slice() {
        [one] => SpiffeId::parse(one).ok_or_else(|| VerifyError::NoSpiffeId(uris.clone())),
        _ => Err(VerifyError::NoSpiffeId(uris)),
    }
}

/// What a caller usually wants to know about an issued leaf.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafInfo {
    pub identity: SpiffeId,
    /// Hex serial number.
    pub serial: String,
    pub not_before: std::time::SystemTime,
    pub not_after: std::time::SystemTime,
}

/// Parses a PEM leaf certificate (no chain verification).
pub fn leaf_info(pem: &str) -> Result<LeafInfo, VerifyError> {
    let der = CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|e| {
        VerifyError::BadCertificate {
            index: 0,
            reason: e.to_string(),
        }
    })?;
    let identity = spiffe_id_of(&der)?;
    let (_, cert) = X509Certificate::from_der(&der).map_err(|e| VerifyError::BadCertificate {
        index: 0,
        reason: e.to_string(),
    })?;
    let at = |t: i64| {
        std::time::UNIX_EPOCH + std::time::Duration::from_secs(u64::try_from(t).unwrap_or(0))
    };
    Ok(LeafInfo {
        identity,
        serial: cert.raw_serial_as_string(),
        not_before: at(cert.validity().not_before.timestamp()),
        not_after: at(cert.validity().not_after.timestamp()),
    })
}
