//! ztunnel's in-pod listeners (SPEC §2, §4): ztunnel stays in the node's
//! network namespace and opens its per-pod listeners *inside* each enrolled
//! pod's namespace, which the node agent hands over through ZDS.
//!
//! ```text
//! node agent ──ZDS (SOCK_SEQPACKET, netns fd via SCM_RIGHTS)──▶ ambit_inpod::ZdsClient
//!                                                                  │ InpodCommand
//!                                                                  ▼
//!   pod netns: 15001 / 15006 / 15008 listeners ◀── manager::InpodManager (one owner task)
//!                     (made on a netns thread: ambit_inpod::PodNetns::run_in)
//! ```
//!
//! The protocol and the namespace helpers live in the `ambit-inpod` crate,
//! shared with the node agent; this module owns what is ztunnel's: which
//! listeners a pod gets, and handing their connections to [`crate::proxy`].
//! The ZDS client stops on ztunnel's drain signal
//! ([`crate::drain::DrainWatcher::wait`]).

pub mod manager;

pub use manager::{
    InpodConfig, InpodError, InpodHandle, InpodManager, ListenerRole, PodSet, PodSummary,
    UnservedSet,
};
