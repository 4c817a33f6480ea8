//! ztunnel configuration: one documented struct, parsed from flags and
//! upper-case environment variables by clap, or built in code by tests.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;

use clap::Parser;
use clap::builder::TypedValueParser as _;

/// Plaintext xDS endpoint of a local control plane (SPEC §2, port 15010).
pub const DEFAULT_XDS_ADDRESS: &str = "http://127.0.0.1:15010";
/// Admin listener: `/config_dump`, `/logging`, `/quitquitquit` (SPEC §2).
pub const DEFAULT_ADMIN_ADDR: &str = "127.0.0.1:15000";
/// Prometheus `/metrics` listener (SPEC §2).
pub const DEFAULT_STATS_ADDR: &str = "0.0.0.0:15020";
/// `/healthz/ready` listener (SPEC §2).
pub const DEFAULT_READINESS_ADDR: &str = "0.0.0.0:15021";
/// Cluster id reported to the control plane when none is configured.
pub const DEFAULT_CLUSTER_ID: &str = "Kubernetes";

/// Everything a ztunnel needs to start. Each flag can also be set through the
/// upper-case environment variable named after it (`--xds-address` ↔
/// `XDS_ADDRESS`); a flag wins over the environment.
#[derive(Debug, Clone, PartialEq, Eq, Parser)]
#[command(name = "ztunnel", version, about = "Ambit node proxy (ztunnel)")]
pub struct Config {
    /// URL of the control plane's xDS endpoint: `https://host:15012` (TLS,
    /// the production endpoint; the server certificate is checked against
    /// `--root-cert` and must cover `host`, a DNS name or IP address) or
    /// `http://host:15010` (plaintext h2c, local mode and tests).
    #[arg(long, env = "XDS_ADDRESS", default_value = DEFAULT_XDS_ADDRESS)]
    pub xds_address: String,

    /// URL of the certificate authority (`IstioCertificateService`); defaults
    /// to the xDS address. `https://` (TLS, verified against `--root-cert`)
    /// or `http://` (plaintext h2c), as for `--xds-address`.
    #[arg(long, env = "CA_ADDRESS")]
    pub ca_address: Option<String>,

    /// Name of the Kubernetes node (or local-mode node) this ztunnel serves.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,

    /// File holding the bearer token sent to the control plane as
    /// `authorization: Bearer <token>`. Re-read on every reconnect, so a
    /// rotated token is picked up without a restart.
    #[arg(long, env = "TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    /// PEM file with trusted root certificates (e.g. the mesh root, or the
    /// next root during a rotation): added to the workload trust bundle, and
    /// the roots that verify the control plane's certificate on `https://`
    /// xDS and CA addresses (required then). Re-read at every new
    /// connection to the control plane.
    #[arg(long, env = "ROOT_CERT")]
    pub root_cert: Option<PathBuf>,

    /// Admin listener (`/config_dump`, `/logging`, `/quitquitquit`). Keep it
    /// on loopback: it can change log levels and stop the proxy.
    #[arg(long, env = "ADMIN_ADDR", default_value = DEFAULT_ADMIN_ADDR)]
    pub admin_addr: SocketAddr,

    /// Prometheus listener (`/metrics`).
    #[arg(long, env = "STATS_ADDR", default_value = DEFAULT_STATS_ADDR)]
    pub stats_addr: SocketAddr,

    /// Readiness listener (`/healthz/ready`).
    #[arg(long, env = "READINESS_ADDR", default_value = DEFAULT_READINESS_ADDR)]
    pub readiness_addr: SocketAddr,

    /// Cluster id reported in the xDS node metadata (`CLUSTER_ID`).
    #[arg(long, env = "CLUSTER_ID", default_value = DEFAULT_CLUSTER_ID)]
    pub cluster_id: String,

    /// Network this node belongs to; the empty string is the default network.
    #[arg(long, env = "NETWORK", default_value = "")]
    pub network: String,

    /// Unix socket of the node agent (ZDS), which hands enrolled pods to
    /// this ztunnel. Set it to an empty string to run without in-pod
    /// capture (xDS, certificates and admin only).
    #[arg(long, env = "ZDS_PATH", default_value = ambit_inpod::DEFAULT_ZDS_PATH,
          value_parser = clap::builder::OsStringValueParser::new().map(PathBuf::from))]
    pub zds_path: PathBuf,

    /// Deliver inbound connections to pods from the original client's IP
    /// (`IP_TRANSPARENT`; needs the node agent's mark routing in the pod).
    /// With `false` the app sees ztunnel's connection from the pod's own IP.
    #[arg(long, env = "INBOUND_TRANSPARENT", default_value_t = true, action = clap::ArgAction::Set)]
    pub inbound_transparent: bool,

    /// Relay plaintext socket-to-socket connections (passthrough to
    /// destinations outside the mesh, plaintext inbound) with `splice(2)`,
    /// inside the kernel; `false` copies them through ztunnel's buffers.
    #[arg(long, env = "SPLICE", default_value_t = true, action = clap::ArgAction::Set)]
    pub splice: bool,

    /// Bound, in milliseconds, on the TLS + HTTP/2 handshakes with an HBONE
    /// peer (a peer that accepts TCP and never answers fails after this).
    #[arg(long, env = "HBONE_HANDSHAKE_TIMEOUT_MS", default_value_t = 10_000)]
    pub hbone_handshake_timeout_ms: u64,
    /// Bound, in milliseconds, on an HBONE peer's answer to a CONNECT and
    /// on waiting for a free stream slot.
    #[arg(long, env = "HBONE_CONNECT_TIMEOUT_MS", default_value_t = 10_000)]
    pub hbone_connect_timeout_ms: u64,
    /// Milliseconds between HTTP/2 PINGs on pooled HBONE connections.
    #[arg(long, env = "HBONE_KEEPALIVE_INTERVAL_MS", default_value_t = 10_000)]
    pub hbone_keepalive_interval_ms: u64,
    /// Milliseconds a PING may go unanswered before its connection is
    /// closed and dropped from the pool.
    #[arg(long, env = "HBONE_KEEPALIVE_TIMEOUT_MS", default_value_t = 20_000)]
    pub hbone_keepalive_timeout_ms: u64,
    /// Seconds established connections may keep running once ztunnel
    /// shuts down (SIGTERM) or a pod leaves the mesh; its listeners close
    /// at once. In Kubernetes keep it below the pod's
    /// terminationGracePeriodSeconds, so a rolling update (the new ztunnel
    /// already serving the pods) loses no connection that ends within it.
    #[arg(long, env = "DRAIN_TIMEOUT_SECS", default_value_t = 5)]
    pub drain_timeout_secs: u64,
}

impl Config {
    /// A configuration with every default of the command line, for a node
    /// named `node_name` talking to the control plane at `xds_address`.
    pub fn new(node_name: impl Into<String>, xds_address: impl Into<String>) -> Self {
        Self {
            xds_address: xds_address.into(),
            ca_address: None,
            node_name: node_name.into(),
            token_file: None,
            root_cert: None,
            admin_addr: parse_default(DEFAULT_ADMIN_ADDR, 15000),
            stats_addr: parse_default(DEFAULT_STATS_ADDR, 15020),
            readiness_addr: parse_default(DEFAULT_READINESS_ADDR, 15021),
            cluster_id: DEFAULT_CLUSTER_ID.to_string(),
            network: String::new(),
            zds_path: PathBuf::from(ambit_inpod::DEFAULT_ZDS_PATH),
            inbound_transparent: true,
            splice: true,
            hbone_handshake_timeout_ms: 10_000,
            hbone_connect_timeout_ms: 10_000,
            hbone_keepalive_interval_ms: 10_000,
            hbone_keepalive_timeout_ms: 20_000,
            drain_timeout_secs: 5,
        }
    }

    /// How long live connections get once draining starts.
    pub fn drain_deadline(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.drain_timeout_secs)
    }

    /// The HBONE client bounds these flags set.
    pub fn hbone_timeouts(&self) -> crate::hbone::ClientTimeouts {
        use std::time::Duration;
        let ms = Duration::from_millis;
        crate::hbone::ClientTimeouts {
            handshake: ms(self.hbone_handshake_timeout_ms.max(1)),
            connect_response: ms(self.hbone_connect_timeout_ms.max(1)),
            stream_slot: ms(self.hbone_connect_timeout_ms.max(1)),
            keepalive_interval: ms(self.hbone_keepalive_interval_ms.max(1)),
            keepalive_timeout: ms(self.hbone_keepalive_timeout_ms.max(1)),
        }
    }

    /// Moves every listener to `127.0.0.1:0`, so the OS picks free ports,
    /// and turns in-pod capture off (many ztunnels in one process must not
    /// share the node's ZDS socket; set [`Config::zds_path`] to a socket of
    /// the test's own). Tests and benchmarks that run many ztunnels in one
    /// process use this and read the bound addresses back from
    /// [`crate::Ztunnel`].
    pub fn with_ephemeral_ports(mut self) -> Self {
        let any = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0));
        self.admin_addr = any;
        self.stats_addr = any;
        self.readiness_addr = any;
        self.zds_path = PathBuf::new();
        self
    }

    /// The node agent's socket, unless in-pod capture is off.
    pub fn zds_socket(&self) -> Option<&std::path::Path> {
        (!self.zds_path.as_os_str().is_empty()).then_some(self.zds_path.as_path())
    }

    /// The CA address in effect: `--ca-address`, else the xDS address.
    pub fn effective_ca_address(&self) -> &str {
        self.ca_address.as_deref().unwrap_or(&self.xds_address)
    }
}

/// Parses one of the default address constants above; they are literals,
/// so the fallback only guards against a typo in this file.
fn parse_default(addr: &str, port: u16) -> SocketAddr {
    addr.parse()
        .unwrap_or(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_command_line() {
        let parsed =
            Config::try_parse_from(["ztunnel", "--node-name", "n1"]).map_err(|e| e.to_string());
        // Environment variables may be set by whoever runs the tests; only
        // compare when they are not.
        if std::env::vars().any(|(k, _)| {
            [
                "XDS_ADDRESS",
                "ADMIN_ADDR",
                "STATS_ADDR",
                "READINESS_ADDR",
                "CLUSTER_ID",
                "NETWORK",
                "CA_ADDRESS",
                "TOKEN_FILE",
                "ROOT_CERT",
                "ZDS_PATH",
                "INBOUND_TRANSPARENT",
                "SPLICE",
            ]
            .contains(&k.as_str())
        }) {
            return;
        }
        assert_eq!(parsed, Ok(Config::new("n1", DEFAULT_XDS_ADDRESS)));
    }

    #[test]
    fn flags_override_defaults() {
        let c = Config::try_parse_from([
            "ztunnel",
            "--node-name",
            "n2",
            "--xds-address",
            "http://10.0.0.1:15010",
            "--admin-addr",
            "127.0.0.1:1",
            "--token-file",
            "/tmp/t",
            "--network",
            "net-a",
        ])
        .expect("flags parse");
        assert_eq!(c.xds_address, "http://10.0.0.1:15010");
        assert_eq!(c.admin_addr, "127.0.0.1:1".parse().unwrap());
        assert_eq!(c.token_file, Some(PathBuf::from("/tmp/t")));
        assert_eq!(c.network, "net-a");
        assert_eq!(c.effective_ca_address(), "http://10.0.0.1:15010");
    }

    #[test]
    fn empty_zds_path_turns_inpod_capture_off() {
        let c = Config::try_parse_from(["ztunnel", "--node-name", "n", "--zds-path", ""])
            .expect("flags parse");
        assert_eq!(c.zds_socket(), None);
        let c =
            Config::try_parse_from(["ztunnel", "--node-name", "n", "--zds-path", "/run/z.sock"])
                .expect("flags parse");
        assert_eq!(c.zds_socket(), Some(std::path::Path::new("/run/z.sock")));
    }

    #[test]
    fn node_name_is_required() {
        if std::env::var_os("NODE_NAME").is_some() {
            return;
        }
        assert!(Config::try_parse_from(["ztunnel"]).is_err());
    }

    #[test]
    fn ephemeral_ports_use_port_zero() {
        let c = Config::new("n", DEFAULT_XDS_ADDRESS).with_ephemeral_ports();
        for a in [c.admin_addr, c.stats_addr, c.readiness_addr] {
            assert_eq!(a.port(), 0);
            assert!(a.ip().is_loopback());
        }
    }
}
