//! The waypoint controller (`ambitctl local waypoint-controller`, started
//! by `local up` as a background process of the cluster): polls the
//! config dir, starts a waypoint pod per waypoint Gateway, stops the pods
//! of removed Gateways, restarts an agent that exited, and keeps
//! `waypoints.json` current. It ends when the cluster's state file is
//! gone; SIGTERM ends it at once (its pods keep running: `local down`
//! stops them, a new controller adopts them).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use super::pod::{self, PodContext, Running};
use super::relay::Relay;
use super::{
    GatewayKey, RELAY_PORT, Wanted, WaypointPhase, WaypointRecord, WaypointTable, find_envoy,
    place, wanted,
};
use crate::config::{ConfigDir, config_files};
use crate::local::state::{PodState, State};
use crate::local::{LocalError, process};

/// What the controller runs for.
#[derive(Debug, Clone)]
pub struct ControllerOptions {
    pub name: String,
    pub state_dir: PathBuf,
    /// How often the config dir is checked (a change is read once two
    /// checks agree).
    pub poll: Duration,
    /// Bound on each wait while making a pod.
    pub timeout: Duration,
}

/// Backoff of failed starts and agent restarts.
const BACKOFF_FIRST: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// (modified, length) per config file: a cheap change detector.
type Signature = BTreeMap<PathBuf, (Option<SystemTime>, u64)>;

fn signature(dir: &Path) -> Signature {
    config_files(dir)
        .into_iter()
        .map(|p| {
            let meta = std::fs::metadata(&p).ok();
            let stamp = (
                meta.as_ref().and_then(|m| m.modified().ok()),
                meta.map_or(0, |m| m.len()),
            );
            (p, stamp)
        })
        .collect()
}

fn log(msg: &str) {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    println!("{}.{:03} {msg}", now.as_secs(), now.subsec_millis());
}

fn random_hex(bytes: usize) -> String {
    (0..bytes)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect()
}

struct Controller {
    ctx: PodContext,
    envoy_found: bool,
    reader: ConfigDir,
    /// The signature last seen, and the one the reader reflects.
    seen: Signature,
    read: Option<Signature>,
    wanted: Wanted,
    table: WaypointTable,
    running: HashMap<GatewayKey, Running>,
    /// Relays of pods adopted from an earlier controller (no agent handle).
    adopted: HashMap<GatewayKey, Relay>,
    /// Next attempt (start or agent restart) per Gateway, and the delay after it.
    backoff: HashMap<GatewayKey, (Instant, Duration)>,
}

/// Runs the controller of cluster `opts.name` until its state file is gone.
pub fn run_controller(opts: &ControllerOptions) -> Result<(), LocalError> {
    let state = State::load(&opts.name, &opts.state_dir)?;
    let control = state.control.clone().ok_or_else(|| LocalError::Command {
        cmd: "waypoint-controller".into(),
        status: "not started".into(),
        stderr: "the cluster has no control plane yet".into(),
    })?;
    let envoy = state.envoy.clone().or_else(find_envoy);
    let reader = ConfigDir::new(state.config_dir.clone());
    let table = WaypointTable::load(&state.state_dir);
    let mut c = Controller {
        envoy_found: envoy.is_some(),
        ctx: PodContext {
            state,
            control,
            envoy: envoy.unwrap_or_else(|| PathBuf::from("envoy")),
            timeout: opts.timeout,
        },
        reader,
        seen: Signature::new(),
        read: None,
        wanted: Wanted::new(),
        table,
        running: HashMap::new(),
        adopted: HashMap::new(),
        backoff: HashMap::new(),
    };
    log(&format!(
        "waypoint controller of cluster {} watching {}",
        opts.name,
        c.ctx.state.config_dir.display()
    ));
    c.adopt();
    let state_file = State::path(&opts.state_dir);
    loop {
        if !state_file.exists() {
            log("the cluster's state file is gone; stopping");
            return Ok(());
        }
        let before = c.table.clone();
        c.read_config();
        c.reconcile();
        c.supervise();
        if c.table != before
            && let Err(e) = c.table.save(&c.ctx.state.state_dir)
        {
            log(&format!("cannot save the waypoint table: {e}"));
        }
        std::thread::sleep(opts.poll);
    }
}

impl Controller {
    /// Pods an earlier controller made: their relays died with it.
    fn adopt(&mut self) {
        for rec in &self.table.waypoints {
            let relay = Relay::start(
                &rec.pod.netns,
                std::net::SocketAddr::from(([127, 0, 0, 1], RELAY_PORT)),
                self.ctx.control.xds_tls_addr,
            );
            match relay {
                Ok(r) => {
                    self.adopted.insert(rec.gateway.clone(), r);
                    log(&format!("adopted waypoint pod {}", rec.key()));
                }
                Err(e) => log(&format!(
                    "waypoint pod {}: cannot relay to the control plane: {e}",
                    rec.key()
                )),
            }
        }
    }

    /// Reads the config dir once it changed and settled (two polls agree).
    fn read_config(&mut self) {
        let root = self.reader.root().to_path_buf();
        let now = signature(&root);
        let settled = now == self.seen;
        self.seen = now.clone();
        if self.read.as_ref() == Some(&now) || (self.read.is_some() && !settled) {
            return;
        }
        self.reader.rescan();
        self.read = Some(now);
        let wanted = wanted(self.reader.objects());
        if wanted != self.wanted {
            let names: Vec<String> = wanted.keys().map(ToString::to_string).collect();
            log(&format!(
                "waypoint Gateways in the config: [{}]",
                names.join(", ")
            ));
        }
        self.wanted = wanted;
        self.table.synced = true;
    }

    fn due(&self, key: &GatewayKey) -> bool {
        self.backoff
            .get(key)
            .is_none_or(|(at, _)| Instant::now() >= *at)
    }

    fn back_off(&mut self, key: &GatewayKey) -> Duration {
        let delay = self
            .backoff
            .get(key)
            .map_or(BACKOFF_FIRST, |(_, d)| (*d * 2).min(BACKOFF_MAX));
        self.backoff
            .insert(key.clone(), (Instant::now() + delay, delay));
        delay
    }

    fn reconcile(&mut self) {
        if self.read.is_none() {
            return;
        }
        // Gone from the config (or no longer runnable): stop.
        let stale: Vec<WaypointRecord> = self
            .table
            .waypoints
            .iter()
            .filter(|w| !matches!(self.wanted.get(&w.gateway), Some(Ok(()))))
            .cloned()
            .collect();
        for rec in stale {
            self.stop(&rec);
        }
        self.table
            .skipped
            .retain(|k, _| self.wanted.keys().any(|w| w.to_string() == *k));
        let wanted: Vec<(GatewayKey, Result<(), String>)> = self
            .wanted
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (key, ok) in wanted {
            if let Err(why) = ok {
                self.table.skipped.insert(key.to_string(), why);
                continue;
            }
            if self.table.get(&key).is_some() || !self.due(&key) {
                continue;
            }
            self.start(&key);
        }
    }

    fn start(&mut self, key: &GatewayKey) {
        if !self.envoy_found {
            if let Some(e) = find_envoy() {
                self.ctx.envoy = e;
                self.envoy_found = true;
            } else {
                self.table.skipped.insert(
                    key.to_string(),
                    format!("Envoy not found; {}", super::ENVOY_HINT),
                );
                self.back_off(key);
                return;
            }
        }
        let (node, ip) = match place(&self.ctx.state, &self.table, key) {
            Ok(p) => p,
            Err(why) => {
                self.table.skipped.insert(key.to_string(), why);
                self.back_off(key);
                return;
            }
        };
        let name = format!("{}-0", key.name);
        let pod_key = format!("{}/{name}", key.namespace);
        if self.ctx.state.pods.iter().any(|p| p.key() == pod_key) {
            self.table.skipped.insert(
                key.to_string(),
                format!("the config already has a pod {pod_key}; rename it or the Gateway"),
            );
            self.back_off(key);
            return;
        }
        let h = random_hex(16);
        let state = &self.ctx.state;
        let pod = PodState {
            netns: format!("{}-{}-{name}", state.name, key.namespace),
            namespace: key.namespace.clone(),
            name: name.clone(),
            node,
            ip,
            uid: format!(
                "{}-{}-{}-{}-{}",
                &h[0..8],
                &h[8..12],
                &h[12..16],
                &h[16..20],
                &h[20..32]
            ),
            container_id: random_hex(32),
            service_account: key.name.clone(),
            ambient: false,
            sidecar: false,
            app: None,
            cni_result: None,
        };
        let mut rec = WaypointRecord {
            gateway: key.clone(),
            log: state
                .log_dir()
                .join(format!("waypoint-{}-{name}.log", key.namespace)),
            manifest: state
                .generated_dir()
                .join(format!("waypoint-{}-{name}.yaml", key.namespace)),
            pod,
            phase: WaypointPhase::Starting,
            agent_pid: None,
            restarts: 0,
            error: None,
        };
        log(&format!(
            "starting waypoint pod {} for Gateway {key} on node {} ({})",
            rec.key(),
            rec.pod.node,
            rec.pod.ip
        ));
        // Recorded before anything is made, so `down` finds it after a crash.
        self.table.waypoints.push(rec.clone());
        if let Err(e) = self.table.save(&self.ctx.state.state_dir) {
            log(&format!("cannot save the waypoint table: {e}"));
        }
        let made = pod::make(&self.ctx, &mut rec);
        match made {
            Ok(running) => {
                rec.phase = WaypointPhase::Running;
                self.table.skipped.remove(&key.to_string());
                self.backoff.remove(key);
                self.running.insert(key.clone(), running);
                self.replace(rec);
                log(&format!("waypoint pod of Gateway {key} started"));
            }
            Err(e) => {
                let _ = pod::remove(&self.ctx, &rec);
                self.table.waypoints.retain(|w| w.gateway != *key);
                self.table.release(rec.pod.ip);
                let delay = self.back_off(key);
                let why = format!(
                    "starting its pod failed: {e}; retrying in {} s (log: {})",
                    delay.as_secs(),
                    rec.log.display()
                );
                log(&format!("Gateway {key}: {why}"));
                self.table.skipped.insert(key.to_string(), why);
            }
        }
    }

    fn replace(&mut self, rec: WaypointRecord) {
        match self
            .table
            .waypoints
            .iter_mut()
            .find(|w| w.gateway == rec.gateway)
        {
            Some(slot) => *slot = rec,
            None => self.table.waypoints.push(rec),
        }
    }

    fn stop(&mut self, rec: &WaypointRecord) {
        log(&format!(
            "stopping waypoint pod {} (Gateway {} left the config)",
            rec.key(),
            rec.gateway
        ));
        if let Err(e) = pod::remove(&self.ctx, rec) {
            log(&format!("stopping waypoint pod {}: {e}", rec.key()));
        }
        if let Some(mut r) = self.running.remove(&rec.gateway) {
            let _ = r.agent.try_wait();
        }
        self.adopted.remove(&rec.gateway);
        self.backoff.remove(&rec.gateway);
        self.table.waypoints.retain(|w| w.gateway != rec.gateway);
        self.table.release(rec.pod.ip);
    }

    /// Restarts agents that exited (the agent exits when Envoy does), with
    /// backoff; reaps them.
    fn supervise(&mut self) {
        let records: Vec<WaypointRecord> = self.table.waypoints.clone();
        for mut rec in records {
            if let Some(r) = self.running.get_mut(&rec.gateway) {
                let _ = r.agent.try_wait();
            }
            let alive = rec.agent_pid.is_some_and(process::is_alive);
            if alive || !self.due(&rec.gateway) {
                continue;
            }
            let delay = self.back_off(&rec.gateway);
            match pod::spawn_agent(&self.ctx, &rec) {
                Ok(child) => {
                    rec.agent_pid = Some(child.id());
                    rec.restarts += 1;
                    rec.error = Some(format!(
                        "agent exited; restarted (restart {}, next backoff {} s)",
                        rec.restarts,
                        delay.as_secs()
                    ));
                    log(&format!(
                        "waypoint pod {}: {}",
                        rec.key(),
                        rec.error.as_deref().unwrap_or("")
                    ));
                    if let Some(r) = self.running.get_mut(&rec.gateway) {
                        r.agent = child;
                    } else if let Some(relay) = self.adopted.remove(&rec.gateway) {
                        self.running.insert(
                            rec.gateway.clone(),
                            Running {
                                _relay: relay,
                                agent: child,
                            },
                        );
                    }
                }
                Err(e) => {
                    rec.error = Some(format!("restarting the agent failed: {e}"));
                    log(&format!("waypoint pod {}: {e}", rec.key()));
                }
            }
            self.replace(rec);
        }
    }
}
