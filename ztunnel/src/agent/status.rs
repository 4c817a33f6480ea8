//! The agent's two HTTP listeners: readiness (`/healthz/ready`, 15021) and
//! merged metrics (`/stats/prometheus`, 15020).
//!
//! * Readiness is 200 only when a valid certificate is served, Envoy runs,
//!   has accepted the certificate over SDS, its admin `/ready` says `LIVE`
//!   and it has received its first CDS and LDS from the control plane;
//!   otherwise 503 with the first reason that fails. Every check is read
//!   at request time, each admin call bounded by a deadline.
//! * Metrics are the agent's own registry (certificate expiry and CA calls
//!   — the identity module's metrics — and SDS counters) converted to the
//!   Prometheus text format, followed by Envoy's own `/stats/prometheus`
//!   fetched from the admin (Istio's "merged metrics") with Istio's request
//!   metrics renamed and relabelled (`request_metrics`); if Envoy cannot be
//!   reached the agent's part is still served, with a comment saying why.
//!
//! HTTP/1.1 only; at most [`MAX_CONNECTIONS`] connections at a time, each
//! with a header read deadline.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tracing::{debug, warn};

use super::envoy_admin::EnvoyAdmin;
use super::request_metrics::ReporterLabels;
use super::secrets::CertStatus;
use crate::drain::{DrainWatcher, run_until_drained};

/// Connections served at once per listener.
pub const MAX_CONNECTIONS: usize = 32;
/// Deadline for Envoy's admin during a readiness check.
const READY_ADMIN_TIMEOUT: Duration = Duration::from_secs(1);
/// Deadline for fetching Envoy's Prometheus stats.
const STATS_TIMEOUT: Duration = Duration::from_secs(5);
/// Envoy's counters of accepted CDS and LDS responses.
const XDS_COUNTERS: [(&str, &str); 2] = [
    ("cluster_manager.cds.update_success", "clusters (CDS)"),
    ("listener_manager.lds.update_success", "listeners (LDS)"),
];

/// Where Envoy is in its life, as readiness reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvoyPhase {
    /// Not started: the agent waits for the first certificate.
    NotStarted,
    /// Running.
    Running {
        /// Its pid.
        pid: u32,
    },
    /// Draining before it is stopped.
    Draining,
    /// Gone.
    Exited(String),
}

/// The agent's own metrics besides the identity and SDS ones.
#[derive(Debug, Clone, Default)]
pub struct StatusMetrics {
    /// `ambit_agent_envoy_scrape_failures_total`.
    pub scrape_failures: Counter,
}

impl StatusMetrics {
    /// Registers the metrics.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "ambit_agent_envoy_scrape_failures",
            "Fetches of Envoy's /stats/prometheus for the merged metrics that failed",
            self.scrape_failures.clone(),
        );
    }
}

/// What the handlers read.
#[derive(Debug)]
pub struct StatusContext {
    /// The certificate.
    pub cert: watch::Receiver<CertStatus>,
    /// The version of `default` Envoy last ACKed over SDS.
    pub acked: watch::Receiver<Option<String>>,
    /// Envoy's phase.
    pub envoy: watch::Receiver<EnvoyPhase>,
    /// Envoy's admin.
    pub admin: EnvoyAdmin,
    /// The agent's registry.
    pub registry: Registry,
    /// Scrape failures.
    pub metrics: StatusMetrics,
    /// Who a sidecar's request metrics report for.
    pub reporter: ReporterLabels,
}

/// Which listener a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Port {
    /// `/healthz/ready`.
    Status,
    /// `/stats/prometheus`.
    Metrics,
}

impl StatusContext {
    /// `Ok` when ready, else why not.
    pub async fn readiness(&self) -> Result<(), String> {
        let cert = self.cert.borrow().clone();
        if let CertStatus::Unavailable(reason) = cert {
            return Err(format!("no valid workload certificate: {reason}"));
        }
        let phase = self.envoy.borrow().clone();
        match phase {
            EnvoyPhase::Running { .. } => {}
            EnvoyPhase::NotStarted => return Err("Envoy is not started yet".into()),
            EnvoyPhase::Draining => return Err("Envoy is draining (the pod is stopping)".into()),
            EnvoyPhase::Exited(how) => return Err(format!("Envoy exited: {how}")),
        }
        if self.acked.borrow().is_none() {
            return Err("Envoy has not accepted the workload certificate over SDS yet".into());
        }
        let state = self
            .admin
            .state(READY_ADMIN_TIMEOUT)
            .await
            .map_err(|e| e.to_string())?;
        if state != "LIVE" {
            return Err(format!(
                "Envoy is {state}: waiting for its initial configuration from the control plane"
            ));
        }
        let names: Vec<&str> = XDS_COUNTERS.iter().map(|(n, _)| *n).collect();
        let counters = self
            .admin
            .counters(&names, READY_ADMIN_TIMEOUT)
            .await
            .map_err(|e| e.to_string())?;
        let missing: Vec<&str> = XDS_COUNTERS
            .iter()
            .filter(|(n, _)| counters.get(*n).copied().unwrap_or(0) == 0)
            .map(|(_, what)| *what)
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "Envoy is LIVE but has not received its {} from the control plane yet",
                missing.join(" and ")
            ));
        }
        Ok(())
    }

    /// The agent's metrics followed by Envoy's.
    pub async fn merged_metrics(&self) -> String {
        let mut own = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut own, &self.registry) {
            own = format!("# the agent's metrics could not be encoded: {e}\n");
        }
        let mut out = openmetrics_to_prometheus(&own);
        match self
            .admin
            .call(Method::GET, "/stats/prometheus", STATS_TIMEOUT)
            .await
        {
            Ok((status, body)) if status.is_success() => {
                out.push_str(&super::request_metrics::rewrite(
                    &String::from_utf8_lossy(&body),
                    &self.reporter,
                ));
            }
            Ok((status, _)) => {
                self.metrics.scrape_failures.inc();
                out.push_str(&format!(
                    "# Envoy's /stats/prometheus answered {status}; only the agent's metrics are shown\n"
                ));
            }
            Err(e) => {
                self.metrics.scrape_failures.inc();
                out.push_str(&format!(
                    "# Envoy's stats are unavailable ({e}); only the agent's metrics are shown\n"
                ));
            }
        }
        out
    }

    async fn route(&self, port: Port, method: &Method, path: &str) -> Response<Full<Bytes>> {
        if method != Method::GET {
            return text(StatusCode::METHOD_NOT_ALLOWED, "only GET is served here\n");
        }
        match (port, path) {
            (Port::Status, "/healthz/ready") => match self.readiness().await {
                Ok(()) => text(StatusCode::OK, "ready\n"),
                Err(why) => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("not ready: {why}\n"),
                ),
            },
            (Port::Metrics, "/stats/prometheus" | "/metrics") => {
                let mut resp = text(StatusCode::OK, self.merged_metrics().await);
                resp.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                resp
            }
            (Port::Status, _) => text(StatusCode::NOT_FOUND, "not found; try /healthz/ready\n"),
            (Port::Metrics, _) => text(StatusCode::NOT_FOUND, "not found; try /stats/prometheus\n"),
        }
    }
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// Serves `port` on `listener` until `drain` fires.
pub async fn serve(
    listener: TcpListener,
    port: Port,
    ctx: Arc<StatusContext>,
    drain: DrainWatcher,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let permit = tokio::select! {
            biased;
            _ = drain.signaled() => break,
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        let accepted = tokio::select! {
            biased;
            _ = drain.signaled() => break,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                warn!(?port, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let ctx = ctx.clone();
        let drain = drain.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                let ctx = ctx.clone();
                async move { Ok::<_, Infallible>(ctx.route(port, req.method(), req.uri().path()).await) }
            });
            let conn = std::pin::pin!(
                http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(10))
                    .serve_connection(TokioIo::new(stream), svc)
            );
            run_until_drained(conn, &drain, |c| c.graceful_shutdown()).await;
        });
    }
    debug!(?port, "listener stopped");
}

/// Binds one of the agent's listeners, naming the flag on failure.
pub async fn bind(
    addr: SocketAddr,
    flag: &'static str,
) -> Result<(TcpListener, SocketAddr), super::AgentError> {
    let err = |source| super::AgentError::Bind { addr, flag, source };
    let l = TcpListener::bind(addr).await.map_err(err)?;
    let local = l.local_addr().map_err(err)?;
    Ok((l, local))
}

/// The text of prometheus-client's OpenMetrics encoder in the classic
/// Prometheus format Envoy's stats use, so the two parts merge into one
/// valid exposition: counters' `# HELP`/`# TYPE` lines name the `_total`
/// sample, `# UNIT` and `# EOF` are dropped.
pub fn openmetrics_to_prometheus(text: &str) -> String {
    let counters: BTreeSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let tail = if tail == "unknown" { "untyped" } else { tail };
                if counters.contains(name) {
                    out.push_str(&format!("{prefix}{name}_total {tail}\n"));
                } else {
                    out.push_str(&format!("{prefix}{name} {tail}\n"));
                }
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_counters_become_prometheus_counters() {
        let om = "# HELP a_requests CA calls.\n# TYPE a_requests counter\na_requests_total{result=\"ok\"} 1\n# HELP g A gauge.\n# TYPE g gauge\ng 2\n# EOF\n";
        let p = openmetrics_to_prometheus(om);
        assert_eq!(
            p,
            "# HELP a_requests_total CA calls.\n# TYPE a_requests_total counter\na_requests_total{result=\"ok\"} 1\n# HELP g A gauge.\n# TYPE g gauge\ng 2\n"
        );
    }

    fn ctx() -> (
        StatusContext,
        watch::Sender<CertStatus>,
        watch::Sender<EnvoyPhase>,
    ) {
        let (cert_tx, cert) = watch::channel(CertStatus::Unavailable("CA down".into()));
        let (envoy_tx, envoy) = watch::channel(EnvoyPhase::NotStarted);
        let (_acked_tx, acked) = watch::channel(None);
        let ctx = StatusContext {
            cert,
            acked,
            envoy,
            admin: EnvoyAdmin::new("127.0.0.1:9".parse().unwrap()),
            registry: Registry::default(),
            metrics: StatusMetrics::default(),
            reporter: ReporterLabels::default(),
        };
        (ctx, cert_tx, envoy_tx)
    }

    #[tokio::test]
    async fn readiness_names_the_first_missing_piece() {
        let (ctx, cert, envoy) = ctx();
        assert!(ctx.readiness().await.unwrap_err().contains("CA down"));
        cert.send_replace(CertStatus::Serving("01".into()));
        assert!(ctx.readiness().await.unwrap_err().contains("not started"));
        envoy.send_replace(EnvoyPhase::Running { pid: 1 });
        assert!(ctx.readiness().await.unwrap_err().contains("SDS"));
        envoy.send_replace(EnvoyPhase::Exited("exit status: 1".into()));
        assert!(ctx.readiness().await.unwrap_err().contains("exited"));
    }

    #[tokio::test]
    async fn metrics_without_envoy_still_serve_the_agents_part() {
        let (mut ctx, _c, _e) = ctx();
        let m = StatusMetrics::default();
        m.register(&mut ctx.registry);
        ctx.metrics = m;
        let text = ctx.merged_metrics().await;
        assert!(
            text.contains("# TYPE ambit_agent_envoy_scrape_failures_total counter"),
            "{text}"
        );
        assert!(text.contains("Envoy's stats are unavailable"), "{text}");
        assert_eq!(ctx.metrics.scrape_failures.get(), 1);
    }
}
