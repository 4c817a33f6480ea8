//! The file source: a directory of Kubernetes YAML, watched for changes.
//!
//! Every `*.yaml` / `*.yml` file under the directory (recursively; names
//! starting with `.` are skipped, symlinks followed) is split into documents
//! at `---` lines and each document decoded into an object. The initial state
//! is sent as one update with `initial_sync_done: true`; afterwards inotify
//! events (debounced ~30 ms) make the source re-read the affected files, and
//! only files whose content hash changed are parsed again. For each such file
//! its previous objects are diffed against the new ones: upserts for changed
//! objects, deletes for vanished ones.
//!
//! Bad input never deletes: a rejected document whose `kind/namespace/name`
//! can be read keeps that object's last good version; a document that is not
//! even valid YAML (so its identity is unknown), an unreadable or non-UTF-8
//! file keep every object the file had. The file's errors travel to the
//! model in the same update (replacing the file's previous errors) and are
//! logged; they clear when the file is fixed or deleted.
//!
//! When two files define the same object, the one whose path sorts first
//! wins and a warning is logged.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::event::{AccessKind, AccessMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::model::{
    Change, ConfigError, DecodeFailure, ModelHandle, Object, ObjectKey, SourceUpdate,
    decode_yaml_document,
};

use super::FILE_SOURCE;

/// Quiet time that ends a burst of file events.
const DEBOUNCE: Duration = Duration::from_millis(30);
/// A burst is processed at the latest this long after its first event.
const DEBOUNCE_MAX: Duration = Duration::from_millis(500);
/// Content hash recorded for a file that could not be read.
const UNREAD: u64 = 0;
/// Deepest directory nesting followed (guards against symlink loops).
const MAX_DEPTH: usize = 16;

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

    let state = State::new(dir.clone());
    let (state, mut update) = tokio::task::spawn_blocking(move || {
        let mut state = state;
        let paths = state.scan(&state.root.clone());
        let update = state.process(paths);
        (state, update)
    })
    .await
    .map_err(|e| FileSourceError::Load(dir.clone(), e.to_string()))?;
    update.errors.retain(|(_, errs)| !errs.is_empty());
    update.initial_sync_done = true;
    info!(
        dir = %dir.display(),
        files = state.files.len(),
        objects = update.changes.len(),
        rejected = update.errors.iter().map(|(_, e)| e.len()).sum::<usize>(),
        "loaded config directory"
    );
    model
        .send(update)
        .await
        .map_err(|_| FileSourceError::ModelClosed(dir.clone()))?;
    let task = tokio::spawn(watch_loop(state, ev_rx, model));
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

async fn watch_loop(
    mut state: State,
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
            let paths = state.paths_for(&batch);
            let update = state.process(paths);
            (state, update)
        });
        let update;
        (state, update) = match job.await {
            Ok(r) => r,
            Err(e) => {
                error!(error = %e, "processing config file changes failed; the file source stops watching (restart the control plane)");
                return;
            }
        };
        if update.changes.is_empty() && update.errors.is_empty() {
            continue;
        }
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

/// One file's last processed content and the objects it currently serves.
struct FileState {
    hash: u64,
    served: BTreeMap<ObjectKey, Arc<Object>>,
}

/// Everything the source knows about the directory.
struct State {
    root: PathBuf,
    files: BTreeMap<PathBuf, FileState>,
    /// Files currently defining each object.
    claims: HashMap<ObjectKey, BTreeSet<PathBuf>>,
    /// What the model currently has from us.
    sent: HashMap<ObjectKey, Arc<Object>>,
}

fn is_yaml(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"))
}

fn content_hash(bytes: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

fn whole_file_error(path: &Path, reason: String) -> ConfigError {
    ConfigError {
        file: path.display().to_string(),
        document: 0,
        line: 1,
        kind: String::new(),
        namespace: String::new(),
        name: String::new(),
        reason,
    }
}

impl State {
    fn new(root: PathBuf) -> Self {
        Self {
            root,
            files: BTreeMap::new(),
            claims: HashMap::new(),
            sent: HashMap::new(),
        }
    }

    /// YAML files under `dir` now, plus the tracked ones that were under it
    /// (so vanished files are noticed).
    fn scan(&self, dir: &Path) -> BTreeSet<PathBuf> {
        let mut out = BTreeSet::new();
        walk(dir, 0, &mut out);
        out.extend(self.files.keys().filter(|f| f.starts_with(dir)).cloned());
        out
    }

    fn is_hidden(&self, p: &Path) -> bool {
        p.strip_prefix(&self.root).is_ok_and(|rel| {
            rel.components()
                .any(|c| c.as_os_str().to_string_lossy().starts_with('.'))
        })
    }

    /// The files to re-read for a batch of events.
    fn paths_for(&self, batch: &Batch) -> BTreeSet<PathBuf> {
        if batch.rescan {
            return self.scan(&self.root.clone());
        }
        let mut out = BTreeSet::new();
        for p in &batch.paths {
            let meta = std::fs::metadata(p);
            if self.is_hidden(p) {
                // Editor temp files are ignored; a hidden directory (the
                // `..data` symlink swap of a mounted ConfigMap) can change
                // what every symlinked file points to.
                if meta.is_ok_and(|m| m.is_dir()) {
                    return self.scan(&self.root.clone());
                }
                continue;
            }
            match meta {
                Ok(m) if m.is_dir() => out.extend(self.scan(p)),
                Ok(_) => {
                    if is_yaml(p) {
                        out.insert(p.clone());
                    }
                }
                Err(_) => {
                    // Gone: the file itself, or every tracked file under a
                    // removed directory.
                    out.extend(self.files.keys().filter(|f| f.starts_with(p)).cloned());
                }
            }
        }
        out
    }

    /// Re-reads `paths` and returns the changes and error scopes for the
    /// model.
    fn process(&mut self, paths: BTreeSet<PathBuf>) -> SourceUpdate {
        let mut touched: BTreeSet<ObjectKey> = BTreeSet::new();
        let mut errors = Vec::new();
        for path in paths {
            let shown = path.display().to_string();
            let bytes = match std::fs::read(&path) {
                Ok(b) => b,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::IsADirectory
                    ) =>
                {
                    if let Some(old) = self.files.remove(&path) {
                        info!(file = %shown, objects = old.served.len(), "config file removed");
                        for k in old.served.into_keys() {
                            self.unclaim(&k, &path);
                            touched.insert(k);
                        }
                        errors.push((shown, Vec::new()));
                    }
                    continue;
                }
                Err(e) => {
                    let err = whole_file_error(
                        &path,
                        format!(
                            "cannot read the file: {e}; fix its permissions — the objects it defined before keep serving"
                        ),
                    );
                    warn!("{err}");
                    errors.push((shown, vec![err]));
                    // Force a re-parse once it is readable again, even if
                    // the content is unchanged, so this error is cleared.
                    self.files
                        .entry(path)
                        .or_insert_with(|| FileState {
                            hash: UNREAD,
                            served: BTreeMap::new(),
                        })
                        .hash = UNREAD;
                    continue;
                }
            };
            let hash = content_hash(&bytes);
            if self.files.get(&path).is_some_and(|f| f.hash == hash) {
                continue;
            }
            let old = self
                .files
                .remove(&path)
                .map(|f| f.served)
                .unwrap_or_default();
            let (served, errs) = match std::str::from_utf8(&bytes) {
                Ok(text) => {
                    let parsed = parse_file(&path, text);
                    (
                        merge_served(&old, parsed.objects, &parsed.rejected, parsed.unidentified),
                        parsed.errors,
                    )
                }
                Err(e) => (
                    old.clone(),
                    vec![whole_file_error(
                        &path,
                        format!(
                            "the file is not valid UTF-8 (first bad byte at offset {}); save it as UTF-8 — the objects it defined before keep serving",
                            e.valid_up_to()
                        ),
                    )],
                ),
            };
            for err in &errs {
                warn!("rejected config: {err}");
            }
            for k in old.keys() {
                if !served.contains_key(k) {
                    self.unclaim(k, &path);
                }
                touched.insert(k.clone());
            }
            for k in served.keys() {
                self.claims
                    .entry(k.clone())
                    .or_default()
                    .insert(path.clone());
                touched.insert(k.clone());
            }
            self.files.insert(path, FileState { hash, served });
            errors.push((shown, errs));
        }
        SourceUpdate {
            source: FILE_SOURCE.to_string(),
            changes: self.reconcile(touched),
            errors,
            initial_sync_done: false,
        }
    }

    fn unclaim(&mut self, k: &ObjectKey, path: &Path) {
        if let Some(set) = self.claims.get_mut(k) {
            set.remove(path);
            if set.is_empty() {
                self.claims.remove(k);
            }
        }
    }

    /// Compares the effective version of each touched object with what the
    /// model has and emits the difference.
    fn reconcile(&mut self, touched: BTreeSet<ObjectKey>) -> Vec<Change> {
        let mut changes = Vec::new();
        for k in touched {
            let owners = self.claims.get(&k);
            if let Some(set) = owners.filter(|s| s.len() > 1) {
                let files: Vec<String> = set.iter().map(|p| p.display().to_string()).collect();
                warn!(object = %k, files = ?files, "object defined in more than one file; the first file wins — remove the duplicates");
            }
            let effective = owners
                .and_then(|s| s.first())
                .and_then(|p| self.files.get(p))
                .and_then(|f| f.served.get(&k))
                .cloned();
            match (effective, self.sent.get(&k)) {
                (Some(new), Some(old)) if Arc::ptr_eq(&new, old) || *new == **old => {}
                (Some(new), _) => {
                    changes.push(Change::Upsert((*new).clone()));
                    self.sent.insert(k, new);
                }
                (None, Some(_)) => {
                    self.sent.remove(&k);
                    changes.push(Change::Delete(k));
                }
                (None, None) => {}
            }
        }
        changes
    }
}

/// The objects a file serves after a re-parse: the accepted ones, plus the
/// last good version of every rejected-but-identified object, plus — when
/// some document could not even be identified — everything it had.
fn merge_served(
    old: &BTreeMap<ObjectKey, Arc<Object>>,
    objects: Vec<Object>,
    rejected: &[ObjectKey],
    unidentified: bool,
) -> BTreeMap<ObjectKey, Arc<Object>> {
    let mut served: BTreeMap<ObjectKey, Arc<Object>> = BTreeMap::new();
    for o in objects {
        let k = o.key();
        let arc = match old.get(&k) {
            Some(prev) if **prev == o => prev.clone(),
            _ => Arc::new(o),
        };
        served.insert(k, arc);
    }
    for k in rejected {
        if let Some(prev) = old.get(k) {
            served.entry(k.clone()).or_insert_with(|| prev.clone());
        }
    }
    if unidentified {
        for (k, prev) in old {
            served.entry(k.clone()).or_insert_with(|| prev.clone());
        }
    }
    served
}

/// Every config file the source reads under `dir`: `*.yaml` / `*.yml`,
/// recursively, skipping dot-entries — for other readers of the same
/// directory (the node agent's local-mode view).
pub fn config_files(dir: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    walk(dir, 0, &mut out);
    out
}

fn walk(dir: &Path, depth: usize, out: &mut BTreeSet<PathBuf>) {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            warn!(dir = %dir.display(), error = %e, "cannot list config directory; its files are not (re)loaded — fix its permissions");
            return;
        }
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() => {
                if depth < MAX_DEPTH {
                    walk(&path, depth + 1, out);
                } else {
                    warn!(dir = %path.display(), "config directory nested too deeply (symlink loop?); not descending");
                }
            }
            Ok(_) if is_yaml(&path) => {
                out.insert(path);
            }
            Ok(_) => {}
            Err(e) => debug!(path = %path.display(), error = %e, "skipping unreadable entry"),
        }
    }
}

/// One document of a file.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Document<'t> {
    /// 0-based index among the file's non-empty documents.
    pub index: usize,
    /// 1-based line of the document's first content line.
    pub line: usize,
    /// Number of file lines before `text`.
    pub offset: usize,
    pub text: std::borrow::Cow<'t, str>,
}

/// A `---` document marker (optionally followed by content) or a `...`
/// document end marker; returns what follows the marker on the line.
fn marker(line: &str) -> Option<&str> {
    if line == "..." || line.starts_with("...") && line[3..].starts_with(char::is_whitespace) {
        return Some("");
    }
    let rest = line.strip_prefix("---")?;
    if rest.is_empty() || rest.starts_with(char::is_whitespace) {
        Some(rest)
    } else {
        None
    }
}

fn is_content(line: &str) -> bool {
    let t = line.trim();
    !t.is_empty() && !t.starts_with('#')
}

/// A document being collected by [`split_documents`].
#[derive(Default)]
struct Chunk {
    /// Byte offset of the body.
    start: usize,
    /// Line index of the chunk's first line.
    offset: usize,
    /// Line index of the first content line.
    first: Option<usize>,
    /// Content that followed the `---` marker on its line.
    head: Option<String>,
}

fn push_document<'t>(text: &'t str, docs: &mut Vec<Document<'t>>, c: Chunk, end: usize) {
    let Some(first) = c.first else {
        return;
    };
    let body = &text[c.start.min(end)..end];
    let text = match c.head {
        Some(h) => std::borrow::Cow::Owned(format!("{h}\n{body}")),
        None => std::borrow::Cow::Borrowed(body),
    };
    docs.push(Document {
        index: docs.len(),
        line: first + 1,
        offset: c.offset,
        text,
    });
}

/// Splits a file into documents at marker lines; empty and comment-only
/// documents are dropped.
pub(crate) fn split_documents(text: &str) -> Vec<Document<'_>> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut docs = Vec::new();
    let mut cur = Chunk::default();
    let mut pos = 0usize;
    for (i, raw) in text.split_inclusive('\n').enumerate() {
        let line = raw.trim_end_matches(['\n', '\r']);
        if let Some(rest) = marker(line) {
            push_document(text, &mut docs, std::mem::take(&mut cur), pos);
            cur.start = pos + raw.len();
            cur.offset = i + 1;
            if is_content(rest) {
                // `--- {inline: doc}`: keep the content, blank the marker.
                cur.head = Some(format!("   {rest}"));
                cur.offset = i;
                cur.first = Some(i);
            }
        } else if cur.first.is_none() && is_content(line) {
            cur.first = Some(i);
        }
        pos += raw.len();
    }
    push_document(text, &mut docs, cur, pos);
    docs
}

/// The result of parsing one file.
pub(crate) struct ParsedFile {
    pub objects: Vec<Object>,
    pub errors: Vec<ConfigError>,
    /// Keys of rejected documents whose identity could be read.
    pub rejected: Vec<ObjectKey>,
    /// Some rejected document's identity could not be read.
    pub unidentified: bool,
}

pub(crate) fn parse_file(path: &Path, text: &str) -> ParsedFile {
    let file = path.display().to_string();
    let mut out = ParsedFile {
        objects: Vec::new(),
        errors: Vec::new(),
        rejected: Vec::new(),
        unidentified: false,
    };
    let mut seen: HashMap<ObjectKey, (usize, usize)> = HashMap::new();
    for doc in split_documents(text) {
        let err = |f: Box<DecodeFailure>| {
            let f = *f;
            let keeps = if f.key.is_some() {
                "the last accepted version of this object, if any, keeps serving"
            } else {
                "every object this file defined before keeps serving"
            };
            ConfigError {
                file: file.clone(),
                document: doc.index,
                line: doc.line,
                kind: f.kind,
                namespace: f.namespace,
                name: f.name,
                reason: format!("{} ({keeps})", f.error),
            }
        };
        match decode_yaml_document(&doc.text, doc.offset) {
            Ok(None) => {}
            Ok(Some(obj)) => {
                let key = obj.key();
                if let Some((d, l)) = seen.get(&key) {
                    out.errors.push(ConfigError {
                        file: file.clone(),
                        document: doc.index,
                        line: doc.line,
                        kind: key.kind.to_string(),
                        namespace: key.namespace.clone(),
                        name: key.name.clone(),
                        reason: format!("duplicate of document {d} (line {l}) in the same file; this copy is ignored — remove one of them"),
                    });
                    continue;
                }
                seen.insert(key, (doc.index, doc.line));
                out.objects.push(obj);
            }
            Err(f) => {
                match &f.key {
                    Some(k) => out.rejected.push(k.clone()),
                    None => out.unidentified = true,
                }
                out.errors.push(err(f));
            }
        }
    }
    out
}

/// Parses the text of one file: the accepted objects and the errors of the
/// rejected documents (with file, document index, line and identity).
pub fn parse_documents(path: &Path, text: &str) -> (Vec<Object>, Vec<ConfigError>) {
    let p = parse_file(path, text);
    (p.objects, p.errors)
}
