//! The workload and service translator: pods, WorkloadEntries, Services,
//! EndpointSlices and ServiceEntries of one namespace become workload drafts
//! and `istio.workload.Address` service resources, following Istio's
//! ambient semantics.
//!
//! Work is done one namespace at a time: selectors are matched through a
//! per-namespace label index, so the cost is linear in the number of
//! objects and memberships.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use ambit_proto::ADDRESS_TYPE_URL;
use ambit_proto::workload::{
    Address, GatewayAddress, NamespacedHostname, NetworkAddress, Port, Service as XdsService,
    TunnelProtocol, Workload, WorkloadStatus, WorkloadType, address, gateway_address,
};

use super::ModelOptions;
use super::index::{
    Backing, DOMAIN_SUFFIX, HBONE_PORT, LABEL_GATEWAY_NAME, LabelIndex, LabelView, WaypointScopes,
    WaypointTraffic, WorkloadDraft, ip_bytes, ip_from_bytes, waypoint_ref, waypoint_serves,
};
use super::snapshot::XdsResource;
use super::store::NamespaceObjects;
use ambit_config::is_enrolled;
use ambit_config::objects::{
    EndpointSlice, Labels, Location, Pod, Service, ServiceEntry, TargetPort, WorkloadEntry,
};

/// One namespace being translated.
pub(crate) struct NsCx<'a> {
    ns: &'a str,
    ns_labels: &'a Labels,
    objs: &'a NamespaceObjects,
    opts: &'a ModelOptions,
    waypoints: &'a WaypointScopes,
}

impl<'a> NsCx<'a> {
    pub(crate) fn new(
        ns: &'a str,
        ns_labels: &'a Labels,
        objs: &'a NamespaceObjects,
        opts: &'a ModelOptions,
        waypoints: &'a WaypointScopes,
    ) -> Self {
        Self {
            ns,
            ns_labels,
            objs,
            opts,
            waypoints,
        }
    }

    /// The waypoint an object with `labels` sends `traffic` to: the one it
    /// is bound to, unless that waypoint is known not to handle such
    /// traffic (`istio.io/waypoint-for`). A waypoint Gateway the config
    /// does not define is still named, so traffic fails closed rather than
    /// bypassing it.
    fn waypoint(&self, labels: &Labels, traffic: WaypointTraffic) -> Option<GatewayAddress> {
        let w = waypoint_ref(self.ns, self.ns_labels, labels)?;
        if let Some(scope) = self.waypoints.get(&w)
            && !waypoint_serves(*scope, traffic)
        {
            return None;
        }
        waypoint_for(self.ns, self.ns_labels, labels)
    }

    /// Translates the namespace's workloads (drafts appended to `wls`),
    /// Services and ServiceEntries (resources appended to `addresses`,
    /// memberships recorded on the drafts; `keys` is the table of service
    /// names the drafts point into). Returns the namespace's label index for
    /// the other translators.
    pub(crate) fn translate(
        &self,
        wls: &mut Vec<WorkloadDraft<'a>>,
        keys: &mut Vec<String>,
        addresses: &mut Vec<XdsResource>,
    ) -> LabelIndex<'a> {
        let index = self.workloads(wls);
        self.services(&index, wls, keys, addresses);
        self.service_entries(&index, wls, keys, addresses);
        index
    }
}

/// The waypoint address of an object bound with `istio.io/use-waypoint`
/// (see [`waypoint_ref`]).
pub fn waypoint_for(ns: &str, ns_labels: &Labels, labels: &Labels) -> Option<GatewayAddress> {
    let w = waypoint_ref(ns, ns_labels, labels)?;
    Some(GatewayAddress {
        destination: Some(gateway_address::Destination::Hostname(NamespacedHostname {
            hostname: format!("{}.{}.svc.{DOMAIN_SUFFIX}", w.name, w.namespace),
            namespace: w.namespace,
        })),
        hbone_mtls_port: HBONE_PORT,
    })
}

fn first_label<'l>(sets: &[&'l Labels], keys: &[&str]) -> Option<&'l str> {
    keys.iter()
        .find_map(|k| sets.iter().find_map(|s| s.get(*k)))
        .map(String::as_str)
}

fn canonical(sets: &[&Labels], fallback_name: &str) -> (String, String) {
    let name = first_label(
        sets,
        &[
            "service.istio.io/canonical-name",
            "app.kubernetes.io/name",
            "app",
        ],
    )
    .unwrap_or(fallback_name);
    let rev = first_label(
        sets,
        &[
            "service.istio.io/canonical-revision",
            "app.kubernetes.io/version",
            "version",
        ],
    )
    .unwrap_or("latest");
    (name.to_string(), rev.to_string())
}

/// The name of the controller that owns a pod (a Deployment for
/// ReplicaSet-owned pods, when the pod-template-hash says so), else the pod
/// name.
pub fn pod_workload_name(pod: &Pod) -> String {
    let m = &pod.metadata;
    let hash = m.labels.get("pod-template-hash");
    let owner = m
        .owner_references
        .iter()
        .find(|o| o.controller == Some(true))
        .or(m.owner_references.first());
    if let Some(o) = owner {
        if o.kind == "ReplicaSet"
            && let Some(dep) = hash.and_then(|h| o.name.strip_suffix(h.as_str())?.strip_suffix('-'))
        {
            return dep.to_string();
        }
        if !o.name.is_empty() {
            return o.name.clone();
        }
    }
    if let Some(h) = hash.filter(|h| !h.is_empty()) {
        // name = <deployment>-<hash>-<random>
        if let Some((prefix, rand)) = m.name.rsplit_once('-')
            && !rand.is_empty()
            && let Some(dep) = prefix
                .strip_suffix(h.as_str())
                .and_then(|p| p.strip_suffix('-'))
            && !dep.is_empty()
        {
            return dep.to_string();
        }
    }
    m.name.clone()
}

impl<'a> NsCx<'a> {
    fn base_workload(&self, uid: String, name: &str, ips: &[IpAddr], network: &str) -> Workload {
        let network = if network.is_empty() {
            self.opts.network.clone()
        } else {
            network.to_string()
        };
        Workload {
            uid,
            name: name.to_string(),
            namespace: self.ns.to_string(),
            addresses: ips.iter().copied().map(ip_bytes).collect(),
            network,
            trust_domain: self.opts.trust_domain.clone(),
            workload_type: WorkloadType::Pod as i32,
            cluster_id: self.opts.cluster_id.clone(),
            ..Default::default()
        }
    }

    /// A pod of a waypoint Gateway of this namespace (its
    /// `gateway.networking.k8s.io/gateway-name` label names one).
    fn is_waypoint_pod(&self, labels: &Labels) -> bool {
        labels
            .get(LABEL_GATEWAY_NAME)
            .and_then(|g| self.objs.gateways.get(g))
            .is_some_and(|g| g.is_waypoint())
    }

    /// Builds the pods' and WorkloadEntries' workloads and the namespace's
    /// label index over them.
    fn workloads(&self, wls: &mut Vec<WorkloadDraft<'a>>) -> LabelIndex<'a> {
        let mut views = Vec::with_capacity(self.objs.pods.len() + self.objs.workload_entries.len());
        for pod in self.objs.pods.values() {
            if pod.spec.host_network || pod.is_terminal() {
                continue;
            }
            let ips = pod.ips();
            if ips.is_empty() {
                continue;
            }
            let labels = &pod.metadata.labels;
            let name = &pod.metadata.name;
            let uid = format!("{}//Pod/{}/{}", self.opts.cluster_id, self.ns, name);
            let mut w = self.base_workload(uid, name, &ips, "");
            let workload_name = pod_workload_name(pod);
            (w.canonical_name, w.canonical_revision) = canonical(&[labels], &workload_name);
            w.workload_name = workload_name;
            w.service_account = pod.service_account().to_string();
            w.node.clone_from(&pod.spec.node_name);
            let sidecar = pod
                .metadata
                .annotations
                .contains_key("sidecar.istio.io/status");
            // Enrolled pods get HBONE from their ztunnel; a waypoint's
            // Envoy speaks HBONE itself (its pod is not captured), and so
            // does any pod that says so with Istio's tunnel label (a
            // sidecar terminating HBONE on 15008).
            let enrolled = !sidecar && is_enrolled(self.ns_labels, labels);
            if enrolled || self.is_waypoint_pod(labels) || accepts_hbone(labels) {
                w.tunnel_protocol = TunnelProtocol::Hbone as i32;
            }
            w.waypoint = self.waypoint(labels, WaypointTraffic::Workload);
            if !pod.is_healthy() {
                w.status = WorkloadStatus::Unhealthy as i32;
            }
            let view = LabelView {
                idx: wls.len(),
                labels,
                extra: None,
            };
            views.push(view);
            wls.push(WorkloadDraft {
                w,
                backing: Backing::Pod(pod),
                selectable: Some(view),
                services: Vec::new(),
            });
        }
        for we in self.objs.workload_entries.values() {
            if let Some(mut wl) = self.entry_workload(we) {
                let view = LabelView {
                    idx: wls.len(),
                    labels: &we.spec.labels,
                    extra: Some(&we.metadata.labels),
                };
                views.push(view);
                wl.selectable = Some(view);
                wls.push(wl);
            }
        }
        LabelIndex::build(views)
    }

    fn entry_workload(&self, we: &'a WorkloadEntry) -> Option<WorkloadDraft<'a>> {
        let spec = &we.spec;
        let name = &we.metadata.name;
        let ip = spec.ip();
        if ip.is_none() && !spec.address.is_empty() {
            tracing::debug!(namespace = self.ns, name = %name, address = %spec.address, "WorkloadEntry address is not an IP; no workload is published for it");
            return None;
        }
        let uid = format!(
            "{}/networking.istio.io/WorkloadEntry/{}/{}",
            self.opts.cluster_id, self.ns, name
        );
        let ips: Vec<IpAddr> = ip.into_iter().collect();
        let mut w = self.base_workload(uid, name, &ips, &spec.network);
        let sets = [&spec.labels, &we.metadata.labels];
        (w.canonical_name, w.canonical_revision) = canonical(&sets, name);
        w.workload_name.clone_from(name);
        w.service_account = if spec.service_account.is_empty() {
            "default".to_string()
        } else {
            spec.service_account.clone()
        };
        let mut merged;
        let labels = if we.metadata.labels.is_empty() {
            &spec.labels
        } else {
            merged = we.metadata.labels.clone();
            merged.extend(spec.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
            &merged
        };
        if is_enrolled(self.ns_labels, labels) || accepts_hbone(labels) {
            w.tunnel_protocol = TunnelProtocol::Hbone as i32;
        }
        w.waypoint = self.waypoint(labels, WaypointTraffic::Workload);
        Some(WorkloadDraft {
            w,
            backing: Backing::Entry(spec),
            selectable: None,
            services: Vec::new(),
        })
    }

    fn service_resource(&self, svc: XdsService, vips: &[IpAddr]) -> XdsResource {
        let name = format!("{}/{}", svc.namespace, svc.hostname);
        let aliases = vips
            .iter()
            .map(|ip| format!("{}/{}", self.opts.network, ip))
            .collect();
        let msg = Address {
            r#type: Some(address::Type::Service(svc)),
        };
        XdsResource::new(ADDRESS_TYPE_URL, name, aliases, &msg)
    }

    /// Kubernetes Services and their endpoint memberships.
    fn services(
        &self,
        index: &LabelIndex<'a>,
        wls: &mut Vec<WorkloadDraft<'a>>,
        keys: &mut Vec<String>,
        out: &mut Vec<XdsResource>,
    ) {
        let objs = self.objs;
        let mut slices: HashMap<&str, Vec<&'a EndpointSlice>> = HashMap::new();
        for s in objs.endpoint_slices.values() {
            if let Some(svc) = s.service_name() {
                slices.entry(svc).or_default().push(s);
            }
        }
        let mut by_name: HashMap<&str, usize> = HashMap::new();
        let mut by_ip: HashMap<IpAddr, usize> = HashMap::new();
        if !slices.is_empty() {
            for v in &index.views {
                let wl = &wls[v.idx];
                if let Backing::Pod(p) = wl.backing {
                    by_name.insert(p.metadata.name.as_str(), v.idx);
                }
                for a in &wl.w.addresses {
                    if let Some(ip) = ip_from_bytes(a) {
                        by_ip.entry(ip).or_insert(v.idx);
                    }
                }
            }
        }
        let mut slice_workloads: HashMap<String, usize> = HashMap::new();
        for (name, svc) in &objs.services {
            let hostname = format!("{name}.{}.svc.{DOMAIN_SUFFIX}", self.ns);
            let key = push_key(keys, format!("{}/{}", self.ns, hostname));
            if let Some(list) = slices.get(name.as_str()) {
                for slice in list {
                    self.slice_members(
                        svc,
                        key,
                        slice,
                        &by_name,
                        &by_ip,
                        &mut slice_workloads,
                        wls,
                    );
                }
            } else if let Some(sel) = svc.spec.selector.as_ref().filter(|s| !s.is_empty()) {
                for idx in index.select(sel) {
                    let wl = &mut wls[idx];
                    for sp in &svc.spec.ports {
                        if let Some(t) = resolve_service_target(sp, wl.backing) {
                            wl.add_port(
                                key,
                                Port {
                                    service_port: sp.port.into(),
                                    target_port: t.into(),
                                },
                            );
                        }
                    }
                }
            }
            let ports = svc
                .spec
                .ports
                .iter()
                .map(|p| Port {
                    service_port: p.port.into(),
                    target_port: match &p.target_port {
                        None => p.port.into(),
                        Some(TargetPort::Number(n)) => (*n).into(),
                        Some(TargetPort::Name(_)) => 0,
                    },
                })
                .collect();
            let labels = &svc.metadata.labels;
            let msg = XdsService {
                name: name.clone(),
                namespace: self.ns.to_string(),
                hostname,
                addresses: self.network_addresses(&svc.spec.vips),
                ports,
                waypoint: self.waypoint(labels, WaypointTraffic::Service),
                ..Default::default()
            };
            out.push(self.service_resource(msg, &svc.spec.vips));
        }
    }

    fn network_addresses(&self, ips: &[IpAddr]) -> Vec<NetworkAddress> {
        ips.iter()
            .map(|ip| NetworkAddress {
                network: self.opts.network.clone(),
                address: ip_bytes(*ip),
            })
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn slice_members(
        &self,
        svc: &'a Service,
        key: u32,
        slice: &'a EndpointSlice,
        by_name: &HashMap<&str, usize>,
        by_ip: &HashMap<IpAddr, usize>,
        slice_workloads: &mut HashMap<String, usize>,
        wls: &mut Vec<WorkloadDraft<'a>>,
    ) {
        for ep in &slice.endpoints {
            let by_ref = ep
                .target_ref
                .as_ref()
                .filter(|r| r.kind == "Pod" && (r.namespace.is_empty() || r.namespace == self.ns))
                .and_then(|r| by_name.get(r.name.as_str()).copied());
            let mut members: Vec<usize> = by_ref.into_iter().collect();
            if members.is_empty() {
                for ip in &ep.ips {
                    if let Some(&i) = by_ip.get(ip) {
                        if !members.contains(&i) {
                            members.push(i);
                        }
                        continue;
                    }
                    // An address no pod or WorkloadEntry has: a workload of its own.
                    let uid = format!(
                        "{}/discovery.k8s.io/EndpointSlice/{}/{}/{}",
                        self.opts.cluster_id, self.ns, slice.metadata.name, ip
                    );
                    let i = *slice_workloads.entry(uid).or_insert_with_key(|uid| {
                        let mut w =
                            self.base_workload(uid.clone(), &slice.metadata.name, &[*ip], "");
                        w.canonical_name.clone_from(&svc.metadata.name);
                        w.canonical_revision = "latest".to_string();
                        w.workload_name.clone_from(&slice.metadata.name);
                        w.node.clone_from(&ep.node_name);
                        if ep.conditions.ready == Some(false) {
                            w.status = WorkloadStatus::Unhealthy as i32;
                        }
                        wls.push(WorkloadDraft {
                            w,
                            backing: Backing::Plain,
                            selectable: None,
                            services: Vec::new(),
                        });
                        wls.len() - 1
                    });
                    members.push(i);
                }
            }
            for i in members {
                let wl = &mut wls[i];
                for sp in &svc.spec.ports {
                    let target = if slice.ports.is_empty() {
                        resolve_service_target(sp, wl.backing)
                    } else {
                        slice
                            .ports
                            .iter()
                            .find(|p| p.name == sp.name)
                            .and_then(|p| p.port)
                    };
                    if let Some(t) = target {
                        wl.add_port(
                            key,
                            Port {
                                service_port: sp.port.into(),
                                target_port: t.into(),
                            },
                        );
                    }
                }
            }
        }
    }

    /// ServiceEntries: one service per host, workloads for inline endpoints,
    /// memberships for selected pods and WorkloadEntries.
    fn service_entries(
        &self,
        index: &LabelIndex<'a>,
        wls: &mut Vec<WorkloadDraft<'a>>,
        keys: &mut Vec<String>,
        out: &mut Vec<XdsResource>,
    ) {
        for (name, se) in &self.objs.service_entries {
            let spec = &se.spec;
            let se_keys: Vec<u32> = spec
                .hosts
                .iter()
                .map(|h| push_key(keys, format!("{}/{}", self.ns, h)))
                .collect();
            let waypoint = self.waypoint(&se.metadata.labels, WaypointTraffic::Service);
            for host in &spec.hosts {
                let ports = spec
                    .ports
                    .iter()
                    .map(|p| Port {
                        service_port: p.number.into(),
                        target_port: p.target_port.unwrap_or(p.number).into(),
                    })
                    .collect();
                let msg = XdsService {
                    name: name.clone(),
                    namespace: self.ns.to_string(),
                    hostname: host.clone(),
                    addresses: self.network_addresses(&spec.vips),
                    ports,
                    subject_alt_names: spec.subject_alt_names.clone(),
                    waypoint: waypoint.clone(),
                    ..Default::default()
                };
                out.push(self.service_resource(msg, &spec.vips));
            }
            if let Some(sel) = &spec.workload_selector {
                for idx in index.select(&sel.labels) {
                    add_entry_ports(&mut wls[idx], se, &se_keys);
                }
            }
            for ep in &spec.endpoints {
                let Some(ip) = ep.ip() else {
                    tracing::debug!(namespace = self.ns, name = %name, address = %ep.address, "ServiceEntry endpoint is not an IP; no workload is published for it");
                    continue;
                };
                let uid = format!(
                    "{}/networking.istio.io/ServiceEntry/{}/{}/{}",
                    self.opts.cluster_id, self.ns, name, ep.address
                );
                let mut w = self.base_workload(uid, name, &[ip], &ep.network);
                (w.canonical_name, w.canonical_revision) =
                    canonical(&[&ep.labels, &se.metadata.labels], name);
                w.workload_name.clone_from(name);
                w.service_account = if ep.service_account.is_empty() {
                    "default".to_string()
                } else {
                    ep.service_account.clone()
                };
                if spec.location == Location::MeshInternal
                    && is_enrolled(self.ns_labels, &ep.labels)
                {
                    w.tunnel_protocol = TunnelProtocol::Hbone as i32;
                }
                w.waypoint = self.waypoint(&ep.labels, WaypointTraffic::Workload);
                let mut wl = WorkloadDraft {
                    w,
                    backing: Backing::Entry(ep),
                    selectable: None,
                    services: Vec::new(),
                };
                add_entry_ports(&mut wl, se, &se_keys);
                wls.push(wl);
            }
        }
    }
}

fn add_entry_ports(wl: &mut WorkloadDraft<'_>, se: &ServiceEntry, keys: &[u32]) {
    for p in &se.spec.ports {
        let target = match wl.backing {
            Backing::Entry(e) => e.ports.get(&p.name).copied(),
            _ => None,
        }
        .or(p.target_port)
        .unwrap_or(p.number);
        for &key in keys {
            wl.add_port(
                key,
                Port {
                    service_port: p.number.into(),
                    target_port: target.into(),
                },
            );
        }
    }
}

/// Target port of a Service port on one selected workload.
fn resolve_service_target(
    sp: &ambit_config::objects::ServicePort,
    backing: Backing<'_>,
) -> Option<u16> {
    if let Backing::Entry(e) = backing
        && let Some(p) = e.ports.get(&sp.name)
    {
        return Some(*p);
    }
    match &sp.target_port {
        None => Some(sp.port),
        Some(TargetPort::Number(n)) => Some(*n),
        Some(TargetPort::Name(name)) => match backing {
            Backing::Pod(p) => p.container_port(name),
            Backing::Entry(e) => e.ports.get(name).copied(),
            Backing::Plain => None,
        },
    }
}

fn push_key(keys: &mut Vec<String>, key: String) -> u32 {
    keys.push(key);
    (keys.len() - 1) as u32
}

/// Istio's label for a workload that terminates HBONE itself:
/// `networking.istio.io/tunnel` listing `http` (HTTP/2 CONNECT over mTLS
/// on 15008). The value is read as a comma-separated list, as Istio asks.
pub(crate) fn accepts_hbone(labels: &BTreeMap<String, String>) -> bool {
    labels
        .get(TUNNEL_LABEL)
        .is_some_and(|v| v.split(',').any(|t| t.trim() == "http"))
}

/// The label naming the tunnel protocols a workload accepts.
pub(crate) const TUNNEL_LABEL: &str = "networking.istio.io/tunnel";
