//! A TCP relay from a pod's loopback to the control plane on the host's:
//! the listener is made inside the pod's netns, each connection is dialled
//! from the host's. Plain threads: a waypoint has two connections to the
//! control plane (the agent's CA channel and Envoy's ADS stream).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::local::{LocalError, netns};

/// Most connections relayed at once per pod (the rest are closed at accept).
const MAX_CONNECTIONS: usize = 32;
/// Bound on dialling the control plane.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection silent this long each way is closed (Envoy's ADS stream
/// pings every 30 s; the peers reconnect).
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// How often the accept loop looks at its stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(50);

/// A running relay; stops accepting when dropped (live connections end
/// when either side closes).
#[derive(Debug)]
pub(crate) struct Relay {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Relay {
    /// Listens on `listen` inside netns `pod_netns` and relays each
    /// connection to `target` (dialled from this process's netns).
    pub(crate) fn start(
        pod_netns: &str,
        listen: SocketAddr,
        target: SocketAddr,
    ) -> Result<Relay, LocalError> {
        let path = netns::path(pod_netns);
        let err = |e: std::io::Error| LocalError::Io {
            what: format!(
                "listening on {listen} in netns {pod_netns} (relay to the control plane)"
            ),
            path: path.clone(),
            source: e,
        };
        let ns = ambit_inpod::PodNetns::open(&path)
            .map_err(|e| err(std::io::Error::other(e.to_string())))?;
        let listener = ns
            .run_in(move || {
                let l = TcpListener::bind(listen)?;
                l.set_nonblocking(true)?;
                Ok(l)
            })
            .map_err(err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("relay-{pod_netns}"))
            .spawn(move || accept_loop(&listener, target, &flag))
            .map_err(err)?;
        Ok(Relay {
            stop,
            thread: Some(thread),
        })
    }
}

fn accept_loop(listener: &TcpListener, target: SocketAddr, stop: &AtomicBool) {
    let live = Arc::new(AtomicUsize::new(0));
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((inside, _)) => {
                if live.load(Ordering::Relaxed) >= MAX_CONNECTIONS {
                    continue; // dropped: closed
                }
                live.fetch_add(1, Ordering::Relaxed);
                let live = live.clone();
                let spawned =
                    std::thread::Builder::new()
                        .name("relay-conn".into())
                        .spawn(move || {
                            relay_one(inside, target);
                            live.fetch_sub(1, Ordering::Relaxed);
                        });
                if spawned.is_err() {
                    eprintln!("relay: cannot start a thread; connection dropped");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(ACCEPT_POLL);
            }
            Err(e) => {
                eprintln!("relay: accept failed: {e}");
                std::thread::sleep(ACCEPT_POLL);
            }
        }
    }
}

fn relay_one(inside: TcpStream, target: SocketAddr) {
    let outside = match TcpStream::connect_timeout(&target, CONNECT_TIMEOUT) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("relay: connecting to the control plane at {target}: {e}");
            return;
        }
    };
    // The accepted socket inherits non-blocking from the listener.
    if inside.set_nonblocking(false).is_err() {
        return;
    }
    for s in [&inside, &outside] {
        let _ = s.set_nodelay(true);
        let _ = s.set_read_timeout(Some(IDLE_TIMEOUT));
    }
    let (Ok(in2), Ok(out2)) = (inside.try_clone(), outside.try_clone()) else {
        return;
    };
    let up = std::thread::Builder::new()
        .name("relay-up".into())
        .spawn(move || pump(in2, out2));
    pump(outside, inside);
    if let Ok(t) = up {
        let _ = t.join();
    }
}

/// Copies `from` to `to` until EOF or an error, then half-closes `to`
/// (and stops reading `from`, so the other direction ends too on errors).
fn pump(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    let _ = from.shutdown(Shutdown::Read);
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => {
                let _ = to.shutdown(Shutdown::Both);
                return;
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
