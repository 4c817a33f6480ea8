//! What ZDS datagrams hold: one protobuf message each (`istio.workload.zds`).
//!
//! The agent sends `WorkloadRequest`s (add, keep, del, snapshot-sent);
//! ztunnel answers each with `WorkloadResponse{Ack}`, whose `error` is empty
//! on success and says why otherwise. A connection starts with ztunnel's
//! `ZdsHello{V1}`. This module only encodes and decodes; the fd that goes
//! with an add travels beside the bytes (see [`super::seqpacket`]).

use ambit_proto::workload::zds::{
    Ack, AddWorkload, DelWorkload, KeepWorkload, Version, WorkloadInfo, WorkloadRequest,
    WorkloadResponse, ZdsHello, workload_request, workload_response,
};
use prost::Message;

use super::{MAX_FDS, MAX_MESSAGE, ZdsError};

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

/// Encodes a `WorkloadRequest` (the node agent's side).
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
