//! The demo that `ambitctl local up` brings up (deploy/local/demo) is valid
//! config and means what the README says: every ai-inference pod is in the
//! mesh (HBONE) under STRICT mTLS, the legacy namespace is not, and the llm
//! Service spreads over both versions with their own target ports.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use ambit_config::parse_documents;
use ambit_control::model::{ModelOptions, Snapshot, Store, build_snapshot};
use ambit_tests::workspace_root;
use ambit_ztunnel::StateSnapshot;
use ambit_ztunnel::state::{Address, TunnelProtocol};
use prost::Message;

#[test]
fn demo_config_is_the_ai_platform_of_the_readme() {
    let dir = workspace_root().join("deploy/local/demo");
    let mut objects = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let (objs, errs) = parse_documents(&path, &text);
        assert!(errs.is_empty(), "{}: {errs:#?}", path.display());
        objects.extend(objs);
    }
    let snap = build_snapshot(
        &Store::from_objects(objects),
        &Snapshot::default(),
        &ModelOptions::default(),
    );
    assert!(snap.errors.is_empty(), "{:#?}", snap.errors);
    let mut state = StateSnapshot::default();
    for (name, r) in &snap.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name {
        let msg = ambit_proto::workload::Address::decode(r.body.value.as_slice()).unwrap();
        state.apply_address(name, &r.version, Address::try_from(&msg).unwrap());
    }
    let pods: BTreeMap<String, TunnelProtocol> = state
        .workloads()
        .map(|w| (format!("{}/{}", w.namespace, w.name), w.protocol))
        .collect();
    let mesh = [
        "orchestrator-0",
        "embedding-0",
        "embedding-1",
        "vector-db-0",
        "llm-v1-0",
        "llm-v2-0",
    ];
    for p in mesh {
        assert_eq!(
            pods.get(&format!("ai-inference/{p}")),
            Some(&TunnelProtocol::Hbone),
            "{p}"
        );
    }
    for p in ["legacy-client", "legacy-web"] {
        assert_eq!(
            pods.get(&format!("legacy/{p}")),
            Some(&TunnelProtocol::Tcp),
            "{p}"
        );
    }
    let llm = state
        .endpoints("ai-inference/llm.ai-inference.svc.cluster.local")
        .expect("llm endpoints");
    let mut ports: Vec<u16> = llm
        .values()
        .flat_map(|e| e.ports.iter().map(|p| p.target_port))
        .collect();
    ports.sort();
    assert_eq!(ports, [8000, 8001], "each llm version keeps its own port");
    // STRICT in ai-inference: the converted policy is there.
    assert!(
        snap.mesh(ambit_proto::AUTHORIZATION_TYPE_URL)
            .by_name
            .keys()
            .any(|k| k.contains("strict") || k.contains("converted")),
        "{:?}",
        snap.mesh(ambit_proto::AUTHORIZATION_TYPE_URL)
            .by_name
            .keys()
            .collect::<Vec<_>>()
    );
}
