//! What every ADS stream does the same way, Delta or SotW: wait for the
//! first synced snapshot, register with the proxy registry and metrics,
//! learn the node id, record ACKs and NACKs, and unregister at the end.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use tonic::Status;
use tracing::{debug, warn};

use super::Shared;
use super::generator::{Generator, Served, TypeSpec};
use super::proxy::ProxyNode;
use super::status::{NackRecord, ProxyInfo, unix_now};
use crate::ca::Caller;
use crate::model::snapshot::Snapshot;

/// Why a stream ended.
#[derive(Debug, thiserror::Error)]
pub(super) enum StreamEnd {
    #[error("the client stopped reading responses (connection closed)")]
    ClientGone,
    #[error("the client's request stream failed: {0}")]
    Client(Status),
    #[error("the mesh model stopped; the control plane is shutting down")]
    ModelStopped,
    /// The stream is refused; the status is sent to the client.
    #[error("refused: {}", .0.message())]
    Refused(Status),
}

/// Identity and bookkeeping of one stream.
pub(super) struct StreamCtx {
    pub id: u64,
    pub peer: String,
    pub node_id: String,
    pub protocol: &'static str,
    pub shared: Arc<Shared>,
    /// Who authenticated the stream.
    caller: Caller,
    /// The proxy and its generator, from the first request.
    served: Option<(ProxyNode, Option<Arc<dyn Generator>>)>,
}

impl StreamCtx {
    pub fn new(
        id: u64,
        peer: String,
        caller: Caller,
        protocol: &'static str,
        shared: Arc<Shared>,
    ) -> Self {
        Self {
            id,
            peer,
            caller,
            node_id: String::new(),
            protocol,
            shared,
            served: None,
        }
    }

    /// Waits until the sources delivered their initial state (an empty mesh
    /// would look real to the client), then registers the stream. `None`
    /// when the model stopped first.
    pub async fn open(&self) -> Option<Arc<Snapshot>> {
        let mut snapshots = self.shared.snapshots.clone();
        let snap = snapshots.wait_for(|s| s.synced).await.ok()?.clone();
        self.shared
            .metrics
            .connected
            .get_or_create(&vec![("protocol", self.protocol)])
            .inc();
        self.shared.registry.connect(ProxyInfo {
            connection: self.id,
            node_id: String::new(),
            kind: "",
            peer: self.peer.clone(),
            protocol: self.protocol,
            connected_at_unix: unix_now(),
            last_snapshot_seq: snap.seq,
            types: Default::default(),
        });
        Some(snap)
    }

    /// Logs how the stream ended and unregisters it.
    pub fn close(&self, result: Result<(), StreamEnd>) {
        match result {
            // Per-stream lines are DEBUG: a crowd of proxies (or a flood)
            // must not flood the log; /debug/connections lists streams.
            Ok(()) => {
                debug!(proxy = %self.node_id, protocol = self.protocol, "xDS stream closed by the client")
            }
            Err(e) => {
                debug!(proxy = %self.node_id, protocol = self.protocol, "xDS stream ended: {e}")
            }
        }
        self.shared.registry.disconnect(self.id);
        self.shared
            .metrics
            .connected
            .get_or_create(&vec![("protocol", self.protocol)])
            .dec();
    }

    /// Learns who the proxy is from the first request (xDS clients send
    /// their node on the first request only), checks the caller may be
    /// served as that proxy and picks its generator.
    pub fn learn_node(&mut self, node: Option<&Node>) -> Result<(), StreamEnd> {
        if self.served.is_some() {
            return Ok(());
        }
        let proxy = ProxyNode::from_node(node);
        if let Err(e) = self.shared.access.authorize(&self.caller, &proxy) {
            self.shared
                .metrics
                .refused
                .get_or_create(&vec![("reason", "permission_denied")])
                .inc();
            self.shared.access.log_refusal(&self.peer, &e.to_string());
            return Err(StreamEnd::Refused(Status::permission_denied(e.to_string())));
        }
        let generator = self.shared.generators.for_kind(proxy.kind);
        if generator.is_none() {
            warn!(
                proxy = %proxy.id, kind = %proxy.kind,
                "this control plane serves no resources to this kind of proxy; its requests are ignored"
            );
        }
        self.node_id = proxy.id.clone();
        let (node_id, kind) = (proxy.id.clone(), proxy.kind.as_str());
        self.shared.registry.update(self.id, |p| {
            p.node_id = node_id;
            p.kind = kind;
        });
        self.served = Some((proxy, generator));
        Ok(())
    }

    /// Refuses a request that would make the stream hold more than it may.
    pub fn check_names<'a>(
        &self,
        held: usize,
        new: impl Iterator<Item = &'a String>,
    ) -> Result<(), StreamEnd> {
        let mut count = held;
        for n in new {
            count += 1;
            let why = if n.len() > super::MAX_NAME_LEN {
                format!(
                    "a resource name of {} bytes (at most {})",
                    n.len(),
                    super::MAX_NAME_LEN
                )
            } else if count > super::MAX_SUBSCRIBED_NAMES {
                format!(
                    "more than {} subscribed names of one type",
                    super::MAX_SUBSCRIBED_NAMES
                )
            } else {
                continue;
            };
            self.shared
                .metrics
                .refused
                .get_or_create(&vec![("reason", "resource_exhausted")])
                .inc();
            self.shared.access.log_refusal(&self.peer, &why);
            return Err(StreamEnd::Refused(Status::resource_exhausted(format!(
                "the request asks for {why}; subscribe to `*` (wildcard) instead of naming this many resources"
            ))));
        }
        Ok(())
    }

    /// The spec of `type_url` when this stream's generator serves it.
    pub fn spec(&self, type_url: &str) -> Option<&'static TypeSpec> {
        let spec = self
            .served
            .as_ref()
            .and_then(|(_, g)| g.as_ref())
            .and_then(|g| g.spec(type_url));
        if spec.is_none() {
            debug!(
                type_url,
                "ignoring a request for a type this proxy is not served"
            );
        }
        spec
    }

    /// Every type this stream's generator serves, in push order.
    pub fn served_types(&self) -> &'static [TypeSpec] {
        match self.served.as_ref().and_then(|(_, g)| g.as_ref()) {
            Some(g) => g.types(),
            None => &[],
        }
    }

    /// What this stream's proxy is served of `type_url` in `snap`.
    pub fn generate(&self, snap: &Snapshot, type_url: &str) -> Served {
        match &self.served {
            Some((proxy, Some(g))) => g.generate(proxy, snap, type_url),
            _ => Served::empty(),
        }
    }

    /// Records the ACK or NACK carried by a request with `nonce`.
    pub fn acked(&self, spec: &'static TypeSpec, nonce: &str, error: Option<&RpcStatus>) {
        let type_url = spec.type_url;
        let Some(err) = error else {
            let nonce = nonce.to_string();
            self.shared.registry.update(self.id, |p| {
                p.types
                    .entry(type_url.to_string())
                    .or_default()
                    .acked(nonce);
            });
            return;
        };
        warn!(
            proxy = %self.node_id, type_url, nonce, error = %err.message,
            "proxy rejected (NACKed) an xDS response and keeps its previous config; \
             fix the resource named in the error"
        );
        self.shared
            .metrics
            .rejects
            .get_or_create(&vec![("type", spec.label)])
            .inc();
        self.shared.registry.record_nack(NackRecord {
            at_unix: unix_now(),
            node_id: self.node_id.clone(),
            type_url: type_url.to_string(),
            nonce: nonce.to_string(),
            message: err.message.clone(),
        });
        let message = err.message.clone();
        self.shared.registry.update(self.id, |p| {
            p.types
                .entry(type_url.to_string())
                .or_default()
                .nacked(message);
        });
    }
}
