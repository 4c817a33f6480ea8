//! `ambit-agent` configuration: one documented struct, parsed from flags and
//! upper-case environment variables by clap (`--pod-name` ↔ `POD_NAME`), or
//! built in code by tests.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, ValueEnum};

use super::AgentError;
use super::request_metrics::ReporterLabels;
use crate::identity::Identity;

/// Envoy admin, on 127.0.0.1 (SPEC §2).
pub const DEFAULT_ADMIN_PORT: u16 = 15000;
/// The agent's merged Prometheus metrics (SPEC §2).
pub const DEFAULT_METRICS_PORT: u16 = 15020;
/// The agent's `/healthz/ready` (SPEC §2).
pub const DEFAULT_STATUS_PORT: u16 = 15021;
/// Envoy's own `/stats/prometheus` (SPEC §2).
pub const DEFAULT_ENVOY_PROMETHEUS_PORT: u16 = 15090;
/// DNS domain of the cluster, used in node ids (`<ns>.svc.cluster.local`).
pub const DNS_DOMAIN: &str = "cluster.local";
/// The pod label naming a waypoint's Gateway.
pub const GATEWAY_NAME_LABEL: &str = "gateway.networking.k8s.io/gateway-name";

/// What the Envoy beside this agent is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EnvoyKind {
    /// A waypoint (L7 proxy of a namespace or service); node id `router~…`.
    Waypoint,
    /// A sidecar beside one legacy workload; node id `sidecar~…`.
    Sidecar,
}

impl EnvoyKind {
    /// The first field of the node id: how the control plane picks the
    /// generator (`router` is Istio's name for gateways and waypoints).
    pub fn node_id_prefix(self) -> &'static str {
        match self {
            EnvoyKind::Waypoint => "router",
            EnvoyKind::Sidecar => "sidecar",
        }
    }
}

/// Everything the agent needs. Each flag can also be set through the
/// upper-case environment variable named after it; a flag wins.
#[derive(Debug, Clone, PartialEq, Eq, Parser)]
#[command(
    name = "ambit-agent",
    version,
    about = "Ambit's agent beside an upstream Envoy (waypoint or sidecar): generates the key, gets the certificate from the mesh CA, serves it to Envoy over SDS on a unix socket, renders Envoy's bootstrap, runs Envoy, answers readiness and merges metrics"
)]
pub struct AgentConfig {
    /// What the Envoy is: `waypoint` (node id `router~…`) or `sidecar`.
    #[arg(long, env = "KIND", value_enum)]
    pub kind: EnvoyKind,

    /// The pod's namespace.
    #[arg(long, env = "NAMESPACE")]
    pub namespace: String,

    /// The pod's service account: the identity is
    /// `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`.
    #[arg(long, env = "SERVICE_ACCOUNT")]
    pub service_account: String,

    /// The pod's name.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: String,

    /// The pod's IP addresses, comma-separated (the first one goes into the
    /// node id; all of them into `INSTANCE_IPS`).
    #[arg(long, env = "POD_IP", value_delimiter = ',', required = true)]
    pub pod_ip: Vec<IpAddr>,

    /// The Kubernetes (or local-mode) node the pod runs on.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,

    /// The pod's labels, `key=value,...`. A waypoint pod carries
    /// `gateway.networking.k8s.io/gateway-name=<gateway>`.
    #[arg(long, env = "LABELS", value_delimiter = ',', value_parser = parse_label)]
    pub labels: Vec<(String, String)>,

    /// The workload the pod belongs to (its Deployment, StatefulSet, …), as
    /// a sidecar's request metrics name it; the injector sets it. Unset: the
    /// pod name, less a ReplicaSet's `-<pod-template-hash>-<suffix>`.
    #[arg(long, env = "WORKLOAD_NAME")]
    pub workload_name: Option<String>,

    /// The control plane's TLS xDS endpoint, `https://host:15012`. Envoy
    /// connects to it itself, with the workload certificate as its client
    /// certificate; the server certificate must chain to the mesh root and
    /// cover `host` (a DNS name or an IP address).
    #[arg(long, env = "XDS_ADDRESS")]
    pub xds_address: String,

    /// The CA (`IstioCertificateService`); defaults to `--xds-address`.
    /// `https://` (verified against `--root-cert`) or `http://` (plaintext,
    /// local mode and tests).
    #[arg(long, env = "CA_ADDRESS")]
    pub ca_address: Option<String>,

    /// PEM file with the mesh root: verifies the control plane (CA and
    /// Envoy's xDS) and is part of the trust bundle Envoy gets as `ROOTCA`.
    #[arg(long, env = "ROOT_CERT")]
    pub root_cert: Option<PathBuf>,

    /// File with the bearer token sent to the CA (a node bootstrap token in
    /// local mode, a projected ServiceAccount token in Kubernetes). Re-read
    /// at every request; a trailing newline is trimmed.
    #[arg(long, env = "TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    /// SPIFFE trust domain of the mesh.
    #[arg(long, env = "TRUST_DOMAIN", default_value = "cluster.local")]
    pub trust_domain: String,

    /// Cluster id reported in the node metadata (`CLUSTER_ID`).
    #[arg(long, env = "CLUSTER_ID", default_value = "Kubernetes")]
    pub cluster_id: String,

    /// Lifetime asked of the CA, in seconds (the CA may cap it); renewed at
    /// about half the remaining lifetime.
    #[arg(long, env = "CERT_TTL_SECS", default_value_t = 24 * 3600)]
    pub cert_ttl_secs: u64,

    /// The Envoy binary: a path, or a name looked up on `PATH`.
    #[arg(long, env = "ENVOY_BINARY", default_value = "envoy")]
    pub envoy_binary: PathBuf,

    /// Envoy worker threads (`--concurrency`).
    #[arg(long, env = "ENVOY_CONCURRENCY", default_value_t = 2)]
    pub envoy_concurrency: u16,

    /// Envoy's log level (`--log-level`); its lines go into the agent's log.
    #[arg(long, env = "ENVOY_LOG_LEVEL", default_value = "warning")]
    pub envoy_log_level: String,

    /// Directory for the SDS socket (`sds.sock`, mode 0600), Envoy's
    /// bootstrap (`envoy-bootstrap.json`) and the bound ports (`ports.json`).
    /// Created (0700) when missing.
    #[arg(long, env = "STATE_DIR", default_value = "/var/run/ambit-agent")]
    pub state_dir: PathBuf,

    /// Envoy admin port, on 127.0.0.1 (0: pick a free one).
    #[arg(long, env = "ADMIN_PORT", default_value_t = DEFAULT_ADMIN_PORT)]
    pub admin_port: u16,

    /// Readiness port (`/healthz/ready`) (0: pick a free one).
    #[arg(long, env = "STATUS_PORT", default_value_t = DEFAULT_STATUS_PORT)]
    pub status_port: u16,

    /// Merged metrics port (`/stats/prometheus`) (0: pick a free one).
    #[arg(long, env = "METRICS_PORT", default_value_t = DEFAULT_METRICS_PORT)]
    pub metrics_port: u16,

    /// Envoy's own Prometheus port (`/stats/prometheus`) (0: pick a free one).
    #[arg(long, env = "ENVOY_PROMETHEUS_PORT", default_value_t = DEFAULT_ENVOY_PROMETHEUS_PORT)]
    pub envoy_prometheus_port: u16,

    /// Every port above on a free ephemeral port (tests, several agents in
    /// one network namespace); `<state-dir>/ports.json` says which.
    #[arg(long, env = "EPHEMERAL_PORTS")]
    pub ephemeral_ports: bool,

    /// On SIGTERM/SIGINT, how long Envoy drains its listeners before it is
    /// stopped, in seconds.
    #[arg(long, env = "DRAIN_DURATION_SECS", default_value_t = 5)]
    pub drain_duration_secs: u64,
}

/// Parses one `key=value` label.
fn parse_label(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("label {s:?} is not key=value"))?;
    let k = k.trim();
    if k.is_empty() {
        return Err(format!("label {s:?} has an empty key"));
    }
    Ok((k.to_string(), v.trim().to_string()))
}

/// The control plane's xDS endpoint as Envoy dials it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsTarget {
    /// Host name or IP address (no brackets).
    pub host: String,
    /// Port.
    pub port: u16,
    /// `host` is an IP literal (a STATIC cluster, no SNI).
    pub ip: Option<IpAddr>,
}

impl AgentConfig {
    /// A configuration with the command line's defaults (tests).
    pub fn new(
        kind: EnvoyKind,
        namespace: &str,
        service_account: &str,
        pod_name: &str,
        pod_ip: IpAddr,
        xds_address: &str,
    ) -> Self {
        Self {
            kind,
            namespace: namespace.into(),
            service_account: service_account.into(),
            pod_name: pod_name.into(),
            pod_ip: vec![pod_ip],
            node_name: String::new(),
            labels: Vec::new(),
            workload_name: None,
            xds_address: xds_address.into(),
            ca_address: None,
            root_cert: None,
            token_file: None,
            trust_domain: "cluster.local".into(),
            cluster_id: "Kubernetes".into(),
            cert_ttl_secs: 24 * 3600,
            envoy_binary: PathBuf::from("envoy"),
            envoy_concurrency: 2,
            envoy_log_level: "warning".into(),
            state_dir: PathBuf::from("/var/run/ambit-agent"),
            admin_port: DEFAULT_ADMIN_PORT,
            status_port: DEFAULT_STATUS_PORT,
            metrics_port: DEFAULT_METRICS_PORT,
            envoy_prometheus_port: DEFAULT_ENVOY_PROMETHEUS_PORT,
            ephemeral_ports: false,
            drain_duration_secs: 5,
        }
    }

    /// The workload identity whose certificate Envoy presents.
    pub fn identity(&self) -> Identity {
        Identity::new(&self.trust_domain, &self.namespace, &self.service_account)
    }

    /// The pod's first IP (the node id's).
    pub fn primary_ip(&self) -> Option<IpAddr> {
        self.pod_ip.first().copied()
    }

    /// Istio's node id: `router~IP~POD.NS~NS.svc.cluster.local` for a
    /// waypoint, `sidecar~…` for a sidecar.
    pub fn node_id(&self) -> String {
        let ip = self
            .primary_ip()
            .map(|ip| ip.to_string())
            .unwrap_or_default();
        format!(
            "{}~{ip}~{}.{ns}~{ns}.svc.{DNS_DOMAIN}",
            self.kind.node_id_prefix(),
            self.pod_name,
            ns = self.namespace,
        )
    }

    /// The pod as its sidecar's request metrics name it: the workload,
    /// and the app and version by Istio's canonical-service label rules.
    pub fn reporter_labels(&self) -> ReporterLabels {
        let labels = self.label_map();
        let first = |keys: &[&str]| keys.iter().find_map(|k| labels.get(*k).cloned());
        let workload = self
            .workload_name
            .clone()
            .filter(|w| !w.is_empty())
            .unwrap_or_else(|| {
                workload_from_pod_name(&self.pod_name, labels.get("pod-template-hash"))
            });
        ReporterLabels {
            app: first(&[
                "service.istio.io/canonical-name",
                "app.kubernetes.io/name",
                "app",
            ])
            .unwrap_or_else(|| workload.clone()),
            version: first(&[
                "service.istio.io/canonical-revision",
                "app.kubernetes.io/version",
                "version",
            ])
            .unwrap_or_else(|| "latest".to_string()),
            principal: self.identity().to_string(),
            namespace: self.namespace.clone(),
            cluster: self.cluster_id.clone(),
            workload,
        }
    }

    /// The labels as a map (a repeated key keeps its last value).
    pub fn label_map(&self) -> BTreeMap<String, String> {
        self.labels.iter().cloned().collect()
    }

    /// Envoy's service cluster `<workload>.<namespace>`: the waypoint's
    /// Gateway name, else the `app` label, else the service account.
    pub fn service_cluster(&self) -> String {
        let labels = self.label_map();
        let name = labels
            .get(GATEWAY_NAME_LABEL)
            .or_else(|| labels.get("app.kubernetes.io/name"))
            .or_else(|| labels.get("app"))
            .cloned()
            .unwrap_or_else(|| self.service_account.clone());
        format!("{name}.{}", self.namespace)
    }

    /// The CA address in effect: `--ca-address`, else the xDS address.
    pub fn effective_ca_address(&self) -> &str {
        self.ca_address.as_deref().unwrap_or(&self.xds_address)
    }

    /// How long Envoy drains on shutdown.
    pub fn drain_duration(&self) -> Duration {
        Duration::from_secs(self.drain_duration_secs)
    }

    /// Ports after `--ephemeral-ports`: (admin, status, metrics, envoy prometheus).
    pub fn requested_ports(&self) -> [u16; 4] {
        if self.ephemeral_ports {
            [0; 4]
        } else {
            [
                self.admin_port,
                self.status_port,
                self.metrics_port,
                self.envoy_prometheus_port,
            ]
        }
    }

    /// The SDS socket.
    pub fn sds_socket(&self) -> PathBuf {
        self.state_dir.join("sds.sock")
    }

    /// Envoy's bootstrap file.
    pub fn bootstrap_path(&self) -> PathBuf {
        self.state_dir.join("envoy-bootstrap.json")
    }

    /// Where the bound ports are written.
    pub fn ports_path(&self) -> PathBuf {
        self.state_dir.join("ports.json")
    }

    /// Checks what can be checked before anything starts, naming the flag.
    pub fn validate(&self) -> Result<XdsTarget, AgentError> {
        let invalid = |flag: &'static str, reason: String| AgentError::Config { flag, reason };
        for (flag, value) in [
            ("--namespace / NAMESPACE", &self.namespace),
            ("--service-account / SERVICE_ACCOUNT", &self.service_account),
            ("--pod-name / POD_NAME", &self.pod_name),
        ] {
            if value.is_empty() || value.contains(['~', '/', ' ']) {
                return Err(invalid(
                    flag,
                    format!(
                        "{value:?} must be a non-empty Kubernetes name (no '~', '/' or spaces)"
                    ),
                ));
            }
        }
        if self.pod_ip.is_empty() {
            return Err(invalid("--pod-ip / POD_IP", "no pod IP given".into()));
        }
        if self.envoy_concurrency == 0 {
            return Err(invalid(
                "--envoy-concurrency / ENVOY_CONCURRENCY",
                "must be at least 1".into(),
            ));
        }
        // sun_path holds 108 bytes with the terminating NUL.
        let socket = self.sds_socket();
        if socket.as_os_str().len() > 100 {
            return Err(invalid(
                "--state-dir / STATE_DIR",
                format!(
                    "the SDS socket path {} is longer than a unix socket path may be (100 bytes here); use a shorter directory",
                    socket.display()
                ),
            ));
        }
        xds_target(&self.xds_address)
    }
}

/// Parses `https://host:port` into what Envoy's `xds-grpc` cluster dials.
pub fn xds_target(address: &str) -> Result<XdsTarget, AgentError> {
    let invalid = |reason: String| AgentError::Config {
        flag: "--xds-address / XDS_ADDRESS",
        reason: format!(
            "{address:?}: {reason}; use the control plane's TLS endpoint, e.g. https://istiod.istio-system.svc:15012"
        ),
    };
    let rest = address.strip_prefix("https://").ok_or_else(|| {
        invalid("Envoy reaches the control plane over TLS with its workload certificate, so the address must start with https://".into())
    })?;
    let authority = rest.trim_end_matches('/');
    if authority.contains('/') || authority.is_empty() {
        return Err(invalid("expected https://host:port with no path".into()));
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, p) = v6
            .split_once(']')
            .ok_or_else(|| invalid("unclosed '[' in an IPv6 address".into()))?;
        (h, p.strip_prefix(':'))
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    let port = match port {
        None => 443,
        Some(p) => p
            .parse::<u16>()
            .map_err(|_| invalid(format!("{p:?} is not a port number")))?,
    };
    if host.is_empty() {
        return Err(invalid("the URL has no host".into()));
    }
    Ok(XdsTarget {
        host: host.to_string(),
        port,
        ip: host.parse().ok(),
    })
}

/// True when `path` names a program to look up on `PATH` (no slash).
pub(crate) fn is_bare_name(path: &Path) -> bool {
    path.components().count() == 1 && !path.as_os_str().to_string_lossy().contains('/')
}

/// A Deployment's pod is named `<deployment>-<pod-template-hash>-<suffix>`;
/// any other pod is its own workload.
fn workload_from_pod_name(pod: &str, hash: Option<&String>) -> String {
    hash.filter(|h| !h.is_empty())
        .and_then(|h| {
            let (prefix, _suffix) = pod.rsplit_once('-')?;
            let dep = prefix.strip_suffix(h.as_str())?.strip_suffix('-')?;
            (!dep.is_empty()).then(|| dep.to_string())
        })
        .unwrap_or_else(|| pod.to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn args() -> Vec<&'static str> {
        vec![
            "ambit-agent",
            "--kind",
            "waypoint",
            "--namespace",
            "shop",
            "--service-account",
            "wp",
            "--pod-name",
            "wp-0",
            "--pod-ip",
            "10.1.0.7",
            "--node-name",
            "node-1",
            "--xds-address",
            "https://istiod.istio-system.svc:15012",
            "--labels",
            "gateway.networking.k8s.io/gateway-name=wp,app=x",
        ]
    }

    #[test]
    fn flags_parse_and_derive_istio_names() {
        let c = AgentConfig::try_parse_from(args()).unwrap();
        assert_eq!(c.kind, EnvoyKind::Waypoint);
        assert_eq!(
            c.node_id(),
            "router~10.1.0.7~wp-0.shop~shop.svc.cluster.local"
        );
        assert_eq!(
            c.identity().to_string(),
            "spiffe://cluster.local/ns/shop/sa/wp"
        );
        assert_eq!(c.service_cluster(), "wp.shop");
        assert_eq!(c.label_map()["app"], "x");
        assert_eq!(
            c.effective_ca_address(),
            "https://istiod.istio-system.svc:15012"
        );
        let t = c.validate().unwrap();
        assert_eq!(
            (t.host.as_str(), t.port, t.ip),
            ("istiod.istio-system.svc", 15012, None)
        );
    }

    #[test]
    fn sidecar_ids_and_dual_stack() {
        let mut a = args();
        a[2] = "sidecar";
        a[10] = "10.1.0.8,fd00::8";
        let c = AgentConfig::try_parse_from(a).unwrap();
        assert!(c.node_id().starts_with("sidecar~10.1.0.8~wp-0.shop~"));
        assert_eq!(c.pod_ip.len(), 2);
    }

    #[test]
    fn xds_targets() {
        let t = xds_target("https://127.0.0.1:15012").unwrap();
        assert_eq!(t.ip, Some("127.0.0.1".parse().unwrap()));
        let t = xds_target("https://[::1]:15012").unwrap();
        assert_eq!((t.host.as_str(), t.port), ("::1", 15012));
        assert!(t.ip.is_some());
        assert_eq!(xds_target("https://cp").unwrap().port, 443);
        for bad in [
            "http://cp:15010",
            "cp:15012",
            "https://cp:x",
            "https://:1",
            "https://cp/p",
        ] {
            let e = xds_target(bad).unwrap_err().to_string();
            assert!(e.contains("--xds-address"), "{bad}: {e}");
        }
    }

    #[test]
    fn bad_labels_and_names_are_refused() {
        let mut a = args();
        a[16] = "novalue";
        assert!(AgentConfig::try_parse_from(a).is_err());
        let mut c = AgentConfig::try_parse_from(args()).unwrap();
        c.namespace = "a~b".into();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("--namespace")
        );
        let mut c = AgentConfig::try_parse_from(args()).unwrap();
        c.state_dir = PathBuf::from("/".repeat(120));
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("--state-dir")
        );
    }

    #[test]
    fn ephemeral_ports_zero_everything() {
        let mut c = AgentConfig::new(
            EnvoyKind::Waypoint,
            "ns",
            "sa",
            "p",
            "10.0.0.1".parse().unwrap(),
            "https://cp:15012",
        );
        assert_eq!(c.requested_ports(), [15000, 15021, 15020, 15090]);
        c.ephemeral_ports = true;
        assert_eq!(c.requested_ports(), [0; 4]);
    }

    #[test]
    fn bare_names() {
        assert!(is_bare_name(Path::new("envoy")));
        assert!(!is_bare_name(Path::new("./envoy")));
        assert!(!is_bare_name(Path::new("/usr/bin/envoy")));
    }

    #[test]
    fn a_sidecar_reports_as_its_workload_app_and_version() {
        let mut c = AgentConfig::new(
            EnvoyKind::Sidecar,
            "shop",
            "llm",
            "llm-v2-5d8f7c6b9-abcde",
            "10.0.0.5".parse().unwrap(),
            "https://control:15012",
        );
        c.labels = vec![
            ("app".into(), "llm".into()),
            ("version".into(), "v2".into()),
            ("pod-template-hash".into(), "5d8f7c6b9".into()),
        ];
        let me = c.reporter_labels();
        assert_eq!(me.workload, "llm-v2");
        assert_eq!((me.app.as_str(), me.version.as_str()), ("llm", "v2"));
        assert_eq!(me.principal, "spiffe://cluster.local/ns/shop/sa/llm");
        assert_eq!(me.cluster, "Kubernetes");
        c.workload_name = Some("llm-canary".into());
        c.labels.clear();
        let me = c.reporter_labels();
        assert_eq!(me.workload, "llm-canary");
        assert_eq!(
            (me.app.as_str(), me.version.as_str()),
            ("llm-canary", "latest")
        );
    }
}
