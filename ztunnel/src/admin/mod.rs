//! The node-local HTTP servers: admin (`/config_dump`, `/connections`,
//! `/logging`, `/quitquitquit`), stats (`/metrics`) and readiness
//! (`/healthz/ready`). Each answers `/` with the list of its endpoints
//! (`index.rs`).
//!
//! hyper 1 HTTP/1.1 with a `match` on method and path; no framework.
//! Unknown paths get 404 pointing to `/`, known paths with the wrong method
//! 405. Serving (`server.rs`) bounds connections, request heads and idle
//! time.

mod config_dump;
mod index;
mod server;

#[cfg(test)]
mod tests;

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Response, StatusCode};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::info;
use tracing_subscriber::EnvFilter;

use crate::identity::CertificateDump;
use crate::metrics::Metrics;
use crate::state::StateReader;

pub use self::config_dump::{ConfigDump, config_dump};
pub(crate) use self::server::serve;

/// Errors of the admin servers.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// A listener could not be bound.
    #[error(
        "could not bind the {what} listener on {addr}: {source}; is another ztunnel or process using it? change {flag}"
    )]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The flag / env var that sets it.
        flag: &'static str,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// A bound listener has no local address (should not happen).
    #[error("could not read the local address of the {what} listener: {source}")]
    LocalAddr {
        /// Which listener.
        what: &'static str,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// `POST /logging` got a filter that does not parse.
    #[error(
        "invalid log filter {filter:?}: {reason}; use e.g. level=info or level=info,ambit_ztunnel::xds=debug"
    )]
    InvalidFilter {
        /// What was sent.
        filter: String,
        /// Why it was refused.
        reason: String,
    },
    /// The log filter could not be swapped.
    #[error("could not change the log filter: {0}")]
    Reload(String),
}

/// Reads and changes the process's log filter at runtime. The binary makes
/// one from its `tracing_subscriber::reload` handle; a library user that
/// owns no subscriber passes none and `/logging` answers 501.
#[derive(Clone)]
pub struct LogControl {
    inner: Arc<dyn LogFilter>,
}

impl fmt::Debug for LogControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LogControl")
            .field("current", &self.inner.current())
            .finish()
    }
}

trait LogFilter: Send + Sync {
    fn current(&self) -> String;
    fn set(&self, filter: EnvFilter) -> Result<(), AdminError>;
}

impl<S: 'static> LogFilter for tracing_subscriber::reload::Handle<EnvFilter, S> {
    fn current(&self) -> String {
        self.with_current(|f| f.to_string())
            .unwrap_or_else(|e| format!("unknown ({e})"))
    }

    fn set(&self, filter: EnvFilter) -> Result<(), AdminError> {
        self.reload(filter)
            .map_err(|e| AdminError::Reload(e.to_string()))
    }
}

impl LogControl {
    /// Control through a reload handle of the process's `EnvFilter`.
    pub fn new<S: 'static>(handle: tracing_subscriber::reload::Handle<EnvFilter, S>) -> Self
    where
        tracing_subscriber::reload::Handle<EnvFilter, S>: Send + Sync,
    {
        Self {
            inner: Arc::new(handle),
        }
    }

    /// The filter in effect.
    pub fn current(&self) -> String {
        self.inner.current()
    }

    /// Replaces the filter with `directives` (EnvFilter syntax).
    pub fn set(&self, directives: &str) -> Result<(), AdminError> {
        let filter = EnvFilter::try_new(directives).map_err(|e| AdminError::InvalidFilter {
            filter: directives.to_string(),
            reason: e.to_string(),
        })?;
        self.inner.set(filter)
    }
}

/// Which server a request arrived on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Listener {
    Admin,
    Stats,
    Readiness,
}

impl Listener {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Listener::Admin => "admin",
            Listener::Stats => "stats",
            Listener::Readiness => "readiness",
        }
    }

    /// Where it listens by default, and the flag that moves it.
    pub(crate) fn default_port_hint(self) -> &'static str {
        match self {
            Listener::Admin => "default 127.0.0.1:15000, --admin-addr",
            Listener::Stats => "default :15020, --stats-addr",
            Listener::Readiness => "default :15021, --readiness-addr",
        }
    }
}

/// What the handlers read and signal.
#[derive(Debug)]
pub(crate) struct AdminContext {
    pub state: StateReader,
    pub metrics: Arc<Metrics>,
    pub ready: watch::Receiver<bool>,
    /// Pods handed over by the node agent but not served.
    pub unserved: watch::Receiver<crate::inpod::UnservedSet>,
    pub log: Option<LogControl>,
    pub quit: watch::Sender<bool>,
    /// Source of the `certificates` section of `/config_dump`.
    pub certificates: Option<crate::identity::CertificateManager>,
}

type Body = Full<Bytes>;

fn text(status: StatusCode, body: impl Into<String>) -> Response<Body> {
    let mut resp = Response::new(Full::new(Bytes::from(body.into())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

fn with_type(mut resp: Response<Body>, content_type: &'static str) -> Response<Body> {
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

fn not_allowed(allow: &'static str) -> Response<Body> {
    let mut resp = text(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method not allowed; use {allow}\n"),
    );
    resp.headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allow));
    resp
}

/// Decodes `%XX` escapes and `+` in a query value.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_param(query: Option<&str>, key: &str) -> Option<String> {
    query?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (percent_decode(k) == key).then(|| percent_decode(v))
    })
}

/// Routes one request; pure over its inputs so tests need no sockets.
pub(crate) fn route(
    listener: Listener,
    ctx: &AdminContext,
    method: &Method,
    path: &str,
    query: Option<&str>,
) -> Response<Body> {
    match (listener, path) {
        (_, "/") => match *method {
            Method::GET => text(StatusCode::OK, index::render(listener)),
            _ => not_allowed("GET"),
        },
        (Listener::Admin, "/connections") => match *method {
            Method::GET => json(&ctx.metrics.tcp.connections.dump(), "connections"),
            _ => not_allowed("GET"),
        },
        (Listener::Admin, "/config_dump") => match *method {
            Method::GET => {
                let snap = ctx.state.load();
                let certs = ctx
                    .certificates
                    .as_ref()
                    .map(|c| CertificateDump::list(&c.view()))
                    .unwrap_or_default();
                json(&config_dump(&snap, certs), "config dump")
            }
            _ => not_allowed("GET"),
        },
        (Listener::Admin, "/logging") => logging(ctx, method, query),
        (Listener::Admin, "/quitquitquit") => match *method {
            Method::POST => {
                info!("shutdown requested through /quitquitquit");
                ctx.quit.send_replace(true);
                text(StatusCode::OK, "shutting down\n")
            }
            _ => not_allowed("POST"),
        },
        (Listener::Stats, "/metrics" | "/stats/prometheus") => match *method {
            Method::GET => match ctx.metrics.encode() {
                Ok(body) => with_type(
                    text(StatusCode::OK, body),
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
                Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
            },
            _ => not_allowed("GET"),
        },
        (Listener::Readiness, "/healthz/ready") => match *method {
            Method::GET => {
                let unserved = ctx.unserved.borrow().clone();
                if !*ctx.ready.borrow() {
                    text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "not ready: waiting for the first xDS sync from the control plane\n",
                    )
                } else if !unserved.is_empty() {
                    let mut body = format!(
                        "not ready: {} pod(s) enrolled by the node agent but not served \
                         (no in-pod listeners); the agent retries the handover:\n",
                        unserved.len()
                    );
                    for (pod, why) in &unserved {
                        body.push_str(&format!("  {pod}: {why}\n"));
                    }
                    text(StatusCode::SERVICE_UNAVAILABLE, body)
                } else {
                    text(StatusCode::OK, "ready\n")
                }
            }
            _ => not_allowed("GET"),
        },
        _ => text(
            StatusCode::NOT_FOUND,
            format!(
                "no such path {path} on the {} listener; GET / lists its endpoints\n",
                listener.name()
            ),
        ),
    }
}

/// `value` as pretty JSON, or a 500 naming `what`.
fn json(value: &impl serde::Serialize, what: &str) -> Response<Body> {
    match serde_json::to_vec_pretty(value) {
        Ok(json) => with_type(
            Response::new(Full::new(Bytes::from(json))),
            "application/json",
        ),
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("could not serialize the {what}: {e}\n"),
        ),
    }
}

fn logging(ctx: &AdminContext, method: &Method, query: Option<&str>) -> Response<Body> {
    let Some(log) = &ctx.log else {
        return text(
            StatusCode::NOT_IMPLEMENTED,
            "log level control is not available in this process (no reload handle)\n",
        );
    };
    match *method {
        Method::GET => text(
            StatusCode::OK,
            format!("current log filter: {}\n", log.current()),
        ),
        Method::POST => {
            let Some(level) = query_param(query, "level") else {
                return text(
                    StatusCode::BAD_REQUEST,
                    "missing ?level=...; use e.g. POST /logging?level=debug\n",
                );
            };
            match log.set(&level) {
                Ok(()) => {
                    info!(filter = %level, "log filter changed through /logging");
                    text(
                        StatusCode::OK,
                        format!("current log filter: {}\n", log.current()),
                    )
                }
                Err(e) => text(StatusCode::BAD_REQUEST, format!("{e}\n")),
            }
        }
        _ => not_allowed("GET, POST"),
    }
}

/// Binds `addr` for the listener `what`, configured by `flag`.
pub(crate) async fn bind(
    what: &'static str,
    addr: SocketAddr,
    flag: &'static str,
) -> Result<(TcpListener, SocketAddr), AdminError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| AdminError::Bind {
            what,
            addr,
            flag,
            source,
        })?;
    let local = listener
        .local_addr()
        .map_err(|source| AdminError::LocalAddr { what, source })?;
    Ok((listener, local))
}
