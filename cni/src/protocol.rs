//! What the CNI plugin and the node agent say to each other: one JSON
//! request per connection on the agent's unix stream socket, one JSON
//! reply, each a single line.
//!
//! The plugin reports every pod it sees (ADD, DEL, CHECK); the agent
//! decides whether the pod is enrolled (its namespace's
//! `istio.io/dataplane-mode` label, the pod's opt-out label), and for an
//! enrolled pod installs the redirection and hands it to ztunnel before
//! answering, so the pod's containers start already captured. The agent
//! also needs the non-enrolled pods: a namespace may gain the label later.

use std::net::IpAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Default path of the node agent's socket for the plugin.
pub const DEFAULT_AGENT_SOCKET: &str = "/var/run/ambit/cni.sock";

/// The CNI command being reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Command {
    Add,
    Del,
    Check,
}

/// The pod, from `CNI_ARGS` (`K8S_POD_NAME`, `K8S_POD_NAMESPACE`,
/// `K8S_POD_UID`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRef {
    pub name: String,
    pub namespace: String,
    /// May be empty: older runtimes do not pass `K8S_POD_UID`.
    #[serde(default)]
    pub uid: String,
}

/// One plugin invocation, as the agent needs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub command: Command,
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_NETNS`: the pod's network namespace path (empty on some DELs).
    #[serde(default)]
    pub netns: PathBuf,
    /// `CNI_IFNAME`.
    #[serde(default)]
    pub ifname: String,
    pub pod: PodRef,
    /// The pod's IPs, from `prevResult` (ADD, CHECK).
    #[serde(default)]
    pub ips: Vec<IpAddr>,
}

/// The agent's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// The request was handled (for ADD: the pod is set up as it should be,
    /// enrolled or not).
    pub ok: bool,
    /// Whether the pod is (now) enrolled in the mesh.
    #[serde(default)]
    pub enrolled: bool,
    /// What went wrong, for the runtime's error message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The failure is transient (ztunnel not connected yet, ...): the
    /// plugin answers CNI error 11 "try again later".
    #[serde(default)]
    pub retry: bool,
}

impl Reply {
    /// Success.
    pub fn ok(enrolled: bool) -> Self {
        Self {
            ok: true,
            enrolled,
            error: None,
            retry: false,
        }
    }

    /// A failure; `retry` when trying again later may succeed.
    pub fn error(msg: impl Into<String>, retry: bool) -> Self {
        Self {
            ok: false,
            enrolled: false,
            error: Some(msg.into()),
            retry,
        }
    }
}

/// How a JSON value reads in an error message ("a string", "an array", ...).
pub fn json_kind(v: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
