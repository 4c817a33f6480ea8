//! In-pod listeners, end to end: a real network namespace per "pod", an
//! in-test node agent speaking ZDS over SOCK_SEQPACKET (netns fd passed with
//! SCM_RIGHTS, `ambit_inpod`'s agent end), and ztunnel's ZDS client + in-pod
//! manager.
//!
//! Needs root and `ip`; prints SKIP and passes otherwise. Every namespace is
//! deleted by a Drop guard, also when an assertion fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::fs::File;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ambit_inpod::{
    PodNetns, SocketOptions, ZdsAgentConn, ZdsClient, ZdsClientConfig, ZdsListener, ZdsMessage,
};
use ambit_proto::workload::zds::WorkloadInfo;
use ambit_ztunnel::drain::{self, DrainTrigger};
use ambit_ztunnel::inpod::{InpodConfig, InpodHandle, InpodManager, PodSet};
use tokio::runtime::Runtime;

const T: Duration = Duration::from_secs(5);
const PORTS: [u16; 3] = [15001, 15006, 15008];

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

/// A network namespace that is deleted when dropped.
struct Netns {
    name: String,
}

impl Netns {
    fn new() -> Self {
        let name = format!("ambit-t-{:08x}", rand::random::<u32>());
        run(&["netns", "add", &name]);
        let ns = Self { name };
        run(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    fn path(&self) -> PathBuf {
        Path::new("/var/run/netns").join(&self.name)
    }

    fn file(&self) -> File {
        File::open(self.path()).unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn run(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// TCP ports in LISTEN in the namespace at `ns` (or the test's own), read
/// from /proc/thread-self/net on a thread that entered it.
fn listening(ns: Option<&Path>) -> BTreeSet<u16> {
    let ns = ns.map(|p| File::open(p).unwrap());
    std::thread::spawn(move || {
        if let Some(ns) = ns {
            nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        }
        let mut ports = BTreeSet::new();
        for table in ["tcp", "tcp6"] {
            let Ok(text) = std::fs::read_to_string(format!("/proc/thread-self/net/{table}")) else {
                continue;
            };
            for line in text.lines().skip(1) {
                let cols: Vec<&str> = line.split_whitespace().collect();
                if cols.len() > 3 && cols[3] == "0A" {
                    let port = cols[1].rsplit(':').next().unwrap();
                    ports.insert(u16::from_str_radix(port, 16).unwrap());
                }
            }
        }
        ports
    })
    .join()
    .unwrap()
}

fn has_all(ports: &BTreeSet<u16>) -> bool {
    PORTS.iter().all(|p| ports.contains(p))
}

fn has_none(ports: &BTreeSet<u16>) -> bool {
    PORTS.iter().all(|p| !ports.contains(p))
}

/// ztunnel's side (ZDS client + manager) on its own runtime.
struct Ztunnel {
    rt: Runtime,
    handle: InpodHandle,
    trigger: DrainTrigger,
}

impl Ztunnel {
    fn start(sock: &Path) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (trigger, drain) = drain::channel();
        let mut cfg = ZdsClientConfig::new(sock);
        cfg.backoff_initial = Duration::from_millis(20);
        cfg.backoff_max = Duration::from_millis(200);
        let handle = rt.block_on(async {
            let handle = InpodManager::spawn(InpodConfig::default(), drain.clone(), None);
            tokio::spawn(ZdsClient::new(cfg, handle.commands.clone()).run(drain.wait()));
            handle
        });
        Self {
            rt,
            handle,
            trigger,
        }
    }

    fn pods(&self) -> PodSet {
        self.handle.pods.borrow().clone()
    }

    fn uids(&self) -> BTreeSet<String> {
        self.pods().into_keys().collect()
    }

    fn stop(self) {
        self.trigger.start();
        let Self { rt, handle, .. } = self;
        rt.block_on(async { tokio::time::timeout(T, handle.task).await })
            .expect("manager stops within the timeout")
            .unwrap();
    }
}

fn info(name: &str) -> WorkloadInfo {
    WorkloadInfo {
        name: name.into(),
        namespace: "shop".into(),
        service_account: "web".into(),
    }
}

fn add(conn: &ZdsAgentConn, uid: &str, ns: &Netns) -> String {
    let msg = ZdsMessage::Add {
        uid: uid.into(),
        info: info(uid),
    };
    conn.request(&msg, Some(ns.file().as_fd())).unwrap()
}

fn del(conn: &ZdsAgentConn, uid: &str) -> String {
    conn.request(&ZdsMessage::Del { uid: uid.into() }, None)
        .unwrap()
}

#[test]
fn add_opens_listeners_inside_the_pod_netns_and_del_closes_them() {
    if !can_run("add_opens_listeners_inside_the_pod_netns_and_del_closes_them") {
        return;
    }
    let pod = Netns::new();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("zds.sock");
    let agent = ZdsListener::bind(&sock).unwrap();
    let host_before = listening(None);
    let zt = Ztunnel::start(&sock);
    let conn = agent.accept(T).unwrap();

    assert_eq!(add(&conn, "pod-1", &pod), "");
    let pods = zt.pods();
    let summary = &pods["pod-1"];
    assert_eq!(summary.name, "pod-1");
    assert_eq!(summary.namespace, "shop");
    assert_eq!(
        summary.netns.ino,
        std::fs::metadata(pod.path()).unwrap().ino()
    );
    let v4: BTreeSet<u16> = summary
        .listeners
        .iter()
        .filter(|(_, a)| a.is_ipv4())
        .map(|(_, a)| a.port())
        .collect();
    assert_eq!(v4, PORTS.into_iter().collect());

    let inside = listening(Some(&pod.path()));
    assert!(has_all(&inside), "listening inside the pod: {inside:?}");
    // Not in ztunnel's own (the test's) namespace — unless they already were.
    let host = listening(None);
    for port in PORTS {
        assert!(
            !host.contains(&port) || host_before.contains(&port),
            "port {port} opened in the node netns"
        );
    }

    // A socket made inside the pod reaches the pod's listeners (the accept
    // loop takes and closes it: no proxy yet).
    let netns = PodNetns::open(pod.path()).unwrap();
    for port in PORTS {
        let dst: SocketAddr = ([127, 0, 0, 1], port).into();
        zt.rt
            .block_on(async {
                tokio::time::timeout(T, netns.connect_from(dst, &SocketOptions::default())).await
            })
            .expect("connect in time")
            .unwrap_or_else(|e| panic!("connect to {dst} inside the pod: {e}"));
    }
    // Re-adding the same pod in the same netns is a no-op.
    assert_eq!(add(&conn, "pod-1", &pod), "");
    assert!(has_all(&listening(Some(&pod.path()))));

    assert_eq!(del(&conn, "pod-1"), "");
    assert!(zt.uids().is_empty());
    let after = listening(Some(&pod.path()));
    assert!(has_none(&after), "closed after Del: {after:?}");
    // Deleting again (or a pod never seen) is fine.
    assert_eq!(del(&conn, "pod-1"), "");
    zt.stop();
}

#[test]
fn bad_messages_get_error_acks_and_the_connection_goes_on() {
    if !can_run("bad_messages_get_error_acks_and_the_connection_goes_on") {
        return;
    }
    let pod = Netns::new();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("zds.sock");
    let agent = ZdsListener::bind(&sock).unwrap();
    let zt = Ztunnel::start(&sock);
    let conn = agent.accept(T).unwrap();

    conn.send_raw(b"not protobuf \xff\xff\xff", &[]).unwrap();
    let ack = conn.recv_ack().unwrap();
    assert!(ack.contains("cannot decode WorkloadRequest"), "{ack}");

    // An empty record is not end-of-file: it gets its own error ack.
    conn.send_raw(&[], &[]).unwrap();
    let ack = conn.recv_ack().unwrap();
    assert!(ack.contains("empty datagram"), "{ack}");

    let no_fd = ZdsMessage::Add {
        uid: "pod-x".into(),
        info: info("pod-x"),
    };
    let ack = conn.request(&no_fd, None).unwrap();
    assert!(ack.contains("without the pod's netns fd"), "{ack}");

    let not_ns = tempfile::tempfile().unwrap();
    let ack = conn.request(&no_fd, Some(not_ns.as_fd())).unwrap();
    assert!(ack.contains("not a network namespace"), "{ack}");

    let ack = conn
        .request(
            &ZdsMessage::Keep {
                uid: "ghost".into(),
            },
            None,
        )
        .unwrap();
    assert!(!ack.is_empty(), "Keep of an unknown pod is refused");
    assert!(zt.uids().is_empty(), "nothing was enrolled");

    // The same connection still works.
    assert_eq!(add(&conn, "pod-ok", &pod), "");
    assert!(has_all(&listening(Some(&pod.path()))));
    assert_eq!(del(&conn, "pod-ok"), "");
    zt.stop();
}

#[test]
fn reconnect_snapshot_keeps_listed_pods_and_drops_the_rest() {
    if !can_run("reconnect_snapshot_keeps_listed_pods_and_drops_the_rest") {
        return;
    }
    let a = Netns::new();
    let b = Netns::new();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("zds.sock");
    let agent = ZdsListener::bind(&sock).unwrap();
    let zt = Ztunnel::start(&sock);

    let conn = agent.accept(T).unwrap();
    assert_eq!(add(&conn, "a", &a), "");
    assert_eq!(add(&conn, "b", &b), "");
    assert_eq!(conn.request(&ZdsMessage::SnapshotSent, None).unwrap(), "");
    assert_eq!(zt.uids(), ["a", "b"].map(String::from).into());

    // The agent restarts: pods keep their listeners while it is away.
    conn.close();
    std::thread::sleep(Duration::from_millis(100));
    assert!(has_all(&listening(Some(&a.path()))));
    assert!(has_all(&listening(Some(&b.path()))));

    let conn = agent.accept(T).unwrap();
    let ack = conn
        .request(&ZdsMessage::Keep { uid: "a".into() }, None)
        .unwrap();
    assert_eq!(ack, "");
    assert_eq!(conn.request(&ZdsMessage::SnapshotSent, None).unwrap(), "");
    assert_eq!(zt.uids(), ["a"].map(String::from).into());
    assert!(has_all(&listening(Some(&a.path()))));
    let in_b = listening(Some(&b.path()));
    assert!(has_none(&in_b), "b was not in the snapshot: {in_b:?}");

    // Keep is only valid inside a snapshot.
    let ack = conn
        .request(&ZdsMessage::Keep { uid: "a".into() }, None)
        .unwrap();
    assert!(ack.contains("after SnapshotSent"), "{ack}");

    // Draining ztunnel closes every pod's listeners.
    zt.stop();
    assert!(has_none(&listening(Some(&a.path()))));
}
