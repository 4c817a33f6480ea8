//! `ambitctl ztunnel-config`: flags and printing; the work is
//! [`ambitctl::ztunnel_config`].

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use ambitctl::ztunnel_config::{self, Section};
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};

use super::{Format, Target, out, structured};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum What {
    Workloads,
    Services,
    Policies,
    Certificates,
    Connections,
}

#[derive(Debug, Args)]
pub struct ZtunnelConfigArgs {
    /// What to show.
    what: What,
    /// The node whose ztunnel to ask (local cluster; default: the first).
    #[arg(long)]
    node: Option<String>,
    /// ztunnel's admin address (instead of the local cluster's).
    #[arg(long, value_name = "ADDR")]
    admin: Option<SocketAddr>,
    /// ztunnel's metrics address, for connections (instead of the local
    /// cluster's).
    #[arg(long, value_name = "ADDR")]
    stats: Option<SocketAddr>,
    #[command(flatten)]
    target: Target,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    output: Format,
}

pub fn run(args: ZtunnelConfigArgs) -> Result<ExitCode> {
    let timeout = Duration::from_secs(args.target.timeout_secs);
    let section = match args.what {
        What::Workloads => Section::Workloads,
        What::Services => Section::Services,
        What::Policies => Section::Policies,
        What::Certificates => Section::Certificates,
        What::Connections => Section::Connections,
    };
    let node_addrs = || -> Result<(SocketAddr, SocketAddr)> {
        let cluster = args
            .target
            .require_local("a ztunnel (pass --admin/--stats)")?;
        let node = match &args.node {
            Some(n) => cluster.state.node(n).with_context(|| {
                let known: Vec<&str> = cluster.nodes().iter().map(|n| n.name.as_str()).collect();
                format!(
                    "no node {n:?} in local cluster {}; nodes: {}",
                    cluster.name(),
                    known.join(", ")
                )
            })?,
            None => cluster
                .nodes()
                .first()
                .with_context(|| format!("local cluster {} has no nodes", cluster.name()))?,
        };
        Ok((node.admin_addr, node.stats_addr))
    };
    if section == Section::Connections {
        let stats = match args.stats {
            Some(a) => a,
            None => node_addrs()?.1,
        };
        let rows = ztunnel_config::collect_connections(stats, timeout)?;
        match args.output {
            Format::Table => out(&ztunnel_config::render_connections(&rows)),
            f => out(&structured(f, &rows)?),
        }
        return Ok(ExitCode::SUCCESS);
    }
    let admin = match args.admin {
        Some(a) => a,
        None => node_addrs()?.0,
    };
    let v = ztunnel_config::dump_section(admin, section, timeout)?;
    match args.output {
        Format::Table => out(&ztunnel_config::render_section(section, &v)),
        f => out(&structured(f, &v)?),
    }
    Ok(ExitCode::SUCCESS)
}
