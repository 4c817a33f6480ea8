//! One Delta ADS stream (`DeltaAggregatedResources`).
//!
//! The stream remembers, per type, what the client holds (`sent`: primary
//! name -> version) and sends only what differs: added or changed resources
//! and the names of removed ones. Clients reconnecting with
//! `initial_resource_versions` get only what changed while they were away.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
};
use tokio::sync::mpsc;
use tonic::{Status, Streaming};
use tracing::{debug, info, warn};

use super::status::{NackRecord, ProxyInfo, type_label, unix_now};
use super::{FULL_SYNC_SLOT_TIMEOUT, LARGE_RESPONSE, SUPPORTED_TYPES, Shared, delta, resources};
use crate::model::snapshot::{ResourceSet, Snapshot, XdsResource};

/// Why a stream ended.
#[derive(Debug, thiserror::Error)]
pub(super) enum StreamEnd {
    #[error("the client stopped reading responses (connection closed)")]
    ClientGone,
    #[error("the client's request stream failed: {0}")]
    Client(Status),
    #[error("the mesh model stopped; the control plane is shutting down")]
    ModelStopped,
}

/// What one client holds and wants of one type.
#[derive(Debug)]
struct Subscription {
    type_url: &'static str,
    wildcard: bool,
    /// Names subscribed explicitly: primary names or `network/ip` aliases.
    names: HashSet<String>,
    /// Primary name -> version the client holds.
    sent: HashMap<String, String>,
    /// The first request of this type has been answered.
    answered: bool,
}

/// Resources to add or update and names to remove, for one response.
#[derive(Debug, Default)]
struct Changes {
    resources: Vec<Resource>,
    removed: Vec<String>,
}

impl Changes {
    fn is_empty(&self) -> bool {
        self.resources.is_empty() && self.removed.is_empty()
    }
}

impl Subscription {
    fn new(type_url: &'static str) -> Self {
        Self {
            type_url,
            wildcard: false,
            names: HashSet::new(),
            sent: HashMap::new(),
            answered: false,
        }
    }

    fn to_resource(&self, res: &XdsResource) -> Resource {
        let aliases = if self.names.is_empty() {
            Vec::new()
        } else {
            res.aliases
                .iter()
                .filter(|a| self.names.contains(*a))
                .cloned()
                .collect()
        };
        Resource {
            name: res.name.clone(),
            aliases,
            version: res.version.clone(),
            resource: Some(res.body.clone()),
            ..Default::default()
        }
    }

    /// Adds `res` to `out` unless the client already holds this version.
    fn offer(&mut self, res: &XdsResource, out: &mut Changes) {
        if self.sent.get(&res.name) != Some(&res.version) {
            out.resources.push(self.to_resource(res));
            self.sent.insert(res.name.clone(), res.version.clone());
        }
    }

    /// Compares everything the client holds and wants with `set`.
    /// `new_names` are explicit names subscribed just now: those that do not
    /// exist are reported as removed so the client stops waiting for them.
    fn reconcile(&mut self, set: &ResourceSet, new_names: &[String]) -> Changes {
        let mut out = Changes::default();
        if self.wildcard {
            for res in set.by_name.values() {
                self.offer(res, &mut out);
            }
        }
        let mut wanted: HashSet<String> = HashSet::new();
        let names: Vec<String> = self.names.iter().cloned().collect();
        for n in &names {
            match set.resolve(n) {
                Some(primary) => {
                    if let Some(res) = set.by_name.get(primary) {
                        if !self.wildcard {
                            self.offer(res, &mut out);
                        }
                        wanted.insert(res.name.clone());
                    }
                }
                None if new_names.contains(n) => out.removed.push(n.clone()),
                None => {}
            }
        }
        let wildcard = self.wildcard;
        self.sent.retain(|name, _| {
            if !set.by_name.contains_key(name) {
                out.removed.push(name.clone());
                false
            } else {
                // No longer wanted: the client dropped it itself.
                wildcard || wanted.contains(name)
            }
        });
        out
    }

    /// Applies the changes of one consecutive snapshot (wildcard only).
    fn apply_delta(&mut self, snap: &Snapshot) -> Changes {
        let mut out = Changes::default();
        let (Some(set), Some(d)) = (resources(snap, self.type_url), delta(snap, self.type_url))
        else {
            return out;
        };
        for name in &d.changed {
            if let Some(res) = set.by_name.get(name) {
                self.offer(res, &mut out);
            }
        }
        for name in &d.removed {
            if self.sent.remove(name).is_some() {
                out.removed.push(name.clone());
            }
        }
        out
    }
}

pub(super) struct DeltaStream {
    id: u64,
    peer: String,
    node_id: String,
    shared: Arc<Shared>,
    tx: mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>,
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
        shared: Arc<Shared>,
        tx: mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>,
    ) -> Self {
        Self {
            id,
            peer,
            node_id: String::new(),
            shared,
            tx,
            subs: Vec::new(),
            nonce: 0,
            snap: Arc::new(Snapshot::default()),
            sync_slot: None,
        }
    }

    pub(super) async fn run(mut self, mut requests: Streaming<DeltaDiscoveryRequest>) {
        let mut snapshots = self.shared.snapshots.clone();
        // Until the sources delivered their initial state, an empty mesh
        // would look real to the client: hold the stream until then.
        let snap = match snapshots.wait_for(|s| s.synced).await {
            Ok(s) => s.clone(),
            Err(_) => return,
        };
        self.snap = snap;
        let labels = vec![("protocol", "delta")];
        self.shared.metrics.connected.get_or_create(&labels).inc();
        self.shared.registry.connect(ProxyInfo {
            connection: self.id,
            node_id: String::new(),
            peer: self.peer.clone(),
            protocol: "delta",
            connected_at_unix: unix_now(),
            last_snapshot_seq: self.snap.seq,
            types: Default::default(),
        });
        debug!("delta xDS stream opened");
        match self.serve(&mut requests, &mut snapshots).await {
            Ok(()) => info!(proxy = %self.node_id, "delta xDS stream closed by the client"),
            Err(e) => info!(proxy = %self.node_id, "delta xDS stream ended: {e}"),
        }
        self.shared.registry.disconnect(self.id);
        self.shared.metrics.connected.get_or_create(&labels).dec();
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
                    debug!(proxy = %self.node_id, "full sync not ACKed in time; releasing its slot");
                    self.sync_slot = None;
                }
            }
        }
    }

    async fn on_request(&mut self, req: DeltaDiscoveryRequest) -> Result<(), StreamEnd> {
        if self.node_id.is_empty() {
            if let Some(node) = &req.node {
                self.node_id = node.id.clone();
                let node_id = self.node_id.clone();
                self.shared
                    .registry
                    .update(self.id, |p| p.node_id = node_id);
            }
        }
        let Some(type_url) = SUPPORTED_TYPES.iter().copied().find(|t| *t == req.type_url) else {
            debug!(type_url = %req.type_url, "ignoring a request for a type this server does not serve");
            return Ok(());
        };
        if !req.response_nonce.is_empty() {
            if self
                .sync_slot
                .as_ref()
                .is_some_and(|s| s.nonce == req.response_nonce)
            {
                self.sync_slot = None;
            }
            match &req.error_detail {
                Some(err) => self.on_nack(type_url, &req.response_nonce, &err.message),
                None => {
                    let nonce = req.response_nonce.clone();
                    self.shared.registry.update(self.id, |p| {
                        let t = p.types.entry(type_url.to_string()).or_default();
                        t.acks += 1;
                        t.last_nonce_acked = nonce;
                    });
                }
            }
        }

        let idx = match self.subs.iter().position(|s| s.type_url == type_url) {
            Some(i) => i,
            None => {
                self.subs.push(Subscription::new(type_url));
                self.subs.len() - 1
            }
        };
        let sub = &mut self.subs[idx];
        let first = !sub.answered;
        let mut changed = first;
        if first {
            sub.answered = true;
            sub.wildcard = req.resource_names_subscribe.is_empty()
                || req.resource_names_subscribe.iter().any(|n| n == "*");
            sub.sent.extend(req.initial_resource_versions);
        }
        let mut new_names = Vec::new();
        for n in req.resource_names_subscribe {
            if n == "*" {
                changed |= !sub.wildcard;
                sub.wildcard = true;
            } else if sub.names.insert(n.clone()) {
                new_names.push(n);
                changed = true;
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
        let Some(set) = resources(&self.snap, type_url) else {
            return Ok(());
        };
        let changes = sub.reconcile(set, &new_names);
        let (wildcard, explicit) = (sub.wildcard, sub.names.len());
        self.shared.registry.update(self.id, |p| {
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

    async fn on_snapshot(&mut self, snap: Arc<Snapshot>) -> Result<(), StreamEnd> {
        let consecutive = snap.seq == self.snap.seq + 1;
        self.snap = snap;
        for idx in 0..self.subs.len() {
            let sub = &mut self.subs[idx];
            let changes = if consecutive && sub.wildcard && sub.names.is_empty() {
                sub.apply_delta(&self.snap)
            } else {
                match resources(&self.snap, sub.type_url) {
                    Some(set) => sub.reconcile(set, &[]),
                    None => Changes::default(),
                }
            };
            if !changes.is_empty() {
                self.send(idx, changes).await?;
            }
        }
        let seq = self.snap.seq;
        self.shared
            .registry
            .update(self.id, |p| p.last_snapshot_seq = seq);
        Ok(())
    }

    fn on_nack(&self, type_url: &'static str, nonce: &str, message: &str) {
        warn!(
            proxy = %self.node_id, type_url, nonce, error = message,
            "proxy rejected (NACKed) an xDS response and keeps its previous config; \
             fix the resource named in the error"
        );
        self.shared
            .metrics
            .rejects
            .get_or_create(&vec![("type", type_label(type_url))])
            .inc();
        self.shared.registry.record_nack(NackRecord {
            at_unix: unix_now(),
            node_id: self.node_id.clone(),
            type_url: type_url.to_string(),
            nonce: nonce.to_string(),
            message: message.to_string(),
        });
        self.shared.registry.update(self.id, |p| {
            p.types.entry(type_url.to_string()).or_default().nacks += 1;
        });
    }

    async fn send(&mut self, idx: usize, changes: Changes) -> Result<(), StreamEnd> {
        self.nonce += 1;
        let nonce = format!("{}-{}", self.id, self.nonce);
        if changes.resources.len() >= LARGE_RESPONSE {
            // Wait for a full-sync slot; our own previous one is released first.
            self.sync_slot = None;
            let permit = self
                .shared
                .full_syncs
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| StreamEnd::ModelStopped)?;
            self.sync_slot = Some(SyncSlot {
                nonce: nonce.clone(),
                deadline: tokio::time::Instant::now() + FULL_SYNC_SLOT_TIMEOUT,
                _permit: permit,
            });
        }
        let sub = &self.subs[idx];
        let type_url = sub.type_url;
        let labels = vec![("type", type_label(type_url))];
        let bytes: usize = changes
            .resources
            .iter()
            .map(|r| r.resource.as_ref().map_or(0, |a| a.value.len()))
            .sum();
        let m = &self.shared.metrics;
        m.pushes.get_or_create(&labels).inc();
        m.resources_sent
            .get_or_create(&labels)
            .inc_by(changes.resources.len() as u64);
        m.push_bytes.get_or_create(&labels).inc_by(bytes as u64);
        let held = sub.sent.len();
        let nonce_copy = nonce.clone();
        self.shared.registry.update(self.id, |p| {
            let t = p.types.entry(type_url.to_string()).or_default();
            t.pushes += 1;
            t.resources_held = held;
            t.last_nonce_sent = nonce_copy;
        });
        debug!(
            type_url,
            nonce,
            resources = changes.resources.len(),
            removed = changes.removed.len(),
            bytes,
            "pushing delta response"
        );
        let resp = DeltaDiscoveryResponse {
            system_version_info: self.snap.seq.to_string(),
            resources: changes.resources,
            type_url: type_url.to_string(),
            removed_resources: changes.removed,
            nonce,
            ..Default::default()
        };
        self.tx
            .send(Ok(resp))
            .await
            .map_err(|_| StreamEnd::ClientGone)
    }
}

/// Sleeps until `deadline`, or forever when there is none.
async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}
