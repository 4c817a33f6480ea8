//! Children (`ip`, `iptables-save`, `iptables-restore`) run with a deadline.
//!
//! A hung child must never stall the node agent: [`run`] keeps the child's
//! handle, feeds stdin and drains stdout/stderr on their own threads (so a
//! child blocked on a full pipe cannot deadlock us), polls for its exit until
//! the deadline, and past it kills the child's whole process group (a shell
//! wrapper and whatever it started) and reaps it. It blocks the calling
//! thread: call it from a blocking thread (`spawn_blocking`, or the thread
//! that entered a pod's netns), never from an async worker.

use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

/// Why a child did not run to completion.
#[derive(Debug, thiserror::Error)]
pub enum SubprocessError {
    /// The program could not be started.
    #[error("cannot start `{command}`: {source} (is it installed and on PATH?)")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    /// Waiting for the child failed.
    #[error("waiting for `{command}` failed: {source}")]
    Wait {
        command: String,
        #[source]
        source: std::io::Error,
    },
    /// The child outlived its deadline and was killed.
    #[error(
        "`{command}` did not finish within {timeout:?} and was killed (a hung iptables/ip, or \
         the xtables lock held by another process); the operation will be retried"
    )]
    TimedOut { command: String, timeout: Duration },
}

/// What a finished child left.
#[derive(Debug)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Longest wait for the output pipes to close once the child is gone (a
/// grandchild that left the process group may keep them open).
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// Runs `cmd` (its stdio is set here) with `stdin` fed to it, and returns
/// its output, or kills it once `timeout` has passed. `command` names it in
/// errors.
pub fn run(
    cmd: &mut Command,
    command: &str,
    stdin: Option<&[u8]>,
    timeout: Duration,
) -> Result<Output, SubprocessError> {
    let started = Instant::now();
    let deadline = started + timeout;
    // Its own process group, so a timeout kills everything it started.
    std::os::unix::process::CommandExt::process_group(cmd, 0);
    let mut child = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| SubprocessError::Spawn {
            command: command.to_string(),
            source,
        })?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        let input = input.to_vec();
        // A child that never reads its stdin must not block us here.
        let _ = std::thread::Builder::new()
            .name("ambit-child-stdin".into())
            .spawn(move || {
                let _ = pipe.write_all(&input);
            });
    }
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());

    let mut pause = Duration::from_millis(1);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(source) => {
                kill(&mut child);
                return Err(SubprocessError::Wait {
                    command: command.to_string(),
                    source,
                });
            }
        }
        let now = Instant::now();
        if now >= deadline {
            kill(&mut child);
            tracing::warn!(
                command,
                ?timeout,
                "child timed out; killed its process group"
            );
            return Err(SubprocessError::TimedOut {
                command: command.to_string(),
                timeout,
            });
        }
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(20));
    };
    let grace = Instant::now() + DRAIN_GRACE;
    Ok(Output {
        status,
        stdout: collect(stdout, grace),
        stderr: collect(stderr, grace),
    })
}

/// Kills the child's process group and reaps the child.
fn kill(child: &mut Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::sync_channel(1);
    if let Some(mut pipe) = pipe {
        let _ = std::thread::Builder::new()
            .name("ambit-child-output".into())
            .spawn(move || {
                let mut buf = Vec::new();
                let _ = pipe.read_to_end(&mut buf);
                let _ = tx.send(buf);
            });
    }
    rx
}

fn collect(rx: mpsc::Receiver<Vec<u8>>, until: Instant) -> Vec<u8> {
    rx.recv_timeout(until.saturating_duration_since(Instant::now()))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    #[test]
    fn output_and_status_come_back() {
        let out = run(
            &mut sh("cat; echo err >&2; exit 3"),
            "sh",
            Some(b"hello"),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(out.stdout, b"hello");
        assert_eq!(out.stderr, b"err\n");
        assert_eq!(out.status.code(), Some(3));
    }

    #[test]
    fn a_hung_child_and_its_children_are_killed_at_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("pid");
        // The shell starts a grandchild that would hold the pipes open.
        let script = format!("sleep 600 & echo $! > {}; wait", pidfile.display());
        let started = Instant::now();
        let err = run(
            &mut sh(&script),
            "sh -c sleep",
            None,
            Duration::from_millis(300),
        )
        .unwrap_err();
        let took = started.elapsed();
        assert!(matches!(err, SubprocessError::TimedOut { .. }), "{err}");
        assert!(err.to_string().contains("300ms"), "{err}");
        assert!(took < Duration::from_secs(2), "took {took:?}");
        let pid: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // Killed, and reaped by init soon: /proc/PID goes or turns zombie.
        let gone = (0..200).any(|_| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let alive = !stat.is_empty() && !stat.contains(") Z");
            if alive {
                std::thread::sleep(Duration::from_millis(10));
            }
            !alive
        });
        assert!(gone, "the grandchild {pid} survived the timeout");
    }

    #[test]
    fn a_child_that_fills_its_pipes_does_not_deadlock() {
        // 4 MiB on each of stdout and stderr, far past a pipe's buffer,
        // while its stdin is also large.
        let input = vec![b'x'; 1 << 20];
        let out = run(
            &mut sh("head -c 4194304 /dev/zero; head -c 4194304 /dev/zero >&2; cat >/dev/null"),
            "sh",
            Some(&input),
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(out.stdout.len(), 4 << 20);
        assert_eq!(out.stderr.len(), 4 << 20);
        assert!(out.status.success());
    }

    #[test]
    fn a_missing_program_is_a_spawn_error() {
        let err = run(
            &mut Command::new("/nonexistent/iptables-restore"),
            "iptables-restore",
            None,
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert!(matches!(err, SubprocessError::Spawn { .. }), "{err}");
    }
}
