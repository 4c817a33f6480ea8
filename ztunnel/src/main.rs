//! The `ztunnel` binary: parse the configuration, set up logging, run the
//! library until SIGTERM, ctrl-c or `POST /quitquitquit`.

#![forbid(unsafe_code)]

/// jemalloc: on the two-node bed it moves a byte for ~20 % less CPU than
/// mimalloc did (bulk through HBONE), with the same memory per idle
/// connection; glibc malloc matched its speed but held ~30 % more per
/// connection (benches/README.md, "Data plane against the floor", levers).
#[cfg(not(any(feature = "system-allocator", feature = "mimalloc")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// mimalloc, for comparison (the `mimalloc` feature; `system-allocator`
/// wins when both are on).
#[cfg(all(feature = "mimalloc", not(feature = "system-allocator")))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::io::IsTerminal;
use std::process::ExitCode;

use ambit_ztunnel::admin::LogControl;
use ambit_ztunnel::{Config, StartOptions};
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};
use tracing::info;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

fn main() -> ExitCode {
    let config = Config::parse();

    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let (filter, reload) = tracing_subscriber::reload::Layer::new(filter);
    tracing_subscriber::registry()
        .with(filter)
        .with(tracing_subscriber::fmt::layer().with_ansi(std::io::stdout().is_terminal()))
        .init();
    raise_nofile_limit();

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ztunnel: could not start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config, LogControl::new(reload))) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ztunnel: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Raises this process's soft RLIMIT_NOFILE to its hard limit, as Istio's
/// ztunnel does: a service manager's default soft limit (1,024 under
/// systemd) would cap the node's pods at a few hundred proxied connections
/// (two sockets each, or more) while the hard limit allows far more. Logs the limit in effect; a failure is a warning,
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

async fn run(config: Config, log: LogControl) -> anyhow::Result<()> {
    let options = StartOptions {
        log_control: Some(log),
    };
    let ztunnel = ambit_ztunnel::start_with(config, options).await?;
    let mut sigterm = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = sigterm.recv() => info!("SIGTERM received; shutting down"),
        _ = tokio::signal::ctrl_c() => info!("interrupt received; shutting down"),
        _ = ztunnel.quit_requested() => info!("quit requested; shutting down"),
    }
    ztunnel.shutdown().await;
    Ok(())
}
