//! The node agent in Kubernetes mode: the [`MeshView`] from the API server,
//! and enrollment of pods that are already running.
//!
//! - [`spawn_kube_view`] runs two kube watchers: Namespaces (all of them,
//!   metadata only — labels are all the agent needs) and the Pods of this
//!   node (`fieldSelector=spec.nodeName=<node>`, all namespaces). Objects
//!   are decoded with `ambit-config` like the file view's, so both modes
//!   decide enrollment from the same typed objects. A relist (after `410
//!   Gone`) drops what it no longer lists. The first view is returned only
//!   once both watches have listed: an empty view would release every
//!   enrolled pod of a restarted agent.
//! - [`adopt_running_pods`] enrolls pods that should be in the mesh but
//!   the agent never saw through a CNI ADD (they started before the agent,
//!   or before ambit-cni was in the chain): it finds their netns
//!   ([`NetnsFinder`]) and hands them to the agent task as an ADD. From
//!   then on the agent's one reconcile (the same as local mode) follows
//!   label flips both ways.

use std::collections::{BTreeSet, HashSet};
use std::path::PathBuf;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use ambit_config::objects::{Kind, Object, ObjectKey};
use ambit_config::{Change, decode_json_value};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Client, Config};
use serde_json::{Value, json};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::AgentClient;
use super::netns::NetnsFinder;
use super::view::MeshView;
use crate::protocol::{Command, PodRef, Request};

/// Deadline of the connection to the API server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often pods that could not be enrolled are tried again.
pub const ADOPT_RETRY: Duration = Duration::from_secs(2);

/// Why Kubernetes mode could not start.
#[derive(Debug, thiserror::Error)]
pub enum KubeViewError {
    #[error("cannot read kubeconfig {path}: {reason}")]
    Kubeconfig { path: PathBuf, reason: String },
    #[error(
        "not running in a pod (no service account token or KUBERNETES_SERVICE_HOST): {0}; pass --kubeconfig"
    )]
    InCluster(String),
    #[error("cannot build the Kubernetes client: {0}")]
    Client(String),
    #[error("the view's watchers stopped before listing")]
    Stopped,
}

/// A client from `kubeconfig`, else the pod's service account.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> Result<Client, KubeViewError> {
    let mut config = match kubeconfig {
        Some(path) => {
            let err = |e: kube::config::KubeconfigError| KubeViewError::Kubeconfig {
                path: path.to_path_buf(),
                reason: e.to_string(),
            };
            let kc = kube::config::Kubeconfig::read_from(path).map_err(err)?;
            Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(err)?
        }
        None => Config::incluster().map_err(|e| KubeViewError::InCluster(e.to_string()))?,
    };
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    config.write_timeout = Some(CONNECT_TIMEOUT);
    Client::try_from(config).map_err(|e| KubeViewError::Client(e.to_string()))
}

/// Which watch an event came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Namespaces,
    Pods,
}

/// Starts watching; returns the view once both watches have listed
/// (callers bound the wait).
pub async fn spawn_kube_view(
    client: Client,
    node: &str,
) -> Result<watch::Receiver<Arc<MeshView>>, KubeViewError> {
    let (tx, mut rx) = watch::channel(Arc::new(MeshView::default()));
    let (synced_tx, mut synced) = watch::channel(false);
    tokio::spawn(run(client, node.to_string(), tx, synced_tx));
    synced
        .wait_for(|s| *s)
        .await
        .map_err(|_| KubeViewError::Stopped)?;
    rx.mark_changed();
    Ok(rx)
}

fn namespace_object(meta: &kube::api::ObjectMeta) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": meta})
}

fn key_of(obj: &Object) -> ObjectKey {
    obj.key()
}

async fn run(
    client: Client,
    node: String,
    tx: watch::Sender<Arc<MeshView>>,
    synced_tx: watch::Sender<bool>,
) {
    let namespaces = watcher::watcher(
        Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .map(|ev| {
        ev.map(|e| {
            (
                Source::Namespaces,
                map_event(e, |m| namespace_object(&m.metadata)),
            )
        })
    });
    let pods = watcher::watcher(
        Api::<Pod>::all(client),
        watcher::Config::default().fields(&format!("spec.nodeName={node}")),
    )
    .default_backoff()
    .map(|ev| {
        ev.map(|e| {
            (
                Source::Pods,
                map_event(e, |p| {
                    let mut v = serde_json::to_value(&p).unwrap_or(Value::Null);
                    v["apiVersion"] = json!("v1");
                    v["kind"] = json!("Pod");
                    v
                }),
            )
        })
    });
    let mut events = pin!(futures::stream::select(namespaces, pods));
    let mut view = MeshView::default();
    // Keys listed by the relist in progress, per source.
    let mut listing: [Option<HashSet<ObjectKey>>; 2] = [None, None];
    let mut listed = [false, false];
    while let Some(ev) = events.next().await {
        let (source, ev) = match ev {
            Ok(x) => x,
            Err(e) => {
                warn!(error = %e, "node agent: watching the API server failed; retrying");
                continue;
            }
        };
        let i = source as usize;
        let changes: Vec<Change> = match ev {
            Event::Init => {
                listing[i] = Some(HashSet::new());
                continue;
            }
            Event::InitApply(v) | Event::Apply(v) => match decode(&v) {
                Some(obj) => {
                    if let Some(l) = listing[i].as_mut() {
                        l.insert(key_of(&obj));
                    }
                    vec![Change::Upsert(obj)]
                }
                None => continue,
            },
            Event::Delete(v) => match decode(&v) {
                Some(obj) => vec![Change::Delete(key_of(&obj))],
                None => continue,
            },
            Event::InitDone => {
                let seen = listing[i].take().unwrap_or_default();
                listed[i] = true;
                stale_keys(&view, source, &seen)
                    .into_iter()
                    .map(Change::Delete)
                    .collect()
            }
        };
        if view.apply(changes) && listed.iter().all(|l| *l) {
            tx.send_replace(Arc::new(view.clone()));
        }
        if listed.iter().all(|l| *l) && !*synced_tx.borrow() {
            tx.send_replace(Arc::new(view.clone()));
            synced_tx.send_replace(true);
            info!(
                node = %node,
                namespaces = view.namespaces.len(),
                pods = view.pods.len(),
                "node agent: namespaces and this node's pods listed"
            );
        }
    }
}

fn decode(v: &Value) -> Option<Object> {
    match decode_json_value(v) {
        Ok(obj) => obj,
        Err(f) => {
            debug!(error = %f.error, "node agent: object not understood; ignored");
            None
        }
    }
}

/// Keys the view holds for `source` that a finished relist did not list.
fn stale_keys(view: &MeshView, source: Source, seen: &HashSet<ObjectKey>) -> Vec<ObjectKey> {
    match source {
        Source::Namespaces => view
            .namespaces
            .keys()
            .map(|n| ObjectKey::new(Kind::Namespace, "", n))
            .filter(|k| !seen.contains(k))
            .collect(),
        Source::Pods => view
            .pods
            .keys()
            .map(|(ns, n)| ObjectKey::new(Kind::Pod, ns, n))
            .filter(|k| !seen.contains(k))
            .collect(),
    }
}

fn map_event<K, V>(ev: Event<K>, f: impl Fn(K) -> V) -> Event<V> {
    match ev {
        Event::Apply(o) => Event::Apply(f(o)),
        Event::Delete(o) => Event::Delete(f(o)),
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(f(o)),
        Event::InitDone => Event::InitDone,
    }
}

/// Runs while the agent lives: enrolls running pods the view says belong
/// in the mesh and the agent has not seen (see the module doc).
pub async fn adopt_running_pods(
    agent: AgentClient,
    mut view: watch::Receiver<Arc<MeshView>>,
    finder: NetnsFinder,
) {
    loop {
        let v = view.borrow_and_update().clone();
        adopt(&agent, &v, &finder).await;
        tokio::select! {
            r = view.changed() => if r.is_err() { return },
            () = tokio::time::sleep(ADOPT_RETRY) => {}
        }
    }
}

async fn adopt(agent: &AgentClient, view: &MeshView, finder: &NetnsFinder) {
    let known: BTreeSet<(String, String)> = agent
        .pods()
        .await
        .into_iter()
        .map(|r| (r.pod.namespace, r.pod.name))
        .collect();
    for ((ns, name), info) in &view.pods {
        let candidate = info.running
            && !info.uid.is_empty()
            && !info.ips.is_empty()
            && view.enrolled(ns, name)
            && !known.contains(&(ns.clone(), name.clone()));
        if !candidate {
            continue;
        }
        let pod = format!("{ns}/{name}");
        let (f, uid) = (finder.clone(), info.uid.clone());
        let found = tokio::task::spawn_blocking(move || f.find(&uid)).await;
        let netns = match found {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                warn!(%pod, error = %e, "cannot find the network namespace of a running pod; retrying later");
                continue;
            }
            Err(e) => {
                warn!(%pod, error = %e, "netns search failed");
                continue;
            }
        };
        let reply = agent
            .handle(Request {
                command: Command::Add,
                container_id: format!("adopted-{}", info.uid),
                netns: netns.clone(),
                ifname: "eth0".into(),
                pod: PodRef {
                    name: name.clone(),
                    namespace: ns.clone(),
                    uid: info.uid.clone(),
                },
                ips: info.ips.clone(),
            })
            .await;
        if reply.ok {
            info!(%pod, netns = %netns.display(), "running pod enrolled without a CNI ADD");
        } else {
            warn!(%pod, error = %reply.error.unwrap_or_default(), "cannot enroll a running pod; retrying later");
        }
    }
}
