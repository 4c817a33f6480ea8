//! ZDS, the node agent → ztunnel protocol (SPEC §4), both ends.
//!
//! ztunnel connects to the node agent's unix `SOCK_SEQPACKET` socket and
//! sends `ZdsHello{V1}`. Then, one datagram each, the agent sends
//! `WorkloadRequest`s (an `AddWorkload` carries the pod's netns fd as
//! `SCM_RIGHTS`), and ztunnel answers every one with `WorkloadResponse{Ack}`
//! — `error` empty on success, otherwise the reason. After a (re)connect the
//! agent sends every pod it has (add or keep), then `SnapshotSent`.
//!
//! * `message.rs`: encoding and decoding of the protobuf messages;
//! * `seqpacket.rs`: the framing (datagrams and their fds);
//! * `client.rs`: ztunnel's end ([`ZdsClient`]), which hands each request to
//!   the owner of ztunnel's pods as an [`InpodCommand`];
//! * `agent.rs`: the node agent's end ([`ZdsListener`], [`ZdsAgentConn`]).

mod agent;
mod client;
mod message;
mod seqpacket;

use std::io;
use std::path::PathBuf;

pub use agent::{ZdsAgentConn, ZdsListener};
pub use client::{InpodCommand, InpodEvent, ZdsClient, ZdsClientConfig};
pub use message::{
    ZdsMessage, ZdsRequestError, decode_ack, decode_hello, decode_request, encode_ack,
    encode_hello, encode_request,
};

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

impl ZdsError {
    /// Whether a blocking call gave up because its timeout passed (e.g. no
    /// ztunnel connected within [`ZdsListener::accept`]'s timeout).
    pub fn is_timeout(&self) -> bool {
        match self {
            Self::Io { source, .. } | Self::Connect { source, .. } => matches!(
                source.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
            Self::Closed { .. } | Self::Protocol { .. } => false,
        }
    }
}
