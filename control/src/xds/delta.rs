//! One Delta ADS stream (`DeltaAggregatedResources`).
//!
//! The stream sends only what differs from what its client holds: added or
//! changed resources and the names of removed ones. Clients reconnecting
//! with `initial_resource_versions` get only what changed while they were
//! away.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};
use tracing::debug;

use super::generator::{Served, TypeSpec};
use super::stream::{StreamCtx, StreamEnd};
use super::wire::{DeltaChunk, OutgoingResource};
use super::{CHUNK, FULL_SYNC_SLOT_TIMEOUT, LARGE_RESPONSE, Shared};
use crate::ca::Caller;
use crate::model::snapshot::{ResourceDelta, ResourceSet, Snapshot, XdsResource};

/// What one client holds and wants of one type.
///
/// A wildcard subscriber holds exactly `current`, the set its generator
/// gave for the snapshot the stream last processed, so nothing per client is
/// stored for it: pushes are the model's own delta, or a diff of two sets
/// when the stream skipped a snapshot. Only explicit (on-demand)
/// subscriptions keep a small map of what was sent.
#[derive(Debug)]
struct Subscription {
    spec: &'static TypeSpec,
    /// The set served for the snapshot the stream last processed (shared
    /// with the model: an `Arc`, not a copy).
    current: Arc<ResourceSet>,
    wildcard: bool,
    /// Names subscribed explicitly: primary names or `network/ip` aliases.
    names: HashSet<String>,
    /// Explicit subscriptions only: primary name -> version the client holds.
    sent: HashMap<String, String>,
    /// The first request of this type has been answered.
    answered: bool,
}

/// Resources to add or update and names to remove, for one response.
/// The resources are the snapshot's own (`Arc`s): each chunk is turned into
/// wire messages only when it is sent, so a full sync never holds a copy of
/// every resource at once.
#[derive(Debug, Default)]
struct Changes {
    resources: Vec<Arc<XdsResource>>,
    removed: Vec<String>,
}

impl Changes {
    fn is_empty(&self) -> bool {
        self.resources.is_empty() && self.removed.is_empty()
    }
}

impl Subscription {
    fn new(spec: &'static TypeSpec, current: Arc<ResourceSet>) -> Self {
        Self {
            spec,
            current,
            wildcard: false,
            names: HashSet::new(),
            sent: HashMap::new(),
            answered: false,
        }
    }

    fn to_outgoing(&self, res: &Arc<XdsResource>) -> OutgoingResource {
        let aliases = if self.names.is_empty() {
            Vec::new()
        } else {
            res.aliases
                .iter()
                .filter(|a| self.names.contains(*a))
                .cloned()
                .collect()
        };
        OutgoingResource {
            resource: res.clone(),
            aliases,
        }
    }

    /// How many resources the client holds, for `/debug/connections`.
    fn held(&self) -> usize {
        if self.wildcard {
            self.current.by_name.len()
        } else {
            self.sent.len()
        }
    }

    /// Wildcard: everything in `set` the client does not already hold
    /// according to `held` (name -> version), and removal of the rest of `held`.
    fn wildcard_against(&self, set: &ResourceSet, held: &HashMap<String, String>) -> Changes {
        let mut out = Changes::default();
        for res in set.by_name.values() {
            if held.get(&res.name) != Some(&res.version) {
                out.resources.push(res.clone());
            }
        }
        out.removed = held
            .keys()
            .filter(|n| !set.by_name.contains_key(*n))
            .cloned()
            .collect();
        out
    }

    /// Wildcard: the difference between two snapshots' sets.
    fn wildcard_diff(&self, prev: &ResourceSet, next: &ResourceSet) -> Changes {
        let mut out = Changes::default();
        for (name, res) in &next.by_name {
            match prev.by_name.get(name) {
                Some(p) if Arc::ptr_eq(p, res) || p.version == res.version => {}
                _ => out.resources.push(res.clone()),
            }
        }
        out.removed = prev
            .by_name
            .keys()
            .filter(|n| !next.by_name.contains_key(*n))
            .cloned()
            .collect();
        out
    }

    /// Wildcard: the model's changes of one consecutive snapshot.
    fn wildcard_delta(&self, set: &ResourceSet, d: &ResourceDelta) -> Changes {
        Changes {
            resources: d
                .changed
                .iter()
                .filter_map(|n| set.by_name.get(n))
                .cloned()
                .collect(),
            removed: d.removed.iter().cloned().collect(),
        }
    }

    /// Explicit names that resolve to nothing in `set`, among `new_names`:
    /// reported as removed so the client stops waiting for them.
    fn unknown(&self, set: &ResourceSet, new_names: &[String]) -> Vec<String> {
        new_names
            .iter()
            .filter(|n| set.resolve(n).is_none())
            .cloned()
            .collect()
    }

    /// Explicit: brings what the client holds in line with its names.
    fn reconcile_explicit(&mut self, set: &ResourceSet, new_names: &[String]) -> Changes {
        let mut out = Changes::default();
        let mut wanted: HashSet<&str> = HashSet::new();
        for n in &self.names {
            if let Some(res) = set.resolve(n).and_then(|p| set.by_name.get(p))
                && wanted.insert(&res.name)
                && self.sent.get(&res.name) != Some(&res.version)
            {
                out.resources.push(res.clone());
            }
        }
        for r in &out.resources {
            self.sent.insert(r.name.clone(), r.version.clone());
        }
        out.removed = self.unknown(set, new_names);
        self.sent.retain(|name, _| {
            if !set.by_name.contains_key(name) {
                out.removed.push(name.clone());
                false
            } else {
                // No longer wanted: the client dropped it itself.
                wanted.contains(name.as_str())
            }
        });
        out
    }
}

pub(super) struct DeltaStream {
    ctx: StreamCtx,
    tx: mpsc::Sender<Result<DeltaChunk, Status>>,
    subs: Vec<Subscription>,
    nonce: u64,
    snap: Arc<Snapshot>,
    /// A full-sync slot, held from sending a large response until its ACK.
    sync_slot: Option<SyncSlot>,
}

/// A held full-sync slot.
struct SyncSlot {
    nonce: String,
    deadline: tokio::time::Instant,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl DeltaStream {
    pub(super) fn new(
        id: u64,
        peer: String,
        caller: Caller,
        shared: Arc<Shared>,
        tx: mpsc::Sender<Result<DeltaChunk, Status>>,
    ) -> Self {
        Self {
            ctx: StreamCtx::new(id, peer, caller, "delta", shared),
            tx,
            subs: Vec::new(),
            nonce: 0,
            snap: Arc::new(Snapshot::default()),
            sync_slot: None,
        }
    }

    pub(super) async fn run(mut self, mut requests: Streaming<DeltaDiscoveryRequest>) {
        if self.ctx.open().await.is_none() {
            return;
        }
        let mut snapshots = self.ctx.shared.snapshots.clone();
        self.snap = snapshots.borrow_and_update().clone();
        debug!("delta xDS stream opened");
        let result = self.serve(&mut requests, &mut snapshots).await;
        if let Err(StreamEnd::Refused(status)) = &result {
            // Best effort: the client may already be gone.
            let _ = self.tx.send(Err(status.clone())).await;
        }
        self.ctx.close(result);
    }

    async fn serve(
        &mut self,
        requests: &mut Streaming<DeltaDiscoveryRequest>,
        snapshots: &mut tokio::sync::watch::Receiver<Arc<Snapshot>>,
    ) -> Result<(), StreamEnd> {
        loop {
            let slot_deadline = self.sync_slot.as_ref().map(|s| s.deadline);
            tokio::select! {
                msg = requests.message() => match msg {
                    Ok(Some(req)) => self.on_request(req).await?,
                    Ok(None) => return Ok(()),
                    Err(status) => return Err(StreamEnd::Client(status)),
                },
                changed = snapshots.changed() => {
                    if changed.is_err() {
                        return Err(StreamEnd::ModelStopped);
                    }
                    let snap = snapshots.borrow_and_update().clone();
                    self.on_snapshot(snap).await?;
                }
                _ = sleep_until_some(slot_deadline) => {
                    debug!(proxy = %self.ctx.node_id, "full sync not ACKed in time; releasing its slot");
                    self.sync_slot = None;
                }
            }
        }
    }

    async fn on_request(&mut self, req: DeltaDiscoveryRequest) -> Result<(), StreamEnd> {
        self.ctx.learn_node(req.node.as_ref())?;
        let Some(spec) = self.ctx.spec(&req.type_url) else {
            return Ok(());
        };
        let type_url = spec.type_url;
        if !req.response_nonce.is_empty() {
            if self
                .sync_slot
                .as_ref()
                .is_some_and(|s| s.nonce == req.response_nonce)
            {
                self.sync_slot = None;
            }
            self.ctx
                .acked(spec, &req.response_nonce, req.error_detail.as_ref());
        }

        let held = self
            .subs
            .iter()
            .find(|s| s.spec == spec)
            .map_or(0, |s| s.names.len());
        self.ctx
            .check_names(held, req.resource_names_subscribe.iter())?;
        let served = self.ctx.generate(&self.snap, type_url);
        let idx = match self.subs.iter().position(|s| s.spec.type_url == type_url) {
            Some(i) => i,
            None => {
                self.subs.push(Subscription::new(spec, served.set.clone()));
                self.subs.len() - 1
            }
        };
        // A request for everything of a large type is a full sync: take a
        // slot before building it, so a crowd of reconnecting proxies is
        // served a few at a time instead of all holding large responses.
        // An empty subscribe list means "everything" only on the first
        // request of a type; later it is an ACK or an unsubscribe and asks
        // for nothing new.
        let first_request = !self.subs[idx].answered;
        let names_all = req.resource_names_subscribe.iter().any(|n| n == "*");
        let wants_all = names_all || (first_request && req.resource_names_subscribe.is_empty());
        let becomes_full = first_request || !self.subs[idx].wildcard;
        let large = served.set.by_name.len() >= LARGE_RESPONSE;
        if wants_all && large && becomes_full {
            self.reserve_full_sync().await?;
        }
        let set = &*served.set;
        let sub = &mut self.subs[idx];
        sub.current = served.set.clone();
        let first = !sub.answered;
        let was_wildcard = sub.wildcard;
        if first {
            sub.answered = true;
            sub.wildcard = wants_all;
        }
        let mut changed = first;
        let mut new_names = Vec::new();
        for n in req.resource_names_subscribe {
            if n == "*" {
                changed |= !sub.wildcard;
                sub.wildcard = true;
            } else if sub.names.insert(n.clone()) {
                new_names.push(n);
                changed = true;
            } else if !sub.wildcard {
                // Subscribing again to a name it has asks for the resource
                // again (Envoy does this for a cluster it re-warms and then
                // waits for the endpoints): forget what was sent.
                if let Some(primary) = set.resolve(&n) {
                    changed |= sub.sent.remove(primary).is_some();
                }
            }
        }
        for n in req.resource_names_unsubscribe {
            if n == "*" {
                changed |= sub.wildcard;
                sub.wildcard = false;
            } else {
                changed |= sub.names.remove(&n);
            }
        }
        if !changed {
            return Ok(());
        }
        let changes = match (first, was_wildcard, sub.wildcard) {
            // First answer: skip what the client says it already holds.
            (true, _, true) => {
                let mut c = sub.wildcard_against(set, &req.initial_resource_versions);
                c.removed.extend(sub.unknown(set, &new_names));
                c
            }
            (true, _, false) => {
                sub.sent = req.initial_resource_versions;
                sub.reconcile_explicit(set, &new_names)
            }
            // Explicit -> wildcard: send the rest of the world.
            (false, false, true) => {
                let held = std::mem::take(&mut sub.sent);
                sub.wildcard_against(set, &held)
            }
            // Wildcard -> explicit: the client holds everything; keep the wanted part.
            (false, true, false) => {
                sub.sent = sub
                    .names
                    .iter()
                    .filter_map(|n| set.resolve(n).and_then(|p| set.by_name.get(p)))
                    .map(|r| (r.name.clone(), r.version.clone()))
                    .collect();
                sub.reconcile_explicit(set, &new_names)
            }
            // Wildcard, new on-demand names: held already unless unknown.
            (false, true, true) => Changes {
                removed: sub.unknown(set, &new_names),
                ..Default::default()
            },
            (false, false, false) => sub.reconcile_explicit(set, &new_names),
        };
        let (wildcard, explicit) = (sub.wildcard, sub.names.len());
        self.ctx.shared.registry.update(self.ctx.id, |p| {
            let t = p.types.entry(type_url.to_string()).or_default();
            t.wildcard = wildcard;
            t.explicit_names = explicit;
        });
        // The first answer is sent even when empty: it tells the client it
        // holds the full state of this type.
        if first || !changes.is_empty() {
            self.send(idx, changes).await?;
        }
        Ok(())
    }

    /// Brings every subscription in line with a new snapshot, in the
    /// generator's type order (ADS ordering).
    async fn on_snapshot(&mut self, snap: Arc<Snapshot>) -> Result<(), StreamEnd> {
        let consecutive = snap.seq == self.snap.seq + 1;
        self.snap = snap;
        // Names whose resources of a later type must be sent again.
        let mut resend: Vec<(&'static str, Vec<String>)> = Vec::new();
        for spec in self.ctx.served_types() {
            let Some(idx) = self.subs.iter().position(|s| s.spec == spec) else {
                continue;
            };
            let Served { set, delta } = self.ctx.generate(&self.snap, spec.type_url);
            let again: Vec<String> = resend
                .iter()
                .filter(|(t, _)| *t == spec.type_url)
                .flat_map(|(_, names)| names.iter().cloned())
                .collect();
            let sub = &mut self.subs[idx];
            if Arc::ptr_eq(&sub.current, &set) && again.is_empty() {
                continue;
            }
            let mut changes = match (sub.wildcard, consecutive, delta) {
                _ if Arc::ptr_eq(&sub.current, &set) => Changes::default(),
                (true, true, Some(d)) => sub.wildcard_delta(&set, &d),
                (true, _, _) => sub.wildcard_diff(&sub.current, &set),
                (false, _, _) => sub.reconcile_explicit(&set, &[]),
            };
            sub.current = set.clone();
            for name in again {
                let held = sub.wildcard || sub.sent.contains_key(&name);
                let queued = changes.resources.iter().any(|r| r.name == name);
                if let (true, false, Some(res)) = (held, queued, set.by_name.get(&name)) {
                    changes.resources.push(res.clone());
                }
            }
            if let Some(follower) = spec.resend_with {
                let names: Vec<String> = changes.resources.iter().map(|r| r.name.clone()).collect();
                if !names.is_empty() {
                    resend.push((follower, names));
                }
            }
            if !changes.is_empty() {
                self.send(idx, changes).await?;
            }
        }
        let seq = self.snap.seq;
        self.ctx
            .shared
            .registry
            .update(self.ctx.id, |p| p.last_snapshot_seq = seq);
        Ok(())
    }

    /// Waits for a full-sync slot (our own previous one is released first).
    /// It is tied to the next response sent and freed by its ACK.
    async fn reserve_full_sync(&mut self) -> Result<(), StreamEnd> {
        self.sync_slot = None;
        let permit = self
            .ctx
            .shared
            .full_syncs
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| StreamEnd::ModelStopped)?;
        self.sync_slot = Some(SyncSlot {
            nonce: String::new(), // the last chunk's nonce, once sent
            deadline: tokio::time::Instant::now() + FULL_SYNC_SLOT_TIMEOUT,
            _permit: permit,
        });
        Ok(())
    }

    /// Sends `changes` as one response, or as several of at most
    /// [`CHUNK`] resources when large: tonic keeps a stream's encode buffer
    /// at the size of the largest message it ever sent, so one 2 MB full
    /// sync would pin 2-4 MB for the life of every stream. All but the last
    /// chunk carry `system_version_info` ending in
    /// [`ambit_proto::PARTIAL_RESPONSE_MARKER`]; Ambit's ztunnel counts a
    /// type as synced only at the last one.
    async fn send(&mut self, idx: usize, changes: Changes) -> Result<(), StreamEnd> {
        let spec = self.subs[idx].spec;
        let type_url = spec.type_url;
        let Changes {
            mut resources,
            removed,
        } = changes;
        let reserved = self.sync_slot.as_ref().is_some_and(|s| s.nonce.is_empty());
        if resources.len() >= LARGE_RESPONSE && !reserved {
            self.reserve_full_sync().await?;
        }
        let labels = vec![("type", spec.label)];
        let bytes: usize = resources.iter().map(|r| r.body.value.len()).sum();
        let count = resources.len();
        let chunks = count.div_ceil(CHUNK).max(1);
        let m = &self.ctx.shared.metrics;
        m.pushes.get_or_create(&labels).inc_by(chunks as u64);
        m.resources_sent.get_or_create(&labels).inc_by(count as u64);
        m.push_bytes.get_or_create(&labels).inc_by(bytes as u64);
        debug!(
            type_url,
            resources = count,
            removed = removed.len(),
            bytes,
            chunks,
            "pushing delta response"
        );

        let seq = self.snap.seq;
        let mut removed = Some(removed);
        let mut nonce = String::new();
        for i in 0..chunks {
            let last = i + 1 == chunks;
            let part = resources.split_off(resources.len() - resources.len().min(CHUNK));
            let part = part.iter().map(|r| self.subs[idx].to_outgoing(r)).collect();
            self.nonce += 1;
            nonce = format!("{}-{}", self.ctx.id, self.nonce);
            if last && let Some(slot) = self.sync_slot.as_mut().filter(|s| s.nonce.is_empty()) {
                slot.nonce = nonce.clone();
            }
            let resp = DeltaChunk {
                system_version_info: if last {
                    seq.to_string()
                } else {
                    format!("{seq}{}", ambit_proto::PARTIAL_RESPONSE_MARKER)
                },
                resources: part,
                type_url,
                removed_resources: if last {
                    removed.take().unwrap_or_default()
                } else {
                    Vec::new()
                },
                nonce: nonce.clone(),
            };
            self.tx
                .send(Ok(resp))
                .await
                .map_err(|_| StreamEnd::ClientGone)?;
        }
        let held = self.subs[idx].held();
        self.ctx.shared.registry.update(self.ctx.id, |p| {
            let t = p.types.entry(type_url.to_string()).or_default();
            t.pushes += chunks as u64;
            t.resources_held = held;
            t.sent(nonce, seq.to_string());
        });
        Ok(())
    }
}

/// Sleeps until `deadline`, or forever when there is none.
async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
