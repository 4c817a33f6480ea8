//! `ambit-node-agent`: one per node. Installs `ambit-cni` into the node's
//! CNI configuration, programs enrolled pods' redirection, hands pods to
//! the node's ztunnel over ZDS. Runs until SIGTERM or ctrl-c, then removes
//! its sockets and ready file; pods keep their redirection when it stops (a
//! restarted agent picks them up). With no primary CNI config yet it keeps
//! running and chains the plugin as soon as one appears (ready from then
//! on). `--uninstall` removes the plugin from the CNI configuration and
//! every enrolled pod's redirection, and exits (with `--hold`, waits for
//! SIGTERM).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use ambit_cni::agent::install::{self, InstallConfig};
use ambit_cni::agent::kube::{adopt_running_pods, spawn_kube_view};
use ambit_cni::agent::netns::NetnsFinder;
use ambit_cni::agent::view::spawn_dirs_view;
use ambit_cni::agent::{Agent, AgentConfig};
use ambit_cni::protocol::DEFAULT_AGENT_SOCKET;
use ambit_cni::redirect::RedirectPorts;
use anyhow::{Context, Result};
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tracing::{info, warn};

/// Flags; each can also be set by the upper-case environment variable.
#[derive(Debug, Parser)]
#[command(
    name = "ambit-node-agent",
    version,
    about = "Ambit node agent: ambient enrollment"
)]
struct Args {
    /// This node's name.
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// Directory of the mesh's Kubernetes YAML (local mode): namespace and
    /// pod labels decide enrollment. Without it the agent runs in
    /// Kubernetes mode (watches namespaces and this node's pods).
    #[arg(long, env = "CONFIG_DIR")]
    config_dir: Option<PathBuf>,
    /// More directories read like `--config-dir` (repeat the flag;
    /// `EXTRA_CONFIG_DIRS` takes a `:`-separated list): local mode's
    /// generated waypoint Pods. The main directory wins where both define
    /// an object.
    #[arg(
        long = "extra-config-dir",
        env = "EXTRA_CONFIG_DIRS",
        value_delimiter = ':'
    )]
    extra_config_dirs: Vec<PathBuf>,
    /// Kubernetes mode: the kubeconfig to use (default: the pod's service
    /// account).
    #[arg(long, env = "KUBECONFIG_FILE")]
    kubeconfig: Option<PathBuf>,
    /// The host's /proc (Kubernetes mode: where running pods' network
    /// namespaces are found; the DaemonSet mounts it at /host/proc).
    #[arg(long, env = "PROC_DIR", default_value = "/proc")]
    proc_dir: PathBuf,
    /// Where the pod table is kept across restarts.
    #[arg(long, env = "STATE_DIR", default_value = "/var/run/ambit")]
    state_dir: PathBuf,
    /// Socket the CNI plugin talks to.
    #[arg(long, env = "CNI_SOCKET", default_value = DEFAULT_AGENT_SOCKET)]
    cni_socket: PathBuf,
    /// Socket ztunnel connects to (ZDS).
    #[arg(long, env = "ZDS_SOCKET", default_value = ambit_inpod::DEFAULT_ZDS_PATH)]
    zds_socket: PathBuf,
    /// Directory the container runtime execs CNI plugins from (created,
    /// mode 0755, when only its last component is missing).
    #[arg(long, env = "CNI_BIN_DIR", default_value = "/opt/cni/bin")]
    cni_bin_dir: PathBuf,
    /// Directory of the node's CNI network configuration. ambit-cni is
    /// chained at the end of its primary config; until the node's CNI has
    /// written one the agent serves, waits and is not ready.
    #[arg(long, env = "CNI_CONF_DIR", default_value = "/etc/cni/net.d")]
    cni_conf_dir: PathBuf,
    /// The `ambit-cni` binary to install (default: next to this binary).
    #[arg(long, env = "PLUGIN_BINARY")]
    plugin_binary: Option<PathBuf>,
    /// Let pods start unenrolled when the agent is unreachable (default:
    /// refuse, so no pod runs unprotected).
    #[arg(long, env = "ALLOW_WITHOUT_AGENT")]
    allow_without_agent: bool,
    /// Do not touch the CNI configuration (it is managed elsewhere).
    #[arg(long, env = "NO_INSTALL")]
    no_install: bool,
    /// Remove the plugin from the CNI configuration and the bin dir, then exit.
    #[arg(long)]
    uninstall: bool,
    /// With --uninstall: then write /tmp/uninstalled and wait for SIGTERM
    /// (how `ambitctl uninstall` cleans every node through the DaemonSet:
    /// the pods' readiness is that file).
    #[arg(long, requires = "uninstall")]
    hold: bool,
    /// Written once the agent serves (view listed, sockets bound, plugin
    /// chained into the primary CNI config, or at once with --no-install)
    /// and removed when it stops: the DaemonSet's readiness.
    #[arg(long, env = "READY_FILE")]
    ready_file: Option<PathBuf>,
    /// Bound, in milliseconds, on installing, removing or checking one pod's
    /// redirection (every `ip`/`iptables` child it runs; a hung child is
    /// killed and the CNI ADD fails with a timeout error).
    #[arg(long, env = "COMMAND_TIMEOUT_MS", default_value_t = 4_000)]
    command_timeout_ms: u64,
}

fn install_config(args: &Args) -> Result<InstallConfig> {
    let plugin_source = match &args.plugin_binary {
        Some(p) => p.clone(),
        None => std::env::current_exe()
            .context("locating this binary")?
            .with_file_name("ambit-cni"),
    };
    Ok(InstallConfig {
        plugin_source,
        cni_bin_dir: args.cni_bin_dir.clone(),
        cni_conf_dir: args.cni_conf_dir.clone(),
        plugin_config: serde_json::json!({
            "type": "ambit-cni",
            "ambit": {
                "agent_socket": args.cni_socket,
                "allow_without_agent": args.allow_without_agent,
            }
        }),
    })
}

#[tokio::main]
async fn main() -> ExitCode {
    ambit_cni::agent::logging::init();
    raise_nofile_limit();
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ambit-node-agent: error: {}", error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// Raises this process's soft RLIMIT_NOFILE to its hard limit, as Istio's
/// ztunnel does: a service manager's default soft limit (1,024 under
/// systemd) would cap the pods' netns handles and the ZDS and CNI sockets
/// of a busy node while the hard limit allows far more. Logs the limit in effect; a failure is a warning,
/// not fatal (the process runs with what it has).
fn raise_nofile_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (soft, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(limits) => limits,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-file limit (RLIMIT_NOFILE)");
            return;
        }
    };
    if soft >= hard {
        tracing::info!(limit = soft, "open-file limit (RLIMIT_NOFILE)");
        return;
    }
    match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
        Ok(()) => tracing::info!(
            limit = hard,
            was = soft,
            "raised the open-file limit (RLIMIT_NOFILE) to its hard limit"
        ),
        Err(e) => tracing::warn!(
            limit = soft,
            hard,
            error = %e,
            "cannot raise the open-file limit (RLIMIT_NOFILE) to its hard limit; running with the soft limit"
        ),
    }
}

/// The error and those of its causes its message does not already carry.
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !out.contains(&c) {
            out.push_str(": ");
            out.push_str(&c);
        }
    }
    out
}

async fn write_ready(f: &Path) -> Result<()> {
    tokio::fs::write(f, "")
        .await
        .with_context(|| format!("writing the ready file {}", f.display()))
}

async fn remove_ready(f: &Path) {
    match tokio::fs::remove_file(f).await {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => warn!(path = %f.display(), error = %e, "cannot remove the ready file"),
    }
}

async fn run(args: Args) -> Result<()> {
    ambit_cni::redirect::set_operation_timeout(std::time::Duration::from_millis(
        args.command_timeout_ms,
    ));
    let install_cfg = install_config(&args)?;
    if args.uninstall {
        let cfg = install_cfg.clone();
        let removed = tokio::task::spawn_blocking(move || install::remove(&cfg)).await??;
        info!(removed, "ambit-cni removed from the CNI configuration");
        // No pod may stay redirected to a ztunnel that is going away.
        let state_dir = args.state_dir.clone();
        let released = tokio::task::spawn_blocking(move || {
            ambit_cni::agent::PodTable::release_all(&state_dir)
        })
        .await?;
        info!(released, "enrolled pods' redirection removed");
        if args.hold {
            std::fs::write("/tmp/uninstalled", "")?;
            let mut sigterm = signal(SignalKind::terminate())?;
            tokio::select! {
                _ = sigterm.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        return Ok(());
    }
    // A ready file left by a previous run that did not stop cleanly must
    // not announce this one.
    if let Some(f) = &args.ready_file {
        remove_ready(f).await;
    }
    // The plugin binary first: a wrong --cni-bin-dir fails before anything
    // is created or bound.
    if !args.no_install {
        let cfg = install_cfg.clone();
        let bin = tokio::task::spawn_blocking(move || install::install_binary(&cfg)).await??;
        info!(binary = %bin.display(), "ambit-cni plugin binary installed");
    }

    let view = match &args.config_dir {
        Some(dir) => {
            let mut dirs = vec![dir.clone()];
            dirs.extend(args.extra_config_dirs.iter().cloned());
            spawn_dirs_view(dirs)
        }
        None => {
            let client = ambit_cni::agent::kube::client(args.kubeconfig.as_deref()).await?;
            info!(node = %args.node_name, "Kubernetes mode: listing namespaces and this node's pods");
            // Wait for the first complete list: an empty view would release
            // every pod. CNI ADDs meanwhile get "try again later".
            let mut listing = std::pin::pin!(spawn_kube_view(client, &args.node_name));
            loop {
                match tokio::time::timeout(std::time::Duration::from_secs(30), &mut listing).await {
                    Ok(v) => break v?,
                    Err(_) => tracing::warn!(
                        "still waiting for the API server to list namespaces and pods (check the node agent's RBAC and the API server's reachability)"
                    ),
                }
            }
        }
    };
    // From here on the agent holds files to clean up: take the signals
    // before it binds anything.
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let adopt_view = args.config_dir.is_none().then(|| view.clone());
    let agent = Agent::start(
        AgentConfig {
            cni_socket: args.cni_socket.clone(),
            zds_socket: args.zds_socket.clone(),
            state_dir: args.state_dir.clone(),
            ports: RedirectPorts::default(),
        },
        view,
    )
    .await?;
    let adopter = adopt_view.map(|v| {
        tokio::spawn(adopt_running_pods(
            agent.client(),
            v,
            NetnsFinder {
                proc_dir: args.proc_dir.clone(),
                ..NetnsFinder::default()
            },
        ))
    });

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (watcher, mut chained) = if args.no_install {
        (None, None)
    } else {
        let (tx, rx) = watch::channel(None);
        let task = tokio::spawn(install::watch_and_reinsert_reporting(
            install_cfg.clone(),
            async {
                let _ = stop_rx.await;
            },
            tx,
        ));
        (Some(task), Some(rx))
    };
    info!(node = %args.node_name, "node agent running");
    let mut ready = false;
    if chained.is_none() {
        if let Some(f) = &args.ready_file {
            write_ready(f).await?;
        }
        ready = true;
    }

    let stop = loop {
        tokio::select! {
            _ = sigterm.recv() => break "SIGTERM received",
            _ = sigint.recv() => break "interrupt received",
            r = wait_chained(&mut chained), if !ready => {
                let conflist = r?;
                if let Some(f) = &args.ready_file {
                    write_ready(f).await?;
                }
                ready = true;
                info!(conflist = %conflist.display(), "node agent ready: ambit-cni is chained into the primary CNI config");
            }
        }
    };
    info!("{stop}; stopping (pods keep their redirection)");
    if let Some(f) = &args.ready_file {
        remove_ready(f).await;
    }
    let _ = stop_tx.send(());
    if let Some(w) = watcher {
        let _ = w.await;
    }
    if let Some(a) = adopter {
        a.abort();
        let _ = a.await;
    }
    agent.shutdown().await;
    info!(cni = %args.cni_socket.display(), zds = %args.zds_socket.display(), "node agent stopped; its sockets are removed");
    Ok(())
}

/// The config file our entry is chained into, once it is.
async fn wait_chained(chained: &mut Option<watch::Receiver<Option<PathBuf>>>) -> Result<PathBuf> {
    let rx = chained
        .as_mut()
        .context("no installer to wait for (--no-install)")?;
    let path = rx
        .wait_for(Option::is_some)
        .await
        .context("the CNI config watcher stopped unexpectedly")?
        .clone();
    path.context("the CNI config watcher reported no config")
}
