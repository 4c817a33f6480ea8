//! `ambitctl proxy-status`: every proxy connected to the control plane —
//! ztunnels, waypoints, sidecars — with, per resource type, the version
//! last sent and ACKed and whether it is SYNCED, STALE (sent, not yet
//! ACKed) or NACKed (with the proxy's error). Read from the control
//! plane's monitoring server: `/debug/connections`, `/debug/nacks`,
//! `/debug/push_status` (control/src/debug.rs, control/src/xds/status.rs).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::http::{self, HttpError};
use crate::table::Table;

/// Why the status could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ProxyStatusError {
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error(
        "the control plane at {addr} sent {path} that does not parse ({detail}); is this an Ambit control plane of the same version?"
    )]
    Decode {
        addr: SocketAddr,
        path: &'static str,
        detail: String,
    },
}

/// One type of one proxy, as the registry reports it.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct TypeStatus {
    pub resources_held: usize,
    pub last_nonce_sent: String,
    pub last_nonce_acked: String,
    pub last_version_sent: String,
    pub last_version_acked: String,
    pub last_nack: String,
    pub acks: u64,
    pub nacks: u64,
    pub pushes: u64,
}

/// One connected proxy, as the registry reports it.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct Connection {
    pub connection: u64,
    pub node_id: String,
    pub kind: String,
    pub peer: String,
    pub protocol: String,
    pub connected_at_unix: u64,
    pub last_snapshot_seq: u64,
    pub types: BTreeMap<String, TypeStatus>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct PushStatus {
    seq: u64,
}

/// The sync state of one type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Sync {
    /// Nothing sent yet.
    NotSent,
    /// The last response is ACKed.
    Synced,
    /// The last response is not ACKed yet.
    Stale,
    /// The proxy rejected the last response.
    Nack,
}

impl Sync {
    pub fn as_str(self) -> &'static str {
        match self {
            Sync::NotSent => "NOT SENT",
            Sync::Synced => "SYNCED",
            Sync::Stale => "STALE",
            Sync::Nack => "NACK",
        }
    }

    fn of(t: &TypeStatus) -> Sync {
        if !t.last_nack.is_empty() {
            Sync::Nack
        } else if t.last_nonce_sent.is_empty() {
            Sync::NotSent
        } else if t.last_nonce_sent == t.last_nonce_acked {
            Sync::Synced
        } else {
            Sync::Stale
        }
    }
}

/// One type of one proxy, for output.
#[derive(Debug, Clone, Serialize)]
pub struct TypeRow {
    /// Short name: `address`, `authorization`, `cluster`, `listener`, ...
    #[serde(rename = "type")]
    pub type_: String,
    pub type_url: String,
    pub status: Sync,
    pub version_sent: String,
    pub version_acked: String,
    pub resources: usize,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub nack: String,
}

/// One proxy, for output.
#[derive(Debug, Clone, Serialize)]
pub struct ProxyRow {
    /// `pod.namespace` (waypoint, sidecar) or the node (ztunnel), from the
    /// node id.
    pub name: String,
    pub kind: String,
    pub node_id: String,
    pub peer: String,
    pub protocol: String,
    pub types: Vec<TypeRow>,
}

impl ProxyRow {
    /// SYNCED only when every type is.
    pub fn synced(&self) -> bool {
        self.types.iter().all(|t| t.status == Sync::Synced)
    }
}

/// Everything `proxy-status` shows.
#[derive(Debug, Clone, Serialize)]
pub struct ProxyStatus {
    pub control_plane: String,
    /// The control plane's current snapshot.
    pub snapshot: u64,
    pub proxies: Vec<ProxyRow>,
}

/// `type.googleapis.com/envoy.config.cluster.v3.Cluster` → `cluster`.
pub fn short_type(url: &str) -> String {
    url.rsplit(['.', '/'])
        .next()
        .unwrap_or(url)
        .to_ascii_lowercase()
}

/// The name part of a node id `KIND~IP~NAME~DOMAIN`.
fn proxy_name(node_id: &str) -> String {
    node_id
        .split('~')
        .nth(2)
        .filter(|s| !s.is_empty())
        .unwrap_or(node_id)
        .to_string()
}

/// Builds the rows from the registry's view.
pub fn rows(connections: Vec<Connection>) -> Vec<ProxyRow> {
    let mut out: Vec<ProxyRow> = connections
        .into_iter()
        .map(|c| ProxyRow {
            name: proxy_name(&c.node_id),
            kind: if c.kind.is_empty() {
                "unknown".into()
            } else {
                c.kind
            },
            types: c
                .types
                .iter()
                .map(|(url, t)| TypeRow {
                    type_: short_type(url),
                    type_url: url.clone(),
                    status: Sync::of(t),
                    version_sent: t.last_version_sent.clone(),
                    version_acked: t.last_version_acked.clone(),
                    resources: t.resources_held,
                    nack: t.last_nack.clone(),
                })
                .collect(),
            node_id: c.node_id,
            peer: c.peer,
            protocol: c.protocol,
        })
        .collect();
    out.sort_by(|a, b| (&a.kind, &a.name, &a.peer).cmp(&(&b.kind, &b.name, &b.peer)));
    out
}

fn fetch<T: serde::de::DeserializeOwned>(
    addr: SocketAddr,
    path: &'static str,
    timeout: Duration,
) -> Result<T, ProxyStatusError> {
    let body = http::get(addr, path, "the control plane's monitoring server", timeout)?;
    serde_json::from_str(&body).map_err(|e| ProxyStatusError::Decode {
        addr,
        path,
        detail: e.to_string(),
    })
}

/// Reads the status from the control plane's monitoring address.
pub fn collect(addr: SocketAddr, timeout: Duration) -> Result<ProxyStatus, ProxyStatusError> {
    let push: PushStatus = fetch(addr, "/debug/push_status", timeout)?;
    let conns: Vec<Connection> = fetch(addr, "/debug/connections", timeout)?;
    Ok(ProxyStatus {
        control_plane: addr.to_string(),
        snapshot: push.seq,
        proxies: rows(conns),
    })
}

/// `SYNCED (7)`, `STALE (sent 8, acked 7)`, `NACK (8)`.
fn cell(t: &TypeRow) -> String {
    let v = |s: &str| {
        if s.is_empty() {
            "-".to_string()
        } else {
            s.to_string()
        }
    };
    match t.status {
        Sync::Synced => format!("SYNCED ({})", v(&t.version_acked)),
        Sync::Stale => format!(
            "STALE (sent {}, acked {})",
            v(&t.version_sent),
            v(&t.version_acked)
        ),
        Sync::Nack => format!("NACK ({})", v(&t.version_sent)),
        Sync::NotSent => "NOT SENT".into(),
    }
}

/// One row per proxy, one column per resource type; NACK errors below.
pub fn render(s: &ProxyStatus) -> String {
    if s.proxies.is_empty() {
        return format!(
            "No proxies are connected to the control plane at {} (snapshot {}).\n",
            s.control_plane, s.snapshot
        );
    }
    let types: BTreeSet<&str> = s
        .proxies
        .iter()
        .flat_map(|p| p.types.iter().map(|t| t.type_.as_str()))
        .collect();
    let mut header = vec!["NAME", "KIND", "PEER"];
    let upper: Vec<String> = types.iter().map(|t| t.to_ascii_uppercase()).collect();
    header.extend(upper.iter().map(String::as_str));
    let mut t = Table::new(&header);
    for p in &s.proxies {
        let mut row = vec![p.name.clone(), p.kind.clone(), p.peer.clone()];
        for ty in &types {
            row.push(
                p.types
                    .iter()
                    .find(|t| t.type_ == *ty)
                    .map_or_else(|| "-".into(), cell),
            );
        }
        t.row(row);
    }
    let mut out = t.render();
    for p in &s.proxies {
        for ty in p.types.iter().filter(|t| t.status == Sync::Nack) {
            out.push_str(&format!(
                "\nNACK {} {} ({}): {}\n",
                p.name, ty.type_, p.node_id, ty.nack
            ));
        }
    }
    out.push_str(&format!(
        "\n{} proxies; control plane {} at snapshot {}.\n",
        s.proxies.len(),
        s.control_plane,
        s.snapshot
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sync_states() {
        let mut t = TypeStatus::default();
        assert_eq!(Sync::of(&t), Sync::NotSent);
        t.last_nonce_sent = "1-1".into();
        assert_eq!(Sync::of(&t), Sync::Stale);
        t.last_nonce_acked = "1-1".into();
        assert_eq!(Sync::of(&t), Sync::Synced);
        t.last_nack = "bad".into();
        assert_eq!(Sync::of(&t), Sync::Nack);
        assert_eq!(
            short_type("type.googleapis.com/envoy.config.cluster.v3.Cluster"),
            "cluster"
        );
        assert_eq!(
            proxy_name("router~10.0.0.1~wp-0.shop~shop.svc.cluster.local"),
            "wp-0.shop"
        );
    }
}
