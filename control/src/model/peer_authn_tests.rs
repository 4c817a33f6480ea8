//! PeerAuthentication translation tests: effective mode per workload as
//! converted DENY policies.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use ambit_proto::security::{Action, Scope, StringMatch, string_match::MatchType};

use super::workloads_tests::{build, pod, uid};

const STATIC: &str = "istio-system/istio_converted_static_strict";
const CONV_WEB: &str = "a/converted_peer_authentication_web";

/// A PeerAuthentication; `sel` is a flow-map body (`app: web`), `ports` a
/// list of `port: MODE`.
fn pa(ns: &str, name: &str, sel: Option<&str>, mode: &str, ports: &[(u16, &str)]) -> String {
    let mut s = format!(
        "---\napiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n"
    );
    if let Some(sel) = sel {
        s += &format!("  selector: {{matchLabels: {{{sel}}}}}\n");
    }
    if !mode.is_empty() {
        s += &format!("  mtls: {{mode: {mode}}}\n");
    }
    if !ports.is_empty() {
        s += "  portLevelMtls:\n";
        for (p, m) in ports {
            s += &format!("    {p}: {{mode: {m}}}\n");
        }
    }
    s
}

fn pods() -> String {
    pod("a", "web", "10.0.0.1", "app: web")
        + &pod("a", "db", "10.0.0.2", "app: db")
        + &pod("b", "web", "10.0.0.3", "app: web")
}

/// Converted policy expectation: (key, destination_ports, not_destination_ports).
type Conv = (&'static str, &'static [u32], &'static [u32]);

struct Case {
    name: &'static str,
    pas: String,
    /// Policies named by a/web, a/db, b/web.
    expect: [&'static [&'static str]; 3],
    converted: &'static [Conv],
}

#[test]
fn peer_authentication_table() {
    let cases = [
        Case {
            name: "no PeerAuthentication: PERMISSIVE, nothing sent",
            pas: String::new(),
            expect: [&[], &[], &[]],
            converted: &[],
        },
        Case {
            name: "mesh-wide STRICT in istio-system",
            pas: pa("istio-system", "default", None, "STRICT", &[]),
            expect: [&[STATIC], &[STATIC], &[STATIC]],
            converted: &[],
        },
        Case {
            name: "mesh-wide STRICT in ambit-system",
            pas: pa("ambit-system", "default", None, "STRICT", &[]),
            expect: [&[STATIC], &[STATIC], &[STATIC]],
            converted: &[],
        },
        Case {
            name: "namespace PERMISSIVE overrides mesh STRICT",
            pas: pa("istio-system", "default", None, "STRICT", &[])
                + &pa("b", "default", None, "PERMISSIVE", &[]),
            expect: [&[STATIC], &[STATIC], &[]],
            converted: &[],
        },
        Case {
            name: "namespace STRICT overrides mesh PERMISSIVE",
            pas: pa("istio-system", "default", None, "PERMISSIVE", &[])
                + &pa("a", "default", None, "STRICT", &[]),
            expect: [&[STATIC], &[STATIC], &[]],
            converted: &[],
        },
        Case {
            name: "namespace UNSET inherits mesh STRICT",
            pas: pa("istio-system", "default", None, "STRICT", &[])
                + &pa("a", "default", None, "", &[]),
            expect: [&[STATIC], &[STATIC], &[STATIC]],
            converted: &[],
        },
        Case {
            name: "namespace DISABLE acts as PERMISSIVE",
            pas: pa("istio-system", "default", None, "STRICT", &[])
                + &pa("a", "default", None, "DISABLE", &[]),
            expect: [&[], &[], &[STATIC]],
            converted: &[],
        },
        Case {
            name: "workload selector PERMISSIVE overrides namespace STRICT",
            pas: pa("a", "default", None, "STRICT", &[])
                + &pa("a", "web", Some("app: web"), "PERMISSIVE", &[]),
            expect: [&[], &[STATIC], &[]],
            converted: &[],
        },
        Case {
            name: "workload selector STRICT overrides namespace PERMISSIVE",
            pas: pa("a", "default", None, "PERMISSIVE", &[])
                + &pa("a", "web", Some("app: web"), "STRICT", &[]),
            expect: [&[STATIC], &[], &[]],
            converted: &[],
        },
        Case {
            name: "workload selector UNSET inherits namespace STRICT",
            pas: pa("a", "default", None, "STRICT", &[])
                + &pa("a", "web", Some("app: web"), "", &[]),
            expect: [&[STATIC], &[STATIC], &[]],
            converted: &[],
        },
        Case {
            name: "port-level PERMISSIVE under namespace STRICT: DENY except that port",
            pas: pa("a", "default", None, "STRICT", &[])
                + &pa("a", "web", Some("app: web"), "", &[(8080, "PERMISSIVE")]),
            expect: [&[CONV_WEB], &[STATIC], &[]],
            converted: &[(CONV_WEB, &[], &[8080])],
        },
        Case {
            name: "port-level DISABLE under selector STRICT: DENY except that port",
            pas: pa(
                "a",
                "web",
                Some("app: web"),
                "STRICT",
                &[(9000, "DISABLE"), (80, "STRICT")],
            ),
            expect: [&[CONV_WEB], &[], &[]],
            converted: &[(CONV_WEB, &[], &[9000])],
        },
        Case {
            name: "port-level STRICT under PERMISSIVE: DENY on those ports only",
            pas: pa(
                "a",
                "web",
                Some("app: web"),
                "",
                &[(9000, "STRICT"), (80, "UNSET")],
            ),
            expect: [&[CONV_WEB], &[], &[]],
            converted: &[(CONV_WEB, &[9000], &[])],
        },
        Case {
            name: "port-level STRICT under STRICT: plain static STRICT",
            pas: pa("istio-system", "default", None, "STRICT", &[])
                + &pa("a", "web", Some("app: web"), "", &[(9000, "STRICT")]),
            expect: [&[STATIC], &[STATIC], &[STATIC]],
            converted: &[],
        },
        Case {
            name: "root-namespace selector policies do not apply (ambient)",
            pas: pa("istio-system", "web", Some("app: web"), "STRICT", &[]),
            expect: [&[], &[], &[]],
            converted: &[],
        },
        Case {
            name: "competing selector policies: first by name wins",
            pas: pa("a", "a-strict", Some("app: web"), "STRICT", &[])
                + &pa("a", "b-permissive", Some("app: web"), "PERMISSIVE", &[]),
            expect: [&[STATIC], &[], &[]],
            converted: &[],
        },
    ];
    for c in cases {
        let out = build(&(pods() + &c.pas));
        let uids = [uid("a", "web"), uid("a", "db"), uid("b", "web")];
        for (u, want) in uids.iter().zip(c.expect) {
            let w = out.workloads.get(u).expect(u);
            assert_eq!(w.authorization_policies, want, "{}: {u}", c.name);
        }
        let mut want_keys: Vec<&str> = c.converted.iter().map(|c| c.0).collect();
        if c.expect.iter().any(|e| e.contains(&STATIC)) {
            want_keys.push(STATIC);
        }
        want_keys.sort_unstable();
        let keys: Vec<&str> = out.policies.keys().map(String::as_str).collect();
        assert_eq!(keys, want_keys, "{}: policies sent", c.name);
        if let Some(s) = out.policies.get(STATIC) {
            assert_eq!(s.scope, Scope::WorkloadSelector as i32);
            assert_eq!(s.action, Action::Deny as i32);
            assert_eq!(s.rules.len(), 1);
            let m = &s.rules[0].clauses[0].matches[0];
            assert_eq!(m.not_principals, vec![presence()], "{}", c.name);
            assert!(m.destination_ports.is_empty() && m.not_destination_ports.is_empty());
        }
        for (key, ports, not_ports) in c.converted {
            let p = &out.policies[*key];
            assert_eq!(p.scope, Scope::WorkloadSelector as i32, "{}", c.name);
            assert_eq!(p.action, Action::Deny as i32, "{}", c.name);
            assert_eq!(p.namespace, "a");
            assert_eq!(p.name, "converted_peer_authentication_web");
            let m = &p.rules[0].clauses[0].matches[0];
            assert_eq!(m.not_principals, vec![presence()], "{}", c.name);
            assert_eq!(&m.destination_ports, ports, "{}", c.name);
            assert_eq!(&m.not_destination_ports, not_ports, "{}", c.name);
        }
    }
}

fn presence() -> StringMatch {
    StringMatch {
        match_type: Some(MatchType::Presence(())),
    }
}

#[test]
fn peer_authentication_composes_with_authorization_policies() {
    let yaml = pods()
        + &pa("a", "default", None, "STRICT", &[])
        + "---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: allow-web, namespace: a}
spec:
  selector: {matchLabels: {app: web}}
  rules: [{}]
";
    let out = build(&yaml);
    assert_eq!(
        out.workloads[&uid("a", "web")].authorization_policies,
        vec!["a/allow-web", STATIC]
    );
    assert!(out.policies.contains_key("a/allow-web"));
}
