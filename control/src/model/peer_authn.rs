//! PeerAuthentication -> `istio.security.Authorization`, the way Istio
//! carries mTLS modes to ztunnel.
//!
//! ztunnel has no notion of an mTLS mode: the control plane resolves the
//! effective mode of every workload and expresses "STRICT" as a DENY of the
//! connections without a peer identity (`not_principals: [presence]`).
//!
//! * Precedence: a workload-selector PeerAuthentication of the workload's
//!   namespace, then the namespace's selector-less one, then the mesh-wide
//!   one (selector-less, in a root namespace); `UNSET` inherits from the next
//!   level, the default is PERMISSIVE. DISABLE acts as PERMISSIVE (ztunnel
//!   accepts plaintext inbound). When several policies compete at one level
//!   the first by name wins (Istio picks the oldest; the store has no
//!   creation times). Root-namespace selector policies are ignored, as in
//!   Istio's ambient mode.
//! * `portLevelMtls` (only on selector policies) overrides the mode per
//!   destination port; an `UNSET` port inherits the workload's mode.
//! * Effective STRICT with no exception: the workload names the shared
//!   `istio-system/istio_converted_static_strict` policy. With exceptions, or
//!   PERMISSIVE with STRICT ports, it names the selector policy's converted
//!   policy `<ns>/converted_peer_authentication_<name>` whose DENY match is
//!   limited with `destination_ports` / `not_destination_ports`.
//! * Every converted policy has scope WORKLOAD_SELECTOR and is attached by
//!   name: ztunnel denies on ANY matching DENY, so a GLOBAL or NAMESPACE
//!   strict policy could not be overridden by a more specific PERMISSIVE one
//!   (Istio attaches its static strict policy per workload for this reason).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ambit_proto::AUTHORIZATION_TYPE_URL;
use ambit_proto::security::{
    Action, Authorization, Clause, Match, Rule, Scope, StringMatch, string_match::MatchType,
};

use super::index::{ROOT_NAMESPACES, WorkloadDraft};
use super::snapshot::XdsResource;
use super::store::Store;
use ambit_config::objects::{Labels, MtlsMode, PeerAuthentication, selector_matches};

/// Name of the shared STRICT policy (Istio's).
pub const STATIC_STRICT_NAME: &str = "istio_converted_static_strict";
/// Namespace the shared STRICT policy is published in.
pub const STATIC_STRICT_NAMESPACE: &str = ROOT_NAMESPACES[0];
/// Prefix of per-PeerAuthentication converted policies (Istio's).
pub const CONVERTED_PREFIX: &str = "converted_peer_authentication_";

/// The two modes ztunnel can tell apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effective {
    Strict,
    Permissive,
}

/// `None` for UNSET (inherit).
fn effective(mode: MtlsMode) -> Option<Effective> {
    match mode {
        MtlsMode::Unset => None,
        MtlsMode::Strict => Some(Effective::Strict),
        MtlsMode::Permissive | MtlsMode::Disable => Some(Effective::Permissive),
    }
}

fn top_mode(pa: &PeerAuthentication) -> Option<Effective> {
    pa.spec.mtls.as_ref().and_then(|m| effective(m.mode))
}

/// Non-empty `matchLabels` (an empty selector selects the whole namespace).
fn selector(pa: &PeerAuthentication) -> Option<&Labels> {
    pa.spec
        .selector
        .as_ref()
        .map(|s| &s.match_labels)
        .filter(|m| !m.is_empty())
}

/// The selector-less policy of a namespace (first by name), if any.
fn namespace_wide(pas: &BTreeMap<String, PeerAuthentication>) -> Option<&PeerAuthentication> {
    pas.values().find(|p| selector(p).is_none())
}

/// What one selector policy makes of the workloads it wins for.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Nothing to enforce (PERMISSIVE everywhere).
    None,
    /// STRICT on every port: the shared static policy.
    StaticStrict,
    /// A converted policy with port limits.
    Converted(Authorization),
}

/// Resolves a workload's mode from its selector policy (if any) over the
/// inherited mode `parent`.
pub fn resolve(ns: &str, pa: Option<&PeerAuthentication>, parent: Effective) -> Outcome {
    let Some(pa) = pa else {
        return match parent {
            Effective::Strict => Outcome::StaticStrict,
            Effective::Permissive => Outcome::None,
        };
    };
    let default = top_mode(pa).unwrap_or(parent);
    let mut differing = BTreeSet::new();
    for (port, m) in &pa.spec.port_level_mtls {
        let mode = effective(m.mode).unwrap_or(default);
        if mode != default {
            differing.insert(u32::from(*port));
        }
    }
    let ports: Vec<u32> = differing.into_iter().collect();
    let base = Match {
        not_principals: vec![StringMatch {
            match_type: Some(MatchType::Presence(())),
        }],
        ..Default::default()
    };
    let m = match (default, ports.is_empty()) {
        (Effective::Strict, true) => return Outcome::StaticStrict,
        (Effective::Permissive, true) => return Outcome::None,
        // STRICT except the PERMISSIVE ports.
        (Effective::Strict, false) => Match {
            not_destination_ports: ports,
            ..base
        },
        // PERMISSIVE except the STRICT ports.
        (Effective::Permissive, false) => Match {
            destination_ports: ports,
            ..base
        },
    };
    Outcome::Converted(deny_policy(
        format!("{CONVERTED_PREFIX}{}", pa.metadata.name),
        ns.to_string(),
        m,
    ))
}

fn deny_policy(name: String, namespace: String, m: Match) -> Authorization {
    Authorization {
        name,
        namespace,
        scope: Scope::WorkloadSelector as i32,
        action: Action::Deny as i32,
        rules: vec![Rule {
            clauses: vec![Clause { matches: vec![m] }],
        }],
    }
}

/// The shared STRICT policy: deny every connection without a peer identity.
pub fn static_strict() -> Authorization {
    deny_policy(
        STATIC_STRICT_NAME.to_string(),
        STATIC_STRICT_NAMESPACE.to_string(),
        Match {
            not_principals: vec![StringMatch {
                match_type: Some(MatchType::Presence(())),
            }],
            ..Default::default()
        },
    )
}

/// The mesh-wide mode: the selector-less policy of the first root namespace
/// that has one setting a mode (none: PERMISSIVE), with that policy.
fn mesh_policy(store: &Store) -> Option<(Effective, &'static str, &PeerAuthentication)> {
    ROOT_NAMESPACES.iter().find_map(|root| {
        let (_, objs) = store.spaces().find(|(ns, _)| ns == root)?;
        let pa = namespace_wide(&objs.peer_authentications)?;
        Some((top_mode(pa)?, *root, pa))
    })
}

/// Which PeerAuthentication decided a mode, at which level.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecidedBy {
    /// A selector policy of the workload's namespace (`namespace/name`).
    Workload(String),
    /// The namespace's selector-less policy.
    Namespace(String),
    /// The selector-less policy of a root namespace.
    Mesh(String),
    /// No policy sets a mode: PERMISSIVE.
    Default,
}

/// The effective mode of one workload, as [`apply`] resolves it, and the
/// policy that decided it — for `ambitctl authn tls-check`.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The mode of every port without a port-level override, as written
    /// (`Unset` when no level sets one: PERMISSIVE). DISABLE acts as
    /// PERMISSIVE in ambient mode.
    pub mode: MtlsMode,
    pub effective: Effective,
    pub decided_by: DecidedBy,
    /// `portLevelMtls` of the workload's selector policy: port, mode as
    /// written, effective mode.
    pub ports: Vec<(u16, MtlsMode, Effective)>,
}

/// Resolves the mode of a workload with `labels` in namespace `ns` with
/// the precedence [`apply`] uses: the first (by name) selector policy of
/// the namespace that selects it, then the namespace's selector-less one,
/// then the mesh-wide one; UNSET inherits.
pub fn decide(store: &Store, ns: &str, labels: &Labels) -> Decision {
    let declared =
        |pa: &PeerAuthentication| pa.spec.mtls.as_ref().map_or(MtlsMode::Unset, |m| m.mode);
    let (mut mode, mut eff, mut decided_by) = match mesh_policy(store) {
        Some((m, root, pa)) => (
            declared(pa),
            m,
            DecidedBy::Mesh(format!("{root}/{}", pa.metadata.name)),
        ),
        None => (MtlsMode::Unset, Effective::Permissive, DecidedBy::Default),
    };
    let pas = store
        .spaces()
        .find(|(n, _)| *n == ns)
        .map(|(_, objs)| &objs.peer_authentications);
    let Some(pas) = pas else {
        return Decision {
            mode,
            effective: eff,
            decided_by,
            ports: Vec::new(),
        };
    };
    if let Some(pa) = namespace_wide(pas)
        && let Some(m) = top_mode(pa)
    {
        (mode, eff) = (declared(pa), m);
        decided_by = DecidedBy::Namespace(format!("{ns}/{}", pa.metadata.name));
    }
    let winner = (!ROOT_NAMESPACES.contains(&ns))
        .then(|| {
            pas.values()
                .find(|p| selector(p).is_some_and(|sel| selector_matches(sel, labels)))
        })
        .flatten();
    let Some(pa) = winner else {
        return Decision {
            mode,
            effective: eff,
            decided_by,
            ports: Vec::new(),
        };
    };
    if let Some(m) = top_mode(pa) {
        (mode, eff) = (declared(pa), m);
        decided_by = DecidedBy::Workload(format!("{ns}/{}", pa.metadata.name));
    }
    let ports = pa
        .spec
        .port_level_mtls
        .iter()
        .map(|(port, m)| (*port, m.mode, effective(m.mode).unwrap_or(eff)))
        .collect();
    Decision {
        mode,
        effective: eff,
        decided_by,
        ports,
    }
}

/// Per-namespace view: inherited mode and the selector policies.
struct NsPolicies<'a> {
    parent: Effective,
    selectors: Vec<(&'a str, &'a Labels, &'a PeerAuthentication)>,
}

/// Resolves every workload's effective mode, names the converted policies in
/// their `authorization_policies` and appends the policies used to `out`.
pub(crate) fn apply(store: &Store, wls: &mut [WorkloadDraft<'_>], out: &mut Vec<XdsResource>) {
    let mesh = mesh_policy(store).map_or(Effective::Permissive, |(m, _, _)| m);
    let mut by_ns: HashMap<&str, NsPolicies<'_>> = HashMap::new();
    let mut any = false;
    for (ns, objs) in store.spaces() {
        let pas = &objs.peer_authentications;
        if pas.is_empty() {
            continue;
        }
        any = true;
        let parent = namespace_wide(pas).and_then(top_mode).unwrap_or(mesh);
        let selectors = if ROOT_NAMESPACES.contains(&ns) {
            Vec::new()
        } else {
            pas.iter()
                .filter_map(|(n, p)| selector(p).map(|l| (n.as_str(), l, p)))
                .collect()
        };
        by_ns.insert(ns, NsPolicies { parent, selectors });
    }
    if !any {
        return;
    }
    let static_key = format!("{STATIC_STRICT_NAMESPACE}/{STATIC_STRICT_NAME}");
    let mut static_used = false;
    // Outcomes of selector policies by converted key, resolved once each
    // (all workloads a policy wins for share the namespace, so the result).
    let mut by_selector: BTreeMap<String, Outcome> = BTreeMap::new();
    for wl in wls.iter_mut() {
        let ns = wl.w.namespace.as_str();
        let (parent, winner) = match by_ns.get(ns) {
            Some(p) => {
                let winner = wl.selectable.and_then(|view| {
                    p.selectors
                        .iter()
                        .find(|(_, sel, _)| view.matches(sel))
                        .map(|(n, _, pa)| (*n, *pa))
                });
                (p.parent, winner)
            }
            None => (mesh, None),
        };
        let (key, outcome) = match winner {
            None => (None, resolve(ns, None, parent)),
            Some((name, pa)) => {
                let key = format!("{ns}/{CONVERTED_PREFIX}{name}");
                let o = by_selector
                    .entry(key.clone())
                    .or_insert_with(|| resolve(ns, Some(pa), parent));
                (Some(key), o.clone())
            }
        };
        match (outcome, key) {
            (Outcome::None, _) => {}
            (Outcome::StaticStrict, _) => {
                static_used = true;
                wl.w.authorization_policies.push(static_key.clone());
            }
            (Outcome::Converted(_), Some(key)) => wl.w.authorization_policies.push(key),
            (Outcome::Converted(a), None) => {
                let key = format!("{}/{}", a.namespace, a.name);
                wl.w.authorization_policies.push(key);
            }
        }
    }
    if static_used {
        out.push(XdsResource::new(
            AUTHORIZATION_TYPE_URL,
            static_key,
            Vec::new(),
            &static_strict(),
        ));
    }
    for (key, outcome) in by_selector {
        if let Outcome::Converted(auth) = outcome {
            out.push(XdsResource::new(
                AUTHORIZATION_TYPE_URL,
                key,
                Vec::new(),
                &auth,
            ));
        }
    }
}
