//! The node proxy's data path: for each enrolled pod, three listeners made
//! inside the pod's network namespace hand their connections here.
//!
//! ```text
//!  app ──(REDIRECT)──▶ :15001 outbound ─ resolve ─┬─ HBONE: pool ══ mTLS + CONNECT ══▶ peer pod :15008
//!                                                 ├─ waypoint-bound: pool ══ CONNECT original dst ══▶ waypoint :15008
//!                                                 └─ plain TCP (non-mesh / unknown)
//!  peer ztunnel ══ mTLS ══▶ :15008 inbound HBONE ─ address + policy check ─▶ app (inside the pod)
//!  plaintext client ─(REDIRECT)─▶ :15006 inbound ─ policy (STRICT denies) ─▶ app (inside the pod)
//! ```
//!
//! * [`ProxyContext`] is shared by every pod: state reader, certificates,
//!   the HBONE pool, metrics, the policy cache and the TLS config cache
//!   (`tls_cache.rs`, evicted when an identity leaves or is renewed).
//! * [`PodContext`] (`pod.rs`) is one enrolled pod: its identity, a socket
//!   thread inside its netns ([`ambit_inpod::NetnsSockets`]) and its own
//!   drain signal, so removing a pod drains only its connections.
//! * `outbound.rs` and `inbound.rs` are the listeners' connection handlers;
//!   what both share — the accept loop, the drain-aware copy, the original
//!   destination, recording the outcome — is in `connection.rs`.
//! * Every connection is one task with one [`metrics::ConnectionResult`]
//!   (metrics, one access-log line and one record in the
//!   [`recent::ConnectionTable`] the admin's `/connections` serves) and
//!   ends within
//!   the drain's deadline once its pod or the whole ztunnel drains.

mod connection;
pub mod inbound;
pub mod live;
pub mod metrics;
pub mod outbound;
mod pod;
pub mod recent;
mod resolve;
pub mod tls_cache;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use ambit_inpod::ZTUNNEL_MARK;
use hyper::http::StatusCode;
use rustls::{ClientConfig, ServerConfig};

use crate::copy::{CopyConfig, CopyError};
use crate::hbone::HbonePool;
use crate::hbone::{ClientError, PoolError, ServerError, TlsError};
use crate::identity::{
    CertificateManager, Identity, IdentityError, TrustBundle, WorkloadCertificate,
};
use crate::rbac::PolicyCache;
use crate::state::{StateReader, Workload};

use self::metrics::{PeerInfo, TcpMetrics};

pub use pod::{ConnGuard, PodConnections, PodContext};
pub use resolve::{Resolved, WaypointMissing, resolve};
pub use tls_cache::{TlsCache, TlsCacheStats};

/// Trust domain of workloads that do not name one.
pub const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";

/// Why a proxied connection failed; each ends up in the access log.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error(
        "cannot read the original destination of a redirected connection: {0} (is the pod's redirection installed with REDIRECT?)"
    )]
    OriginalDst(io::Error),
    #[error(
        "connection to {0} refused: that port is one of ztunnel's own (15001/15006/15008 in pods, \
         15000/15020/15021 on the node), never a destination"
    )]
    Loop(SocketAddr),
    #[error("{addr} is not an address of pod {pod} on this node; refusing (never an open proxy)")]
    NotThisPod { addr: SocketAddr, pod: String },
    #[error("service {service} has no healthy endpoint for port {port}")]
    NoHealthyEndpoint { service: String, port: u16 },
    #[error(
        "{target} is bound to waypoint {waypoint}, which cannot be used: {why}; refusing the \
         connection rather than bypassing the waypoint's policy (check that the waypoint's pods \
         run and are ready)"
    )]
    NoWaypoint {
        waypoint: String,
        target: SocketAddr,
        why: resolve::WaypointMissing,
    },
    #[error("no certificate for {identity}: {source}")]
    Certificate {
        identity: Identity,
        #[source]
        source: IdentityError,
    },
    #[error("cannot build the TLS config for {identity}: {source}")]
    Tls {
        identity: Identity,
        #[source]
        source: TlsError,
    },
    #[error("HBONE to {target}: {source}")]
    Hbone {
        target: SocketAddr,
        #[source]
        source: PoolError,
    },
    #[error("HBONE server: {0}")]
    HboneServer(#[from] ServerError),
    #[error("the HBONE client reset the stream before it was answered: {0}")]
    ClientReset(#[source] h2::Error),
    #[error("connecting to {dst}: {source}")]
    Connect {
        dst: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("connecting to {dst} did not complete within {timeout:?}")]
    ConnectTimeout { dst: SocketAddr, timeout: Duration },
    #[error("denied by {policy}")]
    Denied { policy: String },
    #[error("closed: a policy change denies it ({policy})")]
    Revoked { policy: String },
    #[error(transparent)]
    Copy(#[from] CopyError),
    #[error(
        "closed at the drain deadline while the pod or ztunnel was shutting down (ztunnel: --drain-timeout-secs)"
    )]
    Drained,
}

impl ProxyError {
    /// The `response_flags` for a connection that ended with this error.
    pub fn flags(&self) -> metrics::ResponseFlags {
        use metrics::ResponseFlags as F;
        match self {
            ProxyError::Denied { .. }
            | ProxyError::Revoked { .. }
            | ProxyError::NotThisPod { .. }
            | ProxyError::Loop(_) => F::Deny,
            ProxyError::Copy(_)
            | ProxyError::Drained
            | ProxyError::HboneServer(_)
            | ProxyError::ClientReset(_) => F::DownstreamTerminated,
            ProxyError::Hbone {
                source: PoolError::Client(ClientError::Status { status, .. }),
                ..
            } if *status == StatusCode::UNAUTHORIZED || *status == StatusCode::FORBIDDEN => F::Deny,
            _ => F::ConnectFailure,
        }
    }
}

/// Tuning of the data path.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// The HBONE port of every peer (15008).
    pub hbone_port: u16,
    /// The in-pod listener ports, never valid as a destination.
    pub outbound_port: u16,
    /// See above.
    pub inbound_plaintext_port: u16,
    /// Bound on connecting to an app or a non-mesh destination.
    pub connect_timeout: Duration,
    /// Deliver inbound traffic from the original client's IP
    /// (`IP_TRANSPARENT`; needs the redirection's mark routing in the pod).
    pub inbound_transparent: bool,
    /// `SO_MARK` of ztunnel's sockets in pods.
    pub mark: u32,
    /// Copy-loop buffers.
    pub copy: CopyConfig,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            hbone_port: 15008,
            outbound_port: 15001,
            inbound_plaintext_port: 15006,
            connect_timeout: Duration::from_secs(5),
            inbound_transparent: true,
            mark: ZTUNNEL_MARK,
            copy: CopyConfig::default(),
        }
    }
}

/// What every pod's proxies share.
pub struct ProxyContext {
    pub node: String,
    pub cluster_id: String,
    pub network: Arc<str>,
    pub state: StateReader,
    pub certificates: CertificateManager,
    pub pool: HbonePool,
    /// Istio's `istio_tcp_*` connection metrics, shared with `/metrics`.
    pub metrics: TcpMetrics,
    pub policies: Arc<PolicyCache>,
    pub cfg: ProxyConfig,
    /// Inbound connections, rechecked when policy changes.
    pub live: Arc<live::LiveConnections>,
    /// rustls configs per local identity; see [`tls_cache`].
    pub tls: Arc<TlsCache>,
    /// Round-robin cursor for picking a service's endpoint.
    round_robin: AtomicUsize,
}

impl std::fmt::Debug for ProxyContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyContext")
            .field("node", &self.node)
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl ProxyContext {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        node: String,
        cluster_id: String,
        network: &str,
        state: StateReader,
        certificates: CertificateManager,
        pool: HbonePool,
        metrics: TcpMetrics,
        policies: Arc<PolicyCache>,
        cfg: ProxyConfig,
    ) -> Self {
        Self {
            node,
            cluster_id,
            network: Arc::from(network),
            state,
            certificates,
            pool,
            metrics,
            policies,
            cfg,
            live: Arc::default(),
            tls: Arc::default(),
            round_robin: AtomicUsize::new(0),
        }
    }

    fn bundle(&self) -> Arc<TrustBundle> {
        self.certificates.trust_bundle().borrow().clone()
    }

    /// Whether `cert` is the one its identity holds now. A connection that
    /// fetched it just before a renewal or a forget must not put it back
    /// into the cache after the eviction ran.
    fn is_current(&self, cert: &Arc<WorkloadCertificate>) -> bool {
        self.certificates
            .current(&cert.identity)
            .is_some_and(|c| Arc::ptr_eq(&c, cert))
    }

    /// The client TLS config presenting `cert` and pinning `peer` (cached
    /// while `cert` is current).
    fn client_config(
        &self,
        cert: &Arc<WorkloadCertificate>,
        peer: &Identity,
    ) -> Result<Arc<ClientConfig>, TlsError> {
        if self.is_current(cert) {
            self.tls.client(cert, &self.bundle(), peer)
        } else {
            crate::hbone::client_config(cert, &self.bundle(), peer.clone()).map(Arc::new)
        }
    }

    /// The HBONE server config presenting `cert` (cached while `cert` is
    /// current).
    fn server_config(
        &self,
        cert: &Arc<WorkloadCertificate>,
    ) -> Result<Arc<ServerConfig>, TlsError> {
        if self.is_current(cert) {
            self.tls.server(cert, &self.bundle())
        } else {
            crate::hbone::server_config(cert, &self.bundle()).map(Arc::new)
        }
    }

    async fn certificate(&self, id: &Identity) -> Result<Arc<WorkloadCertificate>, ProxyError> {
        self.certificates
            .fetch(id)
            .await
            .map_err(|source| ProxyError::Certificate {
                identity: id.clone(),
                source,
            })
    }
}

/// The SPIFFE identity xDS gives a workload.
pub fn workload_identity(w: &Workload) -> Identity {
    let td = if w.trust_domain.is_empty() {
        DEFAULT_TRUST_DOMAIN
    } else {
        &w.trust_domain
    };
    let sa = if w.service_account.is_empty() {
        "default"
    } else {
        &w.service_account
    };
    Identity::new(td, &w.namespace, sa)
}

/// What metrics and logs know of a workload.
pub fn peer_info(w: Option<&Workload>, principal: Option<&Identity>) -> PeerInfo {
    let mut info = match w {
        Some(w) => PeerInfo {
            name: w.name.clone(),
            workload: w.workload_name.clone(),
            namespace: w.namespace.clone(),
            canonical_service: w.canonical_name.clone(),
            canonical_revision: w.canonical_revision.clone(),
            principal: String::new(),
        },
        None => PeerInfo::default(),
    };
    if let Some(id) = principal {
        info.principal = id.to_string();
    }
    info
}
