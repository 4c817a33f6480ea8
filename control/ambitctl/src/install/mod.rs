//! `ambitctl install` / `uninstall`: the manifests of `deploy/kubernetes`
//! (compiled in), rendered with `--set` values and applied with server-side
//! apply (field manager `ambitctl`), or removed.
//!
//! - `--set image=REGISTRY` replaces the image registry/prefix
//!   (`ghcr.io/ambit-mesh`), `--set tag=TAG` every image's tag — the
//!   workloads' and the proxy image the control plane injects
//!   (`PROXY_IMAGE`) — `--set replicas=N` the control plane's replicas, and
//!   `--set cniConfDir=DIR,cniBinDir=DIR` where the node agent finds the
//!   node's CNI configuration and plugins (default `/etc/cni/net.d`,
//!   `/opt/cni/bin`; k3s, GKE and others put them elsewhere). Only those
//!   fields change: every other object renders as written.
//! - The Istio CRDs (`deploy/kubernetes/crds`) are applied only where no
//!   CRD of that name exists or it is Ambit's; Istio's are left alone.
//! - Applying is idempotent: each object is reported `created`,
//!   `configured` or `unchanged` (its resourceVersion did not move).
//! - Uninstall ([`remove`]) first turns the installed node-agent DaemonSet
//!   into a cleaner, then deletes everything in reverse order.
//!
//! Every API call is bounded by [`CALL_TIMEOUT`]; waits by the caller's
//! timeout.

mod apply;
mod remove;

use std::time::Duration;

use kube::api::{Api, DynamicObject};
use kube::discovery::ApiResource;
use kube::{Client, Config};
use serde_json::{Value, json};

pub use apply::apply;
pub use remove::uninstall;

/// The manifests, in apply order.
pub const MANIFESTS: [(&str, &str); 7] = [
    (
        "00-namespace.yaml",
        include_str!("../../../../deploy/kubernetes/00-namespace.yaml"),
    ),
    (
        "crds/istio-crds.yaml",
        include_str!("../../../../deploy/kubernetes/crds/istio-crds.yaml"),
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
/// The label every object of the manifests carries.
pub const PART_OF: &str = "app.kubernetes.io/part-of";
/// Environment variables of the manifests' containers that name an image
/// (rewritten by `--set image=` / `tag=` like the containers' own).
const IMAGE_ENV: [&str; 1] = ["PROXY_IMAGE"];

/// Why install or uninstall failed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error(
        "--set {0}: expected KEY=VALUE with KEY one of image, tag, replicas, cniConfDir, cniBinDir (directories are absolute paths)"
    )]
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
    /// The node's CNI configuration directory.
    pub cni_conf_dir: Option<String>,
    /// The node's CNI plugin directory.
    pub cni_bin_dir: Option<String>,
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
                "cniConfDir" | "cniBinDir" => {
                    if !val.starts_with('/') {
                        return Err(bad());
                    }
                    let dir = Some(val.trim_end_matches('/').to_string());
                    if k.trim() == "cniConfDir" {
                        v.cni_conf_dir = dir;
                    } else {
                        v.cni_bin_dir = dir;
                    }
                }
                _ => return Err(bad()),
            }
        }
        Ok(v)
    }

    /// `image` with the registry and tag these values ask for.
    fn retag(&self, image: &str) -> String {
        // A tag is what follows the last `:` after the last `/` (a
        // registry's port is not one).
        let (repo, tag) = match image.rsplit_once(':') {
            Some((r, t)) if !t.contains('/') => (r, t),
            _ => (image, "latest"),
        };
        let repo = match &self.image {
            Some(prefix) => {
                let name = repo.rsplit_once('/').map_or(repo, |(_, n)| n);
                format!("{prefix}/{name}")
            }
            None => repo.to_string(),
        };
        format!("{repo}:{}", self.tag.as_deref().unwrap_or(tag))
    }
}

/// Every document of the manifests with `values` applied, in apply order.
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

/// Applies `values` to a workload's pod template; any other document is
/// left exactly as written (no key is added to it).
fn set_values(doc: &mut Value, values: &Values) {
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or_default();
    if !matches!(kind, "Deployment" | "DaemonSet") {
        return;
    }
    if kind == "Deployment"
        && let Some(n) = values.replicas
        && let Some(spec) = doc.get_mut("spec").and_then(Value::as_object_mut)
    {
        spec.insert("replicas".into(), json!(n));
    }
    if let Some(volumes) = doc
        .pointer_mut("/spec/template/spec/volumes")
        .and_then(Value::as_array_mut)
    {
        for vol in volumes {
            let dir = match vol.get("name").and_then(Value::as_str) {
                Some("cni-conf") => &values.cni_conf_dir,
                Some("cni-bin") => &values.cni_bin_dir,
                _ => &None,
            };
            if let (Some(dir), Some(host)) = (dir, vol.get_mut("hostPath")) {
                host["path"] = json!(dir);
            }
        }
    }
    let Some(containers) = doc
        .pointer_mut("/spec/template/spec/containers")
        .and_then(Value::as_array_mut)
    else {
        return;
    };
    for c in containers {
        if let Some(image) = c.get("image").and_then(Value::as_str) {
            let image = values.retag(image);
            c["image"] = json!(image);
        }
        let Some(env) = c.get_mut("env").and_then(Value::as_array_mut) else {
            continue;
        };
        for var in env {
            let named = var
                .get("name")
                .and_then(Value::as_str)
                .is_some_and(|n| IMAGE_ENV.contains(&n));
            if named && let Some(image) = var.get("value").and_then(Value::as_str) {
                let image = values.retag(image);
                var["value"] = json!(image);
            }
        }
    }
}

/// What `--dry-run` prints: every document, the CRDs only with
/// `include_crds`. Without them the output applies as it is to any cluster
/// (`kubectl apply --server-side` would conflict with Istio's own CRDs
/// where they are installed).
pub fn dry_run_documents(docs: &[Value], include_crds: bool) -> Vec<Value> {
    docs.iter()
        .filter(|d| include_crds || d["kind"] != "CustomResourceDefinition")
        .cloned()
        .collect()
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

/// The API resource of a manifest's document, and whether it is
/// namespaced.
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

/// The API of a manifest's document and a label for messages
/// (`Deployment ambit-system/ambit-control`).
fn api_for(client: &Client, doc: &Value) -> Result<(Api<DynamicObject>, String), InstallError> {
    let (ar, namespaced) = resource_of(doc)?;
    let name = doc["metadata"]["name"].as_str().unwrap_or_default();
    Ok(if namespaced {
        let ns = doc["metadata"]["namespace"]
            .as_str()
            .unwrap_or("ambit-system");
        (
            Api::namespaced_with(client.clone(), ns, &ar),
            format!("{} {ns}/{name}", ar.kind),
        )
    } else {
        (
            Api::all_with(client.clone(), &ar),
            format!("{} {name}", ar.kind),
        )
    })
}

/// One API call bounded by [`CALL_TIMEOUT`].
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

#[cfg(test)]
mod tests;
