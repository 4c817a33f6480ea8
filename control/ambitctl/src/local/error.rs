//! The one error type of `ambitctl local`: each message says what failed,
//! where, and what to do about it.

use std::path::PathBuf;

/// Everything `ambitctl local` can fail at.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error(
        "`ambitctl local` needs root to create network namespaces (running as uid {uid}); run it with sudo"
    )]
    NotRoot { uid: u32 },

    #[error(
        "`{tool}` is not installed or does not run; install it with `apt-get install {package}`"
    )]
    MissingTool {
        tool: &'static str,
        package: &'static str,
    },

    #[error(
        "the CNI reference plugin {} is missing; install it with `apt-get install containernetworking-plugins`",
        path.display()
    )]
    MissingPlugin { path: PathBuf },

    #[error(
        "the binary `{name}` is not in {}; build the workspace with `cargo build --release` (it puts every binary, ambitctl included, in target/release) or point --bin-dir at the directory holding ambit-control, ztunnel, ambit-node-agent, ambit-cni, ambit-demo, ambit-agent and ambitctl",
        bin_dir.display()
    )]
    MissingBinary {
        name: &'static str,
        bin_dir: PathBuf,
    },

    /// `needs`: what in the config needs Envoy ("declares waypoint
    /// Gateways (...)", "has sidecar pods (...)").
    #[error(
        "the config {needs} and no Envoy was found (ENVOY_BIN, or `envoy` on PATH); {}",
        super::waypoints::ENVOY_HINT
    )]
    MissingEnvoy { needs: String },

    #[error("bad cluster name {name:?}: {why}")]
    BadName { name: String, why: String },

    #[error("cannot read the config directory {}: {source}; pass an existing directory of Kubernetes YAML", dir.display())]
    ConfigDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("the config in {} has errors; fix them and run again:\n  {}", dir.display(), errors.join("\n  "))]
    Config { dir: PathBuf, errors: Vec<String> },

    #[error("cannot build a local cluster from {}: {why}", dir.display())]
    Plan { dir: PathBuf, why: String },

    #[error("{what} ({}): {source}", path.display())]
    Io {
        what: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("`{cmd}` failed ({status}): {stderr}")]
    Command {
        cmd: String,
        status: String,
        stderr: String,
    },

    #[error("timed out after {secs} s waiting for {what}; last lines of {}:\n{tail}", log.display())]
    Timeout {
        what: String,
        secs: u64,
        log: PathBuf,
        tail: String,
    },

    #[error("process {pid} exited while waiting for {what}; last lines of {}:\n{tail}", log.display())]
    Exited {
        what: String,
        pid: u32,
        log: PathBuf,
        tail: String,
    },

    #[error("CNI {command} of pod {pod} failed in plugin `{plugin}`: {output}")]
    Cni {
        pod: String,
        plugin: String,
        command: String,
        output: String,
    },

    #[error(
        "a local cluster named {name:?} already exists (state in {}); remove it with `ambitctl local down --name {name}` first, or pick another --name",
        state_dir.display()
    )]
    Exists { name: String, state_dir: PathBuf },

    #[error(
        "leftovers of a local cluster named {name:?} exist ({what}); remove them with `ambitctl local down --name {name}` first"
    )]
    Leftovers { name: String, what: String },

    #[error(
        "no local cluster named {name:?}: {} does not exist; start one with `ambitctl local up` (or pass the --name/--state-dir it was started with)",
        state_dir.display()
    )]
    NotFound { name: String, state_dir: PathBuf },

    #[error(
        "the state file {} is unreadable ({why}); the cluster can still be removed with `ambitctl local down --name {name}`",
        path.display()
    )]
    BadState {
        name: String,
        path: PathBuf,
        why: String,
    },

    #[error(
        "no running {role} process{} in local cluster {name}; `ambitctl local status` lists them",
        node.as_deref().map(|n| format!(" for {n}")).unwrap_or_default()
    )]
    NoSuchProcess {
        name: String,
        role: &'static str,
        node: Option<String>,
    },

    #[error("no pod {pod} in local cluster {name}; pods are: {known}")]
    NoSuchPod {
        name: String,
        pod: String,
        known: String,
    },

    #[error(
        "`local down` of cluster {name} left something behind:\n  {}\n{report}run `ambitctl local down --name {name}` again; if it persists, remove it by hand (`ip netns del`, `kill`)",
        errors.join("\n  ")
    )]
    Down {
        name: String,
        errors: Vec<String>,
        report: String,
    },

    #[error("`local up` of cluster {name} failed: {source}\n{cleanup}")]
    Up {
        name: String,
        #[source]
        source: Box<LocalError>,
        cleanup: String,
    },
}

impl LocalError {
    /// An I/O error with what was being done and on which path.
    pub(crate) fn io(
        what: impl Into<String>,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> LocalError {
        let what = what.into();
        let path = path.into();
        move |source| LocalError::Io { what, path, source }
    }
}
