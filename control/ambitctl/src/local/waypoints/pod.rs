//! Making and removing one waypoint pod, as a runtime and kubelet would:
//! its Pod object (the generated manifest), netns and CNI ADD through its
//! node's chain, the relay to the control plane, `ambit-agent` (which runs
//! Envoy); and the reverse.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use super::relay::Relay;
use super::{LABEL_DATAPLANE_MODE, RELAY_PORT, WaypointRecord, manifest};
use crate::local::cni::{self, CniCall};
use crate::local::process::{self, spawn_detached};
use crate::local::state::{ControlState, State};
use crate::local::{LocalError, netns};

/// How long a stopping agent gets to drain Envoy and exit before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(4);
/// Envoy's drain on a stop (`--drain-duration-secs`).
const DRAIN_SECS: &str = "1";

/// What making pods needs from the cluster.
#[derive(Debug, Clone)]
pub(super) struct PodContext {
    pub state: State,
    pub control: ControlState,
    pub envoy: PathBuf,
    /// Bound on each wait while making a pod.
    pub timeout: Duration,
}

impl PodContext {
    fn cni_bin(&self) -> PathBuf {
        self.state.state_dir.join("cni-bin")
    }
}

/// Writes `text` to `path` atomically (temp file + rename), so the
/// control plane and node agents never read half a manifest.
fn write_atomic(path: &Path, text: &str) -> Result<(), LocalError> {
    let tmp = path.with_extension("yaml.tmp");
    std::fs::write(&tmp, text).map_err(LocalError::io("writing a waypoint manifest", &tmp))?;
    std::fs::rename(&tmp, path).map_err(LocalError::io("writing a waypoint manifest", path))
}

/// What keeps a made pod running: its relay to the control plane and the
/// agent's process handle (to reap it).
#[derive(Debug)]
pub(super) struct Running {
    /// Held: dropping it stops the relay.
    pub _relay: Relay,
    pub agent: Child,
}

/// Makes the pod of `rec` up to a running agent; `rec` records each step
/// (the caller saves it).
pub(super) fn make(ctx: &PodContext, rec: &mut WaypointRecord) -> Result<Running, LocalError> {
    let dir = ctx.state.generated_dir();
    std::fs::create_dir_all(&dir).map_err(LocalError::io("creating a directory", &dir))?;
    write_atomic(&rec.manifest, &manifest(&rec.gateway, &rec.pod))?;
    netns::add(&rec.pod.netns)?;
    let node = ctx
        .state
        .node(&rec.pod.node)
        .cloned()
        .ok_or_else(|| LocalError::Plan {
            dir: ctx.state.config_dir.clone(),
            why: format!(
                "waypoint pod {} is on unknown node {}",
                rec.key(),
                rec.pod.node
            ),
        })?;
    // The control plane and the node agent learn the pod from the manifest;
    // ADD once the control plane has it (its certificate depends on it).
    wait_known(ctx, rec)?;
    let list = cni::read_conflist(&node.conflist)?;
    let cni_bin = ctx.cni_bin();
    let result = CniCall {
        node: &node,
        pod: &rec.pod,
        cni_bin: &cni_bin,
    }
    .add_retrying(&list, ctx.timeout)?;
    rec.pod.cni_result = Some(result);
    // Not captured: if the node agent took the ADD before reading the
    // manifest (namespace labels alone say ambient), it releases the pod
    // once it reads `istio.io/dataplane-mode: none`.
    wait_not_enrolled(ctx, &node.agent_dir, rec)?;
    let relay = Relay::start(
        &rec.pod.netns,
        SocketAddr::from(([127, 0, 0, 1], RELAY_PORT)),
        ctx.control.xds_tls_addr,
    )?;
    let agent = spawn_agent(ctx, rec)?;
    rec.agent_pid = Some(agent.id());
    Ok(Running {
        _relay: relay,
        agent,
    })
}

/// Polls `check` every 100 ms for at most `limit`; `Err(what)` on timeout.
fn poll(what: &str, limit: Duration, mut check: impl FnMut() -> bool) -> Result<(), LocalError> {
    let deadline = Instant::now() + limit;
    while !check() {
        if Instant::now() >= deadline {
            return Err(LocalError::Command {
                cmd: what.to_string(),
                status: format!("not done within {} s", limit.as_secs()),
                stderr: String::new(),
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

fn wait_known(ctx: &PodContext, rec: &WaypointRecord) -> Result<(), LocalError> {
    let needle = format!("/Pod/{}/{}\"", rec.pod.namespace, rec.pod.name);
    let addr = ctx.control.monitoring_addr;
    poll(
        &format!(
            "waiting for the control plane to serve waypoint pod {} from {} (http://{addr}/debug/resources?type=address)",
            rec.key(),
            rec.manifest.display()
        ),
        ctx.timeout,
        || {
            process::http_get(
                addr,
                "/debug/resources?type=address",
                Duration::from_secs(1),
            )
            .is_ok_and(|(s, body)| s == 200 && body.contains(&needle))
        },
    )
}

fn wait_not_enrolled(
    ctx: &PodContext,
    agent_dir: &Path,
    rec: &WaypointRecord,
) -> Result<(), LocalError> {
    let table = agent_dir.join("pods.json");
    let key = rec.key();
    poll(
        &format!(
            "waiting for the node agent of {} to leave waypoint pod {key} uncaptured ({LABEL_DATAPLANE_MODE}: none; see {})",
            rec.pod.node,
            table.display()
        ),
        ctx.timeout,
        || {
            crate::local::status::agent_table(&table)
                .get(&key)
                .is_some_and(|(enrolled, _)| !enrolled)
        },
    )
}

/// The agent's environment: the container spec Kubernetes runs
/// (`ambit_control::k8s::waypoint::objects`, `inject::proxy`), with the pod
/// fields the downward API would fill taken from the pod.
fn agent_env(rec: &WaypointRecord) -> Vec<(&'static str, String)> {
    use ambit_control::inject::InjectSettings;
    use ambit_control::inject::proxy::{EnvValue, agent_env};
    use ambit_control::k8s::waypoint::objects::{waypoint_pod_labels, waypoint_proxy};
    let p = &rec.pod;
    let labels = waypoint_pod_labels(&rec.gateway.name, &Default::default());
    let settings = InjectSettings::default();
    agent_env(&waypoint_proxy(&rec.gateway.name, &labels, &settings))
        .into_iter()
        .map(|(name, value)| {
            let value = match value {
                EnvValue::Literal(v) => v,
                EnvValue::PodField("metadata.namespace") => p.namespace.clone(),
                EnvValue::PodField("metadata.name") => p.name.clone(),
                EnvValue::PodField("status.podIP") => p.ip.to_string(),
                EnvValue::PodField("spec.serviceAccountName") => p.service_account.clone(),
                EnvValue::PodField("spec.nodeName") => p.node.clone(),
                EnvValue::PodField(_) => String::new(),
            };
            (name, value)
        })
        .collect()
}

/// Starts `ambit-agent` inside the pod's netns (`ip netns exec` execs it:
/// same pid); it leads its process group, with Envoy. It runs what a
/// waypoint Deployment's container runs ([`agent_env`]); the flags are what
/// differs on one host: the control plane through the pod's relay, this
/// cluster's root and node token files, the Envoy binary and state dir.
pub(super) fn spawn_agent(ctx: &PodContext, rec: &WaypointRecord) -> Result<Child, LocalError> {
    let node = ctx
        .state
        .node(&rec.pod.node)
        .ok_or_else(|| LocalError::NoSuchPod {
            name: ctx.state.name.clone(),
            pod: format!("{} (its node {} is unknown)", rec.key(), rec.pod.node),
            known: String::new(),
        })?;
    let agent_dir = agent_dir(&ctx.state, rec);
    let p = &rec.pod;
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &p.netns])
        .arg(ctx.state.bin_dir.join("ambit-agent"))
        .envs(agent_env(rec))
        .args(["--xds-address", &format!("https://127.0.0.1:{RELAY_PORT}")])
        .arg("--root-cert")
        .arg(ctx.control.data_dir.join("ca").join("root-cert.pem"))
        .arg("--token-file")
        .arg(&node.token_file)
        .arg("--envoy-binary")
        .arg(&ctx.envoy)
        .arg("--state-dir")
        .arg(&agent_dir)
        .args(["--drain-duration-secs", DRAIN_SECS]);
    spawn_detached(
        cmd,
        &format!("ambit-agent of waypoint pod {}", rec.key()),
        &rec.log,
        &ctx.state.state_dir,
    )
}

/// `<state-dir>/waypoints/<namespace>-<pod>`: the agent's state (SDS
/// socket, bootstrap, ports.json).
pub(super) fn agent_dir(state: &State, rec: &WaypointRecord) -> PathBuf {
    state
        .state_dir
        .join("waypoints")
        .join(format!("{}-{}", rec.pod.namespace, rec.pod.name))
}

/// Stops the agent: SIGTERM to it alone (it drains Envoy, then stops it),
/// SIGKILL to its process group after [`STOP_GRACE`].
pub(super) fn stop_agent(pid: u32) {
    if !process::is_alive(pid) {
        return;
    }
    if let Ok(raw) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), Signal::SIGTERM);
    }
    let deadline = Instant::now() + STOP_GRACE;
    while process::is_alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    // Envoy shares the agent's group; whatever is left goes now.
    process::signal(pid, Signal::SIGKILL);
}

/// Removes what [`make`] made, whatever got made: agent and Envoy (and
/// anything else in the netns), CNI DEL, the netns, the manifest. Every
/// step runs; the first error is returned.
pub(super) fn remove(ctx: &PodContext, rec: &WaypointRecord) -> Result<(), LocalError> {
    let mut first: Option<LocalError> = None;
    let mut note = |r: Result<(), LocalError>| {
        if let Err(e) = r
            && first.is_none()
        {
            first = Some(e);
        }
    };
    if let Some(pid) = rec.agent_pid {
        stop_agent(pid);
    }
    if let Ok(meta) = std::fs::metadata(netns::path(&rec.pod.netns)) {
        use std::os::unix::fs::MetadataExt;
        let inside = process::in_netns(&[(meta.dev(), meta.ino(), rec.pod.netns.clone())]);
        let pids: Vec<u32> = inside.iter().map(|(p, _)| *p).collect();
        let (_, alive) = process::kill_each(&pids, Duration::from_secs(1), Duration::from_secs(5));
        if !alive.is_empty() {
            note(Err(LocalError::Command {
                cmd: format!("stopping waypoint pod {}", rec.key()),
                status: "processes survived SIGKILL".into(),
                stderr: format!("{alive:?} still run in netns {}", rec.pod.netns),
            }));
        }
    }
    if let Some(result) = &rec.pod.cni_result
        && let Some(node) = ctx.state.node(&rec.pod.node)
    {
        let cni_bin = ctx.cni_bin();
        note(cni::read_conflist(&node.conflist).and_then(|list| {
            CniCall {
                node,
                pod: &rec.pod,
                cni_bin: &cni_bin,
            }
            .del(&list, Some(result))
        }));
    }
    if netns::exists(&rec.pod.netns) {
        note(netns::delete(&rec.pod.netns));
    }
    match std::fs::remove_file(&rec.manifest) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => note(Err(LocalError::io(
            "removing a waypoint manifest",
            &rec.manifest,
        )(e))),
    }
    let dir = agent_dir(&ctx.state, rec);
    if dir.exists() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    match first {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
