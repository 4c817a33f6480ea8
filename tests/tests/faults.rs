//! Fault tests (issue 14, the slow suite): each injects one fault found in
//! a real fault run while traffic flows, and asserts that nothing that
//! could have been kept was lost.
//!
//! * process-level faults on real binaries, through `ambitctl local`'s
//!   library (`signal_process`, `start_process_again`): the control plane
//!   killed for 60 s; a ztunnel SIGKILLed and restarted; a node agent
//!   killed and restarted mid-connection;
//! * in-process beds for the rest: a ztunnel replaced by another while
//!   connections sit in TIME_WAIT (enrollbed), the CA unreachable across a
//!   renewal, broken YAML in the served directory, a peer ztunnel that
//!   accepts TCP and never answers (meshbed).
//!
//! The tests are independent (own namespaces, own cluster names) and run
//! in parallel; the 60 s outage is the floor of the file's runtime. Needs
//! root, `ip`, `iptables`, the CNI reference plugins and the workspace's
//! binaries; prints SKIP and passes otherwise. Every bed is torn down on
//! drop, also when an assertion fails.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use ambit_inpod::PodNetns;
use ambit_tests::enrollbed::{self, EnrollBed};
use ambit_tests::meshbed::{MeshBed, PodSpec, WAIT, metric_sum};
use ambit_tests::netbed;
use ambit_tests::traffic::{EchoServer, Tally, Traffic, echo_once};
use ambitctl::local::{self, DownOnDrop, LocalCluster, Role, UpOptions};
use nix::sys::signal::Signal;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The control plane's outage in the first test.
const OUTAGE: Duration = Duration::from_secs(60);

fn assert_nothing_lost(what: &str, (long, fresh): &(Tally, Tally), min_fresh: u64) {
    println!(
        "{what}: long-lived {} round trips, {} lost; new connections {} ok, {} failed",
        long.ok, long.failed, fresh.ok, fresh.failed
    );
    assert_eq!(
        long.failed, 0,
        "{what}: long-lived connections lost: {:?}",
        long.errors
    );
    assert_eq!(
        fresh.failed, 0,
        "{what}: new connections failed: {:?}",
        fresh.errors
    );
    assert!(long.ok > 0, "{what}: no long-lived traffic ran");
    assert!(
        fresh.ok >= min_fresh,
        "{what}: only {} new connections ran",
        fresh.ok
    );
}

/// Polls `check` every 20 ms until it holds; fails after `limit`.
async fn until<F, Fut>(what: &str, limit: Duration, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !check().await {
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

// ------------------------------------------------------ ambitctl local beds

/// `mesh` is ambient; each `(name, node, ip)` is a pod of it.
fn mesh_yaml(pods: &[(&str, &str, &str)]) -> String {
    let mut y = String::from(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: mesh\n  labels: {istio.io/dataplane-mode: ambient}\n---\n",
    );
    for (name, node, ip) in pods {
        y.push_str(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: mesh\n  labels: {{app: {name}}}\nspec:\n  nodeName: {node}\nstatus:\n  podIP: {ip}\n---\n"
        ));
    }
    y
}

struct LocalBed {
    cluster: DownOnDrop,
    _config: tempfile::TempDir,
    _state: tempfile::TempDir,
}

fn local_up(test: &str, yaml: &str) -> Option<LocalBed> {
    let bins = enrollbed::local_bin_dir(test)?;
    let config = tempfile::tempdir().unwrap();
    std::fs::write(config.path().join("mesh.yaml"), yaml).unwrap();
    let state = tempfile::tempdir().unwrap();
    let mut opts = UpOptions::new(config.path(), bins);
    opts.name = format!("f{:06x}", rand::random::<u32>() & 0xff_ffff);
    opts.state_dir = Some(state.path().join("state"));
    let started = Instant::now();
    let cluster = local::up(&opts)
        .unwrap_or_else(|e| panic!("{test}: local up failed: {e}"))
        .down_on_drop();
    println!("{test}: local up took {:?}", started.elapsed());
    Some(LocalBed {
        cluster,
        _config: config,
        _state: state,
    })
}

fn pod_ns(c: &LocalCluster, key: &str) -> PodNetns {
    let pod = c.pod(key).unwrap();
    PodNetns::open(Path::new("/var/run/netns").join(&pod.netns)).unwrap()
}

fn addr(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse::<IpAddr>().unwrap(), port)
}

/// Whether the control plane serves every ztunnel and each has ACKed
/// everything it was sent (`/debug/connections`).
async fn control_resynced(monitoring: SocketAddr, ztunnels: usize) -> bool {
    let Ok(body) = ambit_tests::get(monitoring, "/debug/connections").await else {
        return false;
    };
    let Ok(serde_json::Value::Array(proxies)) = serde_json::from_str(&body) else {
        return false;
    };
    let synced = proxies
        .iter()
        .filter(|p| p["kind"] == "ztunnel")
        .filter(|p| {
            p["types"].as_object().is_some_and(|types| {
                !types.is_empty()
                    && types.values().all(|t| {
                        let sent = t["last_nonce_sent"].as_str().unwrap_or("");
                        !sent.is_empty() && t["last_nonce_acked"].as_str() == Some(sent)
                    })
            })
        })
        .count();
    synced == ztunnels
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_down_for_60s_loses_nothing_and_ztunnels_resync_fast() {
    let test = "control_plane_down_for_60s_loses_nothing_and_ztunnels_resync_fast";
    let yaml = mesh_yaml(&[
        ("client", "node-a", "10.40.1.10"),
        ("server", "node-b", "10.40.2.10"),
    ]);
    let Some(mut bed) = tokio::task::block_in_place(|| local_up(test, &yaml)) else {
        return;
    };
    let server = addr("10.40.2.10", 8080);
    let _echo = EchoServer::start(&pod_ns(&bed.cluster, "mesh/server"), 8080).unwrap();
    let client = pod_ns(&bed.cluster, "mesh/client");
    until("the first meshed echo", WAIT, || async {
        echo_once(&client, server).await.is_ok()
    })
    .await;
    let monitoring = bed.cluster.state.control.as_ref().unwrap().monitoring_addr;
    assert!(control_resynced(monitoring, 2).await);

    let traffic = Traffic::start(client.clone(), server, 4, Duration::from_millis(250))
        .await
        .unwrap();
    tokio::task::block_in_place(|| {
        bed.cluster
            .signal_process(Role::Control, None, Signal::SIGKILL)
            .unwrap()
    });
    let down_at = Instant::now();
    // The outage itself is the fault: it lasts what the scenario says.
    tokio::time::sleep(OUTAGE).await;
    let mid = traffic.tally();
    assert_eq!(
        mid.0.failed + mid.1.failed,
        0,
        "lost during the outage: {mid:?}"
    );
    // ztunnels stay ready on their last config.
    for n in bed.cluster.state.nodes.clone() {
        let ready = ambit_tests::get(n.readiness_addr, "/healthz/ready").await;
        assert!(
            ready.is_ok(),
            "ztunnel of {} not ready in the outage: {ready:?}",
            n.name
        );
    }

    tokio::task::block_in_place(|| {
        bed.cluster
            .start_process_again(Role::Control, None)
            .unwrap()
    });
    let back_at = Instant::now();
    until("the control plane to be ready again", WAIT, || async {
        ambit_tests::get(monitoring, "/ready").await.is_ok()
    })
    .await;
    let ready_at = Instant::now();
    until("both ztunnels to reconnect and ACK", WAIT, || {
        control_resynced(monitoring, 2)
    })
    .await;
    let resync = ready_at.elapsed();
    println!(
        "control plane: down {:?}; ready {:?} after its restart; ztunnels resynced {resync:?} after it was ready",
        back_at - down_at,
        ready_at - back_at
    );
    assert!(
        resync <= Duration::from_secs(5),
        "ztunnels resynced {resync:?} after the control plane returned"
    );
    traffic.flows_on(5, WAIT).await.unwrap();
    let (long, fresh) = traffic.finish().await;
    assert_nothing_lost("control plane outage", &(long, fresh), OUTAGE.as_secs() * 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ztunnel_crash_and_agent_restart_lose_nothing_through_other_nodes() {
    let test = "ztunnel_crash_and_agent_restart_lose_nothing_through_other_nodes";
    let yaml = mesh_yaml(&[
        ("client-a", "node-a", "10.41.1.10"),
        ("server-b", "node-b", "10.41.2.10"),
        ("client-c", "node-c", "10.41.3.10"),
    ]);
    let Some(mut bed) = tokio::task::block_in_place(|| local_up(test, &yaml)) else {
        return;
    };
    let server = addr("10.41.2.10", 8080);
    let server_ns = pod_ns(&bed.cluster, "mesh/server-b");
    let _echo = EchoServer::start(&server_ns, 8080).unwrap();
    let (client_a, client_c) = (
        pod_ns(&bed.cluster, "mesh/client-a"),
        pod_ns(&bed.cluster, "mesh/client-c"),
    );
    for c in [&client_a, &client_c] {
        until("the first meshed echo", WAIT, || async {
            echo_once(c, server).await.is_ok()
        })
        .await;
    }
    // node-c -> node-b traffic must not notice anything below.
    let traffic = Traffic::start(client_c.clone(), server, 4, Duration::from_millis(200))
        .await
        .unwrap();

    // 1. The node agent of the server's node is killed and restarted
    //    while connections to its pod are open.
    let node_b = bed.cluster.state.node("node-b").unwrap().clone();
    let restarted = tokio::task::block_in_place(|| {
        bed.cluster
            .signal_process(Role::NodeAgent, Some("node-b"), Signal::SIGKILL)
            .unwrap();
        let at = Instant::now();
        bed.cluster
            .start_process_again(Role::NodeAgent, Some("node-b"))
            .unwrap();
        at
    });
    until("the restarted agent to listen", WAIT, || async {
        std::os::unix::net::UnixStream::connect(&node_b.cni_socket).is_ok()
    })
    .await;
    let agent_back = restarted.elapsed();
    println!("node agent: listening again {agent_back:?} after its restart");
    let server_netns =
        Path::new("/var/run/netns").join(&bed.cluster.pod("mesh/server-b").unwrap().netns);
    assert!(
        tokio::task::block_in_place(|| ambit_cni::redirect::is_installed(&server_netns)).unwrap(),
        "the restarted agent left the pod's redirection alone"
    );
    traffic.flows_on(3, WAIT).await.unwrap();
    let mid = traffic.tally();
    assert_eq!(
        mid.0.failed + mid.1.failed,
        0,
        "lost across the agent restart: {mid:?}"
    );

    // 2. node-a's ztunnel is SIGKILLed and started again.
    let restarted = tokio::task::block_in_place(|| {
        bed.cluster
            .signal_process(Role::Ztunnel, Some("node-a"), Signal::SIGKILL)
            .unwrap();
        let at = Instant::now();
        bed.cluster
            .start_process_again(Role::Ztunnel, Some("node-a"))
            .unwrap();
        at
    });
    until(
        "client-a's traffic through the new ztunnel",
        WAIT,
        || async { echo_once(&client_a, server).await.is_ok() },
    )
    .await;
    let served_again = restarted.elapsed();
    println!("ztunnel SIGKILL: the pod's traffic flows again {served_again:?} after the restart");
    assert!(
        served_again < Duration::from_secs(2),
        "pods served again after {served_again:?}"
    );
    let node_a = bed.cluster.state.node("node-a").unwrap().clone();
    until("the restarted ztunnel to be ready", WAIT, || async {
        ambit_tests::get(node_a.readiness_addr, "/healthz/ready")
            .await
            .is_ok()
    })
    .await;
    traffic.flows_on(5, WAIT).await.unwrap();
    let tallies = traffic.finish().await;
    assert_nothing_lost(
        "agent restart and ztunnel crash (node-c -> node-b)",
        &tallies,
        5,
    );
    let status = tokio::task::block_in_place(|| bed.cluster.status());
    for p in &status.pods {
        assert_eq!(
            p.enrolled,
            Some(true),
            "{}/{} enrolled",
            p.namespace,
            p.name
        );
        assert!(!p.unserved, "{}/{} black-holed", p.namespace, p.name);
    }
}

// ----------------------------------------------------------- enrollbed

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ztunnel_replaced_while_connections_sit_in_time_wait_black_holes_no_pod() {
    let test = "ztunnel_replaced_while_connections_sit_in_time_wait_black_holes_no_pod";
    if !enrollbed::can_run(test) {
        return;
    }
    let mut bed = EnrollBed::start(2, &[("ai", true)]).await.unwrap();
    let client0 = bed.add_pod(0, "client0", "ai", "client").await.unwrap();
    let server0 = bed.add_pod(0, "server0", "ai", "server").await.unwrap();
    let client1 = bed.add_pod(1, "client1", "ai", "client").await.unwrap();
    let server1 = bed.add_pod(1, "server1", "ai", "server").await.unwrap();
    for n in [0, 1] {
        for p in [&client0, &server0, &client1, &server1] {
            bed.wait_workload(n, p.net.ip).await.unwrap();
        }
    }
    let _e0 = EchoServer::start(&server0.net.open().unwrap(), 8080).unwrap();
    let _e1 = EchoServer::start(&server1.net.open().unwrap(), 8080).unwrap();
    // Node 1's traffic, which the replacement on node 0 must not touch.
    let traffic = Traffic::start(
        client1.net.open().unwrap(),
        server1.net.addr(8080),
        4,
        Duration::from_millis(100),
    )
    .await
    .unwrap();

    // TIME_WAIT on client0's :15001: the server speaks and closes first.
    let bye = netbed::listen(&server0.net, 9090).unwrap();
    let bye_task = tokio::spawn(async move {
        while let Ok((mut s, _)) = bye.accept().await {
            let _ = s.write_all(b"bye").await;
        }
    });
    let client0_ns = client0.net.open().unwrap();
    for _ in 0..20 {
        let mut s = ambit_tests::traffic::connect(&client0_ns, server0.net.addr(9090))
            .await
            .unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(WAIT, s.read_to_end(&mut got))
            .await
            .unwrap()
            .unwrap();
    }
    bye_task.abort();
    let netns = client0.net.netns.clone();
    until("TIME_WAIT sockets on client0's :15001", WAIT, || {
        let out = netbed::netns_exec(
            &netns,
            &["ss", "-Htan", "state", "time-wait", "( sport = :15001 )"],
        )
        .unwrap_or_default();
        async move { out.lines().count() > 0 }
    })
    .await;

    let took = bed.replace_ztunnel(0).await.unwrap();
    println!("ztunnel replacement with TIME_WAIT: every pod served again after {took:?}");
    assert!(
        took < Duration::from_secs(2),
        "pods served again after {took:?}"
    );
    assert!(bed.ztunnel(0).unserved().borrow().is_empty());
    let started = Instant::now();
    echo_once(&client0_ns, server0.net.addr(8080))
        .await
        .unwrap();
    println!(
        "first connection through the new ztunnel took {:?}",
        started.elapsed()
    );
    for n in [0, 1] {
        let pods = bed.agent(n).pods().await;
        assert!(
            pods.iter().all(|r| r.enrolled && r.served),
            "node {n}: a pod is not served: {pods:?}"
        );
    }
    traffic.flows_on(5, WAIT).await.unwrap();
    let tallies = traffic.finish().await;
    assert_nothing_lost("ztunnel replacement on another node", &tallies, 5);
    bed.shutdown().await;
}

// -------------------------------------------------------------- meshbed

fn two_node_pods() -> Vec<PodSpec> {
    vec![
        PodSpec::mesh("client", "ai", 0, "client"),
        PodSpec::mesh("server", "ai", 1, "server"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ca_unreachable_across_a_renewal_keeps_the_old_certificate_until_expiry() {
    let test = "ca_unreachable_across_a_renewal_keeps_the_old_certificate_until_expiry";
    if !netbed::can_run(test) {
        return;
    }
    let mut bed = MeshBed::new(2, &two_node_pods()).unwrap();
    // Short-lived certificates: renewal due after ~half of 12 s.
    bed.tune_control = |cfg| cfg.max_cert_ttl_secs = 12;
    bed.start("").await.unwrap();
    let _echo = EchoServer::start(&bed.pod("server").open().unwrap(), 8080).unwrap();
    let client_ns = bed.pod("client").open().unwrap();
    let server = bed.pod("server").addr(8080);
    until("the first meshed echo", WAIT, || async {
        echo_once(&client_ns, server).await.is_ok()
    })
    .await;
    let client_id = ambit_ztunnel::identity::Identity::new("cluster.local", "ai", "client");
    let old = bed
        .ztunnel(0)
        .certificates()
        .fetch(&client_id)
        .await
        .unwrap();
    let expires = Instant::now() + old.time_to_expiry();
    println!(
        "certificate {} expires in {:?}",
        old.serial_hex(),
        old.time_to_expiry()
    );

    bed.stop_control_plane().await.unwrap();
    // The renewal is tried and fails: the CA is gone.
    let failed_after = until("a failed renewal", old.time_to_expiry(), || async {
        let m = bed.metrics(0).await.unwrap_or_default();
        metric_sum(&m, "ztunnel_ca_requests_total", &[("result", "error")]) >= 1.0
    })
    .await;
    println!("renewal failed {failed_after:?} after the CA went away");
    // Until it expires the old certificate keeps serving new connections.
    let mut checks = 0;
    while Instant::now() + Duration::from_secs(2) < expires {
        echo_once(&client_ns, server).await.unwrap();
        let current = bed
            .ztunnel(0)
            .certificates()
            .fetch(&client_id)
            .await
            .unwrap();
        assert_eq!(
            current.serial_hex(),
            old.serial_hex(),
            "still the old certificate"
        );
        checks += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(checks > 0, "no check ran before the expiry");

    bed.restart_control_plane().await.unwrap();
    let renewed = until("a renewed certificate", Duration::from_secs(60), || async {
        let c = bed.ztunnel(0).certificates().fetch(&client_id).await;
        c.is_ok_and(|c| c.serial_hex() != old.serial_hex())
    })
    .await;
    println!("renewed {renewed:?} after the CA returned ({checks} checks on the old one)");
    until("traffic on the renewed certificates", WAIT, || async {
        echo_once(&client_ns, server).await.is_ok()
    })
    .await;
    bed.shutdown().await;
}

const LATE_VIP: &str = "10.96.0.77";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_yaml_in_the_served_directory_unmeshes_nothing() {
    let test = "broken_yaml_in_the_served_directory_unmeshes_nothing";
    if !netbed::can_run(test) {
        return;
    }
    let mut bed = MeshBed::new(2, &two_node_pods()).unwrap();
    bed.start("").await.unwrap();
    let _echo = EchoServer::start(&bed.pod("server").open().unwrap(), 8080).unwrap();
    let client_ns = bed.pod("client").open().unwrap();
    let server = bed.pod("server").addr(8080);
    until("the first meshed echo", WAIT, || async {
        echo_once(&client_ns, server).await.is_ok()
    })
    .await;
    let reader = bed.ztunnel(0).state_reader();
    let workloads = reader.load().workload_count();
    let traffic = Traffic::start(client_ns.clone(), server, 2, Duration::from_millis(100))
        .await
        .unwrap();

    let dir = bed.config_dir().to_path_buf();
    // Half-written: a writer still has it open.
    let mut half = std::fs::File::create(dir.join("half.yaml")).unwrap();
    std::io::Write::write_all(
        &mut half,
        b"apiVersion: v1\nkind: Service\nmetadata:\n  name: half\n  namespace: ai\nspec:\n  clus",
    )
    .unwrap();
    // Truncated mid-document and closed.
    std::fs::write(
        dir.join("truncated.yaml"),
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: ai\n  labels: {istio.io/dataplane-mode: amb",
    )
    .unwrap();
    // A second definition of the served pod, moved to another address and
    // out of the mesh.
    std::fs::write(
        dir.join("duplicate.yaml"),
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: server\n  namespace: ai\n  labels: {app: other, istio.io/dataplane-mode: none}\nspec:\n  nodeName: node-1\n  serviceAccountName: other\nstatus:\n  podIP: 10.99.0.9\n",
    )
    .unwrap();
    // 100,000 levels deep.
    std::fs::write(
        dir.join("deep.yaml"),
        format!("a: {}{}\n", "[".repeat(100_000), "]".repeat(100_000)),
    )
    .unwrap();
    // And a good change alongside them, which must flow within 1 s.
    let written = Instant::now();
    bed.write_config(
        "late.yaml",
        &format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: late\n  namespace: ai\nspec:\n  \
             clusterIP: {LATE_VIP}\n  selector: {{app: server}}\n  ports:\n  - {{name: tcp, port: 80, targetPort: 8080}}\n"
        ),
    )
    .unwrap();
    let vip: IpAddr = LATE_VIP.parse().unwrap();
    let flowed = until("the good change to reach ztunnel", WAIT, || {
        let found = reader.load().service_by_vip("", vip).is_some();
        async move { found }
    })
    .await;
    println!(
        "broken YAML: the good change reached ztunnel {:?} after it was written",
        written.elapsed()
    );
    assert!(
        flowed <= Duration::from_secs(1),
        "a good change next to broken files took {flowed:?}"
    );
    echo_once(&client_ns, SocketAddr::new(vip, 80))
        .await
        .unwrap();
    let snap = reader.load();
    assert_eq!(snap.workload_count(), workloads, "no workload was lost");
    let server_ip = IpAddr::V4(bed.ip("server"));
    let w = snap
        .workload_by_ip("", server_ip)
        .expect("server still known at its address");
    assert_eq!(
        w.service_account, "server",
        "the serving definition was kept"
    );
    assert!(
        snap.workload_by_ip("", "10.99.0.9".parse().unwrap())
            .is_none()
    );
    drop(half);
    traffic.flows_on(5, WAIT).await.unwrap();
    let tallies = traffic.finish().await;
    assert_nothing_lost("broken YAML", &tallies, 5);
    let m = bed.metrics(1).await.unwrap();
    assert!(
        metric_sum(
            &m,
            "istio_tcp_connections_opened_total",
            &[
                ("reporter", "destination"),
                ("connection_security_policy", "mutual_tls")
            ]
        ) >= 5.0,
        "the traffic stayed mTLS:\n{m}"
    );
    bed.shutdown().await;
}

/// HBONE handshake bound of the ztunnels in the silent-peer test.
const HANDSHAKE_MS: u64 = 1500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_ztunnel_that_accepts_tcp_and_never_answers_fails_clearly_in_time() {
    let test = "a_peer_ztunnel_that_accepts_tcp_and_never_answers_fails_clearly_in_time";
    if !netbed::can_run(test) {
        return;
    }
    let mut pods = two_node_pods();
    // xDS says `ghost` is an HBONE pod on node 1, but its :15008 is a
    // listener that accepts and never says a word.
    let mut ghost = PodSpec::mesh("ghost", "ai", 1, "ghost");
    ghost.handover = false;
    pods.push(ghost);
    let mut bed = MeshBed::new(2, &pods).unwrap();
    bed.tune_ztunnel = |z| z.hbone_handshake_timeout_ms = HANDSHAKE_MS;
    bed.start("").await.unwrap();
    let silent = bed
        .pod("ghost")
        .open()
        .unwrap()
        .bind_listener("0.0.0.0:15008".parse().unwrap(), false)
        .unwrap();
    let silent = tokio::net::TcpListener::from_std(silent).unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = silent.accept().await {
            held.push(tcp);
        }
    });
    let _echo = EchoServer::start(&bed.pod("server").open().unwrap(), 8080).unwrap();
    let client_ns = bed.pod("client").open().unwrap();
    let server = bed.pod("server").addr(8080);
    until("the first meshed echo", WAIT, || async {
        echo_once(&client_ns, server).await.is_ok()
    })
    .await;
    let traffic = Traffic::start(client_ns.clone(), server, 2, Duration::from_millis(100))
        .await
        .unwrap();

    let started = Instant::now();
    let mut s = ambit_tests::traffic::connect(&client_ns, bed.pod("ghost").addr(8080))
        .await
        .unwrap();
    let read = tokio::time::timeout(WAIT, async {
        let _ = s.write_all(b"anyone?").await;
        let mut buf = [0u8; 8];
        s.read(&mut buf).await
    })
    .await
    .expect("the caller must not hang on a silent peer");
    let took = started.elapsed();
    println!("silent peer: the caller saw {read:?} after {took:?} (bound {HANDSHAKE_MS} ms)");
    assert!(
        matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "the caller sees a reset: {read:?}"
    );
    let bound = Duration::from_millis(HANDSHAKE_MS);
    assert!(
        took >= bound - Duration::from_millis(100) && took < bound + Duration::from_secs(2),
        "failed after {took:?} with a {bound:?} handshake bound"
    );
    let m = bed.metrics(0).await.unwrap();
    assert!(
        metric_sum(
            &m,
            "istio_tcp_connections_closed_total",
            &[
                ("reporter", "source"),
                ("response_flags", "CONNECT"),
                ("destination_workload", "ghost")
            ]
        ) >= 1.0,
        "the failure is counted as a connect failure:\n{m}"
    );
    holder.abort();
    traffic.flows_on(5, WAIT).await.unwrap();
    let tallies = traffic.finish().await;
    assert_nothing_lost("silent peer (other traffic)", &tallies, 5);
    bed.shutdown().await;
}
