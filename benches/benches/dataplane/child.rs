//! The ztunnel under test, in a child process of its own (this binary
//! re-executed with `AMBIT_BENCH_ROLE=ztunnel`), so its CPU time and RSS
//! are its own. Runs like the shipped binary: mimalloc (the bench's global
//! allocator), a default multi-thread runtime (one worker per core), logs
//! at `info` (access log included) written to a file.
//!
//! Environment: `XDS_ADDRESS`, `TOKEN_FILE`, `ROOT_CERT`, `ZDS_PATH`,
//! `NODE_NAME`, `ZT_LOG_FILE`, `ZT_LOG` (filter, default `info`),
//! `INBOUND_TRANSPARENT` (inherited; `false` turns it off). Prints
//! `READY <admin> <stats>` once synced, and stops on SIGTERM or when stdin
//! closes.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::EnvFilter;

/// Value of `AMBIT_BENCH_ROLE` that selects this role.
pub const ROLE: &str = "ztunnel";

fn var(name: &str) -> Result<String> {
    std::env::var(name).with_context(|| format!("ztunnel child: {name} is not set"))
}

pub fn run() -> Result<()> {
    let log = std::fs::File::create(var("ZT_LOG_FILE")?)?;
    let filter = std::env::var("ZT_LOG").unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::new(filter))
        .with_ansi(false)
        .with_writer(std::sync::Mutex::new(log))
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let result = runtime.block_on(async {
        let mut config = ambit_ztunnel::Config::new(var("NODE_NAME")?, var("XDS_ADDRESS")?)
            .with_ephemeral_ports();
        config.token_file = Some(PathBuf::from(var("TOKEN_FILE")?));
        config.root_cert = Some(PathBuf::from(var("ROOT_CERT")?));
        config.zds_path = PathBuf::from(var("ZDS_PATH")?);
        if let Ok(v) = std::env::var("INBOUND_TRANSPARENT") {
            config.inbound_transparent = v != "false";
        }
        let zt = ambit_ztunnel::start(config).await?;
        tokio::time::timeout(Duration::from_secs(20), zt.wait_ready())
            .await
            .context("ztunnel child: no xDS sync within 20 s")?;
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "READY {} {}", zt.admin_addr(), zt.stats_addr())?;
            out.flush()?;
        }
        let stdin_closed = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            let mut stdin = std::io::stdin().lock();
            while stdin.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                line.clear();
            }
        });
        let mut term = signal(SignalKind::terminate())?;
        tokio::select! {
            _ = stdin_closed => {}
            _ = term.recv() => {}
        }
        zt.shutdown().await;
        Ok(())
    });
    // The stdin reader may still block; do not wait for it.
    runtime.shutdown_background();
    result
}
