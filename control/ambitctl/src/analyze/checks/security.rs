//! Security checks: policies that select nothing (IST0127), L7 policy no
//! waypoint or sidecar enforces (AMB0005), STRICT mTLS with clients outside
//! the mesh (AMB0006), deny-by-default policies refusing the metrics scrape
//! (AMB0007).

use std::collections::BTreeMap;

use ambit_config::objects::{
    AuthorizationAction, AuthorizationPolicy, Kind, LABEL_USE_WAYPOINT, Labels, Object, ObjectKey,
    Pod, selector_matches,
};
use ambit_control::model::peer_authn::{self, DecidedBy, Effective};
use ambit_control::model::{l7_fields, unsupported_warning};

use super::super::Mesh;
use super::super::message::{
    L7_POLICY_NOT_ENFORCED, METRICS_SCRAPE_DENIED, Message, NO_MATCHING_WORKLOADS,
    REFERENCED_NOT_FOUND, STRICT_WITH_PLAINTEXT_CLIENTS,
};
use crate::config::is_enrolled;

/// Namespaces whose selector-less policies apply mesh-wide (as the
/// control plane's model).
const ROOT_NAMESPACES: [&str; 2] = ["istio-system", "ambit-system"];

/// Prometheus' scrape annotations.
const SCRAPE_PORT: &str = "prometheus.io/port";
/// The sidecar agent's merged metrics and Envoy's own.
const MESH_METRICS_PORTS: [u16; 2] = [15020, 15090];

pub(super) fn run(mesh: &Mesh, out: &mut Vec<Message>) {
    selectors_match(mesh, out);
    l7_policies(mesh, out);
    strict_with_plaintext(mesh, out);
    metrics_scrape(mesh, out);
}

/// Whether a pod runs a sidecar (injection by namespace or pod label).
fn has_sidecar(ns_labels: &Labels, pod: &Pod) -> bool {
    match pod
        .metadata
        .labels
        .get("sidecar.istio.io/inject")
        .map(String::as_str)
    {
        Some("true") => true,
        Some("false") => false,
        _ => ns_labels.get("istio-injection").map(String::as_str) == Some("enabled"),
    }
}

/// Labels of every workload in view (pods and WorkloadEntries) by namespace.
fn workloads(mesh: &Mesh) -> Vec<(&str, Labels)> {
    let mut out: Vec<(&str, Labels)> = mesh
        .pods()
        .map(|(ns, p)| (ns, p.metadata.labels.clone()))
        .collect();
    for (ns, objs) in mesh.spaces() {
        for we in objs.workload_entries.values() {
            let mut l = we.metadata.labels.clone();
            l.extend(we.spec.labels.clone());
            out.push((ns, l));
        }
    }
    out
}

/// The pods a policy in `ns` with `selector` applies to.
fn selected<'m>(mesh: &'m Mesh, ns: &str, selector: Option<&Labels>) -> Vec<(&'m str, &'m Pod)> {
    let root = ROOT_NAMESPACES.contains(&ns);
    mesh.pods()
        .filter(|(pns, p)| {
            (root || *pns == ns) && selector.is_none_or(|s| selector_matches(s, &p.metadata.labels))
        })
        .collect()
}

/// IST0127 for AuthorizationPolicy and PeerAuthentication selectors.
fn selectors_match(mesh: &Mesh, out: &mut Vec<Message>) {
    let wls = workloads(mesh);
    for obj in &mesh.objects {
        let sel = match obj {
            Object::AuthorizationPolicy(ap)
                if ap.spec.target_refs.is_empty() && ap.spec.target_ref.is_none() =>
            {
                ap.spec.selector_labels()
            }
            Object::PeerAuthentication(pa) => pa
                .spec
                .selector
                .as_ref()
                .map(|s| &s.match_labels)
                .filter(|m| !m.is_empty()),
            _ => None,
        };
        let Some(sel) = sel else {
            continue;
        };
        let ns = obj.metadata().namespace.as_str();
        let root = ROOT_NAMESPACES.contains(&ns);
        if wls
            .iter()
            .any(|(wns, l)| (root || *wns == ns) && selector_matches(sel, l))
        {
            continue;
        }
        let labels: Vec<String> = sel.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let scope = if root { "any namespace" } else { ns };
        out.push(mesh.msg_at(
            NO_MATCHING_WORKLOADS,
            &obj.key(),
            "selector",
            format!(
                "No matching workloads for this resource with the following labels: {} (in {scope}); it applies to nothing — fix the selector or the pods' labels",
                labels.join(",")
            ),
        ));
    }
}

/// Whether the Service `ns/name` (or its namespace) names a waypoint.
fn bound_to_waypoint(mesh: &Mesh, ns: &str, labels: &Labels) -> bool {
    let named = |l: &Labels| {
        l.get(LABEL_USE_WAYPOINT)
            .is_some_and(|v| !v.is_empty() && v != "none")
    };
    if labels.contains_key(LABEL_USE_WAYPOINT) {
        return named(labels);
    }
    named(mesh.ns_labels(ns))
}

/// AMB0005 (and IST0101 for targetRefs naming nothing).
fn l7_policies(mesh: &Mesh, out: &mut Vec<Message>) {
    for obj in mesh.of_kind(Kind::AuthorizationPolicy) {
        let Object::AuthorizationPolicy(ap) = obj else {
            continue;
        };
        let key = obj.key();
        let ns = ap.metadata.namespace.as_str();
        let refs: Vec<_> = ap
            .spec
            .target_ref
            .iter()
            .chain(&ap.spec.target_refs)
            .collect();
        if refs.is_empty() {
            let Some(text) = unsupported_warning(ap) else {
                continue;
            };
            let pods = selected(mesh, ns, ap.spec.selector_labels());
            let sidecars = !pods.is_empty()
                && pods
                    .iter()
                    .all(|(pns, p)| has_sidecar(mesh.ns_labels(pns), p));
            if !sidecars {
                out.push(mesh.msg(
                    L7_POLICY_NOT_ENFORCED,
                    &key,
                    format!("{text}; no waypoint or sidecar enforces this policy"),
                ));
            }
            continue;
        }
        for r in refs {
            let rns = if r.namespace.is_empty() {
                ns
            } else {
                r.namespace.as_str()
            };
            let (kind, name) = (r.kind.as_str(), r.name.as_str());
            let found = match kind {
                "Gateway" => mesh
                    .spaces()
                    .find(|(n, _)| *n == rns)
                    .and_then(|(_, o)| o.gateways.get(name))
                    .map(|g| (g.is_waypoint(), true)),
                "Service" => mesh
                    .spaces()
                    .find(|(n, _)| *n == rns)
                    .and_then(|(_, o)| o.services.get(name))
                    .map(|s| (bound_to_waypoint(mesh, rns, &s.metadata.labels), false)),
                "ServiceEntry" => mesh
                    .spaces()
                    .find(|(n, _)| *n == rns)
                    .and_then(|(_, o)| o.service_entries.get(name))
                    .map(|s| (bound_to_waypoint(mesh, rns, &s.metadata.labels), false)),
                _ => continue,
            };
            match found {
                None => out.push(mesh.msg_at(
                    REFERENCED_NOT_FOUND,
                    &key,
                    "targetRefs",
                    format!(
                        "Referenced {kind} not found: targetRef {rns}/{name}; the policy applies to nothing until it exists — check the name, namespace and kind"
                    ),
                )),
                Some((true, _)) => {}
                Some((false, true)) => out.push(mesh.msg_at(
                    L7_POLICY_NOT_ENFORCED,
                    &key,
                    "targetRefs",
                    format!(
                        "targetRef Gateway {rns}/{name} is not a waypoint (gatewayClassName istio-waypoint), so nothing in the mesh enforces this policy — target a waypoint Gateway"
                    ),
                )),
                Some((false, false)) => out.push(mesh.msg_at(
                    L7_POLICY_NOT_ENFORCED,
                    &key,
                    "targetRefs",
                    format!(
                        "targetRef {kind} {rns}/{name} uses no waypoint ({LABEL_USE_WAYPOINT} on it or its namespace), so nothing enforces this policy — label it with {LABEL_USE_WAYPOINT}=<waypoint>"
                    ),
                )),
            }
        }
    }
}

/// Whether the pod is outside the mesh (no ztunnel, no sidecar).
fn outside_mesh(mesh: &Mesh, ns: &str, pod: &Pod) -> bool {
    let nsl = mesh.ns_labels(ns);
    !is_enrolled(nsl, &pod.metadata.labels) && !has_sidecar(nsl, pod)
}

/// AMB0006: STRICT on workloads behind a Service while pods outside the
/// mesh are in view (the migration trap: they connect in plaintext and
/// are refused).
fn strict_with_plaintext(mesh: &Mesh, out: &mut Vec<Message>) {
    let outside: Vec<String> = mesh
        .pods()
        .filter(|(ns, p)| outside_mesh(mesh, ns, p))
        .map(|(ns, p)| format!("{ns}/{}", p.metadata.name))
        .collect();
    if outside.is_empty() {
        return;
    }
    // Deciding policy -> STRICT workloads behind a Service.
    let mut strict: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (ns, objs) in mesh.spaces() {
        for pod in objs.pods.values().filter(|p| !p.is_terminal()) {
            if outside_mesh(mesh, ns, pod) {
                continue;
            }
            let behind = objs.services.values().any(|s| {
                s.spec.selector.as_ref().is_some_and(|sel| {
                    !sel.is_empty() && selector_matches(sel, &pod.metadata.labels)
                })
            });
            if !behind {
                continue;
            }
            let d = peer_authn::decide(&mesh.store, ns, &pod.metadata.labels);
            let any_strict = d.effective == Effective::Strict
                || d.ports.iter().any(|(_, _, e)| *e == Effective::Strict);
            let by = match d.decided_by {
                DecidedBy::Workload(n) | DecidedBy::Namespace(n) | DecidedBy::Mesh(n) => n,
                DecidedBy::Default => continue,
            };
            if any_strict {
                strict
                    .entry(by)
                    .or_default()
                    .push(format!("{ns}/{}", pod.metadata.name));
            }
        }
    }
    for (by, pods) in strict {
        let Some((ns, name)) = by.split_once('/') else {
            continue;
        };
        let key = ObjectKey::new(Kind::PeerAuthentication, ns, name);
        let shown: Vec<&str> = outside.iter().take(3).map(String::as_str).collect();
        let more = outside.len().saturating_sub(shown.len());
        let more = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        out.push(mesh.msg_at(
            STRICT_WITH_PLAINTEXT_CLIENTS,
            &key,
            "mtls",
            format!(
                "STRICT mTLS refuses plaintext to {} pod(s) behind Services (e.g. {}), and pods outside the mesh can reach them ({}{more}): their connections will be refused — enroll those namespaces first (istio.io/dataplane-mode=ambient), or keep PERMISSIVE until every client is in the mesh",
                pods.len(),
                pods[0],
                shown.join(", ")
            ),
        ));
    }
}

/// Whether one rule of an ALLOW policy can allow a connection to `port`
/// as ztunnel enforces it (rules with HTTP attributes never match there).
fn rule_allows_port(ap: &AuthorizationPolicy, rule: usize, port: u16) -> bool {
    let Some(r) = ap.spec.rules.get(rule) else {
        return false;
    };
    let mut one = ap.clone();
    one.spec.rules = vec![r.clone()];
    if !l7_fields(&one).is_empty() {
        return false;
    }
    let to_ok = r.to.is_empty()
        || r.to.iter().any(|t| {
            let o = &t.operation;
            (o.ports.is_empty() || o.ports.iter().any(|p| p.0 == port))
                && !o.not_ports.iter().any(|p| p.0 == port)
        });
    let when_ok = r.when.iter().all(|c| {
        c.key != "destination.port"
            || ((c.values.is_empty() || c.values.iter().any(|v| v.trim() == port.to_string()))
                && !c.not_values.iter().any(|v| v.trim() == port.to_string()))
    });
    to_ok && when_ok
}

/// Whether a DENY policy names `port` explicitly.
fn deny_names_port(ap: &AuthorizationPolicy, port: u16) -> bool {
    ap.spec.rules.iter().any(|r| {
        r.from.is_empty()
            && r.to
                .iter()
                .any(|t| t.operation.ports.iter().any(|p| p.0 == port))
    })
}

/// The ports a pod is scraped on, when ztunnel enforces policy for it.
fn scrape_ports(mesh: &Mesh, ns: &str, pod: &Pod) -> Vec<u16> {
    if !is_enrolled(mesh.ns_labels(ns), &pod.metadata.labels) {
        return Vec::new();
    }
    let mut ports: Vec<u16> = pod
        .metadata
        .annotations
        .get(SCRAPE_PORT)
        .and_then(|p| p.trim().parse().ok())
        .into_iter()
        .collect();
    for c in &pod.spec.containers {
        for p in &c.ports {
            if MESH_METRICS_PORTS.contains(&p.container_port) && !ports.contains(&p.container_port)
            {
                ports.push(p.container_port);
            }
        }
    }
    ports
}

/// AMB0007: an ALLOW policy (deny by default) or a DENY policy that makes
/// ztunnel refuse a pod's metrics scrape port.
fn metrics_scrape(mesh: &Mesh, out: &mut Vec<Message>) {
    // policy key -> (pod, port) refused.
    let mut blocked: BTreeMap<ObjectKey, Vec<(String, u16)>> = BTreeMap::new();
    let policies: Vec<&AuthorizationPolicy> = mesh
        .of_kind(Kind::AuthorizationPolicy)
        .filter_map(|o| match o {
            Object::AuthorizationPolicy(ap)
                if ap.spec.target_ref.is_none()
                    && ap.spec.target_refs.is_empty()
                    && matches!(
                        ap.spec.action,
                        AuthorizationAction::Allow | AuthorizationAction::Deny
                    ) =>
            {
                Some(ap)
            }
            _ => None,
        })
        .collect();
    for (ns, pod) in mesh.pods() {
        let ports = scrape_ports(mesh, ns, pod);
        if ports.is_empty() {
            continue;
        }
        let applying: Vec<&AuthorizationPolicy> = policies
            .iter()
            .copied()
            .filter(|ap| {
                let pns = ap.metadata.namespace.as_str();
                (pns == ns || ROOT_NAMESPACES.contains(&pns))
                    && ap
                        .spec
                        .selector_labels()
                        .is_none_or(|s| selector_matches(s, &pod.metadata.labels))
            })
            .collect();
        let key = |ap: &AuthorizationPolicy| {
            ObjectKey::new(
                Kind::AuthorizationPolicy,
                &ap.metadata.namespace,
                &ap.metadata.name,
            )
        };
        let allows: Vec<&&AuthorizationPolicy> = applying
            .iter()
            .filter(|ap| ap.spec.action == AuthorizationAction::Allow)
            .collect();
        for port in ports {
            let who = format!("{ns}/{}", pod.metadata.name);
            if let Some(deny) = applying
                .iter()
                .find(|ap| ap.spec.action == AuthorizationAction::Deny && deny_names_port(ap, port))
            {
                blocked.entry(key(deny)).or_default().push((who, port));
                continue;
            }
            let allowed = allows
                .iter()
                .any(|ap| (0..ap.spec.rules.len()).any(|i| rule_allows_port(ap, i, port)));
            if let Some(first) = allows.first().filter(|_| !allowed) {
                blocked.entry(key(first)).or_default().push((who, port));
            }
        }
    }
    for (key, hits) in blocked {
        let shown: Vec<String> = hits
            .iter()
            .take(3)
            .map(|(p, port)| format!("{p}:{port}"))
            .collect();
        out.push(mesh.msg(
            METRICS_SCRAPE_DENIED,
            &key,
            format!(
                "this policy makes ztunnel refuse the metrics scrape of {} pod port(s) ({}): dashboards and SLO alerts lose these pods — add a rule allowing the scraper (e.g. from its namespace) to ports {}",
                hits.len(),
                shown.join(", "),
                {
                    let mut p: Vec<String> = hits.iter().map(|(_, p)| p.to_string()).collect();
                    p.sort();
                    p.dedup();
                    p.join(", ")
                }
            ),
        ));
    }
}
