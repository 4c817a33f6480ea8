#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

fn ep(ip: &str, port: Option<u16>, ns: &str, w: &str, id: Option<&str>) -> ZtEndpoint {
    ZtEndpoint {
        ip: Some(ip.parse().unwrap()),
        port,
        workload: (!w.is_empty()).then(|| w.to_string()),
        namespace: (!ns.is_empty()).then(|| ns.to_string()),
        identity: id.map(str::to_string),
    }
}

const CLIENT_ID: &str = "spiffe://cluster.local/ns/mesh/sa/client";
const SERVER_ID: &str = "spiffe://cluster.local/ns/mesh/sa/server";

fn outbound(id: u64, port: u16, trace: &str, start: u64) -> ZtRecord {
    ZtRecord {
        id,
        direction: "outbound".into(),
        state: "closed".into(),
        src: ep("10.20.1.10", Some(port), "mesh", "client", Some(CLIENT_ID)),
        dst: ep("10.20.2.10", Some(8080), "mesh", "server", Some(SERVER_ID)),
        dst_service: None,
        security: "mutual_tls".into(),
        upstream: Some("10.20.2.10:15008".parse().unwrap()),
        hbone_peer: None,
        waypoint: None,
        trace_id: Some(trace.into()),
        start_unix_ms: start,
        duration_ms: 3,
        bytes_sent: Some(100),
        bytes_received: Some(50),
        response_flags: "-".into(),
        error: None,
    }
}

/// The server's half: every stream of one pooled tunnel has its peer.
fn inbound(id: u64, trace: Option<&str>, start: u64) -> ZtRecord {
    ZtRecord {
        id,
        direction: "inbound".into(),
        src: ep("10.20.1.10", None, "mesh", "client", Some(CLIENT_ID)),
        upstream: None,
        hbone_peer: Some("10.20.1.10:51515".parse().unwrap()),
        trace_id: trace.map(str::to_string),
        start_unix_ms: start + 1,
        ..outbound(id, 0, "", start)
    }
}

fn plaintext_inbound(id: u64, start: u64) -> ZtRecord {
    ZtRecord {
        id,
        direction: "inbound".into(),
        src: ep("10.20.1.20", Some(41000), "plain", "outsider", None),
        dst: ep("10.20.2.10", Some(8080), "mesh", "server", None),
        security: "none".into(),
        upstream: None,
        trace_id: None,
        start_unix_ms: start,
        response_flags: "DENY".into(),
        error: Some("denied by STRICT".into()),
        ..outbound(id, 0, "", start)
    }
}

fn node(name: &str, recent: Vec<ZtRecord>, open: Vec<ZtRecord>) -> (String, ZtConnections) {
    (
        name.to_string(),
        ZtConnections {
            capacity: 256,
            closed_total: recent.len() as u64,
            open,
            recent,
        },
    )
}

#[test]
fn two_app_connections_over_one_tunnel_are_two_rows_with_the_apps_ports() {
    let nodes = [
        node(
            "node-a",
            vec![
                outbound(1, 40001, "t1", 1000),
                outbound(2, 40002, "t2", 2000),
            ],
            vec![],
        ),
        node(
            "node-b",
            vec![
                inbound(7, Some("t1"), 1000),
                inbound(8, Some("t2"), 2000),
                plaintext_inbound(9, 3000),
                // A tunnel whose client's ztunnel did not report it.
                inbound(10, Some("t-unknown"), 4000),
            ],
            vec![],
        ),
    ];
    let rows = merge(&nodes);
    assert_eq!(rows.len(), 4, "{rows:#?}");
    let (a, b) = (&rows[0], &rows[1]);
    assert_eq!(a.src_addr, "10.20.1.10:40001");
    assert_eq!(b.src_addr, "10.20.1.10:40002");
    for c in [a, b] {
        assert!(c.mtls && !c.open);
        assert_eq!(c.src_workload, "mesh/client");
        assert_eq!(c.dst_workload, "mesh/server");
        assert_eq!(c.src_identity.as_deref(), Some(CLIENT_ID));
        let client = c.report("node-a", "outbound").unwrap();
        let server = c.report("node-b", "inbound").unwrap();
        assert_eq!(client.upstream, Some("10.20.2.10:15008".parse().unwrap()));
        assert_eq!(server.hbone_peer, Some("10.20.1.10:51515".parse().unwrap()));
    }
    let plain = &rows[2];
    assert_eq!(plain.src_addr, "10.20.1.20:41000");
    assert!(!plain.mtls);
    assert_eq!(plain.response_flags, "DENY");
    assert_eq!(plain.reported_by.len(), 1);
    // Only the server saw it: the port HBONE does not carry is not made up.
    let lone = &rows[3];
    assert_eq!(lone.src_addr, "10.20.1.10");
    assert_eq!(
        lone.reported_by[0].hbone_peer,
        Some("10.20.1.10:51515".parse().unwrap())
    );

    let text = crate::local::render::status(&status_with(vec![], rows.clone()));
    for want in [
        "mesh/client 10.20.1.10:40001",
        "mesh/client 10.20.1.10:40002",
        "node-b inbound #7 (HBONE from 10.20.1.10:51515)",
        "plain/outsider 10.20.1.20:41000",
        "DENY (denied by STRICT)",
        "ok, 150 B, 3 ms",
    ] {
        assert!(text.contains(want), "{want:?} missing:\n{text}");
    }
    // One row each, not one per tunnel, nor duplicated per ztunnel.
    assert_eq!(text.matches(":40001").count(), 1, "{text}");
    assert!(
        text.contains("node-a outbound #1, node-b inbound #7"),
        "{text}"
    );
    assert!(text.contains("A CLIENT without a port"), "{text}");
    assert_eq!(text.matches("10.20.1.10:51515").count(), 3, "{text}");
}

#[test]
fn a_failure_on_the_server_side_shows_on_the_row() {
    let mut server = inbound(7, Some("t1"), 1000);
    server.response_flags = "CONNECT".into();
    server.error = Some("connection refused".into());
    server.dst = ep(
        "10.20.2.11",
        Some(8080),
        "mesh",
        "server-1",
        Some(SERVER_ID),
    );
    let mut client = outbound(1, 40001, "t1", 1000);
    client.dst = ep("10.96.0.10", Some(80), "mesh", "server-1", Some(SERVER_ID));
    client.dst_service = Some("server.mesh.svc.cluster.local".into());
    let rows = merge(&[
        node("node-a", vec![client], vec![]),
        node("node-b", vec![server], vec![]),
    ]);
    assert_eq!(rows.len(), 1);
    let c = &rows[0];
    assert_eq!(c.response_flags, "CONNECT");
    assert_eq!(c.error.as_deref(), Some("connection refused"));
    assert_eq!(c.dst_addr, "10.96.0.10:80");
    assert_eq!(c.delivered_to.as_deref(), Some("10.20.2.11:8080"));
    let text = crate::local::render::status(&status_with(vec![], rows.clone()));
    assert!(
        text.contains(
            "server.mesh.svc.cluster.local 10.96.0.10:80 → mesh/server-1 10.20.2.11:8080"
        ),
        "{text}"
    );
}

#[test]
fn waypoint_hops_name_the_waypoint_once_and_long_errors_are_cut() {
    let wp = "mesh/waypoint-0";
    let mut to_waypoint = outbound(1, 40001, "t1", 1000);
    to_waypoint.dst = ep(
        "10.96.0.20",
        Some(80),
        "mesh",
        "waypoint-0",
        Some(SERVER_ID),
    );
    to_waypoint.dst_service = Some("llm.mesh.svc.cluster.local".into());
    to_waypoint.waypoint = Some(wp.into());
    let mut from_waypoint = inbound(2, Some("envoy's own"), 1001);
    from_waypoint.src = ep("10.20.1.200", None, "mesh", "waypoint-0", None);
    from_waypoint.dst = ep("10.20.2.20", Some(8000), "mesh", "llm-v1-0", None);
    from_waypoint.waypoint = Some(wp.into());
    from_waypoint.state = "open".into();
    from_waypoint.duration_ms = 12_345;
    let mut failed = outbound(3, 40003, "t3", 1002);
    failed.response_flags = "DC".into();
    failed.error = Some("x".repeat(200));
    let rows = merge(&[
        node("node-a", vec![to_waypoint, failed], vec![]),
        node("node-b", vec![], vec![from_waypoint]),
    ]);
    let text = crate::local::render::status(&status_with(vec![], rows));
    assert!(
        text.contains("llm.mesh.svc.cluster.local 10.96.0.20:80 via waypoint mesh/waypoint-0"),
        "{text}"
    );
    assert!(!text.contains("mesh/waypoint-0 llm.mesh"), "{text}");
    assert!(text.contains("mesh/llm-v1-0 10.20.2.20:8000  "), "{text}");
    assert!(text.contains("open 12.3 s"), "{text}");
    assert_eq!(text.matches("via waypoint").count(), 1, "{text}");
    assert!(
        text.contains(&format!("DC ({}…)", "x".repeat(71))),
        "{text}"
    );
}

#[test]
fn every_open_connection_and_the_last_closed_ones_are_kept() {
    let closed: Vec<ZtRecord> = (0..30)
        .map(|i| outbound(i, 40000 + i as u16, &format!("c{i}"), i * 10))
        .collect();
    let open: Vec<ZtRecord> = (100..103)
        .map(|i| ZtRecord {
            state: "open".into(),
            bytes_sent: None,
            bytes_received: None,
            ..outbound(i, 50000 + i as u16, &format!("o{i}"), 5)
        })
        .collect();
    let rows = merge(&[node("node-a", closed, open)]);
    assert_eq!(rows.len(), RECENT_CONNECTIONS + 3);
    assert_eq!(rows.iter().filter(|c| c.open).count(), 3);
    // The oldest closed ones went; what is left is in start order.
    assert!(!rows.iter().any(|c| c.src_addr.ends_with(":40000")));
    assert!(
        rows.windows(2)
            .all(|w| w[0].start_unix_ms <= w[1].start_unix_ms)
    );
    let text = crate::local::render::status(&status_with(vec![], rows));
    assert!(text.contains("open"), "{text}");
}

#[test]
fn rfc3339_times() {
    assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
    assert_eq!(rfc3339(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
    assert_eq!(rfc3339(1_709_164_800_000), "2024-02-29T00:00:00.000Z");
    assert_eq!(rfc3339(1_735_689_599_999), "2024-12-31T23:59:59.999Z");
}

#[test]
fn metrics_are_parsed_not_matched() {
    let text = "# TYPE istio_tcp_connections_opened counter\n\
        istio_tcp_connections_opened_total{reporter=\"source\",connection_security_policy=\"mutual_tls\"} 3\n\
        istio_tcp_connections_opened_total{connection_security_policy=\"mutual_tls\",x=\"a}b\"} 2\n\
        istio_tcp_connections_opened_total{reporter=\"destination\",connection_security_policy=\"none\"} 1\n\
        istio_tcp_connections_opened_total_other{connection_security_policy=\"none\"} 7\n\
        istio_tcp_connections_closed_total{connection_security_policy=\"none\"} 9\n";
    let m = opened_by_policy(text);
    assert_eq!(m.get("mutual_tls"), Some(&5));
    assert_eq!(m.get("none"), Some(&1));
    assert_eq!(m.len(), 2);
}

// ------------------------------------------------------------ render

fn pod(
    name: &str,
    mesh: Mesh,
    ambient: bool,
    mode: &str,
    enrolled: Option<bool>,
    zt: &[(&str, Option<&str>)],
) -> PodStatus {
    PodStatus {
        namespace: "mesh".into(),
        name: name.into(),
        node: "node-a".into(),
        ip: Ipv4Addr::new(10, 20, 1, 10),
        netns: format!("t-mesh-{name}"),
        ambient,
        dataplane_mode: mode.into(),
        in_config: true,
        enrolled,
        unserved: false,
        ztunnels: zt
            .iter()
            .map(|(n, p)| (n.to_string(), p.map(str::to_string)))
            .collect(),
        mesh,
        app: None,
        app_running: None,
    }
}

fn status_with(pods: Vec<PodStatus>, connections: Vec<Connection>) -> Status {
    let proc_ = ProcStatus {
        pid: Some(1),
        alive: true,
        log: None,
    };
    Status {
        name: "t".into(),
        state_dir: "/s".into(),
        config_dir: "/c".into(),
        log_dir: "/s/logs".into(),
        phase: Phase::Ready,
        control: ControlStatus {
            process: proc_.clone(),
            ready: true,
            xds_tls_addr: None,
            monitoring_addr: None,
        },
        nodes: vec![],
        pods,
        connections,
        config_errors: vec![],
        waypoint_controller: proc_,
        waypoints: vec![],
        waypoints_skipped: vec![],
        sidecars: vec![],
    }
}

#[test]
fn the_mesh_column_says_what_the_live_sources_say() {
    let hbone = [("node-a", Some("HBONE")), ("node-b", Some("HBONE"))];
    let tcp = [("node-a", Some("TCP")), ("node-b", Some("TCP"))];
    let pods = vec![
        pod("in", Mesh::Enrolled, true, "ambient", Some(true), &hbone),
        pod("out", Mesh::NotEnrolled, false, "none", Some(false), &tcp),
        // Relabelled to none; the node agent still redirects it.
        pod("leaving", Mesh::Disagree, false, "none", Some(true), &tcp),
        // Back to ambient; one ztunnel not there yet.
        pod(
            "coming",
            Mesh::Disagree,
            true,
            "ambient",
            Some(true),
            &[("node-a", Some("HBONE")), ("node-b", Some("TCP"))],
        ),
    ];
    let text = crate::local::render::status(&status_with(pods, vec![]));
    let line = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("mesh/{name} ")))
            .unwrap_or_else(|| panic!("no row for {name}:\n{text}"))
            .to_string()
    };
    let mesh_of = |name: &str| line(name).split_whitespace().nth(3).map(str::to_string);
    assert_eq!(mesh_of("in").as_deref(), Some("enrolled"), "{text}");
    assert_eq!(mesh_of("out").as_deref(), Some("no"), "{text}");
    assert!(
        line("leaving").contains("DISAGREE (labels say none; node agent: enrolled; ztunnels: TCP)"),
        "{text}"
    );
    assert!(
        line("coming").contains(
            "DISAGREE (labels say ambient; node agent: enrolled; ztunnels: HBONE on node-a, TCP on node-b)"
        ),
        "{text}"
    );
    assert!(
        text.contains("take") || text.contains("takes a second"),
        "{text}"
    );
    // The old contradiction cannot be printed any more.
    assert!(
        !text.contains("NOT ENROLLED (labels say ambient)"),
        "{text}"
    );
}

#[test]
fn sidecar_pods_have_their_own_verdict_and_table() {
    let zt = |p: Option<&str>| -> BTreeMap<String, Option<String>> {
        [("node-a".to_string(), p.map(str::to_string))].into()
    };
    assert_eq!(
        sidecar_verdict(Some(false), &zt(Some("HBONE"))),
        Mesh::Sidecar
    );
    assert_eq!(sidecar_verdict(None, &zt(Some("HBONE"))), Mesh::Sidecar);
    // Redirected by the node agent too, or not tunnelled to: not right.
    assert_eq!(
        sidecar_verdict(Some(true), &zt(Some("HBONE"))),
        Mesh::Disagree
    );
    assert_eq!(
        sidecar_verdict(Some(false), &zt(Some("TCP"))),
        Mesh::Disagree
    );

    let sidecar = |pod: &str, ready: bool| SidecarStatus {
        pod: pod.into(),
        node: "node-a".into(),
        ip: "10.20.1.10".parse().unwrap(),
        agent_pid: Some(42),
        agent_running: true,
        relay_running: ready,
        ready,
        readiness: if ready {
            "ready".into()
        } else {
            "503: no certificate".into()
        },
        log: None,
    };
    let mut s = status_with(vec![], vec![]);
    s.sidecars = vec![sidecar("legacy/web", true), sidecar("legacy/db", false)];
    assert!(!s.healthy());
    assert!(s.sidecar("legacy/web").is_some_and(|c| c.ready));
    let text = crate::local::render::status(&s);
    assert!(text.contains("SIDECAR POD"), "{text}");
    let line = |pod: &str| {
        text.lines()
            .find(|l| l.starts_with(pod))
            .unwrap_or_default()
    };
    assert!(
        line("legacy/web").contains("42 running") && line("legacy/web").contains("ready"),
        "{text}"
    );
    assert!(
        line("legacy/db").contains("NOT READY (503: no certificate)")
            && line("legacy/db").contains("RELAY"),
        "{text}"
    );
    s.sidecars.pop();
    assert!(s.healthy());
}
