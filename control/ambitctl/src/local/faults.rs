//! Process-level faults on a running cluster, for fault tests and drills:
//! signal one of its processes (SIGKILL for a crash, SIGTERM for a clean
//! stop) and wait until it is gone, then start it again with the command
//! and log it was recorded with — as a supervisor (kubelet, systemd) would.

use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use super::process::{self, spawn_detached};
use super::state::Role;
use super::{LocalCluster, LocalError};

/// How long a signalled process gets to be gone.
const GONE_WITHIN: Duration = Duration::from_secs(10);

impl LocalCluster {
    fn record_index(&self, role: Role, node: Option<&str>) -> Result<usize, LocalError> {
        self.state
            .processes
            .iter()
            .rposition(|p| {
                p.role == role
                    && match role {
                        Role::Control | Role::WaypointController => true,
                        Role::App => p.pod.as_deref() == node,
                        _ => p.node.as_deref() == node,
                    }
            })
            .ok_or_else(|| LocalError::NoSuchProcess {
                name: self.state.name.clone(),
                role: role.as_str(),
                node: node.map(str::to_string),
            })
    }

    /// Sends `signal` to the process of `role` (`node`: the node of an
    /// agent or ztunnel, the `namespace/name` of an app, `None` for the
    /// control plane) and waits until it is gone. Returns its pid.
    pub fn signal_process(
        &mut self,
        role: Role,
        node: Option<&str>,
        signal: Signal,
    ) -> Result<u32, LocalError> {
        let rec = self.state.processes[self.record_index(role, node)?].clone();
        if !process::is_alive(rec.pid) || !process::belongs_to(rec.pid, &self.state.state_dir) {
            return Err(LocalError::NoSuchProcess {
                name: self.state.name.clone(),
                role: role.as_str(),
                node: node.map(str::to_string),
            });
        }
        process::signal(rec.pid, signal);
        let deadline = Instant::now() + GONE_WITHIN;
        while process::is_alive(rec.pid) {
            // Reap it when it is our child, so it does not linger as a zombie.
            for c in &mut self.children {
                if c.id() == rec.pid {
                    let _ = c.try_wait();
                }
            }
            if Instant::now() > deadline {
                return Err(LocalError::Timeout {
                    what: format!("{} (pid {}) to exit after {signal}", role.as_str(), rec.pid),
                    secs: GONE_WITHIN.as_secs(),
                    log: rec.log.clone(),
                    tail: process::log_tail(&rec.log, 20),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(rec.pid)
    }

    /// Starts the process of `role` for `node` again with its recorded
    /// command, appending to its log; the state records the new pid.
    /// Returns it. Does not wait for readiness.
    pub fn start_process_again(
        &mut self,
        role: Role,
        node: Option<&str>,
    ) -> Result<u32, LocalError> {
        let i = self.record_index(role, node)?;
        let rec = self.state.processes[i].clone();
        let (program, args) = rec
            .command
            .split_first()
            .ok_or_else(|| LocalError::Command {
                cmd: role.as_str().into(),
                status: "not run".into(),
                stderr: "no recorded command".into(),
            })?;
        let mut cmd = Command::new(program);
        cmd.args(args);
        let what = format!("{} (restarted)", role.as_str());
        let child = spawn_detached(cmd, &what, &rec.log, &self.state.state_dir)?;
        let pid = child.id();
        self.children.push(child);
        self.state.processes[i].pid = pid;
        self.state.save()?;
        Ok(pid)
    }
}
