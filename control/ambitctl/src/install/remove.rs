//! Uninstall: clean every node's CNI configuration through the node agent
//! that is installed (its own image, paths and settings), then delete what
//! the manifests created, in reverse order, and wait for it to be gone.

use std::time::Duration;

use kube::Client;
use kube::api::{DeleteParams, Patch, PatchParams};
use serde_json::{Value, json};
use tokio::time::Instant;

use super::{InstallError, api_for, bounded};

/// The node agent's DaemonSet and container as the manifests name them.
const NODE_AGENT: &str = "ambit-node-agent";
const NODE_AGENT_CONTAINER: &str = "node-agent";
/// Field manager of the cleaner patch (not `ambitctl`'s apply, so the
/// installed spec keeps every field it had).
const CLEANER_MANAGER: &str = "ambitctl-uninstall";

/// Removes what [`super::apply`] created: cleans every node's CNI
/// configuration through the installed node-agent DaemonSet (bounded by
/// `wait`), deletes the objects in reverse order (CRDs only with
/// `delete_crds`), then waits (within the same `wait`) until they are gone.
pub async fn uninstall(
    client: &Client,
    docs: &[Value],
    wait: Duration,
    delete_crds: bool,
) -> Result<Vec<String>, InstallError> {
    let deadline = Instant::now() + wait;
    let mut report = Vec::new();
    if let Some(agent) = docs
        .iter()
        .find(|d| d["kind"] == "DaemonSet" && d["metadata"]["name"] == NODE_AGENT)
    {
        report.push(clean_nodes(client, agent, deadline, wait).await?);
    }
    let mut deleted = Vec::new();
    for doc in docs.iter().rev() {
        if doc["kind"] == "CustomResourceDefinition" && !delete_crds {
            let name = doc["metadata"]["name"].as_str().unwrap_or_default();
            report.push(format!(
                "kept CustomResourceDefinition {name} (holds your objects; --delete-crds removes it)"
            ));
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
            Ok(_) => {
                report.push(format!("deleted {label}"));
                deleted.push(doc);
            }
            Err(InstallError::Api { reason, .. })
                if reason.contains("NotFound") || reason.contains("not found") =>
            {
                report.push(format!("absent {label}"))
            }
            Err(e) => return Err(e),
        }
    }
    for doc in deleted {
        if let Some(line) = wait_gone(client, doc, deadline).await? {
            report.push(line);
        }
    }
    Ok(report)
}

/// Waits until `doc`'s object is gone. A Namespace that stays
/// `Terminating` past the deadline is reported (its finalizer is the
/// controller manager's), not an error.
async fn wait_gone(
    client: &Client,
    doc: &Value,
    deadline: Instant,
) -> Result<Option<String>, InstallError> {
    let (api, label) = api_for(client, doc)?;
    let name = doc["metadata"]["name"].as_str().unwrap_or_default();
    loop {
        let Some(obj) = bounded(&format!("reading {label}"), api.get_opt(name)).await? else {
            return Ok(None);
        };
        if Instant::now() >= deadline {
            if obj.metadata.deletion_timestamp.is_some() {
                return Ok(Some(format!(
                    "{label} is still terminating (its finalizers run in the cluster's controller manager); it goes by itself"
                )));
            }
            return Err(InstallError::Timeout {
                what: format!("waiting for {label} to be deleted"),
                limit: Duration::ZERO,
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Turns the installed node agent into the cleaner (`--uninstall --hold`:
/// removes ambit-cni from its node's conflist and every enrolled pod's
/// redirection, then reports ready) and waits until every scheduled pod
/// of the new generation is ready. Only the container's arguments and
/// readiness probe change, so the installed image, paths and settings are
/// the ones that clean.
async fn clean_nodes(
    client: &Client,
    agent: &Value,
    deadline: Instant,
    wait: Duration,
) -> Result<String, InstallError> {
    let (api, label) = api_for(client, agent)?;
    let Some(_) = bounded(&format!("reading {label}"), api.get_opt(NODE_AGENT)).await? else {
        return Ok(format!("absent {label} (no node to clean)"));
    };
    let cleaner = json!({"spec": {"template": {"spec": {"containers": [{
        "name": NODE_AGENT_CONTAINER,
        "args": ["--uninstall", "--hold"],
        "readinessProbe": {
            "exec": {"command": ["test", "-f", "/tmp/uninstalled"]},
            "periodSeconds": 2,
        },
    }]}}}});
    let patched = bounded(
        &format!("turning {label} into the CNI cleaner"),
        api.patch(
            NODE_AGENT,
            &PatchParams {
                field_manager: Some(CLEANER_MANAGER.into()),
                ..PatchParams::default()
            },
            &Patch::Strategic(&cleaner),
        ),
    )
    .await?;
    let generation = patched.metadata.generation.unwrap_or(0);
    loop {
        let ds = bounded(&format!("reading {label}"), api.get(NODE_AGENT)).await?;
        let st = &ds.data["status"];
        let n = |k: &str| st[k].as_i64().unwrap_or(-1);
        let desired = n("desiredNumberScheduled");
        let done = n("observedGeneration") >= generation
            && desired >= 0
            && n("updatedNumberScheduled").max(0) == desired
            && n("numberReady").max(0) == desired;
        if done {
            return Ok(format!(
                "removed ambit-cni from the CNI configuration of {desired} node(s)"
            ));
        }
        if Instant::now() >= deadline {
            return Err(InstallError::Timeout {
                what: format!(
                    "waiting for every node to remove ambit-cni ({label}: {} of {} done); see `kubectl -n ambit-system get pods -l app=ambit-node-agent`",
                    n("numberReady").max(0),
                    desired.max(0)
                ),
                limit: wait,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
