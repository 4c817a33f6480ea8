//! ztunnel towards a control plane over real TLS on loopback (SPEC §2, the
//! 15012 endpoint): xDS and the CA behind a tokio-rustls acceptor whose
//! serving certificate (for IP 127.0.0.1) is signed by an in-test root.
//! A ztunnel trusting that root syncs and gets ready; one trusting another
//! root never connects; `https://` without `--root-cert` refuses to start.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use ambit_proto::auth::istio_certificate_service_server::{
    IstioCertificateService, IstioCertificateServiceServer,
};
use ambit_proto::auth::{IstioCertificateRequest, IstioCertificateResponse};
use ambit_ztunnel::control_channel::{ControlChannel, XDS_ADDRESS_FLAG};
use ambit_ztunnel::identity::{CaClient, GrpcCaClient, Identity};
use ambit_ztunnel::metrics::TerminationReason;
use ambit_ztunnel::{Config, Ztunnel};
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
use rustls_pki_types::{CertificateDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::Stream;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::server::Connected;
use tonic::{Request, Response, Status, Streaming};

const T: Duration = Duration::from_secs(10);
const TOKEN: &str = "node-token";

// ---- certificates ----

/// A self-signed root CA: its PEM and an issuer to sign with.
struct Root {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

fn root(name: &str) -> Root {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let pem = params.self_signed(&key).unwrap().pem();
    Root {
        pem,
        issuer: Issuer::new(params, key),
    }
}

/// A serving certificate for IP 127.0.0.1 signed by `root`, as rustls wants it.
fn server_tls(root: &Root) -> Arc<rustls::ServerConfig> {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.subject_alt_names = vec![SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST))];
    let cert = params.signed_by(&key, &root.issuer).unwrap();
    let chain = vec![CertificateDer::from(cert.der().to_vec())];
    let key = PrivatePkcs8KeyDer::from(key.serialize_der()).into();
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(config)
}

fn write(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

// ---- the TLS control plane stub ----

/// A server-side TLS connection as tonic wants it.
struct TlsConn(TlsStream<TcpStream>);

impl Connected for TlsConn {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

impl AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// What the stub saw: `authorization` of each xDS stream and CA request,
/// and the ALPN protocol of each accepted TLS connection.
#[derive(Clone, Default)]
struct Seen {
    xds_auth: Arc<Mutex<Vec<Option<String>>>>,
    ca_auth: Arc<Mutex<Vec<Option<String>>>>,
    alpn: Arc<Mutex<Vec<Option<Vec<u8>>>>>,
}

fn auth<T>(r: &Request<T>) -> Option<String> {
    r.metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// Answers each initial subscription with an empty (complete) response,
/// which is a sync point for its type.
#[derive(Clone)]
struct Ads {
    seen: Seen,
}

type SotwStream = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = SotwStream;
    type DeltaAggregatedResourcesStream =
        UnboundedReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        _request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<SotwStream>, Status> {
        Err(Status::unimplemented("the test server only speaks Delta"))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        self.seen.xds_auth.lock().unwrap().push(auth(&request));
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut nonce = 0;
            while let Ok(Some(req)) = inbound.message().await {
                if !req.response_nonce.is_empty() {
                    continue; // an ACK
                }
                nonce += 1;
                let resp = DeltaDiscoveryResponse {
                    type_url: req.type_url,
                    system_version_info: "v1".into(),
                    nonce: nonce.to_string(),
                    ..Default::default()
                };
                if tx.send(Ok(resp)).is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }
}

/// Signs nothing: answers every request with a fixed chain.
struct Ca {
    seen: Seen,
}

#[tonic::async_trait]
impl IstioCertificateService for Ca {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        self.seen.ca_auth.lock().unwrap().push(auth(&request));
        Ok(Response::new(IstioCertificateResponse {
            cert_chain: vec!["leaf".into(), "root".into()],
        }))
    }
}

/// Serves xDS and the CA over TLS with `tls` on a loopback port.
async fn serve_tls(tls: Arc<rustls::ServerConfig>, seen: Seen) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = TlsAcceptor::from(tls);
    let (tx, rx) = mpsc::unbounded_channel::<Result<TlsConn, std::io::Error>>();
    let alpn = seen.alpn.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            let alpn = alpn.clone();
            tokio::spawn(async move {
                // A failed handshake (the client refused our certificate)
                // is simply dropped, as a real server would.
                if let Ok(Ok(conn)) = tokio::time::timeout(T, acceptor.accept(tcp)).await {
                    let proto = conn.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
                    alpn.lock().unwrap().push(proto);
                    let _ = tx.send(Ok(TlsConn(conn)));
                }
            });
        }
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AggregatedDiscoveryServiceServer::new(Ads {
                seen: seen.clone(),
            }))
            .add_service(IstioCertificateServiceServer::new(Ca { seen }))
            .serve_with_incoming(UnboundedReceiverStream::new(rx)),
    );
    addr
}

// ---- helpers ----

async fn within<F: Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(T, f)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    within(what, async {
        while !f() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

/// The whole source chain of an error, for matching on inner causes.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(" / ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

fn metric_line(zt: &Ztunnel, name: &str) -> String {
    let text = zt.metrics().encode().unwrap();
    text.lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .to_string()
}

// ---- tests ----

#[tokio::test]
async fn xds_and_ca_over_tls_with_the_right_root() {
    let mesh_root = root("mesh root");
    let seen = Seen::default();
    let addr = serve_tls(server_tls(&mesh_root), seen.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let root_path = write(dir.path(), "root.pem", &mesh_root.pem);
    let token = write(dir.path(), "token", &format!("{TOKEN}\n"));

    let mut config = Config::new("node-tls", format!("https://{addr}")).with_ephemeral_ports();
    config.root_cert = Some(root_path.clone());
    config.token_file = Some(token.clone());
    let zt = ambit_ztunnel::start(config).await.unwrap();
    within("ztunnel ready over TLS", zt.wait_ready()).await;
    assert_eq!(
        metric_line(&zt, "ztunnel_xds_connected"),
        "ztunnel_xds_connected 1"
    );
    assert_eq!(
        zt.metrics()
            .xds
            .terminations(TerminationReason::ConnectionError),
        0
    );
    assert_eq!(
        seen.xds_auth.lock().unwrap().as_slice(),
        &[Some(format!("Bearer {TOKEN}"))]
    );
    assert!(
        seen.alpn
            .lock()
            .unwrap()
            .iter()
            .all(|p| p.as_deref() == Some(b"h2".as_slice())),
        "ALPN h2 negotiated on every connection"
    );

    // The CA client over the same TLS endpoint, token included.
    let ca =
        GrpcCaClient::with_root_cert(&format!("https://{addr}"), Some(token), Some(&root_path))
            .unwrap();
    let who: Identity = "spiffe://cluster.local/ns/default/sa/web".parse().unwrap();
    let chain_pem = within(
        "CA answer over TLS",
        ca.sign(&who, "csr".into(), Duration::from_secs(3600)),
    )
    .await
    .unwrap();
    assert_eq!(chain_pem, vec!["leaf".to_string(), "root".to_string()]);
    assert_eq!(
        seen.ca_auth.lock().unwrap().as_slice(),
        &[Some(format!("Bearer {TOKEN}"))]
    );
    within("shutdown", zt.shutdown()).await;
}

#[tokio::test]
async fn a_foreign_root_never_connects_until_the_root_file_is_fixed() {
    let mesh_root = root("mesh root");
    let other_root = root("someone else's root");
    let seen = Seen::default();
    let addr = serve_tls(server_tls(&mesh_root), seen.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let root_path = write(dir.path(), "other.pem", &other_root.pem);

    let mut config = Config::new("node-foreign", format!("https://{addr}")).with_ephemeral_ports();
    config.root_cert = Some(root_path.clone());
    let zt = ambit_ztunnel::start(config).await.unwrap();
    eventually("two connection errors", || {
        zt.metrics()
            .xds
            .terminations(TerminationReason::ConnectionError)
            >= 2
    })
    .await;
    assert!(!zt.is_ready());
    assert_eq!(
        metric_line(&zt, "ztunnel_xds_connected"),
        "ztunnel_xds_connected 0"
    );
    assert!(
        seen.xds_auth.lock().unwrap().is_empty(),
        "no stream got through"
    );
    assert!(
        seen.alpn.lock().unwrap().is_empty(),
        "no handshake completed"
    );

    // The connection error says what failed and what to check.
    let channel = ControlChannel::new(
        &format!("https://{addr}"),
        Some(&root_path),
        XDS_ADDRESS_FLAG,
    )
    .unwrap()
    .map_endpoint(|e| e.connect_timeout(T));
    let err = within("connect", channel.connect()).await.unwrap_err();
    let msg = chain(&err);
    assert!(msg.contains("TLS handshake"), "{msg}");
    assert!(msg.contains("UnknownIssuer"), "{msg}");
    assert!(msg.contains("--root-cert"), "{msg}");

    // The CA client refuses the server the same way.
    let ca =
        GrpcCaClient::with_root_cert(&format!("https://{addr}"), None, Some(&root_path)).unwrap();
    let who: Identity = "spiffe://cluster.local/ns/default/sa/web".parse().unwrap();
    let err = within(
        "CA refusal",
        ca.sign(&who, "csr".into(), Duration::from_secs(60)),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("Unavailable"), "{err}");
    assert!(err.to_string().contains("TLS handshake"), "{err}");
    assert!(seen.ca_auth.lock().unwrap().is_empty());

    // The root file is re-read at every connection attempt: once it holds
    // the right root, the next reconnect succeeds.
    write(dir.path(), "other.pem", &mesh_root.pem);
    within("ready after the root file is fixed", zt.wait_ready()).await;
    assert_eq!(
        metric_line(&zt, "ztunnel_xds_connected"),
        "ztunnel_xds_connected 1"
    );
    within("shutdown", zt.shutdown()).await;
}

#[tokio::test]
async fn the_certificate_must_cover_the_url_host() {
    let mesh_root = root("mesh root");
    let addr = serve_tls(server_tls(&mesh_root), Seen::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let root_path = write(dir.path(), "root.pem", &mesh_root.pem);
    // The certificate names IP 127.0.0.1, not "localhost".
    let channel = ControlChannel::new(
        &format!("https://localhost:{}", addr.port()),
        Some(&root_path),
        XDS_ADDRESS_FLAG,
    )
    .unwrap()
    .map_endpoint(|e| e.connect_timeout(T));
    let err = within("connect", channel.connect()).await.unwrap_err();
    let msg = chain(&err);
    assert!(msg.contains("server name localhost"), "{msg}");
    assert!(msg.contains("not valid for name"), "{msg}");
}

#[tokio::test]
async fn https_without_root_cert_does_not_start() {
    let config = Config::new("node-noroot", "https://127.0.0.1:15012").with_ephemeral_ports();
    let err = ambit_ztunnel::start(config).await.unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("--root-cert"), "{msg}");

    // Same for an https CA address next to a plaintext xDS address.
    let mut config = Config::new("node-noroot-ca", "http://127.0.0.1:15010").with_ephemeral_ports();
    config.ca_address = Some("https://127.0.0.1:15012".into());
    let msg = ambit_ztunnel::start(config).await.unwrap_err().to_string();
    assert!(
        msg.contains("--root-cert") && msg.contains("--ca-address"),
        "{msg}"
    );

    // And for an https xDS address next to a plaintext CA address.
    let mut config =
        Config::new("node-noroot-xds", "https://127.0.0.1:15012").with_ephemeral_ports();
    config.ca_address = Some("http://127.0.0.1:15010".into());
    let msg = ambit_ztunnel::start(config).await.unwrap_err().to_string();
    assert!(
        msg.contains("--root-cert") && msg.contains("--xds-address"),
        "{msg}"
    );

    // And an empty root file is refused at startup, naming the flag.
    let dir = tempfile::tempdir().unwrap();
    let mut config =
        Config::new("node-empty-root", "https://127.0.0.1:15012").with_ephemeral_ports();
    config.root_cert = Some(write(dir.path(), "empty.pem", ""));
    let msg = ambit_ztunnel::start(config).await.unwrap_err().to_string();
    assert!(msg.contains("--root-cert"), "{msg}");
}
