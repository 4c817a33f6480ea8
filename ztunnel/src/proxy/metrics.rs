//! TCP connection metrics and the access log, recorded when a connection
//! ends.
//!
//! A proxy creates one [`ConnectionResult`] when it accepts a connection.
//! That counts `istio_tcp_connections_opened_total` at once; the proxy then
//! counts bytes with [`ConnectionResult::record_sent`] /
//! [`ConnectionResult::record_received`] and ends with
//! [`ConnectionResult::finish`] or [`ConnectionResult::fail`]. Ending counts
//! `istio_tcp_connections_closed_total`, adds the bytes to
//! `istio_tcp_sent_bytes_total` / `istio_tcp_received_bytes_total` and
//! writes one access-log line (target `access`). A result dropped without
//! either (task cancelled, panic, forgotten branch) still records, with
//! response flag `DC`.
//!
//! Names and labels follow Istio's ztunnel so dashboards keep working. Byte
//! counters are added once, when the connection ends, with the same labels
//! as the close (including the final `response_flags`); a long-lived
//! connection's bytes therefore show up when it closes.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Instant;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::recent::{ConnectionRecord, ConnectionState, ConnectionTable, Endpoint, Outcome};

/// Label value for a peer field nobody knows (Istio's convention).
pub const UNKNOWN: &str = "unknown";

/// Which side of the connection reports it (Istio's `reporter` label).
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub enum Reporter {
    /// The proxy next to the client (outbound).
    #[default]
    Source,
    /// The proxy next to the server (inbound).
    Destination,
}

impl Reporter {
    /// The label value: `source` or `destination`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reporter::Source => "source",
            Reporter::Destination => "destination",
        }
    }

    /// The access-log `direction`: `outbound` or `inbound`.
    pub fn direction(self) -> &'static str {
        match self {
            Reporter::Source => "outbound",
            Reporter::Destination => "inbound",
        }
    }
}

/// `connection_security_policy` label.
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub enum SecurityPolicy {
    /// Plain TCP (PERMISSIVE inbound, passthrough, non-mesh peers).
    #[default]
    None,
    /// HBONE with mutual TLS.
    MutualTls,
}

impl SecurityPolicy {
    /// The label value: `none` or `mutual_tls`.
    pub fn as_str(self) -> &'static str {
        match self {
            SecurityPolicy::None => "none",
            SecurityPolicy::MutualTls => "mutual_tls",
        }
    }
}

/// `response_flags` label: how the connection ended (Envoy's short codes,
/// as Istio uses them).
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub enum ResponseFlags {
    /// `-`: no problem (also the value while the connection is open).
    #[default]
    None,
    /// `DENY`: refused by authorization policy or PeerAuthentication.
    Deny,
    /// `CONNECT`: the upstream connection could not be established.
    ConnectFailure,
    /// `DC`: the connection ended before the proxy finished it (dropped,
    /// cancelled by drain or by the downstream going away).
    DownstreamTerminated,
}

impl ResponseFlags {
    /// The label value: `-`, `DENY`, `CONNECT` or `DC`.
    pub fn as_str(self) -> &'static str {
        match self {
            ResponseFlags::None => "-",
            ResponseFlags::Deny => "DENY",
            ResponseFlags::ConnectFailure => "CONNECT",
            ResponseFlags::DownstreamTerminated => "DC",
        }
    }
}

/// `request_protocol` label; ztunnel only proxies TCP.
#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
pub enum RequestProtocol {
    /// `tcp`.
    #[default]
    Tcp,
}

impl RequestProtocol {
    /// The label value: `tcp`.
    pub fn as_str(self) -> &'static str {
        match self {
            RequestProtocol::Tcp => "tcp",
        }
    }
}

macro_rules! label_value_as_str {
    ($($ty:ty),*) => {$(
        impl EncodeLabelValue for $ty {
            fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), fmt::Error> {
                fmt::Write::write_str(encoder, self.as_str())
            }
        }
    )*};
}
label_value_as_str!(Reporter, SecurityPolicy, ResponseFlags, RequestProtocol);

/// What the proxy knows about one end of a connection. Empty strings mean
/// "not known" and are labelled `unknown`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerInfo {
    /// Pod (or VM) name, for the access log.
    pub name: String,
    /// Workload name (e.g. the Deployment).
    pub workload: String,
    /// Namespace.
    pub namespace: String,
    /// Canonical service (`service.istio.io/canonical-name`, else `app`).
    pub canonical_service: String,
    /// Canonical revision (`service.istio.io/canonical-revision`, else `version`).
    pub canonical_revision: String,
    /// SPIFFE ID (`spiffe://<td>/ns/<ns>/sa/<sa>`); for the source, only the
    /// identity proven by mTLS.
    pub principal: String,
}

/// The service a connection was addressed to, if it went to a VIP.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceInfo {
    /// Hostname, e.g. `echo.default.svc.cluster.local`.
    pub hostname: String,
    /// Service name.
    pub name: String,
    /// Service namespace.
    pub namespace: String,
}

/// Everything known when a connection is accepted.
#[derive(Clone, Debug)]
pub struct ConnectionOpen {
    /// Who reports.
    pub reporter: Reporter,
    /// Downstream (client) address.
    pub src: SocketAddr,
    /// Address the client connected to (original destination).
    pub dst: SocketAddr,
    /// The client end.
    pub source: PeerInfo,
    /// The server end.
    pub destination: PeerInfo,
    /// The service, if a VIP was used.
    pub destination_service: Option<ServiceInfo>,
    /// mTLS or not.
    pub security: SecurityPolicy,
    /// Where the proxy actually connected (the peer's HBONE address, a
    /// waypoint's, or the plain destination), when it differs from `dst`.
    pub upstream: Option<SocketAddr>,
    /// The waypoint the connection went through (`namespace/pod`), if any.
    pub waypoint: Option<String>,
    /// The trace id of the HBONE `CONNECT`'s `traceparent` (sent outbound,
    /// received inbound), pairing the two ends' records of one connection.
    pub trace_id: Option<u128>,
    /// Inbound HBONE: the client end of the pooled HBONE connection the
    /// stream came on (then `src` is that address too: HBONE does not carry
    /// the application's source port).
    pub hbone_peer: Option<SocketAddr>,
}

fn or_unknown(s: &str) -> String {
    if s.is_empty() {
        UNKNOWN.to_string()
    } else {
        s.to_string()
    }
}

/// Istio's label set of the TCP metrics.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TcpLabels {
    /// `source` or `destination`.
    pub reporter: Reporter,
    /// Source workload name.
    pub source_workload: String,
    /// Source canonical service.
    pub source_canonical_service: String,
    /// Source canonical revision.
    pub source_canonical_revision: String,
    /// Source namespace.
    pub source_workload_namespace: String,
    /// Source SPIFFE ID (only when mTLS proved it).
    pub source_principal: String,
    /// Source app (the canonical service, as Istio's ztunnel does).
    pub source_app: String,
    /// Source version (the canonical revision).
    pub source_version: String,
    /// Destination service hostname.
    pub destination_service: String,
    /// Destination service namespace.
    pub destination_service_namespace: String,
    /// Destination service name.
    pub destination_service_name: String,
    /// Destination workload name.
    pub destination_workload: String,
    /// Destination canonical service.
    pub destination_canonical_service: String,
    /// Destination canonical revision.
    pub destination_canonical_revision: String,
    /// Destination namespace.
    pub destination_workload_namespace: String,
    /// Destination SPIFFE ID.
    pub destination_principal: String,
    /// Destination app.
    pub destination_app: String,
    /// Destination version.
    pub destination_version: String,
    /// Always `tcp`.
    pub request_protocol: RequestProtocol,
    /// `-` while open; the outcome once closed.
    pub response_flags: ResponseFlags,
    /// `mutual_tls` or `none`.
    pub connection_security_policy: SecurityPolicy,
}

impl TcpLabels {
    /// The labels of a connection just accepted (`response_flags` = `-`).
    pub fn new(open: &ConnectionOpen) -> Self {
        let src = &open.source;
        let dst = &open.destination;
        let svc = open.destination_service.clone().unwrap_or_default();
        Self {
            reporter: open.reporter,
            source_workload: or_unknown(&src.workload),
            source_canonical_service: or_unknown(&src.canonical_service),
            source_canonical_revision: or_unknown(&src.canonical_revision),
            source_workload_namespace: or_unknown(&src.namespace),
            source_principal: or_unknown(&src.principal),
            source_app: or_unknown(&src.canonical_service),
            source_version: or_unknown(&src.canonical_revision),
            destination_service: or_unknown(&svc.hostname),
            destination_service_namespace: or_unknown(&svc.namespace),
            destination_service_name: or_unknown(&svc.name),
            destination_workload: or_unknown(&dst.workload),
            destination_canonical_service: or_unknown(&dst.canonical_service),
            destination_canonical_revision: or_unknown(&dst.canonical_revision),
            destination_workload_namespace: or_unknown(&dst.namespace),
            destination_principal: or_unknown(&dst.principal),
            destination_app: or_unknown(&dst.canonical_service),
            destination_version: or_unknown(&dst.canonical_revision),
            request_protocol: RequestProtocol::Tcp,
            response_flags: ResponseFlags::None,
            connection_security_policy: open.security,
        }
    }
}

/// Labels of `ambit_authorization_denials_total`: who was refused, by which
/// policy.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DenialLabels {
    /// `namespace/name` of the DENY policy that matched, or
    /// `no ALLOW policy matched`.
    pub policy: String,
    /// `source` or `destination`.
    pub reporter: Reporter,
    /// Destination workload name.
    pub destination_workload: String,
    /// Destination namespace.
    pub destination_workload_namespace: String,
    /// Source SPIFFE ID (only when mTLS proved it).
    pub source_principal: String,
    /// `mutual_tls` or `none`.
    pub connection_security_policy: SecurityPolicy,
}

/// The four Istio TCP metric families, the denials by policy, and the table
/// of open and recent connections (admin `/connections`). Cloning shares
/// them: one pointer, which every open connection holds.
#[derive(Clone, Debug, Default)]
pub struct TcpMetrics {
    families: Arc<TcpFamilies>,
}

impl std::ops::Deref for TcpMetrics {
    type Target = TcpFamilies;

    fn deref(&self) -> &TcpFamilies {
        &self.families
    }
}

/// What [`TcpMetrics`] shares.
#[derive(Debug, Default)]
pub struct TcpFamilies {
    /// `istio_tcp_connections_opened_total`.
    pub opened: Family<TcpLabels, Counter>,
    /// `istio_tcp_connections_closed_total`.
    pub closed: Family<TcpLabels, Counter>,
    /// `istio_tcp_sent_bytes_total`: bytes sent to the downstream client.
    pub sent_bytes: Family<TcpLabels, Counter>,
    /// `istio_tcp_received_bytes_total`: bytes received from the downstream client.
    pub received_bytes: Family<TcpLabels, Counter>,
    /// `ambit_authorization_denials_total`: connections refused or closed by
    /// authorization policy (PeerAuthentication STRICT included).
    pub denials: Family<DenialLabels, Counter>,
    /// Open connections and the last closed ones, one record each
    /// (`super::recent`).
    pub connections: ConnectionTable,
    /// One shared copy of each label set in use: an open connection holds
    /// a pointer to its labels, not ~0.8 KB of its own strings. Grows as
    /// the families do (they keep every label set too).
    interned: RwLock<HashSet<Arc<TcpLabels>>>,
}

impl TcpMetrics {
    /// The shared copy of `labels`: a read lock when the set is known (the
    /// common case), the write lock only to add a new one.
    fn intern(&self, labels: TcpLabels) -> Arc<TcpLabels> {
        // A panic while holding this lock leaves a consistent set.
        let known = self.interned.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(shared) = known.get(&labels) {
            return shared.clone();
        }
        drop(known);
        let mut set = self
            .interned
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        // Another connection may have added it between the two locks.
        if let Some(shared) = set.get(&labels) {
            return shared.clone();
        }
        let shared = Arc::new(labels);
        set.insert(shared.clone());
        shared
    }

    /// Registers the families in `registry` (the encoder adds `_total`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "istio_tcp_connections_opened",
            "TCP connections opened",
            self.opened.clone(),
        );
        registry.register(
            "istio_tcp_connections_closed",
            "TCP connections closed",
            self.closed.clone(),
        );
        registry.register(
            "istio_tcp_sent_bytes",
            "Bytes sent to the client of a TCP connection, counted when it closes",
            self.sent_bytes.clone(),
        );
        registry.register(
            "istio_tcp_received_bytes",
            "Bytes received from the client of a TCP connection, counted when it closes",
            self.received_bytes.clone(),
        );
        registry.register(
            "ambit_authorization_denials",
            "Connections refused or closed by authorization policy, by policy",
            self.denials.clone(),
        );
    }
}

/// One accepted connection: counts it as opened now, and records the close,
/// the bytes and one access-log line exactly once, when finished or dropped.
#[derive(Debug)]
pub struct ConnectionResult {
    metrics: TcpMetrics,
    labels: Arc<TcpLabels>,
    src: SocketAddr,
    dst: SocketAddr,
    src_name: String,
    dst_name: String,
    upstream: Option<SocketAddr>,
    waypoint: Option<String>,
    start: Instant,
    span: tracing::Span,
    sent: AtomicU64,
    received: AtomicU64,
    recorded: bool,
    /// Its id in `metrics.connections`.
    table_id: u64,
}

impl ConnectionResult {
    /// Counts the connection as opened and opens its span
    /// (`connection{src, dst, direction}`); instrument the connection's task
    /// with [`ConnectionResult::span`].
    pub fn new(open: ConnectionOpen, metrics: &TcpMetrics) -> Self {
        let labels = metrics.intern(TcpLabels::new(&open));
        metrics.opened.get_or_create(&labels).inc();
        let table_id = metrics.connections.open(table_record(&open));
        let span = tracing::info_span!(
            "connection",
            src = %open.src,
            dst = %open.dst,
            direction = open.reporter.direction(),
        );
        // Fall back to the canonical service when the pod name is unknown.
        let name = |p: &PeerInfo| {
            if p.name.is_empty() {
                or_unknown(&p.canonical_service)
            } else {
                p.name.clone()
            }
        };
        Self {
            metrics: metrics.clone(),
            src_name: name(&open.source),
            dst_name: name(&open.destination),
            labels,
            src: open.src,
            dst: open.dst,
            upstream: open.upstream,
            waypoint: open.waypoint,
            start: Instant::now(),
            span,
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            recorded: false,
            table_id,
        }
    }

    /// The connection's span.
    pub fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// The labels the close will be recorded with (`response_flags` is set
    /// when ending).
    pub fn labels(&self) -> &TcpLabels {
        &self.labels
    }

    /// Adds `n` bytes sent to the downstream client (callable from both copy
    /// directions at once).
    pub fn record_sent(&self, n: u64) {
        self.sent.fetch_add(n, Ordering::Relaxed);
    }

    /// Adds `n` bytes received from the downstream client.
    pub fn record_received(&self, n: u64) {
        self.received.fetch_add(n, Ordering::Relaxed);
    }

    /// Bytes sent so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Bytes received so far.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Ends a connection that completed normally (`response_flags` = `-`).
    pub fn finish(mut self) {
        self.record(ResponseFlags::None, None);
    }

    /// Ends a connection that failed, with `flags` and the error for the log.
    pub fn fail(mut self, flags: ResponseFlags, error: &dyn fmt::Display) {
        self.record(flags, Some(error.to_string()));
    }

    /// Ends a connection that `policy` refused or closed: `DENY`, counted
    /// in `ambit_authorization_denials_total` under the policy's name.
    pub fn deny(mut self, policy: &str, error: &dyn fmt::Display) {
        let l = &self.labels;
        let labels = DenialLabels {
            policy: policy.to_string(),
            reporter: l.reporter,
            destination_workload: l.destination_workload.clone(),
            destination_workload_namespace: l.destination_workload_namespace.clone(),
            source_principal: l.source_principal.clone(),
            connection_security_policy: l.connection_security_policy,
        };
        self.metrics.denials.get_or_create(&labels).inc();
        self.record(ResponseFlags::Deny, Some(error.to_string()));
    }

    fn record(&mut self, flags: ResponseFlags, error: Option<String>) {
        if self.recorded {
            return;
        }
        self.recorded = true;
        let flagged;
        let labels = if flags == ResponseFlags::None {
            &*self.labels
        } else {
            flagged = TcpLabels {
                response_flags: flags,
                ..TcpLabels::clone(&self.labels)
            };
            &flagged
        };
        let sent = self.sent();
        let received = self.received();
        self.metrics.closed.get_or_create(labels).inc();
        self.metrics.sent_bytes.get_or_create(labels).inc_by(sent);
        self.metrics
            .received_bytes
            .get_or_create(labels)
            .inc_by(received);

        let mtls = labels.connection_security_policy == SecurityPolicy::MutualTls;
        // Identities are only logged when mTLS proved them.
        let (src_identity, dst_identity) = if mtls {
            (
                labels.source_principal.as_str(),
                labels.destination_principal.as_str(),
            )
        } else {
            ("-", "-")
        };
        let duration_ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.metrics.connections.close(
            self.table_id,
            Outcome {
                response_flags: flags.as_str(),
                error: error.clone(),
                bytes_sent: sent,
                bytes_received: received,
            },
        );
        let upstream = self
            .upstream
            .map_or_else(|| "-".to_string(), |a| a.to_string());
        tracing::event!(
            target: "access",
            parent: None,
            tracing::Level::INFO,
            src.addr = %self.src,
            src.workload = %self.src_name,
            src.namespace = %labels.source_workload_namespace,
            src.identity = src_identity,
            dst.addr = %self.dst,
            dst.service = %labels.destination_service,
            dst.workload = %self.dst_name,
            dst.namespace = %labels.destination_workload_namespace,
            dst.identity = dst_identity,
            upstream = %upstream,
            waypoint = self.waypoint.as_deref().unwrap_or("-"),
            direction = labels.reporter.direction(),
            bytes_sent = sent,
            bytes_recv = received,
            duration_ms,
            response_flags = flags.as_str(),
            error = error.as_deref().unwrap_or("-"),
            "connection complete"
        );
    }
}

/// The connection table's record of a connection just accepted.
fn table_record(open: &ConnectionOpen) -> ConnectionRecord {
    let mtls = open.security == SecurityPolicy::MutualTls;
    let known = |s: &str| (!s.is_empty()).then(|| s.to_string());
    let endpoint = |addr: SocketAddr, p: &PeerInfo| Endpoint {
        workload: known(&p.name),
        namespace: known(&p.namespace),
        identity: if mtls { known(&p.principal) } else { None },
        ..Endpoint::at(addr)
    };
    let mut src = endpoint(open.src, &open.source);
    if open.hbone_peer.is_some() {
        src.port = None;
    }
    ConnectionRecord {
        id: 0,
        direction: open.reporter.direction(),
        state: ConnectionState::Open,
        src,
        dst: endpoint(open.dst, &open.destination),
        dst_service: open
            .destination_service
            .as_ref()
            .and_then(|s| known(&s.hostname)),
        security: open.security.as_str(),
        upstream: open.upstream,
        hbone_peer: open.hbone_peer,
        waypoint: open.waypoint.clone(),
        trace_id: open.trace_id.map(super::recent::format_trace_id),
        start_unix_ms: 0,
        duration_ms: 0,
        bytes_sent: None,
        bytes_received: None,
        response_flags: ResponseFlags::None.as_str(),
        error: None,
    }
}

impl Drop for ConnectionResult {
    fn drop(&mut self) {
        self.record(
            ResponseFlags::DownstreamTerminated,
            Some("connection dropped before it finished".to_string()),
        );
    }
}

#[cfg(test)]
#[path = "metrics_tests.rs"]
mod tests;
