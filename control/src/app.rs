//! Wiring of the control plane: listeners, the model, the config source
//! (a directory in local mode, the API server in Kubernetes mode), the xDS
//! server, the CA and the monitoring server. Binaries, tests and benchmarks all
//! start the control plane through [`ControlPlane::start`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tracing::{info, warn};

use crate::ca::{
    CaError, CaMetrics, CaService, CaServiceOptions, CaStore, NodeTokenFile, SignerOptions,
    SnapshotPodLocator, TokenAuthenticator, TokenReview,
};
use crate::config::{ControlConfig, SourceChoice};
use crate::debug::{DebugState, ReadinessCheck, always_ready};
use crate::model::snapshot::Snapshot;
use crate::model::spawn_model;
use crate::source::file::{FileSource, FileSourceError, spawn_file_source};
use crate::source::kube::{KubeSource, KubeSourceOptions};
use crate::xds::{Generators, ProxyRegistry, XdsAccess, XdsMetrics, XdsServer};

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("cannot listen for {what} on {addr}: {source}; is another process using the port?")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot read the config directory: {0}")]
    Source(#[from] FileSourceError),
    #[error(transparent)]
    Flags(#[from] crate::config::FlagError),
    #[error("Kubernetes: {0}")]
    Kube(#[from] crate::k8s::K8sError),
    #[error("the mesh model stopped before delivering its first snapshot")]
    ModelStopped,
    #[error("cannot set up the certificate authority: {0}")]
    Ca(#[from] CaError),
}

/// A running control plane.
pub struct ControlPlane {
    xds_addr: SocketAddr,
    xds_tls_addr: SocketAddr,
    monitoring_addr: SocketAddr,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    proxies: Arc<ProxyRegistry>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    _source: Source,
}

/// The running config source.
enum Source {
    // Held: dropping it stops watching the directory.
    File(#[allow(dead_code)] FileSource),
    Kube {
        source: Arc<KubeSource>,
        #[allow(dead_code)] // used by the leader's writers (next step)
        client: kube::Client,
    },
}

fn kube_source_options(cfg: &ControlConfig) -> KubeSourceOptions {
    KubeSourceOptions {
        relist_every: (cfg.kube_relist_secs > 0).then(|| Duration::from_secs(cfg.kube_relist_secs)),
        retry_max: Duration::from_millis(cfg.kube_retry_max_ms),
        ..KubeSourceOptions::default()
    }
}

/// `/ready` in Kubernetes mode: every watch listed once (the model's
/// synced flag follows) and the gRPC servers running.
fn kube_readiness(source: Arc<KubeSource>, serving: Arc<AtomicBool>) -> ReadinessCheck {
    Arc::new(move || {
        let waiting = source.waiting_for();
        if !waiting.is_empty() {
            return Err(format!(
                "waiting for the Kubernetes watches to list: {}",
                waiting.join("; ")
            ));
        }
        if !serving.load(Ordering::Acquire) {
            return Err("the CA is not loaded yet, so xDS and the CA do not serve".into());
        }
        Ok(())
    })
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, AppError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Bind { what, addr, source })
}

fn local_addr(
    what: &'static str,
    l: &TcpListener,
    addr: SocketAddr,
) -> Result<SocketAddr, AppError> {
    l.local_addr()
        .map_err(|source| AppError::Bind { what, addr, source })
}

impl ControlPlane {
    /// Binds every listener, starts the config source and starts serving.
    ///
    /// Local mode (`--config-dir`): returns once the first snapshot of the
    /// directory is published. Kubernetes mode: returns once the servers
    /// run; `/ready` stays 503 and xDS streams wait until every watch has
    /// listed its kind once ([`Self::wait_synced`]).
    pub async fn start(cfg: ControlConfig) -> Result<Self, AppError> {
        Self::start_with_generators(cfg, Generators::standard()).await
    }

    /// [`ControlPlane::start`] with the given xDS generators (tests and
    /// embedders that serve a proxy kind the standard set does not).
    pub async fn start_with_generators(
        cfg: ControlConfig,
        generators: Generators,
    ) -> Result<Self, AppError> {
        let choice = cfg.source()?;
        let xds_listener = if cfg.no_xds_plaintext {
            None
        } else {
            Some(bind("xDS (plaintext gRPC)", cfg.xds_plaintext_addr).await?)
        };
        let tls_listener = bind("xDS + CA (TLS gRPC)", cfg.xds_tls_addr).await?;
        let mon_listener = bind("monitoring (HTTP)", cfg.monitoring_addr).await?;
        let xds_addr = match &xds_listener {
            Some(l) => local_addr("xDS", l, cfg.xds_plaintext_addr)?,
            None => cfg.xds_plaintext_addr,
        };
        let xds_tls_addr = local_addr("xDS TLS", &tls_listener, cfg.xds_tls_addr)?;
        let monitoring_addr = local_addr("monitoring", &mon_listener, cfg.monitoring_addr)?;

        let (model, mut snapshots) = spawn_model(cfg.model_options());
        let mut registry = Registry::default();
        let xds_metrics = XdsMetrics::register(&mut registry);
        let model_metrics = ModelMetrics::register(&mut registry);
        let ca_metrics = CaMetrics::register(&mut registry);
        let proxies = Arc::new(ProxyRegistry::default());
        let (shutdown, shutdown_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        // Set once the gRPC servers run (the CA is loaded).
        let serving = Arc::new(AtomicBool::new(false));

        let (source, readiness) = match &choice {
            SourceChoice::Dir(dir) => {
                let source = spawn_file_source(dir.clone(), model).await?;
                snapshots
                    .wait_for(|s| s.synced)
                    .await
                    .map_err(|_| AppError::ModelStopped)?;
                (Source::File(source), always_ready())
            }
            SourceChoice::Kube(access) => {
                let client = crate::k8s::client(access).await?;
                let source = Arc::new(KubeSource::spawn(
                    client.clone(),
                    model,
                    kube_source_options(&cfg),
                ));
                let readiness = kube_readiness(source.clone(), serving.clone());
                (Source::Kube { source, client }, readiness)
            }
        };
        tasks.push(tokio::spawn(model_metrics.run(snapshots.clone())));

        let debug = DebugState {
            snapshots: snapshots.clone(),
            proxies: proxies.clone(),
            metrics: Arc::new(registry),
            readiness,
        };
        tasks.push(tokio::spawn(crate::http::serve(
            mon_listener,
            debug.handler(),
            shutdown_rx.clone(),
        )));

        let authenticator = authenticator(&cfg);
        let store = CaStore::load_or_create(&cfg.data_dir.join("ca"), cfg.ca_dir.as_deref())?;
        let ca = build_ca(
            &cfg,
            store,
            authenticator.clone(),
            snapshots.clone(),
            ca_metrics,
        );
        let xds = XdsServer::with_generators(
            snapshots.clone(),
            generators,
            XdsAccess::new(
                authenticator.clone(),
                CaServiceOptions::default().node_proxy_identities,
            ),
            proxies.clone(),
            xds_metrics,
        );
        let tls_config = Arc::new(ca.server_tls_config(&cfg.tls_names)?);
        let tls_incoming =
            crate::tls_listener::incoming(tls_listener, tls_config, shutdown_rx.clone());
        let mut incomings = vec![("TLS", Incoming::Tls(tls_incoming))];
        if let Some(l) = xds_listener {
            incomings.push(("plaintext", Incoming::Plain(TcpListenerStream::new(l))));
        }
        for (what, incoming) in incomings {
            let router = tonic::transport::Server::builder()
                .tcp_nodelay(true)
                // What one client connection may make the server hold: a
                // proxy needs one xDS stream and a few CA calls.
                .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
                .http2_max_header_list_size(Some(MAX_HEADER_LIST_BYTES))
                .http2_max_pending_accept_reset_streams(Some(64))
                .http2_keepalive_interval(Some(Duration::from_secs(30)))
                .http2_keepalive_timeout(Some(Duration::from_secs(20)))
                .tcp_keepalive(Some(Duration::from_secs(60)))
                .initial_connection_window_size(Some(16 << 20))
                .initial_stream_window_size(Some(8 << 20))
                .add_service(xds.clone().into_service())
                .add_service(ca.clone().into_server());
            let mut stop = shutdown_rx.clone();
            let stopped = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            tasks.push(tokio::spawn(async move {
                let result = match incoming {
                    Incoming::Plain(i) => router.serve_with_incoming_shutdown(i, stopped).await,
                    Incoming::Tls(i) => router.serve_with_incoming_shutdown(i, stopped).await,
                };
                if let Err(e) = result {
                    warn!("{what} gRPC server stopped: {e}");
                }
            }));
        }
        serving.store(true, Ordering::Release);

        match &choice {
            SourceChoice::Dir(dir) => info!(
                %xds_addr, %xds_tls_addr, %monitoring_addr, config_dir = %dir.display(),
                "control plane serving (local mode)"
            ),
            SourceChoice::Kube(access) => info!(
                %xds_tls_addr, %monitoring_addr, ?access,
                "control plane serving (Kubernetes mode); ready once every watch has listed its kind"
            ),
        }
        Ok(Self {
            xds_addr,
            xds_tls_addr,
            monitoring_addr,
            snapshots,
            proxies,
            shutdown,
            tasks,
            _source: source,
        })
    }

    /// Waits until the model's snapshot holds the sources' complete initial
    /// state (at once in local mode, where [`Self::start`] waited already).
    pub async fn wait_synced(&self) -> Result<(), AppError> {
        let mut rx = self.snapshots.clone();
        rx.wait_for(|s| s.synced)
            .await
            .map(|_| ())
            .map_err(|_| AppError::ModelStopped)
    }

    /// The Kubernetes source, in Kubernetes mode.
    pub fn kube_source(&self) -> Option<&KubeSource> {
        match &self._source {
            Source::Kube { source, .. } => Some(source),
            Source::File(_) => None,
        }
    }

    /// Where xDS is served (plaintext gRPC).
    pub fn xds_addr(&self) -> SocketAddr {
        self.xds_addr
    }

    /// Where xDS and the CA are served over TLS (the production endpoint).
    pub fn xds_tls_addr(&self) -> SocketAddr {
        self.xds_tls_addr
    }

    /// Where `/metrics`, `/ready` and `/debug` are served.
    pub fn monitoring_addr(&self) -> SocketAddr {
        self.monitoring_addr
    }

    /// The model's published snapshots.
    pub fn snapshots(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.snapshots.clone()
    }

    /// Connected proxies.
    pub fn proxies(&self) -> &ProxyRegistry {
        &self.proxies
    }

    /// Stops the servers and waits for them.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            t.abort();
            let _ = t.await;
        }
    }
}

/// Bearer-token authentication shared by xDS and the CA: node tokens in
/// local mode, TokenReview in Kubernetes.
fn authenticator(cfg: &ControlConfig) -> Arc<dyn TokenAuthenticator> {
    match &cfg.node_tokens_file {
        Some(path) => Arc::new(NodeTokenFile::new(path)),
        None => Arc::new(TokenReview),
    }
}

/// Concurrent HTTP/2 streams per gRPC connection (15010, 15012).
pub const MAX_STREAMS_PER_CONNECTION: u32 = 100;
/// Largest request header block accepted on the gRPC ports.
pub const MAX_HEADER_LIST_BYTES: u32 = 64 << 10;

/// The CA served next to xDS: the persisted (or plugged-in) root, node
/// tokens in local mode, pod placement from the model's snapshots.
fn build_ca(
    cfg: &ControlConfig,
    store: CaStore,
    authenticator: Arc<dyn TokenAuthenticator>,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    metrics: CaMetrics,
) -> CaService {
    let opts = CaServiceOptions {
        signer: SignerOptions {
            trust_domain: cfg.trust_domain.clone(),
            max_ttl: Duration::from_secs(cfg.max_cert_ttl_secs),
            ..SignerOptions::default()
        },
        ..CaServiceOptions::default()
    };
    CaService::new(
        Arc::new(store),
        opts,
        authenticator,
        Arc::new(SnapshotPodLocator::new(snapshots)),
        metrics,
    )
}

/// The two gRPC listeners' connection streams.
enum Incoming {
    Plain(TcpListenerStream),
    Tls(
        tokio_stream::wrappers::ReceiverStream<std::io::Result<crate::tls_listener::TlsConnection>>,
    ),
}

/// Metrics about the model itself.
#[derive(Debug, Clone)]
struct ModelMetrics {
    snapshots: Counter,
    build_seconds: Histogram,
    resources: Family<Vec<(&'static str, String)>, Gauge>,
    config_errors: Gauge,
}

impl ModelMetrics {
    fn register(registry: &mut Registry) -> Self {
        let m = Self {
            snapshots: Counter::default(),
            build_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            resources: Family::default(),
            config_errors: Gauge::default(),
        };
        registry.register(
            "ambit_model_snapshots",
            "Snapshots of the mesh published",
            m.snapshots.clone(),
        );
        registry.register(
            "ambit_model_build_seconds",
            "Time to translate and encode one snapshot",
            m.build_seconds.clone(),
        );
        registry.register(
            "ambit_model_resources",
            "xDS resources in the current snapshot",
            m.resources.clone(),
        );
        registry.register(
            "ambit_config_errors",
            "Config documents currently rejected (see /debug/config_errors)",
            m.config_errors.clone(),
        );
        m
    }

    async fn run(self, mut snapshots: watch::Receiver<Arc<Snapshot>>) {
        let mut seen = std::collections::BTreeSet::new();
        loop {
            {
                let s = snapshots.borrow_and_update().clone();
                self.snapshots.inc();
                self.build_seconds.observe(s.build_time.as_secs_f64());
                let counts = s.counts_by_type();
                // A type that vanished drops to 0 rather than keep a stale value.
                for gone in seen.difference(&counts.keys().cloned().collect()) {
                    self.resources
                        .get_or_create(&vec![("type", gone.clone())])
                        .set(0);
                }
                seen = counts.keys().cloned().collect();
                for (t, n) in counts {
                    self.resources
                        .get_or_create(&vec![("type", t)])
                        .set(n as i64);
                }
                self.config_errors.set(s.errors.len() as i64);
            }
            if snapshots.changed().await.is_err() {
                return;
            }
        }
    }
}
