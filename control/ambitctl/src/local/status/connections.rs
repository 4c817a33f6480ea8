//! Application connections for `local status`, from each ztunnel's admin
//! `/connections` (JSON): one row per connection an app made, not per
//! HBONE tunnel. A client's ztunnel reports it outbound with the app's own
//! socket (`src` ip:port); the server's ztunnel reports it inbound, with
//! the pooled HBONE connection it came on (`hbone_peer`, shared by every
//! stream of that tunnel). Both carry the `CONNECT`'s trace id, which joins
//! them into one row; what only one side saw (plaintext, a refusal before
//! the tunnel, a ztunnel that did not answer) is a row of its own.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

/// Closed connections shown (the most recent), besides every open one.
pub const RECENT_CONNECTIONS: usize = 20;
/// Open connections shown at most.
pub const OPEN_CONNECTIONS: usize = 50;

/// One end of a record, as ztunnel serves it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct ZtEndpoint {
    pub ip: Option<IpAddr>,
    pub port: Option<u16>,
    pub workload: Option<String>,
    pub namespace: Option<String>,
    pub identity: Option<String>,
}

impl ZtEndpoint {
    /// `ip:port`, or the IP alone when the port is not known.
    fn addr(&self) -> String {
        match (self.ip, self.port) {
            (Some(ip), Some(port)) => SocketAddr::new(ip, port).to_string(),
            (Some(ip), None) => ip.to_string(),
            (None, _) => "-".into(),
        }
    }

    /// `namespace/workload`, or empty.
    fn who(&self) -> String {
        match (&self.namespace, &self.workload) {
            (Some(ns), Some(w)) => format!("{ns}/{w}"),
            (None, Some(w)) => w.clone(),
            _ => String::new(),
        }
    }
}

/// One record of ztunnel's `/connections`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ZtRecord {
    pub id: u64,
    pub direction: String,
    pub state: String,
    pub src: ZtEndpoint,
    pub dst: ZtEndpoint,
    #[serde(default)]
    pub dst_service: Option<String>,
    pub security: String,
    #[serde(default)]
    pub upstream: Option<SocketAddr>,
    #[serde(default)]
    pub hbone_peer: Option<SocketAddr>,
    #[serde(default)]
    pub waypoint: Option<String>,
    #[serde(default)]
    pub trace_id: Option<String>,
    pub start_unix_ms: u64,
    pub duration_ms: u64,
    #[serde(default)]
    pub bytes_sent: Option<u64>,
    #[serde(default)]
    pub bytes_received: Option<u64>,
    pub response_flags: String,
    #[serde(default)]
    pub error: Option<String>,
}

/// ztunnel's `/connections`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct ZtConnections {
    pub capacity: usize,
    pub closed_total: u64,
    pub open: Vec<ZtRecord>,
    pub recent: Vec<ZtRecord>,
}

/// What one ztunnel saw of a connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub node: String,
    /// Its id in that ztunnel's `/connections`.
    pub id: u64,
    /// `outbound` (the client's ztunnel) or `inbound` (the server's).
    pub direction: String,
    pub open: bool,
    pub response_flags: String,
    pub error: Option<String>,
    pub bytes_sent: Option<u64>,
    pub bytes_received: Option<u64>,
    pub duration_ms: u64,
    /// Inbound HBONE: the client end of the pooled HBONE connection the
    /// stream came on.
    pub hbone_peer: Option<SocketAddr>,
    /// Outbound: where it went (a peer's or waypoint's HBONE address, or
    /// the endpoint a VIP resolved to).
    pub upstream: Option<SocketAddr>,
}

/// One application connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Connection {
    /// When it was accepted, RFC 3339 UTC.
    pub time: String,
    pub start_unix_ms: u64,
    /// Still open where it was seen.
    pub open: bool,
    /// The client as the app's socket has it, `ip:port` (the client's
    /// ztunnel saw it, or a plaintext inbound); the IP alone when only the
    /// server's ztunnel saw it over HBONE, which does not carry the port.
    pub src_addr: String,
    /// `namespace/pod`, or empty when unknown.
    pub src_workload: String,
    /// The identity mTLS proved, `None` for plaintext.
    pub src_identity: Option<String>,
    /// What the client connected to: a service VIP or a pod address.
    pub dst_addr: String,
    /// `namespace/pod` of the server (a waypoint's when one relayed it).
    pub dst_workload: String,
    /// The service hostname, when a VIP was used.
    pub dst_service: Option<String>,
    /// The pod address the server's ztunnel delivered to, when it differs
    /// from `dst_addr`.
    pub delivered_to: Option<String>,
    pub mtls: bool,
    pub waypoint: Option<String>,
    /// The first problem either side reported (`-` when none).
    pub response_flags: String,
    pub error: Option<String>,
    /// Each ztunnel's report, the client's first.
    pub reported_by: Vec<Report>,
}

impl Connection {
    /// The report of `node` in `direction`, if it saw the connection.
    pub fn report(&self, node: &str, direction: &str) -> Option<&Report> {
        self.reported_by
            .iter()
            .find(|r| r.node == node && r.direction == direction)
    }
}

fn report(node: &str, r: &ZtRecord) -> Report {
    Report {
        node: node.to_string(),
        id: r.id,
        direction: r.direction.clone(),
        open: r.state == "open",
        response_flags: r.response_flags.clone(),
        error: r.error.clone(),
        bytes_sent: r.bytes_sent,
        bytes_received: r.bytes_received,
        duration_ms: r.duration_ms,
        hbone_peer: r.hbone_peer,
        upstream: r.upstream,
    }
}

/// A row from the record that saw the client (outbound, or inbound alone).
fn row(node: &str, r: &ZtRecord) -> Connection {
    Connection {
        time: rfc3339(r.start_unix_ms),
        start_unix_ms: r.start_unix_ms,
        open: r.state == "open",
        src_addr: r.src.addr(),
        src_workload: r.src.who(),
        src_identity: r.src.identity.clone(),
        dst_addr: r.dst.addr(),
        dst_workload: r.dst.who(),
        dst_service: r.dst_service.clone(),
        delivered_to: None,
        mtls: r.security == "mutual_tls",
        waypoint: r.waypoint.clone(),
        response_flags: r.response_flags.clone(),
        error: r.error.clone(),
        reported_by: vec![report(node, r)],
    }
}

/// Adds the server's inbound record to a client's row.
fn join(c: &mut Connection, node: &str, r: &ZtRecord) {
    c.open |= r.state == "open";
    let delivered = r.dst.addr();
    if delivered != c.dst_addr {
        c.delivered_to = Some(delivered);
    }
    if c.src_identity.is_none() {
        c.src_identity.clone_from(&r.src.identity);
    }
    if c.response_flags == "-" && r.response_flags != "-" {
        c.response_flags.clone_from(&r.response_flags);
        c.error.clone_from(&r.error);
    }
    c.reported_by.push(report(node, r));
}

/// Joins every node's records into application connections: all open
/// ones (up to [`OPEN_CONNECTIONS`]) and the last [`RECENT_CONNECTIONS`]
/// closed, oldest first.
pub fn merge(nodes: &[(String, ZtConnections)]) -> Vec<Connection> {
    let records = || {
        nodes.iter().flat_map(|(node, c)| {
            c.open
                .iter()
                .chain(c.recent.iter())
                .map(move |r| (node.as_str(), r))
        })
    };
    // Inbound HBONE records by trace id.
    let mut inbound: HashMap<&str, Vec<(&str, &ZtRecord)>> = HashMap::new();
    for (node, r) in records() {
        if r.direction == "inbound"
            && let Some(t) = &r.trace_id
        {
            inbound.entry(t.as_str()).or_default().push((node, r));
        }
    }
    let mut rows = Vec::new();
    for (node, r) in records() {
        if r.direction == "inbound" {
            continue;
        }
        let mut c = row(node, r);
        if let Some(servers) = r.trace_id.as_deref().and_then(|t| inbound.remove(t)) {
            for (n, s) in servers {
                join(&mut c, n, s);
            }
        }
        rows.push((c, node, r.id));
    }
    // What no client's ztunnel reported (plaintext from outside, a client
    // whose ztunnel did not answer, a waypoint's own HBONE).
    let unjoined: std::collections::HashSet<(&str, u64)> = inbound
        .values()
        .flatten()
        .map(|(n, r)| (*n, r.id))
        .collect();
    for (node, r) in records() {
        if r.direction == "inbound" && (r.trace_id.is_none() || unjoined.contains(&(node, r.id))) {
            rows.push((row(node, r), node, r.id));
        }
    }
    rows.sort_by(|a, b| (a.0.start_unix_ms, a.1, a.2).cmp(&(b.0.start_unix_ms, b.1, b.2)));
    let (open, closed): (Vec<_>, Vec<_>) = rows.into_iter().map(|r| r.0).partition(|c| c.open);
    let skip_open = open.len().saturating_sub(OPEN_CONNECTIONS);
    let skip_closed = closed.len().saturating_sub(RECENT_CONNECTIONS);
    let mut out: Vec<Connection> = open
        .into_iter()
        .skip(skip_open)
        .chain(closed.into_iter().skip(skip_closed))
        .collect();
    out.sort_by_key(|c| c.start_unix_ms);
    out
}

/// Milliseconds since the Unix epoch as RFC 3339 UTC
/// (`2026-12-02T15:11:52.570Z`).
pub fn rfc3339(unix_ms: u64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(unix_ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.millisecond()
    )
}

/// Sums `istio_tcp_connections_opened_total` by
/// `connection_security_policy` (Prometheus text, parsed).
pub fn opened_by_policy(metrics: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for s in crate::metrics::samples(metrics, "istio_tcp_connections_opened_total") {
        let policy = s
            .labels
            .get("connection_security_policy")
            .cloned()
            .unwrap_or_else(|| "unknown".to_string());
        // Counters are whole numbers.
        *out.entry(policy).or_insert(0) += s.value.max(0.0) as u64;
    }
    out
}
