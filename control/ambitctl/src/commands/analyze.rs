//! `ambitctl analyze`: flags and printing; the work is [`ambitctl::analyze`].

use std::path::PathBuf;
use std::process::ExitCode;

use ambitctl::analyze::{self, Cluster, Files, LocalMesh, Severity, Source, Suppression};
use anyhow::{Context, Result};
use clap::{Args, ValueEnum};

use super::{Format, out};

/// The lowest severity that makes `analyze` exit non-zero.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum FailOn {
    Error,
    Warning,
    Info,
}

#[derive(Debug, Args)]
pub struct AnalyzeArgs {
    /// YAML files or directories to analyze together (repeatable; a
    /// directory is read recursively like the control plane reads one).
    #[arg(short = 'f', long = "file", value_name = "FILE|DIR")]
    files: Vec<PathBuf>,
    /// Positional files or directories (same as -f).
    #[arg(value_name = "FILE|DIR")]
    paths: Vec<PathBuf>,
    /// A config directory as the control plane serves it (same as -f DIR).
    #[arg(long)]
    config_dir: Option<PathBuf>,
    /// Also analyze the live local mesh (`ambitctl local up`): the
    /// directory its control plane serves. NAME defaults to `ambit`.
    #[arg(long, value_name = "NAME", num_args = 0..=1, default_missing_value = ambitctl::local::DEFAULT_NAME)]
    local: Option<String>,
    /// The local mesh's state directory (default /var/run/ambit-local/NAME).
    #[arg(long, requires = "local")]
    state_dir: Option<PathBuf>,
    /// Also analyze a Kubernetes cluster: every object the mesh reads,
    /// listed from the API server of the current context (KUBECONFIG or
    /// ~/.kube/config; --kubeconfig FILE picks the file).
    #[arg(long)]
    cluster: bool,
    /// The kubeconfig for --cluster (implies --cluster).
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
    /// Exit non-zero when a message is at least this severe.
    #[arg(long, value_enum, default_value = "error")]
    fail_on: FailOn,
    /// Suppress messages: CODE, or CODE=Kind namespace/name (`*` at the
    /// end matches any rest); repeatable. The annotation
    /// galley.istio.io/analyze-suppress: CODE[,CODE] on a resource does
    /// the same for it.
    #[arg(long, value_name = "CODE[=RESOURCE]")]
    suppress: Vec<String>,
    /// List every message code and what it checks, then exit.
    #[arg(long)]
    list_codes: bool,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    output: Format,
}

pub fn run(args: AnalyzeArgs) -> Result<ExitCode> {
    if args.list_codes {
        let mut t = ambitctl::table::Table::new(&["CODE", "NAME", "SEVERITY", "CHECKS"]);
        for c in analyze::message::ALL {
            t.row(vec![
                c.id.into(),
                c.name.into(),
                c.severity.to_string(),
                c.summary.into(),
            ]);
        }
        out(&t.render());
        return Ok(ExitCode::SUCCESS);
    }
    let mut paths = args.files;
    paths.extend(args.paths);
    paths.extend(args.config_dir);
    let files = Files::new(paths);
    let local = args.local.map(|name| LocalMesh {
        name,
        state_dir: args.state_dir,
    });
    let cluster = if args.cluster || args.kubeconfig.is_some() {
        Some(list_cluster(args.kubeconfig.as_deref())?)
    } else {
        None
    };
    let mut sources: Vec<&dyn Source> = Vec::new();
    if let Some(c) = &cluster {
        sources.push(c);
    }
    if !files.paths.is_empty() {
        sources.push(&files);
    }
    if let Some(l) = &local {
        sources.push(l);
    }
    anyhow::ensure!(
        !sources.is_empty(),
        "nothing to analyze: give files or directories (-f FILE|DIR, --config-dir DIR), --local [NAME] or --cluster"
    );
    let suppressions = args
        .suppress
        .iter()
        .map(|s| s.parse::<Suppression>())
        .collect::<Result<Vec<_>, _>>()?;
    let report = analyze::analyze(&sources, &suppressions)?;
    match args.output {
        Format::Table => out(&analyze::render_table(&report)),
        Format::Json => out(&analyze::render_json(&report).context("encoding the report")?),
        Format::Yaml => out(&analyze::render_yaml(&report).context("encoding the report")?),
    }
    let threshold = match args.fail_on {
        FailOn::Error => Severity::Error,
        FailOn::Warning => Severity::Warning,
        FailOn::Info => Severity::Info,
    };
    Ok(if report.fails(threshold) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// The cluster's objects, listed once.
fn list_cluster(kubeconfig: Option<&std::path::Path>) -> Result<Cluster> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let client = ambitctl::install::client(kubeconfig).await?;
        let server = kubeconfig
            .map(|p| format!("of {}", p.display()))
            .unwrap_or_else(|| "of the current kube context".to_string());
        let cluster = Cluster::list(client, server).await?;
        for kind in &cluster.absent {
            eprintln!("note: the cluster does not serve {kind} (CRD not installed); skipped");
        }
        Ok(cluster)
    })
}
