//! `ambit-agent redirect`, the injected init container, inside a real pod
//! network namespace with iptables-nft, over IPv4 and IPv6: the app's
//! outbound connections reach the proxy's 15001, Envoy's own (uid 1337) go
//! out untouched, inbound connections reach 15006 except the proxy's own
//! ports, and running it twice changes nothing. Needs root (CI runs it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use ambit_tests::agentbed::agent_binary;
use ambit_tests::netbed::{self, Cluster, PodNet};
use tokio::net::TcpListener;
use tokio::time::timeout;

const T: Duration = Duration::from_secs(5);

/// Accepts one connection on `l` within [`T`], or says nothing came.
async fn accepted(l: &TcpListener) -> bool {
    timeout(T, l.accept()).await.is_ok_and(|r| r.is_ok())
}

/// The IPv6 or the IPv4 listener of a pair.
fn pick(pair: &(TcpListener, TcpListener), v6: bool) -> &TcpListener {
    if v6 { &pair.1 } else { &pair.0 }
}

/// Connects from `pod` to `dst` as uid/gid 1337 (Envoy's), with a process
/// of its own so the socket carries that owner; true when it connected.
fn connect_as_proxy(pod: &PodNet, dst: SocketAddr) -> bool {
    // bash's /dev/tcp: a plain connect(2), no interpreter the uid cannot read.
    let script = format!("exec 3<>/dev/tcp/{}/{}", dst.ip(), dst.port());
    let result = netbed::netns_exec(
        &pod.netns,
        &[
            "setpriv",
            "--reuid",
            "1337",
            "--regid",
            "1337",
            "--clear-groups",
            "timeout",
            "3",
            "bash",
            "-c",
            &script,
        ],
    );
    if let Err(e) = &result {
        eprintln!("connecting as the proxy to {dst}: {e:#}");
    }
    result.is_ok()
}

fn install(pod: &PodNet) -> String {
    let bin = agent_binary().unwrap();
    let bin = bin.to_str().unwrap();
    netbed::netns_exec(&pod.netns, &[bin, "redirect"]).unwrap();
    netbed::netns_exec(&pod.netns, &["iptables-save", "-t", "nat"]).unwrap()
        + &netbed::netns_exec(&pod.netns, &["ip6tables-save", "-t", "nat"]).unwrap()
}

#[tokio::test]
async fn the_init_container_captures_the_app_and_not_the_proxy() {
    if !netbed::can_run("the_init_container_captures_the_app_and_not_the_proxy") {
        return;
    }
    let mut cluster = Cluster::dual_stack(1).unwrap();
    let app = cluster.add_pod(0, "app").unwrap();
    let peer = cluster.add_pod(0, "peer").unwrap();
    let first = install(&app);
    let again = install(&app);
    let jumps = |s: &str| s.matches("-A OUTPUT -p tcp -j AMBIT_SIDECAR_OUT").count();
    assert_eq!(jumps(&first), 2, "one jump per family:\n{first}");
    assert_eq!(jumps(&again), 2, "running it again adds nothing:\n{again}");

    // One listener per family and port (an IPv6 listener is IPv6-only).
    let both = |pod: &PodNet, port: u16| {
        (
            netbed::listen(pod, port).unwrap(),
            netbed::listen6(pod, port).unwrap(),
        )
    };
    let outbound = both(&app, 15001);
    let inbound = both(&app, 15006);
    let readiness = both(&app, 15021);
    let peer_http = both(&peer, 80);

    for (family, v6, dst) in [
        ("IPv4", false, peer.addr(80)),
        ("IPv6", true, peer.addr6(80)),
    ] {
        // The app's connection is captured: it lands on 15001, not at the peer.
        let _app_conn = netbed::connect(&app, dst).await.unwrap();
        assert!(
            accepted(pick(&outbound, v6)).await,
            "{family}: the app's outbound reaches 15001"
        );
        // Envoy's own connection (uid 1337) goes out to the peer.
        let app2 = app.clone();
        let proxied = tokio::task::spawn_blocking(move || connect_as_proxy(&app2, dst));
        assert!(proxied.await.unwrap(), "{family}: the proxy connects out");
        assert!(
            accepted(pick(&peer_http, v6)).await,
            "{family}: the proxy's connection reaches the peer"
        );
    }
    for (family, v6, to_app, to_ready) in [
        ("IPv4", false, app.addr(8080), app.addr(15021)),
        ("IPv6", true, app.addr6(8080), app.addr6(15021)),
    ] {
        let _c = netbed::connect(&peer, to_app).await.unwrap();
        assert!(
            accepted(pick(&inbound, v6)).await,
            "{family}: inbound to 8080 reaches 15006"
        );
        let _c = netbed::connect(&peer, to_ready).await.unwrap();
        assert!(
            accepted(pick(&readiness, v6)).await,
            "{family}: 15021 is the proxy's own, not captured"
        );
    }
}
