//! One module per command family: its flags (clap) and how its results are
//! printed. The work is done by the library module of the same name
//! (`ambitctl::<family>`). Shared here: the output format flag and writing
//! to stdout.

pub mod analyze;
pub mod authn;
pub mod install;
pub mod kube_inject;
pub mod local;
pub mod proxy_config;
pub mod proxy_status;
pub mod ztunnel_config;

use std::net::SocketAddr;
use std::path::PathBuf;

use ambitctl::local::LocalCluster;
use anyhow::{Context, Result};
use clap::ValueEnum;

/// `-o`: human tables by default, or machine-readable output.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Format {
    Table,
    Json,
    Yaml,
}

/// Writes to stdout; a closed pipe (`| head`) is not an error.
pub fn out(text: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush());
}

/// JSON or YAML of `value` (for `-o json|yaml`).
pub fn structured(format: Format, value: &impl serde::Serialize) -> Result<String> {
    Ok(match format {
        Format::Yaml => serde_saphyr::to_string(value).context("encoding YAML")?,
        _ => format!(
            "{}\n",
            serde_json::to_string_pretty(value).context("encoding JSON")?
        ),
    })
}

/// Where the live mesh is: explicit addresses, or the local cluster's
/// state (`ambitctl local up`), which names every listener.
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// The control plane's monitoring address (default: the local
    /// cluster's, else 127.0.0.1:15014).
    #[arg(long, value_name = "ADDR")]
    control_plane: Option<SocketAddr>,
    /// The local cluster to read addresses from.
    #[arg(long, env = "AMBIT_LOCAL_NAME", default_value = ambitctl::local::DEFAULT_NAME)]
    name: String,
    /// The local cluster's state directory (default
    /// /var/run/ambit-local/NAME).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Longest wait for each request, in seconds.
    #[arg(long, default_value_t = 5)]
    pub timeout_secs: u64,
}

impl Target {
    /// The local cluster, when its state exists.
    pub fn local(&self) -> Option<LocalCluster> {
        LocalCluster::open(&self.name, self.state_dir.as_deref()).ok()
    }

    /// The local cluster, or an error saying to pass addresses.
    pub fn require_local(&self, what: &str) -> Result<LocalCluster> {
        LocalCluster::open(&self.name, self.state_dir.as_deref()).with_context(|| {
            format!("no local cluster to find {what} in; start one with `ambitctl local up`, or pass the address")
        })
    }

    pub fn control_plane(&self) -> Result<SocketAddr> {
        if let Some(a) = self.control_plane {
            return Ok(a);
        }
        Ok(self
            .local()
            .and_then(|c| c.control().map(|c| c.monitoring_addr))
            .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 15014))))
    }
}
