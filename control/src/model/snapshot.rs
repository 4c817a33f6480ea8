//! Immutable snapshots of the translated mesh, published by the model's
//! writer task and read by every xDS stream.
//!
//! A snapshot holds each xDS resource already encoded as a protobuf `Any` (envoy-types' own type, so it goes
//! into responses without conversion)
//! together with a content version, so an xDS stream never encodes anything:
//! it compares versions and forwards `Arc`s.

use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;
use prost::Message;

use super::ConfigError;

/// One encoded xDS resource.
#[derive(Debug, Clone, PartialEq)]
pub struct XdsResource {
    /// Primary name: workload uid, `namespace/hostname` for services,
    /// `namespace/name` for authorizations.
    pub name: String,
    /// Alternative names a client may subscribe by (`network/ip`).
    pub aliases: Vec<String>,
    /// Content version: a hash of the encoded bytes.
    pub version: String,
    /// The encoded message.
    pub body: Any,
}

impl XdsResource {
    /// Encodes `msg` under `type_url`.
    pub fn new<M: Message>(type_url: &str, name: String, aliases: Vec<String>, msg: &M) -> Self {
        let value = msg.encode_to_vec();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        value.hash(&mut h);
        Self {
            name,
            aliases,
            version: format!("{:016x}", h.finish()),
            body: Any {
                type_url: type_url.to_string(),
                value,
            },
        }
    }
}

/// All resources of one xDS type, by primary name, with an alias index.
#[derive(Debug, Default, Clone)]
pub struct ResourceSet {
    pub by_name: HashMap<String, Arc<XdsResource>>,
    /// alias (`network/ip`) -> primary name.
    pub aliases: HashMap<String, String>,
}

/// What changed in one resource set between two consecutive snapshots.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ResourceDelta {
    /// Added or modified primary names.
    pub changed: BTreeSet<String>,
    /// Primary names that no longer exist.
    pub removed: BTreeSet<String>,
}

impl ResourceDelta {
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty() && self.removed.is_empty()
    }
}

impl ResourceSet {
    /// Builds a set from freshly translated resources, reusing the `Arc`s of
    /// `prev` for resources whose content did not change, and returns the
    /// delta against `prev`.
    pub fn build(prev: &ResourceSet, items: Vec<XdsResource>) -> (ResourceSet, ResourceDelta) {
        let mut next = ResourceSet {
            by_name: HashMap::with_capacity(items.len()),
            aliases: HashMap::new(),
        };
        let mut delta = ResourceDelta::default();
        for item in items {
            for a in &item.aliases {
                next.aliases.insert(a.clone(), item.name.clone());
            }
            let arc = match prev.by_name.get(&item.name) {
                Some(old) if old.version == item.version && old.aliases == item.aliases => {
                    old.clone()
                }
                _ => {
                    delta.changed.insert(item.name.clone());
                    Arc::new(item)
                }
            };
            next.by_name.insert(arc.name.clone(), arc);
        }
        for name in prev.by_name.keys() {
            if !next.by_name.contains_key(name) {
                delta.removed.insert(name.clone());
            }
        }
        (next, delta)
    }

    /// Resolves a subscribed name (primary or alias) to its primary name.
    pub fn resolve<'a>(&'a self, name: &'a str) -> Option<&'a str> {
        if self.by_name.contains_key(name) {
            Some(name)
        } else {
            self.aliases.get(name).map(String::as_str)
        }
    }
}

/// One published state of the mesh.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Increases by one with every publication.
    pub seq: u64,
    /// `istio.workload.Address` resources (workloads and services).
    pub addresses: ResourceSet,
    /// `istio.security.Authorization` resources.
    pub authorizations: ResourceSet,
    /// Changes against the snapshot with `seq - 1`.
    pub address_delta: ResourceDelta,
    pub authorization_delta: ResourceDelta,
    /// True once every configured source has delivered its initial state.
    pub synced: bool,
    /// Documents currently rejected, for `/debug/config_errors`.
    pub errors: Arc<Vec<ConfigError>>,
    /// Time spent translating and encoding this snapshot.
    pub build_time: std::time::Duration,
}
