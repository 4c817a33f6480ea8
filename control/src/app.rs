//! Wiring of the control plane: listeners, the model, the file source, the
//! xDS server and the monitoring server. Binaries, tests and benchmarks all
//! start the control plane through [`ControlPlane::start`].

use std::net::SocketAddr;
use std::sync::Arc;
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
use crate::config::ControlConfig;
use crate::debug::DebugState;
use crate::model::snapshot::Snapshot;
use crate::model::spawn_model;
use crate::source::file::{
    FileSource, FileSourceError, spawn_extra_file_source, spawn_file_source,
};
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
    _source: FileSource,
    _extra_sources: Vec<FileSource>,
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
    /// Binds every listener, loads the config directory and starts serving.
    /// Returns once the first snapshot of the config is published.
    pub async fn start(cfg: ControlConfig) -> Result<Self, AppError> {
        Self::start_with_generators(cfg, Generators::standard()).await
    }

    /// [`ControlPlane::start`] with the given xDS generators (tests and
    /// embedders that serve a proxy kind the standard set does not).
    pub async fn start_with_generators(
        cfg: ControlConfig,
        generators: Generators,
    ) -> Result<Self, AppError> {
        let xds_listener = bind("xDS (plaintext gRPC)", cfg.xds_plaintext_addr).await?;
        let tls_listener = bind("xDS + CA (TLS gRPC)", cfg.xds_tls_addr).await?;
        let mon_listener = bind("monitoring (HTTP)", cfg.monitoring_addr).await?;
        let xds_addr = local_addr("xDS", &xds_listener, cfg.xds_plaintext_addr)?;
        let xds_tls_addr = local_addr("xDS TLS", &tls_listener, cfg.xds_tls_addr)?;
        let monitoring_addr = local_addr("monitoring", &mon_listener, cfg.monitoring_addr)?;

        let (model, mut snapshots) = spawn_model(cfg.model_options());
        // Extra directories first: their initial state does not mark the
        // model synced, the main directory's (sent last) does, so the first
        // synced snapshot holds all of them.
        let mut extra_sources = Vec::with_capacity(cfg.extra_config_dirs.len());
        for dir in &cfg.extra_config_dirs {
            extra_sources.push(spawn_extra_file_source(dir.clone(), model.clone()).await?);
        }
        let source = spawn_file_source(cfg.config_dir.clone(), model).await?;
        snapshots
            .wait_for(|s| s.synced)
            .await
            .map_err(|_| AppError::ModelStopped)?;

        let mut registry = Registry::default();
        let xds_metrics = XdsMetrics::register(&mut registry);
        let model_metrics = ModelMetrics::register(&mut registry);
        let proxies = Arc::new(ProxyRegistry::default());
        let (shutdown, shutdown_rx) = watch::channel(false);
        let mut tasks = Vec::new();

        tasks.push(tokio::spawn(model_metrics.run(snapshots.clone())));

        let authenticator = authenticator(&cfg);
        let ca = build_ca(
            &cfg,
            authenticator.clone(),
            snapshots.clone(),
            CaMetrics::register(&mut registry),
        )?;
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
        for (what, incoming) in [
            (
                "plaintext",
                Incoming::Plain(TcpListenerStream::new(xds_listener)),
            ),
            ("TLS", Incoming::Tls(tls_incoming)),
        ] {
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

        let debug = DebugState {
            snapshots: snapshots.clone(),
            proxies: proxies.clone(),
            metrics: Arc::new(registry),
        };
        tasks.push(tokio::spawn(crate::http::serve(
            mon_listener,
            debug.handler(),
            shutdown_rx,
        )));

        info!(
            %xds_addr, %xds_tls_addr, %monitoring_addr, config_dir = %cfg.config_dir.display(),
            "control plane serving"
        );
        Ok(Self {
            xds_addr,
            xds_tls_addr,
            monitoring_addr,
            snapshots,
            proxies,
            shutdown,
            tasks,
            _source: source,
            _extra_sources: extra_sources,
        })
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
    authenticator: Arc<dyn TokenAuthenticator>,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    metrics: CaMetrics,
) -> Result<CaService, AppError> {
    let store = CaStore::load_or_create(&cfg.data_dir.join("ca"), cfg.ca_dir.as_deref())?;
    let opts = CaServiceOptions {
        signer: SignerOptions {
            trust_domain: cfg.trust_domain.clone(),
            max_ttl: Duration::from_secs(cfg.max_cert_ttl_secs),
            ..SignerOptions::default()
        },
        ..CaServiceOptions::default()
    };
    Ok(CaService::new(
        Arc::new(store),
        opts,
        authenticator,
        Arc::new(SnapshotPodLocator::new(snapshots)),
        metrics,
    ))
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
