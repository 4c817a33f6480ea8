//! Real upstream Envoys as waypoint clients of the bench's xDS server: each
//! in its own pod network namespace (each binds 15008), bootstrapped as
//! waypoint `shop/waypoint` with the bench's token, ADS over the server's
//! unix socket. Whether one holds a route is read from its own admin
//! `/config_dump`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ambit_tests::envoy::{Envoy, envoy_binary, waypoint_bootstrap};
use ambit_tests::netbed::{self, Cluster};
use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::{TOKEN, env_or, node_id};

/// The route configurations of `llm`, and nothing else, from the admin API.
const LLM_ROUTES: &str = "/config_dump?resource=dynamic_route_configs&name_regex=llm.*";

pub struct RealEnvoys {
    /// Dropped before the cluster that holds their namespaces.
    envoys: Vec<Arc<Envoy>>,
    _cluster: Cluster,
    pub started: Instant,
}

/// How long until one Envoy showed the route, and how many admin polls
/// that took.
#[derive(Debug, Clone, Copy)]
pub struct Converged {
    pub after: Duration,
    pub polls: u32,
}

impl RealEnvoys {
    /// `ENVOYS` (default 2) Envoys with node ids from `first` on, or none
    /// when there is no root, `ip` or Envoy here.
    pub async fn start(xds_socket: &Path, first: usize) -> Result<Option<RealEnvoys>> {
        let n = env_or("ENVOYS", 2);
        if n == 0 {
            return Ok(None);
        }
        if !netbed::can_run("waypoint_xds real Envoys") {
            println!("  real Envoys skipped: they need root, ip and iptables");
            return Ok(None);
        }
        if let Err(e) = envoy_binary() {
            println!("  real Envoys skipped: {e:#}");
            return Ok(None);
        }
        let socket = xds_socket.to_path_buf();
        let started = Instant::now();
        tokio::task::spawn_blocking(move || {
            let mut cluster = Cluster::new(1)?;
            let mut envoys = Vec::new();
            for i in 0..n {
                let pod = cluster.add_pod(0, &format!("wp{i}"))?;
                let bootstrap = waypoint_bootstrap(
                    &node_id(first + i),
                    "shop",
                    "waypoint",
                    TOKEN,
                    &socket,
                    &socket.with_file_name("sds.sock"),
                );
                let envoy = Envoy::start(&bootstrap, Some(&pod.netns))
                    .with_context(|| format!("starting real Envoy {i}"))?;
                envoys.push(Arc::new(envoy));
            }
            Ok(Some(RealEnvoys {
                envoys,
                _cluster: cluster,
                started,
            }))
        })
        .await?
    }

    pub fn len(&self) -> usize {
        self.envoys.len()
    }

    /// For each Envoy, polled concurrently, the time from `since` until
    /// its config dump shows `llm` weights `want`; fails after `limit`.
    pub async fn converged(
        &self,
        want: &[u32],
        since: Instant,
        limit: Duration,
    ) -> Result<Vec<Converged>> {
        let mut tasks = Vec::new();
        for envoy in &self.envoys {
            let (envoy, want) = (envoy.clone(), want.to_vec());
            tasks.push(tokio::task::spawn_blocking(move || {
                wait_weights(&envoy, &want, since, limit)
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await??);
        }
        Ok(out)
    }

    /// "a ms, b ms (n, m polls)".
    pub fn describe(&self, took: &[Converged]) -> String {
        let times: Vec<String> = took.iter().map(|c| format!("{:?}", c.after)).collect();
        let polls: Vec<String> = took.iter().map(|c| c.polls.to_string()).collect();
        format!("{} ({} admin polls)", times.join(", "), polls.join(", "))
    }
}

/// Polls `envoy`'s config dump until the `llm` route carries `want`; the
/// time is taken when the answer that showed it arrived (an upper bound, by
/// at most one poll's round trip).
fn wait_weights(envoy: &Envoy, want: &[u32], since: Instant, limit: Duration) -> Result<Converged> {
    let mut polls = 0;
    loop {
        polls += 1;
        let dump = envoy
            .admin_get(LLM_ROUTES)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok());
        if dump.is_some_and(|d| llm_weights(&d) == want) {
            return Ok(Converged {
                after: since.elapsed(),
                polls,
            });
        }
        if since.elapsed() > limit {
            let routes = envoy.admin_get("/config_dump?resource=dynamic_route_configs");
            bail!(
                "a real Envoy did not show weights {want:?} within {limit:?}; its routes: {}; log:\n{}",
                routes.map_or_else(|e| format!("{e:#}"), |r| r.chars().take(1500).collect()),
                envoy.log()
            );
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The cluster weights of the `llm.shop…` route configurations in a route
/// config dump (a whole `RoutesConfigDump` or, with `resource=`, its
/// `DynamicRouteConfig`s).
fn llm_weights(dump: &Value) -> Vec<u32> {
    let mut out = Vec::new();
    for config in dump["configs"].as_array().into_iter().flatten() {
        let dynamic = config["dynamic_route_configs"].as_array();
        let entries = dynamic.into_iter().flatten().chain(std::iter::once(config));
        for entry in entries {
            let rc = &entry["route_config"];
            if !rc["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("llm.shop"))
            {
                continue;
            }
            for vh in rc["virtual_hosts"].as_array().into_iter().flatten() {
                for route in vh["routes"].as_array().into_iter().flatten() {
                    let clusters = route["route"]["weighted_clusters"]["clusters"].as_array();
                    for c in clusters.into_iter().flatten() {
                        out.push(c["weight"].as_u64().unwrap_or(0) as u32);
                    }
                }
            }
        }
    }
    out
}
