//! ztunnel's xDS client: arbitrary Delta responses, one after another, into
//! one state (`ambit_ztunnel::xds::handle_response`: decode the `Any`
//! bodies as `istio.workload.Address` / `istio.security.Authorization`,
//! validate, apply, build the ACK/NACK).
//!
//! Input: frames (`ambit_fuzz::frames`), each a `DeltaDiscoveryResponse`.
//! Checks: no panic; the reply echoes the nonce and type; a NACK exactly
//! when something was rejected; the indexes agree with each other.
#![no_main]

use ambit_control::model::snapshot::Snapshot;
use ambit_ztunnel::StateSnapshot;
use ambit_ztunnel::xds::handle_response;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryResponse, Resource};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fn response(snap: &Snapshot, type_url: &str, nonce: &str) -> DeltaDiscoveryResponse {
    let set = snap.mesh(type_url);
    let mut names: Vec<&String> = set.by_name.keys().collect();
    names.sort();
    DeltaDiscoveryResponse {
        system_version_info: snap.seq.to_string(),
        type_url: type_url.to_string(),
        nonce: nonce.to_string(),
        resources: names
            .into_iter()
            .filter_map(|n| set.by_name.get(n))
            .map(|r| Resource {
                name: r.name.clone(),
                aliases: r.aliases.clone(),
                version: r.version.clone(),
                resource: Some(r.body.clone()),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn seeds() -> Vec<(String, Vec<u8>)> {
    let snaps = ambit_fuzz::mesh_snapshots();
    let (small, full) = (&snaps[0], &snaps[1]);
    let addr = ambit_proto::ADDRESS_TYPE_URL;
    let authz = ambit_proto::AUTHORIZATION_TYPE_URL;
    let mut out = Vec::new();
    let enc = |r: &DeltaDiscoveryResponse| r.encode_to_vec();
    for (name, snap) in [("small", small), ("full", full)] {
        out.push((
            format!("{name}-addresses"),
            ambit_fuzz::frame(&[enc(&response(snap, addr, "1"))]),
        ));
        out.push((
            format!("{name}-authorizations"),
            ambit_fuzz::frame(&[enc(&response(snap, authz, "2"))]),
        ));
    }
    // A full sync, then the small mesh's resources again and the rest removed.
    let grown = response(full, addr, "1");
    let mut shrunk = response(small, addr, "2");
    shrunk.removed_resources = full
        .mesh(addr)
        .by_name
        .keys()
        .filter(|n| !small.mesh(addr).by_name.contains_key(*n))
        .cloned()
        .collect();
    out.push((
        "grow-then-shrink".to_string(),
        ambit_fuzz::frame(&[enc(&grown), enc(&shrunk)]),
    ));
    // One resource, alone (small inputs mutate fastest).
    for (i, r) in grown.resources.iter().take(6).enumerate() {
        let one = DeltaDiscoveryResponse {
            type_url: addr.to_string(),
            nonce: "n".into(),
            resources: vec![r.clone()],
            ..Default::default()
        };
        out.push((format!("one-address-{i}"), ambit_fuzz::frame(&[enc(&one)])));
    }
    out
}

/// The indexes agree: every workload is found by its uid, every service by
/// its key, every authorization by its key.
fn check_indexes(state: &StateSnapshot) {
    for w in state.workloads() {
        let found = state.workload_by_uid(&w.uid);
        assert!(
            found.is_some_and(|f| std::sync::Arc::ptr_eq(&f, w)),
            "workload {}",
            w.uid
        );
    }
    for s in state.services() {
        assert!(
            state.service_by_hostname(&s.key()).is_some(),
            "service {}",
            s.key()
        );
    }
    for a in state.authorizations() {
        assert!(
            state.authorization(&a.key()).is_some(),
            "policy {}",
            a.key()
        );
    }
}

fuzz_target!(
    init: {
        if let Some(dir) = ambit_fuzz::seeds_requested() {
            ambit_fuzz::write_seeds(&dir, seeds());
        }
    },
    |data: &[u8]| {
        let mut state = StateSnapshot::default();
        for msg in ambit_fuzz::frames(data) {
            let Ok(resp) = DeltaDiscoveryResponse::decode(msg) else {
                continue;
            };
            let handled = handle_response(&mut state, &resp);
            assert_eq!(handled.reply.response_nonce, resp.nonce);
            assert_eq!(handled.reply.type_url, resp.type_url);
            assert_eq!(handled.is_nack(), !handled.errors.is_empty());
            check_indexes(&state);
        }
    }
);
