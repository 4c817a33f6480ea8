use std::cell::RefCell;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use super::*;

/// A scripted agent that records what it is asked.
struct Fake {
    answer: Result<Reply, AgentError>,
    probe: Result<(), AgentError>,
    seen: RefCell<Vec<(Request, Duration)>>,
}

impl Fake {
    fn replying(answer: Result<Reply, AgentError>) -> Self {
        Self {
            answer,
            probe: Ok(()),
            seen: RefCell::new(Vec::new()),
        }
    }
    fn down() -> Self {
        Self {
            answer: Err(AgentError::Unreachable("connection refused".into())),
            probe: Err(AgentError::Unreachable("connection refused".into())),
            seen: RefCell::new(Vec::new()),
        }
    }
}

impl Agent for Fake {
    fn request(&self, _: &Path, r: &Request, t: Duration) -> Result<Reply, AgentError> {
        self.seen.borrow_mut().push((r.clone(), t));
        self.answer.clone()
    }
    fn probe(&self, _: &Path, _: Duration) -> Result<(), AgentError> {
        self.probe.clone()
    }
}

fn env(command: &str) -> Env {
    Env {
        command: Some(command.into()),
        container_id: Some("c0ffee".into()),
        netns: Some("/var/run/netns/pod1".into()),
        ifname: Some("eth0".into()),
        args: Some(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web-1;\
             K8S_POD_INFRA_CONTAINER_ID=c0ffee;K8S_POD_UID=u-1"
                .into(),
        ),
        path: Some("/opt/cni/bin".into()),
        not_unicode: Vec::new(),
    }
}

fn prev() -> Value {
    json!({
        "cniVersion": "1.0.0",
        "interfaces": [{"name": "eth0", "sandbox": "/var/run/netns/pod1"}],
        "ips": [
            {"address": "10.244.7.5/24", "gateway": "10.244.7.1", "interface": 0},
            {"address": "fd00::5/64", "interface": 0}
        ],
        "dns": {}
    })
}

fn conf(extra: Value) -> Vec<u8> {
    let mut c =
        json!({"cniVersion": "1.0.0", "name": "net", "type": "ambit-cni", "prevResult": prev()});
    if let (Value::Object(c), Value::Object(extra)) = (&mut c, extra) {
        c.extend(extra);
    }
    c.to_string().into_bytes()
}

fn code(out: &Outcome) -> u64 {
    assert_ne!(out.exit_code, 0, "expected a failure: {out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["msg"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    v["code"].as_u64().unwrap()
}

fn stdout_json(out: &Outcome) -> Value {
    assert_eq!(out.exit_code, 0, "{}", String::from_utf8_lossy(&out.stdout));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn add_reports_the_pod_and_returns_prev_result() {
    let agent = Fake::replying(Ok(Reply::ok(true)));
    let out = run_with(&env("ADD"), &conf(json!({})), &agent);
    assert_eq!(stdout_json(&out), prev());
    let seen = agent.seen.borrow();
    let (req, timeout) = &seen[0];
    assert_eq!(req.command, Command::Add);
    assert_eq!(req.pod.name, "web-1");
    assert_eq!(req.pod.namespace, "demo");
    assert_eq!(req.pod.uid, "u-1");
    assert_eq!(req.container_id, "c0ffee");
    assert_eq!(req.netns, PathBuf::from("/var/run/netns/pod1"));
    assert_eq!(req.ifname, "eth0");
    let ips: Vec<IpAddr> = vec!["10.244.7.5".parse().unwrap(), "fd00::5".parse().unwrap()];
    assert_eq!(req.ips, ips);
    assert_eq!(*timeout, Duration::from_millis(5000));
}

#[test]
fn add_output_takes_the_config_version() {
    let agent = Fake::replying(Ok(Reply::ok(false)));
    let c = json!({"cniVersion": "0.4.0", "name": "n", "type": "ambit-cni", "prevResult": prev()});
    let out = run_with(&env("ADD"), c.to_string().as_bytes(), &agent);
    let mut want = prev();
    want["cniVersion"] = json!("0.4.0");
    assert_eq!(stdout_json(&out), want);
}

#[test]
fn bad_stdin_codes() {
    let agent = Fake::down();
    let cases: Vec<(&[u8], u64)> = vec![
        (b"", 6),
        (b"  \n", 6),
        (b"not json", 6),
        (b"{\"cniVersion\":", 6),
        (b"[1,2]", 6),
        (br#"{"cniVersion": 1, "name":"n","type":"t"}"#, 6),
        (br#"{"cniVersion": "9.9.9", "name":"n","type":"t"}"#, 1),
        (br#"{"name":"n","type":"t","prevResult":{}}"#, 1),
        (br#"{"cniVersion":"1.0.0","name":"n","type":"t"}"#, 7),
        (br#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":[]}"#, 7),
        (br#"{"cniVersion":"1.0.0","type":"t","prevResult":{}}"#, 7),
        (br#"{"cniVersion":"1.0.0","name":5,"type":"t","prevResult":{}}"#, 7),
        (br#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":{"ips":"x"}}"#, 7),
        (br#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":{"ips":[{"address":"10.0.0.1/99"}]}}"#, 7),
        (br#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":{},"ambit":"x"}"#, 7),
        (br#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":{},"ambit":{"agent_timeout_ms":"5"}}"#, 7),
        (br#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":{},"ambit":{"agent_timeout_ms":0}}"#, 7),
        (br#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":{},"ambit":{"allow_without_agent":"yes"}}"#, 7),
        (br#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":{},"ambit":{"agent_sock":"/x"}}"#, 2),
        (br#"{"cniVersion":"1.0.0","name":"n","type":"t","prevResult":{},"agent_socket":"/x"}"#, 2),
    ];
    for (stdin, want) in cases {
        let out = run_with(&env("ADD"), stdin, &agent);
        assert_eq!(code(&out), want, "{}", String::from_utf8_lossy(stdin));
    }
    assert!(agent.seen.borrow().is_empty());
}

#[test]
fn error_json_shape() {
    let out = run_with(
        &env("ADD"),
        br#"{"cniVersion":"0.3.1","name":"n","type":"t"}"#,
        &Fake::down(),
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cniVersion"], "0.3.1");
    assert_eq!(v["code"], 7);
    assert!(v["msg"].as_str().unwrap().contains("prevResult"));
    assert!(v["details"].as_str().is_some());
    // Unknown version: reported in ours.
    let out = run_with(&env("ADD"), br#"{"cniVersion":"9.9.9"}"#, &Fake::down());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["cniVersion"], "1.0.0");
}

#[test]
fn unknown_top_level_keys_are_ignored() {
    let agent = Fake::replying(Ok(Reply::ok(true)));
    let c = conf(
        json!({"runtimeConfig": {"portMappings": []}, "capabilities": {"x": true}, "args": {}}),
    );
    assert_eq!(stdout_json(&run_with(&env("ADD"), &c, &agent)), prev());
}

#[test]
fn env_problems_are_code_4() {
    let agent = Fake::replying(Ok(Reply::ok(true)));
    let mut e = env("ADD");
    e.command = None;
    assert_eq!(code(&run_with(&e, &conf(json!({})), &agent)), 4);
    assert_eq!(code(&run_with(&env("FROB"), &conf(json!({})), &agent)), 4);
    for unset in ["container_id", "netns", "ifname"] {
        let mut e = env("ADD");
        match unset {
            "container_id" => e.container_id = None,
            "netns" => e.netns = None,
            _ => e.ifname = Some(String::new()),
        }
        assert_eq!(code(&run_with(&e, &conf(json!({})), &agent)), 4, "{unset}");
    }
    let mut e = env("ADD");
    e.args = Some("IgnoreUnknown=1;garbage;K8S_POD_NAME=x;K8S_POD_NAMESPACE=y".into());
    assert_eq!(code(&run_with(&e, &conf(json!({})), &agent)), 4);
    e.args = Some("K8S_POD_NAME=x".into());
    assert_eq!(code(&run_with(&e, &conf(json!({})), &agent)), 4);
    e.not_unicode = vec!["CNI_NETNS".into()];
    assert_eq!(code(&run_with(&e, &conf(json!({})), &agent)), 4);
    assert!(agent.seen.borrow().is_empty());
}

#[test]
fn add_agent_failures() {
    let down = Fake::down();
    assert_eq!(code(&run_with(&env("ADD"), &conf(json!({})), &down)), 11);
    let timeout = Fake::replying(Err(AgentError::Exchange("timed out".into())));
    assert_eq!(code(&run_with(&env("ADD"), &conf(json!({})), &timeout)), 11);
    let retry = Fake::replying(Ok(Reply::error("ztunnel not connected", true)));
    let out = run_with(&env("ADD"), &conf(json!({})), &retry);
    assert_eq!(code(&out), 11);
    assert!(String::from_utf8_lossy(&out.stdout).contains("ztunnel not connected"));
    let refused = Fake::replying(Ok(Reply::error("no such pod", false)));
    assert_eq!(
        code(&run_with(&env("ADD"), &conf(json!({})), &refused)),
        999
    );
    let garbage = Fake::replying(Err(AgentError::BadReply("eh".into())));
    let allow = conf(json!({"ambit": {"allow_without_agent": true}}));
    assert_eq!(code(&run_with(&env("ADD"), &allow, &garbage)), 999);
}

#[test]
fn add_allow_without_agent() {
    let allow = conf(json!({"ambit": {"allow_without_agent": true}}));
    let out = run_with(&env("ADD"), &allow, &Fake::down());
    assert_eq!(stdout_json(&out), prev());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("WITHOUT mesh enrollment"), "{stderr}");
    // An explicit refusal still fails.
    let refused = Fake::replying(Ok(Reply::error("no", false)));
    assert_eq!(code(&run_with(&env("ADD"), &allow, &refused)), 999);
}

#[test]
fn add_without_k8s_args_passes_through() {
    let agent = Fake::down();
    for args in [None, Some("IgnoreUnknown=1"), Some("")] {
        let mut e = env("ADD");
        e.args = args.map(String::from);
        assert_eq!(stdout_json(&run_with(&e, &conf(json!({})), &agent)), prev());
    }
    assert!(agent.seen.borrow().is_empty());
}

#[test]
fn del_always_succeeds_quietly() {
    let no_prev = br#"{"cniVersion":"1.0.0","name":"n","type":"ambit-cni"}"#;
    for agent in [
        Fake::down(),
        Fake::replying(Ok(Reply::error("boom", false))),
        Fake::replying(Err(AgentError::BadReply("eh".into()))),
        Fake::replying(Ok(Reply::ok(false))),
    ] {
        for stdin in [&no_prev[..], &conf(json!({}))[..]] {
            let mut e = env("DEL");
            e.netns = None;
            let out = run_with(&e, stdin, &agent);
            assert_eq!(out.exit_code, 0, "{out:?}");
            assert!(out.stdout.is_empty());
        }
        let seen = agent.seen.borrow();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0].0.command, Command::Del);
        assert!(seen[0].0.ips.is_empty());
        assert_eq!(seen[1].0.ips.len(), 2);
        assert!(seen[0].1 <= DEL_TIMEOUT);
    }
    // Malformed CNI_ARGS: DEL still succeeds, the agent is not told.
    let agent = Fake::down();
    let mut e = env("DEL");
    e.args = Some("K8S_POD_NAME=x;junk".into());
    assert_eq!(run_with(&e, no_prev, &agent).exit_code, 0);
    assert!(agent.seen.borrow().is_empty());
}

#[test]
fn check() {
    let ok = Fake::replying(Ok(Reply::ok(true)));
    let out = run_with(&env("CHECK"), &conf(json!({})), &ok);
    assert_eq!((out.exit_code, out.stdout.len()), (0, 0));
    assert_eq!(ok.seen.borrow()[0].0.command, Command::Check);
    let not_ok = Fake::replying(Ok(Reply::error("rules missing", false)));
    assert_eq!(
        code(&run_with(&env("CHECK"), &conf(json!({})), &not_ok)),
        999
    );
    assert_eq!(
        code(&run_with(&env("CHECK"), &conf(json!({})), &Fake::down())),
        11
    );
    let allow = conf(json!({"ambit": {"allow_without_agent": true}}));
    assert_eq!(run_with(&env("CHECK"), &allow, &Fake::down()).exit_code, 0);
    let no_prev = br#"{"cniVersion":"1.0.0","name":"n","type":"ambit-cni"}"#;
    assert_eq!(code(&run_with(&env("CHECK"), no_prev, &ok)), 7);
}

#[test]
fn version_status_gc() {
    let out = run_with(&env("VERSION"), b"", &Fake::down());
    assert_eq!(
        stdout_json(&out),
        json!({"cniVersion":"1.0.0","supportedVersions":["0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]})
    );
    let c = br#"{"cniVersion":"1.1.0","name":"n","type":"ambit-cni"}"#;
    let ok = Fake::replying(Ok(Reply::ok(true)));
    assert_eq!(run_with(&env("STATUS"), c, &ok).exit_code, 0);
    assert_eq!(code(&run_with(&env("STATUS"), c, &Fake::down())), 50);
    let allow = br#"{"cniVersion":"1.1.0","name":"n","type":"ambit-cni","ambit":{"allow_without_agent":true}}"#;
    assert_eq!(run_with(&env("STATUS"), allow, &Fake::down()).exit_code, 0);
    let out = run_with(&env("GC"), c, &Fake::down());
    assert_eq!((out.exit_code, out.stdout.len()), (0, 0));
    assert_eq!(code(&run_with(&env("GC"), b"", &Fake::down())), 6);
}

#[test]
fn log_line_per_invocation() {
    let c = conf(json!({"ambit": {"log_file": "/tmp/x.log"}}));
    let out = run_with(&env("ADD"), &c, &Fake::down());
    assert_eq!(out.log_file, Some(PathBuf::from("/tmp/x.log")));
    let line: Value = serde_json::from_str(out.log.as_deref().unwrap()).unwrap();
    assert_eq!(line["command"], "ADD");
    assert_eq!(line["pod"], "demo/web-1");
    assert_eq!(line["result"], "error");
    assert_eq!(line["code"], 11);
    let out = run_with(&env("ADD"), &conf(json!({})), &Fake::down());
    assert_eq!(out.log, None);
}

#[test]
fn cidr_and_args_parsing() {
    assert_eq!(
        config::parse_cidr_ip("10.1.2.3/24"),
        "10.1.2.3".parse().ok()
    );
    assert_eq!(config::parse_cidr_ip("10.1.2.3"), "10.1.2.3".parse().ok());
    assert_eq!(config::parse_cidr_ip("fd00::1/128"), "fd00::1".parse().ok());
    assert_eq!(config::parse_cidr_ip("10.1.2.3/33"), None);
    assert_eq!(config::parse_cidr_ip("10.1.2/24"), None);
    assert_eq!(config::parse_cidr_ip("fd00::1/x"), None);
    let args = config::parse_cni_args("IgnoreUnknown=1;;K8S_POD_NAME=a=b;").unwrap();
    assert_eq!(args.get("K8S_POD_NAME").map(String::as_str), Some("a=b"));
    assert!(config::parse_cni_args("=1").is_err());
}

#[test]
fn real_socket_missing_is_unreachable() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("none.sock");
    let req = Request {
        command: Command::Add,
        container_id: "c".into(),
        netns: PathBuf::new(),
        ifname: String::new(),
        pod: PodRef {
            name: "p".into(),
            namespace: "n".into(),
            uid: String::new(),
        },
        ips: Vec::new(),
    };
    let err = UnixAgent
        .request(&sock, &req, Duration::from_millis(200))
        .unwrap_err();
    assert!(matches!(err, AgentError::Unreachable(_)), "{err:?}");
    assert!(UnixAgent.probe(&sock, Duration::from_millis(200)).is_err());
    // A listener that never answers: the exchange times out.
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let start = std::time::Instant::now();
    let err = UnixAgent
        .request(&sock, &req, Duration::from_millis(300))
        .unwrap_err();
    assert!(matches!(err, AgentError::Exchange(_)), "{err:?}");
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(UnixAgent.probe(&sock, Duration::from_millis(200)).is_ok());
}
