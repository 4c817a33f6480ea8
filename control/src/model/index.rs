//! What every translator shares, below all of them: the workloads under
//! construction ([`WorkloadDraft`]), what each was made from, and the
//! per-namespace label index selectors are matched through. Translators
//! (workloads and services, authorization, peer authentication) fill the
//! drafts; [`super::assemble`] encodes them.

use std::collections::HashMap;
use std::net::IpAddr;

use ambit_config::gateway_api::WaypointFor;
use ambit_config::objects::{
    LABEL_USE_WAYPOINT, LABEL_USE_WAYPOINT_NAMESPACE, Labels, Pod, WorkloadEntrySpec,
};
use ambit_proto::workload::{Port, Workload};

use super::store::Store;

/// DNS domain of the cluster (service hostnames `name.ns.svc.<suffix>`).
pub const DOMAIN_SUFFIX: &str = "cluster.local";
/// Namespaces whose selector-less policies apply mesh-wide.
pub use ambit_config::objects::ROOT_NAMESPACES;
/// HBONE port of waypoints.
pub const HBONE_PORT: u32 = 15008;
/// Label carried by the pods and services of a Gateway (waypoints included).
pub const LABEL_GATEWAY_NAME: &str = "gateway.networking.k8s.io/gateway-name";

/// The waypoint an object is bound to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct WaypointRef {
    pub namespace: String,
    pub name: String,
}

/// What traffic each waypoint Gateway of the store handles
/// (`istio.io/waypoint-for`); a Gateway with an unknown value is absent.
pub type WaypointScopes = std::collections::BTreeMap<WaypointRef, WaypointFor>;

/// The traffic an object bound to a waypoint sends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaypointTraffic {
    /// Traffic addressed to a service (its VIP or hostname).
    Service,
    /// Traffic addressed to a workload (its IP).
    Workload,
}

/// The waypoints of `store` and what each handles.
pub fn waypoint_scopes(store: &Store) -> WaypointScopes {
    let mut out = WaypointScopes::new();
    for (ns, objs) in store.spaces() {
        for (name, gw) in &objs.gateways {
            if !gw.is_waypoint() {
                continue;
            }
            if let Some(scope) = gw.waypoint_for() {
                let key = WaypointRef {
                    namespace: ns.to_string(),
                    name: name.clone(),
                };
                out.insert(key, scope);
            }
        }
    }
    out
}

/// Whether a waypoint handling `scope` takes `traffic` (Istio: a Service
/// names only a waypoint for services, a workload only one for workloads;
/// `all` is both).
pub fn waypoint_serves(scope: WaypointFor, traffic: WaypointTraffic) -> bool {
    matches!(
        (scope, traffic),
        (WaypointFor::All, _)
            | (WaypointFor::Service, WaypointTraffic::Service)
            | (WaypointFor::Workload, WaypointTraffic::Workload)
    )
}

/// `istio.io/use-waypoint` on the object, else on its namespace (with
/// `istio.io/use-waypoint-namespace` for a waypoint elsewhere); `none` on
/// the object disables a namespace waypoint. Gateways never use one.
pub fn waypoint_ref(ns: &str, ns_labels: &Labels, labels: &Labels) -> Option<WaypointRef> {
    if labels.contains_key(LABEL_GATEWAY_NAME) {
        return None;
    }
    let source = if labels.contains_key(LABEL_USE_WAYPOINT) {
        labels
    } else {
        ns_labels
    };
    let name = source.get(LABEL_USE_WAYPOINT)?;
    if name.is_empty() || name == "none" {
        return None;
    }
    let namespace = source
        .get(LABEL_USE_WAYPOINT_NAMESPACE)
        .map(String::as_str)
        .filter(|s| !s.is_empty())
        .unwrap_or(ns);
    Some(WaypointRef {
        namespace: namespace.to_string(),
        name: name.clone(),
    })
}

/// What a workload was made from, for per-workload target port resolution.
#[derive(Clone, Copy)]
pub(crate) enum Backing<'a> {
    Pod(&'a Pod),
    Entry(&'a WorkloadEntrySpec),
    Plain,
}

/// A workload under construction.
pub(crate) struct WorkloadDraft<'a> {
    pub w: Workload,
    pub backing: Backing<'a>,
    /// Labels selectors see (pods and WorkloadEntries only).
    pub selectable: Option<LabelView<'a>>,
    /// Memberships: (index into the translation's service key table
    /// (`namespace/hostname`), port).
    pub services: Vec<(u32, Port)>,
}

impl WorkloadDraft<'_> {
    pub(crate) fn add_port(&mut self, key: u32, port: Port) {
        let dup = self
            .services
            .iter()
            .any(|(k, p)| *k == key && p.service_port == port.service_port);
        if !dup {
            self.services.push((key, port));
        }
    }
}

/// Label view of a selectable workload: primary labels, then fallbacks
/// (a WorkloadEntry's metadata labels behind its spec labels).
#[derive(Clone, Copy)]
pub(crate) struct LabelView<'a> {
    /// Index into the global workload list.
    pub idx: usize,
    pub labels: &'a Labels,
    pub extra: Option<&'a Labels>,
}

impl LabelView<'_> {
    fn get(&self, k: &str) -> Option<&str> {
        self.labels
            .get(k)
            .or_else(|| self.extra.and_then(|e| e.get(k)))
            .map(String::as_str)
    }

    pub fn matches(&self, selector: &Labels) -> bool {
        selector
            .iter()
            .all(|(k, v)| self.get(k) == Some(v.as_str()))
    }
}

/// Label index over the selectable workloads (pods, WorkloadEntries) of one
/// namespace.
pub(crate) struct LabelIndex<'a> {
    pub views: Vec<LabelView<'a>>,
    postings: HashMap<(&'a str, &'a str), Vec<u32>>,
}

impl<'a> LabelIndex<'a> {
    pub(crate) fn build(views: Vec<LabelView<'a>>) -> Self {
        let mut postings: HashMap<(&str, &str), Vec<u32>> = HashMap::new();
        for (i, v) in views.iter().enumerate() {
            let extra = v.extra.into_iter().flatten();
            for (k, val) in v.labels.iter().chain(extra) {
                let list = postings.entry((k.as_str(), val.as_str())).or_default();
                if list.last() != Some(&(i as u32)) {
                    list.push(i as u32);
                }
            }
        }
        Self { views, postings }
    }

    /// Indices (into the global workload list) of workloads matching a
    /// non-empty selector; an empty selector selects all.
    pub fn select(&self, selector: &Labels) -> Vec<usize> {
        if selector.is_empty() {
            return self.views.iter().map(|v| v.idx).collect();
        }
        let mut best: Option<&Vec<u32>> = None;
        for (k, v) in selector {
            match self.postings.get(&(k.as_str(), v.as_str())) {
                None => return Vec::new(),
                Some(list) if best.is_none_or(|b| list.len() < b.len()) => best = Some(list),
                Some(_) => {}
            }
        }
        best.into_iter()
            .flatten()
            .map(|&i| self.views[i as usize])
            .filter(|v| v.matches(selector))
            .map(|v| v.idx)
            .collect()
    }
}

pub(crate) fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

pub(crate) fn ip_from_bytes(b: &[u8]) -> Option<IpAddr> {
    match b.len() {
        4 => <[u8; 4]>::try_from(b).ok().map(IpAddr::from),
        16 => <[u8; 16]>::try_from(b).ok().map(IpAddr::from),
        _ => None,
    }
}
