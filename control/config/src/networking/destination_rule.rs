//! `networking.istio.io` DestinationRule: the traffic policy (load
//! balancing, connection pool, outlier detection, TLS) of a host, and its
//! subsets (versions by label).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::PortSelector;
use crate::objects::{LabelSelector, Labels, ObjectMeta, nullable, selector_matches};
use crate::scalars::{
    CheckOnDecode, checked_option, optional_count, optional_istio_duration, optional_whole_percent,
};

/// Why a part of a DestinationRule is unusable. Every message ends with what
/// to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DestinationRuleError {
    #[error("{0} and {1} are both set; a load balancer takes either simple or consistentHash")]
    TwoLoadBalancers(&'static str, &'static str),
    #[error(
        "{0} and {1} are both set; a consistent hash takes exactly one of httpHeaderName, httpCookie, useSourceIp, httpQueryParameterName"
    )]
    TwoHashKeys(&'static str, &'static str),
    #[error(
        "the consistent hash has no key; set one of httpHeaderName, httpCookie, useSourceIp, httpQueryParameterName"
    )]
    NoHashKey,
    #[error("ringHash and maglev are both set; choose one hash algorithm")]
    TwoHashAlgorithms,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct DestinationRule {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: DestinationRuleSpec,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct DestinationRuleSpec {
    /// The service the rule applies to (short name, FQDN, wildcard).
    #[serde(deserialize_with = "nullable")]
    pub host: String,
    pub traffic_policy: Option<TrafficPolicy>,
    /// Named versions of the service, each a label selector.
    #[serde(deserialize_with = "nullable")]
    pub subsets: Vec<Subset>,
    #[serde(deserialize_with = "nullable")]
    pub export_to: Vec<String>,
    /// The workloads (sidecars) the rule applies to, by `matchLabels`
    /// (Istio's `type.v1beta1.WorkloadSelector`, unlike the `labels` of a
    /// Sidecar's or ServiceEntry's selector).
    pub workload_selector: Option<LabelSelector>,
}

impl DestinationRule {
    /// The subset called `name`.
    pub fn subset(&self, name: &str) -> Option<&Subset> {
        self.spec.subsets.iter().find(|s| s.name == name)
    }

    /// The subset names, in order.
    pub fn subset_names(&self) -> impl Iterator<Item = &str> {
        self.spec.subsets.iter().map(|s| s.name.as_str())
    }
}

/// A named version of a service: the endpoints whose labels match.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Subset {
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "nullable")]
    pub labels: Labels,
    /// Overrides the rule's policy for this subset.
    pub traffic_policy: Option<TrafficPolicy>,
}

impl Subset {
    /// True when an endpoint with `labels` belongs to this subset.
    pub fn selects(&self, labels: &Labels) -> bool {
        selector_matches(&self.labels, labels)
    }
}

/// How traffic to a host (or subset) is handled.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TrafficPolicy {
    #[serde(deserialize_with = "checked_option")]
    pub load_balancer: Option<LoadBalancerSettings>,
    pub connection_pool: Option<ConnectionPoolSettings>,
    pub outlier_detection: Option<OutlierDetection>,
    pub tls: Option<ClientTlsSettings>,
    /// Per-port overrides of the policy above.
    #[serde(deserialize_with = "nullable")]
    pub port_level_settings: Vec<PortTrafficPolicy>,
}

impl TrafficPolicy {
    /// The override for `port`, if any.
    pub fn port_settings(&self, port: u16) -> Option<&PortTrafficPolicy> {
        self.port_level_settings
            .iter()
            .find(|p| p.port.is_some_and(|p| p.number == port))
    }
}

/// The policy of one port (`portLevelSettings`).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PortTrafficPolicy {
    pub port: Option<PortSelector>,
    #[serde(deserialize_with = "checked_option")]
    pub load_balancer: Option<LoadBalancerSettings>,
    pub connection_pool: Option<ConnectionPoolSettings>,
    pub outlier_detection: Option<OutlierDetection>,
    pub tls: Option<ClientTlsSettings>,
}

/// How an endpoint is picked.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LoadBalancerSettings {
    pub simple: Option<SimpleLb>,
    pub consistent_hash: Option<ConsistentHashLb>,
    /// Decoded only.
    pub locality_lb_setting: Option<LocalityLbSetting>,
    /// Ramp-up time of a new endpoint's share of traffic.
    #[serde(deserialize_with = "optional_istio_duration")]
    pub warmup_duration_secs: Option<Duration>,
}

impl CheckOnDecode for LoadBalancerSettings {
    type Error = DestinationRuleError;
    fn check(&self) -> Result<(), DestinationRuleError> {
        if self.simple.is_some() && self.consistent_hash.is_some() {
            return Err(DestinationRuleError::TwoLoadBalancers(
                "simple",
                "consistentHash",
            ));
        }
        Ok(())
    }
}

/// A simple load-balancing algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SimpleLb {
    /// The proxy's default (least request in Envoy).
    #[default]
    Unspecified,
    RoundRobin,
    /// `LEAST_CONN` is its deprecated name.
    #[serde(alias = "LEAST_CONN")]
    LeastRequest,
    Random,
    /// Forward to the address the caller asked for.
    Passthrough,
}

/// Session affinity by a hash of some request property.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "ConsistentHashFields")]
pub struct ConsistentHashLb {
    pub hash_key: HashKey,
    /// Deprecated ring size (use `ring_hash`).
    pub minimum_ring_size: Option<u64>,
    pub ring_hash: Option<RingHash>,
    pub maglev: Option<Maglev>,
}

/// What a consistent hash hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashKey {
    HttpHeaderName(String),
    HttpCookie(HttpCookie),
    UseSourceIp,
    HttpQueryParameterName(String),
}

/// A consistent hash as written, before its key is picked.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct ConsistentHashFields {
    http_header_name: Option<String>,
    http_cookie: Option<HttpCookie>,
    use_source_ip: Option<bool>,
    http_query_parameter_name: Option<String>,
    minimum_ring_size: Option<u64>,
    ring_hash: Option<RingHash>,
    maglev: Option<Maglev>,
}

impl TryFrom<ConsistentHashFields> for ConsistentHashLb {
    type Error = DestinationRuleError;
    fn try_from(f: ConsistentHashFields) -> Result<Self, DestinationRuleError> {
        let mut keys: Vec<(&'static str, HashKey)> = Vec::new();
        if let Some(h) = f.http_header_name {
            keys.push(("httpHeaderName", HashKey::HttpHeaderName(h)));
        }
        if let Some(c) = f.http_cookie {
            keys.push(("httpCookie", HashKey::HttpCookie(c)));
        }
        if f.use_source_ip == Some(true) {
            keys.push(("useSourceIp", HashKey::UseSourceIp));
        }
        if let Some(q) = f.http_query_parameter_name {
            keys.push(("httpQueryParameterName", HashKey::HttpQueryParameterName(q)));
        }
        if f.ring_hash.is_some() && f.maglev.is_some() {
            return Err(DestinationRuleError::TwoHashAlgorithms);
        }
        let hash_key = match keys.len() {
            0 => return Err(DestinationRuleError::NoHashKey),
            1 => keys.remove(0).1,
            _ => return Err(DestinationRuleError::TwoHashKeys(keys[0].0, keys[1].0)),
        };
        Ok(ConsistentHashLb {
            hash_key,
            minimum_ring_size: f.minimum_ring_size,
            ring_hash: f.ring_hash,
            maglev: f.maglev,
        })
    }
}

/// A cookie hashed for affinity (generated with `ttl` when absent).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpCookie {
    pub name: String,
    #[serde(default, deserialize_with = "nullable")]
    pub path: String,
    #[serde(default, deserialize_with = "optional_istio_duration")]
    pub ttl: Option<Duration>,
}

/// Ring hash (Ketama) settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RingHash {
    pub minimum_ring_size: Option<u64>,
}

/// Maglev settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Maglev {
    pub table_size: Option<u64>,
}

/// Locality-weighted load balancing (decoded only).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LocalityLbSetting {
    #[serde(deserialize_with = "nullable")]
    pub distribute: Vec<LocalityDistribute>,
    #[serde(deserialize_with = "nullable")]
    pub failover: Vec<LocalityFailover>,
    #[serde(deserialize_with = "nullable")]
    pub failover_priority: Vec<String>,
    pub enabled: Option<bool>,
}

/// Traffic from one locality spread over others by weight.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LocalityDistribute {
    #[serde(deserialize_with = "nullable")]
    pub from: String,
    #[serde(deserialize_with = "nullable")]
    pub to: BTreeMap<String, u32>,
}

/// The region traffic fails over to.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LocalityFailover {
    #[serde(deserialize_with = "nullable")]
    pub from: String,
    #[serde(deserialize_with = "nullable")]
    pub to: String,
}

/// Connection limits towards the host.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ConnectionPoolSettings {
    pub tcp: Option<TcpSettings>,
    pub http: Option<HttpSettings>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TcpSettings {
    #[serde(deserialize_with = "optional_count")]
    pub max_connections: Option<u32>,
    #[serde(deserialize_with = "optional_istio_duration")]
    pub connect_timeout: Option<Duration>,
    pub tcp_keepalive: Option<TcpKeepalive>,
    #[serde(deserialize_with = "optional_istio_duration")]
    pub max_connection_duration: Option<Duration>,
    #[serde(deserialize_with = "optional_istio_duration")]
    pub idle_timeout: Option<Duration>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TcpKeepalive {
    #[serde(deserialize_with = "optional_count")]
    pub probes: Option<u32>,
    #[serde(deserialize_with = "optional_istio_duration")]
    pub time: Option<Duration>,
    #[serde(deserialize_with = "optional_istio_duration")]
    pub interval: Option<Duration>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpSettings {
    #[serde(deserialize_with = "optional_count")]
    pub http1_max_pending_requests: Option<u32>,
    #[serde(deserialize_with = "optional_count")]
    pub http2_max_requests: Option<u32>,
    #[serde(deserialize_with = "optional_count")]
    pub max_requests_per_connection: Option<u32>,
    #[serde(deserialize_with = "optional_count")]
    pub max_retries: Option<u32>,
    #[serde(deserialize_with = "optional_istio_duration")]
    pub idle_timeout: Option<Duration>,
    pub h2_upgrade_policy: Option<H2UpgradePolicy>,
    pub use_client_protocol: Option<bool>,
    #[serde(deserialize_with = "optional_count")]
    pub max_concurrent_streams: Option<u32>,
}

/// Whether HTTP/1.1 connections are upgraded to HTTP/2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum H2UpgradePolicy {
    #[default]
    Default,
    DoNotUpgrade,
    Upgrade,
}

/// Ejection of endpoints that keep failing.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct OutlierDetection {
    #[serde(rename = "consecutive5xxErrors", deserialize_with = "optional_count")]
    pub consecutive_5xx_errors: Option<u32>,
    #[serde(deserialize_with = "optional_count")]
    pub consecutive_gateway_errors: Option<u32>,
    #[serde(deserialize_with = "optional_count")]
    pub consecutive_local_origin_failures: Option<u32>,
    pub split_external_local_origin_errors: Option<bool>,
    #[serde(deserialize_with = "optional_istio_duration")]
    pub interval: Option<Duration>,
    #[serde(deserialize_with = "optional_istio_duration")]
    pub base_ejection_time: Option<Duration>,
    #[serde(deserialize_with = "optional_whole_percent")]
    pub max_ejection_percent: Option<u32>,
    #[serde(deserialize_with = "optional_whole_percent")]
    pub min_health_percent: Option<u32>,
}

/// TLS towards the host.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ClientTlsSettings {
    #[serde(deserialize_with = "nullable")]
    pub mode: ClientTlsMode,
    #[serde(deserialize_with = "nullable")]
    pub client_certificate: String,
    #[serde(deserialize_with = "nullable")]
    pub private_key: String,
    #[serde(deserialize_with = "nullable")]
    pub ca_certificates: String,
    #[serde(deserialize_with = "nullable")]
    pub credential_name: String,
    #[serde(deserialize_with = "nullable")]
    pub subject_alt_names: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub sni: String,
    pub insecure_skip_verify: Option<bool>,
}

/// The TLS mode towards a host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ClientTlsMode {
    #[default]
    Disable,
    Simple,
    Mutual,
    IstioMutual,
}
