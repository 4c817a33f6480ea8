//! Status the leader writes: a waypoint Gateway's `Accepted` and
//! `Programmed` conditions and its address.
//!
//! Only the leader runs this (it starts on becoming leader and stops on
//! losing it). It watches Gateway API Gateways of the waypoint classes
//! (`istio-waypoint`, `ambit-waypoint`) and, when their status does not say
//! what the control plane knows, patches the `status` subresource:
//! `Accepted`/`Programmed` `True` when `ambit-config` accepts the Gateway
//! (the control plane then serves its configuration to waypoint proxies),
//! `False` with reason `Invalid` and the decoder's message when it does
//! not; `observedGeneration` is the Gateway's generation; the address is
//! the waypoint's service hostname. Conditions of other types are kept.
//! A status that already matches is not written again, so the Gateway's
//! own update event (caused by the patch) ends the loop.

use std::pin::pin;

use ambit_config::decode_json_value;
use futures::StreamExt;
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::discovery::ApiResource;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use serde_json::{Value, json};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::call;
use crate::source::kube::Discovered;

/// Gateway classes whose Gateways are waypoints.
pub const WAYPOINT_CLASSES: [&str; 2] = ["istio-waypoint", "ambit-waypoint"];

/// Settings of the status writer.
#[derive(Debug, Clone)]
pub struct StatusOptions {
    /// DNS suffix of service hostnames (`cluster.local`).
    pub domain: String,
}

/// Runs while the process lives: writes status whenever this replica
/// leads and the API server serves Gateways (at the version discovery
/// found).
pub async fn run(
    client: Client,
    mut leader: watch::Receiver<bool>,
    mut discovered: watch::Receiver<Discovered>,
    opts: StatusOptions,
) {
    loop {
        if leader.wait_for(|l| *l).await.is_err() {
            return;
        }
        let served = |d: &Discovered| {
            d.served
                .as_ref()
                .and_then(|s| s.get(ambit_config::Kind::Gateway))
                .cloned()
        };
        let Ok(ar) = discovered
            .wait_for(|d| served(d).is_some())
            .await
            .map(|d| served(&d))
        else {
            return;
        };
        let Some(ar) = ar else { continue };
        info!(api_version = %ar.api_version, "leading: writing waypoint Gateway status");
        tokio::select! {
            () = write_while_leading(client.clone(), &ar, &opts) => {}
            _ = leader.wait_for(|l| !*l) => {
                info!("no longer leading: stopped writing Gateway status");
            }
            _ = discovered.wait_for(|d| served(d).as_ref() != Some(&ar)) => {}
        }
    }
}

async fn write_while_leading(client: Client, ar: &ApiResource, opts: &StatusOptions) {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), ar);
    let mut events = pin!(watcher::watcher(api, watcher::Config::default()).default_backoff());
    while let Some(ev) = events.next().await {
        match ev {
            Ok(Event::Apply(gw) | Event::InitApply(gw)) => {
                if let Err(e) = reconcile(&client, ar, gw, opts).await {
                    warn!(error = %e, "cannot write a Gateway's status; retried at its next change or relist");
                }
            }
            Ok(_) => {}
            Err(e) => debug!(error = %e, "watching Gateways for status failed"),
        }
    }
}

/// The status a Gateway should have, or `None` when it is not a
/// waypoint.
pub fn desired_status(gw: &Value, domain: &str, now: &str) -> Option<Value> {
    let class = gw["spec"]["gatewayClassName"].as_str()?;
    if !WAYPOINT_CLASSES.contains(&class) {
        return None;
    }
    let name = gw["metadata"]["name"].as_str()?;
    let ns = gw["metadata"]["namespace"].as_str()?;
    let generation = gw["metadata"]["generation"].as_i64().unwrap_or(0);
    let (ok, reason, message) = match decode_json_value(gw) {
        Ok(_) => (
            "True",
            None,
            "accepted by ambit; its configuration is served to waypoint proxies".to_string(),
        ),
        Err(f) => ("False", Some("Invalid"), f.error.to_string()),
    };
    let condition = |type_: &str, good_reason: &str| {
        json!({
            "type": type_,
            "status": ok,
            "reason": reason.unwrap_or(good_reason),
            "message": message,
            "observedGeneration": generation,
            "lastTransitionTime": now,
        })
    };
    let mut conditions: Vec<Value> = gw["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|c| !matches!(c["type"].as_str(), Some("Accepted" | "Programmed")))
        .collect();
    for (t, r) in [("Accepted", "Accepted"), ("Programmed", "Programmed")] {
        let mut c = condition(t, r);
        // Keep the transition time when only the generation moved.
        if let Some(old) = gw["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|x| x["type"] == t))
            && old["status"] == c["status"]
        {
            c["lastTransitionTime"] = old["lastTransitionTime"].clone();
        }
        conditions.push(c);
    }
    Some(json!({
        "conditions": conditions,
        "addresses": [{"type": "Hostname", "value": format!("{name}.{ns}.svc.{domain}")}],
    }))
}

/// True when `current` already says what `desired` says (ignoring
/// transition times and messages' order of conditions).
fn same_status(current: &Value, desired: &Value) -> bool {
    let key = |c: &Value| {
        (
            c["type"].clone(),
            c["status"].clone(),
            c["reason"].clone(),
            c["message"].clone(),
            c["observedGeneration"].clone(),
        )
    };
    let set = |v: &Value| {
        let mut s: Vec<_> = v["conditions"]
            .as_array()
            .map(|cs| cs.iter().map(key).collect())
            .unwrap_or_default();
        s.sort_by_key(|k| k.0.to_string());
        s
    };
    set(current) == set(desired) && current["addresses"] == desired["addresses"]
}

async fn reconcile(
    client: &Client,
    ar: &ApiResource,
    gw: DynamicObject,
    opts: &StatusOptions,
) -> Result<(), super::K8sError> {
    let (Some(name), Some(ns)) = (gw.metadata.name.clone(), gw.metadata.namespace.clone()) else {
        return Ok(());
    };
    let mut value = gw.data;
    value["apiVersion"] = json!(ar.api_version);
    value["kind"] = json!(ar.kind);
    value["metadata"] = serde_json::to_value(&gw.metadata).unwrap_or(Value::Null);
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let Some(desired) = desired_status(&value, &opts.domain, &now) else {
        return Ok(());
    };
    if same_status(&value["status"], &desired) {
        return Ok(());
    }
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, ar);
    let patch = json!({"status": desired});
    call(
        format!("patching the status of Gateway {ns}/{name}"),
        api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)),
    )
    .await?;
    info!(gateway = %format!("{ns}/{name}"), "wrote waypoint Gateway status");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waypoint_status() {
        let gw = json!({
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "Gateway",
            "metadata": {"name": "waypoint", "namespace": "shop", "generation": 3},
            "spec": {"gatewayClassName": "istio-waypoint",
                     "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
        });
        let s = desired_status(&gw, "cluster.local", "2026-01-01T00:00:00Z");
        let s = s.unwrap_or_default();
        let types: Vec<&str> = s["conditions"]
            .as_array()
            .map(|c| c.iter().filter_map(|x| x["type"].as_str()).collect())
            .unwrap_or_default();
        assert_eq!(types, ["Accepted", "Programmed"]);
        assert_eq!(s["conditions"][1]["status"], "True");
        assert_eq!(s["conditions"][1]["observedGeneration"], 3);
        assert_eq!(
            s["addresses"][0]["value"],
            "waypoint.shop.svc.cluster.local"
        );
        assert!(same_status(&s, &s));
        let other = json!({"metadata": {"name": "x", "namespace": "y"}, "spec": {"gatewayClassName": "nginx"}});
        assert!(desired_status(&other, "cluster.local", "t").is_none());
    }
}
