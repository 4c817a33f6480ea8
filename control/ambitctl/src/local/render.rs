//! Human-readable output of `local up` and `local status`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::status::{Connection, Mesh, PodStatus, ProcStatus, Report, Status};

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

/// What the labels say, for people.
fn labels_say(p: &PodStatus) -> String {
    if !p.in_config {
        return "the pod is no longer in the config".into();
    }
    match (p.ambient, p.dataplane_mode.as_str()) {
        (_, "") => "no dataplane-mode label".into(),
        (true, _) => "labels say ambient".into(),
        (false, mode) => format!("labels say {mode}"),
    }
}

/// The MESH column: whether the pod is in the mesh, from the live sources.
fn mesh(p: &PodStatus) -> String {
    match p.mesh {
        Mesh::EnrolledNotServed => {
            "ENROLLED, NOT SERVED (redirected, ztunnel has no listeners; agent retrying)".into()
        }
        Mesh::Enrolled => "enrolled".into(),
        Mesh::Sidecar => "sidecar".into(),
        Mesh::NotEnrolled if !p.in_config => "no (not in the config)".into(),
        Mesh::NotEnrolled => "no".into(),
        Mesh::Disagree => {
            let agent = match p.enrolled {
                Some(true) if p.unserved => "node agent: enrolled, not served",
                Some(true) => "node agent: enrolled",
                Some(false) => "node agent: not enrolled",
                None => "node agent: no record",
            };
            let mut by: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for (node, proto) in &p.ztunnels {
                by.entry(proto.as_deref().unwrap_or("not listed"))
                    .or_default()
                    .push(node);
            }
            let ztunnels = match by.len() {
                0 => "ztunnels: no answer".to_string(),
                1 => format!("ztunnels: {}", by.keys().next().copied().unwrap_or("-")),
                _ => format!(
                    "ztunnels: {}",
                    by.iter()
                        .map(|(proto, nodes)| format!("{proto} on {}", nodes.join(",")))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            format!("DISAGREE ({}; {agent}; {ztunnels})", labels_say(p))
        }
    }
}

/// `namespace/pod ip:port`, or the address alone.
fn endpoint(workload: &str, addr: &str) -> String {
    if workload.is_empty() {
        addr.to_string()
    } else {
        format!("{workload} {addr}")
    }
}

/// `15:11:52.570` of an RFC 3339 time.
fn time_of_day(rfc3339: &str) -> &str {
    rfc3339
        .split_once('T')
        .map_or(rfc3339, |(_, t)| t.trim_end_matches('Z'))
}

fn bytes(n: u64) -> String {
    match n {
        0..1_000 => format!("{n} B"),
        1_000..1_000_000 => format!("{:.1} kB", n as f64 / 1e3),
        _ => format!("{:.1} MB", n as f64 / 1e6),
    }
}

/// One row per application connection.
fn connections(conns: &[Connection]) -> String {
    let rows: Vec<Vec<String>> = conns
        .iter()
        .map(|c| {
            let mut server = match &c.dst_service {
                Some(svc) => format!("{svc} {}", c.dst_addr),
                None => c.dst_addr.clone(),
            };
            // The peer of a waypoint-bound connection is the waypoint: say
            // so once, after the destination.
            let via = c
                .waypoint
                .as_ref()
                .filter(|w| !c.src_workload.ends_with(&format!("/{}", pod_of(w))));
            let dst_workload = if via.is_some() { "" } else { &c.dst_workload };
            match (&c.delivered_to, dst_workload.is_empty()) {
                (Some(to), false) => {
                    let _ = write!(server, " → {dst_workload} {to}");
                }
                (Some(to), true) => {
                    let _ = write!(server, " → {to}");
                }
                (None, false) => server = endpoint(dst_workload, &server),
                (None, true) => {}
            }
            if let Some(w) = via {
                let _ = write!(server, " via waypoint {w}");
            }
            let client = report_of(c, "outbound");
            let ms = c.reported_by.first().map_or(0, |r| r.duration_ms);
            let outcome = if c.open {
                format!("open {}", since(ms))
            } else if c.response_flags == "-" {
                let moved = client.or(c.reported_by.first()).map_or(0, |r| {
                    r.bytes_sent.unwrap_or(0) + r.bytes_received.unwrap_or(0)
                });
                format!("ok, {}, {ms} ms", bytes(moved))
            } else {
                match &c.error {
                    Some(e) => format!("{} ({})", c.response_flags, shorten(e, 72)),
                    None => c.response_flags.clone(),
                }
            };
            let seen: Vec<String> = c
                .reported_by
                .iter()
                .map(|r| match r.hbone_peer {
                    Some(t) => format!("{} {} #{} (HBONE from {t})", r.node, r.direction, r.id),
                    None => format!("{} {} #{}", r.node, r.direction, r.id),
                })
                .collect();
            vec![
                time_of_day(&c.time).to_string(),
                endpoint(&c.src_workload, &c.src_addr),
                server,
                if c.mtls { "mTLS" } else { "plaintext" }.to_string(),
                outcome,
                seen.join(", "),
            ]
        })
        .collect();
    table(
        &[
            "STARTED (UTC)",
            "CLIENT",
            "SERVER",
            "SECURITY",
            "OUTCOME",
            "SEEN BY",
        ],
        &rows,
    )
}

/// The pod of a `namespace/pod` name.
fn pod_of(name: &str) -> &str {
    name.rsplit_once('/').map_or(name, |(_, p)| p)
}

/// A duration so far: `850 ms`, `12.3 s`, `4 min`.
fn since(ms: u64) -> String {
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..120_000 => format!("{:.1} s", ms as f64 / 1e3),
        _ => format!("{} min", ms / 60_000),
    }
}

/// `text` cut to `max` characters with `…` (the JSON output has it whole).
fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

fn report_of<'c>(c: &'c Connection, direction: &str) -> Option<&'c Report> {
    c.reported_by.iter().find(|r| r.direction == direction)
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
    if s.pods.iter().any(|p| p.mesh == Mesh::Disagree) {
        out.push_str(
            "DISAGREE: the config's labels, the node agent and the ztunnels do not agree yet; \
             a label change takes a second or two to apply everywhere (if it stays, see the \
             node agent's and the control plane's logs).\n",
        );
    }
    for n in &s.nodes {
        if let Some(e) = &n.admin_error {
            let _ = writeln!(
                out,
                "ztunnel of {}: admin not answering ({e}); its view of the pods and its connections are missing.",
                n.name
            );
        }
    }
    if !s.config_errors.is_empty() {
        let _ = writeln!(
            out,
            "The config has {} rejected document(s) (their last good version keeps serving; `ambitctl analyze --local` explains):",
            s.config_errors.len()
        );
        for e in &s.config_errors {
            let _ = writeln!(out, "  {e}");
        }
    }
    out.push_str(&waypoints(s));
    out.push_str(&sidecars(s));
    out
}

/// The sidecar pods' agents (with Envoy) and whether they are ready.
fn sidecars(s: &Status) -> String {
    if s.sidecars.is_empty() {
        return String::new();
    }
    let rows: Vec<Vec<String>> = s
        .sidecars
        .iter()
        .map(|c| {
            let agent = match (c.agent_pid, c.agent_running) {
                (Some(pid), true) => format!("{pid} running"),
                (Some(pid), false) => format!("{pid} EXITED"),
                (None, _) => "not started".into(),
            };
            let mut ready = if c.ready {
                "ready".to_string()
            } else {
                format!("NOT READY ({})", c.readiness)
            };
            if !c.relay_running {
                ready.push_str(", RELAY TO THE CONTROL PLANE NOT RUNNING");
            }
            vec![
                c.pod.clone(),
                c.node.clone(),
                c.ip.to_string(),
                agent,
                ready,
            ]
        })
        .collect();
    format!(
        "\n{}",
        table(
            &["SIDECAR POD", "NODE", "IP", "AGENT + ENVOY", "READINESS"],
            &rows
        )
    )
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
        out.push_str("No connections yet (the ztunnels' /connections are empty).\n");
    } else {
        out.push_str(
            "Connections apps made (each ztunnel's /connections; CLIENT is the app's own socket, \
             one row per connection even when many share one HBONE tunnel; `-o json` has every \
             field):\n",
        );
        out.push_str(&connections(&s.connections));
        let portless = s
            .connections
            .iter()
            .any(|c| c.reported_by.iter().all(|r| r.hbone_peer.is_some()));
        if portless {
            out.push_str(
                "A CLIENT without a port was seen only by the server's ztunnel, over HBONE, which \
                 does not carry the client's port; #N is the connection's id in that ztunnel's \
                 /connections.\n",
            );
        }
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
        "\nLogs: {} (control.log, agent-<node>.log, ztunnel-<node>.log, pod-<namespace>-<pod>.log, waypoints.log, waypoint-<namespace>-<pod>.log, sidecar-<namespace>-<pod>.log)",
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
        && let Some(p) = s
            .pods
            .iter()
            .find(|p| !p.ambient && p.mesh != Mesh::Sidecar)
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
