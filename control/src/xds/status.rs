//! What the xDS server knows about its clients, for `/debug` and metrics.
//!
//! Streams report events here; the debug server reads copies. The lock is
//! held only to copy or update a few fields, never across an await.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Serialize;

/// How many NACKs `/debug/nacks` remembers.
const NACK_HISTORY: usize = 256;

type Labels = Vec<(&'static str, &'static str)>;

/// xDS server metrics, named after Istio's pilot metrics where one exists.
#[derive(Debug, Default, Clone)]
pub struct XdsMetrics {
    /// Connected xDS streams by protocol (`delta`, `sotw`).
    pub connected: Family<Labels, Gauge>,
    /// Responses pushed, by resource type.
    pub pushes: Family<Labels, Counter>,
    /// Resources sent (added or changed), by resource type.
    pub resources_sent: Family<Labels, Counter>,
    /// Encoded resource bytes sent, by resource type.
    pub push_bytes: Family<Labels, Counter>,
    /// NACKs received, by resource type.
    pub rejects: Family<Labels, Counter>,
    /// Streams refused, by reason (`unauthenticated`, `permission_denied`,
    /// `resource_exhausted`).
    pub refused: Family<Labels, Counter>,
}

impl XdsMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register("pilot_xds", "Connected xDS streams", m.connected.clone());
        registry.register("pilot_xds_pushes", "xDS responses pushed", m.pushes.clone());
        registry.register(
            "pilot_xds_resources_sent",
            "xDS resources sent (added or changed)",
            m.resources_sent.clone(),
        );
        registry.register(
            "pilot_xds_push_bytes",
            "Encoded xDS resource bytes sent",
            m.push_bytes.clone(),
        );
        registry.register(
            "pilot_total_xds_rejects",
            "xDS responses rejected (NACKed) by proxies",
            m.rejects.clone(),
        );
        registry.register(
            "ambit_xds_auth_failures",
            "xDS streams refused: no or bad credentials, or not allowed what the node asked for",
            m.refused.clone(),
        );
        m
    }
}

/// Per resource type state of one connected proxy.
#[derive(Debug, Default, Clone, Serialize)]
pub struct TypeStatus {
    pub wildcard: bool,
    pub explicit_names: usize,
    pub resources_held: usize,
    pub last_nonce_sent: String,
    pub last_nonce_acked: String,
    /// The version (snapshot sequence) of the last response sent.
    pub last_version_sent: String,
    /// The version the proxy last ACKed (empty until it ACKs a response
    /// whose version is known).
    pub last_version_acked: String,
    /// The error of the last NACK, until a later response is ACKed.
    pub last_nack: String,
    pub acks: u64,
    pub nacks: u64,
    pub pushes: u64,
}

impl TypeStatus {
    /// A response with `nonce` and `version` was sent.
    pub fn sent(&mut self, nonce: String, version: String) {
        self.last_nonce_sent = nonce;
        self.last_version_sent = version;
    }

    /// The proxy ACKed `nonce`.
    pub fn acked(&mut self, nonce: String) {
        self.acks += 1;
        if nonce == self.last_nonce_sent {
            self.last_version_acked = self.last_version_sent.clone();
        }
        self.last_nonce_acked = nonce;
        self.last_nack.clear();
    }

    /// The proxy NACKed a response with `message`.
    pub fn nacked(&mut self, message: String) {
        self.nacks += 1;
        self.last_nack = message;
    }
}

/// One connected proxy as `/debug/connections` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct ProxyInfo {
    pub connection: u64,
    pub node_id: String,
    /// `ztunnel`, `waypoint` or `sidecar` (empty until the first request).
    pub kind: &'static str,
    pub peer: String,
    pub protocol: &'static str,
    pub connected_at_unix: u64,
    pub last_snapshot_seq: u64,
    pub types: BTreeMap<String, TypeStatus>,
}

/// One NACK as `/debug/nacks` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct NackRecord {
    pub at_unix: u64,
    pub node_id: String,
    pub type_url: String,
    pub nonce: String,
    pub message: String,
}

#[derive(Debug, Default)]
struct Inner {
    proxies: BTreeMap<u64, ProxyInfo>,
    nacks: VecDeque<NackRecord>,
}

/// Registry of connected proxies and recent NACKs.
#[derive(Debug, Default)]
pub struct ProxyRegistry {
    inner: Mutex<Inner>,
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl ProxyRegistry {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic elsewhere while holding this lock cannot leave the debug
        // data inconsistent in a way that matters; keep serving it.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn connect(&self, info: ProxyInfo) {
        self.lock().proxies.insert(info.connection, info);
    }

    pub fn disconnect(&self, connection: u64) {
        self.lock().proxies.remove(&connection);
    }

    /// Applies `f` to the entry of `connection`, if it is still registered.
    pub fn update(&self, connection: u64, f: impl FnOnce(&mut ProxyInfo)) {
        if let Some(p) = self.lock().proxies.get_mut(&connection) {
            f(p);
        }
    }

    pub fn record_nack(&self, rec: NackRecord) {
        let mut inner = self.lock();
        if inner.nacks.len() >= NACK_HISTORY {
            inner.nacks.pop_front();
        }
        inner.nacks.push_back(rec);
    }

    pub fn proxies(&self) -> Vec<ProxyInfo> {
        self.lock().proxies.values().cloned().collect()
    }

    pub fn nacks(&self) -> Vec<NackRecord> {
        self.lock().nacks.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::TypeStatus;

    #[test]
    fn versions_follow_sends_acks_and_nacks() {
        let mut t = TypeStatus::default();
        t.sent("1-1".into(), "7".into());
        t.acked("1-1".into());
        assert_eq!(
            (t.last_version_sent.as_str(), t.last_version_acked.as_str()),
            ("7", "7")
        );
        t.sent("1-2".into(), "8".into());
        t.nacked("bad route".into());
        assert_eq!(t.last_version_acked, "7");
        assert_eq!(t.last_nack, "bad route");
        // An ACK of an older nonce keeps the known version; a later ACK
        // clears the NACK.
        t.sent("1-3".into(), "9".into());
        t.acked("1-3".into());
        assert_eq!(
            (t.last_version_acked.as_str(), t.last_nack.as_str()),
            ("9", "")
        );
        assert_eq!((t.acks, t.nacks), (2, 1));
    }
}
