//! Pod operations on a running cluster, as a container runtime does them.

use std::time::Duration;

use super::cni::{self, CniCall};
use super::state::Role;
use super::{LocalCluster, LocalError, netns, process};

impl LocalCluster {
    /// Deletes pod `namespace/name` as a runtime does: stops its app and
    /// every other process in its netns (a `local exec … &`), runs
    /// CNI DEL through its node's chain (reverse order, the cached ADD
    /// result as `prevResult`), removes its netns and forgets it. The YAML
    /// is not changed: remove the pod there too if the mesh should forget it.
    pub fn delete_pod(&mut self, key: &str) -> Result<(), LocalError> {
        let pod = self.pod(key)?.clone();
        // Its app, and its sidecar's agent (with Envoy) and relay: the
        // relay runs in the host's netns, so the scan below misses it.
        for role in [Role::App, Role::Sidecar, Role::SidecarRelay] {
            if let Some(p) = self.state.process(role, Some(key))
                && process::is_alive(p.pid)
                && process::belongs_to(p.pid, &self.state.state_dir)
            {
                process::stop_all(&[p.pid], Duration::from_secs(5));
            }
        }
        if let Ok(meta) = std::fs::metadata(netns::path(&pod.netns)) {
            use std::os::unix::fs::MetadataExt;
            let inside = process::in_netns(&[(meta.dev(), meta.ino(), pod.netns.clone())]);
            let pids: Vec<u32> = inside.iter().map(|(p, _)| *p).collect();
            let (_, alive) =
                process::kill_each(&pids, Duration::from_secs(2), Duration::from_secs(5));
            if !alive.is_empty() {
                return Err(LocalError::Command {
                    cmd: format!("deleting pod {key}"),
                    status: "processes survived SIGKILL".into(),
                    stderr: format!("{alive:?} still run in netns {}", pod.netns),
                });
            }
        }
        let node = self
            .state
            .node(&pod.node)
            .cloned()
            .ok_or_else(|| LocalError::NoSuchPod {
                name: self.state.name.clone(),
                pod: format!("{key} (its node {} is unknown)", pod.node),
                known: String::new(),
            })?;
        let list = cni::read_conflist(&node.conflist)?;
        let cni_bin = self.state.state_dir.join("cni-bin");
        CniCall {
            node: &node,
            pod: &pod,
            cni_bin: &cni_bin,
        }
        .del(&list, pod.cni_result.as_ref())?;
        if netns::exists(&pod.netns) {
            netns::delete(&pod.netns)?;
        }
        self.state.pods.retain(|p| p.key() != key);
        self.state.netns.retain(|n| *n != pod.netns);
        self.state.save()
    }
}
