//! Unit tests that need no root: message encoding, netns fd validation, and
//! the ZDS client against an in-test agent with a fake owner task.

use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use ambit_proto::workload::zds::{WorkloadInfo, WorkloadRequest, ZdsHello};
use prost::Message;
use tokio::sync::{mpsc, oneshot};

use crate::netns::{NetnsError, PodNetns};
use crate::zds::{
    self, InpodCommand, InpodEvent, ZdsClient, ZdsClientConfig, ZdsListener, ZdsMessage,
    ZdsRequestError,
};

const T: Duration = Duration::from_secs(5);

fn info() -> WorkloadInfo {
    WorkloadInfo {
        name: "web-0".into(),
        namespace: "shop".into(),
        service_account: "web".into(),
    }
}

#[test]
fn requests_round_trip() {
    let msgs = [
        ZdsMessage::Add {
            uid: "u1".into(),
            info: info(),
        },
        ZdsMessage::Keep { uid: "u2".into() },
        ZdsMessage::Del { uid: "u3".into() },
        ZdsMessage::SnapshotSent,
    ];
    for msg in msgs {
        let bytes = zds::encode_request(&msg);
        assert_eq!(zds::decode_request(&bytes).unwrap(), msg);
    }
}

#[test]
fn add_without_info_decodes_with_empty_info() {
    use ambit_proto::workload::zds::{AddWorkload, workload_request::Payload};
    let bytes = WorkloadRequest {
        payload: Some(Payload::Add(AddWorkload {
            uid: "u".into(),
            workload_info: None,
        })),
    }
    .encode_to_vec();
    assert_eq!(
        zds::decode_request(&bytes).unwrap(),
        ZdsMessage::Add {
            uid: "u".into(),
            info: WorkloadInfo::default()
        }
    );
}

#[test]
fn bad_requests_are_errors_not_panics() {
    let err = zds::decode_request(b"\xff\xff\xff\xff garbage").unwrap_err();
    assert!(matches!(err, ZdsRequestError::Decode { .. }), "{err}");
    assert!(err.to_string().contains("cannot decode WorkloadRequest"));

    // An empty datagram decodes to a request without a payload (as does an
    // unknown oneof member, which prost skips).
    assert_eq!(
        zds::decode_request(&[]).unwrap_err(),
        ZdsRequestError::NoPayload
    );
    let unknown_field = [0x3a, 0x00]; // field 7, length-delimited, empty
    assert_eq!(
        zds::decode_request(&unknown_field).unwrap_err(),
        ZdsRequestError::NoPayload
    );

    let bytes = zds::encode_request(&ZdsMessage::Del { uid: String::new() });
    assert_eq!(
        zds::decode_request(&bytes).unwrap_err(),
        ZdsRequestError::EmptyUid {
            kind: "DelWorkload"
        }
    );
}

#[test]
fn ack_and_hello_round_trip() {
    assert_eq!(zds::decode_ack(&zds::encode_ack("")).unwrap(), "");
    assert_eq!(zds::decode_ack(&zds::encode_ack("no")).unwrap(), "no");
    assert!(zds::decode_ack(&[]).is_err(), "an ack without payload");
    zds::decode_hello(&zds::encode_hello()).unwrap();
    let v0 = ZdsHello { version: 0 }.encode_to_vec();
    assert!(
        zds::decode_hello(&v0)
            .unwrap_err()
            .to_string()
            .contains("not V1")
    );
}

#[test]
fn netns_open_validates() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let err = PodNetns::open(&missing).unwrap_err();
    assert!(matches!(err, NetnsError::Open { .. }));
    assert!(err.to_string().contains(&missing.display().to_string()));

    let file = dir.path().join("plain");
    std::fs::write(&file, b"x").unwrap();
    let err = PodNetns::open(&file).unwrap_err();
    assert!(matches!(err, NetnsError::NotNetns { .. }), "{err}");

    let err = PodNetns::open("/proc/self/ns/uts").unwrap_err();
    assert!(err.to_string().contains("uts:["), "{err}");

    let ns = PodNetns::open("/proc/self/ns/net").unwrap();
    let meta = std::fs::metadata("/proc/self/ns/net").unwrap();
    assert_eq!(ns.id().ino, meta.ino());
    assert_eq!(ns.id().dev, meta.dev());
    assert_eq!(ns.clone().id(), ns.id());
}

#[test]
fn run_in_own_netns_when_root() {
    // /proc/self belongs to the effective uid.
    if std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(1)
        != 0
    {
        println!("SKIP run_in_own_netns_when_root: needs root (setns)");
        return;
    }
    let ns = PodNetns::open("/proc/self/ns/net").unwrap();
    let caller = std::thread::current().id();
    let (worker, n) = ns.run_in(|| Ok((std::thread::current().id(), 7))).unwrap();
    assert_ne!(worker, caller);
    assert_eq!(n, 7);
    let err = ns
        .run_in(|| -> std::io::Result<()> { Err(std::io::Error::other("boom")) })
        .unwrap_err();
    assert_eq!(err.to_string(), "boom");
}

/// A stand-in for the manager: records events, refuses Keep of "bad".
fn fake_owner() -> (mpsc::Sender<InpodCommand>, mpsc::UnboundedReceiver<String>) {
    let (tx, mut rx) = mpsc::channel::<InpodCommand>(8);
    let (seen_tx, seen_rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(cmd) = rx.recv().await {
            let (desc, outcome) = match cmd.event {
                InpodEvent::Connected => ("connected".to_string(), Ok(())),
                InpodEvent::Add { uid, info, netns } => (
                    format!("add {uid} {} ino={}", info.name, netns.id().ino),
                    Ok(()),
                ),
                InpodEvent::Keep { uid } if uid == "bad" => {
                    (format!("keep {uid}"), Err("nope".to_string()))
                }
                InpodEvent::Keep { uid } => (format!("keep {uid}"), Ok(())),
                InpodEvent::Del { uid } => (format!("del {uid}"), Ok(())),
                InpodEvent::SnapshotSent => ("snapshot".to_string(), Ok(())),
            };
            let _ = seen_tx.send(desc);
            let _ = cmd.reply.send(outcome);
        }
    });
    (tx, seen_rx)
}

async fn next(rx: &mut mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(T, rx.recv())
        .await
        .expect("owner saw nothing in time")
        .expect("owner gone")
}

/// A shutdown signal for the client: fire it by sending `()` (or dropping
/// the sender).
fn shutdown_signal() -> (oneshot::Sender<()>, impl std::future::Future<Output = ()>) {
    let (tx, rx) = oneshot::channel::<()>();
    (tx, async move {
        let _ = rx.await;
    })
}

/// Runs a blocking agent step off the runtime threads.
async fn blocking<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    tokio::time::timeout(T, tokio::task::spawn_blocking(f))
        .await
        .expect("agent step timed out")
        .expect("agent step panicked")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_acks_every_request_and_reconnects() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("zds.sock");
    let listener = std::sync::Arc::new(ZdsListener::bind(&path).unwrap());
    let (handler, mut seen) = fake_owner();
    let (stop, shutdown) = shutdown_signal();
    let mut cfg = ZdsClientConfig::new(&path);
    cfg.backoff_initial = Duration::from_millis(20);
    cfg.backoff_max = Duration::from_millis(200);
    let client = tokio::spawn(ZdsClient::new(cfg, handler).run(shutdown));

    let l = listener.clone();
    let conn = blocking(move || l.accept(T).unwrap()).await;
    assert_eq!(next(&mut seen).await, "connected");

    let netns_ino = std::fs::metadata("/proc/self/ns/net").unwrap().ino();
    let plain = tempfile::tempfile().unwrap();
    let (conn, acks) = blocking(move || {
        let ns = std::fs::File::open("/proc/self/ns/net").unwrap();
        let add = |uid: &str| ZdsMessage::Add {
            uid: uid.into(),
            info: info(),
        };
        let acks = vec![
            conn.request(&add("u1"), Some(ns.as_fd())).unwrap(),
            conn.request(&add("u2"), None).unwrap(),
            conn.request(&add("u3"), Some(plain.as_fd())).unwrap(),
            {
                conn.send_raw(b"\x08\xff\xff", &[]).unwrap();
                conn.recv_ack().unwrap()
            },
            conn.request(&ZdsMessage::Del { uid: "u1".into() }, Some(ns.as_fd()))
                .unwrap(),
            {
                let bytes = zds::encode_request(&add("u4"));
                conn.send_raw(&bytes, &[ns.as_fd(), ns.as_fd()]).unwrap();
                conn.recv_ack().unwrap()
            },
            conn.request(&ZdsMessage::Keep { uid: "bad".into() }, None)
                .unwrap(),
            conn.request(&ZdsMessage::SnapshotSent, None).unwrap(),
            {
                conn.send_raw(&[], &[]).unwrap();
                conn.recv_ack().unwrap()
            },
        ];
        (conn, acks)
    })
    .await;
    assert_eq!(acks[0], "", "valid add");
    assert!(
        acks[1].contains("without the pod's netns fd"),
        "{}",
        acks[1]
    );
    assert!(acks[2].contains("not a network namespace"), "{}", acks[2]);
    assert!(acks[3].contains("cannot decode"), "{}", acks[3]);
    assert!(acks[4].contains("DelWorkload carried 1 fd"), "{}", acks[4]);
    assert!(acks[5].contains("with 2 fds"), "{}", acks[5]);
    assert_eq!(acks[6], "nope", "the owner's refusal is passed on");
    assert_eq!(acks[7], "");
    assert!(acks[8].contains("empty datagram"), "{}", acks[8]);
    // Only well-formed requests reached the owner.
    assert_eq!(
        next(&mut seen).await,
        format!("add u1 web-0 ino={netns_ino}")
    );
    assert_eq!(next(&mut seen).await, "keep bad");
    assert_eq!(next(&mut seen).await, "snapshot");

    // The agent goes away; ztunnel comes back and says hello again.
    blocking(move || conn.close()).await;
    let l = listener.clone();
    let conn = blocking(move || l.accept(T).unwrap()).await;
    assert_eq!(next(&mut seen).await, "connected");
    let ack = blocking(move || conn.request(&ZdsMessage::SnapshotSent, None).unwrap()).await;
    assert_eq!(ack, "");
    assert_eq!(next(&mut seen).await, "snapshot");

    let _ = stop.send(());
    tokio::time::timeout(T, client)
        .await
        .expect("client stops when shut down")
        .unwrap();
}

#[tokio::test]
async fn client_keeps_retrying_while_agent_is_absent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("zds.sock");
    let (handler, mut seen) = fake_owner();
    let (stop, shutdown) = shutdown_signal();
    let mut cfg = ZdsClientConfig::new(&path);
    cfg.backoff_initial = Duration::from_millis(10);
    cfg.backoff_max = Duration::from_millis(50);
    let client = tokio::spawn(ZdsClient::new(cfg, handler).run(shutdown));
    tokio::time::sleep(Duration::from_millis(120)).await;
    // The agent appears late.
    let listener = ZdsListener::bind(&path).unwrap();
    let _conn = blocking(move || listener.accept(T).unwrap()).await;
    assert_eq!(next(&mut seen).await, "connected");
    let _ = stop.send(());
    tokio::time::timeout(T, client).await.unwrap().unwrap();
}
