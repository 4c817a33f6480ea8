//! A bed for `ambit-agent` with a real Envoy: an in-process control plane
//! (CA + xDS with a tiny waypoint generator serving empty CDS/LDS), an
//! optional recording CA front, and the agent as a real process in its own
//! process group (killed with everything it started when the handle drops).
//!
//! ```text
//!  test ──spawn──▶ ambit-agent ──spawn──▶ envoy ══ADS (mTLS, SDS cert)══▶ control plane :15012
//!                      │ CSR                                               ▲
//!                      └────▶ RecordingCa (records, then forwards) ──────▶ CA :15010
//! ```

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ambit_control::xds::{Generator, Generators, ProxyKind, ProxyNode, Served, TypeSpec};
use ambit_control::{ControlConfig, ControlPlane};
use ambit_proto::auth::istio_certificate_service_client::IstioCertificateServiceClient;
use ambit_proto::auth::istio_certificate_service_server::{
    IstioCertificateService, IstioCertificateServiceServer,
};
use ambit_proto::auth::{IstioCertificateRequest, IstioCertificateResponse};
use anyhow::{Context, Result, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use prost::Message;
use serde_json::Value;
use tokio::sync::watch;
use tonic::transport::Channel;

const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

/// Serves every waypoint empty CDS and LDS, so Envoy initializes. (The
/// real waypoint generator lives in the control plane; this keeps the
/// agent's tests independent of what it serves.)
#[derive(Debug)]
pub struct EmptyEnvoyGenerator;

const TYPES: &[TypeSpec] = &[
    TypeSpec {
        type_url: CLUSTER,
        label: "cluster",
        resend_with: None,
    },
    TypeSpec {
        type_url: LISTENER,
        label: "listener",
        resend_with: None,
    },
];

impl Generator for EmptyEnvoyGenerator {
    fn kind(&self) -> ProxyKind {
        ProxyKind::Waypoint
    }
    fn types(&self) -> &'static [TypeSpec] {
        TYPES
    }
    fn generate(&self, _: &ProxyNode, _: &ambit_control::model::Snapshot, _: &str) -> Served {
        Served::empty()
    }
}

/// The mesh the agent runs in: namespace `shop`, the waypoint pod
/// `wp-0` (service account `wp`) on `node-1`.
pub const MESH_YAML: &str = "\
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Pod
metadata:
  name: wp-0
  namespace: shop
  labels: {gateway.networking.k8s.io/gateway-name: wp}
spec: {nodeName: node-1, serviceAccountName: wp}
status: {podIP: 10.9.0.7}
";

/// The waypoint's node id.
pub const NODE_ID: &str = "router~10.9.0.7~wp-0.shop~shop.svc.cluster.local";
/// The waypoint's identity.
pub const SPIFFE_ID: &str = "spiffe://cluster.local/ns/shop/sa/wp";

/// A control plane for the agent: node token `token-1` for `node-1`.
pub struct Plane {
    pub cp: ControlPlane,
    pub dir: tempfile::TempDir,
}

impl Plane {
    /// Serves [`MESH_YAML`] with [`EmptyEnvoyGenerator`] for waypoints;
    /// certificates live at most `max_ttl`.
    pub async fn start(max_ttl: Duration) -> Result<Plane> {
        let mut generators = Generators::standard();
        generators.register(Arc::new(EmptyEnvoyGenerator));
        Plane::start_with(MESH_YAML, max_ttl, generators).await
    }

    /// Serves `yaml` with `generators`.
    pub async fn start_with(
        yaml: &str,
        max_ttl: Duration,
        generators: Generators,
    ) -> Result<Plane> {
        let dir = tempfile::tempdir().context("temp dir")?;
        let config = dir.path().join("config");
        std::fs::create_dir_all(&config)?;
        std::fs::write(config.join("mesh.yaml"), yaml)?;
        std::fs::write(dir.path().join("node-tokens"), "token-1 node-1\n")?;
        std::fs::write(dir.path().join("token"), "token-1\n")?;
        let mut cfg = ControlConfig::for_tests(config, dir.path().join("cp"));
        cfg.node_tokens_file = Some(dir.path().join("node-tokens"));
        cfg.max_cert_ttl_secs = max_ttl.as_secs();
        let cp = ControlPlane::start_with_generators(cfg, generators)
            .await
            .context("starting the control plane")?;
        Ok(Plane { cp, dir })
    }

    /// The mesh root.
    pub fn root_cert(&self) -> PathBuf {
        self.dir.path().join("cp/ca/root-cert.pem")
    }

    /// The node bootstrap token file of `node-1`.
    pub fn token_file(&self) -> PathBuf {
        self.dir.path().join("token")
    }
}

/// One `CreateCertificate` as the CA received it.
#[derive(Debug, Clone)]
pub struct SeenRequest {
    pub csr: String,
    pub metadata_keys: Vec<String>,
    /// The whole request as encoded on the wire.
    pub raw: Vec<u8>,
}

/// A CA front: records every request, refuses the first `refuse` of them
/// (UNAVAILABLE), holds the others until opened, and forwards them to the
/// control plane's CA (plaintext port) with the caller's token.
#[derive(Clone)]
pub struct RecordingCa {
    upstream: IstioCertificateServiceClient<Channel>,
    seen: Arc<Mutex<Vec<SeenRequest>>>,
    open: watch::Receiver<bool>,
    refuse: usize,
}

/// What the front answers to refused requests.
pub const REFUSAL: &str = "test CA front refuses this request";

/// The running front.
pub struct RecordingCaHandle {
    pub url: String,
    pub seen: Arc<Mutex<Vec<SeenRequest>>>,
    pub open: watch::Sender<bool>,
}

impl RecordingCa {
    /// Starts a front of `cp`'s CA, closed (requests wait) or open,
    /// refusing the first `refuse` requests.
    pub async fn start(cp: &ControlPlane, open: bool, refuse: usize) -> Result<RecordingCaHandle> {
        let upstream = Channel::from_shared(format!("http://{}", cp.xds_addr()))?.connect_lazy();
        let (open_tx, open_rx) = watch::channel(open);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let front = RecordingCa {
            upstream: IstioCertificateServiceClient::new(upstream),
            seen: seen.clone(),
            open: open_rx,
            refuse,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(IstioCertificateServiceServer::new(front))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Ok(RecordingCaHandle {
            url: format!("http://{addr}"),
            seen,
            open: open_tx,
        })
    }
}

impl RecordingCaHandle {
    /// The requests so far.
    pub fn seen(&self) -> Vec<SeenRequest> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

#[tonic::async_trait]
impl IstioCertificateService for RecordingCa {
    async fn create_certificate(
        &self,
        request: tonic::Request<IstioCertificateRequest>,
    ) -> Result<tonic::Response<IstioCertificateResponse>, tonic::Status> {
        let auth = request.metadata().get("authorization").cloned();
        let body = request.into_inner();
        let seen = SeenRequest {
            csr: body.csr.clone(),
            metadata_keys: body
                .metadata
                .as_ref()
                .map(|m| m.fields.keys().cloned().collect())
                .unwrap_or_default(),
            raw: body.encode_to_vec(),
        };
        let n = match self.seen.lock() {
            Ok(mut s) => {
                s.push(seen);
                s.len()
            }
            Err(_) => 0,
        };
        if n <= self.refuse {
            return Err(tonic::Status::unavailable(REFUSAL));
        }
        let mut open = self.open.clone();
        tokio::time::timeout(Duration::from_secs(30), open.wait_for(|o| *o))
            .await
            .map_err(|_| tonic::Status::unavailable("test CA front stayed closed"))?
            .map_err(|_| tonic::Status::unavailable("test CA front gone"))?;
        let mut up = tonic::Request::new(body);
        if let Some(a) = auth {
            up.metadata_mut().insert("authorization", a);
        }
        self.upstream.clone().create_certificate(up).await
    }
}

/// The built `ambit-agent` (next to the test binary's directory).
pub fn agent_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .context("test binary has no target dir")?;
    let bin = dir.join("ambit-agent");
    if !bin.is_file() {
        bail!(
            "{} is not built: run `cargo build -p ambit-ztunnel --bin ambit-agent` (or `cargo test --workspace`, which builds it)",
            bin.display()
        );
    }
    Ok(bin)
}

/// A running `ambit-agent` (and, in its process group, its Envoy). Killed
/// with its whole group when dropped.
pub struct Agent {
    child: Child,
    pub pid: i32,
    pub state_dir: PathBuf,
    pub log: PathBuf,
    pub ports: Value,
    _dir: tempfile::TempDir,
}

/// Flags of one agent run.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// `https://…` of the control plane.
    pub xds_address: String,
    /// `--ca-address`, when not the xDS address.
    pub ca_address: Option<String>,
    /// `--kind`: `waypoint` or `sidecar`.
    pub kind: String,
    /// The pod: namespace, node, service account, name, IP, Gateway (a
    /// waypoint's; empty for a sidecar).
    pub namespace: String,
    pub node_name: String,
    pub service_account: String,
    pub pod_name: String,
    pub pod_ip: String,
    pub gateway: String,
    /// Run the agent (and so its Envoy) inside this network namespace (a
    /// name under `/var/run/netns`), as in a pod.
    pub netns: Option<String>,
    /// Run the agent (and its Envoy) with this group id, as a sidecar's
    /// proxy runs: `ambit-agent redirect` exempts the proxy's gid.
    pub gid: Option<u32>,
}

impl AgentOptions {
    /// The waypoint of [`MESH_YAML`] (`wp-0` in `shop` on `node-1`, service
    /// account and Gateway `wp`).
    pub fn new(xds_address: String) -> AgentOptions {
        AgentOptions {
            xds_address,
            ca_address: None,
            kind: "waypoint".into(),
            namespace: "shop".into(),
            node_name: "node-1".into(),
            service_account: "wp".into(),
            pod_name: "wp-0".into(),
            pod_ip: "10.9.0.7".into(),
            gateway: "wp".into(),
            netns: None,
            gid: None,
        }
    }
}

impl Agent {
    /// Starts the agent for the bed's waypoint and waits for its ports.
    pub async fn start(plane: &Plane, envoy: &Path, opts: &AgentOptions) -> Result<Agent> {
        Agent::launch(&plane.root_cert(), &plane.token_file(), envoy, opts).await
    }

    /// Starts an agent trusting `root_cert`, authenticating to the CA with
    /// the node token in `token_file`, running `envoy`; waits for its
    /// ports (`ports.json`).
    pub async fn launch(
        root_cert: &Path,
        token_file: &Path,
        envoy: &Path,
        opts: &AgentOptions,
    ) -> Result<Agent> {
        let bin = agent_binary()?;
        let dir = tempfile::tempdir()?;
        let state_dir = dir.path().join("state");
        let log = dir.path().join("agent.log");
        let out = std::fs::File::create(&log)?;
        // `ip netns exec` enters the namespace and execs the agent (same
        // pid, so the process group below is the agent's).
        let mut cmd = match &opts.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]);
                c
            }
            None => Command::new("env"),
        };
        if let Some(gid) = opts.gid {
            cmd.args(["setpriv", "--regid", &gid.to_string(), "--clear-groups"]);
        }
        cmd.arg(&bin);
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .args(["--kind", &opts.kind])
            .args(["--namespace", &opts.namespace])
            .args(["--node-name", &opts.node_name])
            .args(["--service-account", &opts.service_account])
            .args(["--pod-name", &opts.pod_name, "--pod-ip", &opts.pod_ip])
            .args(["--xds-address", &opts.xds_address])
            .arg("--root-cert")
            .arg(root_cert)
            .arg("--token-file")
            .arg(token_file)
            .arg("--envoy-binary")
            .arg(envoy)
            .args(["--envoy-concurrency", "1", "--envoy-log-level", "info"])
            .arg("--state-dir")
            .arg(&state_dir)
            .args(["--ephemeral-ports", "--drain-duration-secs", "1"])
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .process_group(0);
        if !opts.gateway.is_empty() {
            cmd.arg("--labels").arg(format!(
                "gateway.networking.k8s.io/gateway-name={}",
                opts.gateway
            ));
        }
        if let Some(ca) = &opts.ca_address {
            cmd.args(["--ca-address", ca]);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let pid = i32::try_from(child.id())?;
        let mut agent = Agent {
            child,
            pid,
            state_dir,
            log,
            ports: Value::Null,
            _dir: dir,
        };
        let ports_file = agent.state_dir.join("ports.json");
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(text) = std::fs::read_to_string(&ports_file)
                && let Ok(v) = serde_json::from_str::<Value>(&text)
            {
                agent.ports = v;
                return Ok(agent);
            }
            if let Some(status) = agent.child.try_wait()? {
                bail!(
                    "the agent exited at start ({status}):\n{}",
                    agent.log_text()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "the agent wrote no ports.json within 15 s:\n{}",
                    agent.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A port from `ports.json` (`admin`, `status`, `metrics`, `envoy_prometheus`).
    pub fn port(&self, name: &str) -> u16 {
        self.ports[name]
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .unwrap_or(0)
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self, name: &str) -> std::net::SocketAddr {
        std::net::SocketAddr::from(([127, 0, 0, 1], self.port(name)))
    }

    /// The agent's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `signal` to the agent.
    pub fn signal(&self, signal: Signal) -> Result<()> {
        kill(Pid::from_raw(self.pid), signal).context("signalling the agent")
    }

    /// SIGKILLs the agent and its Envoy (the whole process group) and
    /// waits until they are gone.
    pub async fn kill_all(&mut self, limit: Duration) -> Result<()> {
        let _ = kill(Pid::from_raw(-self.pid), Signal::SIGKILL);
        self.wait_exit(limit).await?;
        let deadline = Instant::now() + limit;
        while !group_members(self.pid).is_empty() {
            if Instant::now() > deadline {
                bail!(
                    "processes of the agent's group still live after {limit:?}: {:?}",
                    group_members(self.pid)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Waits (polling, never blocking the runtime) for the agent to exit.
    pub async fn wait_exit(&mut self, limit: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!(
                    "the agent did not exit within {limit:?}:\n{}",
                    self.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Live processes of the agent's process group other than the agent
    /// (its Envoy).
    pub fn children(&self) -> Vec<i32> {
        group_members(self.pid)
            .into_iter()
            .filter(|p| *p != self.pid)
            .collect()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(-self.pid), Signal::SIGKILL);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Pids of the live (not zombie) processes whose process group is `pgid`.
pub fn group_members(pgid: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            // pid (comm) state ppid pgrp ...; comm may hold spaces.
            let Some(rest) = stat.rsplit_once(") ").map(|(_, r)| r) else {
                return false;
            };
            let fields: Vec<&str> = rest.split_whitespace().collect();
            fields.first() != Some(&"Z") && fields.get(2) == Some(&pgid.to_string().as_str())
        })
        .collect()
}
