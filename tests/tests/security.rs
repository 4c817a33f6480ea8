//! The data plane's security regression suite (issue 13), end to end in
//! network namespaces with real ztunnels (see `meshbed`):
//!
//! * `hbone_is_no_open_proxy_and_trusts_no_impostor`: a mesh client with a
//!   valid certificate cannot CONNECT through a pod's 15008 to another
//!   pod, loopback (127.0.0.1, ::1), the node, an address of no pod (403)
//!   or ztunnel's own ports 15001/15006/15008/15000/15020/15021 (400), over
//!   IPv4 and IPv6; a destination proving a valid mesh identity other than
//!   the one xDS gives it is refused, over both families.
//! * `strict_cannot_be_bypassed_over_ipv4_or_ipv6`: with STRICT, a client
//!   outside the mesh reaches nothing — not via the pod IP, not via 15006,
//!   not with plaintext on 15008 — over either family; PERMISSIVE shows the
//!   IPv6 plaintext path is captured at all.
//! * `hbone_port_bounds_oversized_headers_and_stream_floods`: 200 KiB of
//!   headers on a pod's 15008 get 431 on that stream only (sent in one
//!   frame) or GOAWAY for that connection only (split in CONTINUATIONs);
//!   a client that ignores SETTINGS and opens 1,000 streams on one
//!   connection gets 100 and `REFUSED_STREAM` for the rest.
//!
//! * `a_departed_identity_leaves_no_tls_state_on_its_node`: once an
//!   identity's last pod leaves, its node's ztunnel keeps no certificate,
//!   TLS config (private key) or pooled connection of it.
//!
//! Where else: the dual-stack mTLS, policy and source-address parity is
//! `dual_stack.rs`; the HBONE server and admin-server bounds at unit level
//! are in `ztunnel/src/hbone/server_limits_tests.rs` and
//! `ztunnel/src/admin/server_tests.rs`. Needs root; SKIP otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ambit_inpod::SocketOptions;
use ambit_tests::h2raw::{
    COMPRESSION_ERROR, ENHANCE_YOUR_CALM, REFUSED_STREAM, RawH2, connect_block,
};
use ambit_tests::meshbed::{MeshBed, PodSpec, WAIT, metric_sum};
use ambit_tests::netbed;
use ambit_ztunnel::hbone::{ClientError, HboneClient, HboneConnection, client_config};
use ambit_ztunnel::identity::Identity;
use hyper::http::{HeaderMap, HeaderValue, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::timeout;

fn id(sa: &str) -> Identity {
    Identity::new("cluster.local", "ai", sa)
}

fn marker(tag: &str) -> Vec<u8> {
    format!("AMBIT-SECRET-{tag}-{:016x}", rand::random::<u64>()).into_bytes()
}

/// The client config of `client`'s identity (issued by node 0's ztunnel),
/// pinning `peer`.
async fn client_cfg(bed: &MeshBed, peer: &Identity) -> Arc<rustls::ClientConfig> {
    let cert = timeout(WAIT, bed.ztunnel(0).certificates().fetch(&id("client")))
        .await
        .unwrap()
        .unwrap();
    let bundle = bed
        .ztunnel(0)
        .certificates()
        .trust_bundle()
        .borrow()
        .clone();
    Arc::new(client_config(&cert, &bundle, peer.clone()).unwrap())
}

/// A TCP connection from inside pod `from` to `to`, marked as ztunnel's
/// own (so the pod's redirection lets it out as is).
async fn marked_tcp(bed: &MeshBed, from: &str, to: SocketAddr) -> tokio::net::TcpStream {
    let opts = SocketOptions {
        mark: Some(ambit_inpod::ZTUNNEL_MARK),
        ..SocketOptions::default()
    };
    timeout(WAIT, bed.pod(from).open().unwrap().connect_from(to, &opts))
        .await
        .unwrap()
        .unwrap()
}

async fn hbone(bed: &MeshBed, to: SocketAddr, peer: &Identity) -> HboneConnection {
    let tcp = marked_tcp(bed, "client", to).await;
    timeout(WAIT, HboneClient::connect(tcp, client_cfg(bed, peer).await))
        .await
        .unwrap()
        .unwrap()
}

async fn connect_status(conn: &HboneConnection, target: SocketAddr) -> StatusCode {
    match timeout(WAIT, conn.connect_stream(target, HeaderMap::new()))
        .await
        .unwrap()
    {
        Ok(_) => StatusCode::OK,
        Err(e) => e
            .status()
            .unwrap_or_else(|| panic!("CONNECT {target}: no status: {e}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hbone_is_no_open_proxy_and_trusts_no_impostor() {
    if !netbed::can_run("hbone_is_no_open_proxy_and_trusts_no_impostor") {
        return;
    }
    // xDS says `victim` is ai/sa/victim behind HBONE, but its netns is the
    // test's: an impostor with a valid certificate of another identity
    // (server's) serves HBONE there, on both families.
    let mut victim = PodSpec::mesh("victim", "ai", 1, "victim");
    victim.handover = false;
    let pods = [
        PodSpec::mesh("client", "ai", 0, "client"),
        PodSpec::mesh("server-0", "ai", 1, "server"),
        PodSpec::mesh("server-1", "ai", 0, "server"),
        victim,
    ];
    let mut bed = MeshBed::dual_stack(2, &pods).unwrap();
    bed.start("").await.unwrap();
    let _s0 = bed.echo("server-0", 8080).await.unwrap();
    let _s1 = bed.echo("server-1", 8080).await.unwrap();

    let server_cert = timeout(WAIT, bed.ztunnel(1).certificates().fetch(&id("server")))
        .await
        .unwrap()
        .unwrap();
    let bundle = bed
        .ztunnel(1)
        .certificates()
        .trust_bundle()
        .borrow()
        .clone();
    let server_cfg = Arc::new(ambit_ztunnel::hbone::server_config(&server_cert, &bundle).unwrap());
    let victim_ns = bed.pod("victim").open().unwrap();
    let mut impostors = Vec::new();
    for any in ["0.0.0.0:15008", "[::]:15008"] {
        let l = victim_ns
            .bind_listener(any.parse().unwrap(), false)
            .unwrap();
        let l = tokio::net::TcpListener::from_std(l).unwrap();
        let cfg = server_cfg.clone();
        impostors.push(tokio::spawn(async move {
            while let Ok((tcp, _)) = l.accept().await {
                let server = ambit_ztunnel::hbone::HboneServer::new(cfg.clone());
                tokio::spawn(async move {
                    // An impostor that would accept any tunnel.
                    let _ = server
                        .serve(
                            tcp,
                            |_| Ok(()),
                            |_, pending| async move {
                                let _ = pending.accept();
                            },
                        )
                        .await;
                });
            }
        }));
    }
    for dst in [
        SocketAddr::new(bed.ip("victim").into(), 8080),
        SocketAddr::new(bed.ip6("victim").into(), 8080),
    ] {
        assert!(
            bed.refused("client", dst).await.unwrap(),
            "a destination proving the wrong identity must be refused ({dst})"
        );
    }
    let metrics = bed.metrics(0).await.unwrap();
    assert!(
        metric_sum(
            &metrics,
            "istio_tcp_connections_closed_total",
            &[("reporter", "source"), ("response_flags", "CONNECT")]
        ) >= 2.0,
        "both refusals counted as connect failures:\n{metrics}"
    );
    for t in impostors {
        t.abort();
    }

    // A real mesh client asks server-0's ztunnel for everything but server-0.
    let s0 = [IpAddr::from(bed.ip("server-0")), bed.ip6("server-0").into()];
    let forbidden: Vec<IpAddr> = vec![
        bed.ip("server-1").into(),
        bed.ip6("server-1").into(),
        bed.ip("client").into(),
        "127.0.0.1".parse().unwrap(),
        "::1".parse().unwrap(),
        netbed::node_ip(1).into(),
        netbed::node_ip6(1).into(),
        // Addresses of no pod, inside the bed's ranges.
        "10.10.9.9".parse().unwrap(),
        "fd00:10:9::9".parse().unwrap(),
    ];
    for via in s0 {
        let conn = hbone(&bed, SocketAddr::new(via, 15008), &id("server")).await;
        for own in s0 {
            let to = SocketAddr::new(own, 8080);
            assert_eq!(
                connect_status(&conn, to).await,
                StatusCode::OK,
                "{to} via {via}"
            );
        }
        for ip in &forbidden {
            let to = SocketAddr::new(*ip, 8080);
            assert_eq!(
                connect_status(&conn, to).await,
                StatusCode::FORBIDDEN,
                "CONNECT {to} via {via} must be refused"
            );
        }
        for own in s0 {
            for port in [15001, 15006, 15008, 15000, 15020, 15021] {
                let to = SocketAddr::new(own, port);
                assert_eq!(
                    connect_status(&conn, to).await,
                    StatusCode::BAD_REQUEST,
                    "CONNECT to ztunnel's port {to} via {via} must be refused"
                );
            }
        }
        assert!(conn.is_usable(), "refusals never break the connection");
    }
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_cannot_be_bypassed_over_ipv4_or_ipv6() {
    if !netbed::can_run("strict_cannot_be_bypassed_over_ipv4_or_ipv6") {
        return;
    }
    let pods = [
        PodSpec::mesh("client", "ai", 0, "client"),
        PodSpec::mesh("server", "ai", 1, "server"),
        PodSpec::plain("legacy", "legacy", 0, "legacy"),
    ];
    let mut bed = MeshBed::dual_stack(2, &pods).unwrap();
    bed.start("").await.unwrap();
    let _app = bed.echo("server", 8080).await.unwrap();
    let app = [
        SocketAddr::new(bed.ip("server").into(), 8080),
        SocketAddr::new(bed.ip6("server").into(), 8080),
    ];

    // PERMISSIVE: plaintext from outside passes, and over IPv6 it too goes
    // through the server's ztunnel (captured, counted), not around it.
    for dst in app {
        let m = marker("plain");
        assert_eq!(bed.echo_once("legacy", dst, &m).await.unwrap(), m, "{dst}");
    }
    let plaintext = |m: &str| {
        metric_sum(
            m,
            "istio_tcp_connections_opened_total",
            &[
                ("reporter", "destination"),
                ("connection_security_policy", "none"),
                ("destination_workload", "server"),
            ],
        )
    };
    let m = bed.metrics(1).await.unwrap();
    assert_eq!(plaintext(&m), 2.0, "both families captured:\n{m}");

    let strict = "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata:\n  \
                  name: strict\n  namespace: ai\nspec:\n  mtls:\n    mode: STRICT\n";
    bed.write_config("strict.yaml", strict).unwrap();
    bed.wait_refused("legacy", app[0], true).await.unwrap();
    for ip in [IpAddr::from(bed.ip("server")), bed.ip6("server").into()] {
        for port in [8080, 15006, 15008] {
            let dst = SocketAddr::new(ip, port);
            assert!(
                bed.refused("legacy", dst).await.unwrap(),
                "STRICT bypassed by plaintext to {dst}"
            );
        }
    }
    // Mesh clients still get through, over both families.
    for dst in app {
        let m = marker("mtls");
        assert_eq!(bed.echo_once("client", dst, &m).await.unwrap(), m, "{dst}");
    }
    let m = bed.metrics(1).await.unwrap();
    assert!(
        metric_sum(
            &m,
            "istio_tcp_connections_closed_total",
            &[
                ("connection_security_policy", "none"),
                ("response_flags", "DENY"),
            ]
        ) >= 4.0,
        "the refusals were ztunnel's (8080 and 15006, both families):\n{m}"
    );
    bed.shutdown().await;
}

/// Resident set size of this process (ztunnels included), in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Echoes `tag` on an open CONNECT stream.
async fn echo_on(s: &mut ambit_ztunnel::hbone::H2Stream, tag: &str) {
    let m = marker(tag);
    timeout(WAIT, async {
        s.write_all(&m).await.unwrap();
        let mut got = vec![0u8; m.len()];
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(got, m, "{tag}");
    })
    .await
    .unwrap_or_else(|_| panic!("echo {tag} timed out"));
}

/// A raw HTTP/2 client over mTLS (client's certificate) to `to`.
async fn raw_client(
    bed: &MeshBed,
    to: SocketAddr,
) -> RawH2<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = marked_tcp(bed, "client", to).await;
    let cfg = client_cfg(bed, &id("server")).await;
    let name = rustls::pki_types::ServerName::IpAddress(to.ip().into());
    let tls = timeout(
        WAIT,
        tokio_rustls::TlsConnector::from(cfg).connect(name, tcp),
    )
    .await
    .unwrap()
    .unwrap();
    RawH2::start(tls).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hbone_port_bounds_oversized_headers_and_stream_floods() {
    if !netbed::can_run("hbone_port_bounds_oversized_headers_and_stream_floods") {
        return;
    }
    let pods = [
        PodSpec::mesh("client", "ai", 0, "client"),
        PodSpec::mesh("server", "ai", 1, "server"),
    ];
    let mut bed = MeshBed::new(2, &pods).unwrap();
    bed.start("").await.unwrap();
    let _app = bed.echo("server", 8080).await.unwrap();
    let hbone_addr = SocketAddr::new(bed.ip("server").into(), 15008);
    let target = SocketAddr::new(bed.ip("server").into(), 8080);

    // 200 KiB of headers from a client that has seen the server's SETTINGS
    // (so it sends them in one frame, as h2 does): 431 on that stream; the
    // connection and its other stream carry on.
    let conn = hbone(&bed, hbone_addr, &id("server")).await;
    let mut held = timeout(WAIT, conn.connect_stream(target, HeaderMap::new()))
        .await
        .unwrap()
        .expect("an ordinary CONNECT is accepted");
    let mut big = HeaderMap::new();
    big.insert(
        "x-padding",
        HeaderValue::from_str(&"a".repeat(200 * 1024)).unwrap(),
    );
    let err = timeout(WAIT, conn.connect_stream(target, big))
        .await
        .unwrap()
        .expect_err("200 KiB of headers must be refused");
    assert!(
        matches!(&err, ClientError::Status { status, .. } if *status == StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
        "{err}"
    );
    echo_on(&mut held, "held-after-431").await;
    let mut fresh = timeout(WAIT, conn.connect_stream(target, HeaderMap::new()))
        .await
        .unwrap()
        .expect("the same connection still opens streams");
    echo_on(&mut fresh, "fresh-after-431").await;

    // The same 200 KiB split into 16 KiB HEADERS + CONTINUATION frames is
    // a flood pattern: h2 closes that connection with GOAWAY after a few
    // frames (never buffering the block), and other connections are
    // untouched.
    let mut raw = raw_client(&bed, hbone_addr).await;
    let padding = vec![b'a'; 200 * 1024];
    let block = connect_block(&target.to_string(), &[("x-padding", &padding)]);
    let frames = raw.open_split(&block, 16 * 1024).await;
    let tally = raw
        .read_until(WAIT, |t| t.goaway.is_some() || t.closed)
        .await
        .unwrap();
    assert!(
        matches!(tally.goaway, Some(ENHANCE_YOUR_CALM | COMPRESSION_ERROR)),
        "{tally:?}"
    );
    assert_eq!(tally.responses, 0, "{tally:?}");
    println!("200 KiB header block in 16 KiB frames: GOAWAY {tally:?} after {frames} frames");
    echo_on(&mut held, "held-after-goaway").await;

    // 1,000 streams on one connection from a client that ignores SETTINGS.
    let before = rss_kib();
    let mut raw = raw_client(&bed, hbone_addr).await;
    const FLOOD: usize = 1000;
    let block = connect_block(&target.to_string(), &[]);
    for _ in 0..FLOOD {
        raw.open(&block).await.unwrap();
    }
    raw.flush().await.unwrap();
    let tally = raw
        .read_until(WAIT, |t| t.answered() >= FLOOD || t.goaway.is_some())
        .await
        .unwrap();
    let peak = rss_kib();
    let refused = tally.resets.get(&REFUSED_STREAM).copied().unwrap_or(0);
    assert_eq!(tally.goaway, None, "{tally:?}");
    assert!(
        tally.responses <= 100,
        "the server took {} streams of one connection: {tally:?}",
        tally.responses
    );
    assert_eq!(tally.responses + refused, FLOOD, "{tally:?}");
    println!(
        "flood on a pod's 15008: {FLOOD} streams -> {} accepted, {refused} REFUSED_STREAM; \
         process RSS {before} KiB -> {peak} KiB (+{} KiB)",
        tally.responses,
        peak.saturating_sub(before)
    );
    // Other clients are unaffected.
    let other = hbone(&bed, hbone_addr, &id("server")).await;
    assert_eq!(connect_status(&other, target).await, StatusCode::OK);
    drop(raw);
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_departed_identity_leaves_no_tls_state_on_its_node() {
    if !netbed::can_run("a_departed_identity_leaves_no_tls_state_on_its_node") {
        return;
    }
    let pods = [
        PodSpec::mesh("client", "ai", 0, "client"),
        PodSpec::mesh("leaver", "ai", 0, "leaver"),
        PodSpec::mesh("server", "ai", 1, "server"),
    ];
    let mut bed = MeshBed::new(2, &pods).unwrap();
    bed.start("").await.unwrap();
    let _app = bed.echo("server", 8080).await.unwrap();
    let dst = SocketAddr::new(bed.ip("server").into(), 8080);
    for from in ["client", "leaver"] {
        let m = marker(from);
        assert_eq!(bed.echo_once(from, dst, &m).await.unwrap(), m);
    }
    let zt = bed.ztunnel(0);
    let leaver = id("leaver");
    assert!(zt.tls_cache_stats().identities.contains(&leaver));
    assert!(zt.pool().stats().keys.keys().any(|k| k.src == leaver));

    // The pod is deleted: ZDS removes it, then xDS drops its workload.
    bed.unenroll("leaver").await.unwrap();
    bed.remove_from_config("leaver").unwrap();
    let zt = bed.ztunnel(0);
    ambit_tests::eventually(WAIT, "the identity is forgotten everywhere", || async {
        let gone = !zt.certificates().identities().contains(&leaver)
            && !zt.tls_cache_stats().identities.contains(&leaver)
            && !zt.pool().stats().keys.keys().any(|k| k.src == leaver);
        gone.then_some(())
    })
    .await
    .unwrap();
    // The identity that stays keeps its certificate and configs.
    let stats = zt.tls_cache_stats();
    assert!(stats.identities.contains(&id("client")), "{stats:?}");
    let m = marker("client-after");
    assert_eq!(bed.echo_once("client", dst, &m).await.unwrap(), m);
    bed.shutdown().await;
}
