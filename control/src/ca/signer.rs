//! CSR validation and workload certificate issuance.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rcgen::{
    CertificateParams, DistinguishedName, ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose,
    PublicKeyData, SanType, SignatureAlgorithm,
};
use rustls_pki_types::CertificateSigningRequestDer;
use rustls_pki_types::pem::PemObject;
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::FromDer;
use x509_parser::public_key::PublicKey;

use super::SpiffeId;
use super::store::{BACKDATE, CaError, CaStore, random_serial};

/// Signing settings.
#[derive(Debug, Clone)]
pub struct SignerOptions {
    /// Only identities of this SPIFFE trust domain are issued.
    pub trust_domain: String,
    /// Lifetime when the request asks for none (`validity_duration` 0).
    pub default_ttl: Duration,
    /// Longer requests are capped to this.
    pub max_ttl: Duration,
}

impl Default for SignerOptions {
    fn default() -> Self {
        Self {
            trust_domain: "cluster.local".into(),
            default_ttl: Duration::from_secs(24 * 3600),
            max_ttl: Duration::from_secs(24 * 3600),
        }
    }
}

/// Why a CSR was refused or could not be signed. `reason()` is the metric
/// label; the message is what the caller sees.
#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error("the CSR is not a PEM `CERTIFICATE REQUEST`: {0}; send a PEM-encoded PKCS#10 request")]
    NotPem(String),
    #[error("the CSR could not be parsed as PKCS#10: {0}")]
    Malformed(String),
    #[error(
        "the CSR's signature does not verify with its own public key ({0}); the request was corrupted or not signed with the key it carries"
    )]
    BadSignature(String),
    #[error("the CSR's key type is not supported ({0}); use ECDSA P-256 (or P-384, RSA ≥ 2048)")]
    UnsupportedKey(String),
    #[error("the CSR must carry exactly one URI SAN with the SPIFFE identity, it has {0}")]
    UriSanCount(usize),
    #[error("the CSR carries a non-URI SAN ({0}); workload certificates carry only the SPIFFE URI")]
    ExtraSan(String),
    #[error(
        "the CSR's SAN `{0}` is not a SPIFFE identity of the form spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>"
    )]
    NotSpiffe(String),
    #[error(
        "the CSR asks for `{id}` in trust domain `{got}`, but this CA issues only for trust domain `{want}`"
    )]
    WrongTrustDomain {
        id: String,
        got: String,
        want: String,
    },
    #[error(
        "the requested validity_duration {0} s is negative; send 0 for the default or a positive number of seconds"
    )]
    NegativeTtl(i64),
    #[error("the CA certificate expires before the certificate could be issued; rotate the CA")]
    CaExpired,
    #[error(
        "signing failed inside the CA: {0}; this is a bug or a broken CA key — check the control plane log"
    )]
    Internal(String),
}

impl SignError {
    /// Short label for `citadel_server_csr_sign_err_count{reason}`.
    pub fn reason(&self) -> &'static str {
        match self {
            SignError::NotPem(_) | SignError::Malformed(_) => "csr_parse_error",
            SignError::BadSignature(_) => "csr_signature_error",
            SignError::UnsupportedKey(_) => "csr_key_error",
            SignError::UriSanCount(_) | SignError::ExtraSan(_) | SignError::NotSpiffe(_) => {
                "csr_san_error"
            }
            SignError::WrongTrustDomain { .. } => "csr_trust_domain_error",
            SignError::NegativeTtl(_) => "ttl_error",
            SignError::CaExpired | SignError::Internal(_) => "cert_sign_error",
        }
    }

    /// Whether the caller (not the CA) is at fault.
    pub fn is_invalid_argument(&self) -> bool {
        !matches!(self, SignError::CaExpired | SignError::Internal(_))
    }
}

/// A parsed, signature-checked CSR for one SPIFFE identity.
#[derive(Debug, Clone)]
pub struct CsrRequest {
    pub identity: SpiffeId,
    key: CsrPublicKey,
}

/// The CSR's public key, as rcgen needs it.
#[derive(Debug, Clone)]
struct CsrPublicKey {
    raw: Vec<u8>,
    alg: &'static SignatureAlgorithm,
}

impl PublicKeyData for CsrPublicKey {
    fn der_bytes(&self) -> &[u8] {
        &self.raw
    }
    fn algorithm(&self) -> &'static SignatureAlgorithm {
        self.alg
    }
}

/// Validates CSRs and issues workload certificates. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Signer {
    store: Arc<CaStore>,
    opts: SignerOptions,
}

impl Signer {
    pub fn new(store: Arc<CaStore>, opts: SignerOptions) -> Self {
        Self { store, opts }
    }

    pub fn store(&self) -> &Arc<CaStore> {
        &self.store
    }

    pub fn options(&self) -> &SignerOptions {
        &self.opts
    }

    /// Parses `csr_pem`, verifies its signature and checks it carries exactly
    /// one SPIFFE URI SAN in the trust domain (and no other SAN).
    pub fn parse_csr(&self, csr_pem: &str) -> Result<CsrRequest, SignError> {
        let der = CertificateSigningRequestDer::from_pem_slice(csr_pem.as_bytes())
            .map_err(|e| SignError::NotPem(e.to_string()))?;
        let (_, csr) = X509CertificationRequest::from_der(der.as_ref())
            .map_err(|e| SignError::Malformed(e.to_string()))?;
        csr.verify_signature()
            .map_err(|e| SignError::BadSignature(e.to_string()))?;
        let key = csr_public_key(&csr)?;

        let mut uris = Vec::new();
        if let Some(exts) = csr.requested_extensions() {
            for ext in exts {
                if let ParsedExtension::SubjectAlternativeName(san) = ext {
                    for name in &san.general_names {
                        match name {
                            GeneralName::URI(u) => uris.push(u.to_string()),
                            other => return Err(SignError::ExtraSan(other.to_string())),
                        }
                    }
                }
            }
        }
        if uris.len() != 1 {
            return Err(SignError::UriSanCount(uris.len()));
        }
        let uri = &uris[0];
        let identity = SpiffeId::parse(uri).ok_or_else(|| SignError::NotSpiffe(uri.clone()))?;
        if identity.trust_domain != self.opts.trust_domain {
            return Err(SignError::WrongTrustDomain {
                id: uri.clone(),
                got: identity.trust_domain,
                want: self.opts.trust_domain.clone(),
            });
        }
        Ok(CsrRequest { identity, key })
    }

    /// The lifetime granted for a requested `validity_duration` (seconds):
    /// the default for 0, capped at the maximum.
    pub fn granted_ttl(&self, requested_secs: i64) -> Result<Duration, SignError> {
        if requested_secs < 0 {
            return Err(SignError::NegativeTtl(requested_secs));
        }
        let ttl = if requested_secs == 0 {
            self.opts.default_ttl
        } else {
            Duration::from_secs(requested_secs.unsigned_abs())
        };
        Ok(ttl.min(self.opts.max_ttl))
    }

    /// Issues the workload certificate for `req`; returns the chain, leaf
    /// first and root last, one PEM certificate per entry.
    pub fn issue(&self, req: &CsrRequest, ttl: Duration) -> Result<Vec<String>, SignError> {
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        let uri = req.identity.to_string();
        params.subject_alt_names = vec![SanType::URI(
            uri.try_into()
                .map_err(|e: rcgen::Error| SignError::Internal(e.to_string()))?,
        )];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let leaf = self.sign(params, &req.key, ttl)?;
        let mut chain = Vec::with_capacity(1 + self.store.chain_pem().len());
        chain.push(leaf);
        chain.extend(self.store.chain_pem().iter().cloned());
        Ok(chain)
    }

    /// Signs `params` for `key`, valid from `BACKDATE` ago for `ttl`, but
    /// never past the CA certificate's own expiry. Returns the PEM leaf.
    fn sign(
        &self,
        mut params: CertificateParams,
        key: &impl PublicKeyData,
        ttl: Duration,
    ) -> Result<String, SignError> {
        let now = SystemTime::now();
        let ca_end = self.store.signing_not_after();
        let end = (now + ttl).min(ca_end);
        if end <= now {
            return Err(SignError::CaExpired);
        }
        params.not_before = (now - BACKDATE).into();
        params.not_after = end.into();
        params.serial_number = Some(random_serial());
        let cert = params
            .signed_by(key, self.store.issuer())
            .map_err(|e| SignError::Internal(e.to_string()))?;
        Ok(cert.pem())
    }

    /// Issues a serving certificate for `names` (DNS names or IP addresses)
    /// with a fresh local key; returns (chain PEM leaf first, key).
    pub fn issue_server_cert(
        &self,
        names: &[String],
        ttl: Duration,
    ) -> Result<(Vec<String>, KeyPair), CaError> {
        let gen_err = |e: rcgen::Error| CaError::Generate {
            what: "the serving certificate",
            reason: e.to_string(),
        };
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(gen_err)?;
        let mut params = CertificateParams::new(names.to_vec()).map_err(gen_err)?;
        let mut dn = DistinguishedName::new();
        dn.push(rcgen::DnType::OrganizationName, "ambit");
        params.distinguished_name = dn;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let leaf = self
            .sign(params, &key, ttl)
            .map_err(|e| CaError::Generate {
                what: "the serving certificate",
                reason: e.to_string(),
            })?;
        let mut chain = vec![leaf];
        chain.extend(self.store.chain_pem().iter().cloned());
        Ok((chain, key))
    }
}

fn csr_public_key(csr: &X509CertificationRequest<'_>) -> Result<CsrPublicKey, SignError> {
    let spki = &csr.certification_request_info.subject_pki;
    let parsed = spki
        .parsed()
        .map_err(|e| SignError::UnsupportedKey(e.to_string()))?;
    let alg: &'static SignatureAlgorithm = match &parsed {
        PublicKey::EC(p) if p.key_size() == 256 => &rcgen::PKCS_ECDSA_P256_SHA256,
        PublicKey::EC(p) if p.key_size() == 384 => &rcgen::PKCS_ECDSA_P384_SHA384,
        PublicKey::RSA(r) if r.key_size() >= 2048 => &rcgen::PKCS_RSA_SHA256,
        PublicKey::EC(p) => {
            return Err(SignError::UnsupportedKey(format!(
                "EC key of {} bits",
                p.key_size()
            )));
        }
        PublicKey::RSA(r) => {
            return Err(SignError::UnsupportedKey(format!(
                "RSA key of {} bits",
                r.key_size()
            )));
        }
        _ => {
            return Err(SignError::UnsupportedKey(format!(
                "algorithm {}",
                spki.algorithm.algorithm
            )));
        }
    };
    Ok(CsrPublicKey {
        raw: spki.subject_public_key.data.to_vec(),
        alg,
    })
}
