//! The file source: a directory of Kubernetes YAML, watched for changes.
//!
//! Reading is [`ambit_config::ConfigDir`]'s job (which files, documents,
//! decoding, the per-file diff, last good versions, duplicates) — the node
//! agent reads the same directory with the same reader. This module is the
//! async wrapper: it loads the directory on a blocking thread and sends the
//! result as one update with `initial_sync_done: true`; afterwards inotify
//! events (debounced ~30 ms) make it re-read the affected files there, and
//! each non-empty result becomes a [`SourceUpdate`].

use std::collections::BTreeSet;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ambit_config::{ConfigDir, DirUpdate};

use notify::event::{AccessKind, AccessMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::model::{ModelHandle, SourceUpdate};

use super::FILE_SOURCE;

/// Quiet time that ends a burst of file events.
const DEBOUNCE: Duration = Duration::from_millis(30);
/// A burst is processed at the latest this long after its first event.
const DEBOUNCE_MAX: Duration = Duration::from_millis(500);

/// Errors of the file source.
#[derive(Debug, thiserror::Error)]
pub enum FileSourceError {
    #[error("cannot open config directory {path}: {source}; check that it exists and is readable")]
    Dir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("config path {0} is not a directory; pass a directory of YAML files")]
    NotADirectory(PathBuf),
    #[error(
        "cannot watch config directory {path} for changes: {source}; raise fs.inotify.max_user_watches / max_user_instances if they are exhausted"
    )]
    Watch {
        path: PathBuf,
        #[source]
        source: notify::Error,
    },
    #[error(
        "the model stopped before the initial config of {0} could be sent; check the log for why the model task ended"
    )]
    ModelClosed(PathBuf),
    #[error(
        "loading config directory {0} failed unexpectedly: {1}; this is a bug, please report it"
    )]
    Load(PathBuf, String),
}

/// A running file source. Dropping it stops watching.
pub struct FileSource {
    dir: PathBuf,
    _watcher: RecommendedWatcher,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for FileSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileSource")
            .field("dir", &self.dir)
            .finish()
    }
}

impl FileSource {
    /// The watched directory (absolute).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for FileSource {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Loads `dir`, sends the initial update (returns once it has been sent) and
/// keeps watching `dir` until the returned [`FileSource`] is dropped.
pub async fn spawn_file_source(
    dir: PathBuf,
    model: ModelHandle,
) -> Result<FileSource, FileSourceError> {
    let dir = std::path::absolute(&dir).map_err(|source| FileSourceError::Dir {
        path: dir.clone(),
        source,
    })?;
    let meta = std::fs::metadata(&dir).map_err(|source| FileSourceError::Dir {
        path: dir.clone(),
        source,
    })?;
    if !meta.is_dir() {
        return Err(FileSourceError::NotADirectory(dir));
    }
    // Watch first, so nothing written during the initial load is missed.
    let (ev_tx, ev_rx) = mpsc::unbounded_channel();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<Event>| {
        // The receiver is gone only when the source is shutting down.
        let _ = ev_tx.send(res);
    })
    .map_err(|source| FileSourceError::Watch {
        path: dir.clone(),
        source,
    })?;
    watcher
        .watch(&dir, RecursiveMode::Recursive)
        .map_err(|source| FileSourceError::Watch {
            path: dir.clone(),
            source,
        })?;

    let reader = ConfigDir::new(dir.clone());
    let (reader, loaded) = tokio::task::spawn_blocking(move || {
        let mut reader = reader;
        let loaded = reader.rescan();
        (reader, loaded)
    })
    .await
    .map_err(|e| FileSourceError::Load(dir.clone(), e.to_string()))?;
    let mut update = source_update(loaded);
    update.errors.retain(|(_, errs)| !errs.is_empty());
    update.initial_sync_done = true;
    info!(
        dir = %dir.display(),
        files = reader.file_count(),
        objects = update.changes.len(),
        rejected = update.errors.iter().map(|(_, e)| e.len()).sum::<usize>(),
        "loaded config directory"
    );
    model
        .send(update)
        .await
        .map_err(|_| FileSourceError::ModelClosed(dir.clone()))?;
    let task = tokio::spawn(watch_loop(reader, ev_rx, model));
    Ok(FileSource {
        dir,
        _watcher: watcher,
        task,
    })
}

/// Events gathered during one debounce window.
#[derive(Default)]
struct Batch {
    paths: BTreeSet<PathBuf>,
    rescan: bool,
}

impl Batch {
    fn add(&mut self, ev: notify::Result<Event>) {
        match ev {
            Err(e) => {
                warn!(error = %e, "file watch error; rescanning the config directory");
                self.rescan = true;
            }
            Ok(ev) => {
                if let EventKind::Access(a) = ev.kind {
                    // Our own reads produce open/close events; only a
                    // finished write matters.
                    if a != AccessKind::Close(AccessMode::Write) {
                        return;
                    }
                }
                if ev.need_rescan() {
                    self.rescan = true;
                }
                self.paths.extend(ev.paths);
            }
        }
    }
}

/// The model's update for what the reader returned.
fn source_update(u: DirUpdate) -> SourceUpdate {
    SourceUpdate {
        source: FILE_SOURCE.to_string(),
        changes: u.changes,
        errors: u.errors,
        initial_sync_done: false,
    }
}

async fn watch_loop(
    mut reader: ConfigDir,
    mut events: mpsc::UnboundedReceiver<notify::Result<Event>>,
    model: ModelHandle,
) {
    while let Some(first) = events.recv().await {
        let mut batch = Batch::default();
        batch.add(first);
        let started = Instant::now();
        loop {
            let deadline = (Instant::now() + DEBOUNCE).min(started + DEBOUNCE_MAX);
            match tokio::time::timeout_at(deadline, events.recv()).await {
                Ok(Some(ev)) => batch.add(ev),
                Ok(None) | Err(_) => break,
            }
        }
        if !batch.rescan && batch.paths.is_empty() {
            continue;
        }
        let job = tokio::task::spawn_blocking(move || {
            let update = if batch.rescan {
                reader.rescan()
            } else {
                reader.reread(&batch.paths)
            };
            (reader, update)
        });
        let update;
        (reader, update) = match job.await {
            Ok(r) => r,
            Err(e) => {
                error!(error = %e, "processing config file changes failed; the file source stops watching (restart the control plane)");
                return;
            }
        };
        if update.is_empty() {
            continue;
        }
        let update = source_update(update);
        debug!(
            changes = update.changes.len(),
            files = update.errors.len(),
            "config files changed"
        );
        if model.send(update).await.is_err() {
            debug!("model stopped; file source stops watching");
            return;
        }
    }
}
