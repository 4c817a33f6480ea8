//! Istio's request metrics as Prometheus reads them from a waypoint.
//!
//! The control plane configures Envoy's `stats` access logger to count
//! every request with Istio's metric and label names (see the control
//! plane's `model/waypoint/telemetry.rs`). Envoy prints such stats with its
//! own `envoy_` prefix and cannot split the caller's `baggage` into labels,
//! so the agent finishes the job when it serves Envoy's stats on 15020:
//!
//! * `envoy_istio_*` becomes `istio_*` and `envoy_ambit_*` becomes `ambit_*`;
//! * the `source_baggage` label becomes `source_workload`,
//!   `source_workload_namespace`, `source_app`, `source_version` (and
//!   `source_cluster`);
//! * a sidecar's series (`reporter="source"` or `"destination"`) get the
//!   reporting pod's own labels (`source_*` or `destination_*`): the
//!   control plane shares one outbound configuration among a namespace's
//!   sidecars, so only the agent knows which pod it is;
//! * empty workload labels read `unknown`, as Istio's do;
//! * `ambit_requests_denied_total` keeps only the requests an RBAC filter
//!   refused, its `policy` label naming the policy (`<namespace>/<name>`,
//!   or `none` when no ALLOW policy matched).
//!
//! Everything else passes through unchanged. The rewrite is a pure
//! function of the text, run once per scrape.

/// Envoy's prefix on the stats it prints.
const ENVOY_PREFIX: &str = "envoy_";
/// Scopes whose stats lose Envoy's prefix.
const SCOPES: [&str; 2] = ["istio_", "ambit_"];
/// The denial counter.
const DENIED: &str = "ambit_requests_denied_total";
/// Envoy's response-code details of an RBAC denial.
const RBAC_DENIED: &str = "rbac_access_denied_matched_policy[";
/// Labels Istio reports as `unknown` when empty.
const UNKNOWN_WHEN_EMPTY: [&str; 10] = [
    "source_workload",
    "source_workload_namespace",
    "source_principal",
    "source_app",
    "source_version",
    "destination_workload",
    "destination_workload_namespace",
    "destination_principal",
    "destination_app",
    "destination_version",
];

/// Who the reporting pod is, as its sidecar's series name it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReporterLabels {
    pub workload: String,
    pub namespace: String,
    pub principal: String,
    pub app: String,
    pub version: String,
    pub cluster: String,
}

impl ReporterLabels {
    /// The labels, each name prefixed with `side` (`source` or `destination`).
    fn as_side(&self, side: &str) -> [(String, String); 6] {
        [
            ("workload", &self.workload),
            ("workload_namespace", &self.namespace),
            ("principal", &self.principal),
            ("app", &self.app),
            ("version", &self.version),
            ("cluster", &self.cluster),
        ]
        .map(|(k, v)| (format!("{side}_{k}"), v.clone()))
    }
}

/// Rewrites Envoy's Prometheus text as described in the module docs;
/// `me` is the pod a sidecar reports for.
pub fn rewrite(envoy_text: &str, me: &ReporterLabels) -> String {
    let mut out = String::with_capacity(envoy_text.len());
    for line in envoy_text.lines() {
        match rewrite_line(line, me) {
            Some(l) => {
                out.push_str(&l);
                out.push('\n');
            }
            None => continue,
        }
    }
    out
}

/// The name without Envoy's prefix when it belongs to a rewritten scope.
fn scoped(name: &str) -> Option<&str> {
    let rest = name.strip_prefix(ENVOY_PREFIX)?;
    SCOPES.iter().any(|s| rest.starts_with(s)).then_some(rest)
}

/// One line rewritten; `None` drops it.
fn rewrite_line(line: &str, me: &ReporterLabels) -> Option<String> {
    if let Some(rest) = line.strip_prefix("# TYPE ") {
        let (name, kind) = rest.split_once(' ')?;
        return Some(match scoped(name) {
            Some(n) => format!("# TYPE {n} {kind}"),
            None => line.to_string(),
        });
    }
    if line.starts_with('#') {
        return Some(line.to_string());
    }
    let name_end = line.find(['{', ' ']).unwrap_or(line.len());
    let Some(name) = scoped(&line[..name_end]) else {
        return Some(line.to_string());
    };
    let Some(rest) = line[name_end..].strip_prefix('{') else {
        return Some(format!("{name}{}", &line[name_end..]));
    };
    let (labels, value) = parse_labels(rest)?;
    let labels = relabel(name, labels, me)?;
    let mut out = String::with_capacity(line.len());
    out.push_str(name);
    out.push('{');
    for (i, (k, v)) in labels.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(k);
        out.push_str("=\"");
        escape_into(&mut out, v);
        out.push('"');
    }
    out.push('}');
    out.push_str(value);
    Some(out)
}

/// The labels of one series, changed as the module docs say; `None` drops
/// the series.
fn relabel(
    name: &str,
    labels: Vec<(String, String)>,
    me: &ReporterLabels,
) -> Option<Vec<(String, String)>> {
    let mut out = Vec::with_capacity(labels.len() + 6);
    for (k, v) in labels {
        match k.as_str() {
            "reporter" if v == "source" || v == "destination" => {
                let side = me.as_side(&v);
                out.push((k, v));
                out.extend(side);
            }
            "source_baggage" => out.extend(from_baggage(&v)),
            "policy" if name == DENIED => out.push((k, denied_policy(&v)?)),
            "grpc_response_status" if v == "-" => out.push((k, String::new())),
            _ => out.push((k, v)),
        }
    }
    for (k, v) in &mut out {
        if (v.is_empty() || v == "-") && UNKNOWN_WHEN_EMPTY.contains(&k.as_str()) {
            *v = "unknown".to_string();
        }
    }
    Some(out)
}

/// The policy an RBAC filter denied by, from Envoy's response-code details
/// (`rbac_access_denied_matched_policy[ns[a]-policy[b]-rule[0]]`); `None`
/// for a 403 that no RBAC filter answered.
fn denied_policy(details: &str) -> Option<String> {
    let id = details.strip_prefix(RBAC_DENIED)?.strip_suffix(']')?;
    let named = || {
        let rest = id.strip_prefix("ns[")?;
        let (ns, rest) = rest.split_once("]-policy[")?;
        let (name, _) = rest.rsplit_once("]-rule[")?;
        Some(format!("{ns}/{name}"))
    };
    Some(named().unwrap_or_else(|| id.to_string()))
}

/// Source labels from a W3C baggage value as ztunnels send it
/// (`k8s.namespace.name=a,k8s.deployment.name=b,service.name=c,service.version=d`).
fn from_baggage(baggage: &str) -> Vec<(String, String)> {
    let mut workload = String::new();
    let mut namespace = String::new();
    let mut app = String::new();
    let mut version = String::new();
    let mut cluster = String::new();
    for member in baggage.split(',') {
        let Some((k, v)) = member.split_once('=') else {
            continue;
        };
        // Properties (`;k=v`) are not used.
        let v = v.split(';').next().unwrap_or("").trim();
        match k.trim() {
            "k8s.namespace.name" => namespace = v.to_string(),
            "k8s.cluster.name" => cluster = v.to_string(),
            "service.name" => app = v.to_string(),
            "service.version" => version = v.to_string(),
            "k8s.pod.name" => {}
            k if k.starts_with("k8s.") && k.ends_with(".name") => workload = v.to_string(),
            _ => {}
        }
    }
    [
        ("source_workload", workload),
        ("source_workload_namespace", namespace),
        ("source_app", app),
        ("source_version", version),
        ("source_cluster", cluster),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Parses `k="v",k2="v2"} value` into the labels and the rest (` value`).
fn parse_labels(s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    let mut rest = s;
    loop {
        if let Some(after) = rest.strip_prefix('}') {
            return Some((labels, after));
        }
        let rest_after_comma = rest.strip_prefix(',').unwrap_or(rest);
        let (key, after_key) = rest_after_comma.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after_key.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i + 1,
                c => value.push(c),
            }
        };
        labels.push((key.to_string(), value));
        rest = &after_key[end..];
    }
}

fn escape_into(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ENVOY: &str = r#"# TYPE envoy_cluster_upstream_rq counter
envoy_cluster_upstream_rq{envoy_response_code="200",envoy_cluster_name="x"} 7
# TYPE envoy_istio_requests_total counter
envoy_istio_requests_total{reporter="waypoint",source_principal="spiffe://cluster.local/ns/shop/sa/client",source_baggage="k8s.cluster.name=Kubernetes,k8s.namespace.name=shop,k8s.deployment.name=client,service.name=client,service.version=v1",destination_workload="llm-v2",destination_version="v2",response_code="200",grpc_response_status="-",route_name="llm.shop#1"} 42
envoy_istio_requests_total{reporter="waypoint",source_principal="",source_baggage="",destination_workload="",destination_version="",response_code="403",grpc_response_status="",route_name="a\"b"} 3
# TYPE envoy_istio_request_duration_milliseconds histogram
envoy_istio_request_duration_milliseconds_bucket{reporter="waypoint",source_baggage="k8s.namespace.name=shop",le="0.5"} 1
# TYPE envoy_ambit_requests_denied_total counter
envoy_ambit_requests_denied_total{reporter="waypoint",policy="rbac_access_denied_matched_policy[ns[shop]-policy[only-orch]-rule[0]]",destination_service="llm"} 2
envoy_ambit_requests_denied_total{reporter="waypoint",policy="rbac_access_denied_matched_policy[none]",destination_service="llm"} 1
envoy_ambit_requests_denied_total{reporter="waypoint",policy="via_upstream",destination_service="llm"} 5
"#;

    #[test]
    fn istio_names_baggage_and_denials() {
        let out = rewrite(ENVOY, &ReporterLabels::default());
        assert!(out.contains("envoy_cluster_upstream_rq{envoy_response_code=\"200\",envoy_cluster_name=\"x\"} 7\n"), "{out}");
        assert!(
            out.contains("# TYPE istio_requests_total counter\n"),
            "{out}"
        );
        assert!(out.contains(
            "istio_requests_total{reporter=\"waypoint\",source_principal=\"spiffe://cluster.local/ns/shop/sa/client\",source_workload=\"client\",source_workload_namespace=\"shop\",source_app=\"client\",source_version=\"v1\",source_cluster=\"Kubernetes\",destination_workload=\"llm-v2\",destination_version=\"v2\",response_code=\"200\",grpc_response_status=\"\",route_name=\"llm.shop#1\"} 42\n"
        ), "{out}");
        // Empty identities read `unknown`; escapes survive.
        assert!(
            out.contains("source_principal=\"unknown\",source_workload=\"unknown\""),
            "{out}"
        );
        assert!(out.contains("route_name=\"a\\\"b\"} 3\n"), "{out}");
        assert!(out.contains("istio_request_duration_milliseconds_bucket{reporter=\"waypoint\",source_workload=\"unknown\",source_workload_namespace=\"shop\""), "{out}");
        assert!(out.contains("le=\"0.5\"} 1\n"), "{out}");
        assert!(out.contains("ambit_requests_denied_total{reporter=\"waypoint\",policy=\"shop/only-orch\",destination_service=\"llm\"} 2\n"), "{out}");
        assert!(out.contains("ambit_requests_denied_total{reporter=\"waypoint\",policy=\"none\",destination_service=\"llm\"} 1\n"), "{out}");
        assert!(
            !out.contains("via_upstream"),
            "a 403 from the app is no denial: {out}"
        );
        assert!(!out.contains("envoy_istio"), "{out}");
    }

    #[test]
    fn malformed_lines_are_dropped_or_kept_never_panic() {
        for bad in [
            "envoy_istio_requests_total{reporter=\"x",
            "envoy_istio_requests_total{reporter=",
            "envoy_istio_requests_total{",
            "envoy_istio_requests_total 3",
            "# TYPE",
            "envoy_istio_x{a=\"\\",
            "",
        ] {
            let _ = rewrite(bad, &ReporterLabels::default());
        }
        assert_eq!(
            rewrite("envoy_istio_requests_total 3\n", &ReporterLabels::default()),
            "istio_requests_total 3\n"
        );
    }

    #[test]
    fn a_sidecar_names_itself_as_source_or_destination() {
        let me = ReporterLabels {
            workload: "client".into(),
            namespace: "shop".into(),
            principal: "spiffe://cluster.local/ns/shop/sa/client".into(),
            app: "client".into(),
            version: "v1".into(),
            cluster: "Kubernetes".into(),
        };
        let text = "envoy_istio_requests_total{reporter=\"source\",destination_workload=\"llm-v2\",response_code=\"200\"} 7\n\
envoy_istio_requests_total{reporter=\"destination\",source_principal=\"\",source_baggage=\"\",response_code=\"200\"} 2\n";
        let out = rewrite(text, &me);
        assert!(out.contains("istio_requests_total{reporter=\"source\",source_workload=\"client\",source_workload_namespace=\"shop\",source_principal=\"spiffe://cluster.local/ns/shop/sa/client\",source_app=\"client\",source_version=\"v1\",source_cluster=\"Kubernetes\",destination_workload=\"llm-v2\",response_code=\"200\"} 7\n"), "{out}");
        assert!(out.contains("istio_requests_total{reporter=\"destination\",destination_workload=\"client\",destination_workload_namespace=\"shop\",destination_principal=\"spiffe://cluster.local/ns/shop/sa/client\",destination_app=\"client\",destination_version=\"v1\",destination_cluster=\"Kubernetes\",source_principal=\"unknown\",source_workload=\"unknown\""), "{out}");
        // A waypoint's series are left as they are.
        let waypoint = rewrite("envoy_istio_requests_total{reporter=\"waypoint\"} 1\n", &me);
        assert_eq!(waypoint, "istio_requests_total{reporter=\"waypoint\"} 1\n");
    }
}
