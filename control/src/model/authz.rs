//! AuthorizationPolicy -> `istio.security.Authorization` (L4 only), with
//! Istio's ambient semantics:
//!
//! * scope GLOBAL for a selector-less policy in a root namespace, NAMESPACE
//!   without selector, WORKLOAD_SELECTOR with one (the policy is then listed
//!   in each selected workload's `authorization_policies`);
//! * a rule is a list of clauses that must all match: one clause with a
//!   match per `to` operation, one with a match per `from` source, and one
//!   per `when` condition (values and notValues in one match);
//! * `serviceAccounts` (`sa` in the policy's namespace, or `ns/sa`) and the
//!   `source.serviceAccount` condition become principal matches on the
//!   suffix `/ns/<ns>/sa/<sa>`: any trust domain, as Istio matches service
//!   accounts (identity segments hold no `/`, so the suffix pins both
//!   names);
//! * L7 attributes cannot be checked by ztunnel (Istio's list: hosts,
//!   methods, paths and their negations, requestPrincipals, remoteIpBlocks
//!   and their negations, `when` keys other than the L4 ones): in an ALLOW
//!   policy the rule holding them is omitted (it never matches, so what it
//!   would have allowed is denied when no other rule allows it: fails
//!   closed), in a DENY policy they are dropped (the rule denies more: fails
//!   closed too); the model writer logs a warning naming the policy and the
//!   fields when it accepts a new version ([`unsupported_warning`]);
//! * CUSTOM and AUDIT policies and policies with `targetRef(s)` (waypoint
//!   policies) are not sent to ztunnel.

use ambit_proto::AUTHORIZATION_TYPE_URL;
use ambit_proto::security::{
    Action, Address as AuthzAddress, Authorization, Clause, Match, Rule, Scope, StringMatch,
    string_match::MatchType,
};

use super::index::{LabelIndex, ROOT_NAMESPACES, WorkloadDraft};
use super::snapshot::XdsResource;
use super::store::NamespaceObjects;
use ambit_config::objects::{
    AuthorizationAction, AuthorizationPolicy, AuthorizationRule, Cidr, Condition, Labels,
    Operation, Source, service_account_ref,
};

/// Translates the namespace's policies, attaches selector policies to the
/// namespace's workloads and collects root-namespace selector policies (which
/// select across all namespaces) into `root`.
pub(crate) fn translate_namespace<'a>(
    ns: &str,
    objs: &'a NamespaceObjects,
    index: &LabelIndex<'_>,
    wls: &mut [WorkloadDraft<'_>],
    out: &mut Vec<XdsResource>,
    root: &mut Vec<(String, &'a Labels)>,
) {
    let is_root = ROOT_NAMESPACES.contains(&ns);
    for (name, pol) in &objs.authorization_policies {
        let Some(auth) = convert(ns, pol, is_root) else {
            continue;
        };
        let full = format!("{ns}/{name}");
        if let Some(sel) = pol.spec.selector_labels() {
            if is_root {
                root.push((full.clone(), sel));
            } else {
                for idx in index.select(sel) {
                    wls[idx].w.authorization_policies.push(full.clone());
                }
            }
        }
        out.push(XdsResource::new(
            AUTHORIZATION_TYPE_URL,
            full,
            Vec::new(),
            &auth,
        ));
    }
}

/// Attaches root-namespace selector policies to matching pods and
/// WorkloadEntries of every namespace.
pub(crate) fn apply_root_policies(root: &[(String, &Labels)], wls: &mut [WorkloadDraft<'_>]) {
    if root.is_empty() {
        return;
    }
    for wl in wls.iter_mut() {
        let Some(view) = wl.selectable else {
            continue;
        };
        for (full, sel) in root {
            if view.matches(sel) {
                wl.w.authorization_policies.push(full.clone());
            }
        }
    }
}

/// Converts one policy; `None` when it is not for ztunnel.
pub fn convert(ns: &str, pol: &AuthorizationPolicy, is_root: bool) -> Option<Authorization> {
    let spec = &pol.spec;
    let name = &pol.metadata.name;
    let action = match spec.action {
        AuthorizationAction::Allow => Action::Allow,
        AuthorizationAction::Deny => Action::Deny,
        AuthorizationAction::Audit | AuthorizationAction::Custom => {
            tracing::debug!(namespace = ns, name = %name, "CUSTOM/AUDIT policy is not enforced by ztunnel; skipped");
            return None;
        }
    };
    if spec.target_ref.is_some() || !spec.target_refs.is_empty() {
        tracing::debug!(namespace = ns, name = %name, "policy with targetRefs applies to waypoints, not ztunnel; skipped");
        return None;
    }
    let scope = match (spec.selector_labels(), is_root) {
        (Some(_), _) => Scope::WorkloadSelector,
        (None, true) => Scope::Global,
        (None, false) => Scope::Namespace,
    };
    let rules = spec
        .rules
        .iter()
        .filter_map(|r| convert_rule(r, action, ns))
        .collect();
    Some(Authorization {
        name: name.clone(),
        namespace: ns.to_string(),
        scope: scope as i32,
        action: action as i32,
        rules,
    })
}

/// The HTTP attributes a policy uses that ztunnel cannot check, by their
/// Istio field names (`when` conditions by key), sorted and deduplicated —
/// the list Istio puts in its `UnsupportedValue` status ("ztunnel does not
/// support HTTP attributes (found: ...)"). `remoteIpBlocks` and
/// `notRemoteIpBlocks` are among them, as in Istio.
pub fn l7_fields(pol: &AuthorizationPolicy) -> Vec<String> {
    let mut found: Vec<String> = Vec::new();
    for r in &pol.spec.rules {
        for t in &r.to {
            found.extend(operation_l7(&t.operation).iter().map(|s| s.to_string()));
        }
        for f in &r.from {
            found.extend(source_l7(&f.source).iter().map(|s| s.to_string()));
        }
        for c in &r.when {
            if !L4_WHEN_KEYS.contains(&c.key.as_str()) {
                found.push(c.key.clone());
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

/// What ztunnel will not enforce of `pol` as written, or `None`: the CUSTOM
/// and AUDIT actions, or HTTP attributes ([`l7_warning`]).
pub fn unsupported_warning(pol: &AuthorizationPolicy) -> Option<String> {
    let action = match pol.spec.action {
        AuthorizationAction::Custom => "CUSTOM",
        AuthorizationAction::Audit => "AUDIT",
        AuthorizationAction::Allow | AuthorizationAction::Deny => return l7_warning(pol),
    };
    let (ns, name) = (&pol.metadata.namespace, &pol.metadata.name);
    Some(format!(
        "AuthorizationPolicy {ns}/{name}: ztunnel does not support the {action} action; accepted but not enforced (no policy is sent to ztunnel)"
    ))
}

/// The warning for a policy that applies to ztunnel and uses HTTP
/// attributes, or `None`; the wording follows Istio's status message.
pub fn l7_warning(pol: &AuthorizationPolicy) -> Option<String> {
    let spec = &pol.spec;
    if spec.target_ref.is_some() || !spec.target_refs.is_empty() {
        return None;
    }
    let effect = match spec.action {
        AuthorizationAction::Allow => {
            "within an ALLOW policy, rules matching HTTP attributes are omitted (they never match)"
        }
        AuthorizationAction::Deny => {
            "a DENY policy with HTTP attributes is enforced without the HTTP rules"
        }
        AuthorizationAction::Audit | AuthorizationAction::Custom => return None,
    };
    let fields = l7_fields(pol);
    if fields.is_empty() {
        return None;
    }
    Some(format!(
        "AuthorizationPolicy {}/{}: ztunnel does not support HTTP attributes (found: {}); \
         {effect}, which is more restrictive than requested; attach the policy to a \
         waypoint with targetRefs to enforce them",
        pol.metadata.namespace,
        pol.metadata.name,
        fields.join(", ")
    ))
}

const L4_WHEN_KEYS: [&str; 6] = [
    "source.ip",
    "source.namespace",
    "source.principal",
    "source.serviceAccount",
    "destination.ip",
    "destination.port",
];

fn operation_l7(o: &Operation) -> Vec<&'static str> {
    [
        ("hosts", o.hosts.is_empty()),
        ("notHosts", o.not_hosts.is_empty()),
        ("methods", o.methods.is_empty()),
        ("notMethods", o.not_methods.is_empty()),
        ("paths", o.paths.is_empty()),
        ("notPaths", o.not_paths.is_empty()),
    ]
    .into_iter()
    .filter_map(|(name, empty)| (!empty).then_some(name))
    .collect()
}

fn source_l7(s: &Source) -> Vec<&'static str> {
    [
        ("remoteIpBlocks", s.remote_ip_blocks.is_empty()),
        ("notRemoteIpBlocks", s.not_remote_ip_blocks.is_empty()),
        ("requestPrincipals", s.request_principals.is_empty()),
        ("notRequestPrincipals", s.not_request_principals.is_empty()),
    ]
    .into_iter()
    .filter_map(|(name, empty)| (!empty).then_some(name))
    .collect()
}

fn match_is_empty(m: &Match) -> bool {
    *m == Match::default()
}

/// One rule. In an ALLOW policy a rule with any HTTP attribute is omitted
/// (`None`), as Istio does. In a DENY policy the HTTP attributes are
/// dropped and the L4 part kept; an operation or source that held only
/// HTTP attributes then matches any connection, so its whole `to` / `from`
/// clause (an OR) matches anything and is left out — emitting an empty
/// match instead would make the clause match nothing (ztunnel's semantics)
/// and the DENY would fail open. `ns` is the policy's namespace (for bare
/// service account names).
fn convert_rule(rule: &AuthorizationRule, action: Action, ns: &str) -> Option<Rule> {
    let allow = action == Action::Allow;
    let mut clauses = Vec::new();
    let mut to = Vec::with_capacity(rule.to.len());
    let mut to_any = false;
    for t in &rule.to {
        let o = &t.operation;
        let l7 = !operation_l7(o).is_empty();
        if allow && l7 {
            return None;
        }
        let m = Match {
            destination_ports: o.ports.iter().map(|p| p.0.into()).collect(),
            not_destination_ports: o.not_ports.iter().map(|p| p.0.into()).collect(),
            ..Default::default()
        };
        to_any |= l7 && match_is_empty(&m);
        to.push(m);
    }
    if !to.is_empty() && !to_any {
        clauses.push(Clause { matches: to });
    }
    let mut from = Vec::with_capacity(rule.from.len());
    let mut from_any = false;
    for f in &rule.from {
        let s = &f.source;
        let l7 = !source_l7(s).is_empty();
        if allow && l7 {
            return None;
        }
        let m = Match {
            namespaces: string_matches(&s.namespaces, false),
            not_namespaces: string_matches(&s.not_namespaces, false),
            // Decoding refuses serviceAccounts next to principals, so
            // each list holds one kind.
            principals: [
                string_matches(&s.principals, true),
                service_account_matches(&s.service_accounts, ns),
            ]
            .concat(),
            not_principals: [
                string_matches(&s.not_principals, true),
                service_account_matches(&s.not_service_accounts, ns),
            ]
            .concat(),
            source_ips: s.ip_blocks.iter().map(cidr).collect(),
            not_source_ips: s.not_ip_blocks.iter().map(cidr).collect(),
            ..Default::default()
        };
        from_any |= l7 && match_is_empty(&m);
        from.push(m);
    }
    if !from.is_empty() && !from_any {
        clauses.push(Clause { matches: from });
    }
    for c in &rule.when {
        if !L4_WHEN_KEYS.contains(&c.key.as_str()) {
            if allow {
                return None;
            }
            continue;
        }
        // values and notValues of one condition go into ONE match: a clause
        // whose only match sets no field never matches (Istio's semantics),
        // which would make the whole rule unmatchable.
        clauses.push(Clause {
            matches: vec![when_match(c, ns)],
        });
    }
    Some(Rule { clauses })
}

fn when_match(c: &Condition, ns: &str) -> Match {
    let mut m = Match::default();
    match c.key.as_str() {
        "source.namespace" => {
            m.namespaces = string_matches(&c.values, false);
            m.not_namespaces = string_matches(&c.not_values, false);
        }
        "source.principal" => {
            m.principals = string_matches(&c.values, true);
            m.not_principals = string_matches(&c.not_values, true);
        }
        "source.serviceAccount" => {
            m.principals = service_account_matches(&c.values, ns);
            m.not_principals = service_account_matches(&c.not_values, ns);
        }
        "source.ip" => {
            m.source_ips = cidrs(&c.values);
            m.not_source_ips = cidrs(&c.not_values);
        }
        "destination.ip" => {
            m.destination_ips = cidrs(&c.values);
            m.not_destination_ips = cidrs(&c.not_values);
        }
        "destination.port" => {
            m.destination_ports = ports(&c.values);
            m.not_destination_ports = ports(&c.not_values);
        }
        _ => {}
    }
    m
}

fn cidrs(values: &[String]) -> Vec<AuthzAddress> {
    values
        .iter()
        .filter_map(|v| v.parse::<Cidr>().ok())
        .map(|c| cidr(&c))
        .collect()
}

fn ports(values: &[String]) -> Vec<u32> {
    values
        .iter()
        .filter_map(|v| v.trim().parse::<u16>().ok())
        .map(u32::from)
        .collect()
}

fn cidr(c: &Cidr) -> AuthzAddress {
    AuthzAddress {
        address: match c.addr {
            std::net::IpAddr::V4(a) => a.octets().to_vec(),
            std::net::IpAddr::V6(a) => a.octets().to_vec(),
        },
        length: c.len.into(),
    }
}

/// Service accounts (`sa` in `ns`, or `namespace/sa`) as principal
/// matches on `/ns/<namespace>/sa/<sa>`, whatever the trust domain.
fn service_account_matches(values: &[String], ns: &str) -> Vec<StringMatch> {
    values
        .iter()
        .map(|v| {
            let (namespace, sa) = service_account_ref(v, ns);
            StringMatch {
                match_type: Some(MatchType::Suffix(format!("/ns/{namespace}/sa/{sa}"))),
            }
        })
        .collect()
}

/// `*` = presence, `*suffix`, `prefix*`, else exact; principals lose a
/// leading `spiffe://`.
pub fn string_matches(values: &[String], principal: bool) -> Vec<StringMatch> {
    values
        .iter()
        .map(|v| {
            let v = if principal {
                v.strip_prefix("spiffe://").unwrap_or(v)
            } else {
                v
            };
            let m = if v == "*" {
                MatchType::Presence(())
            } else if let Some(s) = v.strip_prefix('*') {
                MatchType::Suffix(s.to_string())
            } else if let Some(p) = v.strip_suffix('*') {
                MatchType::Prefix(p.to_string())
            } else {
                MatchType::Exact(v.to_string())
            };
            StringMatch {
                match_type: Some(m),
            }
        })
        .collect()
}
