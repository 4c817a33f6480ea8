//! The `ztunnel` binary: parse the configuration, set up logging, run the
//! library until SIGTERM, ctrl-c or `POST /quitquitquit`.

#![forbid(unsafe_code)]

/// mimalloc: faster than glibc malloc for many small allocations across
/// threads, and it returns freed memory instead of fragmenting.
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
