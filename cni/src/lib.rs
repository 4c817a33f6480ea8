//! Ambit's ambient enrollment: the CNI plugin the container runtime execs
//! (`ambit-cni`) and the node agent (`ambit-node-agent`) that installs it,
//! programs each enrolled pod's traffic redirection and hands the pod to the
//! node's ztunnel over ZDS.
//!
//! ```text
//! runtime ──exec──▶ ambit-cni ──unix socket (protocol)──▶ node agent ──ZDS──▶ ztunnel
//!                    (chained after bridge/host-local)      │ redirect::install in the pod netns
//! ```
#![forbid(unsafe_code)]

pub mod agent;
pub mod plugin;
pub mod protocol;
pub mod redirect;
pub mod subprocess;
