//! The agent task and the pod table it owns.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ambit_proto::workload::zds::WorkloadInfo;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use super::Event;
use super::view::MeshView;
use super::zds::{ZdsServerError, ZtunnelConnection};
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
    /// Loads the table, keeping only pods whose netns still exists; an
    /// enrolled pod whose redirection chain is gone is marked not enrolled
    /// (the reconcile puts it back if it should be).
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
    ztunnel: Option<ZtunnelConnection>,
    zds_socket: PathBuf,
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
        ztunnel: None,
        zds_socket,
    };
    task.reconcile().await;
    loop {
        tokio::select! {
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
                task.ztunnel = Some(z);
                task.send_snapshot().await;
            }
        }
    }
}

impl AgentTask {
    fn ztunnel(&self) -> Result<&ZtunnelConnection, ZdsServerError> {
        self.ztunnel
            .as_ref()
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
        redirect::install(&rec.netns, &self.ports).map_err(|e| e.to_string())?;
        let handed = match self.ztunnel() {
            Ok(z) => z.add(&rec.uid(), self.info(rec), &rec.netns).await,
            Err(e) => Err(e),
        };
        if let Err(e) = handed {
            if matches!(e, ZdsServerError::Io(_)) {
                self.ztunnel = None;
            }
            let _ = redirect::remove(&rec.netns);
            return Err(e.to_string());
        }
        tracing::info!(uid = %rec.uid(), pod = %format!("{}/{}", rec.pod.namespace, rec.pod.name), "pod enrolled");
        Ok(())
    }

    /// Tells ztunnel the pod left (best effort) and removes its redirection.
    async fn release(&mut self, rec: &PodRecord) {
        if let Some(z) = &self.ztunnel
            && let Err(e) = z.del(&rec.uid()).await
        {
            tracing::warn!(uid = %rec.uid(), error = %e, "ztunnel did not ack the pod's removal");
            if matches!(e, ZdsServerError::Io(_)) {
                self.ztunnel = None;
            }
        }
        if let Err(e) = redirect::remove(&rec.netns) {
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
                    Some(rec) if rec.enrolled => match redirect::is_installed(&rec.netns) {
                        Ok(true) => Reply::ok(true),
                        Ok(false) => Reply::error(format!("pod {uid}: redirection missing"), false),
                        Err(e) => Reply::error(e.to_string(), false),
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
            if want == rec.enrolled {
                continue;
            }
            if want {
                match self.enroll(&rec).await {
                    Ok(()) => {
                        if let Some(r) = self.table.pods.get_mut(&uid) {
                            r.enrolled = true;
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
    async fn send_snapshot(&mut self) {
        let enrolled: Vec<PodRecord> = self
            .table
            .pods
            .values()
            .filter(|r| r.enrolled)
            .cloned()
            .collect();
        let Some(z) = self.ztunnel.clone() else {
            return;
        };
        for rec in &enrolled {
            if let Err(e) = z.add(&rec.uid(), self.info(rec), &rec.netns).await {
                tracing::warn!(uid = %rec.uid(), error = %e, "snapshot: ztunnel refused a pod");
                if matches!(e, ZdsServerError::Io(_)) {
                    self.ztunnel = None;
                    return;
                }
            }
        }
        if let Err(e) = z.snapshot_sent().await {
            tracing::warn!(error = %e, "snapshot: SnapshotSent failed");
            self.ztunnel = None;
            return;
        }
        tracing::info!(pods = enrolled.len(), "snapshot sent to ztunnel");
        self.reconcile().await;
    }
}
