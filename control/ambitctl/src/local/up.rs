//! `local up`: prerequisites, plan, state file, topology, control plane,
//! node agents and ztunnels, pods through CNI (demo apps and the last
//! readiness checks are in `apps.rs`).

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use super::cni::{self, AMBIT_PLUGIN, CniCall, PLUGINS, REFERENCE_PLUGINS};
use super::plan::{Plan, plan_dir};
use super::prereq::prerequisites;
use super::process::{self, free_addr, spawn_detached, wait_until};
use super::state::{ControlState, NodeState, Phase, PodState, ProcRecord, Role, State};
use super::waypoints::find_envoy;
use super::{DownOptions, LocalCluster, LocalError, UpOptions, check_name, down, netns};

/// Longest unix socket path (`sun_path` is 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// How often a child that lost a picked port to another process is started
/// again on fresh ports.
const PORT_TRIES: usize = 3;

pub(super) fn up(opts: &UpOptions) -> Result<LocalCluster, LocalError> {
    check_name(&opts.name)?;
    let state_dir = absolute(&opts.state_dir_or_default())?;
    let bin_dir = absolute(&opts.bin_dir)?;
    prerequisites(&bin_dir)?;
    let config_dir = absolute(&opts.config_dir)?;
    let plan = plan_dir(&config_dir)?;
    let envoy = opts.envoy.clone().or_else(find_envoy);
    if envoy.is_none() {
        let gateways: Vec<String> = plan.waypoints.iter().map(ToString::to_string).collect();
        let sidecars: Vec<String> = plan
            .pods
            .iter()
            .filter(|p| p.sidecar)
            .map(|p| p.key())
            .collect();
        let mut needs = Vec::new();
        if !gateways.is_empty() {
            needs.push(format!(
                "declares waypoint Gateways ({})",
                gateways.join(", ")
            ));
        }
        if !sidecars.is_empty() {
            needs.push(format!(
                "has pods that ask for a sidecar ({})",
                sidecars.join(", ")
            ));
        }
        if !needs.is_empty() {
            return Err(LocalError::MissingEnvoy {
                needs: needs.join(" and "),
            });
        }
    }

    // Never touch an existing cluster: refuse before claiming anything.
    if State::path(&state_dir).exists() {
        return Err(LocalError::Exists {
            name: opts.name.clone(),
            state_dir,
        });
    }
    let prefix = format!("{}-", opts.name);
    let left: Vec<String> = netns::list()
        .into_iter()
        .filter(|n| n.starts_with(&prefix))
        .collect();
    if !left.is_empty() {
        return Err(LocalError::Leftovers {
            name: opts.name.clone(),
            what: format!("network namespaces {}", left.join(", ")),
        });
    }
    if let Some(parent) = state_dir.parent() {
        std::fs::create_dir_all(parent)
            .map_err(LocalError::io("creating the state directory", parent))?;
    }
    match std::fs::create_dir(&state_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let empty = std::fs::read_dir(&state_dir)
                .map_err(LocalError::io("reading the state directory", &state_dir))?
                .next()
                .is_none();
            if !empty {
                return Err(LocalError::Exists {
                    name: opts.name.clone(),
                    state_dir,
                });
            }
        }
        Err(e) => {
            return Err(LocalError::io("creating the state directory", &state_dir)(
                e,
            ));
        }
    }

    // Claim the cluster: of two concurrent `up`s of one name, one wins here.
    let state_file = State::path(&state_dir);
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&state_file)
    {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(LocalError::Exists {
                name: opts.name.clone(),
                state_dir,
            });
        }
        Err(e) => return Err(LocalError::io("creating the state file", &state_file)(e)),
    }

    // The config the mesh serves: a working copy in the state dir, so edits
    // never touch the files `up` was given (a checkout's tracked demo).
    let (config_dir, source_dir) = if opts.working_copy {
        let copy = state_dir.join(super::WORKING_COPY_DIR);
        if let Err(e) = super::workcopy::copy_config(&config_dir, &copy) {
            let _ = std::fs::remove_dir_all(&state_dir);
            return Err(e);
        }
        (copy, Some(config_dir))
    } else {
        (config_dir, None)
    };
    let mut b = Builder {
        plan,
        state: State {
            name: opts.name.clone(),
            state_dir: state_dir.clone(),
            config_dir,
            source_dir,
            bin_dir,
            phase: Phase::Starting,
            started_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            control: None,
            netns: Vec::new(),
            processes: Vec::new(),
            nodes: Vec::new(),
            pods: Vec::new(),
            envoy,
        },
        children: Vec::new(),
        timeout: opts.timeout,
    };
    match b.build() {
        Ok(()) => Ok(LocalCluster::from_parts(b.state, b.children)),
        Err(e) => {
            b.state.phase = Phase::Failed;
            let _ = b.state.save();
            let cleanup = if opts.keep_on_failure {
                format!(
                    "Left as it is for inspection (--keep-on-failure): logs in {}; remove it with `ambitctl local down --name {}`.",
                    b.state.log_dir().display(),
                    opts.name
                )
            } else {
                let report = down(&DownOptions {
                    state_dir: Some(state_dir),
                    ..DownOptions::new(opts.name.clone())
                });
                for mut c in b.children {
                    let _ = c.try_wait();
                }
                match report {
                    Ok(_) => "Everything it started was removed (pass --keep-on-failure to keep it for inspection).".to_string(),
                    Err(d) => format!("Cleaning up failed too: {d}"),
                }
            };
            Err(LocalError::Up {
                name: opts.name.clone(),
                source: Box::new(e),
                cleanup,
            })
        }
    }
}

fn absolute(p: &Path) -> Result<PathBuf, LocalError> {
    std::path::absolute(p).map_err(LocalError::io("resolving the path", p))
}

fn mkdir(p: &Path) -> Result<(), LocalError> {
    std::fs::create_dir_all(p).map_err(LocalError::io("creating a directory", p))
}

fn write(p: &Path, text: &str) -> Result<(), LocalError> {
    std::fs::write(p, text).map_err(LocalError::io("writing a file", p))
}

/// Writes a file only root can read (bootstrap tokens).
fn write_secret(p: &Path, text: &str) -> Result<(), LocalError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(p)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(LocalError::io("writing a token file", p))
}

fn random_hex(bytes: usize) -> String {
    (0..bytes)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect()
}

pub(super) struct Builder {
    pub(super) plan: Plan,
    pub(super) state: State,
    pub(super) children: Vec<Child>,
    pub(super) timeout: Duration,
}

impl Builder {
    fn dir(&self) -> &Path {
        &self.state.state_dir
    }

    pub(super) fn bin(&self, name: &str) -> PathBuf {
        self.state.bin_dir.join(name)
    }

    fn build(&mut self) -> Result<(), LocalError> {
        self.state.save()?;
        mkdir(&self.state.log_dir())?;
        mkdir(&self.state.generated_dir())?;
        let cni_bin = self.dir().join("cni-bin");
        mkdir(&cni_bin)?;
        for p in PLUGINS {
            let link = cni_bin.join(p);
            symlink(Path::new(REFERENCE_PLUGINS).join(p), &link)
                .map_err(LocalError::io("linking a CNI plugin", &link))?;
        }
        self.plan_nodes()?;
        self.sidecar_manifests()?;
        self.topology()?;
        let mut tries = 0;
        loop {
            match self.control() {
                Err(e) if process::is_port_clash(&e) && tries < PORT_TRIES => {
                    tries += 1;
                    self.forget_exited(&e)?;
                }
                r => break r?,
            }
        }
        self.node_processes()?;
        self.pods(&cni_bin)?;
        // Waypoints before the apps, so no app's first call finds a
        // waypoint-bound service without its waypoint.
        self.waypoint_controller()?;
        // Sidecars before the apps, as their proxy starts before a pod's
        // app in Kubernetes: an app's first call is already captured.
        self.sidecars()?;
        self.apps()?;
        self.certificates()?;
        self.state.phase = Phase::Ready;
        self.state.save()
    }

    /// Node records (paths, ports) before anything is made.
    fn plan_nodes(&mut self) -> Result<(), LocalError> {
        for n in &self.plan.nodes {
            let dir = self.state.state_dir.join("nodes").join(&n.name);
            let node = NodeState {
                name: n.name.clone(),
                netns: format!("{}-{}", self.state.name, n.name),
                lan_ip: n.lan_ip,
                subnet: n.subnet_cidr(),
                gateway: n.gateway,
                conflist: dir.join("net.d").join("10-ambit.conflist"),
                cni_socket: dir.join("cni.sock"),
                zds_socket: dir.join("zds.sock"),
                agent_dir: dir.join("agent"),
                token_file: dir.join("token"),
                admin_addr: free_addr()?,
                stats_addr: free_addr()?,
                readiness_addr: free_addr()?,
                dir,
            };
            for s in [&node.cni_socket, &node.zds_socket] {
                if s.as_os_str().len() > MAX_SOCKET_PATH {
                    return Err(LocalError::Plan {
                        dir: self.state.config_dir.clone(),
                        why: format!(
                            "the socket path {} is longer than {MAX_SOCKET_PATH} bytes; pass a shorter --state-dir",
                            s.display()
                        ),
                    });
                }
            }
            mkdir(&node.dir.join("net.d"))?;
            mkdir(&node.agent_dir)?;
            self.state.nodes.push(node);
        }
        self.state.save()
    }

    fn add_netns(&mut self, name: &str) -> Result<(), LocalError> {
        self.state.netns.push(name.to_string());
        self.state.save()?;
        netns::add(name)
    }

    fn topology(&mut self) -> Result<(), LocalError> {
        let lan = format!("{}-lan", self.state.name);
        self.add_netns(&lan)?;
        netns::make_lan(&lan)?;
        let plan = self.plan.clone();
        for (n, node) in plan.nodes.iter().zip(self.state.nodes.clone()) {
            self.add_netns(&node.netns)?;
            netns::make_node(&lan, &node.netns, n)?;
        }
        for (i, node) in self.state.nodes.iter().enumerate() {
            for other in plan.nodes.iter().filter(|o| o.index != i) {
                netns::route_to(&node.netns, other)?;
            }
        }
        Ok(())
    }

    pub(super) fn spawn(
        &mut self,
        role: Role,
        node: Option<&str>,
        pod: Option<&str>,
        cmd: Vec<String>,
        log: PathBuf,
    ) -> Result<u32, LocalError> {
        let what = match (node, pod) {
            (_, Some(p)) => format!("{} of pod {p}", role.as_str()),
            (Some(n), None) => format!("{} of node {n}", role.as_str()),
            _ => role.as_str().to_string(),
        };
        let (program, args) = cmd.split_first().ok_or_else(|| LocalError::Command {
            cmd: what.clone(),
            status: "not run".into(),
            stderr: "empty command".into(),
        })?;
        let mut c = Command::new(program);
        c.args(args);
        let child = spawn_detached(c, &what, &log, &self.state.state_dir)?;
        let pid = child.id();
        self.children.push(child);
        self.state.processes.push(ProcRecord {
            role,
            node: node.map(str::to_string),
            pod: pod.map(str::to_string),
            pid,
            log,
            command: cmd,
        });
        self.state.save()?;
        Ok(pid)
    }

    fn control(&mut self) -> Result<(), LocalError> {
        let data_dir = self.dir().join("control");
        let tokens = self.dir().join("node-tokens");
        let mut lines = String::new();
        for n in &self.state.nodes {
            let token = random_hex(16);
            // No trailing newline, like a Kubernetes projected token: a client
            // that sends the file verbatim as a header value must work too.
            write_secret(&n.token_file, &token)?;
            lines.push_str(&format!("{token} {}\n", n.name));
        }
        write_secret(&tokens, &lines)?;
        let cs = ControlState {
            xds_plaintext_addr: free_addr()?,
            xds_tls_addr: free_addr()?,
            monitoring_addr: free_addr()?,
            data_dir: data_dir.clone(),
            node_tokens_file: tokens.clone(),
        };
        let cmd = vec![
            self.bin("ambit-control").display().to_string(),
            "--config-dir".into(),
            self.state.config_dir.display().to_string(),
            "--extra-config-dir".into(),
            self.state.generated_dir().display().to_string(),
            "--data-dir".into(),
            data_dir.display().to_string(),
            "--node-tokens-file".into(),
            tokens.display().to_string(),
            "--xds-plaintext-addr".into(),
            cs.xds_plaintext_addr.to_string(),
            "--xds-tls-addr".into(),
            cs.xds_tls_addr.to_string(),
            "--tls-names".into(),
            "127.0.0.1,localhost".into(),
            "--monitoring-addr".into(),
            cs.monitoring_addr.to_string(),
        ];
        let monitoring = cs.monitoring_addr;
        self.state.control = Some(cs);
        let log = self.state.log_dir().join("control.log");
        let pid = self.spawn(Role::Control, None, None, cmd, log.clone())?;
        let root = data_dir.join("ca").join("root-cert.pem");
        wait_until(
            &format!("ambit-control to be ready (http://{monitoring}/ready)"),
            Some(pid),
            &log,
            self.timeout,
            || {
                root.exists()
                    && process::http_get(monitoring, "/ready", Duration::from_secs(1))
                        .is_ok_and(|(s, _)| s == 200)
            },
        )
    }

    fn node_processes(&mut self) -> Result<(), LocalError> {
        let cs = self
            .state
            .control
            .clone()
            .ok_or_else(|| LocalError::Command {
                cmd: "ambit-control".into(),
                status: "not started".into(),
                stderr: "no control plane".into(),
            })?;
        let xds = format!("https://{}", cs.xds_tls_addr);
        let root = cs.data_dir.join("ca").join("root-cert.pem");
        let mut waits = Vec::new();
        for n in self.state.nodes.clone() {
            let conflist = cni::primary_conflist(&n, &n.dir.join("ipam"));
            let text = serde_json::to_string_pretty(&conflist).unwrap_or_default();
            write(&n.conflist, &text)?;
            let agent = vec![
                self.bin("ambit-node-agent").display().to_string(),
                "--node-name".into(),
                n.name.clone(),
                "--config-dir".into(),
                self.state.config_dir.display().to_string(),
                "--extra-config-dir".into(),
                self.state.generated_dir().display().to_string(),
                "--state-dir".into(),
                n.agent_dir.display().to_string(),
                "--cni-socket".into(),
                n.cni_socket.display().to_string(),
                "--zds-socket".into(),
                n.zds_socket.display().to_string(),
                "--cni-bin-dir".into(),
                self.dir().join("cni-bin").display().to_string(),
                "--cni-conf-dir".into(),
                n.dir.join("net.d").display().to_string(),
                "--plugin-binary".into(),
                self.bin("ambit-cni").display().to_string(),
            ];
            let log = self.state.log_dir().join(format!("agent-{}.log", n.name));
            let pid = self.spawn(Role::NodeAgent, Some(&n.name), None, agent, log.clone())?;
            waits.push((n.clone(), Role::NodeAgent, pid, log));
            let zt = self.ztunnel_cmd(&n, &xds, &root);
            let log = self.state.log_dir().join(format!("ztunnel-{}.log", n.name));
            let pid = self.spawn(Role::Ztunnel, Some(&n.name), None, zt, log.clone())?;
            waits.push((n, Role::Ztunnel, pid, log));
        }
        for (n, role, pid, log) in waits {
            if role == Role::NodeAgent {
                wait_until(
                    &format!(
                        "the node agent of node {} to chain {AMBIT_PLUGIN} into {} and listen on {}",
                        n.name,
                        n.conflist.display(),
                        n.cni_socket.display()
                    ),
                    Some(pid),
                    &log,
                    self.timeout,
                    || cni::has_ambit(&n.conflist) && n.cni_socket.exists(),
                )?;
            } else {
                self.wait_ztunnel(n, pid, log, &xds, &root)?;
            }
        }
        Ok(())
    }

    fn ztunnel_cmd(&self, n: &NodeState, xds: &str, root: &Path) -> Vec<String> {
        vec![
            self.bin("ztunnel").display().to_string(),
            "--xds-address".into(),
            xds.into(),
            "--ca-address".into(),
            xds.into(),
            "--node-name".into(),
            n.name.clone(),
            "--token-file".into(),
            n.token_file.display().to_string(),
            "--root-cert".into(),
            root.display().to_string(),
            "--admin-addr".into(),
            n.admin_addr.to_string(),
            "--stats-addr".into(),
            n.stats_addr.to_string(),
            "--readiness-addr".into(),
            n.readiness_addr.to_string(),
            "--zds-path".into(),
            n.zds_socket.display().to_string(),
        ]
    }

    /// Waits for node `n`'s ztunnel to report ready; starts it again on
    /// fresh ports when another process took one of its ports first.
    fn wait_ztunnel(
        &mut self,
        mut n: NodeState,
        mut pid: u32,
        log: PathBuf,
        xds: &str,
        root: &Path,
    ) -> Result<(), LocalError> {
        let mut tries = 0;
        loop {
            let addr = n.readiness_addr;
            let ready = wait_until(
                &format!(
                    "the ztunnel of node {} to be ready (http://{addr}/healthz/ready)",
                    n.name
                ),
                Some(pid),
                &log,
                self.timeout,
                || {
                    process::http_get(addr, "/healthz/ready", Duration::from_secs(1))
                        .is_ok_and(|(s, _)| s == 200)
                },
            );
            match ready {
                Err(e) if process::is_port_clash(&e) && tries < PORT_TRIES => {
                    tries += 1;
                    self.forget_exited(&e)?;
                    n.admin_addr = free_addr()?;
                    n.stats_addr = free_addr()?;
                    n.readiness_addr = free_addr()?;
                    if let Some(slot) = self.state.nodes.iter_mut().find(|s| s.name == n.name) {
                        *slot = n.clone();
                    }
                    let cmd = self.ztunnel_cmd(&n, xds, root);
                    pid = self.spawn(Role::Ztunnel, Some(&n.name), None, cmd, log.clone())?;
                }
                r => return r,
            }
        }
    }

    /// Forgets the child `err` reports exited: reaps it and drops its record,
    /// so `down` never signals a pid the OS may have handed to another process.
    fn forget_exited(&mut self, err: &LocalError) -> Result<(), LocalError> {
        let LocalError::Exited { pid, .. } = err else {
            return Ok(());
        };
        self.state.processes.retain(|p| p.pid != *pid);
        if let Some(i) = self.children.iter().position(|c| c.id() == *pid) {
            let mut child = self.children.swap_remove(i);
            // Exited already: this only reaps it.
            let _ = child.wait();
        }
        self.state.save()
    }

    fn pods(&mut self, cni_bin: &Path) -> Result<(), LocalError> {
        for p in self.plan.pods.clone() {
            let pod = PodState {
                netns: format!("{}-{}-{}", self.state.name, p.namespace, p.name),
                namespace: p.namespace.clone(),
                name: p.name.clone(),
                node: p.node.clone(),
                ip: p.ip,
                uid: if p.uid.is_empty() {
                    let h = random_hex(16);
                    format!(
                        "{}-{}-{}-{}-{}",
                        &h[0..8],
                        &h[8..12],
                        &h[12..16],
                        &h[16..20],
                        &h[20..32]
                    )
                } else {
                    p.uid.clone()
                },
                container_id: random_hex(32),
                service_account: p.service_account.clone(),
                ambient: p.ambient,
                sidecar: p.sidecar,
                app: p.app.clone(),
                cni_result: None,
            };
            self.state.pods.push(pod.clone());
            self.add_netns(&pod.netns)?;
            let node = self
                .state
                .node(&pod.node)
                .cloned()
                .ok_or_else(|| LocalError::Plan {
                    dir: self.state.config_dir.clone(),
                    why: format!("pod {} is on unknown node {}", pod.key(), pod.node),
                })?;
            // Read the file the agent rewrote, as the runtime does.
            let list = cni::read_conflist(&node.conflist)?;
            let result = CniCall {
                node: &node,
                pod: &pod,
                cni_bin,
            }
            .add_retrying(&list, self.timeout)?;
            if let Some(last) = self.state.pods.last_mut() {
                last.cni_result = Some(result);
            }
            self.state.save()?;
        }
        Ok(())
    }
}
