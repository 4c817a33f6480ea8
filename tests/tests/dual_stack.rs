//! Dual-stack parity (issue 13): a pod pair with IPv4 and IPv6 addresses on
//! two nodes gets the same mesh over both families — mTLS on the wire (a
//! capture between the nodes sees no plaintext, and IPv6 packets did cross),
//! the original client address of the family used, and AuthorizationPolicy
//! evaluated on the IPv6 source as on the IPv4 one. The STRICT refusals for
//! both families are in `security.rs`. Needs root; SKIP otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, SocketAddr};

use ambit_tests::meshbed::{MeshBed, PodSpec, WAIT, metric_sum};
use ambit_tests::netbed::{self, Capture};
use tokio::io::AsyncReadExt;
use tokio::time::timeout;

/// DENY per family and port, by source block: the IPv6 client range may
/// not reach 8082, the IPv4 client range may not reach 8083.
const POLICIES: &str = "\
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-v6-8082, namespace: ai}
spec:
  selector: {matchLabels: {app: server}}
  action: DENY
  rules:
  - from: [{source: {ipBlocks: ['fd00:10:1::/64']}}]
    to: [{operation: {ports: ['8082']}}]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-v4-8083, namespace: ai}
spec:
  selector: {matchLabels: {app: server}}
  action: DENY
  rules:
  - from: [{source: {ipBlocks: ['10.10.1.0/24']}}]
    to: [{operation: {ports: ['8083']}}]
";

fn marker(tag: &str) -> Vec<u8> {
    format!("AMBIT-SECRET-{tag}-{:016x}", rand::random::<u64>()).into_bytes()
}

/// The first line a whoami server writes: the address it sees.
async fn seen_by_app(bed: &MeshBed, from: &str, dst: SocketAddr) -> SocketAddr {
    let mut s = bed.connect(from, dst).await.unwrap();
    let mut line = Vec::new();
    timeout(WAIT, async {
        let mut b = [0u8; 1];
        while s.read_exact(&mut b).await.is_ok() && b[0] != b'\n' {
            line.push(b[0]);
        }
    })
    .await
    .unwrap();
    String::from_utf8(line).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dual_stack_pods_get_the_same_mesh_over_ipv4_and_ipv6() {
    if !netbed::can_run("dual_stack_pods_get_the_same_mesh_over_ipv4_and_ipv6") {
        return;
    }
    let pods = [
        PodSpec::mesh("client", "ai", 0, "client"),
        PodSpec::mesh("server", "ai", 1, "server"),
    ];
    let mut bed = MeshBed::dual_stack(2, &pods).unwrap();
    bed.start(POLICIES).await.unwrap();
    let _apps = [
        bed.echo("server", 8080).await.unwrap(),
        bed.whoami("server", 8081).await.unwrap(),
        bed.echo("server", 8082).await.unwrap(),
        bed.echo("server", 8083).await.unwrap(),
    ];
    let families: [(IpAddr, IpAddr); 2] = [
        (bed.ip("client").into(), bed.ip("server").into()),
        (bed.ip6("client").into(), bed.ip6("server").into()),
    ];

    let capture = Capture::start(bed.cluster.lan_netns()).unwrap();
    let mut secrets = Vec::new();
    for (client, server) in families {
        let m = marker(if server.is_ipv6() { "v6" } else { "v4" });
        let dst = SocketAddr::new(server, 8080);
        assert_eq!(bed.echo_once("client", dst, &m).await.unwrap(), m, "{dst}");
        secrets.push(m);
        let seen = seen_by_app(&bed, "client", SocketAddr::new(server, 8081)).await;
        assert_eq!(seen.ip(), client, "the app sees the client's own address");
    }
    let wire = capture.stop();
    for m in &secrets {
        assert!(
            !netbed::contains(&wire, m),
            "plaintext {} crossed the link between nodes",
            String::from_utf8_lossy(m)
        );
    }
    assert!(
        netbed::contains(&wire, &bed.ip6("server").octets()),
        "IPv6 packets crossed the link ({} bytes captured)",
        wire.len()
    );
    // Both families went over HBONE: the client's ztunnel pooled a
    // connection to the server's 15008 at each of its addresses.
    let pooled: Vec<IpAddr> = bed
        .ztunnel(0)
        .pool()
        .stats()
        .keys
        .keys()
        .map(|k| k.dst_ip)
        .collect();
    for (_, server) in families {
        assert!(pooled.contains(&server), "no HBONE to {server}: {pooled:?}");
    }
    let dst_metrics = bed.metrics(1).await.unwrap();
    assert!(
        metric_sum(
            &dst_metrics,
            "istio_tcp_connections_opened_total",
            &[
                ("reporter", "destination"),
                ("connection_security_policy", "mutual_tls"),
                ("source_principal", "spiffe://cluster.local/ns/ai/sa/client"),
            ]
        ) >= 4.0,
        "{dst_metrics}"
    );

    // Policy sees the source address of the family used.
    let [(_, v4), (_, v6)] = families;
    bed.wait_refused("client", SocketAddr::new(v6, 8082), true)
        .await
        .unwrap();
    assert!(
        !bed.refused("client", SocketAddr::new(v4, 8082))
            .await
            .unwrap()
    );
    assert!(
        bed.refused("client", SocketAddr::new(v4, 8083))
            .await
            .unwrap()
    );
    assert!(
        !bed.refused("client", SocketAddr::new(v6, 8083))
            .await
            .unwrap()
    );
    let dst_metrics = bed.metrics(1).await.unwrap();
    for policy in ["ai/deny-v6-8082", "ai/deny-v4-8083"] {
        assert!(
            metric_sum(
                &dst_metrics,
                "ambit_authorization_denials_total",
                &[("policy", policy)]
            ) >= 1.0,
            "{policy} counted:\n{dst_metrics}"
        );
    }
    bed.shutdown().await;
}
