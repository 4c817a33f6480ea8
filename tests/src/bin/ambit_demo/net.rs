//! Outgoing calls of `ambit-demo` (HTTP GET and TCP echo checks), their results,
//! and the argument parsers and error wording they share with the servers.

use std::fmt;
use std::io;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::header::{HOST, USER_AGENT};
use hyper::{Request, Uri};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::{info, warn};

/// Largest response body a call reads.
const MAX_BODY: usize = 1024 * 1024;
/// Longest non-JSON body kept in a result.
const MAX_TEXT: usize = 2048;

/// An `http://host[:port][/path]` URL to GET.
#[derive(Clone, Debug)]
pub struct HttpTarget {
    url: String,
    /// Host as used to connect (IPv6 without brackets).
    host: String,
    port: u16,
    /// `host[:port]` as written, for the Host header.
    authority: String,
    /// Path and query, at least `/`.
    path: String,
}

impl HttpTarget {
    /// Parses a `--call` / `--forward` URL.
    pub fn parse(s: &str) -> Result<Self, String> {
        let uri: Uri = s
            .parse()
            .map_err(|e| format!("'{s}' is not a URL ({e}); expected http://HOST[:PORT][/PATH]"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => {
                return Err(format!(
                    "'{s}': scheme '{other}' is not supported; only http:// URLs (the mesh adds the TLS)"
                ));
            }
            None => {
                return Err(format!(
                    "'{s}' has no scheme; expected http://HOST[:PORT][/PATH]"
                ));
            }
        }
        let authority = uri
            .authority()
            .ok_or_else(|| format!("'{s}' has no host; expected http://HOST[:PORT][/PATH]"))?;
        if authority.as_str().contains('@') {
            return Err(format!("'{s}': user info in URLs is not supported"));
        }
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("'{s}' has an empty host"));
        }
        Ok(HttpTarget {
            url: s.to_string(),
            host: host.to_string(),
            port: authority.port_u16().unwrap_or(80),
            authority: authority.as_str().to_string(),
            path: uri
                .path_and_query()
                .map_or_else(|| "/".to_string(), |p| p.as_str().to_string()),
        })
    }
}

impl fmt::Display for HttpTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.url)
    }
}

/// A `HOST:PORT` TCP echo server to check.
#[derive(Clone, Debug)]
pub struct TcpTarget(String);

impl TcpTarget {
    /// Parses a `--tcp-call` address (`10.96.0.40:7000`, `name:7000`, `[::1]:7000`).
    pub fn parse(s: &str) -> Result<Self, String> {
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("'{s}' is not HOST:PORT"))?;
        if host.is_empty() || host == "[]" {
            return Err(format!("'{s}' has an empty host; expected HOST:PORT"));
        }
        if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
            return Err(format!(
                "'{s}': write IPv6 addresses in brackets, e.g. [::1]:7000"
            ));
        }
        match port.parse::<u16>() {
            Ok(p) if p != 0 => Ok(TcpTarget(s.to_string())),
            _ => Err(format!("'{s}': '{port}' is not a port (1-65535)")),
        }
    }
}

impl fmt::Display for TcpTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Parses `2s`, `500ms`, `1.5s`, `1m`, `100us`, or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration; expected e.g. 2s, 500ms, 1m"))?;
    let scale = match unit.trim() {
        "" | "s" | "sec" | "secs" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => return Err(format!("'{s}': unknown unit '{other}'; use ms, s, m or h")),
    };
    Duration::try_from_secs_f64(value * scale).map_err(|e| format!("'{s}': {e}"))
}

/// Milliseconds with one decimal, for logs.
pub struct Ms(pub Duration);

impl fmt::Display for Ms {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.1}", self.0.as_secs_f64() * 1000.0)
    }
}

fn ms_json(d: Duration) -> f64 {
    (d.as_secs_f64() * 10_000.0).round() / 10.0
}

/// A short, stable wording of a socket error ("connection refused", "connection reset").
pub fn describe_io(e: &io::Error) -> String {
    use io::ErrorKind::*;
    let words = match e.kind() {
        ConnectionRefused => "connection refused",
        ConnectionReset => "connection reset",
        ConnectionAborted => "connection aborted",
        BrokenPipe => "broken pipe (peer closed the connection)",
        TimedOut => "timed out",
        HostUnreachable => "host unreachable",
        NetworkUnreachable => "network unreachable",
        AddrNotAvailable => "address not available",
        UnexpectedEof => "connection closed early",
        NotConnected => "not connected",
        _ => return e.to_string(),
    };
    words.to_string()
}

/// Wording of a hyper error, preferring the socket error underneath.
pub fn describe_hyper(e: &hyper::Error) -> String {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<io::Error>() {
            return describe_io(io);
        }
        source = s.source();
    }
    if e.is_incomplete_message() {
        return "connection closed before a response".to_string();
    }
    e.to_string()
}

/// Aborts a spawned task when dropped (a timed-out call leaves nothing behind).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A response to a GET.
struct Reply {
    status: u16,
    body: Value,
}

/// The result of one HTTP call.
pub struct CallOutcome {
    url: String,
    elapsed: Duration,
    result: Result<Reply, String>,
}

impl CallOutcome {
    /// Got an answer with a 2xx status.
    pub fn ok(&self) -> bool {
        matches!(&self.result, Ok(r) if (200..300).contains(&r.status))
    }

    /// `{"url", "status", "ms", "body"}` or `{"url", "error", "ms"}`.
    pub fn to_json(&self) -> Value {
        match &self.result {
            Ok(r) => json!({
                "url": self.url,
                "status": r.status,
                "ms": ms_json(self.elapsed),
                "body": r.body,
            }),
            Err(e) => json!({ "url": self.url, "error": e, "ms": ms_json(self.elapsed) }),
        }
    }

    /// The answer's status code, if there was an answer.
    pub fn status(&self) -> Option<u16> {
        self.result.as_ref().ok().map(|r| r.status)
    }

    /// The answering server's name (its JSON `service`), if it said.
    pub fn server(&self) -> Option<String> {
        let r = self.result.as_ref().ok()?;
        r.body.get("service")?.as_str().map(str::to_string)
    }

    /// One log line: `call url=... status=200 ms=1.3 peer_seen_by_server=... server=...`
    /// or `call url=... ms=... error="connection reset"`.
    pub fn log(&self) {
        self.log_as("call");
    }

    /// The same line under another name (`forward` for a failed `--forward`).
    pub fn log_as(&self, what: &str) {
        let ms = Ms(self.elapsed);
        match &self.result {
            Ok(r) => {
                let field = |k: &str| {
                    r.body
                        .get(k)
                        .and_then(Value::as_str)
                        .unwrap_or("-")
                        .to_string()
                };
                let (peer, server) = (field("peer"), field("service"));
                if self.ok() {
                    info!(url = %self.url, status = r.status, ms = %ms, peer_seen_by_server = %peer, server = %server, "{what}");
                } else {
                    warn!(url = %self.url, status = r.status, ms = %ms, peer_seen_by_server = %peer, server = %server, "{what}");
                }
            }
            Err(e) => warn!(url = %self.url, ms = %ms, error = ?e, "{what}"),
        }
    }
}

/// GETs `target` on a fresh connection within `timeout`; never fails, the outcome says.
pub async fn http_get(target: &HttpTarget, timeout: Duration, caller: &str) -> CallOutcome {
    let start = Instant::now();
    let result = match tokio::time::timeout(timeout, get(target, caller)).await {
        Ok(result) => result,
        Err(_) => Err(format!("timed out after {}", super::humantime(timeout))),
    };
    CallOutcome {
        url: target.url.clone(),
        elapsed: start.elapsed(),
        result,
    }
}

async fn get(target: &HttpTarget, caller: &str) -> Result<Reply, String> {
    let stream = TcpStream::connect((target.host.as_str(), target.port))
        .await
        .map_err(|e| format!("connect to {}: {}", target.authority, describe_io(&e)))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| describe_hyper(&e))?;
    let _conn = AbortOnDrop(tokio::spawn(conn));
    let request = Request::get(target.path.as_str())
        .header(HOST, target.authority.as_str())
        .header(USER_AGENT, format!("ambit-demo ({caller})"))
        .body(Empty::<Bytes>::new())
        .map_err(|e| format!("building the request: {e}"))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| describe_hyper(&e))?;
    let status = response.status().as_u16();
    let body = Limited::new(response.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| match e.downcast::<hyper::Error>() {
            Ok(h) => format!("reading the body: {}", describe_hyper(&h)),
            Err(other) => format!("reading the body: {other}"),
        })?
        .to_bytes();
    Ok(Reply {
        status,
        body: body_json(&body),
    })
}

/// The body as JSON when it is JSON, else as (truncated) text.
fn body_json(body: &[u8]) -> Value {
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        return v;
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim_end();
    match text.char_indices().nth(MAX_TEXT) {
        Some((cut, _)) => Value::String(format!("{}…", &text[..cut])),
        None => Value::String(text.to_string()),
    }
}

/// The result of one TCP echo check.
pub struct TcpOutcome {
    addr: String,
    elapsed: Duration,
    result: Result<usize, String>,
}

impl TcpOutcome {
    /// The line came back intact.
    pub fn ok(&self) -> bool {
        self.result.is_ok()
    }

    /// `{"addr", "bytes", "ms"}` or `{"addr", "error", "ms"}`.
    pub fn to_json(&self) -> Value {
        match &self.result {
            Ok(n) => json!({ "addr": self.addr, "bytes": n, "ms": ms_json(self.elapsed) }),
            Err(e) => json!({ "addr": self.addr, "error": e, "ms": ms_json(self.elapsed) }),
        }
    }

    /// `tcp-call addr=... bytes=.. ms=..` or `tcp-call addr=... ms=.. error="..."`.
    pub fn log(&self) {
        let ms = Ms(self.elapsed);
        match &self.result {
            Ok(n) => info!(addr = %self.addr, bytes = n, ms = %ms, "tcp-call"),
            Err(e) => warn!(addr = %self.addr, ms = %ms, error = ?e, "tcp-call"),
        }
    }
}

/// Sends one line to a TCP echo server and expects the same bytes back.
pub async fn tcp_check(
    target: &TcpTarget,
    timeout: Duration,
    caller: &str,
    seq: u64,
) -> TcpOutcome {
    let start = Instant::now();
    let line = format!("ambit-demo {caller} #{seq}\n");
    let result = match tokio::time::timeout(timeout, echo_once(&target.0, line.as_bytes())).await {
        Ok(result) => result,
        Err(_) => Err(format!("timed out after {}", super::humantime(timeout))),
    };
    TcpOutcome {
        addr: target.0.clone(),
        elapsed: start.elapsed(),
        result,
    }
}

async fn echo_once(addr: &str, line: &[u8]) -> Result<usize, String> {
    let mut stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect to {addr}: {}", describe_io(&e)))?;
    let _ = stream.set_nodelay(true);
    stream
        .write_all(line)
        .await
        .map_err(|e| format!("sending: {}", describe_io(&e)))?;
    let mut echoed = vec![0u8; line.len()];
    stream.read_exact(&mut echoed).await.map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            "connection closed before the echo".to_string()
        } else {
            format!("reading the echo: {}", describe_io(&e))
        }
    })?;
    if echoed != line {
        return Err(format!(
            "echo mismatch: sent {:?}, got {:?}",
            String::from_utf8_lossy(line),
            String::from_utf8_lossy(&echoed)
        ));
    }
    let _ = stream.shutdown().await;
    Ok(line.len())
}
