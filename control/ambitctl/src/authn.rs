//! `ambitctl authn tls-check [NS/POD] [SERVICE]`: the effective mTLS mode
//! of each service port, which PeerAuthentication decided it — resolved by
//! the control plane's own precedence (`ambit_control::model::peer_authn::decide`:
//! workload selector > namespace > mesh-wide; UNSET inherits) — and
//! whether live traffic to it is `mutual_tls`, from ztunnels'
//! `istio_tcp_connections_opened_total{reporter="destination"}`.

use std::collections::BTreeMap;

use ambit_config::objects::{MtlsMode, Object, Pod, Service, TargetPort, selector_matches};
use ambit_control::model::Store;
use ambit_control::model::peer_authn::{DecidedBy, Effective, decide};
use serde::Serialize;

use crate::metrics;
use crate::table::Table;

/// One service port (and the workloads behind it that share a decision).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TlsRow {
    /// `name.namespace.svc.cluster.local`.
    pub host: String,
    pub port: u16,
    /// The workload ports the mode applies to (PeerAuthentication's
    /// `portLevelMtls` keys are workload ports).
    pub target_ports: Vec<u16>,
    /// STRICT, PERMISSIVE or DISABLE as written; PERMISSIVE when nothing
    /// sets one.
    pub mode: String,
    /// What ztunnel enforces: STRICT or PERMISSIVE (DISABLE acts as
    /// PERMISSIVE in ambient mode).
    pub effective: String,
    /// `PeerAuthentication ns/name (workload|namespace|mesh)` or `default`.
    pub decided_by: String,
    /// Pods behind the service port with this decision.
    pub workloads: Vec<String>,
    /// Connections ztunnels accepted for it, by security policy.
    pub live_mutual_tls: u64,
    pub live_plaintext: u64,
}

fn mode_name(m: MtlsMode) -> &'static str {
    match m {
        MtlsMode::Strict => "STRICT",
        MtlsMode::Permissive | MtlsMode::Unset => "PERMISSIVE",
        MtlsMode::Disable => "DISABLE",
    }
}

fn effective_name(e: Effective) -> &'static str {
    match e {
        Effective::Strict => "STRICT",
        Effective::Permissive => "PERMISSIVE",
    }
}

fn decided(d: &DecidedBy) -> String {
    match d {
        DecidedBy::Workload(n) => format!("PeerAuthentication {n} (workload)"),
        DecidedBy::Namespace(n) => format!("PeerAuthentication {n} (namespace)"),
        DecidedBy::Mesh(n) => format!("PeerAuthentication {n} (mesh)"),
        DecidedBy::Default => "default (no PeerAuthentication)".into(),
    }
}

fn target_port(svc_port: &ambit_config::objects::ServicePort, pod: &Pod) -> u16 {
    match &svc_port.target_port {
        Some(TargetPort::Number(n)) => *n,
        Some(TargetPort::Name(name)) => pod.container_port(name).unwrap_or(svc_port.port),
        None => svc_port.port,
    }
}

/// Live connection counts per (service host or `ns/pod`) and policy.
fn live(metrics_texts: &[String]) -> BTreeMap<(String, String), u64> {
    let mut out = BTreeMap::new();
    for text in metrics_texts {
        for s in metrics::samples(text, "istio_tcp_connections_opened_total") {
            if s.labels.get("reporter").map(String::as_str) != Some("destination") {
                continue;
            }
            let policy = s
                .labels
                .get("connection_security_policy")
                .cloned()
                .unwrap_or_default();
            let n = s.value.max(0.0) as u64;
            if let Some(svc) = s
                .labels
                .get("destination_service")
                .filter(|x| *x != "unknown")
            {
                *out.entry((svc.clone(), policy.clone())).or_insert(0) += n;
            }
            if let (Some(ns), Some(wl)) = (
                s.labels.get("destination_workload_namespace"),
                s.labels.get("destination_workload"),
            ) {
                *out.entry((format!("{ns}/{wl}"), policy)).or_insert(0) += n;
            }
        }
    }
    out
}

/// The mode of every service port (of `service` — `name`,
/// `name.namespace` or the host — when given) for the pods behind it (only
/// `namespace/pod` when given), with live traffic from `metrics_texts`.
pub fn tls_check(
    objects: Vec<Object>,
    metrics_texts: &[String],
    pod: Option<&str>,
    service: Option<&str>,
) -> Vec<TlsRow> {
    let store = Store::from_objects(objects);
    let live = live(metrics_texts);
    let mut rows = Vec::new();
    for (ns, objs) in store.spaces() {
        for (name, svc) in &objs.services {
            let host = format!("{name}.{ns}.svc.cluster.local");
            if let Some(want) = service
                && !(want == name || want == format!("{name}.{ns}") || want == host)
            {
                continue;
            }
            let pods: Vec<&Pod> = objs
                .pods
                .values()
                .filter(|p| !p.is_terminal() && selects(svc, p))
                .filter(|p| pod.is_none_or(|k| k == format!("{ns}/{}", p.metadata.name)))
                .collect();
            for sp in &svc.spec.ports {
                // Pods sharing (target port, decision) share a row.
                let mut groups: Vec<TlsRow> = Vec::new();
                for p in &pods {
                    let d = decide(&store, ns, &p.metadata.labels);
                    let tp = target_port(sp, p);
                    let (mode, eff) = match d.ports.iter().find(|(port, _, _)| *port == tp) {
                        Some((_, m, e)) if *m != MtlsMode::Unset => (*m, *e),
                        Some((_, _, e)) => (d.mode, *e),
                        None => (d.mode, d.effective),
                    };
                    let row = TlsRow {
                        host: host.clone(),
                        port: sp.port,
                        target_ports: vec![tp],
                        mode: mode_name(mode).into(),
                        effective: effective_name(eff).into(),
                        decided_by: decided(&d.decided_by),
                        workloads: Vec::new(),
                        live_mutual_tls: 0,
                        live_plaintext: 0,
                    };
                    let wl = format!("{ns}/{}", p.metadata.name);
                    match groups.iter_mut().find(|g| {
                        (&g.mode, &g.effective, &g.decided_by)
                            == (&row.mode, &row.effective, &row.decided_by)
                    }) {
                        Some(g) => {
                            g.workloads.push(wl);
                            if !g.target_ports.contains(&tp) {
                                g.target_ports.push(tp);
                            }
                        }
                        None => groups.push(TlsRow {
                            workloads: vec![wl],
                            ..row
                        }),
                    }
                }
                for g in &mut groups {
                    let count = |key: &str, policy: &str| {
                        live.get(&(key.to_string(), policy.to_string()))
                            .copied()
                            .unwrap_or(0)
                    };
                    g.live_mutual_tls = count(&host, "mutual_tls");
                    g.live_plaintext = count(&host, "none");
                    if g.live_mutual_tls + g.live_plaintext == 0 {
                        for w in &g.workloads {
                            g.live_mutual_tls += count(w, "mutual_tls");
                            g.live_plaintext += count(w, "none");
                        }
                    }
                }
                rows.extend(groups);
            }
        }
    }
    rows
}

fn selects(svc: &Service, pod: &Pod) -> bool {
    svc.spec
        .selector
        .as_ref()
        .is_some_and(|s| !s.is_empty() && selector_matches(s, &pod.metadata.labels))
}

/// `mutual_tls (12)`, `none (3) + mutual_tls (9)`, `-`.
fn live_cell(r: &TlsRow) -> String {
    match (r.live_mutual_tls, r.live_plaintext) {
        (0, 0) => "no traffic seen".into(),
        (m, 0) => format!("mutual_tls ({m})"),
        (0, p) => format!("plaintext ({p})"),
        (m, p) => format!("mutual_tls ({m}), plaintext ({p})"),
    }
}

pub fn render(rows: &[TlsRow]) -> String {
    if rows.is_empty() {
        return "No service port matches (a Service with a selector and pods behind it).\n".into();
    }
    let mut t = Table::new(&[
        "HOST:PORT",
        "MODE",
        "ENFORCED",
        "DECIDED BY",
        "WORKLOADS",
        "LIVE",
    ]);
    for r in rows {
        let mut wl = r
            .workloads
            .iter()
            .take(2)
            .cloned()
            .collect::<Vec<_>>()
            .join(",");
        if r.workloads.len() > 2 {
            wl.push_str(&format!(" +{}", r.workloads.len() - 2));
        }
        t.row(vec![
            format!("{}:{}", r.host, r.port),
            r.mode.clone(),
            r.effective.clone(),
            r.decided_by.clone(),
            wl,
            live_cell(r),
        ]);
    }
    t.render()
}
