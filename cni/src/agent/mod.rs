//! The node agent: one per node. It installs the CNI plugin, learns which
//! pods are enrolled, programs their redirection and hands them to ztunnel.
//!
//! ```text
//!  ambit-cni ──unix socket──▶ cni server ─┐
//!  config dir / kube watch ──MeshView──────┼─▶ agent task (owns the pod table) ──ZDS──▶ ztunnel
//!  ztunnel connects ──▶ zds accept thread ─┘        │ redirect::install/remove in pod netns
//!                                                   └─▶ <state-dir>/pods.json
//! ```
//!
//! One task owns the pod table and does everything in order: a CNI ADD for
//! an enrolled pod installs its redirection, hands it to ztunnel and waits
//! for the ack before answering; a label change enrolls or releases running
//! pods; a (re)connecting ztunnel gets every enrolled pod, then
//! `SnapshotSent`. The table is persisted, and a restarted agent trusts a
//! pod's own redirection chain as the marker that it is enrolled, so
//! restarting the agent never touches a pod's traffic.

pub mod install;
pub mod kube;
pub mod logging;
pub mod netns;
mod pods;
pub mod sockets;
pub mod view;
pub mod zds;

use std::path::PathBuf;
use std::sync::Arc;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot, watch};

use crate::protocol::{Reply, Request};
use crate::redirect::RedirectPorts;

pub use pods::{PodRecord, PodTable};
use view::MeshView;

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot listen for the CNI plugin on {path}: {source}")]
    CniSocket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Zds(#[from] zds::ZdsServerError),
    #[error(transparent)]
    SocketPath(#[from] sockets::SocketPathError),
    #[error("cannot use the state directory {path}: {source}")]
    State {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Where the agent listens and keeps its state.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Socket the CNI plugin connects to.
    pub cni_socket: PathBuf,
    /// Socket ztunnel connects to (ZDS).
    pub zds_socket: PathBuf,
    /// Where the pod table is persisted.
    pub state_dir: PathBuf,
    /// ztunnel's in-pod ports the redirection points at.
    pub ports: RedirectPorts,
}

enum Event {
    Cni(Request, oneshot::Sender<Reply>),
    Pods(oneshot::Sender<Vec<PodRecord>>),
}

/// A running agent. Its socket files are removed when it is shut down or
/// dropped.
#[derive(Debug)]
pub struct Agent {
    events: mpsc::Sender<Event>,
    task: tokio::task::JoinHandle<()>,
    cni_task: tokio::task::JoinHandle<()>,
    /// The CNI and ZDS sockets' paths, removed on drop.
    sockets: Vec<sockets::BoundPath>,
}

impl Agent {
    /// Loads the persisted pod table, binds both sockets and starts the
    /// agent task, which follows `view`. A socket file another process
    /// still serves is an error ([`sockets::SocketPathError::InUse`]); one
    /// left by an agent that died is replaced.
    pub async fn start(
        cfg: AgentConfig,
        view: watch::Receiver<Arc<MeshView>>,
    ) -> Result<Self, AgentError> {
        let checked = cfg.clone();
        tokio::task::spawn_blocking(move || -> Result<(), AgentError> {
            std::fs::create_dir_all(&checked.state_dir).map_err(|source| AgentError::State {
                path: checked.state_dir.clone(),
                source,
            })?;
            // Both checked before either is bound: a refusal leaves nothing
            // behind. The plugin's socket first: probing a live agent there
            // costs it nothing (an empty request).
            sockets::prepare(&checked.cni_socket)?;
            sockets::prepare(&checked.zds_socket)?;
            Ok(())
        })
        .await
        .map_err(|e| AgentError::State {
            path: cfg.state_dir.clone(),
            source: std::io::Error::other(e.to_string()),
        })??;
        let table = PodTable::load_async(&cfg.state_dir).await;
        let (zt_tx, zt_rx) = mpsc::channel(4);
        let zds_path = zds::serve(&cfg.zds_socket, zt_tx)?;
        let listener = bind_unix(&cfg.cni_socket)?;
        let sockets = vec![zds_path, sockets::BoundPath::new(&cfg.cni_socket)];
        let (events, rx) = mpsc::channel(64);
        let task = tokio::spawn(pods::run(
            table,
            cfg.ports,
            view,
            rx,
            zt_rx,
            cfg.zds_socket.clone(),
        ));
        let cni_task = tokio::spawn(serve_cni(listener, events.clone()));
        tracing::info!(cni = %cfg.cni_socket.display(), zds = %cfg.zds_socket.display(), "node agent started");
        Ok(Self {
            events,
            task,
            cni_task,
            sockets,
        })
    }

    /// Handles one plugin request as if it came over the socket.
    pub async fn handle(&self, req: Request) -> Reply {
        ask(&self.events, req).await
    }

    /// The pods the agent knows, enrolled or not.
    pub async fn pods(&self) -> Vec<PodRecord> {
        self.client().pods().await
    }

    /// A handle other tasks use to talk to the agent task.
    pub fn client(&self) -> AgentClient {
        AgentClient {
            events: self.events.clone(),
        }
    }

    /// Stops the agent and removes its socket files. Pods keep their
    /// redirection (a restarted agent picks them up again).
    pub async fn shutdown(self) {
        self.cni_task.abort();
        drop(self.sockets);
        drop(self.events);
        let _ = self.task.await;
    }
}

/// Talks to a running agent's task (cloneable). [`Agent::shutdown`] waits
/// for the task, which ends once every client is dropped too: stop tasks
/// holding one first.
#[derive(Clone)]
pub struct AgentClient {
    events: mpsc::Sender<Event>,
}

impl std::fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentClient").finish_non_exhaustive()
    }
}

impl AgentClient {
    /// Handles one plugin request as if it came over the socket.
    pub async fn handle(&self, req: Request) -> Reply {
        ask(&self.events, req).await
    }

    /// The pods the agent knows, enrolled or not.
    pub async fn pods(&self) -> Vec<PodRecord> {
        let (tx, rx) = oneshot::channel();
        if self.events.send(Event::Pods(tx)).await.is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }
}

/// Binds the plugin's socket ([`sockets::prepare`] made the path free).
fn bind_unix(path: &std::path::Path) -> Result<UnixListener, AgentError> {
    UnixListener::bind(path).map_err(|source| AgentError::CniSocket {
        path: path.to_path_buf(),
        source,
    })
}

/// Largest request line the plugin may send.
const MAX_REQUEST: usize = 64 * 1024;

/// Hands a plugin request to the agent task and waits for its reply.
async fn ask(events: &mpsc::Sender<Event>, req: Request) -> Reply {
    let (tx, rx) = oneshot::channel();
    if events.send(Event::Cni(req, tx)).await.is_err() {
        return Reply::error("the node agent is shutting down", true);
    }
    rx.await
        .unwrap_or_else(|_| Reply::error("the node agent dropped the request", true))
}

async fn serve_cni(listener: UnixListener, events: mpsc::Sender<Event>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(cni_connection(stream, events.clone()));
            }
            Err(e) => {
                tracing::warn!(error = %e, "CNI socket accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

async fn cni_connection(stream: UnixStream, events: mpsc::Sender<Event>) {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read).take(MAX_REQUEST as u64);
    let reply = match reader.read_line(&mut line).await {
        Err(e) => Reply::error(format!("reading the request: {e}"), false),
        Ok(_) => match serde_json::from_str::<Request>(&line) {
            Err(e) => Reply::error(format!("not a valid request: {e}"), false),
            Ok(req) => ask(&events, req).await,
        },
    };
    let mut out = serde_json::to_vec(&reply).unwrap_or_else(|_| b"{\"ok\":false}".to_vec());
    out.push(b'\n');
    let _ = write.write_all(&out).await;
}
