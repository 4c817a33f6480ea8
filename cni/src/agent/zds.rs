//! The node agent's side of ZDS: it listens, ztunnel connects. Each
//! accepted connection is checked (hello) on a dedicated thread and handed
//! to the agent, which then talks to it with blocking requests run off the
//! async runtime.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ambit_inpod::{ZdsAgentConn, ZdsListener, ZdsMessage};
use ambit_proto::workload::zds::WorkloadInfo;
use tokio::sync::mpsc;

use super::sockets::BoundPath;

/// How long ztunnel has to answer one request.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// Why talking to ztunnel failed.
#[derive(Debug, thiserror::Error)]
pub enum ZdsServerError {
    #[error("cannot listen for ztunnel on {path}: {reason}")]
    Listen { path: PathBuf, reason: String },
    #[error(
        "ztunnel is not connected to the node agent (socket {0}); is ztunnel running on this node?"
    )]
    NotConnected(PathBuf),
    #[error("cannot open the pod netns {path} to pass it to ztunnel: {source}")]
    Netns {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "ZDS request to ztunnel failed: {0}; ztunnel will get a full snapshot when it reconnects"
    )]
    Io(String),
    #[error("ztunnel refused {what}: {reason}")]
    Refused { what: String, reason: String },
}

/// One connected ztunnel, as the node agent talks to it (requests are
/// serialized on the connection and acked one at a time).
#[derive(Clone)]
pub struct ZtunnelConnection {
    conn: Arc<Mutex<ZdsAgentConn>>,
}

impl std::fmt::Debug for ZtunnelConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ZtunnelConnection")
    }
}

impl ZtunnelConnection {
    /// Sends one request (with the pod's netns fd for `Add`) and waits for
    /// the ack on a blocking thread.
    pub async fn request(
        &self,
        msg: ZdsMessage,
        netns: Option<PathBuf>,
    ) -> Result<(), ZdsServerError> {
        let conn = self.conn.clone();
        let what = msg.kind().to_string();
        let ack = tokio::task::spawn_blocking(move || -> Result<String, ZdsServerError> {
            let file = match &netns {
                Some(p) => {
                    Some(
                        std::fs::File::open(p).map_err(|source| ZdsServerError::Netns {
                            path: p.clone(),
                            source,
                        })?,
                    )
                }
                None => None,
            };
            let conn = conn.lock().unwrap_or_else(PoisonError::into_inner);
            conn.request(&msg, file.as_ref().map(|f| f.as_fd()))
                .map_err(|e| ZdsServerError::Io(e.to_string()))
        })
        .await
        .map_err(|e| ZdsServerError::Io(e.to_string()))??;
        if ack.is_empty() {
            Ok(())
        } else {
            Err(ZdsServerError::Refused { what, reason: ack })
        }
    }

    /// `AddWorkload` with the netns fd.
    pub async fn add(
        &self,
        uid: &str,
        info: WorkloadInfo,
        netns: &Path,
    ) -> Result<(), ZdsServerError> {
        let msg = ZdsMessage::Add {
            uid: uid.to_string(),
            info,
        };
        self.request(msg, Some(netns.to_path_buf())).await
    }

    /// `DelWorkload`.
    pub async fn del(&self, uid: &str) -> Result<(), ZdsServerError> {
        self.request(
            ZdsMessage::Del {
                uid: uid.to_string(),
            },
            None,
        )
        .await
    }

    /// `SnapshotSent`.
    pub async fn snapshot_sent(&self) -> Result<(), ZdsServerError> {
        self.request(ZdsMessage::SnapshotSent, None).await
    }

    /// Whether ztunnel has gone (its end of the connection is closed). A
    /// connection busy with a request is not gone.
    pub fn is_closed(&self) -> bool {
        match self.conn.try_lock() {
            Ok(conn) => conn.is_closed(),
            Err(_) => false,
        }
    }

    /// The same connection (not just an equal one).
    pub fn same(&self, other: &ZtunnelConnection) -> bool {
        Arc::ptr_eq(&self.conn, &other.conn)
    }
}

/// The ztunnels connected to this node agent, oldest first. Usually one;
/// during a ztunnel rolling update the new one connects while the old one
/// still serves, drains, and exits: new pods go to the newest, a pod that
/// leaves is removed from every one, and a ztunnel that is gone is
/// dropped. Replacing the old connection instead would make the old
/// ztunnel reconnect and the two take the pods from each other in turn.
#[derive(Debug, Default)]
pub struct Ztunnels {
    conns: Vec<ZtunnelConnection>,
}

impl Ztunnels {
    /// The newest connected ztunnel.
    pub fn latest(&self) -> Option<ZtunnelConnection> {
        self.conns.last().cloned()
    }

    /// Every connected ztunnel, oldest first.
    pub fn all(&self) -> Vec<ZtunnelConnection> {
        self.conns.clone()
    }

    /// A ztunnel connected: it is the newest now.
    pub fn connected(&mut self, z: ZtunnelConnection) {
        self.conns.push(z);
        tracing::info!(connected = self.conns.len(), "ztunnel connections");
    }

    /// Forgets `z` (its connection failed).
    pub fn lost(&mut self, z: &ZtunnelConnection) {
        let before = self.conns.len();
        self.conns.retain(|c| !c.same(z));
        if self.conns.len() != before {
            tracing::info!(
                connected = self.conns.len(),
                "a ztunnel connection was lost"
            );
        }
    }

    /// Forgets every ztunnel that has gone.
    pub fn prune(&mut self) {
        let before = self.conns.len();
        self.conns.retain(|c| !c.is_closed());
        if self.conns.len() != before {
            tracing::info!(
                gone = before - self.conns.len(),
                connected = self.conns.len(),
                "ztunnels gone"
            );
        }
    }
}

/// Binds `path` (replacing a stale socket, refusing one another process
/// serves) and accepts ztunnels on a dedicated thread, sending each to
/// `tx`. The thread ends when `tx`'s receiver is gone. The returned guard
/// removes the socket file when dropped.
pub fn serve(
    path: &Path,
    tx: mpsc::Sender<ZtunnelConnection>,
) -> Result<BoundPath, ZdsServerError> {
    let listen_err = |reason: String| ZdsServerError::Listen {
        path: path.to_path_buf(),
        reason,
    };
    super::sockets::prepare(path).map_err(|e| listen_err(e.to_string()))?;
    let listener = ZdsListener::bind(path).map_err(|e| listen_err(e.to_string()))?;
    let bound = BoundPath::new(path);
    let shown = path.display().to_string();
    std::thread::Builder::new()
        .name("ambit-zds-accept".into())
        .spawn(move || {
            loop {
                if tx.is_closed() {
                    return;
                }
                // The timeout also bounds every later request's ack.
                match listener.accept(ACK_TIMEOUT) {
                    Ok(conn) => {
                        tracing::info!(socket = %shown, "ztunnel connected");
                        let z = ZtunnelConnection {
                            conn: Arc::new(Mutex::new(conn)),
                        };
                        if tx.blocking_send(z).is_err() {
                            return;
                        }
                    }
                    // Timeouts are how the loop notices shutdown.
                    Err(e) if e.is_timeout() => {}
                    // Connected and left without a hello: another node
                    // agent checking whether this one still serves.
                    Err(ambit_inpod::ZdsError::Closed { .. }) => {
                        tracing::debug!(socket = %shown, "a client connected to the ZDS socket and left without a hello");
                    }
                    Err(e) => {
                        tracing::warn!(socket = %shown, error = %e, "ZDS accept failed");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })
        .map_err(|e| listen_err(e.to_string()))?;
    Ok(bound)
}
