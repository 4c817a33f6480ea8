//! ZDS framing: one message per unix `SOCK_SEQPACKET` datagram, the pod's
//! netns fd riding along as `SCM_RIGHTS` ancillary data.
//!
//! [`send_datagram`] and [`recv_datagram`] work on any such socket (blocking
//! or not); [`SeqpacketConn`] drives a connected one from tokio (ztunnel's
//! end). Received fds are owned at once, so nothing leaks when a message is
//! refused. No `unsafe`: an fd number that arrives is adopted by reopening
//! it through `/proc/self/fd`.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;

use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use socket2::{Domain, SockAddr, Socket, Type};
use tokio::io::Interest;
use tracing::warn;

use super::{MAX_FDS, ZdsError};

/// One received datagram: its length, its fds (each already owned, or why
/// not), and whether the kernel truncated it.
pub(crate) struct Received {
    pub(crate) len: usize,
    pub(crate) fds: Vec<io::Result<OwnedFd>>,
    pub(crate) truncated: bool,
}

/// A connected, non-blocking `SOCK_SEQPACKET` socket driven by tokio.
///
/// Registered with tokio as a `UnixDatagram` — the only safe, non-deprecated
/// way to get readiness for an `OwnedFd` — but only used through readiness
/// plus raw `recvmsg`/`sendmsg`, which behave the same on either type.
pub(crate) struct SeqpacketConn {
    sock: tokio::net::UnixDatagram,
}

impl SeqpacketConn {
    /// Connects to the listening socket at `path`. Must run inside a tokio
    /// runtime.
    pub(crate) fn connect(path: &Path) -> Result<Self, ZdsError> {
        let err = |source| ZdsError::Connect {
            path: path.to_path_buf(),
            source,
        };
        let sock = Socket::new(Domain::UNIX, Type::SEQPACKET, None).map_err(err)?;
        sock.set_nonblocking(true).map_err(err)?;
        sock.connect(&SockAddr::unix(path).map_err(err)?)
            .map_err(err)?;
        let std_sock = std::os::unix::net::UnixDatagram::from(OwnedFd::from(sock));
        let sock = tokio::net::UnixDatagram::from_std(std_sock).map_err(err)?;
        Ok(Self { sock })
    }

    /// Waits for and receives one datagram into `buf`.
    pub(crate) async fn recv(&self, buf: &mut [u8]) -> io::Result<Received> {
        let fd = self.sock.as_raw_fd();
        loop {
            self.sock.readable().await?;
            match self
                .sock
                .try_io(Interest::READABLE, || recv_datagram(fd, buf))
            {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                other => return other,
            }
        }
    }

    /// After a zero-length read: end of file, or an empty record? At EOF a
    /// peek reads 0 again; after an empty record it finds nothing yet.
    pub(crate) fn at_eof(&self) -> bool {
        let mut byte = [0u8; 1];
        let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
        !matches!(
            nix::sys::socket::recv(self.sock.as_raw_fd(), &mut byte, flags),
            Err(nix::errno::Errno::EAGAIN) | Ok(1..)
        )
    }

    /// Sends one datagram (no fds).
    pub(crate) async fn send(&self, bytes: &[u8]) -> io::Result<()> {
        let fd = self.sock.as_raw_fd();
        loop {
            self.sock.writable().await?;
            match self
                .sock
                .try_io(Interest::WRITABLE, || send_datagram(fd, bytes, &[]))
            {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                other => return other,
            }
        }
    }
}

/// Sends one datagram, with `fds` as `SCM_RIGHTS` when non-empty.
pub(crate) fn send_datagram(fd: RawFd, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    use nix::sys::socket::ControlMessage;
    let iov = [IoSlice::new(bytes)];
    let rights = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    let sent = sendmsg::<()>(fd, &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    if sent == bytes.len() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "sent {sent} of {} bytes of a datagram",
            bytes.len()
        )))
    }
}

/// Receives one datagram. Every fd that arrives is owned at once (closed
/// on drop), so a refused message leaks nothing.
pub(crate) fn recv_datagram(fd: RawFd, buf: &mut [u8]) -> io::Result<Received> {
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(fd, &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)?;
    let mut truncated = msg.flags.contains(MsgFlags::MSG_TRUNC);
    let mut raw_fds = Vec::new();
    match msg.cmsgs() {
        Ok(cmsgs) => {
            for c in cmsgs {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    raw_fds.extend(fds);
                }
            }
        }
        // MSG_CTRUNC: the kernel dropped what did not fit.
        Err(_) => truncated = true,
    }
    let len = msg.bytes;
    let fds = raw_fds.into_iter().map(adopt_fd).collect();
    Ok(Received {
        len,
        fds,
        truncated,
    })
}

/// Takes ownership of an fd that just arrived with `SCM_RIGHTS`, without
/// `unsafe`: reopen it through `/proc/self/fd` (same namespace, new fd we
/// own), then close the received number.
fn adopt_fd(raw: RawFd) -> io::Result<OwnedFd> {
    let reopened = std::fs::File::open(format!("/proc/self/fd/{raw}"));
    let closed = nix::unistd::close(raw);
    let file = reopened.map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("reopening received fd {raw} through /proc/self/fd: {e}"),
        )
    })?;
    if let Err(e) = closed {
        warn!(fd = raw, error = %e, "ZDS: closing a received fd failed");
    }
    Ok(OwnedFd::from(file))
}
