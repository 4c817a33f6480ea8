//! The node agent in Kubernetes mode against the in-process fake API
//! server: its view holds every namespace and only its node's pods (field
//! selector), follows label flips and survives a relist after `410 Gone`;
//! a running pod the agent never saw through CNI is found by its cgroup,
//! enrolled (redirection in its netns, handed over ZDS) and released and
//! enrolled again as its namespace's label flips — the same reconcile as
//! local mode.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ambit_cni::agent::kube::{adopt_running_pods, spawn_kube_view};
use ambit_cni::agent::netns::NetnsFinder;
use ambit_cni::agent::view::MeshView;
use ambit_cni::agent::{Agent, AgentConfig};
use ambit_cni::redirect::{self, RedirectPorts};
use ambit_inpod::zds::{InpodCommand, InpodEvent, ZdsClient, ZdsClientConfig};
use ambit_tests::eventually;
use ambit_tests::fakeapi::FakeApiServer;
use ambit_tests::kubebed::{namespace, pod};
use serde_json::json;
use tokio::sync::{mpsc, watch};

const LIMIT: Duration = Duration::from_secs(10);

async fn view_of(fake: &FakeApiServer, node: &str) -> watch::Receiver<Arc<MeshView>> {
    let client = fake
        .client(
            &format!("ambit-node-agent/{node}"),
            &format!("agent-{node}"),
        )
        .unwrap();
    tokio::time::timeout(LIMIT, spawn_kube_view(client, node))
        .await
        .expect("the view lists within the limit")
        .unwrap()
}

fn pods_of(v: &watch::Receiver<Arc<MeshView>>) -> BTreeSet<String> {
    v.borrow()
        .pods
        .keys()
        .map(|(ns, n)| format!("{ns}/{n}"))
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn view_holds_every_namespace_and_only_this_nodes_pods_and_follows_changes() {
    let fake = FakeApiServer::start().await.unwrap();
    fake.apply(namespace(
        "shop",
        json!({"istio.io/dataplane-mode": "ambient"}),
    ))
    .unwrap();
    fake.apply(namespace("other", json!({}))).unwrap();
    fake.apply(pod("shop", "a", "10.1.0.2", "node-1", json!({})))
        .unwrap();
    fake.apply(pod("shop", "b", "10.1.1.2", "node-2", json!({})))
        .unwrap();
    fake.apply(pod("other", "c", "10.1.0.3", "node-1", json!({})))
        .unwrap();
    let v = view_of(&fake, "node-1").await;
    assert_eq!(pods_of(&v), set(&["other/c", "shop/a"]), "field selector");
    assert_eq!(v.borrow().namespaces.len(), 2);
    assert!(v.borrow().enrolled("shop", "a"));
    assert!(!v.borrow().enrolled("other", "c"));
    let info = v.borrow().pods[&("shop".to_string(), "a".to_string())].clone();
    assert!(info.running && !info.uid.is_empty() && info.ips.len() == 1);

    // A label flip both ways.
    fake.apply(namespace(
        "other",
        json!({"istio.io/dataplane-mode": "ambient"}),
    ))
    .unwrap();
    let vv = v.clone();
    eventually(LIMIT, "other enrolled", || {
        let v = vv.clone();
        async move { v.borrow().enrolled("other", "c").then_some(()) }
    })
    .await
    .unwrap();
    let mut p = fake.get("v1", "Pod", "other", "c").unwrap();
    p["metadata"]["labels"] = json!({"istio.io/dataplane-mode": "none"});
    fake.apply(p).unwrap();
    let vv = v.clone();
    eventually(LIMIT, "pod opted out", || {
        let v = vv.clone();
        async move { (!v.borrow().enrolled("other", "c")).then_some(()) }
    })
    .await
    .unwrap();

    // Relist after 410 Gone: changes made while the watch was down are
    // all there, nothing stale stays.
    fake.drop_watches();
    fake.delete("v1", "Pod", "other", "c").unwrap();
    fake.apply(pod("shop", "d", "10.1.0.4", "node-1", json!({})))
        .unwrap();
    fake.apply(pod("shop", "e", "10.1.1.4", "node-2", json!({})))
        .unwrap();
    fake.compact();
    let vv = v.clone();
    eventually(LIMIT, "relisted", || {
        let v = vv.clone();
        async move { (pods_of(&v) == set(&["shop/a", "shop/d"])).then_some(()) }
    })
    .await
    .unwrap();
    let lists = fake
        .calls()
        .into_iter()
        .filter(|c| c.identity == "ambit-node-agent/node-1" && c.resource == "pods")
        .collect::<Vec<_>>();
    assert!(lists.iter().all(|c| c.verb == "list" || c.verb == "watch"));
    assert!(
        lists.iter().all(|c| c.namespace.is_empty()),
        "all namespaces"
    );
}

/// A ztunnel stand-in: acks every ZDS message and records the adds/deletes.
fn fake_ztunnel(
    path: std::path::PathBuf,
) -> (Arc<Mutex<Vec<String>>>, tokio::task::JoinHandle<()>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let (tx, mut rx) = mpsc::channel::<InpodCommand>(16);
    let l = log.clone();
    let task = tokio::spawn(async move {
        let client = ZdsClient::new(ZdsClientConfig::new(path), tx);
        let run = tokio::spawn(client.run(std::future::pending()));
        while let Some(cmd) = rx.recv().await {
            let entry = match &cmd.event {
                InpodEvent::Add { uid, .. } => format!("add {uid}"),
                InpodEvent::Del { uid } => format!("del {uid}"),
                InpodEvent::SnapshotSent => "snapshot".to_string(),
                _ => String::new(),
            };
            if !entry.is_empty() {
                l.lock().unwrap().push(entry);
            }
            let _ = cmd.reply.send(Ok(()));
        }
        run.abort();
    });
    (log, task)
}

struct Netns(String);
impl Drop for Netns {
    fn drop(&mut self) {
        let _ = redirect::remove(std::path::Path::new(&format!("/var/run/netns/{}", self.0)));
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_pod_is_enrolled_from_the_watch_and_follows_label_flips() {
    if !ambit_tests::netbed::can_run(
        "running_pod_is_enrolled_from_the_watch_and_follows_label_flips",
    ) {
        return;
    }
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let fake = FakeApiServer::start().await.unwrap();
    fake.apply(namespace(
        "shop",
        json!({"istio.io/dataplane-mode": "ambient"}),
    ))
    .unwrap();
    fake.apply(pod("shop", "web-0", "10.1.0.5", "node-1", json!({})))
        .unwrap();
    let uid = fake.get("v1", "Pod", "shop", "web-0").unwrap()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_string();

    // The pod's netns, pinned where a runtime pins it, and a /proc where
    // its pause process's cgroup names the pod.
    let ns = Netns(format!("ambit-kna-{}", std::process::id()));
    assert!(
        Command::new("ip")
            .args(["netns", "add", &ns.0])
            .status()
            .unwrap()
            .success()
    );
    // A pod's loopback is up (the runtime's loopback plugin).
    assert!(
        Command::new("ip")
            .args(["-n", &ns.0, "link", "set", "lo", "up"])
            .status()
            .unwrap()
            .success()
    );
    let pinned = std::path::PathBuf::from(format!("/var/run/netns/{}", ns.0));
    let dir = tempfile::tempdir().unwrap();
    let proc_dir = dir.path().join("proc");
    let pid = proc_dir.join("4242");
    std::fs::create_dir_all(pid.join("ns")).unwrap();
    std::fs::write(
        pid.join("cgroup"),
        format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-1.scope\n", uid.replace('-', "_")),
    )
    .unwrap();
    std::os::unix::fs::symlink(&pinned, pid.join("ns/net")).unwrap();

    let v = view_of(&fake, "node-1").await;
    let zds = dir.path().join("zds.sock");
    let agent = Agent::start(
        AgentConfig {
            cni_socket: dir.path().join("cni.sock"),
            zds_socket: zds.clone(),
            state_dir: dir.path().join("state"),
            ports: RedirectPorts::default(),
        },
        v.clone(),
    )
    .await
    .unwrap();
    let (zlog, ztask) = fake_ztunnel(zds);
    let zl = zlog.clone();
    eventually(LIMIT, "ztunnel connected (snapshot received)", || {
        let zl = zl.clone();
        async move {
            zl.lock()
                .unwrap()
                .contains(&"snapshot".to_string())
                .then_some(())
        }
    })
    .await
    .unwrap();
    let adopter = tokio::spawn(adopt_running_pods(
        agent.client(),
        v.clone(),
        NetnsFinder {
            proc_dir,
            netns_dirs: vec!["/var/run/netns".into()],
        },
    ));
    let enrolled = |agent: &Agent, want: bool| {
        let c = agent.client();
        async move {
            let pods = c.pods().await;
            pods.iter()
                .any(|p| p.pod.name == "web-0" && p.enrolled == want)
                .then_some(())
        }
    };
    eventually(LIMIT, "running pod enrolled without CNI", || {
        enrolled(&agent, true)
    })
    .await
    .unwrap();
    let rec = agent
        .pods()
        .await
        .into_iter()
        .find(|p| p.pod.name == "web-0")
        .unwrap();
    assert_eq!(rec.netns, pinned, "the pinned path, not /proc");
    assert!(redirect::is_installed(&pinned).unwrap());
    assert!(zlog.lock().unwrap().contains(&format!("add {uid}")));

    // The namespace leaves the mesh: released; and back.
    fake.apply(namespace("shop", json!({}))).unwrap();
    eventually(LIMIT, "released", || enrolled(&agent, false))
        .await
        .unwrap();
    assert!(!redirect::is_installed(&pinned).unwrap());
    assert!(zlog.lock().unwrap().contains(&format!("del {uid}")));
    fake.apply(namespace(
        "shop",
        json!({"istio.io/dataplane-mode": "ambient"}),
    ))
    .unwrap();
    eventually(LIMIT, "enrolled again", || enrolled(&agent, true))
        .await
        .unwrap();
    assert!(redirect::is_installed(&pinned).unwrap());

    adopter.abort();
    let _ = adopter.await;
    ztask.abort();
    agent.shutdown().await;
    // Uninstall: the pod's redirection goes with the mesh.
    let state = dir.path().join("state");
    let released =
        tokio::task::spawn_blocking(move || ambit_cni::agent::PodTable::release_all(&state))
            .await
            .unwrap();
    assert_eq!(released, 1);
    assert!(!redirect::is_installed(&pinned).unwrap());
}
