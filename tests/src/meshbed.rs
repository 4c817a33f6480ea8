//! A whole mesh in network namespaces: the [`crate::netbed`] cluster, an
//! in-process control plane serving YAML generated for the bed's pods, one
//! in-process ztunnel per node, and an in-test node agent per node that
//! installs the pod redirection and hands enrolled pods over ZDS.
//!
//! ```text
//!  MeshBed::new(nodes, pods)      netns per node and pod, IPs assigned
//!  (MeshBed::dual_stack: IPv6 too; each pod's YAML lists both addresses)
//!  bed.start(extra_yaml).await    control plane + ztunnels + ZDS hand-over
//!  bed.start_waypoint("wp-0")     agent + real Envoy in a PodSpec::waypoint pod
//!  bed.connect("client", addr)    a plain connection from inside a pod
//! ```
//!
//! Everything is torn down on drop (namespaces by the cluster, processes
//! are tasks of the test's runtime).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ambit_control::{ControlConfig, ControlPlane};
use ambit_inpod::{ZdsAgentConn, ZdsListener, ZdsMessage};
use ambit_proto::workload::zds::WorkloadInfo;
use ambit_ztunnel::Ztunnel;
use anyhow::{Context, Result, bail};
use tokio::net::TcpStream;

use crate::netbed::{self, App, Cluster, PodNet, redirect};
use crate::waypointpod::{WaypointPod, WaypointPodSpec};

/// Bound on every wait of the bed.
pub const WAIT: Duration = Duration::from_secs(15);

/// One pod of the bed.
#[derive(Clone, Debug)]
pub struct PodSpec {
    pub name: String,
    pub namespace: String,
    pub node: usize,
    pub service_account: String,
    /// `app` label (also the canonical service).
    pub app: String,
    /// Enrolled in the mesh: its namespace is ambient and the node agent
    /// hands it to ztunnel.
    pub enrolled: bool,
    /// Handed over ZDS (with its redirection) when enrolled; `false`
    /// leaves an enrolled pod's netns to the test (e.g. an impostor).
    pub handover: bool,
    /// `version` label.
    pub version: String,
    /// More labels (e.g. `istio.io/use-waypoint`).
    pub labels: Vec<(String, String)>,
    /// A waypoint pod: the Gateway it runs (see [`PodSpec::waypoint`]).
    pub gateway: Option<String>,
    /// Pod annotations.
    pub annotations: Vec<(String, String)>,
}

impl PodSpec {
    /// An enrolled pod `name` in `namespace` on `node`, service account and
    /// app label = `app`.
    pub fn mesh(name: &str, namespace: &str, node: usize, app: &str) -> Self {
        Self {
            name: name.into(),
            namespace: namespace.into(),
            node,
            service_account: app.into(),
            app: app.into(),
            enrolled: true,
            handover: true,
            version: "v1".into(),
            labels: Vec::new(),
            gateway: None,
            annotations: Vec::new(),
        }
    }

    /// The same, outside the mesh.
    pub fn plain(name: &str, namespace: &str, node: usize, app: &str) -> Self {
        Self {
            enrolled: false,
            ..Self::mesh(name, namespace, node, app)
        }
    }

    /// A pod of waypoint Gateway `gateway` (service account `gateway`):
    /// labelled `gateway.networking.k8s.io/gateway-name` and
    /// `istio.io/dataplane-mode: none` (never captured: its Envoy speaks
    /// HBONE itself). [`MeshBed::start_waypoint`] runs its agent and Envoy.
    pub fn waypoint(name: &str, namespace: &str, node: usize, gateway: &str) -> Self {
        Self {
            enrolled: false,
            gateway: Some(gateway.into()),
            labels: vec![
                (
                    "gateway.networking.k8s.io/gateway-name".into(),
                    gateway.into(),
                ),
                ("istio.io/dataplane-mode".into(), "none".into()),
            ],
            ..Self::mesh(name, namespace, node, gateway)
        }
    }

    /// A pod with an injected sidecar (as the webhook leaves it: the
    /// `sidecar.istio.io/status` annotation, and Istio's tunnel label so
    /// ztunnels reach it over HBONE on its Envoy's 15008), never handed
    /// to ztunnel. [`MeshBed::start_sidecar`] runs its capture, agent and
    /// Envoy.
    pub fn sidecar(name: &str, namespace: &str, node: usize, app: &str) -> Self {
        Self {
            enrolled: false,
            annotations: vec![("sidecar.istio.io/status".into(), "{}".into())],
            labels: vec![("networking.istio.io/tunnel".into(), "http".into())],
            ..Self::mesh(name, namespace, node, app)
        }
    }

    /// With `version` as its `version` label.
    pub fn version(mut self, version: &str) -> Self {
        self.version = version.into();
        self
    }

    /// With one more label.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.push((key.into(), value.into()));
        self
    }
}

/// The mesh test bed.
pub struct MeshBed {
    pub cluster: Cluster,
    specs: Vec<PodSpec>,
    pods: BTreeMap<String, PodNet>,
    config: tempfile::TempDir,
    data: tempfile::TempDir,
    cp: Option<ControlPlane>,
    ztunnels: Vec<Option<Ztunnel>>,
    agents: Vec<Arc<Mutex<ZdsAgentConn>>>,
    /// Applied to the control plane's config before it starts (e.g. a
    /// short certificate TTL).
    pub tune_control: fn(&mut ControlConfig),
    /// Applied to each ztunnel's config before it starts (e.g. short HBONE
    /// timeouts).
    pub tune_ztunnel: fn(&mut ambit_ztunnel::Config),
    /// (xDS plaintext, xDS TLS, monitoring) of the stopped control plane,
    /// so [`MeshBed::restart_control_plane`] binds them again.
    stopped_cp: Option<(SocketAddr, SocketAddr, SocketAddr)>,
    /// Running waypoint pods, by pod name.
    waypoints: BTreeMap<String, WaypointPod>,
}

impl Drop for MeshBed {
    fn drop(&mut self) {
        // Agents and Envoys first (killed with their process groups),
        // before the cluster's namespaces go.
        self.waypoints.clear();
    }
}

/// The name of node `i` in the beds' YAML and tokens.
pub fn node_name(i: usize) -> String {
    format!("node-{i}")
}

/// A control plane serving `config_dir` with its data under
/// `<data_dir>/cp` and a bootstrap token `token-<i>` for each of `nodes`.
pub async fn start_control_plane(
    config_dir: &Path,
    data_dir: &Path,
    nodes: usize,
) -> Result<ControlPlane> {
    start_control_plane_with(config_dir, data_dir, nodes, |_| {}).await
}

/// [`start_control_plane`] with `tune` applied to its config first.
pub async fn start_control_plane_with(
    config_dir: &Path,
    data_dir: &Path,
    nodes: usize,
    tune: impl FnOnce(&mut ControlConfig),
) -> Result<ControlPlane> {
    let mut tokens = String::new();
    for i in 0..nodes {
        let _ = writeln!(tokens, "token-{i} {}", node_name(i));
    }
    let tokens_file = data_dir.join("node-tokens");
    std::fs::write(&tokens_file, tokens)?;
    let mut cfg = ControlConfig::for_tests(config_dir.to_path_buf(), data_dir.join("cp"));
    cfg.node_tokens_file = Some(tokens_file);
    tune(&mut cfg);
    ControlPlane::start(cfg)
        .await
        .context("starting the control plane")
}

/// An in-process ztunnel for node `node` of `cp` (TLS xDS and CA, the
/// node's bootstrap token, the mesh root) taking pods over `zds_path`;
/// returns once it is ready.
pub async fn start_ztunnel(
    cp: &ControlPlane,
    data_dir: &Path,
    node: usize,
    zds_path: PathBuf,
) -> Result<Ztunnel> {
    start_ztunnel_with(cp, data_dir, node, zds_path, |_| {}).await
}

/// [`start_ztunnel`] with `tune` applied to its config first.
pub async fn start_ztunnel_with(
    cp: &ControlPlane,
    data_dir: &Path,
    node: usize,
    zds_path: PathBuf,
    tune: impl FnOnce(&mut ambit_ztunnel::Config),
) -> Result<Ztunnel> {
    let token = data_dir.join(format!("token-{node}"));
    std::fs::write(&token, format!("token-{node}\n"))?;
    let mut z =
        ambit_ztunnel::Config::new(node_name(node), format!("https://{}", cp.xds_tls_addr()))
            .with_ephemeral_ports();
    z.token_file = Some(token);
    z.root_cert = Some(data_dir.join("cp/ca/root-cert.pem"));
    z.zds_path = zds_path;
    tune(&mut z);
    let zt = ambit_ztunnel::start(z).await?;
    tokio::time::timeout(WAIT, zt.wait_ready())
        .await
        .context("ztunnel ready")?;
    Ok(zt)
}

fn pod_uid(spec: &PodSpec) -> String {
    format!("uid-{}-{}", spec.namespace, spec.name)
}

impl MeshBed {
    /// Builds the namespaces and assigns pod IPs; nothing runs yet. Logs
    /// (access log included) go to the test's captured output, shown when
    /// a test fails; `RUST_LOG` overrides the default `info`.
    pub fn new(nodes: usize, specs: &[PodSpec]) -> Result<Self> {
        Self::build(Cluster::new(nodes)?, specs)
    }

    /// [`MeshBed::new`] on a dual-stack cluster ([`Cluster::dual_stack`]):
    /// every pod has an IPv4 and an IPv6 address, both in its workload.
    pub fn dual_stack(nodes: usize, specs: &[PodSpec]) -> Result<Self> {
        Self::build(Cluster::dual_stack(nodes)?, specs)
    }

    fn build(mut cluster: Cluster, specs: &[PodSpec]) -> Result<Self> {
        let nodes = cluster.nodes();
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter(filter)
            .try_init();
        let mut pods = BTreeMap::new();
        for s in specs {
            if s.node >= nodes {
                bail!(
                    "pod {} on node {} but the bed has {nodes} nodes",
                    s.name,
                    s.node
                );
            }
            let pod = cluster.add_pod(s.node, &s.name)?;
            pods.insert(s.name.clone(), pod);
        }
        Ok(Self {
            cluster,
            specs: specs.to_vec(),
            pods,
            config: tempfile::tempdir()?,
            data: tempfile::tempdir()?,
            cp: None,
            ztunnels: Vec::new(),
            agents: Vec::new(),
            tune_control: |_| {},
            tune_ztunnel: |_| {},
            stopped_cp: None,
            waypoints: BTreeMap::new(),
        })
    }

    /// A pod's network.
    pub fn pod(&self, name: &str) -> &PodNet {
        match self.pods.get(name) {
            Some(p) => p,
            None => panic!("no pod {name} in the bed"),
        }
    }

    /// A pod's IP.
    pub fn ip(&self, name: &str) -> Ipv4Addr {
        self.pod(name).ip
    }

    /// A pod's IPv6 address (dual-stack beds only; panics otherwise).
    pub fn ip6(&self, name: &str) -> Ipv6Addr {
        match self.pod(name).ip6 {
            Some(ip) => ip,
            None => panic!("pod {name} has no IPv6 address (use MeshBed::dual_stack)"),
        }
    }

    /// Removes pod `name` from the served config (as if it were deleted
    /// from the cluster): its workload leaves xDS. Pair with
    /// [`MeshBed::unenroll`] to also take it from its ztunnel.
    pub fn remove_from_config(&mut self, name: &str) -> Result<()> {
        let before = self.specs.len();
        self.specs.retain(|s| s.name != name);
        if self.specs.len() == before {
            bail!("no pod {name} in the bed's config");
        }
        self.write_config("pods.yaml", &self.base_yaml())
    }

    /// The YAML for namespaces and pods.
    fn base_yaml(&self) -> String {
        let mut ns: BTreeMap<&str, bool> = BTreeMap::new();
        for s in &self.specs {
            *ns.entry(&s.namespace).or_default() |= s.enrolled;
        }
        let mut y = String::new();
        for (name, ambient) in ns {
            let _ = write!(
                y,
                "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n"
            );
            if ambient {
                y.push_str("  labels:\n    istio.io/dataplane-mode: ambient\n");
            }
            y.push_str("---\n");
        }
        for s in &self.specs {
            let mut labels = format!("app: {}, version: {}", s.app, s.version);
            for (k, v) in &s.labels {
                let _ = write!(labels, ", {k}: {v:?}");
            }
            let annotations: Vec<String> = s
                .annotations
                .iter()
                .map(|(k, v)| format!("{k}: {v:?}"))
                .collect();
            let annotations = annotations.join(", ");
            let _ = write!(
                y,
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {}\n  namespace: {}\n  uid: {}\n  \
                 labels: {{{labels}}}\n  annotations: {{{annotations}}}\nspec:\n  nodeName: {}\n  \
                 serviceAccountName: {}\nstatus:\n  podIP: {}\n",
                s.name,
                s.namespace,
                pod_uid(s),
                node_name(s.node),
                s.service_account,
                self.ip(&s.name)
            );
            if let Some(ip6) = self.pod(&s.name).ip6 {
                let _ = writeln!(
                    y,
                    "  podIPs: [{{ip: '{}'}}, {{ip: '{ip6}'}}]",
                    self.ip(&s.name)
                );
            }
            y.push_str("---\n");
        }
        y
    }

    /// Writes `extra.yaml` in the served config dir (the control plane
    /// picks changes up).
    /// The directory the control plane serves.
    pub fn config_dir(&self) -> &Path {
        self.config.path()
    }

    pub fn write_config(&self, name: &str, yaml: &str) -> Result<()> {
        crate::write_atomic(&self.config.path().join(name), yaml)
    }

    /// Starts the control plane (serving the pods plus `extra_yaml`), a
    /// ztunnel per node, and hands every enrolled pod to its node's
    /// ztunnel after installing its redirection.
    pub async fn start(&mut self, extra_yaml: &str) -> Result<()> {
        std::fs::write(self.config.path().join("pods.yaml"), self.base_yaml())?;
        std::fs::write(self.config.path().join("extra.yaml"), extra_yaml)?;
        let nodes = self.cluster.nodes();
        let cp = start_control_plane_with(
            self.config.path(),
            self.data.path(),
            nodes,
            self.tune_control,
        )
        .await?;
        for i in 0..nodes {
            let sock = self.data.path().join(format!("zds-{i}.sock"));
            let listener = ZdsListener::bind(&sock)?;
            let zt = start_ztunnel_with(&cp, self.data.path(), i, sock, self.tune_ztunnel).await?;
            let conn = tokio::task::spawn_blocking(move || listener.accept(WAIT))
                .await?
                .context("ztunnel connecting to the node agent")?;
            self.ztunnels.push(Some(zt));
            self.agents.push(Arc::new(Mutex::new(conn)));
        }
        self.cp = Some(cp);
        for i in 0..nodes {
            let enrolled: Vec<PodSpec> = self
                .specs
                .iter()
                .filter(|s| s.node == i && s.enrolled && s.handover)
                .cloned()
                .collect();
            for s in &enrolled {
                self.enroll(s).await?;
            }
            self.agent_request(i, ZdsMessage::SnapshotSent, None)
                .await?;
        }
        Ok(())
    }

    /// Installs a pod's redirection and hands it to its ztunnel.
    async fn enroll(&self, s: &PodSpec) -> Result<()> {
        let pod = self.pod(&s.name).clone();
        redirect::install(&pod.path(), &redirect::RedirectPorts::default())?;
        let msg = ZdsMessage::Add {
            uid: pod_uid(s),
            info: WorkloadInfo {
                name: s.name.clone(),
                namespace: s.namespace.clone(),
                service_account: s.service_account.clone(),
            },
        };
        self.agent_request(s.node, msg, Some(pod)).await
    }

    async fn agent_request(&self, node: usize, msg: ZdsMessage, pod: Option<PodNet>) -> Result<()> {
        let conn = self.agents[node].clone();
        let ack = tokio::task::spawn_blocking(move || -> Result<String> {
            let conn = conn
                .lock()
                .map_err(|_| anyhow::anyhow!("agent lock poisoned"))?;
            let file = match &pod {
                Some(p) => Some(std::fs::File::open(p.path())?),
                None => None,
            };
            Ok(conn.request(&msg, file.as_ref().map(|f| f.as_fd()))?)
        })
        .await??;
        if !ack.is_empty() {
            bail!("ztunnel refused a ZDS request on node {node}: {ack}");
        }
        Ok(())
    }

    /// Tells a pod's ztunnel the pod is gone (its listeners close, its
    /// connections drain) and removes its redirection.
    pub async fn unenroll(&self, name: &str) -> Result<()> {
        let s = self
            .specs
            .iter()
            .find(|s| s.name == name)
            .context("no such pod")?
            .clone();
        self.agent_request(s.node, ZdsMessage::Del { uid: pod_uid(&s) }, None)
            .await?;
        Ok(redirect::remove(&self.pod(name).path())?)
    }

    /// The ztunnel of `node`; panics when it was taken.
    pub fn ztunnel(&self, node: usize) -> &Ztunnel {
        match self.ztunnels.get(node) {
            Some(Some(z)) => z,
            _ => panic!("no running ztunnel on node {node}"),
        }
    }

    /// Takes the ztunnel of `node` out of the bed (e.g. to shut it down
    /// while the rest keeps running).
    pub fn take_ztunnel(&mut self, node: usize) -> Option<Ztunnel> {
        self.ztunnels.get_mut(node).and_then(Option::take)
    }

    /// The control plane.
    pub fn control_plane(&self) -> Option<&ControlPlane> {
        self.cp.as_ref()
    }

    /// Stops the control plane (xDS and CA unreachable); the ztunnels keep
    /// running on what they have.
    pub async fn stop_control_plane(&mut self) -> Result<()> {
        let cp = self.cp.take().context("the control plane is not running")?;
        self.stopped_cp = Some((cp.xds_addr(), cp.xds_tls_addr(), cp.monitoring_addr()));
        cp.shutdown().await;
        Ok(())
    }

    /// Starts the control plane again on the addresses it had, with the
    /// same config directory and CA.
    pub async fn restart_control_plane(&mut self) -> Result<()> {
        let (plain, tls, mon) = self
            .stopped_cp
            .take()
            .context("the control plane was not stopped")?;
        let tune = self.tune_control;
        let cp = start_control_plane_with(
            self.config.path(),
            self.data.path(),
            self.cluster.nodes(),
            move |cfg| {
                tune(cfg);
                cfg.xds_plaintext_addr = plain;
                cfg.xds_tls_addr = tls;
                cfg.monitoring_addr = mon;
            },
        )
        .await?;
        self.cp = Some(cp);
        Ok(())
    }

    /// `/metrics` of the ztunnel of `node`.
    pub async fn metrics(&self, node: usize) -> Result<String> {
        crate::get(self.ztunnel(node).stats_addr(), "/metrics").await
    }

    /// A plain connection from inside pod `from` (captured by its
    /// redirection when enrolled).
    pub async fn connect(&self, from: &str, dst: SocketAddr) -> Result<TcpStream> {
        tokio::time::timeout(WAIT, netbed::connect(self.pod(from), dst))
            .await
            .context("connect timed out")?
    }

    /// Writes `msg` on a fresh connection from pod `from` to `dst` and
    /// returns the echo (as long as `msg`); fails when none comes in time.
    pub async fn echo_once(&self, from: &str, dst: SocketAddr, msg: &[u8]) -> Result<Vec<u8>> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = self.connect(from, dst).await?;
        tokio::time::timeout(WAIT, async {
            s.write_all(msg).await?;
            let mut got = vec![0u8; msg.len()];
            s.read_exact(&mut got).await?;
            Ok::<_, std::io::Error>(got)
        })
        .await
        .with_context(|| format!("echo from {from} to {dst} timed out"))?
        .with_context(|| format!("echo from {from} to {dst}"))
    }

    /// Whether a connection from pod `from` to `dst` is refused: it cannot
    /// be made, or what comes back is not the echo (reset, closed, or e.g.
    /// a TLS alert from an HBONE port) in time.
    pub async fn refused(&self, from: &str, dst: SocketAddr) -> Result<bool> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let Ok(mut s) = self.connect(from, dst).await else {
            return Ok(true);
        };
        let r = tokio::time::timeout(WAIT, async {
            s.write_all(b"ping").await?;
            let mut buf = [0u8; 4];
            s.read_exact(&mut buf).await.map(|_| buf)
        })
        .await
        .with_context(|| format!("neither refused nor echoed: {from} -> {dst}"))?;
        Ok(!matches!(r, Ok(b) if &b == b"ping"))
    }

    /// Polls [`MeshBed::refused`] until it says `want` (a config change is
    /// applied asynchronously), bounded by [`WAIT`].
    pub async fn wait_refused(&self, from: &str, dst: SocketAddr, want: bool) -> Result<()> {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.refused(from, dst).await? != want {
            if tokio::time::Instant::now() > deadline {
                bail!("{from} -> {dst}: refused is still {} after {WAIT:?}", !want);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// An echo server in pod `name` on `port`.
    pub async fn echo(&self, name: &str, port: u16) -> Result<App> {
        netbed::echo_server(self.pod(name), port).await
    }

    /// A server in pod `name` that first writes the peer's address.
    pub async fn whoami(&self, name: &str, port: u16) -> Result<App> {
        netbed::whoami_server(self.pod(name), port).await
    }

    /// Waits until the ztunnel of `node` holds `n` enrolled pods.
    pub async fn wait_pods(&self, node: usize, n: usize) -> Result<()> {
        let mut rx = self.ztunnel(node).pods();
        tokio::time::timeout(WAIT, rx.wait_for(|p| p.len() == n))
            .await
            .context("waiting for pods")??;
        Ok(())
    }

    /// Starts the agent and Envoy of waypoint pod `name` (a
    /// [`PodSpec::waypoint`]) inside its netns, with the mesh CA's
    /// certificate for its service account, and waits until it is ready.
    /// Needs [`MeshBed::start`] first.
    pub async fn start_waypoint(&mut self, name: &str) -> Result<()> {
        let spec = self
            .specs
            .iter()
            .find(|s| s.name == name)
            .with_context(|| format!("no pod {name} in the bed"))?
            .clone();
        let gateway = spec
            .gateway
            .clone()
            .with_context(|| format!("pod {name} is no waypoint pod (PodSpec::waypoint)"))?;
        let cp = self
            .cp
            .as_ref()
            .context("start the bed (MeshBed::start) before its waypoints")?;
        let token_file = self.data.path().join(format!("token-{}", spec.node));
        if !token_file.is_file() {
            bail!("no node token for node {} (is the bed started?)", spec.node);
        }
        let wp = WaypointPod::start(WaypointPodSpec {
            pod: self.pod(name).clone(),
            namespace: spec.namespace.clone(),
            pod_name: spec.name.clone(),
            node_name: node_name(spec.node),
            service_account: spec.service_account.clone(),
            gateway,
            control_plane: cp.xds_tls_addr(),
            root_cert: self.data.path().join("cp/ca/root-cert.pem"),
            token_file,
            envoy: crate::envoy::envoy_binary()?,
            kind: "waypoint".into(),
        })
        .await?;
        wp.wait_ready(crate::waypointpod::READY_LIMIT).await?;
        self.waypoints.insert(name.to_string(), wp);
        Ok(())
    }

    /// Runs the sidecar of a [`PodSpec::sidecar`] pod: `ambit-agent
    /// redirect` in its netns (what `istio-init` does), then the agent and
    /// Envoy in it with the proxy's gid. Waits until it is ready; it is
    /// then reachable as [`MeshBed::waypoint`] (the same process pair).
    pub async fn start_sidecar(&mut self, name: &str) -> Result<()> {
        let spec = self
            .specs
            .iter()
            .find(|s| s.name == name)
            .with_context(|| format!("no pod {name} in the bed"))?
            .clone();
        let cp = self
            .cp
            .as_ref()
            .context("start the bed (MeshBed::start) before its sidecars")?;
        let token_file = self.data.path().join(format!("token-{}", spec.node));
        let pod = self.pod(name).clone();
        crate::sidecarpod::install_capture(&pod)?;
        let sc = WaypointPod::start(WaypointPodSpec {
            pod,
            namespace: spec.namespace.clone(),
            pod_name: spec.name.clone(),
            node_name: node_name(spec.node),
            service_account: spec.service_account.clone(),
            gateway: String::new(),
            control_plane: cp.xds_tls_addr(),
            root_cert: self.data.path().join("cp/ca/root-cert.pem"),
            token_file,
            envoy: crate::envoy::envoy_binary()?,
            kind: "sidecar".into(),
        })
        .await?;
        sc.wait_ready(crate::waypointpod::READY_LIMIT).await?;
        self.waypoints.insert(name.to_string(), sc);
        Ok(())
    }

    /// A running waypoint pod; panics when there is none of that name.
    pub fn waypoint(&self, name: &str) -> &WaypointPod {
        match self.waypoints.get(name) {
            Some(w) => w,
            None => panic!("no waypoint pod {name} started in the bed"),
        }
    }

    /// The agent and Envoy log of waypoint pod `name`, if it was started.
    pub fn waypoint_log(&self, name: &str) -> Option<String> {
        self.waypoints.get(name).map(WaypointPod::log)
    }

    /// The same, to kill or restart it.
    pub fn waypoint_mut(&mut self, name: &str) -> &mut WaypointPod {
        match self.waypoints.get_mut(name) {
            Some(w) => w,
            None => panic!("no waypoint pod {name} started in the bed"),
        }
    }

    /// Stops the ztunnels and the control plane.
    pub async fn shutdown(mut self) {
        self.waypoints.clear();
        for zt in self.ztunnels.drain(..).flatten() {
            zt.shutdown().await;
        }
        if let Some(cp) = self.cp.take() {
            cp.shutdown().await;
        }
    }
}

/// Sum of a metric's samples whose label set contains every `labels` pair.
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, ""));
            if n != name {
                return None;
            }
            let ok = labels
                .iter()
                .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
            if ok { value.parse::<f64>().ok() } else { None }
        })
        .sum()
}
