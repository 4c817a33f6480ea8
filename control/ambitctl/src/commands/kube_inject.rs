//! `ambitctl kube-inject`: flags and printing; the work is
//! [`ambitctl::kube_inject`].

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use ambit_control::inject::{InjectSettings, Redirection};
use anyhow::{Context, Result};
use clap::Args;

#[derive(Debug, Args)]
pub struct KubeInjectArgs {
    /// The YAML to inject (`-` for standard input): pods, and workloads
    /// with a pod template (Deployment, StatefulSet, DaemonSet, ReplicaSet,
    /// Job, CronJob, ReplicationController). Other documents pass through.
    #[arg(short = 'f', long = "filename", value_name = "FILE")]
    file: PathBuf,
    /// Where to write the result (default: standard output).
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: Option<PathBuf>,
    /// The sidecar image (ambit-agent and Envoy).
    #[arg(long, default_value = "ghcr.io/ambit-mesh/proxy:0.1.0")]
    proxy_image: String,
    /// The control plane's xDS/CA address the sidecar dials.
    #[arg(long, default_value = "https://ambit-control.ambit-system.svc:15012")]
    xds_address: String,
    /// The node agent redirects the pod's traffic (no privileged init
    /// container), as on clusters running the Ambit node agent.
    #[arg(long)]
    node_agent_redirection: bool,
}

pub fn run(args: KubeInjectArgs) -> Result<ExitCode> {
    let text = if args.file.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading standard input")?;
        s
    } else {
        std::fs::read_to_string(&args.file)
            .with_context(|| format!("reading {}", args.file.display()))?
    };
    let settings = InjectSettings {
        proxy_image: args.proxy_image,
        xds_address: args.xds_address,
        redirection: if args.node_agent_redirection {
            Redirection::NodeAgent
        } else {
            Redirection::InitContainer
        },
        ..Default::default()
    };
    let (yaml, outcomes) = ambitctl::kube_inject::inject_yaml(&text, &settings)?;
    for o in &outcomes {
        if let Some(reason) = o.skipped {
            eprintln!("{} {}: not injected: {reason}", o.kind, o.name);
        }
    }
    match args.output {
        Some(path) => {
            std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?
        }
        None => print!("{yaml}"),
    }
    Ok(ExitCode::SUCCESS)
}
