//! Human-readable output of `local up` and `local status`.

use std::fmt::Write as _;

use super::status::{Connection, PodStatus, ProcStatus, Status};

/// Left-aligned columns, two spaces apart.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(c.chars().count());
            }
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let mut l = String::new();
        for (i, c) in cells.iter().enumerate() {
            let w = widths.get(i).copied().unwrap_or(0);
            if i + 1 == cells.len() {
                l.push_str(c);
            } else {
                let _ = write!(l, "{c:<w$}  ");
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(header.to_vec(), &mut out);
    for r in rows {
        line(r.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

fn proc(p: &ProcStatus) -> String {
    match (p.pid, p.alive) {
        (Some(pid), true) => format!("{pid} running"),
        (Some(pid), false) => format!("{pid} EXITED"),
        (None, _) => "not started".into(),
    }
}

fn mesh(p: &PodStatus) -> String {
    match (p.enrolled, p.ambient) {
        (Some(true), _) if p.unserved => {
            "ENROLLED, NOT SERVED (redirected, ztunnel has no listeners; agent retrying)".into()
        }
        (Some(true), _) => "enrolled".into(),
        (_, true) => "NOT ENROLLED (labels say ambient)".into(),
        (Some(false), false) | (None, false) => "no".into(),
    }
}

fn endpoint(workload: &str, addr: &str) -> String {
    if workload.is_empty() || workload == "-" {
        addr.to_string()
    } else {
        format!("{workload} {addr}")
    }
}

/// `src → dst  mTLS|plaintext  flags` rows.
fn connections(conns: &[Connection]) -> String {
    let rows: Vec<Vec<String>> = conns
        .iter()
        .map(|c| {
            let mut flags = c.response_flags.clone();
            if !c.error.is_empty() && c.error != "-" {
                let _ = write!(flags, " ({})", c.error);
            }
            vec![
                c.node.clone(),
                c.direction.clone(),
                format!(
                    "{} → {}",
                    endpoint(&c.src_workload, &c.src_addr),
                    endpoint(&c.dst_workload, &c.dst_addr)
                ),
                if c.mtls { "mTLS" } else { "plaintext" }.to_string(),
                flags,
            ]
        })
        .collect();
    table(
        &["NODE", "DIRECTION", "CONNECTION", "SECURITY", "FLAGS"],
        &rows,
    )
}

/// The nodes and pods tables, shared by `up` and `status`.
fn body(s: &Status) -> String {
    let mut out = String::new();
    let c = &s.control;
    let _ = writeln!(
        out,
        "control plane: {}{}  xDS/CA https://{}  monitoring http://{}\n",
        proc(&c.process),
        if c.ready { ", ready" } else { ", NOT READY" },
        c.xds_tls_addr.as_deref().unwrap_or("-"),
        c.monitoring_addr.as_deref().unwrap_or("-"),
    );
    let rows: Vec<Vec<String>> = s
        .nodes
        .iter()
        .map(|n| {
            let opened = if n.connections_opened.is_empty() {
                "-".to_string()
            } else {
                n.connections_opened
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            vec![
                n.name.clone(),
                n.lan_ip.to_string(),
                n.subnet.clone(),
                proc(&n.agent),
                format!(
                    "{}{}",
                    proc(&n.ztunnel),
                    if n.ztunnel_ready {
                        ", ready"
                    } else {
                        ", NOT READY"
                    }
                ),
                opened,
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "NODE",
            "LAN IP",
            "POD SUBNET",
            "NODE AGENT",
            "ZTUNNEL",
            "CONNECTIONS OPENED (by security policy)",
        ],
        &rows,
    ));
    out.push('\n');
    let rows: Vec<Vec<String>> = s
        .pods
        .iter()
        .map(|p| {
            let app = match (&p.app, p.app_running) {
                (Some(a), Some(true)) => format!("ambit-demo {a}"),
                (Some(a), _) => format!("ambit-demo {a} (EXITED)"),
                (None, _) => "-".into(),
            };
            vec![
                format!("{}/{}", p.namespace, p.name),
                p.node.clone(),
                p.ip.to_string(),
                mesh(p),
                app,
            ]
        })
        .collect();
    out.push_str(&table(&["POD", "NODE", "IP", "MESH", "APP"], &rows));
    out.push_str(&waypoints(s));
    out
}

/// The waypoint pods, and the requests per route through each.
fn waypoints(s: &Status) -> String {
    let mut out = String::new();
    if s.waypoints.is_empty() && s.waypoints_skipped.is_empty() {
        return out;
    }
    out.push('\n');
    let mut rows: Vec<Vec<String>> = s
        .waypoints
        .iter()
        .map(|w| {
            let agent = match (w.agent_pid, w.agent_running) {
                (Some(pid), true) => format!("{pid} running"),
                (Some(pid), false) => format!("{pid} EXITED"),
                (None, _) => "not started".into(),
            };
            let mut ready = if w.ready {
                "ready".to_string()
            } else {
                format!("NOT READY ({})", w.readiness)
            };
            if w.restarts > 0 {
                let _ = write!(ready, ", {} restarts", w.restarts);
            }
            vec![
                w.gateway.to_string(),
                w.pod.clone(),
                w.node.clone(),
                w.ip.to_string(),
                agent,
                ready,
            ]
        })
        .collect();
    for k in &s.waypoints_skipped {
        rows.push(vec![
            k.gateway.clone(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            format!("NO POD: {}", k.why),
        ]);
    }
    out.push_str(&table(
        &[
            "WAYPOINT",
            "POD",
            "NODE",
            "IP",
            "AGENT + ENVOY",
            "READINESS",
        ],
        &rows,
    ));
    let rows: Vec<Vec<String>> = s
        .waypoints
        .iter()
        .flat_map(|w| {
            w.routes.iter().map(move |r| {
                vec![
                    w.gateway.to_string(),
                    r.destination.clone(),
                    r.match_.clone(),
                    if r.subset.is_empty() {
                        "-".into()
                    } else {
                        r.subset.clone()
                    },
                    format!("{}%", r.weight),
                    r.requests.to_string(),
                    r.ok_2xx.to_string(),
                    r.error_5xx.to_string(),
                    r.retries.to_string(),
                    ms(r.p50_ms),
                    ms(r.p99_ms),
                ]
            })
        })
        .collect();
    if !rows.is_empty() {
        let sources: std::collections::BTreeSet<&str> = s
            .waypoints
            .iter()
            .flat_map(|w| w.routes.iter())
            .map(|r| r.source.as_str())
            .collect();
        let source = sources.into_iter().collect::<Vec<_>>().join(" and ");
        let _ = writeln!(
            out,
            "\nRequests per route through waypoints (since each waypoint started; {source}):"
        );
        out.push_str(&table(
            &[
                "WAYPOINT", "ROUTE", "MATCH", "SUBSET", "WEIGHT", "REQUESTS", "2XX", "5XX",
                "RETRIES", "P50", "P99",
            ],
            &rows,
        ));
    }
    let denials: Vec<Vec<String>> = s
        .waypoints
        .iter()
        .flat_map(|w| {
            w.denials.iter().map(move |d| {
                vec![
                    w.gateway.to_string(),
                    d.policy.clone(),
                    d.destination_service.clone(),
                    d.source_principal.clone(),
                    d.requests.to_string(),
                ]
            })
        })
        .collect();
    if !denials.is_empty() {
        let _ = writeln!(
            out,
            "\nRequests denied by L7 authorization (policy `none`: no ALLOW policy matched):"
        );
        out.push_str(&table(
            &["WAYPOINT", "POLICY", "SERVICE", "SOURCE", "DENIED"],
            &denials,
        ));
    }
    out
}

/// A duration in milliseconds, or `-`.
fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_string(), |v| format!("{v:.1} ms"))
}

/// `local status`, for people.
pub fn status(s: &Status) -> String {
    let mut out = format!(
        "Local cluster {} ({:?}): config {}, state {}\n",
        s.name,
        s.phase,
        s.config_dir.display(),
        s.state_dir.display()
    );
    out.push_str(&body(s));
    out.push('\n');
    if s.connections.is_empty() {
        out.push_str("No connections yet (ztunnel access logs are empty).\n");
    } else {
        out.push_str("Recent connections (ztunnel access logs):\n");
        out.push_str(&connections(&s.connections));
    }
    let _ = writeln!(out, "\nLogs: {}", s.log_dir.display());
    out
}

/// How `local up`'s hints name the cluster and the command.
pub struct Hints<'a> {
    /// The command that runs this `ambitctl` as the user typed it
    /// (`ambitctl` when that is the one on PATH).
    pub ambitctl: &'a str,
    /// The directory the served working copy was made from, if any.
    pub source_dir: Option<&'a std::path::Path>,
}

/// What `local up` prints once the cluster is ready.
pub fn up_summary(s: &Status, app_args: &[(String, Vec<String>)], hints: &Hints) -> String {
    let flag = if s.name == super::DEFAULT_NAME {
        String::new()
    } else {
        format!(" --name {}", s.name)
    };
    let ctl = hints.ambitctl;
    let mut out = format!(
        "Local cluster {} is up: {} nodes, {} pods.\n",
        s.name,
        s.nodes.len(),
        s.pods.len(),
    );
    match hints.source_dir {
        Some(src) => {
            let _ = writeln!(
                out,
                "Config: a working copy of {} in {}: edit the files there, changes apply live; \
                 {src} stays as it is. `{ctl} local down{flag} --keep-config DIR` saves the copy.\n",
                src.display(),
                s.config_dir.display(),
                src = src.display(),
            );
        }
        None => {
            let _ = writeln!(
                out,
                "Config: {} (served in place: edits apply live).\n",
                s.config_dir.display()
            );
        }
    }
    out.push_str(&body(s));
    let _ = writeln!(
        out,
        "\nLogs: {} (control.log, agent-<node>.log, ztunnel-<node>.log, pod-<namespace>-<pod>.log, waypoints.log, waypoint-<namespace>-<pod>.log)",
        s.log_dir.display()
    );
    out.push_str("\nNext:\n");
    let _ = writeln!(
        out,
        "  {ctl} local status{flag}          # nodes, pods, recent connections and whether they were mTLS"
    );
    for line in exec_examples(s, app_args) {
        let _ = writeln!(out, "  {ctl} local exec{flag} {line}");
    }
    if let Some(w) = s.waypoints.first() {
        let _ = writeln!(
            out,
            "  {ctl} proxy-config routes{flag} {}   # the routes waypoint {} runs; edit the VirtualService weights and `local status` shows them",
            w.pod, w.gateway
        );
    }
    let _ = writeln!(
        out,
        "  {ctl} local down{flag}            # removes every process, namespace and file"
    );
    out
}

/// `POD -- CMD  # why` lines: a mesh pod making one of its own calls (or
/// calling a mesh server), and a pod outside the mesh calling that server.
fn exec_examples(s: &Status, app_args: &[(String, Vec<String>)]) -> Vec<String> {
    let ambient = |key: &str| s.pod(key).is_some_and(|p| p.ambient);
    let server = app_args.iter().find_map(|(key, args)| {
        let http = args
            .windows(2)
            .find(|w| w[0] == "--http")
            .and_then(|w| w[1].parse::<u16>().ok())?;
        let pod = s.pod(key).filter(|p| p.ambient)?;
        Some((key.clone(), format!("http://{}:{http}/", pod.ip)))
    });
    // A periodic caller (`--call`) is an entry point; else a forwarder.
    let client = ["--call", "--forward"].iter().find_map(|flag| {
        app_args.iter().find_map(|(key, args)| {
            let url = args
                .windows(2)
                .find(|w| w[0] == *flag)
                .map(|w| w[1].clone())?;
            ambient(key).then(|| (key.clone(), url))
        })
    });
    let mut out = Vec::new();
    let call = |from: &str, url: &str, why: &str| {
        format!("{from} -- ambit-demo --call {url} --once   # {why}")
    };
    match (&client, &server) {
        (Some((from, url)), _) => out.push(call(from, url, "one call, over mTLS")),
        (None, Some((to, url))) => {
            let from = s
                .pods
                .iter()
                .map(|p| format!("{}/{}", p.namespace, p.name))
                .find(|k| ambient(k) && k != to);
            if let Some(from) = from {
                out.push(call(&from, url, "one call, over mTLS"));
            }
        }
        (None, None) => {}
    }
    if let Some((_, url)) = &server
        && let Some(p) = s.pods.iter().find(|p| !p.ambient)
    {
        let from = format!("{}/{}", p.namespace, p.name);
        out.push(call(
            &from,
            url,
            "plaintext from outside the mesh (refused where STRICT mTLS applies)",
        ));
    }
    if out.is_empty()
        && let Some(p) = s.pods.first()
    {
        out.push(format!("{}/{} -- ip addr", p.namespace, p.name));
    }
    out
}
