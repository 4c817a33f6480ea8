//! The load bench's bed: `ambitctl::local` (the real binaries as
//! processes) with `mesh/client` on node-1 and `mesh/server` on node-2, the
//! processes' memory, and the machine's state.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ambit_tests::netbed::{self, PodNet};
use ambit_ztunnel::hbone::client_config;
use ambit_ztunnel::identity::{CertificateManager, Identity};
use ambitctl::local::{self, DownOnDrop, Role, UpOptions};
use anyhow::{Context, Result};

use crate::dpload::{self, Mem};

/// The echo server's port in `mesh/server`.
pub const ECHO_PORT: u16 = 7000;
/// Namespace of the pods.
pub const NS: &str = "mesh";

/// The bed's pods; the server's `version` label is `version` (changing it
/// gives the server's workload a new canonical revision: a push).
fn config(version: &str) -> String {
    format!(
        "\
apiVersion: v1
kind: Namespace
metadata: {{name: {NS}, labels: {{istio.io/dataplane-mode: ambient}}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: client, namespace: {NS}, uid: uid-client, labels: {{app: client}}}}
spec: {{nodeName: node-1, serviceAccountName: client}}
status: {{podIP: 10.10.1.10}}
---
apiVersion: v1
kind: Pod
metadata: {{name: server, namespace: {NS}, uid: uid-server, labels: {{app: server, version: \"{version}\"}}}}
spec: {{nodeName: node-2, serviceAccountName: server}}
status: {{podIP: 10.10.2.10}}
"
    )
}

/// `target/release` (or `LOAD_BIN_DIR`, e.g. to run another build of one
/// binary), when every binary local mode runs is there; prints SKIP and
/// returns `None` otherwise.
pub fn binaries() -> Result<Option<PathBuf>> {
    let exe = std::env::current_exe()?;
    let bins: PathBuf = match std::env::var_os("LOAD_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => exe
            .parent()
            .and_then(|d| d.parent())
            .context("locating target/release")?
            .to_path_buf(),
    };
    let missing: Vec<_> = local::BINARIES
        .iter()
        .chain(&[local::CONTROLLER_BINARY])
        .filter(|b| !bins.join(b).exists())
        .collect();
    if !missing.is_empty() {
        println!(
            "SKIP load bench: build the binaries first (cargo build --release --workspace --bins); missing {missing:?} in {}",
            bins.display()
        );
        return Ok(None);
    }
    Ok(Some(bins))
}

/// Raises RLIMIT_NOFILE to `n` (soft and hard: needs CAP_SYS_RESOURCE
/// beyond the hard limit), else the soft limit to the hard one; returns
/// (soft, hard) in effect.
pub fn raise_nofile(n: u64) -> Result<(u64, u64)> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < n && setrlimit(Resource::RLIMIT_NOFILE, n, hard.max(n)).is_err() {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok(getrlimit(Resource::RLIMIT_NOFILE)?)
}

/// Load average, CPUs, available memory, and how busy the CPUs were over
/// half a second.
pub async fn machine_state() -> String {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    let avail = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0);
    let busy0 = dpload::machine_busy_secs();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let busy = (dpload::machine_busy_secs() - busy0) / 0.5;
    format!(
        "load average {}, {} CPUs, {:.0} % of a CPU busy over 0.5 s, {:.1} GiB available",
        load.join(" "),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        busy * 100.0,
        avail as f64 / (1 << 20) as f64
    )
}

/// MiB from KiB.
pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// `rss (anon a)` in MiB.
pub fn mem_cell(m: &Mem) -> String {
    format!("{:.1} MiB (anon {:.1})", mib(m.rss), mib(m.anon))
}

/// The running bed. Dropping it takes the cluster down (processes,
/// namespaces, state dir).
pub struct Bed {
    pub cluster: DownOnDrop,
    pub client: PodNet,
    pub server: PodNet,
    /// ztunnel of node-1 (the client's: outbound).
    pub zt_src: u32,
    /// ztunnel of node-2 (the server's: inbound).
    pub zt_dst: u32,
    pub control: u32,
    pub xds_tls: SocketAddr,
    pub monitoring: SocketAddr,
    pub root_cert: PathBuf,
    /// node-1's bootstrap token file.
    pub token_node1: PathBuf,
    pub bins: PathBuf,
    config: tempfile::TempDir,
    _state: tempfile::TempDir,
}

fn pod(c: &local::LocalCluster, key: &str, node: usize) -> Result<PodNet> {
    let p = c.pod(key)?;
    Ok(PodNet {
        name: p.name.clone(),
        netns: p.netns.clone(),
        ip: p.ip,
        ip6: None,
        node,
    })
}

fn pid_of(c: &local::LocalCluster, role: Role, node: Option<&str>) -> Result<u32> {
    c.state
        .processes
        .iter()
        .find(|p| p.role == role && p.node.as_deref() == node)
        .map(|p| p.pid)
        .with_context(|| format!("no {} process for {node:?}", role.as_str()))
}

impl Bed {
    /// Brings the cluster up with `extra` YAML (in `extra.yaml`) beside the
    /// pods; the pods get a wide ephemeral port range and `tcp_tw_reuse`
    /// (tens of thousands of connections from one client IP), and a short
    /// conntrack TIME_WAIT (see [`tune_pod`]).
    pub async fn start(bins: &Path, extra: &str) -> Result<Bed> {
        let config = tempfile::tempdir()?;
        std::fs::write(config.path().join("pods.yaml"), self::config("v0"))?;
        std::fs::write(config.path().join("extra.yaml"), extra)?;
        let state = tempfile::tempdir()?;
        let mut opts = UpOptions::new(config.path(), bins);
        opts.name = format!("ld{:05x}", rand::random::<u32>() & 0xfffff);
        opts.state_dir = Some(state.path().join("state"));
        let up = {
            let opts = opts.clone();
            tokio::task::spawn_blocking(move || local::up(&opts)).await?
        };
        let cluster = up.context("local up")?.down_on_drop();
        let client = pod(&cluster, &format!("{NS}/client"), 0)?;
        let server = pod(&cluster, &format!("{NS}/server"), 1)?;
        for p in [&client, &server] {
            tune_pod(p);
        }
        let cs = cluster.control().context("no control plane")?.clone();
        let node1 = cluster
            .nodes()
            .iter()
            .find(|n| n.name == "node-1")
            .context("no node-1")?
            .clone();
        Ok(Bed {
            zt_src: pid_of(&cluster, Role::Ztunnel, Some("node-1"))?,
            zt_dst: pid_of(&cluster, Role::Ztunnel, Some("node-2"))?,
            control: pid_of(&cluster, Role::Control, None)?,
            xds_tls: cs.xds_tls_addr,
            monitoring: cs.monitoring_addr,
            root_cert: cs.data_dir.join("ca").join("root-cert.pem"),
            token_node1: node1.token_file,
            bins: bins.to_path_buf(),
            cluster,
            client,
            server,
            config,
            _state: state,
        })
    }

    /// Rewrites the pods' file with the server's `version` label set to
    /// `version`.
    pub fn set_server_version(&self, version: &str) -> Result<()> {
        ambit_tests::write_atomic(&self.config.path().join("pods.yaml"), &config(version))
    }

    /// `(opened, closed)` connections the ztunnel of `node` (`node-1`,
    /// `node-2`) counted (`istio_tcp_connections_{opened,closed}_total`).
    pub async fn zt_connections(&self, node: &str) -> Result<(f64, f64)> {
        let n = self
            .cluster
            .nodes()
            .iter()
            .find(|n| n.name == node)
            .with_context(|| format!("no {node}"))?;
        let text = ambit_tests::get(n.stats_addr, "/metrics").await?;
        let sum = |name| ambit_tests::meshbed::metric_sum(&text, name, &[]);
        Ok((
            sum("istio_tcp_connections_opened_total"),
            sum("istio_tcp_connections_closed_total"),
        ))
    }

    /// xDS responses the control plane pushed so far
    /// (`pilot_xds_pushes_total`).
    pub async fn pushes(&self) -> Result<f64> {
        let text = ambit_tests::get(self.monitoring, "/metrics").await?;
        Ok(ambit_tests::meshbed::metric_sum(
            &text,
            "pilot_xds_pushes_total",
            &[],
        ))
    }

    /// Writes `name` in the served config directory.
    pub fn write_config(&self, name: &str, yaml: &str) -> Result<()> {
        ambit_tests::write_atomic(&self.config.path().join(name), yaml)
    }

    /// Memory of (source ztunnel, destination ztunnel, control plane).
    pub fn mem(&self) -> [Mem; 3] {
        [
            dpload::mem(self.zt_src),
            dpload::mem(self.zt_dst),
            dpload::mem(self.control),
        ]
    }

    /// The echo app in `mesh/server`'s `port`.
    pub fn echo_addr(&self) -> SocketAddr {
        self.server.addr(ECHO_PORT)
    }

    /// A client TLS config presenting `mesh/client`'s certificate (issued
    /// by the control plane's CA for node-1's token) and pinning
    /// `mesh/server`'s identity, resumption off: what the source ztunnel
    /// uses to dial the server pod's 15008.
    pub async fn hbone_tls(&self) -> Result<Arc<rustls::ClientConfig>> {
        let mut cfg = ambit_ztunnel::Config::new("node-1", format!("https://{}", self.xds_tls));
        cfg.token_file = Some(self.token_node1.clone());
        cfg.root_cert = Some(self.root_cert.clone());
        let certs = CertificateManager::from_config(&cfg)?;
        let client = Identity::new("cluster.local", NS, "client");
        let server = Identity::new("cluster.local", NS, "server");
        let cert = tokio::time::timeout(Duration::from_secs(20), certs.fetch(&client))
            .await
            .context("client certificate")??;
        let bundle = certs.trust_bundle().borrow().clone();
        let mut tls = client_config(&cert, &bundle, server)?;
        tls.resumption = rustls::client::Resumption::disabled();
        Ok(Arc::new(tls))
    }

    /// Takes the cluster down now (on a blocking thread), reporting
    /// failures.
    pub async fn down(self) -> Result<()> {
        tokio::task::spawn_blocking(move || {
            let Bed {
                cluster,
                config,
                _state,
                zt_src,
                zt_dst,
                ..
            } = self;
            if let Some(keep) = std::env::var_os("LOAD_LOG_DIR") {
                // The ztunnels first, so what they print at exit is kept.
                stop(&[zt_src, zt_dst]);
                copy_logs(&cluster.log_dir(), Path::new(&keep));
            }
            // The state and config dirs go after the cluster.
            let r = cluster.down();
            drop((config, _state));
            r
        })
        .await?
        .context("local down")?;
        Ok(())
    }
}

/// Sends SIGTERM to `pids` and waits (up to 10 s) until they are gone.
fn stop(pids: &[u32]) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    for &pid in pids {
        let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let alive = |p: u32| {
        std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
        })
    };
    while pids.iter().any(|&p| alive(p)) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Copies the `*.log` files of `from` into `to`, each prefixed with the
/// time (beds of one run do not overwrite each other's).
fn copy_logs(from: &Path, to: &Path) {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let _ = std::fs::create_dir_all(to);
    for e in std::fs::read_dir(from).into_iter().flatten().flatten() {
        let name = e.file_name();
        let dest = to.join(format!("{stamp}-{}", name.to_string_lossy()));
        if let Err(err) = std::fs::copy(e.path(), &dest) {
            eprintln!("cannot keep {}: {err}", e.path().display());
        }
    }
}

/// Value of `AMBIT_LOAD_ROLE` that makes this binary the echo app.
pub const ECHO_ROLE: &str = "echo";

/// The echo app in its own process (this binary re-executed inside the
/// server pod's netns), so its sockets count against its own file limit:
/// 10,000 connections through the mesh are 10,000 sockets at each end.
/// Stopped (stdin closed, then killed) on drop.
pub struct EchoChild {
    child: tokio::process::Child,
}

impl Bed {
    /// Starts the echo app on [`ECHO_PORT`] in `mesh/server`.
    pub async fn echo(&self) -> Result<EchoChild> {
        use tokio::io::AsyncBufReadExt;
        let mut child = tokio::process::Command::new("ip")
            .args(["netns", "exec", &self.server.netns])
            .arg(std::env::current_exe()?)
            .env("AMBIT_LOAD_ROLE", ECHO_ROLE)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting the echo app")?;
        let out = child.stdout.take().context("echo stdout")?;
        let mut line = String::new();
        tokio::time::timeout(
            Duration::from_secs(10),
            tokio::io::BufReader::new(out).read_line(&mut line),
        )
        .await
        .context("the echo app did not start")??;
        if line.trim() != "READY" {
            anyhow::bail!("the echo app said {line:?}");
        }
        Ok(EchoChild { child })
    }
}

impl Drop for EchoChild {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.start_kill();
    }
}

/// The echo app's main: echoes on every connection until EOF, then closes;
/// stops when stdin closes.
pub fn echo_main() -> Result<()> {
    use std::io::Write;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let l = tokio::net::TcpListener::bind(("0.0.0.0", ECHO_PORT)).await?;
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "READY")?;
            out.flush()?;
        }
        let stdin_closed = tokio::task::spawn_blocking(|| {
            let mut buf = [0u8; 64];
            let mut stdin = std::io::stdin();
            while std::io::Read::read(&mut stdin, &mut buf).is_ok_and(|n| n > 0) {}
        });
        let serve = async {
            loop {
                match l.accept().await {
                    Ok((mut s, _)) => {
                        let _ = s.set_nodelay(true);
                        tokio::spawn(async move {
                            let mut buf = [0u8; 512];
                            while let Ok(n) = s.read(&mut buf).await {
                                if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                            }
                            let _ = s.shutdown().await;
                        });
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        };
        tokio::select! {
            _ = stdin_closed => {}
            () = serve => {}
        }
        anyhow::Ok(())
    })?;
    rt.shutdown_background();
    Ok(())
}

/// Ephemeral ports 16000–65000 and `tcp_tw_reuse` in the pod: a client
/// making tens of thousands of connections to one address from one IP
/// needs both (see the data-plane section of benches/README.md). The
/// conntrack TIME_WAIT is lowered from 120 to 10 s in the pod: the capture
/// (REDIRECT) tracks every connection, the table (262,144 entries,
/// shared by the host) would fill at ~2,000 new connections/s sustained.
pub fn tune_pod(p: &PodNet) {
    for (key, value) in [
        ("net/ipv4/ip_local_port_range", "16000 65000"),
        ("net/ipv4/tcp_tw_reuse", "1"),
        ("net/netfilter/nf_conntrack_tcp_timeout_time_wait", "10"),
        ("net/core/somaxconn", "16384"),
        ("net/ipv4/tcp_max_syn_backlog", "16384"),
    ] {
        if let Err(e) = netbed::sysctl(&p.netns, key, value) {
            println!("  (pod {}: cannot set {key}: {e:#})", p.name);
        }
    }
}

/// TCP sockets in `pod`'s netns: (established, time-wait) from
/// `/proc/net/sockstat` (`inuse`, `tw`).
pub async fn sockets(pod: &PodNet) -> Result<(u64, u64)> {
    let sockstat = read_in(pod, "/proc/thread-self/net/sockstat").await?;
    let line = sockstat
        .lines()
        .find_map(|l| l.strip_prefix("TCP:"))
        .context("no TCP line in sockstat")?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let field = |name: &str| {
        words
            .iter()
            .position(|w| *w == name)
            .and_then(|i| words.get(i + 1)?.parse().ok())
            .unwrap_or(0)
    };
    Ok((field("inuse"), field("tw")))
}

/// Reads `path` (a `/proc/thread-self/net/...` file) inside `pod`'s netns,
/// on a blocking thread.
pub async fn read_in(pod: &PodNet, path: &'static str) -> Result<String> {
    let ns = pod.open()?;
    Ok(tokio::task::spawn_blocking(move || ns.run_in(|| std::fs::read_to_string(path))).await??)
}

/// Percentiles (µs) of sorted ns samples: `p50 / p90 / p99 / max`.
pub fn pcts(sorted: &[u64]) -> String {
    if sorted.is_empty() {
        return "-".into();
    }
    let p = |q| dpload::percentile(sorted, q);
    let fmt = |us: f64| {
        if us >= 10_000.0 {
            format!("{:.0} ms", us / 1e3)
        } else if us >= 1000.0 {
            format!("{:.1} ms", us / 1e3)
        } else {
            format!("{us:.0} µs")
        }
    };
    format!(
        "{} / {} / {} / {}",
        fmt(p(0.5)),
        fmt(p(0.9)),
        fmt(p(0.99)),
        fmt(p(1.0))
    )
}
