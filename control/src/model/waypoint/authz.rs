//! L7 AuthorizationPolicy at the waypoint, as Envoy RBAC with Istio's
//! semantics (DENY first, then ALLOW if any ALLOW policy applies; AUDIT
//! logs). Policies bind the way Istio's ambient mode binds them to a
//! waypoint: `targetRefs` naming the waypoint `Gateway` (every service it
//! serves) or a `Service` bound to it (that service); `selector` policies
//! stay with ztunnel (L4) and are not enforced here.
//!
//! The caller's identity at the waypoint is the SPIFFE ID of its HBONE
//! client certificate, carried from the HBONE listener to the service's
//! chain in the filter-state object [`PEER_PRINCIPAL`]; source IPs are the
//! original client's (restored on the internal listener).
//!
//! Supported keys: `from.source` principals, namespaces, ipBlocks,
//! remoteIpBlocks (and the `not` forms); `to.operation` hosts, ports,
//! methods, paths (and the `not` forms; `*` prefix/suffix/presence); `when`
//! `request.headers[...]`, `source.ip`, `remote.ip`, `source.namespace`,
//! `source.principal`, `destination.ip`, `destination.port`,
//! `connection.sni`. Not supported (no JWT validation at the waypoint):
//! `requestPrincipals` and `request.auth.*` — an ALLOW rule using them
//! matches nothing, a DENY rule ignores them (both fail safe) and a finding
//! says so.

use std::collections::BTreeMap;

use ambit_config::objects::{
    AuthorizationAction, AuthorizationPolicy, AuthorizationRule, Cidr, Condition, Operation,
    Source, service_account_ref,
};
use envoy_types::pb::envoy::config::core::v3::CidrRange;
use envoy_types::pb::envoy::config::rbac::v3::{
    Permission, Policy, Principal, Rbac as RbacRules, permission, principal, rbac::Action,
};
use envoy_types::pb::envoy::config::route::v3::{
    HeaderMatcher, header_matcher::HeaderMatchSpecifier,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    FilterStateMatcher, PathMatcher, RegexMatcher, StringMatcher, filter_state_matcher,
    path_matcher, string_matcher::MatchPattern,
};

use super::envoy::{any, stable_map, u32_value};
use super::{BoundService, Finding, WaypointPlan};
use crate::model::index::ROOT_NAMESPACES;
use ambit_config::gateway_api::WAYPOINT_GATEWAY_CLASSES;
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::{Rbac as HttpRbac, RbacPerRoute};
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use envoy_types::pb::google::protobuf::Any;

/// The HTTP RBAC filters of a service chain, in the order they run: AUDIT
/// (logs), DENY, then ALLOW. Each enforces nothing by itself; the service's
/// virtual host gives it rules ([`per_route_configs`]), so a policy change
/// is an RDS update that applies to the next request on every connection.
pub const HTTP_RBAC_FILTERS: [(&str, Action); 3] = [
    ("ambit.rbac.audit", Action::Log),
    ("ambit.rbac.deny", Action::Deny),
    ("ambit.rbac.allow", Action::Allow),
];

/// Filter-state key holding the HBONE peer's SPIFFE ID (a string object).
pub const PEER_PRINCIPAL: &str = "io.ambit.peer_principal";

/// The RBAC rules a service's traffic is checked against, by action.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServiceRbac {
    pub deny: Option<RbacRules>,
    pub allow: Option<RbacRules>,
    pub audit: Option<RbacRules>,
}

impl ServiceRbac {
    pub fn is_empty(&self) -> bool {
        self.deny.is_none() && self.allow.is_none() && self.audit.is_none()
    }

    fn rules(&self, action: Action) -> Option<&RbacRules> {
        match action {
            Action::Allow => self.allow.as_ref(),
            Action::Deny => self.deny.as_ref(),
            Action::Log => self.audit.as_ref(),
        }
    }
}

/// The base config of one HTTP RBAC filter: no rules, so no enforcement.
pub fn http_base_filter() -> HttpRbac {
    HttpRbac::default()
}

/// The virtual host's `typed_per_filter_config` entries giving each RBAC
/// filter the service's rules for that action (none: the filter passes).
pub fn per_route_configs(rbac: &ServiceRbac) -> Vec<(String, Any)> {
    HTTP_RBAC_FILTERS
        .iter()
        .filter_map(|(name, action)| {
            let rules = rbac.rules(*action)?.clone();
            let per_route = RbacPerRoute {
                rbac: Some(HttpRbac {
                    rules: Some(rules),
                    track_per_rule_stats: true,
                    ..Default::default()
                }),
            };
            Some((name.to_string(), any(&per_route)))
        })
        .collect()
}

/// The network RBAC filters of a TCP service chain (AUDIT, DENY, ALLOW),
/// only those with rules. A change replaces the chain: new connections get
/// it, open ones keep the rules they were accepted under (as Istio).
pub fn network_filters(rbac: &ServiceRbac, stat_prefix: &str) -> Vec<(String, NetworkRbac)> {
    HTTP_RBAC_FILTERS
        .iter()
        .filter_map(|(name, action)| {
            let rules = rbac.rules(*action)?.clone();
            Some((
                name.replace("ambit.rbac", "ambit.tcp_rbac"),
                NetworkRbac {
                    rules: Some(rules),
                    stat_prefix: format!("{stat_prefix}."),
                    ..Default::default()
                },
            ))
        })
        .collect()
}

/// Whether `policy` applies to `svc` at waypoint `plan`.
pub fn binds(policy: &AuthorizationPolicy, plan: &WaypointPlan, svc: &BoundService) -> bool {
    let ns = &policy.metadata.namespace;
    let refs = policy
        .spec
        .target_refs
        .iter()
        .chain(policy.spec.target_ref.as_ref());
    refs.into_iter().any(|r| {
        let rns = if r.namespace.is_empty() {
            ns
        } else {
            &r.namespace
        };
        match r.kind.as_str() {
            "Gateway" => rns == &plan.namespace && r.name == plan.name,
            "Service" => rns == &svc.namespace && r.name == svc.name,
            // Every waypoint of the class, from a root namespace.
            "GatewayClass" => {
                ROOT_NAMESPACES.contains(&ns.as_str())
                    && WAYPOINT_GATEWAY_CLASSES.contains(&r.name.as_str())
            }
            _ => false,
        }
    })
}

/// The RBAC rules of the policies bound to `svc` on service port `port`.
pub fn service_rbac(
    policies: &[&AuthorizationPolicy],
    port: u16,
    http: bool,
    findings: &mut Vec<Finding>,
) -> ServiceRbac {
    let mut by_action: BTreeMap<i32, BTreeMap<String, Policy>> = BTreeMap::new();
    for p in policies {
        let action = match p.spec.action {
            AuthorizationAction::Allow => Action::Allow,
            AuthorizationAction::Deny => Action::Deny,
            AuthorizationAction::Audit => Action::Log,
            AuthorizationAction::Custom => {
                findings.push(finding(p, "action CUSTOM needs an external authorizer, which Ambit's waypoints do not have; the policy is not enforced"));
                continue;
            }
        };
        let entries = by_action.entry(action as i32).or_default();
        let name = format!("ns[{}]-policy[{}]", p.metadata.namespace, p.metadata.name);
        for (i, rule) in p.spec.rules.iter().enumerate() {
            let on = Port { number: port, http };
            if let Some(policy) = envoy_policy(rule, action, on, p, findings) {
                entries.insert(format!("{name}-rule[{i}]"), policy);
            }
        }
    }
    // An ALLOW policy without rules allows nothing but still makes the
    // service deny what no other ALLOW allows: the ALLOW rules exist (maybe
    // empty) whenever an ALLOW policy binds.
    let mut make = |action: Action| {
        let policies = by_action.remove(&(action as i32))?;
        Some(RbacRules {
            action: action as i32,
            policies: stable_map(policies),
            ..Default::default()
        })
    };
    let has_allow = policies
        .iter()
        .any(|p| p.spec.action == AuthorizationAction::Allow);
    let allow = make(Action::Allow).or_else(|| {
        has_allow.then(|| RbacRules {
            action: Action::Allow as i32,
            ..Default::default()
        })
    });
    ServiceRbac {
        deny: make(Action::Deny),
        allow,
        audit: make(Action::Log),
    }
}

fn finding(p: &AuthorizationPolicy, reason: &str) -> Finding {
    Finding {
        kind: "AuthorizationPolicy".into(),
        namespace: p.metadata.namespace.clone(),
        name: p.metadata.name.clone(),
        reason: reason.to_string(),
    }
}

/// The service port a rule is translated for.
#[derive(Clone, Copy)]
struct Port {
    number: u16,
    /// HTTP-only fields (hosts, methods, paths, request headers) apply; on
    /// a TCP port an ALLOW rule using them matches nothing and a DENY rule
    /// ignores them (Istio's fail-safe reading).
    http: bool,
}

/// One rule: `from` (any) AND `to` (any) AND every `when`. `None` when the
/// rule can never match on this port.
fn envoy_policy(
    rule: &AuthorizationRule,
    action: Action,
    port: Port,
    p: &AuthorizationPolicy,
    findings: &mut Vec<Finding>,
) -> Option<Policy> {
    let allow = action == Action::Allow;
    let mut unsupported = Vec::new();
    let mut principals: Vec<Principal> = Vec::new();
    let mut permissions: Vec<Permission> = Vec::new();
    if !rule.from.is_empty() {
        let sources: Vec<Principal> = rule
            .from
            .iter()
            .filter_map(|f| source(&f.source, ns_of(p), allow, &mut unsupported))
            .collect();
        if sources.is_empty() {
            return None;
        }
        principals.push(or_ids(sources));
    }
    if !rule.to.is_empty() {
        let ops: Vec<Permission> = rule
            .to
            .iter()
            .filter(|t| op_port_matches(&t.operation, port.number))
            .filter(|t| port.http || !allow || !has_http_fields(&t.operation))
            .map(|t| operation(&t.operation, port.http))
            .collect();
        if ops.is_empty() {
            return None;
        }
        permissions.push(or_rules(ops));
    }
    for c in &rule.when {
        if !port.http && c.key.starts_with("request.headers[") {
            if allow {
                return None;
            }
            continue;
        }
        match condition(c, ns_of(p)) {
            Some(Cond::Principal(x)) => principals.push(x),
            Some(Cond::Permission(x)) => permissions.push(x),
            None => {
                unsupported.push(c.key.clone());
                if allow {
                    return report(p, &unsupported, allow, findings);
                }
            }
        }
    }
    if allow && !unsupported.is_empty() {
        return report(p, &unsupported, allow, findings);
    }
    if !unsupported.is_empty() {
        report(p, &unsupported, allow, findings);
    }
    Some(Policy {
        permissions: vec![and_rules(permissions)],
        principals: vec![and_ids(principals)],
        ..Default::default()
    })
}

fn report(
    p: &AuthorizationPolicy,
    keys: &[String],
    allow: bool,
    findings: &mut Vec<Finding>,
) -> Option<Policy> {
    let effect = if allow {
        "this ALLOW rule matches nothing (more restrictive)"
    } else {
        "this DENY rule ignores them (matches more)"
    };
    findings.push(finding(
        p,
        &format!(
            "{} cannot be checked at the waypoint (no JWT validation); {effect}",
            keys.join(", ")
        ),
    ));
    None
}

fn and_ids(ids: Vec<Principal>) -> Principal {
    match <[Principal; 1]>::try_from(ids) {
        Ok([one]) => one,
        Err(ids) if ids.is_empty() => any_principal(),
        Err(ids) => Principal {
            identifier: Some(principal::Identifier::AndIds(principal::Set { ids })),
        },
    }
}

fn or_ids(ids: Vec<Principal>) -> Principal {
    match <[Principal; 1]>::try_from(ids) {
        Ok([one]) => one,
        Err(ids) => Principal {
            identifier: Some(principal::Identifier::OrIds(principal::Set { ids })),
        },
    }
}

fn not_id(p: Principal) -> Principal {
    Principal {
        identifier: Some(principal::Identifier::NotId(Box::new(p))),
    }
}

fn any_principal() -> Principal {
    Principal {
        identifier: Some(principal::Identifier::Any(true)),
    }
}

fn and_rules(rules: Vec<Permission>) -> Permission {
    match <[Permission; 1]>::try_from(rules) {
        Ok([one]) => one,
        Err(rules) if rules.is_empty() => Permission {
            rule: Some(permission::Rule::Any(true)),
        },
        Err(rules) => Permission {
            rule: Some(permission::Rule::AndRules(permission::Set { rules })),
        },
    }
}

fn or_rules(rules: Vec<Permission>) -> Permission {
    match <[Permission; 1]>::try_from(rules) {
        Ok([one]) => one,
        Err(rules) => Permission {
            rule: Some(permission::Rule::OrRules(permission::Set { rules })),
        },
    }
}

fn not_rule(p: Permission) -> Permission {
    Permission {
        rule: Some(permission::Rule::NotRule(Box::new(p))),
    }
}

/// Istio's value forms: `*` (present), `*x` (suffix), `x*` (prefix), exact.
fn value_matcher(v: &str) -> StringMatcher {
    let pattern = if v == "*" {
        MatchPattern::SafeRegex(RegexMatcher {
            regex: ".+".into(),
            ..Default::default()
        })
    } else if let Some(s) = v.strip_prefix('*') {
        MatchPattern::Suffix(s.into())
    } else if let Some(p) = v.strip_suffix('*') {
        MatchPattern::Prefix(p.into())
    } else {
        MatchPattern::Exact(v.into())
    };
    StringMatcher {
        match_pattern: Some(pattern),
        ignore_case: false,
    }
}

fn peer(matcher: StringMatcher) -> Principal {
    Principal {
        identifier: Some(principal::Identifier::FilterState(FilterStateMatcher {
            key: PEER_PRINCIPAL.into(),
            matcher: Some(filter_state_matcher::Matcher::StringMatch(matcher)),
        })),
    }
}

/// A principal (`cluster.local/ns/a/sa/b`, with `*` forms) as the SPIFFE
/// URI the certificate carries (written with its trust domain, as Istio
/// writes principals).
fn principal_id(v: &str) -> Principal {
    let v = v.strip_prefix("spiffe://").unwrap_or(v);
    let m = if v == "*" {
        value_matcher("*")
    } else if let Some(s) = v.strip_prefix('*') {
        value_matcher(&format!("*{s}"))
    } else {
        value_matcher(&format!("spiffe://{v}"))
    };
    peer(m)
}

/// A namespace (with `*` forms) as a match on the SPIFFE URI's `ns` part.
fn namespace_id(v: &str) -> Principal {
    let ns = regex_escape(v.trim_matches('*'));
    let ns = match (v.starts_with('*'), v.ends_with('*') && v.len() > 1) {
        _ if v == "*" => ".+".to_string(),
        (true, true) => format!("[^/]*{ns}[^/]*"),
        (true, false) => format!("[^/]*{ns}"),
        (false, true) => format!("{ns}[^/]*"),
        (false, false) => ns,
    };
    peer(StringMatcher {
        match_pattern: Some(MatchPattern::SafeRegex(RegexMatcher {
            regex: format!("spiffe://[^/]+/ns/{ns}/sa/[^/]+"),
            ..Default::default()
        })),
        ignore_case: false,
    })
}

fn cidr(c: &Cidr) -> CidrRange {
    CidrRange {
        address_prefix: c.addr.to_string(),
        prefix_len: Some(u32_value(c.len.into())),
    }
}

fn ip_id(c: &Cidr, direct: bool) -> Principal {
    Principal {
        identifier: Some(if direct {
            principal::Identifier::DirectRemoteIp(cidr(c))
        } else {
            principal::Identifier::RemoteIp(cidr(c))
        }),
    }
}

/// A service account (`ns/sa`, or `sa` of the policy's namespace) as a
/// match on the SPIFFE URI's `ns` and `sa` parts, any trust domain.
fn service_account_id(v: &str, policy_ns: &str) -> Principal {
    let (ns, sa) = service_account_ref(v, policy_ns);
    peer(StringMatcher {
        match_pattern: Some(MatchPattern::SafeRegex(RegexMatcher {
            regex: format!(
                "spiffe://[^/]+/ns/{}/sa/{}",
                regex_escape(ns),
                regex_escape(sa)
            ),
            ..Default::default()
        })),
        ignore_case: false,
    })
}

/// The namespace a policy is in.
fn ns_of(p: &AuthorizationPolicy) -> &str {
    p.metadata.namespace.as_str()
}

/// A source: every field given must match.
fn source(
    s: &Source,
    policy_ns: &str,
    allow: bool,
    unsupported: &mut Vec<String>,
) -> Option<Principal> {
    let mut ids = Vec::new();
    let any_of = |vals: &[String], f: &dyn Fn(&str) -> Principal| {
        or_ids(vals.iter().map(|v| f(v)).collect())
    };
    if !s.principals.is_empty() {
        ids.push(any_of(&s.principals, &|v| principal_id(v)));
    }
    if !s.not_principals.is_empty() {
        ids.push(not_id(any_of(&s.not_principals, &|v| principal_id(v))));
    }
    if !s.namespaces.is_empty() {
        ids.push(any_of(&s.namespaces, &namespace_id));
    }
    if !s.not_namespaces.is_empty() {
        ids.push(not_id(any_of(&s.not_namespaces, &namespace_id)));
    }
    let account = |v: &str| service_account_id(v, policy_ns);
    if !s.service_accounts.is_empty() {
        ids.push(any_of(&s.service_accounts, &account));
    }
    if !s.not_service_accounts.is_empty() {
        ids.push(not_id(any_of(&s.not_service_accounts, &account)));
    }
    for (blocks, direct, negate) in [
        (&s.ip_blocks, true, false),
        (&s.not_ip_blocks, true, true),
        (&s.remote_ip_blocks, false, false),
        (&s.not_remote_ip_blocks, false, true),
    ] {
        if !blocks.is_empty() {
            let p = or_ids(blocks.iter().map(|c| ip_id(c, direct)).collect());
            ids.push(if negate { not_id(p) } else { p });
        }
    }
    if !s.request_principals.is_empty() || !s.not_request_principals.is_empty() {
        unsupported.push("requestPrincipals".into());
        if allow {
            return None;
        }
    }
    Some(and_ids(ids))
}

fn header(name: &str, m: StringMatcher) -> HeaderMatcher {
    HeaderMatcher {
        name: name.into(),
        header_match_specifier: Some(HeaderMatchSpecifier::StringMatch(m)),
        ..Default::default()
    }
}

fn header_perm(name: &str, v: &str) -> Permission {
    Permission {
        rule: Some(permission::Rule::Header(header(name, value_matcher(v)))),
    }
}

/// A host as Istio matches it: case-insensitive, with or without the port.
fn host_perm(v: &str) -> Permission {
    let mut exact = value_matcher(v);
    exact.ignore_case = true;
    let with_port = StringMatcher {
        match_pattern: Some(MatchPattern::SafeRegex(RegexMatcher {
            regex: format!("(?i){}:[0-9]+", host_regex(v)),
            ..Default::default()
        })),
        ignore_case: false,
    };
    or_rules(vec![
        Permission {
            rule: Some(permission::Rule::Header(header(":authority", exact))),
        },
        Permission {
            rule: Some(permission::Rule::Header(header(":authority", with_port))),
        },
    ])
}

/// A host value with Istio's `*` forms as a regex body.
fn host_regex(v: &str) -> String {
    if v == "*" {
        ".+".into()
    } else if let Some(s) = v.strip_prefix('*') {
        format!(".*{}", regex_escape(s))
    } else if let Some(p) = v.strip_suffix('*') {
        format!("{}.*", regex_escape(p))
    } else {
        regex_escape(v)
    }
}

fn path_perm(v: &str) -> Permission {
    Permission {
        rule: Some(permission::Rule::UrlPath(PathMatcher {
            rule: Some(path_matcher::Rule::Path(value_matcher(v))),
        })),
    }
}

fn port_perm(p: u16) -> Permission {
    Permission {
        rule: Some(permission::Rule::DestinationPort(p.into())),
    }
}

/// Whether an operation's ports allow service port `port` (checked here:
/// each service port has its own chain).
fn op_port_matches(o: &Operation, port: u16) -> bool {
    (o.ports.is_empty() || o.ports.iter().any(|p| p.0 == port))
        && !o.not_ports.iter().any(|p| p.0 == port)
}

fn has_http_fields(o: &Operation) -> bool {
    [
        &o.hosts,
        &o.not_hosts,
        &o.methods,
        &o.not_methods,
        &o.paths,
        &o.not_paths,
    ]
    .iter()
    .any(|v| !v.is_empty())
}

/// An operation: every field given must match (HTTP fields only on an
/// HTTP port).
fn operation(o: &Operation, http: bool) -> Permission {
    let mut rules = Vec::new();
    let mut field = |vals: &[String], negate: bool, f: &dyn Fn(&str) -> Permission| {
        if !vals.is_empty() {
            let p = or_rules(vals.iter().map(|v| f(v)).collect());
            rules.push(if negate { not_rule(p) } else { p });
        }
    };
    if http {
        field(&o.hosts, false, &host_perm);
        field(&o.not_hosts, true, &host_perm);
        field(&o.methods, false, &|v| header_perm(":method", v));
        field(&o.not_methods, true, &|v| header_perm(":method", v));
        field(&o.paths, false, &path_perm);
        field(&o.not_paths, true, &path_perm);
    }
    and_rules(rules)
}

enum Cond {
    Principal(Principal),
    Permission(Permission),
}

/// A `when` condition, or `None` for a key the waypoint cannot check.
fn condition(c: &Condition, policy_ns: &str) -> Option<Cond> {
    let key = c.key.as_str();
    let cidrs = |vals: &[String]| -> Vec<Cidr> {
        vals.iter()
            .filter_map(|v| {
                let (a, l) = v.split_once('/').unwrap_or((v, ""));
                let addr: std::net::IpAddr = a.parse().ok()?;
                let len = l.parse().unwrap_or(if addr.is_ipv4() { 32 } else { 128 });
                Some(Cidr { addr, len })
            })
            .collect()
    };
    let principal_cond = |f: &dyn Fn(&str) -> Principal| {
        let yes = (!c.values.is_empty()).then(|| or_ids(c.values.iter().map(|v| f(v)).collect()));
        let no = (!c.not_values.is_empty())
            .then(|| not_id(or_ids(c.not_values.iter().map(|v| f(v)).collect())));
        Cond::Principal(and_ids(yes.into_iter().chain(no).collect()))
    };
    let permission_cond = |f: &dyn Fn(&str) -> Permission| {
        let yes = (!c.values.is_empty()).then(|| or_rules(c.values.iter().map(|v| f(v)).collect()));
        let no = (!c.not_values.is_empty())
            .then(|| not_rule(or_rules(c.not_values.iter().map(|v| f(v)).collect())));
        Cond::Permission(and_rules(yes.into_iter().chain(no).collect()))
    };
    if let Some(h) = key
        .strip_prefix("request.headers[")
        .and_then(|k| k.strip_suffix(']'))
    {
        let h = h.to_ascii_lowercase();
        return Some(permission_cond(&|v| header_perm(&h, v)));
    }
    match key {
        "source.ip" | "remote.ip" => {
            let direct = key == "source.ip";
            let to =
                |vals: &[String]| or_ids(cidrs(vals).iter().map(|c| ip_id(c, direct)).collect());
            let yes = (!c.values.is_empty()).then(|| to(&c.values));
            let no = (!c.not_values.is_empty()).then(|| not_id(to(&c.not_values)));
            Some(Cond::Principal(and_ids(
                yes.into_iter().chain(no).collect(),
            )))
        }
        "source.namespace" => Some(principal_cond(&namespace_id)),
        "source.principal" => Some(principal_cond(&|v| principal_id(v))),
        "source.serviceAccount" => Some(principal_cond(&|v| service_account_id(v, policy_ns))),
        "destination.ip" => {
            let to = |vals: &[String]| {
                or_rules(
                    cidrs(vals)
                        .iter()
                        .map(|c| Permission {
                            rule: Some(permission::Rule::DestinationIp(cidr(c))),
                        })
                        .collect(),
                )
            };
            let yes = (!c.values.is_empty()).then(|| to(&c.values));
            let no = (!c.not_values.is_empty()).then(|| not_rule(to(&c.not_values)));
            Some(Cond::Permission(and_rules(
                yes.into_iter().chain(no).collect(),
            )))
        }
        "destination.port" => Some(permission_cond(&|v| match v.parse::<u16>() {
            Ok(p) => port_perm(p),
            // Not a port: matches nothing.
            Err(_) => not_rule(Permission {
                rule: Some(permission::Rule::Any(true)),
            }),
        })),
        "connection.sni" => Some(permission_cond(&|v| Permission {
            rule: Some(permission::Rule::RequestedServerName(value_matcher(v))),
        })),
        _ => None,
    }
}

fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The regex a peer identity must match, from a one-principal source.
    fn regex_of(p: &Principal) -> Option<String> {
        match &p.identifier {
            Some(principal::Identifier::FilterState(f)) => match &f.matcher {
                Some(filter_state_matcher::Matcher::StringMatch(StringMatcher {
                    match_pattern: Some(MatchPattern::SafeRegex(r)),
                    ..
                })) => Some(r.regex.clone()),
                _ => None,
            },
            Some(principal::Identifier::AndIds(ids)) => ids.ids.iter().find_map(regex_of),
            Some(principal::Identifier::OrIds(ids)) => ids.ids.iter().find_map(regex_of),
            _ => None,
        }
    }

    #[test]
    fn service_accounts_match_their_namespace_and_account_only() {
        let s = Source {
            service_accounts: vec!["shop/web.v2".into()],
            ..Source::default()
        };
        let mut unsupported = Vec::new();
        let p = source(&s, "ai", true, &mut unsupported);
        assert!(unsupported.is_empty());
        assert_eq!(
            p.as_ref().and_then(regex_of).as_deref(),
            Some(r"spiffe://[^/]+/ns/shop/sa/web\.v2"),
            "an explicit namespace, dots escaped"
        );
        let s = Source {
            service_accounts: vec!["llm".into()],
            ..Source::default()
        };
        let p = source(&s, "ai", true, &mut unsupported);
        assert_eq!(
            p.as_ref().and_then(regex_of).as_deref(),
            Some("spiffe://[^/]+/ns/ai/sa/llm"),
            "a bare account is of the policy's namespace"
        );
    }
}
