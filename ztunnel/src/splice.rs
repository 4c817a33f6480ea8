//! Zero-copy relay between two TCP sockets, for the plaintext paths
//! (passthrough to a destination outside the mesh, plaintext inbound):
//! each direction moves bytes socket → pipe → socket with `splice(2)`, so
//! the kernel hands page references along and the bytes never enter
//! ztunnel's memory.
//!
//! * Same contract as [`crate::copy::copy_bidirectional`]: half-close
//!   propagation (EOF shuts down the other side's write half), both
//!   directions driven by one future, byte counts known even on error
//!   ([`CopyError::copied`]), backpressure (a direction reads again only
//!   once its pipe is empty).
//! * A direction starts on a buffer (allocated when the socket is readable,
//!   released when it runs dry): request/response traffic costs one read and
//!   one write per message, as in the buffered copy, and no pipe. Once a read
//!   fills [`INITIAL_BUFFER`] the direction is bulk and moves to its own pipe,
//!   kept until the direction ends.
//! * If a pipe cannot be made (out of file descriptors), that direction
//!   stays on buffers.

#![forbid(unsafe_code)]

use std::io;
use std::os::fd::OwnedFd;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, BytesMut};
use nix::fcntl::{FcntlArg, OFlag, SpliceFFlags, fcntl, splice};
use tokio::io::Interest;
use tokio::net::TcpStream;

use crate::copy::{CopyError, INITIAL_BUFFER, Operation, Side, StepError, drive_both};

/// Pipe capacity asked for (the kernel's default is 64 KiB): how much one
/// `splice` pair moves at most.
const PIPE_SIZE: usize = 256 * 1024;

/// Relays `a` ⇄ `b` until both directions have ended. Returns the bytes
/// written `(A→B, B→A)`.
pub async fn splice_bidirectional(a: &TcpStream, b: &TcpStream) -> Result<(u64, u64), CopyError> {
    let mut a_to_b = Direction::default();
    let mut b_to_a = Direction::default();
    drive_both(|cx, from| match from {
        Side::A => (a_to_b.poll_relay(cx, a, b), a_to_b.copied),
        Side::B => (b_to_a.poll_relay(cx, b, a), b_to_a.copied),
    })
    .await
}

/// Where a direction's bytes wait between its read and its write (none
/// while the direction is idle).
enum Held {
    /// A pipe (read end, write end) holding `len` bytes.
    Pipe(OwnedFd, OwnedFd, usize),
    /// A buffer: small reads, or no pipe could be made.
    Buffer(BytesMut),
}

#[derive(Default)]
struct Direction {
    held: Option<Held>,
    /// A read filled [`INITIAL_BUFFER`]: bulk traffic, spliced from now on.
    bulk: bool,
    /// A pipe could not be made: stay on buffers.
    no_pipe: bool,
    copied: u64,
    read_eof: bool,
    done: bool,
}

impl Direction {
    /// Drives this direction; `Ready(Ok)` once EOF was read, everything
    /// written and `dst`'s write half shut down.
    fn poll_relay(
        &mut self,
        cx: &mut Context<'_>,
        src: &TcpStream,
        dst: &TcpStream,
    ) -> Poll<Result<(), StepError>> {
        if self.done {
            return Poll::Ready(Ok(()));
        }
        loop {
            if self.pending() == 0 && !self.read_eof {
                ready!(self.poll_fill(cx, src)).map_err(|e| (Operation::Read, e))?;
            }
            while self.pending() > 0 {
                let n = ready!(self.poll_drain(cx, dst)).map_err(|e| (Operation::Write, e))?;
                if n == 0 {
                    let e = io::Error::new(io::ErrorKind::WriteZero, "the socket took no bytes");
                    return Poll::Ready(Err((Operation::Write, e)));
                }
                self.copied += n as u64;
            }
            // A direction that turned bulk moves from its buffer to a pipe.
            if self.bulk && !self.no_pipe && matches!(self.held, Some(Held::Buffer(_))) {
                self.held = None;
            }
            if self.read_eof {
                self.held = None;
                socket2::SockRef::from(dst)
                    .shutdown(std::net::Shutdown::Write)
                    .map_err(|e| (Operation::Shutdown, e))?;
                self.done = true;
                return Poll::Ready(Ok(()));
            }
        }
    }

    /// Bytes read and not yet written.
    fn pending(&self) -> usize {
        match &self.held {
            Some(Held::Pipe(_, _, len)) => *len,
            Some(Held::Buffer(buf)) => buf.len(),
            None => 0,
        }
    }

    /// What the next read goes into: a pipe once the direction is bulk, a
    /// buffer before (a request/response exchange costs a read and a write,
    /// no pipe) or when no pipe can be made.
    fn storage(&mut self) -> &mut Held {
        let (bulk, no_pipe) = (self.bulk, &mut self.no_pipe);
        self.held.get_or_insert_with(|| {
            let pipe = if bulk && !*no_pipe { new_pipe() } else { None };
            *no_pipe |= bulk && pipe.is_none();
            pipe.unwrap_or_else(|| Held::Buffer(BytesMut::new()))
        })
    }

    /// Waits until `src` is readable and reads what it has (an empty read
    /// is EOF).
    fn poll_fill(&mut self, cx: &mut Context<'_>, src: &TcpStream) -> Poll<io::Result<()>> {
        loop {
            ready!(src.poll_read_ready(cx))?;
            let want = if self.bulk { PIPE_SIZE } else { INITIAL_BUFFER };
            let read = match self.storage() {
                Held::Pipe(_, w, len) => src
                    .try_io(Interest::READABLE, || {
                        splice(src, None, &*w, None, want, flags()).map_err(io::Error::from)
                    })
                    .inspect(|n| *len = *n),
                Held::Buffer(buf) => {
                    // Allocated only now that bytes are waiting.
                    buf.reserve(want);
                    src.try_read_buf(&mut (&mut *buf).limit(want))
                }
            };
            match read {
                Ok(0) => {
                    self.read_eof = true;
                    return Poll::Ready(Ok(()));
                }
                Ok(n) => {
                    self.bulk |= n >= INITIAL_BUFFER;
                    return Poll::Ready(Ok(()));
                }
                // Spurious readiness; `try_io` / `try_read_buf` cleared it.
                // Nothing is held (the pipe or buffer is empty), so the
                // would-block was the socket's: an idle direction keeps no
                // buffer (a bulk one keeps its pipe, which holds no pages
                // while empty).
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if matches!(self.held, Some(Held::Buffer(_))) {
                        self.held = None;
                    }
                    continue;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    /// Writes what is held to `dst`; returns how many bytes went.
    fn poll_drain(&mut self, cx: &mut Context<'_>, dst: &TcpStream) -> Poll<io::Result<usize>> {
        loop {
            ready!(dst.poll_write_ready(cx))?;
            let wrote = match &mut self.held {
                Some(Held::Pipe(r, _, len)) => dst
                    .try_io(Interest::WRITABLE, || {
                        splice(&*r, None, dst, None, *len, flags()).map_err(io::Error::from)
                    })
                    .inspect(|n| *len -= (*n).min(*len)),
                Some(Held::Buffer(buf)) => dst.try_write(buf).inspect(|n| buf.advance(*n)),
                None => Ok(0),
            };
            match wrote {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                other => return Poll::Ready(other),
            }
        }
    }
}

fn flags() -> SpliceFFlags {
    SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK
}

/// A non-blocking pipe sized [`PIPE_SIZE`] when the kernel allows (else its
/// default size); `None` when none can be made (out of file descriptors).
fn new_pipe() -> Option<Held> {
    match nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC) {
        Ok((r, w)) => {
            // Best effort: a smaller pipe only means more, smaller splices.
            let _ = fcntl(&w, FcntlArg::F_SETPIPE_SZ(PIPE_SIZE as i32));
            Some(Held::Pipe(r, w, 0))
        }
        Err(e) => {
            tracing::debug!(error = %e, "no pipe for splice; copying through a buffer");
            None
        }
    }
}

#[cfg(test)]
#[path = "splice_tests.rs"]
mod tests;
