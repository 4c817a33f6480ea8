//! The secrets the agent serves Envoy: `default` (the workload certificate
//! chain and its private key, PEM inline) and `ROOTCA` (the trust bundle),
//! each encoded once as an `Any` with a content hash as version.
//!
//! [`follow`] is the single writer of the published [`SecretSet`]: it
//! watches the identity's certificate state (issuance, renewal, failure)
//! and the trust bundle, and publishes a new set only when a secret's bytes
//! changed. The SDS streams read the set; readiness reads the certificate
//! status.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::DataSource;
use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, Secret, TlsCertificate, secret,
};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use rustls_pki_types::PrivateKeyDer;
use tokio::sync::watch;

use crate::identity::{TrustBundle, WorkloadCertificate};

/// The type URL of SDS resources.
pub const SECRET_TYPE_URL: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
/// The workload certificate and key (Istio's name).
pub const DEFAULT_SECRET: &str = "default";
/// The trust bundle as a validation context (Istio's name).
pub const ROOT_SECRET: &str = "ROOTCA";

/// One encoded secret.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretEntry {
    /// Hash of `resource.value`.
    pub version: String,
    /// The `Secret` as an `Any`.
    pub resource: Any,
    /// The leaf's serial (hex), for `default`; for logs.
    pub serial: Option<String>,
}

impl std::fmt::Debug for SecretEntry {
    // Never print the bytes: `default` holds the private key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretEntry")
            .field("version", &self.version)
            .field("serial", &self.serial)
            .finish_non_exhaustive()
    }
}

/// Every secret currently served, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SecretSet {
    /// Name → secret.
    pub by_name: BTreeMap<String, SecretEntry>,
}

impl SecretSet {
    /// The secrets for a certificate (if any yet) and a trust bundle (if
    /// not empty).
    pub fn build(cert: Option<&WorkloadCertificate>, bundle: &TrustBundle) -> SecretSet {
        let mut by_name = BTreeMap::new();
        if let Some(cert) = cert {
            let secret = Secret {
                name: DEFAULT_SECRET.into(),
                r#type: Some(secret::Type::TlsCertificate(TlsCertificate {
                    certificate_chain: Some(inline(certificate_chain_pem(cert))),
                    private_key: Some(inline(private_key_pem(cert))),
                    ..Default::default()
                })),
            };
            by_name.insert(
                DEFAULT_SECRET.to_string(),
                entry(&secret, Some(cert.serial_hex())),
            );
        }
        if !bundle.is_empty() {
            let roots: Vec<pem::Pem> = bundle
                .roots
                .iter()
                .map(|der| pem::Pem::new("CERTIFICATE", der.as_ref()))
                .collect();
            let secret = Secret {
                name: ROOT_SECRET.into(),
                r#type: Some(secret::Type::ValidationContext(
                    CertificateValidationContext {
                        trusted_ca: Some(inline(pem_many(&roots))),
                        ..Default::default()
                    },
                )),
            };
            by_name.insert(ROOT_SECRET.to_string(), entry(&secret, None));
        }
        SecretSet { by_name }
    }

    /// The secret `name`, if served.
    pub fn get(&self, name: &str) -> Option<&SecretEntry> {
        self.by_name.get(name)
    }
}

fn inline(bytes: Vec<u8>) -> DataSource {
    DataSource {
        specifier: Some(Specifier::InlineBytes(bytes)),
        ..Default::default()
    }
}

fn pem_many(pems: &[pem::Pem]) -> Vec<u8> {
    let config = pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF);
    pem::encode_many_config(pems, config).into_bytes()
}

/// The chain Envoy presents: leaf and intermediates (the root is left out;
/// peers have it).
fn certificate_chain_pem(cert: &WorkloadCertificate) -> Vec<u8> {
    let pems: Vec<pem::Pem> = cert
        .presented_chain()
        .iter()
        .map(|der| pem::Pem::new("CERTIFICATE", der.as_ref()))
        .collect();
    pem_many(&pems)
}

fn private_key_pem(cert: &WorkloadCertificate) -> Vec<u8> {
    let (tag, der) = match cert.private_key() {
        PrivateKeyDer::Pkcs8(k) => ("PRIVATE KEY", k.secret_pkcs8_der().to_vec()),
        PrivateKeyDer::Sec1(k) => ("EC PRIVATE KEY", k.secret_sec1_der().to_vec()),
        PrivateKeyDer::Pkcs1(k) => ("RSA PRIVATE KEY", k.secret_pkcs1_der().to_vec()),
        // Keys are generated here as PKCS#8; anything else is unreachable.
        _ => ("PRIVATE KEY", Vec::new()),
    };
    pem_many(&[pem::Pem::new(tag, der)])
}

fn entry(secret: &Secret, serial: Option<String>) -> SecretEntry {
    let value = secret.encode_to_vec();
    SecretEntry {
        version: content_hash(&value),
        resource: Any {
            type_url: SECRET_TYPE_URL.into(),
            value,
        },
        serial,
    }
}

/// A short content hash (versions only need to be stable within one run).
pub fn content_hash(bytes: &[u8]) -> String {
    let mut h = std::hash::DefaultHasher::new();
    bytes.hash(&mut h);
    format!("{:016x}", h.finish())
}

/// What readiness knows about the certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CertStatus {
    /// No usable certificate: why (the CA's last error, or expiry).
    Unavailable(String),
    /// A valid certificate is being served (its serial, hex).
    Serving(String),
}

/// Publishes the secrets for every change of the certificate state or the
/// trust bundle until both channels close. `status` tells readiness
/// whether a usable certificate is there.
pub(crate) async fn follow(
    mut cert: watch::Receiver<crate::identity::CertificateState>,
    mut bundle: watch::Receiver<Arc<TrustBundle>>,
    secrets: watch::Sender<Arc<SecretSet>>,
    status: watch::Sender<CertStatus>,
) {
    loop {
        // The newest certificate is served even once expired (Envoy keeps
        // what it has until a renewal arrives; removing it would only tear
        // down its TLS contexts); readiness reports the expiry.
        let (latest, usable, reason) = {
            let state = cert.borrow_and_update();
            (
                state.cert.clone(),
                state.usable().cloned(),
                state.unavailable_reason(),
            )
        };
        let roots = bundle.borrow_and_update().clone();
        let next = SecretSet::build(latest.as_deref(), &roots);
        secrets.send_if_modified(|current| {
            if **current == next {
                return false;
            }
            for (name, e) in &next.by_name {
                if current.get(name).map(|c| &c.version) != Some(&e.version) {
                    tracing::info!(secret = %name, version = %e.version, serial = e.serial.as_deref().unwrap_or(""), "secret updated; pushing it to Envoy over SDS");
                }
            }
            *current = Arc::new(next);
            true
        });
        let now = match &usable {
            Some(c) => CertStatus::Serving(c.serial_hex()),
            None => CertStatus::Unavailable(reason),
        };
        status.send_if_modified(|s| {
            if *s == now {
                false
            } else {
                *s = now;
                true
            }
        });
        // A certificate that expires without a renewal must stop being
        // reported as serving: wake up at its expiry too.
        let expiry = usable
            .as_ref()
            .map(|c| c.time_to_expiry())
            .unwrap_or(std::time::Duration::from_secs(3600));
        tokio::select! {
            changed = cert.changed() => if changed.is_err() { return },
            changed = bundle.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(expiry) => {}
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn empty_inputs_serve_nothing_and_hashes_are_stable() {
        let set = SecretSet::build(None, &TrustBundle::default());
        assert!(set.by_name.is_empty());
        assert_eq!(content_hash(b"abc"), content_hash(b"abc"));
        assert_ne!(content_hash(b"abc"), content_hash(b"abd"));
    }

    #[test]
    fn roots_become_rootca() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let root = params.self_signed(&key).unwrap();
        let bundle = TrustBundle {
            roots: vec![root.der().clone()],
        };
        let set = SecretSet::build(None, &bundle);
        let e = set.get(ROOT_SECRET).unwrap();
        let secret = Secret::decode(e.resource.value.as_slice()).unwrap();
        let Some(secret::Type::ValidationContext(v)) = secret.r#type else {
            panic!("not a validation context");
        };
        let Some(Specifier::InlineBytes(pem)) = v.trusted_ca.unwrap().specifier else {
            panic!("not inline");
        };
        let text = String::from_utf8(pem).unwrap();
        assert!(text.starts_with("-----BEGIN CERTIFICATE-----\n"), "{text}");
        assert!(!text.contains('\r'));
        assert_eq!(e.resource.type_url, SECRET_TYPE_URL);
        assert_eq!(SecretSet::build(None, &bundle), set, "same input, same set");
    }
}
