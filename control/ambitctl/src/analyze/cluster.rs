//! A Kubernetes cluster as an `analyze` source: every kind the mesh reads
//! (the control plane's [`WatchSpec`] list, so analyze sees exactly what
//! the Kubernetes source would), each at the version the API server's
//! discovery says it serves, listed once in pages and made
//! [`Document::from_json`]s. A kind none of whose versions is served (its
//! CRD is not installed: an older Gateway API channel, no Istio CRDs) is
//! skipped, as the control plane treats it as empty too.

use std::time::Duration;

use ambit_control::source::kube::WatchSpec;
use ambit_control::source::kube::discovery::discover;
use kube::api::{Api, DynamicObject, ListParams};
use kube::discovery::ApiResource;
use serde_json::{Map, Value};

use super::AnalyzeError;
use super::source::{Document, Source};

/// Objects per list page.
const PAGE: u32 = 500;
/// Bound on one list call.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The mesh's objects as one cluster holds them, listed at construction.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// The API server, for messages.
    pub server: String,
    documents: Vec<Document>,
    /// Kinds whose resource the API server does not serve (CRD absent).
    pub absent: Vec<String>,
}

impl Cluster {
    /// Lists every kind the mesh reads, cluster-wide.
    pub async fn list(client: kube::Client, server: String) -> Result<Cluster, AnalyzeError> {
        let specs = WatchSpec::all();
        let served = tokio::time::timeout(CALL_TIMEOUT, discover(&client, &specs))
            .await
            .map_err(|_| {
                AnalyzeError::Cluster(format!(
                    "API discovery on {server}: no answer in {CALL_TIMEOUT:?}"
                ))
            })?
            .map_err(|e| AnalyzeError::Cluster(format!("{server}: {e}")))?;
        let mut documents = Vec::new();
        let mut absent = Vec::new();
        for spec in specs {
            let Some(ar) = served.get(spec.kind) else {
                absent.push(spec.qualified_plural());
                continue;
            };
            list_kind(&client, &server, &spec, ar, &mut documents).await?;
        }
        Ok(Cluster {
            server,
            documents,
            absent,
        })
    }
}

/// Lists one kind, page by page, into `documents`.
async fn list_kind(
    client: &kube::Client,
    server: &str,
    spec: &WatchSpec,
    ar: &ApiResource,
    documents: &mut Vec<Document>,
) -> Result<(), AnalyzeError> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), ar);
    let mut params = ListParams::default().limit(PAGE);
    if let Some(fields) = spec.field_selector {
        params = params.fields(fields);
    }
    loop {
        let what = || format!("listing {} on {server}", spec.qualified_plural());
        let page = match tokio::time::timeout(CALL_TIMEOUT, api.list(&params)).await {
            Err(_) => {
                return Err(AnalyzeError::Cluster(format!(
                    "{}: no answer in {CALL_TIMEOUT:?}",
                    what()
                )));
            }
            Ok(Err(e)) => {
                return Err(AnalyzeError::Cluster(format!(
                    "{}: {e}; check the kubeconfig's context and that it may list this resource",
                    what()
                )));
            }
            Ok(Ok(page)) => page,
        };
        for obj in page.items {
            documents.push(Document::from_json(as_json(obj, ar)));
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(()),
        }
    }
}

/// An object as the API server sends it, with the `apiVersion` and `kind`
/// list items lack.
fn as_json(obj: DynamicObject, ar: &ApiResource) -> Value {
    let mut map = match obj.data {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    map.insert("apiVersion".into(), Value::String(ar.api_version.clone()));
    map.insert("kind".into(), Value::String(ar.kind.clone()));
    // Serializing ObjectMeta (plain fields and string maps) cannot fail.
    let meta = serde_json::to_value(&obj.metadata).unwrap_or_else(|_| Value::Object(Map::new()));
    map.insert("metadata".into(), meta);
    Value::Object(map)
}

impl Source for Cluster {
    fn describe(&self) -> String {
        format!("cluster {}", self.server)
    }

    fn documents(&self) -> Result<Vec<Document>, AnalyzeError> {
        Ok(self.documents.clone())
    }
}
