//! Snapshot assembly, on top of every translator: the store is translated
//! one namespace at a time (workloads and services, then authorization
//! policies on the same label index), mesh-wide policies are applied, the
//! workload drafts encoded, and the resource families become a [`Snapshot`]
//! that shares every unchanged resource with the previous one.

use std::sync::Arc;
use std::time::Instant;

use super::index::WorkloadDraft;
use super::snapshot::{ResourceFamily, Snapshot, XdsResource};
use super::store::Store;
use super::waypoint::{self, WaypointPlan};
use super::workloads::NsCx;
use super::{ConfigError, ModelOptions};
use super::{authz, encode, peer_authn};

/// Translated, encoded resources.
#[derive(Debug, Default)]
pub struct Translated {
    pub addresses: Vec<XdsResource>,
    pub authorizations: Vec<XdsResource>,
    /// What each waypoint serves (its Envoy resources are built from it).
    pub waypoints: Vec<WaypointPlan>,
}

/// Translates the whole store.
pub fn translate(store: &Store, opts: &ModelOptions) -> Translated {
    let mut wls: Vec<WorkloadDraft> = Vec::new();
    let mut out = Translated::default();
    let mut root_policies = Vec::new();
    let mut keys: Vec<String> = Vec::new();
    for (ns, objs) in store.spaces() {
        let ns_labels = store.namespace_labels(ns);
        let cx = NsCx::new(ns, ns_labels, objs, opts);
        let index = cx.translate(&mut wls, &mut keys, &mut out.addresses);
        authz::translate_namespace(
            ns,
            objs,
            &index,
            &mut wls,
            &mut out.authorizations,
            &mut root_policies,
        );
    }
    authz::apply_root_policies(&root_policies, &mut wls);
    peer_authn::apply(store, &mut wls, &mut out.authorizations);
    out.waypoints = waypoint::plan(store, &wls, &keys, opts);
    out.addresses.reserve(wls.len());
    for wl in wls {
        out.addresses.push(encode::workload_resource(wl, &keys));
    }
    out
}

/// Translates `store` into a new snapshot following `prev`: `seq` is
/// `prev.seq + 1`, unchanged resources keep `prev`'s `Arc`s, deltas are
/// against `prev`, `synced` is carried over from `prev`.
pub fn build_snapshot(store: &Store, prev: &Snapshot, opts: &ModelOptions) -> Snapshot {
    let started = Instant::now();
    let out = translate(store, opts);
    let mut families = vec![
        ResourceFamily::mesh(ambit_proto::ADDRESS_TYPE_URL, out.addresses),
        ResourceFamily::mesh(ambit_proto::AUTHORIZATION_TYPE_URL, out.authorizations),
    ];
    for plan in &out.waypoints {
        families.extend(waypoint::families(plan, &opts.trust_domain));
    }
    let sets = Snapshot::build_sets(prev, families);
    let mut errors = store.errors();
    // What translation found wrong across objects (a route to an undefined
    // subset, two VirtualServices for one host, ...): served as described,
    // and listed with the documents the sources rejected.
    errors.extend(
        out.waypoints
            .iter()
            .flat_map(|p| &p.findings)
            .map(|f| ConfigError {
                file: String::new(),
                document: 0,
                line: 0,
                kind: f.kind.clone(),
                namespace: f.namespace.clone(),
                name: f.name.clone(),
                reason: f.reason.clone(),
            }),
    );
    let errors = if *prev.errors == errors {
        prev.errors.clone()
    } else {
        Arc::new(errors)
    };
    Snapshot {
        seq: prev.seq + 1,
        sets,
        synced: prev.synced,
        errors,
        build_time: started.elapsed(),
    }
}
