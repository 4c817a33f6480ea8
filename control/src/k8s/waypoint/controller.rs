//! The waypoint deployment controller: while this replica leads, the
//! control plane is Ready and the API server serves Gateways, it keeps what
//! runs each waypoint Gateway (`objects.rs`) and its status (`status.rs`) in
//! step.
//!
//! ```text
//! watch Gateways ──────────┐
//! watch Deployments ───────┼─▶ cache ─▶ dirty keys ─▶ reconcile(ns/name):
//! watch Services ──────────┘   (labelled gateway.istio.io/managed)   apply SA + Deployment + Service
//!                                                                    when their hash changed;
//!                                                                    patch the Gateway's status
//!                                                                    when it says something else
//! ```
//!
//! Nothing is reconciled before all three watches have listed, so a new
//! leader sees what exists and writes only what differs: the applied
//! objects carry a hash of what was applied, and a status equal to the
//! desired one is not written. Writes are server-side applies with field
//! manager `ambit-control` (forced: these are our fields), so fields users
//! add to the objects stay theirs. Deleting a Gateway leaves the cleanup to
//! the garbage collector (the objects are owned by it).

use std::collections::{BTreeMap, BTreeSet};
use std::pin::pin;
use std::time::Duration;

use ambit_config::gateway_api::WAYPOINT_GATEWAY_CLASSES;
use ambit_config::{Object, decode_json_value};
use futures::{FutureExt, StreamExt, stream};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use kube::Client;
use kube::api::{Api, DynamicObject, Patch, PatchParams, ResourceExt};
use kube::discovery::ApiResource;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use serde_json::Value;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::objects::{
    GatewayRef, LABEL_MANAGED, MANAGED_VALUE, refusal, spec_hash, waypoint_objects,
};
use super::status::{Running, desired_status, same_status};
use crate::inject::InjectSettings;
use crate::k8s::{K8sError, call};
use crate::source::kube::Discovered;

/// Field manager of what the controller applies.
pub const FIELD_MANAGER: &str = "ambit-control";

/// How the controller runs.
#[derive(Debug, Clone)]
pub struct WaypointOptions {
    /// DNS suffix of service hostnames (`cluster.local`).
    pub domain: String,
    /// The proxy image and the agent's settings.
    pub settings: InjectSettings,
    /// Every waypoint is reconciled again this often (anti-entropy).
    pub resync: Duration,
}

/// `(namespace, name)`.
type Key = (String, String);

/// What the watches say.
#[derive(Default)]
struct Cache {
    gateways: BTreeMap<Key, DynamicObject>,
    /// Ready replicas and the applied hash of each managed Deployment.
    deployments: BTreeMap<Key, (Option<i32>, Option<String>)>,
    /// ClusterIP and the applied hash of each managed Service.
    services: BTreeMap<Key, (Option<String>, Option<String>)>,
}

enum Change {
    Gateway(Result<Event<DynamicObject>, watcher::Error>),
    Deployment(Result<Event<Deployment>, watcher::Error>),
    Service(Result<Event<Service>, watcher::Error>),
}

/// Runs while the process lives.
pub async fn run(
    client: Client,
    mut leader: watch::Receiver<bool>,
    mut discovered: watch::Receiver<Discovered>,
    mut ready: watch::Receiver<bool>,
    opts: WaypointOptions,
) {
    let served = |d: &Discovered| {
        d.served
            .as_ref()
            .and_then(|s| s.get(ambit_config::Kind::Gateway))
            .cloned()
    };
    loop {
        if leader.wait_for(|l| *l).await.is_err() || ready.wait_for(|r| *r).await.is_err() {
            return;
        }
        let Ok(ar) = discovered
            .wait_for(|d| served(d).is_some())
            .await
            .map(|d| served(&d))
        else {
            return;
        };
        let Some(ar) = ar else { continue };
        info!(api_version = %ar.api_version, "leading: running waypoint Gateways (Deployment, Service, status)");
        tokio::select! {
            () = lead(client.clone(), &ar, &opts) => {}
            _ = leader.wait_for(|l| !*l) => {
                info!("no longer leading: stopped running waypoint Gateways");
            }
            _ = discovered.wait_for(|d| served(d).as_ref() != Some(&ar)) => {}
        }
    }
}

fn key_of(meta: &kube::api::ObjectMeta) -> Key {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

fn hash_of(meta: &kube::api::ObjectMeta) -> Option<String> {
    meta.annotations
        .as_ref()
        .and_then(|a| a.get(super::objects::SPEC_HASH))
        .cloned()
}

async fn lead(client: Client, ar: &ApiResource, opts: &WaypointOptions) {
    let managed = watcher::Config::default().labels(&format!("{LABEL_MANAGED}={MANAGED_VALUE}"));
    let gateways = watcher::watcher(
        Api::<DynamicObject>::all_with(client.clone(), ar),
        watcher::Config::default(),
    )
    .default_backoff()
    .map(Change::Gateway);
    let deployments = watcher::watcher(Api::<Deployment>::all(client.clone()), managed.clone())
        .default_backoff()
        .map(Change::Deployment);
    let services = watcher::watcher(Api::<Service>::all(client.clone()), managed)
        .default_backoff()
        .map(Change::Service);
    let mut changes = pin!(stream::select(
        gateways,
        stream::select(deployments, services)
    ));
    let mut cache = Cache::default();
    let mut listed = [false; 3];
    let mut dirty: BTreeSet<Key> = BTreeSet::new();
    let mut resync = tokio::time::interval(opts.resync);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            change = changes.next() => {
                let Some(change) = change else { return };
                apply_change(&mut cache, change, &mut listed, &mut dirty);
                while let Some(Some(more)) = changes.next().now_or_never() {
                    apply_change(&mut cache, more, &mut listed, &mut dirty);
                }
            }
            _ = resync.tick() => dirty.extend(cache.gateways.keys().cloned()),
        }
        if !listed.iter().all(|l| *l) {
            continue;
        }
        for key in std::mem::take(&mut dirty) {
            if let Err(e) = reconcile(&client, ar, opts, &cache, &key).await {
                warn!(gateway = %format!("{}/{}", key.0, key.1), error = %e, "cannot run a waypoint Gateway; retried at its next change or the resync");
            }
        }
    }
}

/// Records one watch event; marks the Gateways it concerns.
fn apply_change(
    cache: &mut Cache,
    change: Change,
    listed: &mut [bool; 3],
    dirty: &mut BTreeSet<Key>,
) {
    match change {
        Change::Gateway(ev) => match ev {
            Ok(Event::Apply(g) | Event::InitApply(g)) => {
                let key = key_of(&g.metadata);
                dirty.insert(key.clone());
                cache.gateways.insert(key, g);
            }
            Ok(Event::Delete(g)) => {
                cache.gateways.remove(&key_of(&g.metadata));
            }
            Ok(Event::Init) => cache.gateways.clear(),
            Ok(Event::InitDone) => listed[0] = true,
            Err(e) => debug!(error = %e, "watching Gateways failed; retrying"),
        },
        Change::Deployment(ev) => match ev {
            Ok(Event::Apply(d) | Event::InitApply(d)) => {
                let key = key_of(&d.metadata);
                let ready = d.status.as_ref().and_then(|s| s.ready_replicas);
                cache
                    .deployments
                    .insert(key.clone(), (ready, hash_of(&d.metadata)));
                dirty.insert(key);
            }
            Ok(Event::Delete(d)) => {
                let key = key_of(&d.metadata);
                cache.deployments.remove(&key);
                dirty.insert(key);
            }
            Ok(Event::Init) => cache.deployments.clear(),
            Ok(Event::InitDone) => listed[1] = true,
            Err(e) => debug!(error = %e, "watching waypoint Deployments failed; retrying"),
        },
        Change::Service(ev) => match ev {
            Ok(Event::Apply(s) | Event::InitApply(s)) => {
                let key = key_of(&s.metadata);
                let ip = s
                    .spec
                    .as_ref()
                    .and_then(|s| s.cluster_ip.clone())
                    .filter(|ip| !ip.is_empty() && ip != "None");
                cache
                    .services
                    .insert(key.clone(), (ip, hash_of(&s.metadata)));
                dirty.insert(key);
            }
            Ok(Event::Delete(s)) => {
                let key = key_of(&s.metadata);
                cache.services.remove(&key);
                dirty.insert(key);
            }
            Ok(Event::Init) => cache.services.clear(),
            Ok(Event::InitDone) => listed[2] = true,
            Err(e) => debug!(error = %e, "watching waypoint Services failed; retrying"),
        },
    }
}

/// The Gateway as the API server holds it, with the `apiVersion`/`kind`
/// list items lack.
fn gateway_value(g: &DynamicObject, ar: &ApiResource) -> Value {
    let mut v = g.data.clone();
    v["apiVersion"] = Value::String(ar.api_version.clone());
    v["kind"] = Value::String(ar.kind.clone());
    v["metadata"] = serde_json::to_value(&g.metadata).unwrap_or(Value::Null);
    v
}

async fn reconcile(
    client: &Client,
    ar: &ApiResource,
    opts: &WaypointOptions,
    cache: &Cache,
    key: &Key,
) -> Result<(), K8sError> {
    let Some(g) = cache.gateways.get(key) else {
        return Ok(()); // deleted: what it owned goes with it
    };
    let value = gateway_value(g, ar);
    let class = value["spec"]["gatewayClassName"]
        .as_str()
        .unwrap_or_default();
    if !WAYPOINT_GATEWAY_CLASSES.contains(&class) || g.metadata.deletion_timestamp.is_some() {
        return Ok(());
    }
    let decoded = match decode_json_value(&value) {
        Ok(Some(Object::Gateway(gw))) => Ok(gw),
        Ok(_) => return Ok(()),
        Err(f) => Err(("Invalid", f.error.to_string())),
    };
    let problem = match &decoded {
        Ok(gw) => refusal(gw).map(|m| ("UnsupportedProtocol", m)),
        Err((reason, m)) => Some((*reason, m.clone())),
    };
    if let (Ok(gw), None) = (&decoded, &problem) {
        let objs = waypoint_objects(
            &GatewayRef {
                api_version: &ar.api_version,
                gateway: gw,
            },
            &opts.settings,
        );
        let have_deployment = cache.deployments.get(key).and_then(|d| d.1.as_deref());
        if have_deployment != spec_hash(&objs.deployment) {
            apply(client, &objs.service_account, key).await?;
            apply(client, &objs.deployment, key).await?;
        }
        let have_service = cache.services.get(key).and_then(|s| s.1.as_deref());
        if have_service != spec_hash(&objs.service) {
            apply(client, &objs.service, key).await?;
        }
    }
    let running = Running {
        ready_replicas: cache.deployments.get(key).and_then(|d| d.0),
        cluster_ip: cache.services.get(key).and_then(|s| s.0.clone()),
    };
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let desired = desired_status(&value, problem, &running, &opts.domain, &now);
    if same_status(&value["status"], &desired) {
        return Ok(());
    }
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &key.0, ar);
    let patch = serde_json::json!({"status": desired});
    call(
        format!("patching the status of Gateway {}/{}", key.0, key.1),
        api.patch_status(&key.1, &PatchParams::default(), &Patch::Merge(&patch)),
    )
    .await?;
    info!(gateway = %format!("{}/{}", key.0, key.1), programmed = %desired["conditions"][1]["status"], "wrote waypoint Gateway status");
    Ok(())
}

/// Server-side applies one of the waypoint's objects.
async fn apply(client: &Client, doc: &Value, key: &Key) -> Result<(), K8sError> {
    let kind = doc["kind"].as_str().unwrap_or_default();
    let (group, version) = doc["apiVersion"]
        .as_str()
        .unwrap_or_default()
        .split_once('/')
        .unwrap_or(("", "v1"));
    let plural = match kind {
        "Deployment" => "deployments",
        "Service" => "services",
        _ => "serviceaccounts",
    };
    let ar = ApiResource {
        group: group.to_string(),
        version: version.to_string(),
        api_version: doc["apiVersion"].as_str().unwrap_or_default().to_string(),
        kind: kind.to_string(),
        plural: plural.to_string(),
    };
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &key.0, &ar);
    let applied = call(
        format!("applying {kind} {}/{}", key.0, key.1),
        api.patch(
            &key.1,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(doc),
        ),
    )
    .await?;
    info!(object = %format!("{kind} {}/{}", key.0, key.1), resource_version = ?applied.resource_version(), "applied a waypoint object");
    Ok(())
}
