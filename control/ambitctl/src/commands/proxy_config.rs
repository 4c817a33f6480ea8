//! `ambitctl proxy-config`: flags and printing; the work is
//! [`ambitctl::proxy_config`].

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use ambitctl::proxy_config::{self, Section};
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};

use super::{Format, Target, out, structured};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum What {
    Routes,
    Clusters,
    Listeners,
    Endpoints,
    Secrets,
}

#[derive(Debug, Args)]
pub struct ProxyConfigArgs {
    /// What to show.
    what: What,
    /// NAMESPACE/POD of the waypoint or sidecar (local cluster: its admin
    /// is reached from inside the pod's network namespace).
    pod: Option<String>,
    /// Envoy's admin address, instead of a pod.
    #[arg(long, value_name = "ADDR", conflicts_with = "pod")]
    admin: Option<SocketAddr>,
    /// Envoy's admin port inside the pod.
    #[arg(long, default_value_t = 15000)]
    admin_port: u16,
    #[command(flatten)]
    target: Target,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    output: Format,
}

pub fn run(args: ProxyConfigArgs) -> Result<ExitCode> {
    let timeout = Duration::from_secs(args.target.timeout_secs);
    let section = match args.what {
        What::Routes => Section::Routes,
        What::Clusters => Section::Clusters,
        What::Listeners => Section::Listeners,
        What::Endpoints => Section::Endpoints,
        What::Secrets => Section::Secrets,
    };
    let dump = match (&args.admin, &args.pod) {
        (Some(a), _) => proxy_config::fetch(*a, timeout)?,
        (None, Some(pod)) => {
            let cluster = args.target.require_local(&format!("pod {pod}"))?;
            let p = cluster.find_pod(pod)?;
            let path = std::path::Path::new("/var/run/netns").join(&p.netns);
            proxy_config::fetch_in_netns(pod, &path, args.admin_port, timeout)?
        }
        (None, None) => anyhow::bail!(
            "which Envoy? give NAMESPACE/POD of a waypoint or sidecar (local cluster), or --admin ADDR"
        ),
    };
    let v = proxy_config::section(&dump, section);
    match args.output {
        Format::Table => out(&proxy_config::render(section, &v)),
        f => out(&structured(f, &v).context("encoding the section")?),
    }
    Ok(ExitCode::SUCCESS)
}
