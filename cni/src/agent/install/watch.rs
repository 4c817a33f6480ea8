//! Keeping our entry in the primary config while other CNIs rewrite it.

use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::event::{AccessKind, AccessMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep_until, timeout_at};
use tracing::{debug, info, warn};

use super::conflist::is_config_name;
use super::{InsertOutcome, InstallConfig, InstallError, insert};

/// Quiet time that ends a burst of events (another CNI's write, our rename).
const DEBOUNCE: Duration = Duration::from_millis(100);
/// A burst is handled at the latest this long after its first event.
const DEBOUNCE_MAX: Duration = Duration::from_secs(1);
/// Check interval when the directory cannot be watched.
const POLL_INTERVAL: Duration = Duration::from_secs(1);
/// Check interval while watching: catches what events cannot show (a
/// symlinked config's target changing, the directory being replaced).
const RESYNC_INTERVAL: Duration = Duration::from_secs(10);

type Events = mpsc::UnboundedSender<notify::Result<Event>>;

/// An inotify watch on the conf dir, and which directory it is on.
struct DirWatch {
    _watcher: RecommendedWatcher,
    identity: (u64, u64),
}

fn dir_identity(dir: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()))
}

fn start_watch(dir: &Path, tx: Events) -> notify::Result<DirWatch> {
    let identity = dir_identity(dir)
        .ok_or_else(|| notify::Error::path_not_found().add_path(dir.to_path_buf()))?;
    let mut watcher = notify::recommended_watcher(move |res| {
        // The receiver lives as long as the watch loop.
        let _ = tx.send(res);
    })?;
    watcher.watch(dir, RecursiveMode::NonRecursive)?;
    Ok(DirWatch {
        _watcher: watcher,
        identity,
    })
}

/// Whether an event can mean the primary config changed. Our own reads
/// (open / close-without-write) and unrelated files do not.
fn relevant(dir: &Path, ev: &notify::Result<Event>) -> bool {
    let Ok(ev) = ev else {
        return true;
    };
    if ev.need_rescan() {
        return true;
    }
    if let EventKind::Access(a) = ev.kind
        && a != AccessKind::Close(AccessMode::Write)
    {
        return false;
    }
    ev.paths.is_empty()
        || ev
            .paths
            .iter()
            .any(|p| p == dir || p.file_name().is_some_and(is_config_name))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trigger {
    Start,
    Event,
    Timer,
}

/// Logs outcomes; a failure repeated every poll is logged once.
#[derive(Default)]
struct Reporter {
    last_error: Option<String>,
    /// Whether an insert ever succeeded (before, nothing is "again").
    chained_once: bool,
}

impl Reporter {
    fn ok(&mut self, outcome: &InsertOutcome, trigger: Trigger) {
        let first = !std::mem::replace(&mut self.chained_once, true);
        if self.last_error.take().is_some() && !first {
            info!(path = %outcome.path().display(), "the CNI config is usable again");
        }
        let path = outcome.path().display();
        match (outcome, trigger) {
            (InsertOutcome::Unchanged(_), _) if first => {
                info!(%path, "ambit-cni is chained in the primary CNI config")
            }
            (InsertOutcome::Unchanged(_), _) => {
                debug!(%path, "ambit-cni is chained in the primary CNI config")
            }
            (InsertOutcome::Inserted(_), Trigger::Start) => {
                info!(%path, "chained ambit-cni at the end of the primary CNI config")
            }
            (InsertOutcome::Inserted(_), _) if first => {
                info!(%path, "the primary CNI config appeared; chained ambit-cni at its end")
            }
            (InsertOutcome::Inserted(_), _) => info!(
                %path,
                "the primary CNI config was rewritten without ambit-cni (by another CNI?); re-inserted it"
            ),
            (InsertOutcome::Updated(_), _) => {
                info!(%path, "rewrote the ambit-cni entry of the primary CNI config")
            }
        }
    }

    fn err(&mut self, e: &InstallError) {
        let msg = e.to_string();
        if self.last_error.as_deref() == Some(msg.as_str()) {
            debug!(error = %msg, "ambit-cni still cannot be chained");
        } else {
            warn!(error = %msg, "ambit-cni cannot be chained into the CNI config; retrying when the conf dir changes");
            self.last_error = Some(msg);
        }
    }
}

/// Where our entry is chained now: `Some(config file)` after an insert
/// succeeded, `None` before the first and after one failed.
pub type Chained = watch::Sender<Option<PathBuf>>;

async fn reconcile(
    cfg: &Arc<InstallConfig>,
    trigger: Trigger,
    report: &mut Reporter,
    chained: &Chained,
) {
    let c = Arc::clone(cfg);
    let now = match tokio::task::spawn_blocking(move || insert(&c)).await {
        Ok(Ok(outcome)) => {
            report.ok(&outcome, trigger);
            Some(outcome.path().to_path_buf())
        }
        Ok(Err(e)) => {
            report.err(&e);
            None
        }
        Err(e) => {
            warn!(error = %e, "inserting ambit-cni into the CNI config failed unexpectedly; retrying when the conf dir changes");
            None
        }
    };
    chained.send_if_modified(|c| {
        let changed = *c != now;
        *c = now;
        changed
    });
}

/// Keeps our entry chained in the primary config until `shutdown` resolves:
/// inserts it now, then again whenever the conf dir changes (another CNI
/// rewriting or replacing its file, a new primary file appearing), after a
/// short debounce (100 ms quiet, at most 1 s), and every 10 s regardless.
/// The directory is watched with inotify (`notify`); when it cannot be (it
/// does not exist yet, inotify limits) it is polled every second and the
/// watch retried. Each change is logged; errors (e.g. a config that is not
/// valid JSON, left untouched) are logged once until they change, and do
/// not stop the loop. Takes the config by value so it can be spawned.
/// On uninstall, stop it (resolve `shutdown`, await it) before [`remove`](super::remove),
/// or it chains the entry right back.
pub async fn watch_and_reinsert<F: Future>(cfg: InstallConfig, shutdown: F) {
    let (chained, _) = watch::channel(None);
    watch_and_reinsert_reporting(cfg, shutdown, chained).await
}

/// [`watch_and_reinsert`], publishing on `chained` which config file holds
/// our entry after each attempt (`None` while there is no primary config
/// or it cannot be used): the node agent is ready once it is `Some`.
pub async fn watch_and_reinsert_reporting<F: Future>(
    cfg: InstallConfig,
    shutdown: F,
    chained: Chained,
) {
    let cfg = Arc::new(cfg);
    let dir = cfg.cni_conf_dir.clone();
    let mut shutdown = std::pin::pin!(shutdown);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut watch: Option<DirWatch> = None;
    let mut watch_error_logged = false;
    let mut report = Reporter::default();
    let mut trigger = Trigger::Start;
    debug!(dir = %dir.display(), "keeping ambit-cni chained in the CNI config");
    loop {
        // (Re)watch before reading, so no later write goes unnoticed.
        if let Some(w) = &watch
            && dir_identity(&dir) != Some(w.identity)
        {
            info!(dir = %dir.display(), "the CNI conf dir was replaced or removed; watching it again");
            watch = None;
        }
        if watch.is_none() {
            match start_watch(&dir, tx.clone()) {
                Ok(w) => {
                    if watch_error_logged {
                        info!(dir = %dir.display(), "watching the CNI conf dir");
                    }
                    watch_error_logged = false;
                    watch = Some(w);
                }
                Err(_) if !watch_error_logged && !dir.exists() => {
                    info!(dir = %dir.display(), "the CNI conf dir does not exist yet; checking for it every second");
                    watch_error_logged = true;
                }
                Err(e) if !watch_error_logged => {
                    warn!(dir = %dir.display(), error = %e, "cannot watch the CNI conf dir; polling it every second instead (if inotify limits are exhausted, raise fs.inotify.max_user_instances / max_user_watches)");
                    watch_error_logged = true;
                }
                Err(e) => debug!(error = %e, "still cannot watch the CNI conf dir"),
            }
        }

        reconcile(&cfg, trigger, &mut report, &chained).await;

        let next_check = Instant::now()
            + if watch.is_some() {
                RESYNC_INTERVAL
            } else {
                POLL_INTERVAL
            };
        trigger = loop {
            tokio::select! {
                biased;
                _ = &mut shutdown => {
                    debug!(dir = %dir.display(), "stopped keeping ambit-cni chained");
                    return;
                }
                // Never `None`: `tx` lives in this function.
                Some(ev) = rx.recv() => {
                    if let Err(e) = &ev {
                        debug!(error = %e, "CNI conf dir watch error; checking the config");
                    }
                    if relevant(&dir, &ev) {
                        break Trigger::Event;
                    }
                }
                _ = sleep_until(next_check) => break Trigger::Timer,
            }
        };
        if trigger == Trigger::Event {
            // Let the burst end: the other CNI may still be writing.
            let started = Instant::now();
            let mut deadline = started + DEBOUNCE;
            loop {
                tokio::select! {
                    biased;
                    _ = &mut shutdown => {
                        debug!(dir = %dir.display(), "stopped keeping ambit-cni chained");
                        return;
                    }
                    r = timeout_at(deadline, rx.recv()) => match r {
                        Ok(Some(ev)) => {
                            if relevant(&dir, &ev) {
                                deadline = (Instant::now() + DEBOUNCE).min(started + DEBOUNCE_MAX);
                            }
                        }
                        Ok(None) | Err(_) => break,
                    }
                }
            }
        }
    }
}
