//! In-pod plumbing shared by ztunnel and the node agent (SPEC §4).
//!
//! ztunnel stays in the node's network namespace and opens its per-pod
//! listeners *inside* each enrolled pod's namespace; the node agent hands
//! it each pod's namespace over ZDS. This crate holds what both sides need
//! and nothing of either's policy:
//!
//! ```text
//!  node agent                                            ztunnel
//!  zds::ZdsListener ─accept─▶ zds::ZdsAgentConn ══ZDS══▶ zds::ZdsClient ──InpodCommand──▶ (ztunnel's in-pod manager)
//!    (SOCK_SEQPACKET; AddWorkload carries the pod netns fd as SCM_RIGHTS; every request acked)
//!
//!  netns::PodNetns: a pod's netns held by fd; sockets made on a thread that entered it
//!  netns::NetnsSockets: a long-lived socket thread per pod, for per-connection sockets
//! ```
//!
//! * [`zds`]: the protocol, both ends. ztunnel's client reports each request
//!   to an owner task and acks it with the owner's answer; it stops when a
//!   shutdown future the caller supplies resolves.
//! * [`netns`]: [`PodNetns`], [`NetnsSockets`], [`SocketOptions`]: the node
//!   agent runs its redirection commands in a pod's netns with them, and
//!   ztunnel makes its listeners and connections there.
//! * [`sidecar_capture`]: a sidecar pod's nat rules, installed by the
//!   injected init container (`ambit-agent redirect`) or by the node agent.
//!
//! Depends on `ambit-proto` and generic crates only, never on ztunnel, the
//! node agent or the control plane. No `unsafe`: a received fd is adopted
//! by reopening it through `/proc/self/fd`.
#![forbid(unsafe_code)]

pub mod netns;
pub mod sidecar_capture;
pub mod zds;

#[cfg(test)]
mod listener_tests;
#[cfg(test)]
mod tests;

pub use netns::{NetnsError, NetnsId, NetnsSockets, PodNetns, SocketOptions};
pub use zds::{
    DEFAULT_ZDS_PATH, InpodCommand, InpodEvent, ZdsAgentConn, ZdsClient, ZdsClientConfig, ZdsError,
    ZdsListener, ZdsMessage, ZdsRequestError,
};

/// `SO_MARK` on ztunnel's sockets inside pods, so the pod's redirection rules
/// let them through (Istio uses the same value, 0x539). ztunnel sets it; the
/// node agent's rules match it.
pub const ZTUNNEL_MARK: u32 = 0x539;
