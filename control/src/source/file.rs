//! The file source: a directory of Kubernetes YAML, watched for changes.
//!
//! Reading is [`ambit_config::ConfigDir`]'s job (which files, documents,
//! decoding, the per-file diff, last good versions, duplicates) — the node
//! agent reads the same directory with the same reader. This module is the
//! async wrapper: it loads the directory on a blocking thread and sends the
//! result as one update with `initial_sync_done: true`; afterwards inotify
//! events make it re-read the affected files there, and each non-empty
//! result becomes a [`SourceUpdate`].
//!
//! Writes settle before a file is read, so a file caught half-written (which
//! may well be valid YAML, just missing its end) is never served: a file is
//! read [`SETTLE`] after its last event once its writer closed it
//! (close-write) or it was renamed into place (moved-to), [`SETTLE_OPEN`]
//! after its last event while a writer still holds it open, and at the
//! latest [`SETTLE_MAX`] after its first event. Writers should still write
//! atomically (temp file + rename), see the README.

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ambit_config::{ConfigDir, DirUpdate};

use notify::event::{AccessKind, AccessMode, CreateKind, ModifyKind};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::model::{ModelHandle, SourceUpdate};

use super::FILE_SOURCE;
use crate::model::OVERLAY_SOURCE;

/// Quiet time after the last event of a closed (or renamed, removed) file
/// before it is read: the writer is done, this only coalesces an editor's
/// burst of events (write, close, rename) into one read. Every change pays
/// it, so it stays small (150 ms here made a pod change take ~200 ms to
/// reach 100 ztunnels instead of ~120 ms).
pub const SETTLE: Duration = Duration::from_millis(30);
/// Quiet time before reading a file whose writer has not closed it yet.
pub const SETTLE_OPEN: Duration = Duration::from_secs(1);
/// A file is read at the latest this long after its first event, even if
/// writes keep coming.
pub const SETTLE_MAX: Duration = Duration::from_secs(2);

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
    spawn(dir, model, true).await
}

/// [`spawn_file_source`] for a directory beside the main one
/// (`--extra-config-dir`): its initial update does not say
/// `initial_sync_done`, so the model counts as synced only once the main
/// directory (loaded after the extra ones) has been sent. Its updates are
/// an overlay ([`crate::model::OVERLAY_SOURCE`]): an object it serves wins
/// over the main directory's object of the same kind, namespace and name.
pub async fn spawn_extra_file_source(
    dir: PathBuf,
    model: ModelHandle,
) -> Result<FileSource, FileSourceError> {
    spawn(dir, model, false).await
}

async fn spawn(
    dir: PathBuf,
    model: ModelHandle,
    marks_sync: bool,
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
    let mut update = source_update(loaded, marks_sync);
    update.errors.retain(|(_, errs)| !errs.is_empty());
    update.initial_sync_done = marks_sync;
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
    let task = tokio::spawn(watch_loop(reader, ev_rx, model, marks_sync));
    Ok(FileSource {
        dir,
        _watcher: watcher,
        task,
    })
}

/// A path with events not yet acted on.
#[derive(Debug, Clone, Copy)]
struct Pending {
    first: Instant,
    last: Instant,
    /// No write is in progress: the last write was closed, or the path was
    /// renamed, removed or only had its metadata changed.
    settled: bool,
}

impl Pending {
    fn due(&self) -> Instant {
        let quiet = if self.settled { SETTLE } else { SETTLE_OPEN };
        (self.last + quiet).min(self.first + SETTLE_MAX)
    }
}

/// Paths with pending events, and whether the whole directory needs a rescan.
#[derive(Debug, Default)]
struct PendingEvents {
    paths: HashMap<PathBuf, Pending>,
    rescan: Option<Pending>,
}

impl PendingEvents {
    fn note(slot: &mut Option<Pending>, now: Instant, settled: bool) {
        match slot {
            Some(p) => {
                p.last = now;
                p.settled = settled;
            }
            None => {
                *slot = Some(Pending {
                    first: now,
                    last: now,
                    settled,
                })
            }
        }
    }

    fn add(&mut self, ev: notify::Result<Event>, now: Instant) {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                warn!(error = %e, "file watch error; rescanning the config directory");
                Self::note(&mut self.rescan, now, true);
                return;
            }
        };
        let settled = match ev.kind {
            // Our own reads produce open/close events; only a finished
            // write matters.
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
            EventKind::Access(_) => return,
            // Data written (or a new file): more may follow until close.
            EventKind::Modify(ModifyKind::Data(_) | ModifyKind::Any)
            | EventKind::Create(CreateKind::File | CreateKind::Any) => false,
            // Renamed into place (moved-to), removed, metadata, directories.
            _ => true,
        };
        if ev.need_rescan() {
            Self::note(&mut self.rescan, now, true);
        }
        for path in ev.paths {
            let mut slot = self.paths.get(&path).copied();
            Self::note(&mut slot, now, settled);
            if let Some(p) = slot {
                self.paths.insert(path, p);
            }
        }
    }

    /// When the next path is due, if any is pending.
    fn next_due(&self) -> Option<Instant> {
        self.paths
            .values()
            .chain(&self.rescan)
            .map(Pending::due)
            .min()
    }

    /// Takes what is due at `now`: whether to rescan, and the paths.
    fn take_due(&mut self, now: Instant) -> (bool, BTreeSet<PathBuf>) {
        let rescan = self.rescan.is_some_and(|p| p.due() <= now);
        if rescan {
            self.rescan = None;
        }
        let due: BTreeSet<PathBuf> = self
            .paths
            .iter()
            .filter(|(_, p)| p.due() <= now)
            .map(|(path, _)| path.clone())
            .collect();
        for path in &due {
            self.paths.remove(path);
        }
        (rescan, due)
    }
}

/// The model's update for what the reader returned.
fn source_update(u: DirUpdate, main: bool) -> SourceUpdate {
    SourceUpdate {
        source: if main { FILE_SOURCE } else { OVERLAY_SOURCE }.to_string(),
        changes: u.changes,
        errors: u.errors,
        initial_sync_done: false,
    }
}

async fn watch_loop(
    mut reader: ConfigDir,
    mut events: mpsc::UnboundedReceiver<notify::Result<Event>>,
    model: ModelHandle,
    main: bool,
) {
    let mut pending = PendingEvents::default();
    loop {
        let next = pending.next_due();
        tokio::select! {
            ev = events.recv() => match ev {
                Some(ev) => {
                    pending.add(ev, Instant::now());
                    continue;
                }
                None => return,
            },
            () = sleep_until_or_forever(next) => {}
        }
        let (rescan, paths) = pending.take_due(Instant::now());
        if !rescan && paths.is_empty() {
            continue;
        }
        let job = tokio::task::spawn_blocking(move || {
            let update = if rescan {
                reader.rescan()
            } else {
                reader.reread(&paths)
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
        let update = source_update(update, main);
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

async fn sleep_until_or_forever(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
