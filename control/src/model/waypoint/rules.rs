//! The routing rules of one service port, in one shape whatever the user
//! wrote them in: Istio `VirtualService` `http`/`tcp` rules or a Gateway API
//! `HTTPRoute` attached to the Service (GAMMA). The Envoy builders read only
//! this model, so waypoints (and sidecars later) share one translation.

use std::time::Duration;

use ambit_config::gateway_api::{
    HttpMethod, HttpPathModifier, HttpRoute as GatewayHttpRoute, HttpRouteFilter, PathMatchType,
    ValueMatchType,
};
use ambit_config::networking::{
    Destination, HeaderOperations, HttpRoute as IstioHttpRoute, StringMatch, VirtualService,
};

use crate::model::index::DOMAIN_SUFFIX;

/// How a string is matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextMatch {
    Exact(String),
    Prefix(String),
    Regex(String),
    /// Present, any value.
    Present,
}

impl TextMatch {
    fn from_istio(m: &StringMatch) -> TextMatch {
        match m {
            StringMatch::Exact(s) => TextMatch::Exact(s.clone()),
            StringMatch::Prefix(s) => TextMatch::Prefix(s.clone()),
            StringMatch::Regex(s) => TextMatch::Regex(s.clone()),
            StringMatch::Any => TextMatch::Present,
        }
    }
}

/// One way a request can match a rule (a rule matches when any does).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestMatch {
    /// `None`: any path.
    pub path: Option<TextMatch>,
    pub ignore_path_case: bool,
    /// (header name, match, inverted).
    pub headers: Vec<(String, TextMatch, bool)>,
    pub query: Vec<(String, TextMatch)>,
}

/// Header changes: `set` overwrites, `add` appends.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HeaderEdits {
    pub set: Vec<(String, String)>,
    pub add: Vec<(String, String)>,
    pub remove: Vec<String>,
}

impl HeaderEdits {
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.add.is_empty() && self.remove.is_empty()
    }

    fn from_istio(ops: Option<&HeaderOperations>) -> HeaderEdits {
        let Some(ops) = ops else {
            return HeaderEdits::default();
        };
        HeaderEdits {
            set: ops
                .set
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            add: ops
                .add
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            remove: ops.remove.clone(),
        }
    }
}

/// A destination of a rule, host resolved to a fully qualified name.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightedDestination {
    pub host: String,
    /// `None`: the port the request came in on (or the service's only one).
    pub port: Option<u16>,
    /// Empty: every endpoint.
    pub subset: String,
    pub weight: u32,
    pub request_headers: HeaderEdits,
    pub response_headers: HeaderEdits,
}

/// Retries of a rule.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryRule {
    pub attempts: u32,
    pub per_try_timeout: Option<Duration>,
    /// Envoy retry conditions (`5xx`, `reset`, ...); HTTP codes go to
    /// `status_codes` with `retriable-status-codes`.
    pub retry_on: Vec<String>,
    pub status_codes: Vec<u32>,
}

/// Faults injected by a rule.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FaultRule {
    /// (delay, percent of requests).
    pub delay: Option<(Duration, f64)>,
    /// (HTTP status, percent of requests).
    pub abort: Option<(u32, f64)>,
}

/// A mirror: a copy of a share of the requests.
#[derive(Debug, Clone, PartialEq)]
pub struct MirrorRule {
    pub destination: WeightedDestination,
    pub percent: f64,
}

/// Path rewriting.
#[derive(Debug, Clone, PartialEq)]
pub enum PathRewrite {
    /// Replace what the path match matched (a prefix) — or the whole path
    /// when the match is not a prefix.
    Prefix(String),
    Full(String),
    Regex {
        pattern: String,
        substitution: String,
    },
}

/// What a rule does with a matching request.
#[derive(Debug, Clone, PartialEq)]
pub enum RuleAction {
    Forward(Box<Forward>),
    Redirect {
        scheme: Option<String>,
        host: Option<String>,
        port: Option<u16>,
        path: Option<String>,
        status: u16,
    },
    Respond {
        status: u16,
        body: Option<String>,
    },
}

/// Forwarding to weighted destinations, with everything around it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Forward {
    pub destinations: Vec<WeightedDestination>,
    /// `None`: no timeout (Istio's default for mesh routes).
    pub timeout: Option<Duration>,
    /// `None`: the mesh default (Istio's: 2 attempts on connection
    /// failures, refused streams and 503).
    pub retries: Option<RetryRule>,
    pub fault: FaultRule,
    pub mirrors: Vec<MirrorRule>,
    pub rewrite_path: Option<PathRewrite>,
    pub rewrite_host: Option<String>,
    pub request_headers: HeaderEdits,
    pub response_headers: HeaderEdits,
}

/// One routing rule.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteRule {
    /// For logs and per-route metrics: the rule's name, or `<object>#<index>`.
    pub name: String,
    /// Empty: every request.
    pub matches: Vec<RequestMatch>,
    pub action: RuleAction,
}

/// Resolves a host as written in `namespace` to a fully qualified name:
/// `llm` → `llm.<namespace>.svc.cluster.local`, `llm.shop` →
/// `llm.shop.svc.cluster.local`; anything with more dots is kept.
pub fn qualify(host: &str, namespace: &str) -> String {
    match host.matches('.').count() {
        0 => format!("{host}.{namespace}.svc.{DOMAIN_SUFFIX}"),
        1 => format!("{host}.svc.{DOMAIN_SUFFIX}"),
        _ => host.to_string(),
    }
}

fn destination(d: &Destination, namespace: &str, weight: u32) -> WeightedDestination {
    WeightedDestination {
        host: qualify(&d.host, namespace),
        port: d.port.as_ref().map(|p| p.number),
        subset: d.subset.clone(),
        weight,
        request_headers: HeaderEdits::default(),
        response_headers: HeaderEdits::default(),
    }
}

/// The `http` rules of a VirtualService that apply to requests arriving on
/// `port`, in order.
pub fn from_virtual_service(vs: &VirtualService, port: u16) -> Vec<RouteRule> {
    let ns = &vs.metadata.namespace;
    let mut out = Vec::new();
    for (i, r) in vs.spec.http.iter().enumerate() {
        // A rule whose every match names another port does not apply here.
        let matches: Vec<RequestMatch> =
            r.matches
                .iter()
                .filter(|m| m.port.is_none_or(|p| p == port))
                .map(|m| RequestMatch {
                    path: m.uri.as_ref().map(TextMatch::from_istio),
                    ignore_path_case: m.ignore_uri_case,
                    headers: pseudo_headers(m)
                        .chain(m.headers.iter().map(|(k, v)| {
                            (k.to_ascii_lowercase(), TextMatch::from_istio(v), false)
                        }))
                        .chain(
                            m.without_headers.iter().map(|(k, v)| {
                                (k.to_ascii_lowercase(), TextMatch::from_istio(v), true)
                            }),
                        )
                        .collect(),
                    query: m
                        .query_params
                        .iter()
                        .map(|(k, v)| (k.clone(), TextMatch::from_istio(v)))
                        .collect(),
                })
                .collect();
        if !r.matches.is_empty() && matches.is_empty() {
            continue;
        }
        let name = if r.name.is_empty() {
            format!("{}.{}#{i}", vs.metadata.name, ns)
        } else {
            r.name.clone()
        };
        out.push(RouteRule {
            name,
            matches,
            action: istio_action(r, ns),
        });
    }
    out
}

/// `method`, `authority` and `scheme` matches are pseudo-header matches.
fn pseudo_headers(
    m: &ambit_config::networking::HttpMatchRequest,
) -> impl Iterator<Item = (String, TextMatch, bool)> + '_ {
    [
        (":method", &m.method),
        (":authority", &m.authority),
        (":scheme", &m.scheme),
    ]
    .into_iter()
    .filter_map(|(h, v)| {
        v.as_ref()
            .map(|v| (h.to_string(), TextMatch::from_istio(v), false))
    })
}

fn istio_action(r: &IstioHttpRoute, ns: &str) -> RuleAction {
    if let Some(red) = &r.redirect {
        return RuleAction::Redirect {
            scheme: Some(red.scheme.clone()).filter(|s| !s.is_empty()),
            host: Some(red.authority.clone()).filter(|s| !s.is_empty()),
            port: red.port,
            path: Some(red.uri.clone()).filter(|s| !s.is_empty()),
            status: red.redirect_code.unwrap_or(301),
        };
    }
    if let Some(dr) = &r.direct_response {
        return RuleAction::Respond {
            status: dr.status,
            body: dr.body.as_ref().and_then(|b| b.string.clone()),
        };
    }
    let lone = r.route.len() == 1;
    let destinations = r
        .route
        .iter()
        .map(|d| {
            let weight = if lone && d.weight == 0 { 100 } else { d.weight };
            let mut wd = destination(&d.destination, ns, weight);
            if let Some(h) = &d.headers {
                wd.request_headers = HeaderEdits::from_istio(h.request.as_ref());
                wd.response_headers = HeaderEdits::from_istio(h.response.as_ref());
            }
            wd
        })
        .collect();
    let retries = r.retries.as_ref().map(|rt| {
        let mut retry_on = Vec::new();
        let mut status_codes = Vec::new();
        for c in rt.retry_conditions() {
            match c.parse::<u32>() {
                Ok(code) => status_codes.push(code),
                Err(_) => retry_on.push(c.to_string()),
            }
        }
        if !status_codes.is_empty() {
            retry_on.push("retriable-status-codes".to_string());
        }
        if retry_on.is_empty() {
            // Istio's default conditions when only attempts are given.
            retry_on = default_retry_on();
            status_codes = vec![503];
        }
        RetryRule {
            attempts: rt.attempts,
            per_try_timeout: rt.per_try_timeout,
            retry_on,
            status_codes,
        }
    });
    let fault = r
        .fault
        .as_ref()
        .map(|f| FaultRule {
            delay: f.delay.as_ref().map(|d| {
                let pct = d
                    .percentage
                    .map(|p| p.value)
                    .or(d.percent.map(f64::from))
                    .unwrap_or(100.0);
                (d.fixed_delay, pct)
            }),
            abort: f.abort.as_ref().and_then(|a| {
                let pct = a.percentage.map_or(100.0, |p| p.value);
                a.http_status.map(|s| (u32::from(s), pct))
            }),
        })
        .unwrap_or_default();
    let mut mirrors: Vec<MirrorRule> = r
        .mirrors
        .iter()
        .map(|m| MirrorRule {
            destination: destination(&m.destination, ns, 100),
            percent: m.percentage.map_or(100.0, |p| p.value),
        })
        .collect();
    if let Some(m) = &r.mirror {
        mirrors.push(MirrorRule {
            destination: destination(m, ns, 100),
            percent: r.mirror_percentage.map_or(100.0, |p| p.value),
        });
    }
    let (rewrite_path, rewrite_host) = match &r.rewrite {
        None => (None, None),
        Some(rw) => {
            let path = if let Some(rx) = &rw.uri_regex_rewrite {
                Some(PathRewrite::Regex {
                    pattern: rx.pattern.clone(),
                    substitution: rx.rewrite.clone(),
                })
            } else if rw.uri.is_empty() {
                None
            } else {
                Some(PathRewrite::Prefix(rw.uri.clone()))
            };
            (path, Some(rw.authority.clone()).filter(|a| !a.is_empty()))
        }
    };
    let (request_headers, response_headers) = match &r.headers {
        Some(h) => (
            HeaderEdits::from_istio(h.request.as_ref()),
            HeaderEdits::from_istio(h.response.as_ref()),
        ),
        None => Default::default(),
    };
    RuleAction::Forward(Box::new(Forward {
        destinations,
        timeout: r.timeout,
        retries,
        fault,
        mirrors,
        rewrite_path,
        rewrite_host,
        request_headers,
        response_headers,
    }))
}

/// Istio's default retry conditions.
pub fn default_retry_on() -> Vec<String> {
    [
        "connect-failure",
        "refused-stream",
        "unavailable",
        "cancelled",
        "retriable-status-codes",
    ]
    .into_iter()
    .map(str::to_string)
    .collect()
}

/// The rules of an HTTPRoute attached to a Service, for requests arriving
/// on `port` (backend ports are explicit in Gateway API).
pub fn from_http_route(route: &GatewayHttpRoute) -> Vec<RouteRule> {
    let ns = &route.metadata.namespace;
    let mut out = Vec::new();
    for (i, rule) in route.spec.rules.iter().enumerate() {
        let matches = rule
            .matches
            .iter()
            .map(|m| {
                let path = m.effective_path();
                let path = match path.type_ {
                    PathMatchType::Exact => TextMatch::Exact(path.value),
                    PathMatchType::PathPrefix if path.value == "/" => TextMatch::Prefix("/".into()),
                    // Gateway API prefixes match whole path segments.
                    PathMatchType::PathPrefix => TextMatch::Regex(format!(
                        "{}(/.*)?",
                        regex_syntax_escape(path.value.trim_end_matches('/'))
                    )),
                    PathMatchType::RegularExpression => TextMatch::Regex(path.value),
                };
                let value = |t: &ValueMatchType, v: &str| match t {
                    ValueMatchType::Exact => TextMatch::Exact(v.to_string()),
                    ValueMatchType::RegularExpression => TextMatch::Regex(v.to_string()),
                };
                let mut headers: Vec<(String, TextMatch, bool)> = m
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_ascii_lowercase(),
                            value(&h.type_, &h.value),
                            false,
                        )
                    })
                    .collect();
                if let Some(method) = &m.method {
                    headers.push((
                        ":method".into(),
                        TextMatch::Exact(method_name(method).into()),
                        false,
                    ));
                }
                RequestMatch {
                    path: Some(path),
                    ignore_path_case: false,
                    headers,
                    query: m
                        .query_params
                        .iter()
                        .map(|q| (q.name.clone(), value(&q.type_, &q.value)))
                        .collect(),
                }
            })
            .collect();
        let name = rule
            .name
            .clone()
            .unwrap_or_else(|| format!("{}.{}#{i}", route.metadata.name, ns));
        let mut fwd = Forward {
            destinations: rule
                .backend_refs
                .iter()
                .map(|b| WeightedDestination {
                    host: qualify(&b.name, b.namespace.as_deref().unwrap_or(ns)),
                    port: b.port,
                    subset: String::new(),
                    weight: b.effective_weight(),
                    request_headers: HeaderEdits::default(),
                    response_headers: HeaderEdits::default(),
                })
                .collect(),
            timeout: rule
                .timeouts
                .and_then(|t| t.request)
                .filter(|d| !d.is_zero()),
            retries: None,
            ..Default::default()
        };
        if let Some(per_try) = rule
            .timeouts
            .and_then(|t| t.backend_request)
            .filter(|d| !d.is_zero())
        {
            fwd.retries = Some(RetryRule {
                attempts: 2,
                per_try_timeout: Some(per_try),
                retry_on: default_retry_on(),
                status_codes: vec![503],
            });
        }
        let mut action = None;
        for f in &rule.filters {
            match f {
                HttpRouteFilter::RequestHeaderModifier(h) => {
                    fwd.request_headers = gateway_headers(h);
                }
                HttpRouteFilter::ResponseHeaderModifier(h) => {
                    fwd.response_headers = gateway_headers(h);
                }
                HttpRouteFilter::RequestRedirect(r) => {
                    action = Some(RuleAction::Redirect {
                        scheme: r.scheme.clone(),
                        host: r.hostname.clone(),
                        port: r.port,
                        path: match &r.path {
                            Some(HttpPathModifier::ReplaceFullPath(p)) => Some(p.clone()),
                            Some(HttpPathModifier::ReplacePrefixMatch(p)) => Some(p.clone()),
                            None => None,
                        },
                        status: r.status_code.unwrap_or(302),
                    });
                }
                HttpRouteFilter::UrlRewrite(r) => {
                    fwd.rewrite_host = r.hostname.clone();
                    fwd.rewrite_path = match &r.path {
                        Some(HttpPathModifier::ReplaceFullPath(p)) => {
                            Some(PathRewrite::Full(p.clone()))
                        }
                        Some(HttpPathModifier::ReplacePrefixMatch(p)) => {
                            Some(PathRewrite::Prefix(p.clone()))
                        }
                        None => None,
                    };
                }
                HttpRouteFilter::RequestMirror(m) => {
                    let b = &m.backend_ref;
                    let percent = match (m.percent, &m.fraction) {
                        (Some(p), _) => f64::from(p),
                        (None, Some(f)) => {
                            100.0 * f64::from(f.numerator)
                                / f64::from(f.denominator.unwrap_or(100).max(1))
                        }
                        (None, None) => 100.0,
                    };
                    fwd.mirrors.push(MirrorRule {
                        destination: WeightedDestination {
                            host: qualify(&b.name, b.namespace.as_deref().unwrap_or(ns)),
                            port: b.port,
                            subset: String::new(),
                            weight: 100,
                            request_headers: HeaderEdits::default(),
                            response_headers: HeaderEdits::default(),
                        },
                        percent,
                    });
                }
                HttpRouteFilter::Cors(_) | HttpRouteFilter::ExtensionRef(_) => {}
            }
        }
        out.push(RouteRule {
            name,
            matches,
            action: action.unwrap_or_else(|| RuleAction::Forward(Box::new(fwd))),
        });
    }
    out
}

fn gateway_headers(h: &ambit_config::gateway_api::HttpHeaderFilter) -> HeaderEdits {
    HeaderEdits {
        set: h
            .set
            .iter()
            .map(|x| (x.name.clone(), x.value.clone()))
            .collect(),
        add: h
            .add
            .iter()
            .map(|x| (x.name.clone(), x.value.clone()))
            .collect(),
        remove: h.remove.clone(),
    }
}

fn method_name(m: &HttpMethod) -> &'static str {
    match m {
        HttpMethod::Get => "GET",
        HttpMethod::Head => "HEAD",
        HttpMethod::Post => "POST",
        HttpMethod::Put => "PUT",
        HttpMethod::Delete => "DELETE",
        HttpMethod::Connect => "CONNECT",
        HttpMethod::Options => "OPTIONS",
        HttpMethod::Trace => "TRACE",
        HttpMethod::Patch => "PATCH",
    }
}

/// Escapes RE2 metacharacters in a literal.
fn regex_syntax_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
