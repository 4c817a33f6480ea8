//! The node agent and the plugin as a newcomer runs them by hand (README,
//! "Running the parts by hand"): the built `ambit-node-agent` on a bare
//! temporary root — no CNI bin dir yet, a conf dir with no network config —
//! keeps running and serving, chains `ambit-cni` into the config written
//! later (ready from then on), refuses to take over the sockets of a live
//! agent, replaces those of a killed one, removes its sockets and ready file
//! on SIGTERM and exits 0, and logs no ANSI escapes into a file. `ambit-cni
//! --help` prints its usage; `CNI_COMMAND=VERSION` still gets the CNI JSON.
//!
//! Real processes, bounded waits on readiness signals (log lines, files,
//! sockets), every process killed by its guard even when an assertion fails.
//! No root needed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use ambit_inpod::zds::{ZdsMessage, decode_request, encode_ack, encode_hello};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use socket2::{Domain, SockAddr, Socket, Type};

/// Bound on every wait.
const LIMIT: Duration = Duration::from_secs(10);

/// A binary built next to this test's (`target/<profile>/`).
fn built(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lives in target/<profile>/deps");
    let bin = dir.join(name);
    assert!(
        bin.is_file(),
        "{} is not built: run `cargo build -p ambit-cni --bins` (or `cargo test --workspace`, which builds it)",
        bin.display()
    );
    bin
}

/// A child process, killed and reaped when dropped (a failing assertion
/// leaves nothing running).
struct Proc {
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log holds `needle`, failing early if the process exits.
    fn wait_log(&mut self, needle: &str) {
        let deadline = Instant::now() + LIMIT;
        loop {
            if self.log().contains(needle) {
                return;
            }
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!(
                    "the process exited ({st}) before logging {needle:?}:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "no {needle:?} in the log within {LIMIT:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn assert_running(&mut self) {
        if let Some(st) = self.child.try_wait().unwrap() {
            panic!("the process exited ({st}):\n{}", self.log());
        }
    }

    /// Waits (bounded) for the exit.
    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + LIMIT;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "still running after {LIMIT:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + LIMIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One node's paths, all under a temporary root, as the README lays them out.
struct Node {
    _root: tempfile::TempDir,
    root: PathBuf,
    cni_socket: PathBuf,
    zds_socket: PathBuf,
    bin_dir: PathBuf,
    conf_dir: PathBuf,
    ready: PathBuf,
}

impl Node {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ambit-node-1");
        let conf_dir = root.join("net.d");
        // `mkdir -p /tmp/ambit-node-1/net.d`: the bin dir does not exist.
        fs::create_dir_all(&conf_dir).unwrap();
        Self {
            cni_socket: root.join("cni.sock"),
            zds_socket: root.join("zds.sock"),
            bin_dir: root.join("bin"),
            ready: root.join("ready"),
            conf_dir,
            root,
            _root: tmp,
        }
    }

    /// Starts the agent with the README's flags (and a ready file), its
    /// stdout and stderr into a log file: not a terminal.
    fn start_agent(&self, log_name: &str) -> Proc {
        let log = self.root.join(log_name);
        let out = fs::File::create(&log).unwrap();
        let err = out.try_clone().unwrap();
        let child = Command::new(built("ambit-node-agent"))
            .current_dir(ambit_tests::workspace_root())
            .args(["--node-name", "node-1", "--config-dir", "deploy/local/demo"])
            .arg("--state-dir")
            .arg(&self.root)
            .arg("--cni-socket")
            .arg(&self.cni_socket)
            .arg("--zds-socket")
            .arg(&self.zds_socket)
            .arg("--cni-bin-dir")
            .arg(&self.bin_dir)
            .arg("--cni-conf-dir")
            .arg(&self.conf_dir)
            .arg("--ready-file")
            .arg(&self.ready)
            // Colour must go because the output is a file, not because of
            // NO_COLOR.
            .env_remove("NO_COLOR")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap();
        Proc { child, log }
    }
}

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&fs::read(p).unwrap()).unwrap()
}

/// What a runtime would exec: the installed plugin with the conflist's entry.
fn plugin_status(plugin: &Path, conflist: &Value) -> std::process::Output {
    let entry = conflist["plugins"]
        .as_array()
        .and_then(|p| p.last())
        .cloned()
        .unwrap();
    let mut conf = entry;
    conf["cniVersion"] = conflist["cniVersion"].clone();
    conf["name"] = conflist["name"].clone();
    let mut child = Command::new(plugin)
        .env_clear()
        .env("CNI_COMMAND", "STATUS")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(conf.to_string().as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// Connects to the ZDS socket as ztunnel does (hello) and takes the
/// agent's snapshot of enrolled pods: none here, so just `SnapshotSent`.
fn ztunnel_handshake(zds: &Path) {
    let s = Socket::new(Domain::UNIX, Type::SEQPACKET, None).unwrap();
    s.connect(&SockAddr::unix(zds).unwrap()).unwrap();
    s.set_read_timeout(Some(LIMIT)).unwrap();
    s.send(&encode_hello()).unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let n = std::io::Read::read(&mut &s, &mut buf).expect("a request within the limit");
    assert_eq!(decode_request(&buf[..n]).unwrap(), ZdsMessage::SnapshotSent);
    s.send(&encode_ack("")).unwrap();
}

#[test]
fn node_agent_on_a_bare_root_waits_for_the_cni_config_then_chains_itself_and_cleans_up() {
    let node = Node::new();
    let mut agent = node.start_agent("agent.log");

    // It serves before any CNI config exists, and says what it waits for.
    agent.wait_log("node agent running");
    agent.wait_log("no CNI network config");
    agent.assert_running();
    assert!(node.cni_socket.exists() && node.zds_socket.exists());
    assert!(
        !node.ready.exists(),
        "not ready before ambit-cni is chained"
    );
    let bin = node.bin_dir.join("ambit-cni");
    assert!(
        bin.is_file(),
        "the plugin is installed into the new bin dir"
    );
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&node.bin_dir), 0o755);
    assert_eq!(mode(&bin), 0o755);
    UnixStream::connect(&node.cni_socket).expect("the CNI socket accepts");
    ztunnel_handshake(&node.zds_socket);
    agent.wait_log("ztunnel connected");

    // The node's primary CNI writes its config (atomically, as CNIs do):
    // ambit-cni is chained last, and the agent is ready.
    let conflist = node.conf_dir.join("10-demo.conflist");
    let tmp = node.conf_dir.join(".10-demo.tmp");
    fs::write(
        &tmp,
        json!({"cniVersion": "1.0.0", "name": "demo",
               "plugins": [{"type": "bridge", "bridge": "cni0"}]})
        .to_string(),
    )
    .unwrap();
    fs::rename(&tmp, &conflist).unwrap();
    wait_for("the ready file", || node.ready.exists());
    let written = read_json(&conflist);
    let types: Vec<&str> = written["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["type"].as_str())
        .collect();
    assert_eq!(types, ["bridge", "ambit-cni"]);
    assert_eq!(
        written["plugins"][1]["ambit"]["agent_socket"],
        node.cni_socket.to_str().unwrap()
    );
    agent.assert_running();

    // What a runtime would run now: the installed plugin reaches the agent.
    let st = plugin_status(&bin, &written);
    assert!(
        st.status.success(),
        "STATUS through the chained entry: {} {}",
        String::from_utf8_lossy(&st.stdout),
        String::from_utf8_lossy(&st.stderr)
    );

    // A second agent on the same sockets is refused; the first keeps them.
    let mut second = node.start_agent("second.log");
    let st = second.wait_exit();
    assert!(!st.success(), "the second agent must not start");
    let said = second.log();
    assert!(
        said.contains("served by another running process") && said.contains("--cni-socket"),
        "{said}"
    );
    assert!(
        !said.contains("Stack backtrace"),
        "one clear line, no backtrace: {said}"
    );
    UnixStream::connect(&node.cni_socket).expect("the first agent still serves");
    agent.assert_running();

    // SIGTERM: exit 0, sockets and ready file gone.
    kill(agent.pid(), Signal::SIGTERM).unwrap();
    let st = agent.wait_exit();
    assert!(st.success(), "{st}:\n{}", agent.log());
    for p in [&node.cni_socket, &node.zds_socket, &node.ready] {
        assert!(!p.exists(), "{} is left after SIGTERM", p.display());
    }
    let log = agent.log();
    assert!(log.contains("SIGTERM received"), "{log}");
    assert!(
        !log.contains("\x1b["),
        "ANSI escapes in a log file:\n{log:?}"
    );
    // Left for the runtime: the chained entry stays (pods fail closed while
    // no agent runs) and so does the binary.
    assert!(bin.exists());
}

#[test]
fn a_killed_agents_sockets_are_replaced_and_ctrl_c_cleans_up() {
    let node = Node::new();
    fs::write(
        node.conf_dir.join("10-demo.conflist"),
        json!({"cniVersion": "1.0.0", "name": "demo",
               "plugins": [{"type": "bridge", "bridge": "cni0"}]})
        .to_string(),
    )
    .unwrap();
    let mut agent = node.start_agent("agent.log");
    wait_for("the ready file", || node.ready.exists());
    // Killed hard: nothing is cleaned up.
    kill(agent.pid(), Signal::SIGKILL).unwrap();
    agent.wait_exit();
    assert!(node.cni_socket.exists() && node.zds_socket.exists() && node.ready.exists());

    // The next agent takes over the stale sockets, and is ready only once
    // it has chained the plugin itself.
    let mut again = node.start_agent("again.log");
    again.wait_log("removing a stale socket");
    again.wait_log("node agent ready");
    assert!(node.ready.exists());
    UnixStream::connect(&node.cni_socket).expect("the new agent serves");

    kill(again.pid(), Signal::SIGINT).unwrap();
    let st = again.wait_exit();
    assert!(st.success(), "{st}:\n{}", again.log());
    for p in [&node.cni_socket, &node.zds_socket, &node.ready] {
        assert!(!p.exists(), "{} is left after ctrl-c", p.display());
    }
}

#[test]
fn the_plugin_prints_usage_for_people_and_cni_for_the_runtime() {
    let plugin = built("ambit-cni");
    for flag in ["--help", "-h"] {
        let out = Command::new(&plugin)
            .arg(flag)
            .env_remove("CNI_COMMAND")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "{flag}: {}", out.status);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(!text.trim_start().starts_with('{'), "not CNI JSON: {text}");
        for part in [
            "container runtime",
            "CNI_COMMAND",
            "ambit-node-agent",
            "/etc/cni/net.d",
        ] {
            assert!(text.contains(part), "{part:?} in {flag}: {text}");
        }
    }
    let out = Command::new(&plugin)
        .arg("--version")
        .env_remove("CNI_COMMAND")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ambit-cni "));

    // The runtime's call, arguments or not: CNI JSON.
    for args in [&[][..], &["--help"][..]] {
        let out = Command::new(&plugin)
            .args(args)
            .env("CNI_COMMAND", "VERSION")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", out.status);
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["cniVersion"], "1.0.0", "{v}");
        assert!(
            v["supportedVersions"]
                .as_array()
                .is_some_and(|a| a.contains(&json!("0.4.0"))),
            "{v}"
        );
    }
}
