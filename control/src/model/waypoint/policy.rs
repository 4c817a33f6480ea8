//! DestinationRule traffic policy on a waypoint's clusters: subsets, load
//! balancing, connection pools (circuit breakers), outlier detection; and
//! the route hash policies a consistent hash needs. Istio's merge order:
//! a subset's policy overrides the top-level one field by field
//! (`loadBalancer`, `connectionPool`, `outlierDetection`), and within each
//! level `portLevelSettings` for the port override the level's own.

use std::time::Duration;

use ambit_config::networking::{
    ConnectionPoolSettings, DestinationRule, HashKey, LoadBalancerSettings, OutlierDetection,
    SimpleLb, TrafficPolicy,
};
use ambit_config::objects::Labels;
use envoy_types::pb::envoy::config::cluster::v3::{
    CircuitBreakers, Cluster, OutlierDetection as EnvoyOutlier,
    circuit_breakers::Thresholds,
    cluster::{LbConfig, LbPolicy, MaglevLbConfig, RingHashLbConfig},
};
use envoy_types::pb::envoy::config::core::v3::HttpProtocolOptions as CommonHttpOptions;
use envoy_types::pb::envoy::config::route::v3::route_action::{HashPolicy, hash_policy};
use envoy_types::pb::google::protobuf::UInt64Value;

use super::envoy::{duration, u32_value};

/// The policy that applies to one cluster: what the levels above say.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EffectivePolicy {
    pub load_balancer: Option<LoadBalancerSettings>,
    pub connection_pool: Option<ConnectionPoolSettings>,
    pub outlier_detection: Option<OutlierDetection>,
}

impl EffectivePolicy {
    fn layer(&mut self, policy: &TrafficPolicy, port: u16) {
        let port_level = policy.port_settings(port);
        if let Some(lb) = pick(&policy.load_balancer, port_level.map(|p| &p.load_balancer)) {
            self.load_balancer = Some(lb);
        }
        if let Some(cp) = pick(
            &policy.connection_pool,
            port_level.map(|p| &p.connection_pool),
        ) {
            self.connection_pool = Some(cp);
        }
        if let Some(od) = pick(
            &policy.outlier_detection,
            port_level.map(|p| &p.outlier_detection),
        ) {
            self.outlier_detection = Some(od);
        }
    }
}

/// One cluster of a service port: the default (`subset` empty, every
/// endpoint) or a DestinationRule subset.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterVariant {
    pub subset: String,
    /// Endpoints must carry these labels (none for the default).
    pub selector: Labels,
    pub policy: EffectivePolicy,
}

/// The clusters of one service port under its DestinationRule.
pub fn variants(dr: Option<&DestinationRule>, port: u16) -> Vec<ClusterVariant> {
    let mut top = EffectivePolicy::default();
    if let Some(p) = dr.and_then(|d| d.spec.traffic_policy.as_ref()) {
        top.layer(p, port);
    }
    let mut out = vec![ClusterVariant {
        subset: String::new(),
        selector: Labels::new(),
        policy: top.clone(),
    }];
    for subset in dr.map(|d| d.spec.subsets.as_slice()).unwrap_or_default() {
        let mut policy = top.clone();
        if let Some(p) = &subset.traffic_policy {
            policy.layer(p, port);
        }
        out.push(ClusterVariant {
            subset: subset.name.clone(),
            selector: subset.labels.clone(),
            policy,
        });
    }
    out
}

/// Load balancing, circuit breakers and outlier detection on `cluster`;
/// HTTP connection limits into `http` (the cluster's upstream HTTP options).
pub fn apply(
    cluster: &mut Cluster,
    http: Option<&mut CommonHttpOptions>,
    policy: &EffectivePolicy,
) {
    cluster.lb_policy = LbPolicy::LeastRequest as i32;
    if let Some(lb) = &policy.load_balancer {
        if let Some(ch) = &lb.consistent_hash {
            if ch.maglev.is_some() {
                cluster.lb_policy = LbPolicy::Maglev as i32;
                cluster.lb_config = Some(LbConfig::MaglevLbConfig(MaglevLbConfig {
                    table_size: ch
                        .maglev
                        .as_ref()
                        .and_then(|m| m.table_size)
                        .map(|v| UInt64Value { value: v }),
                }));
            } else {
                cluster.lb_policy = LbPolicy::RingHash as i32;
                let min = ch
                    .ring_hash
                    .as_ref()
                    .and_then(|r| r.minimum_ring_size)
                    .or(ch.minimum_ring_size);
                cluster.lb_config = Some(LbConfig::RingHashLbConfig(RingHashLbConfig {
                    minimum_ring_size: min.map(|v| UInt64Value { value: v }),
                    ..Default::default()
                }));
            }
        } else {
            cluster.lb_policy = match lb.simple.unwrap_or_default() {
                SimpleLb::RoundRobin => LbPolicy::RoundRobin,
                SimpleLb::Random => LbPolicy::Random,
                // Istio's default (and LEAST_CONN, its old spelling).
                _ => LbPolicy::LeastRequest,
            } as i32;
        }
    }
    if let Some(cp) = &policy.connection_pool {
        let mut t = Thresholds::default();
        if let Some(tcp) = &cp.tcp {
            t.max_connections = tcp.max_connections.map(u32_value);
            if let Some(d) = tcp.connect_timeout {
                cluster.connect_timeout = Some(duration(d));
            }
        }
        if let Some(h) = &cp.http {
            t.max_pending_requests = h.http1_max_pending_requests.map(u32_value);
            t.max_requests = h.http2_max_requests.map(u32_value);
            t.max_retries = h.max_retries.map(u32_value);
            if let Some(opts) = http {
                opts.max_requests_per_connection = h.max_requests_per_connection.map(u32_value);
                opts.idle_timeout = h.idle_timeout.map(duration);
            }
        }
        cluster.circuit_breakers = Some(CircuitBreakers {
            thresholds: vec![t],
            ..Default::default()
        });
    }
    if let Some(od) = &policy.outlier_detection {
        cluster.outlier_detection = Some(outlier(od));
    }
}

/// Istio's defaults for what an OutlierDetection leaves out.
fn outlier(od: &OutlierDetection) -> EnvoyOutlier {
    let mut o = EnvoyOutlier {
        interval: Some(duration(od.interval.unwrap_or(Duration::from_secs(10)))),
        base_ejection_time: Some(duration(
            od.base_ejection_time.unwrap_or(Duration::from_secs(30)),
        )),
        max_ejection_percent: Some(u32_value(od.max_ejection_percent.unwrap_or(10))),
        // Only the kinds of failures configured count.
        enforcing_consecutive_5xx: Some(u32_value(0)),
        enforcing_consecutive_gateway_failure: Some(u32_value(0)),
        enforcing_success_rate: Some(u32_value(0)),
        ..Default::default()
    };
    if let Some(n) = od.consecutive_5xx_errors.filter(|n| *n > 0) {
        o.consecutive_5xx = Some(u32_value(n));
        o.enforcing_consecutive_5xx = Some(u32_value(100));
    }
    if let Some(n) = od.consecutive_gateway_errors.filter(|n| *n > 0) {
        o.consecutive_gateway_failure = Some(u32_value(n));
        o.enforcing_consecutive_gateway_failure = Some(u32_value(100));
    }
    if let Some(n) = od.consecutive_local_origin_failures.filter(|n| *n > 0) {
        o.consecutive_local_origin_failure = Some(u32_value(n));
        o.enforcing_consecutive_local_origin_failure = Some(u32_value(100));
        o.split_external_local_origin_errors = true;
    }
    // `minHealthPercent` maps to the cluster's panic threshold, which is
    // left at Envoy's default (50 %).
    o
}

/// The route hash policy a consistent-hash load balancer needs.
pub fn hash_policy(policy: &EffectivePolicy) -> Vec<HashPolicy> {
    let Some(ch) = policy
        .load_balancer
        .as_ref()
        .and_then(|lb| lb.consistent_hash.as_ref())
    else {
        return Vec::new();
    };
    let specifier = match &ch.hash_key {
        HashKey::HttpHeaderName(h) => hash_policy::PolicySpecifier::Header(hash_policy::Header {
            header_name: h.clone(),
            ..Default::default()
        }),
        HashKey::HttpCookie(c) => hash_policy::PolicySpecifier::Cookie(hash_policy::Cookie {
            name: c.name.clone(),
            path: c.path.clone(),
            ttl: c.ttl.map(duration),
            ..Default::default()
        }),
        HashKey::UseSourceIp => {
            hash_policy::PolicySpecifier::ConnectionProperties(hash_policy::ConnectionProperties {
                source_ip: true,
            })
        }
        HashKey::HttpQueryParameterName(q) => {
            hash_policy::PolicySpecifier::QueryParameter(hash_policy::QueryParameter {
                name: q.clone(),
            })
        }
    };
    vec![HashPolicy {
        policy_specifier: Some(specifier),
        ..Default::default()
    }]
}

/// A route hash policy (for the route builder's signatures).
pub type HashPolicyT = HashPolicy;

/// The port-level value when there is one, else the level's own.
fn pick<T: Clone>(own: &Option<T>, per_port: Option<&Option<T>>) -> Option<T> {
    per_port.and_then(|p| p.clone()).or_else(|| own.clone())
}
