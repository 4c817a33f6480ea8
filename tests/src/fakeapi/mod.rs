//! An in-process fake Kubernetes API server speaking the real HTTP/JSON
//! protocol, so kube's own client and watcher run unchanged against it.
//!
//! - list with `labelSelector`, `fieldSelector`, `limit`/`continue`, and
//!   metadata-only lists (`Accept: ...;as=PartialObjectMetadataList`);
//! - watch from a resourceVersion, replaying the history after it;
//!   `allowWatchBookmarks` (BOOKMARK events on [`FakeApiServer::send_bookmarks`]
//!   and every [`BOOKMARK_EVERY`]); `410 Gone` (as the API server sends
//!   it: an `ERROR` event) for a resourceVersion older than the history
//!   ([`FakeApiServer::compact`]); `timeoutSeconds`; dropped connections
//!   ([`FakeApiServer::drop_watches`]); selectors applied to every event
//!   (an object leaving a selector is `DELETED` for that watch);
//! - get, create (`409 AlreadyExists`), update (`409 Conflict` on a stale
//!   resourceVersion), merge and apply patches, delete, the `status`
//!   subresource, and TokenReview answered from a table
//!   ([`FakeApiServer::set_token_review`]);
//! - every request recorded as (identity, verb, group, resource,
//!   subresource) for RBAC tests ([`FakeApiServer::calls`]); the identity
//!   is the name given to the caller's bearer token
//!   ([`FakeApiServer::set_identity`]).
//!
//! Served over plain HTTP on 127.0.0.1; no authorization is enforced.

mod routes;
mod select;
mod store;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

pub use select::Selector;
use store::State;
pub use store::{ApiCall, ResourceDef, TokenReviewAnswer, rfc3339_now};

/// Bookmarks are sent to every watch that asked for them this often.
pub const BOOKMARK_EVERY: Duration = Duration::from_secs(1);

/// The resources the fake serves from the start: what Ambit's control
/// plane, node agent and installer use.
pub fn standard_resources() -> Vec<ResourceDef> {
    let r = ResourceDef::new;
    let mut v = vec![
        r("v1", "Namespace", "namespaces", false),
        r("v1", "Pod", "pods", true),
        r("v1", "Service", "services", true),
        r("v1", "Node", "nodes", false),
        r("v1", "Secret", "secrets", true),
        r("v1", "ServiceAccount", "serviceaccounts", true),
        r("v1", "ConfigMap", "configmaps", true),
        r(
            "discovery.k8s.io/v1",
            "EndpointSlice",
            "endpointslices",
            true,
        ),
        r("coordination.k8s.io/v1", "Lease", "leases", true),
        r(
            "authentication.k8s.io/v1",
            "TokenReview",
            "tokenreviews",
            false,
        ),
        r(
            "admissionregistration.k8s.io/v1",
            "MutatingWebhookConfiguration",
            "mutatingwebhookconfigurations",
            false,
        ),
        r("apps/v1", "Deployment", "deployments", true),
        r("apps/v1", "DaemonSet", "daemonsets", true),
        r(
            "policy/v1",
            "PodDisruptionBudget",
            "poddisruptionbudgets",
            true,
        ),
        r(
            "rbac.authorization.k8s.io/v1",
            "ClusterRole",
            "clusterroles",
            false,
        ),
        r(
            "rbac.authorization.k8s.io/v1",
            "ClusterRoleBinding",
            "clusterrolebindings",
            false,
        ),
        r("rbac.authorization.k8s.io/v1", "Role", "roles", true),
        r(
            "rbac.authorization.k8s.io/v1",
            "RoleBinding",
            "rolebindings",
            true,
        ),
        r(
            "apiextensions.k8s.io/v1",
            "CustomResourceDefinition",
            "customresourcedefinitions",
            false,
        ),
    ];
    v.extend(istio_resources());
    v.extend(gateway_api_resources());
    v
}

/// The Istio kinds Ambit serves (their CRDs).
pub fn istio_resources() -> Vec<ResourceDef> {
    let r = ResourceDef::new;
    vec![
        r(
            "networking.istio.io/v1",
            "ServiceEntry",
            "serviceentries",
            true,
        ),
        r(
            "networking.istio.io/v1",
            "WorkloadEntry",
            "workloadentries",
            true,
        ),
        r(
            "networking.istio.io/v1",
            "VirtualService",
            "virtualservices",
            true,
        ),
        r(
            "networking.istio.io/v1",
            "DestinationRule",
            "destinationrules",
            true,
        ),
        r("networking.istio.io/v1", "Sidecar", "sidecars", true),
        r("telemetry.istio.io/v1", "Telemetry", "telemetries", true),
        r(
            "security.istio.io/v1",
            "PeerAuthentication",
            "peerauthentications",
            true,
        ),
        r(
            "security.istio.io/v1",
            "AuthorizationPolicy",
            "authorizationpolicies",
            true,
        ),
    ]
}

/// The Gateway API kinds Ambit reads (their CRDs).
pub fn gateway_api_resources() -> Vec<ResourceDef> {
    let r = ResourceDef::new;
    vec![
        r("gateway.networking.k8s.io/v1", "Gateway", "gateways", true),
        r(
            "gateway.networking.k8s.io/v1",
            "HTTPRoute",
            "httproutes",
            true,
        ),
        r(
            "gateway.networking.k8s.io/v1",
            "GRPCRoute",
            "grpcroutes",
            true,
        ),
        r(
            "gateway.networking.k8s.io/v1alpha2",
            "TCPRoute",
            "tcproutes",
            true,
        ),
    ]
}

/// A running fake API server. Dropping it stops serving.
pub struct FakeApiServer {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for FakeApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeApiServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl FakeApiServer {
    /// Serves [`standard_resources`] on 127.0.0.1 (a free port).
    pub async fn start() -> Result<Self> {
        Self::start_with(standard_resources()).await
    }

    /// Serves exactly `resources`.
    pub async fn start_with(resources: Vec<ResourceDef>) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the fake API server")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        {
            let mut s = lock(&state);
            for r in resources {
                s.register(r);
            }
        }
        let serve = tokio::spawn(routes::serve(listener, state.clone()));
        let st = state.clone();
        let bookmarks = tokio::spawn(async move {
            let mut tick = tokio::time::interval(BOOKMARK_EVERY);
            loop {
                tick.tick().await;
                lock(&st).bookmarks();
            }
        });
        Ok(Self {
            addr,
            state,
            tasks: vec![serve, bookmarks],
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig for this server whose user sends `token`, and
    /// names `token`'s caller `identity` in [`Self::calls`].
    pub fn kubeconfig(&self, dir: &Path, identity: &str, token: &str) -> Result<PathBuf> {
        self.set_identity(token, identity);
        let file: String = identity
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let path = dir.join(format!("kubeconfig-{file}"));
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: {identity}\n  user:\n    token: {token}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: {identity}\n    namespace: default\n\
             current-context: fake\n",
            self.url()
        );
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }

    /// A kube client for this server whose requests carry `token`.
    pub fn client(&self, identity: &str, token: &str) -> Result<kube::Client> {
        self.set_identity(token, identity);
        let mut cfg = kube::Config::new(self.url().parse().context("fake server URL")?);
        cfg.auth_info.token = Some(token.to_string().into());
        kube::Client::try_from(cfg).context("building a kube client")
    }

    /// Names the caller presenting bearer `token` in [`Self::calls`].
    pub fn set_identity(&self, token: &str, identity: &str) {
        self.state()
            .identities
            .insert(token.to_string(), identity.to_string());
    }

    /// What a TokenReview of `token` answers (unknown tokens are not
    /// authenticated).
    pub fn set_token_review(&self, token: &str, answer: TokenReviewAnswer) {
        self.state().reviews.insert(token.to_string(), answer);
    }

    /// Serves a new resource (a CRD was installed).
    pub fn register(&self, def: ResourceDef) {
        self.state().register(def);
    }

    /// Stops serving a resource (its CRD was deleted): lists answer 404.
    pub fn unregister(&self, api_version: &str, kind: &str) {
        let mut s = self.state();
        if let Some(key) = s.find_kind(api_version, kind) {
            s.unregister(&key);
        }
    }

    /// Creates or replaces an object (by its apiVersion, kind, namespace
    /// and name); returns it as stored.
    pub fn apply(&self, obj: Value) -> Result<Value> {
        let (api_version, kind) = (
            obj["apiVersion"].as_str().unwrap_or("").to_string(),
            obj["kind"].as_str().unwrap_or("").to_string(),
        );
        let mut s = self.state();
        let res = s
            .find_kind(&api_version, &kind)
            .ok_or_else(|| anyhow!("the fake serves no {api_version} {kind}"))?;
        s.put(&res, obj)
            .map_err(|(code, _, msg)| anyhow!("{code}: {msg}"))
    }

    /// Deletes an object.
    pub fn delete(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> Result<()> {
        let mut s = self.state();
        let res = s
            .find_kind(api_version, kind)
            .ok_or_else(|| anyhow!("the fake serves no {api_version} {kind}"))?;
        s.remove(&res, namespace, name)
            .map(|_| ())
            .map_err(|(code, _, msg)| anyhow!("{code}: {msg}"))
    }

    /// The stored object, if any.
    pub fn get(&self, api_version: &str, kind: &str, namespace: &str, name: &str) -> Option<Value> {
        let s = self.state();
        let res = s.find_kind(api_version, kind)?;
        s.get(&res, namespace, name).cloned()
    }

    /// Every stored object of a kind.
    pub fn list(&self, api_version: &str, kind: &str) -> Vec<Value> {
        let s = self.state();
        s.find_kind(api_version, kind)
            .and_then(|k| s.resources.get(&k))
            .map(|r| r.objects.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Sets `metadata.deletionTimestamp` (the object is being deleted, e.g.
    /// with foreground propagation).
    pub fn mark_deleting(
        &self,
        api_version: &str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Result<()> {
        let mut obj = self
            .get(api_version, kind, namespace, name)
            .ok_or_else(|| anyhow!("no {kind} {namespace}/{name}"))?;
        obj["metadata"]["deletionTimestamp"] = Value::String(rfc3339_now());
        self.apply(obj).map(|_| ())
    }

    /// The current (latest) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.state().rv
    }

    /// Forgets the event history: every watch resuming from an earlier
    /// resourceVersion gets `410 Gone` and lists again.
    pub fn compact(&self) {
        self.state().compact();
    }

    /// Closes every open watch connection (the clients resume them).
    pub fn drop_watches(&self) {
        self.state().watches.clear();
    }

    /// Open watches per resource plural.
    pub fn watch_count(&self, plural: &str) -> usize {
        self.state()
            .watches
            .iter()
            .filter(|w| w.res.ends_with(&format!("/{plural}")))
            .count()
    }

    /// Sends a BOOKMARK with the current resourceVersion to every watch
    /// that allows them.
    pub fn send_bookmarks(&self) {
        self.state().bookmarks();
    }

    /// Answers every request with `code` (e.g. 503) until set to `None`.
    pub fn set_failing(&self, code: Option<u16>) {
        self.state().failing = code;
    }

    /// Every request so far.
    pub fn calls(&self) -> Vec<ApiCall> {
        self.state().calls.clone()
    }

    /// (verb, group, resource, subresource) of `identity`'s requests.
    pub fn verbs_of(&self, identity: &str) -> BTreeSet<(String, String, String, String)> {
        self.state()
            .calls
            .iter()
            .filter(|c| c.identity == identity)
            .map(|c| {
                (
                    c.verb.clone(),
                    c.group.clone(),
                    c.resource.clone(),
                    c.subresource.clone(),
                )
            })
            .collect()
    }

    pub fn clear_calls(&self) {
        self.state().calls.clear();
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panicking request handler (a test bug) must not wedge the server.
    state.lock().unwrap_or_else(|p| p.into_inner())
}
