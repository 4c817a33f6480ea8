//! Which services each namespace's sidecars may reach, and what each
//! sidecar pod accepts inbound, from the store and the workload drafts (the
//! same ones the workload and waypoint translations read).
//!
//! Visibility: by default a sidecar sees the services of its own namespace
//! and of the root namespaces (this keeps xDS small in a large mesh). An
//! Istio `Sidecar` without `workloadSelector` in the namespace — else one
//! in a root namespace — replaces that with its `egress[].hosts`
//! (`ns/host`, `ns` being `*`, `.` or `~`; `host` being `*`, `*.suffix` or
//! a name). Sidecars with a `workloadSelector` are not applied yet (one
//! outbound set per namespace); a finding says so.

use std::collections::{BTreeMap, BTreeSet};

use ambit_config::networking::{
    DestinationRule, NamespacedHost, OutboundTrafficMode, Sidecar, VirtualService,
};
use ambit_config::objects::{
    AuthorizationPolicy, MtlsMode, Pod, ROOT_NAMESPACES, Service, selector_matches,
};

use super::{InboundPort, InboundService, NamespacePlan, PeerMode, PodPlan, runs_sidecar};
use crate::model::ModelOptions;
use crate::model::index::{
    Backing, DOMAIN_SUFFIX, WaypointScopes, WaypointTraffic, WorkloadDraft, ip_from_bytes,
    waypoint_ref, waypoint_scopes, waypoint_serves,
};
use crate::model::peer_authn;
use crate::model::store::Store;
use crate::model::waypoint::authz;
use crate::model::waypoint::plan::{
    Catalog, Reach, bound_service, destination_rules_by_host, endpoints, route_service, rule_hosts,
    subset_findings, virtual_services_by_host,
};
use crate::model::waypoint::rules::qualify;
use crate::model::waypoint::{BoundEndpoint, BoundService, Finding, Protocol};

/// The outbound plan of every namespace with a sidecar pod and the inbound
/// plan of every sidecar pod, sorted by namespace (and name).
pub(crate) fn plan(
    store: &Store,
    drafts: &[WorkloadDraft<'_>],
    keys: &[String],
    opts: &ModelOptions,
) -> (Vec<NamespacePlan>, Vec<PodPlan>) {
    let pods: Vec<(&WorkloadDraft<'_>, &Pod)> = drafts
        .iter()
        .filter_map(|d| match d.backing {
            Backing::Pod(p) if runs_sidecar(p) => Some((d, p)),
            _ => None,
        })
        .collect();
    if pods.is_empty() {
        return (Vec::new(), Vec::new());
    }
    let mesh = Mesh {
        store,
        catalog: Catalog::new(store, drafts, keys),
        drafts,
        opts,
        virtual_services: virtual_services_by_host(store),
        destination_rules: destination_rules_by_host(store),
        waypoint_scopes: waypoint_scopes(store),
    };
    let namespaces: BTreeSet<&str> = pods
        .iter()
        .map(|(_, p)| p.metadata.namespace.as_str())
        .collect();
    let mut findings = Vec::new();
    let mut ns_plans: Vec<NamespacePlan> = namespaces
        .into_iter()
        .map(|ns| namespace_plan(&mesh, ns))
        .collect();
    let mut pod_plans: Vec<PodPlan> = pods
        .iter()
        .filter_map(|(draft, pod)| pod_plan(&mesh, draft, pod, keys, &mut findings))
        .collect();
    pod_plans.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    findings.sort_by(|a, b| {
        (&a.namespace, &a.name, &a.reason).cmp(&(&b.namespace, &b.name, &b.reason))
    });
    findings.dedup();
    if let Some(first) = ns_plans.first_mut() {
        first.findings.extend(findings);
    }
    (ns_plans, pod_plans)
}

/// What every namespace's plan reads, computed once.
struct Mesh<'a, 'd> {
    store: &'a Store,
    catalog: Catalog<'a>,
    drafts: &'a [WorkloadDraft<'d>],
    opts: &'a ModelOptions,
    virtual_services: BTreeMap<String, Vec<&'a VirtualService>>,
    destination_rules: BTreeMap<String, Vec<&'a DestinationRule>>,
    waypoint_scopes: WaypointScopes,
}

impl Mesh<'_, '_> {
    /// The pods of the waypoint serving service `svc` of `ns`
    /// (`istio.io/use-waypoint` on it or its namespace, naming a waypoint
    /// Gateway that takes service traffic); `None` when it has none. A
    /// waypoint without ready pods is an empty list: the service's traffic
    /// then fails rather than skipping the waypoint's policy.
    fn waypoint_of(&self, ns: &str, svc: &Service) -> Option<Vec<BoundEndpoint>> {
        let w = waypoint_ref(ns, self.store.namespace_labels(ns), &svc.metadata.labels)?;
        let scope = self.waypoint_scopes.get(&w)?;
        if !waypoint_serves(*scope, WaypointTraffic::Service) {
            return None;
        }
        let host = format!("{}.{}.svc.{DOMAIN_SUFFIX}", w.name, w.namespace);
        Some(
            self.catalog
                .members
                .get(&host)
                .map(|m| endpoints(self.drafts, m, self.opts, Reach::Hbone))
                .unwrap_or_default(),
        )
    }

    /// The service `host` of `ns` as the sidecars see it: every endpoint,
    /// with its transport, and the DestinationRule's subsets and policy.
    fn service(&self, host: &str, ns: &str, svc: &Service) -> BoundService {
        bound_service(
            host,
            ns,
            svc,
            &self.catalog,
            self.drafts,
            self.opts,
            &self.destination_rules,
            Reach::Any,
        )
    }
}

/// What the sidecars of `ns` see and how it is routed.
fn namespace_plan(mesh: &Mesh<'_, '_>, ns: &str) -> NamespacePlan {
    let mut findings = Vec::new();
    let sidecar = egress_config(mesh.store, ns, &mut findings);
    let mut services: Vec<BoundService> = Vec::new();
    let mut waypoints = BTreeMap::new();
    for (host, (svc_ns, svc)) in &mesh.catalog.services {
        if !visible(sidecar, ns, svc_ns, host) {
            continue;
        }
        let mut bound = mesh.service(host, svc_ns, svc);
        bound.bound = true;
        if let Some(via) = mesh
            .waypoint_of(svc_ns, svc)
            .filter(|_| !bound.vips.is_empty())
        {
            // The waypoint routes and authorizes: the sidecar sends it
            // everything for the service (no subsets of its own).
            bound.destination_rule = None;
            waypoints.insert(host.clone(), via);
            services.push(bound);
            continue;
        }
        route_service(
            &mut bound,
            mesh.store,
            &mesh.virtual_services,
            &mut findings,
        );
        services.push(bound);
    }
    // Services the rules send traffic to get clusters too.
    let have: BTreeSet<String> = services.iter().map(|s| s.hostname.clone()).collect();
    let wanted: BTreeSet<String> = services
        .iter()
        .flat_map(|s| s.rules.values().flatten())
        .flat_map(rule_hosts)
        .filter(|h| !have.contains(h))
        .collect();
    for host in wanted {
        if let Some((svc_ns, svc)) = mesh.catalog.services.get(&host) {
            services.push(mesh.service(&host, svc_ns, svc));
        }
    }
    findings.extend(subset_findings(&services));
    let allow_any = sidecar
        .and_then(|s| s.spec.outbound_traffic_policy)
        .is_none_or(|p| p.mode == OutboundTrafficMode::AllowAny);
    NamespacePlan {
        namespace: ns.to_string(),
        services,
        waypoints,
        allow_any,
        findings,
    }
}

/// The `Sidecar` whose egress hosts the namespace's sidecars follow: the
/// namespace's own selector-less one (first by name), else a root
/// namespace's; `None`: the default visibility.
fn egress_config<'s>(
    store: &'s Store,
    ns: &str,
    findings: &mut Vec<Finding>,
) -> Option<&'s Sidecar> {
    let sidecars = |n: &str| {
        store
            .spaces()
            .find(|(x, _)| *x == n)
            .map(|(_, objs)| &objs.sidecars)
    };
    if let Some(all) = sidecars(ns) {
        for s in all.values().filter(|s| s.spec.workload_selector.is_some()) {
            findings.push(Finding {
                kind: "Sidecar".into(),
                namespace: ns.to_string(),
                name: s.metadata.name.clone(),
                reason: "a Sidecar with a workloadSelector is not applied yet: the namespace's sidecars follow its selector-less Sidecar (or the default visibility) — drop the selector to apply it to the whole namespace".into(),
            });
        }
    }
    let selectorless = |n: &str| {
        sidecars(n)?
            .values()
            .find(|s| s.spec.workload_selector.is_none())
    };
    selectorless(ns).or_else(|| ROOT_NAMESPACES.iter().find_map(|r| selectorless(r)))
}

/// Whether a service `host` of namespace `svc_ns` is visible to the
/// sidecars of `ns`.
fn visible(sidecar: Option<&Sidecar>, ns: &str, svc_ns: &str, host: &str) -> bool {
    match sidecar {
        None => svc_ns == ns || ROOT_NAMESPACES.contains(&svc_ns),
        Some(s) => s
            .spec
            .egress
            .iter()
            .flat_map(|e| &e.hosts)
            .any(|h| host_matches(h, ns, svc_ns, host)),
    }
}

/// One `egress.hosts` entry against a service.
pub(super) fn host_matches(h: &NamespacedHost, ns: &str, svc_ns: &str, host: &str) -> bool {
    let ns_ok = match h.namespace.as_str() {
        "*" => true,
        "." => svc_ns == ns,
        "~" => false,
        other => other == svc_ns,
    };
    ns_ok
        && match h.host.as_str() {
            "*" => true,
            pattern if pattern.starts_with("*.") => host.ends_with(&pattern[1..]),
            name => name == host || qualify(name, svc_ns) == host,
        }
}

/// The inbound side of one sidecar pod.
fn pod_plan(
    mesh: &Mesh<'_, '_>,
    draft: &WorkloadDraft<'_>,
    pod: &Pod,
    keys: &[String],
    findings: &mut Vec<Finding>,
) -> Option<PodPlan> {
    let ns = pod.metadata.namespace.as_str();
    let ips: Vec<_> = draft
        .w
        .addresses
        .iter()
        .filter_map(|a| ip_from_bytes(a))
        .collect();
    if ips.is_empty() {
        return None;
    }
    let labels = &pod.metadata.labels;
    let policies = bound_policies(mesh.store, ns, labels);
    let declared = declared_ports(draft, pod, &mesh.catalog, keys, &policies);
    let decision = peer_authn::decide(mesh.store, ns, labels);
    let mode_of = |port: Option<u16>| {
        let written = port
            .and_then(|p| decision.ports.iter().find(|(x, _, _)| *x == p))
            .map(|(_, m, _)| *m)
            .filter(|m| *m != MtlsMode::Unset)
            .unwrap_or(decision.mode);
        match written {
            MtlsMode::Strict => PeerMode::Strict,
            MtlsMode::Disable => PeerMode::Disable,
            MtlsMode::Permissive | MtlsMode::Unset => PeerMode::Permissive,
        }
    };
    let ports = declared
        .into_iter()
        .map(|(port, (protocol, service))| InboundPort {
            port,
            protocol,
            mode: mode_of(Some(port)),
            rbac: authz::service_rbac(&policies, port, protocol.is_http(), findings),
            service,
        })
        .collect();
    // Port 0: rules naming ports never match it (those ports are declared).
    let other_ports = InboundPort {
        port: 0,
        protocol: Protocol::Tcp,
        mode: mode_of(None),
        rbac: authz::service_rbac(&policies, 0, false, findings),
        service: None,
    };
    Some(PodPlan {
        namespace: ns.to_string(),
        name: pod.metadata.name.clone(),
        service_account: draft.w.service_account.clone(),
        ips,
        ports,
        other_ports,
    })
}

/// The AuthorizationPolicies that apply to a sidecar pod: `selector`
/// policies (or selector-less ones) of its namespace and of the root
/// namespaces; `targetRefs` policies are for waypoints and gateways.
fn bound_policies<'s>(
    store: &'s Store,
    ns: &str,
    labels: &ambit_config::objects::Labels,
) -> Vec<&'s AuthorizationPolicy> {
    store
        .spaces()
        .filter(|(n, _)| *n == ns || ROOT_NAMESPACES.contains(n))
        .flat_map(|(_, objs)| objs.authorization_policies.values())
        .filter(|p| p.spec.target_refs.is_empty() && p.spec.target_ref.is_none())
        .filter(|p| {
            p.spec
                .selector
                .as_ref()
                .is_none_or(|s| selector_matches(&s.match_labels, labels))
        })
        .collect()
}

/// The pod's ports and their protocols: service target ports (protocol of
/// the service port), container ports (protocol from the port name), and
/// ports its policies name (so a rule for a port always has its chain).
fn declared_ports(
    draft: &WorkloadDraft<'_>,
    pod: &Pod,
    catalog: &Catalog<'_>,
    keys: &[String],
    policies: &[&AuthorizationPolicy],
) -> Vec<(u16, (Protocol, Option<InboundService>))> {
    let mut out: BTreeMap<u16, (Protocol, Option<InboundService>)> = BTreeMap::new();
    for (key, port) in &draft.services {
        let Some(k) = keys.get(*key as usize) else {
            continue;
        };
        let host = k.split_once('/').map_or(k.as_str(), |(_, h)| h);
        let found = catalog.services.get(host);
        let protocol = found
            .and_then(|(_, svc)| {
                svc.spec
                    .ports
                    .iter()
                    .find(|p| u32::from(p.port) == port.service_port)
            })
            .map_or(Protocol::Tcp, |p| {
                Protocol::infer(p.app_protocol.as_deref(), &p.name)
            });
        let service = found.map(|(ns, svc)| InboundService {
            hostname: host.to_string(),
            name: svc.metadata.name.clone(),
            namespace: ns.to_string(),
        });
        if let Ok(target) = u16::try_from(port.target_port) {
            out.entry(target).or_insert((protocol, service));
        }
    }
    for c in pod
        .spec
        .containers
        .iter()
        .filter(|c| c.name != super::PROXY_CONTAINER)
    {
        for p in &c.ports {
            out.entry(p.container_port)
                .or_insert_with(|| (Protocol::infer(None, &p.name), None));
        }
    }
    let policy_ports = policies
        .iter()
        .flat_map(|p| &p.spec.rules)
        .flat_map(|r| &r.to)
        .flat_map(|t| t.operation.ports.iter().chain(&t.operation.not_ports));
    for p in policy_ports {
        out.entry(p.0).or_insert((Protocol::Tcp, None));
    }
    out.remove(&0);
    out.into_iter().collect()
}
