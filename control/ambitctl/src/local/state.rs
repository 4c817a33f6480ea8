//! `<state-dir>/state.json`: everything `local up` made, written before
//! each thing is made, so `local down` can undo a half-finished or crashed
//! `up`. Replaced atomically (temp file + rename) on every change.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::LocalError;

/// Name of the state file inside the state dir.
pub const STATE_FILE: &str = "state.json";

/// Environment variable set on every process `local up` starts, holding
/// the state dir: `local down` finds leftovers by it in `/proc/*/environ`.
pub const STATE_ENV: &str = "AMBIT_LOCAL_STATE_DIR";

/// How far `up` got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Starting,
    Ready,
    Failed,
}

/// What a started process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    Control,
    NodeAgent,
    Ztunnel,
    App,
    /// `ambitctl local waypoint-controller`: starts and stops waypoint
    /// pods as the config's waypoint Gateways come and go.
    WaypointController,
    /// A sidecar pod's `ambit-agent --kind sidecar` (Envoy in its group).
    Sidecar,
    /// `ambitctl local relay`: a sidecar pod's way to the control plane.
    SidecarRelay,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Control => "ambit-control",
            Role::NodeAgent => "ambit-node-agent",
            Role::Ztunnel => "ztunnel",
            Role::App => "ambit-demo",
            Role::WaypointController => "waypoint-controller",
            Role::Sidecar => "sidecar",
            Role::SidecarRelay => "sidecar-relay",
        }
    }
}

/// One started process; it leads its own process group (pgid = pid).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcRecord {
    pub role: Role,
    /// The node it serves (agent, ztunnel) or runs on (app).
    pub node: Option<String>,
    /// `namespace/name` of the pod (app).
    pub pod: Option<String>,
    pub pid: u32,
    pub log: PathBuf,
    pub command: Vec<String>,
}

/// The control plane's listeners.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlState {
    pub xds_plaintext_addr: SocketAddr,
    pub xds_tls_addr: SocketAddr,
    pub monitoring_addr: SocketAddr,
    pub data_dir: PathBuf,
    pub node_tokens_file: PathBuf,
}

/// One node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeState {
    pub name: String,
    pub netns: String,
    pub lan_ip: Ipv4Addr,
    /// `a.b.c.0/24`.
    pub subnet: String,
    pub gateway: Ipv4Addr,
    /// `<state-dir>/nodes/<name>`.
    pub dir: PathBuf,
    pub conflist: PathBuf,
    pub cni_socket: PathBuf,
    pub zds_socket: PathBuf,
    /// The node agent's state dir (its `pods.json`).
    pub agent_dir: PathBuf,
    pub token_file: PathBuf,
    pub admin_addr: SocketAddr,
    pub stats_addr: SocketAddr,
    pub readiness_addr: SocketAddr,
}

/// One pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodState {
    pub namespace: String,
    pub name: String,
    pub node: String,
    pub netns: String,
    pub ip: Ipv4Addr,
    /// `K8S_POD_UID` given to CNI: `metadata.uid`, or generated.
    pub uid: String,
    pub container_id: String,
    #[serde(default)]
    pub service_account: String,
    /// Whether its labels put it in the mesh.
    pub ambient: bool,
    /// Whether it runs a sidecar (it asks for injection, or has one).
    #[serde(default)]
    pub sidecar: bool,
    /// `ambit-demo` arguments, if it runs the demo app.
    pub app: Option<Vec<String>>,
    /// The chain's ADD result, passed back on DEL as runtimes do.
    pub cni_result: Option<serde_json::Value>,
}

impl PodState {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The whole state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    pub name: String,
    pub state_dir: PathBuf,
    /// The directory the mesh serves (and the node agents read).
    pub config_dir: PathBuf,
    /// When `config_dir` is a working copy: the directory it was copied from.
    #[serde(default)]
    pub source_dir: Option<PathBuf>,
    pub bin_dir: PathBuf,
    pub phase: Phase,
    /// Seconds since the Unix epoch when `up` began.
    pub started_at: u64,
    pub control: Option<ControlState>,
    /// Every network namespace made, in creation order.
    pub netns: Vec<String>,
    pub processes: Vec<ProcRecord>,
    pub nodes: Vec<NodeState>,
    pub pods: Vec<PodState>,
    /// The Envoy waypoint pods run (`ENVOY_BIN`, else `envoy` on PATH),
    /// when one was found at `up`.
    #[serde(default)]
    pub envoy: Option<PathBuf>,
}

impl State {
    /// `<state-dir>/state.json`.
    pub fn path(state_dir: &Path) -> PathBuf {
        state_dir.join(STATE_FILE)
    }

    /// Reads the state of the cluster `name` kept in `state_dir`.
    pub fn load(name: &str, state_dir: &Path) -> Result<State, LocalError> {
        let path = State::path(state_dir);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(LocalError::NotFound {
                    name: name.to_string(),
                    state_dir: state_dir.to_path_buf(),
                });
            }
            Err(e) => return Err(LocalError::io("reading the state file", &path)(e)),
        };
        serde_json::from_slice(&bytes).map_err(|e| LocalError::BadState {
            name: name.to_string(),
            path,
            why: e.to_string(),
        })
    }

    /// Writes the state file atomically.
    pub fn save(&self) -> Result<(), LocalError> {
        let path = State::path(&self.state_dir);
        let tmp = self.state_dir.join(".state.json.tmp");
        let json = serde_json::to_vec_pretty(self).map_err(|e| LocalError::Io {
            what: "encoding the state file".into(),
            path: path.clone(),
            source: std::io::Error::other(e),
        })?;
        std::fs::write(&tmp, json).map_err(LocalError::io("writing the state file", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(LocalError::io("writing the state file", &path))
    }

    /// The pod `namespace/name`.
    pub fn pod(&self, key: &str) -> Result<&PodState, LocalError> {
        self.pods
            .iter()
            .find(|p| p.key() == key)
            .ok_or_else(|| LocalError::NoSuchPod {
                name: self.name.clone(),
                pod: key.to_string(),
                known: self
                    .pods
                    .iter()
                    .map(PodState::key)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// The node named `name`.
    pub fn node(&self, name: &str) -> Option<&NodeState> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The process of `role` for `node` (agent, ztunnel) or pod (app,
    /// sidecar, sidecar relay).
    pub fn process(&self, role: Role, node_or_pod: Option<&str>) -> Option<&ProcRecord> {
        self.processes.iter().rev().find(|p| {
            p.role == role
                && match role {
                    Role::Control | Role::WaypointController => true,
                    Role::App | Role::Sidecar | Role::SidecarRelay => {
                        p.pod.as_deref() == node_or_pod
                    }
                    _ => p.node.as_deref() == node_or_pod,
                }
        })
    }

    /// `<state-dir>/generated`: the Pods `ambitctl` writes for waypoint
    /// Gateways and the injected version of sidecar pods, served by the
    /// control plane (over the config dir's objects of the same name) and
    /// read by the node agents beside the config dir (`--extra-config-dir`).
    pub fn generated_dir(&self) -> PathBuf {
        self.state_dir.join("generated")
    }

    /// `<state-dir>/logs`.
    pub fn log_dir(&self) -> PathBuf {
        self.state_dir.join("logs")
    }
}
