//! The data plane end to end, in network namespaces this test builds: two
//! nodes joined by a bridge, pods on each, a ztunnel per node (in process,
//! its per-pod sockets made inside the pods' namespaces), pods handed over
//! ZDS by an in-test node agent that installs the redirection rules, and
//! the control plane serving YAML written for the bed.
//!
//! STRICT, impostor and open-proxy checks live in `security.rs` (over IPv4
//! and IPv6); dual-stack parity in `dual_stack.rs`.
//!
//! Needs root, `ip` and `iptables`; prints SKIP and passes otherwise.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ambit_tests::meshbed::{MeshBed, PodSpec, WAIT, metric_sum};
use ambit_tests::netbed::{self, Capture};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::timeout;

const VIP: &str = "10.96.0.10";

fn services() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: server\n  namespace: ai\nspec:\n  \
         clusterIP: {VIP}\n  selector: {{app: server}}\n  ports:\n  - {{name: tcp, port: 80, targetPort: 8080}}\n"
    )
}

/// client (node 0), server-0 (node 1), server-1 (node 0), all in `ai`.
fn basic_pods() -> Vec<PodSpec> {
    vec![
        PodSpec::mesh("client", "ai", 0, "client"),
        PodSpec::mesh("server-0", "ai", 1, "server"),
        PodSpec::mesh("server-1", "ai", 0, "server"),
        PodSpec::plain("legacy", "legacy", 0, "legacy"),
    ]
}

async fn bed(pods: &[PodSpec], extra: &str) -> Option<MeshBed> {
    let mut bed = MeshBed::new(2, pods).unwrap();
    bed.start(extra).await.unwrap();
    Some(bed)
}

/// Writes `msg`, reads the echo, returns it.
async fn echo_once(bed: &MeshBed, from: &str, dst: SocketAddr, msg: &[u8]) -> Vec<u8> {
    let mut s = bed.connect(from, dst).await.unwrap();
    timeout(WAIT, async {
        s.write_all(msg).await.unwrap();
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got).await.unwrap();
        got
    })
    .await
    .expect("echo in time")
}

/// Whether a connection from `from` to `dst` is refused: no echo comes back.
async fn refused(bed: &MeshBed, from: &str, dst: SocketAddr) -> bool {
    let Ok(mut s) = bed.connect(from, dst).await else {
        return true;
    };
    let r = timeout(WAIT, async {
        s.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await
    })
    .await
    .expect("refusal or echo in time");
    r.is_err()
}

fn marker(tag: &str) -> Vec<u8> {
    format!("AMBIT-SECRET-{tag}-{:016x}", rand::random::<u64>()).into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_through_vip_and_pod_ip_is_mtls_on_the_wire() {
    if !netbed::can_run("echo_through_vip_and_pod_ip_is_mtls_on_the_wire") {
        return;
    }
    let Some(bed) = bed(&basic_pods(), &services()).await else {
        return;
    };
    let _s0 = bed.echo("server-0", 8080).await.unwrap();
    let _s1 = bed.echo("server-1", 8080).await.unwrap();
    let capture = Capture::start(bed.cluster.lan_netns()).unwrap();

    let cross = SocketAddr::new(bed.ip("server-0").into(), 8080);
    let same = SocketAddr::new(bed.ip("server-1").into(), 8080);
    let vip: SocketAddr = format!("{VIP}:80").parse().unwrap();
    let mut secrets = Vec::new();
    for (dst, tag) in [
        (cross, "cross"),
        (same, "same"),
        (vip, "vip1"),
        (vip, "vip2"),
    ] {
        let m = marker(tag);
        assert_eq!(
            echo_once(&bed, "client", dst, &m).await,
            m,
            "echo via {tag}"
        );
        secrets.push(m);
    }
    let wire = capture.stop();
    assert!(
        wire.len() > 1000,
        "the capture saw the HBONE traffic ({} bytes)",
        wire.len()
    );
    for m in &secrets {
        assert!(
            !netbed::capture::contains(&wire, m),
            "plaintext {} crossed the link between nodes",
            String::from_utf8_lossy(m)
        );
    }

    // Both ends counted the cross-node connection as mTLS, with Istio's labels.
    let src = bed.metrics(0).await.unwrap();
    let opened = "istio_tcp_connections_opened_total";
    assert!(
        metric_sum(
            &src,
            opened,
            &[
                ("reporter", "source"),
                ("destination_workload_namespace", "ai"),
                ("connection_security_policy", "mutual_tls"),
                ("source_principal", "spiffe://cluster.local/ns/ai/sa/client"),
            ]
        ) >= 4.0,
        "source metrics:\n{src}"
    );
    assert!(
        metric_sum(
            &src,
            opened,
            &[("destination_service", "server.ai.svc.cluster.local")]
        ) >= 2.0,
        "VIP connections carry destination_service:\n{src}"
    );
    let dst = bed.metrics(1).await.unwrap();
    assert!(
        metric_sum(
            &dst,
            "istio_tcp_received_bytes_total",
            &[
                ("reporter", "destination"),
                ("source_principal", "spiffe://cluster.local/ns/ai/sa/client"),
                ("connection_security_policy", "mutual_tls"),
            ]
        ) > 0.0,
        "destination metrics:\n{dst}"
    );
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn app_sees_the_original_source_ip_and_half_close_works() {
    if !netbed::can_run("app_sees_the_original_source_ip_and_half_close_works") {
        return;
    }
    let Some(bed) = bed(&basic_pods(), &services()).await else {
        return;
    };
    let _who = bed.whoami("server-0", 8081).await.unwrap();
    let _echo = bed.echo("server-0", 8080).await.unwrap();

    let dst = SocketAddr::new(bed.ip("server-0").into(), 8081);
    let mut s = bed.connect("client", dst).await.unwrap();
    let mut line = Vec::new();
    timeout(WAIT, async {
        let mut b = [0u8; 1];
        while s.read_exact(&mut b).await.is_ok() && b[0] != b'\n' {
            line.push(b[0]);
        }
    })
    .await
    .unwrap();
    let seen: SocketAddr = String::from_utf8(line).unwrap().parse().unwrap();
    assert_eq!(seen.ip(), std::net::IpAddr::from(bed.ip("client")));

    // Half-close: shut our write side, still read the whole echo.
    let payload: Vec<u8> = (0..256 * 1024).map(|i| (i % 251) as u8).collect();
    let dst = SocketAddr::new(bed.ip("server-0").into(), 8080);
    let s = bed.connect("client", dst).await.unwrap();
    let (mut r, mut w) = s.into_split();
    let p = payload.clone();
    let writer = tokio::spawn(async move {
        w.write_all(&p).await.unwrap();
        w.shutdown().await.unwrap();
        w
    });
    let mut got = Vec::new();
    timeout(WAIT, r.read_to_end(&mut got))
        .await
        .unwrap()
        .unwrap();
    let _w = writer.await.unwrap();
    assert_eq!(got.len(), payload.len());
    assert!(got == payload, "echo after half-close differs");
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_connections_share_the_pool() {
    if !netbed::can_run("thousand_concurrent_connections_share_the_pool") {
        return;
    }
    raise_fd_limit();
    let Some(bed) = bed(&basic_pods(), &services()).await else {
        return;
    };
    let _s0 = bed.echo("server-0", 8080).await.unwrap();
    let dst = SocketAddr::new(bed.ip("server-0").into(), 8080);
    let bed = Arc::new(bed);
    // Open all first, so they really are concurrent.
    let mut conns = Vec::new();
    for _ in 0..1000 {
        conns.push(bed.connect("client", dst).await.unwrap());
    }
    let tasks: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(i, mut s)| {
            tokio::spawn(async move {
                let msg = format!("connection {i:04} {}", "x".repeat(1000));
                s.write_all(msg.as_bytes()).await.unwrap();
                let mut got = vec![0u8; msg.len()];
                s.read_exact(&mut got).await.unwrap();
                assert_eq!(got, msg.as_bytes(), "connection {i}");
                s
            })
        })
        .collect();
    let mut open = Vec::new();
    for t in tasks {
        open.push(
            timeout(WAIT * 2, t)
                .await
                .expect("all echoes in time")
                .unwrap(),
        );
    }
    let stats = bed.ztunnel(0).pool().stats();
    let conns = stats.connections();
    assert!(
        (10..=12).contains(&conns),
        "1,000 streams at 100 per connection share ~10 pooled connections, got {conns}"
    );
    assert_eq!(stats.active_streams(), 1000);
    drop(open);
    let bed = Arc::into_inner(bed).expect("no other owner");
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_accepting_and_drains_live_connections() {
    if !netbed::can_run("shutdown_stops_accepting_and_drains_live_connections") {
        return;
    }
    let Some(mut bed) = bed(&basic_pods(), &services()).await else {
        return;
    };
    let _s0 = bed.echo("server-0", 8080).await.unwrap();
    let dst = SocketAddr::new(bed.ip("server-0").into(), 8080);
    let mut live = bed.connect("client", dst).await.unwrap();
    let m = marker("before");
    timeout(WAIT, async {
        live.write_all(&m).await.unwrap();
        let mut b = vec![0u8; m.len()];
        live.read_exact(&mut b).await.unwrap();
    })
    .await
    .unwrap();

    // SIGTERM-equivalent on the server's node.
    let zt = bed.take_ztunnel(1).unwrap();
    let started = tokio::time::Instant::now();
    let stopping = tokio::spawn(zt.shutdown());
    // New connections to the draining node are refused...
    let deadline = tokio::time::Instant::now() + WAIT;
    while !refused(&bed, "client", dst).await {
        assert!(tokio::time::Instant::now() < deadline, "still accepting");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ...while the live one keeps working.
    let m = marker("during");
    timeout(WAIT, async {
        live.write_all(&m).await.unwrap();
        let mut b = vec![0u8; m.len()];
        live.read_exact(&mut b).await.unwrap();
        assert_eq!(b, m);
    })
    .await
    .unwrap();
    // At the drain deadline it is closed and the ztunnel is gone.
    let limit = ambit_ztunnel::drain::DRAIN_DEADLINE + Duration::from_secs(3);
    timeout(limit, stopping)
        .await
        .expect("stopped in time")
        .unwrap();
    let mut b = [0u8; 8];
    let n = timeout(WAIT, live.read(&mut b)).await.expect("closed");
    assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    assert!(started.elapsed() >= ambit_ztunnel::drain::DRAIN_DEADLINE);
    bed.shutdown().await;
}

fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < 16384
    {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard.min(65536), hard);
    }
}
