//! The demo that `ambitctl local up` brings up (deploy/local/demo) is valid
//! config and means what the README says: every ai-inference pod is in the
//! mesh (HBONE) under STRICT mTLS, the legacy namespace is not, the llm
//! Service spreads over both versions with their own target ports, and it
//! is bound to the ai-inference waypoint, whose Envoy routes 80/20 to the
//! v1/v2 subsets with retries and a timeout.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use ambit_config::parse_documents;
use ambit_control::model::{ModelOptions, Snapshot, Store, build_snapshot};
use ambit_tests::workspace_root;
use ambit_ztunnel::StateSnapshot;
use ambit_ztunnel::state::{Address, TunnelProtocol};
use envoy_types::pb::envoy::config::route::v3::{RouteConfiguration, route, route_action};
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
    // llm goes through the waypoint, whose routes split 80/20.
    let llm_svc = snap
        .mesh(ambit_proto::ADDRESS_TYPE_URL)
        .by_name
        .iter()
        .find(|(n, _)| n.contains("llm.ai-inference.svc"))
        .map(|(_, r)| ambit_proto::workload::Address::decode(r.body.value.as_slice()).unwrap())
        .expect("the llm Service");
    let Some(ambit_proto::workload::address::Type::Service(svc)) = llm_svc.r#type else {
        panic!("llm is not a service: {llm_svc:?}");
    };
    assert!(
        svc.waypoint.is_some(),
        "llm is bound to the waypoint: {svc:?}"
    );
    let scope = ambit_control::model::waypoint::scope("ai-inference", "waypoint");
    let routes = snap
        .set(&scope, ambit_control::model::waypoint::ROUTE_TYPE)
        .expect("the waypoint's routes");
    let mut weights = BTreeMap::new();
    let mut retries = None;
    for r in routes.resources.by_name.values() {
        let rc = RouteConfiguration::decode(r.body.value.as_slice()).unwrap();
        for vh in &rc.virtual_hosts {
            for route in &vh.routes {
                let Some(route::Action::Route(action)) = &route.action else {
                    continue;
                };
                if let Some(route_action::ClusterSpecifier::WeightedClusters(wc)) =
                    &action.cluster_specifier
                {
                    for c in &wc.clusters {
                        let w = c.weight.as_ref().map_or(0, |w| w.value);
                        weights.insert(c.name.clone(), w);
                    }
                    retries = action.retry_policy.as_ref().map(|p| {
                        (
                            p.num_retries.as_ref().map_or(0, |n| n.value),
                            action.timeout.as_ref().map_or(0, |t| t.seconds),
                        )
                    });
                }
            }
        }
    }
    let host = "llm.ai-inference.svc.cluster.local";
    assert_eq!(
        (
            weights.get(&format!("outbound|80|v1|{host}")),
            weights.get(&format!("outbound|80|v2|{host}"))
        ),
        (Some(&80), Some(&20)),
        "{weights:?}"
    );
    assert_eq!(retries, Some((2, 10)), "2 retries, 10 s timeout");

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
