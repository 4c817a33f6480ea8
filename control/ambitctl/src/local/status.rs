//! `local status`: processes, readiness, enrollment (the node agents'
//! `pods.json`), recent connections (ztunnel access logs) and connection
//! totals by security policy (ztunnel `/metrics`).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::process::{http_get, is_alive, read_tail};
use super::state::{Phase, Role, State};
use super::waypoints::{SkippedWaypoint, WaypointStatus, probe};

/// Connections shown per node.
pub const RECENT_CONNECTIONS: usize = 20;

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
}

/// One pod.
#[derive(Debug, Clone, Serialize)]
pub struct PodStatus {
    pub namespace: String,
    pub name: String,
    pub node: String,
    pub ip: Ipv4Addr,
    pub netns: String,
    /// Whether its labels put it in the mesh.
    pub ambient: bool,
    /// What its node agent says (`None`: not in the agent's table).
    pub enrolled: Option<bool>,
    /// Enrolled and redirected, but its ztunnel does not serve it (no
    /// listeners; the agent is retrying the handover).
    pub unserved: bool,
    /// `ambit-demo` arguments.
    pub app: Option<String>,
    pub app_running: Option<bool>,
}

/// One access-log line of a ztunnel.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Connection {
    /// The node whose ztunnel logged it.
    pub node: String,
    pub time: String,
    pub direction: String,
    pub src_addr: String,
    pub src_workload: String,
    pub dst_addr: String,
    pub dst_workload: String,
    pub dst_service: String,
    /// The peer identity proved by mTLS; `None` for plaintext.
    pub src_identity: Option<String>,
    pub mtls: bool,
    pub response_flags: String,
    pub error: String,
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
    /// The last [`RECENT_CONNECTIONS`] of each node, oldest first across nodes.
    pub connections: Vec<Connection>,
    /// The waypoint controller.
    pub waypoint_controller: ProcStatus,
    /// Waypoint pods, with their readiness and requests per route.
    pub waypoints: Vec<WaypointStatus>,
    /// Waypoint Gateways without a pod, and why.
    pub waypoints_skipped: Vec<SkippedWaypoint>,
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
    let mut nodes = Vec::new();
    let mut connections = Vec::new();
    let mut enrolled: BTreeMap<String, (bool, bool)> = BTreeMap::new();
    for n in &state.nodes {
        let ztunnel = ProcStatus::of(state, Role::Ztunnel, Some(&n.name));
        if let Some(log) = &ztunnel.log {
            connections.extend(recent_connections(&n.name, log, RECENT_CONNECTIONS));
        }
        enrolled.extend(agent_table(&n.agent_dir.join("pods.json")));
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
        });
    }
    // One timeline across nodes (RFC 3339 timestamps sort as text).
    connections.sort_by(|a, b| a.time.cmp(&b.time));
    let pods = state
        .pods
        .iter()
        .map(|p| {
            let key = p.key();
            PodStatus {
                namespace: p.namespace.clone(),
                name: p.name.clone(),
                node: p.node.clone(),
                ip: p.ip,
                netns: p.netns.clone(),
                ambient: p.ambient,
                enrolled: enrolled.get(&key).map(|(e, _)| *e),
                unserved: enrolled.get(&key).is_some_and(|(e, served)| *e && !*served),
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
        name: state.name.clone(),
        state_dir: state.state_dir.clone(),
        config_dir: state.config_dir.clone(),
        log_dir: state.log_dir(),
        phase: state.phase,
        control,
        nodes,
        pods,
        connections,
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

/// The last `n` `connection complete` lines of a ztunnel log.
pub fn recent_connections(node: &str, log: &std::path::Path, n: usize) -> Vec<Connection> {
    let lines: Vec<Connection> = read_tail(log, 1024 * 1024)
        .iter()
        .filter(|l| l.contains("connection complete"))
        .filter_map(|l| parse_access_line(node, l))
        .collect();
    let start = lines.len().saturating_sub(n);
    lines[start..].to_vec()
}

/// Parses one access-log line (tracing's `key=value` format; string values
/// in quotes).
pub fn parse_access_line(node: &str, line: &str) -> Option<Connection> {
    let (head, fields) = line.split_once("connection complete")?;
    let kv = fields_of(fields);
    let get = |k: &str| kv.get(k).cloned().unwrap_or_default();
    let identity = get("src.identity");
    let mtls = !identity.is_empty() && identity != "-";
    Some(Connection {
        node: node.to_string(),
        time: head.split_whitespace().next().unwrap_or("").to_string(),
        direction: get("direction"),
        src_addr: get("src.addr"),
        src_workload: get("src.workload"),
        dst_addr: get("dst.addr"),
        dst_workload: get("dst.workload"),
        dst_service: get("dst.service"),
        src_identity: mtls.then_some(identity),
        mtls,
        response_flags: get("response_flags"),
        error: get("error"),
    })
}

fn fields_of(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s.trim_start();
    while let Some((key, after)) = rest.split_once('=') {
        let key = key.trim().to_string();
        let (value, next) = if let Some(q) = after.strip_prefix('"') {
            // Up to the next unescaped quote.
            let mut end = None;
            let mut escaped = false;
            for (i, c) in q.char_indices() {
                match c {
                    '\\' if !escaped => escaped = true,
                    '"' if !escaped => {
                        end = Some(i);
                        break;
                    }
                    _ => escaped = false,
                }
            }
            let end = end.unwrap_or(q.len());
            (
                q[..end].replace("\\\"", "\""),
                q.get(end + 1..).unwrap_or(""),
            )
        } else {
            let end = after.find(char::is_whitespace).unwrap_or(after.len());
            (after[..end].to_string(), &after[end..])
        };
        out.insert(key, value);
        rest = next.trim_start();
    }
    out
}

/// Sums `istio_tcp_connections_opened_total` by `connection_security_policy`.
pub fn opened_by_policy(metrics: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("istio_tcp_connections_opened_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once('}') else {
            continue;
        };
        let policy = labels
            .split("connection_security_policy=\"")
            .nth(1)
            .and_then(|v| v.split('"').next())
            .unwrap_or("unknown");
        let n = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        // Counters are whole numbers.
        let n = n as u64;
        *out.entry(policy.to_string()).or_insert(0) += n;
    }
    out
}
