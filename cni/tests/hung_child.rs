//! Regression test (issue 14): one hung `iptables-restore` must not stall
//! the node agent. The real `ambit-node-agent` runs with a fake
//! `iptables-restore` first on its PATH that hangs the first time it runs
//! (then hands over to the real one). The ADD that meets it fails with a
//! clear timeout error within the agent's bound, and an ADD of another pod
//! sent meanwhile is answered within that bound too.
//!
//! Needs root, `ip` and `iptables`; prints SKIP and passes otherwise. The
//! namespaces and the agent are removed by Drop guards, also on failure.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ambit_cni::protocol::{Command as CniCommand, PodRef, Reply, Request};

const AGENT: &str = env!("CARGO_BIN_EXE_ambit-node-agent");
/// The agent's `--command-timeout-ms` in this test.
const BOUND: Duration = Duration::from_millis(1500);
/// Scheduling slack on a shared 2-core machine.
const SLACK: Duration = Duration::from_millis(1500);

fn which(tool: &str) -> Option<PathBuf> {
    let out = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .ok()?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !path.is_empty()).then(|| PathBuf::from(path))
}

fn can_run(test: &str) -> Option<PathBuf> {
    let root = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap()) == 0;
    let restore = which("iptables-restore");
    if !root || which("ip").is_none() || restore.is_none() {
        println!("SKIP {test}: needs root, ip and iptables-restore");
        return None;
    }
    restore
}

struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Self {
        let name = format!("ambit-hc-{}-{tag}", std::process::id());
        let ok = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap();
        assert!(ok.success(), "ip netns add {name}");
        let ns = Self(name);
        Command::new("ip")
            .args(["-n", &ns.0, "link", "set", "lo", "up"])
            .status()
            .unwrap();
        ns
    }

    fn path(&self) -> PathBuf {
        Path::new("/var/run/netns").join(&self.0)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn add(socket: &Path, name: &str, netns: &Path) -> (Reply, Duration) {
    let req = Request {
        command: CniCommand::Add,
        container_id: format!("ctr-{name}"),
        netns: netns.to_path_buf(),
        ifname: "eth0".into(),
        pod: PodRef {
            name: name.into(),
            namespace: "shop".into(),
            uid: format!("uid-{name}"),
        },
        ips: vec!["10.9.0.2".parse().unwrap()],
    };
    let started = Instant::now();
    let mut s = UnixStream::connect(socket).unwrap();
    // Far past the bound: on a build without the fix the agent never answers.
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut line = serde_json::to_vec(&req).unwrap();
    line.push(b'\n');
    s.write_all(&line).unwrap();
    let mut reply = String::new();
    BufReader::new(s)
        .read_line(&mut reply)
        .expect("the agent answers the ADD (a hung child must not stall it)");
    (serde_json::from_str(&reply).unwrap(), started.elapsed())
}

#[test]
fn a_hung_iptables_restore_fails_its_add_in_time_and_stalls_no_other() {
    let Some(real) = can_run("a_hung_iptables_restore_fails_its_add_in_time_and_stalls_no_other")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for sub in ["config", "state", "fakebin", "marks"] {
        std::fs::create_dir(d.join(sub)).unwrap();
    }
    std::fs::write(
        d.join("config/ns.yaml"),
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: shop\n  labels:\n    istio.io/dataplane-mode: ambient\n",
    )
    .unwrap();
    // Hangs in pod A's netns (a wrapper shell and a child, like a stuck
    // xtables lock holder), behaves everywhere else.
    let fake = d.join("fakebin/iptables-restore");
    let marks = d.join("marks");
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\ncase \"$(ip netns identify)\" in *-a)\n  sleep 600 &\n  echo $! > {marks}/sleep.tmp && mv {marks}/sleep.tmp {marks}/sleep\n  wait; exit 1;;\nesac\nexec {real} \"$@\"\n",
            marks = marks.display(),
            real = real.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let a = Netns::new("a");
    let b = Netns::new("b");
    let probe = Netns::new("p");

    let socket = d.join("cni.sock");
    let path = format!(
        "{}:{}",
        d.join("fakebin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let _agent = Killed(
        Command::new(AGENT)
            .args(["--node-name", "node-1", "--no-install"])
            .arg("--config-dir")
            .arg(d.join("config"))
            .arg("--state-dir")
            .arg(d.join("state"))
            .arg("--cni-socket")
            .arg(&socket)
            .arg("--zds-socket")
            .arg(d.join("zds.sock"))
            .arg("--command-timeout-ms")
            .arg(BOUND.as_millis().to_string())
            .env("PATH", path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while UnixStream::connect(&socket).is_err() {
        assert!(Instant::now() < deadline, "the agent did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Ready once the agent's view has the namespace: a probe pod's ADD then
    // gets as far as handing it to (the absent) ztunnel.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (reply, _) = add(&socket, "probe", &probe.path());
        if reply
            .error
            .as_deref()
            .is_some_and(|e| e.contains("ztunnel is not connected"))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent never enrolled: {reply:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let (sock_a, path_a) = (socket.clone(), a.path());
    let first = std::thread::spawn(move || add(&sock_a, "a", &path_a));
    // Let A reach the hung child first.
    let sleep_pid = marks.join("sleep");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sleep_pid.exists() {
        assert!(Instant::now() < deadline, "A never ran iptables-restore");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (reply_b, took_b) = add(&socket, "b", &b.path());
    let (reply_a, took_a) = first.join().unwrap();

    println!("hung child: A answered in {took_a:?}, B in {took_b:?}");
    assert!(!reply_a.ok, "A's ADD must fail: {reply_a:?}");
    let err_a = reply_a.error.clone().unwrap_or_default();
    assert!(
        err_a.contains("iptables-restore") && err_a.contains("did not finish within"),
        "A's error names the hung command and the timeout: {err_a}"
    );
    assert!(reply_a.retry, "a timeout is worth retrying");
    assert!(took_a < BOUND + SLACK, "A answered after {took_a:?}");
    // B waited for A's bound at most, then ran its own (real) commands; it
    // fails only because no ztunnel runs in this test.
    assert!(took_b < BOUND + SLACK, "B was stalled for {took_b:?}");
    let err_b = reply_b.error.clone().unwrap_or_default();
    assert!(
        !err_b.contains("did not finish within"),
        "B must not time out: {err_b}"
    );
    assert!(err_b.contains("ztunnel is not connected"), "{err_b}");
    // The hung child's own child was killed with it.
    let pid = std::fs::read_to_string(&sleep_pid).unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).unwrap_or_default();
    assert!(
        stat.is_empty() || stat.contains(") Z"),
        "the hung child's `sleep` ({}) outlived the timeout: {stat}",
        pid.trim()
    );
}
