//! The agent's unix socket paths (the CNI plugin's and ztunnel's): before
//! binding, a socket file left by an agent that died is removed, but one a
//! live agent still serves is never taken over; after binding, the path is
//! removed again when the agent stops ([`BoundPath`]).

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};

/// Why a socket path cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SocketPathError {
    #[error(
        "{path} is served by another running process (a connection to it succeeded): is another ambit-node-agent running on this node? Stop it first, or give this one other sockets (--cni-socket, --zds-socket)"
    )]
    InUse { path: PathBuf },
    #[error(
        "{path} exists and is not a socket; it was left untouched: remove it or choose another path"
    )]
    NotASocket { path: PathBuf },
    #[error("cannot check or replace {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// What is at a socket path before we bind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathState {
    /// Nothing.
    Free,
    /// A socket file nobody listens on (its agent died); safe to remove.
    Stale,
    /// A socket somebody accepts connections on.
    Live,
}

/// Whether a process listens on the unix socket at `path`. Tries a stream
/// and a seqpacket connection (the CNI socket is one, ZDS the other),
/// without blocking: a full backlog still counts as live.
pub fn probe(path: &Path) -> Result<PathState, SocketPathError> {
    let io_err = |source: io::Error| SocketPathError::Io {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(PathState::Free),
        Err(e) => return Err(io_err(e)),
        Ok(m) if !m.file_type().is_socket() => {
            return Err(SocketPathError::NotASocket {
                path: path.to_path_buf(),
            });
        }
        Ok(_) => {}
    }
    let addr = UnixAddr::new(path).map_err(|e| io_err(e.into()))?;
    for ty in [SockType::Stream, SockType::SeqPacket] {
        let fd = socket(
            AddressFamily::Unix,
            ty,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )
        .map_err(|e| io_err(e.into()))?;
        match connect(fd.as_raw_fd(), &addr) {
            // Connected, or the listener's backlog is full: somebody serves it.
            Ok(()) | Err(Errno::EAGAIN) | Err(Errno::EINPROGRESS) => return Ok(PathState::Live),
            // The socket file has no listener behind it.
            Err(Errno::ECONNREFUSED) => return Ok(PathState::Stale),
            // A socket of another type is bound there: try the other type.
            Err(Errno::EPROTOTYPE) => continue,
            Err(Errno::ENOENT) => return Ok(PathState::Free),
            Err(e) => return Err(io_err(e.into())),
        }
    }
    // Bound by a live process (a stale file would have been refused), just
    // not as a stream or seqpacket socket: not ours to remove.
    Ok(PathState::Live)
}

/// Makes `path` ready to bind: creates its directory, removes a stale
/// socket file, and refuses a live socket or a file that is not a socket.
pub fn prepare(path: &Path) -> Result<(), SocketPathError> {
    let io_err = |source| SocketPathError::Io {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io_err)?;
    }
    match probe(path)? {
        PathState::Free => Ok(()),
        PathState::Live => Err(SocketPathError::InUse {
            path: path.to_path_buf(),
        }),
        PathState::Stale => {
            tracing::info!(path = %path.display(), "removing a stale socket (no process listens on it)");
            match std::fs::remove_file(path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(io_err(e)),
            }
        }
    }
}

/// A socket path this agent bound; removed when dropped, unless something
/// else has replaced it in the meantime (same device and inode check).
#[derive(Debug)]
pub struct BoundPath {
    path: PathBuf,
    identity: Option<(u64, u64)>,
}

fn identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

impl BoundPath {
    /// Records the socket just bound at `path`.
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            identity: identity(path),
        }
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for BoundPath {
    fn drop(&mut self) {
        if self.identity.is_some() && identity(&self.path) == self.identity {
            match std::fs::remove_file(&self.path) {
                Ok(()) => tracing::debug!(path = %self.path.display(), "removed the socket"),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %self.path.display(), error = %e, "cannot remove the socket")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use std::os::unix::net::{UnixDatagram, UnixListener};

    #[test]
    fn free_stale_and_live_stream_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/cni.sock");
        assert_eq!(probe(&path).unwrap(), PathState::Free);
        prepare(&path).unwrap();
        assert!(path.parent().unwrap().is_dir(), "the directory is created");

        let listener = UnixListener::bind(&path).unwrap();
        assert_eq!(probe(&path).unwrap(), PathState::Live);
        let err = prepare(&path).unwrap_err();
        assert!(matches!(err, SocketPathError::InUse { .. }), "{err}");
        assert!(path.exists(), "a live socket is never removed");
        assert!(err.to_string().contains("--cni-socket"), "{err}");

        drop(listener);
        assert_eq!(probe(&path).unwrap(), PathState::Stale);
        prepare(&path).unwrap();
        assert!(!path.exists(), "a stale socket is removed");
    }

    #[test]
    fn a_live_seqpacket_socket_is_live() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("zds.sock");
        let listener = ambit_inpod::ZdsListener::bind(&path).unwrap();
        assert_eq!(probe(&path).unwrap(), PathState::Live);
        assert!(matches!(prepare(&path), Err(SocketPathError::InUse { .. })));
        drop(listener);
        assert_eq!(probe(&path).unwrap(), PathState::Stale);
    }

    #[test]
    fn a_bound_datagram_socket_is_somebody_elses() {
        // Neither stream nor seqpacket (EPROTOTYPE for both), but a live
        // process holds it: not removed. Once that process lets go, it is.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dgram.sock");
        let d = UnixDatagram::bind(&path).unwrap();
        assert_eq!(probe(&path).unwrap(), PathState::Live);
        drop(d);
        assert_eq!(probe(&path).unwrap(), PathState::Stale);
    }

    #[test]
    fn a_regular_file_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cni.sock");
        std::fs::write(&path, "mine").unwrap();
        assert!(matches!(
            prepare(&path),
            Err(SocketPathError::NotASocket { .. })
        ));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "mine");
    }

    #[test]
    fn bound_path_removes_only_its_own_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cni.sock");
        let l = UnixListener::bind(&path).unwrap();
        drop(BoundPath::new(&path));
        assert!(!path.exists(), "removed on drop");
        drop(l);

        let _l = UnixListener::bind(&path).unwrap();
        let guard = BoundPath::new(&path);
        // Another agent replaced it meanwhile.
        std::fs::remove_file(&path).unwrap();
        let _other = UnixListener::bind(&path).unwrap();
        drop(guard);
        assert!(path.exists(), "another process's socket stays");
    }
}
