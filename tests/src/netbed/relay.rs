//! A TCP relay from inside a pod's network namespace to an address of the
//! test's own (host) namespace — how a process in a pod (a waypoint's
//! agent and Envoy) reaches the in-process control plane, which listens on
//! the host's loopback. The relay's listener lives in the pod; each
//! accepted connection is copied to a fresh connection made from the host
//! namespace. Bytes pass untouched (TLS stays end to end).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::net::TcpStream;
use tokio::task::{JoinHandle, JoinSet};

use super::{PodNet, listen_on};

/// Bound on connecting to the relay's target.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A running relay; stops (with every relayed connection) on drop.
#[derive(Debug)]
pub struct Relay {
    /// Where it listens, inside the pod.
    pub listen: SocketAddr,
    /// Where it connects, from the host namespace.
    pub target: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Relay {
    /// Listens on `listen` inside `pod` and relays each connection to
    /// `target` in the test's namespace.
    pub fn start(pod: &PodNet, listen: SocketAddr, target: SocketAddr) -> Result<Relay> {
        let listener = listen_on(pod, listen)
            .with_context(|| format!("relay listener {listen} in pod {}", pod.name))?;
        let name = pod.name.clone();
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((inside, _)) => {
                            conns.spawn(relay_one(inside, target));
                        }
                        Err(e) => {
                            println!("relay in pod {name}: accept failed: {e}");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    },
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(Relay {
            listen,
            target,
            task,
        })
    }
}

async fn relay_one(mut inside: TcpStream, target: SocketAddr) {
    let outside = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target)).await;
    let mut outside = match outside {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            println!("relay: connecting to {target}: {e}");
            return;
        }
        Err(_) => {
            println!("relay: connecting to {target}: no answer within {CONNECT_TIMEOUT:?}");
            return;
        }
    };
    let _ = tokio::io::copy_bidirectional(&mut inside, &mut outside).await;
}
