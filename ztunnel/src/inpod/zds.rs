//! ztunnel's end of ZDS, the node agent → ztunnel protocol (SPEC §4).
//!
//! ztunnel connects to the node agent's unix `SOCK_SEQPACKET` socket and
//! sends `ZdsHello{V1}`. Then, one datagram each, the agent sends
//! `WorkloadRequest`s (an `AddWorkload` carries the pod's netns fd as
//! `SCM_RIGHTS`), and ztunnel answers every one with `WorkloadResponse{Ack}`
//! — `error` empty on success, otherwise the reason. A message ztunnel cannot
//! use gets an error ack and the connection goes on; when the agent goes
//! away ztunnel reconnects with backoff and keeps its pods meanwhile.
//!
//! Requests are handed, as [`InpodCommand`]s, to one owner task (see
//! [`super::manager`]), which answers through a oneshot.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use ambit_proto::workload::zds::{
    Ack, AddWorkload, DelWorkload, KeepWorkload, Version, WorkloadInfo, WorkloadRequest,
    WorkloadResponse, ZdsHello, workload_request, workload_response,
};
use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use prost::Message;
use socket2::{Domain, SockAddr, Socket, Type};
use tokio::io::Interest;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use super::netns::PodNetns;
use crate::drain::DrainWatcher;

/// Where Istio's node agent listens by default; ours too.
pub const DEFAULT_ZDS_PATH: &str = "/var/run/ztunnel/ztunnel.sock";
/// Largest datagram accepted; a `WorkloadRequest` is a few hundred bytes.
pub const MAX_MESSAGE: usize = 64 * 1024;
/// fds accepted in one datagram before the rest are truncated by the kernel.
const MAX_FDS: usize = 16;

/// Connection-level ZDS failures (a single bad message is a
/// [`ZdsRequestError`], answered in its ack instead).
#[derive(Debug, thiserror::Error)]
pub enum ZdsError {
    #[error(
        "cannot connect to the node agent's ZDS socket {path}: {source} (is ambit-node-agent \
         running on this node, and is its socket directory mounted into ztunnel?)"
    )]
    Connect { path: PathBuf, source: io::Error },
    #[error("ZDS connection {path}: {op} failed: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: io::Error,
    },
    #[error("the node agent closed the ZDS connection {path}")]
    Closed { path: PathBuf },
    #[error("ZDS {what}: {reason}")]
    Protocol { what: &'static str, reason: String },
}

/// Why one `WorkloadRequest` was refused; the text goes back in `Ack.error`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ZdsRequestError {
    #[error("cannot decode WorkloadRequest ({len} bytes): {reason}")]
    Decode { len: usize, reason: String },
    #[error(
        "WorkloadRequest has no payload or one this ztunnel does not know; it understands add, \
         keep, del and snapshot_sent"
    )]
    NoPayload,
    #[error(
        "message truncated: larger than {MAX_MESSAGE} bytes or carrying more than {MAX_FDS} fds"
    )]
    Truncated,
    #[error("empty datagram; send one encoded WorkloadRequest per datagram")]
    Empty,
    #[error("{kind} has an empty uid; send the pod's uid")]
    EmptyUid { kind: &'static str },
    #[error(
        "AddWorkload for uid {uid:?} came without the pod's netns fd; send it as SCM_RIGHTS \
         ancillary data in the same datagram"
    )]
    MissingFd { uid: String },
    #[error("AddWorkload for uid {uid:?} came with {count} fds; send exactly one, the pod's netns")]
    TooManyFds { uid: String, count: usize },
    #[error("{kind} carried {count} fd(s); only AddWorkload carries one (the pod's netns)")]
    UnexpectedFds { kind: &'static str, count: usize },
    #[error("the fd sent with AddWorkload for uid {uid:?} is unusable: {reason}")]
    BadFd { uid: String, reason: String },
    #[error("ztunnel is shutting down and cannot take workloads")]
    ShuttingDown,
}

/// A decoded `WorkloadRequest`, before its fd (if any) is attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ZdsMessage {
    Add { uid: String, info: WorkloadInfo },
    Keep { uid: String },
    Del { uid: String },
    SnapshotSent,
}

impl ZdsMessage {
    /// The protobuf message name, for logs and errors.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Add { .. } => "AddWorkload",
            Self::Keep { .. } => "KeepWorkload",
            Self::Del { .. } => "DelWorkload",
            Self::SnapshotSent => "SnapshotSent",
        }
    }
}

/// Decodes one datagram's bytes.
pub fn decode_request(bytes: &[u8]) -> Result<ZdsMessage, ZdsRequestError> {
    use workload_request::Payload;
    let req = WorkloadRequest::decode(bytes).map_err(|e| ZdsRequestError::Decode {
        len: bytes.len(),
        reason: e.to_string(),
    })?;
    let nonempty = |uid: String, kind| {
        if uid.is_empty() {
            Err(ZdsRequestError::EmptyUid { kind })
        } else {
            Ok(uid)
        }
    };
    match req.payload {
        Some(Payload::Add(AddWorkload { uid, workload_info })) => Ok(ZdsMessage::Add {
            uid: nonempty(uid, "AddWorkload")?,
            info: workload_info.unwrap_or_default(),
        }),
        Some(Payload::Keep(KeepWorkload { uid })) => Ok(ZdsMessage::Keep {
            uid: nonempty(uid, "KeepWorkload")?,
        }),
        Some(Payload::Del(DelWorkload { uid })) => Ok(ZdsMessage::Del {
            uid: nonempty(uid, "DelWorkload")?,
        }),
        Some(Payload::SnapshotSent(_)) => Ok(ZdsMessage::SnapshotSent),
        None => Err(ZdsRequestError::NoPayload),
    }
}

/// Encodes a `WorkloadRequest` (the node agent's side; used by tests).
pub fn encode_request(msg: &ZdsMessage) -> Vec<u8> {
    use workload_request::Payload;
    let payload = match msg.clone() {
        ZdsMessage::Add { uid, info } => Payload::Add(AddWorkload {
            uid,
            workload_info: Some(info),
        }),
        ZdsMessage::Keep { uid } => Payload::Keep(KeepWorkload { uid }),
        ZdsMessage::Del { uid } => Payload::Del(DelWorkload { uid }),
        ZdsMessage::SnapshotSent => Payload::SnapshotSent(Default::default()),
    };
    WorkloadRequest {
        payload: Some(payload),
    }
    .encode_to_vec()
}

/// `WorkloadResponse{Ack{error}}`; `error` empty on success.
pub fn encode_ack(error: &str) -> Vec<u8> {
    WorkloadResponse {
        payload: Some(workload_response::Payload::Ack(Ack {
            error: error.to_string(),
        })),
    }
    .encode_to_vec()
}

/// Decodes an ack: `Ok("")` on success, `Ok(reason)` for a refused request.
pub fn decode_ack(bytes: &[u8]) -> Result<String, ZdsError> {
    let resp = WorkloadResponse::decode(bytes).map_err(|e| ZdsError::Protocol {
        what: "WorkloadResponse",
        reason: e.to_string(),
    })?;
    match resp.payload {
        Some(workload_response::Payload::Ack(ack)) => Ok(ack.error),
        None => Err(ZdsError::Protocol {
            what: "WorkloadResponse",
            reason: "no ack payload".to_string(),
        }),
    }
}

/// `ZdsHello{version: V1}`.
pub fn encode_hello() -> Vec<u8> {
    ZdsHello {
        version: Version::V1 as i32,
    }
    .encode_to_vec()
}

/// Decodes a hello and checks it speaks V1.
pub fn decode_hello(bytes: &[u8]) -> Result<(), ZdsError> {
    let hello = ZdsHello::decode(bytes).map_err(|e| ZdsError::Protocol {
        what: "ZdsHello",
        reason: e.to_string(),
    })?;
    if hello.version == Version::V1 as i32 {
        Ok(())
    } else {
        Err(ZdsError::Protocol {
            what: "ZdsHello",
            reason: format!("version {} is not V1 (1)", hello.version),
        })
    }
}

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

/// ztunnel's ZDS client; [`ZdsClient::run`] until drained.
#[derive(Debug)]
pub struct ZdsClient {
    cfg: ZdsClientConfig,
    handler: mpsc::Sender<InpodCommand>,
}

impl ZdsClient {
    pub fn new(cfg: ZdsClientConfig, handler: mpsc::Sender<InpodCommand>) -> Self {
        Self { cfg, handler }
    }

    /// Connects, serves, and reconnects with backoff, until `drain` fires.
    pub async fn run(self, drain: DrainWatcher) {
        let mut delay = self.cfg.backoff_initial;
        let mut failures: u32 = 0;
        loop {
            let outcome = tokio::select! {
                _ = drain.signaled() => return,
                r = self.serve_once(&drain) => r,
            };
            match outcome {
                Ok(Served::Drained) => return,
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
                _ = drain.signaled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(self.cfg.backoff_max);
        }
    }

    /// One connection. `Ok(Spoke)` once the hello went out and the agent then
    /// closed, so the next attempt starts from the short delay.
    async fn serve_once(&self, drain: &DrainWatcher) -> Result<Served, ZdsError> {
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
            return Ok(Served::Drained);
        }
        let mut buf = vec![0u8; MAX_MESSAGE];
        loop {
            let received = tokio::select! {
                _ = drain.signaled() => return Ok(Served::Drained),
                r = conn.recv(&mut buf) => r.map_err(|source| ZdsError::Io {
                    path: path.clone(),
                    op: "receiving",
                    source,
                }),
            };
            let received = match received {
                Ok(r) => r,
                Err(e) => {
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

enum Served {
    Spoke,
    Drained,
}

/// One received datagram: its length, its fds (each already owned, or why
/// not), and whether the kernel truncated it.
struct Received {
    len: usize,
    fds: Vec<io::Result<OwnedFd>>,
    truncated: bool,
}

/// A connected, non-blocking `SOCK_SEQPACKET` socket driven by tokio.
///
/// Registered with tokio as a `UnixDatagram` — the only safe, non-deprecated
/// way to get readiness for an `OwnedFd` — but only used through readiness
/// plus raw `recvmsg`/`sendmsg`, which behave the same on either type.
struct SeqpacketConn {
    sock: tokio::net::UnixDatagram,
}

impl SeqpacketConn {
    fn connect(path: &Path) -> Result<Self, ZdsError> {
        let err = |source| ZdsError::Connect {
            path: path.to_path_buf(),
            source,
        };
        let sock = Socket::new(Domain::UNIX, Type::SEQPACKET, None).map_err(err)?;
        sock.set_nonblocking(true).map_err(err)?;
        sock.connect(&SockAddr::unix(path).map_err(err)?)
            .map_err(err)?;
        let std_sock = std::os::unix::net::UnixDatagram::from(OwnedFd::from(sock));
        let sock = tokio::net::UnixDatagram::from_std(std_sock).map_err(err)?;
        Ok(Self { sock })
    }

    async fn recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        let fd = self.sock.as_raw_fd();
        loop {
            self.sock.readable().await?;
            match self
                .sock
                .try_io(Interest::READABLE, || recv_datagram(fd, buf))
            {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                other => return other,
            }
        }
    }

    /// After a zero-length read: end of file, or an empty record? At EOF a
    /// peek reads 0 again; after an empty record it finds nothing yet.
    fn at_eof(&self) -> bool {
        let mut byte = [0u8; 1];
        let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
        !matches!(
            nix::sys::socket::recv(self.sock.as_raw_fd(), &mut byte, flags),
            Err(nix::errno::Errno::EAGAIN) | Ok(1..)
        )
    }

    async fn send(&self, bytes: &[u8]) -> io::Result<()> {
        let fd = self.sock.as_raw_fd();
        loop {
            self.sock.writable().await?;
            match self
                .sock
                .try_io(Interest::WRITABLE, || send_datagram(fd, bytes, &[]))
            {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                other => return other,
            }
        }
    }
}

/// Sends one datagram, with `fds` as `SCM_RIGHTS` when non-empty.
pub(crate) fn send_datagram(fd: RawFd, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    use nix::sys::socket::ControlMessage;
    let iov = [IoSlice::new(bytes)];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    let sent = sendmsg::<()>(fd, &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    if sent == bytes.len() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "sent {sent} of {} bytes of a datagram",
            bytes.len()
        )))
    }
}

/// Receives one datagram. Every fd that arrives is owned at once (closed
/// on drop), so a refused message leaks nothing.
fn recv_datagram(fd: RawFd, buf: &mut [u8]) -> io::Result<Received> {
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(fd, &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let mut truncated = msg.flags.contains(MsgFlags::MSG_TRUNC);
    let mut raw_fds = Vec::new();
    match msg.cmsgs() {
        Ok(cmsgs) => {
            for c in cmsgs {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    raw_fds.extend(fds);
                }
            }
        }
        // MSG_CTRUNC: the kernel dropped what did not fit.
        Err(_) => truncated = true,
    }
    let len = msg.bytes;
    let fds = raw_fds.into_iter().map(adopt_fd).collect();
    Ok(Received {
        len,
        fds,
        truncated,
    })
}

/// Takes ownership of an fd that just arrived with `SCM_RIGHTS`, without
/// `unsafe`: reopen it through `/proc/self/fd` (same namespace, new fd we
/// own), then close the received number.
pub(crate) fn adopt_fd(raw: RawFd) -> io::Result<OwnedFd> {
    let reopened = std::fs::File::open(format!("/proc/self/fd/{raw}"));
    let closed = nix::unistd::close(raw);
    let file = reopened.map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("reopening received fd {raw} through /proc/self/fd: {e}"),
        )
    })?;
    if let Err(e) = closed {
        warn!(fd = raw, error = %e, "ZDS: closing a received fd failed");
    }
    Ok(OwnedFd::from(file))
}

/// The node agent's end of ZDS, blocking, with timeouts: what tests use to
/// hand pods over, and a reference for the node agent.
pub mod agent {
    use std::io::Read;
    use std::os::fd::{AsRawFd, BorrowedFd};
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    use socket2::{Domain, SockAddr, Socket, Type};

    use super::{MAX_MESSAGE, ZdsError, ZdsMessage, send_datagram};

    fn io_err(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> ZdsError {
        let path = path.to_path_buf();
        move |source| ZdsError::Io { path, op, source }
    }

    /// A listening ZDS socket.
    #[derive(Debug)]
    pub struct ZdsListener {
        sock: Socket,
        path: PathBuf,
    }

    impl ZdsListener {
        /// Binds and listens on `path` (which must not exist).
        pub fn bind(path: impl AsRef<Path>) -> Result<Self, ZdsError> {
            let path = path.as_ref();
            let sock =
                Socket::new(Domain::UNIX, Type::SEQPACKET, None).map_err(io_err(path, "socket"))?;
            sock.bind(&SockAddr::unix(path).map_err(io_err(path, "address"))?)
                .map_err(io_err(path, "bind"))?;
            sock.listen(16).map_err(io_err(path, "listen"))?;
            Ok(Self {
                sock,
                path: path.to_path_buf(),
            })
        }

        /// Waits up to `timeout` for ztunnel to connect and checks its hello.
        pub fn accept(&self, timeout: Duration) -> Result<ZdsAgentConn, ZdsError> {
            let path = &self.path;
            self.sock
                .set_read_timeout(Some(timeout))
                .map_err(io_err(path, "timeout"))?;
            let (sock, _) = self.sock.accept().map_err(io_err(path, "accept"))?;
            sock.set_read_timeout(Some(timeout))
                .map_err(io_err(path, "timeout"))?;
            let conn = ZdsAgentConn {
                sock,
                path: path.clone(),
            };
            let hello = conn.recv()?;
            super::decode_hello(&hello)?;
            Ok(conn)
        }
    }

    /// One accepted ztunnel connection.
    #[derive(Debug)]
    pub struct ZdsAgentConn {
        sock: Socket,
        path: PathBuf,
    }

    impl ZdsAgentConn {
        /// Sends raw bytes (any content) with optional fds.
        pub fn send_raw(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), ZdsError> {
            let raw: Vec<_> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
            send_datagram(self.sock.as_raw_fd(), bytes, &raw).map_err(io_err(&self.path, "sending"))
        }

        /// Receives one datagram (within the accept timeout).
        pub fn recv(&self) -> Result<Vec<u8>, ZdsError> {
            let mut buf = vec![0u8; MAX_MESSAGE];
            let n = (&self.sock)
                .read(&mut buf)
                .map_err(io_err(&self.path, "receiving"))?;
            if n == 0 {
                return Err(ZdsError::Closed {
                    path: self.path.clone(),
                });
            }
            buf.truncate(n);
            Ok(buf)
        }

        /// Receives an ack: `""` on success, otherwise the reason.
        pub fn recv_ack(&self) -> Result<String, ZdsError> {
            super::decode_ack(&self.recv()?)
        }

        /// Sends a request (with the netns fd for `Add`) and returns its ack.
        pub fn request(
            &self,
            msg: &ZdsMessage,
            fd: Option<BorrowedFd<'_>>,
        ) -> Result<String, ZdsError> {
            let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
            self.send_raw(&super::encode_request(msg), &fds)?;
            self.recv_ack()
        }

        /// Closes the connection (as an agent restart would).
        pub fn close(self) {
            drop(self.sock);
        }
    }
}
