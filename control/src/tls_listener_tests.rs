//! The TLS listener's bounds on unauthenticated connections: a client that
//! finishes the TLS handshake and then sends nothing (or nothing that
//! authenticates) is closed at its deadline and frees its place; one whose
//! request authenticated stays and frees its place at once. Found by the
//! load bench (`benches/benches/load/xds_idle.rs`): before, a finished
//! handshake left the per-source count, so one address could hold any
//! number of silent TLS connections, ~24 KiB of control-plane memory each.

use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::{DigitallySignedStruct, SignatureScheme};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;
use tokio_stream::StreamExt;
use tonic::transport::server::Connected;

use super::*;

const LIMIT: Duration = Duration::from_secs(5);

/// Accepts any server certificate: these tests are about the listener.
#[derive(Debug)]
struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }
    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn configs() -> (Arc<rustls::ServerConfig>, TlsConnector) {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let server = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
    let client = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(provider())))
        .with_no_client_auth();
    (Arc::new(server), TlsConnector::from(Arc::new(client)))
}

/// The listener with `limits`; each finished connection is served by a
/// task that reads like the gRPC server does, marks the connection
/// authenticated when it reads `auth`, and echoes.
async fn serve(limits: Limits) -> (SocketAddr, watch::Sender<bool>) {
    let (server, _) = configs();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = watch::channel(false);
    let mut conns = incoming_with(listener, server, stopped, limits);
    tokio::spawn(async move {
        while let Some(Ok(mut conn)) = conns.next().await {
            tokio::spawn(async move {
                let auth = conn.connect_info().auth;
                let mut buf = [0u8; 64];
                while let Ok(n) = conn.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if &buf[..n] == b"auth" {
                        auth.mark();
                    }
                    if conn.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                // Its place is free before the client sees the close.
                drop(auth);
                drop(conn);
            });
        }
    });
    (addr, stop)
}

async fn tls(addr: SocketAddr) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let (_, connector) = configs();
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").unwrap();
    tokio::time::timeout(LIMIT, connector.connect(name, tcp))
        .await
        .map_err(|_| std::io::Error::other("handshake timed out"))?
}

/// Whether the server closed `s` (EOF or error) within `within`.
async fn closed_within(
    s: &mut tokio_rustls::client::TlsStream<TcpStream>,
    within: Duration,
) -> bool {
    let mut b = [0u8; 16];
    matches!(
        tokio::time::timeout(within, s.read(&mut b)).await,
        Ok(Ok(0) | Err(_))
    )
}

fn limits() -> Limits {
    Limits {
        handshake_timeout: Duration::from_secs(2),
        auth_deadline: Duration::from_millis(300),
        per_source: 1,
        total: 16,
    }
}

#[tokio::test]
async fn a_silent_tls_connection_is_closed_at_its_deadline_and_frees_its_place() {
    let (addr, _stop) = serve(limits()).await;
    let mut silent = tls(addr).await.expect("first connection");
    // Its handshake finished, but it still holds the source's one place.
    let mut second = tls(addr).await;
    if let Ok(s) = second.as_mut() {
        assert!(
            closed_within(s, LIMIT).await,
            "a second unauthenticated connection from the source must be refused"
        );
    }
    assert!(
        closed_within(&mut silent, LIMIT).await,
        "a connection with no authenticated request must be closed at its deadline"
    );
    // Its place is free again.
    let mut third = tls(addr).await.expect("a connection after the deadline");
    third.write_all(b"auth").await.unwrap();
    let mut b = [0u8; 4];
    tokio::time::timeout(LIMIT, third.read_exact(&mut b))
        .await
        .expect("echo in time")
        .expect("echo");
    assert_eq!(&b, b"auth");
}

#[tokio::test]
async fn an_authenticated_connection_stays_and_frees_its_place() {
    let (addr, _stop) = serve(limits()).await;
    let mut first = tls(addr).await.expect("first connection");
    first.write_all(b"auth").await.unwrap();
    let mut b = [0u8; 4];
    tokio::time::timeout(LIMIT, first.read_exact(&mut b))
        .await
        .expect("echo in time")
        .expect("echo");
    // Past the deadline it is still served.
    tokio::time::sleep(Duration::from_millis(600)).await;
    first.write_all(b"ping").await.unwrap();
    tokio::time::timeout(LIMIT, first.read_exact(&mut b))
        .await
        .expect("still served after the deadline")
        .expect("echo");
    assert_eq!(&b, b"ping");
    // And the source's place is free for another connection.
    let mut second = tls(addr).await.expect("second connection");
    second.write_all(b"auth").await.unwrap();
    tokio::time::timeout(LIMIT, second.read_exact(&mut b))
        .await
        .expect("echo in time")
        .expect("echo");
}

/// A TLS connection from `source` (a loopback address).
async fn tls_from(
    source: [u8; 4],
    addr: SocketAddr,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let (_, connector) = configs();
    let sock = tokio::net::TcpSocket::new_v4()?;
    sock.bind(SocketAddr::from((source, 0)))?;
    let tcp = sock.connect(addr).await?;
    let name = ServerName::try_from("localhost").unwrap();
    tokio::time::timeout(LIMIT, connector.connect(name, tcp))
        .await
        .map_err(|_| std::io::Error::other("handshake timed out"))?
}

#[tokio::test]
async fn when_full_a_quieter_source_evicts_the_busiest_sources_oldest() {
    let (addr, _stop) = serve(Limits {
        handshake_timeout: Duration::from_secs(5),
        auth_deadline: Duration::from_secs(5),
        per_source: 8,
        total: 2,
    })
    .await;
    // A flood from 127.0.0.2 fills the listener.
    let mut oldest = tls_from([127, 0, 0, 2], addr).await.expect("flood 1");
    let mut newer = tls_from([127, 0, 0, 2], addr).await.expect("flood 2");
    // Another connection from the flooding source is refused...
    if let Ok(mut s) = tls_from([127, 0, 0, 2], addr).await {
        assert!(
            closed_within(&mut s, LIMIT).await,
            "a third from the full source"
        );
    }
    // ...but one from a source holding none gets in, in place of the
    // flood's oldest, long before any deadline.
    let mut proxy = tls_from([127, 0, 0, 1], addr)
        .await
        .expect("a quieter source is admitted");
    assert!(
        closed_within(&mut oldest, Duration::from_secs(2)).await,
        "the busiest source's oldest connection is evicted"
    );
    proxy.write_all(b"auth").await.unwrap();
    let mut b = [0u8; 4];
    tokio::time::timeout(LIMIT, proxy.read_exact(&mut b))
        .await
        .expect("echo in time")
        .expect("echo");
    // The flood's newer connection is still there (not past its deadline).
    newer.write_all(b"ping").await.unwrap();
    tokio::time::timeout(LIMIT, newer.read_exact(&mut b))
        .await
        .expect("the newer flood connection still served")
        .expect("echo");
    assert_eq!(&b, b"ping");
}
