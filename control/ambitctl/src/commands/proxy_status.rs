//! `ambitctl proxy-status`: flags and printing; the work is
//! [`ambitctl::proxy_status`].

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use ambitctl::proxy_status;
use anyhow::{Context, Result};
use clap::Args;

use super::{Format, Target, out, structured};

#[derive(Debug, Args)]
pub struct ProxyStatusArgs {
    #[command(flatten)]
    target: Target,
    /// Only the proxy whose name (pod.namespace or node) or node id
    /// contains this.
    proxy: Option<String>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    output: Format,
}

pub fn run(args: ProxyStatusArgs) -> Result<ExitCode> {
    let addr: SocketAddr = args.target.control_plane()?;
    let mut status = proxy_status::collect(addr, Duration::from_secs(args.target.timeout_secs))
        .context("reading proxy status")?;
    if let Some(p) = &args.proxy {
        status
            .proxies
            .retain(|r| r.name.contains(p.as_str()) || r.node_id.contains(p.as_str()));
    }
    match args.output {
        Format::Table => out(&proxy_status::render(&status)),
        f => out(&structured(f, &status)?),
    }
    Ok(ExitCode::SUCCESS)
}
