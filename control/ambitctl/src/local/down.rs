//! `local down`: stop every process of the cluster, then every process
//! still living in one of its network namespaces (what `local exec … &`
//! started in a pod: deleting a pod kills its processes), and wait until
//! they are gone (bounded); delete every netns named `<name>-*`, remove the
//! state dir. Works from the state file when
//! there is one and from `/proc` and `ip netns` when there is not (a crash,
//! a half-finished `up`); running it again finds nothing and succeeds.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::state::{Role, STATE_FILE, State};
use super::waypoints::WaypointTable;
use super::{LocalError, check_name, netns, process};

/// How long processes found inside a pod's netns get after SIGTERM.
const IN_POD_GRACE: Duration = Duration::from_secs(2);
/// How long `down` waits for killed processes to be gone.
const GONE_BOUND: Duration = Duration::from_secs(5);

/// What `local down` removes.
#[derive(Debug, Clone)]
pub struct DownOptions {
    pub name: String,
    /// Default: `/var/run/ambit-local/<name>`.
    pub state_dir: Option<PathBuf>,
    /// How long processes get after SIGTERM before SIGKILL.
    pub grace: Duration,
    /// Save the config's working copy here first (a new or empty
    /// directory); nothing is removed when that fails.
    pub keep_config: Option<PathBuf>,
}

impl DownOptions {
    /// The cluster `name` in its default state dir, 5 s grace.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            state_dir: None,
            grace: Duration::from_secs(5),
            keep_config: None,
        }
    }
}

/// What `local down` did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DownReport {
    pub name: String,
    pub state_dir: PathBuf,
    /// `pid role` of each process stopped.
    pub stopped: Vec<String>,
    /// Pids that needed SIGKILL.
    pub killed: Vec<u32>,
    pub netns_removed: Vec<String>,
    pub state_dir_removed: bool,
    /// Where the config's working copy was saved (`keep_config`).
    pub config_kept: Option<PathBuf>,
    /// Things worth knowing (an unreadable state file, ...).
    pub notes: Vec<String>,
}

impl DownReport {
    /// Whether there was nothing to remove.
    pub fn was_empty(&self) -> bool {
        self.stopped.is_empty() && self.netns_removed.is_empty() && !self.state_dir_removed
    }

    /// Lines for people.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if self.was_empty() {
            out.push_str(&format!(
                "Nothing to remove: no local cluster named {} (state dir {}).\n",
                self.name,
                self.state_dir.display()
            ));
        }
        for n in &self.notes {
            out.push_str(&format!("note: {n}\n"));
        }
        for s in &self.stopped {
            out.push_str(&format!("stopped process {s}\n"));
        }
        if !self.killed.is_empty() {
            out.push_str(&format!(
                "  (killed after the grace period: {:?})\n",
                self.killed
            ));
        }
        for n in &self.netns_removed {
            out.push_str(&format!("removed netns {n}\n"));
        }
        if self.state_dir_removed {
            out.push_str(&format!("removed {}\n", self.state_dir.display()));
        }
        if let Some(kept) = &self.config_kept {
            out.push_str(&format!(
                "kept the config's working copy in {}\n",
                kept.display()
            ));
        }
        if !self.was_empty() {
            out.push_str(&format!("Local cluster {} is gone.\n", self.name));
        }
        out
    }
}

/// Removes the cluster; see the module docs.
pub fn down(opts: &DownOptions) -> Result<DownReport, LocalError> {
    check_name(&opts.name)?;
    let state_dir = std::path::absolute(
        opts.state_dir
            .clone()
            .unwrap_or_else(|| super::default_state_dir(&opts.name)),
    )
    .map_err(LocalError::io("resolving the state directory", "."))?;
    let mut report = DownReport {
        name: opts.name.clone(),
        state_dir: state_dir.clone(),
        ..DownReport::default()
    };
    let state = match State::load(&opts.name, &state_dir) {
        Ok(s) => Some(s),
        Err(LocalError::NotFound { .. }) => None,
        Err(e) => {
            report.notes.push(format!(
                "{e}; cleaning up from /proc and `ip netns` instead"
            ));
            None
        }
    };
    // Save the working copy before anything goes; on failure nothing has.
    if let Some(to) = &opts.keep_config {
        match state.as_ref().and_then(|s| s.source_dir.as_ref().map(|_| s)) {
            Some(s) => report.config_kept = Some(super::workcopy::keep(&s.config_dir, to)?),
            None => report.notes.push(format!(
                "--keep-config {}: the cluster served its config directory in place (no working copy); nothing to keep",
                to.display()
            )),
        }
    }

    // The waypoint controller first, so it restarts no waypoint agent
    // while the rest is being stopped.
    let mut pids: Vec<(u32, String)> = Vec::new();
    if let Some(s) = &state {
        let controllers: Vec<u32> = s
            .processes
            .iter()
            .filter(|p| p.role == Role::WaypointController)
            .map(|p| p.pid)
            .filter(|pid| process::is_alive(*pid) && process::belongs_to(*pid, &state_dir))
            .collect();
        report
            .killed
            .extend(process::stop_all(&controllers, opts.grace));
        pids.extend(
            controllers
                .iter()
                .map(|pid| (*pid, format!("{pid} {}", Role::WaypointController.as_str()))),
        );
    }

    // Processes: the recorded ones that are still ours, plus any found by scan.
    if let Some(s) = &state {
        for p in &s.processes {
            if p.role != Role::WaypointController
                && process::is_alive(p.pid)
                && process::belongs_to(p.pid, &state_dir)
            {
                let whom = p.pod.as_deref().or(p.node.as_deref()).unwrap_or("");
                pids.push((p.pid, format!("{} {} {whom}", p.pid, p.role.as_str())));
            }
        }
    }
    // Waypoint agents (with their Envoy) are the controller's, in its table.
    for w in WaypointTable::load(&state_dir).waypoints {
        if let Some(pid) = w.agent_pid
            && !pids.iter().any(|(p, _)| *p == pid)
            && process::is_alive(pid)
            && process::belongs_to(pid, &state_dir)
        {
            pids.push((pid, format!("{pid} ambit-agent waypoint {}", w.key())));
        }
    }
    for pid in process::scan(&state_dir) {
        if !pids.iter().any(|(p, _)| *p == pid) {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            pids.push((pid, format!("{pid} {} (found in /proc)", comm.trim())));
        }
    }
    let only: Vec<u32> = pids.iter().map(|(p, _)| *p).collect();
    report.killed.extend(process::stop_all(&only, opts.grace));
    report.stopped = pids
        .into_iter()
        .map(|(_, s)| s.trim().to_string())
        .collect();

    // Namespaces: recorded ones and any named `<name>-*`; pods first, the
    // lan last (order is cosmetic: each takes its links along).
    let prefix = format!("{}-", opts.name);
    let mut names: Vec<String> = state.as_ref().map(|s| s.netns.clone()).unwrap_or_default();
    for n in netns::list() {
        if n.starts_with(&prefix) && !names.contains(&n) {
            names.push(n);
        }
    }
    let mut errors = Vec::new();

    // Whatever still runs inside them (a `local exec … &`) goes too, and is
    // waited for: a deleted netns file does not end its processes.
    let ids: Vec<(u64, u64, String)> = names
        .iter()
        .filter_map(|n| {
            use std::os::unix::fs::MetadataExt;
            let meta = std::fs::metadata(netns::path(n)).ok()?;
            Some((meta.dev(), meta.ino(), n.clone()))
        })
        .collect();
    let inside = process::in_netns(&ids);
    if !inside.is_empty() {
        let pids: Vec<u32> = inside.iter().map(|(p, _)| *p).collect();
        let (killed, alive) = process::kill_each(&pids, opts.grace.min(IN_POD_GRACE), GONE_BOUND);
        report.killed.extend(killed);
        report.stopped.extend(inside.into_iter().map(|(_, s)| s));
        if !alive.is_empty() {
            errors.push(format!(
                "processes {alive:?} in the cluster's namespaces survived SIGKILL for {GONE_BOUND:?}"
            ));
        }
    }
    // Deleted in reverse: keep the lan first so it goes last.
    let lan = format!("{prefix}lan");
    names.sort_by_key(|n| *n != lan);
    for n in names.iter().rev() {
        if !netns::exists(n) {
            continue;
        }
        match netns::delete(n) {
            Ok(()) => report.netns_removed.push(n.clone()),
            Err(e) => errors.push(format!("removing netns {n}: {e}")),
        }
    }

    // The state dir, only when it is one of ours (or empty).
    if state_dir.exists() {
        let ours = state_dir.join(STATE_FILE).exists()
            || std::fs::read_dir(&state_dir).is_ok_and(|mut d| d.next().is_none());
        if ours {
            match std::fs::remove_dir_all(&state_dir) {
                Ok(()) => report.state_dir_removed = true,
                Err(e) => errors.push(format!("removing {}: {e}", state_dir.display())),
            }
        } else {
            report.notes.push(format!(
                "{} has no {STATE_FILE}; not a local cluster's state dir, left in place",
                state_dir.display()
            ));
        }
    }
    let alive: Vec<u32> = only
        .iter()
        .copied()
        .filter(|p| process::is_alive(*p))
        .collect();
    if !alive.is_empty() {
        errors.push(format!("processes {alive:?} survived SIGKILL"));
    }
    if errors.is_empty() {
        Ok(report)
    } else {
        Err(LocalError::Down {
            name: opts.name.clone(),
            errors,
            report: report.render(),
        })
    }
}
