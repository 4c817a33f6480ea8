#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use super::*;

fn record(port: u16) -> ConnectionRecord {
    ConnectionRecord {
        id: 0,
        direction: "outbound",
        state: ConnectionState::Closed,
        src: Endpoint::at(SocketAddr::from(([10, 0, 0, 1], port))),
        dst: Endpoint::at(SocketAddr::from(([10, 0, 0, 2], 80))),
        dst_service: None,
        security: "none",
        upstream: None,
        hbone_peer: None,
        waypoint: None,
        trace_id: None,
        start_unix_ms: 0,
        duration_ms: 5,
        bytes_sent: Some(1),
        bytes_received: Some(1),
        response_flags: "DENY",
        error: Some("x".into()),
    }
}

fn done() -> Outcome {
    Outcome {
        response_flags: "-",
        error: None,
        bytes_sent: 3,
        bytes_received: 4,
    }
}

#[test]
fn open_resets_the_outcome_and_close_moves_to_the_ring() {
    let t = ConnectionTable::new(4);
    let id = t.open(record(1000));
    let d = t.dump();
    let r = &d.open[0];
    assert_eq!(
        (r.id, r.state, r.response_flags),
        (id, ConnectionState::Open, "-")
    );
    assert_eq!((r.bytes_sent, r.error.as_ref()), (None, None));
    assert!(r.start_unix_ms > 0);
    t.close(id, done());
    t.close(id, done()); // a second close does nothing
    let d = t.dump();
    assert!(d.open.is_empty());
    assert_eq!(d.closed_total, 1);
    assert_eq!(d.recent.len(), 1);
    assert_eq!(d.recent[0].bytes_received, Some(4));
    assert_eq!(d.recent[0].state, ConnectionState::Closed);
}

#[test]
fn the_ring_keeps_the_last_capacity_connections_oldest_first() {
    let t = ConnectionTable::new(3);
    for port in 1..=5u16 {
        let id = t.open(record(port));
        t.close(id, done());
    }
    let d = t.dump();
    let ports: Vec<_> = d.recent.iter().map(|r| r.src.port).collect();
    assert_eq!(ports, [Some(3), Some(4), Some(5)]);
    assert_eq!((d.capacity, d.closed_total), (3, 5));
}

#[test]
fn concurrent_opens_and_closes_lose_nothing() {
    let t = Arc::new(ConnectionTable::new(10_000));
    let threads: Vec<_> = (0..4u16)
        .map(|n| {
            let t = t.clone();
            std::thread::spawn(move || {
                for i in 0..500u16 {
                    let id = t.open(record(n * 1000 + i));
                    if i % 2 == 0 {
                        t.close(id, done());
                    }
                }
            })
        })
        .collect();
    for th in threads {
        th.join().unwrap();
    }
    let d = t.dump();
    assert_eq!((d.open.len(), d.recent.len()), (1000, 1000));
    assert_eq!(t.open_len(), 1000);
    assert!(d.open.windows(2).all(|w| w[0].id < w[1].id), "oldest first");
}

#[test]
fn traceparent_trace_ids() {
    let id = trace_id_of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
    assert_eq!(format_trace_id(id), "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(format_trace_id(1), "00000000000000000000000000000001");
    for bad in [
        "",
        "00",
        "00-xyz-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e47361-00f067aa0ba902b7-01",
    ] {
        assert_eq!(trace_id_of(bad), None, "{bad:?}");
    }
}

#[test]
fn an_open_record_keeps_every_string_as_given() {
    let t = ConnectionTable::new(4);
    let mut r = record(1000);
    r.src.workload = Some("client-0".into());
    r.src.namespace = Some(String::new()); // present but empty: not absent
    r.src.identity = None;
    r.dst.workload = Some("server-7".into());
    r.dst.namespace = Some("ai".into());
    r.dst.identity = Some("spiffe://cluster.local/ns/ai/sa/server".into());
    r.dst_service = Some("embed.ai.svc.cluster.local".into());
    r.waypoint = None;
    r.trace_id = Some("0af7651916cd43dd8448eb211c80319c".into());
    r.src.port = None;
    r.hbone_peer = Some(SocketAddr::from(([10, 0, 0, 9], 40000)));
    let id = t.open(r.clone());
    let got = t.dump().open.remove(0);
    assert_eq!((&got.src, &got.dst), (&r.src, &r.dst));
    assert_eq!(
        (
            &got.dst_service,
            &got.waypoint,
            &got.trace_id,
            got.hbone_peer
        ),
        (&r.dst_service, &r.waypoint, &r.trace_id, r.hbone_peer)
    );
    t.close(id, done());
    let closed = t.dump().recent.remove(0);
    assert_eq!((&closed.src, &closed.dst), (&r.src, &r.dst));
    assert_eq!(closed.trace_id, r.trace_id);
}
