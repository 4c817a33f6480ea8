//! Talking to the node agent: one connection per request on its unix stream
//! socket, one JSON line each way ([`crate::protocol`]), all of connect,
//! write and read within one deadline.

use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, UnixAddr};

use crate::protocol::{Reply, Request};

/// Largest reply accepted from the agent.
pub const MAX_REPLY: usize = 64 * 1024;

/// Why an exchange with the agent failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    /// Nothing accepts connections on the socket (missing, refused, backlog
    /// full until the deadline).
    #[error("cannot connect: {0}")]
    Unreachable(String),
    /// Connected, but the request or the reply did not get through in time.
    #[error("{0}")]
    Exchange(String),
    /// The agent answered something that is not a [`Reply`].
    #[error("{0}")]
    BadReply(String),
}

/// The node agent as the plugin sees it; tests substitute a fake.
pub trait Agent {
    /// Send `request`, wait for the reply, everything within `timeout`.
    fn request(
        &self,
        socket: &Path,
        request: &Request,
        timeout: Duration,
    ) -> Result<Reply, AgentError>;

    /// Whether the socket accepts a connection within `timeout` (STATUS).
    fn probe(&self, socket: &Path, timeout: Duration) -> Result<(), AgentError>;
}

/// The real agent, over its unix socket.
#[derive(Debug, Clone, Copy, Default)]
pub struct UnixAgent;

impl Agent for UnixAgent {
    fn request(
        &self,
        socket: &Path,
        request: &Request,
        timeout: Duration,
    ) -> Result<Reply, AgentError> {
        let deadline = Instant::now() + timeout;
        let mut stream = connect(socket, deadline)?;
        let mut line = serde_json::to_vec(request)
            .map_err(|e| AgentError::Exchange(format!("cannot encode the request: {e}")))?;
        line.push(b'\n');
        stream
            .set_write_timeout(Some(remaining(deadline)?))
            .map_err(|e| AgentError::Exchange(format!("socket setup: {e}")))?;
        stream
            .write_all(&line)
            .map_err(|e| AgentError::Exchange(io_msg("sending the request", &e)))?;
        // The agent reads one line; closing our side also serves an agent
        // that reads to end of stream.
        let _ = stream.shutdown(Shutdown::Write);
        let reply = read_line(&mut stream, deadline)?;
        serde_json::from_slice::<Reply>(&reply).map_err(|e| {
            AgentError::BadReply(format!(
                "{e} in {:?}",
                String::from_utf8_lossy(&reply[..reply.len().min(200)])
            ))
        })
    }

    fn probe(&self, socket: &Path, timeout: Duration) -> Result<(), AgentError> {
        connect(socket, Instant::now() + timeout).map(drop)
    }
}

fn remaining(deadline: Instant) -> Result<Duration, AgentError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(AgentError::Exchange("timed out".into()))
    } else {
        Ok(left)
    }
}

fn io_msg(what: &str, e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => format!("{what}: timed out"),
        _ => format!("{what}: {e}"),
    }
}

/// Connect without blocking past `deadline`: a unix stream connect either
/// completes at once or fails with EAGAIN while the listener's backlog is
/// full, in which case we retry until the deadline.
fn connect(path: &Path, deadline: Instant) -> Result<UnixStream, AgentError> {
    let addr = UnixAddr::new(path)
        .map_err(|e| AgentError::Unreachable(format!("invalid socket path: {e}")))?;
    loop {
        let fd = socket::socket(
            AddressFamily::Unix,
            SockType::Stream,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(|e| AgentError::Unreachable(format!("socket(): {e}")))?;
        match socket::connect(fd.as_raw_fd(), &addr) {
            Ok(()) => {
                let stream = UnixStream::from(fd);
                stream
                    .set_nonblocking(false)
                    .map_err(|e| AgentError::Unreachable(format!("socket setup: {e}")))?;
                return Ok(stream);
            }
            Err(Errno::EAGAIN | Errno::EINTR) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(Errno::EAGAIN) => {
                return Err(AgentError::Unreachable(
                    "timed out (the agent does not accept connections)".into(),
                ));
            }
            Err(e) => {
                return Err(AgentError::Unreachable(std::io::Error::from(e).to_string()));
            }
        }
    }
}

/// Read up to the first newline (or end of stream), at most [`MAX_REPLY`].
fn read_line(stream: &mut UnixStream, deadline: Instant) -> Result<Vec<u8>, AgentError> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        stream
            .set_read_timeout(Some(remaining(deadline).map_err(|_| {
                AgentError::Exchange("waiting for the reply: timed out".into())
            })?))
            .map_err(|e| AgentError::Exchange(format!("socket setup: {e}")))?;
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                let part = &chunk[..n];
                if let Some(pos) = part.iter().position(|b| *b == b'\n') {
                    buf.extend_from_slice(&part[..pos]);
                    return Ok(buf);
                }
                buf.extend_from_slice(part);
                if buf.len() > MAX_REPLY {
                    return Err(AgentError::BadReply(format!(
                        "reply longer than {MAX_REPLY} bytes"
                    )));
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(AgentError::Exchange(io_msg("waiting for the reply", &e))),
        }
    }
    if buf.iter().all(u8::is_ascii_whitespace) {
        return Err(AgentError::Exchange(
            "the agent closed the connection without replying".into(),
        ));
    }
    Ok(buf)
}
