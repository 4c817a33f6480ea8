//! The monitoring server (15014): `/ready`, `/metrics` and `/debug/*`.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use prometheus_client::registry::Registry;
use serde::Serialize;
use tokio::sync::watch;

use crate::http::{Handler, json, respond};
use crate::model::snapshot::{MESH_SCOPE, ResourceSet, Snapshot, type_short_name};
use crate::xds::ProxyRegistry;

const INDEX: &str = "\
ambit-control monitoring endpoints:
  /ready                  200 once every config source delivered its initial state
                          (in Kubernetes: every watch listed once) and xDS serves
  /metrics                Prometheus metrics
  /debug/push_status      current snapshot: sequence, sizes, build time
  /debug/connections      connected proxies and what they hold
  /debug/nacks            recent xDS responses rejected by proxies
  /debug/config_errors    documents currently rejected, with file and line
  /debug/resources?type=TYPE[&scope=SCOPE]   resource names and versions of one
                          type (short name such as address, authorization, or the
                          type URL); scope: a waypoint's set (default: mesh-wide)
";

#[derive(Serialize)]
struct PushStatus {
    seq: u64,
    synced: bool,
    build_time_ms: f64,
    addresses: usize,
    authorizations: usize,
    /// Resources per type over every scope.
    resources: BTreeMap<String, usize>,
    config_errors: usize,
    connections: usize,
}

#[derive(Serialize)]
struct ResourceView<'a> {
    name: &'a str,
    aliases: &'a [String],
    version: &'a str,
    bytes: usize,
}

/// What `/ready` checks besides the model's synced snapshot: `Err` says
/// what is still missing (a watch not listed yet, the CA not loaded, ...).
pub type ReadinessCheck = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// A readiness check that always passes.
pub fn always_ready() -> ReadinessCheck {
    Arc::new(|| Ok(()))
}

/// Everything the monitoring handler reads.
#[derive(Clone)]
pub struct DebugState {
    pub snapshots: watch::Receiver<Arc<Snapshot>>,
    pub proxies: Arc<ProxyRegistry>,
    pub metrics: Arc<Registry>,
    pub readiness: ReadinessCheck,
}

fn resource_list(set: &ResourceSet) -> Vec<ResourceView<'_>> {
    let mut v: Vec<_> = set
        .by_name
        .values()
        .map(|r| ResourceView {
            name: &r.name,
            aliases: &r.aliases,
            version: &r.version,
            bytes: r.body.value.len(),
        })
        .collect();
    v.sort_by(|a, b| a.name.cmp(b.name));
    v
}

fn query(req: &Request<Incoming>) -> BTreeMap<String, String> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl DebugState {
    pub fn handler(self) -> Handler {
        Arc::new(move |req| self.handle(req))
    }

    fn handle(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        if req.method() != Method::GET {
            return respond(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                "only GET is supported here\n",
            );
        }
        let snap = self.snapshots.borrow().clone();
        match req.uri().path() {
            "/" | "/debug" | "/debug/" => respond(StatusCode::OK, "text/plain", INDEX),
            "/ready" => match (self.readiness)() {
                Err(why) => respond(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    format!("not ready: {why}\n"),
                ),
                Ok(()) if snap.synced => respond(StatusCode::OK, "text/plain", "ready\n"),
                Ok(()) => respond(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    "not ready: waiting for the config sources' initial state\n",
                ),
            },
            "/metrics" => {
                let mut out = String::new();
                match prometheus_client::encoding::text::encode(&mut out, &self.metrics) {
                    Ok(()) => respond(
                        StatusCode::OK,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        out,
                    ),
                    Err(e) => respond(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "text/plain",
                        format!("could not encode metrics: {e}\n"),
                    ),
                }
            }
            "/debug/push_status" => json(&PushStatus {
                seq: snap.seq,
                synced: snap.synced,
                build_time_ms: snap.build_time.as_secs_f64() * 1e3,
                addresses: snap.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name.len(),
                authorizations: snap.mesh(ambit_proto::AUTHORIZATION_TYPE_URL).by_name.len(),
                resources: snap.counts_by_type(),
                config_errors: snap.errors.len(),
                connections: self.proxies.proxies().len(),
            }),
            "/debug/connections" => json(&self.proxies.proxies()),
            "/debug/nacks" => json(&self.proxies.nacks()),
            "/debug/config_errors" => json(&*snap.errors),
            "/debug/resources" => {
                let q = query(req);
                let wanted = q.get("type").map_or("address", String::as_str);
                let scope = q.get("scope").map_or(MESH_SCOPE, String::as_str);
                let types = snap.sets.get(scope);
                let found = types.and_then(|t| {
                    t.iter()
                        .find(|(url, _)| **url == wanted || type_short_name(url) == wanted)
                });
                match found {
                    Some((_, set)) => json(&resource_list(&set.resources)),
                    None => {
                        let known: Vec<String> = types
                            .into_iter()
                            .flat_map(|t| t.keys())
                            .map(|u| type_short_name(u))
                            .collect();
                        respond(
                            StatusCode::NOT_FOUND,
                            "text/plain",
                            format!(
                                "no {wanted:?} resources in scope {scope:?}; types there: {}\n",
                                known.join(", ")
                            ),
                        )
                    }
                }
            }
            _ => respond(
                StatusCode::NOT_FOUND,
                "text/plain",
                format!("not found\n\n{INDEX}"),
            ),
        }
    }
}
