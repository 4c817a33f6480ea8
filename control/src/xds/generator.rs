//! Generators: what each kind of proxy is served.
//!
//! The model publishes one [`Snapshot`] holding every resource family it
//! knows (by scope and type URL). A stream picks one [`Generator`] from the
//! kind of its proxy (see [`super::proxy`]) when the first request arrives;
//! from then on it asks the generator, per subscribed type, which set its
//! proxy is served. The Delta and SotW machinery knows nothing about types:
//! adding a type is one generator (or one more [`TypeSpec`] in an existing
//! one) and its registration in [`Generators::standard`].

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use super::proxy::{ProxyKind, ProxyNode};

use crate::model::snapshot::{ResourceDelta, ResourceSet, Snapshot, empty_set};

/// One xDS type a generator serves.
#[derive(Debug, PartialEq, Eq)]
pub struct TypeSpec {
    pub type_url: &'static str,
    /// Short name for metrics labels and logs (`address`, `cluster`, ...).
    pub label: &'static str,
    /// When resources of this type change, the resources of the same names
    /// of this (later-pushed) type are sent again even if unchanged: Envoy
    /// warms an updated cluster until it receives its endpoints anew.
    pub resend_with: Option<&'static str>,
}

/// The resources one proxy is served of one type, in one snapshot.
#[derive(Debug, Clone)]
pub struct Served {
    pub set: Arc<ResourceSet>,
    /// The exact changes against the previous snapshot (`seq - 1`), when the
    /// model computed them (shared and scoped sets); `None` makes a stream
    /// that skipped no snapshot diff the two sets instead.
    pub delta: Option<Arc<ResourceDelta>>,
}

impl Served {
    /// Nothing of this type for this proxy (yet).
    pub fn empty() -> Served {
        Served {
            set: empty_set(),
            delta: None,
        }
    }

    /// The model's set `(scope, type_url)` of `snap`, or an empty one.
    pub fn from_snapshot(snap: &Snapshot, scope: &str, type_url: &str) -> Served {
        match snap.set(scope, type_url) {
            Some(t) => Served {
                set: t.resources.clone(),
                delta: Some(t.delta.clone()),
            },
            None => Served::empty(),
        }
    }
}

impl Served {
    /// The union of sets from several scopes whose names do not overlap
    /// (one proxy served more than one scope). An empty part with nothing
    /// removed adds nothing, so when only one part has content it comes
    /// back as is (pointer-equal while unchanged); otherwise the union is
    /// a new set, with the parts' deltas joined when every part has one.
    pub fn merge(parts: Vec<Served>) -> Served {
        let quiet = |s: &Served| {
            s.set.by_name.is_empty() && s.delta.as_ref().is_some_and(|d| d.removed.is_empty())
        };
        let mut loud: Vec<Served> = parts.into_iter().filter(|p| !quiet(p)).collect();
        if loud.len() <= 1 {
            return loud.pop().unwrap_or_else(Served::empty);
        }
        let mut set = ResourceSet::default();
        let mut delta = Some(ResourceDelta::default());
        for part in &loud {
            set.by_name
                .extend(part.set.by_name.iter().map(|(k, v)| (k.clone(), v.clone())));
            set.aliases
                .extend(part.set.aliases.iter().map(|(k, v)| (k.clone(), v.clone())));
            match (&mut delta, &part.delta) {
                (Some(d), Some(p)) => {
                    d.changed.extend(p.changed.iter().cloned());
                    d.removed.extend(p.removed.iter().cloned());
                }
                _ => delta = None,
            }
        }
        if let Some(d) = &mut delta {
            // A name that moved from one part to another is not gone.
            d.removed.retain(|n| !set.by_name.contains_key(n));
        }
        Served {
            set: Arc::new(set),
            delta: delta.map(Arc::new),
        }
    }
}

/// What one kind of proxy is served.
pub trait Generator: Send + Sync + fmt::Debug {
    /// The kind of proxy this generator serves.
    fn kind(&self) -> ProxyKind;

    /// The types served, in the order pushes go out after a change (ADS
    /// ordering for Envoy: clusters, endpoints, listeners, routes).
    fn types(&self) -> &'static [TypeSpec];

    /// The resources of `type_url` (one of [`Generator::types`]) that `proxy`
    /// is served in `snap`. Unchanged sets must come back pointer-equal so
    /// streams skip them without comparing.
    fn generate(&self, proxy: &ProxyNode, snap: &Snapshot, type_url: &str) -> Served;

    /// The spec of `type_url` when this generator serves it.
    fn spec(&self, type_url: &str) -> Option<&'static TypeSpec> {
        self.types().iter().find(|t| t.type_url == type_url)
    }
}

/// The generators of one server, by proxy kind.
#[derive(Debug, Clone)]
pub struct Generators {
    by_kind: HashMap<ProxyKind, Arc<dyn Generator>>,
}

impl Generators {
    /// No generators: every request is ignored (for tests of one kind).
    pub fn empty() -> Generators {
        Generators {
            by_kind: HashMap::new(),
        }
    }

    /// Every generator this control plane has.
    pub fn standard() -> Generators {
        let mut g = Generators::empty();
        g.register(Arc::new(super::ztunnel::ZtunnelGenerator));
        g.register(Arc::new(super::waypoint::WaypointGenerator));
        g.register(Arc::new(super::sidecar::SidecarGenerator));
        g
    }

    /// Adds (or replaces) the generator of its kind.
    pub fn register(&mut self, generator: Arc<dyn Generator>) {
        self.by_kind.insert(generator.kind(), generator);
    }

    /// The generator for a proxy of `kind`, if this server serves that kind.
    pub fn for_kind(&self, kind: ProxyKind) -> Option<Arc<dyn Generator>> {
        self.by_kind.get(&kind).cloned()
    }
}
