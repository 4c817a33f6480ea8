//! Installing the `ambit-cni` plugin on the node (issue 5, item 2): the
//! binary goes into the CNI bin dir, and an `ambit-cni` entry is chained at
//! the end of the node's primary network config, where the agent keeps it
//! while other CNIs rewrite the file.
//!
//! # Which file
//!
//! The *primary* config is the one the container runtime uses: libcni lists
//! the conf dir's `*.conf`, `*.conflist` and `*.json` files (directories
//! skipped, hidden files included, case-sensitive extensions) and the runtime
//! takes the first in byte order ([`find_primary_conflist`]). Our own temp
//! files (`.<name>.ambit-tmp-*`) never match those extensions and are skipped
//! anyway. A missing or empty conf dir is `Ok(None)` there, and
//! [`InstallError::NoPrimaryConfig`] from [`insert`]: ambit-cni only chains
//! after a primary CNI, so there is nothing to insert into until one has
//! written its config ([`watch_and_reinsert`] inserts as soon as it does).
//!
//! # What is written
//!
//! * Our entry is appended at the **end** of `plugins` (it needs the other
//!   plugins' `prevResult`); every other plugin, its position and every other
//!   field stay as they were. Any existing `ambit-cni` entries (wherever they
//!   are) are replaced by exactly one, with the current config.
//! * A single-plugin `foo.conf` (or `foo.json`) is converted like Istio's
//!   install-cni does and as libcni's `ConfListFromConf` reads it:
//!   `foo.conflist` = `{"cniVersion", "name"` copied from the conf, `"plugins":
//!   [<the conf, unchanged>, <ours>]}`; it is written first and `foo.conf` is
//!   removed after, so the runtime always sees a complete config (`foo.conf`
//!   sorts before `foo.conflist`, so it stays the primary until removed). A
//!   stale `foo.conflist` (e.g. our earlier conversion, before the primary
//!   CNI re-created `foo.conf`) is overwritten. Rewriting a `.conf` in place
//!   as a list is not an option: runtimes reject a `.conf` without `type`.
//!   [`remove`] does not convert back: the list with the one original plugin
//!   is equivalent.
//! * Writes are atomic: a temp file in the same directory, fsync, the
//!   original file's mode (and owner, when permitted), rename, fsync of the
//!   directory. A symlinked config is therefore replaced by a regular file.
//!   Just before writing, the file is re-read; if another CNI changed it in
//!   the meantime the merge is redone (up to 3 times).
//! * JSON object keys are written in sorted order (pretty-printed, 2-space
//!   indent): the workspace's `serde_json` is built without `preserve_order`.
//!   Key order has no meaning to libcni (Istio's Go code sorts them too);
//!   values, array order and plugin order are preserved exactly.
//! * A file that is not valid JSON, or not a network config, is never
//!   modified: the error names the file, the problem (line/column for JSON
//!   errors) and what to do.

use std::io;
use std::path::PathBuf;

mod atomic;
mod binary;
mod conflist;
mod watch;

pub use binary::install_binary;
pub use conflist::{find_primary_conflist, insert, remove};
pub use watch::{Chained, watch_and_reinsert, watch_and_reinsert_reporting};

/// The plugin's `type` in the conflist, and the installed binary's name.
pub const PLUGIN_TYPE: &str = "ambit-cni";

/// Where the plugin goes and what its conflist entry says.
#[derive(Debug, Clone)]
pub struct InstallConfig {
    /// The `ambit-cni` binary to install (shipped in the agent's image).
    pub plugin_source: PathBuf,
    /// The runtime's CNI bin dir, e.g. `/opt/cni/bin`.
    pub cni_bin_dir: PathBuf,
    /// The runtime's CNI conf dir, e.g. `/etc/cni/net.d`.
    pub cni_conf_dir: PathBuf,
    /// Our entry in `plugins`, e.g.
    /// `{"type":"ambit-cni","ambit":{"agent_socket":"/var/run/ambit/cni.sock"}}`.
    /// Must be an object whose `type` is [`PLUGIN_TYPE`]. Written as given;
    /// libcni overrides `name`/`cniVersion` with the list's when it runs us.
    pub plugin_config: serde_json::Value,
}

impl InstallConfig {
    /// Where [`install_binary`] puts the plugin: `cni_bin_dir/ambit-cni`.
    pub fn installed_binary(&self) -> PathBuf {
        self.cni_bin_dir.join(PLUGIN_TYPE)
    }
}

/// What [`insert`] did to the primary config (the path is the file now
/// holding our entry: for a converted `foo.conf`, `foo.conflist`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InsertOutcome {
    /// There was no `ambit-cni` entry; one was appended.
    Inserted(PathBuf),
    /// There was an entry (or several, or not last, or a `.conf` to convert)
    /// and the file was rewritten with exactly one current entry, last.
    Updated(PathBuf),
    /// The file already had exactly our current entry, last; not touched.
    Unchanged(PathBuf),
}

impl InsertOutcome {
    /// The config file holding our entry.
    pub fn path(&self) -> &std::path::Path {
        match self {
            InsertOutcome::Inserted(p)
            | InsertOutcome::Updated(p)
            | InsertOutcome::Unchanged(p) => p,
        }
    }

    /// Whether the file was written.
    pub fn changed(&self) -> bool {
        !matches!(self, InsertOutcome::Unchanged(_))
    }
}

/// Why installing, inserting or removing the plugin failed. Each message
/// names the file, what was wrong and what to do.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error(
        "the ambit-cni plugin config to insert is invalid: {0}; pass a JSON object with \"type\": \"{PLUGIN_TYPE}\""
    )]
    PluginConfig(String),
    #[error(
        "cannot read the plugin binary {path}: {source}; ship ambit-cni in the agent image and point the plugin source at it"
    )]
    Source {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "the CNI bin dir {dir} does not exist, nor does {parent}; it must be the directory the container runtime execs CNI plugins from (containerd and CRI-O: /opt/cni/bin, where the node's primary CNI plugins are): install the primary CNI first, pass the runtime's directory with --cni-bin-dir (CNI_BIN_DIR), or run with --no-install to leave the node's CNI setup alone"
    )]
    BinDirMissing { dir: PathBuf, parent: PathBuf },
    #[error(
        "cannot read {path}: {source}; check that the directory is mounted into the agent and readable"
    )]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "cannot write {path}: {source}; check that the directory is mounted read-write into the agent, that it runs as root, and that the disk has space"
    )]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "no CNI network config (*.conflist, *.conf, *.json) in {dir}; ambit-cni is chained after the node's primary CNI: install that CNI (or wait for it to write its config) — the node agent inserts itself as soon as the file appears; check --cni-conf-dir if the runtime uses another directory"
    )]
    NoPrimaryConfig { dir: PathBuf },
    #[error(
        "{path} is not valid JSON at line {line}, column {column} ({reason}); the file was left untouched — it belongs to the node's primary CNI: fix it or have that CNI rewrite it, and the agent will insert itself again"
    )]
    NotJson {
        path: PathBuf,
        line: usize,
        column: usize,
        reason: String,
    },
    #[error(
        "{path} is not a usable CNI network config: {problem}; the file was left untouched — {hint}"
    )]
    BadConfig {
        path: PathBuf,
        problem: String,
        hint: &'static str,
    },
}
