//! The control plane in Kubernetes mode against a real kube-apiserver (the
//! kit in `../shared/kube`) holding a cluster of `PODS` pods (5,000),
//! `SERVICES` services (1,000, each with its EndpointSlice) and `NODES`
//! nodes (200), all created through the API:
//!
//! 1. time to Ready from a cold start of the control plane (a child
//!    process: this binary with `AMBIT_BENCH_ROLE=control`, so its RSS and
//!    CPU are its own), running as its ServiceAccount with the shipped RBAC;
//! 2. its RSS and CPU once synced;
//! 3. `CHANGES` (100) writes through the API — half pod label edits, half
//!    AuthorizationPolicy edits — each timed from the write until a
//!    ztunnel's xDS stream carries it: p50 / p99.
//!
//! Run: `cargo bench -p ambit-benches --bench kube` (no root needed).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ambit_control::{ControlConfig, ControlPlane};
use ambit_tests::kubeapi::{Crds, KubeApiServer, api_of};
use ambit_tests::kubebed::{Observer, pod_uid};
use anyhow::{Context, Result, bail};
use futures::StreamExt;
use kube::Client;
use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};

const NAMESPACES: usize = 20;
/// Requests in flight while the cluster is filled.
const CONCURRENCY: usize = 16;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
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

/// CPU seconds (user + system) used so far by process `pid`.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn pod_ip(i: usize) -> String {
    format!("10.{}.{}.{}", 100 + i / 65_536, (i / 256) % 256, i % 256)
}

/// Server-side applies every document, `CONCURRENCY` at a time; pods get
/// their status written afterwards, as the kubelet would.
async fn apply_all(client: &Client, docs: Vec<Value>) -> Result<()> {
    let results: Vec<Result<()>> = futures::stream::iter(docs)
        .map(|doc| {
            let client = client.clone();
            async move {
                let status = doc.get("status").cloned();
                let mut body = doc.clone();
                if let Some(m) = body.as_object_mut() {
                    m.remove("status");
                }
                let (api, name) = api_of(&client, &body)?;
                api.patch(
                    &name,
                    &PatchParams::apply("bench").force(),
                    &Patch::Apply(&body),
                )
                .await
                .with_context(|| format!("applying {name}"))?;
                if let Some(status) = status {
                    api.patch_status(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(&json!({"status": status})),
                    )
                    .await
                    .with_context(|| format!("status of {name}"))?;
                }
                Ok(())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    results.into_iter().collect()
}

/// The cluster: nodes, namespaces (half ambient) with their
/// ServiceAccount, services with selectors and EndpointSlices, pods.
fn cluster(pods: usize, services: usize, nodes: usize) -> (Vec<Value>, Vec<Value>) {
    let mut first = Vec::new();
    for n in 0..nodes {
        first.push(json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": format!("node-{n}"), "labels": {"kubernetes.io/hostname": format!("node-{n}")}}}));
    }
    for ns in 0..NAMESPACES {
        let labels = if ns % 2 == 0 {
            json!({"istio.io/dataplane-mode": "ambient"})
        } else {
            json!({})
        };
        first.push(json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": format!("ns-{ns}"), "labels": labels}}));
    }
    let mut rest = Vec::new();
    for ns in 0..NAMESPACES {
        rest.push(json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": "app", "namespace": format!("ns-{ns}")}}));
    }
    let per_service = pods.div_ceil(services.max(1));
    for s in 0..services {
        let ns = format!("ns-{}", s % NAMESPACES);
        let app = format!("app-{s}");
        rest.push(json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": app, "namespace": ns},
            "spec": {"selector": {"app": app}, "ports": [
                {"name": "http", "port": 80, "targetPort": 8080},
                {"name": "grpc", "port": 9090, "targetPort": 9090}]}}));
        let endpoints: Vec<Value> = (0..per_service)
            .map(|k| s * per_service + k)
            .filter(|i| *i < pods)
            .map(|i| {
                json!({"addresses": [pod_ip(i)], "conditions": {"ready": true},
                "nodeName": format!("node-{}", i % nodes),
                "targetRef": {"kind": "Pod", "name": format!("pod-{i}"), "namespace": ns}})
            })
            .collect();
        rest.push(
            json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{app}-1"), "namespace": ns,
                         "labels": {"kubernetes.io/service-name": app}},
            "addressType": "IPv4", "endpoints": endpoints,
            "ports": [{"name": "http", "port": 8080}, {"name": "grpc", "port": 9090}]}),
        );
    }
    for i in 0..pods {
        let s = i / per_service;
        rest.push(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("pod-{i}"), "namespace": format!("ns-{}", s % NAMESPACES),
                         "labels": {"app": format!("app-{s}"), "version": "v1"}},
            "spec": {"nodeName": format!("node-{}", i % nodes), "serviceAccountName": "app",
                     "automountServiceAccountToken": false,
                     "containers": [{"name": "app", "image": "example.test/app:1",
                                     "ports": [{"containerPort": 8080}]}]},
            "status": {"phase": "Running", "podIP": pod_ip(i), "podIPs": [{"ip": pod_ip(i)}],
                       "conditions": [{"type": "Ready", "status": "True"}]}}));
    }
    (first, rest)
}

/// The child: a control plane as its ServiceAccount until stdin closes.
fn run_control_child() -> Result<()> {
    let start = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let kubeconfig = std::env::var("BENCH_KUBECONFIG")?.into();
        let data = std::env::var("BENCH_DATA")?.into();
        let mut cfg = ControlConfig::for_kube_tests(kubeconfig, data, "bench");
        cfg.kube_retry_max_ms = 4_000;
        let cp = ControlPlane::start(cfg).await?;
        cp.wait_synced().await?;
        println!(
            "ready {} {} {}",
            cp.xds_addr(),
            cp.monitoring_addr(),
            start.elapsed().as_millis()
        );
        tokio::task::spawn_blocking(|| {
            let mut buf = String::new();
            let _ = std::io::stdin().read_line(&mut buf);
        })
        .await?;
        cp.shutdown().await;
        Ok(())
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() -> Result<()> {
    if std::env::var("AMBIT_BENCH_ROLE").as_deref() == Ok("control") {
        return run_control_child();
    }
    if std::env::args().any(|a| a == "--list") {
        return Ok(());
    }
    let pods = env_usize("PODS", 5_000);
    let services = env_usize("SERVICES", 1_000);
    let nodes = env_usize("NODES", 200);
    let changes = env_usize("CHANGES", 100);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(bench(pods, services, nodes, changes))
}

async fn bench(pods: usize, services: usize, nodes: usize, changes: usize) -> Result<()> {
    let kube = KubeApiServer::start(Crds::Standard).await?;
    kube.install_ambit().await?;
    let client = kube.client().await?;
    let (first, rest) = cluster(pods, services, nodes);
    let t = Instant::now();
    apply_all(&client, first).await?;
    apply_all(&client, rest).await?;
    println!(
        "cluster through the API: {pods} pods, {services} services + EndpointSlices, {nodes} nodes, {NAMESPACES} namespaces in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let zt_uid = kube
        .running_pod(
            "ambit-system",
            "ztunnel-0",
            "ztunnel",
            "node-0",
            "10.99.0.2",
            json!({"app": "ztunnel"}),
        )
        .await?;
    kube.apply(
        &json!({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
        "metadata": {"name": "bench", "namespace": "ns-0"},
        "spec": {"action": "DENY", "rules": [{"to": [{"operation": {"ports": ["1"]}}]}]}}),
    )
    .await?;

    // 1. Cold start to Ready.
    let dir = tempfile::tempdir()?;
    let kc = kube
        .kubeconfig_for(
            "ambit-system",
            "ambit-control",
            &dir.path().join("cp.kubeconfig"),
        )
        .await?;
    let mut child = Command::new(std::env::current_exe()?)
        .env("AMBIT_BENCH_ROLE", "control")
        .env("BENCH_KUBECONFIG", &kc)
        .env("BENCH_DATA", dir.path().join("data"))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let stdout = child.stdout.take().context("child stdout")?;
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).map(|_| line)
    })
    .await??;
    let mut parts = line.split_whitespace().skip(1);
    let xds: std::net::SocketAddr = parts.next().context("child did not report")?.parse()?;
    let _mon: std::net::SocketAddr = parts.next().context("child did not report")?.parse()?;
    let ready_ms: u64 = parts.next().context("child did not report")?.parse()?;
    let cpu_start = cpu_secs(pid);
    println!(
        "cold start to Ready (every kind listed, CA loaded): {ready_ms} ms; CPU {cpu_start:.2} s"
    );

    // 2. A ztunnel's view of it all, then the idle footprint.
    let token = kube
        .token(
            "ambit-system",
            "ztunnel",
            Some("istio-ca"),
            Some(("ztunnel-0", &zt_uid)),
        )
        .await?;
    let mut addresses =
        Observer::connect_with_token(xds, ambit_proto::ADDRESS_TYPE_URL, &token).await?;
    let mut policies =
        Observer::connect_with_token(xds, ambit_proto::AUTHORIZATION_TYPE_URL, &token).await?;
    let t = Instant::now();
    addresses
        .until(Duration::from_secs(60), "the full workload set", |h| {
            h.len() > pods
        })
        .await?;
    policies
        .until(Duration::from_secs(60), "the policy", |h| {
            h.contains("ns-0/bench")
        })
        .await?;
    println!(
        "one ztunnel's full sync: {} resources in {}",
        addresses.held.len(),
        ms(t.elapsed())
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (rss, hwm) = rss_kib(pid);
    println!(
        "control-plane RSS synced and serving one ztunnel: {} MiB (peak {} MiB); CPU so far {:.2} s",
        rss / 1024,
        hwm / 1024,
        cpu_secs(pid)
    );

    // 3. Writes through the API, each timed until the ztunnel has it.
    let mut lat_pods = Vec::new();
    let mut lat_policy = Vec::new();
    let cpu0 = cpu_secs(pid);
    for round in 0..changes {
        let t = Instant::now();
        if round % 2 == 0 {
            // A pod label edit: its workload's revision changes.
            let i = (round * 37) % pods;
            let s = i / pods.div_ceil(services.max(1));
            let name = format!("pod-{i}");
            let api = kube::Api::<kube::api::DynamicObject>::namespaced_with(
                client.clone(),
                &format!("ns-{}", s % NAMESPACES),
                &kube::discovery::ApiResource::erase::<k8s_openapi::api::core::v1::Pod>(&()),
            );
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(
                    &json!({"metadata": {"labels": {"version": format!("v{}", round + 2)}}}),
                ),
            )
            .await?;
            let uid = pod_uid(&format!("ns-{}", s % NAMESPACES), &name);
            until_sent(&mut addresses, &uid).await?;
            lat_pods.push(t.elapsed());
        } else {
            kube.apply(&json!({"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
                "metadata": {"name": "bench", "namespace": "ns-0"},
                "spec": {"action": "DENY", "rules": [{"to": [{"operation": {"ports": [format!("{}", round + 2)]}}]}]}}))
                .await?;
            until_sent(&mut policies, "ns-0/bench").await?;
            lat_policy.push(t.elapsed());
        }
    }
    let cpu_changes = cpu_secs(pid) - cpu0;
    let mut all: Vec<Duration> = lat_pods.iter().chain(&lat_policy).copied().collect();
    all.sort();
    lat_pods.sort();
    lat_policy.sort();
    println!(
        "{changes} writes, API write -> ztunnel stream: p50 {} p99 {} max {} (pod labels p50 {} p99 {}; policies p50 {} p99 {}); control-plane CPU {:.2} s",
        ms(percentile(&all, 0.5)),
        ms(percentile(&all, 0.99)),
        ms(*all.last().context("no change measured")?),
        ms(percentile(&lat_pods, 0.5)),
        ms(percentile(&lat_pods, 0.99)),
        ms(percentile(&lat_policy, 0.5)),
        ms(percentile(&lat_policy, 0.99)),
        cpu_changes
    );
    let (rss, hwm) = rss_kib(pid);
    println!(
        "control-plane RSS after the writes: {} MiB (peak {} MiB)",
        rss / 1024,
        hwm / 1024
    );
    drop(child.stdin.take());
    let _ = child.wait();
    Ok(())
}

/// Reads responses until one sends `name`.
async fn until_sent(obs: &mut Observer, name: &str) -> Result<()> {
    let start = Instant::now();
    loop {
        let left = Duration::from_secs(10)
            .checked_sub(start.elapsed())
            .with_context(|| format!("{name} never arrived"))?;
        let (sent, _) = obs.next(left).await?;
        if sent.iter().any(|n| n == name) {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(10) {
            bail!("{name} never arrived");
        }
    }
}
