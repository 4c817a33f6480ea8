//! Client-side helpers: what a caller of the CA sends (used by tools and
//! tests; ztunnel has its own implementation).

use std::collections::BTreeMap;

use rcgen::{CertificateParams, DistinguishedName, KeyPair, SanType};

/// Metadata key under which a node proxy names the identity it asks for.
use super::service::IMPERSONATED_IDENTITY_KEY;

/// Errors building a CSR.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot build a CSR for {what}: {reason}")]
    Csr { what: String, reason: String },
}

/// A fresh key pair and a PEM CSR for it.
#[derive(Debug)]
pub struct GeneratedCsr {
    /// PKCS#8 PEM private key; never leaves the caller.
    pub key_pem: String,
    pub csr_pem: String,
}

/// Generates an ECDSA P-256 key and a CSR carrying `uris` as URI SANs and
/// `dns` as DNS SANs (a valid workload CSR has exactly one SPIFFE URI).
pub fn generate_csr(uris: &[&str], dns: &[&str]) -> Result<GeneratedCsr, ClientError> {
    let what = format!("{uris:?} {dns:?}");
    let err = |e: rcgen::Error| ClientError::Csr {
        what: what.clone(),
        reason: e.to_string(),
    };
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(err)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    for u in uris {
        params
            .subject_alt_names
            .push(SanType::URI((*u).try_into().map_err(err)?));
    }
    for d in dns {
        params
            .subject_alt_names
            .push(SanType::DnsName((*d).try_into().map_err(err)?));
    }
    let csr = params.serialize_request(&key).map_err(err)?;
    Ok(GeneratedCsr {
        key_pem: key.serialize_pem(),
        csr_pem: csr.pem().map_err(err)?,
    })
}

/// Request metadata naming the impersonated identity, as Istio's ztunnel
/// sends it when asking on behalf of a pod.
pub fn impersonation_metadata(spiffe_id: &str) -> prost_types::Struct {
    let mut fields = BTreeMap::new();
    fields.insert(
        IMPERSONATED_IDENTITY_KEY.to_string(),
        prost_types::Value {
            kind: Some(prost_types::value::Kind::StringValue(spiffe_id.to_string())),
        },
    );
    prost_types::Struct { fields }
}
