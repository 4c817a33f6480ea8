//! What the node agent knows of the cluster: namespace labels and pod
//! labels / service accounts — enough to decide whether a pod is enrolled.
//!
//! One seam, two sides: [`spawn_dir_view`] reads the control plane's config
//! directory (local mode); `super::kube::spawn_kube_view` watches the API
//! server and publishes the same [`MeshView`] on the same `watch` channel.
//!
//! The directory is read with the control plane's own reader
//! ([`ambit_config::ConfigDir`]) and the view follows the reader's changes,
//! so both sides agree on every object: a rejected or half-written document
//! keeps its last good version (a broken namespaces file does not release
//! the namespace's pods), and only files that changed are parsed again.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ambit_config::objects::{Kind, Labels, Object};
use ambit_config::{Change, ConfigDir, config_files, is_enrolled, wants_sidecar_capture};
use tokio::sync::watch;

/// One pod as the view knows it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodInfo {
    pub labels: Labels,
    pub service_account: String,
    /// `metadata.uid` (empty when the source does not say).
    pub uid: String,
    /// `status.podIPs` (or `podIP`).
    pub ips: Vec<std::net::IpAddr>,
    /// `status.phase` is `Running`: its sandbox and netns exist, so the
    /// agent may enroll it without a CNI ADD (Kubernetes mode).
    pub running: bool,
    /// An injected sidecar pod whose capture the node agent installs
    /// ([`ambit_config::wants_sidecar_capture`]).
    pub sidecar_capture: bool,
}

/// Namespace and pod labels, immutable once published.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MeshView {
    pub namespaces: HashMap<String, Labels>,
    /// By `(namespace, name)`.
    pub pods: HashMap<(String, String), PodInfo>,
}

impl MeshView {
    /// Builds a view from decoded objects.
    pub fn from_objects(objects: impl IntoIterator<Item = Object>) -> Self {
        let mut view = Self::default();
        view.apply(objects.into_iter().map(Change::Upsert));
        view
    }

    /// The union of `views`; where two define a namespace or pod, the
    /// first one's wins.
    pub fn merged(views: &[Arc<MeshView>]) -> Self {
        let mut out = Self::default();
        for v in views.iter().rev() {
            out.namespaces
                .extend(v.namespaces.iter().map(|(k, l)| (k.clone(), l.clone())));
            out.pods
                .extend(v.pods.iter().map(|(k, p)| (k.clone(), p.clone())));
        }
        out
    }

    /// Applies a config reader's changes; true when the view changed.
    pub fn apply(&mut self, changes: impl IntoIterator<Item = Change>) -> bool {
        let before = self.clone();
        for c in changes {
            match c {
                Change::Upsert(Object::Namespace(ns)) => {
                    self.namespaces.insert(ns.metadata.name, ns.metadata.labels);
                }
                Change::Upsert(Object::Pod(p)) => {
                    let sa = p.service_account().to_string();
                    let mut ips: Vec<std::net::IpAddr> =
                        p.status.pod_ips.iter().map(|i| i.ip).collect();
                    if ips.is_empty() {
                        ips.extend(p.status.pod_ip);
                    }
                    let sidecar_capture =
                        wants_sidecar_capture(&p.metadata.labels, &p.metadata.annotations);
                    self.pods.insert(
                        (p.metadata.namespace, p.metadata.name),
                        PodInfo {
                            sidecar_capture,
                            labels: p.metadata.labels,
                            service_account: sa,
                            uid: p.metadata.uid,
                            ips,
                            running: p.status.phase == "Running",
                        },
                    );
                }
                Change::Upsert(_) => {}
                Change::Delete(k) => match k.kind {
                    Kind::Namespace => {
                        self.namespaces.remove(&k.name);
                    }
                    Kind::Pod => {
                        self.pods.remove(&(k.namespace, k.name));
                    }
                    _ => {}
                },
            }
        }
        *self != before
    }

    /// Whether pod `namespace/name` belongs in the mesh: its own
    /// `istio.io/dataplane-mode` label wins, else its namespace's.
    pub fn enrolled(&self, namespace: &str, name: &str) -> bool {
        let empty = Labels::new();
        let ns = self.namespaces.get(namespace).unwrap_or(&empty);
        let pod = self
            .pods
            .get(&(namespace.to_string(), name.to_string()))
            .map_or(&empty, |p| &p.labels);
        is_enrolled(ns, pod)
    }

    /// Whether pod `namespace/name` is a sidecar pod whose capture the node
    /// agent installs (never one the mesh enrolls: ambient wins).
    pub fn sidecar_capture(&self, namespace: &str, name: &str) -> bool {
        !self.enrolled(namespace, name)
            && self
                .pods
                .get(&(namespace.to_string(), name.to_string()))
                .is_some_and(|p| p.sidecar_capture)
    }

    /// The pod's service account (`default` when unknown).
    pub fn service_account(&self, namespace: &str, name: &str) -> String {
        self.pods
            .get(&(namespace.to_string(), name.to_string()))
            .map(|p| p.service_account.clone())
            .filter(|sa| !sa.is_empty())
            .unwrap_or_else(|| "default".to_string())
    }
}

/// How often the config directory is checked for changes. A change is
/// read once the directory looked the same at two checks in a row, so a
/// file still being written is not read half-way.
pub const DIR_POLL: Duration = Duration::from_millis(200);

/// (modified, length) of every config file the control plane reads: a
/// cheap change detector.
type Signature = BTreeMap<PathBuf, (Option<SystemTime>, u64)>;

fn signature(dir: &Path) -> Signature {
    config_files(dir)
        .into_iter()
        .map(|p| {
            let meta = std::fs::metadata(&p).ok();
            let stamp = (
                meta.as_ref().and_then(|m| m.modified().ok()),
                meta.map_or(0, |m| m.len()),
            );
            (p, stamp)
        })
        .collect()
}

/// A config directory read with the shared reader, and the view built from
/// what it returned.
#[derive(Debug)]
pub struct DirView {
    reader: ConfigDir,
    view: MeshView,
    /// The signature the view reflects.
    read: Signature,
}

impl DirView {
    /// Reads every config file of `dir`.
    pub fn load(dir: &Path) -> Self {
        let mut reader = ConfigDir::new(dir);
        let read = signature(dir);
        let mut view = MeshView::default();
        view.apply(reader.rescan().changes);
        Self { reader, view, read }
    }

    /// The current view.
    pub fn view(&self) -> &MeshView {
        &self.view
    }

    /// Re-reads the files whose signature differs from `now` (changed, new
    /// or gone); true when the view changed.
    fn refresh_to(&mut self, now: Signature) -> bool {
        let changed: Vec<PathBuf> = now
            .iter()
            .filter(|(p, s)| self.read.get(*p) != Some(*s))
            .map(|(p, _)| p.clone())
            .chain(self.read.keys().filter(|p| !now.contains_key(*p)).cloned())
            .collect();
        self.read = now;
        if changed.is_empty() {
            return false;
        }
        let update = self.reader.reread(&changed);
        self.view.apply(update.changes)
    }

    /// Re-reads what changed since the last read; true when the view
    /// changed.
    pub fn refresh(&mut self) -> bool {
        let now = signature(self.reader.root());
        self.refresh_to(now)
    }
}

/// Reads every YAML file of `dir` into a view, as the control plane does
/// (rejected documents are left out; the control plane reports them).
pub fn read_dir_view(dir: &Path) -> MeshView {
    DirView::load(dir).view
}

/// Publishes the view of `dir` now and after every change (checked every
/// [`DIR_POLL`], read once settled); the task ends when every receiver is
/// gone.
pub fn spawn_dir_view(dir: PathBuf) -> watch::Receiver<Arc<MeshView>> {
    let dir_view = DirView::load(&dir);
    let (tx, rx) = watch::channel(Arc::new(dir_view.view.clone()));
    tokio::spawn(async move {
        let mut dir_view = Some(dir_view);
        let mut seen = signature(&dir);
        let mut tick = tokio::time::interval(DIR_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = tx.closed() => return,
            }
            let d = dir.clone();
            let Ok(sig) = tokio::task::spawn_blocking(move || signature(&d)).await else {
                continue;
            };
            if sig != seen {
                // Still changing: read once it has settled.
                seen = sig;
                continue;
            }
            let Some(mut current) = dir_view.take() else {
                return;
            };
            if current.read == sig {
                dir_view = Some(current);
                continue;
            }
            let job = tokio::task::spawn_blocking(move || {
                let changed = current.refresh_to(sig);
                (current, changed)
            });
            let Ok((current, changed)) = job.await else {
                tracing::error!(dir = %dir.display(), "re-reading the config directory failed unexpectedly; the node agent's view stops following it (restart the agent)");
                return;
            };
            if changed {
                tx.send_replace(Arc::new(current.view.clone()));
            }
            dir_view = Some(current);
        }
    });
    rx
}

/// How often the merged view of several directories looks for a change
/// of one of them.
const MERGE_POLL: Duration = Duration::from_millis(50);

/// [`spawn_dir_view`] over several directories (the first is the main
/// one, and wins where two define an object): one reader per directory,
/// their views merged and published after a change of any. With one
/// directory it is `spawn_dir_view`.
pub fn spawn_dirs_view(dirs: Vec<PathBuf>) -> watch::Receiver<Arc<MeshView>> {
    let mut rxs: Vec<watch::Receiver<Arc<MeshView>>> =
        dirs.into_iter().map(spawn_dir_view).collect();
    if rxs.len() == 1
        && let Some(rx) = rxs.pop()
    {
        return rx;
    }
    let merge = |rxs: &mut [watch::Receiver<Arc<MeshView>>]| {
        let views: Vec<Arc<MeshView>> = rxs
            .iter_mut()
            .map(|r| r.borrow_and_update().clone())
            .collect();
        Arc::new(MeshView::merged(&views))
    };
    let (tx, rx) = watch::channel(merge(&mut rxs));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(MERGE_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = tx.closed() => return,
            }
            // A reader whose task ended reports an error: nothing new from it.
            if rxs.iter().any(|r| r.has_changed().unwrap_or(false)) {
                tx.send_replace(merge(&mut rxs));
            }
        }
    });
    rx
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_files_the_control_plane_reads() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("team")).unwrap();
        std::fs::write(
            dir.path().join("team/ns.yml"),
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: ai\n  labels: {istio.io/dataplane-mode: ambient}\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("pods.yaml"),
            "apiVersion: v1\nkind: Pod\nmetadata: {name: job, namespace: ai, labels: {istio.io/dataplane-mode: none}}\n\
             spec: {nodeName: n, serviceAccountName: batch}\n---\n\
             apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: ai}\nspec: {nodeName: n, serviceAccountName: web}\n",
        )
        .unwrap();
        // Ignored, as by the control plane: dot-files and other extensions.
        std::fs::write(
            dir.path().join(".hidden.yaml"),
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: other\n  labels: {istio.io/dataplane-mode: ambient}\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.json"), "{}").unwrap();
        let view = read_dir_view(dir.path());
        assert!(view.enrolled("ai", "web"), "namespace from a subdirectory");
        assert!(!view.enrolled("ai", "job"), "the pod's own opt-out wins");
        assert!(!view.enrolled("other", "x"), "dot-files are not read");
        assert_eq!(view.service_account("ai", "web"), "web");
        assert_eq!(view.service_account("ai", "unknown"), "default");
    }

    const NAMESPACE: &str = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: ai\n  labels:\n    istio.io/dataplane-mode: ambient\n";

    /// A namespaces file caught half-written (not even YAML), or with a
    /// rejected document, keeps the namespace's last good labels: its pods
    /// stay enrolled, as at the control plane.
    #[test]
    fn half_written_namespaces_file_keeps_pods_enrolled() {
        let dir = tempfile::tempdir().unwrap();
        let ns = dir.path().join("namespaces.yaml");
        std::fs::write(&ns, NAMESPACE).unwrap();
        std::fs::write(
            dir.path().join("pods.yaml"),
            "apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: ai}\nspec: {nodeName: n}\n",
        )
        .unwrap();
        let mut dv = DirView::load(dir.path());
        assert!(dv.view().enrolled("ai", "web"));
        for broken in [
            // Cut in the middle of the labels: not YAML at all.
            &NAMESPACE[..NAMESPACE.len() - 12],
            // A rejected document whose identity is known.
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: ai\n  labels: [istio.io/dataplane-mode]\n",
        ] {
            std::fs::write(&ns, broken).unwrap();
            dv.refresh();
            assert!(
                dv.view().enrolled("ai", "web"),
                "after writing {broken:?} the pod must stay enrolled"
            );
        }
        // A real change is followed: the namespace opts out.
        std::fs::write(&ns, NAMESPACE.replace("ambient", "none")).unwrap();
        assert!(dv.refresh());
        assert!(!dv.view().enrolled("ai", "web"));
        // Deleting the file removes the namespace.
        std::fs::write(&ns, NAMESPACE).unwrap();
        assert!(dv.refresh());
        std::fs::remove_file(&ns).unwrap();
        assert!(dv.refresh());
        assert!(!dv.view().enrolled("ai", "web"));
        assert!(dv.view().namespaces.is_empty());
    }

    /// Only changed files are parsed again: a file whose (valid) content the
    /// agent read is not parsed again when another file changes.
    #[test]
    fn unchanged_files_are_not_reparsed() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
        std::fs::write(&a, NAMESPACE).unwrap();
        std::fs::write(&b, NAMESPACE.replace("name: ai", "name: db")).unwrap();
        let mut dv = DirView::load(dir.path());
        // Changed behind the agent's back with the same length and mtime
        // kept: only a re-parse of every file would notice.
        let mtime = std::fs::metadata(&a).unwrap().modified().unwrap();
        std::fs::write(&a, NAMESPACE.replace("ambient", "nonenon")).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&a)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        std::fs::write(&b, NAMESPACE.replace("name: ai", "name: dc")).unwrap();
        assert!(dv.refresh());
        assert!(dv.view().namespaces.contains_key("dc"));
        assert_eq!(
            dv.view().namespaces["ai"]["istio.io/dataplane-mode"],
            "ambient",
            "a.yaml was not parsed again"
        );
    }

    /// A pod in an extra directory (local mode's waypoint pods) decides its
    /// own enrollment; the main directory wins where both define an object.
    #[tokio::test]
    async fn extra_directories_are_merged_into_the_view() {
        let main = tempfile::tempdir().unwrap();
        let extra = tempfile::tempdir().unwrap();
        std::fs::write(main.path().join("ns.yaml"), NAMESPACE).unwrap();
        std::fs::write(
            extra.path().join("wp.yaml"),
            "apiVersion: v1\nkind: Pod\nmetadata: {name: waypoint-0, namespace: ai, labels: {istio.io/dataplane-mode: none}}\n\
             spec: {nodeName: n, serviceAccountName: waypoint}\n---\n\
             apiVersion: v1\nkind: Namespace\nmetadata: {name: ai}\n",
        )
        .unwrap();
        let mut rx = spawn_dirs_view(vec![main.path().to_path_buf(), extra.path().to_path_buf()]);
        let view = rx.borrow_and_update().clone();
        assert!(
            view.enrolled("ai", "web"),
            "the main directory's namespace wins"
        );
        assert!(
            !view.enrolled("ai", "waypoint-0"),
            "the extra pod's opt-out counts"
        );
        assert_eq!(view.service_account("ai", "waypoint-0"), "waypoint");
        // Removing the extra pod is followed.
        std::fs::remove_file(extra.path().join("wp.yaml")).unwrap();
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                rx.changed().await.unwrap();
                if rx.borrow().enrolled("ai", "waypoint-0") {
                    break;
                }
            }
        })
        .await
        .expect("the view follows the extra directory");
    }
}
