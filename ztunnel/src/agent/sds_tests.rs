//! SDS over a real unix socket with a tonic client: SotW and Delta, pushes
//! on change, ACK/NACK, the socket's lifecycle.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{Secret, secret};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use hyper_util::rt::TokioIo;
use prost::Message;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use super::*;
use crate::agent::secrets::ROOT_SECRET;
use crate::test_support::{TestCa, id};

const LIMIT: Duration = Duration::from_secs(5);

struct Bed {
    _dir: tempfile::TempDir,
    path: PathBuf,
    tx: watch::Sender<Arc<SecretSet>>,
    server: SdsServer,
    ca: TestCa,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn bed() -> Bed {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sds.sock");
    let ca = TestCa::new("sds");
    let cert = ca.issue(&id("wp"));
    let (tx, rx) = watch::channel(Arc::new(SecretSet::build(Some(&cert), &ca.bundle())));
    let server = SdsServer::new(rx, SdsMetrics::default());
    let listener = bind(&path).await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.clone().serve(listener, async {
        let _ = stopped.await;
    }));
    Bed {
        _dir: dir,
        path,
        tx,
        server,
        ca,
        _stop: stop,
    }
}

async fn client(path: &Path) -> SecretDiscoveryServiceClient<Channel> {
    let path = path.to_path_buf();
    let channel = Endpoint::from_static("http://sds.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                tokio::net::UnixStream::connect(path)
                    .await
                    .map(TokioIo::new)
            }
        }))
        .await
        .unwrap();
    SecretDiscoveryServiceClient::new(channel)
}

fn decode(any: &envoy_types::pb::google::protobuf::Any) -> Secret {
    assert_eq!(any.type_url, SECRET_TYPE_URL);
    Secret::decode(any.value.as_slice()).unwrap()
}

fn request(names: &[&str], version: &str, nonce: &str, nack: bool) -> DiscoveryRequest {
    DiscoveryRequest {
        type_url: SECRET_TYPE_URL.into(),
        resource_names: names.iter().map(|s| s.to_string()).collect(),
        version_info: version.into(),
        response_nonce: nonce.into(),
        error_detail: nack.then(|| RpcStatus {
            code: 3,
            message: "bad secret".into(),
            details: vec![],
        }),
        ..Default::default()
    }
}

#[tokio::test]
async fn sotw_serves_pushes_and_tracks_acks() {
    let b = bed().await;
    let mut c = client(&b.path).await;
    let (req_tx, req_rx) = mpsc::channel(8);
    req_tx
        .send(request(&[DEFAULT_SECRET, ROOT_SECRET], "", "", false))
        .await
        .unwrap();
    let mut responses = c
        .stream_secrets(ReceiverStream::new(req_rx))
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(LIMIT, responses.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.resources.len(), 2);
    let names: Vec<String> = first.resources.iter().map(|r| decode(r).name).collect();
    assert_eq!(names, ["ROOTCA", "default"]);
    let default = decode(&first.resources[1]);
    let Some(secret::Type::TlsCertificate(tls)) = default.r#type else {
        panic!("default is not a TLS certificate");
    };
    let Some(Specifier::InlineBytes(chain)) = tls.certificate_chain.unwrap().specifier else {
        panic!("chain not inline");
    };
    let chain = String::from_utf8(chain).unwrap();
    assert_eq!(
        chain.matches("BEGIN CERTIFICATE").count(),
        1,
        "leaf only, no root"
    );
    let Some(Specifier::InlineBytes(key)) = tls.private_key.unwrap().specifier else {
        panic!("key not inline");
    };
    assert!(
        String::from_utf8(key)
            .unwrap()
            .starts_with("-----BEGIN PRIVATE KEY-----\n")
    );

    // Not ACKed yet; ACK the response.
    let mut acked = b.server.acked_default();
    assert!(acked.borrow().is_none());
    req_tx
        .send(request(
            &[DEFAULT_SECRET, ROOT_SECRET],
            &first.version_info,
            &first.nonce,
            false,
        ))
        .await
        .unwrap();
    tokio::time::timeout(LIMIT, acked.wait_for(|a| a.is_some()))
        .await
        .unwrap()
        .unwrap();

    // A renewal is pushed with a new version and nonce.
    let renewed = b.ca.issue(&id("wp"));
    b.tx.send(Arc::new(SecretSet::build(Some(&renewed), &b.ca.bundle())))
        .unwrap();
    let second = tokio::time::timeout(LIMIT, responses.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_ne!(second.version_info, first.version_info);
    assert_ne!(second.nonce, first.nonce);

    // A NACK is counted and not answered with a resend.
    req_tx
        .send(request(
            &[DEFAULT_SECRET, ROOT_SECRET],
            &first.version_info,
            &second.nonce,
            true,
        ))
        .await
        .unwrap();
    let metrics = b.server.metrics.clone();
    tokio::time::timeout(LIMIT, async {
        while metrics.nacks.get() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(200), responses.message())
            .await
            .is_err(),
        "no response to a NACK"
    );
    assert_eq!(metrics.pushes.get(), 2);
    assert_eq!(metrics.streams.get(), 1);
}

#[tokio::test]
async fn sotw_waits_for_a_secret_that_does_not_exist_yet() {
    let b = bed().await;
    b.tx.send(Arc::new(SecretSet::build(None, &b.ca.bundle())))
        .unwrap();
    let mut c = client(&b.path).await;
    let (req_tx, req_rx) = mpsc::channel(8);
    req_tx
        .send(request(&[DEFAULT_SECRET], "", "", false))
        .await
        .unwrap();
    let mut responses = c
        .stream_secrets(ReceiverStream::new(req_rx))
        .await
        .unwrap()
        .into_inner();
    assert!(
        tokio::time::timeout(Duration::from_millis(200), responses.message())
            .await
            .is_err(),
        "nothing to send before the certificate exists"
    );
    let cert = b.ca.issue(&id("wp"));
    b.tx.send(Arc::new(SecretSet::build(Some(&cert), &b.ca.bundle())))
        .unwrap();
    let r = tokio::time::timeout(LIMIT, responses.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(r.resources.len(), 1);
    assert_eq!(decode(&r.resources[0]).name, DEFAULT_SECRET);
}

#[tokio::test]
async fn delta_sends_only_changes() {
    let b = bed().await;
    let mut c = client(&b.path).await;
    let (req_tx, req_rx) = mpsc::channel(8);
    req_tx
        .send(DeltaDiscoveryRequest {
            type_url: SECRET_TYPE_URL.into(),
            resource_names_subscribe: vec![DEFAULT_SECRET.into(), ROOT_SECRET.into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let mut responses = c
        .delta_secrets(ReceiverStream::new(req_rx))
        .await
        .unwrap()
        .into_inner();
    let first = tokio::time::timeout(LIMIT, responses.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.resources.len(), 2);
    req_tx
        .send(DeltaDiscoveryRequest {
            type_url: SECRET_TYPE_URL.into(),
            response_nonce: first.nonce.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut acked = b.server.acked_default();
    tokio::time::timeout(LIMIT, acked.wait_for(|a| a.is_some()))
        .await
        .unwrap()
        .unwrap();
    // Renewal: only `default` changes (same roots).
    let renewed = b.ca.issue(&id("wp"));
    b.tx.send(Arc::new(SecretSet::build(Some(&renewed), &b.ca.bundle())))
        .unwrap();
    let second = tokio::time::timeout(LIMIT, responses.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(second.resources.len(), 1);
    assert_eq!(second.resources[0].name, DEFAULT_SECRET);
    assert!(second.removed_resources.is_empty());
}

#[tokio::test]
async fn wrong_type_and_too_many_names_are_refused() {
    let b = bed().await;
    let mut c = client(&b.path).await;
    let mut req = request(&[DEFAULT_SECRET], "", "", false);
    req.type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".into();
    let (req_tx, req_rx) = mpsc::channel(8);
    req_tx.send(req).await.unwrap();
    let mut responses = c
        .stream_secrets(ReceiverStream::new(req_rx))
        .await
        .unwrap()
        .into_inner();
    let err = tokio::time::timeout(LIMIT, responses.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    let names: Vec<String> = (0..100).map(|i| format!("n{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let err = c
        .fetch_secrets(request(&names, "", "", false))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted);
    let ok = c
        .fetch_secrets(request(&[ROOT_SECRET], "", "", false))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.resources.len(), 1);
}

#[tokio::test]
async fn socket_is_private_and_stale_ones_are_replaced() {
    let b = bed().await;
    let mode = std::fs::metadata(&b.path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // Served: a second bind is refused.
    let err = bind(&b.path).await.unwrap_err();
    assert!(matches!(err, SdsError::InUse { .. }), "{err}");

    // A stale socket (nobody listening) is replaced.
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join("sds.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let _l = bind(&stale).await.unwrap();

    // A regular file is not removed.
    let file = dir.path().join("file.sock");
    std::fs::write(&file, "x").unwrap();
    let err = bind(&file).await.unwrap_err();
    assert!(matches!(err, SdsError::NotASocket { .. }), "{err}");
    assert!(file.exists());
}
