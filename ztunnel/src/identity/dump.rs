//! The `certificates` section of `/config_dump`, read from the certificate
//! manager's [`CertificateView`].

use serde::Serialize;

use super::Identity;
use super::cert::rfc3339;
use super::view::{CertificateState, CertificateView};

/// One managed identity as shown by `/config_dump`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CertificateDump {
    /// The SPIFFE id.
    pub identity: String,
    /// `Available`, `Initializing` or `Unavailable: <error>`.
    pub state: String,
    /// Leaf serial number (hex), when a certificate is held.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// Leaf notBefore (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_before: Option<String>,
    /// Leaf notAfter (RFC 3339).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_after: Option<String>,
    /// Subjects of the chain, leaf first, root last.
    pub chain: Vec<String>,
    /// The last CA error, when the last attempt failed while an older
    /// certificate keeps serving.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

impl CertificateDump {
    /// One entry per managed identity, sorted by SPIFFE id.
    pub fn list(view: &CertificateView) -> Vec<Self> {
        let mut out: Vec<Self> = view
            .states()
            .iter()
            .map(|(id, state)| Self::new(id, state))
            .collect();
        out.sort_by(|a, b| a.identity.cmp(&b.identity));
        out
    }

    fn new(id: &Identity, state: &CertificateState) -> Self {
        let cert = state.cert.as_ref();
        Self {
            identity: id.to_string(),
            state: state.summary(),
            serial: cert.map(|c| c.serial_hex()),
            not_before: cert.map(|c| rfc3339(c.not_before)),
            not_after: cert.map(|c| rfc3339(c.not_after)),
            chain: cert.map(|c| c.chain_subjects.clone()).unwrap_or_default(),
            last_error: state.last_error.clone(),
        }
    }
}
