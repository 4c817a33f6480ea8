//! The agent task and the pod table it owns.
//!
//! The redirection runs `ip`/`iptables` children; every call goes through
//! `spawn_blocking` (the children are bounded by
//! [`redirect::operation_timeout`]), so a hung child delays this task by at
//! most that bound and never blocks an async worker.
//!
//! A pod the connected ztunnel refuses while the agent sends it its
//! snapshot (e.g. its ports are still held by the ztunnel it replaces)
//! keeps its redirection — the other ztunnel may still serve it, and
//! removing it would leave the pod unprotected — is marked not `served`,
//! and its handover is retried with backoff ([`HANDOFF_RETRY_MAX`]) until
//! ztunnel takes it. `pods.json` and `ambitctl local status` show it.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ambit_proto::workload::zds::WorkloadInfo;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use super::Event;
use super::view::MeshView;
use super::zds::{ZdsServerError, ZtunnelConnection, Ztunnels};
use crate::protocol::{Command, PodRef, Reply, Request};
use crate::redirect::{self, RedirectPorts};

/// One pod the agent has seen through the plugin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRecord {
    pub pod: PodRef,
    pub container_id: String,
    pub netns: PathBuf,
    pub ips: Vec<IpAddr>,
    /// Redirection installed and handed to ztunnel (or waiting for ztunnel
    /// to reconnect).
    pub enrolled: bool,
    /// `false` while an enrolled pod's redirection is in place but the
    /// connected ztunnel refused it (no listeners): the agent retries.
    #[serde(default = "served_default")]
    pub served: bool,
    /// A sidecar pod's capture is installed (node-agent redirection).
    #[serde(default)]
    pub sidecar_captured: bool,
}

fn served_default() -> bool {
    true
}

/// First delay before handing a refused pod to ztunnel again.
pub const HANDOFF_RETRY_INITIAL: Duration = Duration::from_millis(200);
/// How often the node agent forgets ztunnels that have gone (an old one
/// after a rolling update).
const ZTUNNEL_PRUNE_EVERY: Duration = Duration::from_secs(5);
/// Longest delay between handover retries.
pub const HANDOFF_RETRY_MAX: Duration = Duration::from_secs(5);

/// Runs a blocking redirection call off the async workers.
async fn blocking<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> Result<T, redirect::RedirectError> + Send + 'static,
) -> Result<T, String> {
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(e) => Err(format!("{what}: the blocking task failed: {e}")),
    }
}

async fn install_redirect(netns: &Path, ports: RedirectPorts) -> Result<(), String> {
    let netns = netns.to_path_buf();
    blocking("installing the redirection", move || {
        redirect::install(&netns, &ports)
    })
    .await
}

/// A sidecar pod's capture (node-agent redirection): what `istio-init`
/// would install, so the pod needs no NET_ADMIN.
async fn install_sidecar_capture(netns: &Path) -> Result<(), String> {
    let netns = netns.to_path_buf();
    blocking("installing the sidecar capture", move || {
        redirect::install_sidecar(&netns, &Default::default())
    })
    .await
}

async fn remove_redirect(netns: &Path) -> Result<(), String> {
    let netns = netns.to_path_buf();
    blocking("removing the redirection", move || redirect::remove(&netns)).await
}

async fn redirect_installed(netns: &Path) -> Result<bool, String> {
    let netns = netns.to_path_buf();
    blocking("checking the redirection", move || {
        redirect::is_installed(&netns)
    })
    .await
}

impl PodRecord {
    /// The uid ztunnel knows the pod by: the Kubernetes uid, else
    /// `namespace/name`.
    pub fn uid(&self) -> String {
        if self.pod.uid.is_empty() {
            format!("{}/{}", self.pod.namespace, self.pod.name)
        } else {
            self.pod.uid.clone()
        }
    }
}

/// Every pod of the node, by [`PodRecord::uid`], persisted to
/// `<state-dir>/pods.json` after each change.
#[derive(Debug)]
pub struct PodTable {
    pods: BTreeMap<String, PodRecord>,
    file: PathBuf,
}

impl PodTable {
    /// [`PodTable::load`] on a blocking thread.
    pub async fn load_async(state_dir: &Path) -> Self {
        let dir = state_dir.to_path_buf();
        match tokio::task::spawn_blocking(move || Self::load(&dir)).await {
            Ok(table) => table,
            Err(e) => {
                tracing::warn!(error = %e, "loading the pod table failed; starting empty");
                Self {
                    pods: BTreeMap::new(),
                    file: state_dir.join("pods.json"),
                }
            }
        }
    }

    /// Loads the table, keeping only pods whose netns still exists; an
    /// enrolled pod whose redirection chain is gone is marked not enrolled
    /// (the reconcile puts it back if it should be). Blocks (runs children).
    pub fn load(state_dir: &Path) -> Self {
        let file = state_dir.join("pods.json");
        let mut pods: BTreeMap<String, PodRecord> = std::fs::read(&file)
            .ok()
            .and_then(|b| match serde_json::from_slice(&b) {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::warn!(file = %file.display(), error = %e, "unreadable pod table; starting empty");
                    None
                }
            })
            .unwrap_or_default();
        pods.retain(|uid, rec| {
            let alive = std::fs::File::open(&rec.netns).is_ok();
            if !alive {
                tracing::info!(uid, pod = %format!("{}/{}", rec.pod.namespace, rec.pod.name), "pod's netns is gone; forgetting it");
            }
            alive
        });
        for (uid, rec) in &mut pods {
            if rec.enrolled {
                let marker = redirect::is_installed(&rec.netns).unwrap_or(false);
                tracing::info!(uid, chain = marker, "rediscovered enrolled pod");
                rec.enrolled = marker;
            }
        }
        Self { pods, file }
    }

    /// Removes the redirection of every enrolled pod in the table at
    /// `state_dir` and records them as not enrolled (uninstall: no pod may
    /// stay redirected to a ztunnel that is going away). Returns how many
    /// were released. Blocks (runs children).
    pub fn release_all(state_dir: &Path) -> usize {
        let mut table = Self::load(state_dir);
        let mut released = 0;
        for (uid, rec) in &mut table.pods {
            if !rec.enrolled {
                continue;
            }
            match redirect::remove(&rec.netns) {
                Ok(()) => {
                    rec.enrolled = false;
                    released += 1;
                    tracing::info!(uid, pod = %format!("{}/{}", rec.pod.namespace, rec.pod.name), "redirection removed (uninstall)");
                }
                Err(e) => {
                    tracing::warn!(uid, error = %e, "cannot remove a pod's redirection")
                }
            }
        }
        table.save();
        released
    }

    fn save(&self) {
        let tmp = self.file.with_extension("json.tmp");
        let write = serde_json::to_vec_pretty(&self.pods)
            .map_err(std::io::Error::other)
            .and_then(|b| std::fs::write(&tmp, b))
            .and_then(|()| std::fs::rename(&tmp, &self.file));
        if let Err(e) = write {
            tracing::warn!(file = %self.file.display(), error = %e, "cannot persist the pod table");
        }
    }
}

struct AgentTask {
    table: PodTable,
    ports: RedirectPorts,
    view: Arc<MeshView>,
    ztunnels: Ztunnels,
    zds_socket: PathBuf,
    /// Next handover retry of unserved pods, and the delay after it.
    retry: Option<(tokio::time::Instant, Duration)>,
}

pub(super) async fn run(
    table: PodTable,
    ports: RedirectPorts,
    mut view_rx: watch::Receiver<Arc<MeshView>>,
    mut events: mpsc::Receiver<Event>,
    mut ztunnels: mpsc::Receiver<ZtunnelConnection>,
    zds_socket: PathBuf,
) {
    let view = view_rx.borrow_and_update().clone();
    let mut task = AgentTask {
        table,
        ports,
        view,
        ztunnels: Ztunnels::default(),
        zds_socket,
        retry: None,
    };
    task.reconcile().await;
    let mut prune = tokio::time::interval(ZTUNNEL_PRUNE_EVERY);
    prune.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let retry_at = task.retry.map(|(at, _)| at);
        tokio::select! {
            () = sleep_until(retry_at) => {
                task.retry_unserved().await;
            }
            ev = events.recv() => match ev {
                None => return,
                Some(Event::Cni(req, reply)) => {
                    let r = task.cni(req).await;
                    let _ = reply.send(r);
                }
                Some(Event::Pods(reply)) => {
                    let _ = reply.send(task.table.pods.values().cloned().collect());
                }
            },
            changed = view_rx.changed() => {
                if changed.is_err() {
                    return;
                }
                task.view = view_rx.borrow_and_update().clone();
                task.reconcile().await;
            }
            Some(z) = ztunnels.recv() => {
                task.ztunnels.prune();
                task.ztunnels.connected(z.clone());
                task.send_snapshot(z).await;
            }
            _ = prune.tick() => task.ztunnels.prune(),
        }
    }
}

impl AgentTask {
    /// The newest ztunnel: the one new pods go to.
    fn ztunnel(&self) -> Result<ZtunnelConnection, ZdsServerError> {
        self.ztunnels
            .latest()
            .ok_or_else(|| ZdsServerError::NotConnected(self.zds_socket.clone()))
    }

    fn info(&self, rec: &PodRecord) -> WorkloadInfo {
        WorkloadInfo {
            name: rec.pod.name.clone(),
            namespace: rec.pod.namespace.clone(),
            service_account: self.view.service_account(&rec.pod.namespace, &rec.pod.name),
        }
    }

    /// Installs the redirection and hands the pod to ztunnel. On failure the
    /// redirection is removed again: a pod must not be captured with no
    /// ztunnel listening.
    async fn enroll(&mut self, rec: &PodRecord) -> Result<(), String> {
        if let Err(e) = install_redirect(&rec.netns, self.ports).await {
            // A failed install (e.g. a child timed out) may have left part
            // of it (the ip rule); take back what is there.
            if let Err(undo) = remove_redirect(&rec.netns).await {
                tracing::debug!(uid = %rec.uid(), error = %undo, "cleaning up a failed install");
            }
            return Err(e);
        }
        let handed = match self.ztunnel() {
            Ok(z) => {
                let r = z.add(&rec.uid(), self.info(rec), &rec.netns).await;
                if matches!(r, Err(ZdsServerError::Io(_))) {
                    self.ztunnels.lost(&z);
                }
                r
            }
            Err(e) => Err(e),
        };
        if let Err(e) = handed {
            if let Err(undo) = remove_redirect(&rec.netns).await {
                tracing::warn!(uid = %rec.uid(), error = %undo, "cannot undo the redirection of a pod ztunnel did not take");
            }
            return Err(e.to_string());
        }
        tracing::info!(uid = %rec.uid(), pod = %format!("{}/{}", rec.pod.namespace, rec.pod.name), "pod enrolled");
        Ok(())
    }

    /// Tells every connected ztunnel the pod left (best effort) and
    /// removes its redirection.
    async fn release(&mut self, rec: &PodRecord) {
        for z in self.ztunnels.all() {
            if let Err(e) = z.del(&rec.uid()).await {
                tracing::warn!(uid = %rec.uid(), error = %e, "ztunnel did not ack the pod's removal");
                if matches!(e, ZdsServerError::Io(_)) {
                    self.ztunnels.lost(&z);
                }
            }
        }
        if let Err(e) = remove_redirect(&rec.netns).await {
            // A deleted pod's netns may be gone already: nothing to remove.
            tracing::debug!(uid = %rec.uid(), error = %e, "removing the redirection");
        }
        tracing::info!(uid = %rec.uid(), pod = %format!("{}/{}", rec.pod.namespace, rec.pod.name), "pod released");
    }

    async fn cni(&mut self, req: Request) -> Reply {
        let key = PodRecord {
            pod: req.pod.clone(),
            container_id: req.container_id.clone(),
            netns: req.netns.clone(),
            ips: req.ips.clone(),
            enrolled: false,
            served: true,
            sidecar_captured: false,
        };
        let uid = key.uid();
        match req.command {
            Command::Add => {
                if let Some(old) = self.table.pods.remove(&uid)
                    && old.enrolled
                    && old.netns != req.netns
                {
                    self.release(&old).await;
                }
                let mut rec = key;
                let want = self.view.enrolled(&rec.pod.namespace, &rec.pod.name);
                if want {
                    if let Err(e) = self.enroll(&rec).await {
                        self.table.save();
                        return Reply::error(
                            format!(
                                "cannot enroll pod {}/{}: {e}",
                                rec.pod.namespace, rec.pod.name
                            ),
                            true,
                        );
                    }
                    rec.enrolled = true;
                } else if self.view.sidecar_capture(&rec.pod.namespace, &rec.pod.name) {
                    if let Err(e) = install_sidecar_capture(&rec.netns).await {
                        return Reply::error(
                            format!(
                                "cannot install the sidecar capture of pod {}/{}: {e}",
                                rec.pod.namespace, rec.pod.name
                            ),
                            true,
                        );
                    }
                    rec.sidecar_captured = true;
                }
                self.table.pods.insert(uid, rec);
                self.table.save();
                Reply::ok(want)
            }
            Command::Del => {
                let found = self
                    .table
                    .pods
                    .iter()
                    .find(|(k, r)| **k == uid || r.container_id == req.container_id)
                    .map(|(k, _)| k.clone());
                if let Some(k) = found
                    && let Some(rec) = self.table.pods.remove(&k)
                {
                    if rec.enrolled {
                        self.release(&rec).await;
                    }
                    self.table.save();
                }
                Reply::ok(false)
            }
            Command::Check => {
                let want = self.view.enrolled(&req.pod.namespace, &req.pod.name);
                match self.table.pods.get(&uid) {
                    None => {
                        Reply::error(format!("pod {} is unknown to the node agent", uid), false)
                    }
                    Some(rec) if rec.enrolled != want => Reply::error(
                        format!("pod {uid}: enrolled={} but should be {want}", rec.enrolled),
                        true,
                    ),
                    Some(rec) if rec.enrolled && !rec.served => Reply::error(
                        format!(
                            "pod {uid}: redirected but ztunnel does not serve it yet (retrying)"
                        ),
                        true,
                    ),
                    Some(rec) if rec.enrolled => match redirect_installed(&rec.netns).await {
                        Ok(true) => Reply::ok(true),
                        Ok(false) => Reply::error(format!("pod {uid}: redirection missing"), false),
                        Err(e) => Reply::error(e, false),
                    },
                    Some(_) => Reply::ok(false),
                }
            }
        }
    }

    /// Brings every known pod to what the view says.
    async fn reconcile(&mut self) {
        let uids: Vec<String> = self.table.pods.keys().cloned().collect();
        let mut changed = false;
        for uid in uids {
            let Some(rec) = self.table.pods.get(&uid).cloned() else {
                continue;
            };
            let want = self.view.enrolled(&rec.pod.namespace, &rec.pod.name);
            if !rec.sidecar_captured && self.view.sidecar_capture(&rec.pod.namespace, &rec.pod.name)
            {
                // The view learnt the pod after its ADD: capture it now.
                match install_sidecar_capture(&rec.netns).await {
                    Ok(()) => {
                        if let Some(r) = self.table.pods.get_mut(&uid) {
                            r.sidecar_captured = true;
                        }
                        changed = true;
                    }
                    Err(e) => {
                        tracing::warn!(uid, error = %e, "cannot install a sidecar pod's capture; will retry on the next change")
                    }
                }
            }
            if want == rec.enrolled {
                continue;
            }
            if want {
                match self.enroll(&rec).await {
                    Ok(()) => {
                        if let Some(r) = self.table.pods.get_mut(&uid) {
                            r.enrolled = true;
                            r.served = true;
                        }
                        changed = true;
                    }
                    Err(e) => {
                        tracing::warn!(uid, error = %e, "cannot enroll running pod; will retry on the next change or ztunnel connection")
                    }
                }
            } else {
                self.release(&rec).await;
                if let Some(r) = self.table.pods.get_mut(&uid) {
                    r.enrolled = false;
                }
                changed = true;
            }
        }
        if changed {
            self.table.save();
        }
    }

    /// Sends every enrolled pod, then `SnapshotSent`, to a (re)connected
    /// ztunnel; then enrolls pods that should be but could not be before.
    /// Hands every enrolled pod to a ztunnel that just connected.
    async fn send_snapshot(&mut self, z: ZtunnelConnection) {
        let enrolled: Vec<PodRecord> = self
            .table
            .pods
            .values()
            .filter(|r| r.enrolled)
            .cloned()
            .collect();
        for rec in &enrolled {
            let served = match z.add(&rec.uid(), self.info(rec), &rec.netns).await {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(uid = %rec.uid(), error = %e, "snapshot: ztunnel refused a pod; keeping its redirection and retrying the handover");
                    if matches!(e, ZdsServerError::Io(_)) {
                        self.ztunnels.lost(&z);
                        return;
                    }
                    false
                }
            };
            self.set_served(&rec.uid(), served);
        }
        self.table.save();
        self.schedule_retry(HANDOFF_RETRY_INITIAL);
        if let Err(e) = z.snapshot_sent().await {
            tracing::warn!(error = %e, "snapshot: SnapshotSent failed");
            self.ztunnels.lost(&z);
            return;
        }
        tracing::info!(pods = enrolled.len(), "snapshot sent to ztunnel");
        self.reconcile().await;
    }

    fn set_served(&mut self, uid: &str, served: bool) {
        if let Some(r) = self.table.pods.get_mut(uid) {
            r.served = served;
        }
    }

    /// Arms the retry timer when some enrolled pod is unserved, else clears it.
    fn schedule_retry(&mut self, delay: Duration) {
        let any = self.table.pods.values().any(|r| r.enrolled && !r.served);
        self.retry = any.then(|| (tokio::time::Instant::now() + delay, delay));
    }

    /// Hands every enrolled-but-unserved pod to ztunnel again.
    async fn retry_unserved(&mut self) {
        let delay = self.retry.map_or(HANDOFF_RETRY_INITIAL, |(_, d)| d);
        let Some(z) = self.ztunnels.latest() else {
            // A reconnecting ztunnel gets the whole snapshot anyway.
            self.retry = None;
            return;
        };
        let unserved: Vec<PodRecord> = self
            .table
            .pods
            .values()
            .filter(|r| r.enrolled && !r.served)
            .cloned()
            .collect();
        for rec in &unserved {
            match z.add(&rec.uid(), self.info(rec), &rec.netns).await {
                Ok(()) => {
                    tracing::info!(uid = %rec.uid(), pod = %format!("{}/{}", rec.pod.namespace, rec.pod.name), "ztunnel took the pod on a retry");
                    self.set_served(&rec.uid(), true);
                }
                Err(ZdsServerError::Io(e)) => {
                    tracing::warn!(error = %e, "ZDS connection lost while retrying a handover");
                    self.ztunnels.lost(&z);
                    self.retry = None;
                    return;
                }
                Err(e) => {
                    tracing::warn!(uid = %rec.uid(), error = %e, retry_in = ?delay, "ztunnel still refuses the pod");
                }
            }
        }
        self.table.save();
        self.schedule_retry((delay * 2).min(HANDOFF_RETRY_MAX));
    }
}

/// Sleeps until `at`, or forever when there is nothing to wait for.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
