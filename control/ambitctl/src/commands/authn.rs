//! `ambitctl authn tls-check`: flags and printing; the work is
//! [`ambitctl::authn`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use ambitctl::analyze::{Files, LocalMesh, Source};
use ambitctl::authn;
use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use super::{Format, Target, out, structured};

#[derive(Debug, Subcommand)]
pub enum AuthnCmd {
    /// The effective mTLS mode per service port, the PeerAuthentication
    /// that decided it, and whether live traffic is mutual_tls.
    TlsCheck(TlsCheckArgs),
}

#[derive(Debug, Args)]
pub struct TlsCheckArgs {
    /// Only the ports serving this pod (NAMESPACE/POD).
    pod: Option<String>,
    /// Only this Service (name, name.namespace or host).
    service: Option<String>,
    /// Read config from these files or directories instead of the local
    /// cluster's config directory.
    #[arg(short = 'f', long = "file", value_name = "FILE|DIR")]
    files: Vec<PathBuf>,
    /// ztunnel metrics addresses to read live traffic from (default: every
    /// node of the local cluster); repeatable.
    #[arg(long, value_name = "ADDR")]
    stats: Vec<SocketAddr>,
    #[command(flatten)]
    target: Target,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    output: Format,
}

pub fn run(cmd: AuthnCmd) -> Result<ExitCode> {
    let AuthnCmd::TlsCheck(args) = cmd;
    let timeout = Duration::from_secs(args.target.timeout_secs);
    let (docs, mut stats) = if args.files.is_empty() {
        let cluster = args
            .target
            .require_local("the mesh's config (or pass -f DIR)")?;
        let local = LocalMesh {
            name: cluster.name().to_string(),
            state_dir: Some(cluster.state_dir().to_path_buf()),
        };
        let stats: Vec<SocketAddr> = cluster.nodes().iter().map(|n| n.stats_addr).collect();
        (local.documents()?, stats)
    } else {
        (Files::new(args.files.clone()).documents()?, Vec::new())
    };
    if !args.stats.is_empty() {
        stats = args.stats.clone();
    }
    let objects = docs
        .into_iter()
        .filter_map(|d| d.decoded.ok().flatten())
        .collect();
    let mut texts = Vec::new();
    for addr in stats {
        let text = ambitctl::http::get(addr, "/metrics", "ztunnel's metrics", timeout)
            .with_context(|| format!("reading live traffic from ztunnel metrics at {addr}"))?;
        texts.push(text);
    }
    let rows = authn::tls_check(
        objects,
        &texts,
        args.pod.as_deref(),
        args.service.as_deref(),
    );
    match args.output {
        Format::Table => out(&authn::render(&rows)),
        f => out(&structured(f, &rows)?),
    }
    Ok(ExitCode::SUCCESS)
}
