//! A pod's network namespace, held open by fd, and sockets made inside it.
//!
//! ztunnel runs in the node's network namespace. Sockets belong to the
//! namespace of the thread that *creates* them, and keep it for life, so a
//! listener made inside a pod's namespace keeps serving that pod when it is
//! then driven by tokio on an ordinary runtime thread. [`PodNetns::run_in`]
//! creates them on a short-lived dedicated thread that enters the pod's
//! namespace first: tokio's runtime threads never change namespace.

use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::sched::{CloneFlags, setns};
use nix::sys::statfs::{NSFS_MAGIC, fstatfs};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

/// Backlog of the listeners ztunnel opens inside pods.
pub const LISTEN_BACKLOG: i32 = 1024;

/// Why a network namespace could not be taken hold of.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error(
        "cannot open network namespace {path}: {source} (is the pod still running? ztunnel \
         needs root and the host's /var/run/netns and /proc)"
    )]
    Open { path: PathBuf, source: io::Error },
    #[error("cannot inspect network namespace {what}: {source}")]
    Inspect { what: String, source: io::Error },
    #[error(
        "{what} is not a network namespace ({found}); the node agent must pass the pod's \
         /proc/PID/ns/net or /var/run/netns/NAME"
    )]
    NotNetns { what: String, found: String },
}

/// Identity of a network namespace: the (device, inode) of its nsfs file.
/// Two fds name the same namespace exactly when their ids are equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NetnsId {
    pub dev: u64,
    pub ino: u64,
}

impl std::fmt::Display for NetnsId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "net:[{}]", self.ino)
    }
}

/// A pod's network namespace, kept alive by an open fd. Cheap to clone.
#[derive(Debug, Clone)]
pub struct PodNetns {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    fd: OwnedFd,
    id: NetnsId,
}

impl PodNetns {
    /// Opens a namespace by path: `/var/run/netns/NAME`, `/proc/PID/ns/net`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, NetnsError> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|source| NetnsError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_fd(OwnedFd::from(file), &path.display().to_string())
    }

    /// Takes ownership of an fd naming a network namespace (as received over
    /// ZDS). `what` names it in error messages.
    pub fn from_fd(fd: OwnedFd, what: &str) -> Result<Self, NetnsError> {
        let inspect = |source: io::Error| NetnsError::Inspect {
            what: what.to_string(),
            source,
        };
        let fs = fstatfs(&fd).map_err(|e| inspect(e.into()))?;
        if fs.filesystem_type() != NSFS_MAGIC {
            return Err(NetnsError::NotNetns {
                what: what.to_string(),
                found: format!("a file on a {:?} filesystem", fs.filesystem_type()),
            });
        }
        // An fd opened through a namespace file (not a bind mount of it)
        // reads back as `TYPE:[INODE]`; refuse the wrong namespace type early.
        // Bind mounts read back as their path; setns() then checks the type.
        if let Ok(link) = std::fs::read_link(format!("/proc/self/fd/{}", raw(&fd))) {
            let link = link.to_string_lossy();
            if link.ends_with(']') && !link.starts_with("net:[") {
                return Err(NetnsError::NotNetns {
                    what: what.to_string(),
                    found: format!("a {link} namespace"),
                });
            }
        }
        let file = File::from(fd);
        let meta = file.metadata().map_err(inspect)?;
        let id = NetnsId {
            dev: meta.dev(),
            ino: meta.ino(),
        };
        Ok(Self {
            inner: Arc::new(Inner {
                fd: OwnedFd::from(file),
                id,
            }),
        })
    }

    /// The namespace's identity.
    pub fn id(&self) -> NetnsId {
        self.inner.id
    }

    /// The namespace fd (e.g. to pass it on).
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.fd.as_fd()
    }

    /// Runs `f` on a new thread that has entered this namespace, and waits
    /// for it. The calling thread never changes namespace. Takes a thread
    /// start (tens of µs): batch socket creation into one call where possible.
    pub fn run_in<T, F>(&self, f: F) -> io::Result<T>
    where
        F: FnOnce() -> io::Result<T> + Send,
        T: Send,
    {
        let fd = self.inner.fd.as_fd();
        let id = self.inner.id;
        std::thread::scope(|scope| {
            let worker = std::thread::Builder::new()
                .name("ambit-netns".to_string())
                .spawn_scoped(scope, move || {
                    setns(fd, CloneFlags::CLONE_NEWNET).map_err(|e| {
                        let e = io::Error::from(e);
                        io::Error::new(
                            e.kind(),
                            format!(
                                "cannot enter pod network namespace {id}: {e} (ztunnel needs \
                                 CAP_SYS_ADMIN, and the fd must be a network namespace)"
                            ),
                        )
                    })?;
                    f()
                })?;
            worker
                .join()
                .map_err(|_| io::Error::other(format!("worker thread in {id} panicked")))?
        })
    }

    /// A listening TCP socket inside this namespace: `SO_REUSEADDR`,
    /// `IPV6_V6ONLY` for IPv6 (so `0.0.0.0` and `[::]` can share a port),
    /// `IP_TRANSPARENT` when asked (needs `CAP_NET_ADMIN`), non-blocking —
    /// ready for `tokio::net::TcpListener::from_std`.
    pub fn bind_listener(&self, addr: SocketAddr, transparent: bool) -> io::Result<TcpListener> {
        self.run_in(move || listener_socket(addr, transparent))
    }

    /// A TCP socket created inside this namespace, not yet connected, for
    /// delivering traffic to the pod's app (or sending it out of the pod):
    /// call `.connect(dst).await` on it. See [`SocketOptions`].
    pub fn tcp_socket(
        &self,
        dst: SocketAddr,
        opts: &SocketOptions,
    ) -> io::Result<tokio::net::TcpSocket> {
        let opts = *opts;
        let sock = self.run_in(move || client_socket(dst, &opts))?;
        Ok(tokio::net::TcpSocket::from_std_stream(sock.into()))
    }

    /// Connects to `dst` from inside this namespace. Must run inside a tokio
    /// runtime; the socket is created on a namespace thread, the connect
    /// itself is asynchronous.
    pub async fn connect_from(
        &self,
        dst: SocketAddr,
        opts: &SocketOptions,
    ) -> io::Result<tokio::net::TcpStream> {
        let socket = self.tcp_socket(dst, opts)?;
        socket.connect(dst).await.map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("connecting to {dst} inside pod netns {}: {e}", self.id()),
            )
        })
    }
}

/// A long-lived thread inside one pod's network namespace that creates
/// sockets on request, so the per-connection path pays a channel hop
/// (a few µs) instead of a thread start. Clones share the thread; it ends
/// when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct NetnsSockets {
    jobs: std::sync::mpsc::Sender<SocketJob>,
    id: NetnsId,
}

type SocketJob = Box<dyn FnOnce() + Send>;

impl NetnsSockets {
    /// Starts the thread and enters `netns` in it; fails when the
    /// namespace cannot be entered.
    pub fn spawn(netns: &PodNetns) -> io::Result<Self> {
        let (jobs, rx) = std::sync::mpsc::channel::<SocketJob>();
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<io::Result<()>>(1);
        let ns = netns.clone();
        let id = netns.id();
        std::thread::Builder::new()
            .name("ambit-netns-sockets".to_string())
            .spawn(move || {
                let entered = setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|e| {
                    let e = io::Error::from(e);
                    io::Error::new(
                        e.kind(),
                        format!("cannot enter pod network namespace {id}: {e}"),
                    )
                });
                let ok = entered.is_ok();
                let _ = ready_tx.send(entered);
                drop(ns);
                if ok {
                    for job in rx {
                        job();
                    }
                }
            })?;
        ready_rx
            .recv()
            .map_err(|_| io::Error::other(format!("socket thread for {id} died at start")))??;
        Ok(Self { jobs, id })
    }

    /// The namespace's identity.
    pub fn id(&self) -> NetnsId {
        self.id
    }

    /// Runs `f` on the namespace thread and returns its result. Keep `f`
    /// short (socket creation): jobs of one pod run one after another.
    pub async fn run<T, F>(&self, f: F) -> io::Result<T>
    where
        F: FnOnce() -> io::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job: SocketJob = Box::new(move || {
            let _ = tx.send(f());
        });
        let gone = || io::Error::other(format!("socket thread of pod netns {} is gone", self.id));
        self.jobs.send(job).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Connects to `dst` with a socket made in the namespace.
    pub async fn connect(
        &self,
        dst: SocketAddr,
        opts: &SocketOptions,
    ) -> io::Result<tokio::net::TcpStream> {
        let opts = *opts;
        let sock = self.run(move || client_socket(dst, &opts)).await?;
        let socket = tokio::net::TcpSocket::from_std_stream(sock.into());
        socket.connect(dst).await.map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("connecting to {dst} inside pod netns {}: {e}", self.id),
            )
        })
    }
}

/// How [`PodNetns::tcp_socket`] prepares a socket.
#[derive(Debug, Clone, Copy, Default)]
pub struct SocketOptions {
    /// `SO_MARK`, so the pod's redirection rules let ztunnel's own traffic
    /// through (needs `CAP_NET_ADMIN`).
    pub mark: Option<u32>,
    /// Local address to bind before connecting; with `transparent` it may be
    /// a non-local address (the original client's IP, kept visible to the app).
    pub bind: Option<SocketAddr>,
    /// `IP_TRANSPARENT` (needs `CAP_NET_ADMIN`).
    pub transparent: bool,
}

fn raw(fd: &OwnedFd) -> i32 {
    use std::os::fd::AsRawFd;
    fd.as_raw_fd()
}

fn with_context(e: io::Error, what: String) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn set_transparent(sock: &Socket, v6: bool) -> io::Result<()> {
    if v6 {
        sock.set_ip_transparent_v6(true)
    } else {
        sock.set_ip_transparent_v4(true)
    }
}

/// Creates a listener in the *current thread's* namespace (call it from
/// [`PodNetns::run_in`]). Errors keep their [`io::ErrorKind`].
pub fn listener_socket(addr: SocketAddr, transparent: bool) -> io::Result<TcpListener> {
    let ctx = |e: io::Error, step: &str| with_context(e, format!("listening on {addr}: {step}"));
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
        .map_err(|e| ctx(e, "socket"))?;
    sock.set_reuse_address(true)
        .map_err(|e| ctx(e, "SO_REUSEADDR"))?;
    if addr.is_ipv6() {
        sock.set_only_v6(true).map_err(|e| ctx(e, "IPV6_V6ONLY"))?;
    }
    if transparent {
        set_transparent(&sock, addr.is_ipv6()).map_err(|e| ctx(e, "IP_TRANSPARENT"))?;
    }
    sock.bind(&SockAddr::from(addr))
        .map_err(|e| ctx(e, "bind"))?;
    sock.listen(LISTEN_BACKLOG).map_err(|e| ctx(e, "listen"))?;
    sock.set_nonblocking(true)
        .map_err(|e| ctx(e, "O_NONBLOCK"))?;
    Ok(sock.into())
}

fn client_socket(dst: SocketAddr, opts: &SocketOptions) -> io::Result<Socket> {
    let ctx = |e: io::Error, step: &str| with_context(e, format!("socket to {dst}: {step}"));
    let sock = Socket::new(Domain::for_address(dst), Type::STREAM, Some(Protocol::TCP))
        .map_err(|e| ctx(e, "socket"))?;
    if let Some(mark) = opts.mark {
        sock.set_mark(mark).map_err(|e| ctx(e, "SO_MARK"))?;
    }
    if opts.transparent {
        set_transparent(&sock, dst.is_ipv6()).map_err(|e| ctx(e, "IP_TRANSPARENT"))?;
    }
    if let Some(local) = opts.bind {
        // IPv6 sockets honour this SOL_IP option too (inet6_bind checks it).
        if local.port() == 0 {
            // Pick the port at connect time, unique per 4-tuple: binding the
            // same client IP for every delivered connection would otherwise
            // reserve a port per bind, and once TIME_WAIT sockets fill half
            // the range each bind scans it in the kernel (milliseconds).
            nix::sys::socket::setsockopt(
                &sock,
                nix::sys::socket::sockopt::IpBindAddressNoPort,
                &true,
            )
            .map_err(|e| ctx(e.into(), "IP_BIND_ADDRESS_NO_PORT"))?;
        }
        sock.bind(&SockAddr::from(local))
            .map_err(|e| ctx(e, "bind"))?;
    }
    sock.set_nonblocking(true)
        .map_err(|e| ctx(e, "O_NONBLOCK"))?;
    Ok(sock)
}

/// The unspecified address of each family, for "all addresses of the pod".
pub const UNSPECIFIED: [std::net::IpAddr; 2] = [
    std::net::IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    std::net::IpAddr::V6(Ipv6Addr::UNSPECIFIED),
];
