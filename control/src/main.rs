//! `ambit-control`: the Ambit control plane.

/// mimalloc: faster than glibc malloc for many small allocations across
/// threads, and it returns freed memory instead of fragmenting.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use anyhow::Context;
use clap::Parser;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Colour only on a terminal: log files stay plain text.
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_ansi(std::io::stdout().is_terminal())
        .with_env_filter(
            // RUST_LOG, as for ztunnel and the node agent; LOG_LEVEL still works.
            EnvFilter::try_from_default_env()
                .or_else(|_| EnvFilter::try_from_env("LOG_LEVEL"))
                .unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    raise_nofile_limit();
    let cfg = ambit_control::ControlConfig::parse();
    let cp = ambit_control::ControlPlane::start(cfg)
        .await
        .context("control plane failed to start")?;
    wait_for_signal().await?;
    tracing::info!("shutting down");
    cp.shutdown().await;
    Ok(())
}

/// Raises this process's soft RLIMIT_NOFILE to its hard limit, as Istio's
/// ztunnel does: a service manager's default soft limit (1,024 under
/// systemd) would cap the xDS and CA listeners at about a thousand
/// proxies and clients while the hard limit allows far more. Logs the limit in effect; a failure is a warning,
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

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("cannot install SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("cannot wait for ctrl-c")?,
        _ = term.recv() => {}
    }
    Ok(())
}
