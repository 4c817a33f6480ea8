//! Starting and stopping one ztunnel: bind every listener, spawn the xDS
//! client and the servers, hand back a [`Ztunnel`] handle.
//!
//! Nothing here is global: each ztunnel has its own metrics registry,
//! state and tasks, so tests and benchmarks can run many in one process.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ambit_inpod::{ZdsClient, ZdsClientConfig};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{Instrument, info, info_span, warn};

use crate::admin::{self, AdminContext, AdminError, Listener, LogControl};
use crate::config::Config;
use crate::drain::{self, DrainTrigger, DrainWatcher};
use crate::hbone::HbonePool;
use crate::identity::IdentityError;
use crate::identity::{CertificateManager, Identity};
use crate::inpod::{InpodConfig, InpodManager, PodSet, UnservedSet};
use crate::metrics::Metrics;
use crate::proxy::{
    ProxyConfig, ProxyContext, TlsCache, TlsCacheStats, tls_cache, workload_identity,
};
use crate::rbac::PolicyCache;
use crate::state::{StateReader, StateSnapshot, TunnelProtocol, new_state};
use crate::xds::{XdsClient, XdsClientConfig, XdsError, XdsHandle};

/// Errors of starting a ztunnel.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The xDS client could not be set up (bad address).
    #[error(transparent)]
    Xds(#[from] XdsError),
    /// A listener could not be bound.
    #[error(transparent)]
    Admin(#[from] AdminError),
    /// The certificate manager could not be set up (bad CA address, root file).
    #[error(transparent)]
    Identity(#[from] IdentityError),
}

/// Optional extras for [`start_with`].
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    /// Lets `/logging` read and change the log filter. The binary passes
    /// its reload handle; embedded ztunnels usually pass none.
    pub log_control: Option<LogControl>,
}

/// A running ztunnel.
#[derive(Debug)]
pub struct Ztunnel {
    node_name: String,
    admin_addr: SocketAddr,
    stats_addr: SocketAddr,
    readiness_addr: SocketAddr,
    state: StateReader,
    ready: watch::Receiver<bool>,
    quit: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    xds: XdsHandle,
    certificates: CertificateManager,
    pool: HbonePool,
    pods: watch::Receiver<PodSet>,
    /// The data path's TLS configs (`None` when in-pod capture is off).
    tls: Option<Arc<TlsCache>>,
    unserved: watch::Receiver<UnservedSet>,
    drain: DrainTrigger,
    drain_deadline: Duration,
    tasks: Vec<JoinHandle<()>>,
}

/// Starts a ztunnel with default options; see [`start_with`].
pub async fn start(config: Config) -> Result<Ztunnel, AppError> {
    start_with(config, StartOptions::default()).await
}

/// Binds every listener (a bind error names the address and the flag),
/// then starts the xDS client and the admin, stats and readiness servers.
/// Returns once everything is listening; use [`Ztunnel::wait_ready`] to
/// wait for the first xDS sync.
pub async fn start_with(config: Config, options: StartOptions) -> Result<Ztunnel, AppError> {
    let certificates = CertificateManager::from_config(&config)?;
    let mut metrics = Metrics::new();
    certificates.register_metrics(metrics.registry_mut());
    let metrics = Arc::new(metrics);
    let (writer, reader) = new_state();
    let (ready_tx, ready_rx) = watch::channel(false);
    let (xds_client, xds) = XdsClient::new(
        XdsClientConfig::from_config(&config),
        writer,
        metrics.clone(),
        ready_tx,
    )?;

    let (admin_tcp, admin_addr) =
        admin::bind("admin", config.admin_addr, "--admin-addr / ADMIN_ADDR").await?;
    let (stats_tcp, stats_addr) =
        admin::bind("stats", config.stats_addr, "--stats-addr / STATS_ADDR").await?;
    let (ready_tcp, readiness_addr) = admin::bind(
        "readiness",
        config.readiness_addr,
        "--readiness-addr / READINESS_ADDR",
    )
    .await?;

    let drain_deadline = config.drain_deadline();
    let (drain, watcher) = drain::channel_with(drain_deadline);
    let (quit_tx, quit_rx) = watch::channel(false);
    let certificates_handle = certificates.clone();
    let pool = HbonePool::new(crate::hbone::PoolConfig {
        timeouts: config.hbone_timeouts(),
        ..Default::default()
    });
    let policies = Arc::new(PolicyCache::new());

    let span = info_span!("ztunnel", node = %config.node_name);
    let mut tasks = Vec::new();
    let (_, no_pods) = watch::channel(PodSet::new());
    let mut pods = no_pods;
    let mut tls = None;
    let (_, none_unserved) = watch::channel(UnservedSet::new());
    let mut unserved = none_unserved;
    if let Some(path) = config.zds_socket() {
        let ctx = Arc::new(ProxyContext::new(
            config.node_name.clone(),
            config.cluster_id.clone(),
            &config.network,
            reader.clone(),
            certificates.clone(),
            pool.clone(),
            metrics.tcp.clone(),
            policies.clone(),
            ProxyConfig {
                inbound_transparent: config.inbound_transparent,
                copy: crate::copy::CopyConfig {
                    splice: config.splice,
                    ..Default::default()
                },
                ..ProxyConfig::default()
            },
        ));
        let ctx_for_policies = ctx.clone();
        tls = Some(ctx.tls.clone());
        tasks.push(tokio::spawn(
            tls_cache::follow_certificates(
                certificates.clone(),
                ctx.tls.clone(),
                pool.clone(),
                watcher.clone(),
            )
            .instrument(span.clone()),
        ));
        let inpod = InpodManager::spawn(InpodConfig::default(), watcher.clone(), Some(ctx));
        pods = inpod.pods.clone();
        unserved = inpod.unserved.clone();
        let zds = ZdsClient::new(ZdsClientConfig::new(path), inpod.commands);
        tasks.push(tokio::spawn(
            zds.run(watcher.clone().wait()).instrument(span.clone()),
        ));
        tasks.push(tokio::spawn(
            async move {
                let _ = inpod.task.await;
            }
            .instrument(span.clone()),
        ));
        tasks.push(tokio::spawn(
            follow_policies(reader.clone(), ctx_for_policies, watcher.clone())
                .instrument(span.clone()),
        ));
    }
    let ctx = Arc::new(AdminContext {
        state: reader.clone(),
        metrics: metrics.clone(),
        ready: ready_rx.clone(),
        unserved: unserved.clone(),
        log: options.log_control,
        quit: quit_tx,
        certificates: Some(certificates.clone()),
    });
    tasks.extend([
        tokio::spawn(xds_client.run(watcher.clone()).instrument(span.clone())),
        tokio::spawn(
            track_local_identities(
                reader.clone(),
                certificates,
                config.node_name.clone(),
                watcher.clone(),
            )
            .instrument(span.clone()),
        ),
        tokio::spawn(
            admin::serve(admin_tcp, Listener::Admin, ctx.clone(), watcher.clone())
                .instrument(span.clone()),
        ),
        tokio::spawn(
            admin::serve(stats_tcp, Listener::Stats, ctx.clone(), watcher.clone())
                .instrument(span.clone()),
        ),
        tokio::spawn(
            admin::serve(ready_tcp, Listener::Readiness, ctx, watcher).instrument(span.clone()),
        ),
    ]);
    span.in_scope(|| {
        info!(
            xds = %config.xds_address,
            admin = %admin_addr,
            stats = %stats_addr,
            readiness = %readiness_addr,
            "ztunnel started"
        )
    });

    Ok(Ztunnel {
        node_name: config.node_name,
        admin_addr,
        stats_addr,
        readiness_addr,
        state: reader,
        ready: ready_rx,
        quit: quit_rx,
        metrics,
        xds,
        certificates: certificates_handle,
        pool,
        pods,
        tls,
        unserved,
        drain,
        drain_deadline,
        tasks,
    })
}

impl Ztunnel {
    /// Bound address of the admin server.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Bound address of the stats server.
    pub fn stats_addr(&self) -> SocketAddr {
        self.stats_addr
    }

    /// Bound address of the readiness server.
    pub fn readiness_addr(&self) -> SocketAddr {
        self.readiness_addr
    }

    /// The node this ztunnel serves.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// The current state snapshot.
    pub fn state(&self) -> Arc<StateSnapshot> {
        self.state.load()
    }

    /// A reader of the state, to watch its generation or wait for a
    /// condition ([`StateReader::wait_for`]).
    pub fn state_reader(&self) -> StateReader {
        self.state.clone()
    }

    /// True once the first response of every xDS type has been applied.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Waits for [`Self::is_ready`]. Never returns if the control plane is
    /// never reached: wrap it in a timeout.
    pub async fn wait_ready(&self) {
        let mut rx = self.ready.clone();
        if rx.wait_for(|ready| *ready).await.is_err() {
            // The xDS task is gone without becoming ready (shut down).
            std::future::pending::<()>().await;
        }
    }

    /// This ztunnel's metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The certificate manager of this node's workloads.
    pub fn certificates(&self) -> &CertificateManager {
        &self.certificates
    }

    /// The pods enrolled through ZDS, with their listeners (empty when
    /// in-pod capture is off).
    pub fn pods(&self) -> watch::Receiver<PodSet> {
        self.pods.clone()
    }

    /// What the data path's TLS config cache holds (empty when in-pod
    /// capture is off): no entry for an identity that left the node.
    pub fn tls_cache_stats(&self) -> TlsCacheStats {
        self.tls.as_ref().map(|t| t.stats()).unwrap_or_default()
    }

    /// Pods the node agent handed over that this ztunnel could not serve
    /// (readiness is 503 while there are any).
    pub fn unserved(&self) -> watch::Receiver<UnservedSet> {
        self.unserved.clone()
    }

    /// The outbound HBONE connection pool.
    pub fn pool(&self) -> &HbonePool {
        &self.pool
    }

    /// Handle for on-demand xDS requests.
    pub fn xds(&self) -> &XdsHandle {
        &self.xds
    }

    /// Resolves when `POST /quitquitquit` was received.
    pub async fn quit_requested(&self) {
        let mut rx = self.quit.clone();
        if rx.wait_for(|quit| *quit).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Stops the xDS client and every listener; live connections get the
    /// drain deadline (`--drain-timeout-secs`) to finish. Tasks still
    /// running after that are aborted.
    pub async fn shutdown(self) {
        self.drain.start();
        let deadline = tokio::time::Instant::now() + self.drain_deadline + Duration::from_secs(1);
        for mut task in self.tasks {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                warn!(node = %self.node_name, "task did not stop in time; aborting it");
                task.abort();
            }
        }
        info!(node = %self.node_name, "ztunnel stopped");
    }
}

/// Keeps a certificate prefetched for every identity of an enrolled (HBONE)
/// workload on this node, and forgets identities whose last workload left.
async fn track_local_identities(
    state: StateReader,
    certificates: CertificateManager,
    node: String,
    drain: DrainWatcher,
) {
    let mut generation = state.generation();
    let mut held: HashSet<Identity> = HashSet::new();
    loop {
        let snap = state.load();
        let wanted: HashSet<Identity> = snap
            .workloads()
            .filter(|w| w.node == node && w.protocol == TunnelProtocol::Hbone)
            .map(|w| workload_identity(w))
            .collect();
        drop(snap);
        certificates.prefetch(wanted.difference(&held).cloned());
        for gone in held.difference(&wanted) {
            certificates.forget(gone);
        }
        held = wanted;
        tokio::select! {
            changed = generation.changed() => if changed.is_err() { return },
            _ = drain.signaled() => return,
        }
    }
}

/// Keeps the policy index at the latest state, so connections never pay
/// for building it, and closes live inbound connections the new state
/// denies.
async fn follow_policies(state: StateReader, ctx: Arc<ProxyContext>, drain: DrainWatcher) {
    let mut generation = state.generation();
    loop {
        let snap = state.load();
        ctx.policies.refresh(&snap);
        let closed = ctx.live.recheck(&snap, &ctx.network, &ctx.policies);
        if closed > 0 {
            info!(closed, "closed live connections that the new policy denies");
        }
        drop(snap);
        tokio::select! {
            changed = generation.changed() => if changed.is_err() { return },
            _ = drain.signaled() => return,
        }
    }
}
