//! The control plane's Delta ADS stream, driven by arbitrary request
//! sequences: a real `XdsServer` (authentication, authorization, the
//! ztunnel and waypoint generators, subscription bookkeeping, pushes on
//! new snapshots, chunking, full-sync slots) fed through tonic's own gRPC
//! decoder from an in-memory body — no sockets. Snapshots are the control
//! plane's translation of the repository's fixture meshes.
//!
//! Input: the first byte picks the caller's credentials (node token, the
//! ztunnel service account, a waypoint's service account, a bad token).
//! Then frames (`ambit_fuzz::frames`), each one operation by its first
//! byte: `0` publish mesh snapshot `next byte % 3`; `1` send the rest as
//! raw HTTP body bytes (gRPC framing is the fuzzer's business); anything
//! else sends the rest as one gRPC message (a `DeltaDiscoveryRequest`, or
//! garbage). After every operation the harness waits until the stream
//! task is idle (tokio's paused clock advances only then).
//!
//! Checks: no panic; no hang (the stream ends within a minute of virtual
//! time after the client closes); nonces are unique and non-empty;
//! resources carry a body of the response's type and are not also removed
//! in the same response; an error status is the stream's last item; a
//! stream fed only valid requests ends only with an error status or when
//! the client closes. And the protocol: for every type a client
//! subscribed to only as a wildcard (empty or `*` subscribe lists, no
//! unsubscribe), what it holds after the responses (starting from its
//! `initial_resource_versions`) is exactly what its generator serves for
//! the current snapshot.
#![no_main]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use ambit_control::ca::{Caller, StaticTokens};
use ambit_control::model::snapshot::Snapshot;
use ambit_control::xds::{Generators, ProxyNode, ProxyRegistry, XdsAccess, XdsMetrics, XdsServer};
use bytes::{BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryService;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use http_body::Frame;
use http_body_util::StreamBody;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tonic::codec::{Codec, Streaming};
use tonic_prost::ProstCodec;

const NODE_TOKEN: &str = "node-token";
const ZTUNNEL_SA_TOKEN: &str = "ztunnel-sa-token";
const WAYPOINT_TOKEN: &str = "waypoint-token";

static SNAPSHOTS: LazyLock<Vec<Arc<Snapshot>>> = LazyLock::new(ambit_fuzz::mesh_snapshots);

static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap_or_else(|e| panic!("tokio runtime: {e}"))
});

fn access() -> XdsAccess {
    XdsAccess::new(
        Arc::new(StaticTokens::new([
            (
                NODE_TOKEN.to_string(),
                Caller::Node {
                    name: "node-1".into(),
                },
            ),
            (
                ZTUNNEL_SA_TOKEN.to_string(),
                Caller::Workload {
                    namespace: "ambit-system".into(),
                    service_account: "ztunnel".into(),
                    node: Some("node-1".into()),
                },
            ),
            (
                WAYPOINT_TOKEN.to_string(),
                Caller::Workload {
                    namespace: "shop".into(),
                    service_account: "waypoint".into(),
                    node: None,
                },
            ),
        ])),
        vec![("ambit-system".into(), "ztunnel".into())],
    )
}

/// The snapshot `k` published after `prev` (deltas and `seq` consistent).
fn following(prev: &Snapshot, k: usize) -> Snapshot {
    let src = &SNAPSHOTS[k % SNAPSHOTS.len()];
    let mut next = Snapshot::following(prev, ambit_fuzz::families_of(src));
    next.synced = true;
    next
}

fn grpc_message(msg: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + msg.len());
    b.put_u8(0);
    b.put_u32(msg.len() as u32);
    b.put_slice(msg);
    b.freeze()
}

/// What the client holds of one type, and whether it only ever asked for
/// everything.
#[derive(Default)]
struct TypeView {
    held: BTreeMap<String, String>,
    pure_wildcard: bool,
    requested: bool,
}

/// The client's side: its node, and per type what it holds.
#[derive(Default)]
struct Client {
    node: Option<Option<Node>>,
    views: HashMap<String, TypeView>,
    /// Every message sent so far decoded as a request (so the server saw
    /// exactly these).
    all_valid: bool,
}

impl Client {
    fn on_request(&mut self, req: &DeltaDiscoveryRequest) {
        if self.node.is_none() {
            self.node = Some(req.node.clone());
        }
        let view = self.views.entry(req.type_url.clone()).or_default();
        let wildcard_only = req.resource_names_unsubscribe.is_empty()
            && req.resource_names_subscribe.iter().all(|n| n == "*");
        if !view.requested {
            view.requested = true;
            view.pure_wildcard = wildcard_only;
            view.held = req
                .initial_resource_versions
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
        } else {
            view.pure_wildcard &= wildcard_only;
        }
    }

    fn on_response(&mut self, resp: &DeltaDiscoveryResponse) {
        let view = self.views.entry(resp.type_url.clone()).or_default();
        for r in &resp.resources {
            view.held.insert(r.name.clone(), r.version.clone());
        }
        for n in &resp.removed_resources {
            view.held.remove(n);
        }
    }
}

fn check_response(resp: &DeltaDiscoveryResponse, nonces: &mut HashSet<String>) {
    assert!(!resp.nonce.is_empty(), "response without a nonce");
    assert!(
        nonces.insert(resp.nonce.clone()),
        "nonce {} reused",
        resp.nonce
    );
    assert!(!resp.type_url.is_empty());
    let removed: HashSet<&String> = resp.removed_resources.iter().collect();
    for r in &resp.resources {
        let body = r
            .resource
            .as_ref()
            .unwrap_or_else(|| panic!("{} has no body", r.name));
        assert_eq!(body.type_url, resp.type_url, "body type of {}", r.name);
        assert!(
            !removed.contains(&r.name),
            "{} both sent and removed",
            r.name
        );
    }
}

async fn drive(data: &[u8]) {
    let Some((&who, rest)) = data.split_first() else {
        return;
    };
    let token = match who % 4 {
        0 => NODE_TOKEN,
        1 => ZTUNNEL_SA_TOKEN,
        2 => WAYPOINT_TOKEN,
        _ => "not-a-token",
    };
    let mut current = Arc::new(following(&Snapshot::default(), 0));
    let (snap_tx, snap_rx) = watch::channel(current.clone());
    let registry = Arc::new(ProxyRegistry::default());
    let metrics = XdsMetrics::register(&mut prometheus_client::registry::Registry::default());
    let server = XdsServer::new(snap_rx, access(), registry, metrics);

    let (body_tx, body_rx) = mpsc::channel::<Result<Frame<Bytes>, Status>>(16);
    let body = StreamBody::new(ReceiverStream::new(body_rx));
    let decoder = ProstCodec::<DeltaDiscoveryResponse, DeltaDiscoveryRequest>::default().decoder();
    let streaming = Streaming::new_request(decoder, body, None, Some(4 << 20));
    let mut request = tonic::Request::new(streaming);
    if let Ok(v) = format!("Bearer {token}").parse() {
        request.metadata_mut().insert("authorization", v);
    }
    let responses = match server.delta_aggregated_resources(request).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            assert_eq!(token, "not-a-token", "refused a good token: {status}");
            return;
        }
    };
    assert_ne!(token, "not-a-token", "accepted a bad token");
    let drain = tokio::spawn(async move {
        let mut responses = responses;
        let mut out = Vec::new();
        while let Some(item) = responses.next().await {
            out.push(item);
        }
        out
    });

    let idle = || tokio::time::sleep(Duration::from_millis(1));
    idle().await;
    let mut client = Client {
        all_valid: true,
        ..Client::default()
    };
    for op in ambit_fuzz::frames(rest) {
        let Some((&code, arg)) = op.split_first() else {
            continue;
        };
        match code {
            0 => {
                let k = arg.first().copied().unwrap_or(0) as usize;
                let next = Arc::new(following(&current, k));
                snap_tx.send_replace(next.clone());
                current = next;
            }
            1 => {
                client.all_valid = false;
                if body_tx
                    .send(Ok(Frame::data(Bytes::copy_from_slice(arg))))
                    .await
                    .is_err()
                {
                    break;
                }
            }
            _ => {
                match DeltaDiscoveryRequest::decode(arg) {
                    Ok(req) => client.on_request(&req),
                    Err(_) => client.all_valid = false,
                }
                if body_tx
                    .send(Ok(Frame::data(grpc_message(arg))))
                    .await
                    .is_err()
                {
                    break;
                }
            }
        }
        idle().await;
        if drain.is_finished() {
            break;
        }
    }
    let ended_early = drain.is_finished();
    drop(body_tx);
    let out = match tokio::time::timeout(Duration::from_secs(60), drain).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => panic!("response reader failed: {e}"),
        Err(_) => panic!("the delta stream did not end within 60 s after the client closed"),
    };

    let mut nonces = HashSet::new();
    let mut errored = false;
    for (i, item) in out.iter().enumerate() {
        match item {
            Ok(resp) => {
                check_response(resp, &mut nonces);
                client.on_response(resp);
            }
            Err(_) => {
                assert_eq!(i + 1, out.len(), "an error status is not the last item");
                errored = true;
            }
        }
    }
    if !client.all_valid || errored {
        return;
    }
    assert!(
        !ended_early,
        "a stream of valid requests ended without a status"
    );
    let Some(node) = &client.node else {
        return;
    };
    let proxy = ProxyNode::from_node(node.as_ref());
    let Some(generator) = Generators::standard().for_kind(proxy.kind) else {
        return;
    };
    for (type_url, view) in &client.views {
        if !view.pure_wildcard || generator.spec(type_url).is_none() {
            continue;
        }
        let served = generator.generate(&proxy, &current, type_url);
        let want: BTreeMap<String, String> = served
            .set
            .by_name
            .values()
            .map(|r| (r.name.clone(), r.version.clone()))
            .collect();
        assert_eq!(
            view.held, want,
            "a wildcard {} client of {type_url} does not hold what is served",
            proxy.kind
        );
    }
}

fn node(id: &str, meta: &[(&str, &str)]) -> Node {
    let fields = meta
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                Value {
                    kind: Some(Kind::StringValue(v.to_string())),
                },
            )
        })
        .collect();
    Node {
        id: id.to_string(),
        metadata: Some(Struct { fields }),
        ..Default::default()
    }
}

fn request(node: Option<&Node>, type_url: &str, sub: &[&str]) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: node.cloned(),
        type_url: type_url.to_string(),
        resource_names_subscribe: sub.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn send(req: &DeltaDiscoveryRequest) -> Vec<u8> {
    let mut m = vec![2];
    m.extend(req.encode_to_vec());
    m
}

fn seeds() -> Vec<(String, Vec<u8>)> {
    let addr = ambit_proto::ADDRESS_TYPE_URL;
    let authz = ambit_proto::AUTHORIZATION_TYPE_URL;
    let zt = ambit_ztunnel::xds::node("node-1", "Kubernetes", "");
    let wp = node(
        "router~10.244.1.9~waypoint-7d9f.shop~shop.svc.cluster.local",
        &[("SERVICE_ACCOUNT", "waypoint"), ("NODE_NAME", "node-1")],
    );
    let publish = |k: u8| vec![0, k];
    let ack = |type_url: &str, nonce: &str| {
        send(&DeltaDiscoveryRequest {
            type_url: type_url.to_string(),
            response_nonce: nonce.to_string(),
            ..Default::default()
        })
    };
    let mut out = Vec::new();
    let mut add = |name: &str, who: u8, ops: Vec<Vec<u8>>| {
        let mut bytes = vec![who];
        bytes.extend(ambit_fuzz::frame(&ops));
        out.push((name.to_string(), bytes));
    };
    add(
        "ztunnel-wildcard-publish",
        0,
        vec![
            send(&request(Some(&zt), addr, &[])),
            ack(addr, "1-1"),
            send(&request(None, authz, &[])),
            ack(authz, "1-2"),
            publish(1),
            ack(addr, "1-3"),
            publish(2),
            publish(0),
        ],
    );
    add(
        "ztunnel-on-demand",
        1,
        vec![
            send(&request(
                Some(&zt),
                addr,
                &["/10.244.1.5", "legacy/legacy.legacy.svc.cluster.local"],
            )),
            publish(1),
            send(&DeltaDiscoveryRequest {
                type_url: addr.to_string(),
                resource_names_subscribe: vec!["*".into()],
                resource_names_unsubscribe: vec!["/10.244.1.5".into()],
                ..Default::default()
            }),
            send(&DeltaDiscoveryRequest {
                type_url: addr.to_string(),
                resource_names_unsubscribe: vec!["*".into()],
                ..Default::default()
            }),
            publish(0),
        ],
    );
    let mut reconnect = request(Some(&zt), addr, &[]);
    reconnect.initial_resource_versions = SNAPSHOTS[0]
        .mesh(addr)
        .by_name
        .values()
        .take(3)
        .map(|r| (r.name.clone(), r.version.clone()))
        .chain([("gone/workload".to_string(), "v0".to_string())])
        .collect();
    add(
        "ztunnel-reconnect",
        0,
        vec![send(&reconnect), publish(1), publish(0)],
    );
    let cds = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    let lds = "type.googleapis.com/envoy.config.listener.v3.Listener";
    let eds = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
    let rds = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
    add(
        "waypoint-ads",
        2,
        vec![
            publish(1),
            send(&request(Some(&wp), cds, &[])),
            send(&request(None, eds, &[])),
            send(&request(None, lds, &[])),
            send(&request(None, rds, &[])),
            publish(0),
            publish(1),
        ],
    );
    add(
        "waypoint-as-node-refused",
        0,
        vec![send(&request(Some(&wp), cds, &[]))],
    );
    add(
        "raw-garbage",
        0,
        vec![
            send(&request(Some(&zt), addr, &[])),
            vec![1, 0, 0, 0, 0, 9, 1, 2],
        ],
    );
    out
}

fuzz_target!(
    init: {
        if let Some(dir) = ambit_fuzz::seeds_requested() {
            ambit_fuzz::write_seeds(&dir, seeds());
        }
        LazyLock::force(&SNAPSHOTS);
    },
    |data: &[u8]| {
        RUNTIME.block_on(drive(data));
    }
);
