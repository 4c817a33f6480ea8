//! A whole mesh in network namespaces: the [`crate::netbed`] cluster, an
//! in-process control plane serving YAML generated for the bed's pods, one
//! in-process ztunnel per node, and an in-test node agent per node that
//! installs the pod redirection and hands enrolled pods over ZDS.
//!
//! ```text
//!  MeshBed::new(nodes, pods)      netns per node and pod, IPs assigned
//!  (MeshBed::dual_stack: IPv6 too; each pod's YAML lists both addresses)
//!  bed.start(extra_yaml).await    control plane + ztunnels + ZDS hand-over
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
        }
    }

    /// The same, outside the mesh.
    pub fn plain(name: &str, namespace: &str, node: usize, app: &str) -> Self {
        Self {
            enrolled: false,
            ..Self::mesh(name, namespace, node, app)
        }
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
    let mut tokens = String::new();
    for i in 0..nodes {
        let _ = writeln!(tokens, "token-{i} {}", node_name(i));
    }
    let tokens_file = data_dir.join("node-tokens");
    std::fs::write(&tokens_file, tokens)?;
    let mut cfg = ControlConfig::for_tests(config_dir.to_path_buf(), data_dir.join("cp"));
    cfg.node_tokens_file = Some(tokens_file);
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
    let token = data_dir.join(format!("token-{node}"));
    std::fs::write(&token, format!("token-{node}\n"))?;
    let mut z =
        ambit_ztunnel::Config::new(node_name(node), format!("https://{}", cp.xds_tls_addr()))
            .with_ephemeral_ports();
    z.token_file = Some(token);
    z.root_cert = Some(data_dir.join("cp/ca/root-cert.pem"));
    z.zds_path = zds_path;
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
            let _ = write!(
                y,
                "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {}\n  namespace: {}\n  uid: {}\n  \
                 labels: {{app: {}, version: v1}}\nspec:\n  nodeName: {}\n  serviceAccountName: {}\n\
                 status:\n  podIP: {}\n",
                s.name,
                s.namespace,
                pod_uid(s),
                s.app,
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
        let cp = start_control_plane(self.config.path(), self.data.path(), nodes).await?;
        for i in 0..nodes {
            let sock = self.data.path().join(format!("zds-{i}.sock"));
            let listener = ZdsListener::bind(&sock)?;
            let zt = start_ztunnel(&cp, self.data.path(), i, sock).await?;
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

    /// Stops the ztunnels and the control plane.
    pub async fn shutdown(mut self) {
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
