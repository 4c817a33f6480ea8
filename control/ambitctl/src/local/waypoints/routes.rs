//! Requests per route through a waypoint, for `local status`: the routes
//! Envoy runs (its `config_dump`, read as `proxy-config routes` reads it)
//! joined with what was counted per destination.
//!
//! Requests and their 2xx/5xx come from Istio's `istio_requests_total` in
//! the waypoint's merged metrics (the agent's :15020) by
//! `destination_service` and `destination_version`, for a destination whose
//! subset is named like the version it selects (`v1` → `version: v1`, the
//! usual convention); else from Envoy's own cluster counters
//! (`cluster.outbound|<port>|<subset>|<host>.upstream_rq_total`, `_2xx`,
//! `_5xx`, from the admin's `/stats`). Retries are always Envoy's
//! (`upstream_rq_retry`). [`route_rows`] is the one function that turns the
//! scraped text into rows; p50/p99 come from Istio's duration histogram, and
//! [`denial_rows`] lists the requests RBAC refused, per policy.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::proxy_config::RouteRow as EnvoyRoute;

/// What was read from one waypoint pod.
#[derive(Debug, Clone, Default)]
pub struct Scrape {
    /// Its routes (`proxy_config::routes` of the dump's routes section).
    pub routes: Vec<EnvoyRoute>,
    /// Envoy admin `/stats?filter=^cluster\.outbound` (text format).
    pub cluster_stats: String,
    /// The agent's `/stats/prometheus` (merged metrics).
    pub prometheus: String,
}

/// Requests to one destination of one route.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RouteRow {
    /// The virtual host (`name (first domain)`).
    pub route: String,
    #[serde(rename = "match")]
    pub match_: String,
    /// `host:port`.
    pub destination: String,
    pub subset: String,
    /// Configured share in percent, as Envoy has it now.
    pub weight: String,
    pub requests: u64,
    pub ok_2xx: u64,
    pub error_5xx: u64,
    pub retries: u64,
    /// Request duration percentiles in milliseconds, from Istio's
    /// `istio_request_duration_milliseconds` histogram (`None` when the
    /// counts are Envoy's, or nothing was measured).
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// `istio_requests_total` or `envoy cluster stats`.
    pub source: String,
}

/// Requests an RBAC filter of the waypoint refused, per policy.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DenialRow {
    /// `<namespace>/<name>`, or `none` (no ALLOW policy matched).
    pub policy: String,
    pub destination_service: String,
    pub source_principal: String,
    pub requests: u64,
}

/// Every series of `ambit_requests_denied_total` in the merged metrics.
pub fn denial_rows(metrics: &str) -> Vec<DenialRow> {
    let mut out = Vec::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("ambit_requests_denied_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once('}') else {
            continue;
        };
        let n = value.trim().parse::<f64>().unwrap_or(0.0) as u64;
        if n == 0 {
            continue;
        }
        let get = |k| label(labels, k).unwrap_or("").to_string();
        out.push(DenialRow {
            policy: get("policy"),
            destination_service: get("destination_service"),
            source_principal: get("source_principal"),
            requests: n,
        });
    }
    out.sort_by(|a, b| b.requests.cmp(&a.requests).then(a.policy.cmp(&b.policy)));
    out
}

/// Cumulative duration buckets (`le` in ms, count) per
/// `<destination_service>|<destination_version>`.
fn istio_latency(metrics: &str) -> BTreeMap<String, BTreeMap<u64, f64>> {
    let mut out: BTreeMap<String, BTreeMap<u64, f64>> = BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("istio_request_duration_milliseconds_bucket{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once('}') else {
            continue;
        };
        let (Some(service), Some(version), Some(le)) = (
            label(labels, "destination_service"),
            label(labels, "destination_version"),
            label(labels, "le"),
        ) else {
            continue;
        };
        // `le` in thousandths of a millisecond, so buckets sort as numbers.
        let le = if le == "+Inf" {
            u64::MAX
        } else {
            match le.parse::<f64>() {
                Ok(v) => (v * 1000.0) as u64,
                Err(_) => continue,
            }
        };
        let n = value.trim().parse::<f64>().unwrap_or(0.0);
        *out.entry(format!("{service}|{version}"))
            .or_default()
            .entry(le)
            .or_default() += n;
    }
    out
}

/// The `q` quantile of cumulative buckets, interpolated linearly inside
/// the bucket it falls in (as Prometheus' `histogram_quantile`).
fn quantile(buckets: &BTreeMap<u64, f64>, q: f64) -> Option<f64> {
    let total = *buckets.get(&u64::MAX).or_else(|| buckets.values().last())?;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev_le = 0.0;
    let mut prev_count = 0.0;
    for (&le, &count) in buckets {
        if count >= rank {
            if le == u64::MAX {
                return Some(prev_le);
            }
            let le = le as f64 / 1000.0;
            let in_bucket = count - prev_count;
            let frac = if in_bucket > 0.0 {
                (rank - prev_count) / in_bucket
            } else {
                1.0
            };
            return Some(prev_le + (le - prev_le) * frac);
        }
        if le != u64::MAX {
            prev_le = le as f64 / 1000.0;
        }
        prev_count = count;
    }
    None
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    requests: u64,
    ok: u64,
    errors: u64,
    retries: u64,
}

/// Rows for every destination of every route, with its counts.
pub fn route_rows(scrape: &Scrape) -> Vec<RouteRow> {
    let istio = istio_counts(&scrape.prometheus);
    let latency = istio_latency(&scrape.prometheus);
    let envoy = cluster_counts(&scrape.cluster_stats);
    let mut seen = std::collections::BTreeSet::new();
    scrape
        .routes
        .iter()
        .filter(|r| r.cluster.starts_with("outbound|"))
        // A destination listed by two routes (e.g. a header match and the
        // default) is counted once: counters are per destination.
        .filter(|r| seen.insert((r.virtual_host.clone(), r.match_.clone(), r.cluster.clone())))
        .map(|r| {
            let host = r.destination.rsplit_once(':').map_or("", |(h, _)| h);
            let from_envoy = envoy.get(&r.cluster).copied().unwrap_or_default();
            let host_in_istio = istio.keys().any(|k| k.split('|').next() == Some(host));
            let (c, source) = match istio.get(&format!("{host}|{}", r.subset)) {
                Some(c) if !r.subset.is_empty() => (*c, "istio_requests_total"),
                // A version nothing reached yet: both sources say zero.
                None if host_in_istio && from_envoy.requests == 0 => {
                    (Counts::default(), "istio_requests_total")
                }
                _ => (from_envoy, "envoy cluster stats"),
            };
            // Percentiles only beside Istio's counts (same series).
            let buckets = (source == "istio_requests_total")
                .then(|| latency.get(&format!("{host}|{}", r.subset)))
                .flatten();
            RouteRow {
                route: r.virtual_host.clone(),
                match_: r.match_.clone(),
                destination: r.destination.clone(),
                subset: r.subset.clone(),
                weight: r.weight.clone(),
                requests: c.requests,
                ok_2xx: c.ok,
                error_5xx: c.errors,
                retries: from_envoy.retries,
                p50_ms: buckets.and_then(|b| quantile(b, 0.5)),
                p99_ms: buckets.and_then(|b| quantile(b, 0.99)),
                source: source.to_string(),
            }
        })
        .collect()
}

/// Per cluster name, from Envoy's text stats
/// (`cluster.<name>.upstream_rq_total: N`).
fn cluster_counts(stats: &str) -> BTreeMap<String, Counts> {
    let mut out: BTreeMap<String, Counts> = BTreeMap::new();
    for line in stats.lines() {
        let Some((key, value)) = line.rsplit_once(": ") else {
            continue;
        };
        let Some(rest) = key.strip_prefix("cluster.") else {
            continue;
        };
        let Ok(n) = value.trim().parse::<u64>() else {
            continue;
        };
        for (suffix, field) in [
            (".upstream_rq_total", 0),
            (".upstream_rq_2xx", 1),
            (".upstream_rq_5xx", 2),
            (".upstream_rq_retry", 3),
        ] {
            if let Some(cluster) = rest.strip_suffix(suffix) {
                let c = out.entry(cluster.to_string()).or_default();
                match field {
                    0 => c.requests = n,
                    1 => c.ok = n,
                    2 => c.errors = n,
                    _ => c.retries = n,
                }
            }
        }
    }
    out
}

/// The value of label `name` in a Prometheus label set (`a="x",b="y"`).
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let start = labels.find(&format!("{name}=\""))? + name.len() + 2;
    let rest = labels.get(start..)?;
    rest.split('"').next()
}

/// Per `<destination_service>|<destination_version>`, from
/// `istio_requests_total` samples that carry a version (a waypoint's).
fn istio_counts(metrics: &str) -> BTreeMap<String, Counts> {
    let mut out: BTreeMap<String, Counts> = BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("istio_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once('}') else {
            continue;
        };
        let (Some(service), Some(version)) = (
            label(labels, "destination_service"),
            label(labels, "destination_version"),
        ) else {
            continue;
        };
        if version.is_empty() || version == "unknown" {
            continue;
        }
        let n = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        // Counters are whole numbers.
        let n = n as u64;
        let c = out.entry(format!("{service}|{version}")).or_default();
        c.requests += n;
        match label(labels, "response_code").and_then(|s| s.chars().next()) {
            Some('2') => c.ok += n,
            Some('5') => c.errors += n,
            _ => {}
        }
    }
    out
}
