//! The mesh certificate authority: `istio.v1.auth.IstioCertificateService`.
//!
//! - [`CaStore`] owns the signing key: a self-signed root generated on first
//!   start and persisted under the data directory, or a plugged-in CA (an
//!   intermediate under an organisation's root, Istio's file names).
//! - [`Signer`] validates a PEM CSR (signature, exactly one SPIFFE URI SAN in
//!   the trust domain) and issues a workload certificate.
//! - [`TokenAuthenticator`] turns `authorization: Bearer <token>` into a
//!   [`Caller`]; [`NodeTokenFile`] serves local mode, [`TokenReview`]
//!   Kubernetes (the API server's TokenReview).
//! - [`PodLocator`] answers "on which nodes run pods of this identity", for
//!   node proxies asking on behalf of their pods ([`SnapshotPodLocator`] reads
//!   the model's published Address resources).
//! - [`CaService`] ties them together as the tonic service.
//!
//! A requested TTL above the configured maximum is **capped**, not refused
//! (Istio's ztunnel asks for its own configured lifetime; a mismatch must not
//! leave workloads without certificates). A negative TTL is refused.

use std::fmt;

mod auth;
mod client;
mod locator;
mod service;
mod signer;
mod store;
mod token_review;
mod verify;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tls_tests;

pub use auth::{
    AuthError, BoxFuture, Caller, NodeTokenFile, StaticTokens, TokenAuthenticator, Unconfigured,
    authenticate_grpc,
};
pub use client::{ClientError, GeneratedCsr, generate_csr, impersonation_metadata};
pub use locator::{PodLocator, SnapshotPodLocator, StaticPodLocator};
pub use service::{CaMetrics, CaService, CaServiceOptions, IMPERSONATED_IDENTITY_KEY};
pub use signer::{CsrRequest, SignError, Signer, SignerOptions};
pub use store::{CaError, CaStore, generate_root};
pub use token_review::{TokenReview, TokenReviewOptions};
pub use verify::{LeafInfo, VerifyError, leaf_info, spiffe_id_of, verify_identity_chain};

/// A workload identity: `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpiffeId {
    pub trust_domain: String,
    pub namespace: String,
    pub service_account: String,
}

impl SpiffeId {
    pub fn new(trust_domain: &str, namespace: &str, service_account: &str) -> Self {
        Self {
            trust_domain: trust_domain.to_string(),
            namespace: namespace.to_string(),
            service_account: service_account.to_string(),
        }
    }

    /// Parses `spiffe://td/ns/NS/sa/SA`; `None` for anything else (other
    /// schemes, extra path segments, empty parts, query or fragment).
    pub fn parse(uri: &str) -> Option<Self> {
        let rest = uri.strip_prefix("spiffe://")?;
        let mut parts = rest.split('/');
        let td = parts.next()?;
        let (ns_kw, ns, sa_kw, sa) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || ns_kw != "ns" || sa_kw != "sa" {
            return None;
        }
        let ok = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        };
        if !ok(td) || !ok(ns) || !ok(sa) {
            return None;
        }
        Some(Self::new(td, ns, sa))
    }
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}
