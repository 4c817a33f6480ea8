//! The bench's one-node mesh: four pods in network namespaces on one node
//! bridge, the control plane in this process, the ztunnel in a child
//! process, and a node agent (this process) that installs the in-pod
//! redirection and hands the two enrolled pods over ZDS.
//!
//! ```text
//!  node-0 cni0 ─┬─ client        (ambient, enrolled)   ─┐ one ztunnel (child
//!               ├─ server        (ambient, enrolled)   ─┘ process) both ends
//!               ├─ plain-client  (not enrolled)          the no-mesh baseline
//!               └─ plain-server  (not enrolled)
//! ```

use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ambit_control::{ControlConfig, ControlPlane};
use ambit_inpod::{ZdsAgentConn, ZdsListener, ZdsMessage};
use ambit_proto::workload::zds::WorkloadInfo;
use ambit_tests::netbed::{self, Cluster, PodNet, redirect};
use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::{JoinHandle, JoinSet};

use super::child;

/// Bound on every setup wait.
pub const WAIT: Duration = Duration::from_secs(20);
/// Namespace of the enrolled pods (ambient).
pub const MESH_NS: &str = "bench";
/// Namespace of the baseline pods (not ambient).
pub const PLAIN_NS: &str = "plain";
/// The sink (reads and discards) in both server pods.
pub const SINK_PORT: u16 = 9000;
/// The echo server in both server pods.
pub const ECHO_PORT: u16 = 9001;
/// Ephemeral ports inside the pods: wider than the default 32768–60999 so
/// the new-connection phases (tens of thousands of connections, each
/// leaving a TIME_WAIT) never run out. Above ztunnel's 150xx ports.
/// `POD_PORT_RANGE` overrides it.
const PORT_RANGE: &str = "16000 65000";

/// Enrolled client pods besides `client`, one per new-connection run (all
/// with service account `client`). ztunnel delivers each inbound
/// connection from the client's IP (transparent) and its delivery socket
/// ends in TIME_WAIT, bound to that IP; with tens of thousands of those
/// per client IP each new bind gets slow (see benches/README.md), so every
/// run gets a fresh client IP and runs do not slow each other down.
pub const CONN_CLIENTS: [&str; 5] = ["conn-1", "conn-8", "hbone-1", "hbone-8", "hbone-r"];

/// One pod: (name, namespace, service account, enrolled).
const PODS: [(&str, &str, &str, bool); 9] = [
    ("client", MESH_NS, "client", true),
    ("server", MESH_NS, "server", true),
    ("plain-client", PLAIN_NS, "plain-client", false),
    ("plain-server", PLAIN_NS, "plain-server", false),
    (CONN_CLIENTS[0], MESH_NS, "client", true),
    (CONN_CLIENTS[1], MESH_NS, "client", true),
    (CONN_CLIENTS[2], MESH_NS, "client", true),
    (CONN_CLIENTS[3], MESH_NS, "client", true),
    (CONN_CLIENTS[4], MESH_NS, "client", true),
];

fn uid(name: &str, ns: &str) -> String {
    format!("uid-{ns}-{name}")
}

/// The ztunnel child; asked to stop (stdin closed) and reaped on drop.
pub struct ZtChild {
    child: Child,
    pub pid: u32,
    pub admin: SocketAddr,
    pub stats: SocketAddr,
    pub log: PathBuf,
}

impl Drop for ZtChild {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Everything the bench runs against. Field order is drop order: the
/// ztunnel stops before the control plane and the namespaces go.
pub struct Bed {
    pub zt: ZtChild,
    _agent: Arc<Mutex<ZdsAgentConn>>,
    cp: Option<ControlPlane>,
    pub client: PodNet,
    pub server: PodNet,
    pub plain_client: PodNet,
    pub plain_server: PodNet,
    /// [`CONN_CLIENTS`], in that order.
    pub conn_clients: Vec<PodNet>,
    /// `https://` xDS/CA address of the control plane.
    pub xds: String,
    pub root_cert: PathBuf,
    pub token_file: PathBuf,
    _dir: tempfile::TempDir,
    _cluster: Cluster,
}

impl Bed {
    /// Builds the namespaces, starts the control plane and the ztunnel
    /// child, enrolls `client` and `server`, and waits until ztunnel holds
    /// both pods' certificates.
    pub async fn start() -> Result<Bed> {
        let range = std::env::var("POD_PORT_RANGE").unwrap_or_else(|_| PORT_RANGE.into());
        let mut cluster = Cluster::new(1)?;
        let mut pods = Vec::new();
        for (name, _, _, _) in PODS {
            let pod = cluster.add_pod(0, name)?;
            netbed::sysctl(&pod.netns, "net/ipv4/ip_local_port_range", &range)?;
            netbed::sysctl(&pod.netns, "net/ipv4/tcp_tw_reuse", "1")?;
            pods.push(pod);
        }
        let dir = tempfile::tempdir()?;
        let config_dir = dir.path().join("config");
        std::fs::create_dir(&config_dir)?;
        std::fs::write(config_dir.join("pods.yaml"), yaml(&pods))?;
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, "token-0\n")?;
        let tokens = dir.path().join("node-tokens");
        std::fs::write(&tokens, "token-0 node-0\n")?;
        let mut cfg = ControlConfig::for_tests(config_dir, dir.path().join("cp"));
        cfg.node_tokens_file = Some(tokens);
        let cp = ControlPlane::start(cfg)
            .await
            .context("starting the control plane")?;
        let root_cert = dir.path().join("cp/ca/root-cert.pem");
        let xds = format!("https://{}", cp.xds_tls_addr());

        let zds = dir.path().join("zds.sock");
        let listener = ZdsListener::bind(&zds)?;
        let log = dir.path().join("ztunnel.log");
        let mut child = Command::new(std::env::current_exe()?)
            .env("AMBIT_BENCH_ROLE", child::ROLE)
            .env("NODE_NAME", "node-0")
            .env("XDS_ADDRESS", &xds)
            .env("TOKEN_FILE", &token_file)
            .env("ROOT_CERT", &root_cert)
            .env("ZDS_PATH", &zds)
            .env("ZT_LOG_FILE", &log)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the ztunnel child")?;
        let pid = child.id();
        let stdout = child.stdout.take().context("child stdout")?;
        // From here on the child is reaped (and stopped) on every path.
        let mut zt = ZtChild {
            child,
            pid,
            admin: "127.0.0.1:0".parse()?,
            stats: "127.0.0.1:0".parse()?,
            log,
        };
        let line = tokio::time::timeout(
            WAIT * 2,
            tokio::task::spawn_blocking(move || {
                let mut line = String::new();
                BufReader::new(stdout).read_line(&mut line).map(|_| line)
            }),
        )
        .await
        .context("the ztunnel child did not report READY")???;
        let mut parts = line.split_whitespace();
        if parts.next() != Some("READY") {
            bail!("the ztunnel child failed to start (see its stderr above); it said {line:?}");
        }
        zt.admin = parts.next().context("no admin address")?.parse()?;
        zt.stats = parts.next().context("no stats address")?.parse()?;
        let agent = tokio::task::spawn_blocking(move || listener.accept(WAIT))
            .await?
            .context("the ztunnel child connecting to the node agent")?;
        let agent = Arc::new(Mutex::new(agent));

        for (pod, (name, ns, sa, enrolled)) in pods.iter().zip(PODS) {
            if !enrolled {
                continue;
            }
            redirect::install(&pod.path(), &redirect::RedirectPorts::default())?;
            let msg = ZdsMessage::Add {
                uid: uid(name, ns),
                info: WorkloadInfo {
                    name: name.into(),
                    namespace: ns.into(),
                    service_account: sa.into(),
                },
            };
            agent_request(&agent, msg, Some(pod.path())).await?;
        }
        agent_request(&agent, ZdsMessage::SnapshotSent, None).await?;
        wait_certificates(zt.admin, 2).await?;

        let mut pods = pods.into_iter();
        let mut next = || pods.next().context("pod");
        let (client, server) = (next()?, next()?);
        let (plain_client, plain_server) = (next()?, next()?);
        Ok(Bed {
            zt,
            _agent: agent,
            cp: Some(cp),
            client,
            server,
            plain_client,
            plain_server,
            conn_clients: pods.collect(),
            xds,
            root_cert,
            token_file,
            _dir: dir,
            _cluster: cluster,
        })
    }

    /// Stops the ztunnel child, then the control plane.
    pub async fn shutdown(mut self) {
        let cp = self.cp.take();
        drop(self);
        if let Some(cp) = cp {
            cp.shutdown().await;
        }
    }
}

fn yaml(pods: &[PodNet]) -> String {
    let mut y = format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {MESH_NS}\n  labels:\n    \
         istio.io/dataplane-mode: ambient\n---\napiVersion: v1\nkind: Namespace\nmetadata:\n  \
         name: {PLAIN_NS}\n"
    );
    for (pod, (name, ns, sa, _)) in pods.iter().zip(PODS) {
        let _ = write!(
            y,
            "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {ns}\n  \
             uid: {}\n  labels: {{app: {sa}, version: v1}}\nspec:\n  nodeName: node-0\n  \
             serviceAccountName: {sa}\nstatus:\n  podIP: {}\n",
            uid(name, ns),
            pod.ip
        );
    }
    y
}

async fn agent_request(
    agent: &Arc<Mutex<ZdsAgentConn>>,
    msg: ZdsMessage,
    netns: Option<PathBuf>,
) -> Result<()> {
    let agent = agent.clone();
    let kind = msg.kind();
    let ack = tokio::task::spawn_blocking(move || -> Result<String> {
        let conn = agent
            .lock()
            .map_err(|_| anyhow::anyhow!("agent lock poisoned"))?;
        let file = netns.map(std::fs::File::open).transpose()?;
        Ok(conn.request(&msg, file.as_ref().map(|f| f.as_fd()))?)
    })
    .await??;
    if !ack.is_empty() {
        bail!("ztunnel refused {kind}: {ack}");
    }
    Ok(())
}

/// Waits until `/config_dump` lists `n` certificates as available.
async fn wait_certificates(admin: SocketAddr, n: usize) -> Result<()> {
    let start = Instant::now();
    loop {
        let dump = ambit_tests::get(admin, "/config_dump").await?;
        if dump.matches("\"Available\"").count() >= n {
            return Ok(());
        }
        if start.elapsed() > WAIT {
            bail!("ztunnel holds fewer than {n} certificates after {WAIT:?}:\n{dump}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A server task in a pod; aborted (with its connections) on drop.
pub struct Server {
    task: JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `port` in `pod`, one task per connection running `conn`.
fn serve<F, Fut>(pod: &PodNet, port: u16, conn: F) -> Result<Server>
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = netbed::listen(pod, port)?;
    let task = tokio::spawn(async move {
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let _ = stream.set_nodelay(true);
                        conns.spawn(conn(stream));
                    }
                    Err(e) => {
                        eprintln!("bench server: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                },
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
    });
    Ok(Server { task })
}

/// Reads and discards everything, counting bytes into `bytes`.
pub fn sink(pod: &PodNet, port: u16, bytes: Arc<AtomicU64>) -> Result<Server> {
    serve(pod, port, move |mut s| {
        let bytes = bytes.clone();
        async move {
            let mut buf = vec![0u8; 256 * 1024];
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                bytes.fetch_add(n as u64, Ordering::Relaxed);
            }
        }
    })
}

/// Echoes until EOF, then closes its write side.
pub fn echo(pod: &PodNet, port: u16) -> Result<Server> {
    serve(pod, port, |mut s| async move {
        let mut buf = vec![0u8; 16 * 1024];
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = s.shutdown().await;
    })
}
