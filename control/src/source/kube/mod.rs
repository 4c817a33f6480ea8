//! The Kubernetes source: the API server's objects, watched, decoded with
//! `ambit-config` into the same typed objects the file source produces and
//! sent through the same [`SourceUpdate`] seam.
//!
//! - Discovery ([`discovery`]) says which version of each kind the API
//!   server serves; it polls (a bodiless `304` while nothing changed), so a
//!   CRD installed later is watched within seconds.
//! - One watch per kind the model knows ([`WatchSpec::all`]), each a kube
//!   runtime `watcher` over `DynamicObject`s (core kinds and CRDs alike, so
//!   decoding stays in `ambit-config`) at the version discovery found;
//!   Namespaces are watched metadata-only. List pages of 500, bookmarks on,
//!   a fresh list after `410 Gone`, a resumed watch after a dropped
//!   connection, retries with jittered exponential backoff (capped at
//!   [`KubeSourceOptions::retry_max`], a few seconds; a failing watch
//!   retries at once when discovery sees the API server answer again), one
//!   WARN per change of a watch's state, and an optional periodic relist
//!   ([`KubeSourceOptions::relist_every`]) that repairs any drift.
//! - A rejected object keeps its last good version; its error is the
//!   config-error scope `kubernetes:<Kind>/<namespace>/<name>`, shown in
//!   `/debug/config_errors` with kind, namespace and name.
//! - A kind none of whose versions is served (its CRD is not installed)
//!   counts as synced and empty: readiness does not wait for it, one INFO
//!   line says so, and it is watched as soon as discovery finds it. A
//!   watched resource that answers `404` asks discovery at once; when the
//!   CRD is gone its objects are deleted. Any other error is that watch's
//!   alone and retried.
//! - The model is told `initial_sync_done` once every watch has completed
//!   its first list (or its kind is absent); until then `/ready` is 503
//!   and xDS streams wait.
//!
//! Nothing but object keys and the pod placement index ([`PodIndex`]) is
//! kept here; the model's store is the only cache of objects.

pub mod discovery;
mod kinds;
mod pods;
mod watch;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ambit_config::Kind;
use kube::Client;
use tokio::sync::{Notify, watch as tokio_watch};
use tokio::task::JoinHandle;
use tracing::info;

pub use discovery::{Discovered, DiscoveryOptions, ServedKinds};
pub use kinds::WatchSpec;
pub use pods::{PodIndex, PodPlacement};

use crate::model::{ModelHandle, SourceUpdate};

/// The `source` name the Kubernetes source puts in its updates.
pub const KUBE_SOURCE: &str = "kubernetes";

/// How the source watches.
#[derive(Debug, Clone)]
pub struct KubeSourceOptions {
    /// What to watch (default: every kind the model knows).
    pub kinds: Vec<WatchSpec>,
    /// Server-side bound of one watch request (`timeoutSeconds`); kube's
    /// watcher treats a watch silent for this long plus 5 s as dead.
    /// `None`: kube's default, 290 s.
    pub watch_timeout_secs: Option<u32>,
    /// Relist everything this often (with up to 10 % jitter), as
    /// anti-entropy; `None` relists only when the API server says the
    /// watch expired.
    pub relist_every: Option<Duration>,
    /// First retry delay after a failed list or watch.
    pub retry_initial: Duration,
    /// Longest retry delay.
    pub retry_max: Duration,
    /// How often discovery asks what is served.
    pub discovery: DiscoveryOptions,
}

impl Default for KubeSourceOptions {
    fn default() -> Self {
        Self {
            kinds: WatchSpec::all(),
            watch_timeout_secs: None,
            relist_every: Some(Duration::from_secs(3600)),
            retry_initial: Duration::from_millis(250),
            retry_max: Duration::from_secs(4),
            discovery: DiscoveryOptions::default(),
        }
    }
}

/// What the watches share: their state (for readiness messages), the
/// initial-sync bookkeeping and the pod index.
pub(crate) struct Shared {
    /// Per kind: "synced", "absent (...)" or why it is not listed yet.
    states: Mutex<BTreeMap<Kind, String>>,
    /// Kinds whose first list has not completed.
    pending: Mutex<std::collections::BTreeSet<Kind>>,
    synced: tokio_watch::Sender<bool>,
    pods: Arc<PodIndex>,
    /// Asks discovery to run now (a watched resource answered 404).
    rediscover: Arc<Notify>,
}

impl Shared {
    fn set_state(&self, kind: Kind, state: &str) {
        if let Ok(mut s) = self.states.lock() {
            s.insert(kind, state.to_string());
        }
    }

    /// Records that `kind` completed its first list; the last one tells the
    /// model the initial state is complete. False when the model is gone.
    async fn report_synced(&self, kind: Kind, model: &ModelHandle) -> bool {
        let last = match self.pending.lock() {
            Ok(mut p) => p.remove(&kind) && p.is_empty(),
            Err(_) => false,
        };
        if !last {
            return true;
        }
        let update = SourceUpdate {
            source: KUBE_SOURCE.to_string(),
            initial_sync_done: true,
            ..SourceUpdate::default()
        };
        if model.send(update).await.is_err() {
            return false;
        }
        info!("every Kubernetes watch has listed its objects: the initial state is complete");
        self.synced.send_replace(true);
        true
    }
}

/// A running Kubernetes source. Dropping it stops every watch.
pub struct KubeSource {
    tasks: Vec<JoinHandle<()>>,
    shared: Arc<Shared>,
    synced: tokio_watch::Receiver<bool>,
    discovered: tokio_watch::Receiver<Discovered>,
}

impl std::fmt::Debug for KubeSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeSource")
            .field("watches", &self.tasks.len())
            .field("synced", &*self.synced.borrow())
            .finish()
    }
}

impl KubeSource {
    /// Starts discovery and one watch per kind; returns at once (see
    /// [`Self::synced`]).
    pub fn spawn(client: Client, model: ModelHandle, opts: KubeSourceOptions) -> KubeSource {
        let (synced_tx, synced) = tokio_watch::channel(opts.kinds.is_empty());
        let (discovery, discovered) = discovery::DiscoveryLoop::new(
            client.clone(),
            opts.kinds.clone(),
            opts.discovery.clone(),
        );
        let shared = Arc::new(Shared {
            states: Mutex::new(
                opts.kinds
                    .iter()
                    .map(|s| (s.kind, "not listed yet".to_string()))
                    .collect(),
            ),
            pending: Mutex::new(opts.kinds.iter().map(|s| s.kind).collect()),
            synced: synced_tx,
            pods: Arc::new(PodIndex::default()),
            rediscover: discovery.now.clone(),
        });
        let mut tasks: Vec<JoinHandle<()>> = opts
            .kinds
            .iter()
            .map(|spec| {
                let w = watch::KindWatch::new(spec.clone(), model.clone(), shared.clone());
                tokio::spawn(w.run(client.clone(), opts.clone(), discovered.clone()))
            })
            .collect();
        tasks.push(tokio::spawn(discovery.run()));
        KubeSource {
            tasks,
            shared,
            synced,
            discovered,
        }
    }

    /// What discovery found: which version of each kind is served.
    pub fn discovered(&self) -> tokio_watch::Receiver<Discovered> {
        self.discovered.clone()
    }

    /// Becomes true once every watch has listed its kind once.
    pub fn synced(&self) -> tokio_watch::Receiver<bool> {
        self.synced.clone()
    }

    /// Kinds not listed yet, each with why (for `/ready`).
    pub fn waiting_for(&self) -> Vec<String> {
        let pending = match self.shared.pending.lock() {
            Ok(p) => p.clone(),
            Err(_) => return Vec::new(),
        };
        let states = self
            .shared
            .states
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default();
        pending
            .into_iter()
            .map(|k| {
                let state = states.get(&k).map_or("not listed yet", String::as_str);
                format!("{k}: {state}")
            })
            .collect()
    }

    /// Each kind's watch state ("synced at v1", "absent (...)", ...).
    pub fn states(&self) -> BTreeMap<Kind, String> {
        self.shared
            .states
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    /// Where every watched pod runs.
    pub fn pods(&self) -> Arc<PodIndex> {
        self.shared.pods.clone()
    }
}

impl Drop for KubeSource {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}
