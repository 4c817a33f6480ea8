//! [`CertificateManager`]: fetches, caches and renews workload certificates.
//!
//! Ownership: the manager actor task is the only writer of the identity map
//! (published as a [`CertificateView`]) and of the trust bundle (a watch
//! channel); each identity's worker task is the only writer of that
//! identity's [`CertificateState`] (a watch channel). Readers only
//! load/borrow, never wait on a lock, and no lock is held across an await.
//! The `/config_dump` section and the expiry metric read the view; this
//! module does not know them.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use rand::Rng;
use rustls_pki_types::CertificateDer;
use tokio::sync::{Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::ca_client::{CaClient, GrpcCaClient};
use super::cert::{TrustBundle, WorkloadCertificate, generate_key_and_csr};
use super::metrics::{ExpiryCollector, IdentityMetrics};
use super::view::{self, CertificateState, CertificateView, IdentityMap, ViewPublisher};
use super::{Identity, IdentityError};

/// Settings of the certificate manager.
#[derive(Debug, Clone)]
pub struct IdentityConfig {
    /// Lifetime requested from the CA (the CA may cap it). Default 24 h.
    pub cert_ttl: Duration,
    /// CA calls in flight at most, across all identities. Default 8.
    pub max_concurrent_requests: usize,
    /// Time allowed for one CA call. Default 10 s.
    pub ca_request_timeout: Duration,
    /// First retry delay after a failure. Default 500 ms.
    pub backoff_initial: Duration,
    /// Longest retry delay. Default 30 s.
    pub backoff_max: Duration,
    /// Extra trusted roots (`--root-cert`, PEM), always in the bundle.
    pub root_cert: Option<PathBuf>,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        Self {
            cert_ttl: Duration::from_secs(24 * 3600),
            max_concurrent_requests: 8,
            ca_request_timeout: Duration::from_secs(10),
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(30),
            root_cert: None,
        }
    }
}

impl IdentityConfig {
    /// Defaults plus `--root-cert` from the ztunnel configuration.
    pub fn from_config(config: &crate::config::Config) -> Self {
        Self {
            root_cert: config.root_cert.clone(),
            ..Self::default()
        }
    }
}

/// Renewal never happens sooner than this after an issuance.
const MIN_REFRESH: Duration = Duration::from_secs(1);

enum Command {
    /// Start managing `id` if not yet; reply with its state watch.
    Ensure {
        id: Identity,
        reply: Option<oneshot::Sender<watch::Receiver<CertificateState>>>,
    },
    /// Stop managing `id`.
    Forget(Identity),
    /// A worker got a new chain (with this root, if any).
    Issued {
        id: Identity,
        generation: u64,
        root: Option<CertificateDer<'static>>,
    },
}

struct Shared {
    ca: Arc<dyn CaClient>,
    cfg: IdentityConfig,
    permits: Semaphore,
    metrics: IdentityMetrics,
}

/// Fetches, caches and renews the certificates of the workloads on this
/// node. Cheap to clone; the background tasks stop when the last clone is
/// dropped.
#[derive(Clone)]
pub struct CertificateManager {
    commands: mpsc::UnboundedSender<Command>,
    view: CertificateView,
    bundle: watch::Receiver<Arc<TrustBundle>>,
    changes: watch::Receiver<u64>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for CertificateManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateManager")
            .field("identities", &self.view.len())
            .finish_non_exhaustive()
    }
}

impl CertificateManager {
    /// A manager signing through `ca`. Reads `config.root_cert` now (an
    /// unreadable file is an error). Must be called inside a Tokio runtime:
    /// it spawns the manager task.
    pub fn new(config: IdentityConfig, ca: Arc<dyn CaClient>) -> Result<Self, IdentityError> {
        let file_roots = match &config.root_cert {
            Some(path) => TrustBundle::load_pem_file(path)?,
            None => Vec::new(),
        };
        let permits = Semaphore::new(config.max_concurrent_requests.max(1));
        let shared = Arc::new(Shared {
            ca,
            cfg: config,
            permits,
            metrics: IdentityMetrics::default(),
        });
        let (publisher, view) = view::channel();
        let (bundle_tx, bundle) = watch::channel(Arc::new(TrustBundle {
            roots: file_roots.clone(),
        }));
        let (commands, rx) = mpsc::unbounded_channel();
        let (changes_tx, changes) = watch::channel(0u64);
        let actor = Actor {
            shared: shared.clone(),
            rx,
            weak: commands.downgrade(),
            workers: HashMap::new(),
            next_generation: 0,
            view: publisher,
            file_roots,
            roots: HashMap::new(),
            latest_root: None,
            bundle_tx,
            changes: changes_tx,
        };
        tokio::spawn(actor.run());
        Ok(Self {
            commands,
            view,
            bundle,
            changes,
            shared,
        })
    }

    /// The production wiring: a [`GrpcCaClient`] towards
    /// `config.effective_ca_address()` with `--token-file`, and
    /// [`IdentityConfig::from_config`]. Must be called inside a Tokio runtime.
    pub fn from_config(config: &crate::config::Config) -> Result<Self, IdentityError> {
        let client = GrpcCaClient::with_root_cert(
            config.effective_ca_address(),
            config.token_file.clone(),
            config.root_cert.as_deref(),
        )
        .map_err(IdentityError::CaClient)?;
        Self::new(IdentityConfig::from_config(config), Arc::new(client))
    }

    /// A valid certificate for `id`: the cached one, or (on first need) a
    /// freshly issued one. Concurrent calls for one identity share one CA
    /// call. Fails fast with the last error when the CA failed and no
    /// unexpired certificate is left (retries continue in the background).
    pub async fn fetch(&self, id: &Identity) -> Result<Arc<WorkloadCertificate>, IdentityError> {
        let mut rx = self.watch_identity(id).await?;
        loop {
            {
                let state = rx.borrow_and_update();
                if let Some(cert) = state.usable() {
                    return Ok(cert.clone());
                }
                if state.attempted {
                    return Err(IdentityError::Unavailable {
                        identity: id.to_string(),
                        reason: state.unavailable_reason(),
                    });
                }
            }
            if rx.changed().await.is_err() {
                return Err(IdentityError::Forgotten {
                    identity: id.to_string(),
                });
            }
        }
    }

    /// Starts managing `id` (if not yet) and returns the watch its worker
    /// writes: every issuance, renewal and failure, as they happen. The
    /// Envoy agent follows its one identity this way to push renewals over
    /// SDS.
    pub(crate) async fn watch_identity(
        &self,
        id: &Identity,
    ) -> Result<watch::Receiver<CertificateState>, IdentityError> {
        if let Some(rx) = self.view.get(id) {
            return Ok(rx);
        }
        let (reply, wait) = oneshot::channel();
        self.commands
            .send(Command::Ensure {
                id: id.clone(),
                reply: Some(reply),
            })
            .map_err(|_| IdentityError::Shutdown)?;
        wait.await.map_err(|_| IdentityError::Shutdown)
    }

    /// Starts fetching certificates for `ids` (the pods on this node) in the
    /// background, without waiting.
    pub fn prefetch(&self, ids: impl IntoIterator<Item = Identity>) {
        for id in ids {
            let _ = self.commands.send(Command::Ensure { id, reply: None });
        }
    }

    /// Stops managing `id` (its last pod left the node): no more renewals;
    /// waiting fetches fail with [`IdentityError::Forgotten`].
    pub fn forget(&self, id: &Identity) {
        let _ = self.commands.send(Command::Forget(id.clone()));
    }

    /// The certificate `id` holds now (possibly expired), if `id` is
    /// managed. Caches built from another certificate of `id`, or of an
    /// identity that is no longer managed, are stale.
    pub fn current(&self, id: &Identity) -> Option<Arc<WorkloadCertificate>> {
        self.view.get(id).and_then(|rx| rx.borrow().cert.clone())
    }

    /// Bumped after every change of the managed set or of a certificate
    /// (an identity forgotten, a certificate issued or renewed): what holds
    /// copies of certificates or keys watches it to drop stale ones.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.clone()
    }

    /// The identities currently managed, sorted.
    pub fn identities(&self) -> Vec<Identity> {
        self.view.identities()
    }

    /// A read-only view of every managed identity's certificate state (what
    /// `/config_dump` and the expiry metric show).
    pub fn view(&self) -> CertificateView {
        self.view.clone()
    }

    /// The trust bundle, updated whenever a new root appears.
    pub fn trust_bundle(&self) -> watch::Receiver<Arc<TrustBundle>> {
        self.bundle.clone()
    }

    /// The CA request metrics.
    pub fn metrics(&self) -> &IdentityMetrics {
        &self.shared.metrics
    }

    /// Registers `ztunnel_ca_requests_total`, `ztunnel_ca_request_duration_seconds`
    /// and `ztunnel_certificate_expiry_seconds{identity}` in `registry`.
    pub fn register_metrics(&self, registry: &mut Registry) {
        self.shared.metrics.register(registry);
        registry.register_collector(Box::new(ExpiryCollector {
            view: self.view.clone(),
        }));
    }
}

/// Aborts a worker task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Worker {
    generation: u64,
    state: watch::Receiver<CertificateState>,
    _task: AbortOnDrop,
}

/// The single writer of the identity map and the trust bundle.
struct Actor {
    shared: Arc<Shared>,
    rx: mpsc::UnboundedReceiver<Command>,
    /// Handed to workers; weak so the actor ends with the last manager handle.
    weak: mpsc::WeakUnboundedSender<Command>,
    workers: HashMap<Identity, Worker>,
    next_generation: u64,
    view: ViewPublisher,
    file_roots: Vec<CertificateDer<'static>>,
    /// The root of each identity's current chain.
    roots: HashMap<Identity, CertificateDer<'static>>,
    /// The root of the newest chain of any identity (kept after forget).
    latest_root: Option<CertificateDer<'static>>,
    bundle_tx: watch::Sender<Arc<TrustBundle>>,
    /// See [`CertificateManager::changes`].
    changes: watch::Sender<u64>,
}

impl Actor {
    async fn run(mut self) {
        while let Some(cmd) = self.rx.recv().await {
            match cmd {
                Command::Ensure { id, reply } => {
                    let state = self.ensure(id);
                    if let Some(reply) = reply {
                        let _ = reply.send(state);
                    }
                }
                Command::Forget(id) => {
                    if self.workers.remove(&id).is_some() {
                        tracing::debug!(identity = %id, "no longer managing certificate");
                        self.roots.remove(&id);
                        self.publish_view();
                        self.publish_bundle();
                        self.changes.send_modify(|n| *n += 1);
                    }
                }
                Command::Issued {
                    id,
                    generation,
                    root,
                } => {
                    let current = self.workers.get(&id).map(|w| w.generation);
                    if current != Some(generation) {
                        continue; // a forgotten worker's late message
                    }
                    match root {
                        Some(root) => {
                            self.latest_root = Some(root.clone());
                            self.roots.insert(id, root);
                        }
                        None => {
                            self.roots.remove(&id);
                        }
                    }
                    self.publish_bundle();
                    // The worker published the new certificate before
                    // sending this, so watchers see it already.
                    self.changes.send_modify(|n| *n += 1);
                }
            }
        }
        // Last handle dropped: dropping `self.workers` aborts every worker.
    }

    fn ensure(&mut self, id: Identity) -> watch::Receiver<CertificateState> {
        if let Some(w) = self.workers.get(&id) {
            return w.state.clone();
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        let (tx, state) = watch::channel(CertificateState::default());
        let task = tokio::spawn(run_worker(
            self.shared.clone(),
            id.clone(),
            generation,
            tx,
            self.weak.clone(),
        ));
        self.workers.insert(
            id,
            Worker {
                generation,
                state: state.clone(),
                _task: AbortOnDrop(task),
            },
        );
        self.publish_view();
        state
    }

    fn publish_view(&self) {
        let map: IdentityMap = self
            .workers
            .iter()
            .map(|(id, w)| (id.clone(), w.state.clone()))
            .collect();
        self.view.publish(map);
    }

    fn publish_bundle(&self) {
        let mut extra: Vec<CertificateDer<'static>> = self
            .roots
            .values()
            .chain(self.latest_root.iter())
            .cloned()
            .collect();
        extra.sort_by(|a, b| a.as_ref().cmp(b.as_ref()));
        extra.dedup();
        let mut roots = self.file_roots.clone();
        for root in extra {
            if !roots.contains(&root) {
                roots.push(root);
            }
        }
        self.bundle_tx.send_if_modified(|bundle| {
            if bundle.roots == roots {
                false
            } else {
                tracing::info!(roots = roots.len(), "trust bundle changed");
                *bundle = Arc::new(TrustBundle { roots });
                true
            }
        });
    }
}

/// `d` scaled by a random factor in [0.9, 1.1].
fn jitter(d: Duration) -> Duration {
    d.mul_f64(rand::rng().random_range(0.9..=1.1))
}

/// The single writer of one identity's certificate state: issue, renew, retry.
async fn run_worker(
    shared: Arc<Shared>,
    id: Identity,
    generation: u64,
    tx: watch::Sender<CertificateState>,
    actor: mpsc::WeakUnboundedSender<Command>,
) {
    let cfg = &shared.cfg;
    let mut backoff = cfg.backoff_initial;
    loop {
        match issue(&shared, &id).await {
            Ok(cert) => {
                backoff = cfg.backoff_initial;
                let refresh_in = jitter(cert.time_to_expiry() / 2).max(MIN_REFRESH);
                tracing::info!(
                    identity = %id,
                    serial = %cert.serial_hex(),
                    refresh_in_secs = refresh_in.as_secs(),
                    "certificate issued"
                );
                let root = cert.root().cloned();
                tx.send_replace(CertificateState {
                    cert: Some(Arc::new(cert)),
                    last_error: None,
                    attempted: true,
                });
                if let Some(actor) = actor.upgrade() {
                    let _ = actor.send(Command::Issued {
                        id: id.clone(),
                        generation,
                        root,
                    });
                }
                tokio::time::sleep(refresh_in).await;
            }
            Err(e) => {
                let wait = jitter(backoff);
                backoff = (backoff * 2).min(cfg.backoff_max);
                let old_valid = tx.borrow().usable().is_some();
                tracing::warn!(
                    identity = %id,
                    error = %e,
                    retry_in_ms = wait.as_millis(),
                    old_certificate_serving = old_valid,
                    "certificate request failed"
                );
                tx.send_modify(|state| {
                    state.last_error = Some(e.to_string());
                    state.attempted = true;
                });
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// One issuance: key, CSR, CA call (bounded by the semaphore and the
/// timeout), validation.
async fn issue(shared: &Shared, id: &Identity) -> Result<WorkloadCertificate, IdentityError> {
    let (key, csr) = generate_key_and_csr(id)?;
    let permit = shared
        .permits
        .acquire()
        .await
        .map_err(|_| IdentityError::Shutdown)?;
    let started = Instant::now();
    let timeout = shared.cfg.ca_request_timeout;
    let answer = tokio::time::timeout(timeout, shared.ca.sign(id, csr, shared.cfg.cert_ttl)).await;
    drop(permit);
    let result = match answer {
        Err(_) => Err(IdentityError::CaTimeout {
            identity: id.to_string(),
            timeout_ms: timeout.as_millis(),
        }),
        Ok(Err(source)) => Err(IdentityError::Ca {
            identity: id.to_string(),
            source,
        }),
        Ok(Ok(chain)) => WorkloadCertificate::from_chain(id, &key, chain),
    };
    shared.metrics.record(result.is_ok(), started.elapsed());
    result
}
