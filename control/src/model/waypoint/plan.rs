//! Which services and endpoints each waypoint serves, and how their traffic
//! is routed, from the store and the workload drafts the workload
//! translator built (memberships and target ports already resolved there,
//! so both agree).
//!
//! A waypoint is a Gateway API `Gateway` of class `istio-waypoint` or
//! `ambit-waypoint`. A Service is bound to it by `istio.io/use-waypoint`
//! (on the Service, else its namespace; `istio.io/use-waypoint-namespace`
//! for a waypoint elsewhere) when the waypoint handles service traffic
//! (`istio.io/waypoint-for`: `service`, the default, or `all`); a workload
//! likewise when it handles workload traffic (`workload` or `all`). Routing of a
//! bound service comes from an `HTTPRoute` whose parent is the Service
//! (GAMMA) or else the first `VirtualService` (by namespace/name) naming
//! its host; every service a rule sends traffic to gets clusters too, with
//! the subsets and traffic policy of its `DestinationRule`. Only HBONE
//! endpoints are served: the waypoint reaches them through their ztunnel.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ambit_config::gateway_api::WaypointFor;
use ambit_config::networking::{DestinationRule, VirtualService};
use ambit_config::objects::{AuthorizationPolicy, Service};
use ambit_proto::workload::gateway_address::Destination;
use ambit_proto::workload::{TunnelProtocol, WorkloadStatus};

use super::authz;
use super::rules::{self, RouteRule, RuleAction, qualify};
use super::tracing;
use super::{
    BoundEndpoint, BoundPort, BoundService, BoundWorkload, EndpointWorkload, Finding, Protocol,
    Transport, WaypointPlan,
};
use crate::model::ModelOptions;
use crate::model::index::{
    Backing, DOMAIN_SUFFIX, WaypointRef, WaypointTraffic, WorkloadDraft, ip_from_bytes,
    waypoint_ref, waypoint_serves,
};
use crate::model::store::Store;

/// Every Service of the mesh by hostname, with its members.
pub(crate) struct Catalog<'s> {
    pub(crate) services: BTreeMap<String, (&'s str, &'s Service)>,
    /// hostname -> (draft, service port, target port).
    pub(crate) members: HashMap<String, Vec<(usize, u16, u16)>>,
}

impl<'s> Catalog<'s> {
    pub(crate) fn new(store: &'s Store, drafts: &[WorkloadDraft<'_>], keys: &[String]) -> Self {
        let mut services = BTreeMap::new();
        for (ns, objs) in store.spaces() {
            for (name, svc) in &objs.services {
                services.insert(format!("{name}.{ns}.svc.{DOMAIN_SUFFIX}"), (ns, svc));
            }
        }
        let mut members: HashMap<String, Vec<(usize, u16, u16)>> = HashMap::new();
        for (i, d) in drafts.iter().enumerate() {
            for (key, port) in &d.services {
                let Some(k) = keys.get(*key as usize) else {
                    continue;
                };
                let host = k.split_once('/').map_or(k.as_str(), |(_, h)| h);
                members.entry(host.to_string()).or_default().push((
                    i,
                    port.service_port as u16,
                    port.target_port as u16,
                ));
            }
        }
        Self { services, members }
    }
}

/// The waypoints of the mesh and what each serves, sorted by namespace and
/// name.
pub(crate) fn plan(
    store: &Store,
    drafts: &[WorkloadDraft<'_>],
    keys: &[String],
    opts: &ModelOptions,
) -> Vec<WaypointPlan> {
    let mut plans: BTreeMap<WaypointRef, WaypointPlan> = BTreeMap::new();
    let mut scopes: BTreeMap<WaypointRef, WaypointFor> = BTreeMap::new();
    for (ns, objs) in store.spaces() {
        for (name, gw) in &objs.gateways {
            let scope = match gw.waypoint_for() {
                Some(s @ (WaypointFor::Service | WaypointFor::Workload | WaypointFor::All))
                    if gw.is_waypoint() =>
                {
                    s
                }
                _ => continue,
            };
            let key = WaypointRef {
                namespace: ns.to_string(),
                name: name.clone(),
            };
            scopes.insert(key.clone(), scope);
            plans.insert(
                key,
                WaypointPlan {
                    namespace: ns.to_string(),
                    name: name.clone(),
                    services: Vec::new(),
                    workloads: Vec::new(),
                    findings: Vec::new(),
                    telemetry: gw.request_telemetry(),
                    tracing: None,
                },
            );
        }
    }
    if plans.is_empty() {
        return Vec::new();
    }
    bind_workloads(&mut plans, &scopes, drafts, opts);
    let catalog = Catalog::new(store, drafts, keys);
    let virtual_services = virtual_services_by_host(store);
    let destination_rules = destination_rules_by_host(store);
    let policies: Vec<&AuthorizationPolicy> = store
        .spaces()
        .flat_map(|(_, objs)| objs.authorization_policies.values())
        .collect();
    let mut policy_findings = Vec::new();
    for (host, (ns, svc)) in &catalog.services {
        let ns_labels = store.namespace_labels(ns);
        let Some(w) = waypoint_ref(ns, ns_labels, &svc.metadata.labels) else {
            continue;
        };
        if !scopes
            .get(&w)
            .is_some_and(|s| waypoint_serves(*s, WaypointTraffic::Service))
        {
            continue;
        }
        let Some(plan) = plans.get_mut(&w) else {
            continue;
        };
        let mut bound = bound_service(
            host,
            ns,
            svc,
            &catalog,
            drafts,
            opts,
            &destination_rules,
            Reach::Hbone,
        );
        bound.bound = true;
        route_service(&mut bound, store, &virtual_services, &mut plan.findings);
        authorize_service(&mut bound, plan, &policies, &mut policy_findings);
        plan.services.push(bound);
    }
    // A policy bound to several services or ports is reported once.
    policy_findings.sort_by(|a: &Finding, b| {
        (&a.namespace, &a.name, &a.reason).cmp(&(&b.namespace, &b.name, &b.reason))
    });
    policy_findings.dedup();
    if let Some(first) = plans.values_mut().next() {
        first.findings.extend(policy_findings);
    }
    // Services the rules send traffic to get clusters too.
    for plan in plans.values_mut() {
        let have: BTreeSet<String> = plan.services.iter().map(|s| s.hostname.clone()).collect();
        let wanted: BTreeSet<String> = plan
            .services
            .iter()
            .flat_map(|s| s.rules.values().flatten())
            .flat_map(rule_hosts)
            .filter(|h| !have.contains(h))
            .collect();
        for host in wanted {
            match catalog.services.get(&host) {
                Some((ns, svc)) => plan.services.push(bound_service(
                    &host,
                    ns,
                    svc,
                    &catalog,
                    drafts,
                    opts,
                    &destination_rules,
                    Reach::Hbone,
                )),
                None => plan.findings.push(Finding::waypoint(
                    plan,
                    format!(
                        "a route sends traffic to {host}, which is no Service of the mesh; requests for it fail with 503 until it exists — check the host's spelling and namespace"
                    ),
                )),
            }
        }
        check_subsets(plan);
        let resolve = |host: &str, port: u16| {
            catalog.services.get(host)?;
            let members = catalog.members.get(host).map_or(&[][..], Vec::as_slice);
            let on_port: Vec<_> = members.iter().copied().filter(|m| m.1 == port).collect();
            Some((
                endpoints(drafts, &on_port, opts, Reach::Hbone),
                plain_endpoints(drafts, &on_port),
            ))
        };
        let mut findings = Vec::new();
        plan.tracing = tracing::plan_tracing(store, plan, &resolve, &mut findings);
        plan.findings.extend(findings);
    }
    plans.into_values().collect()
}

/// The HBONE workloads whose `waypoint` names a waypoint handling
/// workload traffic (the workload translator already applied the binding
/// rules), each in its waypoint's plan.
fn bind_workloads(
    plans: &mut BTreeMap<WaypointRef, WaypointPlan>,
    scopes: &BTreeMap<WaypointRef, WaypointFor>,
    drafts: &[WorkloadDraft<'_>],
    opts: &ModelOptions,
) {
    for d in drafts {
        let w = &d.w;
        let Some(Destination::Hostname(h)) =
            w.waypoint.as_ref().and_then(|g| g.destination.as_ref())
        else {
            continue;
        };
        let Some(name) = h
            .hostname
            .strip_suffix(&format!(".{}.svc.{DOMAIN_SUFFIX}", h.namespace))
        else {
            continue;
        };
        let key = WaypointRef {
            namespace: h.namespace.clone(),
            name: name.to_string(),
        };
        if !scopes
            .get(&key)
            .is_some_and(|s| waypoint_serves(*s, WaypointTraffic::Workload))
            || w.tunnel_protocol != TunnelProtocol::Hbone as i32
        {
            continue;
        }
        let ips: Vec<_> = w
            .addresses
            .iter()
            .filter_map(|a| ip_from_bytes(a))
            .collect();
        let Some(plan) = plans.get_mut(&key).filter(|_| !ips.is_empty()) else {
            continue;
        };
        plan.workloads.push(BoundWorkload {
            namespace: w.namespace.clone(),
            name: w.name.clone(),
            ips,
            identity: identity(opts, &w.namespace, &w.service_account),
        });
    }
    for plan in plans.values_mut() {
        plan.workloads
            .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    }
}

pub(crate) fn identity(opts: &ModelOptions, namespace: &str, service_account: &str) -> String {
    let sa = if service_account.is_empty() {
        "default"
    } else {
        service_account
    };
    format!("spiffe://{}/ns/{namespace}/sa/{sa}", opts.trust_domain)
}

pub(crate) fn rule_hosts(r: &RouteRule) -> Vec<String> {
    match &r.action {
        RuleAction::Forward(f) => f
            .destinations
            .iter()
            .map(|d| d.host.clone())
            .chain(f.mirrors.iter().map(|m| m.destination.host.clone()))
            .collect(),
        _ => Vec::new(),
    }
}

/// VirtualServices that apply to mesh traffic, by qualified host, in
/// namespace/name order (the first one claiming a host wins).
pub(crate) fn virtual_services_by_host(store: &Store) -> BTreeMap<String, Vec<&VirtualService>> {
    let mut out: BTreeMap<String, Vec<&VirtualService>> = BTreeMap::new();
    for (ns, objs) in store.spaces() {
        for vs in objs.virtual_services.values() {
            if !vs.spec.applies_to_mesh() {
                continue;
            }
            for h in &vs.spec.hosts {
                out.entry(qualify(h, ns)).or_default().push(vs);
            }
        }
    }
    out
}

pub(crate) fn destination_rules_by_host(store: &Store) -> BTreeMap<String, Vec<&DestinationRule>> {
    let mut out: BTreeMap<String, Vec<&DestinationRule>> = BTreeMap::new();
    for (ns, objs) in store.spaces() {
        for dr in objs.destination_rules.values() {
            out.entry(qualify(&dr.spec.host, ns)).or_default().push(dr);
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn bound_service(
    host: &str,
    ns: &str,
    svc: &Service,
    catalog: &Catalog<'_>,
    drafts: &[WorkloadDraft<'_>],
    opts: &ModelOptions,
    destination_rules: &BTreeMap<String, Vec<&DestinationRule>>,
    reach: Reach,
) -> BoundService {
    let ports = svc
        .spec
        .ports
        .iter()
        .map(|p| BoundPort {
            port: p.port,
            name: p.name.clone(),
            protocol: Protocol::infer(p.app_protocol.as_deref(), &p.name),
        })
        .collect();
    let endpoints = catalog
        .members
        .get(host)
        .map(|m| endpoints(drafts, m, opts, reach))
        .unwrap_or_default();
    BoundService {
        namespace: ns.to_string(),
        name: svc.metadata.name.clone(),
        hostname: host.to_string(),
        vips: svc.spec.vips.clone(),
        ports,
        endpoints,
        bound: false,
        rules: BTreeMap::new(),
        rbac: BTreeMap::new(),
        destination_rule: destination_rules
            .get(host)
            .and_then(|v| v.first())
            .map(|dr| (*dr).clone()),
    }
}

/// The L7 authorization of each port of a service bound to `plan`, from
/// the policies that bind to it there.
fn authorize_service(
    svc: &mut BoundService,
    plan: &WaypointPlan,
    policies: &[&AuthorizationPolicy],
    findings: &mut Vec<Finding>,
) {
    let bound: Vec<&AuthorizationPolicy> = policies
        .iter()
        .copied()
        .filter(|p| authz::binds(p, plan, svc))
        .collect();
    if bound.is_empty() {
        return;
    }
    for port in &svc.ports {
        let rbac = authz::service_rbac(&bound, port.port, port.protocol.is_http(), findings);
        if !rbac.is_empty() {
            svc.rbac.insert(port.port, rbac);
        }
    }
}

/// The routing rules of each HTTP port of a bound service.
pub(crate) fn route_service(
    svc: &mut BoundService,
    store: &Store,
    virtual_services: &BTreeMap<String, Vec<&VirtualService>>,
    findings: &mut Vec<Finding>,
) {
    let routes: Vec<_> = store
        .spaces()
        .flat_map(|(ns, objs)| objs.http_routes.values().map(move |r| (ns, r)))
        .filter(|(ns, r)| {
            r.service_parents().any(|p| {
                p.name == svc.name && p.namespace.as_deref().unwrap_or(ns) == svc.namespace
            })
        })
        .map(|(_, r)| r)
        .collect();
    let claims = virtual_services.get(&svc.hostname);
    if let Some(vss) = claims.filter(|v| v.len() > 1) {
        let names: Vec<String> = vss
            .iter()
            .map(|v| format!("{}/{}", v.metadata.namespace, v.metadata.name))
            .collect();
        findings.push(Finding {
            kind: "VirtualService".into(),
            namespace: vss[1].metadata.namespace.clone(),
            name: vss[1].metadata.name.clone(),
            reason: format!(
                "{} VirtualServices claim host {}: {}; only the first ({}) is used — merge them into one",
                names.len(),
                svc.hostname,
                names.join(", "),
                names[0]
            ),
        });
    }
    let vs = claims.and_then(|v| v.first()).copied();
    if let (Some(vs), Some(route)) = (vs, routes.first()) {
        findings.push(Finding {
            kind: "VirtualService".into(),
            namespace: vs.metadata.namespace.clone(),
            name: vs.metadata.name.clone(),
            reason: format!(
                "HTTPRoute {}/{} is attached to Service {}/{} too; the HTTPRoute is used and this VirtualService ignored for it",
                route.metadata.namespace, route.metadata.name, svc.namespace, svc.name
            ),
        });
    }
    for port in svc.ports.iter().filter(|p| p.protocol.is_http()) {
        let rules = if let Some(route) = routes.first() {
            rules::from_http_route(route)
        } else if let Some(vs) = vs {
            rules::from_virtual_service(vs, port.port)
        } else {
            Vec::new()
        };
        if !rules.is_empty() {
            svc.rules.insert(port.port, rules);
        }
    }
}

/// A route to a subset no DestinationRule defines falls back to every
/// endpoint of the service (traffic keeps flowing while the rule is on its
/// way: the VirtualService-before-DestinationRule order mistake) and is
/// reported.
fn check_subsets(plan: &mut WaypointPlan) {
    let findings = subset_findings(&plan.services);
    plan.findings.extend(findings);
}

/// The routes of `services` to subsets no DestinationRule of theirs defines.
pub(crate) fn subset_findings(services: &[BoundService]) -> Vec<Finding> {
    let defined: HashMap<&str, BTreeSet<&str>> = services
        .iter()
        .map(|s| {
            let subsets = s
                .destination_rule
                .as_ref()
                .map(|d| d.spec.subsets.iter().map(|x| x.name.as_str()).collect())
                .unwrap_or_default();
            (s.hostname.as_str(), subsets)
        })
        .collect();
    let mut findings = Vec::new();
    for svc in services {
        for (rule, d) in svc.rules.values().flatten().flat_map(|r| match &r.action {
            RuleAction::Forward(f) => f.destinations.iter().map(|d| (r, d)).collect::<Vec<_>>(),
            _ => Vec::new(),
        }) {
            if d.subset.is_empty()
                || defined
                    .get(d.host.as_str())
                    .is_some_and(|s| s.contains(d.subset.as_str()))
            {
                continue;
            }
            findings.push(Finding {
                kind: "Service".into(),
                namespace: svc.namespace.clone(),
                name: svc.name.clone(),
                reason: format!(
                    "route {} sends traffic to subset {:?} of {}, which no DestinationRule defines; until one does, that share goes to every endpoint of {} — apply the DestinationRule (kubectl apply the DestinationRule before the VirtualService)",
                    rule.name, d.subset, d.host, d.host
                ),
            });
        }
    }
    findings
}

/// Which members of a service a proxy can reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Only HBONE ones (a waypoint).
    Hbone,
    /// Every one, each with its transport (a sidecar).
    Any,
}

/// How `d` is reached: over HBONE when the workload API says it speaks it
/// (the workload translator's call, so ztunnels and Envoys agree), a
/// sidecar pod over mTLS, anything else in plaintext.
fn transport(d: &WorkloadDraft<'_>) -> Transport {
    match d.backing {
        _ if d.w.tunnel_protocol == TunnelProtocol::Hbone as i32 => Transport::Hbone,
        Backing::Pod(p) if crate::model::sidecar::runs_sidecar(p) => Transport::Mtls,
        _ => Transport::Plaintext,
    }
}

/// The endpoints among a service's members the proxy can reach, one per
/// workload.
pub(crate) fn endpoints(
    drafts: &[WorkloadDraft<'_>],
    members: &[(usize, u16, u16)],
    opts: &ModelOptions,
    reach: Reach,
) -> Vec<BoundEndpoint> {
    let mut by_draft: BTreeMap<usize, Vec<(u16, u16)>> = BTreeMap::new();
    for (i, sp, tp) in members {
        by_draft.entry(*i).or_default().push((*sp, *tp));
    }
    let mut out = Vec::new();
    for (i, ports) in by_draft {
        let Some(d) = drafts.get(i) else {
            continue;
        };
        let w = &d.w;
        let transport = transport(d);
        if reach == Reach::Hbone && transport != Transport::Hbone {
            continue;
        }
        let Some(ip) = w.addresses.first().and_then(|a| ip_from_bytes(a)) else {
            continue;
        };
        out.push(BoundEndpoint {
            ip,
            ports,
            identity: identity(opts, &w.namespace, &w.service_account),
            labels: draft_labels(d),
            workload: EndpointWorkload {
                name: w.workload_name.clone(),
                namespace: w.namespace.clone(),
                app: w.canonical_name.clone(),
                version: w.canonical_revision.clone(),
            },
            healthy: w.status != WorkloadStatus::Unhealthy as i32,
            transport,
        });
    }
    out.sort_by_key(|e| e.ip);
    out
}

/// The members of a service outside the mesh (no HBONE), as the address
/// and target port they are reached at in plaintext.
fn plain_endpoints(
    drafts: &[WorkloadDraft<'_>],
    members: &[(usize, u16, u16)],
) -> Vec<std::net::SocketAddr> {
    let mut out: Vec<std::net::SocketAddr> = members
        .iter()
        .filter_map(|(i, _, target)| {
            let w = &drafts.get(*i)?.w;
            if w.tunnel_protocol == TunnelProtocol::Hbone as i32
                || w.status == WorkloadStatus::Unhealthy as i32
            {
                return None;
            }
            let ip = w.addresses.first().and_then(|a| ip_from_bytes(a))?;
            Some(std::net::SocketAddr::new(ip, *target))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The labels a DestinationRule subset selects by: the workload's own,
/// behind them a WorkloadEntry's metadata labels.
fn draft_labels(d: &WorkloadDraft<'_>) -> ambit_config::objects::Labels {
    let Some(view) = d.selectable else {
        return Default::default();
    };
    let mut out = view.extra.cloned().unwrap_or_default();
    out.extend(view.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
    out
}
