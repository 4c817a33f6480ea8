//! Workload identities and their certificates.
//!
//! ```text
//!  fetch(id) ──▶ CertificateView (ArcSwap<id → watch<CertificateState>>) ──▶ cached cert
//!      │ miss                     ▲           ▲ read by dump.rs (/config_dump), metrics.rs (expiry)
//!      ▼                          │ publish   │ one writer per identity
//!  manager actor (owns the map, the trust bundle) ──spawns──▶ worker(id)
//!                                                   key + CSR ─▶ CaClient ─▶ chain
//! ```
//!
//! Direction: `manager` owns and writes the state; `view` is the read side
//! it publishes; `dump` and `metrics` read the view and never reach into
//! the manager (the manager records CA calls into `metrics`).
//!
//! * Keys are ECDSA P-256, generated here; the private key never leaves the
//!   process. Only the CSR (one SPIFFE URI SAN) goes to the CA.
//! * One worker task per identity owns that identity's state: concurrent
//!   [`CertificateManager::fetch`]es of one identity share one CA call.
//! * A semaphore bounds the CA calls in flight across all identities.
//! * Certificates are renewed at about half their remaining lifetime (±10 %
//!   jitter); failures back off exponentially (capped) while the old
//!   certificate keeps serving until it expires.
//! * The trust bundle (the `--root-cert` file plus the roots of the chains
//!   received) is published on a watch channel, so a rotated root is picked
//!   up without a restart.
#![forbid(unsafe_code)]

mod ca_client;
mod cert;
mod dump;
mod manager;
mod metrics;
mod view;

#[cfg(test)]
mod tests;

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

pub use ca_client::{CaClient, CaClientError, GrpcCaClient, IMPERSONATED_IDENTITY};
pub use cert::{TrustBundle, WorkloadCertificate};
pub use dump::CertificateDump;
pub use manager::{CertificateManager, IdentityConfig};
pub use metrics::IdentityMetrics;
pub(crate) use view::CertificateState;
pub use view::CertificateView;

/// Errors of the identity module.
#[derive(Debug, Clone, thiserror::Error)]
pub enum IdentityError {
    /// A string is not a SPIFFE id of the form
    /// `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`.
    #[error(
        "invalid SPIFFE identity {input:?}: {reason}; expected spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>"
    )]
    InvalidSpiffeId {
        /// The rejected input.
        input: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Generating the key pair or the CSR failed.
    #[error("could not generate a key pair or CSR for {identity}: {reason}")]
    KeyGeneration {
        /// The identity the key was for.
        identity: String,
        /// The underlying error.
        reason: String,
    },
    /// The CA refused the request or could not be reached.
    #[error("certificate request for {identity} failed: {source}")]
    Ca {
        /// The identity requested.
        identity: String,
        /// What the CA client reported.
        #[source]
        source: CaClientError,
    },
    /// The CA client could not be built (e.g. a malformed `--ca-address`).
    #[error("cannot set up the CA client: {0}")]
    CaClient(#[source] CaClientError),
    /// The CA did not answer within the configured timeout.
    #[error(
        "certificate request for {identity} timed out after {timeout_ms} ms; is the CA at the configured --ca-address reachable?"
    )]
    CaTimeout {
        /// The identity requested.
        identity: String,
        /// The timeout that expired.
        timeout_ms: u128,
    },
    /// The CA answered with a chain this ztunnel cannot use.
    #[error("the CA returned an unusable certificate chain for {identity}: {reason}")]
    InvalidChain {
        /// The identity requested.
        identity: String,
        /// Why the chain was rejected.
        reason: String,
    },
    /// No valid certificate is available for an identity (the last attempt
    /// failed and no unexpired certificate is left).
    #[error("no certificate available for {identity}: {reason}")]
    Unavailable {
        /// The identity.
        identity: String,
        /// The last error, or why the old certificate is unusable.
        reason: String,
    },
    /// The identity was forgotten (its pod left the node) while a fetch waited.
    #[error("certificate for {identity} is no longer managed (the workload left this node)")]
    Forgotten {
        /// The identity.
        identity: String,
    },
    /// The certificate manager has shut down.
    #[error("the certificate manager has shut down")]
    Shutdown,
    /// The `--root-cert` file could not be read or holds no certificate.
    #[error("could not load the root certificate file {path}: {reason}")]
    RootCertFile {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// rustls refused the private key.
    #[error("rustls cannot use the private key of {identity}: {reason}")]
    Rustls {
        /// The identity.
        identity: String,
        /// The rustls error.
        reason: String,
    },
}

/// A workload identity: `spiffe://<trust_domain>/ns/<namespace>/sa/<service_account>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    /// Trust domain, e.g. `cluster.local`.
    pub trust_domain: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Kubernetes service account.
    pub service_account: String,
}

impl Identity {
    /// The SPIFFE URI scheme prefix.
    pub const SCHEME: &'static str = "spiffe://";

    /// An identity from its parts (not validated; see [`Identity::from_str`]).
    pub fn new(
        trust_domain: impl Into<String>,
        namespace: impl Into<String>,
        service_account: impl Into<String>,
    ) -> Self {
        Self {
            trust_domain: trust_domain.into(),
            namespace: namespace.into(),
            service_account: service_account.into(),
        }
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}/ns/{}/sa/{}",
            Self::SCHEME,
            self.trust_domain,
            self.namespace,
            self.service_account
        )
    }
}

impl FromStr for Identity {
    type Err = IdentityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |reason| IdentityError::InvalidSpiffeId {
            input: s.to_string(),
            reason,
        };
        let rest = s
            .strip_prefix(Self::SCHEME)
            .ok_or_else(|| bad("it does not start with spiffe://"))?;
        let parts: Vec<&str> = rest.split('/').collect();
        let [td, ns_kw, ns, sa_kw, sa] = parts.as_slice() else {
            return Err(bad("wrong number of path segments"));
        };
        if *ns_kw != "ns" || *sa_kw != "sa" {
            return Err(bad("the path must be /ns/<namespace>/sa/<service-account>"));
        }
        if td.is_empty() || ns.is_empty() || sa.is_empty() {
            return Err(bad("empty trust domain, namespace or service account"));
        }
        let ok = |p: &str| {
            p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        };
        if !ok(td) || !ok(ns) || !ok(sa) {
            return Err(bad("a segment holds characters other than [A-Za-z0-9._-]"));
        }
        Ok(Self::new(*td, *ns, *sa))
    }
}

impl serde::Serialize for Identity {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}
