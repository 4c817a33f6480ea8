//! In-pod redirection for both IP families (issue 13): the IPv6 rules are
//! installed, checked and removed together with the IPv4 ones, a failing
//! IPv6 half leaves no IPv4 half behind, and on a dual-stack bed IPv6
//! traffic is captured exactly like IPv4 (outbound to 15001, inbound to
//! 15006, 15008 and ztunnel's marked sockets exempt, transparent delivery
//! from an IPv6 client address). Needs root; SKIP otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv6Addr, SocketAddr, SocketAddrV6};
use std::time::Duration;

use ambit_inpod::SocketOptions;
use ambit_tests::netbed::{self, Cluster, PodNet, RedirectPorts, redirect};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

const STEP: Duration = Duration::from_secs(5);

fn ns_out(ns: &str, cmd: &[&str]) -> String {
    netbed::netns_exec(ns, cmd).unwrap()
}

fn original_dst6(stream: &TcpStream) -> SocketAddr {
    use nix::sys::socket::{SockaddrIn6, getsockopt, sockopt};
    let raw = getsockopt(stream, sockopt::Ip6tOriginalDst).unwrap();
    SocketAddr::V6(SocketAddrV6::from(SockaddrIn6::from(raw)))
}

async fn accept(listener: &TcpListener) -> (TcpStream, SocketAddr) {
    timeout(STEP, listener.accept()).await.unwrap().unwrap()
}

async fn echo_ok(from: &PodNet, to: SocketAddr, opts: &SocketOptions) {
    let mut s = timeout(STEP, from.open().unwrap().connect_from(to, opts))
        .await
        .unwrap()
        .unwrap();
    let msg = format!("ping-{:x}", rand::random::<u64>());
    timeout(STEP, async {
        s.write_all(msg.as_bytes()).await.unwrap();
        s.shutdown().await.unwrap();
        let mut back = Vec::new();
        s.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, msg.as_bytes(), "echo {} -> {to}", from.name);
    })
    .await
    .unwrap();
}

/// Counts each expected line of one family in a save of that family.
fn assert_rules(save: &str, family: redirect::Family) {
    let ports = RedirectPorts::default();
    let expected = family
        .rule_lines(&ports)
        .into_iter()
        .chain(redirect::jump_lines());
    for (table, line) in expected {
        let n = save.lines().filter(|l| l.trim_end() == line).count();
        assert_eq!(
            n, 1,
            "{family} {table}: {line:?} appears {n} times in:\n{save}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_families_are_installed_checked_and_removed_together() {
    if !netbed::can_run("both_families_are_installed_checked_and_removed_together") {
        return;
    }
    // An IPv4-only pod still gets both families (harmless, documented).
    let mut c = Cluster::new(1).unwrap();
    let a = c.add_pod(0, "a").unwrap();
    let ports = RedirectPorts::default();
    assert_eq!(
        redirect::families(),
        vec![redirect::Family::V4, redirect::Family::V6]
    );
    redirect::install(&a.path(), &ports).unwrap();
    redirect::install(&a.path(), &ports).unwrap();
    assert!(redirect::is_installed(&a.path()).unwrap());
    assert_rules(&ns_out(&a.netns, &["iptables-save"]), redirect::Family::V4);
    let save6 = ns_out(&a.netns, &["ip6tables-save"]);
    assert_rules(&save6, redirect::Family::V6);
    assert!(
        save6.contains("-s fd16:9254:7127:1337:ffff:ffff:ffff:ffff/128 -p tcp -j RETURN"),
        "the IPv6 probe source is exempt:\n{save6}"
    );
    for flag in ["-4", "-6"] {
        let rules = ns_out(&a.netns, &["ip", flag, "rule", "show"]);
        assert_eq!(
            rules.matches("fwmark 0x111/0xfff lookup 133").count(),
            1,
            "ip {flag} rule: {rules}"
        );
        let routes = ns_out(&a.netns, &["ip", flag, "route", "show", "table", "133"]);
        assert!(
            routes.starts_with("local default dev lo"),
            "{flag}: {routes}"
        );
    }

    // Losing only the IPv6 half reads as not installed; install repairs it.
    netbed::ip(&["-n", &a.netns, "-6", "rule", "del", "pref", "32764"]).unwrap();
    assert!(!redirect::is_installed(&a.path()).unwrap());
    redirect::install(&a.path(), &ports).unwrap();
    assert!(redirect::is_installed(&a.path()).unwrap());
    netbed::netns_exec(
        &a.netns,
        &[
            "ip6tables",
            "-t",
            "nat",
            "-D",
            "OUTPUT",
            "-j",
            "AMBIT_OUTPUT",
        ],
    )
    .unwrap();
    assert!(!redirect::is_installed(&a.path()).unwrap());
    redirect::install(&a.path(), &ports).unwrap();

    redirect::remove(&a.path()).unwrap();
    assert!(!redirect::is_installed(&a.path()).unwrap());
    for save in ["iptables-save", "ip6tables-save"] {
        let out = ns_out(&a.netns, &[save]);
        assert!(!out.contains("AMBIT"), "{save}:\n{out}");
    }
    for flag in ["-4", "-6"] {
        let rules = ns_out(&a.netns, &["ip", flag, "rule", "show"]);
        assert!(!rules.contains("lookup 133"), "ip {flag} rule: {rules}");
    }
    redirect::remove(&a.path()).unwrap(); // nothing installed: still fine
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_ipv6_half_rolls_the_ipv4_half_back() {
    if !netbed::can_run("a_failing_ipv6_half_rolls_the_ipv4_half_back") {
        return;
    }
    let mut c = Cluster::new(1).unwrap();
    let a = c.add_pod(0, "a").unwrap();
    let ports = RedirectPorts::default();
    // ip6tables-restore that always fails (`false` ignores its input).
    let broken = redirect::Programs {
        ip6tables_restore: "false".into(),
        ..redirect::Programs::default()
    };
    let err = redirect::install_with(&a.path(), &ports, &broken).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(
            err,
            redirect::RedirectError::Install {
                family: redirect::Family::V6,
                ref rollback,
                ..
            } if rollback.is_empty()
        ),
        "{text}"
    );
    assert!(text.contains("never half-captured"), "{text}");
    // Nothing of either family is left: the pod is not half-captured.
    assert!(!redirect::is_installed(&a.path()).unwrap());
    for save in ["iptables-save", "ip6tables-save"] {
        let out = ns_out(&a.netns, &[save]);
        assert!(!out.contains("AMBIT"), "{save} after rollback:\n{out}");
    }
    for flag in ["-4", "-6"] {
        let rules = ns_out(&a.netns, &["ip", flag, "rule", "show"]);
        assert!(!rules.contains("lookup 133"), "ip {flag} rule: {rules}");
    }
    // The same on a repair: an installed pod whose IPv6 half then fails
    // is left with neither half.
    redirect::install(&a.path(), &ports).unwrap();
    redirect::install_with(&a.path(), &ports, &broken).unwrap_err();
    let out = ns_out(&a.netns, &["iptables-save"]);
    assert!(!out.contains("AMBIT"), "{out}");
}

/// What ztunnel does to deliver inbound traffic keeping an IPv6 client's address.
async fn deliver6(pod: &PodNet, port: u16, source: Ipv6Addr) -> std::io::Result<TcpStream> {
    let opts = SocketOptions {
        mark: Some(netbed::ZTUNNEL_MARK),
        bind: Some(SocketAddr::new(source.into(), 0)),
        transparent: true,
    };
    pod.open()
        .map_err(std::io::Error::other)?
        .connect_from(pod.addr6(port), &opts)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_traffic_is_captured_like_ipv4() {
    if !netbed::can_run("ipv6_traffic_is_captured_like_ipv4") {
        return;
    }
    let mut c = Cluster::dual_stack(2).unwrap();
    let a = c.add_pod(0, "a").unwrap();
    let b = c.add_pod(1, "b").unwrap();
    assert_eq!(a.ip6, Some("fd00:10:1::2".parse().unwrap()));
    let ports = RedirectPorts::default();
    let plain = SocketOptions::default();
    let marked = SocketOptions {
        mark: Some(netbed::ZTUNNEL_MARK),
        ..SocketOptions::default()
    };
    let _echo_b = netbed::echo_server(&b, 8080).await.unwrap();
    let _hbone_a = netbed::echo_server(&a, 15008).await.unwrap();
    // The bed routes IPv6 between nodes before any redirection.
    echo_ok(&a, b.addr6(8080), &plain).await;

    redirect::install(&a.path(), &ports).unwrap();
    // Outbound: the app's unmarked IPv6 connection lands on [::]:15001.
    let outbound = netbed::listen6(&a, ports.outbound).unwrap();
    let _app = timeout(STEP, a.open().unwrap().connect_from(b.addr6(8080), &plain))
        .await
        .unwrap()
        .unwrap();
    let (got, peer) = accept(&outbound).await;
    assert_eq!(original_dst6(&got), b.addr6(8080));
    assert_eq!(peer.ip(), std::net::IpAddr::from(a.ip6.unwrap()));
    // Loopback is never captured.
    let lo = netbed::listen6(&a, 9099).unwrap();
    let lo_addr: SocketAddr = "[::1]:9099".parse().unwrap();
    let _c = timeout(STEP, a.open().unwrap().connect_from(lo_addr, &plain))
        .await
        .unwrap()
        .unwrap();
    let (l, _) = accept(&lo).await;
    assert_eq!(l.local_addr().unwrap(), lo_addr, "not redirected");

    // Inbound: another pod's IPv6 connection to a:8080 lands on 15006.
    let inbound = netbed::listen6(&a, ports.inbound_plaintext).unwrap();
    let _in = timeout(STEP, b.open().unwrap().connect_from(a.addr6(8080), &plain))
        .await
        .unwrap()
        .unwrap();
    let (got_in, peer_in) = accept(&inbound).await;
    assert_eq!(original_dst6(&got_in), a.addr6(8080));
    assert_eq!(peer_in.ip(), std::net::IpAddr::from(b.ip6.unwrap()));

    // 15008 is exempt inbound; ztunnel's marked sockets are exempt outbound.
    echo_ok(&b, a.addr6(ports.inbound_hbone), &plain).await;
    echo_ok(&a, b.addr6(8080), &marked).await;

    // Transparent delivery from the IPv6 client's address: the app's
    // replies route back through `local ::/0 dev lo table 133`.
    let _who = netbed::whoami_server(&a, 8081).await.unwrap();
    let source = b.ip6.unwrap();
    let s = timeout(STEP, deliver6(&a, 8081, source))
        .await
        .unwrap()
        .unwrap();
    let local = s.local_addr().unwrap();
    assert_eq!(local.ip(), std::net::IpAddr::from(source));
    let mut line = String::new();
    timeout(STEP, BufReader::new(s).read_line(&mut line))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(line, format!("{local}\n"), "the app sees the IPv6 client");

    // Without the IPv6 policy route, the delivery stalls: the route matters.
    netbed::ip(&["-n", &a.netns, "-6", "rule", "del", "pref", "32764"]).unwrap();
    let stalled = timeout(Duration::from_millis(500), deliver6(&a, 8081, source)).await;
    assert!(
        stalled.is_err(),
        "IPv6 delivery worked without the policy route"
    );
    redirect::remove(&a.path()).unwrap();
    echo_ok(&a, b.addr6(8080), &plain).await;
}
