//! `local status`: processes, readiness, whether each pod is in the mesh
//! and the connections apps made, all read live from what the processes
//! hold now:
//!
//! * enrollment (`enrollment.rs`): the config dir's labels now, each node
//!   agent's `pods.json`, each ztunnel's admin `/config_dump` workloads;
//! * connections (`connections.rs`): each ztunnel's admin `/connections`,
//!   joined into one row per application connection;
//! * connection totals by security policy: ztunnel `/metrics` (Prometheus
//!   text, parsed).

mod connections;
mod enrollment;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::process::{http_get, is_alive};
use super::sidecars::{self, SidecarStatus};
use super::state::{Phase, Role, State};
use super::waypoints::{SkippedWaypoint, WaypointStatus, probe};

pub use connections::{
    Connection, OPEN_CONNECTIONS, RECENT_CONNECTIONS, Report, ZtConnections, ZtEndpoint, ZtRecord,
    merge, opened_by_policy, rfc3339,
};
pub use enrollment::{
    LiveConfig, Mesh, PodLabels, labels_of, read_config, sidecar_verdict, verdict,
    ztunnel_workloads,
};

/// A process and whether it runs.
#[derive(Debug, Clone, Serialize)]
pub struct ProcStatus {
    pub pid: Option<u32>,
    pub alive: bool,
    pub log: Option<PathBuf>,
}

impl ProcStatus {
    fn of(state: &State, role: Role, who: Option<&str>) -> Self {
        match state.process(role, who) {
            Some(p) => Self {
                pid: Some(p.pid),
                alive: is_alive(p.pid),
                log: Some(p.log.clone()),
            },
            None => Self {
                pid: None,
                alive: false,
                log: None,
            },
        }
    }
}

/// The control plane.
#[derive(Debug, Clone, Serialize)]
pub struct ControlStatus {
    pub process: ProcStatus,
    pub ready: bool,
    pub xds_tls_addr: Option<String>,
    pub monitoring_addr: Option<String>,
}

/// One node.
#[derive(Debug, Clone, Serialize)]
pub struct NodeStatus {
    pub name: String,
    pub netns: String,
    pub lan_ip: Ipv4Addr,
    pub subnet: String,
    pub agent: ProcStatus,
    pub ztunnel: ProcStatus,
    pub ztunnel_ready: bool,
    pub admin_addr: String,
    pub stats_addr: String,
    /// `istio_tcp_connections_opened_total` summed by
    /// `connection_security_policy` (empty when `/metrics` is unreachable).
    pub connections_opened: BTreeMap<String, u64>,
    /// Why its admin (`/config_dump`, `/connections`) did not answer: its
    /// view of the pods and its connections are then missing.
    pub admin_error: Option<String>,
}

/// One pod.
#[derive(Debug, Clone, Serialize)]
pub struct PodStatus {
    pub namespace: String,
    pub name: String,
    pub node: String,
    pub ip: Ipv4Addr,
    pub netns: String,
    /// Whether its labels put it in the mesh, as the config dir says now.
    pub ambient: bool,
    /// The `istio.io/dataplane-mode` value that decided (the pod's, else
    /// its namespace's; empty when neither has one).
    pub dataplane_mode: String,
    /// Whether the config dir still has the pod.
    pub in_config: bool,
    /// What its node agent says now (`None`: not in the agent's table).
    pub enrolled: Option<bool>,
    /// Enrolled and redirected, but its ztunnel does not serve it (no
    /// listeners; the agent is retrying the handover).
    pub unserved: bool,
    /// How each ztunnel that answered holds its workload: `HBONE` (peers
    /// tunnel to it), `TCP`, or `None` when it does not list it.
    pub ztunnels: BTreeMap<String, Option<String>>,
    /// All of the above considered.
    pub mesh: Mesh,
    /// `ambit-demo` arguments.
    pub app: Option<String>,
    pub app_running: Option<bool>,
}

/// Everything `local status` shows.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub name: String,
    pub state_dir: PathBuf,
    pub config_dir: PathBuf,
    pub log_dir: PathBuf,
    pub phase: Phase,
    pub control: ControlStatus,
    pub nodes: Vec<NodeStatus>,
    pub pods: Vec<PodStatus>,
    /// Application connections, oldest first: every open one (up to
    /// [`OPEN_CONNECTIONS`]) and the last [`RECENT_CONNECTIONS`] closed.
    pub connections: Vec<Connection>,
    /// Documents of the config dir its reader rejects now (the mesh keeps
    /// serving their last good version).
    pub config_errors: Vec<String>,
    /// The waypoint controller.
    pub waypoint_controller: ProcStatus,
    /// Waypoint pods, with their readiness and requests per route.
    pub waypoints: Vec<WaypointStatus>,
    /// Waypoint Gateways without a pod, and why.
    pub waypoints_skipped: Vec<SkippedWaypoint>,
    /// Sidecar pods' agents (with Envoy), with their readiness.
    pub sidecars: Vec<SidecarStatus>,
}

impl Status {
    /// Whether every process runs and every ztunnel is ready.
    pub fn healthy(&self) -> bool {
        self.control.process.alive
            && self.control.ready
            && self
                .nodes
                .iter()
                .all(|n| n.agent.alive && n.ztunnel.alive && n.ztunnel_ready)
            && self.pods.iter().all(|p| p.app_running != Some(false))
            && self.waypoints.iter().all(|w| w.agent_running && w.ready)
            && self
                .sidecars
                .iter()
                .all(|s| s.agent_running && s.relay_running && s.ready)
    }

    /// The sidecar of pod `namespace/name`.
    pub fn sidecar(&self, pod: &str) -> Option<&SidecarStatus> {
        self.sidecars.iter().find(|s| s.pod == pod)
    }

    /// The waypoint pod of Gateway `namespace/name`.
    pub fn waypoint(&self, gateway: &str) -> Option<&WaypointStatus> {
        self.waypoints
            .iter()
            .find(|w| w.gateway.to_string() == gateway)
    }

    /// The pod `namespace/name`.
    pub fn pod(&self, key: &str) -> Option<&PodStatus> {
        self.pods
            .iter()
            .find(|p| format!("{}/{}", p.namespace, p.name) == key)
    }
}

const PROBE: Duration = Duration::from_secs(1);

/// What one ztunnel's admin says: its workloads' protocols and its
/// connections.
fn ztunnel_admin(admin: SocketAddr) -> Result<(BTreeMap<String, String>, ZtConnections), String> {
    let get = |path: &str, what: &str| {
        crate::http::get(admin, path, what, PROBE).map_err(|e| e.to_string())
    };
    let dump = get("/config_dump", "ztunnel's admin")?;
    let dump: serde_json::Value = serde_json::from_str(&dump)
        .map_err(|e| format!("ztunnel's /config_dump at {admin} is not JSON: {e}"))?;
    let conns = get("/connections", "ztunnel's admin")?;
    let conns: ZtConnections = serde_json::from_str(&conns).map_err(|e| {
        format!("ztunnel's /connections at {admin} is not what ambitctl reads: {e}")
    })?;
    Ok((ztunnel_workloads(&dump), conns))
}

/// Collects the status of the cluster described by `state`.
pub fn collect(state: &State) -> Status {
    let control = ControlStatus {
        process: ProcStatus::of(state, Role::Control, None),
        ready: state.control.as_ref().is_some_and(|c| {
            http_get(c.monitoring_addr, "/ready", PROBE).is_ok_and(|(s, _)| s == 200)
        }),
        xds_tls_addr: state.control.as_ref().map(|c| c.xds_tls_addr.to_string()),
        monitoring_addr: state
            .control
            .as_ref()
            .map(|c| c.monitoring_addr.to_string()),
    };
    let config = read_config(&state.config_dir);
    let mut nodes = Vec::new();
    let mut records = Vec::new();
    let mut workloads: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut agents: BTreeMap<String, (bool, bool)> = BTreeMap::new();
    for n in &state.nodes {
        let ztunnel = ProcStatus::of(state, Role::Ztunnel, Some(&n.name));
        let admin_error = match ztunnel_admin(n.admin_addr) {
            Ok((w, c)) => {
                workloads.insert(n.name.clone(), w);
                records.push((n.name.clone(), c));
                None
            }
            Err(e) => Some(e),
        };
        agents.extend(agent_table(&n.agent_dir.join("pods.json")));
        nodes.push(NodeStatus {
            name: n.name.clone(),
            netns: n.netns.clone(),
            lan_ip: n.lan_ip,
            subnet: n.subnet.clone(),
            agent: ProcStatus::of(state, Role::NodeAgent, Some(&n.name)),
            ztunnel_ready: http_get(n.readiness_addr, "/healthz/ready", PROBE)
                .is_ok_and(|(s, _)| s == 200),
            ztunnel,
            admin_addr: n.admin_addr.to_string(),
            stats_addr: n.stats_addr.to_string(),
            connections_opened: http_get(n.stats_addr, "/metrics", PROBE)
                .ok()
                .filter(|(s, _)| *s == 200)
                .map(|(_, body)| opened_by_policy(&body))
                .unwrap_or_default(),
            admin_error,
        });
    }
    let pods = state
        .pods
        .iter()
        .map(|p| {
            let key = p.key();
            let labels = config.pods.get(&key);
            let agent = agents.get(&key);
            let enrolled = agent.map(|(e, _)| *e);
            let served = agent.is_none_or(|(_, served)| *served);
            let ztunnels: BTreeMap<String, Option<String>> = workloads
                .iter()
                .map(|(node, w)| (node.clone(), w.get(&key).cloned()))
                .collect();
            PodStatus {
                namespace: p.namespace.clone(),
                name: p.name.clone(),
                node: p.node.clone(),
                ip: p.ip,
                netns: p.netns.clone(),
                ambient: labels.is_some_and(|l| l.ambient),
                dataplane_mode: labels.map(|l| l.mode.clone()).unwrap_or_default(),
                in_config: labels.is_some(),
                enrolled,
                unserved: enrolled == Some(true) && !served,
                mesh: if p.sidecar {
                    sidecar_verdict(enrolled, &ztunnels)
                } else {
                    verdict(labels, enrolled, served, &ztunnels)
                },
                ztunnels,
                app: p.app.as_ref().map(|a| a.join(" ")),
                app_running: p
                    .app
                    .as_ref()
                    .map(|_| ProcStatus::of(state, Role::App, Some(&key)).alive),
            }
        })
        .collect();
    let (waypoints, waypoints_skipped) = probe::collect(state);
    Status {
        waypoint_controller: ProcStatus::of(state, Role::WaypointController, None),
        waypoints,
        waypoints_skipped,
        sidecars: sidecars::collect(state),
        name: state.name.clone(),
        state_dir: state.state_dir.clone(),
        config_dir: state.config_dir.clone(),
        log_dir: state.log_dir(),
        phase: state.phase,
        control,
        nodes,
        pods,
        connections: merge(&records),
        config_errors: config.errors,
    }
}

/// `namespace/name → (enrolled, served)` from a node agent's `pods.json` (a
/// map uid → `{pod: {name, namespace, uid}, enrolled, served, ...}`).
pub fn agent_table(path: &std::path::Path) -> BTreeMap<String, (bool, bool)> {
    let Ok(bytes) = std::fs::read(path) else {
        return BTreeMap::new();
    };
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice(&bytes) else {
        return BTreeMap::new();
    };
    map.values()
        .filter_map(|rec| {
            let ns = rec["pod"]["namespace"].as_str()?;
            let name = rec["pod"]["name"].as_str()?;
            Some((
                format!("{ns}/{name}"),
                (
                    rec["enrolled"].as_bool().unwrap_or(false),
                    rec["served"].as_bool().unwrap_or(true),
                ),
            ))
        })
        .collect()
}
