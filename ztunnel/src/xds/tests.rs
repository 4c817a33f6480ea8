#![allow(clippy::unwrap_used, clippy::expect_used)]

use ambit_proto::workload as xds;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryResponse, Resource};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

use super::handle_response;
use crate::state::{ResourceType, StateSnapshot};

fn workload_resource(uid: &str, addr: Vec<u8>) -> Resource {
    let msg = xds::Address {
        r#type: Some(xds::address::Type::Workload(xds::Workload {
            uid: uid.to_string(),
            name: uid.to_string(),
            namespace: "default".into(),
            addresses: vec![addr],
            ..Default::default()
        })),
    };
    Resource {
        name: uid.to_string(),
        version: "v1".into(),
        resource: Some(Any {
            type_url: ambit_proto::ADDRESS_TYPE_URL.into(),
            value: msg.encode_to_vec(),
        }),
        ..Default::default()
    }
}

fn response(resources: Vec<Resource>, removed: Vec<&str>) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        type_url: ambit_proto::ADDRESS_TYPE_URL.into(),
        nonce: "n1".into(),
        resources,
        removed_resources: removed.into_iter().map(String::from).collect(),
        ..Default::default()
    }
}

#[test]
fn ack_carries_type_and_nonce() {
    let mut s = StateSnapshot::default();
    let h = handle_response(
        &mut s,
        &response(vec![workload_resource("w1", vec![10, 0, 0, 1])], vec![]),
    );
    assert!(!h.is_nack());
    assert_eq!(h.reply.response_nonce, "n1");
    assert_eq!(h.reply.type_url, ambit_proto::ADDRESS_TYPE_URL);
    assert_eq!(h.ty, Some(ResourceType::Address));
    assert!(s.workload_by_uid("w1").is_some());
}

#[test]
fn bad_address_is_nacked_and_good_ones_kept() {
    let mut s = StateSnapshot::default();
    let h = handle_response(
        &mut s,
        &response(
            vec![
                workload_resource("good", vec![10, 0, 0, 1]),
                workload_resource("bad", vec![10, 0, 0]),
            ],
            vec![],
        ),
    );
    assert!(h.is_nack());
    let detail = h.reply.error_detail.unwrap();
    assert_eq!(detail.code, 3);
    assert!(detail.message.contains("\"bad\""), "{}", detail.message);
    assert!(detail.message.contains("3 bytes"), "{}", detail.message);
    assert_eq!(h.reply.response_nonce, "n1");
    assert!(s.workload_by_uid("good").is_some());
    assert!(s.workload_by_uid("bad").is_none());
    assert!(
        !s.xds_resources(ResourceType::Address).contains_key("bad"),
        "a rejected resource must not be reported as held"
    );
}

#[test]
fn removals_and_bodyless_resources_remove() {
    let mut s = StateSnapshot::default();
    handle_response(
        &mut s,
        &response(
            vec![
                workload_resource("w1", vec![10, 0, 0, 1]),
                workload_resource("w2", vec![10, 0, 0, 2]),
            ],
            vec![],
        ),
    );
    let bodyless = Resource {
        name: "w2".into(),
        ..Default::default()
    };
    let h = handle_response(&mut s, &response(vec![bodyless], vec!["w1", "unknown"]));
    assert!(!h.is_nack());
    assert_eq!(s.workload_count(), 0);
    assert!(s.xds_resources(ResourceType::Address).is_empty());
}

#[test]
fn garbage_body_and_wrong_type_are_rejected() {
    let mut s = StateSnapshot::default();
    let garbage = Resource {
        name: "g".into(),
        resource: Some(Any {
            type_url: ambit_proto::ADDRESS_TYPE_URL.into(),
            value: vec![0xff, 0xff, 0xff],
        }),
        ..Default::default()
    };
    let wrong = Resource {
        name: "w".into(),
        resource: Some(Any {
            type_url: "type.googleapis.com/something.Else".into(),
            value: vec![],
        }),
        ..Default::default()
    };
    let h = handle_response(&mut s, &response(vec![garbage, wrong], vec![]));
    assert_eq!(h.errors.len(), 2);
    let msg = h.reply.error_detail.unwrap().message;
    assert!(msg.contains("rejected 2 of 2"), "{msg}");
}

#[test]
fn unknown_type_is_nacked_without_touching_state() {
    let mut s = StateSnapshot::default();
    let resp = DeltaDiscoveryResponse {
        type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
        nonce: "x".into(),
        ..Default::default()
    };
    let h = handle_response(&mut s, &resp);
    assert!(h.is_nack());
    assert_eq!(h.ty, None);
    assert_eq!(h.reply.response_nonce, "x");
}

#[test]
fn node_identity_and_metadata() {
    let n = super::node("node-a", "Kubernetes", "net1");
    assert_eq!(
        n.id,
        "ztunnel~0.0.0.0~ztunnel-node-a.ambit-system~ambit-system.svc.cluster.local"
    );
    let fields = n.metadata.unwrap().fields;
    for (k, v) in [
        ("NODE_NAME", "node-a"),
        ("CLUSTER_ID", "Kubernetes"),
        ("NETWORK", "net1"),
    ] {
        let got = match &fields[k].kind {
            Some(envoy_types::pb::google::protobuf::value::Kind::StringValue(s)) => s.clone(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(got, v);
    }
}

/// The public entry point (what the fuzz target drives): a truncated body
/// and an unknown type are NACKed, nothing is applied, nothing panics.
#[test]
fn public_handle_response_rejects_truncated_bodies() {
    let mut s = StateSnapshot::default();
    let mut truncated = workload_resource("w1", vec![10, 0, 0, 1]);
    if let Some(any) = &mut truncated.resource {
        any.value.truncate(any.value.len() / 2);
    }
    let h = crate::xds::handle_response(&mut s, &response(vec![truncated], vec![]));
    assert!(h.is_nack());
    assert_eq!(h.errors.len(), 1);
    assert_eq!(s.workload_count(), 0);

    let unknown = DeltaDiscoveryResponse {
        type_url: "type.googleapis.com/not.a.Type".into(),
        ..Default::default()
    };
    let h = crate::xds::handle_response(&mut s, &unknown);
    assert!(h.is_nack());
    assert_eq!(h.ty, None);
}
