//! Pod to pod across two nodes, on the bed of `ambitctl local up`
//! (`ambitctl::local`): the real binaries as processes (control plane,
//! a node agent and a ztunnel per node), pods wired by the CNI reference
//! plugins chained with `ambit-cni`, traffic over the real veth/bridge/lan
//! path. Each figure is measured through the mesh (client and server pods
//! enrolled, one ztunnel at each end) and between two pods outside the mesh
//! on the same nodes, in the same run.
//!
//! ```sh
//! cargo build --release --workspace --bins      # the binaries local mode runs
//! cargo bench -p ambit-benches --bench mesh      # root; SECS=10 RATES=1000,5000
//! ```
//!
//! Reports latency p50/p90/p99 of 1 KiB request/response at fixed rates
//! (open loop, one connection), the two ztunnels' CPU per 1,000 requests/s
//! and their RSS, and single-stream bulk throughput.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ambit_tests::netbed::{self, PodNet};
use ambitctl::local::{self, LocalCluster, Role, UpOptions};
use anyhow::{Context, Result};
use tokio::io::AsyncReadExt;

#[allow(dead_code)]
#[path = "dataplane/load.rs"]
mod load;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const CONFIG: &str = "\
apiVersion: v1
kind: Namespace
metadata: {name: mesh, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Namespace
metadata: {name: plain}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: mesh}
spec: {nodeName: node-1, serviceAccountName: client}
status: {podIP: 10.10.1.10}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: mesh}
spec: {nodeName: node-2, serviceAccountName: server}
status: {podIP: 10.10.2.10}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: plain}
spec: {nodeName: node-1}
status: {podIP: 10.10.1.20}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: plain}
spec: {nodeName: node-2}
status: {podIP: 10.10.2.20}
";

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn pod(c: &LocalCluster, key: &str, node: usize) -> PodNet {
    let p = c.pod(key).expect("pod in the plan");
    PodNet {
        name: p.name.clone(),
        netns: p.netns.clone(),
        ip: p.ip,
        ip6: None,
        node,
    }
}

fn ztunnel_pids(c: &LocalCluster) -> Vec<u32> {
    c.state
        .processes
        .iter()
        .filter(|p| p.role == Role::Ztunnel)
        .map(|p| p.pid)
        .collect()
}

fn cpu(pids: &[u32]) -> f64 {
    pids.iter().map(|p| load::cpu_secs(*p)).sum()
}

fn rss_mib(pids: &[u32]) -> Vec<f64> {
    pids.iter()
        .map(|p| load::mem(*p).rss as f64 / 1024.0)
        .collect()
}

/// A sink counting bytes, in the pod.
async fn sink(
    pod: &PodNet,
    port: u16,
    bytes: Arc<AtomicU64>,
) -> Result<tokio::task::JoinHandle<()>> {
    let l = netbed::listen(pod, port)?;
    Ok(tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let bytes = bytes.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 256 * 1024];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    bytes.fetch_add(n as u64, Ordering::Relaxed);
                }
            });
        }
    }))
}

struct Row {
    what: String,
    plain: String,
    mesh: String,
}

fn main() -> Result<()> {
    if !netbed::can_run("mesh bench") {
        return Ok(());
    }
    let exe = std::env::current_exe()?;
    let bins: PathBuf = exe
        .parent()
        .and_then(|d| d.parent())
        .context("locating target/release")?
        .to_path_buf();
    let missing: Vec<_> = local::BINARIES
        .iter()
        .filter(|b| !bins.join(b).exists())
        .collect();
    if !missing.is_empty() {
        println!(
            "SKIP mesh bench: build the binaries first (cargo build --release --workspace --bins); missing {missing:?}"
        );
        return Ok(());
    }
    let secs = Duration::from_secs(env_u64("SECS", 10));
    let rates: Vec<f64> = std::env::var("RATES")
        .unwrap_or_else(|_| "1000,5000".into())
        .split(',')
        .filter_map(|r| r.trim().parse().ok())
        .collect();

    let config = tempfile::tempdir()?;
    std::fs::write(config.path().join("bench.yaml"), CONFIG)?;
    let state = tempfile::tempdir()?;
    let mut opts = UpOptions::new(config.path(), &bins);
    opts.name = format!("bm{:05x}", rand::random::<u32>() & 0xfffff);
    opts.state_dir = Some(state.path().join("state"));
    let cluster = local::up(&opts).context("local up")?.down_on_drop();
    let zts = ztunnel_pids(&cluster);
    let idle_rss = rss_mib(&zts);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let pairs = [
        (
            "plain",
            pod(&cluster, "plain/client", 0),
            pod(&cluster, "plain/server", 1),
        ),
        (
            "mesh",
            pod(&cluster, "mesh/client", 0),
            pod(&cluster, "mesh/server", 1),
        ),
    ];
    let mut rows: Vec<Row> = Vec::new();
    let mut push = |what: String, plain: String, mesh: String| rows.push(Row { what, plain, mesh });

    // Request/response at fixed rates.
    let _echoes: Vec<_> = rt.block_on(async {
        let mut v = Vec::new();
        for (_, _, server) in &pairs {
            v.push(netbed::echo_server(server, 7000).await?);
        }
        anyhow::Ok(v)
    })?;
    for &rate in &rates {
        let mut cells = Vec::new();
        let mut cpu_cell = String::new();
        for (label, client, server) in &pairs {
            let dst = SocketAddr::new(server.ip.into(), 7000);
            let s = load::connect_blocking(client, dst)?;
            load::rr_warmup(&s, 2000)?;
            let c0 = cpu(&zts);
            let lat = load::rr_open(&s, rate, secs, zts[0])?;
            let zt_cpu = cpu(&zts) - c0;
            cells.push(format!(
                "{:.0} / {:.0} / {:.0}",
                lat.pct(0.5),
                lat.pct(0.9),
                lat.pct(0.99)
            ));
            if *label == "mesh" {
                let vcpu = zt_cpu / lat.usage.secs;
                cpu_cell = format!(
                    "{:.3} vCPU per 1,000 req/s ({:.3} vCPU at {:.0} req/s, both ztunnels)",
                    vcpu / (lat.rps() / 1000.0),
                    vcpu,
                    lat.rps()
                );
            }
        }
        push(
            format!("1 KiB req/resp at {rate:.0}/s: p50 / p90 / p99 µs"),
            cells[0].clone(),
            cells[1].clone(),
        );
        push(format!("ztunnel CPU at {rate:.0}/s"), "-".into(), cpu_cell);
    }
    let loaded_rss = rss_mib(&zts);

    // Bulk, one stream.
    let mut cells = Vec::new();
    for (_, client, server) in &pairs {
        let bytes = Arc::new(AtomicU64::new(0));
        let gbps = rt.block_on(async {
            let _sink = sink(server, 7001, bytes.clone()).await?;
            let dst = SocketAddr::new(server.ip.into(), 7001);
            let b = load::bulk(
                client,
                dst,
                &bytes,
                1,
                secs.min(Duration::from_secs(5)),
                zts[0],
            )
            .await?;
            anyhow::Ok(b.gbps())
        })?;
        cells.push(format!("{gbps:.2} Gbit/s"));
    }
    push("bulk, 1 stream".into(), cells[0].clone(), cells[1].clone());
    let fmt = |v: &[f64]| {
        v.iter()
            .map(|m| format!("{m:.1}"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    push(
        "ztunnel RSS node-1 / node-2, MiB (idle → after load)".into(),
        "-".into(),
        format!("{} → {}", fmt(&idle_rss), fmt(&loaded_rss)),
    );

    println!("\n| measure | no mesh | mesh |\n|---|---|---|");
    for r in &rows {
        println!("| {} | {} | {} |", r.what, r.plain, r.mesh);
    }
    cluster.down().context("local down")?;
    Ok(())
}
