//! Live inbound connections, kept so a policy change can close the ones it
//! no longer allows.
//!
//! Each inbound connection registers its [`ConnectionAttrs`] and the pod
//! address it reached, and gets a [`Revoked`] future it races against its
//! copy loop. [`LiveConnections::recheck`] (run by the state follower after
//! every state change) evaluates every registered connection against the
//! new policies and revokes the denied ones with the policy's name.
//!
//! The registry is sharded by connection id so registering and removing
//! (twice per connection) never contend; a recheck locks one shard at a
//! time and evaluates outside any await.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

use crate::rbac::{ConnectionAttrs, Decision, PolicyCache};
use crate::state::StateSnapshot;

const SHARDS: usize = 16;

struct Entry {
    attrs: ConnectionAttrs,
    /// Pod the connection was delivered to, `namespace` and `name`.
    pod_namespace: Arc<str>,
    pod_name: Arc<str>,
    revoke: oneshot::Sender<String>,
}

/// The registry; one per ztunnel.
pub struct LiveConnections {
    shards: Vec<Mutex<HashMap<u64, Entry>>>,
    next: AtomicU64,
}

impl Default for LiveConnections {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            next: AtomicU64::new(0),
        }
    }
}

impl std::fmt::Debug for LiveConnections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveConnections")
            .field("len", &self.len())
            .finish()
    }
}

/// Resolves with the denying policy's name when the connection is revoked.
pub type Revoked = oneshot::Receiver<String>;

/// Removes the connection from the registry when dropped.
pub struct Registration {
    registry: Arc<LiveConnections>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry
            .shard(self.id)
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.id);
    }
}

impl LiveConnections {
    fn shard(&self, id: u64) -> &Mutex<HashMap<u64, Entry>> {
        &self.shards[(id as usize) % SHARDS]
    }

    /// Registers a connection to pod `namespace/name`.
    pub fn register(
        self: &Arc<Self>,
        attrs: ConnectionAttrs,
        pod_namespace: Arc<str>,
        pod_name: Arc<str>,
    ) -> (Registration, Revoked) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.shard(id)
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                id,
                Entry {
                    attrs,
                    pod_namespace,
                    pod_name,
                    revoke: tx,
                },
            );
        (
            Registration {
                registry: self.clone(),
                id,
            },
            rx,
        )
    }

    /// Live connections registered.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }

    /// Whether none is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Evaluates every live connection against `snap`'s policies and
    /// revokes those now denied; returns how many. A connection whose pod
    /// address left the state is left alone (the pod's removal drains it).
    pub fn recheck(&self, snap: &StateSnapshot, network: &str, policies: &PolicyCache) -> usize {
        let index = policies.index(snap);
        let mut revoked = 0;
        for shard in &self.shards {
            let mut map = shard.lock().unwrap_or_else(PoisonError::into_inner);
            let denied: Vec<(u64, String)> = map
                .iter()
                .filter_map(|(id, e)| {
                    let ip: IpAddr = e.attrs.dst_ip;
                    let w = snap.workload_by_ip(network, ip.to_canonical())?;
                    if *w.name != *e.pod_name || *w.namespace != *e.pod_namespace {
                        return None;
                    }
                    match index.evaluate(&w, &e.attrs) {
                        Decision::Allow => None,
                        Decision::Deny { policy } => Some((*id, policy.to_string())),
                    }
                })
                .collect();
            for (id, policy) in denied {
                if let Some(e) = map.remove(&id) {
                    let _ = e.revoke.send(policy);
                    revoked += 1;
                }
            }
        }
        revoked
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use ambit_proto::security::{Action, Scope};
    use ambit_proto::workload as xds;

    use super::*;
    use crate::identity::Identity;
    use crate::rbac::PeerIdentity;
    use crate::state::{Authorization, RbacMatch, StringMatch, Workload};

    /// A published snapshot (the policy cache follows published generations).
    fn snapshot(writer: &mut crate::state::StateWriter, deny_other: bool) -> Arc<StateSnapshot> {
        let mut s = writer.begin();
        s.insert_workload(
            Workload::try_from(&xds::Workload {
                uid: "Kubernetes//Pod/ai/server".into(),
                name: "server".into(),
                namespace: "ai".into(),
                addresses: vec![vec![10, 0, 0, 9]],
                tunnel_protocol: xds::TunnelProtocol::Hbone as i32,
                ..Default::default()
            })
            .unwrap(),
        );
        if deny_other {
            s.insert_authorization(Authorization {
                name: "deny-other".into(),
                namespace: "ai".into(),
                scope: Scope::Namespace,
                action: Action::Deny,
                rules: vec![vec![vec![RbacMatch {
                    principals: vec![StringMatch::Exact("cluster.local/ns/ai/sa/other".into())],
                    ..RbacMatch::default()
                }]]],
            });
        }
        writer.publish(s)
    }

    fn attrs(sa: &str) -> ConnectionAttrs {
        let id = Identity::new("cluster.local", "ai", sa);
        ConnectionAttrs::mtls(
            "10.0.0.1".parse().unwrap(),
            PeerIdentity::new(&id),
            "10.0.0.9".parse().unwrap(),
            8080,
        )
    }

    #[tokio::test]
    async fn a_new_deny_revokes_only_the_connections_it_matches() {
        let live = Arc::new(LiveConnections::default());
        let (_keep, mut kept) = live.register(attrs("client"), "ai".into(), "server".into());
        let (_gone, revoked) = live.register(attrs("other"), "ai".into(), "server".into());
        // Another pod with the same address: not this registration's pod.
        let (_elsewhere, mut elsewhere) =
            live.register(attrs("other"), "ai".into(), "someone-else".into());
        assert_eq!(live.len(), 3);

        let (mut writer, _reader) = crate::state::new_state();
        let policies = PolicyCache::new();
        assert_eq!(
            live.recheck(&snapshot(&mut writer, false), "", &policies),
            0
        );
        assert_eq!(live.recheck(&snapshot(&mut writer, true), "", &policies), 1);
        assert_eq!(revoked.await.unwrap(), "ai/deny-other");
        assert!(kept.try_recv().is_err(), "the allowed connection stays");
        assert!(
            elsewhere.try_recv().is_err(),
            "a connection of another pod stays"
        );
        assert_eq!(live.len(), 2);
    }

    #[test]
    fn dropping_the_registration_unregisters() {
        let live = Arc::new(LiveConnections::default());
        let (reg, _rx) = live.register(attrs("client"), "ai".into(), "server".into());
        assert!(!live.is_empty());
        drop(reg);
        assert!(live.is_empty());
    }
}
