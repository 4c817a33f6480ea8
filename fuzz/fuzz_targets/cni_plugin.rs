//! The CNI plugin's handling of one invocation: `CNI_*` environment +
//! stdin → outcome (`ambit_cni::plugin::run_with`), against a scripted
//! node agent. The agent's side of the exchange is checked too: every
//! request the plugin sends decodes as the agent decodes it.
//!
//! Input: `KEY=VALUE` lines (`CNI_COMMAND`, `CNI_CONTAINERID`, `CNI_NETNS`,
//! `CNI_IFNAME`, `CNI_ARGS`, `CNI_PATH`, and `AGENT` = ok | unenrolled |
//! refuse | retry | down | bad), an empty line, then stdin. Without an
//! empty line the whole input is stdin of an ADD.
//!
//! Checks: no panic; exit code 0 or 1; a failure prints the CNI error JSON
//! (`cniVersion`, numeric `code`, non-empty `msg`); ADD and VERSION print
//! a JSON object on success; the log line, when there is one, is JSON.
#![no_main]

use std::path::Path;
use std::time::Duration;

use ambit_cni::plugin::{Agent, AgentError, Env, run_with};
use ambit_cni::protocol::{Reply, Request};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

struct Scripted(String);

impl Agent for Scripted {
    fn request(&self, _: &Path, r: &Request, _: Duration) -> Result<Reply, AgentError> {
        // What the agent does with the line the plugin sends.
        let line = serde_json::to_string(r).map_err(|e| AgentError::Exchange(e.to_string()))?;
        let back: Request = serde_json::from_str(&line).map_err(|e| {
            AgentError::BadReply(format!("the agent cannot read the plugin's request: {e}"))
        })?;
        assert_eq!(&back, r, "request does not survive the agent's decoding");
        match self.0.as_str() {
            "unenrolled" => Ok(Reply::ok(false)),
            "refuse" => Ok(Reply::error("pod refused", false)),
            "retry" => Ok(Reply::error("not ready", true)),
            "down" => Err(AgentError::Unreachable("connection refused".into())),
            "bad" => Err(AgentError::BadReply("garbage".into())),
            _ => Ok(Reply::ok(true)),
        }
    }

    fn probe(&self, _: &Path, _: Duration) -> Result<(), AgentError> {
        match self.0.as_str() {
            "down" => Err(AgentError::Unreachable("connection refused".into())),
            _ => Ok(()),
        }
    }
}

fn split(data: &[u8]) -> (Env, String, &[u8]) {
    let mut env = Env {
        command: Some("ADD".into()),
        container_id: Some("c0ffee".into()),
        netns: Some("/var/run/netns/pod1".into()),
        ifname: Some("eth0".into()),
        args: Some("K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web-1;K8S_POD_UID=u-1".into()),
        path: Some("/opt/cni/bin".into()),
        not_unicode: Vec::new(),
    };
    let mut agent = "ok".to_string();
    let Some(pos) = data.windows(2).position(|w| w == b"\n\n") else {
        return (env, agent, data);
    };
    let (head, stdin) = (&data[..pos], &data[pos + 2..]);
    for line in String::from_utf8_lossy(head).lines() {
        let (key, value) = line.split_once('=').unwrap_or((line, ""));
        // A key without `=` is unset, with `=` it is set (maybe empty).
        let value = line.contains('=').then(|| value.to_string());
        match key {
            "CNI_COMMAND" => env.command = value,
            "CNI_CONTAINERID" => env.container_id = value,
            "CNI_NETNS" => env.netns = value,
            "CNI_IFNAME" => env.ifname = value,
            "CNI_ARGS" => env.args = value,
            "CNI_PATH" => env.path = value,
            "AGENT" => agent = value.unwrap_or_default(),
            "NOT_UNICODE" => env.not_unicode.push("CNI_ARGS".into()),
            _ => {}
        }
    }
    (env, agent, stdin)
}

const PREV: &str = r#"{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/pod1"}],"ips":[{"address":"10.244.7.5/24","gateway":"10.244.7.1","interface":0},{"address":"fd00::5/64","interface":0}],"dns":{}}"#;

fn seeds() -> Vec<(String, Vec<u8>)> {
    let confs = [
        ("v1", format!(r#"{{"cniVersion":"1.0.0","name":"net","type":"ambit-cni","prevResult":{PREV}}}"#)),
        ("v040", format!(r#"{{"cniVersion":"0.4.0","name":"n","type":"ambit-cni","prevResult":{PREV}}}"#)),
        ("v031-bridge", format!(r#"{{"cniVersion":"0.3.1","name":"k8s-pod-network","type":"ambit-cni","runtimeConfig":{{"portMappings":[]}},"prevResult":{PREV}}}"#)),
        ("ambit-opts", format!(r#"{{"cniVersion":"1.0.0","name":"abt-net","type":"ambit-cni","ambit":{{"agent_socket":"/var/run/ambit/cni.sock","agent_timeout_ms":5000,"allow_without_agent":true,"log_file":"/tmp/ambit-cni-fuzz.log"}},"prevResult":{PREV}}}"#)),
        ("no-prev", r#"{"cniVersion":"1.0.0","name":"n","type":"ambit-cni"}"#.to_string()),
        ("bad-ip", r#"{"cniVersion":"1.0.0","name":"n","type":"ambit-cni","prevResult":{"ips":[{"address":"nope"}]}}"#.to_string()),
        ("unknown-key", format!(r#"{{"cniVersion":"1.0.0","name":"n","type":"ambit-cni","prevResult":{PREV},"ambit":{{"allow_without_agnet":true}}}}"#)),
    ];
    let heads = [
        (
            "add",
            "CNI_COMMAND=ADD\nCNI_CONTAINERID=c0ffee\nCNI_NETNS=/var/run/netns/pod1\nCNI_IFNAME=eth0\nCNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web-1;K8S_POD_INFRA_CONTAINER_ID=c0ffee;K8S_POD_UID=u-1\nAGENT=ok",
        ),
        (
            "check-refused",
            "CNI_COMMAND=CHECK\nCNI_CONTAINERID=c0ffee\nCNI_NETNS=/var/run/netns/pod1\nCNI_IFNAME=eth0\nCNI_ARGS=K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web-1\nAGENT=refuse",
        ),
        (
            "del-down",
            "CNI_COMMAND=DEL\nCNI_CONTAINERID=c0ffee\nCNI_ARGS=K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web-1\nAGENT=down",
        ),
        ("status", "CNI_COMMAND=STATUS\nAGENT=down"),
        ("version", "CNI_COMMAND=VERSION"),
        ("gc", "CNI_COMMAND=GC"),
        (
            "add-no-pod",
            "CNI_COMMAND=ADD\nCNI_ARGS=IgnoreUnknown=1\nAGENT=retry",
        ),
    ];
    let mut out = Vec::new();
    for (h, head) in heads {
        for (c, conf) in &confs {
            out.push((format!("{h}-{c}"), format!("{head}\n\n{conf}").into_bytes()));
        }
    }
    out
}

fuzz_target!(
    init: {
        if let Some(dir) = ambit_fuzz::seeds_requested() {
            ambit_fuzz::write_seeds(&dir, seeds());
        }
    },
    |data: &[u8]| {
        let (env, agent, stdin) = split(data);
        let out = run_with(&env, stdin, &Scripted(agent));
        assert!(out.exit_code == 0 || out.exit_code == 1, "exit code {}", out.exit_code);
        if out.exit_code == 1 {
            let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
                panic!("error output is not JSON ({e}): {:?}", String::from_utf8_lossy(&out.stdout))
            });
            assert!(v["cniVersion"].is_string(), "{v}");
            assert!(v["code"].is_u64(), "{v}");
            assert!(v["msg"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        } else if matches!(env.command.as_deref(), Some("ADD" | "VERSION")) {
            let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
                panic!("result is not JSON ({e}): {:?}", String::from_utf8_lossy(&out.stdout))
            });
            assert!(v.is_object() && v["cniVersion"].is_string(), "{v}");
        }
        if let Some(line) = &out.log {
            assert!(serde_json::from_str::<Value>(line).is_ok(), "log line {line:?}");
        }
    }
);
