//! Snapshot assembly, on top of every translator: the store is translated
//! one namespace at a time (workloads and services, then authorization
//! policies on the same label index), mesh-wide policies are applied, the
//! workload drafts encoded, and the resource families become a [`Snapshot`]
//! that shares every unchanged resource with the previous one.

use std::sync::Arc;
use std::time::Instant;

use super::index::LABEL_GATEWAY_NAME;
use super::index::{WorkloadDraft, waypoint_scopes};
use super::sidecar;
use super::snapshot::{ResourceFamily, Snapshot, XdsResource};
use super::store::{NamespaceObjects, Store};
use super::waypoint::{self, WaypointPlan};
use super::workloads::NsCx;
use super::{ConfigError, ModelOptions};
use super::{authz, encode, peer_authn};
use ambit_config::objects::{Labels, Service, ServicePort};
use std::collections::BTreeMap;

/// Translated, encoded resources.
#[derive(Debug, Default)]
pub struct Translated {
    pub addresses: Vec<XdsResource>,
    pub authorizations: Vec<XdsResource>,
    /// What each waypoint serves (its Envoy resources are built from it).
    pub waypoints: Vec<WaypointPlan>,
    /// What each namespace's sidecars reach (outbound, shared).
    pub sidecar_namespaces: Vec<sidecar::NamespacePlan>,
    /// What each sidecar pod accepts (inbound).
    pub sidecar_pods: Vec<sidecar::PodPlan>,
}

/// Translates the whole store.
pub fn translate(store: &Store, opts: &ModelOptions) -> Translated {
    let mut wls: Vec<WorkloadDraft> = Vec::new();
    let mut out = Translated::default();
    let mut root_policies = Vec::new();
    let mut keys: Vec<String> = Vec::new();
    let with_waypoint_services = waypoint_services(store);
    let waypoints = waypoint_scopes(store);
    for (ns, objs) in store.spaces() {
        let ns_labels = store.namespace_labels(ns);
        let objs = with_waypoint_services.get(ns).unwrap_or(objs);
        let cx = NsCx::new(ns, ns_labels, objs, opts, &waypoints);
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
    (out.sidecar_namespaces, out.sidecar_pods) = sidecar::plan(store, &wls, &keys, opts);
    out.addresses.reserve(wls.len());
    for wl in wls {
        out.addresses.push(encode::workload_resource(wl, &keys));
    }
    out
}

/// The namespaces where a waypoint Gateway has no Service of its name, with
/// one added: headless, selecting the Gateway's pods, port 15008 — so
/// ztunnels find the waypoint by its hostname (`<gateway>.<ns>.svc...`)
/// however its pods were started (Kubernetes creates such a Service with
/// the waypoint's Deployment; local mode and bare configs may not).
fn waypoint_services(store: &Store) -> BTreeMap<String, NamespaceObjects> {
    let mut out = BTreeMap::new();
    for (ns, objs) in store.spaces() {
        let missing: Vec<&String> = objs
            .gateways
            .iter()
            .filter(|(name, gw)| gw.is_waypoint() && !objs.services.contains_key(*name))
            .map(|(name, _)| name)
            .collect();
        if missing.is_empty() {
            continue;
        }
        let mut with = objs.clone();
        for name in missing {
            with.services
                .insert(name.clone(), waypoint_service(ns, name));
        }
        out.insert(ns.to_string(), with);
    }
    out
}

fn waypoint_service(ns: &str, name: &str) -> Service {
    let mut svc = Service::default();
    svc.metadata.name = name.to_string();
    svc.metadata.namespace = ns.to_string();
    svc.metadata
        .labels
        .insert(LABEL_GATEWAY_NAME.to_string(), name.to_string());
    svc.spec.cluster_ip = "None".to_string();
    svc.spec.selector = Some(Labels::from([(
        LABEL_GATEWAY_NAME.to_string(),
        name.to_string(),
    )]));
    svc.spec.ports = vec![ServicePort {
        name: "mesh".to_string(),
        port: waypoint::HBONE_PORT,
        app_protocol: Some("all".to_string()),
        ..Default::default()
    }];
    svc
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
    for plan in &out.sidecar_namespaces {
        families.extend(sidecar::namespace_families(plan));
    }
    for plan in &out.sidecar_pods {
        families.extend(sidecar::pod_families(plan, &opts.trust_domain));
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
            .chain(
                out.sidecar_namespaces
                    .iter()
                    .flat_map(|p| &p.findings)
                    // The waypoints may have reported the same mistake.
                    .filter(|f| !out.waypoints.iter().any(|w| w.findings.contains(f))),
            )
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
