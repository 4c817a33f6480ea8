//! The `ambit-control` binary as a hostile client meets it: xDS without
//! credentials (both ports), with a wrong token or the wrong identity, and a
//! stream flood from one client. Nothing about the mesh may leak, and the
//! memory a client can make the control plane hold is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ambit_control::ca::{CaStore, Signer, SignerOptions, SpiffeId, generate_csr};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse,
};
use futures::StreamExt;
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tonic::Code;
use tonic::transport::{Channel, Endpoint, Uri};

const T: Duration = Duration::from_secs(10);
const NODE_TOKEN: &str = "node-1-secret";

/// The control-plane binary on loopback ports, killed on drop.
struct ControlProcess {
    child: Child,
    plain: SocketAddr,
    tls: SocketAddr,
    data: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for ControlProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const MESH: &str = "\
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Pod
metadata: {name: web-0, namespace: shop, labels: {app: web}}
spec: {nodeName: node-1, serviceAccountName: web}
status: {podIP: 10.1.0.5}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.96.0.10, selector: {app: web}, ports: [{port: 80}]}
";

/// Reads `key=value` from a log line (ANSI colour codes ignored).
fn field(line: &str, key: &str) -> Option<SocketAddr> {
    let plain: String = {
        let mut out = String::new();
        let mut chars = line.chars();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                out.push(c);
            }
        }
        out
    };
    let at = plain.find(&format!("{key}="))?;
    plain[at + key.len() + 1..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn start() -> ControlProcess {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config");
    std::fs::create_dir(&config).unwrap();
    std::fs::write(config.join("mesh.yaml"), MESH).unwrap();
    let tokens = dir.path().join("node-tokens");
    std::fs::write(&tokens, format!("{NODE_TOKEN} node-1\n")).unwrap();
    let data = dir.path().join("data");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ambit-control"))
        .args(["--config-dir", &config.display().to_string()])
        .args(["--data-dir", &data.display().to_string()])
        .args(["--node-tokens-file", &tokens.display().to_string()])
        .args(["--xds-plaintext-addr", "127.0.0.1:0"])
        .args(["--xds-tls-addr", "127.0.0.1:0"])
        .args(["--monitoring-addr", "127.0.0.1:0"])
        .args(["--tls-names", "localhost"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start ambit-control");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if !sent && line.contains("control plane serving") {
                let _ = tx.send(line.clone());
                sent = true;
            }
        }
    });
    let line = rx
        .recv_timeout(T)
        .expect("control plane did not start in time");
    ControlProcess {
        plain: field(&line, "xds_addr").expect("xds_addr in the log"),
        tls: field(&line, "xds_tls_addr").expect("xds_tls_addr in the log"),
        child,
        data,
        _dir: dir,
    }
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

async fn plain_channel(addr: SocketAddr) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A gRPC channel over TLS to `addr`, verifying the server against the
/// mesh root, with an optional client certificate.
async fn tls_channel(
    addr: SocketAddr,
    data: &Path,
    client: Option<(Vec<String>, String)>,
) -> Channel {
    let root = std::fs::read(data.join("ca/root-cert.pem")).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&root) {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut cfg = match client {
        None => builder.with_no_client_auth(),
        Some((chain, key)) => {
            let certs: Vec<CertificateDer<'static>> = chain
                .iter()
                .map(|p| CertificateDer::from_pem_slice(p.as_bytes()).unwrap())
                .collect();
            let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
            builder.with_client_auth_cert(certs, key).unwrap()
        }
    };
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .origin(format!("https://{addr}").parse().unwrap())
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let connector = connector.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let name = ServerName::try_from("localhost").unwrap();
                let tls = connector.connect(name, tcp).await?;
                Ok::<_, std::io::Error>(TokioIo::new(tls))
            }
        }))
        .await
        .unwrap()
}

fn ztunnel_request() -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: Some(Node {
            id: "ztunnel~10.0.0.1~ztunnel-x.ambit-system~ambit-system.svc.cluster.local".into(),
            ..Default::default()
        }),
        type_url: ambit_proto::ADDRESS_TYPE_URL.into(),
        ..Default::default()
    }
}

/// Opens one Delta stream; returns the first response or the refusal.
async fn first_response(
    channel: Channel,
    token: Option<&str>,
) -> Result<DeltaDiscoveryResponse, tonic::Status> {
    let mut client = AggregatedDiscoveryServiceClient::new(channel);
    let mut req = tonic::Request::new(
        futures::stream::iter([ztunnel_request()]).chain(futures::stream::pending()),
    );
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let mut stream = client.delta_aggregated_resources(req).await?.into_inner();
    match tokio::time::timeout(T, stream.next()).await {
        Ok(Some(r)) => r,
        Ok(None) => Err(tonic::Status::unknown("stream ended without a response")),
        Err(_) => Err(tonic::Status::deadline_exceeded("no response in time")),
    }
}

fn issue(data: &Path, namespace: &str, sa: &str) -> (Vec<String>, String) {
    let store = Arc::new(CaStore::load_or_create(&data.join("ca"), None).unwrap());
    let signer = Signer::new(store, SignerOptions::default());
    let id = SpiffeId::new("cluster.local", namespace, sa).to_string();
    let csr = generate_csr(&[&id], &[]).unwrap();
    let req = signer.parse_csr(&csr.csr_pem).unwrap();
    let chain = signer.issue(&req, Duration::from_secs(3600)).unwrap();
    (chain, csr.key_pem)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_mesh_state_without_credentials_on_either_port() {
    let cp = start();
    for (port, channel) in [
        ("15010", plain_channel(cp.plain).await),
        ("15012", tls_channel(cp.tls, &cp.data, None).await),
    ] {
        for token in [None, Some("wrong-token")] {
            let got = first_response(channel.clone(), token).await;
            let status = got.expect_err(&format!("{port} with {token:?} served resources"));
            assert_eq!(
                status.code(),
                Code::Unauthenticated,
                "{port} {token:?}: {status:?}"
            );
        }
        let ok = first_response(channel.clone(), Some(NODE_TOKEN))
            .await
            .unwrap();
        let names: Vec<&str> = ok.resources.iter().map(|r| r.name.as_str()).collect();
        assert!(
            names.contains(&"shop/web.shop.svc.cluster.local"),
            "{port}: {names:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_authenticate_and_identities_are_scoped() {
    let cp = start();
    // A node proxy's certificate may read the workload API ...
    let ztunnel = issue(&cp.data, "ambit-system", "ztunnel");
    let ch = tls_channel(cp.tls, &cp.data, Some(ztunnel)).await;
    let ok = first_response(ch, None).await.unwrap();
    assert!(!ok.resources.is_empty());
    // ... an application's may not.
    let web = issue(&cp.data, "shop", "web");
    let ch = tls_channel(cp.tls, &cp.data, Some(web)).await;
    let status = first_response(ch, None).await.unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_flood_from_one_client_is_bounded_in_memory() {
    let cp = start();
    let pid = cp.child.id();
    let channel = tls_channel(cp.tls, &cp.data, None).await;
    // Warm up (allocator, first connection) before measuring.
    let _ = first_response(channel.clone(), None).await;
    let before = rss_kib(pid);

    // 20,000 unauthenticated streams from one connection. A TLS
    // connection with no authenticated request is closed 10 s after its
    // handshake (tls_listener::AUTH_DEADLINE) and the channel reconnects:
    // streams then in flight end with the connection.
    let outcomes: Vec<Code> = futures::stream::iter(0..20_000)
        .map(|_| first_response(channel.clone(), None))
        .buffer_unordered(200)
        .map(|r| r.map_or_else(|s| s.code(), |_| Code::Ok))
        .collect()
        .await;
    let refused = outcomes
        .iter()
        .filter(|c| **c == Code::Unauthenticated)
        .count();
    let mut others: std::collections::BTreeMap<String, usize> = Default::default();
    for c in outcomes.iter().filter(|c| **c != Code::Unauthenticated) {
        *others.entry(format!("{c:?}")).or_default() += 1;
    }
    println!("unauthenticated flood: {refused} refused, others (connection closed) {others:?}");
    assert!(refused > 0, "no stream refused as unauthenticated");
    assert!(
        outcomes
            .iter()
            .all(|c| !matches!(c, Code::Ok | Code::DeadlineExceeded)),
        "every stream is refused or ends with its unauthenticated connection: {others:?}"
    );
    let after_flood = rss_kib(pid);
    let per_stream = (after_flood.saturating_sub(before) * 1024) / 20_000;
    println!(
        "unauthenticated flood: RSS {before} KiB -> {after_flood} KiB ({per_stream} bytes per refused stream)"
    );
    assert!(
        after_flood < before + 20 * 1024,
        "20,000 refused streams grew RSS from {before} to {after_flood} KiB"
    );

    // 1,000 authenticated streams held open at once, over 10 connections
    // (100 streams each, the per-connection limit).
    let mut held = Vec::new();
    for c in 0..10 {
        let ch = plain_channel(cp.plain).await;
        for _ in 0..100 {
            let mut client = AggregatedDiscoveryServiceClient::new(ch.clone());
            let mut req = tonic::Request::new(
                futures::stream::iter([ztunnel_request()]).chain(futures::stream::pending()),
            );
            req.metadata_mut().insert(
                "authorization",
                format!("Bearer {NODE_TOKEN}").parse().unwrap(),
            );
            let mut s = client
                .delta_aggregated_resources(req)
                .await
                .unwrap()
                .into_inner();
            let first = tokio::time::timeout(T, s.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            assert!(!first.resources.is_empty(), "connection {c}");
            held.push(s);
        }
    }
    let holding = rss_kib(pid);
    let per_stream = (holding.saturating_sub(after_flood) * 1024) / 1000;
    println!(
        "1,000 authenticated streams: RSS {after_flood} KiB -> {holding} KiB ({per_stream} bytes per stream)"
    );
    assert!(
        per_stream < 64 * 1024,
        "{per_stream} bytes per authenticated stream"
    );
    // A 101st stream on a full connection waits rather than being served
    // beside the others: the server holds at most 100 per connection.
    drop(held);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss_kib(pid);
    println!("after the streams closed: RSS {after} KiB");
}
