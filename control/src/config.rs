//! Command-line and environment configuration of `ambit-control`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::model::ModelOptions;

/// Every flag can also be set by the upper-case environment variable named
/// after it (`--config-dir` → `CONFIG_DIR`).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "ambit-control",
    version,
    about = "Ambit control plane: serves the mesh to ztunnels over xDS"
)]
pub struct ControlConfig {
    /// Directory of Kubernetes and Istio YAML (`*.yaml`, `*.yml`, multi-document)
    /// to serve; it is watched and changes apply live (local mode).
    #[arg(long, env = "CONFIG_DIR")]
    pub config_dir: PathBuf,

    /// More directories of YAML, read and watched like `--config-dir`
    /// (repeat the flag; `EXTRA_CONFIG_DIRS` takes a `:`-separated list).
    /// Local mode passes the directory where `ambitctl` writes the Pods it
    /// starts for waypoint Gateways, so the user's directory stays theirs.
    #[arg(
        long = "extra-config-dir",
        env = "EXTRA_CONFIG_DIRS",
        value_delimiter = ':'
    )]
    pub extra_config_dirs: Vec<PathBuf>,

    /// Directory for state that must survive restarts (the CA's root key).
    #[arg(long, env = "DATA_DIR", default_value = "./ambit-data")]
    pub data_dir: PathBuf,

    /// Plaintext gRPC address for xDS (local mode and tests only).
    #[arg(long, env = "XDS_PLAINTEXT_ADDR", default_value = "127.0.0.1:15010")]
    pub xds_plaintext_addr: SocketAddr,

    /// TLS gRPC address for xDS and the CA: the production endpoint. Its
    /// serving certificate is issued by the mesh CA for `--tls-names`.
    #[arg(long, env = "XDS_TLS_ADDR", default_value = "0.0.0.0:15012")]
    pub xds_tls_addr: SocketAddr,

    /// Names (DNS or IP) the 15012 serving certificate is valid for,
    /// comma-separated.
    #[arg(
        long,
        env = "TLS_NAMES",
        value_delimiter = ',',
        default_value = "ambit-control.ambit-system.svc,ambit-control.ambit-system.svc.cluster.local,istiod.istio-system.svc,localhost,127.0.0.1"
    )]
    pub tls_names: Vec<String>,

    /// Address of `/metrics`, `/ready` and `/debug/*`.
    #[arg(long, env = "MONITORING_ADDR", default_value = "127.0.0.1:15014")]
    pub monitoring_addr: SocketAddr,

    /// SPIFFE trust domain of the mesh.
    #[arg(long, env = "TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,

    /// Cluster name used in workload uids.
    #[arg(long, env = "CLUSTER_ID", default_value = "Kubernetes")]
    pub cluster_id: String,

    /// Network name of this cluster's workloads (empty: the default network).
    #[arg(long, env = "NETWORK", default_value = "")]
    pub network: String,

    /// Longest time a burst of config changes is held back before one push.
    #[arg(long, env = "DEBOUNCE_MAX_MS", default_value_t = 100)]
    pub debounce_max_ms: u64,

    /// Plugged-in CA directory with Istio's file names (`ca-cert.pem`,
    /// `ca-key.pem`, `root-cert.pem`, `cert-chain.pem`). Without it a root is
    /// generated on first start and kept under `<data-dir>/ca`.
    #[arg(long, env = "CA_DIR")]
    pub ca_dir: Option<PathBuf>,

    /// Local mode: file of per-node bootstrap tokens, one `<token> <node-name>`
    /// per line. Without it (and without Kubernetes) certificate requests are
    /// refused as unauthenticated.
    #[arg(long, env = "NODE_TOKENS_FILE")]
    pub node_tokens_file: Option<PathBuf>,

    /// Longest certificate lifetime issued, in seconds (longer requests are capped).
    #[arg(long, env = "MAX_CERT_TTL_SECS", default_value_t = 24 * 3600)]
    pub max_cert_ttl_secs: u64,
}

impl ControlConfig {
    /// A configuration for tests: every listener on 127.0.0.1 port 0.
    pub fn for_tests(config_dir: PathBuf, data_dir: PathBuf) -> Self {
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        Self {
            config_dir,
            extra_config_dirs: Vec::new(),
            data_dir,
            xds_plaintext_addr: any,
            xds_tls_addr: any,
            tls_names: vec!["localhost".into(), "127.0.0.1".into()],
            monitoring_addr: any,
            trust_domain: "cluster.local".into(),
            cluster_id: "Kubernetes".into(),
            network: String::new(),
            debounce_max_ms: 100,
            ca_dir: None,
            node_tokens_file: None,
            max_cert_ttl_secs: 24 * 3600,
        }
    }

    pub fn model_options(&self) -> ModelOptions {
        ModelOptions {
            trust_domain: self.trust_domain.clone(),
            network: self.network.clone(),
            cluster_id: self.cluster_id.clone(),
            debounce_max: Duration::from_millis(self.debounce_max_ms),
            ..ModelOptions::default()
        }
    }
}
