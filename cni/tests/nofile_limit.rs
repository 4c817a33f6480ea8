//! ambit-node-agent raises its soft RLIMIT_NOFILE to the hard limit at start and
//! logs it (benches/README.md, "File limits"): started here with a soft
//! limit of 256, it runs with the hard one.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::resource::{Resource, getrlimit};

const BIN: &str = env!("CARGO_BIN_EXE_ambit-node-agent");
const LOW: u64 = 256;

/// Soft and hard "Max open files" of `pid`.
fn open_file_limits(pid: u32) -> Option<(u64, u64)> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let mut f = line["Max open files".len()..].split_whitespace();
    Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
}

/// The binary with `args`, started through `sh` with a soft
/// open-file limit of [`LOW`]; its limits once raised and its log.
fn limits_after_start(args: &[String]) -> ((u64, u64), String) {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -Sn {LOW} && exec \"$0\" \"$@\""))
        .arg(BIN)
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ambit-node-agent");
    let pid = child.id();
    // `sh` runs with the low limit until it execs the binary, which raises it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = None;
    while Instant::now() < deadline {
        seen = open_file_limits(pid);
        if seen.is_some_and(|(soft, _)| soft != LOW) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let mut log = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    let _ = child.wait();
    (seen.expect("read the limits of ambit-node-agent"), log)
}

#[test]
fn raises_its_open_file_limit_to_the_hard_limit() {
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    if hard <= LOW {
        eprintln!("SKIP: the hard open-file limit is only {hard}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for sub in ["config", "bin", "net.d", "state"] {
        std::fs::create_dir(d.join(sub)).unwrap();
    }
    let path = |p: &str| d.join(p).display().to_string();
    let args = [
        "--node-name=node-1".to_string(),
        format!("--config-dir={}", path("config")),
        format!("--state-dir={}", path("state")),
        format!("--cni-socket={}", path("cni.sock")),
        format!("--zds-socket={}", path("zds.sock")),
        format!("--cni-bin-dir={}", path("bin")),
        format!("--cni-conf-dir={}", path("net.d")),
        format!("--plugin-binary={}", env!("CARGO_BIN_EXE_ambit-cni")),
    ];
    let (limits, log) = limits_after_start(&args);
    assert_eq!(
        limits,
        (hard, hard),
        "ambit-node-agent's open-file limits; its log:\n{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("open-file limit (RLIMIT_NOFILE)")
                && l.contains(&format!("limit={hard}"))),
        "the raised limit is logged:\n{log}"
    );
}
