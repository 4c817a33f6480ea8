//! Keys, CSRs and the certificates made from them.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rcgen::{CertificateParams, DistinguishedName, KeyPair, PKCS_ECDSA_P256_SHA256, SanType};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use time::OffsetDateTime;
use tokio::time::Instant;
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;

use super::{Identity, IdentityError};

/// A fresh key pair and a CSR for it (PEM) naming exactly `identity`.
pub(crate) fn generate_key_and_csr(
    identity: &Identity,
) -> Result<(KeyPair, String), IdentityError> {
    let err = |e: rcgen::Error| IdentityError::KeyGeneration {
        identity: identity.to_string(),
        reason: e.to_string(),
    };
    let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(err)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    let uri = identity.to_string().try_into().map_err(err)?;
    params.subject_alt_names = vec![SanType::URI(uri)];
    let csr = params.serialize_request(&key).map_err(err)?;
    let pem = csr.pem().map_err(err)?;
    Ok((key, pem))
}

/// A workload's certificate and private key.
///
/// The chain runs leaf first, root last. `Debug` never prints the key.
pub struct WorkloadCertificate {
    /// Whose certificate this is.
    pub identity: Identity,
    /// The chain as DER, leaf first, root last.
    pub chain_der: Vec<CertificateDer<'static>>,
    /// The chain as the CA sent it (PEM strings, leaf first, root last).
    pub chain_pem: Vec<String>,
    /// The leaf's serial number (big-endian bytes).
    pub serial: Vec<u8>,
    /// The leaf's notBefore.
    pub not_before: SystemTime,
    /// The leaf's notAfter.
    pub not_after: SystemTime,
    /// Subjects of the chain, leaf first.
    pub chain_subjects: Vec<String>,
    /// The leaf's notAfter on the monotonic (tokio) clock, for scheduling.
    pub(crate) expires_at: Instant,
    key: PrivatePkcs8KeyDer<'static>,
}

impl fmt::Debug for WorkloadCertificate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkloadCertificate")
            .field("identity", &self.identity.to_string())
            .field("serial", &self.serial_hex())
            .field("not_before", &rfc3339(self.not_before))
            .field("not_after", &rfc3339(self.not_after))
            .field("chain_subjects", &self.chain_subjects)
            .finish_non_exhaustive()
    }
}

impl WorkloadCertificate {
    /// Checks the CA's answer against our key and identity and builds the
    /// certificate: the leaf must name exactly `identity`, carry our public
    /// key, and each certificate must be signed by the next.
    pub(crate) fn from_chain(
        identity: &Identity,
        key: &KeyPair,
        chain_pem: Vec<String>,
    ) -> Result<Self, IdentityError> {
        let invalid = |reason: String| IdentityError::InvalidChain {
            identity: identity.to_string(),
            reason,
        };
        let mut chain_der = Vec::new();
        for pem in &chain_pem {
            for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                chain_der.push(cert.map_err(|e| invalid(format!("bad PEM: {e}")))?);
            }
        }
        if chain_der.is_empty() {
            return Err(invalid("no certificate in the response".into()));
        }
        let parsed = chain_der
            .iter()
            .map(|der| {
                x509_parser::parse_x509_certificate(der)
                    .map(|(_, c)| c)
                    .map_err(|e| invalid(format!("unparsable certificate: {e}")))
            })
            .collect::<Result<Vec<X509Certificate<'_>>, _>>()?;
        let leaf = &parsed[0];

        let uris = leaf_uris(leaf).map_err(invalid)?;
        let want = identity.to_string();
        if uris != [want.as_str()] {
            return Err(invalid(format!(
                "the leaf names {uris:?}, expected exactly [{want:?}]"
            )));
        }
        if leaf.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(invalid(
                "the leaf's public key is not the key this ztunnel generated".into(),
            ));
        }
        for (i, pair) in parsed.windows(2).enumerate() {
            pair[0]
                .verify_signature(Some(pair[1].public_key()))
                .map_err(|e| {
                    invalid(format!(
                        "certificate {i} is not signed by certificate {} ({e})",
                        i + 1
                    ))
                })?;
        }

        let not_before = to_system_time(leaf.validity().not_before.to_datetime());
        let not_after = to_system_time(leaf.validity().not_after.to_datetime());
        let remaining = not_after.duration_since(SystemTime::now()).map_err(|_| {
            invalid(format!(
                "the leaf already expired at {}",
                rfc3339(not_after)
            ))
        })?;
        let serial = leaf.raw_serial().to_vec();
        let chain_subjects = parsed.iter().map(|c| c.subject().to_string()).collect();
        drop(parsed);
        Ok(Self {
            identity: identity.clone(),
            chain_der,
            chain_pem,
            serial,
            not_before,
            not_after,
            chain_subjects,
            expires_at: Instant::now() + remaining,
            key: PrivatePkcs8KeyDer::from(key.serialize_der()),
        })
    }

    /// The private key (PKCS#8 DER) for rustls.
    pub fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(self.key.clone_key())
    }

    /// The leaf certificate.
    pub fn leaf(&self) -> &CertificateDer<'static> {
        // from_chain guarantees a non-empty chain.
        &self.chain_der[0]
    }

    /// The chain to present in a handshake: leaf and intermediates (the root
    /// is left out; the peer has it).
    pub fn presented_chain(&self) -> Vec<CertificateDer<'static>> {
        let n = if self.chain_der.len() > 1 {
            self.chain_der.len() - 1
        } else {
            1
        };
        self.chain_der[..n].to_vec()
    }

    /// The root the CA sent (the last element), when the chain has one
    /// besides the leaf.
    pub fn root(&self) -> Option<&CertificateDer<'static>> {
        if self.chain_der.len() > 1 {
            self.chain_der.last()
        } else {
            None
        }
    }

    /// A rustls `CertifiedKey` (presented chain + signing key) for client or
    /// server configs (e.g. a `ResolvesServerCert`).
    pub fn certified_key(&self) -> Result<Arc<rustls::sign::CertifiedKey>, IdentityError> {
        let signer =
            rustls::crypto::ring::sign::any_supported_type(&self.private_key()).map_err(|e| {
                IdentityError::Rustls {
                    identity: self.identity.to_string(),
                    reason: e.to_string(),
                }
            })?;
        Ok(Arc::new(rustls::sign::CertifiedKey::new(
            self.presented_chain(),
            signer,
        )))
    }

    /// The serial number as lower-case hex.
    pub fn serial_hex(&self) -> String {
        self.serial.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Whether the certificate is still within its lifetime.
    pub fn is_valid(&self) -> bool {
        Instant::now() < self.expires_at
    }

    /// Time left before expiry (zero once expired).
    pub fn time_to_expiry(&self) -> Duration {
        self.expires_at.saturating_duration_since(Instant::now())
    }
}

/// The roots this ztunnel trusts: the `--root-cert` file plus the roots of
/// the chains the CA returned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustBundle {
    /// Root certificates (DER), deduplicated, in a stable order.
    pub roots: Vec<CertificateDer<'static>>,
}

impl TrustBundle {
    /// Loads every certificate of a PEM file.
    pub(crate) fn load_pem_file(
        path: &std::path::Path,
    ) -> Result<Vec<CertificateDer<'static>>, IdentityError> {
        let err = |reason: String| IdentityError::RootCertFile {
            path: path.to_path_buf(),
            reason,
        };
        let bytes = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        let certs = CertificateDer::pem_slice_iter(&bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| err(format!("bad PEM: {e}")))?;
        if certs.is_empty() {
            return Err(err("the file holds no PEM certificate".into()));
        }
        Ok(certs)
    }

    /// A rustls root store of these roots (invalid roots are skipped).
    pub fn root_store(&self) -> rustls::RootCertStore {
        let mut store = rustls::RootCertStore::empty();
        let _ = store.add_parsable_certificates(self.roots.iter().cloned());
        store
    }

    /// Whether the bundle is empty.
    pub fn is_empty(&self) -> bool {
        self.roots.is_empty()
    }
}

fn leaf_uris<'a>(leaf: &'a X509Certificate<'_>) -> Result<Vec<&'a str>, String> {
    let san = leaf
        .subject_alternative_name()
        .map_err(|e| format!("bad subjectAltName extension: {e}"))?;
    Ok(san
        .map(|ext| {
            ext.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    GeneralName::URI(u) => Some(*u),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default())
}

fn to_system_time(t: OffsetDateTime) -> SystemTime {
    let secs = t.unix_timestamp();
    if secs >= 0 {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs.unsigned_abs())
    } else {
        SystemTime::UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
    }
}

/// RFC 3339 rendering of a wall-clock time (UTC).
pub(crate) fn rfc3339(t: SystemTime) -> String {
    OffsetDateTime::from(t)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| format!("{t:?}"))
}
