//! The real `ambit-cni` binary, exec'd as a container runtime does: `CNI_*`
//! environment, network configuration on stdin, result or error JSON on
//! stdout. The node agent is a test listener on a unix socket; one test
//! chains the plugin after Debian's real `bridge` + `host-local`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ambit_cni::protocol::{self, Reply, Request};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_ambit-cni");

struct Run {
    code: i32,
    stdout: Vec<u8>,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not JSON ({e}): {:?} / stderr {}",
                String::from_utf8_lossy(&self.stdout),
                self.stderr
            )
        })
    }

    /// The error JSON's code, checking its shape and the exit status.
    fn error_code(&self) -> u64 {
        assert_ne!(self.code, 0, "expected a failure, stderr: {}", self.stderr);
        let v = self.json();
        assert!(v["cniVersion"].is_string(), "{v}");
        assert!(v["msg"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        v["code"].as_u64().unwrap()
    }

    fn ok(&self) -> &Self {
        assert_eq!(
            self.code,
            0,
            "stdout {} stderr {}",
            String::from_utf8_lossy(&self.stdout),
            self.stderr
        );
        self
    }
}

/// Exec `bin` with exactly `env` and `stdin` (None: no stdin at all).
fn exec(bin: &str, env: &[(&str, String)], stdin: Option<&[u8]>) -> Run {
    let mut cmd = Command::new(bin);
    cmd.env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        });
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    if let Some(data) = stdin {
        // The plugin may exit before reading everything (VERSION).
        let _ = child.stdin.take().unwrap().write_all(data);
    }
    let out = child.wait_with_output().unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: out.stdout,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn plugin(env: &[(&str, String)], stdin: &[u8]) -> Run {
    exec(BIN, env, Some(stdin))
}

fn k8s_env(command: &str, netns: &str, pod: &str) -> Vec<(&'static str, String)> {
    vec![
        ("CNI_COMMAND", command.to_string()),
        ("CNI_CONTAINERID", format!("ctr-{pod}")),
        ("CNI_NETNS", netns.to_string()),
        ("CNI_IFNAME", "eth0".to_string()),
        (
            "CNI_ARGS",
            format!(
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME={pod};\
                 K8S_POD_INFRA_CONTAINER_ID=ctr-{pod};K8S_POD_UID=uid-{pod}"
            ),
        ),
        ("CNI_PATH", "/usr/lib/cni".to_string()),
    ]
}

fn prev_result() -> Value {
    json!({
        "cniVersion": "1.0.0",
        "interfaces": [
            {"name": "abt0", "mac": "aa:bb:cc:dd:ee:01"},
            {"name": "eth0", "mac": "aa:bb:cc:dd:ee:02", "sandbox": "/var/run/netns/p1"}
        ],
        "ips": [{"address": "10.244.7.9/24", "gateway": "10.244.7.1", "interface": 1}],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dns": {}
    })
}

fn ambit_conf(socket: &Path, extra_ambit: Value, prev: Option<Value>) -> Vec<u8> {
    let mut ambit = json!({"agent_socket": socket, "agent_timeout_ms": 3000});
    if let (Value::Object(a), Value::Object(e)) = (&mut ambit, extra_ambit) {
        a.extend(e);
    }
    let mut conf =
        json!({"cniVersion": "1.0.0", "name": "abt-net", "type": "ambit-cni", "ambit": ambit});
    if let Some(prev) = prev {
        conf["prevResult"] = prev;
    }
    conf.to_string().into_bytes()
}

/// A node agent that answers one request with `reply` and returns it.
fn fake_agent(socket: &Path, reply: Reply) -> JoinHandle<Request> {
    let listener = UnixListener::bind(socket).unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < deadline, "the plugin never connected");
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        stream.set_nonblocking(false).unwrap();
        let mut line = String::new();
        BufReader::new(&stream).read_line(&mut line).unwrap();
        let req: Request = serde_json::from_str(&line).unwrap();
        let mut out = serde_json::to_vec(&reply).unwrap();
        out.push(b'\n');
        (&stream).write_all(&out).unwrap();
        req
    })
}

#[test]
fn version() {
    let want =
        json!({"cniVersion":"1.0.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]});
    let env = [("CNI_COMMAND", "VERSION".to_string())];
    // What libcni sends, garbage, and nothing: stdin does not matter.
    for stdin in [&br#"{"cniVersion":"1.0.0"}"#[..], b"garbage", b""] {
        assert_eq!(plugin(&env, stdin).ok().json(), want);
    }
    assert_eq!(exec(BIN, &env, None).ok().json(), want);
}

/// `code | what | stdin`; PREV is a valid prevResult, V1 the required
/// `"cniVersion": "1.0.0", "name": "n", "type": "ambit-cni"`.
const BAD_STDIN: &str = r#"
6 | blank               |
6 | not json            | hello
6 | truncated           | {"cniVersion": "1.0.0",
6 | array               | []
6 | numeric version     | {"cniVersion": 1, "name": "n", "type": "ambit-cni", "prevResult": PREV}
1 | version 9.9.9       | {"cniVersion": "9.9.9", "name": "n", "type": "ambit-cni", "prevResult": PREV}
1 | version missing     | {"name": "n", "type": "ambit-cni", "prevResult": PREV}
7 | prevResult missing  | {V1}
7 | prevResult null     | {V1, "prevResult": null}
7 | prevResult string   | {V1, "prevResult": "x"}
7 | name missing        | {"cniVersion": "1.0.0", "type": "ambit-cni", "prevResult": PREV}
7 | type not string     | {"cniVersion": "1.0.0", "name": "n", "type": [], "prevResult": PREV}
7 | ips not array       | {V1, "prevResult": {"ips": 5}}
7 | ip not CIDR         | {V1, "prevResult": {"ips": [{"address": "nope"}]}}
7 | ambit not object    | {V1, "prevResult": PREV, "ambit": true}
7 | timeout string      | {V1, "prevResult": PREV, "ambit": {"agent_timeout_ms": "5"}}
7 | timeout negative    | {V1, "prevResult": PREV, "ambit": {"agent_timeout_ms": -1}}
7 | timeout zero        | {V1, "prevResult": PREV, "ambit": {"agent_timeout_ms": 0}}
7 | socket number       | {V1, "prevResult": PREV, "ambit": {"agent_socket": 7}}
7 | allow not bool      | {V1, "prevResult": PREV, "ambit": {"allow_without_agent": "yes"}}
2 | ambit unknown key   | {V1, "prevResult": PREV, "ambit": {"allow_without_agnet": true}}
2 | our key at top      | {V1, "prevResult": PREV, "allow_without_agent": true}
"#;

#[test]
fn bad_stdin_is_error_json() {
    let env = k8s_env("ADD", "/var/run/netns/p1", "web-1");
    let prev = prev_result().to_string();
    let v1 = r#""cniVersion": "1.0.0", "name": "n", "type": "ambit-cni""#;
    let mut count = 0;
    for line in BAD_STDIN.lines().filter(|l| !l.trim().is_empty()) {
        let mut parts = line.splitn(3, '|');
        let want: u64 = parts.next().unwrap().trim().parse().unwrap();
        let what = parts.next().unwrap().trim();
        let stdin = parts.next().unwrap().trim();
        let stdin = stdin.replace("PREV", &prev).replace("V1", v1);
        let run = plugin(&env, stdin.as_bytes());
        let got = run.error_code();
        assert_eq!(
            got,
            want,
            "{what}: {}",
            String::from_utf8_lossy(&run.stdout)
        );
        assert!(!run.stderr.contains("panicked"), "{what}: {}", run.stderr);
        count += 1;
    }
    assert_eq!(count, 22);
    // Empty, not UTF-8, and no stdin at all.
    assert_eq!(plugin(&env, b"").error_code(), 6);
    assert_eq!(plugin(&env, &[0xff, 0xfe, 0, 1]).error_code(), 6);
    assert_eq!(exec(BIN, &env, None).error_code(), 6);
}

#[test]
fn bad_environment_is_code_4() {
    let stdin = ambit_conf(
        Path::new("/nonexistent.sock"),
        json!({}),
        Some(prev_result()),
    );
    let run = plugin(&[("CNI_COMMAND", "FROB".into())], &stdin);
    assert_eq!(run.error_code(), 4);
    // Set but empty is still the runtime's call (unset is a person: usage).
    let run = plugin(&[("CNI_COMMAND", String::new())], &stdin);
    assert_eq!(run.error_code(), 4);
    let mut env = k8s_env("ADD", "/var/run/netns/p1", "web-1");
    env.retain(|(k, _)| *k != "CNI_NETNS");
    assert_eq!(plugin(&env, &stdin).error_code(), 4);
}

#[test]
fn del_twice_without_agent_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nobody-listens.sock");
    let env = k8s_env("DEL", "", "never-seen");
    for stdin in [
        ambit_conf(&sock, json!({}), None),
        ambit_conf(&sock, json!({}), Some(prev_result())),
    ] {
        for _ in 0..2 {
            let run = plugin(&env, &stdin);
            run.ok();
            assert!(run.stdout.is_empty());
        }
    }
}

#[test]
fn add_through_fake_agent_returns_prev_result() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let agent = fake_agent(&sock, Reply::ok(true));
    let run = plugin(
        &k8s_env("ADD", "/var/run/netns/p1", "web-1"),
        &ambit_conf(&sock, json!({}), Some(prev_result())),
    );
    run.ok();
    assert_eq!(run.json(), prev_result());
    let req = agent.join().unwrap();
    assert_eq!(req.command, protocol::Command::Add);
    assert_eq!(req.pod.name, "web-1");
    assert_eq!(req.pod.namespace, "demo");
    assert_eq!(req.pod.uid, "uid-web-1");
    assert_eq!(req.container_id, "ctr-web-1");
    assert_eq!(req.netns, PathBuf::from("/var/run/netns/p1"));
    assert_eq!(req.ifname, "eth0");
    assert_eq!(req.ips, vec!["10.244.7.9".parse::<IpAddr>().unwrap()]);
}

#[test]
fn add_with_agent_down() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("down.sock");
    let env = k8s_env("ADD", "/var/run/netns/p1", "web-1");
    let run = plugin(&env, &ambit_conf(&sock, json!({}), Some(prev_result())));
    assert_eq!(run.error_code(), 11);
    assert!(run.json()["msg"].as_str().unwrap().contains("down.sock"));
    let allowed = ambit_conf(
        &sock,
        json!({"allow_without_agent": true}),
        Some(prev_result()),
    );
    let run = plugin(&env, &allowed);
    run.ok();
    assert_eq!(run.json(), prev_result());
    assert!(
        run.stderr.contains("WITHOUT mesh enrollment"),
        "{}",
        run.stderr
    );
}

#[test]
fn add_agent_asks_to_retry() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let agent = fake_agent(&sock, Reply::error("ztunnel is not connected yet", true));
    let env = k8s_env("ADD", "/var/run/netns/p1", "web-1");
    let run = plugin(&env, &ambit_conf(&sock, json!({}), Some(prev_result())));
    assert_eq!(run.error_code(), 11);
    assert!(
        run.json()["msg"]
            .as_str()
            .unwrap()
            .contains("ztunnel is not connected yet")
    );
    agent.join().unwrap();
}

#[test]
fn add_agent_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let agent = fake_agent(&sock, Reply::error("netns is gone", false));
    let env = k8s_env("ADD", "/var/run/netns/p1", "web-1");
    let run = plugin(&env, &ambit_conf(&sock, json!({}), Some(prev_result())));
    assert_eq!(run.error_code(), 999);
    agent.join().unwrap();
}

#[test]
fn non_kubernetes_add_passes_through() {
    let env = vec![
        ("CNI_COMMAND", "ADD".to_string()),
        ("CNI_CONTAINERID", "plain".to_string()),
        ("CNI_NETNS", "/var/run/netns/plain".to_string()),
        ("CNI_IFNAME", "eth0".to_string()),
        ("CNI_ARGS", "IgnoreUnknown=1".to_string()),
        ("CNI_PATH", "/usr/lib/cni".to_string()),
    ];
    let stdin = ambit_conf(
        Path::new("/nonexistent/agent.sock"),
        json!({}),
        Some(prev_result()),
    );
    let run = plugin(&env, &stdin);
    run.ok();
    assert_eq!(run.json(), prev_result());
}

#[test]
fn check_and_status() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let env = k8s_env("CHECK", "/var/run/netns/p1", "web-1");
    let stdin = ambit_conf(&sock, json!({}), Some(prev_result()));
    assert_eq!(plugin(&env, &stdin).error_code(), 11);
    let status_conf = json!({"cniVersion": "1.1.0", "name": "n", "type": "ambit-cni", "ambit": {"agent_socket": sock}});
    let status = vec![("CNI_COMMAND", "STATUS".to_string())];
    assert_eq!(
        plugin(&status, status_conf.to_string().as_bytes()).error_code(),
        50
    );

    let agent = fake_agent(&sock, Reply::error("redirection missing", false));
    assert_eq!(plugin(&env, &stdin).error_code(), 999);
    assert_eq!(agent.join().unwrap().command, protocol::Command::Check);
    std::fs::remove_file(&sock).unwrap();
    let agent = fake_agent(&sock, Reply::ok(true));
    let run = plugin(&env, &stdin);
    run.ok();
    assert!(run.stdout.is_empty());
    agent.join().unwrap();
    // The listener is gone with the thread, but the socket file stays:
    // connecting is refused.
    assert_eq!(
        plugin(&status, status_conf.to_string().as_bytes()).error_code(),
        50
    );
    std::fs::remove_file(&sock).unwrap();
    let _listener = UnixListener::bind(&sock).unwrap();
    plugin(&status, status_conf.to_string().as_bytes()).ok();
    let gc = vec![("CNI_COMMAND", "GC".to_string())];
    plugin(&gc, status_conf.to_string().as_bytes()).ok();
}

#[test]
fn log_file_gets_one_line_per_invocation() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let log = dir.path().join("cni.log");
    let stdin = ambit_conf(&sock, json!({"log_file": log}), Some(prev_result()));
    assert_eq!(
        plugin(&k8s_env("ADD", "/var/run/netns/p1", "web-1"), &stdin).error_code(),
        11
    );
    plugin(&k8s_env("DEL", "", "web-1"), &stdin).ok();
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert_eq!(lines[0]["command"], "ADD");
    assert_eq!(lines[0]["code"], 11);
    assert_eq!(lines[1]["command"], "DEL");
    assert_eq!(lines[1]["result"], "ok");
    assert_eq!(lines[1]["pod"], "demo/web-1");
}

/// Removes the test's netns and bridge whatever happens.
struct Cleanup {
    netns: String,
    bridge: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .status();
    }
}

fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    // /proc/self belongs to the process's effective uid.
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

#[test]
fn chained_after_real_bridge_and_host_local() {
    let (bridge_bin, ipam_bin) = ("/usr/lib/cni/bridge", "/usr/lib/cni/host-local");
    if !Path::new(bridge_bin).exists() || !Path::new(ipam_bin).exists() || !is_root() {
        println!("SKIP: needs root and {bridge_bin}, {ipam_bin} (containernetworking-plugins)");
        return;
    }
    let tag = format!("{:06x}", (std::process::id() ^ nanos()) & 0xff_ffff);
    let guard = Cleanup {
        netns: format!("abt-ns-{tag}"),
        bridge: format!("abt{tag}"),
    };
    let st = Command::new("ip")
        .args(["netns", "add", &guard.netns])
        .status()
        .unwrap();
    assert!(st.success(), "ip netns add");
    let netns_path = format!("/var/run/netns/{}", guard.netns);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let pod = format!("web-{tag}");
    let env = |cmd: &str| k8s_env(cmd, &netns_path, &pod);

    // What a runtime builds from a conflist: each plugin gets name and
    // cniVersion; the chained one gets the previous result.
    let bridge_conf = json!({
        "cniVersion": "1.0.0",
        "name": "abt-test",
        "type": "bridge",
        "bridge": guard.bridge,
        "isGateway": false,
        "ipMasq": false,
        "ipam": {
            "type": "host-local",
            "subnet": "10.244.7.0/24",
            "dataDir": dir.path().join("ipam"),
        }
    });
    let added = exec(
        bridge_bin,
        &env("ADD"),
        Some(bridge_conf.to_string().as_bytes()),
    );
    added.ok();
    let result = added.json();
    let pod_ip: IpAddr = result["ips"][0]["address"]
        .as_str()
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .parse()
        .unwrap();

    let agent = fake_agent(&sock, Reply::ok(true));
    let ours = exec(
        BIN,
        &env("ADD"),
        Some(&ambit_conf(&sock, json!({}), Some(result.clone()))),
    );
    ours.ok();
    assert_eq!(ours.json(), result);
    let req = agent.join().unwrap();
    assert_eq!(req.ips, vec![pod_ip]);
    assert_eq!(req.netns, PathBuf::from(&netns_path));
    assert_eq!(req.pod.name, pod);
    let addrs = Command::new("ip")
        .args([
            "netns",
            "exec",
            &guard.netns,
            "ip",
            "-o",
            "addr",
            "show",
            "dev",
            "eth0",
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&addrs.stdout).contains(&pod_ip.to_string()));

    // DEL in reverse order, each with the cached result as prevResult.
    std::fs::remove_file(&sock).unwrap();
    let agent = fake_agent(&sock, Reply::ok(false));
    exec(
        BIN,
        &env("DEL"),
        Some(&ambit_conf(&sock, json!({}), Some(result.clone()))),
    )
    .ok();
    assert_eq!(agent.join().unwrap().command, protocol::Command::Del);
    let mut del_conf = bridge_conf.clone();
    del_conf["prevResult"] = result.clone();
    exec(
        bridge_bin,
        &env("DEL"),
        Some(del_conf.to_string().as_bytes()),
    )
    .ok();
    let lease = dir
        .path()
        .join("ipam")
        .join("abt-test")
        .join(pod_ip.to_string());
    assert!(
        !lease.exists(),
        "host-local kept the lease {}",
        lease.display()
    );
    // A second DEL through ambit-cni, agent gone: still fine.
    exec(
        BIN,
        &env("DEL"),
        Some(&ambit_conf(&sock, json!({}), Some(result))),
    )
    .ok();
    drop(guard);
}

fn nanos() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0)
}
