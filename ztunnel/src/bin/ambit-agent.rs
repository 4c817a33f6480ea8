//! The `ambit-agent` binary: parse the configuration, set up logging, run
//! the agent (`ambit_ztunnel::agent::run`) until SIGTERM/SIGINT or until
//! Envoy exits, and exit with the agent's code (Envoy's status when it
//! exited by itself).

#![forbid(unsafe_code)]

use std::io::IsTerminal;
use std::process::ExitCode;

use ambit_ztunnel::agent::{self, AgentConfig};
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tracing::info;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    // `ambit-agent redirect ...`: the sidecar's init container, one shot.
    if std::env::args().nth(1).as_deref() == Some("redirect") {
        let args = agent::redirect::RedirectArgs::parse_from(std::env::args().skip(1));
        return match agent::redirect::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("ambit-agent redirect: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let config = AgentConfig::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();

    // One thread is plenty: the agent serves one Envoy. Blocking work
    // (file writes) goes to tokio's blocking pool.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ambit-agent: could not start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("ambit-agent: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(config: AgentConfig) -> anyhow::Result<u8> {
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let (stop_tx, stop_rx) = mpsc::channel(4);
    tokio::spawn(async move {
        loop {
            let name = tokio::select! {
                _ = sigterm.recv() => "SIGTERM",
                _ = sigint.recv() => "SIGINT",
            };
            info!("{name} received");
            if stop_tx.send(()).await.is_err() {
                return;
            }
        }
    });
    let exit = agent::run(config, stop_rx).await?;
    info!(?exit, "ambit-agent exiting");
    Ok(exit.code())
}
