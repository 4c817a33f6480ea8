//! What the node agent knows of the cluster: namespace labels and pod
//! labels / service accounts — enough to decide whether a pod is enrolled.
//!
//! One seam, two sides: [`spawn_dir_view`] reads the control plane's config
//! directory (local mode); a Kubernetes watch will publish the same
//! [`MeshView`] on the same `watch` channel.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ambit_control::model::objects::{Labels, Object};
use ambit_control::model::translate::is_enrolled;
use ambit_control::source::file::{config_files, parse_documents};
use tokio::sync::watch;

/// One pod as the view knows it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodInfo {
    pub labels: Labels,
    pub service_account: String,
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
        for o in objects {
            match o {
                Object::Namespace(ns) => {
                    view.namespaces
                        .insert(ns.metadata.name.clone(), ns.metadata.labels);
                }
                Object::Pod(p) => {
                    let sa = p.service_account().to_string();
                    view.pods.insert(
                        (p.metadata.namespace.clone(), p.metadata.name.clone()),
                        PodInfo {
                            labels: p.metadata.labels,
                            service_account: sa,
                        },
                    );
                }
                _ => {}
            }
        }
        view
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

    /// The pod's service account (`default` when unknown).
    pub fn service_account(&self, namespace: &str, name: &str) -> String {
        self.pods
            .get(&(namespace.to_string(), name.to_string()))
            .map(|p| p.service_account.clone())
            .filter(|sa| !sa.is_empty())
            .unwrap_or_else(|| "default".to_string())
    }
}

/// How often the config directory is checked for changes.
pub const DIR_POLL: Duration = Duration::from_millis(200);

/// (path, modified, length) of every config file the control plane reads
/// (same rules: `*.yaml`/`*.yml`, recursive, no dot-entries): a cheap change
/// detector.
fn signature(dir: &Path) -> Vec<(PathBuf, Option<SystemTime>, u64)> {
    config_files(dir)
        .into_iter()
        .map(|p| {
            let meta = std::fs::metadata(&p).ok();
            (
                p,
                meta.as_ref().and_then(|m| m.modified().ok()),
                meta.map_or(0, |m| m.len()),
            )
        })
        .collect()
}

/// Reads every YAML file of `dir` into a view. Files or documents that do
/// not parse are skipped (the control plane reports them).
pub fn read_dir_view(dir: &Path) -> MeshView {
    let mut objects = Vec::new();
    for (path, _, _) in signature(dir) {
        match std::fs::read_to_string(&path) {
            Ok(text) => objects.extend(parse_documents(&path, &text).0),
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot read config file"),
        }
    }
    MeshView::from_objects(objects)
}

/// Publishes the view of `dir` now and after every change (checked every
/// [`DIR_POLL`]); the task ends when every receiver is gone.
pub fn spawn_dir_view(dir: PathBuf) -> watch::Receiver<Arc<MeshView>> {
    let (tx, rx) = watch::channel(Arc::new(read_dir_view(&dir)));
    tokio::spawn(async move {
        let mut last = signature(&dir);
        let mut tick = tokio::time::interval(DIR_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = tx.closed() => return,
            }
            let sig = signature(&dir);
            if sig == last {
                continue;
            }
            last = sig;
            let d = dir.clone();
            let Ok(view) = tokio::task::spawn_blocking(move || read_dir_view(&d)).await else {
                continue;
            };
            tx.send_if_modified(|cur| {
                if **cur == view {
                    false
                } else {
                    *cur = Arc::new(view);
                    true
                }
            });
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
}
