#![allow(clippy::unwrap_used, clippy::expect_used)]

//! `ConnectionResult` against a real `Metrics` registry and a captured
//! tracing subscriber.

use std::io;
use std::sync::mpsc;

use super::*;
use crate::Metrics;

fn open(security: SecurityPolicy) -> ConnectionOpen {
    ConnectionOpen {
        reporter: Reporter::Source,
        src: "10.0.0.1:40000".parse().unwrap(),
        dst: "10.96.0.10:80".parse().unwrap(),
        source: PeerInfo {
            name: "client-7d4f".to_string(),
            workload: "client".to_string(),
            namespace: "default".to_string(),
            canonical_service: "client".to_string(),
            canonical_revision: "v1".to_string(),
            principal: "spiffe://cluster.local/ns/default/sa/client".to_string(),
        },
        destination: PeerInfo {
            name: "echo-5c9b".to_string(),
            workload: "echo".to_string(),
            namespace: "apps".to_string(),
            canonical_service: "echo".to_string(),
            canonical_revision: String::new(),
            principal: "spiffe://cluster.local/ns/apps/sa/echo".to_string(),
        },
        destination_service: Some(ServiceInfo {
            hostname: "echo.apps.svc.cluster.local".to_string(),
            name: "echo".to_string(),
            namespace: "apps".to_string(),
        }),
        security,
        upstream: None,
        waypoint: None,
        trace_id: None,
        hbone_peer: None,
    }
}

/// The full label set, as the text encoder renders it.
fn rendered_labels(flags: &str, security: &str) -> String {
    format!(
        "reporter=\"source\",source_workload=\"client\",source_canonical_service=\"client\",\
         source_canonical_revision=\"v1\",source_workload_namespace=\"default\",\
         source_principal=\"spiffe://cluster.local/ns/default/sa/client\",source_app=\"client\",\
         source_version=\"v1\",destination_service=\"echo.apps.svc.cluster.local\",\
         destination_service_namespace=\"apps\",destination_service_name=\"echo\",\
         destination_workload=\"echo\",destination_canonical_service=\"echo\",\
         destination_canonical_revision=\"unknown\",destination_workload_namespace=\"apps\",\
         destination_principal=\"spiffe://cluster.local/ns/apps/sa/echo\",destination_app=\"echo\",\
         destination_version=\"unknown\",request_protocol=\"tcp\",response_flags=\"{flags}\",\
         connection_security_policy=\"{security}\""
    )
}

fn assert_contains(text: &str, want: &str) {
    assert!(text.contains(want), "missing {want:?} in\n{text}");
}

/// A `MakeWriter` output that sends every write over a channel.
struct Capture(mpsc::Sender<Vec<u8>>);

impl io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let _ = self.0.send(buf.to_vec());
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Runs `f` with a fmt subscriber and returns everything it wrote.
fn capture_logs(f: impl FnOnce()) -> String {
    let (tx, rx) = mpsc::channel();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || Capture(tx.clone()))
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let bytes: Vec<u8> = rx.try_iter().flatten().collect();
    String::from_utf8(bytes).unwrap()
}

#[test]
fn finished_connection_records_open_close_and_bytes() {
    let m = Metrics::new();
    let conn = ConnectionResult::new(open(SecurityPolicy::MutualTls), &m.tcp);
    let open_text = m.encode().unwrap();
    let labels = rendered_labels("-", "mutual_tls");
    assert_contains(
        &open_text,
        &format!("istio_tcp_connections_opened_total{{{labels}}} 1"),
    );
    assert!(
        !open_text.contains("istio_tcp_connections_closed_total{"),
        "closed before the end:\n{open_text}"
    );

    conn.record_sent(100);
    conn.record_received(40);
    conn.record_sent(23);
    conn.finish();

    let text = m.encode().unwrap();
    for want in [
        format!("istio_tcp_connections_opened_total{{{labels}}} 1"),
        format!("istio_tcp_connections_closed_total{{{labels}}} 1"),
        format!("istio_tcp_sent_bytes_total{{{labels}}} 123"),
        format!("istio_tcp_received_bytes_total{{{labels}}} 40"),
    ] {
        assert_contains(&text, &want);
    }
    // Exactly one close was recorded, under no other label set.
    let closed: Vec<_> = text
        .lines()
        .filter(|l| l.starts_with("istio_tcp_connections_closed_total{"))
        .collect();
    assert_eq!(closed.len(), 1, "{text}");
}

#[test]
fn dropped_without_finish_records_dc() {
    let m = Metrics::new();
    let conn = ConnectionResult::new(open(SecurityPolicy::None), &m.tcp);
    conn.record_received(5);
    let logs = capture_logs(|| drop(conn));

    let mut labels = TcpLabels::new(&open(SecurityPolicy::None));
    assert_eq!(m.tcp.opened.get_or_create(&labels).get(), 1);
    labels.response_flags = ResponseFlags::DownstreamTerminated;
    assert_eq!(m.tcp.closed.get_or_create(&labels).get(), 1);
    assert_eq!(m.tcp.received_bytes.get_or_create(&labels).get(), 5);
    labels.response_flags = ResponseFlags::None;
    assert_eq!(m.tcp.closed.get_or_create(&labels).get(), 0);

    let text = m.encode().unwrap();
    assert_contains(
        &text,
        &format!(
            "istio_tcp_connections_closed_total{{{}}} 1",
            rendered_labels("DC", "none")
        ),
    );
    assert_eq!(logs.matches("connection complete").count(), 1, "{logs}");
    assert_contains(&logs, "response_flags=\"DC\"");
    assert_contains(&logs, "connection dropped before it finished");
}

#[test]
fn failed_connection_records_its_flag() {
    let m = Metrics::new();
    let conn = ConnectionResult::new(open(SecurityPolicy::MutualTls), &m.tcp);
    let logs = capture_logs(|| conn.fail(ResponseFlags::ConnectFailure, &"connection refused"));
    let mut labels = TcpLabels::new(&open(SecurityPolicy::MutualTls));
    labels.response_flags = ResponseFlags::ConnectFailure;
    assert_eq!(m.tcp.closed.get_or_create(&labels).get(), 1);
    assert_eq!(logs.matches("connection complete").count(), 1, "{logs}");
    assert_contains(&logs, "response_flags=\"CONNECT\"");
    assert_contains(&logs, "error=\"connection refused\"");
}

#[test]
fn connections_with_the_same_labels_share_them_and_a_failure_does_not_change_them() {
    let m = Metrics::new();
    let a = ConnectionResult::new(open(SecurityPolicy::MutualTls), &m.tcp);
    let b = ConnectionResult::new(open(SecurityPolicy::MutualTls), &m.tcp);
    let c = ConnectionResult::new(open(SecurityPolicy::None), &m.tcp);
    assert!(Arc::ptr_eq(&a.labels, &b.labels));
    assert!(!Arc::ptr_eq(&a.labels, &c.labels));
    // `a`'s failure is counted under its flag; `b`, sharing the labels,
    // still closes under `-`.
    capture_logs(|| a.fail(ResponseFlags::ConnectFailure, &"connection refused"));
    capture_logs(|| b.finish());
    let open_labels = TcpLabels::new(&open(SecurityPolicy::MutualTls));
    assert_eq!(open_labels.response_flags, ResponseFlags::None);
    assert_eq!(m.tcp.closed.get_or_create(&open_labels).get(), 1);
    assert_eq!(m.tcp.opened.get_or_create(&open_labels).get(), 2);
    drop(c);
}

#[test]
fn access_log_is_written_once_with_bytes_and_duration() {
    let m = Metrics::new();
    let mut o = open(SecurityPolicy::MutualTls);
    o.upstream = Some("10.0.2.9:15008".parse().unwrap());
    o.waypoint = Some("apps/waypoint-0".to_string());
    let logs = capture_logs(|| {
        let conn = ConnectionResult::new(o, &m.tcp);
        conn.record_sent(7);
        conn.record_received(9);
        conn.finish();
    });
    let lines: Vec<_> = logs
        .lines()
        .filter(|l| l.contains("connection complete"))
        .collect();
    assert_eq!(lines.len(), 1, "{logs}");
    let line = lines[0];
    for want in [
        " INFO access:",
        "src.addr=10.0.0.1:40000",
        "src.workload=client-7d4f",
        "src.namespace=default",
        "src.identity=\"spiffe://cluster.local/ns/default/sa/client\"",
        "dst.addr=10.96.0.10:80",
        "dst.service=echo.apps.svc.cluster.local",
        "dst.workload=echo-5c9b",
        "dst.identity=\"spiffe://cluster.local/ns/apps/sa/echo\"",
        "upstream=10.0.2.9:15008",
        "waypoint=\"apps/waypoint-0\"",
        "direction=\"outbound\"",
        "bytes_sent=7",
        "bytes_recv=9",
        "duration_ms=",
        "response_flags=\"-\"",
    ] {
        assert_contains(line, want);
    }
}

#[test]
fn plaintext_logs_no_identities_and_unknown_labels() {
    let mut o = open(SecurityPolicy::None);
    o.source = PeerInfo::default();
    o.destination_service = None;
    let labels = TcpLabels::new(&o);
    assert_eq!(labels.source_workload, UNKNOWN);
    assert_eq!(labels.destination_service, UNKNOWN);
    assert_eq!(labels.connection_security_policy, SecurityPolicy::None);

    let m = Metrics::new();
    let logs = capture_logs(|| ConnectionResult::new(o, &m.tcp).finish());
    assert_contains(&logs, "src.identity=\"-\"");
    assert_contains(&logs, "dst.identity=\"-\"");
    assert_contains(&logs, "src.workload=unknown");
    assert_contains(&logs, "upstream=-");
    assert_contains(&logs, "waypoint=\"-\"");
}

#[test]
fn each_connection_is_one_record_open_then_closed() {
    let m = Metrics::new();
    let mut o = open(SecurityPolicy::MutualTls);
    o.upstream = Some("10.0.2.9:15008".parse().unwrap());
    o.trace_id = Some(0xabc);
    let conn = ConnectionResult::new(o, &m.tcp);
    let d = m.tcp.connections.dump();
    assert_eq!((d.open.len(), d.recent.len()), (1, 0));
    let r = &d.open[0];
    assert_eq!(r.direction, "outbound");
    assert_eq!(r.src.port, Some(40000), "the app's own port");
    assert_eq!(r.src.workload.as_deref(), Some("client-7d4f"));
    assert_eq!(
        r.dst_service.as_deref(),
        Some("echo.apps.svc.cluster.local")
    );
    assert_eq!(
        r.dst.identity.as_deref(),
        Some("spiffe://cluster.local/ns/apps/sa/echo")
    );
    assert_eq!(
        r.trace_id.as_deref(),
        Some("00000000000000000000000000000abc")
    );
    assert_eq!(r.bytes_sent, None, "bytes are counted at close");
    conn.record_sent(7);
    conn.record_received(9);
    conn.fail(ResponseFlags::DownstreamTerminated, &"reset by peer");
    let d = m.tcp.connections.dump();
    assert_eq!((d.open.len(), d.recent.len(), d.closed_total), (0, 1, 1));
    let r = &d.recent[0];
    assert_eq!(r.state, crate::proxy::recent::ConnectionState::Closed);
    assert_eq!((r.bytes_sent, r.bytes_received), (Some(7), Some(9)));
    assert_eq!(r.response_flags, "DC");
    assert_eq!(r.error.as_deref(), Some("reset by peer"));
}

#[test]
fn an_inbound_hbone_record_has_no_source_port_and_names_its_tunnel() {
    let m = Metrics::new();
    let mut o = open(SecurityPolicy::MutualTls);
    o.reporter = Reporter::Destination;
    o.src = "10.0.0.1:51000".parse().unwrap();
    o.hbone_peer = Some(o.src);
    o.trace_id = Some(7);
    ConnectionResult::new(o, &m.tcp).finish();
    let d = m.tcp.connections.dump();
    let r = &d.recent[0];
    assert_eq!(r.direction, "inbound");
    assert_eq!(r.src.port, None);
    assert_eq!(r.hbone_peer, Some("10.0.0.1:51000".parse().unwrap()));
    let json = serde_json::to_value(r).unwrap();
    assert_eq!(json["src"]["ip"], "10.0.0.1");
    assert!(json["src"].get("port").is_none(), "{json}");
    assert_eq!(json["hbone_peer"], "10.0.0.1:51000");
    assert_eq!(json["state"], "closed");
    assert_eq!(json["security"], "mutual_tls");

    // Plaintext: no identities, whatever the peers are.
    let mut o = open(SecurityPolicy::None);
    o.reporter = Reporter::Destination;
    ConnectionResult::new(o, &m.tcp).finish();
    let d = m.tcp.connections.dump();
    let r = &d.recent[1];
    assert_eq!(
        (r.src.identity.as_ref(), r.dst.identity.as_ref()),
        (None, None)
    );
    assert_eq!(r.src.port, Some(40000));
}
