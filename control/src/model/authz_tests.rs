//! Authorization translation tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use ambit_proto::security::{Action, Scope, StringMatch, string_match::MatchType};

use super::workloads_tests::{build, pod, uid};

fn sm(m: MatchType) -> StringMatch {
    StringMatch {
        match_type: Some(m),
    }
}

#[test]
fn authorization_policies() {
    let yaml = pod("a", "p", "10.0.0.1", "app: web")
        + &pod("b", "q", "10.0.0.2", "app: web")
        + "---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: allow-web, namespace: a}
spec:
  selector: {matchLabels: {app: web}}
  action: ALLOW
  rules:
  - from:
    - source:
        principals: ['spiffe://cluster.local/ns/a/sa/client', 'cluster.local/ns/b/*', '*']
        notNamespaces: ['*-test']
        ipBlocks: [10.0.0.0/8, 192.168.1.1]
    to:
    - operation: {ports: ['8080', 9090], notPorts: ['22']}
  - to:
    - operation: {methods: [GET]}
---
apiVersion: security.istio.io/v1beta1
kind: AuthorizationPolicy
metadata: {name: deny-ns, namespace: a}
spec:
  action: DENY
  rules:
  - to: [{operation: {paths: [/admin], ports: ['9000']}}]
    when: [{key: source.ip, values: [1.2.3.4], notValues: [5.6.7.8/30]}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: global, namespace: istio-system}
spec: {}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: root-sel, namespace: ambit-system}
spec:
  selector: {matchLabels: {app: web}}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: ext, namespace: a}
spec: {action: CUSTOM, provider: {name: opa}, rules: [{}]}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: wp, namespace: a}
spec:
  targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}]
";
    let out = build(&yaml);
    let names: Vec<&str> = out.policies.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        vec![
            "a/allow-web",
            "a/deny-ns",
            "ambit-system/root-sel",
            "istio-system/global"
        ],
        "CUSTOM and waypoint (targetRefs) policies are not for ztunnel"
    );
    let allow = &out.policies["a/allow-web"];
    assert_eq!(allow.scope, Scope::WorkloadSelector as i32);
    assert_eq!(allow.action, Action::Allow as i32);
    assert_eq!(
        allow.rules.len(),
        1,
        "the ALLOW rule with an L7 attribute never matches: dropped"
    );
    let clauses = &allow.rules[0].clauses;
    assert_eq!(clauses.len(), 2);
    let to = &clauses[0].matches[0];
    assert_eq!(to.destination_ports, vec![8080, 9090]);
    assert_eq!(to.not_destination_ports, vec![22]);
    let from = &clauses[1].matches[0];
    assert_eq!(
        from.principals,
        vec![
            sm(MatchType::Exact("cluster.local/ns/a/sa/client".into())),
            sm(MatchType::Prefix("cluster.local/ns/b/".into())),
            sm(MatchType::Presence(())),
        ]
    );
    assert_eq!(
        from.not_namespaces,
        vec![sm(MatchType::Suffix("-test".into()))]
    );
    assert_eq!(from.source_ips.len(), 2);
    assert_eq!(
        (
            from.source_ips[0].address.clone(),
            from.source_ips[0].length
        ),
        (vec![10, 0, 0, 0], 8)
    );
    assert_eq!(
        (
            from.source_ips[1].address.clone(),
            from.source_ips[1].length
        ),
        (vec![192, 168, 1, 1], 32)
    );

    let deny = &out.policies["a/deny-ns"];
    assert_eq!(deny.scope, Scope::Namespace as i32);
    assert_eq!(deny.action, Action::Deny as i32);
    let c = &deny.rules[0].clauses;
    assert_eq!(
        c.len(),
        2,
        "to + one when clause holding values and notValues"
    );
    assert_eq!(
        c[0].matches[0].destination_ports,
        vec![9000],
        "DENY keeps the L4 part"
    );
    // values and notValues share one match: a match that sets no field
    // never matches, so splitting them would make the DENY inert.
    assert_eq!(c[1].matches.len(), 1);
    assert_eq!(c[1].matches[0].source_ips[0].address, vec![1, 2, 3, 4]);
    assert_eq!(c[1].matches[0].not_source_ips[0].length, 30);

    let global = &out.policies["istio-system/global"];
    assert_eq!(global.scope, Scope::Global as i32);
    assert!(global.rules.is_empty());
    assert_eq!(
        out.policies["ambit-system/root-sel"].scope,
        Scope::WorkloadSelector as i32
    );

    let p = &out.workloads[&uid("a", "p")];
    assert_eq!(
        p.authorization_policies,
        vec![
            "a/allow-web".to_string(),
            "ambit-system/root-sel".to_string()
        ]
    );
    let q = &out.workloads[&uid("b", "q")];
    assert_eq!(
        q.authorization_policies,
        vec!["ambit-system/root-sel".to_string()],
        "root selector policies select in every namespace"
    );
}

fn policy_yaml(name: &str, spec: &str) -> String {
    format!(
        "---\napiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {{name: {name}, namespace: a}}\nspec: {spec}\n"
    )
}

fn parse_policy(spec: &str) -> ambit_config::objects::AuthorizationPolicy {
    let (objs, errs) =
        ambit_config::parse_documents(std::path::Path::new("t.yaml"), &policy_yaml("p", spec));
    assert!(errs.is_empty(), "{errs:#?}");
    objs.into_iter()
        .find_map(|o| match o {
            ambit_config::objects::Object::AuthorizationPolicy(p) => Some(p),
            _ => None,
        })
        .unwrap()
}

/// Istio (ambient/authorization.go `handleRule`): in an ALLOW policy a rule
/// with any HTTP attribute is omitted, the other rules are kept; the policy
/// stays an ALLOW, so with every rule omitted it allows nothing.
#[test]
fn allow_rules_with_http_attributes_are_omitted() {
    // (case, rules, rules kept)
    let cases: &[(&str, &str, usize)] = &[
        ("methods", "[{to: [{operation: {methods: [GET]}}]}]", 0),
        (
            "notMethods",
            "[{to: [{operation: {notMethods: [GET]}}]}]",
            0,
        ),
        (
            "paths",
            "[{to: [{operation: {paths: [/x], ports: ['80']}}]}]",
            0,
        ),
        ("notPaths", "[{to: [{operation: {notPaths: [/x]}}]}]", 0),
        ("hosts", "[{to: [{operation: {hosts: [a.b]}}]}]", 0),
        ("notHosts", "[{to: [{operation: {notHosts: [a.b]}}]}]", 0),
        (
            "requestPrincipals",
            "[{from: [{source: {requestPrincipals: ['*']}}]}]",
            0,
        ),
        (
            "notRequestPrincipals",
            "[{from: [{source: {notRequestPrincipals: ['*']}}]}]",
            0,
        ),
        (
            "remoteIpBlocks",
            "[{from: [{source: {remoteIpBlocks: [10.0.0.0/8]}}]}]",
            0,
        ),
        (
            "notRemoteIpBlocks",
            "[{from: [{source: {notRemoteIpBlocks: [10.0.0.0/8]}}]}]",
            0,
        ),
        (
            "when request.headers",
            "[{when: [{key: 'request.headers[x]', values: [y]}]}]",
            0,
        ),
        (
            "one L7 rule among L4 rules",
            "[{to: [{operation: {ports: ['80']}}]}, {to: [{operation: {methods: [GET]}}]}, {from: [{source: {namespaces: [b]}}]}]",
            2,
        ),
        (
            "L4 when keys are kept",
            "[{when: [{key: source.ip, values: [1.2.3.4]}, {key: destination.port, values: ['80']}]}]",
            1,
        ),
    ];
    for (case, rules, kept) in cases {
        let out = build(&policy_yaml(
            "p",
            &format!("{{action: ALLOW, rules: {rules}}}"),
        ));
        let p = out.policies.get("a/p").unwrap_or_else(|| panic!("{case}"));
        assert_eq!(p.action, Action::Allow as i32, "{case}: stays an ALLOW");
        assert_eq!(p.rules.len(), *kept, "{case}");
    }
}

/// Istio: a DENY policy with HTTP attributes is enforced without them. An
/// operation/source holding only HTTP attributes then matches anything, so
/// its clause is left out (an empty match would match nothing and the DENY
/// would fail open).
#[test]
fn deny_rules_drop_http_attributes() {
    // (case, rules, clauses per rule, first clause's destination ports)
    let cases: &[(&str, &str, usize, Vec<u32>)] = &[
        (
            "methods only",
            "[{to: [{operation: {methods: [GET]}}]}]",
            0,
            vec![],
        ),
        (
            "paths and ports",
            "[{to: [{operation: {paths: [/x], ports: ['80']}}]}]",
            1,
            vec![80],
        ),
        (
            "one L7-only operation among others",
            "[{to: [{operation: {ports: ['80']}}, {operation: {methods: [GET]}}]}]",
            0,
            vec![],
        ),
        (
            "requestPrincipals only, with a to",
            "[{from: [{source: {requestPrincipals: ['*']}}], to: [{operation: {ports: ['81']}}]}]",
            1,
            vec![81],
        ),
        (
            "remoteIpBlocks only",
            "[{from: [{source: {remoteIpBlocks: [10.0.0.0/8]}}]}]",
            0,
            vec![],
        ),
        (
            "non-L4 when key",
            "[{to: [{operation: {ports: ['82']}}], when: [{key: 'request.auth.claims[iss]', values: [x]}]}]",
            1,
            vec![82],
        ),
    ];
    for (case, rules, clauses, ports) in cases {
        let out = build(&policy_yaml(
            "p",
            &format!("{{action: DENY, rules: {rules}}}"),
        ));
        let p = &out.policies["a/p"];
        assert_eq!(p.action, Action::Deny as i32, "{case}");
        assert_eq!(p.rules.len(), 1, "{case}: the rule is kept");
        let c = &p.rules[0].clauses;
        assert_eq!(c.len(), *clauses, "{case}");
        if let Some(first) = c.first() {
            assert_eq!(&first.matches[0].destination_ports, ports, "{case}");
        }
        assert!(
            c.iter()
                .all(|c| c.matches.iter().all(|m| *m != Default::default())),
            "{case}: no empty match"
        );
    }
}

/// CUSTOM and AUDIT (Istio: "ztunnel does not support the X action") and
/// policies with targetRef(s) (Istio: "TargetRef is not intended for
/// ztunnel") produce no Authorization; selected workloads do not list them.
#[test]
fn not_for_ztunnel() {
    let cases: &[(&str, &str)] = &[
        (
            "custom",
            "{action: CUSTOM, provider: {name: opa}, rules: [{}]}",
        ),
        ("audit", "{action: AUDIT, rules: [{}]}"),
        (
            "targetRefs gateway",
            "{targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}], action: DENY, rules: [{}]}",
        ),
        (
            "targetRefs service",
            "{targetRefs: [{kind: Service, group: '', name: web}], rules: [{to: [{operation: {methods: [GET]}}]}]}",
        ),
        (
            "targetRef",
            "{targetRef: {kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}, action: DENY, rules: [{}]}",
        ),
    ];
    for (case, spec) in cases {
        // A selector where the policy has no targetRef(s): Istio allows only
        // one of them.
        let spec = if spec.contains("targetRef") {
            spec.to_string()
        } else {
            spec.replacen('{', "{selector: {matchLabels: {app: web}}, ", 1)
        };
        let yaml = pod("a", "web", "10.0.0.1", "app: web") + &policy_yaml("p", &spec);
        let out = build(&yaml);
        assert!(out.policies.is_empty(), "{case}: {:?}", out.policies);
        assert!(
            out.workloads[&uid("a", "web")]
                .authorization_policies
                .is_empty(),
            "{case}"
        );
    }
}

/// The warning names the policy and Istio's field names; none for L4-only,
/// waypoint, CUSTOM or AUDIT policies.
#[test]
fn l7_warning_names_policy_and_fields() {
    let cases: &[(&str, Option<&str>)] = &[
        (
            "{rules: [{to: [{operation: {paths: [/x], methods: [GET]}}], from: [{source: {remoteIpBlocks: [1.2.3.4]}}], when: [{key: 'request.headers[x]', values: [y]}]}]}",
            Some(
                "a/p: ztunnel does not support HTTP attributes (found: methods, paths, remoteIpBlocks, request.headers[x]); within an ALLOW policy",
            ),
        ),
        (
            "{action: DENY, rules: [{to: [{operation: {notHosts: [h]}}]}]}",
            Some(
                "(found: notHosts); a DENY policy with HTTP attributes is enforced without the HTTP rules",
            ),
        ),
        (
            "{rules: [{from: [{source: {ipBlocks: [1.2.3.4]}}], when: [{key: destination.port, values: ['80']}]}]}",
            None,
        ),
        (
            "{targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: w}], rules: [{to: [{operation: {methods: [GET]}}]}]}",
            None,
        ),
        (
            "{action: CUSTOM, provider: {name: x}, rules: [{to: [{operation: {methods: [GET]}}]}]}",
            None,
        ),
    ];
    for (spec, want) in cases {
        let got = super::authz::l7_warning(&parse_policy(spec));
        match (want, &got) {
            (None, None) => {}
            (Some(w), Some(g)) => assert!(g.contains(w), "{spec}: {g}"),
            _ => panic!("{spec}: {got:?}"),
        }
    }
}

/// `serviceAccounts` (`ns/sa`, or `sa` in the policy's namespace) become
/// principal matches on `/ns/<ns>/sa/<sa>` (any trust domain, as Istio):
/// a source holding only them is a real constraint, never a match-all
/// source, and the `not` form and the `source.serviceAccount` condition
/// follow the same rule.
#[test]
fn service_accounts_become_principal_matches() {
    let suffix = |s: &str| sm(MatchType::Suffix(s.into()));
    let yaml = pod("a", "web", "10.0.0.1", "app: web")
        + &policy_yaml(
            "sa",
            "{selector: {matchLabels: {app: web}}, rules: [{from: [{source: {serviceAccounts: [other/sa, sa]}}]}]}",
        )
        + &policy_yaml(
            "not-sa",
            "{action: DENY, rules: [{from: [{source: {notServiceAccounts: [client]}}], to: [{operation: {ports: ['8080']}}]}]}",
        )
        + &policy_yaml(
            "when-sa",
            "{rules: [{when: [{key: source.serviceAccount, values: [b/x], notValues: [y]}]}]}",
        );
    let out = build(&yaml);

    let p = &out.policies["a/sa"];
    assert_eq!(p.rules.len(), 1, "the rule is L4: kept");
    let clauses = &p.rules[0].clauses;
    assert_eq!(clauses.len(), 1, "one `from` clause");
    let m = &clauses[0].matches[0];
    assert_eq!(
        m.principals,
        vec![suffix("/ns/other/sa/sa"), suffix("/ns/a/sa/sa")]
    );
    assert_ne!(*m, Default::default(), "not an empty (match-all) source");
    assert!(m.namespaces.is_empty() && m.not_principals.is_empty());
    assert_eq!(
        out.workloads[&uid("a", "web")].authorization_policies,
        vec!["a/sa".to_string()]
    );

    let deny = &out.policies["a/not-sa"];
    let c = &deny.rules[0].clauses;
    assert_eq!(c.len(), 2, "to + from: the DENY keeps its source");
    assert_eq!(
        c[1].matches[0].not_principals,
        vec![suffix("/ns/a/sa/client")]
    );

    let when = &out.policies["a/when-sa"];
    assert_eq!(when.rules.len(), 1, "source.serviceAccount is an L4 key");
    let m = &when.rules[0].clauses[0].matches[0];
    assert_eq!(m.principals, vec![suffix("/ns/b/sa/x")]);
    assert_eq!(m.not_principals, vec![suffix("/ns/a/sa/y")]);
}
