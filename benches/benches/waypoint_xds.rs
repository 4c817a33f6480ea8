//! Waypoint xDS push benchmark (issue 15): 100 lightweight Delta ADS
//! clients that look like waypoint Envoys (`router~…` node ids of the
//! `shop/waypoint` Gateway, authenticated as its service account) hold the
//! full waypoint configuration of `tests/fixtures/waypoint/base.yaml` plus an
//! 80/20 `llm` VirtualService; then the weights change to 100/0 and the time
//! from publishing the new snapshot until every client holds the new route
//! configuration is measured, with what was sent.
//!
//! The xDS server (`ambit_control::xds::XdsServer`, the real one) and the
//! clients share this process and its two cores; clients decode every
//! resource as Envoy messages and ACK. Real Envoys converging on a weight
//! change is the waypoint e2e test's job (`tests/tests/waypoint.rs`).
//! Run: `cargo bench -p ambit-benches --bench waypoint_xds` (`CLIENTS`,
//! default 100; `ROUNDS`, default 5).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ambit_control::ca::{Caller, StaticTokens};
use ambit_control::model::waypoint::{CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE};
use ambit_control::model::{ModelOptions, Snapshot, Store, build_snapshot};
use ambit_control::xds::{ProxyRegistry, XdsAccess, XdsMetrics, XdsServer};
use anyhow::{Context, Result};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;

const TOKEN: &str = "bench-waypoint-token";
const TYPES: [&str; 4] = [CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE];

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn vs(v1: u32, v2: u32) -> String {
    format!(
        "apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{name: llm, namespace: shop}}
spec:
  hosts: [llm]
  http:
  - route:
    - {{destination: {{host: llm, subset: v1}}, weight: {v1}}}
    - {{destination: {{host: llm, subset: v2}}, weight: {v2}}}
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {{name: llm, namespace: shop}}
spec:
  host: llm
  subsets:
  - {{name: v1, labels: {{version: v1}}}}
  - {{name: v2, labels: {{version: v2}}}}
"
    )
}

fn store(v1: u32, v2: u32) -> Store {
    let base = ambit_tests::workspace_root().join("tests/fixtures/waypoint/base.yaml");
    let text = std::fs::read_to_string(&base).unwrap();
    let (mut objects, errors) = ambit_config::parse_documents(&base, &text);
    assert!(errors.is_empty(), "{errors:#?}");
    let (more, errors) =
        ambit_config::parse_documents(std::path::Path::new("vs.yaml"), &vs(v1, v2));
    assert!(errors.is_empty(), "{errors:#?}");
    objects.extend(more);
    Store::from_objects(objects)
}

fn text(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

fn node(i: usize) -> Node {
    let labels = Struct {
        fields: [(
            "gateway.networking.k8s.io/gateway-name".to_string(),
            text("waypoint"),
        )]
        .into(),
    };
    Node {
        id: format!(
            "router~10.10.{}.{}~waypoint-{i}.shop~shop.svc.cluster.local",
            i / 250,
            i % 250 + 1
        ),
        cluster: "waypoint.shop".into(),
        metadata: Some(Struct {
            fields: [
                ("NAMESPACE".to_string(), text("shop")),
                (
                    "LABELS".to_string(),
                    Value {
                        kind: Some(Kind::StructValue(labels)),
                    },
                ),
            ]
            .into(),
        }),
        ..Default::default()
    }
}

/// What a client reports: the full sync done, then each route update.
enum Event {
    Synced { bytes: usize },
    Route { weights: Vec<u32>, bytes: usize },
}

/// One waypoint-like client: wildcard on the four types, decode, ACK.
async fn client(addr: std::net::SocketAddr, i: usize, events: mpsc::Sender<Event>) -> Result<()> {
    let mut c = AggregatedDiscoveryServiceClient::connect(format!("http://{addr}"))
        .await?
        .max_decoding_message_size(64 << 20);
    let (tx, rx) = mpsc::channel(8);
    for (n, t) in TYPES.iter().enumerate() {
        tx.send(DeltaDiscoveryRequest {
            node: (n == 0).then(|| node(i)),
            type_url: t.to_string(),
            ..Default::default()
        })
        .await?;
    }
    let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse()?);
    let mut stream = c.delta_aggregated_resources(req).await?.into_inner();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut synced = false;
    loop {
        let resp = stream.next().await.context("stream ended")??;
        let bytes: usize = resp
            .resources
            .iter()
            .filter_map(|r| r.resource.as_ref())
            .map(|a| a.value.len())
            .sum();
        let mut weights = Vec::new();
        if resp.type_url == ROUTE_TYPE {
            for r in &resp.resources {
                let any = r.resource.as_ref().context("route without body")?;
                let rc = RouteConfiguration::decode(any.value.as_slice())?;
                if rc.name.starts_with("llm.shop") {
                    weights = rc
                        .virtual_hosts
                        .iter()
                        .flat_map(|v| &v.routes)
                        .filter_map(|r| match &r.action {
                            Some(envoy_types::pb::envoy::config::route::v3::route::Action::Route(a)) => a.cluster_specifier.as_ref(),
                            _ => None,
                        })
                        .filter_map(|c| match c {
                            envoy_types::pb::envoy::config::route::v3::route_action::ClusterSpecifier::WeightedClusters(w) => Some(w),
                            _ => None,
                        })
                        .flat_map(|w| w.clusters.iter().map(|c| c.weight.as_ref().map_or(0, |v| v.value)))
                        .collect();
                }
            }
        }
        *seen.entry(resp.type_url.clone()).or_default() += bytes;
        tx.send(DeltaDiscoveryRequest {
            type_url: resp.type_url.clone(),
            response_nonce: resp.nonce.clone(),
            ..Default::default()
        })
        .await?;
        if !synced {
            if seen.len() == TYPES.len() {
                synced = true;
                let _ = events
                    .send(Event::Synced {
                        bytes: seen.values().sum(),
                    })
                    .await;
            }
        } else if resp.type_url == ROUTE_TYPE {
            let _ = events.send(Event::Route { weights, bytes }).await;
        }
    }
}

fn main() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(bench())
}

async fn bench() -> Result<()> {
    let clients = env_or("CLIENTS", 100);
    let rounds = env_or("ROUNDS", 5);
    let opts = ModelOptions::default();
    let t = Instant::now();
    let mut snap = build_snapshot(&store(80, 20), &Snapshot::default(), &opts);
    let build = t.elapsed();
    snap.synced = true;
    let (tx, rx) = watch::channel(Arc::new(snap));
    let access = XdsAccess::new(
        Arc::new(StaticTokens::new([(
            TOKEN.to_string(),
            Caller::Workload {
                namespace: "shop".into(),
                service_account: "waypoint".into(),
                node: None,
            },
        )])),
        vec![],
    );
    let mut registry = prometheus_client::registry::Registry::default();
    let server = XdsServer::new(
        rx,
        access,
        Arc::new(ProxyRegistry::default()),
        XdsMetrics::register(&mut registry),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(server.into_service())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let (ev_tx, mut ev_rx) = mpsc::channel(clients * 4);
    let start = Instant::now();
    // Set when the measurements are done: streams then end with the runtime.
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for i in 0..clients {
        let ev = ev_tx.clone();
        let done = done.clone();
        tokio::spawn(async move {
            if let Err(e) = client(addr, i, ev).await
                && !done.load(std::sync::atomic::Ordering::Relaxed)
            {
                eprintln!("client {i}: {e:#}");
            }
        });
    }
    let mut full_bytes = 0;
    for _ in 0..clients {
        match tokio::time::timeout(Duration::from_secs(60), ev_rx.recv()).await {
            Ok(Some(Event::Synced { bytes })) => full_bytes = bytes,
            Ok(Some(Event::Route { .. })) => {}
            _ => anyhow::bail!("not every client synced within 60 s"),
        }
    }
    println!(
        "waypoint xDS: snapshot build {build:?}; {clients} waypoint clients hold the full config (CDS, EDS, LDS, RDS: {full_bytes} B each) {:?} after connecting",
        start.elapsed()
    );
    let mut lasts = Vec::new();
    for round in 0..rounds {
        let (v1, v2) = if round % 2 == 0 { (100, 0) } else { (80, 20) };
        let prev = tx.borrow().clone();
        let t = Instant::now();
        let mut next = build_snapshot(&store(v1, v2), &prev, &opts);
        next.synced = true;
        let built = t.elapsed();
        tx.send_replace(Arc::new(next));
        let mut got = 0;
        let mut first = None;
        let mut bytes = 0;
        while got < clients {
            match tokio::time::timeout(Duration::from_secs(10), ev_rx.recv()).await {
                Ok(Some(Event::Route { weights, bytes: b })) if weights == vec![v1, v2] => {
                    got += 1;
                    bytes = b;
                    first.get_or_insert_with(|| t.elapsed());
                }
                Ok(Some(_)) => {}
                _ => anyhow::bail!(
                    "round {round}: {got} of {clients} clients got {v1}/{v2} within 10 s"
                ),
            }
        }
        let last = t.elapsed();
        lasts.push(last);
        println!(
            "  round {round}: {v1}/{v2}: rebuild {built:?}; first client {:?}, last {last:?}; route update {bytes} B per client",
            first.unwrap_or_default()
        );
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    lasts.sort();
    println!(
        "one weight change to {clients} waypoint clients (snapshot publish to the last client holding it): median {:?}, max {:?} over {rounds} rounds",
        lasts[lasts.len() / 2],
        lasts[lasts.len() - 1]
    );
    Ok(())
}
