//! `ambitctl kube-inject`: the webhook's injection applied to files, for
//! clusters without the webhook or to review what it would do. The same
//! decision and patch as the webhook (`ambit_control::inject`), applied to
//! pods and to the pod templates of workload kinds; everything else passes
//! through unchanged.

use ambit_control::inject::{
    Decision, InjectSettings, NAMESPACE_LABEL, PatchError, SkipReason, apply_patch, decide,
    injection_patch,
};
use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

/// Why a file could not be injected.
#[derive(Debug, thiserror::Error)]
pub enum KubeInjectError {
    #[error("the input is not YAML: {0}")]
    Yaml(String),
    #[error("document {doc} ({kind} {name}): the pod template is not a valid pod: {source}")]
    NotAPod {
        doc: usize,
        kind: String,
        name: String,
        source: serde_json::Error,
    },
    #[error("document {doc} ({kind} {name}): {source}")]
    Patch {
        doc: usize,
        kind: String,
        name: String,
        source: PatchError,
    },
    #[error("writing YAML failed: {0}")]
    Output(String),
}

/// What happened to one pod or pod template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub kind: String,
    pub name: String,
    /// `None`: injected.
    pub skipped: Option<SkipReason>,
}

/// Injects every pod and pod template in the YAML `text` (one or more
/// documents) and returns the documents as YAML, with what was done to each.
pub fn inject_yaml(
    text: &str,
    settings: &InjectSettings,
) -> Result<(String, Vec<Outcome>), KubeInjectError> {
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(text).map_err(|e| KubeInjectError::Yaml(e.to_string()))?;
    let mut out = Vec::new();
    let mut outcomes = Vec::new();
    for (i, mut doc) in docs.into_iter().enumerate() {
        if doc.is_null() {
            continue;
        }
        let kind = doc["kind"].as_str().unwrap_or_default().to_string();
        let name = doc["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if let Some(template) = pod_template(&mut doc, &kind) {
            let skipped = inject_pod(template, settings).map_err(|e| match e {
                InjectPodError::NotAPod(source) => KubeInjectError::NotAPod {
                    doc: i + 1,
                    kind: kind.clone(),
                    name: name.clone(),
                    source,
                },
                InjectPodError::Patch(source) => KubeInjectError::Patch {
                    doc: i + 1,
                    kind: kind.clone(),
                    name: name.clone(),
                    source,
                },
            })?;
            outcomes.push(Outcome {
                kind,
                name,
                skipped,
            });
        }
        out.push(doc);
    }
    let yaml = out
        .iter()
        .map(serde_saphyr::to_string)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| KubeInjectError::Output(e.to_string()))?;
    Ok((yaml.join("---\n"), outcomes))
}

/// The pod (template) inside a document of `kind`, if it has one.
fn pod_template<'a>(doc: &'a mut Value, kind: &str) -> Option<&'a mut Value> {
    let api = doc["apiVersion"].as_str().unwrap_or_default();
    let core_pod = kind == "Pod" && api == "v1";
    let path: &[&str] = match kind {
        _ if core_pod => &[],
        "Deployment"
        | "StatefulSet"
        | "DaemonSet"
        | "ReplicaSet"
        | "Job"
        | "ReplicationController" => &["spec", "template"],
        "CronJob" => &["spec", "jobTemplate", "spec", "template"],
        _ => return None,
    };
    let mut at = doc;
    for key in path {
        at = at.get_mut(*key)?;
    }
    at.is_object().then_some(at)
}

enum InjectPodError {
    NotAPod(serde_json::Error),
    Patch(PatchError),
}

/// Injects one pod (template) in place; `Some(reason)` when left alone.
/// The namespace counts as selected: the user asked for this file.
fn inject_pod(
    pod: &mut Value,
    settings: &InjectSettings,
) -> Result<Option<SkipReason>, InjectPodError> {
    let typed: Pod = serde_json::from_value(pod.clone()).map_err(InjectPodError::NotAPod)?;
    let selected = [(NAMESPACE_LABEL.to_string(), "enabled".to_string())].into();
    match decide(&typed, &selected) {
        Decision::Skip(reason) => Ok(Some(reason)),
        Decision::Inject => {
            let ops = injection_patch(&typed, settings).map_err(InjectPodError::Patch)?;
            apply_patch(pod, &ops).map_err(InjectPodError::Patch)?;
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "\
apiVersion: apps/v1
kind: Deployment
metadata: {name: embed, namespace: ai}
spec:
  selector: {matchLabels: {app: embed}}
  template:
    metadata: {labels: {app: embed, version: v2}}
    spec:
      containers: [{name: embed, image: embed:2}]
---
apiVersion: v1
kind: Service
metadata: {name: embed, namespace: ai}
spec: {ports: [{port: 80}], selector: {app: embed}}
---
apiVersion: v1
kind: Pod
metadata: {name: tools, namespace: ai, annotations: {sidecar.istio.io/inject: \"false\"}}
spec:
  containers: [{name: tools, image: busybox}]
";

    fn containers(doc: &Value) -> Vec<String> {
        let spec = doc["spec"]["template"]["spec"]["containers"]
            .as_array()
            .or_else(|| doc["spec"]["containers"].as_array())
            .cloned()
            .unwrap_or_default();
        spec.iter()
            .filter_map(|c| c["name"].as_str().map(String::from))
            .collect()
    }

    #[test]
    fn injects_templates_skips_opt_outs_and_passes_other_kinds_through() {
        let (yaml, outcomes) = inject_yaml(FILE, &InjectSettings::default()).expect("injects");
        let docs: Vec<Value> = serde_saphyr::from_multiple(&yaml).expect("YAML out");
        assert_eq!(docs.len(), 3);
        assert_eq!(containers(&docs[0]), ["embed", "istio-proxy"]);
        assert_eq!(docs[1]["kind"], "Service");
        assert_eq!(containers(&docs[2]), ["tools"]);
        assert_eq!(
            outcomes,
            [
                Outcome {
                    kind: "Deployment".into(),
                    name: "embed".into(),
                    skipped: None
                },
                Outcome {
                    kind: "Pod".into(),
                    name: "tools".into(),
                    skipped: Some(SkipReason::OptedOut)
                },
            ]
        );
        // Its own output again: already injected, byte for byte the same.
        let (again, outcomes) = inject_yaml(&yaml, &InjectSettings::default()).expect("again");
        assert_eq!(again, yaml);
        assert_eq!(outcomes[0].skipped, Some(SkipReason::AlreadyInjected));
    }

    #[test]
    fn a_broken_template_is_named() {
        let bad = "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec: {containers: 7}\n";
        let err = inject_yaml(bad, &InjectSettings::default()).expect_err("refused");
        let text = err.to_string();
        assert!(text.contains("document 1 (Pod x)"), "{text}");
    }
}
