//! Traffic checks: routes to hosts and subsets that do not exist (IST0101),
//! two VirtualServices for one host (IST0109), subsets that select no pod
//! (AMB0003), HTTP routing on TCP ports (AMB0004), and `use-waypoint`
//! labels naming no waypoint (IST0101).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ambit_config::networking::{Destination, VirtualService};
use ambit_config::objects::{
    Kind, LABEL_USE_WAYPOINT, LABEL_USE_WAYPOINT_NAMESPACE, Object, ObjectKey, Service,
    selector_matches,
};
use ambit_control::model::waypoint::Protocol;
use ambit_control::model::waypoint::rules::qualify;

use super::super::Mesh;
use super::super::message::{
    CONFLICTING_VS_HOSTS, L7_RULES_ON_TCP_PORT, Message, REFERENCED_NOT_FOUND,
    SUBSET_SELECTS_NO_POD,
};

/// Every host a route may name: Services (and the headless Service the
/// control plane adds for a waypoint without one) and ServiceEntry hosts.
pub(super) struct Hosts<'m> {
    pub services: BTreeMap<String, (&'m str, &'m Service)>,
    waypoints: BTreeSet<String>,
    entries: Vec<String>,
}

impl<'m> Hosts<'m> {
    pub fn new(mesh: &'m Mesh) -> Self {
        let mut services = BTreeMap::new();
        let mut waypoints = BTreeSet::new();
        let mut entries = Vec::new();
        for (ns, objs) in mesh.spaces() {
            for (name, svc) in &objs.services {
                services.insert(qualify(name, ns), (ns, svc));
            }
            for (name, gw) in &objs.gateways {
                if gw.is_waypoint() {
                    waypoints.insert(qualify(name, ns));
                }
            }
            for se in objs.service_entries.values() {
                for h in &se.spec.hosts {
                    entries.push(h.clone());
                    entries.push(qualify(h, ns));
                }
            }
        }
        Self {
            services,
            waypoints,
            entries,
        }
    }

    /// Whether the qualified host exists (wildcards and IPs always do).
    pub fn exists(&self, host: &str) -> bool {
        if host.starts_with('*') || host.parse::<IpAddr>().is_ok() {
            return true;
        }
        self.services.contains_key(host)
            || self.waypoints.contains(host)
            || self.entries.iter().any(|e| match e.strip_prefix('*') {
                Some(suffix) => host.ends_with(suffix),
                None => e == host,
            })
    }
}

pub(super) fn run(mesh: &Mesh, out: &mut Vec<Message>) {
    let hosts = Hosts::new(mesh);
    virtual_services(mesh, &hosts, out);
    subsets_select_pods(mesh, &hosts, out);
    http_routes(mesh, out);
    use_waypoint(mesh, out);
}

/// Subsets every DestinationRule defines, by qualified host.
fn defined_subsets(mesh: &Mesh) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (ns, objs) in mesh.spaces() {
        for dr in objs.destination_rules.values() {
            out.entry(qualify(&dr.spec.host, ns))
                .or_default()
                .extend(dr.spec.subsets.iter().map(|s| s.name.clone()));
        }
    }
    out
}

fn destinations(vs: &VirtualService) -> Vec<&Destination> {
    let s = &vs.spec;
    let mut out: Vec<&Destination> = s.http.iter().flat_map(|r| r.destinations()).collect();
    out.extend(
        s.tcp
            .iter()
            .flat_map(|r| r.route.iter().map(|d| &d.destination)),
    );
    out.extend(
        s.tls
            .iter()
            .flat_map(|r| r.route.iter().map(|d| &d.destination)),
    );
    out
}

fn virtual_services(mesh: &Mesh, hosts: &Hosts<'_>, out: &mut Vec<Message>) {
    let subsets = defined_subsets(mesh);
    let mut claims: BTreeMap<String, Vec<ObjectKey>> = BTreeMap::new();
    for obj in mesh.of_kind(Kind::VirtualService) {
        let Object::VirtualService(vs) = obj else {
            continue;
        };
        let key = obj.key();
        let ns = vs.metadata.namespace.as_str();
        let mesh_vs = vs.spec.applies_to_mesh();
        for h in &vs.spec.hosts {
            let q = qualify(h, ns);
            if mesh_vs {
                claims.entry(q.clone()).or_default().push(key.clone());
            }
            if mesh_vs && !hosts.exists(&q) {
                out.push(mesh.msg_at(
                    REFERENCED_NOT_FOUND,
                    &key,
                    "hosts",
                    format!(
                        "Referenced host not found: {h:?} ({q}) is no Service or ServiceEntry, so these rules route nothing; check the host's spelling and namespace, or create the Service"
                    ),
                ));
            }
        }
        let mut seen = BTreeSet::new();
        for d in destinations(vs) {
            let q = qualify(&d.host, ns);
            if !seen.insert((q.clone(), d.subset.clone())) {
                continue;
            }
            if !hosts.exists(&q) {
                out.push(mesh.msg_at(
                    REFERENCED_NOT_FOUND,
                    &key,
                    "destination",
                    format!(
                        "Referenced host not found: destination {:?} ({q}) is no Service or ServiceEntry; requests routed there fail with 503 — check the host's spelling and namespace",
                        d.host
                    ),
                ));
                continue;
            }
            if !d.subset.is_empty() && !subsets.get(&q).is_some_and(|s| s.contains(&d.subset)) {
                out.push(mesh.msg_at(
                    REFERENCED_NOT_FOUND,
                    &key,
                    "subset",
                    format!(
                        "Referenced host+subset in DestinationRule not found: {q}+{}; no DestinationRule for {q} defines subset {:?}, so that share of traffic goes to every endpoint of the host (or fails) — apply a DestinationRule defining it, before the VirtualService",
                        d.subset, d.subset
                    ),
                ));
            }
        }
        http_on_tcp(mesh, hosts, &key, vs, out);
    }
    for (host, keys) in claims.into_iter().filter(|(_, k)| k.len() > 1) {
        let names: Vec<String> = keys
            .iter()
            .map(|k| format!("{}/{}", k.namespace, k.name))
            .collect();
        for k in &keys {
            out.push(mesh.msg_at(
                CONFLICTING_VS_HOSTS,
                k,
                "hosts",
                format!(
                    "the VirtualServices {} all route host {host} for the mesh; only the first ({}) is used and the others are ignored — merge them into one VirtualService",
                    names.join(", "),
                    names[0]
                ),
            ));
        }
    }
}

/// AMB0004: `http` rules for a Service whose addressed ports are TCP.
fn http_on_tcp(
    mesh: &Mesh,
    hosts: &Hosts<'_>,
    key: &ObjectKey,
    vs: &VirtualService,
    out: &mut Vec<Message>,
) {
    if vs.spec.http.is_empty() || !vs.spec.applies_to_mesh() {
        return;
    }
    let ns = vs.metadata.namespace.as_str();
    for h in &vs.spec.hosts {
        let Some((svc_ns, svc)) = hosts.services.get(&qualify(h, ns)) else {
            continue;
        };
        let protocol = |p: &ambit_config::objects::ServicePort| {
            Protocol::infer(p.app_protocol.as_deref(), &p.name)
        };
        let ports: Vec<u16> = vs
            .spec
            .http
            .iter()
            .flat_map(|r| r.matches.iter().filter_map(|m| m.port))
            .collect();
        let tcp: Vec<&ambit_config::objects::ServicePort> = if ports.is_empty() {
            if svc.spec.ports.iter().any(|p| protocol(p).is_http()) {
                continue;
            }
            svc.spec.ports.iter().collect()
        } else {
            svc.spec
                .ports
                .iter()
                .filter(|p| ports.contains(&p.port) && !protocol(p).is_http())
                .collect()
        };
        for p in tcp {
            let name = if p.name.is_empty() {
                "(unnamed)"
            } else {
                &p.name
            };
            out.push(mesh.msg_at(
                L7_RULES_ON_TCP_PORT,
                key,
                "http",
                format!(
                    "the http rules for {h} never apply on port {} of Service {svc_ns}/{}: the port is named {name:?} with appProtocol {:?}, so waypoints treat it as TCP; name it http (or http-<suffix>) or set appProtocol: http",
                    p.port,
                    svc.metadata.name,
                    p.app_protocol.as_deref().unwrap_or("unset"),
                ),
            ));
        }
    }
}

/// AMB0003: a subset whose labels select none of the Service's pods (only
/// when the Service and at least one of its pods are in view).
fn subsets_select_pods(mesh: &Mesh, hosts: &Hosts<'_>, out: &mut Vec<Message>) {
    for obj in mesh.of_kind(Kind::DestinationRule) {
        let Object::DestinationRule(dr) = obj else {
            continue;
        };
        let host = qualify(&dr.spec.host, &dr.metadata.namespace);
        let Some((svc_ns, svc)) = hosts.services.get(&host) else {
            continue;
        };
        let Some(sel) = svc.spec.selector.as_ref().filter(|s| !s.is_empty()) else {
            continue;
        };
        let pods: Vec<_> = mesh
            .pods()
            .filter(|(ns, p)| ns == svc_ns && selector_matches(sel, &p.metadata.labels))
            .map(|(_, p)| p)
            .collect();
        if pods.is_empty() {
            continue;
        }
        for s in &dr.spec.subsets {
            if pods
                .iter()
                .any(|p| selector_matches(&s.labels, &p.metadata.labels))
            {
                continue;
            }
            let labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            out.push(mesh.msg_at(
                SUBSET_SELECTS_NO_POD,
                &obj.key(),
                "subsets",
                format!(
                    "subset {:?} selects no pod of Service {svc_ns}/{} (labels {}; the Service has {} pod(s)); traffic routed to it fails with 503 — fix the labels or label the pods",
                    s.name,
                    svc.metadata.name,
                    labels.join(","),
                    pods.len()
                ),
            ));
        }
    }
}

/// IST0101 for HTTPRoute parents and backends that do not exist.
fn http_routes(mesh: &Mesh, out: &mut Vec<Message>) {
    for obj in mesh.of_kind(Kind::HttpRoute) {
        let Object::HttpRoute(r) = obj else {
            continue;
        };
        let ns = r.metadata.namespace.as_str();
        let key = obj.key();
        let has = |kind: Kind, ns: &str, name: &str| {
            mesh.docs.contains_key(&ObjectKey::new(kind, ns, name))
        };
        for p in &r.spec.parent_refs {
            let pns = p.effective_namespace(ns);
            let missing = if p.is_service() {
                (!has(Kind::Service, pns, &p.name)).then_some("Service")
            } else if p.is_gateway() {
                (!has(Kind::Gateway, pns, &p.name)).then_some("Gateway")
            } else {
                None
            };
            if let Some(what) = missing {
                out.push(mesh.msg_at(
                    REFERENCED_NOT_FOUND,
                    &key,
                    "parentRefs",
                    format!(
                        "Referenced {what} not found: parentRef {pns}/{}; the route attaches to nothing until it exists — check the name, namespace, group and kind",
                        p.name
                    ),
                ));
            }
        }
        for b in r.backend_refs() {
            let kind = b.kind.as_deref().unwrap_or("Service");
            let group = b.group.as_deref().unwrap_or("");
            if kind != "Service" || !(group.is_empty() || group == "core") {
                continue;
            }
            let bns = b.namespace.as_deref().unwrap_or(ns);
            if !has(Kind::Service, bns, &b.name) {
                out.push(mesh.msg_at(
                    REFERENCED_NOT_FOUND,
                    &key,
                    "backendRefs",
                    format!(
                        "Referenced Service not found: backendRef {bns}/{}; requests routed there fail with 500 — check the name and namespace",
                        b.name
                    ),
                ));
            }
        }
    }
}

/// IST0101: `istio.io/use-waypoint` naming no waypoint Gateway.
fn use_waypoint(mesh: &Mesh, out: &mut Vec<Message>) {
    for obj in &mesh.objects {
        let labels = &obj.metadata().labels;
        let Some(name) = labels.get(LABEL_USE_WAYPOINT) else {
            continue;
        };
        if name.is_empty() || name == "none" {
            continue;
        }
        let own_ns = match obj.kind() {
            Kind::Namespace => obj.metadata().name.as_str(),
            _ => obj.metadata().namespace.as_str(),
        };
        let ns = labels
            .get(LABEL_USE_WAYPOINT_NAMESPACE)
            .filter(|s| !s.is_empty())
            .map_or(own_ns, String::as_str);
        let gw = mesh
            .spaces()
            .find(|(n, _)| *n == ns)
            .and_then(|(_, o)| o.gateways.get(name));
        let text = match gw {
            Some(g) if g.is_waypoint() => continue,
            Some(g) => format!(
                "Referenced waypoint not found: Gateway {ns}/{name} has gatewayClassName {:?}, not istio-waypoint, so traffic is not sent through it; use a waypoint Gateway (gatewayClassName: istio-waypoint)",
                g.spec.gateway_class_name
            ),
            None => format!(
                "Referenced waypoint not found: {LABEL_USE_WAYPOINT}={name} but there is no Gateway {ns}/{name}; traffic goes without a waypoint (no L7 routing or policy) until it exists — create the waypoint or fix the label"
            ),
        };
        out.push(mesh.msg_at(REFERENCED_NOT_FOUND, &obj.key(), LABEL_USE_WAYPOINT, text));
    }
}
