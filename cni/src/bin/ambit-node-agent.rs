//! `ambit-node-agent`: one per node. Installs `ambit-cni` into the node's
//! CNI configuration, programs enrolled pods' redirection, hands pods to
//! the node's ztunnel over ZDS. Runs until SIGTERM or ctrl-c; pods keep
//! their redirection when it stops (a restarted agent picks them up).
//! `--uninstall` removes the plugin from the CNI configuration and every
//! enrolled pod's redirection, and exits (with `--hold`, waits for SIGTERM).

use std::path::PathBuf;

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
use tracing::info;

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
    /// Directory the container runtime execs CNI plugins from.
    #[arg(long, env = "CNI_BIN_DIR", default_value = "/opt/cni/bin")]
    cni_bin_dir: PathBuf,
    /// Directory of the node's CNI network configuration.
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
    /// installed) and removed when it stops: the DaemonSet's readiness.
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
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    ambit_cni::redirect::set_operation_timeout(std::time::Duration::from_millis(
        args.command_timeout_ms,
    ));
    let install_cfg = install_config(&args)?;
    if args.uninstall {
        let removed = install::remove(&install_cfg)?;
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
    let watcher = if args.no_install {
        None
    } else {
        let bin = install::install_binary(&install_cfg)?;
        let outcome = install::insert(&install_cfg)?;
        info!(binary = %bin.display(), conflist = %outcome.path().display(), "ambit-cni installed");
        Some(tokio::spawn(install::watch_and_reinsert(
            install_cfg.clone(),
            async {
                let _ = stop_rx.await;
            },
        )))
    };
    info!(node = %args.node_name, "node agent running");
    if let Some(f) = &args.ready_file {
        std::fs::write(f, "").with_context(|| format!("writing the ready file {}", f.display()))?;
    }

    let mut sigterm = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = sigterm.recv() => info!("SIGTERM received; stopping (pods keep their redirection)"),
        _ = tokio::signal::ctrl_c() => info!("interrupt received; stopping (pods keep their redirection)"),
    }
    if let Some(f) = &args.ready_file {
        let _ = std::fs::remove_file(f);
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
    Ok(())
}
