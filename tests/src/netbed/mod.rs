//! A network-namespace test bed for end-to-end data-plane tests: nodes and
//! pods as network namespaces, wired like a small Kubernetes cluster.
//!
//! ```text
//!  <prefix>-lan: bridge lan0 ──────────────┬──────────────────────── ...
//!                                           │ veth n0 ↔ eth0
//!  <prefix>-n0: eth0 172.31.0.1/24, cni0 10.10.1.1/24, ip_forward=1,
//!               10.10.(j+1).0/24 via 172.31.0.(j+1) for every other node j
//!                     │ veth v<host> (on cni0) ↔ eth0
//!  <prefix>-<pod>: eth0 10.10.1.<host>/24, default via 10.10.1.1
//! ```
//!
//! [`Cluster::dual_stack`] adds IPv6 (ULA) to the same wiring, for tests
//! that ask for it (the others stay IPv4-only): nodes `fd00:31::(n+1)/64`
//! on the lan, `cni0` `fd00:10:(n+1)::1/64`, pods `fd00:10:(n+1)::<host>/64`
//! with a default route via their `cni0`, routes between nodes, IPv6
//! forwarding on; addresses skip duplicate address detection so they are
//! usable at once.
//!
//! ztunnel runs in the test process (the host netns) and makes its per-pod
//! sockets inside pod namespaces via [`PodNetns`]; [`redirect`] holds the
//! in-pod rules, [`capture`] a packet capture, and the app helpers below
//! run in-pod servers on the test's tokio runtime. Needs root; tests call
//! [`can_run`] first and skip otherwise.

pub mod capture;
pub mod relay;
pub use ambit_cni::redirect;

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};

use ambit_inpod::{PodNetns, SocketOptions};
use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

pub use capture::{Capture, contains};
pub use redirect::{RedirectPorts, ZTUNNEL_MARK};
pub use relay::Relay;

/// Where `ip netns` keeps named namespaces.
pub const NETNS_DIR: &str = "/var/run/netns";

/// Serialises `ip netns add/del` within the process: the first `add` sets up
/// the shared mount of [`NETNS_DIR`], which races with itself.
static NETNS_LOCK: Mutex<()> = Mutex::new(());

/// Path of the named network namespace `ns`.
pub fn netns_path(ns: &str) -> PathBuf {
    Path::new(NETNS_DIR).join(ns)
}

/// Whether this machine can run netbed tests (root, `ip`, `iptables`,
/// `iptables-save`, `iptables-restore`). Otherwise prints `SKIP <test>: why`
/// and returns false; tests call it first and return early.
pub fn can_run(test: &str) -> bool {
    static CHECK: OnceLock<Result<(), String>> = OnceLock::new();
    match CHECK.get_or_init(preflight) {
        Ok(()) => true,
        Err(why) => {
            println!("SKIP {test}: {why}");
            false
        }
    }
}

fn preflight() -> Result<(), String> {
    let uid = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .map_err(|e| format!("cannot read /proc/self: {e}"))?;
    if uid != 0 {
        return Err(format!("needs root for network namespaces (uid {uid})"));
    }
    for (tool, flag) in [
        ("ip", "-V"),
        ("iptables", "-V"),
        ("iptables-save", "-V"),
        ("iptables-restore", "-V"),
    ] {
        let ok = Command::new(tool)
            .arg(flag)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return Err(format!("`{tool}` is not installed or does not run"));
        }
    }
    Ok(())
}

/// Runs `cmd` (program first); returns stdout, or an error naming the
/// command with its exit status and stderr.
pub fn run(cmd: &[&str]) -> Result<String> {
    let (program, args) = cmd.split_first().context("run: empty command")?;
    let shown = cmd.join(" ");
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run `{shown}`"))?;
    if !out.status.success() {
        bail!(
            "`{shown}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `ip ARGS...`.
pub fn ip(args: &[&str]) -> Result<()> {
    let mut cmd = vec!["ip"];
    cmd.extend_from_slice(args);
    run(&cmd).map(drop)
}

/// Runs `cmd` inside network namespace `ns` (`ip netns exec`); returns stdout.
pub fn netns_exec(ns: &str, cmd: &[&str]) -> Result<String> {
    let mut full = vec!["ip", "netns", "exec", ns];
    full.extend_from_slice(cmd);
    run(&full)
}

/// Writes `value` to `/proc/sys/<key>` (e.g. `net/ipv4/ip_forward`) inside `ns`.
pub fn sysctl(ns: &str, key: &str, value: &str) -> Result<()> {
    let path = format!("/proc/sys/{key}");
    let value = value.to_string();
    PodNetns::open(netns_path(ns))?
        .run_in(|| std::fs::write(&path, value))
        .with_context(|| format!("setting {key} in netns {ns}"))
}

/// Address of node `node` on the lan (`172.31.0.(node+1)`).
pub fn node_ip(node: usize) -> Ipv4Addr {
    Ipv4Addr::new(172, 31, 0, octet(node + 1))
}

/// IPv6 address of node `node` on the lan (`fd00:31::(node+1)`), in a
/// dual-stack cluster.
pub fn node_ip6(node: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x31, 0, 0, 0, 0, 0, hextet(node + 1))
}

/// IPv6 address `host` in node `node`'s pod subnet (`fd00:10:(node+1)::host`).
pub fn pod_ip6(node: usize, host: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x10, hextet(node + 1), 0, 0, 0, 0, hextet(host))
}

fn hextet(n: usize) -> u16 {
    u16::try_from(n).unwrap_or(u16::MAX)
}

/// The pod subnet's third octet of node `node`: pods get `10.10.(node+1).x`.
fn octet(n: usize) -> u8 {
    u8::try_from(n).unwrap_or(u8::MAX)
}

/// One pod: its own network namespace with `eth0` on its node's `cni0`.
#[derive(Clone, Debug)]
pub struct PodNet {
    /// The name given to [`Cluster::add_pod`].
    pub name: String,
    /// Its network namespace's name (`<prefix>-<name>`).
    pub netns: String,
    /// Its address on `eth0`.
    pub ip: Ipv4Addr,
    /// Its IPv6 address on `eth0`, in a dual-stack cluster.
    pub ip6: Option<Ipv6Addr>,
    /// Index of its node.
    pub node: usize,
}

impl PodNet {
    /// `/var/run/netns/<netns>`.
    pub fn path(&self) -> PathBuf {
        netns_path(&self.netns)
    }

    /// Opens the pod's namespace as ztunnel does.
    pub fn open(&self) -> Result<PodNetns> {
        PodNetns::open(self.path()).with_context(|| format!("opening netns of pod {}", self.name))
    }

    /// `self.ip:port`.
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.ip.into(), port)
    }

    /// `[self.ip6]:port`; panics when the pod has no IPv6 address (the
    /// cluster was not made with [`Cluster::dual_stack`]).
    pub fn addr6(&self, port: u16) -> SocketAddr {
        match self.ip6 {
            Some(ip) => SocketAddr::new(ip.into(), port),
            None => panic!(
                "pod {} has no IPv6 address (use Cluster::dual_stack)",
                self.name
            ),
        }
    }
}

/// A cluster of nodes and pods. Dropping it deletes every namespace it made
/// (and with them their links, routes and rules), also when a test fails.
#[derive(Debug)]
pub struct Cluster {
    prefix: String,
    lan: String,
    nodes: Vec<String>,
    pods: Vec<PodNet>,
    /// Pods added per node, for the next free address.
    pods_per_node: Vec<usize>,
    /// Every namespace made, in creation order.
    created: Vec<String>,
    /// IPv6 too (see [`Cluster::dual_stack`]).
    ipv6: bool,
}

impl Cluster {
    /// A lan with `nodes` nodes (1..=250) and no pods yet, IPv4 only.
    pub fn new(nodes: usize) -> Result<Cluster> {
        Self::build_cluster(nodes, false)
    }

    /// [`Cluster::new`] with IPv6 as well: every node and pod also gets a
    /// ULA address (see the module docs).
    pub fn dual_stack(nodes: usize) -> Result<Cluster> {
        Self::build_cluster(nodes, true)
    }

    /// Whether nodes and pods have IPv6 addresses too.
    pub fn is_dual_stack(&self) -> bool {
        self.ipv6
    }

    fn build_cluster(nodes: usize, ipv6: bool) -> Result<Cluster> {
        if !(1..=250).contains(&nodes) {
            bail!("Cluster::new: {nodes} nodes; 1 to 250 are supported");
        }
        let prefix = format!("ab{:06x}", rand::random::<u32>() & 0xff_ffff);
        let mut cluster = Cluster {
            lan: format!("{prefix}-lan"),
            nodes: (0..nodes).map(|i| format!("{prefix}-n{i}")).collect(),
            prefix,
            pods: Vec::new(),
            pods_per_node: vec![0; nodes],
            created: Vec::new(),
            ipv6,
        };
        // On any error, `cluster` drops here and removes what was made.
        cluster
            .build()
            .with_context(|| format!("building cluster {}", cluster.prefix))?;
        Ok(cluster)
    }

    fn build(&mut self) -> Result<()> {
        let lan = self.lan.clone();
        self.add_netns(&lan)?;
        ip(&["-n", &lan, "link", "add", "lan0", "type", "bridge"])?;
        ip(&["-n", &lan, "link", "set", "lan0", "up"])?;
        for (i, node) in self.nodes.clone().iter().enumerate() {
            self.add_netns(node)?;
            let port = format!("n{i}");
            let ip_cidr = format!("{}/24", node_ip(i));
            let cni = format!("10.10.{}.1/24", octet(i + 1));
            ip(&[
                "-n", &lan, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
                node,
            ])?;
            ip(&["-n", &lan, "link", "set", &port, "master", "lan0", "up"])?;
            ip(&["-n", node, "addr", "add", &ip_cidr, "dev", "eth0"])?;
            ip(&["-n", node, "link", "set", "eth0", "up"])?;
            ip(&["-n", node, "link", "add", "cni0", "type", "bridge"])?;
            ip(&["-n", node, "addr", "add", &cni, "dev", "cni0"])?;
            ip(&["-n", node, "link", "set", "cni0", "up"])?;
            sysctl(node, "net/ipv4/ip_forward", "1")?;
            if self.ipv6 {
                let lan6 = format!("{}/64", node_ip6(i));
                let cni6 = format!("{}/64", pod_ip6(i, 1));
                ip(&["-n", node, "addr", "add", &lan6, "dev", "eth0", "nodad"])?;
                ip(&["-n", node, "addr", "add", &cni6, "dev", "cni0", "nodad"])?;
                sysctl(node, "net/ipv6/conf/all/forwarding", "1")?;
            }
        }
        for (i, node) in self.nodes.iter().enumerate() {
            for j in (0..self.nodes.len()).filter(|j| *j != i) {
                let subnet = format!("10.10.{}.0/24", octet(j + 1));
                let via = node_ip(j).to_string();
                ip(&["-n", node, "route", "add", &subnet, "via", &via])?;
                if self.ipv6 {
                    let subnet6 = format!("{}/64", pod_ip6(j, 0));
                    let via6 = node_ip6(j).to_string();
                    ip(&["-n", node, "-6", "route", "add", &subnet6, "via", &via6])?;
                }
            }
        }
        Ok(())
    }

    /// Creates netns `name` with `lo` up, and records it for deletion.
    fn add_netns(&mut self, name: &str) -> Result<()> {
        {
            let _guard = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            ip(&["netns", "add", name])?;
        }
        self.created.push(name.to_string());
        ip(&["-n", name, "link", "set", "lo", "up"])
    }

    /// Adds pod `name` (unique in the cluster; letters, digits, `-`) on
    /// `node`, with the node's next free address `10.10.(node+1).(k+2)`.
    pub fn add_pod(&mut self, node: usize, name: &str) -> Result<PodNet> {
        let Some(node_ns) = self.nodes.get(node).cloned() else {
            bail!(
                "add_pod {name}: no node {node} (cluster has {})",
                self.nodes.len()
            );
        };
        let valid = !name.is_empty()
            && name.len() <= 40
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        if !valid || name == "lan" || self.nodes.contains(&format!("{}-{name}", self.prefix)) {
            bail!("add_pod: bad pod name {name:?} (letters, digits, '-'; not a node or lan name)");
        }
        if self.pod(name).is_some() {
            bail!("add_pod: pod {name} already exists");
        }
        let host = self.pods_per_node[node] + 2;
        if host > 254 {
            bail!("add_pod {name}: node {node} is full");
        }
        self.pods_per_node[node] += 1;
        let pod = PodNet {
            name: name.to_string(),
            netns: format!("{}-{name}", self.prefix),
            ip: Ipv4Addr::new(10, 10, octet(node + 1), octet(host)),
            ip6: self.ipv6.then(|| pod_ip6(node, host)),
            node,
        };
        let ns = pod.netns.as_str();
        self.add_netns(ns)?;
        let peer = format!("v{host}");
        let cidr = format!("{}/24", pod.ip);
        let gateway = format!("10.10.{}.1", octet(node + 1));
        let setup = || -> Result<()> {
            ip(&[
                "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", &peer, "netns",
                &node_ns,
            ])?;
            ip(&["-n", &node_ns, "link", "set", &peer, "master", "cni0", "up"])?;
            ip(&["-n", ns, "addr", "add", &cidr, "dev", "eth0"])?;
            ip(&["-n", ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", ns, "route", "add", "default", "via", &gateway])?;
            if let Some(ip6) = pod.ip6 {
                let cidr6 = format!("{ip6}/64");
                let gateway6 = pod_ip6(node, 1).to_string();
                ip(&["-n", ns, "addr", "add", &cidr6, "dev", "eth0", "nodad"])?;
                ip(&["-n", ns, "-6", "route", "add", "default", "via", &gateway6])?;
            }
            Ok(())
        };
        setup().with_context(|| format!("wiring pod {name} on node {node}"))?;
        self.pods.push(pod.clone());
        Ok(pod)
    }

    /// Creates an empty, unwired pod namespace `<prefix>-<name>` (deleted
    /// with the cluster), for a CNI plugin chain to wire; returns its name.
    /// Record the wired pod with [`Cluster::adopt_pod`].
    pub fn add_bare_netns(&mut self, name: &str) -> Result<String> {
        let ns = format!("{}-{name}", self.prefix);
        if self.created.contains(&ns) {
            bail!("add_bare_netns: {ns} already exists");
        }
        self.add_netns(&ns)?;
        Ok(ns)
    }

    /// Records a pod wired by someone else (e.g. the CNI plugins) so
    /// [`Cluster::pod`] finds it.
    pub fn adopt_pod(&mut self, pod: PodNet) {
        self.pods.retain(|p| p.name != pod.name);
        self.pods.push(pod);
    }

    /// The pod named `name`.
    pub fn pod(&self, name: &str) -> Option<&PodNet> {
        self.pods.iter().find(|p| p.name == name)
    }

    /// Every pod, in creation order.
    pub fn pods(&self) -> &[PodNet] {
        &self.pods
    }

    /// Netns name of node `node` (panics on a bad index, as slices do).
    pub fn node_netns(&self, node: usize) -> &str {
        &self.nodes[node]
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    /// Netns name of the lan (holds bridge `lan0`; capture inter-node traffic here).
    pub fn lan_netns(&self) -> &str {
        &self.lan
    }

    /// The prefix of every namespace of this cluster (`ab` + 6 hex digits).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _guard = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        // Pods first, then nodes, then the lan; each takes its veths along.
        for ns in self.created.iter().rev() {
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("netbed: cleaning up cluster {}: {e:#}", self.prefix);
            }
        }
    }
}

/// An app server in a pod; aborted (with all its connections) on drop.
#[derive(Debug)]
pub struct App {
    /// The pod's address and the port it listens on (on `0.0.0.0`).
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for App {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Echoes bytes until EOF, then shuts its write side (half-close is visible).
pub async fn echo_server(pod: &PodNet, port: u16) -> Result<App> {
    serve(pod, port, false).await
}

/// Writes the peer's address as `ip:port\n`, then echoes like [`echo_server`].
pub async fn whoami_server(pod: &PodNet, port: u16) -> Result<App> {
    serve(pod, port, true).await
}

/// A listener on `0.0.0.0:port` inside the pod, driven by the current runtime.
pub fn listen(pod: &PodNet, port: u16) -> Result<TcpListener> {
    listen_on(pod, SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port))
}

/// A listener on `[::]:port` (IPv6 only) inside the pod.
pub fn listen6(pod: &PodNet, port: u16) -> Result<TcpListener> {
    listen_on(pod, SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port))
}

/// A listener on `addr` inside the pod.
pub fn listen_on(pod: &PodNet, any: SocketAddr) -> Result<TcpListener> {
    let std = pod
        .open()?
        .bind_listener(any, false)
        .with_context(|| format!("listening on {any} in pod {}", pod.name))?;
    TcpListener::from_std(std).context("registering listener with tokio")
}

/// Serves on `0.0.0.0:port`, and on `[::]:port` too when the pod has IPv6.
async fn serve(pod: &PodNet, port: u16, whoami: bool) -> Result<App> {
    let v4 = listen(pod, port)?;
    let v6 = match pod.ip6 {
        Some(_) => Some(listen6(pod, port)?),
        None => None,
    };
    let task = tokio::spawn(async move {
        // Dropping the set (when the task is aborted) aborts every connection.
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                accepted = v4.accept() => accept_one(&mut conns, accepted, whoami),
                accepted = accept_opt(v6.as_ref()) => accept_one(&mut conns, accepted, whoami),
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
    });
    Ok(App {
        addr: pod.addr(port),
        task,
    })
}

async fn accept_opt(l: Option<&TcpListener>) -> std::io::Result<(TcpStream, SocketAddr)> {
    match l {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

fn accept_one(
    conns: &mut JoinSet<()>,
    accepted: std::io::Result<(TcpStream, SocketAddr)>,
    whoami: bool,
) {
    match accepted {
        Ok((stream, peer)) => {
            conns.spawn(async move {
                let _ = echo(stream, whoami.then_some(peer)).await;
            });
        }
        Err(e) => println!("netbed app: accept failed: {e}"),
    }
}

async fn echo(mut stream: TcpStream, greet: Option<SocketAddr>) -> std::io::Result<()> {
    if let Some(peer) = greet {
        stream.write_all(format!("{peer}\n").as_bytes()).await?;
    }
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return stream.shutdown().await;
        }
        stream.write_all(&buf[..n]).await?;
    }
}

/// An ordinary (unmarked) connection from inside the pod, as its app would
/// make: captured by the redirection rules when installed.
pub async fn connect(pod: &PodNet, dst: SocketAddr) -> Result<TcpStream> {
    pod.open()?
        .connect_from(dst, &SocketOptions::default())
        .await
        .with_context(|| format!("connecting from pod {} to {dst}", pod.name))
}
