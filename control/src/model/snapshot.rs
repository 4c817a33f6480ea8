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

/// Which proxies a resource set is for. [`MESH_SCOPE`] holds what every
/// proxy of a kind shares (the workload API every ztunnel reads); other
/// scopes name one consumer's own set (a waypoint, later a sidecar scope),
/// so per-proxy resources are computed once by the model, not per stream.
pub const MESH_SCOPE: &str = "";

/// All resources of one type in one scope, with the exact changes against
/// the same scope and type in the previous snapshot.
#[derive(Debug, Clone, Default)]
pub struct TypedSet {
    pub resources: Arc<ResourceSet>,
    /// Changes against the snapshot with `seq - 1` (everything is "changed"
    /// when the set did not exist there).
    pub delta: Arc<ResourceDelta>,
}

/// One family of translated resources: a type URL in a scope.
#[derive(Debug)]
pub struct ResourceFamily {
    pub scope: String,
    pub type_url: &'static str,
    pub resources: Vec<XdsResource>,
}

impl ResourceFamily {
    /// A mesh-wide family.
    pub fn mesh(type_url: &'static str, resources: Vec<XdsResource>) -> Self {
        Self {
            scope: MESH_SCOPE.to_string(),
            type_url,
            resources,
        }
    }
}

/// One published state of the mesh.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Increases by one with every publication.
    pub seq: u64,
    /// Every resource set, by scope, then by type URL.
    pub sets: HashMap<String, HashMap<&'static str, TypedSet>>,
    /// True once every configured source has delivered its initial state.
    pub synced: bool,
    /// Documents currently rejected, for `/debug/config_errors`.
    pub errors: Arc<Vec<ConfigError>>,
    /// Time spent translating and encoding this snapshot.
    pub build_time: std::time::Duration,
}

static EMPTY_SET: std::sync::LazyLock<Arc<ResourceSet>> =
    std::sync::LazyLock::new(|| Arc::new(ResourceSet::default()));

/// A shared empty set (for scopes and types with nothing in them).
pub fn empty_set() -> Arc<ResourceSet> {
    EMPTY_SET.clone()
}

impl Snapshot {
    /// The set of `type_url` in `scope`, when it exists.
    pub fn set(&self, scope: &str, type_url: &str) -> Option<&TypedSet> {
        self.sets.get(scope)?.get(type_url)
    }

    /// The snapshot after `prev` holding `families` (no errors, `synced`
    /// carried over): how tests and tools build snapshots by hand.
    pub fn following(prev: &Snapshot, families: Vec<ResourceFamily>) -> Snapshot {
        Snapshot {
            seq: prev.seq + 1,
            sets: Snapshot::build_sets(prev, families),
            synced: prev.synced,
            errors: prev.errors.clone(),
            build_time: std::time::Duration::ZERO,
        }
    }

    /// The mesh-wide changes of `type_url` against `seq - 1`.
    pub fn mesh_delta(&self, type_url: &str) -> &ResourceDelta {
        static EMPTY: std::sync::LazyLock<ResourceDelta> =
            std::sync::LazyLock::new(ResourceDelta::default);
        match self.set(MESH_SCOPE, type_url) {
            Some(t) => &t.delta,
            None => &EMPTY,
        }
    }

    /// The mesh-wide resources of `type_url` (empty when there are none).
    pub fn mesh(&self, type_url: &str) -> &ResourceSet {
        match self.set(MESH_SCOPE, type_url) {
            Some(t) => &t.resources,
            None => &EMPTY_SET,
        }
    }

    /// Builds the sets of a new snapshot from translated families, reusing
    /// `prev`'s `Arc`s for every unchanged resource and unchanged set.
    pub fn build_sets(
        prev: &Snapshot,
        families: Vec<ResourceFamily>,
    ) -> HashMap<String, HashMap<&'static str, TypedSet>> {
        let mut sets: HashMap<String, HashMap<&'static str, TypedSet>> = HashMap::new();
        for f in families {
            let old = prev.set(&f.scope, f.type_url);
            let empty = ResourceSet::default();
            let old_set = old.map_or(&empty, |t| &*t.resources);
            let (set, delta) = ResourceSet::build(old_set, f.resources);
            let typed = match old {
                Some(o) if delta.is_empty() => TypedSet {
                    resources: o.resources.clone(),
                    delta: Arc::new(ResourceDelta::default()),
                },
                _ => TypedSet {
                    resources: Arc::new(set),
                    delta: Arc::new(delta),
                },
            };
            sets.entry(f.scope).or_default().insert(f.type_url, typed);
        }
        sets
    }

    /// Whether any resource changed against `prev`, or a set appeared or
    /// vanished (a waypoint added or removed).
    pub fn sets_differ(&self, prev: &Snapshot) -> bool {
        let keys = |s: &Snapshot| -> BTreeSet<(String, &'static str)> {
            s.sets
                .iter()
                .flat_map(|(scope, types)| types.keys().map(move |t| (scope.clone(), *t)))
                .collect()
        };
        self.change_count() != (0, 0) || keys(self) != keys(prev)
    }

    /// Resources per type (short name, see [`type_short_name`]) over every
    /// scope, for metrics and `/debug/push_status`.
    pub fn counts_by_type(&self) -> std::collections::BTreeMap<String, usize> {
        let mut out = std::collections::BTreeMap::new();
        for types in self.sets.values() {
            for (t, set) in types {
                *out.entry(type_short_name(t)).or_default() += set.resources.by_name.len();
            }
        }
        out
    }

    /// Resources held over every set (for logs and metrics).
    pub fn resource_count(&self) -> usize {
        self.sets
            .values()
            .flat_map(|s| s.values())
            .map(|t| t.resources.by_name.len())
            .sum()
    }

    /// (changed, removed) resource names over every set against `seq - 1`.
    pub fn change_count(&self) -> (usize, usize) {
        self.sets
            .values()
            .flat_map(|s| s.values())
            .fold((0, 0), |(c, r), t| {
                (c + t.delta.changed.len(), r + t.delta.removed.len())
            })
    }
}

/// The short, lower-case name of a type URL: its message name
/// (`type.googleapis.com/istio.workload.Address` → `address`,
/// `…envoy.config.cluster.v3.Cluster` → `cluster`).
pub fn type_short_name(type_url: &str) -> String {
    type_url
        .rsplit(['.', '/'])
        .next()
        .unwrap_or(type_url)
        .to_ascii_lowercase()
}
