//! Reading a directory of Kubernetes YAML, the same way for every reader.
//!
//! [`ConfigDir`] is the stateful, synchronous reader: it remembers each
//! file's content hash and the objects the file serves, so re-reading a file
//! whose content did not change costs one read and one hash, and a changed
//! file yields only the objects that changed. It has no watcher of its own:
//! the control plane's file source drives it from inotify events, the node
//! agent from polling; both apply the same [`Change`]s.
//!
//! Bad input never deletes: a rejected document whose `kind/namespace/name`
//! can be read keeps that object's last good version; a document that is not
//! even valid YAML (so its identity is unknown), an unreadable or non-UTF-8
//! file keep every object the file had. A re-read file's errors are returned
//! with the changes (replacing its previous errors) and are logged; they
//! clear when the file is fixed or deleted.
//!
//! When two files define the same object, the definition that was serving
//! first keeps serving (on the first load: the file whose path sorts first);
//! the other file gets a [`ConfigError`] naming both files, and takes over
//! when the first one drops the object.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tracing::{info, warn};

use crate::change::{Change, ConfigError};
use crate::limits::MAX_FILE_BYTES;
use crate::objects::{Object, ObjectKey};

mod documents;
mod files;

#[cfg(test)]
mod tests;

pub use documents::{Document, ParsedFile, parse_documents, parse_file, split_documents};
pub use files::{MAX_DIR_DEPTH, config_files, is_yaml};

/// Content hash recorded for a file that could not be read.
const UNREAD: u64 = 0;

/// What re-reading some files changed: object changes, and the errors of
/// each re-read file (an empty list clears that file's errors).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DirUpdate {
    pub changes: Vec<Change>,
    /// `(file path, its errors)`, one entry per file that was (re)parsed or
    /// removed.
    pub errors: Vec<(String, Vec<ConfigError>)>,
}

impl DirUpdate {
    /// No change and no error scope.
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty() && self.errors.is_empty()
    }
}

/// An object a file serves, with where its document is.
#[derive(Debug, Clone)]
struct Served {
    object: Arc<Object>,
    document: usize,
    line: usize,
}

/// One file's last processed content and the objects it currently serves.
#[derive(Debug)]
struct FileState {
    hash: u64,
    served: BTreeMap<ObjectKey, Served>,
    /// Errors of the last parse (or read).
    parse_errors: Vec<ConfigError>,
    /// The error list last returned for this file (parse errors plus
    /// duplicates of objects another file serves).
    reported: Vec<ConfigError>,
}

/// The stateful reader of one config directory; see the module docs.
#[derive(Debug)]
pub struct ConfigDir {
    root: PathBuf,
    files: BTreeMap<PathBuf, FileState>,
    /// Files currently defining each object, in the order they started to:
    /// the first one serves it.
    claims: HashMap<ObjectKey, Vec<PathBuf>>,
    /// What the reader's consumer currently has.
    sent: HashMap<ObjectKey, Arc<Object>>,
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

impl ConfigDir {
    /// A reader of `root` that has read nothing yet (call [`Self::rescan`]).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            files: BTreeMap::new(),
            claims: HashMap::new(),
            sent: HashMap::new(),
        }
    }

    /// The directory read.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Number of config files currently tracked.
    pub fn file_count(&self) -> usize {
        self.files.len()
    }

    /// The objects served now (what the returned changes have built up).
    pub fn objects(&self) -> impl Iterator<Item = &Object> {
        self.sent.values().map(|o| o.as_ref())
    }

    /// The error list of every tracked file that has errors now.
    pub fn errors(&self) -> impl Iterator<Item = (&Path, &[ConfigError])> {
        self.files
            .iter()
            .filter(|(_, f)| !f.reported.is_empty())
            .map(|(p, f)| (p.as_path(), f.reported.as_slice()))
    }

    /// Re-reads every config file (the first load, or after lost events).
    pub fn rescan(&mut self) -> DirUpdate {
        let paths = self.scan(&self.root.clone());
        self.read(paths)
    }

    /// Re-reads what changed paths (files or directories, present or gone)
    /// affect.
    pub fn reread<I, P>(&mut self, changed: I) -> DirUpdate
    where
        I: IntoIterator<Item = P>,
        P: AsRef<Path>,
    {
        let paths = self.affected(changed);
        self.read(paths)
    }

    /// YAML files under `dir` now, plus the tracked ones that were under it
    /// (so vanished files are noticed).
    pub fn scan(&self, dir: &Path) -> BTreeSet<PathBuf> {
        let mut out = BTreeSet::new();
        files::walk(dir, 0, &mut out);
        out.extend(self.files.keys().filter(|f| f.starts_with(dir)).cloned());
        out
    }

    fn is_hidden(&self, p: &Path) -> bool {
        p.strip_prefix(&self.root).is_ok_and(|rel| {
            rel.components()
                .any(|c| c.as_os_str().to_string_lossy().starts_with('.'))
        })
    }

    /// The files to re-read when `changed` paths changed.
    pub fn affected<I, P>(&self, changed: I) -> BTreeSet<PathBuf>
    where
        I: IntoIterator<Item = P>,
        P: AsRef<Path>,
    {
        let mut out = BTreeSet::new();
        for p in changed {
            let p = p.as_ref();
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
                        out.insert(p.to_path_buf());
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

    /// Re-reads `paths` and returns the changes and error scopes.
    pub fn read(&mut self, paths: BTreeSet<PathBuf>) -> DirUpdate {
        let mut touched: BTreeSet<ObjectKey> = BTreeSet::new();
        let mut reread: BTreeSet<PathBuf> = BTreeSet::new();
        let mut removed = Vec::new();
        for path in paths {
            let bytes = match read_bounded(&path) {
                Ok(Some(b)) => b,
                Ok(None) => {
                    let err = whole_file_error(
                        &path,
                        format!(
                            "the file is larger than {MAX_FILE_BYTES} bytes (the file-size limit), so it is not read; split it into smaller files — the objects it defined before keep serving"
                        ),
                    );
                    self.mark_unread(&path, err);
                    reread.insert(path);
                    continue;
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::IsADirectory
                    ) =>
                {
                    if let Some(old) = self.files.remove(&path) {
                        info!(file = %path.display(), objects = old.served.len(), "config file removed");
                        for k in old.served.into_keys() {
                            self.unclaim(&k, &path);
                            touched.insert(k);
                        }
                        removed.push(path);
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
                    self.mark_unread(&path, err);
                    reread.insert(path);
                    continue;
                }
            };
            let hash = content_hash(&bytes);
            if self.files.get(&path).is_some_and(|f| f.hash == hash) {
                continue;
            }
            let (old, reported) = self
                .files
                .remove(&path)
                .map(|f| (f.served, f.reported))
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
                let claims = self.claims.entry(k.clone()).or_default();
                if !claims.contains(&path) {
                    claims.push(path.clone());
                }
                touched.insert(k.clone());
            }
            self.files.insert(
                path.clone(),
                FileState {
                    hash,
                    served,
                    parse_errors: errs,
                    reported,
                },
            );
            reread.insert(path);
        }
        let changes = self.reconcile(&touched);
        let mut errors: Vec<(String, Vec<ConfigError>)> = removed
            .iter()
            .map(|p| (p.display().to_string(), Vec::new()))
            .collect();
        errors.extend(self.error_scopes(&touched, reread));
        DirUpdate { changes, errors }
    }

    /// The error lists to return: every re-read file's, plus those of the
    /// other files that define a touched object whose list changed (a
    /// duplicate that took over, or started or stopped being one).
    fn error_scopes(
        &mut self,
        touched: &BTreeSet<ObjectKey>,
        mut affected: BTreeSet<PathBuf>,
    ) -> Vec<(String, Vec<ConfigError>)> {
        let always = affected.clone();
        for k in touched {
            if let Some(files) = self.claims.get(k) {
                affected.extend(files.iter().cloned());
            }
        }
        let mut out = Vec::new();
        for path in affected {
            let Some(state) = self.files.get(&path) else {
                continue;
            };
            let mut errs = state.parse_errors.clone();
            for (k, mine) in &state.served {
                let Some(owner) = self.claims.get(k).and_then(|c| c.first()) else {
                    continue;
                };
                if *owner == path {
                    continue;
                }
                let (d, l) = self
                    .files
                    .get(owner)
                    .and_then(|f| f.served.get(k))
                    .map_or((0, 0), |s| (s.document, s.line));
                errs.push(ConfigError {
                    file: path.display().to_string(),
                    document: mine.document,
                    line: mine.line,
                    kind: k.kind.to_string(),
                    namespace: k.namespace.clone(),
                    name: k.name.clone(),
                    reason: format!(
                        "{k} is also defined in {} (document {d}, line {l}), which defined it first and keeps serving it; this definition is ignored until that one is removed — remove one of the two",
                        owner.display()
                    ),
                });
            }
            if always.contains(&path) || state.reported != errs {
                for e in errs.iter().skip(state.parse_errors.len()) {
                    if !state.reported.contains(e) {
                        warn!("duplicate object: {e}");
                    }
                }
                if let Some(state) = self.files.get_mut(&path) {
                    state.reported.clone_from(&errs);
                }
                out.push((path.display().to_string(), errs));
            }
        }
        out
    }

    /// Keeps what `path` served, records `err` as its error and forces a
    /// re-parse once it is readable again, even if its content is
    /// unchanged, so the error is cleared.
    fn mark_unread(&mut self, path: &Path, err: ConfigError) {
        warn!("{err}");
        let state = self
            .files
            .entry(path.to_path_buf())
            .or_insert_with(|| FileState {
                hash: UNREAD,
                served: BTreeMap::new(),
                parse_errors: Vec::new(),
                reported: Vec::new(),
            });
        state.hash = UNREAD;
        state.parse_errors = vec![err];
    }

    fn unclaim(&mut self, k: &ObjectKey, path: &Path) {
        if let Some(set) = self.claims.get_mut(k) {
            set.retain(|p| p != path);
            if set.is_empty() {
                self.claims.remove(k);
            }
        }
    }

    /// Compares the effective version of each touched object with what the
    /// consumer has and emits the difference.
    fn reconcile(&mut self, touched: &BTreeSet<ObjectKey>) -> Vec<Change> {
        let mut changes = Vec::new();
        for k in touched {
            let effective = self
                .claims
                .get(k)
                .and_then(|s| s.first())
                .and_then(|p| self.files.get(p))
                .and_then(|f| f.served.get(k))
                .map(|s| s.object.clone());
            let k = k.clone();
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

/// The file's bytes, or `None` when it is larger than [`MAX_FILE_BYTES`]
/// (checked before reading, and while reading in case it grows).
fn read_bounded(path: &Path) -> io::Result<Option<Vec<u8>>> {
    let file = std::fs::File::open(path)?;
    if file.metadata()?.is_dir() {
        return Err(io::Error::new(io::ErrorKind::IsADirectory, "a directory"));
    }
    if file.metadata()?.len() > MAX_FILE_BYTES {
        return Ok(None);
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= MAX_FILE_BYTES).then_some(bytes))
}

/// The objects a file serves after a re-parse: the accepted ones, plus the
/// last good version of every rejected-but-identified object, plus — when
/// some document could not even be identified — everything it had.
fn merge_served(
    old: &BTreeMap<ObjectKey, Served>,
    objects: Vec<(Object, usize, usize)>,
    rejected: &[ObjectKey],
    unidentified: bool,
) -> BTreeMap<ObjectKey, Served> {
    let mut served: BTreeMap<ObjectKey, Served> = BTreeMap::new();
    for (o, document, line) in objects {
        let k = o.key();
        let object = match old.get(&k) {
            Some(prev) if *prev.object == o => prev.object.clone(),
            _ => Arc::new(o),
        };
        served.insert(
            k,
            Served {
                object,
                document,
                line,
            },
        );
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
