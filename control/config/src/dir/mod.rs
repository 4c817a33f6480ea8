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
//! When two files define the same object, the one whose path sorts first
//! wins and a warning is logged.

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

/// One file's last processed content and the objects it currently serves.
#[derive(Debug)]
struct FileState {
    hash: u64,
    served: BTreeMap<ObjectKey, Arc<Object>>,
}

/// The stateful reader of one config directory; see the module docs.
#[derive(Debug)]
pub struct ConfigDir {
    root: PathBuf,
    files: BTreeMap<PathBuf, FileState>,
    /// Files currently defining each object.
    claims: HashMap<ObjectKey, BTreeSet<PathBuf>>,
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
        let mut errors = Vec::new();
        for path in paths {
            let shown = path.display().to_string();
            let bytes = match read_bounded(&path) {
                Ok(Some(b)) => b,
                Ok(None) => {
                    let err = whole_file_error(
                        &path,
                        format!(
                            "the file is larger than {MAX_FILE_BYTES} bytes (the file-size limit), so it is not read; split it into smaller files — the objects it defined before keep serving"
                        ),
                    );
                    warn!("{err}");
                    errors.push((shown, vec![err]));
                    self.mark_unread(path);
                    continue;
                }
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
                    self.mark_unread(path);
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
                    let objects = parsed.objects.into_iter().map(|(o, _, _)| o).collect();
                    (
                        merge_served(&old, objects, &parsed.rejected, parsed.unidentified),
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
        DirUpdate {
            changes: self.reconcile(touched),
            errors,
        }
    }

    /// Keeps what `path` served but forces a re-parse once it is readable
    /// again, even if its content is unchanged, so its error is cleared.
    fn mark_unread(&mut self, path: PathBuf) {
        self.files
            .entry(path)
            .or_insert_with(|| FileState {
                hash: UNREAD,
                served: BTreeMap::new(),
            })
            .hash = UNREAD;
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
    /// consumer has and emits the difference.
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
pub(crate) fn merge_served(
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
