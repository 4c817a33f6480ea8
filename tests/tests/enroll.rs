//! Ambient enrollment end to end: pods created by the real CNI `bridge` +
//! `host-local` plugins chained with `ambit-cni`, a node agent per node
//! that programs the redirection and hands pods to its ztunnel over ZDS,
//! the control plane and the agents reading the same config directory.
//!
//! Needs root, `ip`, `iptables` and the CNI reference plugins; prints SKIP
//! and passes otherwise.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ambit_cni::redirect;
use ambit_tests::enrollbed::{EnrollBed, can_run};
use ambit_tests::meshbed::{WAIT, metric_sum};
use ambit_tests::netbed::{self, Capture};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::timeout;

const OPENED: &str = "istio_tcp_connections_opened_total";

async fn echo(bed: &EnrollBed, from: &str, dst: SocketAddr, msg: &[u8]) -> Vec<u8> {
    let mut s = timeout(WAIT, netbed::connect(&bed.pod(from).net, dst))
        .await
        .unwrap()
        .unwrap();
    timeout(WAIT, async {
        s.write_all(msg).await.unwrap();
        let mut b = vec![0u8; msg.len()];
        s.read_exact(&mut b).await.unwrap();
        b
    })
    .await
    .expect("echo in time")
}

async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + WAIT;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn enrolled(bed: &EnrollBed, node: usize, pod: &str) -> bool {
    bed.agent(node)
        .pods()
        .await
        .iter()
        .any(|r| r.pod.name == pod && r.enrolled)
}

async fn in_ztunnel(bed: &EnrollBed, node: usize, pod: &str) -> bool {
    bed.ztunnel(node)
        .pods()
        .borrow()
        .values()
        .any(|p| p.name == pod)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cni_chain_enrolls_ambient_pods_and_leaves_others_alone() {
    if !can_run("cni_chain_enrolls_ambient_pods_and_leaves_others_alone") {
        return;
    }
    let mut bed = EnrollBed::start(2, &[("ai", true), ("legacy", false)])
        .await
        .unwrap();
    let client = bed.add_pod(0, "client", "ai", "client").await.unwrap();
    let server = bed.add_pod(1, "server", "ai", "server").await.unwrap();
    let plain = bed.add_pod(0, "plain", "legacy", "plain").await.unwrap();
    let plain_server = bed
        .add_pod(1, "plain-server", "legacy", "web")
        .await
        .unwrap();

    // Enrolled at ADD: rules in place and handed to ztunnel before the
    // plugin returned.
    assert!(enrolled(&bed, 0, "client").await);
    assert!(in_ztunnel(&bed, 0, "client").await);
    assert!(redirect::is_installed(&client.net.path()).unwrap());
    assert!(!enrolled(&bed, 0, "plain").await);
    assert!(!redirect::is_installed(&plain.net.path()).unwrap());
    assert!(!in_ztunnel(&bed, 0, "plain").await);

    bed.wait_workload(0, server.net.ip).await.unwrap();
    bed.wait_workload(1, client.net.ip).await.unwrap();
    let _s = netbed::echo_server(&server.net, 8080).await.unwrap();
    let _p = netbed::echo_server(&plain_server.net, 8080).await.unwrap();

    let capture = Capture::start(bed.cluster.lan_netns()).unwrap();
    let secret = b"AMBIT-CNI-SECRET-0123456789".to_vec();
    assert_eq!(
        echo(&bed, "client", server.net.addr(8080), &secret).await,
        secret
    );
    let before = metric_sum(&bed.metrics(0).await.unwrap(), OPENED, &[]);
    let open = b"plain-traffic-visible-on-the-wire".to_vec();
    assert_eq!(
        echo(&bed, "plain", plain_server.net.addr(8080), &open).await,
        open
    );
    let wire = capture.stop();
    assert!(
        !netbed::capture::contains(&wire, &secret),
        "enrolled traffic crossed in plaintext"
    );
    assert!(
        netbed::capture::contains(&wire, &open),
        "non-enrolled traffic goes direct"
    );

    let m = bed.metrics(0).await.unwrap();
    assert!(
        metric_sum(
            &m,
            OPENED,
            &[
                ("reporter", "source"),
                ("connection_security_policy", "mutual_tls"),
                ("source_principal", "spiffe://cluster.local/ns/ai/sa/client"),
            ]
        ) >= 1.0,
        "{m}"
    );
    assert_eq!(
        metric_sum(&m, OPENED, &[]),
        before,
        "the non-enrolled pod bypassed ztunnel"
    );

    // DEL releases; a second DEL (the runtime retries) still succeeds.
    bed.del_pod("client").await.unwrap();
    assert!(!enrolled(&bed, 0, "client").await);
    eventually("ztunnel to drop the pod", || async {
        !in_ztunnel(&bed, 0, "client").await
    })
    .await;
    let conf = bed.conflist(0)["plugins"][1].clone();
    let (ok, out) = bed
        .exec_plugin(0, &conf, "DEL", &client, Some(&client.result))
        .unwrap();
    assert!(ok, "second DEL: {out}");
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_label_flip_enrolls_and_releases_running_pods() {
    if !can_run("namespace_label_flip_enrolls_and_releases_running_pods") {
        return;
    }
    let mut bed = EnrollBed::start(2, &[("ai", true), ("web", false)])
        .await
        .unwrap();
    let app = bed.add_pod(0, "app", "web", "app").await.unwrap();
    let server = bed.add_pod(1, "server", "ai", "server").await.unwrap();
    let _s = netbed::echo_server(&server.net, 8080).await.unwrap();
    bed.wait_workload(1, app.net.ip).await.unwrap();
    assert!(!enrolled(&bed, 0, "app").await);

    // web becomes ambient: the running pod is enrolled without a restart.
    bed.set_ambient("web", true).unwrap();
    eventually("app to be enrolled", || async {
        enrolled(&bed, 0, "app").await
    })
    .await;
    assert!(in_ztunnel(&bed, 0, "app").await);
    bed.wait_workload(0, server.net.ip).await.unwrap();
    let principal = "spiffe://cluster.local/ns/web/sa/app";
    // Its workload turns HBONE in xDS shortly after; new connections are mTLS.
    eventually("app's connections to be mTLS", || async {
        let _ = echo(&bed, "app", server.net.addr(8080), b"x").await;
        let m = bed.metrics(1).await.unwrap();
        metric_sum(
            &m,
            OPENED,
            &[
                ("source_principal", principal),
                ("connection_security_policy", "mutual_tls"),
            ],
        ) >= 1.0
    })
    .await;

    // And back: released, rules gone, traffic plaintext again.
    bed.set_ambient("web", false).unwrap();
    eventually("app to be released", || async {
        !enrolled(&bed, 0, "app").await
    })
    .await;
    assert!(!redirect::is_installed(&app.net.path()).unwrap());
    eventually("ztunnel to drop app", || async {
        !in_ztunnel(&bed, 0, "app").await
    })
    .await;
    let before = metric_sum(
        &bed.metrics(0).await.unwrap(),
        OPENED,
        &[("reporter", "source")],
    );
    assert_eq!(
        echo(&bed, "app", server.net.addr(8080), b"plain").await,
        b"plain"
    );
    let after = metric_sum(
        &bed.metrics(0).await.unwrap(),
        OPENED,
        &[("reporter", "source")],
    );
    assert_eq!(
        before, after,
        "a released pod's traffic no longer goes through ztunnel"
    );
    bed.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_keep_pods_captured() {
    if !can_run("restarts_keep_pods_captured") {
        return;
    }
    let mut bed = EnrollBed::start(2, &[("ai", true)]).await.unwrap();
    let client = bed.add_pod(0, "client", "ai", "client").await.unwrap();
    let server = bed.add_pod(1, "server", "ai", "server").await.unwrap();
    let _s = netbed::echo_server(&server.net, 8080).await.unwrap();
    bed.wait_workload(0, server.net.ip).await.unwrap();
    bed.wait_workload(1, client.net.ip).await.unwrap();

    // ztunnel restart: the agent's snapshot gives the pod its listeners back.
    bed.restart_ztunnel(0).await.unwrap();
    let started = Instant::now();
    let mut pods = bed.ztunnel(0).pods();
    timeout(
        Duration::from_secs(2),
        pods.wait_for(|p| p.values().any(|p| p.name == "client")),
    )
    .await
    .expect("listeners back within 2 s")
    .unwrap();
    let took = started.elapsed();
    bed.wait_workload(0, server.net.ip).await.unwrap();
    assert_eq!(
        echo(&bed, "client", server.net.addr(8080), b"after-zt").await,
        b"after-zt"
    );
    println!("ztunnel restart: pod listeners back {took:?} after ready");

    // Node agent restart: a live connection survives, the pod stays enrolled.
    let mut live = netbed::connect(&client.net, server.net.addr(8080))
        .await
        .unwrap();
    live.write_all(b"1").await.unwrap();
    let mut b = [0u8; 1];
    timeout(WAIT, live.read_exact(&mut b))
        .await
        .unwrap()
        .unwrap();
    bed.restart_agent(0).await.unwrap();
    eventually("the restarted agent to know the pod", || async {
        enrolled(&bed, 0, "client").await
    })
    .await;
    timeout(WAIT, async {
        live.write_all(b"2").await.unwrap();
        live.read_exact(&mut b).await.unwrap();
    })
    .await
    .unwrap();
    assert_eq!(&b, b"2");
    assert!(redirect::is_installed(&client.net.path()).unwrap());
    assert!(in_ztunnel(&bed, 0, "client").await);
    bed.shutdown().await;
}

/// Issue 14: a ztunnel that takes over a node while the old one still runs
/// and connections it accepted on a pod's :15001 sit in TIME_WAIT used to
/// fail to bind and refuse the pod, leaving it redirected to a port with
/// no listener. Now the new one binds beside the old one (SO_REUSEPORT),
/// every pod is served within 2 s, readiness is green and traffic flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacing_ztunnel_with_connections_in_time_wait_leaves_no_pod_black_holed() {
    if !can_run("replacing_ztunnel_with_connections_in_time_wait_leaves_no_pod_black_holed") {
        return;
    }
    let mut bed = EnrollBed::start(1, &[("ai", true)]).await.unwrap();
    let client = bed.add_pod(0, "client", "ai", "client").await.unwrap();
    let server = bed.add_pod(0, "server", "ai", "server").await.unwrap();
    bed.wait_workload(0, server.net.ip).await.unwrap();
    let _echo = netbed::echo_server(&server.net, 8080).await.unwrap();

    // A server that speaks first and closes first: ztunnel's accepted
    // sockets on the client's :15001 close actively and sit in TIME_WAIT.
    let bye = netbed::listen(&server.net, 9090).unwrap();
    let bye_task = tokio::spawn(async move {
        while let Ok((mut s, _)) = bye.accept().await {
            let _ = s.write_all(b"bye").await;
        }
    });
    for _ in 0..20 {
        let mut s = timeout(WAIT, netbed::connect(&client.net, server.net.addr(9090)))
            .await
            .unwrap()
            .unwrap();
        let mut got = Vec::new();
        timeout(WAIT, s.read_to_end(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, b"bye");
    }
    let mut time_wait = 0;
    eventually("TIME_WAIT sockets on the client's :15001", || {
        let out = netbed::netns_exec(
            &client.net.netns,
            &["ss", "-Htan", "state", "time-wait", "( sport = :15001 )"],
        )
        .unwrap_or_default();
        time_wait = out.lines().count();
        async move { time_wait > 0 }
    })
    .await;
    bye_task.abort();

    let took = bed.replace_ztunnel(0).await.unwrap();
    println!(
        "ztunnel replacement: pods served by the new ztunnel after {took:?} ({time_wait} sockets in TIME_WAIT)"
    );
    assert!(
        took < Duration::from_secs(2),
        "pods served again after {took:?}"
    );
    assert!(bed.ztunnel(0).unserved().borrow().is_empty());
    let ready = ambit_tests::get(bed.ztunnel(0).readiness_addr(), "/healthz/ready").await;
    assert!(ready.is_ok(), "readiness after the takeover: {ready:?}");
    let agent = bed.agent(0).pods().await;
    assert!(
        agent.iter().all(|r| r.enrolled && r.served),
        "the agent sees every pod served: {agent:?}"
    );
    // The pods' traffic flows through the new ztunnel.
    let msg = b"after-the-takeover".to_vec();
    assert_eq!(echo(&bed, "client", server.net.addr(8080), &msg).await, msg);
    assert!(
        metric_sum(&bed.metrics(0).await.unwrap(), OPENED, &[]) >= 1.0,
        "the new ztunnel carried it"
    );
    bed.shutdown().await;
}

/// Issue 14: when the ztunnel a node agent hands pods to cannot serve one
/// (its port is held by something else), the pod must not sit redirected
/// to nothing unnoticed: ztunnel's readiness and the agent's pod table say
/// "enrolled but not served", the agent keeps retrying the handover, and
/// the pod is served as soon as the port is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_ztunnel_cannot_serve_is_reported_and_retried_until_served() {
    if !can_run("a_pod_ztunnel_cannot_serve_is_reported_and_retried_until_served") {
        return;
    }
    let mut bed = EnrollBed::start(1, &[("ai", true)]).await.unwrap();
    let client = bed.add_pod(0, "client", "ai", "client").await.unwrap();
    let server = bed.add_pod(0, "server", "ai", "server").await.unwrap();
    bed.wait_workload(0, server.net.ip).await.unwrap();
    let _echo = netbed::echo_server(&server.net, 8080).await.unwrap();

    // While ztunnel is down, something that is not a ztunnel (no
    // SO_REUSEPORT) takes the client's :15001.
    bed.stop_ztunnel(0).await;
    // The stopped ztunnel's listener may take a moment to close on a busy
    // machine: retry the bind briefly.
    let netns = client.net.open().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let squatter = loop {
        match netns.run_in(|| std::net::TcpListener::bind("0.0.0.0:15001")) {
            Ok(l) => break l,
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("binding :15001 in the client pod: {e}"),
        }
    };
    bed.start_ztunnel_again(0).await.unwrap();

    let readiness = bed.ztunnel(0).readiness_addr();
    eventually("readiness to name the unserved pod", || async {
        let (status, body) = ambit_tests::http(readiness, "GET", "/healthz/ready")
            .await
            .unwrap_or((0, String::new()));
        status == 503 && body.contains("ai/client") && body.contains("not served")
    })
    .await;
    eventually("the agent to mark the pod not served", || async {
        bed.agent(0)
            .pods()
            .await
            .iter()
            .any(|r| r.pod.name == "client" && r.enrolled && !r.served)
    })
    .await;
    assert!(
        in_ztunnel(&bed, 0, "server").await,
        "the other pod is served"
    );
    assert!(
        redirect::is_installed(&client.net.path()).unwrap(),
        "the redirection stays (another ztunnel may serve it; removing it would unprotect the pod)"
    );

    // The port comes free: the agent's retry hands the pod over.
    drop(squatter);
    let freed = Instant::now();
    eventually("the retried handover", || async {
        in_ztunnel(&bed, 0, "client").await
    })
    .await;
    println!(
        "unserved pod served {:?} after its port came free",
        freed.elapsed()
    );
    eventually("the agent to mark it served", || async {
        bed.agent(0)
            .pods()
            .await
            .iter()
            .all(|r| r.enrolled && r.served)
    })
    .await;
    eventually("readiness to turn green", || async {
        ambit_tests::get(readiness, "/healthz/ready").await.is_ok()
    })
    .await;
    let msg = b"served-again".to_vec();
    assert_eq!(echo(&bed, "client", server.net.addr(8080), &msg).await, msg);
    bed.shutdown().await;
}

/// Node-agent redirection for sidecars: a pod injected without `istio-init`
/// (its status annotation lists no such init container) gets its sidecar
/// capture from the node agent once the agent knows it, in both families;
/// a pod injected with `istio-init` captures itself and is left alone; an
/// ambient pod stays ztunnel's whatever its annotations say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_agent_captures_sidecar_pods_injected_without_istio_init() {
    if !can_run("the_node_agent_captures_sidecar_pods_injected_without_istio_init") {
        return;
    }
    const STATUS: &str = "sidecar.istio.io/status";
    let mut bed = EnrollBed::start(1, &[("legacy", false), ("ai", true)])
        .await
        .unwrap();
    let cni_mode = bed
        .add_pod(0, "cni-mode", "legacy", "legacy")
        .await
        .unwrap();
    let init_mode = bed
        .add_pod(0, "init-mode", "legacy", "legacy")
        .await
        .unwrap();
    let ambient = bed.add_pod(0, "ambient", "ai", "client").await.unwrap();
    let nat = |pod: &ambit_tests::enrollbed::CniPod, program: &str| {
        netbed::netns_exec(&pod.net.netns, &[program, "-t", "nat"]).unwrap_or_default()
    };
    assert!(!nat(&cni_mode, "iptables-save").contains("AMBIT_SIDECAR_OUT"));
    let status = |inits: &str| {
        format!(r#"{{"containers":["istio-proxy"],"initContainers":[{inits}],"volumes":[]}}"#)
    };
    bed.annotate("cni-mode", STATUS, &status("")).unwrap();
    bed.annotate("init-mode", STATUS, &status(r#""istio-init""#))
        .unwrap();
    bed.annotate("ambient", STATUS, &status("")).unwrap();
    let jump = "-A OUTPUT -p tcp -j AMBIT_SIDECAR_OUT";
    eventually(
        "the node agent to capture the sidecar pod in both families",
        || async {
            nat(&cni_mode, "iptables-save").contains(jump)
                && nat(&cni_mode, "ip6tables-save").contains(jump)
        },
    )
    .await;
    let v4 = nat(&cni_mode, "iptables-save");
    assert!(v4.contains("-j REDIRECT --to-ports 15001"), "{v4}");
    assert!(v4.contains("--uid-owner 1337"), "{v4}");
    let v6 = nat(&cni_mode, "ip6tables-save");
    assert!(
        v6.contains("-A OUTPUT -p tcp -j AMBIT_SIDECAR_OUT"),
        "IPv6 too: {v6}"
    );
    assert!(
        !nat(&init_mode, "iptables-save").contains("AMBIT_SIDECAR"),
        "a pod with istio-init captures itself"
    );
    assert!(!nat(&ambient, "iptables-save").contains("AMBIT_SIDECAR"));
    assert!(
        enrolled(&bed, 0, "ambient").await,
        "the ambient pod stays ztunnel's"
    );
    assert!(
        !enrolled(&bed, 0, "cni-mode").await,
        "a sidecar pod is not ztunnel's"
    );
    bed.shutdown().await;
}
