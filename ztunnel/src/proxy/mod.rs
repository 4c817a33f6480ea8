//! The node proxy's data path: for each enrolled pod, three listeners made
//! inside the pod's network namespace hand their connections here.
//!
//! ```text
//!  app ──(REDIRECT)──▶ :15001 outbound ─ resolve ─┬─ HBONE: pool ══ mTLS + CONNECT ══▶ peer pod :15008
//!                                                 └─ plain TCP (non-mesh / unknown)
//!  peer ztunnel ══ mTLS ══▶ :15008 inbound HBONE ─ address + policy check ─▶ app (inside the pod)
//!  plaintext client ─(REDIRECT)─▶ :15006 inbound ─ policy (STRICT denies) ─▶ app (inside the pod)
//! ```
//!
//! * [`ProxyContext`] is shared by every pod: state reader, certificates,
//!   the HBONE pool, metrics, the policy cache and a TLS config cache.
//! * [`Pod`] is one enrolled pod: its identity, a socket thread inside its
//!   netns ([`NetnsSockets`]) and its own drain signal, so removing a pod
//!   drains only its connections.
//! * Every connection is one task with one [`metrics::ConnectionResult`]
//!   (metrics + one access-log line) and ends within
//!   [`DRAIN_DEADLINE`] once its pod or the whole ztunnel drains.

pub mod inbound;
pub mod live;
pub mod metrics;
pub mod outbound;
mod resolve;

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use hyper::http::StatusCode;
use rustls::{ClientConfig, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

use crate::copy::{CopyConfig, CopyError, copy_bidirectional};
use crate::drain::{DRAIN_DEADLINE, DrainWatcher};
use crate::hbone::HbonePool;
use crate::hbone::{ClientError, PoolError, ServerError, TlsError, client_config, server_config};
use crate::identity::{
    CertificateManager, Identity, IdentityError, TrustBundle, WorkloadCertificate,
};
use crate::rbac::PolicyCache;
use crate::state::{StateReader, StateSnapshot, Workload};
use ambit_inpod::{NetnsSockets, SocketOptions, ZTUNNEL_MARK};

use self::metrics::{PeerInfo, TcpMetrics};

pub use resolve::{Resolved, resolve};

/// Trust domain of workloads that do not name one.
pub const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";

/// Why a proxied connection failed; each ends up in the access log.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error(
        "cannot read the original destination of a redirected connection: {0} (is the pod's redirection installed with REDIRECT?)"
    )]
    OriginalDst(io::Error),
    #[error("connection to {0} refused: it would loop back into ztunnel")]
    Loop(SocketAddr),
    #[error("{addr} is not an address of pod {pod} on this node; refusing (never an open proxy)")]
    NotThisPod { addr: SocketAddr, pod: String },
    #[error("service {service} has no healthy endpoint for port {port}")]
    NoHealthyEndpoint { service: String, port: u16 },
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
        "closed after the drain deadline ({DRAIN_DEADLINE:?}) while the pod or ztunnel was shutting down"
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
            ProxyError::Copy(_) | ProxyError::Drained | ProxyError::HboneServer(_) => {
                F::DownstreamTerminated
            }
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

struct CachedClient {
    cert: Arc<WorkloadCertificate>,
    bundle: Arc<TrustBundle>,
    config: Arc<ClientConfig>,
}

/// What every pod's proxies share.
pub struct ProxyContext {
    pub node: String,
    pub cluster_id: String,
    pub network: Arc<str>,
    pub state: StateReader,
    pub certificates: CertificateManager,
    pub pool: HbonePool,
    pub tcp: TcpMetrics,
    pub policies: Arc<PolicyCache>,
    pub cfg: ProxyConfig,
    /// Inbound connections, rechecked when policy changes.
    pub live: Arc<live::LiveConnections>,
    client_tls: Mutex<HashMap<(Identity, Identity), CachedClient>>,
    /// Round-robin cursor for endpoint picks.
    rr: AtomicUsize,
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
        tcp: TcpMetrics,
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
            tcp,
            policies,
            cfg,
            live: Arc::default(),
            client_tls: Mutex::new(HashMap::new()),
            rr: AtomicUsize::new(0),
        }
    }

    fn bundle(&self) -> Arc<TrustBundle> {
        self.certificates.trust_bundle().borrow().clone()
    }

    /// The client TLS config presenting `cert` and pinning `peer`, cached
    /// until the certificate or the trust bundle changes.
    fn client_config(
        &self,
        cert: &Arc<WorkloadCertificate>,
        peer: &Identity,
    ) -> Result<Arc<ClientConfig>, TlsError> {
        let bundle = self.bundle();
        let key = (cert.identity.clone(), peer.clone());
        let mut cache = self
            .client_tls
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = cache.get(&key)
            && Arc::ptr_eq(&c.cert, cert)
            && Arc::ptr_eq(&c.bundle, &bundle)
        {
            return Ok(c.config.clone());
        }
        let config = Arc::new(client_config(cert, &bundle, peer.clone())?);
        cache.insert(
            key,
            CachedClient {
                cert: cert.clone(),
                bundle,
                config: config.clone(),
            },
        );
        Ok(config)
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

struct CachedServer {
    cert: Arc<WorkloadCertificate>,
    bundle: Arc<TrustBundle>,
    config: Arc<ServerConfig>,
}

/// One enrolled pod, as its proxies see it.
pub struct Pod {
    pub uid: String,
    pub name: Arc<str>,
    pub namespace: Arc<str>,
    pub service_account: String,
    /// Makes sockets inside the pod's netns.
    pub sockets: NetnsSockets,
    /// Fires when the pod is removed or ztunnel drains.
    pub drain: DrainWatcher,
    server_tls: Mutex<Option<CachedServer>>,
    /// Each connection task holds a clone; the manager waits for all of
    /// them to be dropped when the pod goes.
    tracker: mpsc::Sender<()>,
}

impl std::fmt::Debug for Pod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

impl std::fmt::Display for Pod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Resolves once every connection of a pod has ended.
pub struct PodConnections(mpsc::Receiver<()>);

impl PodConnections {
    /// Waits for the pod's connections to end.
    pub async fn closed(mut self) {
        while self.0.recv().await.is_some() {}
    }
}

/// A guard held by a connection task for its pod.
pub struct ConnGuard(#[allow(dead_code)] mpsc::Sender<()>);

impl Pod {
    /// A pod; the returned [`PodConnections`] resolves once its
    /// connections (each holding a [`ConnGuard`]) have ended.
    pub fn new(
        uid: String,
        name: String,
        namespace: String,
        service_account: String,
        sockets: NetnsSockets,
        drain: DrainWatcher,
    ) -> (Self, PodConnections) {
        let (tracker, rx) = mpsc::channel(1);
        (
            Self {
                uid,
                name: name.into(),
                namespace: namespace.into(),
                service_account,
                sockets,
                drain,
                server_tls: Mutex::new(None),
                tracker,
            },
            PodConnections(rx),
        )
    }

    /// Marks a connection as running for this pod.
    pub fn guard(&self) -> ConnGuard {
        ConnGuard(self.tracker.clone())
    }

    /// The pod's identity: the one xDS gives its workload (what peers
    /// verify) when xDS knows it, else the node agent's namespace and
    /// service account in the default trust domain.
    pub fn identity(&self, ctx: &ProxyContext, snap: &StateSnapshot) -> Identity {
        let uid = format!("{}//Pod/{}/{}", ctx.cluster_id, self.namespace, self.name);
        if let Some(w) = snap.workload_by_uid(&uid) {
            return workload_identity(&w);
        }
        let sa = if self.service_account.is_empty() {
            "default"
        } else {
            &self.service_account
        };
        Identity::new(DEFAULT_TRUST_DOMAIN, &*self.namespace, sa)
    }

    /// Whether `w` is this pod.
    pub fn is(&self, w: &Workload) -> bool {
        *w.name == *self.name && *w.namespace == *self.namespace
    }

    /// The pod's namespace, shared.
    pub fn namespace_arc(&self) -> Arc<str> {
        self.namespace.clone()
    }

    /// The pod's name, shared.
    pub fn name_arc(&self) -> Arc<str> {
        self.name.clone()
    }

    /// The workload of this pod that owns `ip`, if `ip` is one of its
    /// addresses.
    pub fn workload_at(
        &self,
        ctx: &ProxyContext,
        snap: &StateSnapshot,
        ip: IpAddr,
    ) -> Option<Arc<Workload>> {
        snap.workload_by_ip(&ctx.network, ip.to_canonical())
            .filter(|w| self.is(w))
    }

    /// The HBONE server config for this pod's certificate, cached until the
    /// certificate or the trust bundle changes.
    async fn server_config(&self, ctx: &ProxyContext) -> Result<Arc<ServerConfig>, ProxyError> {
        let id = self.identity(ctx, &ctx.state.load());
        let cert = ctx.certificate(&id).await?;
        let bundle = ctx.bundle();
        let mut cached = self
            .server_tls
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = cached.as_ref()
            && Arc::ptr_eq(&c.cert, &cert)
            && Arc::ptr_eq(&c.bundle, &bundle)
        {
            return Ok(c.config.clone());
        }
        let config = Arc::new(
            server_config(&cert, &bundle).map_err(|source| ProxyError::Tls {
                identity: id.clone(),
                source,
            })?,
        );
        *cached = Some(CachedServer {
            cert,
            bundle,
            config: config.clone(),
        });
        Ok(config)
    }

    /// Connects to `dst` from inside the pod, marked so the pod's rules let
    /// it through; from `src` (the original client) when transparent.
    async fn connect(
        &self,
        ctx: &ProxyContext,
        dst: SocketAddr,
        src: Option<IpAddr>,
    ) -> Result<tokio::net::TcpStream, ProxyError> {
        let bind = src
            .filter(|ip| ip.is_ipv4() == dst.is_ipv4())
            .map(|ip| SocketAddr::new(ip, 0));
        let opts = SocketOptions {
            mark: Some(ctx.cfg.mark),
            transparent: bind.is_some(),
            bind,
        };
        let timeout = ctx.cfg.connect_timeout;
        let stream = tokio::time::timeout(timeout, self.sockets.connect(dst, &opts))
            .await
            .map_err(|_| ProxyError::ConnectTimeout { dst, timeout })?
            .map_err(|source| ProxyError::Connect { dst, source })?;
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }
}

/// Copies both ways until done; once the pod drains, gives the connection
/// [`DRAIN_DEADLINE`] more, then closes it. A revoked connection (a policy
/// change denies it) is closed at once.
async fn copy_until_drained<A, B>(
    pod: &Pod,
    a: A,
    b: B,
    cfg: &CopyConfig,
    revoked: Option<live::Revoked>,
) -> Result<(u64, u64), ProxyError>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let copy = copy_bidirectional(a, b, cfg);
    tokio::pin!(copy);
    let revoked = async {
        match revoked {
            // A dropped sender means "no longer tracked", not "revoked".
            Some(rx) => match rx.await {
                Ok(policy) => policy,
                Err(_) => std::future::pending().await,
            },
            None => std::future::pending().await,
        }
    };
    tokio::pin!(revoked);
    tokio::select! {
        r = &mut copy => return r.map_err(ProxyError::from),
        policy = &mut revoked => return Err(ProxyError::Revoked { policy }),
        _ = pod.drain.signaled() => {}
    }
    tokio::select! {
        r = tokio::time::timeout(DRAIN_DEADLINE, copy) => match r {
            Ok(r) => r.map_err(ProxyError::from),
            Err(_) => Err(ProxyError::Drained),
        },
        policy = revoked => Err(ProxyError::Revoked { policy }),
    }
}

/// Accepts until the pod drains; `handle` runs each connection as a task.
async fn accept_loop<F, Fut>(
    listener: tokio::net::TcpListener,
    pod: Arc<Pod>,
    role: &str,
    handle: F,
) where
    F: Fn(tokio::net::TcpStream, SocketAddr) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    loop {
        let accepted = tokio::select! {
            _ = pod.drain.signaled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                tokio::spawn(handle(stream, peer));
            }
            Err(e) => {
                tracing::warn!(pod = %pod, role, error = %e, "accept failed");
                // E.g. out of fds: do not spin.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}
