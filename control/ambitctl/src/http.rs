//! A minimal HTTP/1.1 GET for the admin and debug endpoints the CLI reads
//! (control plane 15014, ztunnel 15000/15020, Envoy 15000): blocking, one
//! request per connection, every step under one deadline, bodies capped.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// The largest body read (an Envoy config dump of a big mesh fits).
pub const MAX_BODY: u64 = 64 * 1024 * 1024;

/// Why a GET failed.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error(
        "cannot reach {addr} ({what}): {source}; is it running, and is this the right address?"
    )]
    Connect {
        addr: SocketAddr,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} at {addr}{path} answered {status}: {body}")]
    Status {
        addr: SocketAddr,
        path: String,
        what: String,
        status: u16,
        body: String,
    },
    #[error("{what} at {addr}{path} sent something that is not an HTTP response: {detail}")]
    Protocol {
        addr: SocketAddr,
        path: String,
        what: String,
        detail: String,
    },
    #[error("{what} at {addr}{path} sent more than {MAX_BODY} bytes")]
    TooLarge {
        addr: SocketAddr,
        path: String,
        what: String,
    },
}

/// `GET path` from `stream` (already connected to `addr`); `what` names
/// the server in errors. The body of a 200, else an error.
pub fn get_on(
    mut stream: TcpStream,
    addr: SocketAddr,
    path: &str,
    what: &str,
    timeout: Duration,
) -> Result<String, HttpError> {
    let io = |source| HttpError::Connect {
        addr,
        what: what.to_string(),
        source,
    };
    let deadline = Instant::now() + timeout;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    )
    .map_err(io)?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 64 * 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no complete answer within {timeout:?}"),
            )));
        }
        stream.set_read_timeout(Some(left)).map_err(io)?;
        let n = stream.read(&mut chunk).map_err(io)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() as u64 > MAX_BODY {
            return Err(HttpError::TooLarge {
                addr,
                path: path.to_string(),
                what: what.to_string(),
            });
        }
    }
    let protocol = |detail: String| HttpError::Protocol {
        addr,
        path: path.to_string(),
        what: what.to_string(),
        detail,
    };
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| protocol("no end of headers".into()))?;
    let head = String::from_utf8_lossy(&buf[..split]).to_string();
    let raw = &buf[split + 4..];
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| protocol(format!("bad status line {:.80}", head)))?;
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(raw).ok_or_else(|| protocol("bad chunked body".into()))?
    } else {
        raw.to_vec()
    };
    let body = String::from_utf8_lossy(&body).to_string();
    if status != 200 {
        return Err(HttpError::Status {
            addr,
            path: path.to_string(),
            what: what.to_string(),
            status,
            body: body.trim().chars().take(400).collect(),
        });
    }
    Ok(body)
}

/// `GET path` on `addr`.
pub fn get(
    addr: SocketAddr,
    path: &str,
    what: &str,
    timeout: Duration,
) -> Result<String, HttpError> {
    let stream =
        TcpStream::connect_timeout(&addr, timeout).map_err(|source| HttpError::Connect {
            addr,
            what: what.to_string(),
            source,
        })?;
    get_on(stream, addr, path, what, timeout)
}

fn dechunk(mut body: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = body.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&body[..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(body.get(..size)?);
        body = body.get(size + 2..)?;
    }
}
