//! Waypoint xDS push benchmark (issue 15): 100 lightweight Delta ADS
//! clients that look like waypoint Envoys (`router~…` node ids of the
//! `shop/waypoint` Gateway, authenticated as its service account) and two
//! real Envoys (upstream 1.40, each in a pod network namespace, as the same
//! waypoint) hold the full waypoint configuration of
//! `tests/fixtures/waypoint/base.yaml` plus an 80/20 `llm` VirtualService;
//! then the weights flip (100/0 ↔ 80/20) and the time from publishing the
//! new snapshot until each client holds the new route configuration is
//! measured, with what was sent. A real Envoy holds it when its own admin
//! `/config_dump` shows the new weights.
//!
//! The xDS server (`ambit_control::xds::XdsServer`, the real one) and the
//! lightweight clients share this process and its two cores; they decode
//! every resource as Envoy messages and ACK. The real Envoys (one worker
//! each) reach the same server over a unix socket. Real Envoys need root
//! (`ip`; Envoy binds 15008 in its netns) and Envoy (`ENVOY_BIN` or `envoy`
//! on PATH); without them only the lightweight clients run.
//! Run: `cargo bench -p ambit-benches --bench waypoint_xds` (`CLIENTS`,
//! default 100; `ENVOYS`, default 2; `ROUNDS`, default 5).

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

#[path = "waypoint_xds/real.rs"]
mod real;

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

fn store(v1: u32, v2: u32) -> Result<Store> {
    let base = ambit_tests::workspace_root().join("tests/fixtures/waypoint/base.yaml");
    let text = std::fs::read_to_string(&base).with_context(|| base.display().to_string())?;
    let (mut objects, errors) = ambit_config::parse_documents(&base, &text);
    anyhow::ensure!(errors.is_empty(), "{errors:#?}");
    let (more, errors) =
        ambit_config::parse_documents(std::path::Path::new("vs.yaml"), &vs(v1, v2));
    anyhow::ensure!(errors.is_empty(), "{errors:#?}");
    objects.extend(more);
    Ok(Store::from_objects(objects))
}

fn text(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

/// The node id of waypoint client `i` (the real Envoys count from
/// `CLIENTS` on).
fn node_id(i: usize) -> String {
    format!(
        "router~10.10.{}.{}~waypoint-{i}.shop~shop.svc.cluster.local",
        i / 250,
        i % 250 + 1
    )
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
        id: node_id(i),
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

/// The real xDS server, serving what `tx` publishes over TCP (the
/// lightweight clients) and a unix socket in `dir` (the real Envoys, in
/// other network namespaces).
struct Server {
    tx: watch::Sender<Arc<Snapshot>>,
    addr: std::net::SocketAddr,
    dir: tempfile::TempDir,
    registry: Arc<ProxyRegistry>,
}

impl Server {
    async fn start(snap: Snapshot) -> Result<Server> {
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
        let registry = Arc::new(ProxyRegistry::default());
        let mut metrics = prometheus_client::registry::Registry::default();
        let service = XdsServer::new(
            rx,
            access,
            registry.clone(),
            XdsMetrics::register(&mut metrics),
        )
        .into_service();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service.clone())
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let dir = tempfile::tempdir()?;
        let unix = tokio::net::UnixListener::bind(dir.path().join("xds.sock"))?;
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(unix)),
        );
        Ok(Server {
            tx,
            addr,
            dir,
            registry,
        })
    }
}

/// Starts `n` lightweight clients; their events, and a flag to set before
/// the runtime ends their streams.
fn start_clients(
    addr: std::net::SocketAddr,
    n: usize,
) -> (mpsc::Receiver<Event>, Arc<std::sync::atomic::AtomicBool>) {
    let (ev_tx, ev_rx) = mpsc::channel(n * 4 + 1);
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for i in 0..n {
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
    (ev_rx, done)
}

/// Waits until `n` clients synced; the bytes one got.
async fn wait_synced(events: &mut mpsc::Receiver<Event>, n: usize) -> Result<usize> {
    let mut full_bytes = 0;
    for _ in 0..n {
        match tokio::time::timeout(Duration::from_secs(60), events.recv()).await {
            Ok(Some(Event::Synced { bytes })) => full_bytes = bytes,
            Ok(Some(Event::Route { .. })) => {}
            _ => anyhow::bail!("not every client synced within 60 s"),
        }
    }
    Ok(full_bytes)
}

/// Waits until all `n` clients got route weights `want`: when the first
/// and the last did, and the bytes of one update.
async fn wait_route(
    events: &mut mpsc::Receiver<Event>,
    n: usize,
    want: &[u32],
    since: Instant,
) -> Result<(Duration, Duration, usize)> {
    let (mut got, mut first, mut bytes) = (0, None, 0);
    while got < n {
        match tokio::time::timeout(Duration::from_secs(10), events.recv()).await {
            Ok(Some(Event::Route { weights, bytes: b })) if weights == want => {
                got += 1;
                bytes = b;
                first.get_or_insert_with(|| since.elapsed());
            }
            Ok(Some(_)) => {}
            _ => anyhow::bail!("{got} of {n} clients got {want:?} within 10 s"),
        }
    }
    Ok((first.unwrap_or_default(), since.elapsed(), bytes))
}

async fn bench() -> Result<()> {
    let clients = env_or("CLIENTS", 100);
    let rounds = env_or("ROUNDS", 5).max(1);
    let opts = ModelOptions::default();
    let t = Instant::now();
    let mut snap = build_snapshot(&store(80, 20)?, &Snapshot::default(), &opts);
    let build = t.elapsed();
    snap.synced = true;
    let server = Server::start(snap).await?;
    let start = Instant::now();
    let (mut events, done) = start_clients(server.addr, clients);
    let full_bytes = wait_synced(&mut events, clients).await?;
    println!(
        "waypoint xDS: snapshot build {build:?}; {clients} waypoint clients hold the full config (CDS, EDS, LDS, RDS: {full_bytes} B each) {:?} after connecting",
        start.elapsed()
    );
    let envoys = real::RealEnvoys::start(&server.dir.path().join("xds.sock"), clients).await?;
    if let Some(e) = &envoys {
        let took = e
            .converged(&[80, 20], Instant::now(), Duration::from_secs(60))
            .await?;
        println!(
            "  {} real Envoys hold the full config {:?} after starting (route polled in {})",
            e.len(),
            e.started.elapsed(),
            e.describe(&took)
        );
    }
    let (mut light, mut real_max) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let want = if round % 2 == 0 { [100, 0] } else { [80, 20] };
        let prev = server.tx.borrow().clone();
        let t = Instant::now();
        let mut next = build_snapshot(&store(want[0], want[1])?, &prev, &opts);
        next.synced = true;
        let built = t.elapsed();
        server.tx.send_replace(Arc::new(next));
        let real = async {
            match &envoys {
                Some(e) => e
                    .converged(&want, t, Duration::from_secs(10))
                    .await
                    .map(Some),
                None => Ok(None),
            }
        };
        let (lw, real) = tokio::join!(wait_route(&mut events, clients, &want, t), real);
        let (first, last, bytes) = lw.with_context(|| format!("round {round}"))?;
        let real = real.with_context(|| format!("round {round}: real Envoys"))?;
        light.push(last);
        let real_cell = match (&real, &envoys) {
            (Some(took), Some(e)) => {
                real_max.push(took.iter().map(|c| c.after).max().unwrap_or_default());
                format!("; real Envoys {}", e.describe(took))
            }
            _ => String::new(),
        };
        println!(
            "  round {round}: {}/{}: rebuild {built:?}; first client {first:?}, last {last:?}; route update {bytes} B per client{real_cell}",
            want[0], want[1]
        );
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let nacks = server.registry.nacks();
    if !nacks.is_empty() {
        println!("  ! NACKs: {nacks:#?}");
    }
    println!(
        "one weight change to {clients} waypoint clients (snapshot publish to the last client holding it): {} over {rounds} rounds",
        median_max(&mut light)
    );
    if let Some(e) = &envoys {
        println!(
            "the same change in {} real Envoys (publish to the last one's config_dump showing it): {}",
            e.len(),
            median_max(&mut real_max)
        );
    }
    Ok(())
}

fn median_max(v: &mut [Duration]) -> String {
    v.sort();
    match (v.get(v.len() / 2), v.last()) {
        (Some(m), Some(x)) => format!("median {m:?}, max {x:?}"),
        _ => "no rounds".to_string(),
    }
}
