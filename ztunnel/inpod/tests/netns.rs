//! Root tests of the netns helpers and of ZDS with a real network namespace:
//! sockets made inside a fresh netns serve there and not in the caller's,
//! and a netns fd sent over ZDS arrives as a usable [`PodNetns`].
//!
//! Needs root and `ip`; prints SKIP and passes otherwise. Every namespace is
//! deleted by a Drop guard, also when an assertion fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs::File;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use ambit_inpod::{
    InpodCommand, InpodEvent, NetnsSockets, PodNetns, SocketOptions, ZTUNNEL_MARK, ZdsClient,
    ZdsClientConfig, ZdsListener, ZdsMessage,
};
use ambit_proto::workload::zds::WorkloadInfo;
use tokio::sync::{mpsc, oneshot};

const T: Duration = Duration::from_secs(5);

fn can_run(test: &str) -> bool {
    let root = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(1)
        == 0;
    let ip = Command::new("ip")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !root || !ip {
        println!("SKIP {test}: needs root and the `ip` tool (root={root}, ip={ip})");
    }
    root && ip
}

/// A network namespace with `lo` up, deleted when dropped.
struct Netns {
    name: String,
}

impl Netns {
    fn new() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "ambit-ip-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        ip(&["netns", "add", &name]);
        let ns = Self { name };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    fn path(&self) -> PathBuf {
        Path::new("/var/run/netns").join(&self.name)
    }

    fn ino(&self) -> u64 {
        std::fs::metadata(self.path()).unwrap().ino()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn sockets_made_in_a_pod_netns_live_there() {
    if !can_run("sockets_made_in_a_pod_netns_live_there") {
        return;
    }
    let pod = Netns::new();
    let netns = PodNetns::open(pod.path()).unwrap();
    assert_eq!(netns.id().ino, pod.ino());

    let listener = netns
        .bind_listener(([127, 0, 0, 1], 0).into(), false)
        .unwrap();
    let addr = listener.local_addr().unwrap();
    // The caller's namespace has no such listener (its loopback is another).
    let here = TcpStream::connect_timeout(&addr, Duration::from_millis(200));
    assert!(here.is_err(), "{addr} answered in the caller's netns");

    let rt = runtime();
    rt.block_on(async {
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        // A one-off socket from a short-lived netns thread.
        let a = tokio::time::timeout(T, netns.connect_from(addr, &SocketOptions::default()))
            .await
            .expect("connect in time")
            .unwrap();
        let (_, peer_a) = listener.accept().await.unwrap();
        assert_eq!(a.local_addr().unwrap(), peer_a);

        // A marked socket from the pod's long-lived socket thread.
        let sockets = NetnsSockets::spawn(&netns).unwrap();
        assert_eq!(sockets.id(), netns.id());
        let opts = SocketOptions {
            mark: Some(ZTUNNEL_MARK),
            ..SocketOptions::default()
        };
        let b = tokio::time::timeout(T, sockets.connect(addr, &opts))
            .await
            .expect("connect in time")
            .unwrap();
        let (_, peer_b) = listener.accept().await.unwrap();
        assert_eq!(b.local_addr().unwrap(), peer_b);
        assert_eq!(socket2::SockRef::from(&b).mark().unwrap(), ZTUNNEL_MARK);

        // Nothing listens on the port the listener does not hold.
        let closed: SocketAddr = ([127, 0, 0, 1], 1).into();
        let err = sockets
            .connect(closed, &SocketOptions::default())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("inside pod netns"), "{err}");
    });
}

#[test]
fn a_netns_fd_sent_over_zds_arrives_usable() {
    if !can_run("a_netns_fd_sent_over_zds_arrives_usable") {
        return;
    }
    let pod = Netns::new();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("zds.sock");
    let agent = ZdsListener::bind(&sock).unwrap();

    let rt = runtime();
    let (commands, mut rx) = mpsc::channel::<InpodCommand>(4);
    let (stop, stopped) = oneshot::channel::<()>();
    let mut cfg = ZdsClientConfig::new(&sock);
    cfg.backoff_initial = Duration::from_millis(20);
    let client = rt.spawn(ZdsClient::new(cfg, commands).run(async move {
        let _ = stopped.await;
    }));
    // The owner: binds a listener in every added pod's netns and reports
    // where it landed.
    let (seen_tx, seen_rx) = std::sync::mpsc::channel();
    rt.spawn(async move {
        while let Some(cmd) = rx.recv().await {
            let outcome = match cmd.event {
                // pod-2 asks for an address the netns does not have.
                InpodEvent::Add { uid, netns, .. } => netns
                    .bind_listener(
                        if uid == "pod-1" {
                            ([127, 0, 0, 1], 15001).into()
                        } else {
                            ([192, 0, 2, 1], 15001).into()
                        },
                        false,
                    )
                    .map(|l| {
                        let _ = seen_tx.send((uid, netns.id().ino, l));
                    })
                    .map_err(|e| e.to_string()),
                _ => Ok(()),
            };
            let _ = cmd.reply.send(outcome);
        }
    });

    let conn = agent.accept(T).unwrap();
    let add = ZdsMessage::Add {
        uid: "pod-1".into(),
        info: WorkloadInfo {
            name: "web-0".into(),
            namespace: "shop".into(),
            service_account: "web".into(),
        },
    };
    let ns_file = File::open(pod.path()).unwrap();
    assert_eq!(conn.request(&add, Some(ns_file.as_fd())).unwrap(), "");
    let (uid, ino, listener) = seen_rx.recv_timeout(T).unwrap();
    assert_eq!(uid, "pod-1");
    assert_eq!(ino, pod.ino(), "the owner got the pod's netns");
    assert_eq!(listener.local_addr().unwrap().port(), 15001);

    // A listener that cannot be made (an address the pod's netns does not
    // have) comes back as the ack's error text.
    let again = ZdsMessage::Add {
        uid: "pod-2".into(),
        info: WorkloadInfo::default(),
    };
    let ack = conn.request(&again, Some(ns_file.as_fd())).unwrap();
    assert!(ack.contains("192.0.2.1:15001"), "{ack}");

    let _ = stop.send(());
    rt.block_on(async { tokio::time::timeout(T, client).await })
        .expect("client stops when shut down")
        .unwrap();
}
