//! The ADS server: Delta (first-class) and state-of-the-world streams.
//! What a stream serves comes from the generator of its proxy's kind
//! ([`generator`]): the workload API for ztunnels today.
//!
//! Every stream is its own task. It watches the model's snapshot channel
//! (latest state wins: a slow stream skips intermediate snapshots and
//! reconciles against the newest) and writes responses into a small bounded
//! queue, so a client that does not read stalls only itself.

pub mod access;
mod delta;
pub mod generator;
pub mod proxy;
mod service;
pub mod sidecar;
mod sotw;
pub mod status;
mod stream;
pub mod waypoint;
mod wire;
pub mod ztunnel;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::ca::Caller;
use crate::model::snapshot::Snapshot;
pub use access::{AccessError, XdsAccess};
pub use generator::{Generator, Generators, Served, TypeSpec};
pub use proxy::{ProxyKind, ProxyNode};
pub use service::AdsService;
use service::{DeltaResponses, SotwResponses};
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

/// Most names one stream may subscribe to explicitly, per type (on-demand
/// lookups of a busy ztunnel stay far below this).
const MAX_SUBSCRIBED_NAMES: usize = 16_384;

/// Longest resource name a client may subscribe to.
const MAX_NAME_LEN: usize = 1024;

/// Largest request a client may send (a reconnecting ztunnel's
/// `initial_resource_versions` for 10,000 workloads is ~1 MB).
const MAX_REQUEST_BYTES: usize = 4 << 20;

/// A full sync holds its slot until ACKed, or at most this long.
const FULL_SYNC_SLOT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Shared by every stream of one server.
#[derive(Debug)]
struct Shared {
    snapshots: watch::Receiver<Arc<Snapshot>>,
    generators: Generators,
    access: XdsAccess,
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
    /// A server with every generator this control plane has.
    pub fn new(
        snapshots: watch::Receiver<Arc<Snapshot>>,
        access: XdsAccess,
        registry: Arc<ProxyRegistry>,
        metrics: XdsMetrics,
    ) -> Self {
        Self::with_generators(snapshots, Generators::standard(), access, registry, metrics)
    }

    /// A server with the given generators.
    pub fn with_generators(
        snapshots: watch::Receiver<Arc<Snapshot>>,
        generators: Generators,
        access: XdsAccess,
        registry: Arc<ProxyRegistry>,
        metrics: XdsMetrics,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                snapshots,
                generators,
                access,
                registry,
                metrics,
                next_connection: AtomicU64::new(1),
                full_syncs: Arc::new(tokio::sync::Semaphore::new(CONCURRENT_FULL_SYNCS)),
            }),
        }
    }

    /// The tonic service to mount on a gRPC server.
    pub fn into_service(self) -> AdsService {
        AdsService::new(self, MAX_REQUEST_BYTES)
    }

    fn next_connection(&self) -> u64 {
        self.shared.next_connection.fetch_add(1, Ordering::Relaxed)
    }

    /// Authenticates a new stream before anything is read from it or
    /// spawned for it.
    async fn authenticate<T>(&self, req: &Request<T>, peer: &str) -> Result<Caller, Status> {
        let result = self.shared.access.authenticate(req, peer).await;
        if result.is_err() {
            self.shared
                .metrics
                .refused
                .get_or_create(&vec![("reason", "unauthenticated")])
                .inc();
        }
        result
    }
}

fn peer_of<T>(req: &Request<T>) -> String {
    crate::tls_listener::remote_addr(req)
        .map(|a: SocketAddr| a.to_string())
        .unwrap_or_else(|| "unknown".to_string())
}

impl XdsServer {
    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<SotwResponses>, Status> {
        let peer = peer_of(&request);
        let caller = self.authenticate(&request, &peer).await?;
        let id = self.next_connection();
        let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
        let span = tracing::info_span!("xds", conn = id, protocol = "sotw", peer = %peer, caller = %caller);
        let conn = sotw::SotwStream::new(id, peer, caller, self.shared.clone(), tx);
        tokio::spawn(conn.run(request.into_inner()).instrument(span));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<DeltaResponses>, Status> {
        let peer = peer_of(&request);
        let caller = self.authenticate(&request, &peer).await?;
        let id = self.next_connection();
        let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
        let span = tracing::info_span!("xds", conn = id, protocol = "delta", peer = %peer, caller = %caller);
        let conn = delta::DeltaStream::new(id, peer, caller, self.shared.clone(), tx);
        tokio::spawn(conn.run(request.into_inner()).instrument(span));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

#[cfg(test)]
mod tests;
