//! One CONNECT stream as a byte stream: [`H2Stream`] implements
//! `AsyncRead + AsyncWrite` over an h2 `SendStream`/`RecvStream` pair.
//!
//! * Reads hand out DATA frames as they arrive and release their
//!   flow-control capacity as the caller consumes them, so the peer's window
//!   reopens at the pace of the consumer (backpressure across the tunnel).
//! * Writes wait for send capacity (the peer's window, bounded by h2's send
//!   buffer) and never queue more than that.
//! * Written bytes are copied into one `BytesMut` that is split into frames
//!   and reclaimed once h2 has sent them: no allocation per write in steady
//!   state.
//! * `shutdown()` ends our half of the stream (END_STREAM); the peer's
//!   half stays readable — the half-close of TCP, carried over HTTP/2.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use h2::{Reason, RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

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

impl AsyncRead for H2Stream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        while this.pending.is_empty() {
            if this.read_eof {
                return Poll::Ready(Ok(()));
            }
            match ready!(this.recv.poll_data(cx)) {
                Some(Ok(data)) => this.pending = data,
                Some(Err(e)) => {
                    // A clean reset after END_STREAM from us is not an error
                    // for the reader; anything else is.
                    if e.reason() == Some(Reason::NO_ERROR) {
                        this.read_eof = true;
                    } else {
                        return Poll::Ready(Err(h2_to_io(e)));
                    }
                }
                None => this.read_eof = true,
            }
        }
        let n = this.pending.len().min(buf.remaining());
        buf.put_slice(&this.pending[..n]);
        this.pending.advance(n);
        // Reopen the peer's window by what the caller actually took.
        if let Err(e) = this.recv.flow_control().release_capacity(n) {
            return Poll::Ready(Err(h2_to_io(e)));
        }
        Poll::Ready(Ok(()))
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
        if this.write_closed {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        let mut capacity = this.send.capacity();
        if capacity == 0 {
            this.send.reserve_capacity(buf.len());
            // `poll_capacity` is edge-triggered: it reports increases, and
            // the check above covers capacity already assigned.
            capacity = match ready!(this.send.poll_capacity(cx)) {
                Some(Ok(n)) => n,
                Some(Err(_)) | None => return this.poll_send_error(cx).map(Err),
            };
        }
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
