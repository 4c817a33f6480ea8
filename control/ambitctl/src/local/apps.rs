//! The last steps of `local up`: the waypoint controller (and its first
//! waypoint pods), the pods' demo apps, then waiting until every app
//! listens and every enrolled pod's certificate is issued.

use std::time::Duration;

use super::prereq::CONTROLLER_BINARY;
use super::process::{self, wait_until};
use super::state::Role;
use super::up::Builder;
use super::waypoints::{WaypointTable, probe};
use super::{LocalError, netns};

/// The ports an `ambit-demo` argument list listens on (`--http P`, `--tcp P`).
pub fn app_ports(args: &[String]) -> Vec<u16> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let value = match a.as_str() {
            "--http" | "--tcp" => it.next().map(String::as_str),
            other => other
                .strip_prefix("--http=")
                .or_else(|| other.strip_prefix("--tcp=")),
        };
        if let Some(p) = value.and_then(|v| v.rsplit(':').next()?.parse().ok()) {
            out.push(p);
        }
    }
    out
}

impl Builder {
    /// Starts each pod's `ambit-demo` and waits until it listens.
    pub(super) fn apps(&mut self) -> Result<(), LocalError> {
        let mut waits = Vec::new();
        for pod in self.state.pods.clone() {
            let Some(args) = &pod.app else { continue };
            let mut cmd = vec![
                "ip".to_string(),
                "netns".into(),
                "exec".into(),
                pod.netns.clone(),
                self.bin("ambit-demo").display().to_string(),
            ];
            cmd.extend(args.iter().cloned());
            cmd.extend([
                "--name".into(),
                pod.name.clone(),
                "--namespace".into(),
                pod.namespace.clone(),
            ]);
            let log = self
                .state
                .log_dir()
                .join(format!("pod-{}-{}.log", pod.namespace, pod.name));
            let key = pod.key();
            let pid = self.spawn(Role::App, Some(&pod.node), Some(&key), cmd, log.clone())?;
            let ports = app_ports(args);
            waits.push((pod, pid, log, ports));
        }
        for (pod, pid, log, ports) in waits {
            if ports.is_empty() {
                continue;
            }
            wait_until(
                &format!(
                    "ambit-demo of pod {} to listen on port(s) {ports:?}",
                    pod.key()
                ),
                Some(pid),
                &log,
                self.timeout,
                || {
                    let open = netns::listening_ports(&pod.netns);
                    ports.iter().all(|p| open.contains(p))
                },
            )?;
        }
        Ok(())
    }

    /// Starts the waypoint controller and waits until the waypoint pod of
    /// every waypoint Gateway of the config is ready.
    pub(super) fn waypoint_controller(&mut self) -> Result<(), LocalError> {
        let cmd = vec![
            self.bin(CONTROLLER_BINARY).display().to_string(),
            "local".into(),
            "waypoint-controller".into(),
            "--name".into(),
            self.state.name.clone(),
            "--state-dir".into(),
            self.state.state_dir.display().to_string(),
            "--timeout-secs".into(),
            self.timeout.as_secs().max(1).to_string(),
        ];
        let log = self.state.log_dir().join("waypoints.log");
        let pid = self.spawn(Role::WaypointController, None, None, cmd, log.clone())?;
        let wanted = self.plan.waypoints.clone();
        let dir = self.state.state_dir.clone();
        let mut last = String::from("the controller has not read the config yet");
        let result = wait_until(
            &format!(
                "the waypoint controller to start a ready pod for each waypoint Gateway ({})",
                wanted
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Some(pid),
            &log,
            self.timeout,
            || {
                let table = WaypointTable::load(&dir);
                if !table.synced {
                    return false;
                }
                for key in &wanted {
                    let Some(rec) = table.get(key) else {
                        // A failed start is retried with backoff; say why meanwhile.
                        last = match table.skipped.get(&key.to_string()) {
                            Some(why) => format!("Gateway {key}: {why}"),
                            None => format!("no pod for Gateway {key} yet"),
                        };
                        return false;
                    };
                    let (ready, answer) = probe::readiness(&rec.pod.netns);
                    if !ready {
                        last = format!(
                            "waypoint pod {} not ready: {answer} (log: {})",
                            rec.key(),
                            rec.log.display()
                        );
                        return false;
                    }
                }
                true
            },
        );
        match result {
            Err(LocalError::Timeout {
                what,
                secs,
                log,
                tail,
            }) => Err(LocalError::Timeout {
                what: format!("{what}; last: {last}"),
                secs,
                log,
                tail,
            }),
            other => other,
        }
    }

    /// Waits until each node's ztunnel holds a certificate for every
    /// enrolled pod on it (`/config_dump`), so the first call is not
    /// held up by a certificate request.
    pub(super) fn certificates(&mut self) -> Result<(), LocalError> {
        let tables: std::collections::BTreeMap<String, bool> = self
            .state
            .nodes
            .iter()
            .flat_map(|n| super::status::agent_table(&n.agent_dir.join("pods.json")))
            .map(|(pod, (enrolled, _served))| (pod, enrolled))
            .collect();
        for node in self.state.nodes.clone() {
            let mut wanted: Vec<String> = self
                .state
                .pods
                .iter()
                .filter(|p| p.node == node.name && tables.get(&p.key()) == Some(&true))
                .map(|p| format!("/ns/{}/sa/{}", p.namespace, p.service_account))
                .collect();
            wanted.sort();
            wanted.dedup();
            if wanted.is_empty() {
                continue;
            }
            let Some(zt) = self.state.process(Role::Ztunnel, Some(&node.name)).cloned() else {
                continue;
            };
            let admin = node.admin_addr;
            wait_until(
                &format!(
                    "the ztunnel of node {} to hold certificates for {}",
                    node.name,
                    wanted.join(", ")
                ),
                Some(zt.pid),
                &zt.log,
                self.timeout,
                || {
                    let Ok((200, body)) =
                        process::http_get(admin, "/config_dump", Duration::from_secs(2))
                    else {
                        return false;
                    };
                    let Ok(dump) = serde_json::from_str::<serde_json::Value>(&body) else {
                        return false;
                    };
                    let available: Vec<&str> = dump["certificates"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter(|c| {
                            c["state"]
                                .as_str()
                                .is_some_and(|s| s.starts_with("Available"))
                        })
                        .filter_map(|c| c["identity"].as_str())
                        .collect();
                    wanted
                        .iter()
                        .all(|w| available.iter().any(|a| a.ends_with(w.as_str())))
                },
            )?;
        }
        Ok(())
    }
}
