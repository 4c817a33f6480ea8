//! `ambitctl local relay` (hidden; `local up` starts one per sidecar pod as
//! a background process of the cluster): the pod's way to the control
//! plane. It listens on `127.0.0.1:<port>` inside the pod's netns and
//! relays each connection to the control plane's TLS xDS/CA address on the
//! host's loopback, which pods cannot reach — the waypoint controller's
//! relay, in a process of its own. It ends on SIGTERM (`local down`) or
//! once the cluster's state file is gone.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::local::LocalError;
use crate::local::state::State;
use crate::local::waypoints::relay::Relay;

/// How often the relay checks that its cluster still exists.
const CHECK_EVERY: Duration = Duration::from_millis(500);

/// What one relay serves.
#[derive(Debug, Clone)]
pub struct RelayOptions {
    /// The cluster's state dir: the relay ends when its state file is gone.
    pub state_dir: PathBuf,
    /// The pod's network namespace (a name under `/var/run/netns`).
    pub netns: String,
    /// The port on the pod's loopback.
    pub listen_port: u16,
    /// Where each connection goes (dialled from the host's netns).
    pub to: SocketAddr,
}

/// Runs the relay until the cluster's state file is gone (or the process
/// is signalled).
pub fn run_relay(opts: &RelayOptions) -> Result<(), LocalError> {
    let listen = SocketAddr::from(([127, 0, 0, 1], opts.listen_port));
    let _relay = Relay::start(&opts.netns, listen, opts.to)?;
    println!(
        "relaying {listen} in netns {} to {} (until the cluster in {} is gone)",
        opts.netns,
        opts.to,
        opts.state_dir.display()
    );
    let state_file = State::path(&opts.state_dir);
    while state_file.exists() {
        std::thread::sleep(CHECK_EVERY);
    }
    println!("the cluster's state file is gone; stopping");
    Ok(())
}
