//! The xDS connection loop.
//!
//! ```text
//! loop {
//!     connect → send one wildcard subscription per type (with the versions
//!     we hold) → for each response: apply, publish, ACK/NACK
//!     on error: count the termination, back off (100 ms … 2 s, jittered)
//! }
//! ```
//! The state stays published while disconnected, so the data path keeps
//! serving from the last configuration.

use std::collections::{BTreeSet, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse,
};
use prost::Message;
use rand::Rng;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::transport::Endpoint;
use tracing::{Instrument, debug, info, info_span, warn};

use super::{WILDCARD, XdsError, XdsHandle, handler};
use crate::config::Config;
use crate::control_channel::{ControlChannel, ControlChannelError, XDS_ADDRESS_FLAG};
use crate::drain::DrainWatcher;
use crate::metrics::{Metrics, TerminationReason, UrlLabel};
use crate::state::{ResourceType, StateSnapshot, StateWriter};

/// Largest response accepted: a full Address sync of a big mesh is tens of
/// MiB, far beyond tonic's 4 MiB default.
const MAX_MESSAGE_BYTES: usize = 256 * 1024 * 1024;
/// Requests (ACKs, on-demand subscriptions) waiting to go out on a stream.
const REQUEST_QUEUE: usize = 64;
/// On-demand names waiting for the xDS task.
const ON_DEMAND_QUEUE: usize = 1024;

/// Settings of the xDS client.
#[derive(Debug, Clone)]
pub struct XdsClientConfig {
    /// Control plane URL.
    pub address: String,
    /// Node name (node metadata `NODE_NAME`, node id).
    pub node_name: String,
    /// Cluster id (node metadata `CLUSTER_ID`).
    pub cluster_id: String,
    /// Network (node metadata `NETWORK`).
    pub network: String,
    /// Bearer token file, re-read on every connection attempt.
    pub token_file: Option<std::path::PathBuf>,
    /// PEM roots that verify the control plane's certificate; required for
    /// an `https://` address. Read when the client is built and again at
    /// every connection attempt (a rotated root is picked up on reconnect).
    pub root_cert: Option<std::path::PathBuf>,
    /// First reconnect delay.
    pub initial_backoff: Duration,
    /// Longest reconnect delay.
    pub max_backoff: Duration,
    /// Connect timeout of one attempt.
    pub connect_timeout: Duration,
}

impl XdsClientConfig {
    /// The xDS settings of `config`, with the default backoff.
    pub fn from_config(config: &Config) -> Self {
        Self {
            address: config.xds_address.clone(),
            node_name: config.node_name.clone(),
            cluster_id: config.cluster_id.clone(),
            network: config.network.clone(),
            token_file: config.token_file.clone(),
            root_cert: config.root_cert.clone(),
            initial_backoff: Duration::from_millis(100),
            // A returning control plane is used within ~2.5 s however long
            // it was gone; its full-sync gate (8 at a time) and the jitter
            // keep a crowd of reconnecting ztunnels from stampeding it.
            max_backoff: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// Exponential backoff with ±25 % jitter.
#[derive(Debug)]
struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            next: initial,
        }
    }

    fn reset(&mut self) {
        self.next = self.initial;
    }

    fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        base.mul_f64(rand::rng().random_range(0.75..1.25))
    }
}

/// The xDS task: the only writer of the state.
#[derive(Debug)]
pub struct XdsClient {
    config: XdsClientConfig,
    channel: ControlChannel,
    node: Node,
    writer: StateWriter,
    metrics: Arc<Metrics>,
    ready: watch::Sender<bool>,
    synced: HashSet<ResourceType>,
    on_demand_rx: mpsc::Receiver<String>,
    /// Every name requested on demand; re-subscribed on each connection.
    on_demand: BTreeSet<String>,
    connection: u64,
    /// The current stream got past the gRPC call.
    established: bool,
    /// The current stream delivered at least one response.
    received: bool,
    /// Chunks of a full sync received so far (`+partial` responses), applied
    /// to a private copy and published once with the last chunk: readers
    /// never see half a sync, and the indexes are copied once, not per chunk.
    pending: Option<StateSnapshot>,
}

impl XdsClient {
    /// A client that will feed `writer` and flip `ready` to true after the
    /// first response of every type; plus the handle for on-demand requests.
    pub fn new(
        config: XdsClientConfig,
        writer: StateWriter,
        metrics: Arc<Metrics>,
        ready: watch::Sender<bool>,
    ) -> Result<(Self, XdsHandle), XdsError> {
        // Parsed twice on purpose: a malformed URL keeps its precise tonic
        // error; the TLS side (scheme, --root-cert) is the channel's.
        Endpoint::from_shared(config.address.clone()).map_err(|source| {
            XdsError::InvalidAddress {
                addr: config.address.clone(),
                source,
            }
        })?;
        let channel = ControlChannel::new(
            &config.address,
            config.root_cert.as_deref(),
            XDS_ADDRESS_FLAG,
        )
        .map_err(|e: ControlChannelError| XdsError::ControlChannel(Box::new(e)))?
        .map_endpoint(|e| {
            e.connect_timeout(config.connect_timeout)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(30))
                .keep_alive_timeout(Duration::from_secs(10))
                .keep_alive_while_idle(true)
        });
        let node = super::node(&config.node_name, &config.cluster_id, &config.network);
        let (tx, rx) = mpsc::channel(ON_DEMAND_QUEUE);
        let client = Self {
            config,
            channel,
            node,
            writer,
            metrics,
            ready,
            synced: HashSet::new(),
            on_demand_rx: rx,
            on_demand: BTreeSet::new(),
            connection: 0,
            established: false,
            received: false,
            pending: None,
        };
        Ok((client, XdsHandle { on_demand: tx }))
    }

    /// Runs until `drain` fires: connects, serves, reconnects.
    pub async fn run(mut self, drain: DrainWatcher) {
        let mut backoff = Backoff::new(self.config.initial_backoff, self.config.max_backoff);
        loop {
            self.connection += 1;
            let span = info_span!(
                "xds",
                xds = %self.config.address,
                connection = self.connection
            );
            let err = tokio::select! {
                biased;
                _ = drain.signaled() => break,
                err = self.run_stream().instrument(span.clone()) => err,
            };
            self.metrics.xds.connected.set(0);
            let reason = match (&err, self.established) {
                (XdsError::Closed { .. }, _) => TerminationReason::Complete,
                (_, false) => TerminationReason::ConnectionError,
                (_, true) => TerminationReason::Error,
            };
            self.metrics.xds.record_termination(reason);
            if self.received {
                backoff.reset();
            }
            let delay = backoff.next_delay();
            span.in_scope(|| warn!(error = %err, retry_in = ?delay, "xDS connection ended"));
            tokio::select! {
                biased;
                _ = drain.signaled() => break,
                _ = tokio::time::sleep(delay) => {}
            }
        }
        self.metrics.xds.connected.set(0);
        debug!(node = %self.config.node_name, "xDS client stopped");
    }

    /// One connection; returns why it ended.
    async fn run_stream(&mut self) -> XdsError {
        self.established = false;
        self.received = false;
        // A sync cut short by the old stream is redone by the new one, which
        // starts from the published state's resource versions.
        self.pending = None;
        match self.serve_stream().await {
            Ok(never) => match never {},
            Err(e) => e,
        }
    }

    async fn serve_stream(&mut self) -> Result<std::convert::Infallible, XdsError> {
        let addr = self.config.address.clone();
        let token = match &self.config.token_file {
            Some(path) => Some(read_token(path).await?),
            None => None,
        };
        let channel = self
            .channel
            .connect()
            .await
            .map_err(|source| XdsError::Connect {
                addr: addr.clone(),
                source,
            })?;

        let (tx, rx) = mpsc::channel(REQUEST_QUEUE);
        for req in self.initial_requests() {
            debug!(
                type_url = %req.type_url,
                known = req.initial_resource_versions.len(),
                "subscribing"
            );
            send(&tx, req, &addr).await?;
        }
        let mut request = tonic::Request::new(ReceiverStream::new(rx));
        if let Some(token) = token {
            request.metadata_mut().insert("authorization", token);
        }
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES);
        let mut inbound = client
            .delta_aggregated_resources(request)
            .await
            .map_err(|status| XdsError::Stream {
                addr: addr.clone(),
                status: Box::new(status),
            })?
            .into_inner();
        self.established = true;
        self.metrics.xds.connected.set(1);
        info!("xDS stream established");

        loop {
            tokio::select! {
                msg = inbound.message() => {
                    let resp = match msg {
                        Ok(Some(resp)) => resp,
                        Ok(None) => return Err(XdsError::Closed { addr }),
                        Err(status) => {
                            return Err(XdsError::Stream { addr, status: Box::new(status) });
                        }
                    };
                    self.received = true;
                    let reply = self.on_response(&resp);
                    send(&tx, reply, &addr).await?;
                }
                Some(name) = self.on_demand_rx.recv() => {
                    if self.on_demand.insert(name.clone()) {
                        debug!(%name, "on-demand subscription");
                        let req = DeltaDiscoveryRequest {
                            type_url: ResourceType::Address.type_url().to_string(),
                            resource_names_subscribe: vec![name],
                            ..Default::default()
                        };
                        send(&tx, req, &addr).await?;
                    }
                }
            }
        }
    }

    /// One wildcard subscription per type, carrying what we already hold.
    fn initial_requests(&self) -> Vec<DeltaDiscoveryRequest> {
        let current = self.writer.current();
        ResourceType::ALL
            .into_iter()
            .map(|ty| {
                let mut subscribe = vec![WILDCARD.to_string()];
                if ty == ResourceType::Address {
                    subscribe.extend(self.on_demand.iter().cloned());
                }
                DeltaDiscoveryRequest {
                    node: Some(self.node.clone()),
                    type_url: ty.type_url().to_string(),
                    resource_names_subscribe: subscribe,
                    initial_resource_versions: current.resource_versions(ty),
                    ..Default::default()
                }
            })
            .collect()
    }

    /// Applies one response, publishes the new state, returns the ACK/NACK.
    fn on_response(&mut self, resp: &DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
        let url = UrlLabel::new(&resp.type_url);
        let xm = &self.metrics.xds;
        xm.messages.get_or_create(&url).inc();
        xm.message_bytes
            .get_or_create(&url)
            .inc_by(resp.encoded_len() as u64);

        let partial = resp
            .system_version_info
            .ends_with(ambit_proto::PARTIAL_RESPONSE_MARKER);
        let mut next = self.pending.take().unwrap_or_else(|| self.writer.begin());
        let handled = handler::handle_response(&mut next, resp);
        if handled.is_nack() {
            xm.nacks_sent.get_or_create(&url).inc();
            for e in &handled.errors {
                warn!(type_url = %resp.type_url, nonce = %resp.nonce, error = %e, "rejecting xDS resource");
            }
        }
        if partial {
            self.pending = Some(next);
            return handled.reply;
        }
        let snapshot = self.writer.publish(next);
        debug!(
            type_url = %resp.type_url,
            nonce = %resp.nonce,
            updated = resp.resources.len(),
            removed = resp.removed_resources.len(),
            generation = snapshot.generation(),
            nack = handled.is_nack(),
            "applied xDS response"
        );
        if let Some(ty) = handled.ty {
            xm.resources
                .get_or_create(&url)
                .set(snapshot.xds_resources(ty).len() as i64);
            self.mark_synced(ty);
        }
        handled.reply
    }

    /// The first complete response of a type is its sync point; ready once
    /// every subscribed type has synced.
    fn mark_synced(&mut self, ty: ResourceType) {
        if self.synced.insert(ty) && self.synced.len() == ResourceType::ALL.len() {
            let snap = self.writer.current();
            info!(
                workloads = snap.workload_count(),
                services = snap.service_count(),
                policies = snap.authorization_count(),
                "initial xDS sync complete; ready"
            );
            self.ready.send_replace(true);
        }
    }
}

async fn send(
    tx: &mpsc::Sender<DeltaDiscoveryRequest>,
    req: DeltaDiscoveryRequest,
    addr: &str,
) -> Result<(), XdsError> {
    tx.send(req).await.map_err(|_| XdsError::SendFailed {
        addr: addr.to_string(),
    })
}

/// Reads the bearer token and turns it into the `authorization` value.
async fn read_token(path: &Path) -> Result<MetadataValue<tonic::metadata::Ascii>, XdsError> {
    let raw = tokio::fs::read_to_string(path)
        .await
        .map_err(|source| XdsError::TokenRead {
            path: path.to_path_buf(),
            source,
        })?;
    let token = raw.trim();
    if token.is_empty() {
        return Err(XdsError::TokenInvalid {
            path: path.to_path_buf(),
        });
    }
    MetadataValue::try_from(format!("Bearer {token}")).map_err(|_| XdsError::TokenInvalid {
        path: path.to_path_buf(),
    })
}

#[cfg(test)]
mod backoff_tests {
    use super::*;

    #[test]
    fn a_long_outage_is_retried_within_a_few_seconds() {
        let cfg = XdsClientConfig::from_config(&Config::new("n", "http://127.0.0.1:1"));
        let mut b = Backoff::new(cfg.initial_backoff, cfg.max_backoff);
        // However many attempts failed, the next one comes within 2.5 s.
        let worst = (0..100).map(|_| b.next_delay()).max().unwrap_or_default();
        assert!(worst <= Duration::from_millis(2500), "{worst:?}");
    }

    #[test]
    fn backoff_grows_caps_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(15));
        let first = b.next_delay();
        assert!(first >= Duration::from_millis(75) && first <= Duration::from_millis(125));
        for _ in 0..20 {
            b.next_delay();
        }
        let capped = b.next_delay();
        assert!(capped <= Duration::from_millis(18_750), "{capped:?}");
        assert!(capped >= Duration::from_millis(11_250), "{capped:?}");
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(125));
    }
}

#[cfg(test)]
mod token_tests {
    use super::read_token;

    /// Kubernetes' projected tokens end without a newline, hand-written
    /// files (`echo s3cret > token`) with one: both send the same header.
    #[tokio::test]
    async fn token_files_with_and_without_a_newline_send_the_same_header() {
        let dir = tempfile::tempdir().unwrap();
        for (name, body) in [
            ("k8s", "s3cret"),
            ("echo", "s3cret\n"),
            ("crlf", "s3cret\r\n"),
        ] {
            let path = dir.path().join(name);
            std::fs::write(&path, body).unwrap();
            let value = read_token(&path).await.unwrap();
            assert_eq!(value.to_str().unwrap(), "Bearer s3cret", "{name}");
        }
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").unwrap();
        assert!(read_token(&empty).await.is_err());
    }
}
