//! `ambitctl install` / `ambitctl uninstall`: flags and printing; the work
//! is [`ambitctl::install`].

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use ambitctl::install::{self, Values};
use anyhow::{Context, Result};
use clap::Args;

use super::out;

#[derive(Debug, Args)]
pub struct InstallArgs {
    /// Print the manifests (with --set applied) instead of applying them;
    /// `kubectl apply --server-side -f -` takes the output as it is.
    #[arg(long)]
    dry_run: bool,
    /// With --dry-run: also print Istio's CRDs for the kinds Ambit serves
    /// (for a cluster without Istio's CRDs; install applies them by itself
    /// where they are absent).
    #[arg(long, requires = "dry_run")]
    include_crds: bool,
    /// KEY=VALUE: image=REGISTRY/PREFIX, tag=TAG, replicas=N,
    /// cniConfDir=DIR, cniBinDir=DIR (the node's CNI directories, default
    /// /etc/cni/net.d and /opt/cni/bin) (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Kubeconfig to use (default: KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, env = "KUBECONFIG_FILE")]
    kubeconfig: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct UninstallArgs {
    /// Kubeconfig to use (default: KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, env = "KUBECONFIG_FILE")]
    kubeconfig: Option<PathBuf>,
    /// How long to wait for every node to remove ambit-cni, in seconds.
    #[arg(long, default_value_t = 180)]
    timeout_secs: u64,
    /// Also delete the Istio CRDs Ambit installed (and every object of
    /// those kinds).
    #[arg(long)]
    delete_crds: bool,
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

pub fn install(args: InstallArgs) -> Result<ExitCode> {
    let docs = install::render(&Values::parse(&args.set)?)?;
    if args.dry_run {
        if !args.include_crds {
            out(
                "# Without Istio's CRDs (VirtualService, AuthorizationPolicy, ...): on a cluster\n# that has none, add --include-crds or apply deploy/kubernetes/crds first.\n",
            );
        }
        let docs = install::dry_run_documents(&docs, args.include_crds);
        out(&install::to_yaml(&docs)?);
        return Ok(ExitCode::SUCCESS);
    }
    let report = runtime()?.block_on(async {
        let client = install::client(args.kubeconfig.as_deref()).await?;
        install::apply(&client, &docs).await
    })?;
    out(&(report.join("\n") + "\n"));
    out("installed; check with: kubectl -n ambit-system get pods, then ambitctl proxy-status\n");
    Ok(ExitCode::SUCCESS)
}

pub fn uninstall(args: UninstallArgs) -> Result<ExitCode> {
    let docs = install::render(&Values::default())?;
    let report = runtime()?.block_on(async {
        let client = install::client(args.kubeconfig.as_deref()).await?;
        install::uninstall(
            &client,
            &docs,
            Duration::from_secs(args.timeout_secs),
            args.delete_crds,
        )
        .await
    })?;
    out(&(report.join("\n") + "\n"));
    Ok(ExitCode::SUCCESS)
}
