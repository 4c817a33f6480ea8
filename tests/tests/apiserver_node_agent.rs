//! The node agent in Kubernetes mode against a real kube-apiserver (the
//! kit in `../shared/kube`), as ServiceAccount
//! `ambit-system/ambit-node-agent` with the RBAC Ambit ships:
//!
//! - its view holds every namespace and only its node's pods — selected by
//!   the API server (`fieldSelector=spec.nodeName=<node>`, all namespaces,
//!   as the audit log shows) — and follows label flips both ways;
//! - a running pod the agent never saw through CNI is found by its cgroup,
//!   enrolled (redirection in its netns, handed over ZDS), released and
//!   enrolled again as its namespace's label flips — the same reconcile as
//!   local mode (needs root).
//!
//! A relist after `410 Gone` cannot be caused on demand here: it is in
//! `kube_source.rs`, against the fake API server.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::Path;
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
use ambit_tests::kubeapi::{Crds, KubeApiServer, client_from};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

const LIMIT: Duration = Duration::from_secs(20);
const AGENT_USER: &str = "system:serviceaccount:ambit-system:ambit-node-agent";

/// The node agent's view of `node`, as its own ServiceAccount.
async fn view_of(kube: &KubeApiServer, dir: &Path, node: &str) -> watch::Receiver<Arc<MeshView>> {
    let kc = kube
        .kubeconfig_for(
            "ambit-system",
            "ambit-node-agent",
            &dir.join(format!("agent-{node}.kubeconfig")),
        )
        .await
        .unwrap();
    tokio::time::timeout(
        LIMIT,
        spawn_kube_view(client_from(&kc).await.unwrap(), node),
    )
    .await
    .expect("the view lists within the limit")
    .unwrap()
}

/// Namespace `name` with `labels` and a ServiceAccount `default` (no
/// controller makes it on a bare API server).
async fn namespace(kube: &KubeApiServer, name: &str, labels: Value) {
    kube.apply(&json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": labels}}))
        .await
        .unwrap();
    kube.apply(&json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "default", "namespace": name}}))
        .await
        .unwrap();
}

fn pods_of(v: &watch::Receiver<Arc<MeshView>>) -> BTreeSet<String> {
    v.borrow()
        .pods
        .keys()
        .map(|(ns, n)| format!("{ns}/{n}"))
        .collect()
}

async fn until_view(
    v: &watch::Receiver<Arc<MeshView>>,
    what: &str,
    done: impl Fn(&MeshView) -> bool,
) {
    eventually(LIMIT, what, || {
        let ok = done(&v.borrow());
        async move { ok.then_some(()) }
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn view_holds_every_namespace_and_only_this_nodes_pods_and_follows_changes() {
    let kube = KubeApiServer::start_audited(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    namespace(&kube, "shop", json!({"istio.io/dataplane-mode": "ambient"})).await;
    namespace(&kube, "other", json!({})).await;
    let a = kube
        .running_pod("shop", "a", "default", "node-1", "10.1.0.2", json!({}))
        .await
        .unwrap();
    kube.running_pod("shop", "b", "default", "node-2", "10.1.1.2", json!({}))
        .await
        .unwrap();
    kube.running_pod("other", "c", "default", "node-1", "10.1.0.3", json!({}))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let v = view_of(&kube, dir.path(), "node-1").await;
    assert_eq!(
        pods_of(&v),
        BTreeSet::from(["other/c".to_string(), "shop/a".to_string()]),
        "this node's pods only"
    );
    let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> =
        kube::Api::all(kube.client().await.unwrap());
    let every: BTreeSet<String> = namespaces
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    let seen: BTreeSet<String> = v.borrow().namespaces.keys().cloned().collect();
    assert_eq!(seen, every, "every namespace");
    assert!(v.borrow().enrolled("shop", "a"));
    assert!(!v.borrow().enrolled("other", "c"));
    let info = v.borrow().pods[&("shop".to_string(), "a".to_string())].clone();
    assert!(info.running, "{info:?}");
    assert_eq!(info.uid, a);
    assert_eq!(info.ips, ["10.1.0.2".parse::<std::net::IpAddr>().unwrap()]);

    // A label flip both ways: the namespace joins, the pod opts out.
    namespace(
        &kube,
        "other",
        json!({"istio.io/dataplane-mode": "ambient"}),
    )
    .await;
    until_view(&v, "other/c enrolled", |v| v.enrolled("other", "c")).await;
    kube.patch(
        &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "c", "namespace": "other"}}),
        &json!({"metadata": {"labels": {"istio.io/dataplane-mode": "none"}}}),
    )
    .await
    .unwrap();
    until_view(&v, "other/c opted out", |v| !v.enrolled("other", "c")).await;
    // A new pod of this node arrives, one of another node does not, a
    // deleted one goes.
    kube.running_pod("shop", "d", "default", "node-1", "10.1.0.4", json!({}))
        .await
        .unwrap();
    kube.running_pod("shop", "e", "default", "node-2", "10.1.1.4", json!({}))
        .await
        .unwrap();
    kube.delete_pod("other", "c").await.unwrap();
    until_view(&v, "shop/d in, other/c out", |v| {
        v.pods.contains_key(&("shop".into(), "d".into()))
            && !v.pods.contains_key(&("other".into(), "c".into()))
    })
    .await;
    assert_eq!(
        pods_of(&v),
        BTreeSet::from(["shop/a".to_string(), "shop/d".to_string()])
    );

    // The API server did the selecting: every pod request of the agent is
    // a list or watch of all namespaces with its node's field selector.
    let requests: Vec<(String, String)> = kube
        .audit_events()
        .unwrap()
        .into_iter()
        .filter(|e| e["user"]["username"] == AGENT_USER && e["objectRef"]["resource"] == "pods")
        .map(|e| {
            (
                e["verb"].as_str().unwrap().to_string(),
                e["requestURI"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert!(!requests.is_empty());
    for (verb, uri) in &requests {
        assert!(verb == "list" || verb == "watch", "{verb} {uri}");
        assert!(uri.starts_with("/api/v1/pods?"), "all namespaces: {uri}");
        assert!(
            uri.contains("fieldSelector=spec.nodeName%3Dnode-1"),
            "the node's pods only: {uri}"
        );
    }
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
        let _ = redirect::remove(Path::new(&format!("/var/run/netns/{}", self.0)));
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
    let kube = KubeApiServer::start(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    namespace(&kube, "shop", json!({"istio.io/dataplane-mode": "ambient"})).await;
    let uid = kube
        .running_pod("shop", "web-0", "default", "node-1", "10.1.0.5", json!({}))
        .await
        .unwrap();

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

    let v = view_of(&kube, dir.path(), "node-1").await;
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
    namespace(&kube, "shop", json!({})).await;
    eventually(LIMIT, "released", || enrolled(&agent, false))
        .await
        .unwrap();
    assert!(!redirect::is_installed(&pinned).unwrap());
    assert!(zlog.lock().unwrap().contains(&format!("del {uid}")));
    namespace(&kube, "shop", json!({"istio.io/dataplane-mode": "ambient"})).await;
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
