//! A waypoint's HTTP routes: one route configuration per HTTP service port
//! of a bound service, named `<hostname>:<port>`, whose virtual host
//! answers to every name the service is reached by, with the service's
//! routing rules (or everything to the service when it has none).

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::DataSource;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderValue, HeaderValueOption, RuntimeFractionalPercent,
    header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::config::route::v3::{
    Decorator, DirectResponseAction, HeaderMatcher, QueryParameterMatcher, RedirectAction,
    RetryPolicy, Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, WeightedCluster,
    header_matcher::HeaderMatchSpecifier,
    query_parameter_matcher::QueryParameterMatchSpecifier,
    redirect_action::{PathRewriteSpecifier, SchemeRewriteSpecifier},
    retry_policy::{RetryHostPredicate, retry_host_predicate},
    route::Action,
    route_action::{ClusterSpecifier, HostRewriteSpecifier, RequestMirrorPolicy},
    route_match::PathSpecifier,
    weighted_cluster::ClusterWeight,
};
use envoy_types::pb::envoy::extensions::filters::common::fault::v3::{
    FaultDelay, fault_delay::FaultDelaySecifier,
};
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::{
    FaultAbort, HttpFault, fault_abort::ErrorType,
};
use envoy_types::pb::envoy::extensions::retry::host::previous_hosts::v3::PreviousHostsPredicate;
use envoy_types::pb::envoy::r#type::matcher::v3::{
    RegexMatchAndSubstitute, RegexMatcher, StringMatcher, string_matcher::MatchPattern,
};
use envoy_types::pb::envoy::r#type::v3::{FractionalPercent, fractional_percent::DenominatorType};

use super::authz;
use super::envoy::{any, bool_value, duration, stable_map, u32_value};
use super::rules::{
    Forward, HeaderEdits, PathRewrite, RequestMatch, RetryRule, RouteRule, RuleAction, TextMatch,
    WeightedDestination, default_retry_on,
};
use super::{BoundService, ROUTE_TYPE, WaypointPlan, cluster_name, policy};
use crate::model::snapshot::XdsResource;

/// The HTTP fault filter's name (per-route configs key on it).
pub const FAULT_FILTER: &str = "envoy.filters.http.fault";

/// The route configuration name of one HTTP service port.
pub fn route_name(hostname: &str, port: u16) -> String {
    format!("{hostname}:{port}")
}

/// Every route configuration of the waypoint.
pub fn routes(plan: &WaypointPlan) -> Vec<XdsResource> {
    let mut out = Vec::new();
    for svc in plan.services.iter().filter(|s| s.bound) {
        for port in svc.ports.iter().filter(|p| p.protocol.is_http()) {
            let name = route_name(&svc.hostname, port.port);
            let mut routes = service_routes(svc, port.port, &plan.services);
            if plan.tracing.is_some() {
                // Spans are named as Istio names them, `host:port/*`.
                let operation = format!("{}:{}/*", svc.hostname, port.port);
                for r in &mut routes {
                    r.decorator = Some(Decorator {
                        operation: operation.clone(),
                        propagate: None,
                    });
                }
            }
            let rc = RouteConfiguration {
                name: name.clone(),
                virtual_hosts: vec![VirtualHost {
                    name: name.clone(),
                    domains: domains(svc, port.port),
                    routes,
                    // The service's L7 authorization for this port.
                    typed_per_filter_config: svc
                        .rbac
                        .get(&port.port)
                        .map(|rbac| stable_map(authz::per_route_configs(rbac)))
                        .unwrap_or_default(),
                    ..Default::default()
                }],
                ..Default::default()
            };
            out.push(XdsResource::new(ROUTE_TYPE, name, Vec::new(), &rc));
        }
    }
    out
}

/// The routes of one HTTP port of `svc`: its rules, or everything to the
/// service when it has none. `services` are the services the proxy knows
/// (destinations resolve against their ports and DestinationRules). The
/// one route translation waypoints and sidecars share.
pub fn service_routes(svc: &BoundService, port: u16, services: &[BoundService]) -> Vec<Route> {
    match svc.rules.get(&port) {
        Some(rules) => rules
            .iter()
            .flat_map(|r| envoy_routes(r, port, services))
            .collect(),
        None => vec![default_route(svc, port, services)],
    }
}

/// Every `Host` a client may send for the service: the hostname and its
/// short forms, each VIP, with and without the port.
pub fn domains(svc: &BoundService, port: u16) -> Vec<String> {
    let mut names = vec![svc.hostname.clone()];
    if let Some(short) = svc.hostname.strip_suffix(".svc.cluster.local") {
        names.push(format!("{short}.svc"));
        names.push(short.to_string());
        if short.ends_with(&format!(".{}", svc.namespace)) {
            names.push(svc.name.clone());
        }
    }
    names.extend(svc.vips.iter().map(|ip| match ip {
        std::net::IpAddr::V4(a) => a.to_string(),
        std::net::IpAddr::V6(a) => format!("[{a}]"),
    }));
    let mut out = Vec::with_capacity(names.len() * 2);
    for n in names {
        out.push(format!("{n}:{port}"));
        out.push(n);
    }
    out.sort();
    out.dedup();
    out
}

/// The cluster a destination resolves to, and the hash policy its
/// DestinationRule asks for. A subset no DestinationRule defines falls
/// back to every endpoint (the planner reported it).
fn resolve(
    d: &WeightedDestination,
    incoming: u16,
    services: &[BoundService],
) -> (String, Vec<policy::HashPolicyT>) {
    let svc = services.iter().find(|s| s.hostname == d.host);
    let port = d.port.unwrap_or_else(|| match svc {
        Some(s) if s.ports.iter().any(|p| p.port == incoming) => incoming,
        Some(s) if s.ports.len() == 1 => s.ports[0].port,
        _ => incoming,
    });
    let dr = svc.and_then(|s| s.destination_rule.as_ref());
    let defined = dr.is_some_and(|dr| dr.spec.subsets.iter().any(|x| x.name == d.subset));
    let subset = if defined { d.subset.as_str() } else { "" };
    let hash = policy::variants(dr, port)
        .into_iter()
        .find(|v| v.subset == subset)
        .map(|v| policy::hash_policy(&v.policy))
        .unwrap_or_default();
    (cluster_name(port, subset, &d.host), hash)
}

fn default_route(svc: &BoundService, port: u16, services: &[BoundService]) -> Route {
    let rule = RouteRule {
        name: "default".to_string(),
        matches: Vec::new(),
        action: RuleAction::Forward(Box::new(Forward {
            destinations: vec![WeightedDestination {
                host: svc.hostname.clone(),
                port: Some(port),
                subset: String::new(),
                weight: 100,
                request_headers: HeaderEdits::default(),
                response_headers: HeaderEdits::default(),
            }],
            ..Default::default()
        })),
    };
    envoy_routes(&rule, port, services).remove(0)
}

/// One Envoy route per match of the rule (a rule without matches matches
/// every request), in order.
fn envoy_routes(rule: &RouteRule, port: u16, services: &[BoundService]) -> Vec<Route> {
    let catch_all = [RequestMatch::default()];
    let matches: &[RequestMatch] = if rule.matches.is_empty() {
        &catch_all
    } else {
        &rule.matches
    };
    matches
        .iter()
        .map(|m| {
            let mut route = Route {
                name: rule.name.clone(),
                r#match: Some(route_match(m)),
                stat_prefix: rule.name.clone(),
                ..Default::default()
            };
            match &rule.action {
                RuleAction::Forward(f) => forward(&mut route, f, m, port, services),
                RuleAction::Redirect {
                    scheme,
                    host,
                    port,
                    path,
                    status,
                } => {
                    route.action = Some(Action::Redirect(RedirectAction {
                        scheme_rewrite_specifier: scheme
                            .clone()
                            .map(SchemeRewriteSpecifier::SchemeRedirect),
                        host_redirect: host.clone().unwrap_or_default(),
                        port_redirect: port.map_or(0, u32::from),
                        path_rewrite_specifier: path.clone().map(PathRewriteSpecifier::PathRedirect),
                        response_code: redirect_code(*status),
                        ..Default::default()
                    }))
                }
                RuleAction::Respond { status, body } => {
                    route.action = Some(Action::DirectResponse(DirectResponseAction {
                        status: u32::from(*status),
                        body: body.clone().map(|b| DataSource {
                            specifier: Some(
                                envoy_types::pb::envoy::config::core::v3::data_source::Specifier::InlineString(b),
                            ),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }))
                }
            }
            route
        })
        .collect()
}

fn redirect_code(status: u16) -> i32 {
    use envoy_types::pb::envoy::config::route::v3::redirect_action::RedirectResponseCode as C;
    let code = match status {
        302 => C::Found,
        303 => C::SeeOther,
        307 => C::TemporaryRedirect,
        308 => C::PermanentRedirect,
        _ => C::MovedPermanently,
    };
    code as i32
}

fn string_matcher(m: &TextMatch, ignore_case: bool) -> Option<StringMatcher> {
    let pattern = match m {
        TextMatch::Exact(s) => MatchPattern::Exact(s.clone()),
        TextMatch::Prefix(s) => MatchPattern::Prefix(s.clone()),
        TextMatch::Regex(s) => MatchPattern::SafeRegex(RegexMatcher {
            regex: s.clone(),
            ..Default::default()
        }),
        TextMatch::Present => return None,
    };
    Some(StringMatcher {
        match_pattern: Some(pattern),
        ignore_case,
    })
}

fn route_match(m: &RequestMatch) -> RouteMatch {
    let path = match &m.path {
        None => PathSpecifier::Prefix("/".to_string()),
        Some(TextMatch::Exact(p)) => PathSpecifier::Path(p.clone()),
        Some(TextMatch::Prefix(p)) => PathSpecifier::Prefix(p.clone()),
        Some(TextMatch::Regex(r)) => PathSpecifier::SafeRegex(RegexMatcher {
            regex: r.clone(),
            ..Default::default()
        }),
        Some(TextMatch::Present) => PathSpecifier::Prefix("/".to_string()),
    };
    RouteMatch {
        path_specifier: Some(path),
        case_sensitive: m.ignore_path_case.then_some(bool_value(false)),
        headers: m
            .headers
            .iter()
            .map(|(name, t, invert)| HeaderMatcher {
                name: name.clone(),
                header_match_specifier: Some(match string_matcher(t, false) {
                    Some(sm) => HeaderMatchSpecifier::StringMatch(sm),
                    None => HeaderMatchSpecifier::PresentMatch(true),
                }),
                invert_match: *invert,
                ..Default::default()
            })
            .collect(),
        query_parameters: m
            .query
            .iter()
            .map(|(name, t)| QueryParameterMatcher {
                name: name.clone(),
                query_parameter_match_specifier: Some(match string_matcher(t, false) {
                    Some(sm) => QueryParameterMatchSpecifier::StringMatch(sm),
                    None => QueryParameterMatchSpecifier::PresentMatch(true),
                }),
            })
            .collect(),
        ..Default::default()
    }
}

fn header_options(edits: &HeaderEdits) -> Vec<HeaderValueOption> {
    let opt = |(k, v): &(String, String), action: HeaderAppendAction| HeaderValueOption {
        header: Some(HeaderValue {
            key: k.clone(),
            value: v.clone(),
            ..Default::default()
        }),
        append_action: action as i32,
        ..Default::default()
    };
    edits
        .set
        .iter()
        .map(|h| opt(h, HeaderAppendAction::OverwriteIfExistsOrAdd))
        .chain(
            edits
                .add
                .iter()
                .map(|h| opt(h, HeaderAppendAction::AppendIfExistsOrAdd)),
        )
        .collect()
}

/// A share of requests in Envoy's terms (parts per million).
fn percent(p: f64) -> FractionalPercent {
    FractionalPercent {
        numerator: (p.clamp(0.0, 100.0) * 10_000.0).round() as u32,
        denominator: DenominatorType::Million as i32,
    }
}

fn retry_policy(r: Option<&RetryRule>) -> Option<RetryPolicy> {
    let (attempts, per_try, on, codes) = match r {
        // Istio's default for mesh routes.
        None => (2, None, default_retry_on(), vec![503]),
        Some(r) if r.attempts == 0 => return None,
        Some(r) => (
            r.attempts,
            r.per_try_timeout,
            r.retry_on.clone(),
            r.status_codes.clone(),
        ),
    };
    Some(RetryPolicy {
        retry_on: on.join(","),
        num_retries: Some(u32_value(attempts)),
        per_try_timeout: per_try.map(duration),
        retriable_status_codes: codes,
        retry_host_predicate: vec![RetryHostPredicate {
            name: "envoy.retry_host_predicates.previous_hosts".to_string(),
            config_type: Some(retry_host_predicate::ConfigType::TypedConfig(any(
                &PreviousHostsPredicate::default(),
            ))),
        }],
        host_selection_retry_max_attempts: 5,
        ..Default::default()
    })
}

fn forward(route: &mut Route, f: &Forward, m: &RequestMatch, port: u16, services: &[BoundService]) {
    let mut action = RouteAction {
        // Istio: no route timeout unless one is configured.
        timeout: Some(duration(f.timeout.unwrap_or(Duration::ZERO))),
        retry_policy: retry_policy(f.retries.as_ref()),
        ..Default::default()
    };
    let mut hashes = Vec::new();
    if let [only] = f.destinations.as_slice() {
        let (cluster, hash) = resolve(only, port, services);
        action.cluster_specifier = Some(ClusterSpecifier::Cluster(cluster));
        hashes.extend(hash);
        route
            .request_headers_to_add
            .extend(header_options(&only.request_headers));
        route
            .request_headers_to_remove
            .extend(only.request_headers.remove.clone());
        route
            .response_headers_to_add
            .extend(header_options(&only.response_headers));
        route
            .response_headers_to_remove
            .extend(only.response_headers.remove.clone());
    } else {
        let clusters = f
            .destinations
            .iter()
            .map(|d| {
                let (name, hash) = resolve(d, port, services);
                hashes.extend(hash);
                ClusterWeight {
                    name,
                    weight: Some(u32_value(d.weight)),
                    request_headers_to_add: header_options(&d.request_headers),
                    request_headers_to_remove: d.request_headers.remove.clone(),
                    response_headers_to_add: header_options(&d.response_headers),
                    response_headers_to_remove: d.response_headers.remove.clone(),
                    ..Default::default()
                }
            })
            .collect();
        action.cluster_specifier = Some(ClusterSpecifier::WeightedClusters(WeightedCluster {
            clusters,
            ..Default::default()
        }));
    }
    for p in hashes {
        if !action.hash_policy.contains(&p) {
            action.hash_policy.push(p);
        }
    }
    action.request_mirror_policies = f
        .mirrors
        .iter()
        .map(|mi| RequestMirrorPolicy {
            cluster: resolve(&mi.destination, port, services).0,
            runtime_fraction: Some(RuntimeFractionalPercent {
                default_value: Some(percent(mi.percent)),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    match &f.rewrite_path {
        Some(PathRewrite::Prefix(p)) if matches!(m.path, Some(TextMatch::Prefix(_)) | None) => {
            action.prefix_rewrite = p.clone();
        }
        Some(PathRewrite::Prefix(p)) | Some(PathRewrite::Full(p)) => {
            action.regex_rewrite = Some(regex_rewrite("^.*$", p));
        }
        Some(PathRewrite::Regex {
            pattern,
            substitution,
        }) => action.regex_rewrite = Some(regex_rewrite(pattern, substitution)),
        None => {}
    }
    if let Some(h) = &f.rewrite_host {
        action.host_rewrite_specifier = Some(HostRewriteSpecifier::HostRewriteLiteral(h.clone()));
    }
    route
        .request_headers_to_add
        .extend(header_options(&f.request_headers));
    route
        .request_headers_to_remove
        .extend(f.request_headers.remove.clone());
    route
        .response_headers_to_add
        .extend(header_options(&f.response_headers));
    route
        .response_headers_to_remove
        .extend(f.response_headers.remove.clone());
    if f.fault.delay.is_some() || f.fault.abort.is_some() {
        let fault = HttpFault {
            delay: f.fault.delay.map(|(d, p)| FaultDelay {
                fault_delay_secifier: Some(FaultDelaySecifier::FixedDelay(duration(d))),
                percentage: Some(percent(p)),
            }),
            abort: f.fault.abort.map(|(status, p)| FaultAbort {
                error_type: Some(ErrorType::HttpStatus(status)),
                percentage: Some(percent(p)),
                ..Default::default()
            }),
            ..Default::default()
        };
        route
            .typed_per_filter_config
            .insert(FAULT_FILTER.to_string(), any(&fault));
    }
    route.action = Some(Action::Route(action));
}

fn regex_rewrite(pattern: &str, substitution: &str) -> RegexMatchAndSubstitute {
    RegexMatchAndSubstitute {
        pattern: Some(RegexMatcher {
            regex: pattern.to_string(),
            ..Default::default()
        }),
        substitution: substitution.to_string(),
    }
}
