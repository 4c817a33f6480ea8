//! The mesh's trust bundle in ConfigMap `istio-ca-root-cert` (key
//! `root-cert.pem`, Istio's names) in the control plane's namespace, where
//! ztunnel mounts it to verify the control plane on 15012.
//!
//! Only the leader writes it: it creates the ConfigMap, or replaces its
//! data when it differs from the CA's bundle, then checks again every
//! [`RECHECK`] while leading (someone may delete or edit it).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tracing::{info, warn};

use super::{K8sError, call};

/// The ConfigMap's name and key, as Istio names them.
pub const ROOT_CONFIGMAP: &str = "istio-ca-root-cert";
pub const ROOT_CERT_KEY: &str = "root-cert.pem";
/// How often the leader checks the ConfigMap again.
pub const RECHECK: Duration = Duration::from_secs(60);

/// Runs while the process lives: publishes `bundle` whenever this
/// replica leads.
pub async fn run(
    client: Client,
    namespace: String,
    bundle: String,
    mut leader: watch::Receiver<bool>,
) {
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    loop {
        if leader.wait_for(|l| *l).await.is_err() {
            return;
        }
        if let Err(e) = publish(&api, &namespace, &bundle).await {
            warn!(error = %e, "cannot publish the mesh root in ConfigMap {namespace}/{ROOT_CONFIGMAP}; retrying");
            tokio::time::sleep(Duration::from_secs(2)).await;
            continue;
        }
        tokio::select! {
            () = tokio::time::sleep(RECHECK) => {}
            _ = leader.wait_for(|l| !*l) => {}
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
