//! Wiring of the control plane: listeners, the model, the config source
//! (a directory in local mode, the API server in Kubernetes mode), the xDS
//! server, the CA and the monitoring server. Binaries, tests and benchmarks all
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
use tracing::{error, info, warn};

use crate::ca::{
    CaError, CaMetrics, CaService, CaServiceOptions, CaStore, NodeTokenFile, SignerOptions,
    SnapshotPodLocator, TokenAuthenticator, TokenReview, TokenReviewOptions, Unconfigured,
};
use crate::config::{ControlConfig, SourceChoice};
use crate::debug::{DebugState, ReadinessCheck, always_ready};
use crate::k8s::ca_secret::{CaSecretError, CaSecretOptions, load_ca};
use crate::k8s::leader::{LeaderElector, LeaseOptions};
use crate::k8s::waypoint::{self, WaypointOptions};
use crate::k8s::{root_configmap, webhook_ca};
use crate::model::snapshot::Snapshot;
use crate::model::spawn_model;
use crate::source::file::{
    FileSource, FileSourceError, spawn_extra_file_source, spawn_file_source,
};
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
    #[error("cannot load the CA from its Kubernetes Secret: {0}")]
    CaSecret(#[from] CaSecretError),
    #[error("the mesh model stopped before delivering its first snapshot")]
    ModelStopped,
    #[error("xDS and the CA are not serving: the CA could not be loaded (see the log)")]
    NotServing,
    #[error("cannot set up the certificate authority: {0}")]
    Ca(#[from] CaError),
}

/// A running control plane.
pub struct ControlPlane {
    xds_addr: SocketAddr,
    xds_tls_addr: SocketAddr,
    webhook_addr: Option<SocketAddr>,
    monitoring_addr: SocketAddr,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    proxies: Arc<ProxyRegistry>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    serving: watch::Receiver<bool>,
    _source: Source,
}

/// The running config source.
enum Source {
    // Held: dropping it stops watching the directory.
    // The main directory, then the `--extra-config-dir`s.
    File(
        #[allow(dead_code)] FileSource,
        #[allow(dead_code)] Vec<FileSource>,
    ),
    Kube {
        source: Arc<KubeSource>,
        client: kube::Client,
        elector: Box<LeaderElector>,
    },
}

fn lease_options(cfg: &ControlConfig) -> LeaseOptions {
    LeaseOptions {
        namespace: cfg.system_namespace.clone(),
        name: cfg.lease_name.clone(),
        identity: cfg.replica_name(),
        duration: Duration::from_secs(cfg.lease_duration_secs),
        renew_deadline: Duration::from_secs(cfg.lease_renew_deadline_secs),
        retry: Duration::from_millis(cfg.lease_retry_ms),
    }
}

/// Keeps the `ambit_leader` gauge in step with the election.
async fn follow_leadership(mut leader: watch::Receiver<bool>, gauge: Gauge) {
    loop {
        gauge.set(i64::from(*leader.borrow_and_update()));
        if leader.changed().await.is_err() {
            return;
        }
    }
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
fn kube_readiness(source: Arc<KubeSource>, serving: watch::Receiver<bool>) -> ReadinessCheck {
    Arc::new(move || {
        let waiting = source.waiting_for();
        if !waiting.is_empty() {
            return Err(format!(
                "waiting for the Kubernetes watches to list: {}",
                waiting.join("; ")
            ));
        }
        if !*serving.borrow() {
            return Err(
                "the CA is not loaded yet (the leader creates its Secret), so xDS and the CA do not serve"
                    .into(),
            );
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
        let webhook_listener = match cfg.injection_webhook_addr {
            Some(addr) => Some(bind("sidecar injection webhook (HTTPS)", addr).await?),
            None => None,
        };
        let mon_listener = bind("monitoring (HTTP)", cfg.monitoring_addr).await?;
        let xds_addr = match &xds_listener {
            Some(l) => local_addr("xDS", l, cfg.xds_plaintext_addr)?,
            None => cfg.xds_plaintext_addr,
        };
        let xds_tls_addr = local_addr("xDS TLS", &tls_listener, cfg.xds_tls_addr)?;
        let webhook_addr = match (&webhook_listener, cfg.injection_webhook_addr) {
            (Some(l), Some(addr)) => Some(local_addr("injection webhook", l, addr)?),
            _ => None,
        };
        let monitoring_addr = local_addr("monitoring", &mon_listener, cfg.monitoring_addr)?;

        let (model, mut snapshots) = spawn_model(cfg.model_options());
        let mut registry = Registry::default();
        let xds_metrics = XdsMetrics::register(&mut registry);
        let model_metrics = ModelMetrics::register(&mut registry);
        let ca_metrics = CaMetrics::register(&mut registry);
        let leader_gauge = Gauge::default();
        registry.register(
            "ambit_leader",
            "1 while this replica holds the leader Lease (Kubernetes mode)",
            leader_gauge.clone(),
        );
        let proxies = Arc::new(ProxyRegistry::default());
        let (shutdown, shutdown_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        // True once the gRPC servers run (the CA is loaded).
        let (serving, serving_rx) = watch::channel(false);

        let (source, readiness) = match &choice {
            SourceChoice::Dir(dir) => {
                // Extra directories first: their initial state does not mark
                // the model synced, the main directory's (sent last) does, so
                // the first synced snapshot holds all of them.
                let mut extra_sources = Vec::with_capacity(cfg.extra_config_dirs.len());
                for extra in &cfg.extra_config_dirs {
                    extra_sources
                        .push(spawn_extra_file_source(extra.clone(), model.clone()).await?);
                }
                let source = spawn_file_source(dir.clone(), model).await?;
                snapshots
                    .wait_for(|s| s.synced)
                    .await
                    .map_err(|_| AppError::ModelStopped)?;
                (Source::File(source, extra_sources), always_ready())
            }
            SourceChoice::Kube(access) => {
                let client = crate::k8s::client(access).await?;
                let source = Arc::new(KubeSource::spawn(
                    client.clone(),
                    model,
                    kube_source_options(&cfg),
                ));
                let readiness = kube_readiness(source.clone(), serving_rx.clone());
                let elector = Box::new(LeaderElector::spawn(client.clone(), lease_options(&cfg)));
                // Ready: every watch listed and the CA serving (what /ready
                // says); the waypoint controller writes nothing before.
                let (ready_tx, ready_rx) = watch::channel(false);
                let (mut synced, mut serving) = (source.synced(), serving_rx.clone());
                tasks.push(tokio::spawn(async move {
                    if synced.wait_for(|s| *s).await.is_ok()
                        && serving.wait_for(|s| *s).await.is_ok()
                    {
                        ready_tx.send_replace(true);
                        std::future::pending::<()>().await;
                    }
                }));
                tasks.push(tokio::spawn(waypoint::run(
                    client.clone(),
                    elector.subscribe(),
                    source.discovered(),
                    ready_rx,
                    WaypointOptions {
                        domain: "cluster.local".into(),
                        settings: cfg.inject_settings(),
                        resync: Duration::from_secs(600),
                    },
                )));
                tasks.push(tokio::spawn(crate::k8s::config_status::run(
                    client.clone(),
                    snapshots.clone(),
                    elector.subscribe(),
                    source.discovered(),
                )));
                tasks.push(tokio::spawn(follow_leadership(
                    elector.subscribe(),
                    leader_gauge.clone(),
                )));
                (
                    Source::Kube {
                        source,
                        client,
                        elector,
                    },
                    readiness,
                )
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

        let grpc = GrpcParts {
            cfg: cfg.clone(),
            snapshots: snapshots.clone(),
            generators,
            proxies: proxies.clone(),
            ca_metrics,
            xds_metrics,
            tls_listener,
            xds_listener,
            webhook_listener,
            shutdown: shutdown_rx.clone(),
        };
        match &source {
            Source::File(..) => {
                let store =
                    CaStore::load_or_create(&cfg.data_dir.join("ca"), cfg.ca_dir.as_deref())?;
                let servers = grpc.servers(store, authenticator(&cfg))?;
                let _ = serving.send(true);
                tasks.push(tokio::spawn(servers));
            }
            Source::Kube {
                source,
                client,
                elector,
            } => {
                let auth: Arc<dyn TokenAuthenticator> = Arc::new(TokenReview::new(
                    client.clone(),
                    source.pods(),
                    TokenReviewOptions {
                        audience: cfg.token_audience.clone(),
                        ..TokenReviewOptions::default()
                    },
                ));
                if cfg.node_tokens_file.is_some() {
                    warn!(
                        "--node-tokens-file is ignored in Kubernetes mode: callers authenticate with ServiceAccount tokens (TokenReview)"
                    );
                }
                let ca_secrets = CaSecretOptions {
                    namespace: cfg.system_namespace.clone(),
                    root_secret: cfg.ca_secret.clone(),
                    plugged_secret: cfg.plugged_ca_secret.clone(),
                };
                let (client, leader) = (client.clone(), elector.subscribe());
                let ca_leader = elector.subscribe();
                // The CA may have to wait for the leader to create its
                // Secret: serve /ready (503, saying so) meanwhile.
                tasks.push(tokio::spawn(async move {
                    let store = match &grpc.cfg.ca_dir {
                        // A plugged-in CA mounted as files.
                        Some(dir) => {
                            CaStore::load_or_create(&grpc.cfg.data_dir.join("ca"), Some(dir))
                                .map_err(AppError::from)
                        }
                        None => load_ca(client.clone(), &ca_secrets, ca_leader)
                            .await
                            .map_err(AppError::from),
                    };
                    let bundle = store
                        .as_ref()
                        .map(|s| s.trust_bundle_pem().concat())
                        .unwrap_or_default();
                    match store.and_then(|store| grpc.servers(store, auth)) {
                        Ok(servers) => {
                            let _ = serving.send(true);
                            // The leader publishes the root for ztunnels and
                            // sidecars and keeps the injection webhook's
                            // caBundle; both stop with the servers (this task).
                            let ca_bundle = webhook_ca::run(client.clone(), bundle.clone(), leader.clone());
                            let publish = root_configmap::run(client, ca_secrets.namespace, bundle, leader);
                            tokio::join!(servers, publish, ca_bundle);
                        }
                        Err(e) => error!(
                            error = %e,
                            "the CA cannot be loaded: xDS and the CA stay down and /ready says not ready; fix the Secret and restart"
                        ),
                    }
                }));
            }
        }

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
            webhook_addr,
            monitoring_addr,
            snapshots,
            proxies,
            shutdown,
            tasks,
            serving: serving_rx,
            _source: source,
        })
    }

    /// Waits until the model's snapshot holds the sources' complete initial
    /// state (at once in local mode, where [`Self::start`] waited already).
    /// In Kubernetes mode also waits until xDS and the CA serve (the CA
    /// loaded from its Secret). Callers bound the wait.
    pub async fn wait_synced(&self) -> Result<(), AppError> {
        let mut rx = self.snapshots.clone();
        rx.wait_for(|s| s.synced)
            .await
            .map_err(|_| AppError::ModelStopped)?;
        let mut serving = self.serving.clone();
        serving
            .wait_for(|s| *s)
            .await
            .map(|_| ())
            .map_err(|_| AppError::NotServing)
    }

    /// The Kubernetes source, in Kubernetes mode.
    pub fn kube_source(&self) -> Option<&KubeSource> {
        match &self._source {
            Source::Kube { source, .. } => Some(source),
            Source::File(..) => None,
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

    /// Where the sidecar injection webhook is served, when it is.
    pub fn webhook_addr(&self) -> Option<SocketAddr> {
        self.webhook_addr
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

    /// Whether this replica holds the leader Lease (always false in local
    /// mode, where nothing needs a leader).
    pub fn is_leader(&self) -> bool {
        match &self._source {
            Source::Kube { elector, .. } => elector.is_leader(),
            Source::File(..) => false,
        }
    }

    /// Stops the servers and waits for them; in Kubernetes mode releases
    /// the leader Lease first, so another replica takes over at once.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        if let Source::Kube { elector, .. } = self._source {
            elector.release().await;
        }
        for t in self.tasks {
            t.abort();
            let _ = t.await;
        }
    }

    /// Stops at once, as a crash would: the Lease is not released (another
    /// replica takes over when it expires). For tests.
    pub async fn kill(self) {
        for t in self.tasks {
            t.abort();
            let _ = t.await;
        }
    }
}

/// Bearer-token authentication of local mode, shared by xDS and the CA:
/// node tokens (Kubernetes mode uses TokenReview).
fn authenticator(cfg: &ControlConfig) -> Arc<dyn TokenAuthenticator> {
    match &cfg.node_tokens_file {
        Some(path) => Arc::new(NodeTokenFile::new(path)),
        None => Arc::new(Unconfigured),
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

/// What the gRPC servers (xDS and the CA, plaintext and TLS) are built
/// from once the CA's material is loaded.
struct GrpcParts {
    cfg: ControlConfig,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    generators: Generators,
    proxies: Arc<ProxyRegistry>,
    ca_metrics: CaMetrics,
    xds_metrics: XdsMetrics,
    tls_listener: TcpListener,
    xds_listener: Option<TcpListener>,
    webhook_listener: Option<TcpListener>,
    shutdown: watch::Receiver<bool>,
}

impl GrpcParts {
    /// Builds the CA and xDS services; the returned future serves both
    /// listeners until shutdown (dropping it stops them).
    fn servers(
        self,
        store: CaStore,
        authenticator: Arc<dyn TokenAuthenticator>,
    ) -> Result<impl std::future::Future<Output = ()> + Send + 'static, AppError> {
        let cfg = &self.cfg;
        let ca = build_ca(
            cfg,
            store,
            authenticator.clone(),
            self.snapshots.clone(),
            self.ca_metrics,
        );
        let xds = XdsServer::with_generators(
            self.snapshots.clone(),
            self.generators,
            XdsAccess::new(
                authenticator.clone(),
                CaServiceOptions::default().node_proxy_identities,
            ),
            self.proxies.clone(),
            self.xds_metrics,
        );
        let tls_config = Arc::new(ca.server_tls_config(&cfg.tls_names)?);
        let webhook = self.webhook_listener.map(|l| {
            let settings = Arc::new(cfg.inject_settings());
            crate::inject::webhook::serve(l, tls_config.clone(), settings, self.shutdown.clone())
        });
        let tls_incoming =
            crate::tls_listener::incoming(self.tls_listener, tls_config, self.shutdown.clone());
        let mut incomings = vec![("TLS", Incoming::Tls(tls_incoming))];
        if let Some(l) = self.xds_listener {
            incomings.push(("plaintext", Incoming::Plain(TcpListenerStream::new(l))));
        }
        let mut servers = Vec::new();
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
            let mut stop = self.shutdown.clone();
            let stopped = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            servers.push(async move {
                let result = match incoming {
                    Incoming::Plain(i) => router.serve_with_incoming_shutdown(i, stopped).await,
                    Incoming::Tls(i) => router.serve_with_incoming_shutdown(i, stopped).await,
                };
                if let Err(e) = result {
                    warn!("{what} gRPC server stopped: {e}");
                }
            });
        }
        Ok(async move {
            let webhook = async move {
                if let Some(w) = webhook {
                    w.await;
                }
            };
            futures::future::join(futures::future::join_all(servers), webhook).await;
        })
    }
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
