//! From a directory of Kubernetes YAML to the cluster `local up` builds:
//! nodes (the distinct `spec.nodeName`s, sorted), their pod subnets (the
//! /24 of their pods' `status.podIP`s) and the pods. Pure: no root needed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::LocalError;
use super::sidecars::wants_sidecar;
use super::waypoints::{GatewayKey, wanted};
use crate::config::{Labels, Object, is_enrolled, parse_documents};

/// Pod annotation naming the demo app a pod runs: the `ambit-demo`
/// arguments, e.g. `"--http 8080"`.
pub const APP_ANNOTATION: &str = "ambit.dev/demo-app";

/// The lan every node is on: node `i` is `172.31.0.(i+1)/24`.
pub const LAN_PREFIX: [u8; 3] = [172, 31, 0];

/// Most nodes a cluster can have (addresses on the lan's /24).
pub const MAX_NODES: usize = 250;

/// A node of the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodePlan {
    pub name: String,
    /// Position in the sorted node list.
    pub index: usize,
    /// Its address on the lan.
    pub lan_ip: Ipv4Addr,
    /// Network address of its pod /24.
    pub subnet: Ipv4Addr,
    /// `.1` of the subnet, on the node's `cni0` bridge.
    pub gateway: Ipv4Addr,
}

impl NodePlan {
    /// `a.b.c.0/24`.
    pub fn subnet_cidr(&self) -> String {
        format!("{}/24", self.subnet)
    }
}

/// A pod of the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PodPlan {
    pub namespace: String,
    pub name: String,
    pub node: String,
    pub ip: Ipv4Addr,
    /// `metadata.uid`, empty when the YAML has none.
    pub uid: String,
    pub service_account: String,
    /// Whether the labels put it in the mesh (what the node agent decides).
    pub ambient: bool,
    /// Whether it runs a sidecar: it asks for injection (and is not
    /// ambient), or has one already (see `sidecars`).
    pub sidecar: bool,
    /// Its labels.
    pub labels: Labels,
    /// `ambit-demo` arguments from [`APP_ANNOTATION`].
    pub app: Option<Vec<String>>,
    /// The file it was read from.
    pub file: PathBuf,
}

impl PodPlan {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// What `local up` builds from a config directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Plan {
    pub config_dir: PathBuf,
    pub nodes: Vec<NodePlan>,
    /// Sorted by namespace, then name.
    pub pods: Vec<PodPlan>,
    /// Waypoint Gateways local mode runs a pod for (the waypoint
    /// controller starts them; see `waypoints`).
    pub waypoints: Vec<GatewayKey>,
    /// The labels of each Namespace of the config.
    pub namespace_labels: BTreeMap<String, Labels>,
}

impl Plan {
    /// The node named `name`.
    pub fn node(&self, name: &str) -> Option<&NodePlan> {
        self.nodes.iter().find(|n| n.name == name)
    }
}

/// Reads every `*.yaml`/`*.yml` under `dir` (recursively, skipping names
/// starting with `.`, as the control plane does) and plans the cluster.
pub fn plan_dir(dir: &Path) -> Result<Plan, LocalError> {
    let mut files = BTreeSet::new();
    walk(dir, 0, &mut files).map_err(|source| LocalError::ConfigDir {
        dir: dir.to_path_buf(),
        source,
    })?;
    let mut texts = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).map_err(LocalError::io("reading config", &f))?;
        texts.push((f, text));
    }
    plan_documents(dir, &texts)
}

fn walk(dir: &Path, depth: usize, out: &mut BTreeSet<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let meta = std::fs::metadata(&path)?;
        if meta.is_dir() {
            if depth < 16 {
                walk(&path, depth + 1, out)?;
            }
        } else if path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"))
        {
            out.insert(path);
        }
    }
    Ok(())
}

/// Plans the cluster from `(file, text)` pairs read from `dir`.
pub fn plan_documents(dir: &Path, files: &[(PathBuf, String)]) -> Result<Plan, LocalError> {
    let fail = |why: String| LocalError::Plan {
        dir: dir.to_path_buf(),
        why,
    };
    let mut errors = Vec::new();
    let mut namespaces: BTreeMap<String, Labels> = BTreeMap::new();
    let mut raw = Vec::new();
    let mut gateways = Vec::new();
    for (file, text) in files {
        let (objects, errs) = parse_documents(file, text);
        errors.extend(errs.iter().map(ToString::to_string));
        for o in objects {
            match o {
                Object::Namespace(ns) => {
                    namespaces.insert(ns.metadata.name.clone(), ns.metadata.labels.clone());
                }
                Object::Pod(p) if !p.spec.host_network => raw.push((file.clone(), p)),
                g @ Object::Gateway(_) => gateways.push(g),
                _ => {}
            }
        }
    }
    if !errors.is_empty() {
        return Err(LocalError::Config {
            dir: dir.to_path_buf(),
            errors,
        });
    }
    let empty = Labels::new();
    let mut pods = Vec::new();
    for (file, p) in raw {
        let m = &p.metadata;
        let key = format!("{}/{} ({})", m.namespace, m.name, file.display());
        for (what, v) in [("namespace", &m.namespace), ("name", &m.name)] {
            check_name(v).map_err(|why| fail(format!("pod {key}: {what} {v:?} {why}")))?;
        }
        if p.spec.node_name.is_empty() {
            return Err(fail(format!(
                "pod {key} has no spec.nodeName; local mode places pods on the nodes named there — add one (e.g. `nodeName: node-1`)"
            )));
        }
        if p.spec.node_name == "lan" {
            return Err(fail(format!(
                "pod {key} is on a node named \"lan\", which local mode uses for the network between nodes — rename the node"
            )));
        }
        check_name(&p.spec.node_name)
            .map_err(|why| fail(format!("pod {key}: nodeName {:?} {why}", p.spec.node_name)))?;
        let ip = match p.status.pod_ip {
            Some(IpAddr::V4(ip)) => ip,
            Some(IpAddr::V6(ip)) => {
                return Err(fail(format!(
                    "pod {key} has an IPv6 status.podIP {ip}; local mode wires IPv4 pods — give it an IPv4 podIP (IPv6 may stay in podIPs)"
                )));
            }
            None => {
                return Err(fail(format!(
                    "pod {key} has no status.podIP; local mode gives each pod the address written there — add `status: {{podIP: 10.10.N.M}}` in its node's /24"
                )));
            }
        };
        let host = ip.octets()[3];
        if host == 0 || host == 1 || host == 255 {
            return Err(fail(format!(
                "pod {key} has podIP {ip}; .0, .1 (the node's gateway) and .255 of a /24 are taken — pick .2 to .254"
            )));
        }
        if ip.octets()[..3] == LAN_PREFIX {
            return Err(fail(format!(
                "pod {key} has podIP {ip} in 172.31.0.0/24, which local mode uses for the nodes' lan — pick another subnet"
            )));
        }
        let app = m
            .annotations
            .get(APP_ANNOTATION)
            .map(|a| a.split_whitespace().map(str::to_string).collect::<Vec<_>>())
            .filter(|a| !a.is_empty());
        let ns_labels = namespaces.get(&m.namespace).unwrap_or(&empty);
        pods.push(PodPlan {
            namespace: m.namespace.clone(),
            name: m.name.clone(),
            node: p.spec.node_name.clone(),
            ip,
            uid: m.uid.clone(),
            service_account: p.service_account().to_string(),
            ambient: is_enrolled(ns_labels, &m.labels),
            // An ambient pod stays ambient, even one injected already.
            sidecar: !is_enrolled(ns_labels, &m.labels) && wants_sidecar(&p, ns_labels),
            labels: m.labels.clone(),
            app,
            file,
        });
    }
    if pods.is_empty() {
        return Err(fail(
            "no pods found; local mode needs Pods with spec.nodeName and status.podIP (see deploy/local/demo)".into(),
        ));
    }
    pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    let mut by_ip: BTreeMap<Ipv4Addr, String> = BTreeMap::new();
    for p in &pods {
        if let Some(other) = by_ip.insert(p.ip, p.key()) {
            return Err(fail(format!(
                "pods {other} and {} both have podIP {}; give each pod its own address",
                p.key(),
                p.ip
            )));
        }
    }
    let node_names: BTreeSet<&str> = pods.iter().map(|p| p.node.as_str()).collect();
    if node_names.len() > MAX_NODES {
        return Err(fail(format!(
            "{} nodes; local mode supports up to {MAX_NODES}",
            node_names.len()
        )));
    }
    let mut nodes = Vec::new();
    let mut owner: BTreeMap<Ipv4Addr, String> = BTreeMap::new();
    for (index, name) in node_names.into_iter().enumerate() {
        let subnets: BTreeMap<Ipv4Addr, &PodPlan> = pods
            .iter()
            .filter(|p| p.node == name)
            .map(|p| (subnet_of(p.ip), p))
            .collect();
        let mut it = subnets.iter();
        let Some((&subnet, _)) = it.next() else {
            continue;
        };
        if subnets.len() > 1 {
            let list: Vec<String> = subnets
                .iter()
                .map(|(s, p)| format!("{s}/24 (e.g. {} {})", p.key(), p.ip))
                .collect();
            return Err(fail(format!(
                "the pods of node {name} span several /24s: {}; a node's pods share one /24 — move them into one",
                list.join(", ")
            )));
        }
        if let Some(other) = owner.insert(subnet, name.to_string()) {
            return Err(fail(format!(
                "nodes {other} and {name} both have pods in {subnet}/24; each node needs its own /24"
            )));
        }
        let [a, b, c, _] = subnet.octets();
        let [l0, l1, l2] = LAN_PREFIX;
        nodes.push(NodePlan {
            name: name.to_string(),
            index,
            lan_ip: Ipv4Addr::new(l0, l1, l2, u8::try_from(index + 1).unwrap_or(u8::MAX)),
            subnet,
            gateway: Ipv4Addr::new(a, b, c, 1),
        });
    }
    let waypoints = wanted(gateways.iter())
        .into_iter()
        .filter_map(|(k, ok)| ok.is_ok().then_some(k))
        .collect();
    Ok(Plan {
        config_dir: dir.to_path_buf(),
        nodes,
        pods,
        waypoints,
        namespace_labels: namespaces,
    })
}

/// The /24 network address of `ip`.
pub fn subnet_of(ip: Ipv4Addr) -> Ipv4Addr {
    let [a, b, c, _] = ip.octets();
    Ipv4Addr::new(a, b, c, 0)
}

/// Names used in paths and netns names: lower-case letters, digits, `-`
/// and `.`, not starting with `.` or `-` (Kubernetes names are a subset).
fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(['.', '-'])
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
    if ok {
        Ok(())
    } else {
        Err("is not a valid name (1-63 lower-case letters, digits, '-' or '.')".into())
    }
}
