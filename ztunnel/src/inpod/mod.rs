//! In-pod capture building blocks (SPEC §2, §4): ztunnel stays in the node's
//! network namespace and opens its per-pod listeners *inside* each enrolled
//! pod's namespace, which the node agent hands over through ZDS.
//!
//! ```text
//! node agent ──ZDS (SOCK_SEQPACKET, netns fd via SCM_RIGHTS)──▶ zds::ZdsClient
//!                                                                  │ InpodCommand
//!                                                                  ▼
//!   pod netns: 15001 / 15006 / 15008 listeners ◀── manager::InpodManager (one owner task)
//!                     (made on a netns thread: netns::PodNetns::run_in)
//! ```
//!
//! Not wired into the app yet; the accept loops close what they accept
//! until the proxies land. The redirection rules that send a pod's traffic
//! to these listeners are the node agent's job.

pub mod manager;
pub mod netns;
pub mod zds;

#[cfg(test)]
mod tests;

pub use manager::{
    InpodConfig, InpodError, InpodHandle, InpodManager, ListenerRole, PodSet, PodSummary,
};
pub use netns::{NetnsError, NetnsId, NetnsSockets, PodNetns, SocketOptions};
pub use zds::{
    DEFAULT_ZDS_PATH, InpodCommand, InpodEvent, ZdsClient, ZdsClientConfig, ZdsError, ZdsMessage,
    ZdsRequestError,
};

/// `SO_MARK` on ztunnel's sockets inside pods, so the pod's redirection rules
/// let them through (Istio uses the same value, 0x539). The node agent's
/// rules must match it.
pub const ZTUNNEL_MARK: u32 = 0x539;
