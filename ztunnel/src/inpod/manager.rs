//! The single owner of ztunnel's enrolled pods: uid → (netns, listeners).
//!
//! Fed [`InpodCommand`]s by the ZDS client; for each added pod it opens, inside
//! the pod's netns, listeners on `0.0.0.0` and `[::]` for 15001 (outbound),
//! 15006 (inbound plaintext) and 15008 (inbound HBONE), and closes them when
//! the pod is deleted or is missing from the agent's snapshot.
//!
//! A bind that finds the port taken (another ztunnel handing the pod over,
//! or connections of one in TIME_WAIT) is retried with backoff for
//! [`BIND_RETRY_BUDGET`], well inside the agent's ack timeout. A pod that
//! still cannot be served is refused (the agent retries) and listed in
//! [`InpodHandle::unserved`] until it is served or gone, so readiness says
//! so.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ambit_inpod::netns::{UNSPECIFIED, listener_socket};
use ambit_inpod::{InpodCommand, InpodEvent, NetnsId, NetnsSockets, PodNetns};
use ambit_proto::workload::zds::WorkloadInfo;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::drain::{self, DrainTrigger, DrainWatcher};
use crate::proxy::{self, PodConnections, ProxyContext};

/// Why a pod could not be set up; the text goes back in the ZDS ack.
#[derive(Debug, thiserror::Error)]
pub enum InpodError {
    #[error(
        "cannot open listeners in the netns {netns} of pod {pod}: {source} (is another process \
         in the pod using ports 15001/15006/15008?)"
    )]
    Listen {
        pod: String,
        netns: NetnsId,
        source: io::Error,
    },
    #[error("pod {pod}: the listener setup task failed: {reason}")]
    Task { pod: String, reason: String },
    #[error(
        "KeepWorkload for uid {uid:?}, which this ztunnel does not have; send AddWorkload with \
         its netns fd instead"
    )]
    KeepUnknown { uid: String },
    #[error("KeepWorkload for uid {uid:?} after SnapshotSent; Keep is only valid in a snapshot")]
    KeepAfterSnapshot { uid: String },
}

/// Which listeners each pod gets.
#[derive(Debug, Clone)]
pub struct InpodConfig {
    pub outbound_port: u16,
    pub inbound_plaintext_port: u16,
    pub inbound_hbone_port: u16,
    /// Set `IP_TRANSPARENT` on the 15001/15006 listeners (falls back to
    /// without it, with a warning, when not permitted).
    pub transparent: bool,
}

impl Default for InpodConfig {
    fn default() -> Self {
        Self {
            outbound_port: 15001,
            inbound_plaintext_port: 15006,
            inbound_hbone_port: 15008,
            transparent: true,
        }
    }
}

/// What a listener in a pod is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ListenerRole {
    Outbound,
    InboundPlaintext,
    InboundHbone,
}

impl ListenerRole {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Outbound => "outbound",
            Self::InboundPlaintext => "inbound-plaintext",
            Self::InboundHbone => "inbound-hbone",
        }
    }
}

/// One enrolled pod as the rest of ztunnel (and tests) see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodSummary {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    pub netns: NetnsId,
    /// Addresses listened on inside the pod's netns, with their role.
    pub listeners: Vec<(ListenerRole, SocketAddr)>,
}

/// The current pods, by uid.
pub type PodSet = BTreeMap<String, PodSummary>;

/// Pods the node agent handed over that this ztunnel could not serve:
/// `namespace/name (uid …)` → why. Empty when every handed pod is served.
pub type UnservedSet = BTreeMap<String, String>;

/// The entry [`UnservedSet`] holds until the node agent's first snapshot.
fn awaiting_snapshot() -> (String, String) {
    (
        "(every enrolled pod)".to_string(),
        "waiting for the node agent's first snapshot over ZDS; is ambit-node-agent running on this node?".to_string(),
    )
}

/// How long a bind that finds the port in use is retried before the pod is
/// refused. Below the agent's ack timeout (5 s), so the agent hears why.
pub const BIND_RETRY_BUDGET: Duration = Duration::from_secs(2);
/// First delay between bind attempts; doubles up to [`BIND_RETRY_MAX_DELAY`].
pub const BIND_RETRY_INITIAL_DELAY: Duration = Duration::from_millis(10);
/// Longest delay between bind attempts.
pub const BIND_RETRY_MAX_DELAY: Duration = Duration::from_millis(250);

/// Handle to a running [`InpodManager`].
#[derive(Debug)]
pub struct InpodHandle {
    /// Give this to [`ambit_inpod::ZdsClient::new`].
    pub commands: mpsc::Sender<InpodCommand>,
    /// The pod set, updated before each ack is sent.
    pub pods: watch::Receiver<PodSet>,
    /// Pods handed over but not served (their listeners could not be made).
    pub unserved: watch::Receiver<UnservedSet>,
    /// Ends after draining, once every pod's listeners are closed.
    pub task: JoinHandle<()>,
}

/// The manager's record of one enrolled pod: what it must close or drain
/// when the pod goes.
struct EnrolledPod {
    netns: PodNetns,
    summary: PodSummary,
    accept_tasks: Vec<JoinHandle<()>>,
    /// Drains the pod's connections when it goes.
    drain: DrainTrigger,
    connections: Option<PodConnections>,
}

/// Owns every pod's listeners; driven only through its command channel.
pub struct InpodManager {
    cfg: InpodConfig,
    /// The proxies accepted connections go to; `None` only accepts and
    /// closes (listener lifecycle tests).
    proxy: Option<Arc<ProxyContext>>,
    pods: HashMap<String, EnrolledPod>,
    /// `Some` between a (re)connect and `SnapshotSent`: the uids the agent
    /// has mentioned so far.
    seen: Option<HashSet<String>>,
    published: watch::Sender<PodSet>,
    /// uid → (shown name, why) of pods refused; see [`UnservedSet`].
    unserved: BTreeMap<String, (String, String)>,
    published_unserved: watch::Sender<UnservedSet>,
    /// What a pod's live connections get once it drains (ztunnel's own).
    drain_deadline: std::time::Duration,
    /// The node agent's first snapshot has been received.
    snapshot_seen: bool,
}

impl InpodManager {
    /// Starts the owner task.
    pub fn spawn(
        cfg: InpodConfig,
        drain: DrainWatcher,
        proxy: Option<Arc<ProxyContext>>,
    ) -> InpodHandle {
        let (commands, rx) = mpsc::channel(64);
        let (published, pods) = watch::channel(PodSet::new());
        let (published_unserved, unserved) =
            watch::channel(UnservedSet::from([awaiting_snapshot()]));
        let manager = Self {
            cfg,
            proxy,
            pods: HashMap::new(),
            seen: None,
            published,
            unserved: BTreeMap::new(),
            published_unserved,
            drain_deadline: drain.deadline(),
            snapshot_seen: false,
        };
        let task = tokio::spawn(manager.run(rx, drain));
        InpodHandle {
            commands,
            pods,
            unserved,
            task,
        }
    }

    async fn run(mut self, mut rx: mpsc::Receiver<InpodCommand>, drain: DrainWatcher) {
        loop {
            let cmd = tokio::select! {
                _ = drain.signaled() => break,
                cmd = rx.recv() => match cmd {
                    Some(cmd) => cmd,
                    None => break,
                },
            };
            let outcome = self.handle(cmd.event).await.map_err(|e| e.to_string());
            self.publish();
            // The client may have gone away meanwhile; nothing to tell then.
            let _ = cmd.reply.send(outcome);
        }
        let uids: Vec<String> = self.pods.keys().cloned().collect();
        let mut draining = Vec::new();
        for uid in uids {
            draining.extend(self.remove(&uid, "ztunnel is shutting down").await);
        }
        self.publish();
        // Live connections get the drain deadline to finish.
        let all = futures::future::join_all(draining.into_iter().map(PodConnections::closed));
        let _ = tokio::time::timeout(self.drain_deadline, all).await;
    }

    fn publish(&self) {
        let set: PodSet = self
            .pods
            .iter()
            .map(|(uid, pod)| (uid.clone(), pod.summary.clone()))
            .collect();
        self.published.send_if_modified(|current| {
            if *current == set {
                false
            } else {
                *current = set;
                true
            }
        });
        let mut unserved: UnservedSet = self.unserved.values().cloned().collect();
        if !self.snapshot_seen {
            // Not ready before the node agent said which pods are ours: a
            // new ztunnel of a rolling update must hold every pod before
            // the old one is stopped.
            let (pod, why) = awaiting_snapshot();
            unserved.insert(pod, why);
        }
        self.published_unserved.send_if_modified(|current| {
            if *current == unserved {
                false
            } else {
                *current = unserved;
                true
            }
        });
    }

    async fn handle(&mut self, event: InpodEvent) -> Result<(), InpodError> {
        match event {
            InpodEvent::Connected => {
                self.seen = Some(HashSet::new());
                Ok(())
            }
            InpodEvent::Add { uid, info, netns } => {
                if let Some(seen) = &mut self.seen {
                    seen.insert(uid.clone());
                }
                let shown = format!("{}/{} (uid {uid})", info.namespace, info.name);
                let added = self.add(uid.clone(), info, netns).await;
                match &added {
                    Ok(()) => {
                        self.unserved.remove(&uid);
                    }
                    Err(e) => {
                        warn!(pod = %shown, error = %e, "ZDS: cannot serve the pod; the node agent will retry");
                        self.unserved.insert(uid, (shown, e.to_string()));
                    }
                }
                added
            }
            InpodEvent::Keep { uid } => {
                let Some(seen) = &mut self.seen else {
                    return Err(InpodError::KeepAfterSnapshot { uid });
                };
                if !self.pods.contains_key(&uid) {
                    return Err(InpodError::KeepUnknown { uid });
                }
                seen.insert(uid);
                Ok(())
            }
            InpodEvent::Del { uid } => {
                if let Some(seen) = &mut self.seen {
                    seen.remove(&uid);
                }
                self.unserved.remove(&uid);
                // Deleting a pod this ztunnel never had is fine (idempotent).
                self.remove(&uid, "deleted by the node agent").await;
                Ok(())
            }
            InpodEvent::SnapshotSent => {
                self.snapshot_seen = true;
                let Some(seen) = self.seen.take() else {
                    debug!("ZDS: SnapshotSent outside a snapshot; nothing to reconcile");
                    return Ok(());
                };
                let stale: Vec<String> = self
                    .pods
                    .keys()
                    .filter(|uid| !seen.contains(*uid))
                    .cloned()
                    .collect();
                for uid in stale {
                    self.remove(&uid, "missing from the node agent's snapshot")
                        .await;
                }
                self.unserved.retain(|uid, _| seen.contains(uid));
                Ok(())
            }
        }
    }

    async fn add(
        &mut self,
        uid: String,
        info: WorkloadInfo,
        netns: PodNetns,
    ) -> Result<(), InpodError> {
        let pod_name = format!("{}/{} (uid {uid})", info.namespace, info.name);
        if let Some(existing) = self.pods.get_mut(&uid) {
            if existing.netns.id() == netns.id() {
                // A re-add (e.g. after reconnecting): keep the listeners.
                existing.summary.name = info.name;
                existing.summary.namespace = info.namespace;
                existing.summary.service_account = info.service_account;
                debug!(pod = %pod_name, "ZDS: pod already enrolled in the same netns");
                return Ok(());
            }
            // Same uid, new sandbox: start over in the new netns.
            self.remove(&uid, "its netns changed").await;
        }

        let specs = self.listener_specs();
        let bind_netns = netns.clone();
        let want_sockets = self.proxy.is_some();
        let bound = tokio::task::spawn_blocking(move || {
            let listeners = bind_with_retry(&bind_netns, &specs)?;
            let sockets = if want_sockets {
                Some(NetnsSockets::spawn(&bind_netns)?)
            } else {
                None
            };
            Ok::<_, io::Error>((listeners, sockets))
        })
        .await
        .map_err(|e| InpodError::Task {
            pod: pod_name.clone(),
            reason: e.to_string(),
        })?
        .map_err(|source| InpodError::Listen {
            pod: pod_name.clone(),
            netns: netns.id(),
            source,
        })?;

        let (bound, sockets) = bound;
        let (pod_drain, pod_watcher) = drain::channel_with(self.drain_deadline);
        let (pod_context, connections) = match sockets {
            Some(sockets) => {
                let (p, c) = proxy::PodContext::new(
                    uid.clone(),
                    info.name.clone(),
                    info.namespace.clone(),
                    info.service_account.clone(),
                    sockets,
                    pod_watcher,
                );
                (Some(Arc::new(p)), Some(c))
            }
            None => (None, None),
        };
        let mut accept_tasks = Vec::new();
        let mut addrs = Vec::new();
        for (role, addr, listener) in bound {
            let listener = match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => l,
                Err(source) => {
                    abort_all(accept_tasks).await;
                    return Err(InpodError::Listen {
                        pod: pod_name,
                        netns: netns.id(),
                        source,
                    });
                }
            };
            addrs.push((role, addr));
            let task = match (&self.proxy, &pod_context) {
                (Some(ctx), Some(pod)) => {
                    let (ctx, pod) = (ctx.clone(), pod.clone());
                    match role {
                        ListenerRole::Outbound => {
                            tokio::spawn(proxy::outbound::serve(listener, pod, ctx))
                        }
                        ListenerRole::InboundPlaintext => {
                            tokio::spawn(proxy::inbound::serve_plaintext(listener, pod, ctx))
                        }
                        ListenerRole::InboundHbone => {
                            tokio::spawn(proxy::inbound::serve_hbone(listener, pod, ctx))
                        }
                    }
                }
                _ => tokio::spawn(accept_and_drop(listener, role, uid.clone())),
            };
            accept_tasks.push(task);
        }
        info!(pod = %pod_name, netns = %netns.id(), listeners = addrs.len(), "in-pod listeners open");
        let summary = PodSummary {
            uid: uid.clone(),
            name: info.name,
            namespace: info.namespace,
            service_account: info.service_account,
            netns: netns.id(),
            listeners: addrs,
        };
        self.pods.insert(
            uid,
            EnrolledPod {
                netns,
                summary,
                accept_tasks,
                drain: pod_drain,
                connections,
            },
        );
        Ok(())
    }

    fn listener_specs(&self) -> Vec<(ListenerRole, SocketAddr, bool)> {
        let c = &self.cfg;
        let ports = [
            (ListenerRole::Outbound, c.outbound_port, c.transparent),
            (
                ListenerRole::InboundPlaintext,
                c.inbound_plaintext_port,
                c.transparent,
            ),
            (ListenerRole::InboundHbone, c.inbound_hbone_port, false),
        ];
        ports
            .into_iter()
            .flat_map(|(role, port, transparent)| {
                UNSPECIFIED
                    .into_iter()
                    .map(move |ip| (role, SocketAddr::new(ip, port), transparent))
            })
            .collect()
    }

    /// Closes a pod's listeners (closed when this returns) and tells its
    /// live connections to drain: they get the drain deadline to finish.
    /// Returns what resolves once they have ended.
    async fn remove(&mut self, uid: &str, why: &str) -> Option<PodConnections> {
        let Some(pod) = self.pods.remove(uid) else {
            debug!(uid, why, "ZDS: no such pod to remove");
            return None;
        };
        pod.drain.start();
        abort_all(pod.accept_tasks).await;
        info!(
            uid,
            pod = %format!("{}/{}", pod.summary.namespace, pod.summary.name),
            why,
            "in-pod listeners closed; draining its connections"
        );
        pod.connections
    }
}

/// Binds every listener in `netns`, retrying while a port is in use (a
/// ztunnel handing the pod over still holds it) for [`BIND_RETRY_BUDGET`].
/// Runs on a blocking thread.
fn bind_with_retry(
    netns: &PodNetns,
    specs: &[(ListenerRole, SocketAddr, bool)],
) -> io::Result<Vec<(ListenerRole, SocketAddr, std::net::TcpListener)>> {
    let deadline = std::time::Instant::now() + BIND_RETRY_BUDGET;
    let mut delay = BIND_RETRY_INITIAL_DELAY;
    let mut attempts = 1u32;
    loop {
        match netns.run_in(|| bind_all(specs)) {
            Err(e)
                if e.kind() == io::ErrorKind::AddrInUse
                    && std::time::Instant::now() + delay < deadline =>
            {
                debug!(netns = %netns.id(), error = %e, attempts, "in-pod port in use; retrying the bind");
                std::thread::sleep(delay);
                delay = (delay * 2).min(BIND_RETRY_MAX_DELAY);
                attempts += 1;
            }
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                return Err(io::Error::new(
                    e.kind(),
                    format!(
                        "{e} (still in use after {attempts} attempts over {BIND_RETRY_BUDGET:?})"
                    ),
                ));
            }
            other => return other,
        }
    }
}

/// Binds every listener in the current (pod) namespace. IPv4 failures are
/// fatal; IPv6 failures are not (pods without IPv6 are common).
fn bind_all(
    specs: &[(ListenerRole, SocketAddr, bool)],
) -> io::Result<Vec<(ListenerRole, SocketAddr, std::net::TcpListener)>> {
    let mut out = Vec::with_capacity(specs.len());
    for &(role, addr, transparent) in specs {
        let bound = match listener_socket(addr, transparent) {
            Err(e) if transparent && e.kind() == io::ErrorKind::PermissionDenied => {
                warn!(%addr, error = %e, "IP_TRANSPARENT not permitted; listening without it");
                listener_socket(addr, false)
            }
            other => other,
        };
        match bound {
            Ok(listener) => out.push((role, addr, listener)),
            Err(e) if addr.is_ipv6() => {
                info!(%addr, error = %e, "no IPv6 listener in this pod");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

async fn abort_all(tasks: Vec<JoinHandle<()>>) {
    for task in &tasks {
        task.abort();
    }
    // Awaiting makes sure each listener has been dropped (closed).
    for task in tasks {
        let _ = task.await;
    }
}

/// Accept loop of a manager without proxies: accepts and closes.
async fn accept_and_drop(listener: tokio::net::TcpListener, role: ListenerRole, uid: String) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                debug!(uid, role = role.as_str(), %peer, "accepted; no proxy yet, closing");
                drop(stream);
            }
            Err(e) => {
                warn!(uid, role = role.as_str(), error = %e, "accept failed");
                // E.g. out of fds: do not spin.
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}
