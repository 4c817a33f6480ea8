//! The gRPC service `envoy.service.discovery.v3.AggregatedDiscoveryService`,
//! routed by hand so Delta responses can be [`DeltaChunk`]s (encoded from
//! the snapshot's resources without copying them) rather than the generated
//! message type the generated server would require. Requests are decoded
//! with the generated types; state-of-the-world responses use them too.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DiscoveryRequest, DiscoveryResponse,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, StdError, http};
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;

use super::XdsServer;
use super::wire::{DeltaChunk, DeltaCodec};

/// What a Delta stream sends.
pub(super) type DeltaResponses = ReceiverStream<Result<DeltaChunk, Status>>;
/// What a state-of-the-world stream sends.
pub(super) type SotwResponses = ReceiverStream<Result<DiscoveryResponse, Status>>;

const SERVICE: &str = "envoy.service.discovery.v3.AggregatedDiscoveryService";
const SOTW_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// The ADS service to mount on a tonic server. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AdsService {
    server: XdsServer,
    max_request_bytes: usize,
}

impl AdsService {
    pub(super) fn new(server: XdsServer, max_request_bytes: usize) -> AdsService {
        AdsService {
            server,
            max_request_bytes,
        }
    }
}

impl NamedService for AdsService {
    const NAME: &'static str = SERVICE;
}

/// One ADS method bound to the server.
struct Sotw(XdsServer);
struct Delta(XdsServer);

impl StreamingService<DiscoveryRequest> for Sotw {
    type Response = DiscoveryResponse;
    type ResponseStream = SotwResponses;
    type Future = BoxFuture<Response<SotwResponses>, Status>;

    fn call(&mut self, request: Request<Streaming<DiscoveryRequest>>) -> Self::Future {
        let server = self.0.clone();
        Box::pin(async move { server.stream_aggregated_resources(request).await })
    }
}

impl StreamingService<DeltaDiscoveryRequest> for Delta {
    type Response = DeltaChunk;
    type ResponseStream = DeltaResponses;
    type Future = BoxFuture<Response<DeltaResponses>, Status>;

    fn call(&mut self, request: Request<Streaming<DeltaDiscoveryRequest>>) -> Self::Future {
        let server = self.0.clone();
        Box::pin(async move { server.delta_aggregated_resources(request).await })
    }
}

impl<B> tonic::codegen::Service<http::Request<B>> for AdsService
where
    B: tonic::codegen::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let server = self.server.clone();
        // Responses are never limited: a full sync is chunked by the stream.
        let limits = (Some(self.max_request_bytes), Some(usize::MAX));
        match req.uri().path() {
            SOTW_PATH => Box::pin(async move {
                let mut grpc =
                    Grpc::new(ProstCodec::<DiscoveryResponse, DiscoveryRequest>::default())
                        .apply_max_message_size_config(limits.0, limits.1);
                Ok(grpc.streaming(Sotw(server), req).await)
            }),
            DELTA_PATH => Box::pin(async move {
                let mut grpc =
                    Grpc::new(DeltaCodec).apply_max_message_size_config(limits.0, limits.1);
                Ok(grpc.streaming(Delta(server), req).await)
            }),
            _ => {
                Box::pin(async move { Ok(Status::unimplemented("no such ADS method").into_http()) })
            }
        }
    }
}
