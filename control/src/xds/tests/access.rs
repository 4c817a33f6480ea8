//! Who may open a stream and what it is served, over real gRPC: no resource
//! ever reaches a caller without valid credentials or with the wrong
//! identity, and a stream cannot make the server hold unbounded names.

use tonic::Code;

use super::*;

fn workloads() -> Vec<XdsResource> {
    vec![workload("c//Pod/ns/a", [10, 0, 0, 1], "sa")]
}

#[tokio::test]
async fn no_or_wrong_credentials_are_unauthenticated_before_any_resource() {
    let mut h = harness(workloads()).await;
    for token in [None, Some("not-a-known-token")] {
        let refused = DeltaClient::try_open(&mut h, wildcard(), token).await;
        let status = match refused {
            Err(status) => status,
            Ok(mut c) => c.refused().await,
        };
        assert_eq!(
            status.code(),
            Code::Unauthenticated,
            "{token:?}: {status:?}"
        );
    }
    // SotW too.
    let (tx, req_rx) = mpsc::channel(1);
    tx.send(DiscoveryRequest {
        node: node(),
        type_url: ambit_proto::ADDRESS_TYPE_URL.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let sotw = h
        .client
        .stream_aggregated_resources(ReceiverStream::new(req_rx))
        .await;
    assert_eq!(sotw.err().map(|s| s.code()), Some(Code::Unauthenticated));
    let refused = h
        .metrics
        .refused
        .get_or_create(&vec![("reason", "unauthenticated")])
        .get();
    assert_eq!(refused, 3);
    assert!(
        h.registry.proxies().is_empty(),
        "refused streams never register"
    );
}

#[tokio::test]
async fn a_workload_identity_is_not_served_the_workload_api() {
    let mut h = harness(workloads()).await;
    // The waypoint's credentials, asking as a ztunnel.
    let mut c = DeltaClient::open_as(&mut h, wildcard(), WAYPOINT_TOKEN).await;
    let status = c.refused().await;
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(
        status.message().contains("served only to node proxies"),
        "{}",
        status.message()
    );
}

#[tokio::test]
async fn an_envoy_may_claim_only_its_own_namespace() {
    let mut h = harness(workloads()).await;
    let mut c = DeltaClient::open_as(
        &mut h,
        DeltaDiscoveryRequest {
            node: Some(Node {
                id: "router~10.0.0.9~wp.bank~bank.svc.cluster.local".into(),
                ..Default::default()
            }),
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            ..Default::default()
        },
        WAYPOINT_TOKEN,
    )
    .await;
    let status = c.refused().await;
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(
        status.message().contains("\"bank\""),
        "{}",
        status.message()
    );
    // A node token is not an Envoy identity either.
    let mut c = DeltaClient::open(
        &mut h,
        DeltaDiscoveryRequest {
            node: Some(Node {
                id: "router~10.0.0.9~wp.ns~ns.svc.cluster.local".into(),
                ..Default::default()
            }),
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(c.refused().await.code(), Code::PermissionDenied);
}

#[tokio::test]
async fn subscribed_names_are_bounded() {
    let mut h = harness(workloads()).await;
    let mut c = DeltaClient::open(&mut h, on_demand(&["/10.0.0.1"])).await;
    let first = c.recv().await;
    c.ack(&first).await;
    // A name longer than any real resource name.
    c.tx.send(on_demand(&[&"x".repeat(2000)])).await.unwrap();
    let status = c.refused().await;
    assert_eq!(status.code(), Code::ResourceExhausted);

    // Too many names, sent in slices below the request size limit.
    let mut c = DeltaClient::open(&mut h, on_demand(&["/10.0.0.1"])).await;
    let first = c.recv().await;
    c.ack(&first).await;
    let mut refused = None;
    for batch in 0..20 {
        let names: Vec<String> = (0..1000)
            .map(|i| format!("/10.{batch}.{}.{}", i / 256, i % 256))
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        if c.tx.send(on_demand(&refs)).await.is_err() {
            break;
        }
        match tokio::time::timeout(T, c.rx.next()).await {
            Ok(Some(Ok(resp))) => c.ack(&resp).await,
            Ok(Some(Err(status))) => {
                refused = Some(status);
                break;
            }
            other => panic!("unexpected: {other:?}"),
        }
    }
    assert_eq!(refused.map(|s| s.code()), Some(Code::ResourceExhausted));
}

fn on_demand(names: &[&str]) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: node(),
        type_url: ambit_proto::ADDRESS_TYPE_URL.into(),
        resource_names_subscribe: names.iter().map(|n| n.to_string()).collect(),
        ..Default::default()
    }
}
