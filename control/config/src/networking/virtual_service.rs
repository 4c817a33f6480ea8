//! `networking.istio.io` VirtualService: ordered HTTP, TLS and TCP routing
//! rules for a set of hosts.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::PortSelector;
use crate::objects::{Cidr, Labels, ObjectMeta, nullable, optional_port_number};
use crate::scalars::{
    CheckOnDecode, ScalarError, check_regex, checked_list, checked_option, count, http_status,
    istio_duration, istio_weight, optional_http_status, optional_istio_duration,
    optional_whole_percent, percentage, regex,
};

/// Why a part of a VirtualService is unusable. Every message ends with what
/// to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VirtualServiceError {
    #[error("{0} and {1} are both set; a string match takes exactly one of exact, prefix, regex")]
    TwoStringMatchForms(&'static str, &'static str),
    #[error(
        "{0} and {1} are both set; an HTTP route takes exactly one of route, redirect, directResponse, delegate"
    )]
    TwoHttpActions(&'static str, &'static str),
    #[error(
        "the HTTP route has no action; give it one of route, redirect, directResponse, delegate"
    )]
    NoHttpAction,
    #[error("mirror and mirrors are both set; list every mirror under mirrors")]
    MirrorAndMirrors,
    #[error(
        "the route's destination weights sum to {0}, not 100; make them add up to 100 (e.g. 80 and 20 — 100 and 0 to send everything to one)"
    )]
    WeightSum(u64),
    #[error("the abort sets {0}; set exactly one of httpStatus, grpcStatus, http2Error")]
    AbortStatus(&'static str),
    #[error(transparent)]
    Scalar(#[from] ScalarError),
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct VirtualService {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: VirtualServiceSpec,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct VirtualServiceSpec {
    /// Destination hosts the rules apply to (short names, FQDNs, wildcards,
    /// IPs); empty in a delegate VirtualService.
    #[serde(deserialize_with = "nullable")]
    pub hosts: Vec<String>,
    /// Gateways (`ns/name`) and/or `mesh`; empty means `mesh`.
    #[serde(deserialize_with = "nullable")]
    pub gateways: Vec<String>,
    /// The HTTP rules, in order: the first match wins.
    #[serde(deserialize_with = "checked_list")]
    pub http: Vec<HttpRoute>,
    #[serde(deserialize_with = "nullable")]
    pub tls: Vec<TlsRoute>,
    #[serde(deserialize_with = "nullable")]
    pub tcp: Vec<TcpRoute>,
    #[serde(deserialize_with = "nullable")]
    pub export_to: Vec<String>,
}

/// One HTTP rule: match conditions and what to do with matching requests.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRoute {
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    /// Any one of these matches (OR); empty matches every request.
    #[serde(rename = "match", deserialize_with = "nullable")]
    pub matches: Vec<HttpMatchRequest>,
    #[serde(deserialize_with = "nullable")]
    pub route: Vec<HttpRouteDestination>,
    pub redirect: Option<HttpRedirect>,
    pub direct_response: Option<HttpDirectResponse>,
    /// Decoded; the control plane may not support delegation.
    pub delegate: Option<Delegate>,
    pub rewrite: Option<HttpRewrite>,
    #[serde(deserialize_with = "optional_istio_duration")]
    pub timeout: Option<Duration>,
    pub retries: Option<HttpRetry>,
    pub fault: Option<HttpFaultInjection>,
    pub mirror: Option<Destination>,
    #[serde(deserialize_with = "nullable")]
    pub mirrors: Vec<HttpMirrorPolicy>,
    /// Share of requests mirrored to `mirror` (all when absent).
    pub mirror_percentage: Option<Percent>,
    /// Decoded only.
    pub cors_policy: Option<CorsPolicy>,
    pub headers: Option<Headers>,
}

impl CheckOnDecode for HttpRoute {
    type Error = VirtualServiceError;
    fn check(&self) -> Result<(), VirtualServiceError> {
        let set: Vec<&'static str> = [
            (!self.route.is_empty(), "route"),
            (self.redirect.is_some(), "redirect"),
            (self.direct_response.is_some(), "directResponse"),
            (self.delegate.is_some(), "delegate"),
        ]
        .into_iter()
        .filter_map(|(present, name)| present.then_some(name))
        .collect();
        match set[..] {
            [] => return Err(VirtualServiceError::NoHttpAction),
            [_] => {}
            [a, b, ..] => return Err(VirtualServiceError::TwoHttpActions(a, b)),
        }
        if self.mirror.is_some() && !self.mirrors.is_empty() {
            return Err(VirtualServiceError::MirrorAndMirrors);
        }
        // Istio's rule: weights of several destinations add up to 100; a
        // lone destination may leave its weight out.
        let sum: u64 = self.route.iter().map(|d| u64::from(d.weight)).sum();
        let lone_default = self.route.len() == 1 && matches!(sum, 0 | 100);
        if !self.route.is_empty() && !lone_default && sum != 100 {
            return Err(VirtualServiceError::WeightSum(sum));
        }
        Ok(())
    }
}

impl HttpRoute {
    /// Every destination this rule sends or mirrors traffic to.
    pub fn destinations(&self) -> impl Iterator<Item = &Destination> {
        self.route
            .iter()
            .map(|r| &r.destination)
            .chain(self.mirror.as_ref())
            .chain(self.mirrors.iter().map(|m| &m.destination))
    }
}

/// Conditions on a request; every condition given must hold (AND).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpMatchRequest {
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    pub uri: Option<StringMatch>,
    pub scheme: Option<StringMatch>,
    pub method: Option<StringMatch>,
    pub authority: Option<StringMatch>,
    /// Header name (lowercase) -> value match; [`StringMatch::Any`] means
    /// the header must be present.
    #[serde(deserialize_with = "nullable")]
    pub headers: BTreeMap<String, StringMatch>,
    /// Headers that must not match.
    #[serde(deserialize_with = "nullable")]
    pub without_headers: BTreeMap<String, StringMatch>,
    #[serde(deserialize_with = "nullable")]
    pub query_params: BTreeMap<String, StringMatch>,
    #[serde(deserialize_with = "optional_port_number")]
    pub port: Option<u16>,
    #[serde(deserialize_with = "nullable")]
    pub source_labels: Labels,
    #[serde(deserialize_with = "nullable")]
    pub source_namespace: String,
    #[serde(deserialize_with = "nullable")]
    pub ignore_uri_case: bool,
    #[serde(deserialize_with = "nullable")]
    pub gateways: Vec<String>,
}

/// How a string is matched: `{exact: ...}`, `{prefix: ...}` or
/// `{regex: ...}` (RE2); an empty match (`{}`) is [`StringMatch::Any`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(try_from = "StringMatchFields")]
pub enum StringMatch {
    Exact(String),
    Prefix(String),
    Regex(String),
    /// No form given: any value (for headers and query parameters: the
    /// key must be present).
    #[default]
    Any,
}

/// A [`StringMatch`] as written, before its one form is picked.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StringMatchFields {
    exact: Option<String>,
    prefix: Option<String>,
    regex: Option<String>,
}

impl TryFrom<StringMatchFields> for StringMatch {
    type Error = VirtualServiceError;
    fn try_from(f: StringMatchFields) -> Result<Self, VirtualServiceError> {
        match (f.exact, f.prefix, f.regex) {
            (Some(_), Some(_), _) => {
                Err(VirtualServiceError::TwoStringMatchForms("exact", "prefix"))
            }
            (Some(_), _, Some(_)) => {
                Err(VirtualServiceError::TwoStringMatchForms("exact", "regex"))
            }
            (_, Some(_), Some(_)) => {
                Err(VirtualServiceError::TwoStringMatchForms("prefix", "regex"))
            }
            (Some(s), None, None) => Ok(StringMatch::Exact(s)),
            (None, Some(s), None) => Ok(StringMatch::Prefix(s)),
            (None, None, Some(s)) => {
                check_regex(&s)?;
                Ok(StringMatch::Regex(s))
            }
            (None, None, None) => Ok(StringMatch::Any),
        }
    }
}

/// Where traffic goes: a service host (short name, FQDN or ServiceEntry
/// host), optionally a subset of a DestinationRule and a port.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Destination {
    pub host: String,
    #[serde(default, deserialize_with = "nullable")]
    pub subset: String,
    #[serde(default)]
    pub port: Option<PortSelector>,
}

/// A weighted destination of an HTTP rule.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteDestination {
    pub destination: Destination,
    /// Share of traffic (weights of a rule should sum to 100; a lone
    /// destination with weight 0 gets everything).
    #[serde(default, deserialize_with = "istio_weight")]
    pub weight: u32,
    #[serde(default)]
    pub headers: Option<Headers>,
}

/// A weighted destination of a TCP or TLS rule.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteDestination {
    pub destination: Destination,
    #[serde(default, deserialize_with = "istio_weight")]
    pub weight: u32,
}

/// Header edits on the request and on the response.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Headers {
    pub request: Option<HeaderOperations>,
    pub response: Option<HeaderOperations>,
}

/// Headers to overwrite, to append and to remove.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HeaderOperations {
    #[serde(deserialize_with = "nullable")]
    pub set: BTreeMap<String, String>,
    #[serde(deserialize_with = "nullable")]
    pub add: BTreeMap<String, String>,
    #[serde(deserialize_with = "nullable")]
    pub remove: Vec<String>,
}

/// An HTTP redirect answered by the proxy.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRedirect {
    #[serde(deserialize_with = "nullable")]
    pub uri: String,
    #[serde(deserialize_with = "nullable")]
    pub authority: String,
    #[serde(deserialize_with = "optional_port_number")]
    pub port: Option<u16>,
    #[serde(deserialize_with = "nullable")]
    pub scheme: String,
    /// 301 when absent.
    pub redirect_code: Option<u16>,
}

/// A fixed response answered by the proxy.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpDirectResponse {
    #[serde(deserialize_with = "http_status")]
    pub status: u16,
    #[serde(default)]
    pub body: Option<HttpBody>,
}

/// A direct response body: text or base64 bytes.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpBody {
    pub string: Option<String>,
    pub bytes: Option<String>,
}

/// Hands the rule over to another VirtualService (decoded only).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Delegate {
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "nullable")]
    pub namespace: String,
}

/// Rewrites of the path and authority before forwarding.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRewrite {
    /// Replaces the matched prefix (or the whole path for exact matches).
    #[serde(deserialize_with = "nullable")]
    pub uri: String,
    #[serde(deserialize_with = "nullable")]
    pub authority: String,
    pub uri_regex_rewrite: Option<RegexRewrite>,
}

/// A regex substitution on the path.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RegexRewrite {
    #[serde(rename = "match", deserialize_with = "regex")]
    pub pattern: String,
    #[serde(deserialize_with = "nullable")]
    pub rewrite: String,
}

/// The retry policy of an HTTP rule.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRetry {
    #[serde(deserialize_with = "count")]
    pub attempts: u32,
    #[serde(deserialize_with = "optional_istio_duration")]
    pub per_try_timeout: Option<Duration>,
    /// Comma-separated Envoy retry conditions (`5xx,reset`).
    #[serde(deserialize_with = "nullable")]
    pub retry_on: String,
    pub retry_remote_localities: Option<bool>,
}

impl HttpRetry {
    /// The retry conditions, trimmed, without empty entries.
    pub fn retry_conditions(&self) -> impl Iterator<Item = &str> {
        self.retry_on
            .split(',')
            .map(str::trim)
            .filter(|c| !c.is_empty())
    }
}

/// Faults injected into matching requests.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpFaultInjection {
    pub delay: Option<FaultDelay>,
    #[serde(deserialize_with = "checked_option")]
    pub abort: Option<FaultAbort>,
}

/// Delay a share of requests.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FaultDelay {
    #[serde(deserialize_with = "istio_duration")]
    pub fixed_delay: Duration,
    /// Share of requests delayed (all when neither this nor `percent`).
    #[serde(default)]
    pub percentage: Option<Percent>,
    /// Deprecated whole-number form of `percentage`.
    #[serde(default, deserialize_with = "optional_whole_percent")]
    pub percent: Option<u32>,
}

/// Abort a share of requests with an error.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct FaultAbort {
    #[serde(deserialize_with = "optional_http_status")]
    pub http_status: Option<u16>,
    /// A gRPC status name (`UNAVAILABLE`) or number.
    pub grpc_status: Option<String>,
    pub http2_error: Option<String>,
    pub percentage: Option<Percent>,
}

impl CheckOnDecode for FaultAbort {
    type Error = VirtualServiceError;
    fn check(&self) -> Result<(), VirtualServiceError> {
        let set = [
            self.http_status.is_some(),
            self.grpc_status.is_some(),
            self.http2_error.is_some(),
        ]
        .into_iter()
        .filter(|s| *s)
        .count();
        match set {
            1 => Ok(()),
            0 => Err(VirtualServiceError::AbortStatus("none of them")),
            _ => Err(VirtualServiceError::AbortStatus("more than one of them")),
        }
    }
}

/// A percentage, 0 to 100 (`{value: 12.5}`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Deserialize)]
#[serde(default)]
pub struct Percent {
    #[serde(deserialize_with = "percentage")]
    pub value: f64,
}

/// A mirror destination with its own share of requests.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpMirrorPolicy {
    pub destination: Destination,
    #[serde(default)]
    pub percentage: Option<Percent>,
}

/// Cross-origin resource sharing (decoded only).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct CorsPolicy {
    #[serde(deserialize_with = "nullable")]
    pub allow_origins: Vec<StringMatch>,
    #[serde(deserialize_with = "nullable")]
    pub allow_methods: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub allow_headers: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub expose_headers: Vec<String>,
    #[serde(deserialize_with = "optional_istio_duration")]
    pub max_age: Option<Duration>,
    pub allow_credentials: Option<bool>,
}

/// One TCP rule.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TcpRoute {
    #[serde(rename = "match", deserialize_with = "nullable")]
    pub matches: Vec<L4MatchAttributes>,
    #[serde(deserialize_with = "nullable")]
    pub route: Vec<RouteDestination>,
}

/// Conditions on a connection.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct L4MatchAttributes {
    #[serde(deserialize_with = "nullable")]
    pub destination_subnets: Vec<Cidr>,
    #[serde(deserialize_with = "optional_port_number")]
    pub port: Option<u16>,
    #[serde(deserialize_with = "nullable")]
    pub source_labels: Labels,
    #[serde(deserialize_with = "nullable")]
    pub source_namespace: String,
    #[serde(deserialize_with = "nullable")]
    pub gateways: Vec<String>,
}

/// One TLS (SNI) rule (decoded only).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TlsRoute {
    #[serde(rename = "match", deserialize_with = "nullable")]
    pub matches: Vec<TlsMatchAttributes>,
    #[serde(deserialize_with = "nullable")]
    pub route: Vec<RouteDestination>,
}

/// Conditions on a TLS connection.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TlsMatchAttributes {
    #[serde(deserialize_with = "nullable")]
    pub sni_hosts: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub destination_subnets: Vec<Cidr>,
    #[serde(deserialize_with = "optional_port_number")]
    pub port: Option<u16>,
    #[serde(deserialize_with = "nullable")]
    pub source_labels: Labels,
    #[serde(deserialize_with = "nullable")]
    pub source_namespace: String,
    #[serde(deserialize_with = "nullable")]
    pub gateways: Vec<String>,
}

impl VirtualServiceSpec {
    /// Every destination the rules send or mirror traffic to, in rule
    /// order: HTTP (routes, then mirrors), TLS, TCP.
    pub fn destinations(&self) -> impl Iterator<Item = &Destination> {
        let tls = self.tls.iter().flat_map(|r| &r.route);
        let tcp = self.tcp.iter().flat_map(|r| &r.route);
        self.http
            .iter()
            .flat_map(HttpRoute::destinations)
            .chain(tls.chain(tcp).map(|r| &r.destination))
    }

    /// True when the rules apply to mesh traffic (sidecars and waypoints):
    /// `gateways` is empty or names `mesh`.
    pub fn applies_to_mesh(&self) -> bool {
        self.gateways.is_empty() || self.gateways.iter().any(|g| g == "mesh")
    }
}

impl VirtualService {
    /// Every destination the VirtualService sends or mirrors traffic to.
    pub fn destinations(&self) -> impl Iterator<Item = &Destination> {
        self.spec.destinations()
    }
}
