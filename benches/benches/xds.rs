//! Workload-xDS benchmark: a generated mesh of 10,000 pods and 1,000
//! services. Measures snapshot build time, bytes per workload, the time for
//! 100 concurrent ztunnels to hold the full state, the time and bytes to
//! bring one pod change to all of them, and the control plane's RSS.
//!
//! The control plane runs in a child process (this binary re-executed with
//! `AMBIT_BENCH_ROLE=control`) so its RSS is its own; the 100 ztunnels run
//! in this process. Run: `cargo bench -p ambit-benches --bench xds`.
//! Sizes: `PODS`, `SERVICES`, `CLIENTS` environment variables.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ambit_config::parse_documents;
use ambit_control::model::{ModelOptions, Snapshot, Store, build_snapshot};
use ambit_control::{ControlConfig, ControlPlane};
use ambit_tests::{get, write_atomic};
use anyhow::{Context, Result, bail};

const NAMESPACES: usize = 20;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn pod_yaml(out: &mut String, ns: usize, i: usize, app: usize, revision: &str) {
    let (b, c) = ((i / 250) % 250, i % 250);
    let _ = write!(
        out,
        "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: pod-{i}\n  namespace: ns-{ns}\n  \
         labels: {{app: svc-{app}, version: \"{revision}\"}}\nspec:\n  nodeName: node-{}\n  \
         serviceAccountName: sa-{app}\nstatus:\n  podIP: 10.{}.{b}.{c}\n",
        i % 50,
        100 + i / 62500,
    );
}

/// Writes the mesh into `dir`: one file per namespace, and the pod the
/// change benchmark edits in a file of its own.
fn generate(dir: &Path, pods: usize, services: usize) -> Result<()> {
    let pods_per_ns = pods / NAMESPACES;
    let svcs_per_ns = services / NAMESPACES;
    for ns in 0..NAMESPACES {
        let mut y = String::new();
        let ambient = if ns % 2 == 0 {
            "\n  labels: {istio.io/dataplane-mode: ambient}"
        } else {
            ""
        };
        let _ = write!(
            y,
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: ns-{ns}{ambient}\n"
        );
        for s in 0..svcs_per_ns {
            let id = ns * svcs_per_ns + s;
            let _ = write!(
                y,
                "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: svc-{id}\n  namespace: ns-{ns}\n\
                 spec:\n  clusterIP: 10.96.{}.{}\n  selector: {{app: svc-{id}}}\n  ports:\n  \
                 - {{name: http, port: 80, targetPort: 8080}}\n  - {{name: grpc, port: 9090, targetPort: 9090}}\n",
                id / 250,
                id % 250
            );
        }
        for p in 0..pods_per_ns {
            let i = ns * pods_per_ns + p;
            if i == 0 {
                continue; // lives in change.yaml
            }
            let app = ns * svcs_per_ns + p % svcs_per_ns.max(1);
            pod_yaml(&mut y, ns, i, app, "v1");
        }
        std::fs::write(dir.join(format!("ns-{ns}.yaml")), y)?;
    }
    write_change(dir, "v1")
}

fn write_change(dir: &Path, revision: &str) -> Result<()> {
    let mut y = String::new();
    pod_yaml(&mut y, 0, 0, 0, revision);
    write_atomic(&dir.join("change.yaml"), &y)
}

fn load_objects(dir: &Path) -> Result<Vec<ambit_config::Object>> {
    let mut objects = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let path = e?.path();
        let text = std::fs::read_to_string(&path)?;
        let (objs, errs) = parse_documents(&path, &text);
        if let Some(e) = errs.first() {
            bail!("generated config rejected: {e}");
        }
        objects.extend(objs);
    }
    Ok(objects)
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// Sum of a counter family's samples whose line starts with `prefix`.
fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// One Delta client: subscribe to everything, decode every Address, ACK,
/// and return how many resources the full sync (all chunks) held.
async fn raw_full_sync(xds: std::net::SocketAddr, i: usize) -> Result<usize> {
    use envoy_types::pb::envoy::config::core::v3::Node;
    use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
    use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
    use prost::Message;
    use tokio_stream::StreamExt;
    let mut client = AggregatedDiscoveryServiceClient::connect(format!("http://{xds}"))
        .await?
        .max_decoding_message_size(256 << 20);
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(DeltaDiscoveryRequest {
        node: Some(Node {
            id: format!("bench~0.0.0.0~raw-{i}.bench~bench.svc.cluster.local"),
            ..Default::default()
        }),
        type_url: ambit_proto::ADDRESS_TYPE_URL.into(),
        ..Default::default()
    })
    .await?;
    let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    req.metadata_mut()
        .insert("authorization", format!("Bearer token-{i}").parse()?);
    let mut stream = client.delta_aggregated_resources(req).await?.into_inner();
    let mut count = 0;
    loop {
        let resp = stream.next().await.context("stream ended")??;
        for r in &resp.resources {
            let any = r.resource.as_ref().context("resource without body")?;
            ambit_proto::workload::Address::decode(any.value.as_slice())?;
        }
        count += resp.resources.len();
        tx.send(DeltaDiscoveryRequest {
            type_url: resp.type_url.clone(),
            response_nonce: resp.nonce.clone(),
            ..Default::default()
        })
        .await?;
        if !resp
            .system_version_info
            .ends_with(ambit_proto::PARTIAL_RESPONSE_MARKER)
        {
            return Ok(count);
        }
    }
}

/// CPU seconds (user + system) used so far by process `pid`.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the `(comm)` that may contain spaces; utime and stime are 14 and 15.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// The child: a control plane on the generated dir until stdin closes.
fn run_control_child() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let dir = std::env::var("CONFIG_DIR").context("CONFIG_DIR")?;
        let data = tempfile::tempdir()?;
        // Node bootstrap tokens: `token-<i>` authenticates node-<i>.
        let tokens: String = (0..env_usize("CLIENTS", 100))
            .map(|i| format!("token-{i} node-{i}\n"))
            .collect();
        let tokens_file = data.path().join("node-tokens");
        std::fs::write(&tokens_file, tokens)?;
        let mut cfg = ControlConfig::for_tests(dir.into(), data.path().join("cp"));
        cfg.node_tokens_file = Some(tokens_file);
        let cp = ControlPlane::start(cfg).await?;
        println!("READY {} {}", cp.xds_addr(), cp.monitoring_addr());
        tokio::task::spawn_blocking(|| {
            let mut sink = String::new();
            while std::io::stdin()
                .read_line(&mut sink)
                .map(|n| n > 0)
                .unwrap_or(false)
            {}
        })
        .await?;
        cp.shutdown().await;
        Ok(())
    })
}

fn main() -> Result<()> {
    if std::env::var("AMBIT_BENCH_ROLE").as_deref() == Ok("control") {
        return run_control_child();
    }
    if std::env::args().any(|a| a == "--list") {
        return Ok(()); // `cargo test --benches` discovery
    }
    let pods = env_usize("PODS", 10_000);
    let services = env_usize("SERVICES", 1_000);
    let clients = env_usize("CLIENTS", 100);
    let dir = tempfile::tempdir()?;
    generate(dir.path(), pods, services)?;
    println!(
        "mesh: {pods} pods, {services} services in {NAMESPACES} namespaces; {clients} ztunnels"
    );

    // 1. Snapshot build, in process.
    let t = Instant::now();
    let objects = load_objects(dir.path())?;
    let parse = t.elapsed();
    let store = Store::from_objects(objects);
    let opts = ModelOptions::default();
    let mut builds = Vec::new();
    let first = build_snapshot(&store, &Snapshot::default(), &opts);
    let mut prev = Arc::new(first);
    for _ in 0..5 {
        let t = Instant::now();
        let next = build_snapshot(&store, &Snapshot::default(), &opts);
        builds.push(t.elapsed());
        prev = Arc::new(next);
    }
    let mut rebuilds = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let next = build_snapshot(&store, &prev, &opts);
        rebuilds.push(t.elapsed());
        prev = Arc::new(next);
    }
    let (wl_bytes, wl_count) = prev
        .mesh(ambit_proto::ADDRESS_TYPE_URL)
        .by_name
        .values()
        .filter(|r| r.name.contains("//Pod/"))
        .fold((0usize, 0usize), |(b, n), r| {
            (b + r.body.value.len(), n + 1)
        });
    let svc_bytes: usize = prev
        .mesh(ambit_proto::ADDRESS_TYPE_URL)
        .by_name
        .values()
        .filter(|r| !r.name.contains("//Pod/"))
        .map(|r| r.body.value.len())
        .sum();
    println!("parse {pods}+{services} objects from YAML: {}", ms(parse));
    println!(
        "snapshot build from scratch (translate + encode all), median of 5: {}",
        ms(median(&mut builds))
    );
    println!(
        "snapshot rebuild against previous (reuse unchanged), median of 5: {}",
        ms(median(&mut rebuilds))
    );
    println!(
        "bytes per workload on the wire: {} (services: {} each)",
        wl_bytes / wl_count.max(1),
        svc_bytes / (prev.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name.len() - wl_count).max(1)
    );
    drop(prev);
    drop(store);

    // 2. The control plane in a child process.
    let mut child = Command::new(std::env::current_exe()?)
        .env("AMBIT_BENCH_ROLE", "control")
        .env("CONFIG_DIR", dir.path())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("child stdout")?).read_line(&mut line)?;
    let mut parts = line.split_whitespace().skip(1);
    let xds: std::net::SocketAddr = parts.next().context("child did not report")?.parse()?;
    let mon: std::net::SocketAddr = parts.next().context("child did not report")?.parse()?;
    let pid = child.id();
    let (rss_idle, _) = rss_kib(pid);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = rt.block_on(async move {
        let status = get(mon, "/debug/push_status").await?;
        println!("control plane initial snapshot (in child): {status}");

        // 3a. 100 plain Delta clients (decode every resource, keep nothing):
        //     what the server itself can fan out.
        let t = Instant::now();
        let cpu0 = cpu_secs(pid);
        let raw = (0..clients).map(|i| raw_full_sync(xds, i));
        let counts = futures::future::try_join_all(raw).await?;
        let raw_sync = t.elapsed();
        if counts.iter().any(|c| *c != pods + services) {
            bail!("a raw client got {counts:?} resources");
        }
        println!(
            "full sync of {clients} plain Delta clients (decode all, ACK): {} (control plane CPU {:.2} s)",
            ms(raw_sync),
            cpu_secs(pid) - cpu0
        );
        let (rss, hwm) = rss_kib(pid);
        println!(
            "control plane RSS after plain clients: {} MiB (peak {} MiB)",
            rss / 1024,
            hwm / 1024
        );

        // 3b. 100 ztunnels connect at once; time until all hold everything.
        let t = Instant::now();
        let cpu0 = cpu_secs(pid);
        let own0 = cpu_secs(std::process::id());
        let token_dir = tempfile::tempdir()?;
        let mut configs = Vec::new();
        for i in 0..clients {
            let token = token_dir.path().join(format!("token-{i}"));
            std::fs::write(&token, format!("token-{i}"))?;
            let mut c = ambit_ztunnel::Config::new(format!("node-{i}"), format!("http://{xds}"))
                .with_ephemeral_ports();
            c.token_file = Some(token);
            configs.push(c);
        }
        let starts = configs.into_iter().map(ambit_ztunnel::start);
        let zts: Vec<_> = futures::future::try_join_all(starts).await?;
        futures::future::join_all(zts.iter().map(|z| z.wait_ready())).await;
        let sync = t.elapsed();
        for z in &zts {
            let s = z.state();
            if s.workload_count() != pods || s.service_count() != services {
                bail!(
                    "ztunnel {} holds {} workloads / {} services",
                    z.node_name(),
                    s.workload_count(),
                    s.service_count()
                );
            }
        }
        println!(
            "full sync of {clients} ztunnels (connect to all holding {pods} workloads + {services} services): {} (control plane CPU {:.2} s, ztunnel CPU {:.0} ms each)",
            ms(sync),
            cpu_secs(pid) - cpu0,
            (cpu_secs(std::process::id()) - own0) * 1e3 / clients as f64
        );
        let (rss, hwm) = rss_kib(pid);
        println!(
            "control plane RSS: {} MiB before clients, {} MiB serving {clients} clients (peak {} MiB)",
            rss_idle / 1024,
            rss / 1024,
            hwm / 1024
        );

        // 4. One pod change to every client.
        let uid = "Kubernetes//Pod/ns-0/pod-0";
        let mut times = Vec::new();
        let mut sent = Vec::new();
        let mut bytes = Vec::new();
        for round in 2..8 {
            let before = get(mon, "/metrics").await?;
            let rev = format!("v{round}");
            let t = Instant::now();
            write_change(dir.path(), &rev)?;
            let waits = zts.iter().map(|z| {
                let reader = z.state_reader();
                let rev = rev.clone();
                async move {
                    reader
                        .wait_for(|s| {
                            s.workload_by_uid(uid)
                                .is_some_and(|w| w.canonical_revision == rev)
                        })
                        .await;
                    t.elapsed()
                }
            });
            let mut arrivals =
                tokio::time::timeout(Duration::from_secs(30), futures::future::join_all(waits))
                    .await
                    .context("change did not reach every ztunnel in 30 s")?;
            times.push(t.elapsed());
            arrivals.sort();
            let status = get(mon, "/debug/push_status").await?;
            let build = status
                .lines()
                .find(|l| l.contains("build_time_ms"))
                .unwrap_or_default()
                .trim()
                .to_string();
            println!(
                "  round {round}: first client {}, median {}, last {}; {build}",
                ms(arrivals[0]),
                ms(arrivals[arrivals.len() / 2]),
                ms(arrivals[arrivals.len() - 1])
            );
            let after = get(mon, "/metrics").await?;
            let key = "pilot_xds_resources_sent_total{type=\"address\"}";
            let bkey = "pilot_xds_push_bytes_total{type=\"address\"}";
            sent.push(metric(&after, key) - metric(&before, key));
            bytes.push(metric(&after, bkey) - metric(&before, bkey));
        }
        let worst = *times.iter().max().unwrap_or(&Duration::ZERO);
        println!(
            "one pod change to all {clients} clients (file write to last ztunnel updated, debounce included): median {}, max {} over {} rounds",
            ms(median(&mut times)),
            ms(worst),
            sent.len()
        );
        println!(
            "  resources sent per change: {} ({} per client), resource bytes per change: {}",
            sent[0],
            sent[0] / clients as f64,
            bytes[0]
        );
        let (rss, hwm) = rss_kib(pid);
        println!("control plane RSS at end: {} MiB (peak {} MiB)", rss / 1024, hwm / 1024);
        for z in zts {
            z.shutdown().await;
        }
        Ok(())
    });
    drop(child.stdin.take());
    let _ = child.wait();
    result
}
