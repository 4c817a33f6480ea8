//! Full-sync slots: only requests for everything of a large type take one,
//! never the ACKs of an on-demand subscriber.

use super::*;

/// More than `LARGE_RESPONSE` workloads.
fn many() -> Vec<XdsResource> {
    (0..1200u32)
        .map(|i| {
            let ip = [10, 1, (i / 250) as u8, (i % 250) as u8 + 1];
            workload(&format!("c//Pod/ns/p{i}"), ip, "sa")
        })
        .collect()
}

#[tokio::test]
async fn acks_of_an_on_demand_subscriber_take_no_full_sync_slot() {
    let mut h = harness(many()).await;
    // Eight wildcard clients that never ACK hold every full-sync slot (for
    // up to FULL_SYNC_SLOT_TIMEOUT).
    let mut holders = Vec::new();
    for _ in 0..CONCURRENT_FULL_SYNCS {
        let mut c = DeltaClient::open(&mut h, wildcard()).await;
        let first = c.recv().await;
        assert!(!first.resources.is_empty());
        holders.push(c);
    }
    let subscribe = |name: &str| DeltaDiscoveryRequest {
        node: node(),
        type_url: ambit_proto::ADDRESS_TYPE_URL.into(),
        resource_names_subscribe: vec![name.to_string()],
        ..Default::default()
    };
    let mut c = DeltaClient::open(&mut h, subscribe("/10.1.0.1")).await;
    let first = c.recv().await;
    assert_eq!(names(&first), ["c//Pod/ns/p0"]);
    c.ack(&first).await;
    // The ACK must not have parked the stream waiting for a slot: the next
    // on-demand name is answered at once.
    let started = std::time::Instant::now();
    c.tx.send(subscribe("/10.1.0.2")).await.unwrap();
    let next = c.recv().await;
    assert_eq!(names(&next), ["c//Pod/ns/p1"]);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "on-demand answer took {:?}",
        started.elapsed()
    );
    drop(holders);
}
