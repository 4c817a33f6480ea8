//! `ambitctl proxy-config routes|clusters|listeners|endpoints|secrets POD`:
//! what an Envoy (waypoint or sidecar) holds, from its admin
//! `/config_dump?include_eds` (Envoy listens on 127.0.0.1:15000 inside its
//! pod). In local mode the request is made from inside the pod's network
//! namespace, the way `ambitctl local exec` enters it
//! (`ambit_inpod::PodNetns::run_in`). Tables by default — routes show the
//! match, destination, subset and weight, so an 80/20 split reads at a
//! glance — or the dump's section as JSON/YAML.

use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

use crate::http::{self, HttpError};
use crate::table::Table;

/// The dump's sections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    Routes,
    Clusters,
    Listeners,
    Endpoints,
    Secrets,
}

impl Section {
    /// The `@type` of the section's config dump.
    fn dump_type(self) -> &'static str {
        match self {
            Section::Routes => "RoutesConfigDump",
            Section::Clusters => "ClustersConfigDump",
            Section::Listeners => "ListenersConfigDump",
            Section::Endpoints => "EndpointsConfigDump",
            Section::Secrets => "SecretsConfigDump",
        }
    }
}

/// Why the config could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ProxyConfigError {
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error(
        "cannot reach Envoy's admin inside pod {pod} ({netns}): {source}; is the pod running an Envoy (waypoint or sidecar)?"
    )]
    Netns {
        pod: String,
        netns: String,
        #[source]
        source: std::io::Error,
    },
    #[error("Envoy's config dump {0}; is this Envoy's admin port?")]
    Decode(String),
}

/// The admin path read.
pub const DUMP_PATH: &str = "/config_dump?include_eds";

/// The whole dump from an admin address in this network namespace.
pub fn fetch(admin: SocketAddr, timeout: Duration) -> Result<Value, ProxyConfigError> {
    let body = http::get(admin, DUMP_PATH, "Envoy's admin", timeout)?;
    parse(&body)
}

/// The whole dump from Envoy's admin on `port` inside the network
/// namespace at `netns_path` (a pod's).
pub fn fetch_in_netns(
    pod: &str,
    netns_path: &std::path::Path,
    port: u16,
    timeout: Duration,
) -> Result<Value, ProxyConfigError> {
    let err = |source| ProxyConfigError::Netns {
        pod: pod.to_string(),
        netns: netns_path.display().to_string(),
        source,
    };
    let admin = SocketAddr::from(([127, 0, 0, 1], port));
    let ns = ambit_inpod::PodNetns::open(netns_path)
        .map_err(|e| err(std::io::Error::other(e.to_string())))?;
    // Only the socket is made inside the namespace; the request runs here.
    let stream = ns
        .run_in(move || TcpStream::connect_timeout(&admin, timeout))
        .map_err(err)?;
    let body = http::get_on(stream, admin, DUMP_PATH, "Envoy's admin", timeout)?;
    parse(&body)
}

fn parse(body: &str) -> Result<Value, ProxyConfigError> {
    serde_json::from_str(body).map_err(|e| ProxyConfigError::Decode(format!("does not parse: {e}")))
}

/// The section of a dump, as Envoy wrote it.
pub fn section(dump: &Value, section: Section) -> Value {
    dump.get("configs")
        .and_then(Value::as_array)
        .and_then(|c| {
            c.iter().find(|x| {
                x.get("@type")
                    .and_then(Value::as_str)
                    .is_some_and(|t| t.rsplit('.').next() == Some(section.dump_type()))
            })
        })
        .cloned()
        .unwrap_or(Value::Null)
}

fn arr<'v>(v: &'v Value, key: &str) -> &'v [Value] {
    v.get(key)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn st<'v>(v: &'v Value, key: &str) -> &'v str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

/// One destination of one route.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RouteRow {
    pub route_config: String,
    pub virtual_host: String,
    /// `prefix /`, `path /x`, `regex ^/v[12]`, plus header and query
    /// matches.
    #[serde(rename = "match")]
    pub match_: String,
    /// The cluster, or what the route does instead (`redirect`, `direct
    /// response 503`).
    pub cluster: String,
    /// `host:port` of an `outbound|port|subset|host` cluster.
    pub destination: String,
    pub subset: String,
    /// Share of the route's traffic in percent (`100` for a lone cluster).
    pub weight: String,
}

fn route_match(m: &Value) -> String {
    let mut parts = Vec::new();
    if let Some(p) = m.get("prefix").and_then(Value::as_str) {
        parts.push(format!("prefix {p}"));
    }
    if let Some(p) = m.get("path").and_then(Value::as_str) {
        parts.push(format!("path {p}"));
    }
    if let Some(r) = m
        .get("safe_regex")
        .and_then(|r| r.get("regex"))
        .and_then(Value::as_str)
    {
        parts.push(format!("regex {r}"));
    }
    if let Some(p) = m.get("path_separated_prefix").and_then(Value::as_str) {
        parts.push(format!("prefix {p}/"));
    }
    for h in arr(m, "headers") {
        parts.push(format!("header {}", st(h, "name")));
    }
    for q in arr(m, "query_parameters") {
        parts.push(format!("query {}", st(q, "name")));
    }
    if parts.is_empty() {
        "*".into()
    } else {
        parts.join(" ")
    }
}

/// `outbound|80|v1|llm.shop.svc.cluster.local` → (`llm.shop.svc.cluster.local:80`, `v1`).
fn split_cluster(name: &str) -> (String, String) {
    let parts: Vec<&str> = name.split('|').collect();
    match parts[..] {
        [_, port, subset, host] => (format!("{host}:{port}"), subset.to_string()),
        _ => (name.to_string(), String::new()),
    }
}

fn num(v: &Value) -> Option<u64> {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

/// Every destination of every route, in Envoy's order.
pub fn routes(dump_section: &Value) -> Vec<RouteRow> {
    let mut out = Vec::new();
    let configs = arr(dump_section, "dynamic_route_configs")
        .iter()
        .chain(arr(dump_section, "static_route_configs"))
        .filter_map(|c| c.get("route_config"));
    for rc in configs {
        for vh in arr(rc, "virtual_hosts") {
            let domains: Vec<&str> = arr(vh, "domains")
                .iter()
                .filter_map(Value::as_str)
                .collect();
            let vh_name = match domains.first() {
                Some(d) => format!("{} ({d})", st(vh, "name")),
                None => st(vh, "name").to_string(),
            };
            for r in arr(vh, "routes") {
                let base = RouteRow {
                    route_config: st(rc, "name").to_string(),
                    virtual_host: vh_name.clone(),
                    match_: r.get("match").map_or_else(|| "*".into(), route_match),
                    cluster: String::new(),
                    destination: String::new(),
                    subset: String::new(),
                    weight: String::new(),
                };
                let action = r.get("route");
                if let Some(c) = action
                    .and_then(|a| a.get("cluster"))
                    .and_then(Value::as_str)
                {
                    let (destination, subset) = split_cluster(c);
                    out.push(RouteRow {
                        cluster: c.to_string(),
                        destination,
                        subset,
                        weight: "100".into(),
                        ..base
                    });
                } else if let Some(w) = action.and_then(|a| a.get("weighted_clusters")) {
                    let clusters = arr(w, "clusters");
                    let total: u64 = clusters
                        .iter()
                        .filter_map(|c| c.get("weight").and_then(num))
                        .sum();
                    for c in clusters {
                        let name = st(c, "name");
                        let weight = c.get("weight").and_then(num).unwrap_or(0);
                        let (destination, subset) = split_cluster(name);
                        out.push(RouteRow {
                            cluster: name.to_string(),
                            destination,
                            subset,
                            weight: (weight * 100)
                                .checked_div(total)
                                .unwrap_or(weight)
                                .to_string(),
                            ..base.clone()
                        });
                    }
                } else if r.get("redirect").is_some() {
                    out.push(RouteRow {
                        cluster: "redirect".into(),
                        ..base
                    });
                } else if let Some(d) = r.get("direct_response") {
                    out.push(RouteRow {
                        cluster: format!(
                            "direct response {}",
                            d.get("status").and_then(num).unwrap_or(0)
                        ),
                        ..base
                    });
                } else {
                    out.push(base);
                }
            }
        }
    }
    out
}

fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.to_string()
    }
}

fn address(a: &Value) -> String {
    if let Some(s) = a.get("socket_address") {
        let port = s.get("port_value").and_then(num).unwrap_or(0);
        return format!("{}:{port}", st(s, "address"));
    }
    if let Some(i) = a.get("envoy_internal_address") {
        return format!("internal:{}", st(i, "server_listener_name"));
    }
    "-".into()
}

/// A table of one section.
pub fn render(section_kind: Section, v: &Value) -> String {
    let mut t;
    match section_kind {
        Section::Routes => {
            t = Table::new(&[
                "ROUTE",
                "VIRTUAL HOST",
                "MATCH",
                "DESTINATION",
                "SUBSET",
                "WEIGHT",
            ]);
            for r in routes(v) {
                let dest = if r.destination.is_empty() {
                    &r.cluster
                } else {
                    &r.destination
                };
                t.row(vec![
                    or_dash(&r.route_config),
                    or_dash(&r.virtual_host),
                    r.match_.clone(),
                    or_dash(dest),
                    or_dash(&r.subset),
                    if r.weight.is_empty() {
                        "-".into()
                    } else {
                        format!("{}%", r.weight)
                    },
                ]);
            }
        }
        Section::Clusters => {
            t = Table::new(&["CLUSTER", "TYPE", "DESTINATION", "SUBSET"]);
            let clusters = arr(v, "dynamic_active_clusters")
                .iter()
                .chain(arr(v, "static_clusters"))
                .filter_map(|c| c.get("cluster"));
            for c in clusters {
                let name = st(c, "name");
                let (dest, subset) = split_cluster(name);
                let ty = c
                    .get("type")
                    .and_then(Value::as_str)
                    .or_else(|| c.get("cluster_type").map(|_| "CUSTOM"))
                    .unwrap_or("STATIC");
                t.row(vec![
                    name.to_string(),
                    ty.to_string(),
                    dest,
                    or_dash(&subset),
                ]);
            }
        }
        Section::Listeners => {
            t = Table::new(&["LISTENER", "ADDRESS", "FILTER CHAINS"]);
            let listeners = arr(v, "dynamic_listeners")
                .iter()
                .filter_map(|l| l.get("active_state").and_then(|a| a.get("listener")))
                .chain(
                    arr(v, "static_listeners")
                        .iter()
                        .filter_map(|l| l.get("listener")),
                );
            for l in listeners {
                t.row(vec![
                    st(l, "name").to_string(),
                    l.get("address").map_or_else(|| "-".into(), address),
                    arr(l, "filter_chains").len().to_string(),
                ]);
            }
        }
        Section::Endpoints => {
            t = Table::new(&["CLUSTER", "ENDPOINT", "HEALTH", "TUNNEL DESTINATION"]);
            let configs = arr(v, "dynamic_endpoint_configs")
                .iter()
                .chain(arr(v, "static_endpoint_configs"))
                .filter_map(|c| c.get("endpoint_config"));
            for c in configs {
                for group in arr(c, "endpoints") {
                    for e in arr(group, "lb_endpoints") {
                        let addr = e
                            .get("endpoint")
                            .and_then(|x| x.get("address"))
                            .map_or_else(|| "-".into(), address);
                        let tunnel = e
                            .pointer("/metadata/filter_metadata/tunnel/destination")
                            .and_then(Value::as_str)
                            .unwrap_or("-");
                        t.row(vec![
                            st(c, "cluster_name").to_string(),
                            addr,
                            or_dash(st(e, "health_status")),
                            tunnel.to_string(),
                        ]);
                    }
                }
            }
        }
        Section::Secrets => {
            t = Table::new(&["SECRET", "TYPE", "VERSION", "LAST UPDATED"]);
            for s in arr(v, "dynamic_active_secrets")
                .iter()
                .chain(arr(v, "static_secrets"))
            {
                let secret = s.get("secret").unwrap_or(&Value::Null);
                let ty = if secret.get("tls_certificate").is_some() {
                    "certificate"
                } else if secret.get("validation_context").is_some() {
                    "trust bundle"
                } else {
                    "-"
                };
                t.row(vec![
                    st(s, "name").to_string(),
                    ty.to_string(),
                    or_dash(st(s, "version_info")),
                    or_dash(st(s, "last_updated")),
                ]);
            }
        }
    }
    if t.is_empty() {
        return "(none)\n".into();
    }
    t.render()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_routes_read_as_percent() {
        let v: Value = serde_json::json!({
            "dynamic_route_configs": [{"route_config": {"name": "80", "virtual_hosts": [{
                "name": "llm", "domains": ["llm.shop.svc.cluster.local"],
                "routes": [{"match": {"prefix": "/"}, "route": {"weighted_clusters": {"clusters": [
                    {"name": "outbound|80|v1|llm.shop.svc.cluster.local", "weight": 80},
                    {"name": "outbound|80|v2|llm.shop.svc.cluster.local", "weight": 20}]}}}]}]}}]
        });
        let r = routes(&v);
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].subset.as_str(), r[0].weight.as_str()), ("v1", "80"));
        assert_eq!((r[1].subset.as_str(), r[1].weight.as_str()), ("v2", "20"));
        assert_eq!(r[0].destination, "llm.shop.svc.cluster.local:80");
        assert!(render(Section::Routes, &v).contains("80%"));
    }
}
