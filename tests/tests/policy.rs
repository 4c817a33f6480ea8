//! Policy semantics end to end, without a network: YAML -> the control
//! plane's translation (`build_snapshot`) -> the xDS resources it would send
//! -> a ztunnel `StateSnapshot` -> ztunnel's policy engine (`PolicyIndex`),
//! asserting the decision on inbound connections for the PeerAuthentication
//! and AuthorizationPolicy behaviours users rely on.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::IpAddr;
use std::path::Path;

use ambit_config::parse_documents;
use ambit_control::model::{ModelOptions, Snapshot, Store, build_snapshot};
use ambit_ztunnel::StateSnapshot;
use ambit_ztunnel::rbac::{ConnectionAttrs, Decision, PeerIdentity, PolicyIndex};
use ambit_ztunnel::state::{Address, Authorization};
use prost::Message;

const STATIC_STRICT: &str = "istio-system/istio_converted_static_strict";
const CLIENT: &str = "spiffe://cluster.local/ns/a/sa/client";

/// The mesh as one ztunnel sees it.
struct Mesh {
    state: StateSnapshot,
    index: PolicyIndex,
}

impl Mesh {
    fn new(yaml: &str) -> Self {
        let (objs, errs) = parse_documents(Path::new("policy.yaml"), yaml);
        assert!(errs.is_empty(), "config errors: {errs:#?}");
        let store = Store::from_objects(objs);
        let snap = build_snapshot(&store, &Snapshot::default(), &ModelOptions::default());
        let mut state = StateSnapshot::default();
        for (name, r) in &snap.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name {
            assert_eq!(r.body.type_url, ambit_proto::ADDRESS_TYPE_URL);
            let msg = ambit_proto::workload::Address::decode(r.body.value.as_slice()).unwrap();
            let addr = Address::try_from(&msg).unwrap();
            state.apply_address(name, &r.version, addr);
        }
        for (name, r) in &snap.mesh(ambit_proto::AUTHORIZATION_TYPE_URL).by_name {
            assert_eq!(r.body.type_url, ambit_proto::AUTHORIZATION_TYPE_URL);
            let msg =
                ambit_proto::security::Authorization::decode(r.body.value.as_slice()).unwrap();
            let auth = Authorization::try_from(&msg).unwrap();
            state.apply_authorization(name, &r.version, auth);
        }
        let index = PolicyIndex::build(&state);
        Self { state, index }
    }

    /// The decision on a connection from `src` (plaintext when `principal`
    /// is `None`) to `dst:port`.
    fn decide(&self, src: &str, principal: Option<&str>, dst: &str, port: u16) -> Decision {
        let dst_ip: IpAddr = dst.parse().unwrap();
        let src_ip: IpAddr = src.parse().unwrap();
        let w = self
            .state
            .workload_by_ip("", dst_ip)
            .unwrap_or_else(|| panic!("no workload at {dst}"));
        let conn = match principal {
            None => ConnectionAttrs::plaintext(src_ip, dst_ip, port),
            Some(p) => {
                ConnectionAttrs::mtls(src_ip, PeerIdentity::from_spiffe(p).unwrap(), dst_ip, port)
            }
        };
        self.index.evaluate(&w, &conn)
    }

    fn allowed(&self, principal: Option<&str>, dst: &str, port: u16) -> bool {
        self.decide("10.200.0.9", principal, dst, port).is_allowed()
    }
}

fn denied_by(d: &Decision) -> &str {
    match d {
        Decision::Allow => "",
        Decision::Deny { policy } => policy.as_str(),
    }
}

fn pod(ns: &str, name: &str, ip: &str, labels: &str) -> String {
    format!(
        "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels: {{{labels}}}\nspec:\n  nodeName: node1\n  serviceAccountName: {name}\nstatus:\n  podIP: {ip}\n"
    )
}

fn pa(ns: &str, name: &str, body: &str) -> String {
    format!(
        "---\napiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {body}\n"
    )
}

fn ap(ns: &str, name: &str, spec: &str) -> String {
    format!(
        "---\napiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {spec}\n"
    )
}

#[test]
fn peer_authentication_modes() {
    let yaml = pod("strict", "web", "10.1.0.1", "app: web")
        + &pod("open", "web", "10.1.0.2", "app: web")
        + &pod("none", "web", "10.1.0.3", "app: web")
        + &pod("ports", "web", "10.1.0.4", "app: web")
        + &pod("ports", "db", "10.1.0.5", "app: db")
        + &pod("portstrict", "web", "10.1.0.6", "app: web")
        + &pa("strict", "default", "{mtls: {mode: STRICT}}")
        + &pa("open", "default", "{mtls: {mode: PERMISSIVE}}")
        + &pa("ports", "default", "{mtls: {mode: STRICT}}")
        + &pa(
            "ports",
            "web",
            "{selector: {matchLabels: {app: web}}, portLevelMtls: {8080: {mode: PERMISSIVE}}}",
        )
        + &pa(
            "portstrict",
            "web",
            "{selector: {matchLabels: {app: web}}, portLevelMtls: {9090: {mode: STRICT}}}",
        );
    let m = Mesh::new(&yaml);

    // Namespace STRICT: plaintext denied (by the converted policy), mTLS allowed.
    let d = m.decide("10.200.0.9", None, "10.1.0.1", 8080);
    assert_eq!(denied_by(&d), STATIC_STRICT);
    assert!(m.allowed(Some(CLIENT), "10.1.0.1", 8080));
    // Namespace PERMISSIVE, and no PeerAuthentication at all: plaintext allowed.
    assert!(m.allowed(None, "10.1.0.2", 8080));
    assert!(m.allowed(Some(CLIENT), "10.1.0.2", 8080));
    assert!(m.allowed(None, "10.1.0.3", 8080));
    // Port-level PERMISSIVE exception under STRICT: plaintext on that port only.
    assert!(m.allowed(None, "10.1.0.4", 8080));
    let d = m.decide("10.200.0.9", None, "10.1.0.4", 9090);
    assert_eq!(
        denied_by(&d),
        "ports/converted_peer_authentication_web",
        "plaintext to another port of the excepted workload"
    );
    assert!(m.allowed(Some(CLIENT), "10.1.0.4", 9090));
    // The exception is the selected workload's only.
    assert!(!m.allowed(None, "10.1.0.5", 8080));
    assert!(m.allowed(Some(CLIENT), "10.1.0.5", 8080));
    // Port-level STRICT under PERMISSIVE: that port only.
    assert!(m.allowed(None, "10.1.0.6", 8080));
    assert!(!m.allowed(None, "10.1.0.6", 9090));
    assert!(m.allowed(Some(CLIENT), "10.1.0.6", 9090));
}

#[test]
fn mesh_wide_strict_with_overrides() {
    let yaml = pod("a", "web", "10.2.0.1", "app: web")
        + &pod("b", "web", "10.2.0.2", "app: web")
        + &pod("b", "legacy", "10.2.0.3", "app: legacy")
        + &pod("c", "web", "10.2.0.4", "app: web")
        + &pa("ambit-system", "default", "{mtls: {mode: STRICT}}")
        + &pa("b", "default", "{mtls: {mode: UNSET}}")
        + &pa(
            "b",
            "legacy",
            "{selector: {matchLabels: {app: legacy}}, mtls: {mode: DISABLE}}",
        )
        + &pa("c", "default", "{mtls: {mode: PERMISSIVE}}");
    let m = Mesh::new(&yaml);
    assert!(!m.allowed(None, "10.2.0.1", 80), "mesh-wide STRICT");
    assert!(m.allowed(Some(CLIENT), "10.2.0.1", 80));
    assert!(!m.allowed(None, "10.2.0.2", 80), "namespace UNSET inherits");
    assert!(
        m.allowed(None, "10.2.0.3", 80),
        "workload DISABLE overrides"
    );
    assert!(
        m.allowed(None, "10.2.0.4", 80),
        "namespace PERMISSIVE overrides"
    );
}

#[test]
fn deny_by_default_with_named_allows() {
    let yaml = pod("shop", "web", "10.3.0.1", "app: web")
        + &ap("shop", "deny-all", "{}")
        + &ap(
            "shop",
            "allow-client",
            "{action: ALLOW, rules: [{from: [{source: {principals: [cluster.local/ns/a/sa/client]}}]}]}",
        );
    let m = Mesh::new(&yaml);
    assert!(m.allowed(Some(CLIENT), "10.3.0.1", 8080));
    assert!(m.allowed(
        Some("spiffe://cluster.local/ns/a/sa/client"),
        "10.3.0.1",
        9090
    ));
    let other = m.decide(
        "10.200.0.9",
        Some("spiffe://cluster.local/ns/a/sa/other"),
        "10.3.0.1",
        8080,
    );
    assert_eq!(denied_by(&other), ambit_ztunnel::rbac::NO_ALLOW_MATCH);
    assert!(!m.allowed(
        Some("spiffe://cluster.local/ns/b/sa/client"),
        "10.3.0.1",
        8080
    ));
    assert!(
        !m.allowed(None, "10.3.0.1", 8080),
        "plaintext has no principal"
    );
}

#[test]
fn deny_when_source_ip() {
    let yaml = pod("guarded", "web", "10.4.0.1", "app: web")
        + &ap(
            "guarded",
            "deny-ip",
            "{action: DENY, rules: [{when: [{key: source.ip, values: [10.8.0.0/16]}]}]}",
        );
    let m = Mesh::new(&yaml);
    let d = m.decide("10.8.3.4", Some(CLIENT), "10.4.0.1", 80);
    assert_eq!(denied_by(&d), "guarded/deny-ip");
    assert!(!m.decide("10.8.3.4", None, "10.4.0.1", 80).is_allowed());
    assert!(m.decide("10.7.3.4", None, "10.4.0.1", 80).is_allowed());
    assert!(
        m.decide("10.7.3.4", Some(CLIENT), "10.4.0.1", 80)
            .is_allowed()
    );
}

#[test]
fn allow_rules_empty_rule_allows_all_no_rules_allows_nothing() {
    let yaml = pod("all", "web", "10.5.0.1", "app: web")
        + &pod("nothing", "web", "10.5.0.2", "app: web")
        + &ap("all", "nothing", "{}")
        + &ap("all", "everything", "{rules: [{}]}")
        + &ap("nothing", "nothing", "{action: ALLOW}");
    let m = Mesh::new(&yaml);
    assert!(m.allowed(None, "10.5.0.1", 80), "rules: [{{}}] allows all");
    assert!(m.allowed(Some(CLIENT), "10.5.0.1", 80));
    assert!(!m.allowed(None, "10.5.0.2", 80), "ALLOW without rules");
    assert!(!m.allowed(Some(CLIENT), "10.5.0.2", 80));
}

#[test]
fn missing_from_matches_any_source_and_an_empty_from_is_rejected_as_istio_does() {
    // `from: []` means nothing Istio accepts: rejected with its path, never
    // a silently different policy.
    let empty = pod("from", "empty", "10.5.1.1", "app: empty")
        + &ap(
            "from",
            "empty",
            "{selector: {matchLabels: {app: empty}}, rules: [{from: [], to: [{operation: {ports: ['80']}}]}]}",
        );
    let (_, errs) = parse_documents(Path::new("policy.yaml"), &empty);
    assert_eq!(errs.len(), 1, "{errs:#?}");
    assert!(errs[0].reason.contains("spec.rules[0].from"), "{errs:#?}");

    let yaml = pod("from", "missing", "10.5.1.2", "app: missing")
        + &ap(
            "from",
            "missing",
            "{selector: {matchLabels: {app: missing}}, rules: [{to: [{operation: {ports: ['80']}}]}]}",
        );
    let m = Mesh::new(&yaml);
    let dst = "10.5.1.2";
    assert!(m.allowed(None, dst, 80), "{dst}: plaintext on 80");
    assert!(m.allowed(Some(CLIENT), dst, 80), "{dst}: mTLS on 80");
    assert!(
        !m.allowed(Some(CLIENT), dst, 81),
        "{dst}: port 81 matches no rule"
    );
}

#[test]
fn principal_patterns() {
    let yaml = pod("pat", "star", "10.6.0.1", "app: star")
        + &pod("pat", "prefix", "10.6.0.2", "app: prefix")
        + &pod("pat", "suffix", "10.6.0.3", "app: suffix")
        + &ap(
            "pat",
            "star",
            "{selector: {matchLabels: {app: star}}, rules: [{from: [{source: {principals: ['*']}}]}]}",
        )
        + &ap(
            "pat",
            "prefix",
            "{selector: {matchLabels: {app: prefix}}, rules: [{from: [{source: {principals: ['cluster.local/ns/a/*']}}]}]}",
        )
        + &ap(
            "pat",
            "suffix",
            "{selector: {matchLabels: {app: suffix}}, rules: [{from: [{source: {principals: ['*/sa/client']}}]}]}",
        );
    let m = Mesh::new(&yaml);
    let a_other = Some("spiffe://cluster.local/ns/a/sa/other");
    let b_client = Some("spiffe://cluster.local/ns/b/sa/client");
    // `*`: any authenticated peer, never plaintext.
    assert!(m.allowed(Some(CLIENT), "10.6.0.1", 80));
    assert!(m.allowed(b_client, "10.6.0.1", 80));
    assert!(!m.allowed(None, "10.6.0.1", 80));
    // `prefix*`.
    assert!(m.allowed(Some(CLIENT), "10.6.0.2", 80));
    assert!(m.allowed(a_other, "10.6.0.2", 80));
    assert!(!m.allowed(b_client, "10.6.0.2", 80));
    // `*suffix`.
    assert!(m.allowed(Some(CLIENT), "10.6.0.3", 80));
    assert!(m.allowed(b_client, "10.6.0.3", 80));
    assert!(!m.allowed(a_other, "10.6.0.3", 80));
    assert!(!m.allowed(None, "10.6.0.3", 80));
}

#[test]
fn strict_mtls_composes_with_allow_policies() {
    let yaml = pod("both", "web", "10.7.0.1", "app: web")
        + &pa("both", "default", "{mtls: {mode: STRICT}}")
        + &ap("both", "allow-all", "{rules: [{}]}");
    let m = Mesh::new(&yaml);
    // An ALLOW that allows everything does not override STRICT (DENY first).
    assert_eq!(
        denied_by(&m.decide("10.200.0.9", None, "10.7.0.1", 80)),
        STATIC_STRICT
    );
    assert!(m.allowed(Some(CLIENT), "10.7.0.1", 80));
}

#[test]
fn allow_with_http_attributes_without_waypoint_fails_closed() {
    // Istio: the ALLOW rule with `paths` is omitted; the policy still
    // selects `web`, so the L4 traffic that rule was written for is denied.
    let yaml = pod("l7", "web", "10.9.0.1", "app: web")
        + &pod("l7", "mixed", "10.9.0.2", "app: mixed")
        + &ap(
            "l7",
            "paths",
            "{selector: {matchLabels: {app: web}}, rules: [{from: [{source: {principals: ['cluster.local/ns/a/sa/client']}}], to: [{operation: {ports: ['8080'], paths: [/api]}}]}]}",
        )
        + &ap(
            "l7",
            "mixed",
            "{selector: {matchLabels: {app: mixed}}, rules: [{to: [{operation: {methods: [GET]}}]}, {to: [{operation: {ports: ['9090']}}]}]}",
        );
    let m = Mesh::new(&yaml);
    assert!(!m.allowed(Some(CLIENT), "10.9.0.1", 8080), "fails closed");
    assert!(!m.allowed(Some(CLIENT), "10.9.0.1", 80));
    assert!(!m.allowed(None, "10.9.0.1", 8080));
    // Only the L7 rule is omitted: the L4 rule still allows.
    assert!(!m.allowed(Some(CLIENT), "10.9.0.2", 80));
    assert!(m.allowed(Some(CLIENT), "10.9.0.2", 9090));
}

#[test]
fn deny_with_http_attributes_denies_the_l4_part() {
    let yaml = pod("l7d", "web", "10.9.1.1", "app: web")
        + &ap(
            "l7d",
            "deny-get",
            "{action: DENY, rules: [{to: [{operation: {methods: [GET]}}], from: [{source: {namespaces: [a]}}]}]}",
        );
    let m = Mesh::new(&yaml);
    assert_eq!(
        denied_by(&m.decide("10.200.0.9", Some(CLIENT), "10.9.1.1", 80)),
        "l7d/deny-get",
        "methods dropped: every port from namespace a is denied"
    );
    assert!(m.allowed(Some("spiffe://cluster.local/ns/b/sa/x"), "10.9.1.1", 80));
}

#[test]
fn custom_audit_and_waypoint_policies_do_not_affect_ztunnel() {
    let yaml = pod("nz", "web", "10.9.2.1", "app: web")
        + &ap(
            "nz",
            "ext",
            "{action: CUSTOM, provider: {name: opa}, rules: [{}]}",
        )
        + &ap("nz", "audit", "{action: AUDIT, rules: [{}]}")
        + &ap(
            "nz",
            "wp-deny",
            "{targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}], action: DENY, rules: [{}]}",
        )
        + &ap(
            "nz",
            "svc-allow",
            "{targetRefs: [{kind: Service, group: '', name: web}], rules: [{from: [{source: {namespaces: [other]}}]}]}",
        );
    let m = Mesh::new(&yaml);
    assert_eq!(m.state.authorization_count(), 0, "nothing sent to ztunnel");
    assert!(m.allowed(Some(CLIENT), "10.9.2.1", 80));
    assert!(m.allowed(None, "10.9.2.1", 80));
}
