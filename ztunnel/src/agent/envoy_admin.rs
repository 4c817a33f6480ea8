//! A small HTTP/1.1 client of Envoy's admin listener (127.0.0.1): `/ready`,
//! `/stats`, `/stats/prometheus`, `/drain_listeners`. Every call has a
//! deadline covering connect, request and body, and a body size cap.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Errors of one admin call.
#[derive(Debug, thiserror::Error)]
pub enum EnvoyAdminError {
    /// No answer within the deadline.
    #[error("Envoy's admin at {addr} did not answer {method} {path} within {timeout_ms} ms")]
    Timeout {
        /// Admin address.
        addr: SocketAddr,
        /// Method.
        method: Method,
        /// Path.
        path: String,
        /// The deadline.
        timeout_ms: u128,
    },
    /// Connecting or speaking HTTP failed (Envoy not up yet, or gone).
    #[error("Envoy's admin at {addr} could not be asked {method} {path}: {reason}")]
    Http {
        /// Admin address.
        addr: SocketAddr,
        /// Method.
        method: Method,
        /// Path.
        path: String,
        /// What failed.
        reason: String,
    },
}

/// Envoy's admin listener.
#[derive(Debug, Clone, Copy)]
pub struct EnvoyAdmin {
    addr: SocketAddr,
}

/// Largest admin response read (Envoy's Prometheus stats of a busy waypoint
/// are a few MB).
pub const MAX_BODY: usize = 32 << 20;

impl EnvoyAdmin {
    /// The admin at `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        Self { addr }
    }

    /// The address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// One request; the status and the body (at most [`MAX_BODY`]).
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), EnvoyAdminError> {
        let addr = self.addr;
        let http = |reason: String| EnvoyAdminError::Http {
            addr,
            method: method.clone(),
            path: path.to_string(),
            reason,
        };
        let exchange = async {
            let tcp = TcpStream::connect(addr)
                .await
                .map_err(|e| http(format!("connect: {e}")))?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                .await
                .map_err(|e| http(format!("handshake: {e}")))?;
            let conn = tokio::spawn(conn);
            let req = Request::builder()
                .method(method.clone())
                .uri(path)
                .header(hyper::header::HOST, addr.to_string())
                .body(Empty::<Bytes>::new())
                .map_err(|e| http(format!("request: {e}")))?;
            let resp = sender
                .send_request(req)
                .await
                .map_err(|e| http(format!("request: {e}")))?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), MAX_BODY)
                .collect()
                .await
                .map_err(|e| http(format!("body: {e}")))?
                .to_bytes();
            conn.abort();
            Ok((status, body))
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| EnvoyAdminError::Timeout {
                addr,
                method: method.clone(),
                path: path.to_string(),
                timeout_ms: timeout.as_millis(),
            })?
    }

    /// Envoy's server state from `/ready` (`LIVE`, `PRE_INITIALIZING`,
    /// `INITIALIZING`, `DRAINING`).
    pub async fn state(&self, timeout: Duration) -> Result<String, EnvoyAdminError> {
        let (_, body) = self.call(Method::GET, "/ready", timeout).await?;
        Ok(String::from_utf8_lossy(&body).trim().to_string())
    }

    /// The values of the counters `names` (exact stat names) from `/stats`.
    pub async fn counters(
        &self,
        names: &[&str],
        timeout: Duration,
    ) -> Result<BTreeMap<String, u64>, EnvoyAdminError> {
        let alternatives: Vec<String> = names.iter().map(|n| n.replace('.', "\\.")).collect();
        let regex = format!("^({})$", alternatives.join("|"));
        let path = format!("/stats?filter={}", percent_encode(&regex));
        let (_, body) = self.call(Method::GET, &path, timeout).await?;
        Ok(String::from_utf8_lossy(&body)
            .lines()
            .filter_map(|line| {
                let (name, value) = line.split_once(": ")?;
                Some((name.to_string(), value.trim().parse().ok()?))
            })
            .collect())
    }
}

/// Percent-encodes everything but unreserved characters (a query value).
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn percent_encoding() {
        assert_eq!(
            super::percent_encode("^(a\\.b|c)$"),
            "%5E%28a%5C.b%7Cc%29%24"
        );
    }
}
