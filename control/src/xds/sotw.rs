//! One state-of-the-world ADS stream (`StreamAggregatedResources`).
//!
//! Each response carries every subscribed resource of its type; one is sent
//! when the subscription changes or when a subscribed resource changed.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use tokio::sync::{mpsc, watch};
use tonic::{Status, Streaming};

use super::Shared;
use super::generator::TypeSpec;
use super::stream::{StreamCtx, StreamEnd};
use crate::ca::Caller;
use crate::model::snapshot::{ResourceSet, Snapshot};

#[derive(Debug)]
struct Subscription {
    spec: &'static TypeSpec,
    /// Explicit names; empty (or `*`) means every resource.
    names: HashSet<String>,
    /// Primary name -> version of the last response sent.
    sent: BTreeMap<String, String>,
}

impl Subscription {
    fn wildcard(&self) -> bool {
        self.names.is_empty() || self.names.contains("*")
    }

    /// The subscribed resources of `set`, by primary name.
    fn wanted<'a>(&self, set: &'a ResourceSet) -> BTreeMap<&'a str, &'a str> {
        if self.wildcard() {
            set.by_name
                .values()
                .map(|r| (r.name.as_str(), r.version.as_str()))
                .collect()
        } else {
            self.names
                .iter()
                .filter_map(|n| set.resolve(n))
                .filter_map(|p| set.by_name.get(p))
                .map(|r| (r.name.as_str(), r.version.as_str()))
                .collect()
        }
    }

    fn differs(&self, wanted: &BTreeMap<&str, &str>) -> bool {
        wanted.len() != self.sent.len()
            || wanted
                .iter()
                .any(|(n, v)| self.sent.get(*n).map(String::as_str) != Some(*v))
    }
}

pub(super) struct SotwStream {
    ctx: StreamCtx,
    tx: mpsc::Sender<Result<DiscoveryResponse, Status>>,
    subs: Vec<Subscription>,
    nonce: u64,
    snap: Arc<Snapshot>,
}

impl SotwStream {
    pub(super) fn new(
        id: u64,
        peer: String,
        caller: Caller,
        shared: Arc<Shared>,
        tx: mpsc::Sender<Result<DiscoveryResponse, Status>>,
    ) -> Self {
        Self {
            ctx: StreamCtx::new(id, peer, caller, "sotw", shared),
            tx,
            subs: Vec::new(),
            nonce: 0,
            snap: Arc::new(Snapshot::default()),
        }
    }

    pub(super) async fn run(mut self, mut requests: Streaming<DiscoveryRequest>) {
        if self.ctx.open().await.is_none() {
            return;
        }
        let mut snapshots = self.ctx.shared.snapshots.clone();
        self.snap = snapshots.borrow_and_update().clone();
        let result = self.serve(&mut requests, &mut snapshots).await;
        if let Err(StreamEnd::Refused(status)) = &result {
            // Best effort: the client may already be gone.
            let _ = self.tx.send(Err(status.clone())).await;
        }
        self.ctx.close(result);
    }

    async fn serve(
        &mut self,
        requests: &mut Streaming<DiscoveryRequest>,
        snapshots: &mut watch::Receiver<Arc<Snapshot>>,
    ) -> Result<(), StreamEnd> {
        loop {
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
                    self.snap = snapshots.borrow_and_update().clone();
                    // In the generator's type order (ADS ordering); a type
                    // that follows a changed one is sent again in full.
                    let mut force: Vec<&'static str> = Vec::new();
                    for spec in self.ctx.served_types() {
                        if let Some(idx) = self.subs.iter().position(|s| s.spec == spec) {
                            let pushed = self
                                .push_if_changed(idx, force.contains(&spec.type_url))
                                .await?;
                            if let (true, Some(f)) = (pushed, spec.resend_with) {
                                force.push(f);
                            }
                        }
                    }
                }
            }
        }
    }

    async fn on_request(&mut self, req: DiscoveryRequest) -> Result<(), StreamEnd> {
        self.ctx.learn_node(req.node.as_ref())?;
        let Some(spec) = self.ctx.spec(&req.type_url) else {
            return Ok(());
        };
        if !req.response_nonce.is_empty() {
            self.ctx
                .acked(spec, &req.response_nonce, req.error_detail.as_ref());
        }
        self.ctx.check_names(0, req.resource_names.iter())?;
        let names: HashSet<String> = req.resource_names.into_iter().collect();
        let (idx, first) = match self.subs.iter().position(|s| s.spec == spec) {
            Some(i) => (i, false),
            None => {
                self.subs.push(Subscription {
                    spec,
                    names: HashSet::new(),
                    sent: BTreeMap::new(),
                });
                (self.subs.len() - 1, true)
            }
        };
        if first || self.subs[idx].names != names {
            self.subs[idx].names = names;
            self.push_if_changed(idx, first).await?;
        }
        Ok(())
    }

    /// Sends the full subscribed set of `subs[idx]` when it differs from the
    /// last one sent, or always when `force`; true when it sent.
    async fn push_if_changed(&mut self, idx: usize, force: bool) -> Result<bool, StreamEnd> {
        let sub = &self.subs[idx];
        let spec = sub.spec;
        let type_url = spec.type_url;
        let served = self.ctx.generate(&self.snap, type_url);
        let set = &*served.set;
        let wanted = sub.wanted(set);
        if !force && !sub.differs(&wanted) {
            return Ok(false);
        }
        let mut bytes = 0usize;
        let body: Vec<_> = wanted
            .keys()
            .filter_map(|n| set.by_name.get(*n))
            .map(|r| {
                bytes += r.body.value.len();
                r.body.clone()
            })
            .collect();
        let sent: BTreeMap<String, String> = wanted
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        self.subs[idx].sent = sent;
        self.nonce += 1;
        let nonce = format!("{}-{}", self.ctx.id, self.nonce);
        let labels = vec![("type", spec.label)];
        let m = &self.ctx.shared.metrics;
        m.pushes.get_or_create(&labels).inc();
        m.resources_sent
            .get_or_create(&labels)
            .inc_by(body.len() as u64);
        m.push_bytes.get_or_create(&labels).inc_by(bytes as u64);
        let (held, nonce_copy, seq) = (body.len(), nonce.clone(), self.snap.seq);
        self.ctx.shared.registry.update(self.ctx.id, |p| {
            let t = p.types.entry(type_url.to_string()).or_default();
            t.pushes += 1;
            t.resources_held = held;
            t.sent(nonce_copy, seq.to_string());
            p.last_snapshot_seq = seq;
        });
        let resp = DiscoveryResponse {
            version_info: self.snap.seq.to_string(),
            resources: body,
            type_url: type_url.to_string(),
            nonce,
            ..Default::default()
        };
        self.tx
            .send(Ok(resp))
            .await
            .map_err(|_| StreamEnd::ClientGone)?;
        Ok(true)
    }
}
