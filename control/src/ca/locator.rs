//! Which nodes run pods of a given identity: lets the CA check that a node
//! proxy asks only for identities of pods on its own node.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use ambit_proto::workload::{Address, address};
use prost::Message;
use tokio::sync::watch;

use crate::model::Snapshot;

/// Answers which nodes run workloads of `namespace`/`service_account`.
pub trait PodLocator: Send + Sync {
    fn nodes_of_identity(&self, namespace: &str, service_account: &str) -> BTreeSet<String>;
}

type Index = HashMap<(String, String), BTreeSet<String>>;

/// A fixed mapping, for tests and tools: (namespace, service account, node).
#[derive(Debug, Default, Clone)]
pub struct StaticPodLocator {
    index: Index,
}

impl StaticPodLocator {
    pub fn new<'a>(pods: impl IntoIterator<Item = (&'a str, &'a str, &'a str)>) -> Self {
        let mut index = Index::new();
        for (ns, sa, node) in pods {
            index
                .entry((ns.to_string(), sa.to_string()))
                .or_default()
                .insert(node.to_string());
        }
        Self { index }
    }
}

impl PodLocator for StaticPodLocator {
    fn nodes_of_identity(&self, namespace: &str, service_account: &str) -> BTreeSet<String> {
        self.index
            .get(&(namespace.to_string(), service_account.to_string()))
            .cloned()
            .unwrap_or_default()
    }
}

/// Reads the workloads of the model's published snapshots. The index is
/// rebuilt at most once per snapshot `seq`, on the first request after it.
pub struct SnapshotPodLocator {
    rx: watch::Receiver<Arc<Snapshot>>,
    cache: Mutex<(u64, Arc<Index>)>,
}

impl std::fmt::Debug for SnapshotPodLocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotPodLocator").finish_non_exhaustive()
    }
}

impl SnapshotPodLocator {
    pub fn new(rx: watch::Receiver<Arc<Snapshot>>) -> Self {
        let snap = rx.borrow().clone();
        let index = Arc::new(build_index(&snap));
        Self {
            rx,
            cache: Mutex::new((snap.seq, index)),
        }
    }

    fn index(&self) -> Arc<Index> {
        let snap = self.rx.borrow().clone();
        if let Ok(cache) = self.cache.lock()
            && cache.0 == snap.seq
        {
            return cache.1.clone();
        }
        // Built outside the lock; concurrent rebuilds of one seq are harmless.
        let index = Arc::new(build_index(&snap));
        if let Ok(mut cache) = self.cache.lock()
            && cache.0 < snap.seq
        {
            *cache = (snap.seq, index.clone());
        }
        index
    }
}

impl PodLocator for SnapshotPodLocator {
    fn nodes_of_identity(&self, namespace: &str, service_account: &str) -> BTreeSet<String> {
        self.index()
            .get(&(namespace.to_string(), service_account.to_string()))
            .cloned()
            .unwrap_or_default()
    }
}

fn build_index(snap: &Snapshot) -> Index {
    let mut index = Index::new();
    for res in snap.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name.values() {
        let Ok(addr) = Address::decode(res.body.value.as_slice()) else {
            tracing::warn!(name = %res.name, "cannot decode a published Address resource; skipped for CA authorization");
            continue;
        };
        let Some(address::Type::Workload(w)) = addr.r#type else {
            continue;
        };
        if w.node.is_empty() {
            continue;
        }
        let sa = if w.service_account.is_empty() {
            "default".to_string()
        } else {
            w.service_account
        };
        index.entry((w.namespace, sa)).or_default().insert(w.node);
    }
    index
}
