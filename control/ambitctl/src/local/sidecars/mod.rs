//! Sidecar pods in local mode: a config pod that asks for a sidecar (what
//! `ambit_control::inject::decide` says: namespace `istio-injection:
//! enabled`, or the pod's `sidecar.istio.io/inject: "true"`; never an
//! ambient pod or namespace) or already carries one gets what injection and
//! the kubelet would give it in Kubernetes:
//!
//! ```text
//!  local up                               pod netns <name>-<ns>-<pod>
//!  1. injected Pod YAML ─▶ <state>/generated/sidecar-<ns>-<pod>.yaml
//!     (the control plane serves it over the config dir's pod: labels
//!     security.istio.io/tlsMode, networking.istio.io/tunnel, annotation
//!     sidecar.istio.io/status — ztunnels then reach it over HBONE)
//!  2. netns + CNI ADD, as every pod (not ambient: the node agent leaves it)
//!  3. `ambit-agent redirect`          ─▶ iptables: outbound → 15001, inbound → 15006,
//!                                        gid 1337 and 15008/15020/15021 exempt
//!  4. `ambitctl local relay`          ─▶ 127.0.0.1:15012 in the pod → the control
//!                                        plane's TLS xDS/CA on the host's loopback
//!  5. `setpriv --regid 1337 ambit-agent --kind sidecar` ─▶ Envoy (same group)
//!  6. wait for :15021/healthz/ready in the pod, then the pod's demo app
//! ```
//!
//! The relay and the agent are processes of the cluster's state file (roles
//! `sidecar-relay`, `sidecar`): `local status` shows them, `local down`
//! stops them with the rest, and deleting the netns takes the capture along.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ambit_control::inject::{
    Decision, InjectSettings, apply_patch, decide, injection_patch, is_injected,
};
use k8s_openapi::api::core::v1::{Container, Pod as KubePod, PodSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Serialize;
use serde_json::Value;

use super::process::{self, wait_until};
use super::state::{PodState, Role, State};
use super::up::Builder;
use super::waypoints::{RELAY_PORT, STATUS_PORT, probe};
use super::{LocalError, netns};
use crate::config::{Labels, Pod};

mod relay;

pub use relay::{RelayOptions, run_relay};

/// The group the agent and Envoy run with: the capture lets it through.
pub const PROXY_GID: u32 = 1337;
/// What injection adds to the pod's labels (Istio's): peers' Envoys reach
/// it over mTLS, ztunnels over HBONE to its Envoy's 15008.
pub const INJECTED_LABELS: [(&str, &str); 2] = [
    ("security.istio.io/tlsMode", "istio"),
    ("networking.istio.io/tunnel", "http"),
];
/// Bound on `ambit-agent redirect` (it bounds each iptables call at 10 s).
const CAPTURE_LIMIT: Duration = Duration::from_secs(30);
/// Envoy's drain on a stop.
const DRAIN_SECS: &str = "1";

/// Whether local mode runs a sidecar for `pod` in a namespace labelled
/// `ns_labels`: injection would give it one, or it has one already.
pub fn wants_sidecar(pod: &Pod, ns_labels: &Labels) -> bool {
    let k = kube_pod(pod);
    is_injected(&k) || decide(&k, ns_labels) == Decision::Inject
}

/// What `decide` and `is_injected` look at, as a Kubernetes pod.
fn kube_pod(pod: &Pod) -> KubePod {
    let m = &pod.metadata;
    KubePod {
        metadata: ObjectMeta {
            name: Some(m.name.clone()),
            namespace: Some(m.namespace.clone()),
            labels: Some(m.labels.clone()),
            annotations: Some(m.annotations.clone()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            host_network: Some(pod.spec.host_network),
            containers: pod
                .spec
                .containers
                .iter()
                .map(|c| Container {
                    name: c.name.clone(),
                    ..Container::default()
                })
                .collect(),
            ..PodSpec::default()
        }),
        status: None,
    }
}

/// The injected YAML of pod `namespace/name` of `file` (the webhook's patch
/// applied, as the API server would store it), or `None` when the pod is
/// injected already.
pub fn injected_manifest(
    file: &Path,
    namespace: &str,
    name: &str,
    ns_labels: &Labels,
) -> Result<Option<String>, LocalError> {
    let text = std::fs::read_to_string(file).map_err(LocalError::io("reading config", file))?;
    let fail = |why: String| LocalError::Plan {
        dir: file.to_path_buf(),
        why: format!("injecting a sidecar into pod {namespace}/{name}: {why}"),
    };
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).map_err(|e| fail(e.to_string()))?;
    let mut doc = docs
        .into_iter()
        .find(|d| {
            d["kind"].as_str() == Some("Pod")
                && d["metadata"]["name"].as_str() == Some(name)
                && d["metadata"]["namespace"].as_str().unwrap_or("default") == namespace
        })
        .ok_or_else(|| fail(format!("no Pod document in {}", file.display())))?;
    let typed: KubePod = serde_json::from_value(doc.clone()).map_err(|e| fail(e.to_string()))?;
    if decide(&typed, ns_labels) != Decision::Inject {
        return Ok(None);
    }
    let settings = InjectSettings {
        proxy_image: "ambit-local (ambit-agent and Envoy run from the host)".into(),
        xds_address: format!("https://127.0.0.1:{RELAY_PORT}"),
        ..InjectSettings::default()
    };
    let ops = injection_patch(&typed, &settings).map_err(|e| fail(e.to_string()))?;
    apply_patch(&mut doc, &ops).map_err(|e| fail(e.to_string()))?;
    doc["metadata"]["namespace"] = Value::String(namespace.to_string());
    let yaml = serde_saphyr::to_string(&doc).map_err(|e| fail(e.to_string()))?;
    Ok(Some(format!(
        "# Written by `ambitctl local` from {}: pod {namespace}/{name} with its sidecar injected,\n\
         # served instead of the config's version. Removed with the cluster. Do not edit.\n{yaml}",
        file.display()
    )))
}

/// `<state-dir>/sidecars/<namespace>-<pod>`: the agent's state (SDS
/// socket, bootstrap, ports.json).
pub fn agent_dir(state: &State, pod: &PodState) -> PathBuf {
    state
        .state_dir
        .join("sidecars")
        .join(format!("{}-{}", pod.namespace, pod.name))
}

/// `<state-dir>/generated/sidecar-<namespace>-<pod>.yaml`.
pub fn manifest_path(state: &State, namespace: &str, name: &str) -> PathBuf {
    state
        .generated_dir()
        .join(format!("sidecar-{namespace}-{name}.yaml"))
}

/// Runs `ambit-agent redirect` in the pod's netns; bounded.
fn install_capture(
    bin: &Path,
    pod: &PodState,
    log: &Path,
    state_dir: &Path,
) -> Result<(), LocalError> {
    let what = format!(
        "the sidecar capture (`ambit-agent redirect`) of pod {}",
        pod.key()
    );
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &pod.netns])
        .arg(bin)
        .arg("redirect");
    let mut child = process::spawn_detached(cmd, &what, log, state_dir)?;
    let deadline = Instant::now() + CAPTURE_LIMIT;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => {
                return Err(LocalError::Command {
                    cmd: what,
                    status: status.to_string(),
                    stderr: format!("see {}:\n{}", log.display(), process::log_tail(log, 10)),
                });
            }
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(LocalError::Timeout {
                    what,
                    secs: CAPTURE_LIMIT.as_secs(),
                    log: log.to_path_buf(),
                    tail: process::log_tail(log, 10),
                });
            }
            Err(e) => return Err(LocalError::io(format!("waiting for {what}"), log)(e)),
        }
    }
}

impl Builder {
    /// Writes the injected manifest of every sidecar pod that needs one
    /// into the generated dir (before the control plane starts, so its
    /// first snapshot already has them injected).
    pub(super) fn sidecar_manifests(&mut self) -> Result<(), LocalError> {
        for p in self.plan.pods.clone().iter().filter(|p| p.sidecar) {
            let ns_labels = self
                .plan
                .namespace_labels
                .get(&p.namespace)
                .cloned()
                .unwrap_or_default();
            let Some(yaml) = injected_manifest(&p.file, &p.namespace, &p.name, &ns_labels)? else {
                continue;
            };
            let path = manifest_path(&self.state, &p.namespace, &p.name);
            std::fs::write(&path, yaml)
                .map_err(LocalError::io("writing a sidecar pod's manifest", &path))?;
        }
        Ok(())
    }

    /// Capture, relay and agent (with Envoy) of every sidecar pod, then
    /// waits until each agent says ready.
    pub(super) fn sidecars(&mut self) -> Result<(), LocalError> {
        let pods: Vec<PodState> = self
            .state
            .pods
            .iter()
            .filter(|p| p.sidecar)
            .cloned()
            .collect();
        if pods.is_empty() {
            return Ok(());
        }
        let control = self
            .state
            .control
            .clone()
            .ok_or_else(|| LocalError::Command {
                cmd: "starting sidecars".into(),
                status: "not started".into(),
                stderr: "no control plane".into(),
            })?;
        let envoy = self
            .state
            .envoy
            .clone()
            .ok_or_else(|| LocalError::MissingEnvoy {
                needs: format!("has sidecar pods ({})", keys(&pods)),
            })?;
        let mut waits = Vec::new();
        for pod in pods {
            let log = self
                .state
                .log_dir()
                .join(format!("sidecar-{}-{}.log", pod.namespace, pod.name));
            install_capture(&self.bin("ambit-agent"), &pod, &log, &self.state.state_dir)?;
            let key = pod.key();
            let relay = vec![
                self.bin(super::CONTROLLER_BINARY).display().to_string(),
                "local".into(),
                "relay".into(),
                "--name".into(),
                self.state.name.clone(),
                "--state-dir".into(),
                self.state.state_dir.display().to_string(),
                "--netns".into(),
                pod.netns.clone(),
                "--listen-port".into(),
                RELAY_PORT.to_string(),
                "--to".into(),
                control.xds_tls_addr.to_string(),
            ];
            let relay_log = self
                .state
                .log_dir()
                .join(format!("sidecar-relay-{}-{}.log", pod.namespace, pod.name));
            let relay_pid = self.spawn(
                Role::SidecarRelay,
                Some(&pod.node),
                Some(&key),
                relay,
                relay_log.clone(),
            )?;
            wait_until(
                &format!(
                    "the relay of sidecar pod {key} to listen on 127.0.0.1:{RELAY_PORT} in its netns"
                ),
                Some(relay_pid),
                &relay_log,
                self.timeout,
                || netns::listening_ports(&pod.netns).contains(&RELAY_PORT),
            )?;
            let agent = self.agent_command(&pod, &envoy, &control.data_dir)?;
            let pid = self.spawn(
                Role::Sidecar,
                Some(&pod.node),
                Some(&key),
                agent,
                log.clone(),
            )?;
            waits.push((pod, pid, log));
        }
        for (pod, pid, log) in waits {
            let mut last = String::from("no answer yet");
            let ready = wait_until(
                &format!(
                    "the sidecar of pod {} (ambit-agent + Envoy) to be ready on :{STATUS_PORT}/healthz/ready in its netns",
                    pod.key()
                ),
                Some(pid),
                &log,
                self.timeout,
                || {
                    let (ok, answer) = probe::readiness(&pod.netns);
                    last = answer;
                    ok
                },
            );
            if let Err(LocalError::Timeout {
                what,
                secs,
                log,
                tail,
            }) = ready
            {
                return Err(LocalError::Timeout {
                    what: format!("{what}; last answer: {last}"),
                    secs,
                    log,
                    tail,
                });
            }
            ready?;
        }
        Ok(())
    }

    /// `ip netns exec <pod> setpriv --regid 1337 ambit-agent --kind sidecar ...`.
    fn agent_command(
        &self,
        pod: &PodState,
        envoy: &Path,
        control_data: &Path,
    ) -> Result<Vec<String>, LocalError> {
        let node = self.state.node(&pod.node).ok_or_else(|| LocalError::Plan {
            dir: self.state.config_dir.clone(),
            why: format!("pod {} is on unknown node {}", pod.key(), pod.node),
        })?;
        let mut labels: BTreeMap<String, String> = self
            .plan
            .pods
            .iter()
            .find(|p| p.namespace == pod.namespace && p.name == pod.name)
            .map(|p| p.labels.clone())
            .unwrap_or_default();
        for (k, v) in INJECTED_LABELS {
            labels.entry(k.to_string()).or_insert_with(|| v.to_string());
        }
        let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let dir = agent_dir(&self.state, pod);
        let mut cmd = vec![
            "ip".to_string(),
            "netns".into(),
            "exec".into(),
            pod.netns.clone(),
            "setpriv".into(),
            "--regid".into(),
            PROXY_GID.to_string(),
            "--clear-groups".into(),
            self.bin("ambit-agent").display().to_string(),
            "--kind".into(),
            "sidecar".into(),
            "--namespace".into(),
            pod.namespace.clone(),
            "--service-account".into(),
            pod.service_account.clone(),
            "--pod-name".into(),
            pod.name.clone(),
            "--pod-ip".into(),
            pod.ip.to_string(),
            "--node-name".into(),
            pod.node.clone(),
            "--xds-address".into(),
            format!("https://127.0.0.1:{RELAY_PORT}"),
            "--root-cert".into(),
            control_data
                .join("ca")
                .join("root-cert.pem")
                .display()
                .to_string(),
            "--token-file".into(),
            node.token_file.display().to_string(),
            "--envoy-binary".into(),
            envoy.display().to_string(),
            "--envoy-concurrency".into(),
            "1".into(),
            "--state-dir".into(),
            dir.display().to_string(),
            "--drain-duration-secs".into(),
            DRAIN_SECS.into(),
        ];
        if !labels.is_empty() {
            cmd.push("--labels".into());
            cmd.push(labels.join(","));
        }
        Ok(cmd)
    }
}

fn keys(pods: &[PodState]) -> String {
    pods.iter()
        .map(PodState::key)
        .collect::<Vec<_>>()
        .join(", ")
}

/// One sidecar pod as `local status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct SidecarStatus {
    /// `namespace/name`.
    pub pod: String,
    pub node: String,
    pub ip: std::net::Ipv4Addr,
    /// `ambit-agent` (Envoy runs in its process group).
    pub agent_pid: Option<u32>,
    pub agent_running: bool,
    /// The relay to the control plane.
    pub relay_running: bool,
    /// The agent's `/healthz/ready` said 200.
    pub ready: bool,
    /// Its answer otherwise, or why it could not be asked.
    pub readiness: String,
    pub log: Option<PathBuf>,
}

/// Every sidecar pod of the cluster.
pub fn collect(state: &State) -> Vec<SidecarStatus> {
    state
        .pods
        .iter()
        .filter(|p| p.sidecar)
        .map(|p| {
            let key = p.key();
            let agent = state.process(Role::Sidecar, Some(&key));
            let agent_running = agent.is_some_and(|a| process::is_alive(a.pid));
            let relay_running = state
                .process(Role::SidecarRelay, Some(&key))
                .is_some_and(|r| process::is_alive(r.pid));
            let (ready, readiness) = if agent_running {
                probe::readiness(&p.netns)
            } else {
                (false, "agent not running".into())
            };
            SidecarStatus {
                pod: key,
                node: p.node.clone(),
                ip: p.ip,
                agent_pid: agent.map(|a| a.pid),
                agent_running,
                relay_running,
                ready,
                readiness,
                log: agent.map(|a| a.log.clone()),
            }
        })
        .collect()
}
