//! `ambitctl ztunnel-config workloads|services|policies|certificates|connections`:
//! what one ztunnel was told and holds, from its admin `/config_dump`
//! (workloads, services, policies, certificates), and the connections it
//! carried, from its `/metrics` (`istio_tcp_connections_opened_total` and
//! `_closed_total`, by source, destination and security policy).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

use crate::http::{self, HttpError};
use crate::metrics;
use crate::table::Table;

/// The sections of the dump, and connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    Workloads,
    Services,
    Policies,
    Certificates,
    Connections,
}

impl Section {
    pub fn key(self) -> &'static str {
        match self {
            Section::Workloads => "workloads",
            Section::Services => "services",
            Section::Policies => "policies",
            Section::Certificates => "certificates",
            Section::Connections => "connections",
        }
    }
}

/// Why the config could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ZtunnelConfigError {
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error(
        "ztunnel's admin at {addr} sent a /config_dump that {detail}; is this an Ambit or Istio ztunnel?"
    )]
    Decode { addr: SocketAddr, detail: String },
}

/// One section as JSON (`-o json|yaml` print it as is).
pub fn dump_section(
    admin: SocketAddr,
    section: Section,
    timeout: Duration,
) -> Result<Value, ZtunnelConfigError> {
    let body = http::get(admin, "/config_dump", "ztunnel's admin", timeout)?;
    let mut v: Value = serde_json::from_str(&body).map_err(|e| ZtunnelConfigError::Decode {
        addr: admin,
        detail: format!("does not parse ({e})"),
    })?;
    v.get_mut(section.key())
        .map(Value::take)
        .ok_or_else(|| ZtunnelConfigError::Decode {
            addr: admin,
            detail: format!("has no {:?} key", section.key()),
        })
}

fn s<'v>(v: &'v Value, key: &str) -> &'v str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

fn or_dash(x: &str) -> String {
    if x.is_empty() {
        "-".into()
    } else {
        x.to_string()
    }
}

fn list(v: &Value) -> Vec<&Value> {
    match v {
        Value::Array(a) => a.iter().collect(),
        Value::Object(o) => o.values().collect(),
        _ => Vec::new(),
    }
}

fn waypoint(v: &Value) -> String {
    v.get("waypoint")
        .map(|w| s(w, "destination").to_string())
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| "None".into())
}

/// A table of one dump section.
pub fn render_section(section: Section, v: &Value) -> String {
    let mut t = match section {
        Section::Workloads => {
            let mut t = Table::new(&[
                "NAMESPACE",
                "NAME",
                "IP",
                "NODE",
                "WAYPOINT",
                "PROTOCOL",
                "STATUS",
            ]);
            for w in list(v) {
                let ips: Vec<&str> = w
                    .get("workloadIps")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                t.row(vec![
                    or_dash(s(w, "namespace")),
                    or_dash(s(w, "name")),
                    or_dash(&ips.join(",")),
                    or_dash(s(w, "node")),
                    waypoint(w),
                    or_dash(s(w, "protocol")),
                    or_dash(s(w, "status")),
                ]);
            }
            t
        }
        Section::Services => {
            let mut t = Table::new(&[
                "NAMESPACE",
                "NAME",
                "VIPS",
                "PORTS",
                "WAYPOINT",
                "ENDPOINTS",
            ]);
            for x in list(v) {
                let vips: Vec<&str> = x
                    .get("vips")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                let ports: Vec<String> = x
                    .get("ports")
                    .and_then(Value::as_object)
                    .map(|o| o.iter().map(|(k, v)| format!("{k}->{v}")).collect())
                    .unwrap_or_default();
                let eps = x.get("endpoints").map_or(0, |e| list(e).len());
                t.row(vec![
                    or_dash(s(x, "namespace")),
                    or_dash(s(x, "name")),
                    or_dash(&vips.join(",")),
                    or_dash(&ports.join(",")),
                    waypoint(x),
                    eps.to_string(),
                ]);
            }
            t
        }
        Section::Policies => {
            let mut t = Table::new(&["NAMESPACE", "NAME", "ACTION", "SCOPE", "RULES"]);
            for p in list(v) {
                let rules = p.get("rules").map_or(0, |r| list(r).len());
                t.row(vec![
                    or_dash(s(p, "namespace")),
                    or_dash(s(p, "name")),
                    or_dash(s(p, "action")),
                    or_dash(s(p, "scope")),
                    rules.to_string(),
                ]);
            }
            t
        }
        Section::Certificates => {
            let mut t = Table::new(&["IDENTITY", "STATE", "SERIAL", "NOT AFTER"]);
            for c in list(v) {
                let either = |a: &str, b: &str| {
                    let x = s(c, a);
                    or_dash(if x.is_empty() { s(c, b) } else { x })
                };
                t.row(vec![
                    or_dash(s(c, "identity")),
                    or_dash(s(c, "state")),
                    either("serial", "serialNumber"),
                    either("notAfter", "not_after"),
                ]);
            }
            t
        }
        Section::Connections => return String::new(),
    };
    if t.is_empty() {
        t.row(vec!["(none)".into()]);
    }
    t.render()
}

/// Connections one ztunnel carried between a source and a destination
/// with one security policy, as reported by one side.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ConnectionRow {
    /// `source` (the client's ztunnel) or `destination` (the server's).
    pub reporter: String,
    pub source: String,
    pub destination: String,
    /// `mutual_tls` or `none`.
    pub security_policy: String,
    pub opened: u64,
    pub closed: u64,
    pub open: u64,
}

/// `namespace/workload`, `unknown` when the metric does not know.
fn who(l: &BTreeMap<String, String>, ns: &str, wl: &str) -> String {
    let (n, w) = (
        l.get(ns).map_or("unknown", String::as_str),
        l.get(wl).map_or("unknown", String::as_str),
    );
    if n == "unknown" && w == "unknown" {
        "unknown".into()
    } else {
        format!("{n}/{w}")
    }
}

/// Connection counts from a ztunnel's metrics text.
pub fn connections(metrics_text: &str) -> Vec<ConnectionRow> {
    let mut rows: BTreeMap<(String, String, String, String), ConnectionRow> = BTreeMap::new();
    for (metric, opened) in [
        ("istio_tcp_connections_opened_total", true),
        ("istio_tcp_connections_closed_total", false),
    ] {
        for smp in metrics::samples(metrics_text, metric) {
            let l = &smp.labels;
            let dest_service = l.get("destination_service").filter(|s| *s != "unknown");
            let destination = match dest_service {
                Some(svc) => svc.clone(),
                None => who(l, "destination_workload_namespace", "destination_workload"),
            };
            let key = (
                l.get("reporter").cloned().unwrap_or_default(),
                who(l, "source_workload_namespace", "source_workload"),
                destination,
                l.get("connection_security_policy")
                    .cloned()
                    .unwrap_or_default(),
            );
            let row = rows.entry(key.clone()).or_insert_with(|| ConnectionRow {
                reporter: key.0,
                source: key.1,
                destination: key.2,
                security_policy: key.3,
                ..Default::default()
            });
            let n = smp.value.max(0.0) as u64;
            if opened {
                row.opened += n;
            } else {
                row.closed += n;
            }
        }
    }
    rows.into_values()
        .map(|mut r| {
            r.open = r.opened.saturating_sub(r.closed);
            r
        })
        .collect()
}

/// Reads connections from a ztunnel's stats address.
pub fn collect_connections(
    stats: SocketAddr,
    timeout: Duration,
) -> Result<Vec<ConnectionRow>, ZtunnelConfigError> {
    let text = http::get(stats, "/metrics", "ztunnel's metrics", timeout)?;
    Ok(connections(&text))
}

pub fn render_connections(rows: &[ConnectionRow]) -> String {
    let mut t = Table::new(&[
        "REPORTER",
        "SOURCE",
        "DESTINATION",
        "SECURITY",
        "OPENED",
        "CLOSED",
        "OPEN",
    ]);
    for r in rows {
        t.row(vec![
            r.reporter.clone(),
            r.source.clone(),
            r.destination.clone(),
            r.security_policy.clone(),
            r.opened.to_string(),
            r.closed.to_string(),
            r.open.to_string(),
        ]);
    }
    if t.is_empty() {
        return "No connections recorded yet.\n".into();
    }
    t.render()
}
