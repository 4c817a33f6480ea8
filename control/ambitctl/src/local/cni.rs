//! The node's CNI configuration and running its plugin chain exactly as a
//! container runtime does: each plugin exec'd in the node's netns with the
//! `CNI_*` environment, its config on stdin (with `cniVersion`, `name` and,
//! for chained plugins, `prevResult`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::LocalError;
use super::state::{NodeState, PodState};

/// Where Debian's `containernetworking-plugins` are.
pub const REFERENCE_PLUGINS: &str = "/usr/lib/cni";

/// The reference plugins the primary network uses.
pub const PLUGINS: [&str; 2] = ["bridge", "host-local"];

/// Type of our chained plugin (inserted by the node agent).
pub const AMBIT_PLUGIN: &str = "ambit-cni";

/// The primary network of a node: `bridge` on `cni0` with `host-local` IPAM
/// over the node's /24 (pods ask for their address with `IP=`).
pub fn primary_conflist(node: &NodeState, ipam_dir: &Path) -> Value {
    json!({
        "cniVersion": "1.0.0",
        "name": "ambit-local",
        "plugins": [{
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": true,
            "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": node.subnet, "gateway": node.gateway.to_string()}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": ipam_dir,
            }
        }]
    })
}

/// Reads the node's conflist as the runtime would.
pub fn read_conflist(path: &Path) -> Result<Value, LocalError> {
    let text =
        std::fs::read_to_string(path).map_err(LocalError::io("reading the CNI config", path))?;
    serde_json::from_str(&text).map_err(|e| LocalError::Io {
        what: "parsing the CNI config".into(),
        path: path.to_path_buf(),
        source: std::io::Error::other(e),
    })
}

/// Whether the conflist at `path` chains `ambit-cni`.
pub fn has_ambit(path: &Path) -> bool {
    read_conflist(path).is_ok_and(|v| {
        v["plugins"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["type"] == AMBIT_PLUGIN))
    })
}

/// A pod's identity for CNI.
/// One plugin call's environment, as a container runtime sets it.
#[derive(Debug, Clone, Copy)]
pub struct Invocation<'a> {
    /// The node's netns (the plugin runs there: it makes the host side).
    pub node_netns: &'a str,
    /// `CNI_PATH`, where the plugin binaries are.
    pub cni_bin: &'a Path,
    /// `CNI_CONTAINERID`.
    pub container_id: &'a str,
    /// `CNI_NETNS`.
    pub pod_netns: &'a Path,
    /// `CNI_ARGS` (`IgnoreUnknown=1;K8S_POD_...`).
    pub args: &'a str,
}

/// Runs plugin `conf` of conflist `list` for `command` exactly as a runtime
/// does: inside the node's netns, `CNI_*` in the environment, the plugin's
/// config on stdin with the list's `cniVersion` and `name` and, for chained
/// plugins, `prevResult`. Returns (success, stdout, stderr).
pub fn exec_plugin(
    inv: &Invocation<'_>,
    list: &Value,
    conf: &Value,
    command: &str,
    prev: Option<&Value>,
) -> Result<(bool, String, String), LocalError> {
    let ty = conf["type"].as_str().unwrap_or_default();
    let mut stdin = conf.clone();
    if let Some(obj) = stdin.as_object_mut() {
        obj.insert("cniVersion".into(), list["cniVersion"].clone());
        obj.insert("name".into(), list["name"].clone());
        if let Some(p) = prev {
            obj.insert("prevResult".into(), p.clone());
        }
    }
    let plugin = inv.cni_bin.join(ty);
    let mut child = Command::new("ip")
        .args(["netns", "exec", inv.node_netns])
        .arg(&plugin)
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", inv.container_id)
        .env("CNI_NETNS", inv.pod_netns)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_ARGS", inv.args)
        .env("CNI_PATH", inv.cni_bin)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(LocalError::io(format!("running CNI plugin {ty}"), &plugin))?;
    if let Some(mut input) = child.stdin.take() {
        input
            .write_all(stdin.to_string().as_bytes())
            .map_err(LocalError::io(
                format!("writing to CNI plugin {ty}"),
                &plugin,
            ))?;
    }
    let out = child
        .wait_with_output()
        .map_err(LocalError::io(format!("running CNI plugin {ty}"), &plugin))?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
    ))
}

#[derive(Debug)]
pub struct CniCall<'a> {
    pub node: &'a NodeState,
    pub pod: &'a PodState,
    pub cni_bin: &'a Path,
}

impl CniCall<'_> {
    fn args(&self) -> String {
        format!(
            "IgnoreUnknown=1;IP={};K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}",
            self.pod.ip, self.pod.namespace, self.pod.name, self.pod.container_id, self.pod.uid
        )
    }

    fn netns_path(&self) -> PathBuf {
        Path::new(super::netns::NETNS_DIR).join(&self.pod.netns)
    }

    /// Runs one plugin; returns (success, stdout, stderr).
    fn exec(
        &self,
        list: &Value,
        conf: &Value,
        command: &str,
        prev: Option<&Value>,
    ) -> Result<(bool, String, String), LocalError> {
        let inv = Invocation {
            node_netns: &self.node.netns,
            cni_bin: self.cni_bin,
            container_id: &self.pod.container_id,
            pod_netns: &self.netns_path(),
            args: &self.args(),
        };
        exec_plugin(&inv, list, conf, command, prev)
    }

    fn fail(&self, plugin: &str, command: &str, stdout: &str, stderr: &str) -> LocalError {
        let mut output = if stdout.is_empty() {
            "(no output)".to_string()
        } else {
            stdout.to_string()
        };
        if !stderr.is_empty() {
            output.push_str("; stderr: ");
            output.push_str(stderr);
        }
        LocalError::Cni {
            pod: self.pod.key(),
            plugin: plugin.to_string(),
            command: command.to_string(),
            output,
        }
    }

    /// ADD through every plugin of `list` in order; returns the last result.
    pub fn add(&self, list: &Value) -> Result<Value, LocalError> {
        let plugins = list["plugins"].as_array().cloned().unwrap_or_default();
        let mut prev: Option<Value> = None;
        for conf in &plugins {
            let ty = conf["type"].as_str().unwrap_or("?");
            let (ok, out, err) = self.exec(list, conf, "ADD", prev.as_ref())?;
            if !ok {
                return Err(self.fail(ty, "ADD", &out, &err));
            }
            let result: Value = serde_json::from_str(&out).map_err(|e| {
                self.fail(ty, "ADD", &format!("result is not JSON ({e}): {out}"), &err)
            })?;
            prev = Some(result);
        }
        prev.ok_or_else(|| self.fail("-", "ADD", "the conflist has no plugins", ""))
    }

    /// [`CniCall::add`], retried as a runtime retries a sandbox while a
    /// plugin answers "try again later" (CNI error code 11, e.g. the node
    /// agent's ztunnel not connected yet): DEL, 200 ms, ADD again, for at
    /// most `limit`.
    pub fn add_retrying(&self, list: &Value, limit: Duration) -> Result<Value, LocalError> {
        let deadline = Instant::now() + limit;
        loop {
            match self.add(list) {
                Err(LocalError::Cni { output, .. })
                    if output.contains("\"code\":11") && Instant::now() < deadline =>
                {
                    let _ = self.del(list, None);
                    std::thread::sleep(Duration::from_millis(200));
                }
                other => return other,
            }
        }
    }

    /// DEL through every plugin of `list` in reverse order, with the cached
    /// ADD result as `prevResult`.
    pub fn del(&self, list: &Value, result: Option<&Value>) -> Result<(), LocalError> {
        let plugins = list["plugins"].as_array().cloned().unwrap_or_default();
        for conf in plugins.iter().rev() {
            let ty = conf["type"].as_str().unwrap_or("?");
            let (ok, out, err) = self.exec(list, conf, "DEL", result)?;
            if !ok {
                return Err(self.fail(ty, "DEL", &out, &err));
            }
        }
        Ok(())
    }
}
