//! Tests of the `ambit-demo` workload binary, run as real processes on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ambit-demo");
const WAIT: Duration = Duration::from_secs(10);
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// A running `ambit-demo`, its stdout read line by line; killed when dropped.
struct Demo {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Demo {
    fn start(args: &[&str]) -> Demo {
        let mut child = Command::new(BIN)
            .args(args)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning ambit-demo");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Demo {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits for the next line matching `pred` (lines already seen are skipped).
    fn wait_line(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if pred(&line) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no log line {what} within {WAIT:?}; lines so far:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// The port of the `listening http|tcp addr=...` line.
    fn port(&mut self, kind: &str) -> u16 {
        let prefix = format!("listening {kind} addr=");
        let line = self.wait_line(&prefix, |l| l.contains(&prefix));
        let addr = line
            .split(&prefix)
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap();
        addr.parse::<SocketAddr>().unwrap().port()
    }

    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "ambit-demo did not exit within {WAIT:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP server on loopback: `(demo, port)`.
fn http_server(name: &str, extra: &[&str]) -> (Demo, u16) {
    let mut args = vec![
        "--name",
        name,
        "--namespace",
        "test-ns",
        "--bind",
        "127.0.0.1",
        "--http",
        "0",
    ];
    args.extend_from_slice(extra);
    let mut demo = Demo::start(&args);
    let port = demo.port("http");
    (demo, port)
}

/// A one-request HTTP/1.1 GET with `Connection: close`: `(status, body, our address)`.
fn get(port: u16, path: &str) -> (u16, String, SocketAddr) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let local = s.local_addr().unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, body.to_string(), local)
}

/// Runs `ambit-demo ARGS` to completion: `(exit code, stdout, stderr)`.
fn run(args: &[&str]) -> (i32, String, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        out.read_to_string(&mut s).unwrap();
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        err.read_to_string(&mut s).unwrap();
        s
    });
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("ambit-demo {args:?} did not exit within {WAIT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (
        status.code().unwrap_or(-1),
        out.join().unwrap(),
        err.join().unwrap(),
    )
}

/// A loopback port with nothing listening on it.
fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

#[test]
fn http_serves_json_and_healthz() {
    let (mut demo, port) = http_server("web-0", &[]);

    let (status, body, local) = get(port, "/some/path?q=1");
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["service"], "web-0");
    assert_eq!(v["namespace"], "test-ns");
    assert_eq!(v["path"], "/some/path");
    assert_eq!(
        v["peer"],
        local.to_string(),
        "the peer is the TCP peer the app saw"
    );
    assert_eq!(v["calls"], Value::Array(vec![]));
    demo.wait_line("for the request", |l| {
        l.contains(" http ")
            && l.contains("path=/some/path")
            && l.contains(&format!("peer={local}"))
    });

    let (status, body, _) = get(port, "/healthz");
    assert_eq!((status, body.as_str()), (200, "ok"));
    demo.wait_line("for /healthz", |l| {
        l.contains("path=/healthz") && l.contains("status=200")
    });
}

#[test]
fn forward_chain_nests_calls() {
    let (_c, c_port) = http_server("vector-db-0", &[]);
    let c_url = format!("http://127.0.0.1:{c_port}/search");
    let (_b, b_port) = http_server("embedding-0", &["--forward", &c_url]);
    let b_url = format!("http://127.0.0.1:{b_port}/embed");
    let (mut a, a_port) = http_server("orchestrator-0", &["--forward", &b_url]);

    let (status, body, _) = get(a_port, "/ask");
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["service"], "orchestrator-0");
    let to_b = &v["calls"][0];
    assert_eq!(to_b["url"], b_url.as_str());
    assert_eq!(to_b["status"], 200);
    assert_eq!(to_b["body"]["service"], "embedding-0");
    assert_eq!(to_b["body"]["path"], "/embed");
    let to_c = &to_b["body"]["calls"][0];
    assert_eq!(to_c["url"], c_url.as_str());
    assert_eq!(to_c["status"], 200);
    assert_eq!(to_c["body"]["service"], "vector-db-0");
    assert_eq!(to_c["body"]["path"], "/search");
    assert_eq!(to_c["body"]["calls"], Value::Array(vec![]));
    a.wait_line("for the request", |l| {
        l.contains("path=/ask") && l.contains("calls=1")
    });
}

#[test]
fn forward_failure_answers_502_with_the_error() {
    let (_ok, ok_port) = http_server("up-0", &[]);
    let up = format!("http://127.0.0.1:{ok_port}/");
    let down = format!("http://127.0.0.1:{}/", closed_port());
    let (mut a, a_port) = http_server("front-0", &["--forward", &up, "--forward", &down]);

    let (status, body, _) = get(a_port, "/");
    assert_eq!(status, 502, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["calls"][0]["status"], 200);
    assert_eq!(v["calls"][0]["body"]["service"], "up-0");
    assert_eq!(v["calls"][1]["url"], down.as_str());
    let error = v["calls"][1]["error"].as_str().unwrap();
    assert!(error.contains("connection refused"), "{error}");
    a.wait_line("naming the failed hop", |l| {
        l.contains("forward") && l.contains(&down)
    });
}

#[test]
fn tcp_echo_half_close() {
    let mut demo = Demo::start(&["--name", "echo-0", "--bind", "127.0.0.1", "--tcp", "0"]);
    let port = demo.port("tcp");

    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    // Write from another thread so neither side blocks on full buffers.
    let mut writer = s.try_clone().unwrap();
    let sent = payload.clone();
    let w = std::thread::spawn(move || {
        writer.write_all(&sent).unwrap();
        writer.shutdown(Shutdown::Write).unwrap();
    });
    // The echo ends with EOF only because the server closes its write side after ours.
    let mut back = Vec::new();
    s.read_to_end(&mut back).unwrap();
    w.join().unwrap();
    assert_eq!(back.len(), payload.len());
    assert!(back == payload, "echo differs");
    demo.wait_line("for the connection", |l| {
        l.contains("tcp echo") && l.contains(&format!("bytes={}", payload.len()))
    });

    // The periodic client's echo check, once.
    let (code, out, err) = run(&["--tcp-call", &format!("127.0.0.1:{port}"), "--once"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ok"], true);
    assert!(v["tcp_calls"][0]["bytes"].as_u64().unwrap() > 0);
}

#[test]
fn call_once_exit_codes() {
    let (_web, port) = http_server("web-0", &[]);

    let url = format!("http://127.0.0.1:{port}/hello");
    let (code, out, err) = run(&["--name", "client-0", "--call", &url, "--once"]);
    assert_eq!(code, 0, "{out}\n{err}");
    let v: Value = serde_json::from_str(&out).expect("stdout is the JSON results only");
    assert_eq!(v["ok"], true);
    assert_eq!(v["service"], "client-0");
    assert_eq!(v["calls"][0]["url"], url.as_str());
    assert_eq!(v["calls"][0]["status"], 200);
    assert_eq!(v["calls"][0]["body"]["service"], "web-0");
    assert!(
        err.contains("call url=") && err.contains("status=200"),
        "logs go to stderr: {err}"
    );

    let dead = format!("http://127.0.0.1:{}/", closed_port());
    let (code, out, err) = run(&["--call", &url, "--call", &dead, "--once"]);
    assert_eq!(code, 1, "{out}\n{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["calls"][0]["status"], 200);
    let error = v["calls"][1]["error"].as_str().unwrap();
    assert!(error.contains("connection refused"), "{error}");
    assert!(err.contains("error=\"connect to"), "{err}");
}

#[test]
fn call_once_times_out_on_a_silent_server() {
    // Accepts (the kernel does) but never answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/", silent.local_addr().unwrap());
    let started = Instant::now();
    let (code, out, err) = run(&["--call", &url, "--timeout", "300ms", "--once"]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["calls"][0]["error"], "timed out after 300ms");
}

#[test]
fn periodic_call_logs_a_line_per_call() {
    let (_web, port) = http_server("web-0", &[]);
    let url = format!("http://127.0.0.1:{port}/tick");
    let dead = format!("http://127.0.0.1:{}/", closed_port());
    let mut client = Demo::start(&[
        "--name",
        "legacy-client",
        "--call",
        &url,
        "--call",
        &dead,
        "--every",
        "100ms",
    ]);
    for _ in 0..3 {
        let line = client.wait_line("for a good call", |l| {
            l.contains(&format!("call url={url} status=200 ms="))
                && l.contains("peer_seen_by_server=127.0.0.1:")
        });
        assert!(line.contains("server=web-0"), "{line}");
        client.wait_line("for a refused call", |l| {
            l.contains(&format!("call url={dead}"))
                && l.contains("error=\"")
                && l.contains("connection refused")
        });
    }
}

#[test]
fn sigterm_exits_cleanly() {
    let (mut demo, _) = http_server(
        "web-0",
        &[
            "--tcp",
            "0",
            "--call",
            "http://127.0.0.1:9/",
            "--every",
            "1s",
        ],
    );
    demo.port("tcp");
    let killed = Command::new("kill")
        .args(["-TERM", &demo.child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = demo.wait_exit();
    assert!(status.success(), "exit status {status:?}");
    demo.wait_line("on shutdown", |l| {
        l.contains("shutting down") && l.contains("SIGTERM")
    });
}

#[test]
fn bad_arguments_are_rejected_clearly() {
    for (args, says) in [
        (&[][..], "nothing to do"),
        (&["--http", "0", "--once"][..], "--once needs"),
        (&["--call", "https://x/", "--once"][..], "only http://"),
        (&["--call", "nonsense", "--once"][..], "expected http://"),
        (
            &["--tcp-call", "host-without-port", "--once"][..],
            "not HOST:PORT",
        ),
        (
            &["--call", "http://x/", "--every", "soon"][..],
            "not a duration",
        ),
        (&["--forward", "http://x/"][..], "needs --http"),
    ] {
        let (code, out, err) = run(args);
        assert_eq!(code, 2, "{args:?}: {out}\n{err}");
        assert!(err.contains(says), "{args:?} should say {says:?}: {err}");
    }
    // A port already taken is named.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let (code, _, err) = run(&["--bind", "127.0.0.1", "--http", &port]);
    assert_eq!(code, 2);
    assert!(
        err.contains(&format!("binding the HTTP port 127.0.0.1:{port}")),
        "{err}"
    );
}
