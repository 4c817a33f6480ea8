//! The last steps of `local up`: the pods' demo apps, then waiting until
//! every app listens and every enrolled pod's certificate is issued.

use std::time::Duration;

use super::process::{self, wait_until};
use super::state::Role;
use super::up::Builder;
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
