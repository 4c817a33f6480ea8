//! The model's object store: every accepted object, indexed by namespace so
//! translation can work one namespace at a time (Namespaces and Nodes, which
//! are cluster-scoped, by name), plus the current set of configuration
//! errors. Owned by the model's single writer task.

use std::collections::BTreeMap;

use super::{Change, ConfigError};
use ambit_config::objects::{
    AuthorizationPolicy, DestinationRule, EndpointSlice, Gateway, GrpcRoute, HttpRoute, Kind,
    Labels, MeshConfigMap, Namespace, Node, Object, ObjectKey, PeerAuthentication, Pod, Service,
    ServiceEntry, Sidecar, TcpRoute, Telemetry, VirtualService, WorkloadEntry,
};

/// The objects of one namespace, by name.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct NamespaceObjects {
    pub pods: BTreeMap<String, Pod>,
    pub services: BTreeMap<String, Service>,
    pub endpoint_slices: BTreeMap<String, EndpointSlice>,
    pub service_entries: BTreeMap<String, ServiceEntry>,
    pub workload_entries: BTreeMap<String, WorkloadEntry>,
    pub peer_authentications: BTreeMap<String, PeerAuthentication>,
    pub authorization_policies: BTreeMap<String, AuthorizationPolicy>,
    pub virtual_services: BTreeMap<String, VirtualService>,
    pub destination_rules: BTreeMap<String, DestinationRule>,
    pub sidecars: BTreeMap<String, Sidecar>,
    /// Gateway API Gateways (waypoints among them).
    pub gateways: BTreeMap<String, Gateway>,
    pub http_routes: BTreeMap<String, HttpRoute>,
    pub grpc_routes: BTreeMap<String, GrpcRoute>,
    pub tcp_routes: BTreeMap<String, TcpRoute>,
    pub telemetries: BTreeMap<String, Telemetry>,
    /// The mesh configuration ConfigMap (`istio`; only in root namespaces).
    pub mesh_configs: BTreeMap<String, MeshConfigMap>,
}

impl NamespaceObjects {
    fn is_empty(&self) -> bool {
        self.pods.is_empty()
            && self.services.is_empty()
            && self.endpoint_slices.is_empty()
            && self.service_entries.is_empty()
            && self.workload_entries.is_empty()
            && self.peer_authentications.is_empty()
            && self.authorization_policies.is_empty()
            && self.virtual_services.is_empty()
            && self.destination_rules.is_empty()
            && self.sidecars.is_empty()
            && self.gateways.is_empty()
            && self.http_routes.is_empty()
            && self.grpc_routes.is_empty()
            && self.tcp_routes.is_empty()
            && self.telemetries.is_empty()
            && self.mesh_configs.is_empty()
    }

    fn len(&self) -> usize {
        self.pods.len()
            + self.services.len()
            + self.endpoint_slices.len()
            + self.service_entries.len()
            + self.workload_entries.len()
            + self.peer_authentications.len()
            + self.authorization_policies.len()
            + self.virtual_services.len()
            + self.destination_rules.len()
            + self.sidecars.len()
            + self.gateways.len()
            + self.http_routes.len()
            + self.grpc_routes.len()
            + self.tcp_routes.len()
            + self.telemetries.len()
            + self.mesh_configs.len()
    }
}

/// All accepted objects and the current configuration errors.
#[derive(Debug, Default, Clone)]
pub struct Store {
    namespaces: BTreeMap<String, Namespace>,
    nodes: BTreeMap<String, Node>,
    spaces: BTreeMap<String, NamespaceObjects>,
    errors: BTreeMap<String, Vec<ConfigError>>,
}

static NO_LABELS: Labels = Labels::new();

/// Inserts `v` under `k` unless an equal value is already there; true when
/// the map changed.
fn put<T: PartialEq>(map: &mut BTreeMap<String, T>, k: String, v: T) -> bool {
    match map.get_mut(&k) {
        Some(old) if *old == v => false,
        Some(old) => {
            *old = v;
            true
        }
        None => {
            map.insert(k, v);
            true
        }
    }
}

impl Store {
    /// A store holding `objects` (later duplicates win), without errors.
    pub fn from_objects(objects: Vec<Object>) -> Store {
        let mut s = Store::default();
        for o in objects {
            s.upsert(o);
        }
        s
    }

    /// Applies one change; true when the store changed.
    pub fn apply(&mut self, change: Change) -> bool {
        match change {
            Change::Upsert(o) => self.upsert(o),
            Change::Delete(k) => self.delete(&k),
        }
    }

    /// Inserts or replaces an object; true when the store changed.
    pub fn upsert(&mut self, obj: Object) -> bool {
        let meta = obj.metadata();
        let (name, namespace) = (meta.name.clone(), meta.namespace.clone());
        let obj = match obj {
            Object::Namespace(n) => return put(&mut self.namespaces, name, n),
            Object::Node(n) => return put(&mut self.nodes, name, n),
            namespaced => namespaced,
        };
        let ns = self.spaces.entry(namespace).or_default();
        match obj {
            Object::Namespace(_) | Object::Node(_) => false,
            Object::Pod(o) => put(&mut ns.pods, name, o),
            Object::Service(o) => put(&mut ns.services, name, o),
            Object::EndpointSlice(o) => put(&mut ns.endpoint_slices, name, o),
            Object::ServiceEntry(o) => put(&mut ns.service_entries, name, *o),
            Object::WorkloadEntry(o) => put(&mut ns.workload_entries, name, o),
            Object::PeerAuthentication(o) => put(&mut ns.peer_authentications, name, o),
            Object::AuthorizationPolicy(o) => put(&mut ns.authorization_policies, name, o),
            Object::VirtualService(o) => put(&mut ns.virtual_services, name, *o),
            Object::DestinationRule(o) => put(&mut ns.destination_rules, name, *o),
            Object::Sidecar(o) => put(&mut ns.sidecars, name, *o),
            Object::Gateway(o) => put(&mut ns.gateways, name, *o),
            Object::HttpRoute(o) => put(&mut ns.http_routes, name, *o),
            Object::GrpcRoute(o) => put(&mut ns.grpc_routes, name, *o),
            Object::TcpRoute(o) => put(&mut ns.tcp_routes, name, *o),
            Object::Telemetry(o) => put(&mut ns.telemetries, name, *o),
            Object::MeshConfig(o) => put(&mut ns.mesh_configs, name, *o),
        }
    }

    /// Removes an object; true when it existed.
    pub fn delete(&mut self, key: &ObjectKey) -> bool {
        match key.kind {
            Kind::Namespace => return self.namespaces.remove(&key.name).is_some(),
            Kind::Node => return self.nodes.remove(&key.name).is_some(),
            _ => {}
        }
        let Some(ns) = self.spaces.get_mut(&key.namespace) else {
            return false;
        };
        let n = &key.name;
        let removed = match key.kind {
            Kind::Namespace | Kind::Node => false,
            Kind::Pod => ns.pods.remove(n).is_some(),
            Kind::Service => ns.services.remove(n).is_some(),
            Kind::EndpointSlice => ns.endpoint_slices.remove(n).is_some(),
            Kind::ServiceEntry => ns.service_entries.remove(n).is_some(),
            Kind::WorkloadEntry => ns.workload_entries.remove(n).is_some(),
            Kind::PeerAuthentication => ns.peer_authentications.remove(n).is_some(),
            Kind::AuthorizationPolicy => ns.authorization_policies.remove(n).is_some(),
            Kind::VirtualService => ns.virtual_services.remove(n).is_some(),
            Kind::DestinationRule => ns.destination_rules.remove(n).is_some(),
            Kind::Sidecar => ns.sidecars.remove(n).is_some(),
            Kind::Gateway => ns.gateways.remove(n).is_some(),
            Kind::HttpRoute => ns.http_routes.remove(n).is_some(),
            Kind::GrpcRoute => ns.grpc_routes.remove(n).is_some(),
            Kind::TcpRoute => ns.tcp_routes.remove(n).is_some(),
            Kind::Telemetry => ns.telemetries.remove(n).is_some(),
            Kind::MeshConfig => ns.mesh_configs.remove(n).is_some(),
        };
        if ns.is_empty() {
            self.spaces.remove(&key.namespace);
        }
        removed
    }

    /// Looks an object up (cloned; for tests and debugging).
    pub fn get(&self, key: &ObjectKey) -> Option<Object> {
        match key.kind {
            Kind::Namespace => {
                return self
                    .namespaces
                    .get(&key.name)
                    .cloned()
                    .map(Object::Namespace);
            }
            Kind::Node => return self.nodes.get(&key.name).cloned().map(Object::Node),
            _ => {}
        }
        let ns = self.spaces.get(&key.namespace)?;
        let n = &key.name;
        match key.kind {
            Kind::Namespace | Kind::Node => None,
            Kind::Pod => ns.pods.get(n).cloned().map(Object::Pod),
            Kind::Service => ns.services.get(n).cloned().map(Object::Service),
            Kind::EndpointSlice => ns
                .endpoint_slices
                .get(n)
                .cloned()
                .map(Object::EndpointSlice),
            Kind::ServiceEntry => ns
                .service_entries
                .get(n)
                .cloned()
                .map(|o| Object::ServiceEntry(Box::new(o))),
            Kind::WorkloadEntry => ns
                .workload_entries
                .get(n)
                .cloned()
                .map(Object::WorkloadEntry),
            Kind::PeerAuthentication => ns
                .peer_authentications
                .get(n)
                .cloned()
                .map(Object::PeerAuthentication),
            Kind::AuthorizationPolicy => ns
                .authorization_policies
                .get(n)
                .cloned()
                .map(Object::AuthorizationPolicy),
            Kind::VirtualService => ns
                .virtual_services
                .get(n)
                .map(|o| Object::VirtualService(Box::new(o.clone()))),
            Kind::DestinationRule => ns
                .destination_rules
                .get(n)
                .map(|o| Object::DestinationRule(Box::new(o.clone()))),
            Kind::Sidecar => ns
                .sidecars
                .get(n)
                .map(|o| Object::Sidecar(Box::new(o.clone()))),
            Kind::Gateway => ns
                .gateways
                .get(n)
                .map(|o| Object::Gateway(Box::new(o.clone()))),
            Kind::HttpRoute => ns
                .http_routes
                .get(n)
                .map(|o| Object::HttpRoute(Box::new(o.clone()))),
            Kind::GrpcRoute => ns
                .grpc_routes
                .get(n)
                .map(|o| Object::GrpcRoute(Box::new(o.clone()))),
            Kind::TcpRoute => ns
                .tcp_routes
                .get(n)
                .map(|o| Object::TcpRoute(Box::new(o.clone()))),
            Kind::Telemetry => ns
                .telemetries
                .get(n)
                .map(|o| Object::Telemetry(Box::new(o.clone()))),
            Kind::MeshConfig => ns
                .mesh_configs
                .get(n)
                .map(|o| Object::MeshConfig(Box::new(o.clone()))),
        }
    }

    /// Number of objects held.
    pub fn len(&self) -> usize {
        self.namespaces.len()
            + self.nodes.len()
            + self
                .spaces
                .values()
                .map(NamespaceObjects::len)
                .sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Replaces the errors of one scope (a file, or a source-defined scope);
    /// an empty list clears it. True when the error set changed.
    pub fn set_errors(&mut self, scope: String, errors: Vec<ConfigError>) -> bool {
        if errors.is_empty() {
            return self.errors.remove(&scope).is_some();
        }
        put(&mut self.errors, scope, errors)
    }

    /// All current errors, ordered by scope.
    pub fn errors(&self) -> Vec<ConfigError> {
        self.errors.values().flatten().cloned().collect()
    }

    /// Labels of a namespace (empty when the Namespace object is unknown).
    pub fn namespace_labels(&self, ns: &str) -> &Labels {
        self.namespaces
            .get(ns)
            .map(|n| &n.metadata.labels)
            .unwrap_or(&NO_LABELS)
    }

    /// Nodes by name (cluster-scoped).
    pub fn nodes(&self) -> impl Iterator<Item = &Node> {
        self.nodes.values()
    }

    /// Namespaces that hold at least one namespaced object, with their objects.
    pub fn spaces(&self) -> impl Iterator<Item = (&str, &NamespaceObjects)> {
        self.spaces.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The objects of one namespace, if it holds any.
    pub fn space(&self, namespace: &str) -> Option<&NamespaceObjects> {
        self.spaces.get(namespace)
    }
}
