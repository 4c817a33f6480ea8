//! Enrollment end to end: nodes from [`crate::netbed`], pods created by
//! running the real CNI `bridge` + `host-local` plugins chained with
//! `ambit-cni` exactly as a container runtime does, a node agent and a
//! ztunnel per node (in process), and the control plane serving a config
//! directory that the node agents read too (local mode).
//!
//! Needs root, `ip`, `iptables`, `/usr/lib/cni/{bridge,host-local}` and the
//! built `ambit-cni` binary (`cargo test --workspace` builds it); see
//! [`can_run`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use ambit_cni::agent::view::spawn_dir_view;
use ambit_cni::agent::{Agent, AgentConfig};
use ambit_control::ControlPlane;
use ambit_ztunnel::Ztunnel;
use ambitctl::local::cni::{Invocation, exec_plugin};
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::meshbed::{WAIT, node_name, start_control_plane, start_ztunnel};
use crate::netbed::{Cluster, PodNet};

/// Where Debian's `containernetworking-plugins` are.
pub const REFERENCE_PLUGINS: &str = "/usr/lib/cni";

/// The built `ambit-cni`, next to the test binary's directory.
pub fn plugin_binary() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.parent()?; // target/<profile>/deps -> target/<profile>
    let bin = dir.join("ambit-cni");
    bin.exists().then_some(bin)
}

/// Where the workspace's binaries are for an `ambitctl local` cluster (next
/// to the test binary's directory), when the bed can run here and every one
/// is built; prints SKIP with the reason otherwise.
pub fn local_bin_dir(test: &str) -> Option<PathBuf> {
    if !can_run(test) {
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?.parent()?.to_path_buf();
    let missing: Vec<&str> = ambitctl::local::BINARIES
        .iter()
        .copied()
        .chain([ambitctl::local::CONTROLLER_BINARY])
        .filter(|b| !dir.join(b).exists())
        .collect();
    if !missing.is_empty() {
        println!("SKIP {test}: binaries not built: {missing:?} (cargo build --workspace)");
        return None;
    }
    Some(dir)
}

/// Whether the bed can run here; prints SKIP with the reason otherwise.
pub fn can_run(test: &str) -> bool {
    if !crate::netbed::can_run(test) {
        return false;
    }
    let plugins = ["bridge", "host-local"]
        .iter()
        .all(|p| Path::new(REFERENCE_PLUGINS).join(p).exists());
    if !plugins {
        println!(
            "SKIP {test}: needs the CNI reference plugins in {REFERENCE_PLUGINS} (apt-get install containernetworking-plugins)"
        );
        return false;
    }
    if plugin_binary().is_none() {
        println!(
            "SKIP {test}: ambit-cni is not built (run `cargo build -p ambit-cni` or `cargo test --workspace`)"
        );
        return false;
    }
    true
}

/// One pod created through CNI.
#[derive(Debug, Clone)]
pub struct CniPod {
    pub net: PodNet,
    pub namespace: String,
    pub service_account: String,
    pub uid: String,
    pub container_id: String,
    /// The chain's ADD result, passed back on DEL as runtimes do.
    pub result: Value,
    /// Annotations written with the pod ([`EnrollBed::annotate`]).
    pub annotations: std::collections::BTreeMap<String, String>,
}

struct Node {
    agent: Option<Agent>,
    ztunnel: Option<Ztunnel>,
}

/// The bed.
pub struct EnrollBed {
    pub cluster: Cluster,
    config: tempfile::TempDir,
    data: tempfile::TempDir,
    cni_bin: tempfile::TempDir,
    cp: Option<ControlPlane>,
    nodes: Vec<Node>,
    pods: BTreeMap<String, CniPod>,
    namespaces: BTreeMap<String, bool>,
}

impl EnrollBed {
    /// Nodes, control plane, a node agent and a ztunnel per node; the
    /// namespaces in `namespaces` (`name → ambient?`).
    pub async fn start(nodes: usize, namespaces: &[(&str, bool)]) -> Result<Self> {
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
            )
            .try_init();
        let cluster = Cluster::new(nodes)?;
        let cni_bin = tempfile::tempdir()?;
        for p in ["bridge", "host-local"] {
            std::os::unix::fs::symlink(
                Path::new(REFERENCE_PLUGINS).join(p),
                cni_bin.path().join(p),
            )?;
        }
        let plugin = plugin_binary().context("ambit-cni is not built")?;
        std::os::unix::fs::symlink(plugin, cni_bin.path().join("ambit-cni"))?;
        let mut bed = Self {
            cluster,
            config: tempfile::tempdir()?,
            data: tempfile::tempdir()?,
            cni_bin,
            cp: None,
            nodes: Vec::new(),
            pods: BTreeMap::new(),
            namespaces: namespaces
                .iter()
                .map(|(n, a)| (n.to_string(), *a))
                .collect(),
        };
        bed.write_namespaces()?;
        bed.write_pods()?;
        bed.cp = Some(start_control_plane(bed.config.path(), bed.data.path(), nodes).await?);
        for i in 0..nodes {
            let agent = bed.start_agent(i).await?;
            bed.nodes.push(Node {
                agent: Some(agent),
                ztunnel: None,
            });
            let zt = bed.start_ztunnel(i).await?;
            bed.nodes[i].ztunnel = Some(zt);
        }
        Ok(bed)
    }

    fn agent_config(&self, node: usize) -> AgentConfig {
        AgentConfig {
            cni_socket: self.data.path().join(format!("cni-{node}.sock")),
            zds_socket: self.data.path().join(format!("zds-{node}.sock")),
            state_dir: self.data.path().join(format!("agent-{node}")),
            ports: Default::default(),
        }
    }

    async fn start_agent(&self, node: usize) -> Result<Agent> {
        let view = spawn_dir_view(self.config.path().to_path_buf());
        Ok(Agent::start(self.agent_config(node), view).await?)
    }

    async fn start_ztunnel(&self, node: usize) -> Result<Ztunnel> {
        let cp = self.cp.as_ref().context("no control plane")?;
        start_ztunnel(
            cp,
            self.data.path(),
            node,
            self.agent_config(node).zds_socket,
        )
        .await
    }

    /// Stops and starts the ztunnel of `node` (same ZDS socket).
    pub async fn restart_ztunnel(&mut self, node: usize) -> Result<()> {
        if let Some(z) = self.nodes[node].ztunnel.take() {
            z.shutdown().await;
        }
        let z = self.start_ztunnel(node).await?;
        self.nodes[node].ztunnel = Some(z);
        Ok(())
    }

    /// Replaces the ztunnel of `node` as a rolling update does: starts a new
    /// one on the same ZDS socket while the old one still runs (and still
    /// holds the pods' ports, with its connections in TIME_WAIT), waits
    /// until the new one serves every pod the old one had, then stops the
    /// old one. Returns how long the new one took to serve them all.
    pub async fn replace_ztunnel(&mut self, node: usize) -> Result<std::time::Duration> {
        let old = self.nodes[node].ztunnel.take().context("no ztunnel")?;
        let want: Vec<String> = old.pods().borrow().keys().cloned().collect();
        let started = std::time::Instant::now();
        let new = match self.start_ztunnel(node).await {
            Ok(z) => z,
            Err(e) => {
                old.shutdown().await;
                return Err(e);
            }
        };
        let mut pods = new.pods();
        let served = tokio::time::timeout(
            WAIT,
            pods.wait_for(|p| want.iter().all(|uid| p.contains_key(uid))),
        )
        .await;
        let took = started.elapsed();
        old.shutdown().await;
        let unserved = new.unserved().borrow().clone();
        self.nodes[node].ztunnel = Some(new);
        match served {
            Ok(Ok(_)) => Ok(took),
            _ => bail!(
                "the new ztunnel on node {node} did not serve the pods {want:?} within {WAIT:?}; \
                 it reports unserved: {unserved:?}"
            ),
        }
    }

    /// Stops the ztunnel of `node` (its pods keep their redirection).
    pub async fn stop_ztunnel(&mut self, node: usize) {
        if let Some(z) = self.nodes[node].ztunnel.take() {
            z.shutdown().await;
        }
    }

    /// Starts the ztunnel of `node` after [`EnrollBed::stop_ztunnel`].
    pub async fn start_ztunnel_again(&mut self, node: usize) -> Result<()> {
        let z = self.start_ztunnel(node).await?;
        self.nodes[node].ztunnel = Some(z);
        Ok(())
    }

    /// Stops and starts the node agent of `node` (same sockets and state).
    pub async fn restart_agent(&mut self, node: usize) -> Result<()> {
        if let Some(a) = self.nodes[node].agent.take() {
            a.shutdown().await;
        }
        let a = self.start_agent(node).await?;
        self.nodes[node].agent = Some(a);
        Ok(())
    }

    /// The ztunnel of `node`.
    pub fn ztunnel(&self, node: usize) -> &Ztunnel {
        match self.nodes.get(node).and_then(|n| n.ztunnel.as_ref()) {
            Some(z) => z,
            None => panic!("no ztunnel on node {node}"),
        }
    }

    /// The node agent of `node`.
    pub fn agent(&self, node: usize) -> &Agent {
        match self.nodes.get(node).and_then(|n| n.agent.as_ref()) {
            Some(a) => a,
            None => panic!("no agent on node {node}"),
        }
    }

    /// A pod created by [`EnrollBed::add_pod`].
    pub fn pod(&self, name: &str) -> &CniPod {
        match self.pods.get(name) {
            Some(p) => p,
            None => panic!("no pod {name}"),
        }
    }

    fn write_namespaces(&self) -> Result<()> {
        let mut y = String::new();
        for (name, ambient) in &self.namespaces {
            let _ = write!(
                y,
                "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n"
            );
            if *ambient {
                y.push_str("  labels:\n    istio.io/dataplane-mode: ambient\n");
            }
            y.push_str("---\n");
        }
        crate::write_atomic(&self.config.path().join("namespaces.yaml"), &y)
    }

    fn write_pods(&self) -> Result<()> {
        let mut y = String::new();
        for p in self.pods.values() {
            let _ = write!(
                y,
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {}\n  namespace: {}\n  uid: {}\n  \
                 labels: {{app: {}}}\n  annotations: {}\nspec:\n  nodeName: {}\n  serviceAccountName: {}\nstatus:\n  podIP: {}\n---\n",
                p.net.name,
                p.namespace,
                p.uid,
                p.net.name,
                serde_json::to_string(&p.annotations).unwrap_or_else(|_| "{}".into()),
                node_name(p.net.node),
                p.service_account,
                p.net.ip
            );
        }
        crate::write_atomic(&self.config.path().join("pods.yaml"), &y)
    }

    /// Sets annotation `key` of pod `name` (the agents see it once they
    /// re-read the config directory).
    pub fn annotate(&mut self, name: &str, key: &str, value: &str) -> Result<()> {
        let pod = self
            .pods
            .get_mut(name)
            .with_context(|| format!("no pod {name} in the bed"))?;
        pod.annotations.insert(key.to_string(), value.to_string());
        self.write_pods()
    }

    /// Sets whether namespace `ns` is ambient.
    pub fn set_ambient(&mut self, ns: &str, ambient: bool) -> Result<()> {
        self.namespaces.insert(ns.to_string(), ambient);
        self.write_namespaces()
    }

    /// The plugin chain of `node`, as a conflist.
    pub fn conflist(&self, node: usize) -> Value {
        let n = node + 1;
        json!({
            "cniVersion": "1.0.0",
            "name": "ambit-test",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": true,
                    "ipMasq": false,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{
                            "subnet": format!("10.10.{n}.0/24"),
                            "rangeStart": format!("10.10.{n}.100"),
                            "rangeEnd": format!("10.10.{n}.200"),
                            "gateway": format!("10.10.{n}.1"),
                        }]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": self.data.path().join(format!("ipam-{node}")),
                    }
                },
                {
                    "type": "ambit-cni",
                    "ambit": {"agent_socket": self.agent_config(node).cni_socket}
                }
            ]
        })
    }

    /// Runs one plugin of the chain in `node`'s netns, as a runtime does;
    /// returns (success, stdout).
    pub fn exec_plugin(
        &self,
        node: usize,
        conf: &Value,
        command: &str,
        pod: &CniPod,
        prev: Option<&Value>,
    ) -> Result<(bool, String)> {
        let args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}",
            pod.namespace, pod.net.name, pod.container_id, pod.uid
        );
        // The very code `ambitctl local up` runs pods' CNI chains with.
        let inv = Invocation {
            node_netns: self.cluster.node_netns(node),
            cni_bin: self.cni_bin.path(),
            container_id: &pod.container_id,
            pod_netns: &pod.net.path(),
            args: &args,
        };
        let (ok, out, err) = exec_plugin(&inv, &self.conflist(node), conf, command, prev)?;
        if !err.is_empty() {
            tracing::debug!(command, stderr = %err, "CNI plugin stderr");
        }
        Ok((ok, out))
    }

    /// Creates pod `name` in namespace `ns` on `node` through the plugin
    /// chain (ADD), then adds it to the served config (with the IP the
    /// chain gave it). Fails with the plugin's error JSON if the chain does.
    pub async fn add_pod(&mut self, node: usize, name: &str, ns: &str, sa: &str) -> Result<CniPod> {
        let netns = self.cluster.add_bare_netns(name)?;
        let mut pod = CniPod {
            net: PodNet {
                name: name.to_string(),
                netns,
                ip: Ipv4Addr::UNSPECIFIED,
                ip6: None,
                node,
            },
            namespace: ns.to_string(),
            service_account: sa.to_string(),
            uid: format!("uid-{name}-{:08x}", rand::random::<u32>()),
            container_id: format!("{:032x}", rand::random::<u128>()),
            result: Value::Null,
            annotations: Default::default(),
        };
        let list = self.conflist(node);
        let plugins = list["plugins"].as_array().cloned().unwrap_or_default();
        let mut prev: Option<Value> = None;
        for conf in &plugins {
            let (ok, out) = self
                .exec_plugin_async(node, conf, "ADD", &pod, prev.as_ref())
                .await?;
            if !ok {
                bail!("CNI ADD of {name} failed in {}: {out}", conf["type"]);
            }
            prev = Some(
                serde_json::from_str(&out)
                    .with_context(|| format!("result of {}: {out}", conf["type"]))?,
            );
        }
        let result = prev.context("empty chain")?;
        let addr = result["ips"][0]["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse::<Ipv4Addr>().ok())
            .with_context(|| format!("no IPv4 in the chain's result: {result}"))?;
        pod.net.ip = addr;
        pod.result = result;
        self.cluster.adopt_pod(pod.net.clone());
        self.pods.insert(name.to_string(), pod.clone());
        self.write_pods()?;
        Ok(pod)
    }

    async fn exec_plugin_async(
        &self,
        node: usize,
        conf: &Value,
        command: &str,
        pod: &CniPod,
        prev: Option<&Value>,
    ) -> Result<(bool, String)> {
        // Plugins block (the agent may wait for ztunnel); keep the runtime free.
        tokio::task::block_in_place(|| self.exec_plugin(node, conf, command, pod, prev))
    }

    /// Deletes pod `name` through the chain (DEL, in reverse order).
    pub async fn del_pod(&mut self, name: &str) -> Result<()> {
        let pod = self.pod(name).clone();
        let list = self.conflist(pod.net.node);
        let plugins = list["plugins"].as_array().cloned().unwrap_or_default();
        for conf in plugins.iter().rev() {
            let (ok, out) = self
                .exec_plugin_async(pod.net.node, conf, "DEL", &pod, Some(&pod.result))
                .await?;
            if !ok {
                bail!("CNI DEL of {name} failed in {}: {out}", conf["type"]);
            }
        }
        self.pods.remove(name);
        self.write_pods()
    }

    /// Waits until the ztunnel of `node` knows the workload at `ip`.
    pub async fn wait_workload(&self, node: usize, ip: Ipv4Addr) -> Result<()> {
        let reader = self.ztunnel(node).state_reader();
        tokio::time::timeout(
            WAIT,
            reader.wait_for(|s| s.workload_by_ip("", ip.into()).is_some()),
        )
        .await
        .with_context(|| format!("ztunnel on node {node} never learned {ip}"))?;
        Ok(())
    }

    /// `/metrics` of the ztunnel of `node`.
    pub async fn metrics(&self, node: usize) -> Result<String> {
        crate::get(self.ztunnel(node).stats_addr(), "/metrics").await
    }

    /// Stops everything (namespaces go with the cluster on drop).
    pub async fn shutdown(mut self) {
        for n in self.nodes.drain(..) {
            if let Some(z) = n.ztunnel {
                z.shutdown().await;
            }
            if let Some(a) = n.agent {
                a.shutdown().await;
            }
        }
        if let Some(cp) = self.cp.take() {
            cp.shutdown().await;
        }
    }
}
