//! The ADS server over a real gRPC connection on loopback, fed hand-built
//! snapshots.

use std::sync::Arc;
use std::time::Duration;

use ambit_proto::workload::{Address, Workload, address};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::Streaming;
use tonic::transport::Channel;

use super::*;
use crate::ca::{Caller, StaticTokens};
use crate::model::snapshot::{ResourceFamily, XdsResource};

const T: Duration = Duration::from_secs(5);

fn workload(uid: &str, ip: [u8; 4], sa: &str) -> XdsResource {
    let w = Workload {
        uid: uid.into(),
        name: uid.rsplit('/').next().unwrap_or(uid).into(),
        namespace: "ns".into(),
        addresses: vec![ip.to_vec()],
        service_account: sa.into(),
        ..Default::default()
    };
    let ip = std::net::Ipv4Addr::from(ip);
    XdsResource::new(
        ambit_proto::ADDRESS_TYPE_URL,
        uid.into(),
        vec![format!("/{ip}")],
        &Address {
            r#type: Some(address::Type::Workload(w)),
        },
    )
}

/// Publishes snapshots built from resource lists, tracking deltas.
struct Publisher {
    tx: watch::Sender<Arc<Snapshot>>,
}

impl Publisher {
    fn publish(&self, items: Vec<XdsResource>) {
        self.publish_families(vec![
            ResourceFamily::mesh(ambit_proto::ADDRESS_TYPE_URL, items),
            ResourceFamily::mesh(ambit_proto::AUTHORIZATION_TYPE_URL, Vec::new()),
        ]);
    }

    fn publish_families(&self, families: Vec<ResourceFamily>) {
        let prev = self.tx.borrow().clone();
        let mut next = Snapshot::following(&prev, families);
        next.synced = true;
        self.tx.send_replace(Arc::new(next));
    }
}

struct Harness {
    publisher: Publisher,
    client: AggregatedDiscoveryServiceClient<Channel>,
    registry: Arc<ProxyRegistry>,
    metrics: XdsMetrics,
}

async fn harness(initial: Vec<XdsResource>) -> Harness {
    harness_with(initial, Generators::standard()).await
}

async fn harness_with(initial: Vec<XdsResource>, generators: Generators) -> Harness {
    let (tx, rx) = watch::channel(Arc::new(Snapshot::default()));
    let publisher = Publisher { tx };
    publisher.publish(initial);
    let registry = Arc::new(ProxyRegistry::default());
    let metrics = XdsMetrics::register(&mut Registry::default());
    let access = XdsAccess::new(
        Arc::new(StaticTokens::new([
            (
                NODE_TOKEN.to_string(),
                Caller::Node {
                    name: "node-1".into(),
                },
            ),
            (
                WAYPOINT_TOKEN.to_string(),
                Caller::Workload {
                    namespace: "ns".into(),
                    service_account: "waypoint".into(),
                    node: None,
                },
            ),
        ])),
        vec![("ambit-system".into(), "ztunnel".into())],
    );
    let server =
        XdsServer::with_generators(rx, generators, access, registry.clone(), metrics.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(server.into_service())
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let client = AggregatedDiscoveryServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    Harness {
        publisher,
        client,
        registry,
        metrics,
    }
}

/// Authenticates as node-1.
const NODE_TOKEN: &str = "node-1-token";
/// Authenticates as `ns/waypoint`.
const WAYPOINT_TOKEN: &str = "ns-waypoint-token";

/// A streaming request carrying `authorization: Bearer <token>`.
fn authorized<T>(body: T, token: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(body);
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("ascii header"),
    );
    req
}

fn node() -> Option<Node> {
    Some(Node {
        id: "ztunnel~10.0.0.1~ztunnel-test.ambit-system~ambit-system.svc.cluster.local".into(),
        ..Default::default()
    })
}

struct DeltaClient {
    tx: mpsc::Sender<DeltaDiscoveryRequest>,
    rx: Streaming<DeltaDiscoveryResponse>,
}

impl DeltaClient {
    async fn open(h: &mut Harness, first: DeltaDiscoveryRequest) -> Self {
        Self::open_as(h, first, NODE_TOKEN).await
    }

    async fn open_as(h: &mut Harness, first: DeltaDiscoveryRequest, token: &str) -> Self {
        Self::try_open(h, first, Some(token))
            .await
            .expect("stream refused")
    }

    /// Opens a stream with `token` (none: no `authorization` header).
    async fn try_open(
        h: &mut Harness,
        first: DeltaDiscoveryRequest,
        token: Option<&str>,
    ) -> Result<Self, tonic::Status> {
        let (tx, req_rx) = mpsc::channel(16);
        tx.send(first).await.unwrap();
        let body = ReceiverStream::new(req_rx);
        let req = match token {
            Some(t) => authorized(body, t),
            None => tonic::Request::new(body),
        };
        let rx = h.client.delta_aggregated_resources(req).await?.into_inner();
        Ok(Self { tx, rx })
    }

    /// The status the server ended the stream with.
    async fn refused(&mut self) -> tonic::Status {
        match tokio::time::timeout(T, self.rx.next()).await {
            Ok(Some(Err(status))) => status,
            other => panic!("expected the stream to be refused, got {other:?}"),
        }
    }

    async fn recv(&mut self) -> DeltaDiscoveryResponse {
        tokio::time::timeout(T, self.rx.next())
            .await
            .expect("no response within 5 s")
            .expect("stream ended")
            .expect("stream failed")
    }

    async fn ack(&self, resp: &DeltaDiscoveryResponse) {
        self.tx
            .send(DeltaDiscoveryRequest {
                type_url: resp.type_url.clone(),
                response_nonce: resp.nonce.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }

    /// Asserts nothing arrives within `d`.
    async fn quiet(&mut self, d: Duration) {
        if let Ok(r) = tokio::time::timeout(d, self.rx.next()).await {
            panic!("unexpected response: {r:?}");
        }
    }
}

fn wildcard() -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: node(),
        type_url: ambit_proto::ADDRESS_TYPE_URL.into(),
        ..Default::default()
    }
}

fn names(resp: &DeltaDiscoveryResponse) -> Vec<&str> {
    let mut v: Vec<&str> = resp.resources.iter().map(|r| r.name.as_str()).collect();
    v.sort();
    v
}

#[tokio::test]
async fn delta_wildcard_sends_full_state_then_only_changes() {
    let a = workload("c//Pod/ns/a", [10, 0, 0, 1], "sa");
    let b = workload("c//Pod/ns/b", [10, 0, 0, 2], "sa");
    let mut h = harness(vec![a.clone(), b.clone()]).await;
    let mut c = DeltaClient::open(&mut h, wildcard()).await;
    let first = c.recv().await;
    assert_eq!(names(&first), ["c//Pod/ns/a", "c//Pod/ns/b"]);
    assert!(!first.nonce.is_empty());
    c.ack(&first).await;

    // Change b, remove a, add d: exactly those travel.
    let b2 = workload("c//Pod/ns/b", [10, 0, 0, 22], "sa");
    let d = workload("c//Pod/ns/d", [10, 0, 0, 4], "sa");
    h.publisher.publish(vec![b2, d]);
    let next = c.recv().await;
    assert_eq!(names(&next), ["c//Pod/ns/b", "c//Pod/ns/d"]);
    assert_eq!(next.removed_resources, ["c//Pod/ns/a"]);
    assert_ne!(next.nonce, first.nonce);
    c.ack(&next).await;

    // Republishing identical content sends nothing.
    let prev = h.publisher.tx.borrow().clone();
    let same: Vec<XdsResource> = prev
        .mesh(ambit_proto::ADDRESS_TYPE_URL)
        .by_name
        .values()
        .map(|r| (**r).clone())
        .collect();
    h.publisher.publish(same);
    c.quiet(Duration::from_millis(300)).await;
}

#[tokio::test]
async fn nack_is_recorded_and_the_stream_keeps_receiving() {
    let mut h = harness(vec![workload("c//Pod/ns/a", [10, 0, 0, 1], "sa")]).await;
    let mut c = DeltaClient::open(&mut h, wildcard()).await;
    let first = c.recv().await;
    c.tx.send(DeltaDiscoveryRequest {
        type_url: first.type_url.clone(),
        response_nonce: first.nonce.clone(),
        error_detail: Some(RpcStatus {
            code: 3,
            message: "c//Pod/ns/a: address has 3 bytes".into(),
            details: vec![],
        }),
        ..Default::default()
    })
    .await
    .unwrap();

    // The stream survives the NACK and gets the next push.
    h.publisher
        .publish(vec![workload("c//Pod/ns/a", [10, 0, 0, 9], "sa")]);
    let next = c.recv().await;
    assert_eq!(names(&next), ["c//Pod/ns/a"]);

    let nacks = h.registry.nacks();
    assert_eq!(nacks.len(), 1);
    assert!(nacks[0].node_id.starts_with("ztunnel~"));
    assert!(nacks[0].message.contains("3 bytes"));
    assert_eq!(
        h.metrics
            .rejects
            .get_or_create(&vec![("type", "address")])
            .get(),
        1
    );
    let proxies = h.registry.proxies();
    assert_eq!(proxies.len(), 1);
    assert_eq!(proxies[0].types[ambit_proto::ADDRESS_TYPE_URL].nacks, 1);
}

#[tokio::test]
async fn reconnect_with_initial_versions_gets_only_what_changed() {
    let a = workload("c//Pod/ns/a", [10, 0, 0, 1], "sa");
    let b = workload("c//Pod/ns/b", [10, 0, 0, 2], "sa");
    let mut h = harness(vec![a.clone(), b.clone()]).await;
    // The client held a (current) and an old b and a vanished x.
    let mut req = wildcard();
    req.initial_resource_versions
        .insert(a.name.clone(), a.version.clone());
    req.initial_resource_versions
        .insert(b.name.clone(), "stale".into());
    req.initial_resource_versions
        .insert("c//Pod/ns/x".into(), "1".into());
    let mut c = DeltaClient::open(&mut h, req).await;
    let first = c.recv().await;
    assert_eq!(names(&first), ["c//Pod/ns/b"]);
    assert_eq!(first.removed_resources, ["c//Pod/ns/x"]);
}

#[tokio::test]
async fn on_demand_by_alias_and_uid() {
    let a = workload("c//Pod/ns/a", [10, 0, 0, 1], "sa");
    let b = workload("c//Pod/ns/b", [10, 0, 0, 2], "sa");
    let mut h = harness(vec![a, b]).await;
    let mut req = wildcard();
    req.resource_names_subscribe = vec!["/10.0.0.2".into()];
    let mut c = DeltaClient::open(&mut h, req).await;
    let first = c.recv().await;
    assert_eq!(names(&first), ["c//Pod/ns/b"]);
    assert_eq!(first.resources[0].aliases, ["/10.0.0.2"]);

    // Asking for an unknown address answers "does not exist".
    c.tx.send(DeltaDiscoveryRequest {
        type_url: ambit_proto::ADDRESS_TYPE_URL.into(),
        response_nonce: first.nonce.clone(),
        resource_names_subscribe: vec!["/10.9.9.9".into(), "c//Pod/ns/a".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let next = c.recv().await;
    assert_eq!(names(&next), ["c//Pod/ns/a"]);
    assert_eq!(next.removed_resources, ["/10.9.9.9"]);

    // A change to an unsubscribed-to resource is not sent; to a subscribed one it is.
    h.publisher.publish(vec![
        workload("c//Pod/ns/a", [10, 0, 0, 1], "sa"),
        workload("c//Pod/ns/b", [10, 0, 0, 2], "sa"),
        workload("c//Pod/ns/z", [10, 0, 0, 26], "sa"),
    ]);
    c.quiet(Duration::from_millis(300)).await;
    h.publisher.publish(vec![
        workload("c//Pod/ns/a", [10, 0, 0, 1], "other-sa"),
        workload("c//Pod/ns/b", [10, 0, 0, 2], "sa"),
    ]);
    let next = c.recv().await;
    assert_eq!(names(&next), ["c//Pod/ns/a"]);
}

#[tokio::test]
async fn slow_client_does_not_stall_others() {
    let mut h = harness(vec![workload("c//Pod/ns/a", [10, 0, 0, 1], "sa")]).await;
    // The slow client reads its first response and then never again.
    let mut slow = DeltaClient::open(&mut h, wildcard()).await;
    let _ = slow.recv().await;
    let mut fast = DeltaClient::open(&mut h, wildcard()).await;
    let _ = fast.recv().await;
    for i in 0..200u8 {
        h.publisher.publish(vec![workload(
            "c//Pod/ns/a",
            [10, 0, 1, i],
            &"x".repeat(60_000),
        )]);
        // Drain the fast client; it must keep up although slow is stuck.
        let r = fast.recv().await;
        assert_eq!(names(&r), ["c//Pod/ns/a"]);
    }
}

#[tokio::test]
async fn sotw_sends_full_set_on_change() {
    let mut h = harness(vec![
        workload("c//Pod/ns/a", [10, 0, 0, 1], "sa"),
        workload("c//Pod/ns/b", [10, 0, 0, 2], "sa"),
    ])
    .await;
    let (tx, req_rx) = mpsc::channel(4);
    tx.send(DiscoveryRequest {
        node: node(),
        type_url: ambit_proto::ADDRESS_TYPE_URL.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut rx = h
        .client
        .stream_aggregated_resources(authorized(ReceiverStream::new(req_rx), NODE_TOKEN))
        .await
        .unwrap()
        .into_inner();
    let mut recv = async || -> DiscoveryResponse {
        tokio::time::timeout(T, rx.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
    };
    let first = recv().await;
    assert_eq!(first.resources.len(), 2);
    tx.send(DiscoveryRequest {
        type_url: first.type_url.clone(),
        version_info: first.version_info.clone(),
        response_nonce: first.nonce.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    h.publisher
        .publish(vec![workload("c//Pod/ns/a", [10, 0, 0, 1], "sa")]);
    let next = recv().await;
    assert_eq!(next.resources.len(), 1);
    assert_ne!(next.version_info, first.version_info);
}

#[tokio::test]
async fn large_sync_is_chunked_and_marked_partial_until_the_last_chunk() {
    let items: Vec<XdsResource> = (0..2500u32)
        .map(|i| {
            let [_, _, a, b] = i.to_be_bytes();
            workload(&format!("c//Pod/ns/p{i}"), [10, 1, a, b], "sa")
        })
        .collect();
    let mut h = harness(items).await;
    let mut req = wildcard();
    req.initial_resource_versions
        .insert("c//Pod/ns/gone".into(), "1".into());
    let mut c = DeltaClient::open(&mut h, req).await;
    let mut seen = std::collections::HashSet::new();
    let mut removed = Vec::new();
    let mut partial = Vec::new();
    for _ in 0..3 {
        let r = c.recv().await;
        assert!(r.resources.len() <= CHUNK, "chunk of {}", r.resources.len());
        partial.push(
            r.system_version_info
                .ends_with(ambit_proto::PARTIAL_RESPONSE_MARKER),
        );
        seen.extend(r.resources.iter().map(|x| x.name.clone()));
        removed.extend(r.removed_resources.clone());
        c.ack(&r).await;
    }
    assert_eq!(partial, [true, true, false]);
    assert_eq!(seen.len(), 2500);
    assert_eq!(removed, ["c//Pod/ns/gone"]);
    c.quiet(Duration::from_millis(200)).await;
}

mod access;
mod full_sync;
mod generators;
