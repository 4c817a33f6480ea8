//! The connections a ztunnel carries now and the last ones it carried, as
//! the admin's `/connections` serves them (JSON): one record per
//! *application* connection, whichever way it travels.
//!
//! * Outbound records carry the app's own socket (`src.ip` and `src.port`
//!   as the source pod's app bound it) and the destination it asked for;
//!   an HBONE one adds `upstream` (the peer's or waypoint's `:15008`) and
//!   the `trace_id` of the `traceparent` its `CONNECT` sent.
//! * Inbound HBONE records carry the `trace_id` the `CONNECT` arrived with
//!   and `hbone_peer`, the client end of the pooled HBONE connection the
//!   stream came on: every stream of one pooled connection has the same
//!   one, and the application's source port is not carried by HBONE, so
//!   `src.port` is absent. The `trace_id` pairs an inbound record with the
//!   source ztunnel's outbound one.
//! * Inbound plaintext (`:15006`) records carry the client's socket.
//!
//! The data path writes here twice per connection, never per byte: once
//! when [`super::metrics::ConnectionResult`] is created (into one of
//! [`SHARDS`] maps of open connections) and once when it records its end
//! (out of that map, into a ring of the last [`DEFAULT_CAPACITY`] closed
//! ones). Both hold a std mutex for a map or deque operation only, never
//! across an await. Bytes are counted when a connection ends (as the
//! metrics are), so open connections show none yet.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// Closed connections kept by default.
pub const DEFAULT_CAPACITY: usize = 256;

/// Shards of the open-connection map (by connection id).
pub const SHARDS: usize = 16;

/// One end of a connection as this ztunnel knows it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Endpoint {
    /// Its IP.
    pub ip: Option<IpAddr>,
    /// Its port; absent for the source of an inbound HBONE stream (HBONE
    /// does not carry the application's source port).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The pod (or VM) name, when the address is a known workload's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    /// Its namespace.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The SPIFFE identity mTLS proved (the destination's: the one the
    /// client pinned); absent for plaintext.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
}

impl Endpoint {
    /// An endpoint at `addr`.
    pub fn at(addr: SocketAddr) -> Self {
        Self {
            ip: Some(addr.ip().to_canonical()),
            port: Some(addr.port()),
            ..Self::default()
        }
    }
}

/// Open or closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnectionState {
    /// Still carrying traffic (or being set up).
    Open,
    /// Ended; its outcome is known.
    Closed,
}

/// One application connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConnectionRecord {
    /// Unique within this ztunnel process, increasing.
    pub id: u64,
    /// `outbound` (reported by the client's ztunnel) or `inbound` (the
    /// server's).
    pub direction: &'static str,
    /// Open or closed.
    pub state: ConnectionState,
    /// The client.
    pub src: Endpoint,
    /// What the client connected to (a service VIP or a pod address).
    pub dst: Endpoint,
    /// The service hostname, when a VIP was used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dst_service: Option<String>,
    /// `mutual_tls` or `none`.
    pub security: &'static str,
    /// Outbound: where the proxy connected (a peer's or waypoint's HBONE
    /// address, or the endpoint a VIP resolved to), when not `dst`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream: Option<SocketAddr>,
    /// Inbound HBONE: the client end of the pooled HBONE connection the
    /// stream came on (shared by all its streams).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hbone_peer: Option<SocketAddr>,
    /// The waypoint it went through (`namespace/pod`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<String>,
    /// The W3C trace id of the HBONE `CONNECT` (32 hex digits): the same
    /// on the client's outbound and the server's inbound record.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    /// When it was accepted, milliseconds since the Unix epoch.
    pub start_unix_ms: u64,
    /// How long it lasted (so far, while open), milliseconds.
    pub duration_ms: u64,
    /// Bytes sent to the client (counted when it closes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_sent: Option<u64>,
    /// Bytes received from the client (counted when it closes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_received: Option<u64>,
    /// Istio's `response_flags`: `-` (fine, or still open), `DENY`,
    /// `CONNECT`, `DC`.
    pub response_flags: &'static str,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// How a connection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// `response_flags`.
    pub response_flags: &'static str,
    /// The error, if it failed.
    pub error: Option<String>,
    /// Bytes sent to the client.
    pub bytes_sent: u64,
    /// Bytes received from the client.
    pub bytes_received: u64,
}

/// What `/connections` serves.
#[derive(Debug, Clone, Serialize)]
pub struct ConnectionsDump {
    /// Most closed connections kept.
    pub capacity: usize,
    /// Connections closed since the start (those beyond `capacity` are no
    /// longer listed).
    pub closed_total: u64,
    /// Open connections, oldest first.
    pub open: Vec<ConnectionRecord>,
    /// The last closed connections, oldest first.
    pub recent: Vec<ConnectionRecord>,
}

/// An open connection as the table holds it: a record's fixed fields
/// inline and its nine optional strings packed into one allocation (as
/// `Option<String>`s they cost nine allocations and 216 B of headers per
/// open connection). The closed ring, bounded, keeps full records.
struct Open {
    started: Instant,
    start_unix_ms: u64,
    direction: &'static str,
    security: &'static str,
    src: (Option<IpAddr>, Option<u16>),
    dst: (Option<IpAddr>, Option<u16>),
    upstream: Option<SocketAddr>,
    hbone_peer: Option<SocketAddr>,
    strings: PackedStrings,
}

/// The record's strings, in this order.
const STRINGS: usize = 9;

/// Up to [`STRINGS`] optional strings in one allocation.
struct PackedStrings {
    text: Box<str>,
    /// Where each string ends in `text`.
    ends: [u32; STRINGS],
    /// Bit `i`: string `i` is present (`Some`, possibly empty).
    present: u16,
}

impl PackedStrings {
    fn pack(fields: [Option<String>; STRINGS]) -> Self {
        let len = fields.iter().flatten().map(String::len).sum();
        let mut text = String::with_capacity(len);
        let mut ends = [0; STRINGS];
        let mut present = 0;
        for (i, f) in fields.iter().enumerate() {
            if let Some(f) = f {
                text.push_str(f);
                present |= 1 << i;
            }
            // A record's strings are names and identities: far below 4 GiB.
            ends[i] = u32::try_from(text.len()).unwrap_or(u32::MAX);
        }
        Self {
            text: text.into_boxed_str(),
            ends,
            present,
        }
    }

    fn get(&self, i: usize) -> Option<String> {
        if self.present & (1 << i) == 0 {
            return None;
        }
        let end = self.ends[i] as usize;
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        Some(self.text.get(start..end).unwrap_or_default().to_string())
    }
}

impl Open {
    fn new(r: ConnectionRecord) -> Self {
        Self {
            started: Instant::now(),
            start_unix_ms: r.start_unix_ms,
            direction: r.direction,
            security: r.security,
            src: (r.src.ip, r.src.port),
            dst: (r.dst.ip, r.dst.port),
            upstream: r.upstream,
            hbone_peer: r.hbone_peer,
            strings: PackedStrings::pack([
                r.src.workload,
                r.src.namespace,
                r.src.identity,
                r.dst.workload,
                r.dst.namespace,
                r.dst.identity,
                r.dst_service,
                r.waypoint,
                r.trace_id,
            ]),
        }
    }

    /// The full record of open connection `id`.
    fn record(&self, id: u64) -> ConnectionRecord {
        let s = &self.strings;
        let endpoint = |(ip, port): (Option<IpAddr>, Option<u16>), first: usize| Endpoint {
            ip,
            port,
            workload: s.get(first),
            namespace: s.get(first + 1),
            identity: s.get(first + 2),
        };
        ConnectionRecord {
            id,
            direction: self.direction,
            state: ConnectionState::Open,
            src: endpoint(self.src, 0),
            dst: endpoint(self.dst, 3),
            dst_service: s.get(6),
            security: self.security,
            upstream: self.upstream,
            hbone_peer: self.hbone_peer,
            waypoint: s.get(7),
            trace_id: s.get(8),
            start_unix_ms: self.start_unix_ms,
            duration_ms: ms(self.started.elapsed()),
            bytes_sent: None,
            bytes_received: None,
            response_flags: "-",
            error: None,
        }
    }
}

struct Inner {
    capacity: usize,
    next_id: AtomicU64,
    closed_total: AtomicU64,
    /// Boxed: a map's table grows by doubling, and a record inline in every
    /// slot (empty ones too) would cost twice its size per open connection.
    open: Vec<Mutex<HashMap<u64, Box<Open>>>>,
    closed: Mutex<VecDeque<ConnectionRecord>>,
}

/// The open and recently closed connections; cloning shares them.
#[derive(Clone)]
pub struct ConnectionTable {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ConnectionTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionTable")
            .field("capacity", &self.inner.capacity)
            .field(
                "closed_total",
                &self.inner.closed_total.load(Ordering::Relaxed),
            )
            .finish_non_exhaustive()
    }
}

impl Default for ConnectionTable {
    fn default() -> Self {
        Self::new(DEFAULT_CAPACITY)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these leaves consistent data (one map
    // or deque operation), so a poisoned lock is used as is.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl ConnectionTable {
    /// A table keeping the last `capacity` closed connections (at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            inner: Arc::new(Inner {
                capacity,
                next_id: AtomicU64::new(1),
                closed_total: AtomicU64::new(0),
                open: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
                closed: Mutex::new(VecDeque::with_capacity(capacity)),
            }),
        }
    }

    fn shard(&self, id: u64) -> &Mutex<HashMap<u64, Box<Open>>> {
        // `id % SHARDS` is below SHARDS, the vector's length.
        &self.inner.open[(id % SHARDS as u64) as usize]
    }

    /// Registers an accepted connection; `record`'s `id`, `state`, start
    /// and outcome fields are set here. Returns its id for [`Self::close`].
    pub fn open(&self, mut record: ConnectionRecord) -> u64 {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        record.start_unix_ms = unix_ms(SystemTime::now());
        lock(self.shard(id)).insert(id, Box::new(Open::new(record)));
        id
    }

    /// Moves connection `id` from the open ones to the closed ring with its
    /// outcome (the oldest closed one leaves when the ring is full). A
    /// second close of the same id does nothing.
    pub fn close(&self, id: u64, outcome: Outcome) {
        let Some(open) = lock(self.shard(id)).remove(&id) else {
            return;
        };
        let mut record = open.record(id);
        record.state = ConnectionState::Closed;
        record.bytes_sent = Some(outcome.bytes_sent);
        record.bytes_received = Some(outcome.bytes_received);
        record.response_flags = outcome.response_flags;
        record.error = outcome.error;
        self.inner.closed_total.fetch_add(1, Ordering::Relaxed);
        let mut ring = lock(&self.inner.closed);
        if ring.len() >= self.inner.capacity {
            ring.pop_front();
        }
        ring.push_back(record);
    }

    /// The open connections (oldest first) and the last closed ones.
    pub fn dump(&self) -> ConnectionsDump {
        let mut open: Vec<ConnectionRecord> = Vec::new();
        for shard in &self.inner.open {
            let shard = lock(shard);
            open.extend(shard.iter().map(|(id, o)| o.record(*id)));
        }
        open.sort_by_key(|r| r.id);
        let recent: Vec<ConnectionRecord> = lock(&self.inner.closed).iter().cloned().collect();
        ConnectionsDump {
            capacity: self.inner.capacity,
            closed_total: self.inner.closed_total.load(Ordering::Relaxed),
            open,
            recent,
        }
    }

    /// Number of open connections.
    pub fn open_len(&self) -> usize {
        self.inner.open.iter().map(|s| lock(s).len()).sum()
    }
}

/// The trace id of a W3C `traceparent` header value
/// (`00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`), if it is one.
pub fn trace_id_of(traceparent: &str) -> Option<u128> {
    let mut parts = traceparent.trim().split('-');
    let (version, trace) = (parts.next()?, parts.next()?);
    if version.len() != 2 || trace.len() != 32 || !trace.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u128::from_str_radix(trace, 16).ok().filter(|t| *t != 0)
}

/// A trace id as `traceparent` writes it.
pub fn format_trace_id(id: u128) -> String {
    format!("{id:032x}")
}

#[cfg(test)]
#[path = "recent_tests.rs"]
mod tests;
