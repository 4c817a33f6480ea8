//! Authorization end to end in network namespaces (see `dataplane.rs` for
//! the bed): AuthorizationPolicy YAML served by the control plane, enforced
//! by the destination's ztunnel on identities proven by mTLS; a policy
//! change closes live connections it no longer allows; denials are counted
//! with the policy's name.
//!
//! Needs root, `ip` and `iptables`; prints SKIP and passes otherwise.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ambit_tests::meshbed::{MeshBed, PodSpec, WAIT, metric_sum};
use ambit_tests::netbed;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::timeout;

/// client and other (node 0) → server (node 1), all in `ai`.
fn pods() -> Vec<PodSpec> {
    vec![
        PodSpec::mesh("client", "ai", 0, "client"),
        PodSpec::mesh("other", "ai", 0, "other"),
        PodSpec::mesh("server", "ai", 1, "server"),
    ]
}

/// Deny by default in `ai`, then allow only `client` to reach `server`
/// on 8080 (and anyone on 9090, to show ports are matched).
const POLICIES: &str = "\
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: allow-nothing, namespace: ai}
spec: {}
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: client-to-server, namespace: ai}
spec:
  selector: {matchLabels: {app: server}}
  action: ALLOW
  rules:
  - from: [{source: {principals: [cluster.local/ns/ai/sa/client]}}]
    to: [{operation: {ports: ['8080']}}]
  - to: [{operation: {ports: ['9090']}}]
";

async fn echo_ok(bed: &MeshBed, from: &str, dst: SocketAddr) -> bool {
    let Ok(mut s) = bed.connect(from, dst).await else {
        return false;
    };
    let r = timeout(WAIT, async {
        s.write_all(b"hello").await?;
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).await
    })
    .await
    .expect("echo or refusal in time");
    r.is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deny_by_default_with_explicit_allows_between_service_accounts() {
    if !netbed::can_run("deny_by_default_with_explicit_allows_between_service_accounts") {
        return;
    }
    let mut bed = MeshBed::new(2, &pods()).unwrap();
    bed.start(POLICIES).await.unwrap();
    let _a = bed.echo("server", 8080).await.unwrap();
    let _b = bed.echo("server", 9090).await.unwrap();
    let _c = bed.echo("client", 8080).await.unwrap();
    let server = |port| SocketAddr::new(bed.ip("server").into(), port);

    assert!(
        echo_ok(&bed, "client", server(8080)).await,
        "client → server:8080 is allowed"
    );
    assert!(
        !echo_ok(&bed, "other", server(8080)).await,
        "other → server:8080 is denied"
    );
    assert!(
        echo_ok(&bed, "other", server(9090)).await,
        "anyone → server:9090 is allowed"
    );
    let client = SocketAddr::new(bed.ip("client").into(), 8080);
    assert!(
        !echo_ok(&bed, "server", client).await,
        "nothing allows server → client"
    );

    let m = bed.metrics(1).await.unwrap();
    assert!(
        metric_sum(
            &m,
            "ambit_authorization_denials_total",
            &[
                ("policy", "no ALLOW policy matched"),
                ("source_principal", "spiffe://cluster.local/ns/ai/sa/other"),
                ("destination_workload_namespace", "ai"),
            ]
        ) >= 1.0,
        "{m}"
    );
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_change_closes_live_connections_it_denies_within_a_second() {
    if !netbed::can_run("a_policy_change_closes_live_connections_it_denies_within_a_second") {
        return;
    }
    let mut bed = MeshBed::new(2, &pods()).unwrap();
    bed.start("").await.unwrap();
    let _a = bed.echo("server", 8080).await.unwrap();
    let dst = SocketAddr::new(bed.ip("server").into(), 8080);

    // Two live connections, one from each client.
    let mut from_client = bed.connect("client", dst).await.unwrap();
    let mut from_other = bed.connect("other", dst).await.unwrap();
    for s in [&mut from_client, &mut from_other] {
        timeout(WAIT, async {
            s.write_all(b"ping").await.unwrap();
            let mut b = [0u8; 4];
            s.read_exact(&mut b).await.unwrap();
        })
        .await
        .unwrap();
    }

    // Deny `other`; its connection is closed, `client`'s keeps working.
    let deny = "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: deny-other, \
                namespace: ai}\nspec:\n  action: DENY\n  rules:\n  - from: [{source: {principals: \
                ['cluster.local/ns/ai/sa/other']}}]\n";
    let written = Instant::now();
    bed.write_config("deny.yaml", deny).unwrap();
    let mut buf = [0u8; 16];
    let n = timeout(WAIT, from_other.read(&mut buf))
        .await
        .expect("closed in time");
    let elapsed = written.elapsed();
    println!("denied live connection closed {elapsed:?} after the policy file was written");
    assert!(
        matches!(n, Ok(0) | Err(_)),
        "the denied connection is closed, got {n:?}"
    );
    assert!(
        elapsed < Duration::from_secs(1),
        "closed {elapsed:?} after the policy file was written"
    );
    timeout(WAIT, async {
        from_client.write_all(b"pong").await.unwrap();
        let mut b = [0u8; 4];
        from_client.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"pong");
    })
    .await
    .unwrap();

    let m = bed.metrics(1).await.unwrap();
    assert!(
        metric_sum(
            &m,
            "ambit_authorization_denials_total",
            &[
                ("policy", "ai/deny-other"),
                ("source_principal", "spiffe://cluster.local/ns/ai/sa/other")
            ]
        ) >= 1.0,
        "{m}"
    );
    assert!(
        metric_sum(
            &m,
            "istio_tcp_connections_closed_total",
            &[("reporter", "destination"), ("response_flags", "DENY")]
        ) >= 1.0,
        "{m}"
    );
    // New connections from `other` are refused too.
    assert!(!echo_ok(&bed, "other", dst).await);
    bed.shutdown().await;
}
