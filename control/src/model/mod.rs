//! The mesh model: one writer task owns the [`Store`], applies the
//! [`SourceUpdate`]s config sources send through a [`ModelHandle`], and
//! publishes immutable [`Snapshot`]s of the translated xDS resources through a
//! `tokio::sync::watch` channel.
//!
//! Updates are debounced: after the first update arrives the writer keeps
//! applying updates until `debounce_quiet` passes with nothing new or
//! `debounce_max` has passed since the first one, then translates once and
//! publishes, but only when something observable changed (a resource, the
//! error set, or the synced flag).

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

// Bottom to top: objects by namespace (`store`) and the resource types
// (`snapshot`); the drafts and label indexes every translator shares
// (`index`); one translator per resource family (`workloads`, `authz`,
// `peer_authn`, with `encode` for workload bytes); snapshot assembly on top
// (`assemble`). No module imports one above it.
mod assemble;
mod authz;
mod encode;
mod index;
mod overlay;
pub mod peer_authn;
pub mod sidecar;
pub mod snapshot;
pub mod store;
pub mod waypoint;
pub mod workloads;

#[cfg(test)]
mod authz_tests;
#[cfg(test)]
mod peer_authn_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod workloads_tests;

// What sources produce lives in the shared config crate; these names are
// part of the model's API (`SourceUpdate`, `Store`).
pub use ambit_config::{Change, ConfigError, Kind, Object, ObjectKey};
pub use assemble::{Translated, build_snapshot, translate};
// What ztunnel cannot enforce of an AuthorizationPolicy, for the writer's
// warning and for `ambitctl analyze`.
pub use authz::{l7_fields, l7_warning, unsupported_warning};
pub use overlay::OVERLAY_SOURCE;
pub use snapshot::{
    MESH_SCOPE, ResourceDelta, ResourceFamily, ResourceSet, Snapshot, TypedSet, XdsResource,
};
pub use store::Store;

/// Errors of the model's API.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(
        "the model task has stopped, so the update from source {from:?} was dropped; the control plane is shutting down or crashed — check the log above and restart it"
    )]
    Closed { from: String },
}

/// Settings of the model.
#[derive(Debug, Clone)]
pub struct ModelOptions {
    /// SPIFFE trust domain of workload identities.
    pub trust_domain: String,
    /// Network name of local addresses (`""` = the default network).
    pub network: String,
    /// Cluster id used in workload uids.
    pub cluster_id: String,
    /// Publish once no update arrived for this long ...
    pub debounce_quiet: Duration,
    /// ... or this long after the first update of a burst.
    pub debounce_max: Duration,
}

impl Default for ModelOptions {
    fn default() -> Self {
        Self {
            trust_domain: "cluster.local".to_string(),
            network: String::new(),
            cluster_id: "Kubernetes".to_string(),
            debounce_quiet: Duration::from_millis(10),
            debounce_max: Duration::from_millis(100),
        }
    }
}

/// A batch of changes from one source.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SourceUpdate {
    /// Source name, e.g. `file`.
    pub source: String,
    pub changes: Vec<Change>,
    /// Replaces the errors of each named scope (a file path, or a
    /// source-defined scope); an empty list clears that scope.
    pub errors: Vec<(String, Vec<ConfigError>)>,
    /// The source has delivered its complete initial state.
    pub initial_sync_done: bool,
}

/// Sends updates to the model's writer task. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ModelHandle {
    tx: mpsc::Sender<SourceUpdate>,
}

impl ModelHandle {
    /// A handle whose updates arrive on the returned receiver instead of a
    /// model task (for tests of sources and for custom consumers).
    pub fn channel(capacity: usize) -> (ModelHandle, mpsc::Receiver<SourceUpdate>) {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        (ModelHandle { tx }, rx)
    }

    /// Sends one update; waits while the model's queue is full.
    pub async fn send(&self, u: SourceUpdate) -> Result<(), ModelError> {
        self.tx
            .send(u)
            .await
            .map_err(|e| ModelError::Closed { from: e.0.source })
    }
}

/// Starts the model's writer task (needs a Tokio runtime) and returns the
/// handle sources use and the receiver of published snapshots (initially an
/// empty snapshot with `seq` 0).
pub fn spawn_model(opts: ModelOptions) -> (ModelHandle, watch::Receiver<Arc<Snapshot>>) {
    let (handle, rx) = ModelHandle::channel(1024);
    let (snap_tx, snap_rx) = watch::channel(Arc::new(Snapshot::default()));
    tokio::spawn(run_writer(opts, rx, snap_tx));
    (handle, snap_rx)
}

/// What applying updates changed.
#[derive(Debug, Default, Clone, Copy)]
struct Applied {
    objects: bool,
    errors: bool,
    synced: bool,
}

/// Applies one update; `overlay` decides which changes reach the store.
fn apply_update(
    store: &mut Store,
    overlay: &mut overlay::Overlay,
    synced: &mut bool,
    u: SourceUpdate,
    acc: &mut Applied,
) {
    debug!(source = %u.source, changes = u.changes.len(), error_scopes = u.errors.len(), initial_sync_done = u.initial_sync_done, "model update");
    for c in u.changes {
        let Some(c) = overlay.filter(store, &u.source, c) else {
            continue;
        };
        // Said once per accepted new version of a policy, whichever source
        // sent it: what ztunnel will not enforce as written.
        let warning = match &c {
            Change::Upsert(Object::AuthorizationPolicy(ap)) => authz::unsupported_warning(ap),
            _ => None,
        };
        let changed = store.apply(c);
        if changed && let Some(msg) = warning {
            warn!("{msg}");
        }
        acc.objects |= changed;
    }
    for (scope, errs) in u.errors {
        acc.errors |= store.set_errors(scope, errs);
    }
    if u.initial_sync_done && !*synced {
        *synced = true;
        acc.synced = true;
    }
}

async fn run_writer(
    opts: ModelOptions,
    mut rx: mpsc::Receiver<SourceUpdate>,
    snap_tx: watch::Sender<Arc<Snapshot>>,
) {
    let mut store = Store::default();
    let mut overlay = overlay::Overlay::default();
    let mut synced = false;
    let mut current: Arc<Snapshot> = snap_tx.borrow().clone();
    let opts = Arc::new(opts);
    loop {
        let Some(first) = rx.recv().await else {
            break;
        };
        let started = Instant::now();
        let mut acc = Applied::default();
        apply_update(&mut store, &mut overlay, &mut synced, first, &mut acc);
        let mut closed = false;
        loop {
            let deadline = (Instant::now() + opts.debounce_quiet).min(started + opts.debounce_max);
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(u)) => apply_update(&mut store, &mut overlay, &mut synced, u, &mut acc),
                Ok(None) => {
                    closed = true;
                    break;
                }
                Err(_) => break,
            }
        }
        if acc.objects || acc.errors || acc.synced {
            let prev = current.clone();
            let o = opts.clone();
            // Translation is CPU-bound: keep it off the async workers. The
            // store travels to the blocking thread and back.
            let job = tokio::task::spawn_blocking(move || {
                let built = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    build_snapshot(&store, &prev, &o)
                }));
                (store, built)
            });
            let (back, built) = match job.await {
                Ok(r) => r,
                Err(e) => {
                    error!(error = %e, "the model's translation task was cancelled; the model stops publishing");
                    return;
                }
            };
            store = back;
            match built {
                Ok(mut snap) => {
                    snap.synced = synced;
                    let (changed, removed) = snap.change_count();
                    let publish = snap.sets_differ(&current)
                        || !Arc::ptr_eq(&snap.errors, &current.errors)
                        || acc.synced;
                    if publish {
                        info!(
                            seq = snap.seq,
                            resources = snap.resource_count(),
                            changed,
                            removed,
                            errors = snap.errors.len(),
                            build_ms = snap.build_time.as_secs_f64() * 1000.0,
                            "published snapshot"
                        );
                        current = Arc::new(snap);
                        snap_tx.send_replace(current.clone());
                    } else {
                        debug!("update changed no resource; nothing published");
                    }
                }
                Err(_) => {
                    error!(
                        "translating the mesh model panicked (a bug); the previous snapshot keeps serving — please report this with the config that triggered it"
                    );
                }
            }
        }
        if closed {
            break;
        }
    }
    debug!("model writer stopped: every source handle was dropped");
}
