//! Authorization translation tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use ambit_proto::security::{Action, Scope, StringMatch, string_match::MatchType};

use super::translate_tests::{build, pod, uid};

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
spec: {action: CUSTOM, provider: {name: opa}}
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
