//! Asking a waypoint pod how it is, from inside its netns (the socket is
//! made there, the request runs here): the agent's readiness (:15021),
//! Envoy's routes and cluster counters (admin :15000) and the merged
//! metrics (:15020).

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde::Serialize;

use super::routes::{RouteRow, Scrape, route_rows};
use super::{ADMIN_PORT, GatewayKey, METRICS_PORT, STATUS_PORT, WaypointRecord, WaypointTable};
use crate::local::netns;
use crate::local::process::{self, http_get_on};
use crate::local::state::State;
use crate::proxy_config::{self, Section};

/// Bound on each request to a waypoint pod.
const PROBE: Duration = Duration::from_secs(2);

/// One waypoint pod as `local status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct WaypointStatus {
    pub gateway: GatewayKey,
    /// `namespace/name`.
    pub pod: String,
    pub node: String,
    pub ip: std::net::Ipv4Addr,
    pub netns: String,
    pub agent_pid: Option<u32>,
    pub agent_running: bool,
    /// The agent's `/healthz/ready` said 200.
    pub ready: bool,
    /// Its answer otherwise (what is not ready yet), or why it could not be asked.
    pub readiness: String,
    pub restarts: u32,
    pub error: Option<String>,
    pub log: std::path::PathBuf,
    /// Requests per route destination.
    pub routes: Vec<RouteRow>,
}

/// A waypoint Gateway the controller does not run, and why.
#[derive(Debug, Clone, Serialize)]
pub struct SkippedWaypoint {
    pub gateway: String,
    pub why: String,
}

/// `GET path` on `port` of the pod's loopback.
pub fn get_in_pod(netns_name: &str, port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let ns = ambit_inpod::PodNetns::open(netns::path(netns_name))
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let stream = ns.run_in(move || TcpStream::connect_timeout(&addr, PROBE))?;
    http_get_on(stream, addr, path, PROBE)
}

/// Whether the agent of the pod in `netns_name` says ready, with its answer.
pub fn readiness(netns_name: &str) -> (bool, String) {
    match get_in_pod(netns_name, STATUS_PORT, "/healthz/ready") {
        Ok((200, _)) => (true, "ready".into()),
        Ok((status, body)) => (false, format!("{status}: {}", body.trim())),
        Err(e) => (false, format!("no answer on :{STATUS_PORT}: {e}")),
    }
}

/// Reads routes and counters of one waypoint pod (empty parts on errors).
pub fn scrape(netns_name: &str) -> Scrape {
    let routes = get_in_pod(netns_name, ADMIN_PORT, proxy_config::DUMP_PATH)
        .ok()
        .filter(|(s, _)| *s == 200)
        .and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(&body).ok())
        .map(|dump| proxy_config::routes(&proxy_config::section(&dump, Section::Routes)))
        .unwrap_or_default();
    let text = |port: u16, path: &str| {
        get_in_pod(netns_name, port, path)
            .ok()
            .filter(|(s, _)| *s == 200)
            .map(|(_, b)| b)
            .unwrap_or_default()
    };
    Scrape {
        routes,
        cluster_stats: text(ADMIN_PORT, "/stats?filter=%5Ecluster%5C.outbound"),
        prometheus: text(METRICS_PORT, "/stats/prometheus"),
    }
}

fn status_of(rec: &WaypointRecord) -> WaypointStatus {
    let agent_running = rec.agent_pid.is_some_and(process::is_alive);
    let (ready, readiness) = if agent_running {
        readiness(&rec.pod.netns)
    } else {
        (false, "agent not running".into())
    };
    let routes = if agent_running {
        route_rows(&scrape(&rec.pod.netns))
    } else {
        Vec::new()
    };
    WaypointStatus {
        gateway: rec.gateway.clone(),
        pod: rec.key(),
        node: rec.pod.node.clone(),
        ip: rec.pod.ip,
        netns: rec.pod.netns.clone(),
        agent_pid: rec.agent_pid,
        agent_running,
        ready,
        readiness,
        restarts: rec.restarts,
        error: rec.error.clone(),
        log: rec.log.clone(),
        routes,
    }
}

/// Every waypoint pod of the cluster, and the Gateways it does not run.
pub fn collect(state: &State) -> (Vec<WaypointStatus>, Vec<SkippedWaypoint>) {
    let table = WaypointTable::load(&state.state_dir);
    let pods = table.waypoints.iter().map(status_of).collect();
    let skipped = table
        .skipped
        .iter()
        .map(|(g, why)| SkippedWaypoint {
            gateway: g.clone(),
            why: why.clone(),
        })
        .collect();
    (pods, skipped)
}
