//! The plugin's errors and the CNI error codes they map to (CNI spec 1.0.0,
//! "Error": codes 1-99 are reserved by the spec, 100+ are ours).

use std::path::PathBuf;

use serde::Serialize;

use super::config::SUPPORTED_VERSIONS;

/// CNI code 1: incompatible CNI version.
pub const CODE_INCOMPATIBLE_VERSION: u32 = 1;
/// CNI code 2: unsupported field in network configuration.
pub const CODE_UNSUPPORTED_FIELD: u32 = 2;
/// CNI code 4: invalid necessary environment variables.
pub const CODE_INVALID_ENV: u32 = 4;
/// CNI code 5: I/O failure.
pub const CODE_IO: u32 = 5;
/// CNI code 6: failed to decode content.
pub const CODE_DECODE: u32 = 6;
/// CNI code 7: invalid network configuration.
pub const CODE_INVALID_CONFIG: u32 = 7;
/// CNI code 11: try again later.
pub const CODE_TRY_AGAIN: u32 = 11;
/// CNI code 50: the plugin is not available (STATUS).
pub const CODE_NOT_AVAILABLE: u32 = 50;
/// Ours: the node agent refused the pod (permanent failure).
pub const CODE_AGENT_REFUSED: u32 = 999;

/// Everything that makes an invocation fail.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The configuration's `cniVersion` is missing or not one we speak.
    #[error("incompatible CNI version: {0}")]
    IncompatibleVersion(String),
    /// A key inside the `ambit` section we do not know (or one of our
    /// options written at the top level).
    #[error("unsupported field in network configuration: {0}")]
    UnsupportedField(String),
    /// A `CNI_*` variable is missing or malformed.
    #[error("invalid environment variables: {0}")]
    InvalidEnv(String),
    /// Reading stdin failed.
    #[error("I/O failure: {0}")]
    Io(String),
    /// stdin is not a JSON object (empty, truncated, not JSON, too large).
    #[error("failed to decode the network configuration on stdin: {0}")]
    Decode(String),
    /// Valid JSON, but not a valid configuration for this plugin.
    #[error("invalid network configuration: {0}")]
    InvalidConfig(String),
    /// The node agent could not be reached or did not answer in time.
    #[error("the ambit node agent at {} is not available: {cause}", socket.display())]
    AgentUnavailable { socket: PathBuf, cause: String },
    /// The node agent answered with a transient failure.
    #[error("the ambit node agent cannot set the pod up yet: {0}")]
    AgentRetry(String),
    /// The node agent answered with a permanent failure.
    #[error("the ambit node agent refused the pod: {0}")]
    AgentRefused(String),
    /// The node agent answered something that is not a reply.
    #[error("the ambit node agent sent an invalid reply: {0}")]
    AgentProtocol(String),
    /// STATUS: the node agent's socket is not connectable.
    #[error("plugin not available: the ambit node agent at {} is not reachable: {cause}", socket.display())]
    NotAvailable { socket: PathBuf, cause: String },
}

impl PluginError {
    /// The CNI error code.
    pub fn code(&self) -> u32 {
        match self {
            Self::IncompatibleVersion(_) => CODE_INCOMPATIBLE_VERSION,
            Self::UnsupportedField(_) => CODE_UNSUPPORTED_FIELD,
            Self::InvalidEnv(_) => CODE_INVALID_ENV,
            Self::Io(_) => CODE_IO,
            Self::Decode(_) => CODE_DECODE,
            Self::InvalidConfig(_) => CODE_INVALID_CONFIG,
            Self::AgentUnavailable { .. } | Self::AgentRetry(_) => CODE_TRY_AGAIN,
            Self::AgentRefused(_) | Self::AgentProtocol(_) => CODE_AGENT_REFUSED,
            Self::NotAvailable { .. } => CODE_NOT_AVAILABLE,
        }
    }

    /// What to do about it, for the error JSON's `details`.
    pub fn details(&self) -> String {
        match self {
            Self::IncompatibleVersion(_) => format!(
                "set \"cniVersion\" to one of {}",
                SUPPORTED_VERSIONS.join(", ")
            ),
            Self::UnsupportedField(_) => format!(
                "ambit-cni options go in the \"ambit\" object; its keys are {}",
                super::config::AMBIT_KEYS.join(", ")
            ),
            Self::InvalidEnv(_) => "the container runtime must set CNI_COMMAND, CNI_CONTAINERID, \
                 CNI_NETNS and CNI_IFNAME (CNI spec, \"Parameters\"); CNI_ARGS is \
                 KEY=VALUE pairs separated by ';'"
                .to_string(),
            Self::Io(_) => "the runtime must pass the network configuration on stdin".to_string(),
            Self::Decode(_) => {
                "stdin must be one JSON object: the network configuration (CNI spec, \
                 \"Section 1: Network configuration format\")"
                    .to_string()
            }
            Self::InvalidConfig(_) => "ambit-cni is a chained plugin: list it after the \
                 interface plugin (e.g. bridge) in the conflist so it receives \"prevResult\""
                .to_string(),
            Self::AgentUnavailable { .. } => "check that ambit-node-agent runs on this node \
                 and listens on this socket (\"ambit\": {\"agent_socket\": ...}); the pod is \
                 not started so it never runs outside the mesh; set \"ambit\": \
                 {\"allow_without_agent\": true} to let pods start unenrolled instead"
                .to_string(),
            Self::AgentRetry(_) => {
                "transient: the runtime retries the sandbox creation".to_string()
            }
            Self::AgentRefused(_) | Self::AgentProtocol(_) => {
                "see the ambit-node-agent log on this node".to_string()
            }
            Self::NotAvailable { .. } => {
                "start ambit-node-agent on this node (it serves the plugin's socket)".to_string()
            }
        }
    }
}

/// The CNI error JSON (spec "Error" result type).
#[derive(Debug, Serialize)]
pub struct ErrorJson<'a> {
    #[serde(rename = "cniVersion")]
    pub cni_version: &'a str,
    pub code: u32,
    pub msg: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub details: String,
}

impl<'a> ErrorJson<'a> {
    /// The error JSON for `err`, in `cni_version`.
    pub fn new(cni_version: &'a str, err: &PluginError) -> Self {
        Self {
            cni_version,
            code: err.code(),
            msg: err.to_string(),
            details: err.details(),
        }
    }

    /// Serialized, with a trailing newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = serde_json::to_vec(self).unwrap_or_else(|_| {
            // Cannot happen for this struct; keep a valid error anyway.
            br#"{"cniVersion":"1.0.0","code":999,"msg":"cannot serialize the error"}"#.to_vec()
        });
        out.push(b'\n');
        out
    }
}
