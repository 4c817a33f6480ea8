//! Policies indexed for evaluation, built once per state generation.
//!
//! [`PolicyIndex`] splits the policies of one [`StateSnapshot`] into the
//! GLOBAL ones, the NAMESPACE ones per namespace (each list split into DENY
//! and ALLOW) and a by-key map for the workload's selector policies, so an
//! evaluation touches only the policies that can apply: one hash lookup for
//! the namespace and one per policy the workload names.
//!
//! [`PolicyCache`] keeps the index of the latest generation behind an
//! `ArcSwap`: readers load it without blocking; the first reader that sees
//! a newer snapshot builds the next index (reusing the tables when the
//! policies themselves did not change) and publishes it.

use std::collections::HashMap;
use std::sync::Arc;

use ambit_proto::security::{Action, Scope};
use arc_swap::ArcSwap;
use foldhash::fast::RandomState;

use super::{Conn, ConnectionAttrs, Decision, DenyReason, policy_matches};
use crate::state::{Authorization, StateSnapshot, Workload};

/// One policy with its precomputed key.
#[derive(Clone, Debug)]
struct Entry {
    key: Arc<str>,
    deny: bool,
    policy: Arc<Authorization>,
}

/// The DENY and ALLOW policies of one scope, sorted by key.
#[derive(Clone, Debug, Default)]
struct Scoped {
    deny: Vec<Entry>,
    allow: Vec<Entry>,
}

impl Scoped {
    fn push(&mut self, e: Entry) {
        if e.deny {
            self.deny.push(e);
        } else {
            self.allow.push(e);
        }
    }

    fn sort(&mut self) {
        self.deny.sort_by(|a, b| a.key.cmp(&b.key));
        self.allow.sort_by(|a, b| a.key.cmp(&b.key));
    }
}

/// The tables of an index; shared between generations whose policies are
/// the same.
#[derive(Debug, Default)]
struct Tables {
    global: Scoped,
    by_namespace: HashMap<Arc<str>, Scoped, RandomState>,
    by_key: HashMap<Arc<str>, Entry, RandomState>,
    /// Addresses of the policies indexed, sorted: to tell cheaply whether a
    /// later snapshot holds exactly the same policies.
    fingerprint: Vec<usize>,
}

/// The authorization policies of one state generation, indexed for
/// [`evaluate`](Self::evaluate).
#[derive(Clone, Debug, Default)]
pub struct PolicyIndex {
    generation: u64,
    tables: Arc<Tables>,
}

fn fingerprint(snap: &StateSnapshot) -> Vec<usize> {
    let mut ptrs: Vec<usize> = snap
        .authorizations()
        .map(|p| Arc::as_ptr(p) as usize)
        .collect();
    ptrs.sort_unstable();
    ptrs
}

impl PolicyIndex {
    /// Indexes the policies of `snap`.
    pub fn build(snap: &StateSnapshot) -> Self {
        Self::build_with(snap, fingerprint(snap))
    }

    fn build_with(snap: &StateSnapshot, fingerprint: Vec<usize>) -> Self {
        let mut t = Tables {
            fingerprint,
            ..Tables::default()
        };
        t.by_key.reserve(snap.authorization_count());
        let mut namespaces: HashMap<&str, Arc<str>, RandomState> = HashMap::default();
        for policy in snap.authorizations() {
            let key: Arc<str> = Arc::from(policy.key());
            let e = Entry {
                key: key.clone(),
                deny: policy.action == Action::Deny,
                policy: policy.clone(),
            };
            match policy.scope {
                Scope::Global => t.global.push(e.clone()),
                Scope::Namespace => {
                    let ns = namespaces
                        .entry(policy.namespace.as_str())
                        .or_insert_with(|| Arc::from(policy.namespace.as_str()))
                        .clone();
                    t.by_namespace.entry(ns).or_default().push(e.clone());
                }
                Scope::WorkloadSelector => {}
            }
            // Every policy is reachable by key, as in Istio's ztunnel: a
            // workload naming a policy gets it whatever its scope.
            t.by_key.insert(key, e);
        }
        t.global.sort();
        for s in t.by_namespace.values_mut() {
            s.sort();
        }
        Self {
            generation: snap.generation(),
            tables: Arc::new(t),
        }
    }

    /// The state generation this index was built from.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether both indexes share their tables (test aid).
    #[cfg(test)]
    pub(crate) fn shares_tables(&self, other: &PolicyIndex) -> bool {
        Arc::ptr_eq(&self.tables, &other.tables)
    }

    /// Number of policies indexed.
    pub fn len(&self) -> usize {
        self.tables.by_key.len()
    }

    /// Whether no policy is indexed.
    pub fn is_empty(&self) -> bool {
        self.tables.by_key.is_empty()
    }

    /// Keys (`namespace/name`) of the policies that apply to `dst`: global,
    /// then its namespace's, then the ones it names (unknown names skipped).
    pub fn applicable(&self, dst: &Workload) -> impl Iterator<Item = &str> {
        let t = &*self.tables;
        let ns = t.by_namespace.get(dst.namespace.as_str());
        let scoped = [Some(&t.global), ns].into_iter().flatten();
        scoped
            .flat_map(|s| s.deny.iter().chain(s.allow.iter()))
            .chain(
                dst.authorization_policies
                    .iter()
                    .filter_map(|k| t.by_key.get(k.as_str())),
            )
            .map(|e| &*e.key)
    }

    /// The verdict on `conn` to workload `dst`. Allocates nothing.
    pub fn evaluate(&self, dst: &Workload, conn: &ConnectionAttrs) -> Decision {
        let t = &*self.tables;
        let c = Conn::new(conn);
        let ns = t.by_namespace.get(dst.namespace.as_str());
        let deny = |e: &Entry| Decision::Deny {
            policy: DenyReason::Policy(e.key.clone()),
        };

        // 1. DENY of the global and namespace scopes.
        for e in t.global.deny.iter().chain(ns.iter().flat_map(|s| &s.deny)) {
            if policy_matches(&e.policy, &c) {
                return deny(e);
            }
        }
        // 2. The workload's own policies: DENY decides at once, ALLOW is
        //    remembered (DENY must still be checked for every policy).
        let mut allow_applies =
            !t.global.allow.is_empty() || ns.is_some_and(|s| !s.allow.is_empty());
        let mut allowed = false;
        for key in &dst.authorization_policies {
            let Some(e) = t.by_key.get(key.as_str()) else {
                continue;
            };
            if e.deny {
                if policy_matches(&e.policy, &c) {
                    return deny(e);
                }
            } else {
                allow_applies = true;
                allowed = allowed || policy_matches(&e.policy, &c);
            }
        }
        // 3. ALLOW: needed only when some apply.
        if !allow_applies || allowed {
            return Decision::Allow;
        }
        let allows = t
            .global
            .allow
            .iter()
            .chain(ns.iter().flat_map(|s| &s.allow));
        for e in allows {
            if policy_matches(&e.policy, &c) {
                return Decision::Allow;
            }
        }
        Decision::Deny {
            policy: DenyReason::NoAllowMatch,
        }
    }
}

/// The index of the latest state generation seen; cheap to share, never
/// blocks readers. Keyed by [`StateSnapshot::generation`], so it must only
/// see snapshots published by one state writer (for a snapshot built by
/// hand, use [`PolicyIndex::build`]).
#[derive(Debug)]
pub struct PolicyCache {
    current: ArcSwap<PolicyIndex>,
}

impl Default for PolicyCache {
    fn default() -> Self {
        Self::new()
    }
}

impl PolicyCache {
    /// A cache holding the index of the empty state (generation 0).
    pub fn new() -> Self {
        Self {
            current: ArcSwap::from_pointee(PolicyIndex::default()),
        }
    }

    /// The index for `snap`: the cached one when it is of `snap`'s
    /// generation, else a new one, published when it is newer than the
    /// cached one. Building reuses the cached tables when `snap` holds the
    /// same policies (a workload-only change).
    pub fn index(&self, snap: &StateSnapshot) -> Arc<PolicyIndex> {
        let cur = self.current.load();
        if cur.generation == snap.generation() {
            return Arc::clone(&cur);
        }
        let fp = fingerprint(snap);
        let next = Arc::new(if fp == cur.tables.fingerprint {
            PolicyIndex {
                generation: snap.generation(),
                tables: cur.tables.clone(),
            }
        } else {
            PolicyIndex::build_with(snap, fp)
        });
        drop(cur);
        self.current.rcu(|old| {
            if old.generation >= next.generation {
                Arc::clone(old)
            } else {
                Arc::clone(&next)
            }
        });
        next
    }

    /// Brings the cache to `snap` (for the task that follows state
    /// updates, so connections never pay for a build).
    pub fn refresh(&self, snap: &StateSnapshot) {
        self.index(snap);
    }

    /// The cached index, whatever its generation.
    pub fn load(&self) -> Arc<PolicyIndex> {
        self.current.load_full()
    }

    /// Evaluates `conn` to `dst` against the policies of `snap`.
    pub fn evaluate(
        &self,
        snap: &StateSnapshot,
        dst: &Workload,
        conn: &ConnectionAttrs,
    ) -> Decision {
        let cur = self.current.load();
        if cur.generation == snap.generation() {
            return cur.evaluate(dst, conn);
        }
        drop(cur);
        self.index(snap).evaluate(dst, conn)
    }
}
