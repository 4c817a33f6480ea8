//! CA benchmark: signings per second and issuance latency with 500
//! concurrent requesters, each on its own gRPC connection, against the real
//! `CaService` (node-token authentication, pod-on-node authorization, CSR
//! verification, ECDSA P-256 signing) over loopback.
//!
//! Run: `cargo bench -p ambit-benches --bench ca`.
//! Sizes: `REQUESTERS` (500), `REQUESTS` per requester (20).
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ambit_control::ca::{
    CaMetrics, CaService, CaServiceOptions, CaStore, NodeTokenFile, StaticPodLocator, generate_csr,
    impersonation_metadata,
};
use ambit_proto::auth::IstioCertificateRequest;
use ambit_proto::auth::istio_certificate_service_client::IstioCertificateServiceClient;
use anyhow::Result;
use tokio_stream::wrappers::TcpListenerStream;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn main() -> Result<()> {
    let requesters = env_usize("REQUESTERS", 500);
    let per = env_usize("REQUESTS", 20);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let dir = tempfile::tempdir()?;
        let tokens = dir.path().join("node-tokens");
        std::fs::write(&tokens, "bench-token node-1\n")?;
        let ids: Vec<(String, String)> = (0..requesters)
            .map(|i| (format!("ns-{}", i % 20), format!("sa-{i}")))
            .collect();
        let locator = StaticPodLocator::new(
            ids.iter()
                .map(|(ns, sa)| (ns.as_str(), sa.as_str(), "node-1")),
        );
        let store = Arc::new(CaStore::load_or_create(&dir.path().join("ca"), None)?);
        let svc = CaService::new(
            store,
            CaServiceOptions::default(),
            Arc::new(NodeTokenFile::new(&tokens)),
            Arc::new(locator),
            CaMetrics::default(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc.into_server())
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );

        // Keys, CSRs and connections are the requesters' business: made
        // before the clock starts.
        let mut clients = Vec::with_capacity(requesters);
        for (ns, sa) in &ids {
            let spiffe = format!("spiffe://cluster.local/ns/{ns}/sa/{sa}");
            let csr = generate_csr(&[spiffe.as_str()], &[])?;
            let client = IstioCertificateServiceClient::connect(format!("http://{addr}")).await?;
            clients.push((client, spiffe, csr.csr_pem));
        }
        println!("{requesters} requesters x {per} requests, one connection each");

        let start = Instant::now();
        let tasks: Vec<_> = clients
            .into_iter()
            .map(|(mut client, spiffe, csr)| {
                tokio::spawn(async move {
                    let mut lat = Vec::with_capacity(per);
                    for _ in 0..per {
                        let mut req = tonic::Request::new(IstioCertificateRequest {
                            csr: csr.clone(),
                            validity_duration: 3600,
                            metadata: Some(impersonation_metadata(&spiffe)),
                        });
                        if let Ok(v) = "Bearer bench-token".parse() {
                            req.metadata_mut().insert("authorization", v);
                        }
                        let t = Instant::now();
                        let resp = client.create_certificate(req).await?;
                        lat.push(t.elapsed());
                        anyhow::ensure!(resp.get_ref().cert_chain.len() == 2, "bad chain");
                    }
                    Ok::<_, anyhow::Error>(lat)
                })
            })
            .collect();
        let mut all = Vec::with_capacity(requesters * per);
        for t in tasks {
            all.extend(t.await??);
        }
        let elapsed = start.elapsed();
        all.sort();
        let q = |p: f64| all[((all.len() as f64 * p) as usize).min(all.len() - 1)];
        println!(
            "signings: {} in {} = {:.0} signings/s",
            all.len(),
            ms(elapsed),
            all.len() as f64 / elapsed.as_secs_f64()
        );
        println!(
            "issuance latency (request sent -> chain received): p50 {}, p90 {}, p99 {}, max {}",
            ms(q(0.50)),
            ms(q(0.90)),
            ms(q(0.99)),
            ms(all[all.len() - 1])
        );
        Ok(())
    })
}
