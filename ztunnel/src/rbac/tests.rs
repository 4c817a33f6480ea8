#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::IpAddr;
use std::sync::Arc;

use ambit_proto::security::{Action, Scope};
use ambit_proto::workload as xds;

use super::*;
use crate::state::{Authorization, IpNet, RbacMatch, StateSnapshot, StringMatch, Workload};

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn net(s: &str) -> IpNet {
    let (a, l) = s.split_once('/').unwrap();
    IpNet {
        ip: ip(a),
        prefix_len: l.parse().unwrap(),
    }
}

fn exact(s: &str) -> StringMatch {
    StringMatch::Exact(s.into())
}
fn prefix(s: &str) -> StringMatch {
    StringMatch::Prefix(s.into())
}
fn suffix(s: &str) -> StringMatch {
    StringMatch::Suffix(s.into())
}

fn workload(ns: &str, name: &str, policies: &[&str]) -> Workload {
    Workload::try_from(&xds::Workload {
        uid: format!("Kubernetes//Pod/{ns}/{name}"),
        name: name.into(),
        namespace: ns.into(),
        addresses: vec![vec![10, 0, 2, 7]],
        tunnel_protocol: xds::TunnelProtocol::Hbone as i32,
        authorization_policies: policies.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    })
    .unwrap()
}

// One-field matches, to keep the tables one line per case.

fn destination_ips(v: Vec<IpNet>) -> RbacMatch {
    RbacMatch {
        destination_ips: v,
        ..RbacMatch::default()
    }
}

fn destination_ports(v: Vec<u16>) -> RbacMatch {
    RbacMatch {
        destination_ports: v,
        ..RbacMatch::default()
    }
}

fn namespaces(v: Vec<StringMatch>) -> RbacMatch {
    RbacMatch {
        namespaces: v,
        ..RbacMatch::default()
    }
}

fn not_destination_ips(v: Vec<IpNet>) -> RbacMatch {
    RbacMatch {
        not_destination_ips: v,
        ..RbacMatch::default()
    }
}

fn not_destination_ports(v: Vec<u16>) -> RbacMatch {
    RbacMatch {
        not_destination_ports: v,
        ..RbacMatch::default()
    }
}

fn not_namespaces(v: Vec<StringMatch>) -> RbacMatch {
    RbacMatch {
        not_namespaces: v,
        ..RbacMatch::default()
    }
}

fn not_principals(v: Vec<StringMatch>) -> RbacMatch {
    RbacMatch {
        not_principals: v,
        ..RbacMatch::default()
    }
}

fn not_source_ips(v: Vec<IpNet>) -> RbacMatch {
    RbacMatch {
        not_source_ips: v,
        ..RbacMatch::default()
    }
}

fn principals(v: Vec<StringMatch>) -> RbacMatch {
    RbacMatch {
        principals: v,
        ..RbacMatch::default()
    }
}

fn source_ips(v: Vec<IpNet>) -> RbacMatch {
    RbacMatch {
        source_ips: v,
        ..RbacMatch::default()
    }
}

type Rules = Vec<Vec<Vec<RbacMatch>>>;

fn policy(key: &str, scope: Scope, action: Action, rules: Rules) -> Authorization {
    let (ns, name) = key.split_once('/').unwrap();
    Authorization {
        name: name.into(),
        namespace: ns.into(),
        scope,
        action,
        rules,
    }
}

/// One rule, one clause, one match.
fn one(m: RbacMatch) -> Rules {
    vec![vec![vec![m]]]
}

fn index(policies: Vec<Authorization>) -> PolicyIndex {
    let mut s = StateSnapshot::default();
    for p in policies {
        s.insert_authorization(p);
    }
    PolicyIndex::build(&s)
}

const SRC: &str = "10.0.1.5";
const DST: &str = "10.0.2.7";
const PORT: u16 = 8080;

/// mTLS from `spiffe://cluster.local/ns/client/sa/sleep`.
fn mtls() -> ConnectionAttrs {
    let id = PeerIdentity::from_spiffe("spiffe://cluster.local/ns/client/sa/sleep").unwrap();
    ConnectionAttrs::mtls(ip(SRC), id, ip(DST), PORT)
}

fn plaintext() -> ConnectionAttrs {
    ConnectionAttrs::plaintext(ip(SRC), ip(DST), PORT)
}

fn deny(key: &str) -> Decision {
    Decision::Deny {
        policy: DenyReason::Policy(Arc::from(key)),
    }
}

fn no_allow() -> Decision {
    Decision::Deny {
        policy: DenyReason::NoAllowMatch,
    }
}

/// Whether a single ALLOW policy (namespace scope) holding `rules` lets
/// `conn` in: i.e. whether the rules match.
fn allowed_by(rules: Rules, conn: &ConnectionAttrs) -> bool {
    let idx = index(vec![policy(
        "app/p",
        Scope::Namespace,
        Action::Allow,
        rules,
    )]);
    idx.evaluate(&workload("app", "web", &[]), conn)
        .is_allowed()
}

/// Whether a single DENY policy holding `rules` refuses `conn` (the same
/// matching from the other side).
fn denied_by(rules: Rules, conn: &ConnectionAttrs) -> bool {
    let idx = index(vec![policy("app/d", Scope::Namespace, Action::Deny, rules)]);
    idx.evaluate(&workload("app", "web", &[]), conn) == deny("app/d")
}

#[test]
fn every_match_field_and_negation() {
    let m = RbacMatch::default;
    let cases: Vec<(&str, RbacMatch, bool)> = vec![
        // namespaces (OR within the field)
        ("ns exact", namespaces(vec![exact("client")]), true),
        ("ns exact other", namespaces(vec![exact("other")]), false),
        ("ns prefix", namespaces(vec![prefix("cli")]), true),
        ("ns suffix", namespaces(vec![suffix("ent")]), true),
        ("ns presence", namespaces(vec![StringMatch::Presence]), true),
        (
            "ns any of",
            namespaces(vec![exact("x"), exact("client")]),
            true,
        ),
        ("not ns hit", not_namespaces(vec![exact("client")]), false),
        ("not ns miss", not_namespaces(vec![exact("other")]), true),
        (
            "not ns one of",
            not_namespaces(vec![exact("x"), prefix("cl")]),
            false,
        ),
        // principals, compared without spiffe://
        (
            "principal exact",
            principals(vec![exact("cluster.local/ns/client/sa/sleep")]),
            true,
        ),
        (
            "principal with scheme",
            principals(vec![exact("spiffe://cluster.local/ns/client/sa/sleep")]),
            false,
        ),
        (
            "principal other sa",
            principals(vec![exact("cluster.local/ns/client/sa/curl")]),
            false,
        ),
        (
            "principal prefix*",
            principals(vec![prefix("cluster.local/ns/client/")]),
            true,
        ),
        (
            "principal *suffix",
            principals(vec![suffix("/sa/sleep")]),
            true,
        ),
        ("principal *", principals(vec![StringMatch::Presence]), true),
        (
            "principal wrong prefix",
            principals(vec![prefix("example.org/")]),
            false,
        ),
        (
            "not principal hit",
            not_principals(vec![suffix("/sa/sleep")]),
            false,
        ),
        (
            "not principal miss",
            not_principals(vec![exact("cluster.local/ns/a/sa/b")]),
            true,
        ),
        (
            "not principal *",
            not_principals(vec![StringMatch::Presence]),
            false,
        ),
        // source ips
        ("src /24", source_ips(vec![net("10.0.1.0/24")]), true),
        ("src /32", source_ips(vec![net("10.0.1.5/32")]), true),
        ("src /0", source_ips(vec![net("0.0.0.0/0")]), true),
        ("src other", source_ips(vec![net("10.0.9.0/24")]), false),
        ("src v6 net", source_ips(vec![net("::/0")]), false),
        (
            "not src hit",
            not_source_ips(vec![net("10.0.0.0/16")]),
            false,
        ),
        (
            "not src miss",
            not_source_ips(vec![net("192.168.0.0/16")]),
            true,
        ),
        (
            "src minus hole",
            RbacMatch {
                source_ips: vec![net("10.0.0.0/8")],
                not_source_ips: vec![net("10.0.1.0/24")],
                ..m()
            },
            false,
        ),
        // destination ips
        ("dst hit", destination_ips(vec![net("10.0.2.7/32")]), true),
        ("dst miss", destination_ips(vec![net("10.0.3.0/24")]), false),
        (
            "not dst hit",
            not_destination_ips(vec![net("10.0.2.0/24")]),
            false,
        ),
        (
            "not dst miss",
            not_destination_ips(vec![net("10.0.3.0/24")]),
            true,
        ),
        // destination ports
        ("port hit", destination_ports(vec![8080]), true),
        ("port miss", destination_ports(vec![80]), false),
        ("port any of", destination_ports(vec![80, 8080]), true),
        ("not port hit", not_destination_ports(vec![8080]), false),
        ("not port miss", not_destination_ports(vec![80]), true),
        // fields are AND-ed
        (
            "all fields hold",
            RbacMatch {
                namespaces: vec![exact("client")],
                principals: vec![suffix("/sa/sleep")],
                source_ips: vec![net("10.0.0.0/8")],
                destination_ips: vec![net("10.0.2.0/24")],
                destination_ports: vec![8080],
                ..m()
            },
            true,
        ),
        (
            "one field fails",
            RbacMatch {
                namespaces: vec![exact("client")],
                destination_ports: vec![80],
                ..m()
            },
            false,
        ),
    ];
    for (name, mm, want) in cases {
        assert_eq!(allowed_by(one(mm.clone()), &mtls()), want, "ALLOW: {name}");
        assert_eq!(denied_by(one(mm), &mtls()), want, "DENY: {name}");
    }
}

#[test]
fn plaintext_has_no_principal_or_namespace() {
    let cases: Vec<(&str, RbacMatch, bool)> = vec![
        (
            "principal *",
            principals(vec![StringMatch::Presence]),
            false,
        ),
        ("principal prefix \"\"", principals(vec![prefix("")]), false),
        ("principal exact \"\"", principals(vec![exact("")]), false),
        (
            "not principal *",
            not_principals(vec![StringMatch::Presence]),
            true,
        ),
        (
            "not principal exact",
            not_principals(vec![exact("cluster.local/ns/client/sa/sleep")]),
            true,
        ),
        ("ns exact", namespaces(vec![exact("client")]), false),
        ("ns *", namespaces(vec![StringMatch::Presence]), false),
        ("not ns exact", not_namespaces(vec![exact("client")]), true),
        (
            "not ns *",
            not_namespaces(vec![StringMatch::Presence]),
            true,
        ),
        (
            "src ip still works",
            source_ips(vec![net("10.0.1.0/24")]),
            true,
        ),
        ("port still works", destination_ports(vec![8080]), true),
    ];
    for (name, mm, want) in cases {
        assert_eq!(
            allowed_by(one(mm.clone()), &plaintext()),
            want,
            "ALLOW: {name}"
        );
        assert_eq!(denied_by(one(mm), &plaintext()), want, "DENY: {name}");
    }
}

#[test]
fn rule_clause_match_structure() {
    let ns = |s: &str| RbacMatch {
        namespaces: vec![exact(s)],
        ..RbacMatch::default()
    };
    let port = |p: u16| RbacMatch {
        destination_ports: vec![p],
        ..RbacMatch::default()
    };
    let cases: Vec<(&str, Rules, bool)> = vec![
        // ALLOW with no rules allows nothing.
        ("no rules", vec![], false),
        // rules: [{}] — one rule without clauses — matches everything.
        ("one empty rule", vec![vec![]], true),
        // A clause with no matches (`from: []`) holds.
        ("empty clause", vec![vec![vec![]]], true),
        (
            "empty clause and miss",
            vec![vec![vec![], vec![port(80)]]],
            false,
        ),
        // A match that sets nothing (`from: [{source: {}}]`) never holds.
        ("empty match", vec![vec![vec![RbacMatch::default()]]], false),
        (
            "empty match or hit",
            vec![vec![vec![RbacMatch::default(), port(8080)]]],
            true,
        ),
        // Any rule.
        (
            "second rule hits",
            vec![vec![vec![ns("x")]], vec![vec![port(8080)]]],
            true,
        ),
        (
            "no rule hits",
            vec![vec![vec![ns("x")]], vec![vec![port(80)]]],
            false,
        ),
        // Every clause.
        (
            "all clauses hold",
            vec![vec![vec![ns("client")], vec![port(8080)]]],
            true,
        ),
        (
            "one clause fails",
            vec![vec![vec![ns("client")], vec![port(80)]]],
            false,
        ),
        // Any match of a clause.
        ("any match", vec![vec![vec![ns("x"), port(8080)]]], true),
        ("no match", vec![vec![vec![ns("x"), port(80)]]], false),
    ];
    for (name, rules, want) in cases {
        assert_eq!(allowed_by(rules.clone(), &mtls()), want, "ALLOW: {name}");
        assert_eq!(denied_by(rules, &mtls()), want, "DENY: {name}");
    }
}

fn allow_all() -> Rules {
    vec![vec![]]
}

fn nothing() -> Rules {
    vec![]
}

fn from_ns(ns: &str) -> Rules {
    one(RbacMatch {
        namespaces: vec![exact(ns)],
        ..RbacMatch::default()
    })
}

#[test]
fn scopes_and_actions() {
    use Action::{Allow, Deny};
    use Scope::{Global, Namespace, WorkloadSelector as Selector};
    let web = &["app/sel-deny", "app/sel-allow", "app/missing"][..];
    type Case<'a> = (&'a str, Vec<Authorization>, &'a [&'a str], Decision);
    let cases: Vec<Case<'_>> = vec![
        ("no policy", vec![], &[], Decision::Allow),
        (
            "global deny",
            vec![policy("istio-system/d", Global, Deny, allow_all())],
            &[],
            deny("istio-system/d"),
        ),
        (
            "global allow miss",
            vec![policy("istio-system/a", Global, Allow, from_ns("x"))],
            &[],
            no_allow(),
        ),
        (
            "global allow hit",
            vec![policy("istio-system/a", Global, Allow, from_ns("client"))],
            &[],
            Decision::Allow,
        ),
        (
            "namespace deny",
            vec![policy("app/d", Namespace, Deny, allow_all())],
            &[],
            deny("app/d"),
        ),
        (
            "other namespace deny ignored",
            vec![policy("other/d", Namespace, Deny, allow_all())],
            &[],
            Decision::Allow,
        ),
        (
            "other namespace allow ignored",
            vec![policy("other/a", Namespace, Allow, nothing())],
            &[],
            Decision::Allow,
        ),
        (
            "namespace allow with no rules",
            vec![policy("app/a", Namespace, Allow, nothing())],
            &[],
            no_allow(),
        ),
        (
            "namespace allow rules [{}]",
            vec![policy("app/a", Namespace, Allow, allow_all())],
            &[],
            Decision::Allow,
        ),
        (
            "selector deny named",
            vec![policy("app/sel-deny", Selector, Deny, allow_all())],
            web,
            deny("app/sel-deny"),
        ),
        (
            "selector deny not named",
            vec![policy("app/sel-deny", Selector, Deny, allow_all())],
            &[],
            Decision::Allow,
        ),
        (
            "selector allow miss",
            vec![policy("app/sel-allow", Selector, Allow, from_ns("x"))],
            web,
            no_allow(),
        ),
        (
            "selector allow hit",
            vec![policy("app/sel-allow", Selector, Allow, from_ns("client"))],
            web,
            Decision::Allow,
        ),
        (
            "selector allow not named",
            vec![policy("app/sel-allow", Selector, Allow, nothing())],
            &[],
            Decision::Allow,
        ),
        // A root-namespace selector policy is named by the workloads it selects.
        (
            "root selector named",
            vec![policy("istio-system/s", Selector, Deny, allow_all())],
            &["istio-system/s"],
            deny("istio-system/s"),
        ),
        (
            "unknown name ignored",
            vec![],
            &["app/missing"],
            Decision::Allow,
        ),
        (
            "deny over allow",
            vec![
                policy("app/a", Namespace, Allow, allow_all()),
                policy("app/d", Namespace, Deny, from_ns("client")),
            ],
            &[],
            deny("app/d"),
        ),
        (
            "selector deny over namespace allow",
            vec![
                policy("app/a", Namespace, Allow, allow_all()),
                policy("app/sel-deny", Selector, Deny, allow_all()),
            ],
            web,
            deny("app/sel-deny"),
        ),
        (
            "selector deny over selector allow",
            vec![
                policy("app/sel-allow", Selector, Allow, allow_all()),
                policy("app/sel-deny", Selector, Deny, allow_all()),
            ],
            web,
            deny("app/sel-deny"),
        ),
        (
            "deny miss then allow",
            vec![
                policy("app/a", Namespace, Allow, from_ns("client")),
                policy("app/d", Namespace, Deny, from_ns("x")),
            ],
            &[],
            Decision::Allow,
        ),
        (
            "one of several allows",
            vec![
                policy("istio-system/a", Global, Allow, from_ns("x")),
                policy("app/a", Namespace, Allow, from_ns("y")),
                policy("app/sel-allow", Selector, Allow, from_ns("client")),
            ],
            web,
            Decision::Allow,
        ),
        (
            "global allow applies with selector allow miss",
            vec![
                policy("istio-system/a", Global, Allow, from_ns("client")),
                policy("app/sel-allow", Selector, Allow, from_ns("x")),
            ],
            web,
            Decision::Allow,
        ),
        (
            "global deny reported before namespace deny",
            vec![
                policy("app/d", Namespace, Deny, allow_all()),
                policy("istio-system/d", Global, Deny, allow_all()),
            ],
            &[],
            deny("istio-system/d"),
        ),
        (
            "deny keys in order",
            vec![
                policy("app/z", Namespace, Deny, allow_all()),
                policy("app/b", Namespace, Deny, allow_all()),
            ],
            &[],
            deny("app/b"),
        ),
    ];
    for (name, policies, named, want) in cases {
        let idx = index(policies);
        let got = idx.evaluate(&workload("app", "web", named), &mtls());
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn applicable_lists_scoped_policies() {
    let idx = index(vec![
        policy("istio-system/g", Scope::Global, Action::Allow, allow_all()),
        policy("app/n", Scope::Namespace, Action::Deny, nothing()),
        policy("other/n", Scope::Namespace, Action::Deny, nothing()),
        policy("app/s", Scope::WorkloadSelector, Action::Allow, nothing()),
        policy("app/t", Scope::WorkloadSelector, Action::Allow, nothing()),
    ]);
    assert_eq!(idx.len(), 5);
    let w = workload("app", "web", &["app/s", "app/gone"]);
    let got: Vec<&str> = idx.applicable(&w).collect();
    assert_eq!(got, ["istio-system/g", "app/n", "app/s"]);
}

#[test]
fn deny_reason_labels() {
    assert_eq!(DenyReason::NoAllowMatch.to_string(), NO_ALLOW_MATCH);
    assert_eq!(DenyReason::Policy(Arc::from("a/b")).as_str(), "a/b");
    assert!(Decision::Allow.is_allowed());
    assert!(!no_allow().is_allowed());
}

#[test]
fn peer_identity_forms() {
    let id = PeerIdentity::from_spiffe("spiffe://example.org/ns/shop/sa/cart").unwrap();
    assert_eq!(id.principal(), "example.org/ns/shop/sa/cart");
    assert_eq!(id.namespace(), "shop");
    assert_eq!(id.to_string(), "spiffe://example.org/ns/shop/sa/cart");
    let same = PeerIdentity::from(&crate::identity::Identity::new(
        "example.org",
        "shop",
        "cart",
    ));
    assert_eq!(id, same);
    assert!(PeerIdentity::from_spiffe("example.org/ns/shop/sa/cart").is_err());
}

#[test]
fn ip_prefixes() {
    let cases = [
        ("10.0.0.0/8", "10.255.1.1", true),
        ("10.0.0.0/8", "11.0.0.1", false),
        ("10.0.1.128/25", "10.0.1.127", false),
        ("10.0.1.128/25", "10.0.1.200", true),
        ("0.0.0.0/0", "192.0.2.1", true),
        ("fd00::/8", "fd12::1", true),
        ("fd00::/8", "fe80::1", false),
        ("::/0", "2001:db8::1", true),
        ("::/0", "10.0.0.1", false),
        ("10.0.0.0/8", "fd00::1", false),
        ("2001:db8::1/128", "2001:db8::1", true),
        ("2001:db8::1/128", "2001:db8::2", false),
        ("::ffff:10.0.0.0/104", "10.1.2.3", true),
        ("::ffff:10.0.0.0/104", "11.1.2.3", false),
    ];
    for (n, a, want) in cases {
        assert_eq!(net_contains(&net(n), ip(a)), want, "{a} in {n}");
    }
    // A dual-stack socket reports IPv4 peers as IPv4-mapped IPv6.
    let mapped = ConnectionAttrs::plaintext(ip("::ffff:10.0.1.5"), ip(DST), PORT);
    let rules = one(RbacMatch {
        source_ips: vec![net("10.0.1.0/24")],
        ..RbacMatch::default()
    });
    assert!(allowed_by(rules, &mapped));
}

#[test]
fn cache_follows_generations_without_blocking() {
    let (mut writer, reader) = crate::state::new_state();
    let cache = PolicyCache::new();
    let web = workload("app", "web", &[]);
    let conn = mtls();

    let mut next = writer.begin();
    next.insert_workload(web.clone());
    writer.publish(next);
    let snap = reader.load();
    assert_eq!(cache.evaluate(&snap, &web, &conn), Decision::Allow);
    let first = cache.index(&snap);
    assert_eq!(first.generation(), snap.generation());

    // A new DENY takes effect with the next generation.
    let mut next = writer.begin();
    next.insert_authorization(policy("app/d", Scope::Namespace, Action::Deny, allow_all()));
    writer.publish(next);
    let snap = reader.load();
    assert_eq!(cache.evaluate(&snap, &web, &conn), deny("app/d"));
    let with_deny = cache.load();
    assert_eq!(with_deny.generation(), snap.generation());
    assert!(!with_deny.shares_tables(&first));

    // A workload-only change reuses the tables.
    let mut next = writer.begin();
    next.insert_workload(workload("app", "other", &[]));
    writer.publish(next);
    let snap = reader.load();
    let idx = cache.index(&snap);
    assert_eq!(idx.generation(), snap.generation());
    assert!(idx.shares_tables(&with_deny));

    // An older snapshot gets a correct index but does not replace the cache.
    let old = writer.current().clone();
    let mut next = writer.begin();
    next.remove_authorization("app/d");
    writer.publish(next);
    let newest = reader.load();
    assert_eq!(cache.evaluate(&newest, &web, &conn), Decision::Allow);
    assert_eq!(cache.evaluate(&old, &web, &conn), deny("app/d"));
    assert_eq!(cache.load().generation(), newest.generation());
}
