//! Checks of the `security.istio.io` kinds that serde cannot express. They
//! refuse what Istio's own validation refuses, so that a policy Istio would
//! reject is rejected here with the field's path and a hint — never read as
//! a different (wider, or deny-everything) policy.
//!
//! AuthorizationPolicy: one of `selector` / `targetRef` / `targetRefs`;
//! `provider` only with CUSTOM; CUSTOM and DENY need rules; every source and
//! operation sets a field; no empty strings in lists; `when` keys Istio
//! knows, each with values of the right syntax; `serviceAccounts` in the
//! `sa` / `namespace/sa` forms and not mixed with principals or namespaces;
//! `trustDomains` refused until Ambit enforces them. PeerAuthentication:
//! port-level mTLS only with a selector. Lists and maps given empty
//! (`from: []`, `portLevelMtls: {}`) and port syntax are refused while
//! deserializing (`istio.rs`), where the line is known.

use crate::objects::{
    AuthorizationAction, AuthorizationPolicy, AuthorizationPolicySpec, AuthorizationRule, Cidr,
    Condition, Labels, Operation, PeerAuthentication, Source,
};

/// Istio's limits on one `serviceAccounts` list and value.
const MAX_SERVICE_ACCOUNTS: usize = 16;
const MAX_SERVICE_ACCOUNT_LEN: usize = 320;

/// The `when` keys Istio knows that take no name.
const PLAIN_KEYS: [&str; 11] = [
    "source.ip",
    "remote.ip",
    "source.namespace",
    "source.principal",
    "source.serviceAccount",
    "request.auth.principal",
    "request.auth.audiences",
    "request.auth.presenter",
    "destination.ip",
    "destination.port",
    "connection.sni",
];

/// The `when` keys that name a header, claim or filter-metadata key in
/// brackets: the prefix, then how the message shows the form.
const MAP_KEYS: [(&str, &str); 4] = [
    ("request.headers", "request.headers[<name>]"),
    ("request.auth.claims", "request.auth.claims[<claim>]"),
    (
        "request.experimental.inline.headers",
        "request.experimental.inline.headers[<name>]",
    ),
    (
        "experimental.envoy.filters.",
        "experimental.envoy.filters.<filter>[<key>]",
    ),
];

/// What a `when` key's values must look like.
#[derive(Clone, Copy, PartialEq)]
enum Values {
    Ips,
    Ports,
    ServiceAccounts,
    Strings,
}

/// Checks an AuthorizationPolicy.
pub(super) fn validate_policy(ap: &AuthorizationPolicy) -> Result<(), String> {
    let spec = &ap.spec;
    attachment(spec)?;
    if let Some(sel) = &spec.selector {
        selector_labels(&sel.match_labels)?;
    }
    action_fields(spec)?;
    let custom = spec.action == AuthorizationAction::Custom;
    for (i, rule) in spec.rules.iter().enumerate() {
        check_rule(&format!("spec.rules[{i}]"), rule, custom)?;
    }
    Ok(())
}

/// Checks a PeerAuthentication.
pub(super) fn validate_peer_authentication(pa: &PeerAuthentication) -> Result<(), String> {
    let selects = match &pa.spec.selector {
        Some(sel) => {
            selector_labels(&sel.match_labels)?;
            !sel.match_labels.is_empty()
        }
        None => false,
    };
    if !pa.spec.port_level_mtls.is_empty() && !selects {
        return Err(
            "spec.portLevelMtls: port-level mTLS needs spec.selector.matchLabels; \
             a mesh-wide or namespace-wide PeerAuthentication cannot set it — add a selector \
             for the workloads that listen on these ports, or remove portLevelMtls"
                .to_string(),
        );
    }
    Ok(())
}

/// Only one of `selector`, `targetRef` and `targetRefs`.
fn attachment(spec: &AuthorizationPolicySpec) -> Result<(), String> {
    let set: Vec<&str> = [
        ("selector", spec.selector.is_some()),
        ("targetRef", spec.target_ref.is_some()),
        ("targetRefs", !spec.target_refs.is_empty()),
    ]
    .into_iter()
    .filter_map(|(name, set)| set.then_some(name))
    .collect();
    match set.as_slice() {
        [first, second, ..] => Err(format!(
            "spec.{second}: set together with spec.{first}; a policy applies through only one \
             of selector, targetRef and targetRefs — keep one of them"
        )),
        _ => Ok(()),
    }
}

/// Istio refuses empty label keys and `*` in selectors (a selector matches
/// exact labels; a wildcard would select nothing, silently).
fn selector_labels(labels: &Labels) -> Result<(), String> {
    for (k, v) in labels {
        if k.is_empty() {
            return Err(format!(
                "spec.selector.matchLabels: a label with an empty key (value {v:?}); name the label"
            ));
        }
        if k.contains('*') || v.contains('*') {
            return Err(format!(
                "spec.selector.matchLabels: \"{k}: {v}\" holds a wildcard; a selector matches \
                 exact label values — write the value, or leave the selector out to apply to \
                 the whole namespace"
            ));
        }
    }
    Ok(())
}

fn action_name(a: AuthorizationAction) -> &'static str {
    match a {
        AuthorizationAction::Allow => "ALLOW",
        AuthorizationAction::Deny => "DENY",
        AuthorizationAction::Audit => "AUDIT",
        AuthorizationAction::Custom => "CUSTOM",
    }
}

/// `provider` belongs to CUSTOM, which needs it and rules; a DENY without
/// rules would never match.
fn action_fields(spec: &AuthorizationPolicySpec) -> Result<(), String> {
    match spec.action {
        AuthorizationAction::Custom => {
            if spec.rules.is_empty() {
                return Err(
                    "spec.rules: a CUSTOM policy without rules never sends a request \
                     to its provider; add the rules that select the requests, or an empty rule \
                     (`rules: [{}]`) for every request"
                        .to_string(),
                );
            }
            if spec.provider.as_ref().is_none_or(|p| p.name.is_empty()) {
                return Err("spec.provider.name is missing; a CUSTOM policy names the \
                     extensionProvider (in the mesh config) that decides"
                    .to_string());
            }
        }
        action if spec.provider.is_some() => {
            return Err(format!(
                "spec.provider: only a CUSTOM policy has a provider, this one is {}; remove \
                 provider, or set action: CUSTOM",
                action_name(action)
            ));
        }
        AuthorizationAction::Deny if spec.rules.is_empty() => {
            return Err(
                "spec.rules: a DENY policy without rules never matches, so it denies \
                 nothing; add the rules to deny, or an empty rule (`rules: [{}]`) to deny every \
                 request"
                    .to_string(),
            );
        }
        _ => {}
    }
    Ok(())
}

fn check_rule(at: &str, rule: &AuthorizationRule, custom: bool) -> Result<(), String> {
    for (j, f) in rule.from.iter().enumerate() {
        check_source(&format!("{at}.from[{j}].source"), &f.source, custom)?;
    }
    for (j, t) in rule.to.iter().enumerate() {
        check_operation(&format!("{at}.to[{j}].operation"), &t.operation)?;
    }
    for (j, c) in rule.when.iter().enumerate() {
        check_condition(&format!("{at}.when[{j}]"), c, custom)?;
    }
    Ok(())
}

/// `at.field[k]` for the first empty string of `values`.
fn no_empty_strings(at: &str, field: &str, values: &[String]) -> Result<(), String> {
    match values.iter().position(String::is_empty) {
        Some(k) => Err(format!(
            "{at}.{field}[{k}] is an empty string; write the value or remove the entry"
        )),
        None => Ok(()),
    }
}

fn check_source(at: &str, s: &Source, custom: bool) -> Result<(), String> {
    for (field, values) in [
        ("trustDomains", &s.trust_domains),
        ("notTrustDomains", &s.not_trust_domains),
    ] {
        if !values.is_empty() {
            return Err(format!(
                "{at}.{field}: not supported by Ambit yet (ignoring it would widen the policy); \
                 match the trust domain with principals instead, e.g. \"example.org/*\""
            ));
        }
    }
    let identity = [
        ("principals", &s.principals),
        ("notPrincipals", &s.not_principals),
        ("namespaces", &s.namespaces),
        ("notNamespaces", &s.not_namespaces),
    ];
    let accounts = [
        ("serviceAccounts", &s.service_accounts),
        ("notServiceAccounts", &s.not_service_accounts),
    ];
    let request = [
        ("requestPrincipals", &s.request_principals),
        ("notRequestPrincipals", &s.not_request_principals),
    ];
    let ip_blocks = [
        &s.ip_blocks,
        &s.not_ip_blocks,
        &s.remote_ip_blocks,
        &s.not_remote_ip_blocks,
    ];
    let strings = identity.iter().chain(&accounts).chain(&request);
    if strings.clone().all(|(_, v)| v.is_empty()) && ip_blocks.iter().all(|v| v.is_empty()) {
        return Err(format!(
            "{at} sets no field (a misspelt field is ignored, too); a source needs at least one \
             of principals, namespaces, serviceAccounts, ipBlocks, remoteIpBlocks, \
             requestPrincipals or their not- forms — to match any source, leave `from` out"
        ));
    }
    for (field, values) in strings {
        no_empty_strings(at, field, values)?;
    }
    if let Some((sa_field, _)) = accounts.iter().find(|(_, v)| !v.is_empty())
        && let Some((other, _)) = identity.iter().find(|(_, v)| !v.is_empty())
    {
        return Err(format!(
            "{at}: {sa_field} cannot be combined with {other} in one source; list them in \
             separate `from` entries (any entry may match), or write the accounts as principals \
             (\"*/ns/<namespace>/sa/<name>\")"
        ));
    }
    for (field, values) in accounts {
        service_accounts(&format!("{at}.{field}"), values)?;
    }
    if custom {
        let mut unsupported = identity.iter().chain(&accounts).chain(&request);
        if let Some((field, _)) = unsupported.find(|(_, v)| !v.is_empty()) {
            return Err(format!(
                "{at}.{field}: a CUSTOM policy cannot match on {field} (Istio does not \
                 support identity fields in CUSTOM rules); match on ipBlocks or the operation, \
                 and check the identity in an ALLOW or DENY policy"
            ));
        }
    }
    Ok(())
}

/// Istio's `serviceAccounts` form: at most 16 values, each `sa` or
/// `namespace/sa`, no wildcard, at most 320 characters.
fn service_accounts(at: &str, values: &[String]) -> Result<(), String> {
    if values.len() > MAX_SERVICE_ACCOUNTS {
        return Err(format!(
            "{at}: {} values, more than the {MAX_SERVICE_ACCOUNTS} Istio allows; split them over \
             several `from` entries",
            values.len()
        ));
    }
    for (k, v) in values.iter().enumerate() {
        let bad = |what: &str| {
            Err(format!(
                "{at}[{k}]: {v:?} {what}; write a service account as `name` (in the policy's \
                 namespace) or `namespace/name`"
            ))
        };
        if v.contains('*') {
            return bad(
                "holds a wildcard, which serviceAccounts does not allow (use principals or namespaces for patterns)",
            );
        }
        if v.len() > MAX_SERVICE_ACCOUNT_LEN {
            return bad("is longer than 320 characters");
        }
        let parts: Vec<&str> = v.split('/').collect();
        if parts.len() > 2 {
            return bad("has more than one '/'");
        }
        if parts.iter().any(|p| p.is_empty()) {
            return bad("has an empty namespace or name");
        }
    }
    Ok(())
}

fn check_operation(at: &str, o: &Operation) -> Result<(), String> {
    let strings = [
        ("hosts", &o.hosts),
        ("notHosts", &o.not_hosts),
        ("methods", &o.methods),
        ("notMethods", &o.not_methods),
        ("paths", &o.paths),
        ("notPaths", &o.not_paths),
    ];
    if strings.iter().all(|(_, v)| v.is_empty()) && o.ports.is_empty() && o.not_ports.is_empty() {
        return Err(format!(
            "{at} sets no field (a misspelt field is ignored, too); an operation needs at least \
             one of hosts, ports, methods, paths or their not- forms — to match any operation, \
             leave `to` out"
        ));
    }
    for (field, values) in strings {
        no_empty_strings(at, field, values)?;
    }
    Ok(())
}

fn check_condition(at: &str, c: &Condition, custom: bool) -> Result<(), String> {
    let key = c.key.as_str();
    if key.is_empty() {
        return Err(format!(
            "{at}.key is missing; name the attribute, e.g. source.ip"
        ));
    }
    let kind = attribute(key).map_err(|e| format!("{at}.key: {e}"))?;
    if c.values.is_empty() && c.not_values.is_empty() {
        return Err(format!(
            "{at}: neither values nor notValues is set for {key}; list the values to match \
             (values) or to exclude (notValues)"
        ));
    }
    if custom
        && (matches!(
            key,
            "source.namespace" | "source.principal" | "source.serviceAccount"
        ) || key.starts_with("request.auth."))
    {
        return Err(format!(
            "{at}.key: a CUSTOM policy cannot match on {key} (Istio does not support \
             identity conditions in CUSTOM rules); check the identity in an ALLOW or DENY policy"
        ));
    }
    for (field, values) in [("values", &c.values), ("notValues", &c.not_values)] {
        no_empty_strings(at, field, values)?;
        if kind == Values::ServiceAccounts {
            service_accounts(&format!("{at}.{field}"), values)?;
            continue;
        }
        for (k, v) in values.iter().enumerate() {
            let value_at = format!("{at}.{field}[{k}]");
            match kind {
                Values::Ips => {
                    v.parse::<Cidr>()
                        .map_err(|e| format!("{value_at}: {e}; {key} takes IPs or CIDRs"))?;
                }
                Values::Ports => {
                    if v.trim().parse::<u16>().ok().filter(|p| *p != 0).is_none() {
                        return Err(format!(
                            "{value_at}: {v:?} is not a port number; {key} takes numbers 1-65535"
                        ));
                    }
                }
                Values::ServiceAccounts | Values::Strings => {}
            }
        }
    }
    Ok(())
}

/// What the values of `key` must look like, or why Istio refuses the key.
fn attribute(key: &str) -> Result<Values, String> {
    match key {
        "source.ip" | "remote.ip" | "destination.ip" => return Ok(Values::Ips),
        "destination.port" => return Ok(Values::Ports),
        "source.serviceAccount" => return Ok(Values::ServiceAccounts),
        k if PLAIN_KEYS.contains(&k) => return Ok(Values::Strings),
        "destination.namespace" => {
            return Err(format!(
                "{key:?} is no longer a condition; a policy applies in its own namespace \
                 (metadata.namespace) — create the policy in the namespace to match"
            ));
        }
        "destination.name" | "destination.user" => {
            return Err(format!(
                "{key:?} is deprecated (only Istio's old v1alpha1 RBAC had it); choose the \
                 workloads with spec.selector or spec.targetRefs"
            ));
        }
        k if k.starts_with("destination.labels") => {
            return Err(format!(
                "{key:?} is no longer a condition; choose the workloads with \
                 spec.selector.matchLabels"
            ));
        }
        _ => {}
    }
    for (prefix, form) in MAP_KEYS {
        let Some(rest) = key.strip_prefix(prefix) else {
            continue;
        };
        // For the filter prefix the filter name comes before the bracket.
        let rest = if prefix.ends_with('.') {
            match rest.find('[') {
                Some(open) if open > 0 => &rest[open..],
                _ => "",
            }
        } else {
            rest
        };
        let named = rest
            .strip_prefix('[')
            .and_then(|r| r.strip_suffix(']'))
            .is_some_and(|name| !name.is_empty());
        return if named {
            Ok(Values::Strings)
        } else {
            Err(format!(
                "{key:?} does not name what to match; write it as {form}"
            ))
        };
    }
    let known: Vec<&str> = PLAIN_KEYS
        .iter()
        .copied()
        .chain(MAP_KEYS.iter().map(|(_, form)| *form))
        .collect();
    let guess = suggestion(key)
        .map(|s| format!(" (did you mean {s}?)"))
        .unwrap_or_default();
    Err(format!(
        "{key:?} is not an attribute Istio knows{guess}; use one of {}",
        known.join(", ")
    ))
}

/// The known key closest to a misspelt `key`, when it is close.
fn suggestion(key: &str) -> Option<&'static str> {
    let stem = key.split('[').next().unwrap_or(key);
    PLAIN_KEYS
        .iter()
        .map(|k| (*k, edit_distance(key, k)))
        .chain(
            MAP_KEYS
                .iter()
                .map(|(p, form)| (*form, edit_distance(stem, p.trim_end_matches('.')))),
        )
        .filter(|(k, d)| *d <= 3 && *d * 4 <= k.len())
        .min_by_key(|(_, d)| *d)
        .map(|(k, _)| k)
}

/// Levenshtein distance over bytes (keys are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.bytes().enumerate() {
        let mut cur = Vec::with_capacity(b.len() + 1);
        cur.push(i + 1);
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}
