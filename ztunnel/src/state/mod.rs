//! The ztunnel's view of the mesh: workloads, services, endpoints and
//! authorization policies, indexed for the data path.
//!
//! One writer (the xDS task) owns a [`StateWriter`]; it builds the next
//! [`StateSnapshot`] from the current one and publishes it with
//! [`StateWriter::publish`]. Readers hold a [`StateReader`] and get an
//! immutable `Arc<StateSnapshot>` without ever blocking. Every index is a
//! [`ShardedMap`] (copy-on-write shards behind `Arc`s) and every value is an
//! `Arc`, so building the next snapshot copies only the shards a response
//! actually touched, and a copied shard copies pointers, not workloads: a
//! one-workload change costs microseconds however large the mesh.

mod index;
mod sharded;
mod types;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::sync::watch;

pub use self::sharded::ShardedMap;
pub use self::types::{
    Address, Authorization, GatewayAddress, GatewayDestination, HealthStatus, IpNet, Locality,
    NetworkAddress, PortMapping, RbacMatch, Service, StringMatch, TunnelProtocol, Workload,
};

/// Errors of this module: an xDS resource that cannot be turned into state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// An address field is not an IPv4 or IPv6 address.
    #[error(
        "{what} is {len} bytes long, expected 4 (IPv4) or 16 (IPv6); the control plane sent a malformed address"
    )]
    InvalidIp {
        /// Which field.
        what: String,
        /// Its length.
        len: usize,
    },
    /// A port is out of range.
    #[error("{what} {port} is out of range 1-65535; fix the port in the Service or workload spec")]
    InvalidPort {
        /// Which field.
        what: String,
        /// The value received.
        port: u32,
    },
    /// A field every resource of this kind must carry is empty.
    #[error("{kind} has an empty {field}; the control plane must set it")]
    MissingField {
        /// Kind of message.
        kind: &'static str,
        /// The empty field.
        field: &'static str,
    },
    /// An `istio.workload.Address` carries neither a workload nor a service.
    #[error("address resource carries neither a workload nor a service")]
    EmptyAddress,
    /// An enum value this ztunnel does not know.
    #[error(
        "unknown {field} value {value}; is the control plane newer than this ztunnel? upgrade ztunnel"
    )]
    UnknownEnum {
        /// The field.
        field: &'static str,
        /// The value received.
        value: i32,
    },
    /// A CIDR whose prefix is longer than its address.
    #[error(
        "CIDR {ip}/{len} has a prefix longer than the address; fix the ipBlocks in the AuthorizationPolicy"
    )]
    InvalidPrefix {
        /// The address.
        ip: IpAddr,
        /// The prefix length received.
        len: u32,
    },
    /// A workload's service key is not `namespace/hostname`.
    #[error("workload names service {0:?}, expected \"namespace/hostname\"")]
    InvalidServiceKey(String),
}

/// The xDS resource types the state holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResourceType {
    /// `istio.workload.Address` (workloads and services).
    Address,
    /// `istio.security.Authorization`.
    Authorization,
}

impl ResourceType {
    /// Every type, in subscription order.
    pub const ALL: [ResourceType; 2] = [ResourceType::Address, ResourceType::Authorization];

    /// The xDS type URL.
    pub fn type_url(self) -> &'static str {
        match self {
            ResourceType::Address => ambit_proto::ADDRESS_TYPE_URL,
            ResourceType::Authorization => ambit_proto::AUTHORIZATION_TYPE_URL,
        }
    }

    /// The type for `type_url`, if it is one of ours.
    pub fn from_type_url(type_url: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.type_url() == type_url)
    }
}

/// Which index entry an xDS resource name stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResourceKey {
    /// A workload, by uid.
    Workload(Arc<str>),
    /// A service, by `namespace/hostname`.
    Service(Arc<str>),
    /// An authorization policy, by `namespace/name`.
    Authorization(Arc<str>),
}

/// What the state remembers about one xDS resource it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XdsEntry {
    /// The version the server gave it (shared, so copying a shard of the
    /// resource index allocates nothing per entry).
    pub version: Arc<str>,
    /// What it became in the indexes.
    pub key: ResourceKey,
}

/// One workload behind a service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// The workload.
    pub workload_uid: Arc<str>,
    /// The service, `namespace/hostname`.
    pub service: Arc<str>,
    /// Port overrides the workload declares for this service.
    pub ports: Vec<PortMapping>,
}

/// Endpoints of one service, by workload uid.
pub type EndpointSet = HashMap<Arc<str>, Endpoint>;

/// An immutable view of the mesh at one point in time.
#[derive(Clone, Debug, Default)]
pub struct StateSnapshot {
    generation: u64,
    workloads: ShardedMap<Arc<str>, Arc<Workload>>,
    workloads_by_addr: ShardedMap<NetworkAddress, Arc<Workload>>,
    services: ShardedMap<Arc<str>, Arc<Service>>,
    services_by_vip: ShardedMap<NetworkAddress, Arc<Service>>,
    /// Every service key some workload claims, including services not
    /// (yet) received, so a service arriving after its workloads — or
    /// removed and re-added — gets its endpoints at once. Lookups only
    /// show the sets of known services.
    endpoints: ShardedMap<Arc<str>, Arc<EndpointSet>>,
    policies: ShardedMap<Arc<str>, Arc<Authorization>>,
    /// xDS resource name → entry, per type.
    address_resources: ShardedMap<Arc<str>, XdsEntry>,
    authorization_resources: ShardedMap<Arc<str>, XdsEntry>,
}

impl StateSnapshot {
    /// Incremented on every publish; 0 for the empty initial state.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The workload with `ip` on `network`.
    pub fn workload_by_ip(&self, network: &str, ip: IpAddr) -> Option<Arc<Workload>> {
        self.workload_by_addr(&NetworkAddress::new(network, ip))
    }

    /// The workload at `addr`; the allocation-free form of
    /// [`Self::workload_by_ip`] for callers that keep the network as `Arc<str>`.
    pub fn workload_by_addr(&self, addr: &NetworkAddress) -> Option<Arc<Workload>> {
        self.workloads_by_addr.get(addr).cloned()
    }

    /// The workload with `uid`.
    pub fn workload_by_uid(&self, uid: &str) -> Option<Arc<Workload>> {
        self.workloads.get(uid).cloned()
    }

    /// The service with virtual IP `ip` on `network`.
    pub fn service_by_vip(&self, network: &str, ip: IpAddr) -> Option<Arc<Service>> {
        self.services_by_vip
            .get(&NetworkAddress::new(network, ip))
            .cloned()
    }

    /// The service `namespace/hostname`.
    pub fn service_by_hostname(&self, key: &str) -> Option<Arc<Service>> {
        self.services.get(key).cloned()
    }

    /// Endpoints of the service `namespace/hostname`; `None` when the
    /// service is unknown or has no endpoints.
    pub fn endpoints(&self, service_key: &str) -> Option<Arc<EndpointSet>> {
        if !self.services.contains_key(service_key) {
            return None;
        }
        self.endpoints.get(service_key).cloned()
    }

    /// Like [`Self::endpoints`], borrowing from the snapshot.
    pub fn endpoint_set(&self, service_key: &str) -> Option<&EndpointSet> {
        if !self.services.contains_key(service_key) {
            return None;
        }
        self.endpoints.get(service_key).map(|s| &**s)
    }

    /// The authorization policy `namespace/name`.
    pub fn authorization(&self, key: &str) -> Option<Arc<Authorization>> {
        self.policies.get(key).cloned()
    }

    /// Every workload, in no particular order.
    pub fn workloads(&self) -> impl Iterator<Item = &Arc<Workload>> {
        self.workloads.values()
    }

    /// Every service, in no particular order.
    pub fn services(&self) -> impl Iterator<Item = &Arc<Service>> {
        self.services.values()
    }

    /// Every authorization policy, in no particular order.
    pub fn authorizations(&self) -> impl Iterator<Item = &Arc<Authorization>> {
        self.policies.values()
    }

    /// Number of workloads.
    pub fn workload_count(&self) -> usize {
        self.workloads.len()
    }

    /// Number of services.
    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    /// Number of authorization policies.
    pub fn authorization_count(&self) -> usize {
        self.policies.len()
    }

    /// xDS resource name → entry of every resource held of type `ty`.
    pub fn xds_resources(&self, ty: ResourceType) -> &ShardedMap<Arc<str>, XdsEntry> {
        match ty {
            ResourceType::Address => &self.address_resources,
            ResourceType::Authorization => &self.authorization_resources,
        }
    }

    /// xDS resource name → version for type `ty`: what a reconnecting
    /// client sends as `initial_resource_versions`.
    pub fn resource_versions(&self, ty: ResourceType) -> HashMap<String, String> {
        let resources = self.xds_resources(ty);
        let mut versions = HashMap::with_capacity(resources.len());
        versions.extend(
            resources
                .iter()
                .map(|(name, e)| (name.to_string(), e.version.to_string())),
        );
        versions
    }
}

/// The publishing side; owned by the one task that changes the state.
#[derive(Debug)]
pub struct StateWriter {
    current: Arc<StateSnapshot>,
    shared: Arc<ArcSwap<StateSnapshot>>,
    generation: watch::Sender<u64>,
}

/// The reading side; cheap to clone, never blocks.
#[derive(Debug, Clone)]
pub struct StateReader {
    shared: Arc<ArcSwap<StateSnapshot>>,
    generation: watch::Receiver<u64>,
}

/// An empty state: its writer and a first reader.
pub fn new_state() -> (StateWriter, StateReader) {
    let current = Arc::new(StateSnapshot::default());
    let shared = Arc::new(ArcSwap::new(current.clone()));
    let (tx, rx) = watch::channel(0);
    (
        StateWriter {
            current,
            shared: shared.clone(),
            generation: tx,
        },
        StateReader {
            shared,
            generation: rx,
        },
    )
}

impl StateWriter {
    /// The last published snapshot.
    pub fn current(&self) -> &Arc<StateSnapshot> {
        &self.current
    }

    /// A mutable copy of the last published snapshot, to change and then
    /// [`publish`](Self::publish). Cheap: it copies one pointer per index.
    pub fn begin(&self) -> StateSnapshot {
        StateSnapshot::clone(&self.current)
    }

    /// Publishes `next` with the next generation number and wakes watchers.
    pub fn publish(&mut self, mut next: StateSnapshot) -> Arc<StateSnapshot> {
        next.generation = self.current.generation + 1;
        let next = Arc::new(next);
        self.shared.store(next.clone());
        self.current = next.clone();
        self.generation.send_replace(self.current.generation);
        next
    }

    /// A reader of this state.
    pub fn reader(&self) -> StateReader {
        StateReader {
            shared: self.shared.clone(),
            generation: self.generation.subscribe(),
        }
    }
}

impl StateReader {
    /// The current snapshot.
    pub fn load(&self) -> Arc<StateSnapshot> {
        self.shared.load_full()
    }

    /// A watch of the published generation, to await progress.
    pub fn generation(&self) -> watch::Receiver<u64> {
        self.generation.clone()
    }

    /// Waits until a snapshot satisfying `pred` is published and returns it
    /// (returns at once if the current one does). Returns `None` if the
    /// writer is gone and the last snapshot does not satisfy `pred`.
    pub async fn wait_for(
        &self,
        mut pred: impl FnMut(&StateSnapshot) -> bool,
    ) -> Option<Arc<StateSnapshot>> {
        let mut rx = self.generation.clone();
        loop {
            rx.borrow_and_update();
            let snap = self.load();
            if pred(&snap) {
                return Some(snap);
            }
            if rx.changed().await.is_err() {
                let snap = self.load();
                return pred(&snap).then_some(snap);
            }
        }
    }
}
