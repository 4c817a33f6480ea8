//! Shared by the `nofile_limit` tests of ztunnel, ambit-control and
//! ambit-node-agent (each includes it with `#[path]`, as each binary is
//! only reachable from its own crate's tests): the binary, started through
//! `sh` with a soft open-file limit of [`LOW`], must run with the hard
//! limit and log it (benches/README.md, "File limits").

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::resource::{Resource, getrlimit};

const LOW: u64 = 256;

/// Soft and hard "Max open files" of `pid`.
fn open_file_limits(pid: u32) -> Option<(u64, u64)> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let mut f = line["Max open files".len()..].split_whitespace();
    Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
}

/// Appends what `from` yields to `log`, on a thread.
fn collect(mut from: Box<dyn Read + Send>, log: Arc<Mutex<String>>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 {
                break;
            }
            log.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    })
}

/// The binary with `args`, started through `sh` with a soft
/// open-file limit of [`LOW`]; its limits once raised and its log.
fn limits_after_start(bin: &str, args: &[String]) -> ((u64, u64), String) {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -Sn {LOW} && exec \"$0\" \"$@\""))
        .arg(bin)
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start {bin}: {e}"));
    let pid = child.id();
    let log = Arc::new(Mutex::new(String::new()));
    let out = child.stdout.take().unwrap();
    let err = child.stderr.take().unwrap();
    let readers = [
        collect(Box::new(out), log.clone()),
        collect(Box::new(err), log.clone()),
    ];
    // `sh` runs with the low limit until it execs the binary, which raises
    // it, then logs it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = None;
    while Instant::now() < deadline {
        seen = open_file_limits(pid);
        let logged = log.lock().unwrap().contains("RLIMIT_NOFILE");
        if logged && seen.is_some_and(|(soft, _)| soft != LOW) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    for r in readers {
        let _ = r.join();
    }
    let log = log.lock().unwrap().clone();
    (
        seen.unwrap_or_else(|| panic!("read the limits of {bin}")),
        log,
    )
}

/// Starts `bin` with `args` under a low soft limit and checks it raised
/// it to the hard limit and logged so; SKIP when the hard limit is low.
pub fn check_raised(bin: &str, args: &[String]) {
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    if hard <= LOW {
        eprintln!("SKIP: the hard open-file limit is only {hard}");
        return;
    }
    let (limits, log) = limits_after_start(bin, args);
    assert_eq!(
        limits,
        (hard, hard),
        "{bin}'s open-file limits; its log:\n{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("open-file limit (RLIMIT_NOFILE)")
                && l.contains(&format!("limit={hard}"))),
        "the raised limit is logged:\n{log}"
    );
}
