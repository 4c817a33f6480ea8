//! Finding the node's primary network config and chaining our entry into it.

use crate::protocol::json_kind;
use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use tracing::{debug, warn};

use super::atomic::{self, Owner};
use super::binary::remove_binary;
use super::{InsertOutcome, InstallConfig, InstallError, PLUGIN_TYPE};

/// The extensions libcni loads from a conf dir.
const CONF_EXTENSIONS: [&str; 3] = ["conf", "conflist", "json"];

/// Attempts at a read-merge-write that races with another writer.
const MERGE_ATTEMPTS: usize = 3;

const HINT_PRIMARY: &str = "it belongs to the node's primary CNI: fix it or have that CNI rewrite it, and the agent will insert itself again";

/// The config files of `dir` the runtime considers, in the order it does:
/// names ending in `.conf`, `.conflist` or `.json` (case-sensitive, hidden
/// files included, directories skipped, our temp files skipped), byte order.
/// A missing directory has none.
fn config_files(dir: &Path) -> Result<Vec<PathBuf>, InstallError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(InstallError::Read {
                path: dir.to_path_buf(),
                source,
            });
        }
    };
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| InstallError::Read {
            path: dir.to_path_buf(),
            source,
        })?;
        let name = entry.file_name();
        if !is_config_name(&name) {
            continue;
        }
        // libcni skips directories (not following symlinks); so do we.
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        files.push(entry.path());
    }
    files.sort();
    Ok(files)
}

/// Whether a file name is one libcni would load (and not our temp file).
pub(super) fn is_config_name(name: &OsStr) -> bool {
    if atomic::is_temp_name(name) {
        return false;
    }
    Path::new(name)
        .extension()
        .and_then(OsStr::to_str)
        .is_some_and(|e| CONF_EXTENSIONS.contains(&e))
}

/// The node's primary network config: the first of the conf dir's
/// `*.conf` / `*.conflist` / `*.json` files in byte order, as libcni lists
/// them and the runtime picks. `Ok(None)` when there is none, including when
/// the directory does not exist (yet).
pub fn find_primary_conflist(conf_dir: &Path) -> Result<Option<PathBuf>, InstallError> {
    Ok(config_files(conf_dir)?.into_iter().next())
}

/// How a config file is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    /// `{"cniVersion", "name", "plugins": [...]}`
    List,
    /// One plugin: `{"cniVersion", "name", "type", ...}`.
    Single,
}

/// A parsed config file.
struct Loaded {
    path: PathBuf,
    bytes: Vec<u8>,
    doc: Map<String, Value>,
    format: Format,
    mode: u32,
    owner: Owner,
}

fn bad(path: &Path, problem: impl Into<String>, hint: &'static str) -> InstallError {
    InstallError::BadConfig {
        path: path.to_path_buf(),
        problem: problem.into(),
        hint,
    }
}

fn has_ext(path: &Path, ext: &str) -> bool {
    path.extension().is_some_and(|e| e == ext)
}

/// Reads and checks one config file. Never modifies it.
fn load(path: &Path) -> Result<Loaded, InstallError> {
    let read_err = |source| InstallError::Read {
        path: path.to_path_buf(),
        source,
    };
    let meta = fs::metadata(path).map_err(read_err)?;
    let bytes = fs::read(path).map_err(read_err)?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| InstallError::NotJson {
        path: path.to_path_buf(),
        line: e.line(),
        column: e.column(),
        reason: e.to_string(),
    })?;
    let doc = match value {
        Value::Object(m) => m,
        other => {
            return Err(bad(
                path,
                format!("the top level is {}, not a JSON object", json_kind(&other)),
                HINT_PRIMARY,
            ));
        }
    };
    let format = if has_ext(path, "conflist") {
        match doc.get("plugins") {
            Some(Value::Array(_)) => Format::List,
            None => {
                return Err(bad(
                    path,
                    "no \"plugins\" array (a .conflist needs one)",
                    HINT_PRIMARY,
                ));
            }
            Some(other) => {
                return Err(bad(
                    path,
                    format!("\"plugins\" is {}, not an array", json_kind(other)),
                    HINT_PRIMARY,
                ));
            }
        }
    } else {
        // libcni reads .conf/.json as one plugin; a list in one (which the
        // runtime rejects) is accepted here and written out as a .conflist.
        match (doc.get("type"), doc.get("plugins")) {
            (Some(Value::String(_)), _) => Format::Single,
            (_, Some(Value::Array(_))) => Format::List,
            (Some(other), _) => {
                return Err(bad(
                    path,
                    format!("\"type\" is {}, not a string", json_kind(other)),
                    HINT_PRIMARY,
                ));
            }
            (None, _) => {
                return Err(bad(
                    path,
                    "neither a \"type\" (single plugin config) nor a \"plugins\" array (plugin list)",
                    HINT_PRIMARY,
                ));
            }
        }
    };
    Ok(Loaded {
        path: path.to_path_buf(),
        bytes,
        doc,
        format,
        mode: meta.permissions().mode() & 0o7777,
        owner: Owner {
            uid: meta.uid(),
            gid: meta.gid(),
        },
    })
}

fn is_ours(plugin: &Value) -> bool {
    plugin.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)
}

fn check_plugin_config(cfg: &InstallConfig) -> Result<&Value, InstallError> {
    let v = &cfg.plugin_config;
    match v.get("type") {
        _ if !v.is_object() => Err(InstallError::PluginConfig(format!(
            "it is {}, not an object",
            json_kind(v)
        ))),
        Some(Value::String(t)) if t == PLUGIN_TYPE => Ok(v),
        Some(other) => Err(InstallError::PluginConfig(format!(
            "its \"type\" is {other}"
        ))),
        None => Err(InstallError::PluginConfig("it has no \"type\"".into())),
    }
}

/// The merge of our entry into a loaded file: the document to write, where,
/// and what it means.
struct Merged {
    doc: Map<String, Value>,
    target: PathBuf,
    outcome: InsertOutcome,
}

/// The list `plugins` of a `Format::List` document (checked by `load`).
fn plugins_of(doc: &Map<String, Value>) -> &[Value] {
    match doc.get("plugins") {
        Some(Value::Array(a)) => a,
        _ => &[],
    }
}

fn merge(loaded: &Loaded, ours: &Value) -> Result<Merged, InstallError> {
    let path = &loaded.path;
    let target = if has_ext(path, "conflist") {
        path.clone()
    } else {
        path.with_extension("conflist")
    };
    let (mut doc, old_plugins): (Map<String, Value>, Vec<Value>) = match loaded.format {
        Format::List => (loaded.doc.clone(), plugins_of(&loaded.doc).to_vec()),
        Format::Single => {
            // As libcni's ConfListFromConf: the list takes the conf's name
            // and version; the conf itself becomes the first plugin, as is.
            let mut doc = Map::new();
            for key in ["cniVersion", "name"] {
                if let Some(v) = loaded.doc.get(key) {
                    doc.insert(key.to_owned(), v.clone());
                }
            }
            (doc, vec![Value::Object(loaded.doc.clone())])
        }
    };
    let had_ours = old_plugins.iter().any(is_ours);
    let mut plugins: Vec<Value> = old_plugins.into_iter().filter(|p| !is_ours(p)).collect();
    if plugins.is_empty() {
        return Err(bad(
            path,
            if had_ours {
                "its only plugin is ambit-cni; ambit-cni is chained and needs the primary CNI's plugins before it"
            } else {
                "the \"plugins\" array is empty"
            },
            "check that the node's primary CNI is installed and has written this file",
        ));
    }
    plugins.push(ours.clone());
    doc.insert("plugins".to_owned(), Value::Array(plugins));
    let outcome = if target == *path && doc == loaded.doc {
        InsertOutcome::Unchanged(target.clone())
    } else if had_ours {
        InsertOutcome::Updated(target.clone())
    } else {
        InsertOutcome::Inserted(target.clone())
    };
    Ok(Merged {
        doc,
        target,
        outcome,
    })
}

fn render(doc: &Map<String, Value>) -> Vec<u8> {
    // Serializing a Map of Values cannot fail; fall back to compact anyway.
    let mut out = serde_json::to_vec_pretty(doc)
        .unwrap_or_else(|_| Value::Object(doc.clone()).to_string().into_bytes());
    out.push(b'\n');
    out
}

/// Whether the file still has the bytes we merged from.
fn unchanged_since(loaded: &Loaded) -> bool {
    fs::read(&loaded.path).is_ok_and(|b| b == loaded.bytes)
}

/// Writes `doc` to `target` with the original file's mode and owner; when
/// `target` differs (a converted `.conf`), removes the original after.
fn write(loaded: &Loaded, doc: &Map<String, Value>, target: &Path) -> Result<(), InstallError> {
    atomic::replace(target, &render(doc), loaded.mode, Some(loaded.owner)).map_err(|source| {
        InstallError::Write {
            path: target.to_path_buf(),
            source,
        }
    })?;
    if target != loaded.path {
        match fs::remove_file(&loaded.path) {
            Ok(()) => {
                let _ = atomic::sync_dir(&loaded.path);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(InstallError::Write {
                    path: loaded.path.clone(),
                    source,
                });
            }
        }
    }
    Ok(())
}

/// Chains our entry ([`InstallConfig::plugin_config`]) at the end of the
/// primary config's `plugins`, replacing any `ambit-cni` entries, keeping
/// everything else. See the [module docs](super) for the `.conf` conversion
/// and how files are written. [`InstallError::NoPrimaryConfig`] when the
/// conf dir has no config; a file that is not valid JSON or not a network
/// config is left untouched and reported.
pub fn insert(cfg: &InstallConfig) -> Result<InsertOutcome, InstallError> {
    let ours = check_plugin_config(cfg)?;
    let dir = &cfg.cni_conf_dir;
    atomic::sweep_stale_temps(dir);
    for attempt in 1..=MERGE_ATTEMPTS {
        let last = attempt == MERGE_ATTEMPTS;
        let Some(primary) = find_primary_conflist(dir)? else {
            return Err(InstallError::NoPrimaryConfig { dir: dir.clone() });
        };
        let loaded = match load(&primary) {
            // Replaced by delete + create between listing and reading.
            Err(InstallError::Read { source, .. })
                if source.kind() == io::ErrorKind::NotFound && !last =>
            {
                continue;
            }
            r => r?,
        };
        let merged = merge(&loaded, ours)?;
        if !merged.outcome.changed() {
            return Ok(merged.outcome);
        }
        if !last && !unchanged_since(&loaded) {
            continue;
        }
        if merged.target != loaded.path && merged.target.exists() {
            warn!(path = %merged.target.display(), "overwriting the existing file with the conversion of {}", loaded.path.display());
        }
        write(&loaded, &merged.doc, &merged.target)?;
        // The caller logs the outcome (as the watch loop does).
        debug!(
            from = %loaded.path.display(), to = %merged.target.display(), outcome = ?merged.outcome,
            "wrote the primary CNI config"
        );
        return Ok(merged.outcome);
    }
    // The loop's last attempt always returns.
    Err(InstallError::NoPrimaryConfig { dir: dir.clone() })
}

/// Removes every `ambit-cni` entry from the conf dir's config files (the
/// primary and any older one still holding an entry), leaving everything
/// else, then removes the installed binary — only after the configs, so the
/// runtime never calls a missing plugin. `Ok(true)` if anything was removed;
/// a second call is `Ok(false)`. A primary config that cannot be parsed is an
/// error (and the binary stays); other unparsable files are skipped with a
/// warning.
pub fn remove(cfg: &InstallConfig) -> Result<bool, InstallError> {
    let dir = &cfg.cni_conf_dir;
    let mut removed = false;
    for (i, path) in config_files(dir)?.into_iter().enumerate() {
        let primary = i == 0;
        let mut attempt = 1;
        loop {
            let loaded = match load(&path) {
                Ok(l) => l,
                Err(InstallError::Read { source, .. })
                    if source.kind() == io::ErrorKind::NotFound =>
                {
                    break;
                }
                Err(e) if primary => return Err(e),
                Err(e) => {
                    warn!(error = %e, "skipping a config file while removing ambit-cni");
                    break;
                }
            };
            if loaded.format != Format::List || !plugins_of(&loaded.doc).iter().any(is_ours) {
                break;
            }
            let mut doc = loaded.doc.clone();
            let kept: Vec<Value> = plugins_of(&loaded.doc)
                .iter()
                .filter(|p| !is_ours(p))
                .cloned()
                .collect();
            if kept.is_empty() {
                warn!(path = %path.display(), "ambit-cni was the only plugin; the list is left empty");
            }
            doc.insert("plugins".to_owned(), Value::Array(kept));
            if attempt < MERGE_ATTEMPTS && !unchanged_since(&loaded) {
                attempt += 1;
                continue;
            }
            write(&loaded, &doc, &path)?;
            tracing::info!(path = %path.display(), "removed ambit-cni from the CNI config");
            removed = true;
            break;
        }
    }
    Ok(remove_binary(cfg)? || removed)
}
