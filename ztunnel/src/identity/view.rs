//! What the certificate manager publishes: every managed identity and its
//! certificate state, as a read-only [`CertificateView`].
//!
//! The manager (`manager.rs`) is the only writer: its actor publishes the
//! identity map through a [`ViewPublisher`], and each identity's worker
//! writes that identity's [`CertificateState`] on a watch channel. Readers —
//! `fetch`, the `/config_dump` section (`dump.rs`), the expiry metric
//! (`metrics.rs`) — load the view and never wait on a lock. This module
//! depends on neither side.

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::sync::watch;

use super::Identity;
use super::cert::WorkloadCertificate;

/// One identity's certificate state, written only by its worker.
#[derive(Debug, Clone, Default)]
pub(crate) struct CertificateState {
    /// The newest certificate (possibly expired by now).
    pub(crate) cert: Option<Arc<WorkloadCertificate>>,
    /// The error of the last attempt, if it failed.
    pub(crate) last_error: Option<String>,
    /// Whether at least one attempt has finished.
    pub(crate) attempted: bool,
}

impl CertificateState {
    /// The certificate, if it is still valid.
    pub(crate) fn usable(&self) -> Option<&Arc<WorkloadCertificate>> {
        self.cert.as_ref().filter(|c| c.is_valid())
    }

    /// Why [`CertificateState::usable`] has nothing.
    pub(crate) fn unavailable_reason(&self) -> String {
        match (&self.cert, &self.last_error) {
            (_, Some(e)) => e.clone(),
            (Some(_), None) => "the certificate expired".to_string(),
            (None, None) => "no certificate yet".to_string(),
        }
    }

    /// `Available`, `Initializing` or `Unavailable: <why>`.
    pub(crate) fn summary(&self) -> String {
        if self.usable().is_some() {
            "Available".to_string()
        } else if !self.attempted {
            "Initializing".to_string()
        } else {
            format!("Unavailable: {}", self.unavailable_reason())
        }
    }
}

/// The published map: each managed identity and the watch its worker writes.
pub(crate) type IdentityMap = HashMap<Identity, watch::Receiver<CertificateState>>;

/// Read-only view of the managed identities. Cheap to clone; always shows
/// the latest published map.
#[derive(Debug, Clone)]
pub struct CertificateView {
    map: Arc<ArcSwap<IdentityMap>>,
}

/// The manager's end: replaces the published map.
#[derive(Debug)]
pub(crate) struct ViewPublisher {
    map: Arc<ArcSwap<IdentityMap>>,
}

/// An empty view and its publisher.
pub(crate) fn channel() -> (ViewPublisher, CertificateView) {
    let map = Arc::new(ArcSwap::from_pointee(IdentityMap::new()));
    (ViewPublisher { map: map.clone() }, CertificateView { map })
}

impl ViewPublisher {
    pub(crate) fn publish(&self, map: IdentityMap) {
        self.map.store(Arc::new(map));
    }
}

impl CertificateView {
    /// How many identities are managed.
    pub fn len(&self) -> usize {
        self.map.load().len()
    }

    /// Whether no identity is managed.
    pub fn is_empty(&self) -> bool {
        self.map.load().is_empty()
    }

    /// The identities managed, sorted.
    pub fn identities(&self) -> Vec<Identity> {
        let mut ids: Vec<Identity> = self.map.load().keys().cloned().collect();
        ids.sort();
        ids
    }

    /// The watch of one identity's state, if it is managed.
    pub(crate) fn get(&self, id: &Identity) -> Option<watch::Receiver<CertificateState>> {
        self.map.load().get(id).cloned()
    }

    /// Every identity with a copy of its current state, in no order.
    pub(crate) fn states(&self) -> Vec<(Identity, CertificateState)> {
        self.map
            .load()
            .iter()
            .map(|(id, rx)| (id.clone(), rx.borrow().clone()))
            .collect()
    }
}
