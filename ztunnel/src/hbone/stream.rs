//! One CONNECT stream as a byte stream: [`H2Stream`] implements
//! `AsyncRead + AsyncWrite` over an h2 `SendStream`/`RecvStream` pair.
//!
//! * Reads hand out DATA frames as they arrive and release their
//!   flow-control capacity as the caller consumes them, so the peer's window
//!   reopens at the pace of the consumer (backpressure across the tunnel).
//! * Writes wait for send capacity (the peer's window, bounded by h2's send
//!   buffer) and never queue more than that.
//! * The copy loop uses the [`ChunkIo`] side: DATA frames are handed out as
//!   the `Bytes` h2 received, and chunks are sent as DATA frames as they are
//!   — no copy. The `AsyncWrite` side (other callers) copies written bytes
//!   into one `BytesMut` that is split into frames and reclaimed once h2 has
//!   sent them: no allocation per write in steady state.
//! * `shutdown()` ends our half of the stream (END_STREAM); the peer's
//!   half stays readable — the half-close of TCP, carried over HTTP/2.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use h2::{Reason, RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::copy::ChunkIo;

/// Smallest allocation of the write buffer (it is reused across writes).
const WRITE_BUFFER: usize = 64 * 1024;

/// A CONNECT tunnel's byte stream (either end).
pub struct H2Stream {
    send: SendStream<Bytes>,
    recv: RecvStream,
    /// The DATA frame being read, minus what was already handed out.
    pending: Bytes,
    write_buf: BytesMut,
    read_eof: bool,
    write_closed: bool,
}

impl std::fmt::Debug for H2Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("H2Stream")
            .field("pending", &self.pending.len())
            .field("read_eof", &self.read_eof)
            .field("write_closed", &self.write_closed)
            .finish_non_exhaustive()
    }
}

impl H2Stream {
    pub(crate) fn new(send: SendStream<Bytes>, recv: RecvStream) -> Self {
        Self {
            send,
            recv,
            pending: Bytes::new(),
            write_buf: BytesMut::new(),
            read_eof: false,
            write_closed: false,
        }
    }

    /// Resets the stream (RST_STREAM CANCEL) instead of ending it cleanly,
    /// e.g. when the other leg of a proxied connection failed.
    pub fn reset(&mut self) {
        self.send.send_reset(Reason::CANCEL);
    }

    /// The error to report once the send half is unusable.
    fn poll_send_error(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        match ready!(self.send.poll_reset(cx)) {
            Ok(Reason::NO_ERROR | Reason::CANCEL | Reason::STREAM_CLOSED) => {
                Poll::Ready(io::ErrorKind::BrokenPipe.into())
            }
            Ok(reason) => Poll::Ready(io::Error::new(
                io::ErrorKind::ConnectionReset,
                format!("the peer reset the HBONE stream: {reason}"),
            )),
            Err(e) => Poll::Ready(h2_to_io(e)),
        }
    }
}

/// Maps an h2 error to the `io::Error` a TCP socket would give.
pub(crate) fn h2_to_io(e: h2::Error) -> io::Error {
    if e.is_io() {
        return e
            .into_io()
            .unwrap_or_else(|| io::Error::other("h2 I/O error"));
    }
    let kind = if e.is_reset() || e.is_go_away() {
        io::ErrorKind::ConnectionReset
    } else {
        io::ErrorKind::Other
    };
    io::Error::new(kind, e)
}

impl H2Stream {
    /// Waits until `pending` holds bytes or the peer's half has ended
    /// (`Ready(Ok)` with `pending` empty).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.pending.is_empty() {
            if self.read_eof {
                return Poll::Ready(Ok(()));
            }
            match ready!(self.recv.poll_data(cx)) {
                Some(Ok(data)) => self.pending = data,
                Some(Err(e)) => {
                    // A clean reset after END_STREAM from us is not an error
                    // for the reader; anything else is.
                    if e.reason() == Some(Reason::NO_ERROR) {
                        self.read_eof = true;
                    } else {
                        return Poll::Ready(Err(h2_to_io(e)));
                    }
                }
                None => self.read_eof = true,
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Reopens the peer's window by what the caller took.
    fn consumed(&mut self, n: usize) -> io::Result<()> {
        self.recv
            .flow_control()
            .release_capacity(n)
            .map_err(h2_to_io)
    }

    /// Send capacity for up to `want` bytes (at least 1), or why the send
    /// half is unusable.
    fn poll_send_capacity(&mut self, cx: &mut Context<'_>, want: usize) -> Poll<io::Result<usize>> {
        if self.write_closed {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        loop {
            let capacity = self.send.capacity();
            if capacity > 0 {
                return Poll::Ready(Ok(capacity));
            }
            self.send.reserve_capacity(want);
            // `poll_capacity` is edge-triggered: it reports increases (look
            // at `capacity()` again: it may have gone elsewhere already), and
            // the check above covers capacity already assigned.
            match ready!(self.send.poll_capacity(cx)) {
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return self.poll_send_error(cx).map(Err),
            }
        }
    }
}

impl AsyncRead for H2Stream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        ready!(this.poll_fill(cx))?;
        let n = this.pending.len().min(buf.remaining());
        buf.put_slice(&this.pending[..n]);
        this.pending.advance(n);
        Poll::Ready(this.consumed(n))
    }
}

/// The copy loop takes DATA frames as they are and hands its chunks to h2
/// as DATA frames: no copy in either direction.
impl ChunkIo for H2Stream {
    fn poll_read_chunk(
        &mut self,
        cx: &mut Context<'_>,
        _buf: &mut BytesMut,
        _want: usize,
    ) -> Poll<io::Result<Bytes>> {
        ready!(self.poll_fill(cx))?;
        let chunk = std::mem::take(&mut self.pending);
        self.consumed(chunk.len())?;
        Poll::Ready(Ok(chunk))
    }

    fn poll_write_chunk(
        &mut self,
        cx: &mut Context<'_>,
        chunk: &mut Bytes,
    ) -> Poll<io::Result<usize>> {
        if chunk.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let capacity = ready!(self.poll_send_capacity(cx, chunk.len()))?;
        let frame = chunk.split_to(capacity.min(chunk.len()));
        let n = frame.len();
        if self.send.send_data(frame, false).is_err() {
            return self.poll_send_error(cx).map(Err);
        }
        Poll::Ready(Ok(n))
    }
}

impl AsyncWrite for H2Stream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let capacity = ready!(this.poll_send_capacity(cx, buf.len()))?;
        let n = capacity.min(buf.len());
        if this.write_buf.capacity() < n {
            // Reclaims the previous allocation when h2 has sent every frame
            // split from it; allocates only while frames are still queued.
            this.write_buf.reserve(n.max(WRITE_BUFFER));
        }
        this.write_buf.extend_from_slice(&buf[..n]);
        let frame = this.write_buf.split().freeze();
        if this.send.send_data(frame, false).is_err() {
            return this.poll_send_error(cx).map(Err);
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // The connection task writes queued frames out on its own.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.write_closed {
            return Poll::Ready(Ok(()));
        }
        if this.send.send_data(Bytes::new(), true).is_err() {
            return this.poll_send_error(cx).map(Err);
        }
        this.write_closed = true;
        Poll::Ready(Ok(()))
    }
}
