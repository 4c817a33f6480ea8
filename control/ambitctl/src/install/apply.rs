//! Applying the rendered manifests: server-side apply, one object at a time
//! in the manifests' order, each reported as what happened to it.

use kube::Client;
use kube::api::{Patch, PatchParams};
use serde_json::Value;

use super::{FIELD_MANAGER, InstallError, PART_OF, api_for, bounded};

/// Applies `docs` in order with server-side apply (field manager
/// `ambitctl`, forced: the manifests own their fields); returns one line
/// per object: `created`, `configured`, `unchanged`, or `skipped` with the
/// reason. Running it twice with the same documents changes nothing.
pub async fn apply(client: &Client, docs: &[Value]) -> Result<Vec<String>, InstallError> {
    let mut report = Vec::new();
    let params = PatchParams::apply(FIELD_MANAGER).force();
    for doc in docs {
        let (api, label) = api_for(client, doc)?;
        let name = doc["metadata"]["name"].as_str().unwrap_or_default();
        let existing = bounded(&format!("reading {label}"), api.get_opt(name)).await?;
        if doc["kind"] == "CustomResourceDefinition"
            && let Some(crd) = &existing
        {
            let ours = crd.metadata.labels.as_ref().and_then(|l| l.get(PART_OF))
                == Some(&"ambit".to_string());
            if !ours {
                report.push(format!(
                    "skipped {label} (installed by someone else, e.g. Istio; theirs serves)"
                ));
                continue;
            }
        }
        let applied = bounded(
            &format!("applying {label}"),
            api.patch(name, &params, &Patch::Apply(doc)),
        )
        .await?;
        let outcome = match existing {
            None => "created",
            Some(before)
                if before.metadata.resource_version == applied.metadata.resource_version =>
            {
                "unchanged"
            }
            Some(_) => "configured",
        };
        report.push(format!("{outcome} {label}"));
    }
    Ok(report)
}
