//! Background processes (own process group, stdin null, output to a log
//! file, so they outlive `ambitctl`), finding and stopping them, small
//! blocking HTTP probes and free ports.

use std::collections::HashSet;
use std::io::{Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use super::LocalError;
use super::prereq::BINARIES;
use super::state::STATE_ENV;

/// Starts `cmd` detached: its own process group, stdin from /dev/null,
/// stdout and stderr appended to `log`, [`STATE_ENV`] set to `state_dir`.
pub fn spawn_detached(
    mut cmd: Command,
    what: &str,
    log: &Path,
    state_dir: &Path,
) -> Result<Child, LocalError> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(LocalError::io(format!("opening the log of {what}"), log))?;
    let err = file
        .try_clone()
        .map_err(LocalError::io(format!("opening the log of {what}"), log))?;
    cmd.process_group(0)
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .env(STATE_ENV, state_dir);
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "info");
    }
    // mimalloc would back its arenas with transparent huge pages where THP is
    // `madvise`: ~17 MiB of an idle ztunnel's RSS (benches/README.md).
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        cmd.env("MIMALLOC_ALLOW_THP", "0");
    }
    cmd.spawn()
        .map_err(LocalError::io(format!("starting {what}"), log))
}

/// Whether process `pid` exists and is not a zombie.
pub fn is_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // `pid (comm) S ...`: the state follows the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|s| s != 'Z' && s != 'X'),
        Err(_) => false,
    }
}

/// Whether `pid` was started for the cluster in `state_dir`: its
/// environment has [`STATE_ENV`] = `state_dir`, or it is one of the mesh's
/// binaries and its command line mentions `state_dir` (so a `tail -f` of a
/// log there is left alone).
pub fn belongs_to(pid: u32, state_dir: &Path) -> bool {
    let want = format!("{STATE_ENV}={}", state_dir.display());
    if let Ok(env) = std::fs::read(format!("/proc/{pid}/environ"))
        && env.split(|b| *b == 0).any(|v| v == want.as_bytes())
    {
        return true;
    }
    let dir = state_dir.to_string_lossy();
    let dir_slash = format!("{dir}/");
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let program = args
        .first()
        .and_then(|a| Path::new(a).file_name())
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    BINARIES.contains(&program.as_str())
        && args.iter().any(|arg| {
            arg.as_str() == dir
                || arg.starts_with(&dir_slash)
                || arg.contains(&format!("={dir_slash}"))
        })
}

/// Every live process of the cluster in `state_dir` (scan of `/proc`).
pub fn scan(state_dir: &Path) -> Vec<u32> {
    let me = std::process::id();
    let mut out: Vec<u32> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me && is_alive(*pid) && belongs_to(*pid, state_dir))
        .collect();
    out.sort_unstable();
    out
}

/// Sends `sig` to the process group `pid` leads, or to `pid` alone when it
/// leads none.
pub fn signal(pid: u32, sig: Signal) {
    let Ok(raw) = i32::try_from(pid) else { return };
    if killpg(Pid::from_raw(raw), sig).is_err() {
        let _ = kill(Pid::from_raw(raw), sig);
    }
}

/// SIGTERM to every pid's group, up to `grace` for them to exit, then
/// SIGKILL. Returns the pids that had to be killed.
pub fn stop_all(pids: &[u32], grace: Duration) -> Vec<u32> {
    for pid in pids {
        signal(*pid, Signal::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && pids.iter().any(|p| is_alive(*p)) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let stubborn: Vec<u32> = pids.iter().copied().filter(|p| is_alive(*p)).collect();
    for pid in &stubborn {
        signal(*pid, Signal::SIGKILL);
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline && stubborn.iter().any(|p| is_alive(*p)) {
        std::thread::sleep(Duration::from_millis(20));
    }
    stubborn
}

/// Every live process whose network namespace is one of `netns` (the
/// (device, inode) of each namespace's file, with its name), as
/// `(pid, "pid comm (in netns NAME)")`: what a pod's `ambitctl local exec
/// … &` left running. Compares `/proc/PID/ns/net` with the netns files.
pub fn in_netns(netns: &[(u64, u64, String)]) -> Vec<(u32, String)> {
    use std::os::unix::fs::MetadataExt;
    let me = std::process::id();
    let mut out: Vec<(u32, String)> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me && is_alive(*pid))
        .filter_map(|pid| {
            let meta = std::fs::metadata(format!("/proc/{pid}/ns/net")).ok()?;
            let (_, _, name) = netns
                .iter()
                .find(|(dev, ino, _)| *dev == meta.dev() && *ino == meta.ino())?;
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            Some((pid, format!("{pid} {} (in netns {name})", comm.trim())))
        })
        .collect();
    out.sort_unstable();
    out
}

/// SIGTERM to each pid (not its group), up to `grace` for them to exit,
/// then SIGKILL, then up to `bound` for them to be gone. Returns the pids
/// that needed SIGKILL and those still alive at the end.
pub fn kill_each(pids: &[u32], grace: Duration, bound: Duration) -> (Vec<u32>, Vec<u32>) {
    let send = |pid: u32, sig: Signal| {
        if let Ok(raw) = i32::try_from(pid) {
            let _ = kill(Pid::from_raw(raw), sig);
        }
    };
    for pid in pids {
        send(*pid, Signal::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && pids.iter().any(|p| is_alive(*p)) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let stubborn: Vec<u32> = pids.iter().copied().filter(|p| is_alive(*p)).collect();
    for pid in &stubborn {
        send(*pid, Signal::SIGKILL);
    }
    let deadline = Instant::now() + bound;
    while Instant::now() < deadline && stubborn.iter().any(|p| is_alive(*p)) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let alive = stubborn.iter().copied().filter(|p| is_alive(*p)).collect();
    (stubborn, alive)
}

/// Ports handed out by [`free_port`] in this process, never handed out again.
static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// Where the kernel takes the source ports of outgoing connections
/// (`net.ipv4.ip_local_port_range`; Linux's default when unreadable).
fn ephemeral_range() -> (u16, u16) {
    let text =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let mut it = text
        .split_whitespace()
        .filter_map(|w| w.parse::<u16>().ok());
    match (it.next(), it.next()) {
        (Some(lo), Some(hi)) if lo <= hi => (lo, hi),
        _ => (32768, 60999),
    }
}

/// The ports [`free_port`] draws from: a block outside the ephemeral range.
/// A port picked inside it and released can be taken as the source port of
/// any connection on the host before the child binds it (CI saw a ztunnel
/// fail with EADDRINUSE that way); outside it, only another picker can
/// race us. `None` when the ephemeral range leaves no room.
fn listen_block() -> Option<(u16, u16)> {
    let (lo, hi) = ephemeral_range();
    if lo >= 1024 + 4096 {
        Some((lo.saturating_sub(20_000).max(1024), lo - 1))
    } else if hi <= u16::MAX - 4096 {
        Some((hi + 1, u16::MAX))
    } else {
        None
    }
}

/// A free port on 127.0.0.1, distinct from every port this process handed
/// out before. Drawn at random from outside the kernel's ephemeral range and
/// checked by binding it; bound to `:0` and released when no such range
/// exists. The child binds it moments later: [`is_port_clash`] tells a
/// caller that lost the remaining race to pick again.
pub fn free_port() -> Result<u16, LocalError> {
    let mut guard = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let seen = guard.get_or_insert_with(HashSet::new);
    let block = listen_block();
    for _ in 0..200 {
        let port = match block {
            Some((lo, hi)) => rand::random_range(lo..=hi),
            None => 0,
        };
        let Ok(l) = TcpListener::bind(("127.0.0.1", port)) else {
            continue;
        };
        let port = l
            .local_addr()
            .map_err(LocalError::io("finding a free port", "127.0.0.1:0"))?
            .port();
        if seen.insert(port) {
            return Ok(port);
        }
    }
    Err(LocalError::Io {
        what: "finding a free port".into(),
        path: "127.0.0.1".into(),
        source: std::io::Error::other(
            "200 tries found no free port outside the ephemeral range that was not handed out already",
        ),
    })
}

/// Whether `err` is a child that exited because a port picked for it was
/// taken before it could bind it.
pub fn is_port_clash(err: &LocalError) -> bool {
    matches!(err, LocalError::Exited { tail, .. } if tail.contains("Address already in use"))
}

/// `127.0.0.1:<free port>`.
pub fn free_addr() -> Result<SocketAddr, LocalError> {
    Ok(SocketAddr::from(([127, 0, 0, 1], free_port()?)))
}

/// `GET path` on `addr` over HTTP/1.1; returns (status, body).
pub fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    let s = TcpStream::connect_timeout(&addr, timeout)?;
    http_get_on(s, addr, path, timeout)
}

/// [`http_get`] on a stream already connected to `addr` (e.g. made inside
/// a pod's network namespace). Reads at most 64 MiB.
pub fn http_get_on(
    mut s: TcpStream,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = Vec::new();
    (&mut s).take(64 << 20).read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {head:.80}")))?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    Ok((status, body))
}

/// Decodes a chunked body (good enough for our own servers' output).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            out.push_str(rest.get(..n.min(rest.len())).unwrap_or(""));
            break;
        }
        out.push_str(rest.get(..n).unwrap_or(""));
        body = rest.get(n..).unwrap_or("").trim_start_matches("\r\n");
    }
    out
}

/// Polls `check` every 100 ms until it returns true, `pid` exits
/// ([`LocalError::Exited`]) or `timeout` passes ([`LocalError::Timeout`]);
/// both errors carry the tail of `log`.
pub fn wait_until(
    what: &str,
    pid: Option<u32>,
    log: &Path,
    timeout: Duration,
    mut check: impl FnMut() -> bool,
) -> Result<(), LocalError> {
    let deadline = Instant::now() + timeout;
    loop {
        if check() {
            return Ok(());
        }
        if let Some(pid) = pid
            && !is_alive(pid)
        {
            return Err(LocalError::Exited {
                what: what.to_string(),
                pid,
                log: log.to_path_buf(),
                tail: log_tail(log, 20),
            });
        }
        if Instant::now() >= deadline {
            return Err(LocalError::Timeout {
                what: what.to_string(),
                secs: timeout.as_secs(),
                log: log.to_path_buf(),
                tail: log_tail(log, 20),
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The last `n` lines of `log` (reads at most its last 256 KiB).
pub fn log_tail(log: &Path, n: usize) -> String {
    let lines = read_tail(log, 256 * 1024);
    let start = lines.len().saturating_sub(n);
    lines[start..]
        .iter()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The complete lines in the last `max` bytes of `path`.
pub fn read_tail(path: &Path, max: u64) -> Vec<String> {
    let Ok(mut f) = std::fs::File::open(path) else {
        return Vec::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let from = len.saturating_sub(max);
    if f.seek(SeekFrom::Start(from)).is_err() {
        return Vec::new();
    }
    let mut buf = Vec::new();
    if f.read_to_end(&mut buf).is_err() {
        return Vec::new();
    }
    let text = String::from_utf8_lossy(&buf);
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    if from > 0 && !lines.is_empty() {
        lines.remove(0); // probably cut in the middle
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_stay_out_of_the_ephemeral_range_and_are_never_repeated() {
        let (lo, hi) = ephemeral_range();
        let mut seen = HashSet::new();
        for _ in 0..50 {
            let port = free_port().unwrap();
            if listen_block().is_some() {
                assert!(!(lo..=hi).contains(&port), "{port} is in {lo}-{hi}");
            }
            assert!(seen.insert(port), "{port} handed out twice");
        }
    }

    #[test]
    fn only_an_address_in_use_exit_is_a_port_clash() {
        let exited = |tail: &str| LocalError::Exited {
            what: "the ztunnel".into(),
            pid: 1,
            log: "/tmp/log".into(),
            tail: tail.into(),
        };
        let clash = "could not bind the stats listener on 127.0.0.1:43179: Address already in use (os error 98)";
        assert!(is_port_clash(&exited(clash)));
        assert!(!is_port_clash(&exited("no such file")));
    }
}
