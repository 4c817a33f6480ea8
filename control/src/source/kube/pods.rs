//! Where each watched pod runs: `namespace/name` → (uid, node). Filled by
//! the pod watcher from the same decoded objects the model receives; read
//! by TokenReview authentication (a bound ServiceAccount token names its
//! pod, the pod names the node that a node proxy's impersonation is
//! checked against).

use std::collections::HashMap;
use std::sync::RwLock;

use ambit_config::objects::Pod;

/// A pod's placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodPlacement {
    pub uid: String,
    /// `spec.nodeName`; empty until the pod is scheduled.
    pub node: String,
}

/// `namespace/name` → placement, for every pod the source watches.
#[derive(Debug, Default)]
pub struct PodIndex {
    pods: RwLock<HashMap<(String, String), PodPlacement>>,
}

impl PodIndex {
    /// The placement of pod `namespace/name`, when it is known.
    pub fn get(&self, namespace: &str, name: &str) -> Option<PodPlacement> {
        let pods = self.pods.read().ok()?;
        pods.get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }

    /// Number of pods known.
    pub fn len(&self) -> usize {
        self.pods.read().map(|p| p.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn upsert(&self, pod: &Pod) {
        let key = (pod.metadata.namespace.clone(), pod.metadata.name.clone());
        let placement = PodPlacement {
            uid: pod.metadata.uid.clone(),
            node: pod.spec.node_name.clone(),
        };
        if let Ok(mut pods) = self.pods.write() {
            pods.insert(key, placement);
        }
    }

    pub(crate) fn remove(&self, namespace: &str, name: &str) {
        if let Ok(mut pods) = self.pods.write() {
            pods.remove(&(namespace.to_string(), name.to_string()));
        }
    }
}
