//! ztunnel against a tiny in-test Delta ADS server: sync, ACK, NACK,
//! removal, on-demand, reconnect with initial_resource_versions, the HTTP
//! endpoints, and many ztunnels in one process.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use ambit_proto::security as xsec;
use ambit_proto::workload as xds;
use ambit_ztunnel::metrics::TerminationReason;
use ambit_ztunnel::{Config, Ztunnel};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::{TcpListenerStream, UnboundedReceiverStream};
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status, Streaming};

const ADDRESS: &str = ambit_proto::ADDRESS_TYPE_URL;
const AUTHZ: &str = ambit_proto::AUTHORIZATION_TYPE_URL;
const T: Duration = Duration::from_secs(10);
const SVC: &str = "default/web.default.svc.cluster.local";

// ---- the test server ----

/// One client stream as the test sees it.
struct ServerStream {
    metadata: MetadataMap,
    requests: mpsc::UnboundedReceiver<DeltaDiscoveryRequest>,
    responses: mpsc::UnboundedSender<Result<DeltaDiscoveryResponse, Status>>,
}

impl ServerStream {
    async fn next_request(&mut self) -> DeltaDiscoveryRequest {
        tokio::time::timeout(T, self.requests.recv())
            .await
            .expect("timed out waiting for a request from ztunnel")
            .expect("ztunnel closed the stream")
    }

    /// The two initial subscriptions, by type URL.
    async fn initial_requests(&mut self) -> HashMap<String, DeltaDiscoveryRequest> {
        let mut out = HashMap::new();
        for _ in 0..2 {
            let r = self.next_request().await;
            assert!(r.response_nonce.is_empty(), "not an initial request: {r:?}");
            out.insert(r.type_url.clone(), r);
        }
        assert!(out.contains_key(ADDRESS) && out.contains_key(AUTHZ));
        out
    }

    fn send(&self, resp: DeltaDiscoveryResponse) {
        self.responses.send(Ok(resp)).expect("stream gone");
    }
}

#[derive(Clone)]
struct TestAds {
    streams: mpsc::UnboundedSender<ServerStream>,
}

type SotwStream = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for TestAds {
    type StreamAggregatedResourcesStream = SotwStream;
    type DeltaAggregatedResourcesStream =
        UnboundedReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        _request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<SotwStream>, Status> {
        Err(Status::unimplemented("the test server only speaks Delta"))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let metadata = request.metadata().clone();
        let mut inbound = request.into_inner();
        let (req_tx, req_rx) = mpsc::unbounded_channel();
        let (resp_tx, resp_rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                if req_tx.send(m).is_err() {
                    break;
                }
            }
        });
        let _ = self.streams.send(ServerStream {
            metadata,
            requests: req_rx,
            responses: resp_tx,
        });
        Ok(Response::new(UnboundedReceiverStream::new(resp_rx)))
    }
}

struct TestServer {
    addr: SocketAddr,
    streams: mpsc::UnboundedReceiver<ServerStream>,
}

impl TestServer {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        let svc = AggregatedDiscoveryServiceServer::new(TestAds { streams: tx });
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        Self { addr, streams: rx }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn next_stream(&mut self) -> ServerStream {
        tokio::time::timeout(T, self.streams.recv())
            .await
            .expect("timed out waiting for ztunnel to connect")
            .expect("server gone")
    }
}

// ---- resources ----

fn any(type_url: &str, value: Vec<u8>) -> Option<Any> {
    Some(Any {
        type_url: type_url.to_string(),
        value,
    })
}

fn workload_res(uid: &str, addr: Vec<u8>, version: &str) -> Resource {
    let mut services = HashMap::new();
    services.insert(
        SVC.to_string(),
        xds::PortList {
            ports: vec![xds::Port {
                service_port: 80,
                target_port: 8080,
            }],
        },
    );
    let msg = xds::Address {
        r#type: Some(xds::address::Type::Workload(xds::Workload {
            uid: uid.to_string(),
            name: uid.to_string(),
            namespace: "default".into(),
            addresses: vec![addr],
            tunnel_protocol: xds::TunnelProtocol::Hbone as i32,
            services,
            ..Default::default()
        })),
    };
    Resource {
        name: uid.to_string(),
        version: version.to_string(),
        resource: any(ADDRESS, msg.encode_to_vec()),
        ..Default::default()
    }
}

fn service_res(version: &str) -> Resource {
    let msg = xds::Address {
        r#type: Some(xds::address::Type::Service(xds::Service {
            name: "web".into(),
            namespace: "default".into(),
            hostname: "web.default.svc.cluster.local".into(),
            addresses: vec![xds::NetworkAddress {
                network: String::new(),
                address: vec![10, 96, 0, 10],
            }],
            ports: vec![xds::Port {
                service_port: 80,
                target_port: 8080,
            }],
            ..Default::default()
        })),
    };
    Resource {
        name: SVC.to_string(),
        version: version.to_string(),
        resource: any(ADDRESS, msg.encode_to_vec()),
        ..Default::default()
    }
}

fn policy_res(name: &str, version: &str) -> Resource {
    let msg = xsec::Authorization {
        name: name.to_string(),
        namespace: "default".into(),
        action: xsec::Action::Deny as i32,
        ..Default::default()
    };
    Resource {
        name: format!("default/{name}"),
        version: version.to_string(),
        resource: any(AUTHZ, msg.encode_to_vec()),
        ..Default::default()
    }
}

fn response(
    type_url: &str,
    nonce: &str,
    resources: Vec<Resource>,
    removed: &[&str],
) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        type_url: type_url.to_string(),
        nonce: nonce.to_string(),
        resources,
        removed_resources: removed.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

// ---- helpers ----

async fn within<F: Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(T, f)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// Plain HTTP/1.1 request; returns status code and body.
async fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = String::new();
    within("http response", s.read_to_string(&mut raw))
        .await
        .unwrap();
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Polls `f` until true; only for values that have no change signal
/// (metrics counters).
async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    within(what, async {
        while !f() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

fn config(server: &TestServer, node: &str) -> Config {
    Config::new(node, server.url()).with_ephemeral_ports()
}

// ---- tests ----

#[tokio::test]
async fn sync_ack_nack_remove_on_demand_reconnect() {
    let mut server = TestServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let token_path = dir.path().join("token");
    std::fs::write(&token_path, "  first-token \n").unwrap();
    let mut cfg = config(&server, "node-a");
    cfg.token_file = Some(token_path.clone());
    let zt = ambit_ztunnel::start(cfg).await.unwrap();

    // -- subscribe --
    let mut s = server.next_stream().await;
    assert_eq!(
        s.metadata.get("authorization").unwrap(),
        "Bearer first-token"
    );
    let init = s.initial_requests().await;
    for r in init.values() {
        assert!(r.resource_names_subscribe.contains(&"*".to_string()));
        assert!(r.initial_resource_versions.is_empty());
        let node = r.node.as_ref().expect("node on initial request");
        assert_eq!(
            node.id,
            "ztunnel~0.0.0.0~ztunnel-node-a.ambit-system~ambit-system.svc.cluster.local"
        );
    }
    assert!(!zt.is_ready());
    let (code, _) = http(zt.readiness_addr(), "GET", "/healthz/ready").await;
    assert_eq!(code, 503);

    // -- Address: two good workloads, a service, one 3-byte address --
    s.send(response(
        ADDRESS,
        "a1",
        vec![
            workload_res("w1", vec![10, 0, 0, 1], "v1"),
            workload_res("w2", vec![10, 0, 0, 2], "v1"),
            workload_res("bad", vec![10, 0, 0], "v1"),
            service_res("v1"),
        ],
        &[],
    ));
    let nack = s.next_request().await;
    assert_eq!(nack.type_url, ADDRESS);
    assert_eq!(nack.response_nonce, "a1");
    let detail = nack.error_detail.expect("NACK carries error_detail");
    assert!(detail.message.contains("\"bad\""), "{}", detail.message);
    // Address alone is not a full sync.
    assert!(!zt.is_ready());

    // -- Authorization --
    s.send(response(
        AUTHZ,
        "z1",
        vec![policy_res("deny-all", "p1")],
        &[],
    ));
    let ack = s.next_request().await;
    assert_eq!(
        (ack.type_url.as_str(), ack.response_nonce.as_str()),
        (AUTHZ, "z1")
    );
    assert!(ack.error_detail.is_none());
    within("ready", zt.wait_ready()).await;

    let st = zt.state();
    assert_eq!(st.workload_count(), 2);
    assert!(st.workload_by_uid("bad").is_none());
    assert_eq!(
        &*st.workload_by_ip("", "10.0.0.1".parse().unwrap())
            .unwrap()
            .uid,
        "w1"
    );
    assert_eq!(st.endpoints(SVC).unwrap().len(), 2);
    assert!(st.authorization("default/deny-all").is_some());

    let (code, body) = http(zt.readiness_addr(), "GET", "/healthz/ready").await;
    assert_eq!((code, body.as_str()), (200, "ready\n"));
    let (code, metrics) = http(zt.stats_addr(), "GET", "/metrics").await;
    assert_eq!(code, 200);
    for want in [
        format!("ztunnel_xds_nacks_sent_total{{url=\"{ADDRESS}\"}} 1"),
        format!("ztunnel_xds_resources{{url=\"{ADDRESS}\"}} 3"),
        format!("ztunnel_xds_resources{{url=\"{AUTHZ}\"}} 1"),
        format!("istio_xds_message_total{{url=\"{ADDRESS}\"}} 1"),
        "ztunnel_xds_connected 1".to_string(),
    ] {
        assert!(metrics.contains(&want), "missing {want} in\n{metrics}");
    }
    let (code, dump) = http(zt.admin_addr(), "GET", "/config_dump").await;
    assert_eq!(code, 200);
    let dump: serde_json::Value = serde_json::from_str(&dump).unwrap();
    assert_eq!(dump["workloads"].as_array().unwrap().len(), 2);
    assert_eq!(dump["services"][0]["vips"][0], "/10.96.0.10");
    let (code, _) = http(zt.admin_addr(), "GET", "/nope").await;
    assert_eq!(code, 404);
    let (code, _) = http(zt.admin_addr(), "DELETE", "/config_dump").await;
    assert_eq!(code, 405);

    // -- removal; the ACK is sent after the new state is published --
    let generation = zt.state().generation();
    s.send(response(ADDRESS, "a2", vec![], &["w2"]));
    let ack = s.next_request().await;
    assert_eq!(ack.response_nonce, "a2");
    assert!(ack.error_detail.is_none());
    let st = zt.state();
    assert!(st.generation() > generation);
    assert!(st.workload_by_uid("w2").is_none());
    assert!(st.workload_by_ip("", "10.0.0.2".parse().unwrap()).is_none());
    assert_eq!(st.endpoints(SVC).unwrap().len(), 1);

    // -- on demand --
    zt.xds().request_address("/10.0.0.99").unwrap();
    let od = s.next_request().await;
    assert_eq!(od.type_url, ADDRESS);
    assert_eq!(od.resource_names_subscribe, vec!["/10.0.0.99".to_string()]);
    assert!(od.response_nonce.is_empty());

    // -- the server drops the stream; state is kept; reconnect resumes --
    std::fs::write(&token_path, "rotated-token\n").unwrap();
    drop(s);
    let mut s = server.next_stream().await;
    assert_eq!(
        s.metadata.get("authorization").unwrap(),
        "Bearer rotated-token"
    );
    assert_eq!(
        zt.state().workload_count(),
        1,
        "state kept while disconnected"
    );
    let init = s.initial_requests().await;
    let addr_versions = &init[ADDRESS].initial_resource_versions;
    let want: HashMap<String, String> = [("w1", "v1"), (SVC, "v1")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert_eq!(addr_versions, &want);
    assert_eq!(
        init[AUTHZ].initial_resource_versions,
        [("default/deny-all".to_string(), "p1".to_string())].into()
    );
    let subs = &init[ADDRESS].resource_names_subscribe;
    assert!(subs.contains(&"*".to_string()) && subs.contains(&"/10.0.0.99".to_string()));
    assert_eq!(
        zt.metrics().xds.terminations(TerminationReason::Complete),
        1
    );

    // The resumed stream keeps working.
    s.send(response(
        ADDRESS,
        "b1",
        vec![workload_res("w3", vec![10, 0, 0, 3], "v1")],
        &[],
    ));
    assert_eq!(s.next_request().await.response_nonce, "b1");
    assert!(zt.state().workload_by_uid("w3").is_some());

    within("shutdown", zt.shutdown()).await;
}

#[tokio::test]
async fn stream_error_counts_and_reconnects() {
    let mut server = TestServer::start().await;
    let zt = ambit_ztunnel::start(config(&server, "node-b"))
        .await
        .unwrap();
    let s = server.next_stream().await;
    s.responses
        .send(Err(Status::unavailable("test server going away")))
        .unwrap();
    let _s2 = server.next_stream().await;
    eventually("Error termination counted", || {
        zt.metrics().xds.terminations(TerminationReason::Error) == 1
    })
    .await;
    within("shutdown", zt.shutdown()).await;
}

#[tokio::test]
async fn unreachable_control_plane_is_a_connection_error() {
    // A port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let cfg = Config::new("node-c", format!("http://127.0.0.1:{port}")).with_ephemeral_ports();
    let zt = ambit_ztunnel::start(cfg).await.unwrap();
    eventually("ConnectionError counted twice (retrying)", || {
        zt.metrics()
            .xds
            .terminations(TerminationReason::ConnectionError)
            >= 2
    })
    .await;
    assert!(!zt.is_ready());
    assert_eq!(zt.metrics().xds.connected.get(), 0);
    within("shutdown", zt.shutdown()).await;
}

#[tokio::test]
async fn bind_error_names_the_address() {
    let taken = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = taken.local_addr().unwrap();
    let mut cfg = Config::new("node-d", "http://127.0.0.1:1").with_ephemeral_ports();
    cfg.stats_addr = addr;
    let err = ambit_ztunnel::start(cfg).await.unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&addr.to_string()), "{msg}");
    assert!(msg.contains("STATS_ADDR"), "{msg}");
}

#[tokio::test]
async fn invalid_xds_address_is_refused() {
    let cfg = Config::new("node-e", "not a url").with_ephemeral_ports();
    let err = ambit_ztunnel::start(cfg).await.unwrap_err();
    assert!(err.to_string().contains("XDS_ADDRESS"), "{err}");
}

#[tokio::test]
async fn quitquitquit_resolves_quit_requested() {
    let server = TestServer::start().await;
    let zt = ambit_ztunnel::start(config(&server, "node-f"))
        .await
        .unwrap();
    let (code, _) = http(zt.admin_addr(), "POST", "/quitquitquit").await;
    assert_eq!(code, 200);
    within("quit_requested", zt.quit_requested()).await;
    within("shutdown", zt.shutdown()).await;
}

/// Answers every initial request with a fixed set of resources, ACKs aside.
async fn serve_fixed(mut s: ServerStream) {
    let mut n = 0;
    while let Some(req) = s.requests.recv().await {
        if !req.response_nonce.is_empty() {
            continue;
        }
        n += 1;
        let resources = if req.type_url == ADDRESS {
            vec![
                workload_res("w1", vec![10, 0, 0, 1], "v1"),
                service_res("v1"),
            ]
        } else {
            vec![policy_res("deny-all", "p1")]
        };
        let nonce = format!("n{n}");
        if s.responses
            .send(Ok(response(&req.type_url, &nonce, resources, &[])))
            .is_err()
        {
            break;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_ztunnels_in_one_process() {
    let mut server = TestServer::start().await;
    let mut ztunnels: Vec<Ztunnel> = Vec::new();
    for i in 0..100 {
        ztunnels.push(
            ambit_ztunnel::start(config(&server, &format!("node-{i}")))
                .await
                .unwrap(),
        );
    }
    for _ in 0..100 {
        let s = server.next_stream().await;
        tokio::spawn(serve_fixed(s));
    }
    for zt in &ztunnels {
        within("ready", zt.wait_ready()).await;
        assert_eq!(zt.state().workload_count(), 1);
        // Each has its own registry.
        assert_eq!(zt.metrics().xds.messages_received(ADDRESS), 1);
    }
    let mut ports: Vec<u16> = ztunnels.iter().map(|z| z.admin_addr().port()).collect();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(ports.len(), 100);
    within("shutdown all", async {
        for zt in ztunnels {
            zt.shutdown().await;
        }
    })
    .await;
}

#[tokio::test]
async fn chunked_sync_is_published_whole_and_ready_only_at_the_last_chunk() {
    let mut server = TestServer::start().await;
    let zt = ambit_ztunnel::start(config(&server, "node-c"))
        .await
        .unwrap();
    let mut s = server.next_stream().await;
    s.initial_requests().await;
    s.send(response(AUTHZ, "a1", vec![], &[]));
    assert_eq!(s.next_request().await.response_nonce, "a1");
    let partial = format!("7{}", ambit_proto::PARTIAL_RESPONSE_MARKER);
    let mut first = response(
        ADDRESS,
        "c1",
        vec![workload_res("w1", vec![10, 0, 0, 1], "v1")],
        &[],
    );
    first.system_version_info = partial.clone();
    s.send(first);
    // The partial chunk is ACKed but neither published nor counted as sync.
    let ack = s.next_request().await;
    assert_eq!(ack.response_nonce, "c1");
    assert!(ack.error_detail.is_none());
    assert!(!zt.is_ready());
    assert_eq!(zt.state().workload_count(), 0);

    let mut last = response(
        ADDRESS,
        "c2",
        vec![
            workload_res("w2", vec![10, 0, 0, 2], "v1"),
            service_res("v1"),
        ],
        &[],
    );
    last.system_version_info = "7".into();
    s.send(last);
    within("ready after the last chunk", zt.wait_ready()).await;
    let state = zt.state();
    assert_eq!(state.workload_count(), 2);
    assert!(state.workload_by_uid("w1").is_some() && state.workload_by_uid("w2").is_some());
    zt.shutdown().await;
}
