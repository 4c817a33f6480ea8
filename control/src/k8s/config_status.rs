//! Status the leader writes on Istio objects the control plane rejects: a
//! `Reconciled` condition (Istio's `IstioStatus.conditions`), `False` with
//! reason `Invalid` and the decoder's or model's message while the object
//! is rejected (its last good version keeps serving), back to `True` once
//! it is accepted again. Only objects that were reported get written, so
//! a healthy mesh costs no writes.
//!
//! Runs while leading (a new leader starts from nothing and re-reports
//! what is rejected); follows the model's snapshots, whose `errors` list
//! is the one source of truth (`/debug/config_errors` shows the same).

use std::collections::BTreeMap;
use std::sync::Arc;

use ambit_config::Kind;
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use serde_json::json;
use tokio::sync::watch;
use tracing::{info, warn};

use super::call;
use crate::model::snapshot::Snapshot;
use crate::source::kube::Discovered;

/// The kinds whose status this writes (Istio's, which carry
/// `IstioStatus`).
pub const ISTIO_KINDS: [Kind; 7] = [
    Kind::VirtualService,
    Kind::DestinationRule,
    Kind::ServiceEntry,
    Kind::WorkloadEntry,
    Kind::Sidecar,
    Kind::PeerAuthentication,
    Kind::AuthorizationPolicy,
];

type Key = (Kind, String, String);

/// Runs while the process lives: reports rejected Istio objects whenever
/// this replica leads.
pub async fn run(
    client: Client,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    mut leader: watch::Receiver<bool>,
    discovered: watch::Receiver<Discovered>,
) {
    loop {
        if leader.wait_for(|l| *l).await.is_err() {
            return;
        }
        let writer = Writer {
            client: client.clone(),
            discovered: discovered.clone(),
        };
        tokio::select! {
            () = report_while_leading(&writer, snapshots.clone()) => return,
            _ = leader.wait_for(|l| !*l) => {}
        }
    }
}

fn rejected(s: &Snapshot) -> BTreeMap<Key, String> {
    s.errors
        .iter()
        .filter_map(|e| {
            let kind = ISTIO_KINDS.into_iter().find(|k| k.as_str() == e.kind)?;
            Some((
                (kind, e.namespace.clone(), e.name.clone()),
                e.reason.clone(),
            ))
        })
        .collect()
}

/// Writes status at the version each kind is served as.
struct Writer {
    client: Client,
    discovered: watch::Receiver<Discovered>,
}

async fn report_while_leading(client: &Writer, mut snapshots: watch::Receiver<Arc<Snapshot>>) {
    // What this leader has written: key → the message (empty once it wrote
    // Reconciled=True and forgot the object).
    let mut written: BTreeMap<Key, String> = BTreeMap::new();
    loop {
        let now = rejected(&snapshots.borrow_and_update());
        for (key, reason) in &now {
            if written.get(key) == Some(reason) {
                continue;
            }
            match write(client, key, Some(reason)).await {
                Ok(()) => {
                    written.insert(key.clone(), reason.clone());
                }
                Err(e) => {
                    warn!(error = %e, "cannot report a rejected object in its status; retried at the next change")
                }
            }
        }
        let fixed: Vec<Key> = written
            .keys()
            .filter(|k| !now.contains_key(*k))
            .cloned()
            .collect();
        for key in fixed {
            // Gone or accepted again: a deleted object answers 404.
            match write(client, &key, None).await {
                Ok(()) => {}
                Err(e) if e.status_code() == Some(404) => {}
                Err(e) => {
                    warn!(error = %e, "cannot clear a fixed object's status; retried at the next change");
                    continue;
                }
            }
            written.remove(&key);
        }
        if snapshots.changed().await.is_err() {
            return;
        }
    }
}

async fn write(
    writer: &Writer,
    (kind, ns, name): &Key,
    reason: Option<&String>,
) -> Result<(), super::K8sError> {
    let served = writer
        .discovered
        .borrow()
        .served
        .as_ref()
        .and_then(|s| s.get(*kind))
        .cloned();
    // Not served (any more): the object went with its CRD.
    let Some(ar) = served else {
        return Ok(());
    };
    let api: Api<DynamicObject> = Api::namespaced_with(writer.client.clone(), ns, &ar);
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let condition = match reason {
        Some(r) => json!({"type": "Reconciled", "status": "False", "reason": "Invalid",
            "message": format!("rejected by ambit, the last accepted version keeps serving: {r}"),
            "lastTransitionTime": now}),
        None => json!({"type": "Reconciled", "status": "True", "reason": "Accepted",
            "message": "accepted by ambit", "lastTransitionTime": now}),
    };
    let patch = json!({"status": {"conditions": [condition]}});
    call(
        format!("patching the status of {} {ns}/{name}", kind.as_str()),
        api.patch_status(name, &PatchParams::default(), &Patch::Merge(&patch)),
    )
    .await?;
    info!(object = %format!("{}/{ns}/{name}", kind.as_str()), rejected = reason.is_some(), "wrote status");
    Ok(())
}
