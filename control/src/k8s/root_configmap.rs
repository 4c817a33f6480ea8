//! The mesh's trust bundle in ConfigMap `istio-ca-root-cert` (key
//! `root-cert.pem`, Istio's names) in every namespace but Kubernetes' own:
//! ztunnel mounts it from the control plane's namespace to verify 15012,
//! and injected sidecars mount it from their pod's namespace.
//!
//! Only the leader writes it. Every [`SWEEP`] it lists the namespaces and
//! publishes into those it has not published the current bundle to; every
//! [`RECHECK`] it checks all of them again (someone may delete or edit one).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use tokio::sync::watch;
use tracing::{info, warn};

use super::{K8sError, call};

/// The ConfigMap's name and key, as Istio names them.
pub const ROOT_CONFIGMAP: &str = "istio-ca-root-cert";
pub const ROOT_CERT_KEY: &str = "root-cert.pem";
/// How often the leader checks every namespace's ConfigMap again.
pub const RECHECK: Duration = Duration::from_secs(60);
/// How often the leader looks for namespaces it has not published to.
pub const SWEEP: Duration = Duration::from_secs(5);
/// Namespaces of Kubernetes itself: no mesh workload runs there.
const SKIPPED: [&str; 3] = ["kube-system", "kube-public", "kube-node-lease"];

/// Runs while the process lives: publishes `bundle` whenever this
/// replica leads. `system_namespace` is published first and always.
pub async fn run(
    client: Client,
    system_namespace: String,
    bundle: String,
    mut leader: watch::Receiver<bool>,
) {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    loop {
        if leader.wait_for(|l| *l).await.is_err() {
            return;
        }
        // Namespaces holding the current bundle, as far as this leader knows.
        let mut done: BTreeSet<String> = BTreeSet::new();
        let mut recheck = tokio::time::Instant::now() + RECHECK;
        loop {
            if tokio::time::Instant::now() >= recheck {
                done.clear();
                recheck = tokio::time::Instant::now() + RECHECK;
            }
            let mut wanted = vec![system_namespace.clone()];
            match call(
                "listing namespaces",
                namespaces.list_metadata(&ListParams::default()),
            )
            .await
            {
                Ok(list) => wanted.extend(list.items.into_iter().filter_map(|n| n.metadata.name)),
                Err(e) => {
                    warn!(error = %e, "cannot list namespaces to publish the mesh root; retrying")
                }
            }
            for ns in wanted {
                if SKIPPED.contains(&ns.as_str()) || done.contains(&ns) {
                    continue;
                }
                let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
                match publish(&api, &ns, &bundle).await {
                    Ok(()) => {
                        done.insert(ns);
                    }
                    Err(e) => {
                        warn!(error = %e, "cannot publish the mesh root in ConfigMap {ns}/{ROOT_CONFIGMAP}; retrying")
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(SWEEP) => {}
                _ = leader.wait_for(|l| !*l) => break,
            }
        }
    }
}

async fn publish(api: &Api<ConfigMap>, ns: &str, bundle: &str) -> Result<(), K8sError> {
    let data: BTreeMap<String, String> = [(ROOT_CERT_KEY.to_string(), bundle.to_string())].into();
    let current = call(
        format!("reading ConfigMap {ns}/{ROOT_CONFIGMAP}"),
        api.get_opt(ROOT_CONFIGMAP),
    )
    .await?;
    match current {
        None => {
            let cm = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(ROOT_CONFIGMAP.into()),
                    namespace: Some(ns.into()),
                    labels: Some(
                        [(
                            "app.kubernetes.io/managed-by".to_string(),
                            "ambit".to_string(),
                        )]
                        .into(),
                    ),
                    ..ObjectMeta::default()
                },
                data: Some(data),
                ..ConfigMap::default()
            };
            call(
                format!("creating ConfigMap {ns}/{ROOT_CONFIGMAP}"),
                api.create(&PostParams::default(), &cm),
            )
            .await?;
            info!(configmap = %format!("{ns}/{ROOT_CONFIGMAP}"), "published the mesh root");
        }
        Some(mut cm) if cm.data.as_ref() != Some(&data) => {
            cm.data = Some(data);
            call(
                format!("updating ConfigMap {ns}/{ROOT_CONFIGMAP}"),
                api.replace(ROOT_CONFIGMAP, &PostParams::default(), &cm),
            )
            .await?;
            info!(configmap = %format!("{ns}/{ROOT_CONFIGMAP}"), "updated the mesh root");
        }
        Some(_) => {}
    }
    Ok(())
}
