//! Whether each pod is in the mesh, from three live sources and never from
//! what `up` recorded: what its labels say now (the config dir the mesh is
//! served from, read with the control plane's reader and enrollment rule),
//! what its node agent holds (`pods.json`: redirection installed and handed
//! to ztunnel), and how the ztunnels hold its workload (admin
//! `/config_dump`: `HBONE` means peers tunnel to it).

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::config::{ConfigDir, LABEL_DATAPLANE_MODE, Labels, Object, is_enrolled};

/// A pod as the config dir has it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodLabels {
    /// `is_enrolled(namespace labels, pod labels)`.
    pub ambient: bool,
    /// The `istio.io/dataplane-mode` value that decided: the pod's own
    /// `ambient`/`none`, else its namespace's value, else empty.
    pub mode: String,
}

/// What the config dir says now.
#[derive(Debug, Clone, Default)]
pub struct LiveConfig {
    /// `namespace/name` → labels.
    pub pods: BTreeMap<String, PodLabels>,
    /// `file: error` lines of documents the reader rejected (the control
    /// plane and the agents keep serving their last good version).
    pub errors: Vec<String>,
}

/// Reads `dir` as the control plane and the node agents do.
pub fn read_config(dir: &Path) -> LiveConfig {
    let mut reader = ConfigDir::new(dir);
    reader.rescan();
    let mut namespaces: BTreeMap<&str, &Labels> = BTreeMap::new();
    let mut pods = Vec::new();
    for o in reader.objects() {
        match o {
            Object::Namespace(ns) => {
                namespaces.insert(&ns.metadata.name, &ns.metadata.labels);
            }
            Object::Pod(p) => pods.push(p),
            _ => {}
        }
    }
    let empty = Labels::new();
    let pods = pods
        .into_iter()
        .map(|p| {
            let m = &p.metadata;
            let ns = namespaces
                .get(m.namespace.as_str())
                .copied()
                .unwrap_or(&empty);
            (
                format!("{}/{}", m.namespace, m.name),
                labels_of(ns, &m.labels),
            )
        })
        .collect();
    let errors = reader
        .errors()
        .flat_map(|(file, errs)| {
            errs.iter()
                .map(move |e| format!("{}: {}", file.display(), e.reason))
        })
        .collect();
    LiveConfig { pods, errors }
}

/// What a pod's and its namespace's labels say.
pub fn labels_of(ns_labels: &Labels, labels: &Labels) -> PodLabels {
    let own = labels
        .get(LABEL_DATAPLANE_MODE)
        .filter(|v| matches!(v.as_str(), "ambient" | "none"));
    let mode = own
        .or_else(|| ns_labels.get(LABEL_DATAPLANE_MODE))
        .cloned()
        .unwrap_or_default();
    PodLabels {
        ambient: is_enrolled(ns_labels, labels),
        mode,
    }
}

/// `namespace/name` → `protocol` (`HBONE` or `TCP`) of every pod workload
/// in a ztunnel's `/config_dump`.
pub fn ztunnel_workloads(dump: &serde_json::Value) -> BTreeMap<String, String> {
    dump["workloads"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|w| w["workloadType"].as_str().is_none_or(|t| t == "pod"))
        .filter_map(|w| {
            Some((
                format!("{}/{}", w["namespace"].as_str()?, w["name"].as_str()?),
                w["protocol"].as_str()?.to_string(),
            ))
        })
        .collect()
}

/// Whether a pod is in the mesh, all sources considered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mesh {
    /// Labels say ambient, the node agent redirects it and its ztunnel
    /// serves it, the ztunnels reach it over HBONE.
    Enrolled,
    /// As `Enrolled`, but its ztunnel has no listeners for it (the agent
    /// retries the handover; its traffic is held, not leaked).
    EnrolledNotServed,
    /// Labels do not put it in the mesh, the agent does not redirect it,
    /// no ztunnel tunnels to it.
    NotEnrolled,
    /// The sources do not agree: a label change still being applied (a
    /// second or two), or one that did not apply.
    Disagree,
    /// It runs a sidecar: the node agent leaves it alone and the ztunnels
    /// reach it over HBONE, terminated by its Envoy.
    Sidecar,
}

/// Decides [`Mesh`] from the live sources: `labels` (`None`: the pod is
/// not in the config dir any more), `agent` (`Some(enrolled)` from its
/// table, `None` when the agent has no record) with `served`, and each
/// answering ztunnel's protocol for it (`None`: not listed).
pub fn verdict(
    labels: Option<&PodLabels>,
    agent: Option<bool>,
    served: bool,
    ztunnels: &BTreeMap<String, Option<String>>,
) -> Mesh {
    let want = labels.is_some_and(|l| l.ambient);
    let agent_in = agent == Some(true);
    let tunnels = |hbone: bool| {
        ztunnels
            .values()
            .all(|p| (p.as_deref() == Some("HBONE")) == hbone)
    };
    match (want, agent_in) {
        (true, true) if tunnels(true) => {
            if served {
                Mesh::Enrolled
            } else {
                Mesh::EnrolledNotServed
            }
        }
        (false, false) if tunnels(false) => Mesh::NotEnrolled,
        _ => Mesh::Disagree,
    }
}

/// [`Mesh`] of a sidecar pod: not redirected by its node agent, and every
/// answering ztunnel tunnels to it (its Envoy terminates HBONE).
pub fn sidecar_verdict(agent: Option<bool>, ztunnels: &BTreeMap<String, Option<String>>) -> Mesh {
    let hbone = ztunnels.values().all(|p| p.as_deref() == Some("HBONE"));
    if agent != Some(true) && hbone {
        Mesh::Sidecar
    } else {
        Mesh::Disagree
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_deciding_label_is_named() {
        let ambient = labels(&[(LABEL_DATAPLANE_MODE, "ambient")]);
        let none = labels(&[(LABEL_DATAPLANE_MODE, "none")]);
        let other = labels(&[(LABEL_DATAPLANE_MODE, "sidecar")]);
        let empty = Labels::new();
        let l = labels_of(&ambient, &empty);
        assert_eq!((l.ambient, l.mode.as_str()), (true, "ambient"));
        let l = labels_of(&ambient, &none);
        assert_eq!((l.ambient, l.mode.as_str()), (false, "none"));
        let l = labels_of(&none, &ambient);
        assert_eq!((l.ambient, l.mode.as_str()), (true, "ambient"));
        let l = labels_of(&none, &empty);
        assert_eq!((l.ambient, l.mode.as_str()), (false, "none"));
        let l = labels_of(&empty, &other);
        assert_eq!((l.ambient, l.mode.as_str()), (false, ""));
        let l = labels_of(&other, &empty);
        assert_eq!((l.ambient, l.mode.as_str()), (false, "sidecar"));
    }

    #[test]
    fn verdicts() {
        let yes = PodLabels {
            ambient: true,
            mode: "ambient".into(),
        };
        let no = PodLabels {
            ambient: false,
            mode: "none".into(),
        };
        let zt = |p: &[Option<&str>]| -> BTreeMap<String, Option<String>> {
            p.iter()
                .enumerate()
                .map(|(i, p)| (format!("node-{i}"), p.map(str::to_string)))
                .collect()
        };
        let hbone = zt(&[Some("HBONE"), Some("HBONE")]);
        let tcp = zt(&[Some("TCP"), None]);
        let mixed = zt(&[Some("HBONE"), Some("TCP")]);
        let cases = [
            (Some(&yes), Some(true), true, &hbone, Mesh::Enrolled),
            (
                Some(&yes),
                Some(true),
                false,
                &hbone,
                Mesh::EnrolledNotServed,
            ),
            (Some(&no), Some(false), true, &tcp, Mesh::NotEnrolled),
            (Some(&no), None, true, &tcp, Mesh::NotEnrolled),
            (None, None, true, &tcp, Mesh::NotEnrolled),
            // Relabelled to none, the agent not there yet.
            (Some(&no), Some(true), true, &tcp, Mesh::Disagree),
            // Relabelled to none, the control plane not there yet.
            (Some(&no), Some(false), true, &hbone, Mesh::Disagree),
            // Back to ambient: one ztunnel behind.
            (Some(&yes), Some(true), true, &mixed, Mesh::Disagree),
            (Some(&yes), Some(false), true, &hbone, Mesh::Disagree),
            (Some(&yes), None, true, &hbone, Mesh::Disagree),
        ];
        for (l, agent, served, zt, want) in cases {
            assert_eq!(
                verdict(l, agent, served, zt),
                want,
                "{l:?} {agent:?} {served} {zt:?}"
            );
        }
        // No ztunnel answered: the others decide.
        let none = BTreeMap::new();
        assert_eq!(verdict(Some(&yes), Some(true), true, &none), Mesh::Enrolled);
    }

    #[test]
    fn workloads_of_a_dump() {
        let dump = serde_json::json!({"workloads": [
            {"name": "a", "namespace": "n", "protocol": "HBONE", "workloadType": "pod"},
            {"name": "b", "namespace": "n", "protocol": "TCP", "workloadType": "pod"},
            {"name": "vm", "namespace": "n", "protocol": "TCP", "workloadType": "workloadEntry"},
            {"namespace": "n", "protocol": "TCP"},
        ]});
        let w = ztunnel_workloads(&dump);
        assert_eq!(w.len(), 2, "{w:?}");
        assert_eq!(w["n/a"], "HBONE");
        assert_eq!(w["n/b"], "TCP");
        assert!(ztunnel_workloads(&serde_json::json!({})).is_empty());
    }

    #[test]
    fn a_config_dir_is_read_live() {
        let dir = tempfile::tempdir().expect("tempdir");
        let write = |ns_label: &str| {
            std::fs::write(
                dir.path().join("all.yaml"),
                format!(
                    "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: mesh\n  labels: {{istio.io/dataplane-mode: {ns_label}}}\n---\n\
                     apiVersion: v1\nkind: Pod\nmetadata: {{name: a, namespace: mesh}}\nspec: {{nodeName: n1}}\nstatus: {{podIP: 10.1.1.5}}\n---\n\
                     apiVersion: v1\nkind: Pod\nmetadata: {{name: out, namespace: mesh, labels: {{istio.io/dataplane-mode: none}}}}\nspec: {{nodeName: n1}}\nstatus: {{podIP: 10.1.1.6}}\n"
                ),
            )
            .expect("write");
        };
        write("ambient");
        let c = read_config(dir.path());
        assert!(c.errors.is_empty(), "{:?}", c.errors);
        assert!(c.pods["mesh/a"].ambient);
        assert_eq!(c.pods["mesh/out"].mode, "none");
        write("none");
        let c = read_config(dir.path());
        assert_eq!(
            c.pods["mesh/a"],
            PodLabels {
                ambient: false,
                mode: "none".into()
            }
        );
        std::fs::write(dir.path().join("bad.yaml"), "kind: Pod\nmetadata: [\n").expect("write");
        let c = read_config(dir.path());
        assert_eq!(c.errors.len(), 1, "{:?}", c.errors);
        assert!(c.errors[0].contains("bad.yaml"), "{:?}", c.errors);
    }
}
