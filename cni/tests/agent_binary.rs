//! The `ambit-node-agent` binary as an operator runs it: it installs the
//! plugin into the node's CNI configuration, answers the plugin on its
//! socket, stops on SIGTERM, and `--uninstall` removes every trace.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const AGENT: &str = env!("CARGO_BIN_EXE_ambit-node-agent");
const PLUGIN: &str = env!("CARGO_BIN_EXE_ambit-cni");

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

#[test]
fn installs_serves_the_plugin_and_uninstalls() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for sub in ["config", "bin", "net.d", "state"] {
        std::fs::create_dir(d.join(sub)).unwrap();
    }
    std::fs::write(
        d.join("config/ns.yaml"),
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: web\n",
    )
    .unwrap();
    let original = json!({
        "cniVersion": "1.0.0",
        "name": "k8s-pod-network",
        "plugins": [
            {"type": "bridge", "bridge": "cni0", "ipam": {"type": "host-local", "subnet": "10.1.0.0/16"}},
            {"type": "portmap", "capabilities": {"portMappings": true}}
        ]
    });
    let conflist = d.join("net.d/10-bridge.conflist");
    std::fs::write(&conflist, original.to_string()).unwrap();
    let socket = d.join("cni.sock");
    let args = |extra: &[&str]| {
        let mut c = Command::new(AGENT);
        c.arg("--node-name")
            .arg("node-1")
            .arg("--config-dir")
            .arg(d.join("config"))
            .arg("--state-dir")
            .arg(d.join("state"))
            .arg("--cni-socket")
            .arg(&socket)
            .arg("--zds-socket")
            .arg(d.join("zds.sock"))
            .arg("--cni-bin-dir")
            .arg(d.join("bin"))
            .arg("--cni-conf-dir")
            .arg(d.join("net.d"))
            .arg("--plugin-binary")
            .arg(PLUGIN)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c
    };

    let agent = Killed(args(&[]).spawn().unwrap());
    wait_for("the plugin in the conflist", || {
        read_json(&conflist)["plugins"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["type"] == "ambit-cni"))
    });
    let plugins = read_json(&conflist)["plugins"].as_array().cloned().unwrap();
    assert_eq!(plugins.len(), 3, "the other plugins are kept: {plugins:?}");
    assert_eq!(plugins[0]["type"], "bridge");
    assert_eq!(plugins[1]["type"], "portmap");
    assert_eq!(
        plugins[2]["ambit"]["agent_socket"],
        socket.to_str().unwrap()
    );
    assert!(d.join("bin/ambit-cni").exists());

    // The plugin's socket answers: a pod in a non-ambient namespace is
    // recorded, not enrolled.
    wait_for("the CNI socket", || socket.exists());
    let mut s = UnixStream::connect(&socket).unwrap();
    let req = json!({
        "command": "ADD", "container_id": "c1", "netns": "/proc/self/ns/net", "ifname": "eth0",
        "pod": {"name": "p", "namespace": "web", "uid": "u1"}, "ips": ["10.1.0.5"]
    });
    writeln!(s, "{req}").unwrap();
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    let reply: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(reply["enrolled"], false, "{reply}");

    // SIGTERM: a clean exit.
    let pid = agent.0.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let mut agent = agent;
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = agent.0.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "agent did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");

    // --uninstall restores the original chain.
    let st = args(&["--uninstall"]).status().unwrap();
    assert!(st.success());
    assert_eq!(read_json(&conflist)["plugins"], original["plugins"]);
    assert!(!d.join("bin/ambit-cni").exists());
}
