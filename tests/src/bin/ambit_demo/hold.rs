//! `--hold HOST:PORT --for DURATION`: one TCP connection to an echo server
//! kept open for DURATION, a numbered line sent every `--every` and read
//! back within `--timeout`. Prints one JSON line and exits 0 when every
//! line came back and the server closed cleanly after our close, 1 at the
//! first line that did not (what a user of a long-lived connection would
//! notice: a reset, a stall, a lost byte).

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::net::TcpTarget;

/// How a held connection went.
pub struct HoldOutcome {
    pub rounds: u64,
    pub error: Option<String>,
    pub max_rtt: Duration,
    pub held: Duration,
}

impl HoldOutcome {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    pub fn to_json(&self, target: &TcpTarget) -> Value {
        json!({
            "hold": target.to_string(),
            "ok": self.ok(),
            "rounds": self.rounds,
            "error": self.error,
            "max_rtt_ms": self.max_rtt.as_secs_f64() * 1e3,
            "held_ms": self.held.as_millis() as u64,
        })
    }
}

/// Holds one connection to `target` for `hold`.
pub async fn hold(
    target: &TcpTarget,
    hold: Duration,
    every: Duration,
    timeout: Duration,
) -> HoldOutcome {
    let start = Instant::now();
    let mut out = HoldOutcome {
        rounds: 0,
        error: None,
        max_rtt: Duration::ZERO,
        held: Duration::ZERO,
    };
    let result = async {
        let mut s = tokio::time::timeout(timeout, TcpStream::connect(target.to_string()))
            .await
            .map_err(|_| format!("connecting: no answer within {timeout:?}"))?
            .map_err(|e| format!("connecting: {e}"))?;
        let mut buf = vec![0u8; 64];
        while start.elapsed() < hold {
            let line = format!("ping {}\n", out.rounds);
            let sent = Instant::now();
            s.write_all(line.as_bytes())
                .await
                .map_err(|e| format!("round {}: writing: {e}", out.rounds))?;
            let got = &mut buf[..line.len()];
            tokio::time::timeout(timeout, s.read_exact(got))
                .await
                .map_err(|_| format!("round {}: no echo within {timeout:?}", out.rounds))?
                .map_err(|e| format!("round {}: reading: {e}", out.rounds))?;
            if got != line.as_bytes() {
                return Err(format!(
                    "round {}: echoed {:?}",
                    out.rounds,
                    String::from_utf8_lossy(got)
                ));
            }
            out.max_rtt = out.max_rtt.max(sent.elapsed());
            out.rounds += 1;
            tokio::time::sleep(every).await;
        }
        s.shutdown().await.map_err(|e| format!("closing: {e}"))?;
        let n = tokio::time::timeout(timeout, s.read(&mut buf))
            .await
            .map_err(|_| "closing: the server did not close within the timeout".to_string())?
            .map_err(|e| format!("closing: {e}"))?;
        if n != 0 {
            return Err(format!("closing: {n} unexpected bytes"));
        }
        Ok(())
    }
    .await;
    out.error = result.err();
    out.held = start.elapsed();
    out
}
