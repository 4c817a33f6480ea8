//! `istio.v1.auth.IstioCertificateService` over tonic.
//!
//! Per request: authenticate the bearer token, parse and check the CSR,
//! check the `ImpersonatedIdentity` metadata against the CSR, authorize the
//! caller for the identity, cap the TTL, sign. Each refusal is a gRPC status
//! with an operator-readable message and is counted by reason.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use ambit_proto::auth::istio_certificate_service_server::{
    IstioCertificateService, IstioCertificateServiceServer,
};
use ambit_proto::auth::{IstioCertificateRequest, IstioCertificateResponse};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tonic::{Request, Response, Status};
use tracing::{Instrument, info, info_span, warn};

use super::SpiffeId;
use super::auth::{AuthError, Caller, TokenAuthenticator, authenticate_grpc};
use super::locator::PodLocator;
use super::signer::{SignError, Signer, SignerOptions};
use super::store::{CaError, CaStore};

/// Metadata field naming the identity a node proxy asks for (Istio's name).
pub const IMPERSONATED_IDENTITY_KEY: &str = "ImpersonatedIdentity";

/// Largest `CreateCertificate` request accepted.
const MAX_CSR_REQUEST_BYTES: usize = 64 << 10;

/// Lifetime of the control plane's serving certificate; renewed at half.
const SERVING_CERT_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// Why an authenticated caller may not have the identity it asked for.
#[derive(Debug, thiserror::Error)]
pub enum AuthzError {
    #[error(
        "{caller} may only get its own identity, not {requested}; a node proxy must authenticate with its node token or a node proxy service account"
    )]
    NotOwnIdentity { caller: String, requested: String },
    #[error(
        "node {node} asked for {requested}, but no pod with that identity is scheduled on it (pods with it run on: {found_on}); a node proxy may only get identities of pods on its own node — check the pod's nodeName, or wait for the control plane to see the pod"
    )]
    NotOnNode {
        node: String,
        requested: String,
        found_on: String,
    },
    #[error(
        "{caller} is a node proxy identity but its token does not say which node it runs on; use a bound ServiceAccount token"
    )]
    NodeUnknown { caller: String },
    #[error(
        "the CSR asks for {san} but the ImpersonatedIdentity metadata says {impersonated}; they must be equal"
    )]
    ImpersonationMismatch { san: String, impersonated: String },
    #[error("the ImpersonatedIdentity metadata must be a string SPIFFE ID")]
    BadImpersonation,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

/// CA metrics (Istio's names; prometheus-client appends `_total`).
#[derive(Debug, Clone, Default)]
pub struct CaMetrics {
    csr_count: Counter,
    success: Counter,
    auth_failures: Counter,
    errors: Family<ReasonLabel, Counter>,
}

impl CaMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "citadel_server_csr_count",
            "CSRs received by the CA",
            m.csr_count.clone(),
        );
        registry.register(
            "citadel_server_success_cert_issuance_count",
            "Certificates issued by the CA",
            m.success.clone(),
        );
        registry.register(
            "citadel_server_authentication_failure_count",
            "CSRs refused because the caller could not be authenticated",
            m.auth_failures.clone(),
        );
        registry.register(
            "citadel_server_csr_sign_err_count",
            "CSRs refused or failed, by reason",
            m.errors.clone(),
        );
        m
    }

    fn error(&self, reason: &str) {
        self.errors
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
    }
}

/// Service settings beyond signing.
#[derive(Debug, Clone)]
pub struct CaServiceOptions {
    pub signer: SignerOptions,
    /// Service accounts (namespace, name) of node proxies: such a workload
    /// caller may get identities of pods on its own node.
    pub node_proxy_identities: Vec<(String, String)>,
}

impl Default for CaServiceOptions {
    fn default() -> Self {
        Self {
            signer: SignerOptions::default(),
            node_proxy_identities: vec![("ambit-system".into(), "ztunnel".into())],
        }
    }
}

struct Inner {
    signer: Signer,
    auth: Arc<dyn TokenAuthenticator>,
    locator: Arc<dyn PodLocator>,
    node_proxies: Vec<(String, String)>,
    metrics: CaMetrics,
}

/// The CA gRPC service. Cheap to clone.
#[derive(Clone)]
pub struct CaService {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CaService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaService")
            .field("store", self.inner.signer.store())
            .finish_non_exhaustive()
    }
}

impl CaService {
    pub fn new(
        store: Arc<CaStore>,
        opts: CaServiceOptions,
        authenticator: Arc<dyn TokenAuthenticator>,
        locator: Arc<dyn PodLocator>,
        metrics: CaMetrics,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                signer: Signer::new(store, opts.signer),
                auth: authenticator,
                locator,
                node_proxies: opts.node_proxy_identities,
                metrics,
            }),
        }
    }

    pub fn into_server(self) -> IstioCertificateServiceServer<Self> {
        // A CSR is well under 4 KiB; nothing legitimate comes near this.
        IstioCertificateServiceServer::new(self).max_decoding_message_size(MAX_CSR_REQUEST_BYTES)
    }

    pub fn signer(&self) -> &Signer {
        &self.inner.signer
    }

    /// A TLS server configuration (ring provider, ALPN `h2`) whose
    /// certificate for `names` (DNS names or IPs) is issued by this CA and
    /// renewed in place at half its 30-day lifetime. A client certificate is
    /// optional; one that is presented must chain to the mesh's roots, and
    /// its SPIFFE identity then authenticates the caller (see
    /// [`super::authenticate_grpc`]).
    pub fn server_tls_config(&self, names: &[String]) -> Result<rustls::ServerConfig, CaError> {
        let tls_err = |e: &dyn std::fmt::Display| CaError::Tls {
            reason: e.to_string(),
        };
        let resolver = ServingCertResolver::new(self.inner.signer.clone(), names.to_vec())?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for der in self.inner.signer.store().trust_anchors_der() {
            roots.add(der).map_err(|e| tls_err(&e))?;
        }
        let client_verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .allow_unauthenticated()
        .build()
        .map_err(|e| tls_err(&e))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_err(&e))?
            .with_client_cert_verifier(client_verifier)
            .with_cert_resolver(Arc::new(resolver));
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(cfg)
    }

    async fn handle(
        &self,
        req: Request<IstioCertificateRequest>,
    ) -> Result<IstioCertificateResponse, Status> {
        let m = &self.inner.metrics;
        m.csr_count.inc();
        let caller = authenticate_grpc(&*self.inner.auth, &req).await;
        let caller = caller.map_err(|e| {
            m.auth_failures.inc();
            m.error("authentication");
            match e {
                AuthError::Unavailable(_) => Status::unavailable(e.to_string()),
                _ => Status::unauthenticated(e.to_string()),
            }
        })?;
        tracing::Span::current().record("caller", tracing::field::display(&caller));
        let req = req.into_inner();
        let signer = &self.inner.signer;
        let sign_err = |e: SignError| {
            m.error(e.reason());
            if e.is_invalid_argument() {
                Status::invalid_argument(e.to_string())
            } else {
                Status::internal(e.to_string())
            }
        };
        let csr = signer.parse_csr(&req.csr).map_err(sign_err)?;
        tracing::Span::current().record("identity", tracing::field::display(&csr.identity));
        let authz = |e: AuthzError| {
            m.error("authorization");
            match e {
                AuthzError::ImpersonationMismatch { .. } | AuthzError::BadImpersonation => {
                    Status::invalid_argument(e.to_string())
                }
                _ => Status::permission_denied(e.to_string()),
            }
        };
        check_impersonation(req.metadata.as_ref(), &csr.identity).map_err(authz)?;
        self.authorize(&caller, &csr.identity).map_err(authz)?;
        let ttl = signer
            .granted_ttl(req.validity_duration)
            .map_err(sign_err)?;
        let cert_chain = signer.issue(&csr, ttl).map_err(sign_err)?;
        m.success.inc();
        info!(ttl_secs = ttl.as_secs(), "certificate issued");
        Ok(IstioCertificateResponse { cert_chain })
    }

    fn authorize(&self, caller: &Caller, id: &SpiffeId) -> Result<(), AuthzError> {
        let node = match caller {
            Caller::Node { name } => name,
            Caller::Workload {
                namespace,
                service_account,
                node,
            } => {
                if *namespace == id.namespace && *service_account == id.service_account {
                    return Ok(());
                }
                let is_proxy = self
                    .inner
                    .node_proxies
                    .iter()
                    .any(|(ns, sa)| ns == namespace && sa == service_account);
                if !is_proxy {
                    return Err(AuthzError::NotOwnIdentity {
                        caller: caller.to_string(),
                        requested: id.to_string(),
                    });
                }
                node.as_ref().ok_or_else(|| AuthzError::NodeUnknown {
                    caller: caller.to_string(),
                })?
            }
        };
        let nodes = self
            .inner
            .locator
            .nodes_of_identity(&id.namespace, &id.service_account);
        if nodes.contains(node) {
            return Ok(());
        }
        let found_on = if nodes.is_empty() {
            "none known".to_string()
        } else {
            nodes.into_iter().collect::<Vec<_>>().join(", ")
        };
        Err(AuthzError::NotOnNode {
            node: node.clone(),
            requested: id.to_string(),
            found_on,
        })
    }
}

/// The `ImpersonatedIdentity` metadata, when present, must equal the CSR's SAN.
fn check_impersonation(
    meta: Option<&prost_types::Struct>,
    id: &SpiffeId,
) -> Result<(), AuthzError> {
    let Some(v) = meta.and_then(|m| m.fields.get(IMPERSONATED_IDENTITY_KEY)) else {
        return Ok(());
    };
    let Some(prost_types::value::Kind::StringValue(s)) = &v.kind else {
        return Err(AuthzError::BadImpersonation);
    };
    if *s != id.to_string() {
        return Err(AuthzError::ImpersonationMismatch {
            san: id.to_string(),
            impersonated: s.clone(),
        });
    }
    Ok(())
}

#[tonic::async_trait]
impl IstioCertificateService for CaService {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        let peer = crate::tls_listener::remote_addr(&request)
            .map(|a| a.to_string())
            .unwrap_or_default();
        let span = info_span!("ca.create_certificate", %peer, caller = tracing::field::Empty, identity = tracing::field::Empty);
        let res = self.handle(request).instrument(span.clone()).await;
        if let Err(s) = &res {
            span.in_scope(
                || warn!(code = ?s.code(), reason = s.message(), "certificate request refused"),
            );
        }
        res.map(Response::new)
    }
}

/// Serves the control plane's certificate, reissuing it at half-life.
#[derive(Debug)]
struct ServingCertResolver {
    signer: Signer,
    names: Vec<String>,
    current: Mutex<(Arc<CertifiedKey>, SystemTime)>,
}

impl ServingCertResolver {
    fn new(signer: Signer, names: Vec<String>) -> Result<Self, CaError> {
        let first = issue_certified_key(&signer, &names)?;
        Ok(Self {
            signer,
            names,
            current: Mutex::new(first),
        })
    }
}

/// Issues a serving certificate; returns it and when to renew it.
fn issue_certified_key(
    signer: &Signer,
    names: &[String],
) -> Result<(Arc<CertifiedKey>, SystemTime), CaError> {
    let tls = |e: String| CaError::Tls { reason: e };
    let (chain, key) = signer.issue_server_cert(names, SERVING_CERT_TTL)?;
    let certs = chain
        .iter()
        .map(|p| CertificateDer::from_pem_slice(p.as_bytes()).map_err(|e| tls(e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let signing_key =
        rustls::crypto::ring::sign::any_supported_type(&key_der).map_err(|e| tls(e.to_string()))?;
    let renew_at = SystemTime::now() + SERVING_CERT_TTL / 2;
    Ok((Arc::new(CertifiedKey::new(certs, signing_key)), renew_at))
}

impl ResolvesServerCert for ServingCertResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let mut cur = self.current.lock().ok()?;
        if SystemTime::now() >= cur.1 {
            match issue_certified_key(&self.signer, &self.names) {
                Ok(next) => *cur = next,
                Err(e) => {
                    warn!(error = %e, "cannot renew the control plane's serving certificate; serving the old one")
                }
            }
        }
        Some(cur.0.clone())
    }
}
