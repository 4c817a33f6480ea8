//! ztunnel's end of ZDS: connect to the node agent, say hello, turn each
//! request into an [`InpodEvent`] for the owner of the in-pod state, and ack
//! it with the owner's answer.
//!
//! A message ztunnel cannot use gets an error ack and the connection goes
//! on; when the agent goes away the client reconnects with backoff, and the
//! owner keeps its pods meanwhile. The owner (ztunnel's in-pod manager) is
//! reached through a channel of [`InpodCommand`]s and answers each on a
//! oneshot, so this module knows nothing of listeners or proxies.

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use ambit_proto::workload::zds::WorkloadInfo;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use super::message::{decode_request, encode_ack, encode_hello};
use super::seqpacket::{Received, SeqpacketConn};
use super::{MAX_MESSAGE, ZdsError, ZdsMessage, ZdsRequestError};
use crate::netns::PodNetns;

/// What the owner of the in-pod state is asked to do.
#[derive(Debug)]
pub enum InpodEvent {
    /// A (new) connection to the node agent: a snapshot follows, ended by
    /// [`InpodEvent::SnapshotSent`]. Not a wire message.
    Connected,
    Add {
        uid: String,
        info: WorkloadInfo,
        netns: PodNetns,
    },
    Keep {
        uid: String,
    },
    Del {
        uid: String,
    },
    SnapshotSent,
}

/// One event and where to send its outcome (`Err` text goes into the ack).
#[derive(Debug)]
pub struct InpodCommand {
    pub event: InpodEvent,
    pub reply: oneshot::Sender<Result<(), String>>,
}

/// Settings of the ZDS client.
#[derive(Debug, Clone)]
pub struct ZdsClientConfig {
    /// The node agent's socket.
    pub path: PathBuf,
    /// First reconnect delay; doubles up to `backoff_max`.
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
}

impl ZdsClientConfig {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
        }
    }
}

/// ztunnel's ZDS client; [`ZdsClient::run`] until shut down.
#[derive(Debug)]
pub struct ZdsClient {
    cfg: ZdsClientConfig,
    handler: mpsc::Sender<InpodCommand>,
}

/// How one connection ended.
enum Served {
    /// The hello went out, then the connection ended: retry soon.
    Spoke,
    /// The owner is gone: stop.
    OwnerGone,
}

impl ZdsClient {
    pub fn new(cfg: ZdsClientConfig, handler: mpsc::Sender<InpodCommand>) -> Self {
        Self { cfg, handler }
    }

    /// Connects, serves, and reconnects with backoff, until `shutdown`
    /// resolves (or the owner's channel closes). Whatever is in flight when
    /// `shutdown` resolves is dropped unanswered.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut delay = self.cfg.backoff_initial;
        let mut failures: u32 = 0;
        loop {
            let outcome = tokio::select! {
                _ = &mut shutdown => return,
                r = self.serve_once() => r,
            };
            match outcome {
                Ok(Served::OwnerGone) => return,
                Ok(Served::Spoke) => {
                    delay = self.cfg.backoff_initial;
                    failures = 0;
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    // Say it loudly once, then quietly while it stays down.
                    if failures == 1 {
                        warn!(error = %e, retry_in = ?delay, "ZDS: node agent unreachable");
                    } else {
                        debug!(error = %e, failures, retry_in = ?delay, "ZDS: still unreachable");
                    }
                }
            }
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(self.cfg.backoff_max);
        }
    }

    /// One connection. `Ok(Spoke)` once the hello went out and the agent then
    /// closed, so the next attempt starts from the short delay.
    async fn serve_once(&self) -> Result<Served, ZdsError> {
        let path = &self.cfg.path;
        let conn = SeqpacketConn::connect(path)?;
        conn.send(&encode_hello())
            .await
            .map_err(|source| ZdsError::Io {
                path: path.clone(),
                op: "sending ZdsHello",
                source,
            })?;
        info!(path = %path.display(), "ZDS: connected to the node agent");
        if self.dispatch(InpodEvent::Connected).await.is_err() {
            return Ok(Served::OwnerGone);
        }
        let mut buf = vec![0u8; MAX_MESSAGE];
        loop {
            let received = match conn.recv(&mut buf).await {
                Ok(r) => r,
                Err(source) => {
                    let e = ZdsError::Io {
                        path: path.clone(),
                        op: "receiving",
                        source,
                    };
                    warn!(error = %e, "ZDS: connection broken; reconnecting");
                    return Ok(Served::Spoke);
                }
            };
            let empty = received.len == 0 && received.fds.is_empty() && !received.truncated;
            if empty && conn.at_eof() {
                info!(path = %path.display(), "ZDS: the node agent closed the connection");
                return Ok(Served::Spoke);
            }
            let outcome = if empty {
                Err(ZdsRequestError::Empty.to_string())
            } else {
                self.handle(&buf[..received.len], received).await
            };
            let ack = match &outcome {
                Ok(()) => String::new(),
                Err(reason) => {
                    warn!(%reason, "ZDS: refusing request");
                    reason.clone()
                }
            };
            if let Err(source) = conn.send(&encode_ack(&ack)).await {
                warn!(error = %source, "ZDS: cannot send ack; reconnecting");
                return Ok(Served::Spoke);
            }
        }
    }

    /// Turns one datagram into an event for the owner and waits for its outcome.
    async fn handle(&self, bytes: &[u8], received: Received) -> Result<(), String> {
        if received.truncated {
            return Err(ZdsRequestError::Truncated.to_string());
        }
        let msg = decode_request(bytes).map_err(|e| e.to_string())?;
        debug!(kind = msg.kind(), "ZDS: request");
        let mut fds = received.fds;
        let event = match msg {
            ZdsMessage::Add { uid, info } => {
                let fd = match fds.len() {
                    0 => return Err(ZdsRequestError::MissingFd { uid }.to_string()),
                    1 => fds.remove(0),
                    count => return Err(ZdsRequestError::TooManyFds { uid, count }.to_string()),
                };
                let netns = fd
                    .map_err(|e| e.to_string())
                    .and_then(|fd| {
                        PodNetns::from_fd(fd, &format!("netns fd of pod uid {uid:?}"))
                            .map_err(|e| e.to_string())
                    })
                    .map_err(|reason| {
                        ZdsRequestError::BadFd {
                            uid: uid.clone(),
                            reason,
                        }
                        .to_string()
                    })?;
                InpodEvent::Add { uid, info, netns }
            }
            other if !fds.is_empty() => {
                return Err(ZdsRequestError::UnexpectedFds {
                    kind: other.kind(),
                    count: fds.len(),
                }
                .to_string());
            }
            ZdsMessage::Keep { uid } => InpodEvent::Keep { uid },
            ZdsMessage::Del { uid } => InpodEvent::Del { uid },
            ZdsMessage::SnapshotSent => InpodEvent::SnapshotSent,
        };
        self.dispatch(event).await
    }

    async fn dispatch(&self, event: InpodEvent) -> Result<(), String> {
        let (reply, outcome) = oneshot::channel();
        let shutting_down = || ZdsRequestError::ShuttingDown.to_string();
        self.handler
            .send(InpodCommand { event, reply })
            .await
            .map_err(|_| shutting_down())?;
        outcome.await.map_err(|_| shutting_down())?
    }
}
