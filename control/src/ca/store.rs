//! The CA's signing material: a generated, persisted root or a plugged-in CA.
//!
//! Generated root (no plugged-in directory): `<data-dir>/root-cert.pem` and
//! `<data-dir>/root-key.pem` (mode 0600), written atomically on first start
//! and reused afterwards. Plugged-in CA (Istio's `cacerts` layout):
//! `ca-cert.pem` (signing certificate), `ca-key.pem` (its PKCS#8 key),
//! `root-cert.pem` (one or more roots), `cert-chain.pem` (from `ca-cert` up
//! towards the root; optional).
//!
//! The trust bundle is every root of the root file plus every certificate in
//! `<data-dir>/trust-bundle.pem` (optional), de-duplicated, current root
//! first: put the next root there before switching the signing root, so
//! workloads trust both during the rotation.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PublicKeyData,
};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use tracing::{info, warn};
use x509_parser::prelude::{FromDer, X509Certificate};

/// Lifetime of a generated root.
const ROOT_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Not-before of generated certificates lies this far in the past (clock skew).
pub(crate) const BACKDATE: Duration = Duration::from_secs(5 * 60);

pub const ROOT_CERT_FILE: &str = "root-cert.pem";
pub const ROOT_KEY_FILE: &str = "root-key.pem";
pub const TRUST_BUNDLE_FILE: &str = "trust-bundle.pem";
pub const PLUGGED_CERT_FILE: &str = "ca-cert.pem";
pub const PLUGGED_KEY_FILE: &str = "ca-key.pem";
pub const PLUGGED_ROOT_FILE: &str = "root-cert.pem";
pub const PLUGGED_CHAIN_FILE: &str = "cert-chain.pem";

/// Errors loading, creating or using the CA material.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error(
        "cannot create the CA data directory {path}: {source}; check that the parent exists and is writable, or pass another --data-dir"
    )]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot read {path}: {source}; check the file exists and is readable by the control plane"
    )]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot write {path}: {source}; check free space and permissions of the data directory"
    )]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{present} exists but {missing} does not; the CA material is incomplete — restore the missing file from a backup, or remove both to generate a new root (every workload certificate must then be reissued)"
    )]
    Incomplete { present: PathBuf, missing: PathBuf },
    #[error(
        "{path} holds no valid PEM certificate ({reason}); it must contain `-----BEGIN CERTIFICATE-----` blocks"
    )]
    BadCertificate { path: PathBuf, reason: String },
    #[error(
        "cannot load the private key {path}: {reason}; the key must be an unencrypted PKCS#8 ECDSA or RSA key (`BEGIN PRIVATE KEY`); convert with `openssl pkcs8 -topk8 -nocrypt -in KEY -out KEY.pk8`"
    )]
    BadKey { path: PathBuf, reason: String },
    #[error(
        "the private key {key} does not belong to the certificate {cert}; put the matching pair in place"
    )]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error(
        "{path} is not a CA certificate (basic constraints CA:true and key usage keyCertSign are required) so it cannot sign workload certificates"
    )]
    NotCa { path: PathBuf },
    #[error(
        "the CA certificate {path} is not valid now (valid {not_before} .. {not_after}); install a current CA certificate"
    )]
    NotValidNow {
        path: PathBuf,
        not_before: String,
        not_after: String,
    },
    #[error(
        "the certificate chain in {path} is broken at position {index}: {reason}; the chain must run from ca-cert.pem up to the root, each certificate signed by the next"
    )]
    ChainBroken {
        path: PathBuf,
        index: usize,
        reason: String,
    },
    #[error("cannot generate {what}: {reason}")]
    Generate { what: &'static str, reason: String },
    #[error("cannot build the TLS server configuration: {reason}")]
    Tls { reason: String },
}

/// The loaded CA: signing key + certificate, the chain above it, the bundle.
pub struct CaStore {
    issuer: Issuer<'static, KeyPair>,
    /// PEM, signing certificate first, root last.
    chain: Vec<String>,
    /// PEM roots, current root first.
    roots: Vec<String>,
    /// The signing certificate's expiry; issued certificates never outlive it.
    signing_not_after: SystemTime,
    source: String,
}

impl std::fmt::Debug for CaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaStore")
            .field("source", &self.source)
            .field("chain_len", &self.chain.len())
            .field("roots", &self.roots.len())
            .finish_non_exhaustive()
    }
}

impl CaStore {
    /// Loads the plugged-in CA from `plugged` when given, else loads the root
    /// persisted under `data_dir`, generating and persisting one on first
    /// start.
    pub fn load_or_create(data_dir: &Path, plugged: Option<&Path>) -> Result<Self, CaError> {
        create_private_dir(data_dir)?;
        let mut store = match plugged {
            Some(dir) => Self::load_plugged(dir)?,
            None => Self::load_or_generate_root(data_dir)?,
        };
        let bundle = data_dir.join(TRUST_BUNDLE_FILE);
        if bundle.exists() {
            for (pem, _) in read_certs(&bundle)? {
                if !store.roots.contains(&pem) {
                    store.roots.push(pem);
                }
            }
        }
        info!(source = %store.source, roots = store.roots.len(), "CA loaded");
        Ok(store)
    }

    fn load_or_generate_root(dir: &Path) -> Result<Self, CaError> {
        let cert_path = dir.join(ROOT_CERT_FILE);
        let key_path = dir.join(ROOT_KEY_FILE);
        match (cert_path.exists(), key_path.exists()) {
            (true, true) => {}
            (true, false) => {
                return Err(CaError::Incomplete {
                    present: cert_path,
                    missing: key_path,
                });
            }
            (false, true) => {
                return Err(CaError::Incomplete {
                    present: key_path,
                    missing: cert_path,
                });
            }
            (false, false) => {
                let (cert_pem, key_pem) = generate_root()?;
                // Key first: a crash in between leaves a key without a
                // certificate, reported as Incomplete rather than silently
                // replaced.
                write_atomic(&key_path, key_pem.as_bytes(), 0o600)?;
                write_atomic(&cert_path, cert_pem.as_bytes(), 0o644)?;
                info!(dir = %dir.display(), "generated a new self-signed mesh root CA");
            }
        }
        check_key_mode(&key_path);
        let cert_text = read_text(&cert_path)?;
        let key_text = read_text(&key_path)?;
        Self::root_from_pem(
            &cert_path,
            &cert_text,
            &key_path,
            &key_text,
            format!("generated root in {}", dir.display()),
        )
    }

    /// A self-signed root from PEM text (`cert_path`/`key_path` only name
    /// where it came from in errors: a file, or a Secret's key).
    fn root_from_pem(
        cert_path: &Path,
        cert_text: &str,
        key_path: &Path,
        key_text: &str,
        source: String,
    ) -> Result<Self, CaError> {
        let certs = parse_certs(cert_path, cert_text)?;
        let (root_pem, root_der) =
            certs
                .into_iter()
                .next()
                .ok_or_else(|| CaError::BadCertificate {
                    path: cert_path.to_path_buf(),
                    reason: "empty file".into(),
                })?;
        let key = parse_key(key_path, key_text)?;
        let signing_not_after = check_ca_cert(cert_path, &root_der, &key, key_path)?;
        let issuer =
            Issuer::from_ca_cert_der(&root_der, key).map_err(|e| CaError::BadCertificate {
                path: cert_path.to_path_buf(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            issuer,
            chain: vec![root_pem.clone()],
            roots: vec![root_pem],
            signing_not_after,
            source,
        })
    }

    /// The CA of a Kubernetes Secret holding a generated root (Istio's
    /// `istio-ca-secret` keys: `ca-cert.pem`, `ca-key.pem`; a non-empty
    /// `root-cert.pem` adds roots to the trust bundle). `label` names the
    /// Secret in errors.
    pub fn from_root_secret(
        label: &str,
        ca_cert: &str,
        ca_key: &str,
        extra_roots: &str,
    ) -> Result<Self, CaError> {
        let at = |key: &str| PathBuf::from(format!("{label} key {key}"));
        let mut store = Self::root_from_pem(
            &at(PLUGGED_CERT_FILE),
            ca_cert,
            &at(PLUGGED_KEY_FILE),
            ca_key,
            format!("generated root in {label}"),
        )?;
        if !extra_roots.trim().is_empty() {
            for (pem, _) in parse_certs(&at(PLUGGED_ROOT_FILE), extra_roots)? {
                if !store.roots.contains(&pem) {
                    store.roots.push(pem);
                }
            }
        }
        info!(source = %store.source, roots = store.roots.len(), "CA loaded");
        Ok(store)
    }

    /// A plugged-in CA from a Kubernetes Secret with Istio's `cacerts`
    /// keys (`ca-cert.pem`, `ca-key.pem`, `root-cert.pem`, optional
    /// `cert-chain.pem`).
    pub fn from_plugged_secret(
        label: &str,
        ca_cert: &str,
        ca_key: &str,
        root_cert: &str,
        cert_chain: Option<&str>,
    ) -> Result<Self, CaError> {
        let at = |key: &str| PathBuf::from(format!("{label} key {key}"));
        let store = Self::plugged_from_pem(
            [
                (at(PLUGGED_CERT_FILE), ca_cert),
                (at(PLUGGED_KEY_FILE), ca_key),
                (at(PLUGGED_ROOT_FILE), root_cert),
            ],
            cert_chain.map(|c| (at(PLUGGED_CHAIN_FILE), c)),
            format!("plugged-in CA from {label}"),
        )?;
        info!(source = %store.source, roots = store.roots.len(), "CA loaded");
        Ok(store)
    }

    fn load_plugged(dir: &Path) -> Result<Self, CaError> {
        let cert_path = dir.join(PLUGGED_CERT_FILE);
        let key_path = dir.join(PLUGGED_KEY_FILE);
        let root_path = dir.join(PLUGGED_ROOT_FILE);
        let chain_path = dir.join(PLUGGED_CHAIN_FILE);
        let cert = read_text(&cert_path)?;
        let key = read_text(&key_path)?;
        let root = read_text(&root_path)?;
        let chain = if chain_path.exists() {
            Some(read_text(&chain_path)?)
        } else {
            None
        };
        Self::plugged_from_pem(
            [
                (cert_path, cert.as_str()),
                (key_path, key.as_str()),
                (root_path, root.as_str()),
            ],
            chain.as_deref().map(|c| (chain_path, c)),
            format!("plugged-in CA from {}", dir.display()),
        )
    }

    /// `[(ca-cert), (ca-key), (root-cert)]` and the optional chain, each
    /// with where it came from.
    fn plugged_from_pem(
        [(cert_path, cert), (key_path, key), (root_path, root)]: [(PathBuf, &str); 3],
        chain: Option<(PathBuf, &str)>,
        source: String,
    ) -> Result<Self, CaError> {
        let (ca_pem, ca_der) = parse_certs(&cert_path, cert)?
            .into_iter()
            .next()
            .ok_or_else(|| CaError::BadCertificate {
                path: cert_path.clone(),
                reason: "empty file".into(),
            })?;
        let key = parse_key(&key_path, key)?;
        let signing_not_after = check_ca_cert(&cert_path, &ca_der, &key, &key_path)?;
        let roots = parse_certs(&root_path, root)?;
        let mut chain_certs: Vec<(String, CertificateDer<'static>)> =
            vec![(ca_pem, ca_der.clone())];
        let chain_path = match chain {
            Some((path, text)) => {
                for (pem, der) in parse_certs(&path, text)? {
                    if der != ca_der {
                        chain_certs.push((pem, der));
                    }
                }
                path
            }
            None => cert_path.with_file_name(PLUGGED_CHAIN_FILE),
        };
        let chain = &mut chain_certs;
        // End the chain with the root that signed its last element.
        let last_self_signed = chain
            .last()
            .map(|(_, der)| is_self_signed(der))
            .unwrap_or(false);
        if !last_self_signed {
            let root = roots.first().ok_or_else(|| CaError::BadCertificate {
                path: root_path.clone(),
                reason: "empty file".into(),
            })?;
            chain.push(root.clone());
        }
        verify_chain_links(&chain_path, chain)?;
        let issuer =
            Issuer::from_ca_cert_der(&ca_der, key).map_err(|e| CaError::BadCertificate {
                path: cert_path.clone(),
                reason: e.to_string(),
            })?;
        let mut root_pems: Vec<String> = Vec::new();
        if let Some((pem, _)) = chain.last() {
            root_pems.push(pem.clone());
        }
        for (pem, _) in roots {
            if !root_pems.contains(&pem) {
                root_pems.push(pem);
            }
        }
        Ok(Self {
            issuer,
            chain: chain_certs.into_iter().map(|(pem, _)| pem).collect(),
            roots: root_pems,
            signing_not_after,
            source,
        })
    }

    /// The issuer (signing certificate's name and key).
    pub fn issuer(&self) -> &Issuer<'static, KeyPair> {
        &self.issuer
    }

    /// PEM certificates from the signing certificate up to the root, one
    /// per entry (appended to each issued leaf).
    pub fn chain_pem(&self) -> &[String] {
        &self.chain
    }

    /// PEM roots of the trust bundle, the current root first.
    pub fn trust_bundle_pem(&self) -> &[String] {
        &self.roots
    }

    /// The trust bundle as DER, for rustls root stores.
    pub fn trust_anchors_der(&self) -> Vec<CertificateDer<'static>> {
        self.roots
            .iter()
            .filter_map(|p| CertificateDer::from_pem_slice(p.as_bytes()).ok())
            .collect()
    }

    /// Expiry of the signing certificate.
    pub fn signing_not_after(&self) -> SystemTime {
        self.signing_not_after
    }
}

/// Creates `dir` (and parents) with mode 0700 if missing.
fn create_private_dir(dir: &Path) -> Result<(), CaError> {
    if dir.is_dir() {
        return Ok(());
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| CaError::CreateDir {
            path: dir.to_path_buf(),
            source,
        })
}

/// Writes `bytes` to `path` atomically: a temporary file in the same
/// directory with `mode`, fsync, rename over `path`, fsync the directory.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), CaError> {
    let err = |source| CaError::Write {
        path: path.to_path_buf(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("ca");
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(err)?;
    let res = f.write_all(bytes).and_then(|_| f.sync_all());
    drop(f);
    if let Err(e) = res.and_then(|_| fs::rename(&tmp, path)) {
        let _ = fs::remove_file(&tmp);
        return Err(err(e));
    }
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

fn check_key_mode(path: &Path) {
    if let Ok(meta) = fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        warn!(path = %path.display(), mode = format!("{:o}", meta.permissions().mode() & 0o777),
            "the CA private key is readable by group or others; run `chmod 600` on it");
    }
}

/// A new self-signed root CA: (certificate PEM, PKCS#8 key PEM).
pub fn generate_root() -> Result<(String, String), CaError> {
    let gen_err = |e: rcgen::Error| CaError::Generate {
        what: "the root CA",
        reason: e.to_string(),
    };
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(gen_err)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "ambit");
    dn.push(DnType::CommonName, "ambit root CA");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - BACKDATE;
    params.not_after = now + ROOT_LIFETIME;
    params.serial_number = Some(random_serial());
    let cert = params.self_signed(&key).map_err(gen_err)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A random positive 128-bit serial number.
pub(crate) fn random_serial() -> rcgen::SerialNumber {
    let mut bytes: [u8; 16] = rand::random();
    bytes[0] &= 0x7f;
    bytes[0] |= 0x01; // no leading zero byte, positive
    rcgen::SerialNumber::from_slice(&bytes)
}

fn read_text(path: &Path) -> Result<String, CaError> {
    fs::read_to_string(path).map_err(|source| CaError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Splits a PEM file into its certificates, each re-encoded as one
/// normalised PEM block.
pub(crate) fn read_certs(path: &Path) -> Result<Vec<(String, CertificateDer<'static>)>, CaError> {
    parse_certs(path, &read_text(path)?)
}

fn parse_certs(path: &Path, text: &str) -> Result<Vec<(String, CertificateDer<'static>)>, CaError> {
    split_pem_certs(text).map_err(|reason| CaError::BadCertificate {
        path: path.to_path_buf(),
        reason,
    })
}

pub(crate) fn split_pem_certs(
    text: &str,
) -> Result<Vec<(String, CertificateDer<'static>)>, String> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(BEGIN) {
        let after = &rest[start..];
        let end = after
            .find(END)
            .ok_or_else(|| format!("certificate {} has no END line", out.len() + 1))?;
        let block = &after[..end + END.len()];
        let der = CertificateDer::from_pem_slice(block.as_bytes())
            .map_err(|e| format!("certificate {}: {e}", out.len() + 1))?;
        X509Certificate::from_der(&der)
            .map_err(|e| format!("certificate {} is not X.509: {e}", out.len() + 1))?;
        out.push((format!("{}\n", block.trim()), der));
        rest = &after[end + END.len()..];
    }
    if out.is_empty() {
        return Err("no certificate found".into());
    }
    Ok(out)
}

fn parse_key(path: &Path, text: &str) -> Result<KeyPair, CaError> {
    KeyPair::from_pem(text).map_err(|e| CaError::BadKey {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// Checks the signing certificate: a CA, currently valid, matching `key`.
/// Returns its expiry.
fn check_ca_cert(
    path: &Path,
    der: &CertificateDer<'_>,
    key: &KeyPair,
    key_path: &Path,
) -> Result<SystemTime, CaError> {
    let bad = |reason: String| CaError::BadCertificate {
        path: path.to_path_buf(),
        reason,
    };
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| bad(e.to_string()))?;
    if cert.public_key().raw != key.subject_public_key_info().as_slice() {
        return Err(CaError::KeyMismatch {
            cert: path.to_path_buf(),
            key: key_path.to_path_buf(),
        });
    }
    let can_sign = match cert.key_usage() {
        Ok(Some(ku)) => ku.value.key_cert_sign(),
        Ok(None) => true,
        Err(e) => return Err(bad(e.to_string())),
    };
    if !cert.is_ca() || !can_sign {
        return Err(CaError::NotCa {
            path: path.to_path_buf(),
        });
    }
    let validity = cert.validity();
    if !validity.is_valid() {
        return Err(CaError::NotValidNow {
            path: path.to_path_buf(),
            not_before: validity.not_before.to_string(),
            not_after: validity.not_after.to_string(),
        });
    }
    let secs = u64::try_from(validity.not_after.timestamp()).unwrap_or(0);
    Ok(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
}

fn is_self_signed(der: &CertificateDer<'_>) -> bool {
    match X509Certificate::from_der(der) {
        Ok((_, c)) => c.subject() == c.issuer() && c.verify_signature(None).is_ok(),
        Err(_) => false,
    }
}

/// Each certificate of `chain` must be signed by the next one.
fn verify_chain_links(
    path: &Path,
    chain: &[(String, CertificateDer<'static>)],
) -> Result<(), CaError> {
    let broken = |index: usize, reason: String| CaError::ChainBroken {
        path: path.to_path_buf(),
        index,
        reason,
    };
    for (i, pair) in chain.windows(2).enumerate() {
        let (_, child) =
            X509Certificate::from_der(&pair[0].1).map_err(|e| broken(i, e.to_string()))?;
        let (_, parent) =
            X509Certificate::from_der(&pair[1].1).map_err(|e| broken(i + 1, e.to_string()))?;
        if child.issuer() != parent.subject() {
            return Err(broken(
                i,
                format!(
                    "issuer `{}` is not the next certificate's subject `{}`",
                    child.issuer(),
                    parent.subject()
                ),
            ));
        }
        child
            .verify_signature(Some(parent.public_key()))
            .map_err(|e| {
                broken(
                    i,
                    format!("signature does not verify with the next certificate's key: {e}"),
                )
            })?;
    }
    Ok(())
}
