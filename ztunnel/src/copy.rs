//! The bidirectional copy loop at the heart of every proxied connection.
//!
//! ```text
//!   a ──chunk──▶ [direction a→b] ──chunk──▶ b   both directions polled by one
//!   a ◀─chunk── [direction b→a] ◀──chunk── b   future, so byte counts are known
//!                                                even on error
//! ```
//!
//! * **Chunks, not copies**: each side is a [`ChunkIo`]. A socket reads into
//!   the direction's buffer and hands the bytes out as a [`Bytes`] split off
//!   it; an HBONE stream hands out the DATA frames h2 already holds and takes
//!   the chunks it is given as DATA frames. So a byte crosses ztunnel's
//!   memory once: kernel → buffer → (TLS) → kernel, with no user-space copy
//!   between a socket and an HTTP/2 stream in either direction.
//! * **Half-close**: EOF on one side flushes and shuts down the *write* side
//!   of the other; the opposite direction keeps running until it ends too.
//! * **Backpressure**: a direction reads again only once everything it read
//!   was written; a slow writer stops its reader.
//! * **Buffers**: a direction holds no buffer while its source has nothing
//!   to read — a socket's buffer is allocated only once the socket is
//!   readable (never zero-filled), and released whenever the source runs dry
//!   — so an idle connection costs no buffer memory. Reads ask for
//!   [`CopyConfig::initial_buffer`] bytes; after [`CopyConfig::grow_after`]
//!   consecutive reads that fill it, for [`CopyConfig::max_buffer`] (bulk
//!   transfers get big syscalls); a short read brings it back. A buffer whose
//!   chunks have all been written is reused for the next read.
//! * **Splice**: two TCP sockets (the plaintext paths) are relayed by
//!   [`crate::splice`] instead, socket → pipe → socket inside the kernel.
//! * **Errors** end the whole copy (the caller closes both sides) and carry
//!   the bytes copied so far, for metrics and access logs.

#![forbid(unsafe_code)]

use std::fmt;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::AsyncWrite;
use tokio::net::TcpStream;

/// Initial size of each direction's reads.
pub const INITIAL_BUFFER: usize = 16 * 1024;
/// Size a direction's reads grow to under bulk traffic.
pub const MAX_BUFFER: usize = 256 * 1024;
/// Consecutive full reads after which reads grow.
pub const GROW_AFTER: u32 = 4;

/// Tuning of [`copy_bidirectional`]; the defaults suit the data path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyConfig {
    /// Size of each direction's first reads (bytes, at least 1).
    pub initial_buffer: usize,
    /// Size reads grow to once they keep filling the buffer (bytes).
    pub max_buffer: usize,
    /// How many consecutive full reads trigger the growth.
    pub grow_after: u32,
    /// Relay socket-to-socket copies with `splice(2)` ([`crate::splice`])
    /// instead of through a buffer.
    pub splice: bool,
}

impl Default for CopyConfig {
    fn default() -> Self {
        Self {
            initial_buffer: INITIAL_BUFFER,
            max_buffer: MAX_BUFFER,
            grow_after: GROW_AFTER,
            splice: true,
        }
    }
}

/// A side of the copy: a byte stream that reads and writes owned chunks.
///
/// The defaults of `poll_write_chunk`, `poll_flush_chunks` and
/// `poll_shutdown_chunks` go through [`AsyncWrite`]; a stream that can keep
/// the bytes it is handed (an HTTP/2 stream) overrides `poll_write_chunk`.
pub trait ChunkIo: AsyncWrite + Unpin {
    /// Reads the next chunk; an empty chunk is EOF. A source that reads
    /// from the kernel waits until it is readable, then reads at most `want`
    /// bytes into `buf` (reserving them first) and splits them off; a source
    /// that already holds owned bytes returns them and leaves `buf` alone.
    fn poll_read_chunk(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
        want: usize,
    ) -> Poll<io::Result<Bytes>>;

    /// Writes from the front of `chunk` and advances it past what was
    /// taken; returns how many bytes that was (0 only for an empty chunk).
    fn poll_write_chunk(
        &mut self,
        cx: &mut Context<'_>,
        chunk: &mut Bytes,
    ) -> Poll<io::Result<usize>> {
        let n = ready!(Pin::new(&mut *self).poll_write(cx, chunk))?;
        chunk.advance(n.min(chunk.len()));
        Poll::Ready(Ok(n))
    }

    /// Pushes out what was written.
    fn poll_flush_chunks(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self).poll_flush(cx)
    }

    /// Ends the write half (the peer reads EOF).
    fn poll_shutdown_chunks(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self).poll_shutdown(cx)
    }

    /// The TCP socket this side is, if it is one: two of them are relayed
    /// with `splice(2)`.
    fn as_tcp(&self) -> Option<&TcpStream> {
        None
    }
}

impl<T: ChunkIo + ?Sized> ChunkIo for &mut T {
    fn poll_read_chunk(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
        want: usize,
    ) -> Poll<io::Result<Bytes>> {
        (**self).poll_read_chunk(cx, buf, want)
    }

    fn poll_write_chunk(
        &mut self,
        cx: &mut Context<'_>,
        chunk: &mut Bytes,
    ) -> Poll<io::Result<usize>> {
        (**self).poll_write_chunk(cx, chunk)
    }

    fn poll_flush_chunks(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        (**self).poll_flush_chunks(cx)
    }

    fn poll_shutdown_chunks(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        (**self).poll_shutdown_chunks(cx)
    }

    fn as_tcp(&self) -> Option<&TcpStream> {
        (**self).as_tcp()
    }
}

impl ChunkIo for TcpStream {
    fn poll_read_chunk(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut BytesMut,
        want: usize,
    ) -> Poll<io::Result<Bytes>> {
        ready!(self.poll_read_ready(cx))?;
        // Allocated (or reclaimed) only now that bytes are waiting; at most
        // `want` are read even into a larger reused buffer. Read through
        // `AsyncRead` (not `try_read_buf`): a short read clears the socket's
        // readiness, so a request/response message costs one `recvfrom`,
        // not one plus the would-block read after it.
        buf.reserve(want);
        ready!(tokio_util::io::poll_read_buf(
            Pin::new(&mut *self),
            cx,
            &mut (&mut *buf).limit(want)
        ))?;
        Poll::Ready(Ok(buf.split().freeze()))
    }

    fn as_tcp(&self) -> Option<&TcpStream> {
        Some(self)
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
/// Two TCP sockets are relayed with `splice(2)` when
/// [`CopyConfig::splice`] is on.
///
/// A plain fn returning an `async move` block, not an `async fn`: an async
/// fn's future keeps each argument twice (as captured, and as moved into
/// the body), and this future lives as long as the connection.
#[allow(clippy::manual_async_fn)] // an async fn would hold its arguments twice
pub fn copy_bidirectional<A, B>(
    mut a: A,
    mut b: B,
    config: &CopyConfig,
) -> impl Future<Output = Result<(u64, u64), CopyError>>
where
    A: ChunkIo,
    B: ChunkIo,
{
    async move {
        if config.splice
            && let (Some(a), Some(b)) = (a.as_tcp(), b.as_tcp())
        {
            return crate::splice::splice_bidirectional(a, b).await;
        }
        let mut a_to_b = Direction::new(config);
        let mut b_to_a = Direction::new(config);
        drive_both(|cx, from| match from {
            Side::A => (a_to_b.poll_copy(cx, &mut a, &mut b), a_to_b.copied),
            Side::B => (b_to_a.poll_copy(cx, &mut b, &mut a), b_to_a.copied),
        })
        .await
    }
}

/// What failed in one direction: the operation and its error.
pub(crate) type StepError = (Operation, io::Error);

/// Drives both directions of a copy until both are done. `step(cx, from)`
/// polls the direction reading from side `from` and returns its poll and the
/// bytes it has written so far; a direction that failed ends the copy, its
/// read error blamed on `from`, its write error on the other side.
pub(crate) async fn drive_both(
    mut step: impl FnMut(&mut Context<'_>, Side) -> (Poll<Result<(), StepError>>, u64),
) -> Result<(u64, u64), CopyError> {
    let mut done = [false, false];
    let mut copied = [0u64, 0u64];
    poll_fn(|cx| {
        for (i, (from, to)) in [(Side::A, Side::B), (Side::B, Side::A)]
            .into_iter()
            .enumerate()
        {
            if done[i] {
                continue;
            }
            let (poll, n) = step(cx, from);
            copied[i] = n;
            match poll {
                Poll::Ready(Ok(())) => done[i] = true,
                Poll::Ready(Err((operation, source))) => {
                    return Poll::Ready(Err(CopyError::Io {
                        side: if operation == Operation::Read {
                            from
                        } else {
                            to
                        },
                        operation,
                        a_to_b: copied[0],
                        b_to_a: copied[1],
                        source,
                    }));
                }
                Poll::Pending => {}
            }
        }
        if done == [true, true] {
            Poll::Ready(Ok((copied[0], copied[1])))
        } else {
            Poll::Pending
        }
    })
    .await
}

/// One direction's state: its buffer, the chunk in flight and how far it got.
struct Direction {
    /// Where a socket source reads; no allocation while the source is dry.
    buf: BytesMut,
    /// Read but not yet written.
    chunk: Bytes,
    /// How many bytes the next read asks for.
    want: usize,
    copied: u64,
    full_reads: u32,
    read_eof: bool,
    needs_flush: bool,
    done: bool,
    config: CopyConfig,
}

impl Direction {
    fn new(config: &CopyConfig) -> Self {
        Self {
            buf: BytesMut::new(),
            chunk: Bytes::new(),
            want: config.initial_buffer.max(1),
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
        reader: &mut R,
        writer: &mut W,
    ) -> Poll<Result<(), StepError>>
    where
        R: ChunkIo + ?Sized,
        W: ChunkIo + ?Sized,
    {
        if self.done {
            return Poll::Ready(Ok(()));
        }
        loop {
            // Everything read so far is written: read more.
            if self.chunk.is_empty() && !self.read_eof {
                match reader.poll_read_chunk(cx, &mut self.buf, self.want) {
                    Poll::Ready(Ok(chunk)) => {
                        if chunk.is_empty() {
                            self.read_eof = true;
                        }
                        self.size_next_read(chunk.len());
                        self.chunk = chunk;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err((Operation::Read, e))),
                    Poll::Pending => {
                        // The source ran dry: hold no buffer while idle.
                        self.buf = BytesMut::new();
                        // Nothing to read now: push out what was written.
                        if self.needs_flush {
                            ready!(writer.poll_flush_chunks(cx))
                                .map_err(|e| (Operation::Write, e))?;
                            self.needs_flush = false;
                        }
                        return Poll::Pending;
                    }
                }
            }

            while !self.chunk.is_empty() {
                let n = ready!(writer.poll_write_chunk(cx, &mut self.chunk))
                    .map_err(|e| (Operation::Write, e))?;
                if n == 0 {
                    return Poll::Ready(Err((
                        Operation::Write,
                        io::Error::new(io::ErrorKind::WriteZero, "the writer accepted no bytes"),
                    )));
                }
                self.copied += n as u64;
                self.needs_flush = true;
            }

            if self.read_eof {
                ready!(writer.poll_flush_chunks(cx)).map_err(|e| (Operation::Write, e))?;
                self.needs_flush = false;
                ready!(writer.poll_shutdown_chunks(cx)).map_err(|e| (Operation::Shutdown, e))?;
                self.done = true;
                // No buffer is needed while the other direction runs.
                self.buf = BytesMut::new();
                return Poll::Ready(Ok(()));
            }
        }
    }

    /// Sizes the next read after one that returned `n` bytes: bigger once
    /// reads keep filling what they asked for, back to the initial size
    /// after a short one.
    fn size_next_read(&mut self, n: usize) {
        let initial = self.config.initial_buffer.max(1);
        if n >= self.want {
            self.full_reads = self.full_reads.saturating_add(1);
            if self.full_reads >= self.config.grow_after && self.want < self.config.max_buffer {
                self.want = self.config.max_buffer;
                self.full_reads = 0;
            }
        } else {
            self.full_reads = 0;
            if n < initial {
                self.want = initial;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tokio::time::timeout;

    use super::*;

    const WAIT: Duration = Duration::from_secs(30);

    use crate::test_support::loopback_pair as pair;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    /// client ⇄ [proxy a | copy | proxy b] ⇄ server; returns (client,
    /// server, copy task).
    async fn proxied(
        splice: bool,
    ) -> (
        TcpStream,
        TcpStream,
        tokio::task::JoinHandle<Result<(u64, u64), CopyError>>,
    ) {
        let (client, proxy_a) = pair().await;
        let (proxy_b, server) = pair().await;
        let config = CopyConfig {
            splice,
            ..CopyConfig::default()
        };
        let task = tokio::spawn(async move { copy_bidirectional(proxy_a, proxy_b, &config).await });
        (client, server, task)
    }

    /// Each scenario runs through the buffered copy and through splice.
    macro_rules! both_ways {
        ($($scenario:ident),* $(,)?) => {
            mod buffered {
                $(#[tokio::test]
                async fn $scenario() {
                    super::$scenario(false).await
                })*
            }
            mod spliced {
                $(#[tokio::test]
                async fn $scenario() {
                    super::$scenario(true).await
                })*
            }
        };
    }

    both_ways!(
        echoes_a_large_payload_intact_and_counts_bytes,
        client_half_close_still_receives_the_response,
        server_half_close_keeps_the_client_direction_open,
        reset_is_an_error_that_reports_bytes_copied,
    );

    async fn echoes_a_large_payload_intact_and_counts_bytes(splice: bool) {
        let (client, server, copy) = proxied(splice).await;
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

    async fn client_half_close_still_receives_the_response(splice: bool) {
        let (mut client, mut server, copy) = proxied(splice).await;
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

    async fn server_half_close_keeps_the_client_direction_open(splice: bool) {
        let (mut client, mut server, copy) = proxied(splice).await;
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

    async fn reset_is_an_error_that_reports_bytes_copied(splice: bool) {
        let (mut client, server, copy) = proxied(splice).await;
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

    #[tokio::test]
    async fn an_idle_direction_holds_no_buffer() {
        let (mut client, proxy_a) = pair().await;
        let (proxy_b, mut server) = pair().await;
        let (mut a, mut b) = (proxy_a, proxy_b);
        let mut d = Direction::new(&CopyConfig::default());
        client.write_all(b"hello").await.unwrap();
        // Drive the direction until the bytes reached the server.
        let mut got = [0u8; 5];
        let copy = poll_fn(|cx| {
            let _ = d.poll_copy(cx, &mut a, &mut b);
            if d.copied == 5 {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        });
        timeout(WAIT, copy).await.unwrap();
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");
        // Nothing more to read: the direction gives its buffer back.
        let idle = poll_fn(|cx| Poll::Ready(d.poll_copy(cx, &mut a, &mut b).is_pending())).await;
        assert!(idle);
        assert_eq!(d.buf.capacity(), 0, "an idle direction kept its buffer");
        assert!(d.chunk.is_empty());
    }

    #[test]
    fn reads_grow_under_bulk_traffic_and_shrink_after_a_short_one() {
        let config = CopyConfig::default();
        let mut d = Direction::new(&config);
        assert_eq!(d.want, INITIAL_BUFFER);
        for _ in 0..GROW_AFTER - 1 {
            d.size_next_read(INITIAL_BUFFER);
        }
        assert_eq!(d.want, INITIAL_BUFFER);
        d.size_next_read(INITIAL_BUFFER);
        assert_eq!(d.want, MAX_BUFFER);
        assert_eq!(d.full_reads, 0);
        // A partial but large read keeps the size; a small one resets it.
        d.size_next_read(MAX_BUFFER / 2);
        assert_eq!(d.want, MAX_BUFFER);
        d.size_next_read(100);
        assert_eq!(d.want, INITIAL_BUFFER);
    }
}
