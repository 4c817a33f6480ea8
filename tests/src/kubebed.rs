//! Kubernetes-mode test bed: a [`FakeApiServer`] and a control plane
//! watching it (for the faults only the fake can show), and what tests
//! against the real API server use too: a raw Delta ADS observer that
//! records what a ztunnel receives, [`wait_synced`], [`pod_uid`].

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use ambit_control::{ControlConfig, ControlPlane};
use anyhow::{Context, Result, anyhow, bail};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse,
};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use crate::fakeapi::{FakeApiServer, TokenReviewAnswer};

/// The user's extra key naming a bound ServiceAccount token's pod.
const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";

/// The token the control plane's kube client sends (identity
/// `ambit-control` in the fake's call log).
const CONTROL_TOKEN: &str = "control-plane-sa-token";
/// The node bootstrap token observers and ztunnels use.
pub const NODE_TOKEN: &str = "node-1-bootstrap-token";

/// Every document of a YAML file, as JSON.
pub fn yaml_docs(path: &Path) -> Result<Vec<Value>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    Ok(docs.into_iter().filter(Value::is_object).collect())
}

/// Loads every document of a YAML file into the fake.
pub fn load_yaml(fake: &FakeApiServer, path: &Path) -> Result<usize> {
    let docs = yaml_docs(path)?;
    let n = docs.len();
    for doc in docs {
        fake.apply(doc)?;
    }
    Ok(n)
}

/// A running pod on `node` with one IP.
pub fn pod(ns: &str, name: &str, ip: &str, node: &str, labels: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "nodeName": node,
            "serviceAccountName": "default",
            "containers": [{"name": "app", "ports": [{"containerPort": 8080}]}],
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    })
}

/// What TokenReview answers for a projected token (audience `istio-ca`)
/// of ServiceAccount `ns/sa`, bound to pod `ns/pod` when given.
pub fn sa_token(ns: &str, sa: &str, pod: Option<&str>, audiences: &[&str]) -> TokenReviewAnswer {
    let mut extra = std::collections::BTreeMap::new();
    if let Some(p) = pod {
        extra.insert(POD_NAME_EXTRA.to_string(), vec![p.to_string()]);
    }
    TokenReviewAnswer {
        username: format!("system:serviceaccount:{ns}:{sa}"),
        uid: format!("uid-{ns}-{sa}"),
        groups: vec![
            "system:serviceaccounts".into(),
            format!("system:serviceaccounts:{ns}"),
        ],
        audiences: audiences.iter().map(|a| a.to_string()).collect(),
        extra,
    }
}

/// ztunnel's token (ServiceAccount `ambit-system/ztunnel`) from pod
/// `ambit-system/<pod>`, audience `istio-ca`.
fn ztunnel_token(pod: &str) -> TokenReviewAnswer {
    sa_token("ambit-system", "ztunnel", Some(pod), &["istio-ca"])
}

/// A namespace with labels.
pub fn namespace(name: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
}

/// A control plane in Kubernetes mode against `fake`.
pub async fn control_plane(
    fake: &FakeApiServer,
    dir: &Path,
    replica: &str,
) -> Result<ControlPlane> {
    let kubeconfig = fake.kubeconfig(
        dir,
        &format!("ambit-control/{replica}"),
        &format!("{CONTROL_TOKEN}-{replica}"),
    )?;
    let data = dir.join(format!("data-{replica}"));
    // Observers present NODE_TOKEN: ztunnel's ServiceAccount token.
    fake.set_token_review(NODE_TOKEN, ztunnel_token("ztunnel-node-1"));
    let cfg = ControlConfig::for_kube_tests(kubeconfig, data, replica);
    ControlPlane::start(cfg)
        .await
        .context("starting the control plane")
}

/// Waits (bounded) until the control plane has listed every kind.
pub async fn wait_synced(cp: &ControlPlane, limit: Duration) -> Result<()> {
    tokio::time::timeout(limit, cp.wait_synced())
        .await
        .map_err(|_| {
            let waiting = cp
                .kube_source()
                .map(|s| s.waiting_for())
                .unwrap_or_default();
            anyhow!("not synced within {limit:?}; waiting for {waiting:?}")
        })?
        .context("the model stopped")
}

/// A raw Delta ADS client subscribed to addresses as a ztunnel: records
/// exactly what the server sends, ACKs each response.
pub struct Observer {
    tx: mpsc::Sender<DeltaDiscoveryRequest>,
    rx: tonic::Streaming<DeltaDiscoveryResponse>,
    /// Resource names currently held.
    pub held: BTreeSet<String>,
}

impl Observer {
    pub async fn connect(addr: SocketAddr, type_url: &str) -> Result<Self> {
        Self::connect_with_token(addr, type_url, NODE_TOKEN).await
    }

    /// [`Self::connect`] presenting `token`.
    pub async fn connect_with_token(addr: SocketAddr, type_url: &str, token: &str) -> Result<Self> {
        const LIMIT: Duration = Duration::from_secs(10);
        let mut client = tokio::time::timeout(
            LIMIT,
            AggregatedDiscoveryServiceClient::connect(format!("http://{addr}")),
        )
        .await
        .map_err(|_| anyhow!("connecting to xDS at {addr}: no answer within {LIMIT:?}"))??
        .max_decoding_message_size(64 << 20);
        let (tx, rx) = mpsc::channel(8);
        tx.send(DeltaDiscoveryRequest {
            node: Some(Node {
                id: "ztunnel~0.0.0.0~observer.test~test.svc.cluster.local".into(),
                ..Default::default()
            }),
            type_url: type_url.into(),
            ..Default::default()
        })
        .await?;
        let mut req = tonic::Request::new(ReceiverStream::new(rx));
        req.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse()?);
        let rx = tokio::time::timeout(LIMIT, client.delta_aggregated_resources(req))
            .await
            .map_err(|_| anyhow!("opening the xDS stream: no answer within {LIMIT:?}"))??
            .into_inner();
        Ok(Self {
            tx,
            rx,
            held: BTreeSet::new(),
        })
    }

    /// Receives one response (within `limit`), ACKs it and applies it to
    /// [`Self::held`]; returns (names sent, names removed). A resource sent
    /// twice in one response is an error.
    pub async fn next(&mut self, limit: Duration) -> Result<(Vec<String>, Vec<String>)> {
        let resp = tokio::time::timeout(limit, self.rx.next())
            .await
            .map_err(|_| anyhow!("no xDS response within {limit:?}"))?
            .context("xDS stream ended")??;
        self.tx
            .send(DeltaDiscoveryRequest {
                type_url: resp.type_url.clone(),
                response_nonce: resp.nonce.clone(),
                ..Default::default()
            })
            .await?;
        let names: Vec<String> = resp.resources.iter().map(|r| r.name.clone()).collect();
        let unique: BTreeSet<&String> = names.iter().collect();
        if unique.len() != names.len() {
            bail!("one response carried a resource twice: {names:?}");
        }
        for n in &names {
            self.held.insert(n.clone());
        }
        for n in &resp.removed_resources {
            self.held.remove(n);
        }
        Ok((names, resp.removed_resources.clone()))
    }

    /// Reads responses until `done(held)` holds; fails after `limit`.
    pub async fn until(
        &mut self,
        limit: Duration,
        what: &str,
        done: impl Fn(&BTreeSet<String>) -> bool,
    ) -> Result<Duration> {
        let start = Instant::now();
        while !done(&self.held) {
            let left = limit.checked_sub(start.elapsed()).ok_or_else(|| {
                anyhow!("{what}: not reached within {limit:?}; held {:?}", self.held)
            })?;
            self.next(left)
                .await
                .with_context(|| format!("{what}; held {:?}", self.held))?;
        }
        Ok(start.elapsed())
    }
}

/// The workload name of a pod in the Address resources.
pub fn pod_uid(ns: &str, name: &str) -> String {
    format!("Kubernetes//Pod/{ns}/{name}")
}
