//! The ADS server: Delta (first-class) and state-of-the-world streams for
//! `istio.workload.Address` and `istio.security.Authorization`.
//!
//! Every stream is its own task. It watches the model's snapshot channel
//! (latest state wins: a slow stream skips intermediate snapshots and
//! reconciles against the newest) and writes responses into a small bounded
//! queue, so a client that does not read stalls only itself.

mod delta;
mod sotw;
pub mod status;
mod stream;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::model::snapshot::{ResourceDelta, ResourceSet, Snapshot};
pub use status::{ProxyRegistry, XdsMetrics};

/// Responses a stream may have queued before it waits for the client.
const RESPONSE_QUEUE: usize = 4;

/// Responses with at least this many resources count as a full sync.
const LARGE_RESPONSE: usize = 1000;

/// Most resources in one Delta response (~200 KB of workloads).
const CHUNK: usize = 1000;

/// Full syncs in flight at once (sent and not yet ACKed). Bounds the memory
/// a crowd of reconnecting proxies can pin and lets the first of them get
/// ready sooner; small pushes never wait.
const CONCURRENT_FULL_SYNCS: usize = 8;

/// A full sync holds its slot until ACKed, or at most this long.
const FULL_SYNC_SLOT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The xDS types this server serves.
pub const SUPPORTED_TYPES: [&str; 2] = [
    ambit_proto::ADDRESS_TYPE_URL,
    ambit_proto::AUTHORIZATION_TYPE_URL,
];

/// Shared by every stream of one server.
#[derive(Debug)]
struct Shared {
    snapshots: watch::Receiver<Arc<Snapshot>>,
    registry: Arc<ProxyRegistry>,
    metrics: XdsMetrics,
    next_connection: AtomicU64,
    full_syncs: Arc<tokio::sync::Semaphore>,
}

/// The aggregated discovery service. Cheap to clone.
#[derive(Debug, Clone)]
pub struct XdsServer {
    shared: Arc<Shared>,
}

impl XdsServer {
    pub fn new(
        snapshots: watch::Receiver<Arc<Snapshot>>,
        registry: Arc<ProxyRegistry>,
        metrics: XdsMetrics,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                snapshots,
                registry,
                metrics,
                next_connection: AtomicU64::new(1),
                full_syncs: Arc::new(tokio::sync::Semaphore::new(CONCURRENT_FULL_SYNCS)),
            }),
        }
    }

    /// The tonic service to mount on a gRPC server.
    pub fn into_service(self) -> AggregatedDiscoveryServiceServer<Self> {
        AggregatedDiscoveryServiceServer::new(self)
            .max_decoding_message_size(16 << 20)
            .max_encoding_message_size(usize::MAX)
    }

    fn next_connection(&self) -> u64 {
        self.shared.next_connection.fetch_add(1, Ordering::Relaxed)
    }
}

/// Resources of `type_url` in `snap`, when the type is served.
fn resources<'a>(snap: &'a Snapshot, type_url: &str) -> Option<&'a ResourceSet> {
    match type_url {
        ambit_proto::ADDRESS_TYPE_URL => Some(&snap.addresses),
        ambit_proto::AUTHORIZATION_TYPE_URL => Some(&snap.authorizations),
        _ => None,
    }
}

/// Changes of `type_url` between `snap.seq - 1` and `snap`.
fn delta<'a>(snap: &'a Snapshot, type_url: &str) -> Option<&'a ResourceDelta> {
    match type_url {
        ambit_proto::ADDRESS_TYPE_URL => Some(&snap.address_delta),
        ambit_proto::AUTHORIZATION_TYPE_URL => Some(&snap.authorization_delta),
        _ => None,
    }
}

fn peer_of<T>(req: &Request<T>) -> String {
    req.remote_addr()
        .map(|a: SocketAddr| a.to_string())
        .unwrap_or_else(|| "unknown".to_string())
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for XdsServer {
    type StreamAggregatedResourcesStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaAggregatedResourcesStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let id = self.next_connection();
        let peer = peer_of(&request);
        let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
        let span = tracing::info_span!("xds", conn = id, protocol = "sotw", peer = %peer);
        let conn = sotw::SotwStream::new(id, peer, self.shared.clone(), tx);
        tokio::spawn(conn.run(request.into_inner()).instrument(span));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let id = self.next_connection();
        let peer = peer_of(&request);
        let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
        let span = tracing::info_span!("xds", conn = id, protocol = "delta", peer = %peer);
        let conn = delta::DeltaStream::new(id, peer, self.shared.clone(), tx);
        tokio::spawn(conn.run(request.into_inner()).instrument(span));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[cfg(test)]
mod tests;
