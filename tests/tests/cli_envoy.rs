//! `ambitctl proxy-config` and `proxy-status` against a real Envoy: the
//! agent's Envoy runs the control plane's real waypoint configuration for
//! `tests/fixtures/waypoint/base.yaml` with the 80/20 canary of the corpus;
//! `proxy-config routes` shows the split at a glance, and `proxy-status`
//! shows the waypoint with every type SYNCED.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use ambit_tests::agentbed::{Agent, AgentOptions, Plane};
use ambit_tests::envoy::envoy_binary;
use ambit_tests::{eventually, http};
use ambitctl::proxy_config::{self, Section};
use ambitctl::proxy_status::{self, Sync};
use anyhow::{Result, bail};
use nix::sys::signal::Signal;

const LIMIT: Duration = Duration::from_secs(30);

const WAYPOINT_POD: &str = "\
---
apiVersion: v1
kind: Pod
metadata:
  name: waypoint-0
  namespace: shop
  labels: {gateway.networking.k8s.io/gateway-name: waypoint, istio.io/dataplane-mode: none}
spec: {nodeName: node-1, serviceAccountName: waypoint}
status: {podIP: 10.10.1.5}
";

async fn wait_ready(agent: &Agent) -> Result<()> {
    let addr = agent.addr("status");
    let start = std::time::Instant::now();
    let mut last = String::new();
    while start.elapsed() < LIMIT {
        match http(addr, "GET", "/healthz/ready").await {
            Ok((200, _)) => return Ok(()),
            Ok((_, body)) => last = body,
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("agent not ready within {LIMIT:?}; last answer: {last}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_config_shows_the_80_20_split_and_proxy_status_shows_it_synced() {
    let envoy = envoy_binary().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        std::net::TcpListener::bind("0.0.0.0:15008").is_ok(),
        "port 15008 is taken on this host; the waypoint's HBONE listener needs it"
    );
    let root = ambit_tests::workspace_root().join("tests/fixtures/waypoint");
    let base = std::fs::read_to_string(root.join("base.yaml")).unwrap();
    let canary = std::fs::read_to_string(root.join("corpus/01-canary-80-20.yaml")).unwrap();
    let plane = Plane::start_with(
        &format!("{base}\n---\n{canary}{WAYPOINT_POD}"),
        Duration::from_secs(24 * 3600),
        ambit_control::xds::Generators::standard(),
    )
    .await
    .unwrap();
    let opts = AgentOptions {
        service_account: "waypoint".into(),
        pod_name: "waypoint-0".into(),
        pod_ip: "10.10.1.5".into(),
        gateway: "waypoint".into(),
        ..AgentOptions::new(format!("https://{}", plane.cp.xds_tls_addr()))
    };
    let mut agent = Agent::start(&plane, &envoy, &opts).await.unwrap();
    let result: Result<()> = async {
        wait_ready(&agent).await?;
        let admin = agent.addr("admin");
        // Readiness covers CDS and LDS; routes follow over RDS.
        let fetch = move || async move {
            tokio::task::spawn_blocking(move || proxy_config::fetch(admin, Duration::from_secs(5)))
                .await
                .ok()?
                .ok()
        };
        let (dump, routes, split) = eventually(LIMIT, "the llm routes in Envoy", || async {
            let dump = fetch().await?;
            let routes = proxy_config::section(&dump, Section::Routes);
            let split: Vec<(String, String)> = proxy_config::routes(&routes)
                .iter()
                .filter(|r| r.destination == "llm.shop.svc.cluster.local:80")
                .map(|r| (r.subset.clone(), r.weight.clone()))
                .collect();
            (!split.is_empty()).then_some((dump, routes, split))
        })
        .await?;
        let table = proxy_config::render(Section::Routes, &routes);
        println!("{table}");
        if split
            != [
                ("v1".to_string(), "80".to_string()),
                ("v2".to_string(), "20".to_string()),
            ]
        {
            bail!("no 80/20 split of llm in the routes: {split:?}\n{table}");
        }
        let line = |subset: &str, w: &str| {
            table.lines().any(|l| {
                l.contains("llm.shop.svc.cluster.local:80")
                    && l.contains(&format!(" {subset} "))
                    && l.trim_end().ends_with(w)
            })
        };
        if !line("v1", "80%") || !line("v2", "20%") {
            bail!("the table does not show 80%/20% per subset:\n{table}");
        }
        for section in [
            Section::Clusters,
            Section::Listeners,
            Section::Endpoints,
            Section::Secrets,
        ] {
            let t = proxy_config::render(section, &proxy_config::section(&dump, section));
            if t.starts_with("(none)") {
                bail!("{section:?} is empty");
            }
        }
        let secrets = proxy_config::render(
            Section::Secrets,
            &proxy_config::section(&dump, Section::Secrets),
        );
        if !secrets.contains("default") || !secrets.contains("ROOTCA") {
            bail!("secrets lack default/ROOTCA:\n{secrets}");
        }

        // proxy-status: the waypoint, every type it was sent SYNCED.
        let mon = plane.cp.monitoring_addr();
        eventually(
            LIMIT,
            "the waypoint to be SYNCED on every type",
            || async move {
                let s = tokio::task::spawn_blocking(move || {
                    proxy_status::collect(mon, Duration::from_secs(5))
                })
                .await
                .ok()?
                .ok()?;
                let wp = s.proxies.iter().find(|p| p.kind == "waypoint")?;
                let types: Vec<&str> = wp.types.iter().map(|t| t.type_.as_str()).collect();
                (wp.synced()
                    && ["cluster", "listener", "routeconfiguration"]
                        .iter()
                        .all(|t| types.contains(t))
                    && wp
                        .types
                        .iter()
                        .all(|t| t.version_acked == t.version_sent && t.status == Sync::Synced))
                .then_some(())
            },
        )
        .await?;
        let s = proxy_status::collect(mon, Duration::from_secs(5))?;
        let rendered = proxy_status::render(&s);
        println!("{rendered}");
        if !rendered.contains("waypoint-0.shop") || !rendered.contains("SYNCED") {
            bail!("proxy-status table:\n{rendered}");
        }
        agent.signal(Signal::SIGTERM)?;
        agent.wait_exit(Duration::from_secs(20)).await?;
        Ok(())
    }
    .await;
    if let Err(e) = result {
        panic!("{e:#}\n--- agent log ---\n{}", agent.log_text());
    }
}
