//! `ambitctl install` / `uninstall`: the manifests of `deploy/kubernetes`
//! (compiled in), rendered with `--set` values and applied with server-side
//! apply (field manager `ambitctl`), or removed.
//!
//! - `--set image=REGISTRY` replaces the image registry/prefix
//!   (`ghcr.io/ambit-mesh`), `--set tag=TAG` every image's tag,
//!   `--set replicas=N` the control plane's replicas.
//! - CRDs that exist already and are not Ambit's (Istio's) are left alone.
//! - Uninstall first turns the node-agent DaemonSet into a cleaner (its
//!   pods run `ambit-node-agent --uninstall --hold`, which removes
//!   ambit-cni from the node's conflist and bin dir, then report ready),
//!   waits until every node's pod is ready, then deletes everything in
//!   reverse order; CRDs are kept unless asked (they hold users' objects).
//!
//! Every API call is bounded by [`CALL_TIMEOUT`]; waits by the caller's
//! timeout.

use std::time::Duration;

use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::discovery::ApiResource;
use kube::{Client, Config};
use serde_json::{Value, json};

/// The manifests, in apply order.
pub const MANIFESTS: [(&str, &str); 7] = [
    (
        "00-namespace.yaml",
        include_str!("../../../../deploy/kubernetes/00-namespace.yaml"),
    ),
    (
        "01-crds.yaml",
        include_str!("../../../../deploy/kubernetes/01-crds.yaml"),
    ),
    (
        "02-rbac.yaml",
        include_str!("../../../../deploy/kubernetes/02-rbac.yaml"),
    ),
    (
        "03-control-plane.yaml",
        include_str!("../../../../deploy/kubernetes/03-control-plane.yaml"),
    ),
    (
        "04-ztunnel.yaml",
        include_str!("../../../../deploy/kubernetes/04-ztunnel.yaml"),
    ),
    (
        "05-node-agent.yaml",
        include_str!("../../../../deploy/kubernetes/05-node-agent.yaml"),
    ),
    (
        "06-sidecar-injector.yaml",
        include_str!("../../../../deploy/kubernetes/06-sidecar-injector.yaml"),
    ),
];

/// The registry the manifests name.
pub const DEFAULT_IMAGE_PREFIX: &str = "ghcr.io/ambit-mesh";
/// Field manager of the server-side apply.
pub const FIELD_MANAGER: &str = "ambitctl";
/// Deadline of one API call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
const PART_OF: &str = "app.kubernetes.io/part-of";

/// Why install or uninstall failed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("--set {0}: expected KEY=VALUE with KEY one of image, tag, replicas")]
    BadSet(String),
    #[error("{file}: {reason}")]
    Manifest { file: String, reason: String },
    #[error(
        "cannot reach the cluster: {0}; check --kubeconfig / KUBECONFIG and the current context"
    )]
    Client(String),
    #[error("{what}: {reason}")]
    Api { what: String, reason: String },
    #[error("{what}: no answer within {limit:?}")]
    Timeout { what: String, limit: Duration },
}

/// `--set` values.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Values {
    pub image: Option<String>,
    pub tag: Option<String>,
    pub replicas: Option<i64>,
}

impl Values {
    /// Parses `KEY=VALUE` items.
    pub fn parse(items: &[String]) -> Result<Self, InstallError> {
        let mut v = Values::default();
        for item in items {
            let bad = || InstallError::BadSet(item.clone());
            let (k, val) = item.split_once('=').ok_or_else(bad)?;
            let val = val.trim();
            if val.is_empty() {
                return Err(bad());
            }
            match k.trim() {
                "image" => v.image = Some(val.trim_end_matches('/').to_string()),
                "tag" => v.tag = Some(val.to_string()),
                "replicas" => {
                    v.replicas = Some(val.parse().ok().filter(|n| *n >= 1).ok_or_else(bad)?)
                }
                _ => return Err(bad()),
            }
        }
        Ok(v)
    }
}

/// Every document of the manifests with `values` applied.
pub fn render(values: &Values) -> Result<Vec<Value>, InstallError> {
    let mut out = Vec::new();
    for (file, text) in MANIFESTS {
        let docs: Vec<Value> =
            serde_saphyr::from_multiple(text).map_err(|e| InstallError::Manifest {
                file: file.into(),
                reason: e.to_string(),
            })?;
        for mut doc in docs.into_iter().filter(Value::is_object) {
            set_values(&mut doc, values);
            out.push(doc);
        }
    }
    Ok(out)
}

fn set_values(doc: &mut Value, values: &Values) {
    if doc["kind"] == "Deployment"
        && let Some(n) = values.replicas
    {
        doc["spec"]["replicas"] = json!(n);
    }
    let Some(containers) = doc["spec"]["template"]["spec"]["containers"].as_array_mut() else {
        return;
    };
    for c in containers {
        let Some(image) = c["image"].as_str() else {
            continue;
        };
        let (repo, tag) = image.rsplit_once(':').unwrap_or((image, "latest"));
        let name = repo.rsplit_once('/').map_or(repo, |(_, n)| n);
        let prefix = values.image.as_deref().unwrap_or(DEFAULT_IMAGE_PREFIX);
        let repo = if values.image.is_some() {
            format!("{prefix}/{name}")
        } else {
            repo.to_string()
        };
        let tag = values.tag.as_deref().unwrap_or(tag);
        c["image"] = json!(format!("{repo}:{tag}"));
    }
}

/// The documents as one YAML stream (`--dry-run`).
pub fn to_yaml(docs: &[Value]) -> Result<String, InstallError> {
    let mut out = String::new();
    for d in docs {
        out.push_str("---\n");
        out.push_str(
            &serde_saphyr::to_string(d).map_err(|e| InstallError::Manifest {
                file: "rendering".into(),
                reason: e.to_string(),
            })?,
        );
    }
    Ok(out)
}

/// A client from `kubeconfig` (else the usual KUBECONFIG / in-cluster
/// inference).
pub async fn client(kubeconfig: Option<&std::path::Path>) -> Result<Client, InstallError> {
    let err = |e: String| InstallError::Client(e);
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| err(e.to_string()))?;
            Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| err(e.to_string()))?
        }
        None => Config::infer().await.map_err(|e| err(e.to_string()))?,
    };
    config.connect_timeout = Some(CALL_TIMEOUT);
    config.read_timeout = Some(CALL_TIMEOUT);
    Client::try_from(config).map_err(|e| err(e.to_string()))
}

/// The API resource of a manifest's document.
fn resource_of(doc: &Value) -> Result<(ApiResource, bool), InstallError> {
    let api_version = doc["apiVersion"].as_str().unwrap_or_default();
    let kind = doc["kind"].as_str().unwrap_or_default();
    let (plural, namespaced) = match kind {
        "Namespace" => ("namespaces", false),
        "CustomResourceDefinition" => ("customresourcedefinitions", false),
        "ServiceAccount" => ("serviceaccounts", true),
        "ClusterRole" => ("clusterroles", false),
        "ClusterRoleBinding" => ("clusterrolebindings", false),
        "Role" => ("roles", true),
        "RoleBinding" => ("rolebindings", true),
        "Deployment" => ("deployments", true),
        "DaemonSet" => ("daemonsets", true),
        "Service" => ("services", true),
        "PodDisruptionBudget" => ("poddisruptionbudgets", true),
        "MutatingWebhookConfiguration" => ("mutatingwebhookconfigurations", false),
        other => {
            return Err(InstallError::Manifest {
                file: format!("{api_version} {other}"),
                reason: "a kind ambitctl does not know how to apply".into(),
            });
        }
    };
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    Ok((
        ApiResource {
            group: group.into(),
            version: version.into(),
            api_version: api_version.into(),
            kind: kind.into(),
            plural: plural.into(),
        },
        namespaced,
    ))
}

fn api_for(client: &Client, doc: &Value) -> Result<(Api<DynamicObject>, String), InstallError> {
    let (ar, namespaced) = resource_of(doc)?;
    let name = doc["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let api = if namespaced {
        let ns = doc["metadata"]["namespace"]
            .as_str()
            .unwrap_or("ambit-system");
        Api::namespaced_with(client.clone(), ns, &ar)
    } else {
        Api::all_with(client.clone(), &ar)
    };
    Ok((api, format!("{} {name}", ar.kind)))
}

async fn bounded<T>(
    what: &str,
    fut: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, InstallError> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(InstallError::Api {
            what: what.into(),
            reason: e.to_string(),
        }),
        Err(_) => Err(InstallError::Timeout {
            what: what.into(),
            limit: CALL_TIMEOUT,
        }),
    }
}

/// Applies `docs` in order with server-side apply; returns one line per
/// object (`applied`, or `skipped` with the reason).
pub async fn apply(client: &Client, docs: &[Value]) -> Result<Vec<String>, InstallError> {
    let mut report = Vec::new();
    let params = PatchParams::apply(FIELD_MANAGER).force();
    for doc in docs {
        let (api, label) = api_for(client, doc)?;
        let name = doc["metadata"]["name"].as_str().unwrap_or_default();
        if doc["kind"] == "CustomResourceDefinition" {
            let existing = bounded(&format!("reading {label}"), api.get_opt(name)).await?;
            if let Some(crd) = existing {
                let ours = crd.metadata.labels.as_ref().and_then(|l| l.get(PART_OF))
                    == Some(&"ambit".to_string());
                if !ours {
                    report.push(format!(
                        "skipped {label} (installed by someone else, e.g. Istio)"
                    ));
                    continue;
                }
            }
        }
        bounded(
            &format!("applying {label}"),
            api.patch(name, &params, &Patch::Apply(doc)),
        )
        .await?;
        report.push(format!("applied {label}"));
    }
    Ok(report)
}

/// Removes what [`apply`] created: cleans every node's CNI configuration
/// through the node-agent DaemonSet (bounded by `wait`), then deletes the
/// objects in reverse order (CRDs only with `delete_crds`).
pub async fn uninstall(
    client: &Client,
    docs: &[Value],
    wait: Duration,
    delete_crds: bool,
) -> Result<Vec<String>, InstallError> {
    let mut report = Vec::new();
    if let Some(agent) = docs
        .iter()
        .find(|d| d["kind"] == "DaemonSet" && d["metadata"]["name"] == "ambit-node-agent")
    {
        report.push(clean_nodes(client, agent, wait).await?);
    }
    for doc in docs.iter().rev() {
        if doc["kind"] == "CustomResourceDefinition" && !delete_crds {
            continue;
        }
        let (api, label) = api_for(client, doc)?;
        let name = doc["metadata"]["name"].as_str().unwrap_or_default();
        match bounded(
            &format!("deleting {label}"),
            api.delete(name, &DeleteParams::background()),
        )
        .await
        {
            Ok(_) => report.push(format!("deleted {label}")),
            Err(InstallError::Api { reason, .. })
                if reason.contains("NotFound") || reason.contains("not found") =>
            {
                report.push(format!("absent {label}"))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(report)
}

/// Rolls the node agent into `--uninstall --hold` and waits until every
/// scheduled pod of the new generation is ready (its node is clean).
async fn clean_nodes(
    client: &Client,
    agent: &Value,
    wait: Duration,
) -> Result<String, InstallError> {
    let (api, label) = api_for(client, agent)?;
    let name = agent["metadata"]["name"].as_str().unwrap_or_default();
    let Some(_) = bounded(&format!("reading {label}"), api.get_opt(name)).await? else {
        return Ok(format!("absent {label} (no node to clean)"));
    };
    let mut cleaner = agent.clone();
    let c = &mut cleaner["spec"]["template"]["spec"]["containers"][0];
    c["args"] = json!(["--uninstall", "--hold"]);
    c["readinessProbe"] =
        json!({"exec": {"command": ["test", "-f", "/tmp/uninstalled"]}, "periodSeconds": 2});
    let applied = bounded(
        &format!("turning {label} into the CNI cleaner"),
        api.patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&cleaner),
        ),
    )
    .await?;
    let generation = applied.metadata.generation.unwrap_or(0);
    let start = tokio::time::Instant::now();
    loop {
        let ds = bounded(&format!("reading {label}"), api.get(name)).await?;
        let st = &ds.data["status"];
        let n = |k: &str| st[k].as_i64().unwrap_or(-1);
        let done = n("observedGeneration") >= generation
            && n("desiredNumberScheduled") >= 0
            && n("updatedNumberScheduled") == n("desiredNumberScheduled")
            && n("numberReady") == n("desiredNumberScheduled");
        if done {
            return Ok(format!(
                "removed ambit-cni from the CNI configuration of {} node(s)",
                n("desiredNumberScheduled")
            ));
        }
        if start.elapsed() > wait {
            return Err(InstallError::Timeout {
                what: format!(
                    "waiting for every node to remove ambit-cni ({label}: {} of {} done); see `kubectl -n ambit-system get pods -l app=ambit-node-agent`",
                    n("numberReady").max(0),
                    n("desiredNumberScheduled").max(0)
                ),
                limit: wait,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_values_change_images_tags_and_replicas() {
        let v = Values::parse(&[
            "image=registry.local:5000/me/".into(),
            "tag=dev".into(),
            "replicas=3".into(),
        ])
        .unwrap_or_default();
        assert_eq!(v.replicas, Some(3));
        let docs = render(&v).unwrap_or_default();
        let images: Vec<String> = docs
            .iter()
            .filter_map(|d| d["spec"]["template"]["spec"]["containers"].as_array())
            .flatten()
            .filter_map(|c| c["image"].as_str().map(str::to_string))
            .collect();
        assert_eq!(
            images,
            [
                "registry.local:5000/me/ambit-control:dev",
                "registry.local:5000/me/ztunnel:dev",
                "registry.local:5000/me/ambit-node-agent:dev"
            ]
        );
        let d = docs.iter().find(|d| d["kind"] == "Deployment");
        assert_eq!(d.map(|d| d["spec"]["replicas"].clone()), Some(json!(3)));
        assert!(Values::parse(&["replicas=0".into()]).is_err());
        assert!(Values::parse(&["colour=blue".into()]).is_err());
        assert!(to_yaml(&docs).is_ok_and(|y| y.matches("\n---\n").count() + 1 == docs.len()));
    }
}
