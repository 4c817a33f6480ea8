//! `ambitctl local up|down|status|exec`: flags and printing for a whole
//! mesh on this host (SPEC §5); the work is [`ambitctl::local`].

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use ambitctl::local::{
    self, ControllerOptions, DownOptions, LocalCluster, RelayOptions, UpOptions,
};
use anyhow::{Context, Result};
use clap::Subcommand;

use super::{Format, out};

/// Which cluster: its name and where its state is.
#[derive(Debug, clap::Args)]
pub struct Which {
    /// Cluster name (lower-case letters and digits); prefixes its network
    /// namespaces, so several clusters can run side by side.
    #[arg(long, env = "AMBIT_LOCAL_NAME", default_value = local::DEFAULT_NAME)]
    name: String,
    /// State directory (default: /var/run/ambit-local/<name>).
    #[arg(long)]
    state_dir: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum LocalCmd {
    /// Builds the cluster from DIR's YAML and returns once the mesh is ready.
    Up {
        /// Directory of Kubernetes YAML: Namespaces, Pods (with
        /// spec.nodeName and status.podIP; annotation ambit.dev/demo-app
        /// runs `ambit-demo <args>` in the pod), Services, policies.
        #[arg(default_value = "deploy/local/demo")]
        dir: PathBuf,
        #[command(flatten)]
        which: Which,
        /// Directory of ambit-control, ztunnel, ambit-node-agent, ambit-cni,
        /// ambit-demo, ambit-agent and ambitctl (default: the directory of
        /// this binary).
        #[arg(long)]
        bin_dir: Option<PathBuf>,
        /// On failure, leave everything in place for inspection.
        #[arg(long)]
        keep_on_failure: bool,
        /// Longest wait for each readiness step, in seconds.
        #[arg(long, default_value_t = 30)]
        timeout_secs: u64,
        /// Serve DIR itself (edits to DIR apply live) instead of a working
        /// copy of its config files in the state directory (the default,
        /// so playing never edits a checkout's tracked files).
        #[arg(long)]
        in_place: bool,
    },
    /// Stops every process, removes every network namespace and the state
    /// directory (with the config's working copy); also after a crash or a
    /// half-finished `up`.
    Down {
        #[command(flatten)]
        which: Which,
        /// First save the config's working copy (with your edits) in DIR, a
        /// new or empty directory; nothing is removed if that fails.
        #[arg(long, value_name = "DIR")]
        keep_config: Option<PathBuf>,
    },
    /// Nodes; pods and whether each is in the mesh now (its labels in the
    /// config, its node agent, the ztunnels); the connections apps made,
    /// one row each (mTLS or plaintext, outcome).
    Status {
        #[command(flatten)]
        which: Which,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
        output: Format,
    },
    /// Runs CMD inside the network namespace of NAMESPACE/POD
    /// (`ambit-demo` resolves to the cluster's own binary).
    Exec {
        #[command(flatten)]
        which: Which,
        /// NAMESPACE/POD.
        pod: String,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// Runs the waypoint controller of a cluster in the foreground: starts
    /// and stops waypoint pods as the config's waypoint Gateways come and
    /// go (`local up` starts it in the background).
    #[command(hide = true)]
    WaypointController {
        #[command(flatten)]
        which: Which,
        /// Longest wait for each step of making a waypoint pod, in seconds.
        #[arg(long, default_value_t = 30)]
        timeout_secs: u64,
    },
    /// Relays a sidecar pod's connections to the control plane: listens on
    /// 127.0.0.1:PORT inside the pod's netns, dials TO from the host's
    /// (`local up` starts one per sidecar pod in the background).
    #[command(hide = true)]
    Relay {
        #[command(flatten)]
        which: Which,
        /// The pod's network namespace.
        #[arg(long)]
        netns: String,
        /// The port on the pod's loopback.
        #[arg(long)]
        listen_port: u16,
        /// The control plane's address on the host.
        #[arg(long)]
        to: std::net::SocketAddr,
    },
}

/// Runs one `local` command; the exit code is the command's own for `exec`.
pub fn run(cmd: LocalCmd) -> Result<ExitCode> {
    match cmd {
        LocalCmd::Up {
            dir,
            which,
            bin_dir,
            keep_on_failure,
            timeout_secs,
            in_place,
        } => {
            let bin_dir = match bin_dir {
                Some(d) => d,
                None => std::env::current_exe()
                    .context("locating ambitctl to find the other binaries; pass --bin-dir")?
                    .parent()
                    .context("ambitctl has no parent directory; pass --bin-dir")?
                    .to_path_buf(),
            };
            let mut opts = UpOptions::new(dir, bin_dir);
            opts.name = which.name;
            opts.state_dir = which.state_dir;
            opts.keep_on_failure = keep_on_failure;
            opts.timeout = Duration::from_secs(timeout_secs);
            opts.working_copy = !in_place;
            eprintln!(
                "Starting local cluster {} from {} (state in {}) ...",
                opts.name,
                opts.config_dir.display(),
                opts.state_dir_or_default().display()
            );
            let cluster = local::up(&opts)?;
            out(&cluster.summary());
            Ok(ExitCode::SUCCESS)
        }
        LocalCmd::Down { which, keep_config } => {
            let mut opts = DownOptions::new(which.name);
            opts.state_dir = which.state_dir;
            opts.keep_config = keep_config;
            let report = local::down(&opts)?;
            out(&report.render());
            Ok(ExitCode::SUCCESS)
        }
        LocalCmd::Status { which, output } => {
            let cluster = LocalCluster::open(&which.name, which.state_dir.as_deref())?;
            match output {
                Format::Table => out(&cluster.render_status()),
                Format::Json => out(&format!(
                    "{}\n",
                    serde_json::to_string_pretty(&cluster.status()).context("encoding status")?
                )),
                Format::Yaml => {
                    out(&serde_saphyr::to_string(&cluster.status()).context("encoding status")?)
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        LocalCmd::WaypointController {
            which,
            timeout_secs,
        } => {
            let state_dir = which
                .state_dir
                .unwrap_or_else(|| local::default_state_dir(&which.name));
            local::run_controller(&ControllerOptions {
                name: which.name,
                state_dir: std::path::absolute(&state_dir)
                    .context("resolving the state directory")?,
                poll: Duration::from_millis(200),
                timeout: Duration::from_secs(timeout_secs),
            })?;
            Ok(ExitCode::SUCCESS)
        }
        LocalCmd::Relay {
            which,
            netns,
            listen_port,
            to,
        } => {
            let state_dir = which
                .state_dir
                .unwrap_or_else(|| local::default_state_dir(&which.name));
            local::run_relay(&RelayOptions {
                state_dir: std::path::absolute(&state_dir)
                    .context("resolving the state directory")?,
                netns,
                listen_port,
                to,
            })?;
            Ok(ExitCode::SUCCESS)
        }
        LocalCmd::Exec { which, pod, cmd } => {
            let cluster = LocalCluster::open(&which.name, which.state_dir.as_deref())?;
            let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
            let status = cluster
                .command(&pod, &args)?
                .status()
                .with_context(|| format!("running `{}` in pod {pod}", cmd.join(" ")))?;
            let code = match (status.code(), status.signal()) {
                (Some(c), _) => c,
                (None, Some(sig)) => 128 + sig,
                (None, None) => 1,
            };
            Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
        }
    }
}
