//! Self-tests of the network-namespace test bed (`ambit_tests::netbed`):
//! wiring, packet capture, in-pod redirection and transparent delivery.
//! Need root; skipped (with a `SKIP` line) otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use ambit_inpod::SocketOptions;
use ambit_tests::netbed::{self, Capture, Cluster, PodNet, RedirectPorts, redirect};
use anyhow::{Context, Result};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

const STEP: Duration = Duration::from_secs(5);

fn marker(what: &str) -> String {
    format!("ambit-{what}-{:016x}", rand::random::<u64>())
}

/// Writes `payload`, half-closes, and reads until the echo's EOF.
async fn round_trip(stream: &mut TcpStream, payload: &[u8]) -> Result<Vec<u8>> {
    timeout(STEP, async {
        stream.write_all(payload).await?;
        stream.shutdown().await?;
        let mut back = Vec::new();
        stream.read_to_end(&mut back).await?;
        Ok::<_, std::io::Error>(back)
    })
    .await
    .context("round trip timed out")?
    .context("round trip")
}

async fn echo_ok(from: &PodNet, to: SocketAddr, payload: &str) -> Result<()> {
    let mut s = timeout(STEP, netbed::connect(from, to)).await??;
    let back = round_trip(&mut s, payload.as_bytes()).await?;
    anyhow::ensure!(
        back == payload.as_bytes(),
        "echo {} -> {to}: got {:?}",
        from.name,
        String::from_utf8_lossy(&back)
    );
    Ok(())
}

fn original_dst(stream: &TcpStream) -> SocketAddr {
    let sa = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::OriginalDst).unwrap();
    SocketAddr::V4(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
        u16::from_be(sa.sin_port),
    ))
}

async fn accept(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    timeout(STEP, listener.accept()).await.unwrap().unwrap()
}

fn ns_lines(ns: &str, cmd: &[&str]) -> String {
    netbed::netns_exec(ns, cmd).unwrap()
}

#[test]
fn mark_matches_ztunnel() {
    assert_eq!(netbed::ZTUNNEL_MARK, ambit_inpod::ZTUNNEL_MARK);
    assert_eq!(RedirectPorts::default().outbound, 15001);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wiring_and_capture() {
    if !netbed::can_run("wiring_and_capture") {
        return;
    }
    let start = Instant::now();
    let mut c = Cluster::new(2).unwrap();
    let a0 = c.add_pod(0, "a0").unwrap();
    let a1 = c.add_pod(0, "a1").unwrap();
    let b0 = c.add_pod(1, "b0").unwrap();
    let b1 = c.add_pod(1, "b1").unwrap();
    let built = start.elapsed();
    assert_eq!(a0.ip, Ipv4Addr::new(10, 10, 1, 2));
    assert_eq!(a1.ip, Ipv4Addr::new(10, 10, 1, 3));
    assert_eq!(b1.ip, Ipv4Addr::new(10, 10, 2, 3));
    assert_eq!(c.pod("b0").unwrap().netns, format!("{}-b0", c.prefix()));
    for node in 0..2 {
        let fwd = ns_lines(c.node_netns(node), &["sysctl", "-n", "net.ipv4.ip_forward"]);
        assert_eq!(fwd.trim(), "1", "ip_forward in node {node}");
    }
    let _apps = [
        netbed::echo_server(&a0, 8080).await.unwrap(),
        netbed::echo_server(&a1, 8080).await.unwrap(),
        netbed::echo_server(&b0, 8080).await.unwrap(),
        netbed::echo_server(&b1, 8080).await.unwrap(),
    ];

    let capture = Capture::start(c.lan_netns()).unwrap();
    let cross = marker("cross");
    let cross_back = marker("cross-back");
    let same = marker("same");
    echo_ok(&a0, b0.addr(8080), &cross).await.unwrap();
    echo_ok(&b1, a1.addr(8080), &cross_back).await.unwrap();
    echo_ok(&a0, a1.addr(8080), &same).await.unwrap();
    echo_ok(&b0, b1.addr(8080), &same).await.unwrap();
    // The reader thread may not have run yet on a busy machine: `stop`
    // drains what the kernel queued, then the frames are checked.
    let frames = capture.stop();
    assert!(!frames.is_empty(), "nothing captured on the lan");
    assert!(
        netbed::contains(&frames, cross.as_bytes()),
        "cross-node payload not on the lan"
    );
    assert!(netbed::contains(&frames, cross_back.as_bytes()));
    assert!(
        !netbed::contains(&frames, same.as_bytes()),
        "same-node payload crossed the lan"
    );
    println!(
        "wiring_and_capture: cluster of 2 nodes + 4 pods built in {built:?}, test {:?}",
        start.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirection() {
    if !netbed::can_run("redirection") {
        return;
    }
    let start = Instant::now();
    let mut c = Cluster::new(2).unwrap();
    let a = c.add_pod(0, "a").unwrap();
    let b = c.add_pod(1, "b").unwrap();
    let ports = RedirectPorts::default();
    let _echo = netbed::echo_server(&b, 8080).await.unwrap();
    let _hbone = netbed::echo_server(&a, 15008).await.unwrap();
    assert!(!redirect::is_installed(&a.path()).unwrap());
    redirect::remove(&a.path()).unwrap(); // nothing installed: still fine

    redirect::install(&a.path(), &ports).unwrap();
    redirect::install(&a.path(), &ports).unwrap();
    assert!(redirect::is_installed(&a.path()).unwrap());
    let saved = ns_lines(&a.netns, &["iptables-save"]);
    let expected = redirect::rule_lines(&ports)
        .into_iter()
        .chain(redirect::jump_lines());
    for (table, line) in expected {
        let n = saved.lines().filter(|l| l.trim_end() == line).count();
        assert_eq!(n, 1, "{table}: {line:?} appears {n} times in:\n{saved}");
    }
    let rules = ns_lines(&a.netns, &["ip", "rule", "show"]);
    assert_eq!(
        rules.matches("fwmark 0x111/0xfff lookup 133").count(),
        1,
        "{rules}"
    );

    // Outbound: the app's unmarked connection lands on 15001.
    let outbound = netbed::listen(&a, ports.outbound).unwrap();
    let mut app = timeout(STEP, netbed::connect(&a, b.addr(8080)))
        .await
        .unwrap()
        .unwrap();
    let (mut got, peer) = accept(&outbound).await;
    assert_eq!(original_dst(&got), b.addr(8080));
    assert_eq!(peer.ip(), a.ip);
    app.write_all(b"to-15001").await.unwrap();
    let mut buf = [0u8; 8];
    timeout(STEP, got.read_exact(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&buf, b"to-15001");

    // Inbound: another pod's connection to a:8080 lands on 15006.
    let inbound = netbed::listen(&a, ports.inbound_plaintext).unwrap();
    let _app_in = timeout(STEP, netbed::connect(&b, a.addr(8080)))
        .await
        .unwrap()
        .unwrap();
    let (got_in, peer_in) = accept(&inbound).await;
    assert_eq!(original_dst(&got_in), a.addr(8080));
    assert_eq!(peer_in.ip(), b.ip);

    // 15008 is exempt inbound; ztunnel's marked connections are exempt outbound.
    echo_ok(&b, a.addr(ports.inbound_hbone), "hbone-port")
        .await
        .unwrap();
    let marked = SocketOptions {
        mark: Some(netbed::ZTUNNEL_MARK),
        ..SocketOptions::default()
    };
    let ns_a = a.open().unwrap();
    let mut s = timeout(STEP, ns_a.connect_from(b.addr(8080), &marked))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(round_trip(&mut s, b"marked").await.unwrap(), b"marked");

    // Removal restores direct behaviour (15001 is still listening, but unused).
    redirect::remove(&a.path()).unwrap();
    assert!(!redirect::is_installed(&a.path()).unwrap());
    let saved = ns_lines(&a.netns, &["iptables-save"]);
    assert!(!saved.contains("AMBIT"), "{saved}");
    let rules = ns_lines(&a.netns, &["ip", "rule", "show"]);
    assert!(!rules.contains("lookup 133"), "{rules}");
    echo_ok(&a, b.addr(8080), "direct-again").await.unwrap();
    redirect::remove(&a.path()).unwrap();
    println!("redirection: {:?}", start.elapsed());
}

/// What ztunnel does to deliver inbound traffic keeping the client's IP.
async fn deliver(pod: &PodNet, port: u16, source: Ipv4Addr) -> Result<TcpStream> {
    let opts = SocketOptions {
        mark: Some(netbed::ZTUNNEL_MARK),
        bind: Some(SocketAddr::new(source.into(), 0)),
        transparent: true,
    };
    Ok(pod.open()?.connect_from(pod.addr(port), &opts).await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transparent_delivery() {
    if !netbed::can_run("transparent_delivery") {
        return;
    }
    let start = Instant::now();
    let mut c = Cluster::new(2).unwrap();
    let a = c.add_pod(0, "a").unwrap();
    let b = c.add_pod(0, "b").unwrap();
    let far = c.add_pod(1, "far").unwrap();
    let ports = RedirectPorts::default();
    for pod in [&a, &b, &far] {
        redirect::install(&pod.path(), &ports).unwrap();
    }
    let _whoami = netbed::whoami_server(&a, 8080).await.unwrap();
    let _hbone_b = netbed::echo_server(&b, 15008).await.unwrap();
    let _hbone_far = netbed::echo_server(&far, 15008).await.unwrap();

    for source in [b.ip, far.ip, Ipv4Addr::new(10, 10, 1, 99)] {
        let s = timeout(STEP, deliver(&a, 8080, source))
            .await
            .unwrap()
            .unwrap();
        let local = s.local_addr().unwrap();
        assert_eq!(local.ip(), source);
        let mut s = BufReader::new(s);
        let mut line = String::new();
        timeout(STEP, s.read_line(&mut line))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            line,
            format!("{local}\n"),
            "the app sees the original source"
        );
        let payload = marker("delivered");
        let back = round_trip(s.get_mut(), payload.as_bytes()).await.unwrap();
        assert_eq!(back, payload.as_bytes());
    }

    // ztunnel's own marked connections out of the pod still work.
    let marked = SocketOptions {
        mark: Some(netbed::ZTUNNEL_MARK),
        ..SocketOptions::default()
    };
    let ns_a = a.open().unwrap();
    for to in [b.addr(15008), far.addr(15008)] {
        let mut s = timeout(STEP, ns_a.connect_from(to, &marked))
            .await
            .unwrap()
            .unwrap();
        let payload = marker("outbound");
        assert_eq!(
            round_trip(&mut s, payload.as_bytes()).await.unwrap(),
            payload.as_bytes()
        );
    }

    // Without the policy route, the app's replies leave by eth0 and the
    // delivery never completes: the route is what makes it work.
    netbed::ip(&["-n", &a.netns, "rule", "del", "pref", "32764"]).unwrap();
    assert!(!redirect::is_installed(&a.path()).unwrap());
    let stalled = timeout(Duration::from_millis(500), deliver(&a, 8080, far.ip)).await;
    assert!(stalled.is_err(), "delivery worked without the policy route");
    redirect::install(&a.path(), &ports).unwrap(); // repairs a partial install
    assert!(redirect::is_installed(&a.path()).unwrap());
    let s = timeout(STEP, deliver(&a, 8080, far.ip))
        .await
        .unwrap()
        .unwrap();
    let mut line = String::new();
    timeout(STEP, BufReader::new(s).read_line(&mut line))
        .await
        .unwrap()
        .unwrap();
    assert!(line.starts_with(&format!("{}:", far.ip)), "{line}");
    println!("transparent_delivery: {:?}", start.elapsed());
}

fn netns_with_prefix(prefix: &str) -> Vec<String> {
    netbed::run(&["ip", "netns", "list"])
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(prefix))
        .map(str::to_string)
        .collect()
}

#[test]
fn drop_cleans_up() {
    if !netbed::can_run("drop_cleans_up") {
        return;
    }
    let start = Instant::now();
    let mut c = Cluster::new(2).unwrap();
    c.add_pod(0, "x").unwrap();
    c.add_pod(1, "y").unwrap();
    let prefix = format!("{}-", c.prefix());
    assert_eq!(netns_with_prefix(&prefix).len(), 5);
    drop(c);
    assert_eq!(netns_with_prefix(&prefix), Vec::<String>::new());

    // Also when the test owning it panics.
    let (tx, rx) = std::sync::mpsc::channel();
    let failed = std::thread::spawn(move || {
        let mut c = Cluster::new(1).unwrap();
        c.add_pod(0, "z").unwrap();
        tx.send(format!("{}-", c.prefix())).unwrap();
        panic!("a failing test (expected)");
    })
    .join();
    assert!(failed.is_err());
    let prefix = rx.recv().unwrap();
    assert_eq!(netns_with_prefix(&prefix), Vec::<String>::new());
    println!("drop_cleans_up: {:?}", start.elapsed());
}
