//! The CA's signing material in Kubernetes Secrets, read by every replica.
//!
//! - A plugged-in CA: the `cacerts` Secret, Istio's keys `ca-cert.pem`,
//!   `ca-key.pem`, `root-cert.pem`, `cert-chain.pem`. When it exists it
//!   wins.
//! - Otherwise the generated root in `istio-ca-secret` (Istio's layout:
//!   type `istio.io/ca-root`, keys `ca-cert.pem`, `ca-key.pem`, and empty
//!   `cert-chain.pem`, `key.pem`, `root-cert.pem`; a non-empty
//!   `root-cert.pem` adds roots to the trust bundle). Only the leader
//!   creates it, once, with `create` — never `update`, so it is never
//!   overwritten, and a race between two leaders ends with `409
//!   AlreadyExists` and both reading the same root. Followers wait for it.
//!
//! The material is read at start; replacing either Secret takes effect at
//! the next restart of each replica.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{info, warn};

use super::{K8sError, call};
use crate::ca::{CaError, CaStore, generate_root};

/// Istio's type for the generated root's Secret.
pub const CA_ROOT_SECRET_TYPE: &str = "istio.io/ca-root";
pub const CA_CERT_KEY: &str = "ca-cert.pem";
pub const CA_KEY_KEY: &str = "ca-key.pem";
pub const CERT_CHAIN_KEY: &str = "cert-chain.pem";
pub const ROOT_CERT_KEY: &str = "root-cert.pem";
pub const KEY_KEY: &str = "key.pem";

/// How often a follower checks whether the leader created the root.
const FOLLOWER_POLL: Duration = Duration::from_secs(1);
/// How often waiting is logged.
const WAIT_LOG_EVERY: Duration = Duration::from_secs(10);

/// Where the Secrets are.
#[derive(Debug, Clone)]
pub struct CaSecretOptions {
    pub namespace: String,
    /// The generated root (`istio-ca-secret`).
    pub root_secret: String,
    /// The plugged-in CA (`cacerts`).
    pub plugged_secret: String,
}

/// Why the CA could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum CaSecretError {
    #[error("Secret {namespace}/{name} has no {key:?} key; {what}")]
    MissingKey {
        namespace: String,
        name: String,
        key: &'static str,
        what: &'static str,
    },
    #[error("Secret {namespace}/{name} key {key:?} is not UTF-8 PEM text")]
    NotText {
        namespace: String,
        name: String,
        key: &'static str,
    },
    #[error("the CA in a Secret is unusable: {0}")]
    Ca(#[from] CaError),
    #[error(transparent)]
    Kube(#[from] K8sError),
}

fn text(
    secret: &Secret,
    ns: &str,
    name: &str,
    key: &'static str,
    what: &'static str,
) -> Result<Option<String>, CaSecretError> {
    match secret.data.as_ref().and_then(|d| d.get(key)) {
        None => {
            if what.is_empty() {
                Ok(None)
            } else {
                Err(CaSecretError::MissingKey {
                    namespace: ns.into(),
                    name: name.into(),
                    key,
                    what,
                })
            }
        }
        Some(ByteString(b)) => {
            String::from_utf8(b.clone())
                .map(Some)
                .map_err(|_| CaSecretError::NotText {
                    namespace: ns.into(),
                    name: name.into(),
                    key,
                })
        }
    }
}

async fn get(api: &Api<Secret>, ns: &str, name: &str) -> Result<Option<Secret>, K8sError> {
    call(format!("reading Secret {ns}/{name}"), api.get_opt(name)).await
}

fn plugged(secret: &Secret, ns: &str, name: &str) -> Result<CaStore, CaSecretError> {
    const NEEDED: &str =
        "a plugged-in CA needs ca-cert.pem, ca-key.pem and root-cert.pem (Istio's cacerts layout)";
    let cert = text(secret, ns, name, CA_CERT_KEY, NEEDED)?.unwrap_or_default();
    let key = text(secret, ns, name, CA_KEY_KEY, NEEDED)?.unwrap_or_default();
    let root = text(secret, ns, name, ROOT_CERT_KEY, NEEDED)?.unwrap_or_default();
    let chain = text(secret, ns, name, CERT_CHAIN_KEY, "")?.filter(|c| !c.trim().is_empty());
    Ok(CaStore::from_plugged_secret(
        &format!("Secret {ns}/{name}"),
        &cert,
        &key,
        &root,
        chain.as_deref(),
    )?)
}

fn root(secret: &Secret, ns: &str, name: &str) -> Result<CaStore, CaSecretError> {
    const NEEDED: &str = "the generated root's Secret holds ca-cert.pem and ca-key.pem; restore it from a backup, or delete it to generate a new root (every workload certificate is then reissued)";
    let cert = text(secret, ns, name, CA_CERT_KEY, NEEDED)?.unwrap_or_default();
    let key = text(secret, ns, name, CA_KEY_KEY, NEEDED)?.unwrap_or_default();
    let extra = text(secret, ns, name, ROOT_CERT_KEY, "")?.unwrap_or_default();
    Ok(CaStore::from_root_secret(
        &format!("Secret {ns}/{name}"),
        &cert,
        &key,
        &extra,
    )?)
}

/// The Secret the leader creates for a newly generated root.
pub fn root_secret(opts: &CaSecretOptions, cert_pem: &str, key_pem: &str) -> Secret {
    let data: BTreeMap<String, ByteString> = [
        (CA_CERT_KEY, cert_pem),
        (CA_KEY_KEY, key_pem),
        (CERT_CHAIN_KEY, ""),
        (KEY_KEY, ""),
        (ROOT_CERT_KEY, ""),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
    .collect();
    Secret {
        metadata: ObjectMeta {
            name: Some(opts.root_secret.clone()),
            namespace: Some(opts.namespace.clone()),
            labels: Some(
                [(
                    "app.kubernetes.io/managed-by".to_string(),
                    "ambit".to_string(),
                )]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        type_: Some(CA_ROOT_SECRET_TYPE.to_string()),
        data: Some(data),
        ..Secret::default()
    }
}

/// Loads the CA from the Secrets, creating the root Secret when this
/// replica leads and none exists; waits (polling, each call bounded) until
/// it can. An unusable Secret is an error: it needs an operator.
pub async fn load_ca(
    client: Client,
    opts: &CaSecretOptions,
    leader: watch::Receiver<bool>,
) -> Result<CaStore, CaSecretError> {
    let api: Api<Secret> = Api::namespaced(client, &opts.namespace);
    let ns = opts.namespace.as_str();
    let started = Instant::now();
    let mut last_log: Option<Instant> = None;
    loop {
        let waiting_for;
        match get(&api, ns, &opts.plugged_secret).await {
            Ok(Some(s)) => return plugged(&s, ns, &opts.plugged_secret),
            Ok(None) => match get(&api, ns, &opts.root_secret).await {
                Ok(Some(s)) => return root(&s, ns, &opts.root_secret),
                Ok(None) if *leader.borrow() => {
                    let (cert, key) = generate_root()?;
                    let secret = root_secret(opts, &cert, &key);
                    let created = call(
                        format!("creating Secret {ns}/{}", opts.root_secret),
                        api.create(&PostParams::default(), &secret),
                    )
                    .await;
                    match created {
                        Ok(s) => {
                            info!(secret = %format!("{ns}/{}", opts.root_secret), "generated the mesh root CA and stored it in a Secret");
                            return root(&s, ns, &opts.root_secret);
                        }
                        // Created meanwhile by another replica: read it.
                        Err(e) if e.status_code() == Some(409) => continue,
                        Err(e) => waiting_for = Some(e.to_string()),
                    }
                }
                Ok(None) => {
                    waiting_for = Some(format!(
                        "the leader to create Secret {ns}/{} (this replica does not lead)",
                        opts.root_secret
                    ))
                }
                Err(e) => waiting_for = Some(e.to_string()),
            },
            Err(e) => waiting_for = Some(e.to_string()),
        }
        let now = Instant::now();
        if last_log.is_none_or(|t| now.duration_since(t) >= WAIT_LOG_EVERY) {
            last_log = Some(now);
            warn!(
                waited = ?started.elapsed(),
                "the CA is not loaded yet (xDS and the CA do not serve until it is): waiting for {}",
                waiting_for.unwrap_or_default()
            );
        }
        tokio::time::sleep(FOLLOWER_POLL).await;
    }
}
