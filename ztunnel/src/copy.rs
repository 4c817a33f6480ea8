//! The bidirectional copy loop at the heart of every proxied connection.
//!
//! ```text
//!   a ──read──▶ [buf a→b] ──write──▶ b      both directions polled by one future,
//!   a ◀─write── [buf b→a] ◀──read─── b      so byte counts are known even on error
//! ```
//!
//! * **Half-close**: EOF on one side flushes and shuts down the *write* side
//!   of the other; the opposite direction keeps running until it ends too.
//! * **Backpressure**: a direction reads again only once everything it read
//!   was written; a slow writer stops its reader.
//! * **Buffers**: one per direction, allocated when the direction first
//!   reads. It starts at [`CopyConfig::initial_buffer`] and, after
//!   [`CopyConfig::grow_after`] consecutive reads that fill it, is replaced
//!   once by a [`CopyConfig::max_buffer`] one (bulk transfers get big
//!   syscalls, idle or chatty connections keep a small footprint). Nothing is
//!   allocated per chunk.
//! * **Errors** end the whole copy (the caller closes both sides) and carry
//!   the bytes copied so far, for metrics and access logs.

#![forbid(unsafe_code)]

use std::fmt;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Initial size of each direction's buffer.
pub const INITIAL_BUFFER: usize = 16 * 1024;
/// Size a direction's buffer grows to under bulk traffic.
pub const MAX_BUFFER: usize = 256 * 1024;
/// Consecutive full reads after which a buffer grows.
pub const GROW_AFTER: u32 = 4;

/// Tuning of [`copy_bidirectional`]; the defaults suit the data path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyConfig {
    /// Size of each direction's first buffer (bytes, at least 1).
    pub initial_buffer: usize,
    /// Size a buffer grows to once reads keep filling it (bytes).
    pub max_buffer: usize,
    /// How many consecutive full reads trigger the growth.
    pub grow_after: u32,
}

impl Default for CopyConfig {
    fn default() -> Self {
        Self {
            initial_buffer: INITIAL_BUFFER,
            max_buffer: MAX_BUFFER,
            grow_after: GROW_AFTER,
        }
    }
}

/// One end of the copy: `A` is the first argument, `B` the second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The first stream given to [`copy_bidirectional`].
    A,
    /// The second stream given to [`copy_bidirectional`].
    B,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Side::A => f.write_str("side A"),
            Side::B => f.write_str("side B"),
        }
    }
}

/// What a failed copy was doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// Reading from a side.
    Read,
    /// Writing (or flushing) to a side.
    Write,
    /// Shutting down the write half of a side after the other side's EOF.
    Shutdown,
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Operation::Read => f.write_str("reading from"),
            Operation::Write => f.write_str("writing to"),
            Operation::Shutdown => f.write_str("shutting down the write half of"),
        }
    }
}

/// Errors of the copy loop.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// An I/O operation on one side failed; the connection is over.
    #[error(
        "{operation} {side} failed after copying {a_to_b} bytes A→B and {b_to_a} bytes B→A: {source} \
         (a reset or broken pipe usually means the peer or the application closed abruptly)"
    )]
    Io {
        /// The side the operation was on.
        side: Side,
        /// What was being done.
        operation: Operation,
        /// Bytes written to B before the failure.
        a_to_b: u64,
        /// Bytes written to A before the failure.
        b_to_a: u64,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

impl CopyError {
    /// Bytes copied `(A→B, B→A)` before the failure.
    pub fn copied(&self) -> (u64, u64) {
        match self {
            CopyError::Io { a_to_b, b_to_a, .. } => (*a_to_b, *b_to_a),
        }
    }

    /// The underlying I/O error.
    pub fn io_error(&self) -> &io::Error {
        match self {
            CopyError::Io { source, .. } => source,
        }
    }
}

/// Copies `a` ⇄ `b` until both directions have ended, with half-close
/// propagation (see the module docs). Returns the bytes written
/// `(A→B, B→A)`; on error, [`CopyError::copied`] tells what got through.
///
/// Pass `&mut stream` to keep ownership of the streams.
pub async fn copy_bidirectional<A, B>(
    mut a: A,
    mut b: B,
    config: &CopyConfig,
) -> Result<(u64, u64), CopyError>
where
    A: AsyncRead + AsyncWrite + Unpin,
    B: AsyncRead + AsyncWrite + Unpin,
{
    let mut a_to_b = Direction::new(config);
    let mut b_to_a = Direction::new(config);
    poll_fn(|cx| {
        let fail = |side, (operation, source), a_to_b: &Direction, b_to_a: &Direction| {
            Poll::Ready(Err(CopyError::Io {
                side,
                operation,
                a_to_b: a_to_b.copied,
                b_to_a: b_to_a.copied,
                source,
            }))
        };
        let ab = match a_to_b.poll_copy(cx, Pin::new(&mut a), Pin::new(&mut b)) {
            Poll::Ready(Err((Operation::Read, e))) => {
                return fail(Side::A, (Operation::Read, e), &a_to_b, &b_to_a);
            }
            Poll::Ready(Err(e)) => return fail(Side::B, e, &a_to_b, &b_to_a),
            Poll::Ready(Ok(())) => true,
            Poll::Pending => false,
        };
        let ba = match b_to_a.poll_copy(cx, Pin::new(&mut b), Pin::new(&mut a)) {
            Poll::Ready(Err((Operation::Read, e))) => {
                return fail(Side::B, (Operation::Read, e), &a_to_b, &b_to_a);
            }
            Poll::Ready(Err(e)) => return fail(Side::A, e, &a_to_b, &b_to_a),
            Poll::Ready(Ok(())) => true,
            Poll::Pending => false,
        };
        if ab && ba {
            Poll::Ready(Ok((a_to_b.copied, b_to_a.copied)))
        } else {
            Poll::Pending
        }
    })
    .await
}

/// One direction's state: its buffer and how far it got.
struct Direction {
    /// Empty until the first read, so a direction that never carries data
    /// costs nothing.
    buf: Vec<u8>,
    /// Bytes of `buf[..filled]` already written.
    written: usize,
    /// Bytes read into `buf`.
    filled: usize,
    copied: u64,
    full_reads: u32,
    read_eof: bool,
    needs_flush: bool,
    done: bool,
    config: CopyConfig,
}

type StepError = (Operation, io::Error);

impl Direction {
    fn new(config: &CopyConfig) -> Self {
        Self {
            buf: Vec::new(),
            written: 0,
            filled: 0,
            copied: 0,
            full_reads: 0,
            read_eof: false,
            needs_flush: false,
            done: false,
            config: *config,
        }
    }

    /// Drives this direction; `Ready(Ok)` once EOF was read, everything
    /// written and the writer shut down.
    fn poll_copy<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        mut reader: Pin<&mut R>,
        mut writer: Pin<&mut W>,
    ) -> Poll<Result<(), StepError>>
    where
        R: AsyncRead + ?Sized,
        W: AsyncWrite + ?Sized,
    {
        if self.done {
            return Poll::Ready(Ok(()));
        }
        loop {
            // Everything read so far is written: read more.
            if self.written == self.filled && !self.read_eof {
                self.size_buffer();
                let mut rb = ReadBuf::new(&mut self.buf);
                match reader.as_mut().poll_read(cx, &mut rb) {
                    Poll::Ready(Ok(())) => {
                        let n = rb.filled().len();
                        self.written = 0;
                        self.filled = n;
                        if n == 0 {
                            self.read_eof = true;
                        } else if n == self.buf.len() {
                            self.full_reads = self.full_reads.saturating_add(1);
                        } else {
                            self.full_reads = 0;
                        }
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err((Operation::Read, e))),
                    Poll::Pending => {
                        // Nothing to read now: push out what was written.
                        if self.needs_flush {
                            ready!(writer.as_mut().poll_flush(cx))
                                .map_err(|e| (Operation::Write, e))?;
                            self.needs_flush = false;
                        }
                        return Poll::Pending;
                    }
                }
            }

            while self.written < self.filled {
                let n = ready!(
                    writer
                        .as_mut()
                        .poll_write(cx, &self.buf[self.written..self.filled])
                )
                .map_err(|e| (Operation::Write, e))?;
                if n == 0 {
                    return Poll::Ready(Err((
                        Operation::Write,
                        io::Error::new(io::ErrorKind::WriteZero, "the writer accepted no bytes"),
                    )));
                }
                self.written += n;
                self.copied += n as u64;
                self.needs_flush = true;
            }

            if self.read_eof {
                ready!(writer.as_mut().poll_flush(cx)).map_err(|e| (Operation::Write, e))?;
                self.needs_flush = false;
                ready!(writer.as_mut().poll_shutdown(cx)).map_err(|e| (Operation::Shutdown, e))?;
                self.done = true;
                // The buffer is no longer needed while the other direction runs.
                self.buf = Vec::new();
                return Poll::Ready(Ok(()));
            }
        }
    }

    /// Allocates the buffer on first use and grows it once under bulk
    /// traffic. Only called while the buffer holds no unwritten data.
    fn size_buffer(&mut self) {
        let initial = self.config.initial_buffer.max(1);
        if self.buf.is_empty() {
            self.buf = vec![0; initial];
        } else if self.full_reads >= self.config.grow_after
            && self.buf.len() < self.config.max_buffer
        {
            self.buf = vec![0; self.config.max_buffer];
            self.full_reads = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::time::timeout;

    use super::*;

    const WAIT: Duration = Duration::from_secs(30);

    /// A connected loopback pair.
    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (c, s) = tokio::join!(TcpStream::connect(addr), l.accept());
        (c.unwrap(), s.unwrap().0)
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    /// client ⇄ [proxy a | copy | proxy b] ⇄ server; returns (client,
    /// server, copy task).
    async fn proxied() -> (
        TcpStream,
        TcpStream,
        tokio::task::JoinHandle<Result<(u64, u64), CopyError>>,
    ) {
        let (client, proxy_a) = pair().await;
        let (proxy_b, server) = pair().await;
        let task = tokio::spawn(async move {
            copy_bidirectional(proxy_a, proxy_b, &CopyConfig::default()).await
        });
        (client, server, task)
    }

    #[tokio::test]
    async fn echoes_a_large_payload_intact_and_counts_bytes() {
        let (client, server, copy) = proxied().await;
        // The server echoes everything back, then closes its write side.
        let echo = tokio::spawn(async move {
            let (mut r, mut w) = server.into_split();
            let n = tokio::io::copy(&mut r, &mut w).await.unwrap();
            w.shutdown().await.unwrap();
            n
        });
        const LEN: usize = 64 * 1024 * 1024;
        let data = pattern(LEN);
        let got = crate::test_support::roundtrip(client, data.clone()).await;
        assert_eq!(got.len(), LEN);
        assert!(got == data, "payload corrupted");
        assert_eq!(echo.await.unwrap(), LEN as u64);
        let counts = timeout(WAIT, copy).await.unwrap().unwrap().unwrap();
        assert_eq!(counts, (LEN as u64, LEN as u64));
    }

    #[tokio::test]
    async fn client_half_close_still_receives_the_response() {
        let (mut client, mut server, copy) = proxied().await;
        client.write_all(b"request").await.unwrap();
        client.shutdown().await.unwrap();
        // The server sees the request and then EOF, and only then answers.
        let mut req = Vec::new();
        timeout(WAIT, server.read_to_end(&mut req))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(req, b"request");
        let response = pattern(1024 * 1024);
        server.write_all(&response).await.unwrap();
        server.shutdown().await.unwrap();
        let mut got = Vec::new();
        timeout(WAIT, client.read_to_end(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert!(got == response);
        let counts = timeout(WAIT, copy).await.unwrap().unwrap().unwrap();
        assert_eq!(counts, (7, response.len() as u64));
    }

    #[tokio::test]
    async fn server_half_close_keeps_the_client_direction_open() {
        let (mut client, mut server, copy) = proxied().await;
        server.write_all(b"banner").await.unwrap();
        server.shutdown().await.unwrap();
        let mut got = Vec::new();
        timeout(WAIT, client.read_to_end(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, b"banner");
        // The client can still talk after the server's EOF.
        client.write_all(b"still here").await.unwrap();
        client.shutdown().await.unwrap();
        let mut req = Vec::new();
        timeout(WAIT, server.read_to_end(&mut req))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(req, b"still here");
        let counts = timeout(WAIT, copy).await.unwrap().unwrap().unwrap();
        assert_eq!(counts, (10, 6));
    }

    #[tokio::test]
    async fn reset_is_an_error_that_reports_bytes_copied() {
        let (mut client, server, copy) = proxied().await;
        client.write_all(b"hello").await.unwrap();
        let mut server = server;
        let mut buf = [0u8; 5];
        timeout(WAIT, server.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        // Closing with SO_LINGER 0 sends a RST.
        server.set_zero_linger().unwrap();
        drop(server);
        let err = timeout(WAIT, copy).await.unwrap().unwrap().unwrap_err();
        assert_eq!(err.copied(), (5, 0));
        assert_eq!(err.io_error().kind(), io::ErrorKind::ConnectionReset);
        assert!(err.to_string().contains("side B"), "{err}");
        drop(client);
    }

    #[test]
    fn buffer_grows_under_bulk_traffic_only() {
        let config = CopyConfig::default();
        let mut d = Direction::new(&config);
        d.size_buffer();
        assert_eq!(d.buf.len(), INITIAL_BUFFER);
        d.full_reads = GROW_AFTER - 1;
        d.size_buffer();
        assert_eq!(d.buf.len(), INITIAL_BUFFER);
        d.full_reads = GROW_AFTER;
        d.size_buffer();
        assert_eq!(d.buf.len(), MAX_BUFFER);
        assert_eq!(d.full_reads, 0);
    }
}
