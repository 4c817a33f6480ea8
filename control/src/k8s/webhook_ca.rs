//! Keeps the `caBundle` of the sidecar injector's
//! MutatingWebhookConfiguration equal to the mesh root, so the API server
//! trusts the webhook's CA-issued certificate. Only the leader writes; the
//! configuration itself is installed with the manifests (a cluster without
//! it has injection off, which is not an error).

use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::{K8sError, call};

/// The MutatingWebhookConfiguration deploy/kubernetes installs.
pub const INJECTOR_CONFIG: &str = "ambit-sidecar-injector";
/// How often the leader checks it again.
pub const RECHECK: Duration = Duration::from_secs(10);

/// Runs while the process lives: sets every webhook's `caBundle` to
/// `bundle` (PEM) whenever this replica leads.
pub async fn run(client: Client, bundle: String, mut leader: watch::Receiver<bool>) {
    let api: Api<MutatingWebhookConfiguration> = Api::all(client);
    loop {
        if leader.wait_for(|l| *l).await.is_err() {
            return;
        }
        if let Err(e) = keep_current(&api, bundle.as_bytes()).await {
            warn!(error = %e, "cannot set the caBundle of MutatingWebhookConfiguration {INJECTOR_CONFIG}; retrying");
        }
        tokio::select! {
            () = tokio::time::sleep(RECHECK) => {}
            _ = leader.wait_for(|l| !*l) => {}
        }
    }
}

async fn keep_current(
    api: &Api<MutatingWebhookConfiguration>,
    bundle: &[u8],
) -> Result<(), K8sError> {
    let current = call(
        format!("reading MutatingWebhookConfiguration {INJECTOR_CONFIG}"),
        api.get_opt(INJECTOR_CONFIG),
    )
    .await?;
    let Some(mut config) = current else {
        debug!(
            "no MutatingWebhookConfiguration {INJECTOR_CONFIG}: sidecar injection is not installed"
        );
        return Ok(());
    };
    let mut changed = false;
    for hook in config.webhooks.iter_mut().flatten() {
        let have = hook
            .client_config
            .ca_bundle
            .as_ref()
            .map(|b| b.0.as_slice());
        if have != Some(bundle) {
            hook.client_config.ca_bundle = Some(ByteString(bundle.to_vec()));
            changed = true;
        }
    }
    if changed {
        call(
            format!("updating the caBundle of MutatingWebhookConfiguration {INJECTOR_CONFIG}"),
            api.replace(INJECTOR_CONFIG, &PostParams::default(), &config),
        )
        .await?;
        info!(
            config = INJECTOR_CONFIG,
            "set the injection webhook's caBundle to the mesh root"
        );
    }
    Ok(())
}
