//! What each node-local listener serves, one line per endpoint: the index
//! at `/` and the hint of a 404 come from this table, and a test checks
//! that every listed path is routed.

use super::Listener;

/// One endpoint of a listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// Methods it answers.
    pub methods: &'static str,
    pub path: &'static str,
    /// What it shows or does, one line.
    pub what: &'static str,
}

const fn ep(methods: &'static str, path: &'static str, what: &'static str) -> Endpoint {
    Endpoint {
        methods,
        path,
        what,
    }
}

const ADMIN: &[Endpoint] = &[
    ep("GET", "/", "this list"),
    ep(
        "GET",
        "/config_dump",
        "the xDS state this ztunnel holds: workloads, services, policies, and its certificates (JSON)",
    ),
    ep(
        "GET",
        "/connections",
        "open connections and the last closed ones: workloads, addresses, identities, direction, bytes, duration, outcome (JSON)",
    ),
    ep(
        "GET, POST",
        "/logging",
        "the log filter; POST /logging?level=info,ambit_ztunnel::xds=debug changes it",
    ),
    ep(
        "POST",
        "/quitquitquit",
        "shuts this ztunnel down gracefully",
    ),
];

const STATS: &[Endpoint] = &[
    ep("GET", "/", "this list"),
    ep(
        "GET",
        "/metrics",
        "Prometheus metrics: istio_tcp_* connections and bytes, xDS, certificates, denials",
    ),
    ep(
        "GET",
        "/stats/prometheus",
        "the same as /metrics (Istio's path)",
    ),
];

const READINESS: &[Endpoint] = &[
    ep("GET", "/", "this list"),
    ep(
        "GET",
        "/healthz/ready",
        "200 once the first xDS sync is done and every pod handed over is served; 503 naming why not",
    ),
];

/// The endpoints of `listener`.
pub(crate) fn endpoints(listener: Listener) -> &'static [Endpoint] {
    match listener {
        Listener::Admin => ADMIN,
        Listener::Stats => STATS,
        Listener::Readiness => READINESS,
    }
}

/// The other listeners, for the index's last lines.
fn elsewhere(listener: Listener) -> String {
    let mut out = String::new();
    for other in [Listener::Admin, Listener::Stats, Listener::Readiness] {
        if other == listener {
            continue;
        }
        let paths: Vec<&str> = endpoints(other)
            .iter()
            .map(|e| e.path)
            .filter(|p| *p != "/")
            .collect();
        out.push_str(&format!(
            "  {} listener ({}): {}\n",
            other.name(),
            other.default_port_hint(),
            paths.join(" ")
        ));
    }
    out
}

/// The plain-text index of `listener`.
pub(crate) fn render(listener: Listener) -> String {
    let list = endpoints(listener);
    let width = list.iter().map(|e| e.path.len()).max().unwrap_or(0);
    let mwidth = list.iter().map(|e| e.methods.len()).max().unwrap_or(0);
    let mut out = format!("ztunnel {} listener: endpoints\n\n", listener.name());
    for e in list {
        out.push_str(&format!(
            "{:<mwidth$}  {:<width$}  {}\n",
            e.methods, e.path, e.what
        ));
    }
    out.push_str("\nOn the other listeners:\n");
    out.push_str(&elsewhere(listener));
    out
}
