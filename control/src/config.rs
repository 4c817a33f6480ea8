//! Command-line and environment configuration of `ambit-control`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::model::ModelOptions;

/// Where the control plane's config comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceChoice {
    /// Local mode: a directory of YAML.
    Dir(PathBuf),
    /// Kubernetes mode: the API server.
    Kube(ClusterAccess),
}

/// How to reach the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterAccess {
    /// The current context of a kubeconfig file.
    Kubeconfig(PathBuf),
    /// The pod's own ServiceAccount and the in-cluster service address.
    InCluster,
}

/// Flags that do not fit together.
#[derive(Debug, thiserror::Error)]
pub enum FlagError {
    #[error(
        "no config source: pass --config-dir DIR (local mode), --kubeconfig FILE or --in-cluster (Kubernetes mode)"
    )]
    NoSource,
    #[error(
        "more than one config source: pass exactly one of --config-dir, --kubeconfig and --in-cluster (check the CONFIG_DIR, KUBECONFIG_FILE and IN_CLUSTER environment variables too)"
    )]
    TwoSources,
}

/// Every flag can also be set by the upper-case environment variable named
/// after it (`--config-dir` → `CONFIG_DIR`).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "ambit-control",
    version,
    about = "Ambit control plane: serves the mesh to ztunnels over xDS"
)]
pub struct ControlConfig {
    /// Local mode: directory of Kubernetes and Istio YAML (`*.yaml`, `*.yml`,
    /// multi-document) to serve; it is watched and changes apply live.
    /// Exactly one of `--config-dir`, `--kubeconfig` and `--in-cluster`.
    #[arg(long, env = "CONFIG_DIR")]
    pub config_dir: Option<PathBuf>,

    /// Kubernetes mode: watch the cluster this kubeconfig file names (its
    /// current context). (`KUBECONFIG_FILE`, not `KUBECONFIG`, so a shell's
    /// kubectl setting never switches a local control plane to Kubernetes.)
    #[arg(long, env = "KUBECONFIG_FILE")]
    pub kubeconfig: Option<PathBuf>,

    /// Kubernetes mode: watch the cluster this pod runs in (its
    /// ServiceAccount token and `KUBERNETES_SERVICE_HOST`).
    #[arg(long, env = "IN_CLUSTER")]
    pub in_cluster: bool,

    /// Kubernetes mode: the namespace of the control plane, its Lease and
    /// CA Secrets, and of ztunnel's ServiceAccount.
    #[arg(long, env = "SYSTEM_NAMESPACE", default_value = "ambit-system")]
    pub system_namespace: String,

    /// Kubernetes mode: this replica's name in the leader Lease (the pod
    /// name; default: the host name).
    #[arg(long, env = "POD_NAME", default_value = "")]
    pub pod_name: String,

    /// Kubernetes mode: the Lease that elects the replica that writes
    /// (status conditions, the CA root Secret).
    #[arg(long, env = "LEASE_NAME", default_value = "ambit-control")]
    pub lease_name: String,

    /// Kubernetes mode: how long a leader's Lease holds without renewal.
    #[arg(long, env = "LEASE_DURATION_SECS", default_value_t = 15)]
    pub lease_duration_secs: u64,

    /// Kubernetes mode: a leader that could not renew for this long stops
    /// writing (less than the lease duration).
    #[arg(long, env = "LEASE_RENEW_DEADLINE_SECS", default_value_t = 10)]
    pub lease_renew_deadline_secs: u64,

    /// Kubernetes mode: how often the Lease is renewed or tried.
    #[arg(long, env = "LEASE_RETRY_MS", default_value_t = 2000)]
    pub lease_retry_ms: u64,

    /// Kubernetes mode: the Secret holding the generated CA root (Istio's
    /// `istio-ca-secret` layout), created once by the leader.
    #[arg(long, env = "CA_SECRET", default_value = "istio-ca-secret")]
    pub ca_secret: String,

    /// Kubernetes mode: a plugged-in CA Secret (Istio's `cacerts` keys);
    /// when it exists it is used instead of the generated root.
    #[arg(long, env = "PLUGGED_CA_SECRET", default_value = "cacerts")]
    pub plugged_ca_secret: String,

    /// Kubernetes mode: the audience ServiceAccount tokens must be bound to.
    #[arg(long, env = "TOKEN_AUDIENCE", default_value = "istio-ca")]
    pub token_audience: String,

    /// Kubernetes mode: relist every watched kind this often, in seconds
    /// (anti-entropy; 0 = only when the API server expires a watch).
    #[arg(long, env = "KUBE_RELIST_SECS", default_value_t = 3600)]
    pub kube_relist_secs: u64,

    /// Kubernetes mode: longest delay between retries of a failed watch, in
    /// milliseconds (a failing watch also retries at once when the API
    /// server answers discovery again).
    #[arg(long, env = "KUBE_RETRY_MAX_MS", default_value_t = 4_000)]
    pub kube_retry_max_ms: u64,

    /// Do not serve plaintext gRPC (`--xds-plaintext-addr`); the Kubernetes
    /// manifests set it: only 15012 (TLS) serves there.
    #[arg(long, env = "NO_XDS_PLAINTEXT")]
    pub no_xds_plaintext: bool,

    /// More directories of YAML, read and watched like `--config-dir`
    /// (repeat the flag; `EXTRA_CONFIG_DIRS` takes a `:`-separated list).
    /// Local mode passes the directory where `ambitctl` writes the Pods it
    /// starts for waypoint Gateways, so the user's directory stays theirs.
    /// An object there overrides the object of the same kind, namespace and
    /// name in `--config-dir` (local mode writes the injected version of a
    /// pod that asks for a sidecar there).
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

    /// Address of the sidecar injection webhook (HTTPS, `POST /inject`),
    /// served with the same CA-issued certificate as 15012. Off unless set
    /// (the Kubernetes manifests set `0.0.0.0:15017`).
    #[arg(long, env = "INJECTION_WEBHOOK_ADDR")]
    pub injection_webhook_addr: Option<SocketAddr>,

    /// Image injected sidecars run (`ambit-agent` and Envoy).
    #[arg(
        long,
        env = "PROXY_IMAGE",
        default_value = "ghcr.io/ambit-mesh/proxy:0.1.0"
    )]
    pub proxy_image: String,

    /// The xDS/CA address injected sidecars dial; default
    /// `https://ambit-control.<system-namespace>.svc:15012`.
    #[arg(long, env = "INJECTION_XDS_ADDRESS")]
    pub injection_xds_address: Option<String>,
}

impl ControlConfig {
    /// A configuration for tests: every listener on 127.0.0.1 port 0.
    pub fn for_tests(config_dir: PathBuf, data_dir: PathBuf) -> Self {
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        Self {
            config_dir: Some(config_dir),
            extra_config_dirs: Vec::new(),
            kubeconfig: None,
            in_cluster: false,
            system_namespace: "ambit-system".into(),
            pod_name: String::new(),
            lease_name: "ambit-control".into(),
            lease_duration_secs: 15,
            lease_renew_deadline_secs: 10,
            lease_retry_ms: 2000,
            ca_secret: "istio-ca-secret".into(),
            plugged_ca_secret: "cacerts".into(),
            token_audience: "istio-ca".into(),
            kube_relist_secs: 3600,
            kube_retry_max_ms: 4_000,
            no_xds_plaintext: false,
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
            injection_webhook_addr: None,
            proxy_image: "ghcr.io/ambit-mesh/proxy:0.1.0".into(),
            injection_xds_address: None,
        }
    }

    /// What injected sidecars are made of, from the flags.
    pub fn inject_settings(&self) -> crate::inject::InjectSettings {
        crate::inject::InjectSettings {
            proxy_image: self.proxy_image.clone(),
            xds_address: self.injection_xds_address.clone().unwrap_or_else(|| {
                format!("https://ambit-control.{}.svc:15012", self.system_namespace)
            }),
            trust_domain: self.trust_domain.clone(),
            cluster_id: self.cluster_id.clone(),
            ..Default::default()
        }
    }

    /// A Kubernetes-mode configuration for tests: the cluster of
    /// `kubeconfig`, listeners on 127.0.0.1 port 0 (plaintext too), a short
    /// Lease (2 s, renewed every 200 ms) and 1 s watch retries.
    pub fn for_kube_tests(kubeconfig: PathBuf, data_dir: PathBuf, pod_name: &str) -> Self {
        let mut cfg = Self::for_tests(PathBuf::new(), data_dir);
        cfg.config_dir = None;
        cfg.kubeconfig = Some(kubeconfig);
        cfg.pod_name = pod_name.to_string();
        cfg.lease_duration_secs = 2;
        cfg.lease_renew_deadline_secs = 1;
        cfg.lease_retry_ms = 200;
        cfg.kube_retry_max_ms = 1000;
        cfg
    }

    /// Which source the flags select: exactly one of a config directory,
    /// a kubeconfig file, or the cluster the pod runs in.
    pub fn source(&self) -> Result<SourceChoice, FlagError> {
        match (&self.config_dir, &self.kubeconfig, self.in_cluster) {
            (Some(dir), None, false) => Ok(SourceChoice::Dir(dir.clone())),
            (None, Some(file), false) => {
                Ok(SourceChoice::Kube(ClusterAccess::Kubeconfig(file.clone())))
            }
            (None, None, true) => Ok(SourceChoice::Kube(ClusterAccess::InCluster)),
            (None, None, false) => Err(FlagError::NoSource),
            _ => Err(FlagError::TwoSources),
        }
    }

    /// This replica's identity in the leader Lease: `--pod-name`, else the
    /// host name, else a random name.
    pub fn replica_name(&self) -> String {
        if !self.pod_name.is_empty() {
            return self.pod_name.clone();
        }
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| format!("ambit-control-{:08x}", rand::random::<u32>()))
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
