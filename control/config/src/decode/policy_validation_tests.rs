//! AuthorizationPolicy and PeerAuthentication documents Istio would refuse
//! are refused with the field's path and a hint, keeping the object's key
//! (its last good version keeps serving); Istio's valid examples decode.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::objects::AuthorizationAction;

/// An AuthorizationPolicy `a/p` whose `spec` is the given block (indented
/// two spaces).
fn ap(spec: &str) -> String {
    format!(
        "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {{name: p, namespace: a}}\nspec:\n{spec}"
    )
}

/// A PeerAuthentication `a/p` with the given `spec` block.
fn pa(spec: &str) -> String {
    format!(
        "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {{name: p, namespace: a}}\nspec:\n{spec}"
    )
}

/// An AuthorizationPolicy with one rule holding `when` conditions.
fn when(conditions: &str) -> String {
    ap(&format!("  rules:\n  - when:\n{conditions}"))
}

/// An AuthorizationPolicy with one rule whose `from` has one source.
fn source(fields: &str) -> String {
    ap(&format!(
        "  rules:\n  - from:\n    - source: {{{fields}}}\n"
    ))
}

/// Why `doc` (YAML, then the same object as JSON) is not rejected naming
/// `path` with `reason`, a hint and the object's key; `None` when it is.
fn rejection_problem(doc: &str, path: &str, reason: &str) -> Option<String> {
    let names_path = |m: &str| {
        m.starts_with(&format!("{path}:"))
            || m.starts_with(&format!("{path} "))
            || m.contains(&format!(" {path}:"))
            || m.contains(&format!(" {path} "))
    };
    let f = match decode_yaml_document(doc, 0) {
        Ok(o) => return Some(format!("{path}: accepted as {o:?}")),
        Err(f) => f,
    };
    let msg = f.error.to_string();
    if f.key.is_none() || f.namespace != "a" || f.name != "p" {
        return Some(format!("{path}: {msg:?} lost the object's key"));
    }
    if !names_path(&msg) || !msg.contains(reason) || !msg.contains("; ") {
        return Some(format!(
            "{path}: {msg:?} lacks the path, {reason:?} or a hint"
        ));
    }
    let value: serde_json::Value = match serde_saphyr::from_str(doc) {
        Ok(v) => v,
        Err(e) => return Some(format!("{path}: test YAML: {e}")),
    };
    let json = serde_json::to_vec(&value).ok()?;
    match decode_json(&json) {
        Ok(o) => Some(format!("{path}: JSON accepted as {o:?}")),
        Err(f) => {
            let msg = f.error.to_string();
            (!names_path(&msg) || !msg.contains(reason))
                .then(|| format!("{path}: JSON {msg:?} lacks the path or {reason:?}"))
        }
    }
}

/// Every case is rejected as [`rejection_problem`] wants; all failures are
/// reported at once.
fn all_rejected(cases: &[(String, &str, &str)]) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|(doc, path, reason)| rejection_problem(doc, path, reason))
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn accepted(doc: &str) -> Object {
    match decode_yaml_document(doc, 0) {
        Ok(Some(o)) => o,
        other => panic!("{doc}\nnot accepted: {other:?}"),
    }
}

#[test]
fn when_keys_istio_does_not_know_are_rejected() {
    let cases = vec![
        // The case found for real: it used to decode as an ALLOW policy
        // whose only rule ztunnel dropped, i.e. deny-all without an error.
        (
            when(
                "    - {key: source.ip, values: [10.0.0.0/8]}\n    - {key: source.nmespace, values: [prod]}\n",
            ),
            "spec.rules[0].when[1].key",
            "\"source.nmespace\" is not an attribute Istio knows (did you mean source.namespace?); use one of source.ip, remote.ip",
        ),
        (
            when("    - {key: 'request.heders[x-user]', values: [a]}\n"),
            "spec.rules[0].when[0].key",
            "did you mean request.headers[<name>]?",
        ),
        (
            when("    - {key: colour, values: [blue]}\n"),
            "spec.rules[0].when[0].key",
            "\"colour\" is not an attribute Istio knows; use one of",
        ),
        (
            when("    - {key: '', values: [a]}\n"),
            "spec.rules[0].when[0].key",
            "is missing",
        ),
        (
            when("    - {values: [a]}\n"),
            "spec.rules[0].when[0].key",
            "is missing",
        ),
        (
            when("    - {key: destination.namespace, values: [a]}\n"),
            "spec.rules[0].when[0].key",
            "metadata.namespace",
        ),
        (
            when("    - {key: 'destination.labels[app]', values: [web]}\n"),
            "spec.rules[0].when[0].key",
            "spec.selector.matchLabels",
        ),
        (
            when("    - {key: destination.user, values: [web]}\n"),
            "spec.rules[0].when[0].key",
            "\"destination.user\" is deprecated",
        ),
        (
            when("    - {key: destination.name, values: [web]}\n"),
            "spec.rules[0].when[0].key",
            "is deprecated",
        ),
        (
            when("    - {key: request.headers, values: [a]}\n"),
            "spec.rules[0].when[0].key",
            "write it as request.headers[<name>]",
        ),
        (
            when("    - {key: 'request.headers[]', values: [a]}\n"),
            "spec.rules[0].when[0].key",
            "write it as request.headers[<name>]",
        ),
        (
            when("    - {key: 'request.auth.claims[iss', values: [a]}\n"),
            "spec.rules[0].when[0].key",
            "write it as request.auth.claims[<claim>]",
        ),
        (
            when("    - {key: 'experimental.envoy.filters.[x]', values: [a]}\n"),
            "spec.rules[0].when[0].key",
            "experimental.envoy.filters.<filter>[<key>]",
        ),
    ];
    all_rejected(&cases);
}

#[test]
fn when_values_are_checked() {
    let cases = vec![
        (
            when("    - {key: source.ip}\n"),
            "spec.rules[0].when[0]",
            "neither values nor notValues is set for source.ip",
        ),
        (
            when("    - {key: source.ip, values: [], notValues: []}\n"),
            "spec.rules[0].when[0]",
            "neither values nor notValues",
        ),
        (
            when("    - {key: source.namespace, values: [a, '']}\n"),
            "spec.rules[0].when[0].values[1]",
            "is an empty string",
        ),
        (
            when("    - {key: 'request.headers[x]', notValues: ['']}\n"),
            "spec.rules[0].when[0].notValues[0]",
            "is an empty string",
        ),
        (
            when("    - {key: source.ip, values: [10.0.0.1, 10.0.0.0/40]}\n"),
            "spec.rules[0].when[0].values[1]",
            "not an IP address or CIDR",
        ),
        (
            when("    - {key: remote.ip, notValues: [nope]}\n"),
            "spec.rules[0].when[0].notValues[0]",
            "remote.ip takes IPs or CIDRs",
        ),
        (
            when("    - {key: destination.ip, values: [1.2.3]}\n"),
            "spec.rules[0].when[0].values[0]",
            "destination.ip takes IPs or CIDRs",
        ),
        (
            when("    - {key: destination.port, values: [http]}\n"),
            "spec.rules[0].when[0].values[0]",
            "\"http\" is not a port number; destination.port takes numbers 1-65535",
        ),
        (
            when("    - {key: destination.port, notValues: ['70000']}\n"),
            "spec.rules[0].when[0].notValues[0]",
            "is not a port number",
        ),
        (
            when("    - {key: source.serviceAccount, values: ['a/b/c']}\n"),
            "spec.rules[0].when[0].values[0]",
            "has more than one '/'",
        ),
    ];
    all_rejected(&cases);
}

#[test]
fn operation_ports_are_numbers() {
    let to = |op: &str| ap(&format!("  rules:\n  - to:\n    - operation: {{{op}}}\n"));
    let cases = vec![
        (
            to("ports: ['8080', http]"),
            "spec.rules[0].to[0].operation.ports[1]",
            "\"http\" is not a port number",
        ),
        (
            to("notPorts: [0]"),
            "spec.rules[0].to[0].operation.notPorts[0]",
            "port 0 is out of range; use 1-65535",
        ),
        (
            to("ports: ['65536']"),
            "spec.rules[0].to[0].operation.ports[0]",
            "out of range",
        ),
        (
            to("ports: ['']"),
            "spec.rules[0].to[0].operation.ports[0]",
            "is not a port number",
        ),
    ];
    all_rejected(&cases);
}

#[test]
fn conflicting_or_missing_top_level_fields_are_rejected() {
    let target = "{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}";
    let cases = vec![
        (
            ap(&format!(
                "  selector: {{matchLabels: {{app: web}}}}\n  targetRefs: [{target}]\n  rules: [{{}}]\n"
            )),
            "spec.targetRefs",
            "set together with spec.selector; a policy applies through only one of selector, targetRef and targetRefs",
        ),
        (
            ap(&format!(
                "  targetRef: {target}\n  targetRefs: [{target}]\n  rules: [{{}}]\n"
            )),
            "spec.targetRefs",
            "set together with spec.targetRef",
        ),
        (
            ap(&format!("  selector: {{}}\n  targetRef: {target}\n")),
            "spec.targetRef",
            "set together with spec.selector",
        ),
        (
            ap("  selector: {matchLabels: {app: '*'}}\n"),
            "spec.selector.matchLabels",
            "holds a wildcard",
        ),
        (
            ap("  provider: {name: opa}\n  rules: [{}]\n"),
            "spec.provider",
            "only a CUSTOM policy has a provider, this one is ALLOW",
        ),
        (
            ap("  action: DENY\n  provider: {name: opa}\n  rules: [{}]\n"),
            "spec.provider",
            "this one is DENY",
        ),
        (
            ap("  action: CUSTOM\n  provider: {name: opa}\n"),
            "spec.rules",
            "a CUSTOM policy without rules never sends a request to its provider",
        ),
        (
            ap("  action: CUSTOM\n  rules: [{}]\n"),
            "spec.provider.name",
            "is missing",
        ),
        (
            ap("  action: CUSTOM\n  provider: {name: ''}\n  rules: [{}]\n"),
            "spec.provider.name",
            "is missing",
        ),
        (
            ap("  action: DENY\n"),
            "spec.rules",
            "a DENY policy without rules never matches, so it denies nothing; add the rules to deny, or an empty rule (`rules: [{}]`)",
        ),
        (
            ap("  action: DENY\n  rules: []\n"),
            "spec.rules",
            "a DENY policy without rules never matches",
        ),
    ];
    all_rejected(&cases);
}

#[test]
fn empty_or_fieldless_sources_and_operations_are_rejected() {
    let rule = |r: &str| ap(&format!("  rules:\n  - {r}\n"));
    let cases = vec![
        (
            rule("from: []"),
            "spec.rules[0].from",
            "the list is empty; leave the field out to match anything",
        ),
        (rule("to: []"), "spec.rules[0].to", "the list is empty"),
        (
            rule("from: [{source: {}}]"),
            "spec.rules[0].from[0].source",
            "sets no field",
        ),
        (
            rule("from: [{}]"),
            "spec.rules[0].from[0].source",
            "sets no field",
        ),
        (
            rule("from: [{source: {principal: [cluster.local/ns/a/sa/b]}}]"),
            "spec.rules[0].from[0].source",
            "a misspelt field is ignored, too",
        ),
        (
            rule("to: [{operation: {}}]"),
            "spec.rules[0].to[0].operation",
            "sets no field",
        ),
        (
            rule("to: [{operation: {ports: ['80']}}, {operation: {method: [GET]}}]"),
            "spec.rules[0].to[1].operation",
            "sets no field",
        ),
        (
            source("principals: ['']"),
            "spec.rules[0].from[0].source.principals[0]",
            "is an empty string",
        ),
        (
            source("notNamespaces: [b, '']"),
            "spec.rules[0].from[0].source.notNamespaces[1]",
            "is an empty string",
        ),
        (
            source("requestPrincipals: ['']"),
            "spec.rules[0].from[0].source.requestPrincipals[0]",
            "is an empty string",
        ),
        (
            source("ipBlocks: ['']"),
            "spec.rules[0].from[0].source.ipBlocks[0]",
            "not an IP address or CIDR",
        ),
        (
            rule("to: [{operation: {methods: [GET, '']}}]"),
            "spec.rules[0].to[0].operation.methods[1]",
            "is an empty string",
        ),
        (
            rule("to: [{operation: {notPaths: ['']}}]"),
            "spec.rules[0].to[0].operation.notPaths[0]",
            "is an empty string",
        ),
    ];
    all_rejected(&cases);
}

#[test]
fn service_accounts_and_trust_domains_are_checked() {
    let seventeen: Vec<String> = (0..17).map(|i| format!("sa{i}")).collect();
    let cases = vec![
        (
            source("serviceAccounts: [b/sa], namespaces: [b]"),
            "spec.rules[0].from[0].source",
            "serviceAccounts cannot be combined with namespaces in one source",
        ),
        (
            source("notServiceAccounts: [sa], principals: ['*']"),
            "spec.rules[0].from[0].source",
            "notServiceAccounts cannot be combined with principals",
        ),
        (
            source("serviceAccounts: [sa], notPrincipals: [x]"),
            "spec.rules[0].from[0].source",
            "cannot be combined with notPrincipals",
        ),
        (
            source("serviceAccounts: ['b/*']"),
            "spec.rules[0].from[0].source.serviceAccounts[0]",
            "holds a wildcard",
        ),
        (
            source("serviceAccounts: [ok, 'cluster.local/ns/b/sa/x']"),
            "spec.rules[0].from[0].source.serviceAccounts[1]",
            "has more than one '/'; write a service account as `name` (in the policy's namespace) or `namespace/name`",
        ),
        (
            source("notServiceAccounts: [/sa]"),
            "spec.rules[0].from[0].source.notServiceAccounts[0]",
            "has an empty namespace or name",
        ),
        (
            source("serviceAccounts: ['']"),
            "spec.rules[0].from[0].source.serviceAccounts[0]",
            "is an empty string",
        ),
        (
            source(&format!("serviceAccounts: [{}]", seventeen.join(", "))),
            "spec.rules[0].from[0].source.serviceAccounts",
            "17 values, more than the 16 Istio allows",
        ),
        (
            source("trustDomains: [cluster.local]"),
            "spec.rules[0].from[0].source.trustDomains",
            "not supported by Ambit yet",
        ),
        (
            source("principals: ['*'], notTrustDomains: [other.org]"),
            "spec.rules[0].from[0].source.notTrustDomains",
            "not supported by Ambit yet",
        ),
    ];
    all_rejected(&cases);
}

#[test]
fn custom_policies_cannot_match_identities() {
    let custom = |rule: &str| {
        ap(&format!(
            "  action: CUSTOM\n  provider: {{name: opa}}\n  rules:\n  - {rule}\n"
        ))
    };
    let cases = vec![
        (
            custom("from: [{source: {principals: ['*']}}]"),
            "spec.rules[0].from[0].source.principals",
            "a CUSTOM policy cannot match on principals",
        ),
        (
            custom("from: [{source: {serviceAccounts: [sa]}}]"),
            "spec.rules[0].from[0].source.serviceAccounts",
            "a CUSTOM policy cannot match on serviceAccounts",
        ),
        (
            custom("when: [{key: source.namespace, values: [a]}]"),
            "spec.rules[0].when[0].key",
            "a CUSTOM policy cannot match on source.namespace",
        ),
        (
            custom("when: [{key: 'request.auth.claims[iss]', values: [a]}]"),
            "spec.rules[0].when[0].key",
            "cannot match on request.auth.claims[iss]",
        ),
    ];
    all_rejected(&cases);
}

#[test]
fn peer_authentication_port_level_mtls_is_checked() {
    let cases = vec![
        (
            pa("  mtls: {mode: STRICT}\n  portLevelMtls:\n    8080: {mode: PERMISSIVE}\n"),
            "spec.portLevelMtls",
            "port-level mTLS needs spec.selector.matchLabels; a mesh-wide or namespace-wide PeerAuthentication cannot set it",
        ),
        (
            pa("  selector: {}\n  portLevelMtls:\n    8080: {mode: PERMISSIVE}\n"),
            "spec.portLevelMtls",
            "needs spec.selector.matchLabels",
        ),
        (
            pa("  selector: {matchLabels: {app: web}}\n  portLevelMtls: {}\n"),
            "spec.portLevelMtls",
            "the map is empty; leave portLevelMtls out",
        ),
        (
            pa("  selector: {matchLabels: {app: web}}\n  portLevelMtls:\n    0: {mode: STRICT}\n"),
            "spec.portLevelMtls",
            "port 0 is out of range; use 1-65535",
        ),
        (
            pa(
                "  selector: {matchLabels: {app: web}}\n  portLevelMtls:\n    '65536': {mode: STRICT}\n",
            ),
            "spec.portLevelMtls",
            "out of range",
        ),
        (
            pa(
                "  selector: {matchLabels: {app: web}}\n  portLevelMtls:\n    http: {mode: STRICT}\n",
            ),
            "spec.portLevelMtls",
            "is not a port number",
        ),
        (
            pa("  selector: {matchLabels: {'': web}}\n"),
            "spec.selector.matchLabels",
            "a label with an empty key",
        ),
    ];
    all_rejected(&cases);
}

/// Istio's own "full" valid example (every field and every `when` key), a
/// source split so `serviceAccounts` stands alone, and common shapes.
#[test]
fn valid_istio_policies_are_accepted() {
    let full = ap(r#"  selector:
    matchLabels:
      app: httpbin
  rules:
    - from:
        - source:
            principals: ["principal", "principal-prefix-*", "*-suffix-principal", "*"]
            requestPrincipals: ["requestPrincipals", "requestPrincipals-prefix-*", "*"]
            namespaces: ["ns", "ns-prefix-*", "*-ns-suffix", "*"]
            ipBlocks: ["1.2.3.4", "5.6.0.0/16"]
            remoteIpBlocks: ["1.2.3.4", "5.6.0.0/16"]
            notPrincipals: ["not-principal", "*"]
            notRequestPrincipals: ["not-requestPrincipals", "*"]
            notNamespaces: ["not-ns", "*"]
            notIpBlocks: ["9.0.0.1", "9.2.0.0/16"]
            notRemoteIpBlocks: ["9.0.0.1", "9.2.0.0/16"]
      to:
        - operation:
            methods: ["method", "method-prefix-*", "*-suffix-method", "*"]
            hosts: ["exact.com", "*.suffix.com", "prefix.*", "*"]
            ports: ["80", "90"]
            paths: ["/exact", "/prefix/*", "*/suffix", "*"]
            notMethods: ["not-method", "*"]
            notHosts: ["not-exact.com", "*"]
            notPorts: ["8000", 9000]
            notPaths: ["/not-exact", "*"]
      when:
        - key: "request.headers[X-header]"
          values: ["header", "header-prefix-*", "*-suffix-header", "*"]
          notValues: ["not-header", "*"]
        - key: "source.ip"
          values: ["10.10.10.10", "192.168.10.0/24"]
          notValues: ["90.10.10.10", "90.168.10.0/24"]
        - key: "remote.ip"
          values: ["10.10.10.10", "192.168.10.0/24"]
        - key: "source.namespace"
          values: ["ns", "ns-prefix-*", "*-ns-suffix", "*"]
        - key: "source.principal"
          values: ["principal", "*"]
        - key: "source.serviceAccount"
          values: ["ns/sa", "sa"]
        - key: "request.auth.principal"
          values: ["requestPrincipals", "https://example.com/*"]
        - key: "request.auth.audiences"
          values: ["audiences", "*"]
        - key: "request.auth.presenter"
          notValues: ["not-presenter", "*"]
        - key: "request.auth.claims[iss]"
          values: ["iss", "*"]
        - key: "request.auth.claims[nested1][nested2]"
          values: ["nested", "*"]
        - key: "request.experimental.inline.headers[x-user]"
          values: ["a"]
        - key: "destination.ip"
          values: ["10.10.10.10", "192.168.10.0/24"]
        - key: "destination.port"
          values: ["91", "92"]
          notValues: ["9001", "9002"]
        - key: "connection.sni"
          values: ["exact.com", "*.suffix.com", "prefix.*", "*"]
        - key: "experimental.envoy.filters.a.b[c]"
          values: ["exact", "*"]
"#);
    let docs = [
        full,
        ap(r#"  rules:
    - from:
        - source:
            serviceAccounts: ["baz/sa", "sa"]
        - source:
            principals: ["bar"]
        - source:
            notServiceAccounts: ["other/sa"]
            ipBlocks: ["10.0.0.0/8"]
"#),
        // L4 and L7 in one rule; headers and claims.
        ap(r#"  action: DENY
  rules:
  - from: [{source: {namespaces: [prod]}}]
    to: [{operation: {ports: ["8080"], methods: [POST], paths: [/admin*]}}]
    when:
    - {key: "request.headers[x-foo]", values: [bar]}
    - {key: "request.auth.claims[iss]", values: ["https://issuer"]}
    - {key: destination.port, values: ["8080"]}
"#),
        // Allow-nothing, written the usual ways.
        ap("  {}\n"),
        ap("  rules: []\n"),
        ap("  rules:\n"),
        // Deny-all and a CUSTOM policy for every request.
        ap("  action: DENY\n  rules: [{}]\n"),
        ap("  action: CUSTOM\n  provider: {name: opa}\n  rules: [{}]\n"),
        ap("  action: AUDIT\n"),
        // null lists read as absent.
        ap("  rules:\n  - from:\n    to:\n    when:\n"),
        ap(
            "  targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}]\n  rules: [{to: [{operation: {methods: [GET]}}]}]\n",
        ),
        pa("  mtls: {mode: STRICT}\n"),
        pa(
            "  selector: {matchLabels: {app: web}}\n  mtls: {mode: STRICT}\n  portLevelMtls:\n    8080: {mode: PERMISSIVE}\n    '9090': {mode: DISABLE}\n",
        ),
        pa("  selector: {matchLabels: {app: web}}\n  portLevelMtls:\n"),
    ];
    for doc in &docs {
        accepted(doc);
    }
    let Object::AuthorizationPolicy(p) = accepted(&docs[1]) else {
        panic!("not a policy")
    };
    let sources: Vec<(&[String], &[String])> = p.spec.rules[0]
        .from
        .iter()
        .map(|f| {
            (
                f.source.service_accounts.as_slice(),
                f.source.not_service_accounts.as_slice(),
            )
        })
        .collect();
    assert_eq!(
        sources,
        vec![
            (&["baz/sa".to_string(), "sa".to_string()][..], &[][..]),
            (&[][..], &[][..]),
            (&[][..], &["other/sa".to_string()][..]),
        ],
        "serviceAccounts are decoded, not dropped"
    );
    let Object::AuthorizationPolicy(deny) = accepted(&docs[6]) else {
        panic!("not a policy")
    };
    assert_eq!(deny.spec.action, AuthorizationAction::Deny);
    assert_eq!(deny.spec.rules.len(), 1);
}

#[test]
fn service_account_refs_default_to_the_policy_namespace() {
    use crate::objects::service_account_ref;
    assert_eq!(service_account_ref("other/sa", "a"), ("other", "sa"));
    assert_eq!(service_account_ref("sa", "a"), ("a", "sa"));
}
