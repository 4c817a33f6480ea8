//! A waypoint pod for the netns beds: the built `ambit-agent` and a real
//! upstream Envoy running inside a pod's network namespace, with the
//! waypoint's identity (its service account) from the mesh CA — what a
//! waypoint Deployment's pod is in Kubernetes.
//!
//! ```text
//!  pod netns:  ambit-agent ──spawn──▶ envoy  (0.0.0.0:15008 HBONE, admin/status on 127.0.0.1)
//!                 │ CSR (node token)     │ ADS (mTLS, SDS cert)
//!                 ▼                      ▼
//!              127.0.0.1:15012 ── Relay ──▶ control plane's xDS/CA (host netns)
//! ```
//!
//! The control plane of the beds runs in the test process and listens on
//! the host's loopback; [`Relay`] gives the pod the same service on its own
//! loopback (`https://127.0.0.1:15012`, a name the control plane's serving
//! certificate carries). Anything that runs a control plane a pod can
//! reach directly passes its address instead. The agent is killed with
//! its Envoy (one process group) when the [`WaypointPod`] drops, also when
//! a test fails.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::agentbed::{Agent, AgentOptions};
use crate::netbed::{self, PodNet, Relay};

/// The port the xDS/CA relay listens on inside the pod.
pub const XDS_RELAY_PORT: u16 = 15012;
/// Bound on readiness after a start.
pub const READY_LIMIT: Duration = Duration::from_secs(30);

/// What a waypoint pod is.
#[derive(Debug, Clone)]
pub struct WaypointPodSpec {
    /// The pod's network.
    pub pod: PodNet,
    /// Its Kubernetes namespace, pod name and node name.
    pub namespace: String,
    pub pod_name: String,
    pub node_name: String,
    /// Its service account (its identity) and its Gateway.
    pub service_account: String,
    pub gateway: String,
    /// The control plane's xDS + CA TLS address in the test's namespace.
    pub control_plane: SocketAddr,
    /// The mesh root and the node bootstrap token the agent presents to
    /// the CA (a node may get certificates for the pods scheduled on it).
    pub root_cert: PathBuf,
    pub token_file: PathBuf,
    /// The Envoy binary.
    pub envoy: PathBuf,
    /// `waypoint`, or `sidecar` for a pod with an injected sidecar (its
    /// `gateway` is then empty and the agent runs with the proxy's gid,
    /// which the pod's capture exempts).
    pub kind: String,
}

/// A running (or stopped) waypoint pod.
pub struct WaypointPod {
    pub spec: WaypointPodSpec,
    agent: Option<Agent>,
    _relay: Relay,
    /// Logs of the agents stopped so far.
    past_logs: String,
}

impl WaypointPod {
    /// Starts the relay and the agent (which starts Envoy); does not wait
    /// for readiness (see [`WaypointPod::wait_ready`]).
    pub async fn start(spec: WaypointPodSpec) -> Result<WaypointPod> {
        let listen = SocketAddr::from(([127, 0, 0, 1], XDS_RELAY_PORT));
        let relay = Relay::start(&spec.pod, listen, spec.control_plane)?;
        let mut pod = WaypointPod {
            spec,
            agent: None,
            _relay: relay,
            past_logs: String::new(),
        };
        pod.start_agent().await?;
        Ok(pod)
    }

    async fn start_agent(&mut self) -> Result<()> {
        let s = &self.spec;
        let opts = AgentOptions {
            xds_address: format!("https://127.0.0.1:{XDS_RELAY_PORT}"),
            ca_address: None,
            kind: s.kind.clone(),
            namespace: s.namespace.clone(),
            node_name: s.node_name.clone(),
            service_account: s.service_account.clone(),
            pod_name: s.pod_name.clone(),
            pod_ip: s.pod.ip.to_string(),
            gateway: s.gateway.clone(),
            netns: Some(s.pod.netns.clone()),
            gid: (s.kind == "sidecar").then_some(crate::sidecarpod::PROXY_GID),
        };
        let agent = Agent::launch(&s.root_cert, &s.token_file, &s.envoy, &opts)
            .await
            .with_context(|| format!("starting the agent of waypoint pod {}", s.pod_name))?;
        self.agent = Some(agent);
        Ok(())
    }

    fn agent(&self) -> Result<&Agent> {
        self.agent
            .as_ref()
            .with_context(|| format!("waypoint pod {} is stopped", self.spec.pod_name))
    }

    /// `127.0.0.1:<port>` of one of the agent's ports (`admin`, `status`,
    /// `metrics`, `envoy_prometheus`), inside the pod.
    pub fn addr(&self, port: &str) -> Result<SocketAddr> {
        Ok(self.agent()?.addr(port))
    }

    /// A GET from inside the pod to one of the agent's ports.
    pub async fn get(&self, port: &str, path: &str) -> Result<(u16, String)> {
        let addr = self.addr(port)?;
        let stream = tokio::time::timeout(
            Duration::from_secs(5),
            netbed::connect(&self.spec.pod, addr),
        )
        .await
        .with_context(|| format!("connecting to {addr} in pod {}", self.spec.pod_name))??;
        crate::http_on(stream, addr, "GET", path).await
    }

    /// Waits until the agent says ready (certificate served, Envoy live with
    /// its listeners and clusters); returns how long it took. Fails with
    /// the last answer and the agent's log.
    pub async fn wait_ready(&self, limit: Duration) -> Result<Duration> {
        let start = Instant::now();
        let mut last = String::from("no answer yet");
        while start.elapsed() < limit {
            match self.get("status", "/healthz/ready").await {
                Ok((200, _)) => return Ok(start.elapsed()),
                Ok((status, body)) => last = format!("{status}: {}", body.trim()),
                Err(e) => last = format!("{e:#}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!(
            "waypoint pod {} not ready within {limit:?}; last answer: {last}\nagent log:\n{}",
            self.spec.pod_name,
            self.log()
        )
    }

    /// GET on Envoy's admin API; fails on a non-200 answer.
    pub async fn admin(&self, path: &str) -> Result<String> {
        let (status, body) = self.get("admin", path).await?;
        if status != 200 {
            bail!(
                "Envoy admin {path} in {}: {status}: {body}",
                self.spec.pod_name
            );
        }
        Ok(body)
    }

    /// One counter of Envoy's `/stats` (0 when it does not exist yet).
    pub async fn stat(&self, name: &str) -> Result<u64> {
        let text = self
            .admin(&format!("/stats?filter={}", stat_regex(name)))
            .await?;
        Ok(text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0))
    }

    /// Kills the agent and Envoy at once (SIGKILL to their process group),
    /// as a crashed pod; returns once they are gone.
    pub async fn kill(&mut self) -> Result<()> {
        let mut agent = self
            .agent
            .take()
            .with_context(|| format!("waypoint pod {} is not running", self.spec.pod_name))?;
        agent.kill_all(Duration::from_secs(10)).await?;
        self.past_logs.push_str(&agent.log_text());
        Ok(())
    }

    /// Starts the agent (and Envoy) again, as the pod's restart would.
    pub async fn start_again(&mut self) -> Result<()> {
        if self.agent.is_some() {
            bail!("waypoint pod {} is already running", self.spec.pod_name);
        }
        self.start_agent().await
    }

    /// The agents' logs (with Envoy's lines) so far.
    pub fn log(&self) -> String {
        let now = self.agent.as_ref().map(Agent::log_text).unwrap_or_default();
        format!("{}{now}", self.past_logs)
    }
}

/// `^name$` with regex metacharacters escaped (URL-safe: `|` and the like
/// are percent-encoded).
fn stat_regex(name: &str) -> String {
    let mut out = String::from("%5E");
    for c in name.chars() {
        match c {
            '.' | '*' | '+' | '?' | '(' | ')' | '[' | ']' | '{' | '}' | '^' | '$' | '\\' => {
                out.push_str("%5C");
                out.push(c);
            }
            '|' => out.push_str("%5C%7C"),
            ';' => out.push_str("%3B"),
            '/' => out.push_str("%2F"),
            ':' => out.push_str("%3A"),
            _ => out.push(c),
        }
    }
    out.push_str("%24");
    out
}
