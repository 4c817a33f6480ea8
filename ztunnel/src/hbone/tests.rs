#![allow(clippy::unwrap_used, clippy::expect_used)]

//! HBONE end to end over real TLS on 127.0.0.1, with certificates from an
//! in-test CA.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use hyper::http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::timeout;

use super::*;
use crate::copy::{CopyConfig, copy_bidirectional};
use crate::identity::{Identity, TrustBundle, WorkloadCertificate};
use crate::test_support::{TestCa, echo_server, id, roundtrip};

const WAIT: Duration = Duration::from_secs(30);

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 31 + seed as usize) % 251) as u8)
        .collect()
}

/// An HBONE server on 127.0.0.1 standing in for a pod's :15008. It allows
/// CONNECT only to `allowed` (403 otherwise), reports every accepted
/// request and every connection's outcome, and connects accepted streams
/// to their authority with the copy loop.
struct TestServer {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    requests: mpsc::UnboundedReceiver<ConnectRequest>,
    outcomes: mpsc::UnboundedReceiver<Result<(), ServerError>>,
    task: JoinHandle<()>,
}

async fn start_server(
    cert: &WorkloadCertificate,
    bundle: &TrustBundle,
    allowed: SocketAddr,
) -> TestServer {
    let server = HboneServer::new(Arc::new(server_config(cert, bundle).unwrap()))
        .with_handshake_timeout(Duration::from_secs(5));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let (req_tx, requests) = mpsc::unbounded_channel();
    let (out_tx, outcomes) = mpsc::unbounded_channel();
    let count = connections.clone();
    let task = tokio::spawn(async move {
        // Dropping the set (when the task is aborted) closes every connection.
        let mut conns = JoinSet::new();
        loop {
            let Ok((tcp, _)) = l.accept().await else {
                return;
            };
            count.fetch_add(1, Ordering::SeqCst);
            let server = server.clone();
            let req_tx = req_tx.clone();
            let out_tx = out_tx.clone();
            conns.spawn(async move {
                let outcome = server
                    .serve(
                        tcp,
                        |req| {
                            if req.authority == allowed {
                                Ok(())
                            } else {
                                Err(StatusCode::FORBIDDEN)
                            }
                        },
                        |req, pending: PendingConnect| {
                            let _ = req_tx.send(req.clone());
                            async move {
                                // Connect first, then answer: 503 when nobody listens.
                                let Ok(app) = TcpStream::connect(req.authority).await else {
                                    pending.refuse(StatusCode::SERVICE_UNAVAILABLE);
                                    return;
                                };
                                let Ok(stream) = pending.accept() else { return };
                                let _ =
                                    copy_bidirectional(stream, app, &CopyConfig::default()).await;
                            }
                        },
                    )
                    .await;
                let _ = out_tx.send(outcome);
            });
        }
    });
    TestServer {
        addr,
        connections,
        requests,
        outcomes,
        task,
    }
}

async fn client(
    cert: &WorkloadCertificate,
    bundle: &TrustBundle,
    expect: Identity,
    to: SocketAddr,
) -> Result<HboneConnection, ClientError> {
    let config = Arc::new(client_config(cert, bundle, expect).unwrap());
    let tcp = TcpStream::connect(to).await.unwrap();
    timeout(WAIT, HboneClient::connect(tcp, config))
        .await
        .unwrap()
}

struct Mesh {
    ca: TestCa,
    client_id: Identity,
    server_id: Identity,
    echo: SocketAddr,
    server: TestServer,
}

async fn mesh() -> Mesh {
    let ca = TestCa::new("mesh");
    let server_id = id("server");
    let echo = echo_server().await;
    let server = start_server(&ca.issue(&server_id), &ca.bundle(), echo).await;
    Mesh {
        client_id: id("client"),
        server_id,
        echo,
        server,
        ca,
    }
}

impl Mesh {
    async fn connect(&self) -> HboneConnection {
        client(
            &self.ca.issue(&self.client_id),
            &self.ca.bundle(),
            self.server_id.clone(),
            self.server.addr,
        )
        .await
        .unwrap()
    }
}

#[tokio::test]
async fn echo_16mib_through_connect_with_the_copy_loop() {
    let m = mesh().await;
    let conn = m.connect().await;
    assert_eq!(conn.peer_identity(), &m.server_id);

    // The outbound side as the data plane will run it: an app socket copied
    // into a CONNECT stream.
    let outbound = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let outbound_addr = outbound.local_addr().unwrap();
    let echo = m.echo;
    let proxy = tokio::spawn(async move {
        let (app, _) = outbound.accept().await.unwrap();
        let stream = conn.connect_stream(echo, HeaderMap::new()).await.unwrap();
        copy_bidirectional(app, stream, &CopyConfig::default()).await
    });

    const LEN: usize = 16 * 1024 * 1024;
    let data = pattern(LEN, 7);
    let app = TcpStream::connect(outbound_addr).await.unwrap();
    // Half-closes after writing: the rest of the echo must still arrive.
    let got = roundtrip(app, data.clone()).await;
    assert_eq!(got.len(), LEN);
    assert!(got == data, "payload corrupted in the tunnel");
    let counts = timeout(WAIT, proxy).await.unwrap().unwrap().unwrap();
    assert_eq!(counts, (LEN as u64, LEN as u64));
}

#[tokio::test]
async fn ten_concurrent_streams_share_one_connection() {
    let m = mesh().await;
    let conn = m.connect().await;
    let mut streams = JoinSet::new();
    for i in 0..10u8 {
        let conn = conn.clone();
        let echo = m.echo;
        streams.spawn(async move {
            let stream = conn.connect_stream(echo, HeaderMap::new()).await.unwrap();
            let data = pattern(1024 * 1024 + usize::from(i), i);
            let got = roundtrip(stream, data.clone()).await;
            assert!(got == data, "stream {i} corrupted");
        });
    }
    while let Some(r) = timeout(WAIT, streams.join_next()).await.unwrap() {
        r.unwrap();
    }
    assert_eq!(m.server.connections.load(Ordering::SeqCst), 1);
    assert!(conn.is_usable());
}

#[tokio::test]
async fn server_sees_client_identity_and_trace_headers() {
    let mut m = mesh().await;
    let conn = m.connect().await;
    let mut headers = HeaderMap::new();
    headers.insert(
        "baggage",
        HeaderValue::from_static("k8s.namespace.name=default"),
    );
    headers.insert(
        "traceparent",
        HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    );
    headers.insert("forwarded", HeaderValue::from_static("for=127.0.0.1"));
    let stream = conn.connect_stream(m.echo, headers).await.unwrap();
    let req = timeout(WAIT, m.server.requests.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(req.peer_identity, m.client_id);
    assert_eq!(req.authority, m.echo);
    assert_eq!(req.headers["baggage"], "k8s.namespace.name=default");
    assert_eq!(
        req.headers["traceparent"],
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    );
    assert_eq!(req.headers["forwarded"], "for=127.0.0.1");
    assert_eq!(roundtrip(stream, b"ping".to_vec()).await, b"ping");
}

#[tokio::test]
async fn authorization_refusal_is_surfaced_as_403_and_the_connection_stays_usable() {
    let m = mesh().await;
    let conn = m.connect().await;
    // Not the address the server owns: never an open proxy.
    let elsewhere: SocketAddr = "127.0.0.1:9".parse().unwrap();
    let err = conn
        .connect_stream(elsewhere, HeaderMap::new())
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(StatusCode::FORBIDDEN), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("403") && msg.contains("127.0.0.1:9"), "{msg}");
    // A refused stream does not spoil the connection.
    assert!(conn.is_usable());
    let stream = conn.connect_stream(m.echo, HeaderMap::new()).await.unwrap();
    assert_eq!(roundtrip(stream, b"ok".to_vec()).await, b"ok");
}

#[tokio::test]
async fn peer_with_another_identity_is_refused_by_the_client() {
    let ca = TestCa::new("mesh");
    let echo = echo_server().await;
    // A valid certificate, but for the wrong workload.
    let server = start_server(&ca.issue(&id("imposter")), &ca.bundle(), echo).await;
    let err = client(
        &ca.issue(&id("client")),
        &ca.bundle(),
        id("server"),
        server.addr,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ClientError::PeerIdentity { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("spiffe://cluster.local/ns/default/sa/server")
            && msg.contains("spiffe://cluster.local/ns/default/sa/imposter"),
        "{msg}"
    );
}

#[tokio::test]
async fn client_certificate_from_a_foreign_ca_is_refused_by_the_server() {
    let mut m = mesh().await;
    let foreign = TestCa::new("foreign");
    // The client trusts the mesh root (so it accepts the server) but
    // presents a certificate the server cannot chain.
    let result = client(
        &foreign.issue(&m.client_id),
        &m.ca.bundle(),
        m.server_id.clone(),
        m.server.addr,
    )
    .await;
    // TLS 1.3: the client may finish its handshake before the server
    // verifies it; then the first stream fails instead.
    if let Ok(conn) = result {
        assert!(conn.connect_stream(m.echo, HeaderMap::new()).await.is_err());
    }
    let outcome = timeout(WAIT, m.server.outcomes.recv())
        .await
        .unwrap()
        .unwrap();
    let err = outcome.unwrap_err();
    assert!(matches!(err, ServerError::Tls { .. }), "{err:?}");
    assert!(err.to_string().contains("certificate"), "{err}");
    assert!(m.server.requests.try_recv().is_err(), "no request may pass");
}

/// Raw h2 over mTLS, to send what our client never would.
async fn raw_h2(m: &Mesh) -> h2::client::SendRequest<Bytes> {
    let config = Arc::new(
        client_config(
            &m.ca.issue(&m.client_id),
            &m.ca.bundle(),
            m.server_id.clone(),
        )
        .unwrap(),
    );
    let tcp = TcpStream::connect(m.server.addr).await.unwrap();
    let name = rustls::pki_types::ServerName::IpAddress(m.server.addr.ip().into());
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .unwrap();
    let (send, conn) = h2::client::handshake(tls).await.unwrap();
    tokio::spawn(conn);
    send
}

async fn status_of(send: &h2::client::SendRequest<Bytes>, req: Request<()>) -> StatusCode {
    let mut send = send.clone().ready().await.unwrap();
    let (resp, _) = send.send_request(req, true).unwrap();
    timeout(WAIT, resp).await.unwrap().unwrap().status()
}

#[tokio::test]
async fn non_connect_is_405_and_a_bad_authority_is_400() {
    let m = mesh().await;
    let send = raw_h2(&m).await;
    let get = Request::builder()
        .method(Method::GET)
        .uri(format!("https://{}/", m.echo))
        .body(())
        .unwrap();
    assert_eq!(status_of(&send, get).await, StatusCode::METHOD_NOT_ALLOWED);
    let by_name = Request::builder()
        .method(Method::CONNECT)
        .uri("example.com:80")
        .body(())
        .unwrap();
    assert_eq!(status_of(&send, by_name).await, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn half_close_through_the_tunnel() {
    // The app answers only after the client's EOF.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let app_addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut req = Vec::new();
        s.read_to_end(&mut req).await.unwrap();
        s.write_all(&pattern(2 * 1024 * 1024, 3)).await.unwrap();
        s.write_all(&req).await.unwrap();
        s.shutdown().await.unwrap();
    });
    let ca = TestCa::new("mesh");
    let server = start_server(&ca.issue(&id("server")), &ca.bundle(), app_addr).await;
    let conn = client(
        &ca.issue(&id("client")),
        &ca.bundle(),
        id("server"),
        server.addr,
    )
    .await
    .unwrap();
    let stream = conn
        .connect_stream(app_addr, HeaderMap::new())
        .await
        .unwrap();
    let got = roundtrip(stream, b"question".to_vec()).await;
    let mut want = pattern(2 * 1024 * 1024, 3);
    want.extend_from_slice(b"question");
    assert!(got == want);
}

#[tokio::test]
async fn connection_is_unusable_once_the_server_is_gone() {
    let m = mesh().await;
    let conn = m.connect().await;
    assert!(conn.is_usable());
    m.server.task.abort();
    timeout(WAIT, async {
        while conn.is_usable() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the connection should be seen as closed");
    assert!(conn.connect_stream(m.echo, HeaderMap::new()).await.is_err());
}
