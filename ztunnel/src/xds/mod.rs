//! Delta ADS client: one `DeltaAggregatedResources` stream to the control
//! plane, subscribed to every `istio.workload.Address` and
//! `istio.security.Authorization`, feeding the [`crate::state`] store.
//!
//! - [`client`]: the connection loop (connect, subscribe, ACK/NACK,
//!   reconnect with backoff, on-demand requests).
//! - [`handler`]: turns one response into state changes and an ACK or NACK.

mod client;
mod handler;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::PathBuf;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use tokio::sync::mpsc;

use crate::state::StateError;

pub use self::client::{XdsClient, XdsClientConfig};
pub use self::handler::{Handled, handle_response};

/// Wildcard resource name: "everything of this type".
pub const WILDCARD: &str = "*";

/// Errors of the xDS client.
#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    /// `--xds-address` is not a URL tonic can connect to.
    #[error(
        "invalid xDS address {addr:?}: {}; set --xds-address / XDS_ADDRESS to a URL like http://127.0.0.1:15010",
        error_chain(.source)
    )]
    InvalidAddress {
        /// The configured address.
        addr: String,
        /// Why it was refused.
        #[source]
        source: tonic::transport::Error,
    },
    /// The TLS side of an `https://` xDS address could not be set up (no
    /// `--root-cert`, an unusable root file, a scheme other than http/https).
    #[error("cannot set up the xDS channel: {0}")]
    ControlChannel(#[source] Box<crate::control_channel::ControlChannelError>),
    /// The TCP/HTTP2 connection could not be made.
    #[error(
        "could not connect to the control plane at {addr}: {}; is the control plane reachable at {addr}?",
        error_chain(.source)
    )]
    Connect {
        /// The control plane address.
        addr: String,
        /// What failed.
        #[source]
        source: tonic::transport::Error,
    },
    /// The server refused or broke the stream.
    #[error(
        "xDS stream to {addr} failed: {status}; check the control plane's logs (a token problem shows up as Unauthenticated)"
    )]
    Stream {
        /// The control plane address.
        addr: String,
        /// The gRPC status.
        status: Box<tonic::Status>,
    },
    /// The server ended the stream without an error.
    #[error("the control plane at {addr} closed the xDS stream; reconnecting")]
    Closed {
        /// The control plane address.
        addr: String,
    },
    /// The token file could not be read.
    #[error(
        "could not read the xDS token from {path}: {source}; check --token-file / TOKEN_FILE and the file's permissions"
    )]
    TokenRead {
        /// The token file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The token is not usable as an HTTP header value.
    #[error(
        "the token in {path} is not a valid header value (empty, or contains non-ASCII or control characters); rewrite the file"
    )]
    TokenInvalid {
        /// The token file.
        path: PathBuf,
    },
    /// A resource's body does not decode as the expected message.
    #[error(
        "resource {name:?} of {type_url} does not decode as {expected}: {source}; are the ztunnel and control plane protos out of sync?"
    )]
    Decode {
        /// xDS type URL.
        type_url: String,
        /// Resource name.
        name: String,
        /// Expected message.
        expected: &'static str,
        /// Decoder error.
        #[source]
        source: prost::DecodeError,
    },
    /// A resource's body is some other message type.
    #[error("resource {name:?} of {type_url} carries a {got} body")]
    WrongBodyType {
        /// xDS type URL.
        type_url: String,
        /// Resource name.
        name: String,
        /// Type URL of the body.
        got: String,
    },
    /// A resource decodes but is not valid.
    #[error("resource {name:?} of {type_url} is invalid: {source}")]
    InvalidResource {
        /// xDS type URL.
        type_url: String,
        /// Resource name.
        name: String,
        /// What is wrong with it.
        #[source]
        source: StateError,
    },
    /// The server sent a type this client did not subscribe to.
    #[error(
        "unsupported xDS type {type_url}; this ztunnel only handles {} and {}",
        ambit_proto::ADDRESS_TYPE_URL,
        ambit_proto::AUTHORIZATION_TYPE_URL
    )]
    UnknownType {
        /// The type URL received.
        type_url: String,
    },
    /// The outgoing request queue of the stream is gone (the stream ended).
    #[error("the xDS stream to {addr} ended while sending a request; reconnecting")]
    SendFailed {
        /// The control plane address.
        addr: String,
    },
    /// Too many on-demand requests are waiting for the xDS task.
    #[error("on-demand request for {name:?} dropped: the xDS request queue is full; retry later")]
    OnDemandQueueFull {
        /// The requested name.
        name: String,
    },
    /// The xDS task has stopped (the ztunnel is shutting down).
    #[error("on-demand request for {name:?} dropped: the xDS client has stopped")]
    OnDemandStopped {
        /// The requested name.
        name: String,
    },
}

/// `error: cause: cause` — tonic's transport errors say only "transport
/// error" at the top; the useful part ("Connection refused") is below.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = cause.source();
    }
    out
}

/// Handle to ask the running xDS client for resources on demand.
#[derive(Debug, Clone)]
pub struct XdsHandle {
    on_demand: mpsc::Sender<String>,
}

impl XdsHandle {
    /// Subscribes to the Address resource `name` (`network/ip`, a workload
    /// uid or `namespace/hostname`) on the current stream, and on every
    /// later one. Returns at once; the resource shows up in the state when
    /// the server sends it (watch [`crate::state::StateReader::generation`]).
    pub fn request_address(&self, name: impl Into<String>) -> Result<(), XdsError> {
        use mpsc::error::TrySendError;
        self.on_demand.try_send(name.into()).map_err(|e| match e {
            TrySendError::Full(name) => XdsError::OnDemandQueueFull { name },
            TrySendError::Closed(name) => XdsError::OnDemandStopped { name },
        })
    }
}

/// The Node sent on the first request of each stream.
pub fn node(node_name: &str, cluster_id: &str, network: &str) -> Node {
    let string = |s: &str| Value {
        kind: Some(Kind::StringValue(s.to_string())),
    };
    let fields: HashMap<String, Value> = [
        ("NODE_NAME".to_string(), string(node_name)),
        ("CLUSTER_ID".to_string(), string(cluster_id)),
        ("NETWORK".to_string(), string(network)),
    ]
    .into_iter()
    .collect();
    Node {
        id: format!(
            "ztunnel~0.0.0.0~ztunnel-{node_name}.ambit-system~ambit-system.svc.cluster.local"
        ),
        metadata: Some(Struct { fields }),
        user_agent_name: "ambit-ztunnel".to_string(),
        ..Default::default()
    }
}
