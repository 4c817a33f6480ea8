//! The node agent's end of ZDS: it listens, ztunnel connects and says hello,
//! then the agent sends requests and waits for each ack.
//!
//! Blocking, with timeouts (the accept timeout also bounds every later
//! read), so the agent runs it on its own threads and never on an async
//! runtime's workers. Tests use it too, to hand pods to ztunnel.

use std::io::Read;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use socket2::{Domain, SockAddr, Socket, Type};

use super::message::{decode_ack, decode_hello, encode_request};
use super::seqpacket::send_datagram;
use super::{MAX_MESSAGE, ZdsError, ZdsMessage};

fn io_err(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> ZdsError {
    let path = path.to_path_buf();
    move |source| ZdsError::Io { path, op, source }
}

/// A listening ZDS socket.
#[derive(Debug)]
pub struct ZdsListener {
    sock: Socket,
    path: PathBuf,
}

impl ZdsListener {
    /// Binds and listens on `path` (which must not exist).
    pub fn bind(path: impl AsRef<Path>) -> Result<Self, ZdsError> {
        let path = path.as_ref();
        let sock =
            Socket::new(Domain::UNIX, Type::SEQPACKET, None).map_err(io_err(path, "socket"))?;
        sock.bind(&SockAddr::unix(path).map_err(io_err(path, "address"))?)
            .map_err(io_err(path, "bind"))?;
        sock.listen(16).map_err(io_err(path, "listen"))?;
        Ok(Self {
            sock,
            path: path.to_path_buf(),
        })
    }

    /// Waits up to `timeout` for ztunnel to connect and checks its hello.
    /// The same timeout then bounds every read on the connection.
    pub fn accept(&self, timeout: Duration) -> Result<ZdsAgentConn, ZdsError> {
        let path = &self.path;
        self.sock
            .set_read_timeout(Some(timeout))
            .map_err(io_err(path, "timeout"))?;
        let (sock, _) = self.sock.accept().map_err(io_err(path, "accept"))?;
        sock.set_read_timeout(Some(timeout))
            .map_err(io_err(path, "timeout"))?;
        let conn = ZdsAgentConn {
            sock,
            path: path.clone(),
        };
        let hello = conn.recv()?;
        decode_hello(&hello)?;
        Ok(conn)
    }
}

/// One accepted ztunnel connection.
#[derive(Debug)]
pub struct ZdsAgentConn {
    sock: Socket,
    path: PathBuf,
}

impl ZdsAgentConn {
    /// Sends raw bytes (any content) with optional fds.
    pub fn send_raw(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), ZdsError> {
        let raw: Vec<_> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
        send_datagram(self.sock.as_raw_fd(), bytes, &raw).map_err(io_err(&self.path, "sending"))
    }

    /// Receives one datagram (within the accept timeout).
    pub fn recv(&self) -> Result<Vec<u8>, ZdsError> {
        let mut buf = vec![0u8; MAX_MESSAGE];
        let n = (&self.sock)
            .read(&mut buf)
            .map_err(io_err(&self.path, "receiving"))?;
        if n == 0 {
            return Err(ZdsError::Closed {
                path: self.path.clone(),
            });
        }
        buf.truncate(n);
        Ok(buf)
    }

    /// Receives an ack: `""` on success, otherwise the reason.
    pub fn recv_ack(&self) -> Result<String, ZdsError> {
        decode_ack(&self.recv()?)
    }

    /// Sends a request (with the netns fd for `Add`) and returns its ack.
    pub fn request(
        &self,
        msg: &ZdsMessage,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<String, ZdsError> {
        let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
        self.send_raw(&encode_request(msg), &fds)?;
        self.recv_ack()
    }

    /// Whether ztunnel has closed its end (checked without waiting and
    /// without consuming anything: ztunnel sends only when asked, so
    /// anything but end-of-file means it is still there).
    pub fn is_closed(&self) -> bool {
        use nix::sys::socket::{MsgFlags, recv};
        let mut byte = [0u8; 1];
        match recv(
            self.sock.as_raw_fd(),
            &mut byte,
            MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
        ) {
            Ok(0) => true,
            Ok(_) => false,
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => false,
            Err(_) => true,
        }
    }

    /// Closes the connection (as an agent restart would).
    pub fn close(self) {
        drop(self.sock);
    }
}
