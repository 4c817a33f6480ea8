//! Which version of each watched kind the API server serves.
//!
//! A cluster may have Istio's CRDs or not, the Gateway API's standard
//! channel (TCPRoute at `v1` since v1.5, absent before), its experimental
//! channel (`v1alpha2`), an old one, or none. For every kind, the first of
//! the versions the decoder understands ([`WatchSpec::versions`]) that the
//! API server lists is the one watched; a kind none of whose versions is
//! listed is **absent**: not watched, empty, not waited for.
//!
//! - One request tells it all: aggregated discovery (`GET /apis` as an
//!   `APIGroupDiscoveryList`, Kubernetes 1.30+), polled with
//!   `If-None-Match`, so an unchanged answer is a bodiless `304`. An API
//!   server without it is asked group by group (`/apis/<group>/<version>`).
//! - The core group (`/api/v1`) is always served.
//! - [`DiscoveryLoop`] polls every [`DiscoveryOptions::poll`] (a CRD
//!   installed later is watched within that) and at once when a watch
//!   asks (its resource answered `404`); it publishes each new answer on a
//!   `watch` channel, and bumps [`Discovered::reachable_epoch`] when the
//!   API server answers again after failing, so failing watches retry at
//!   once instead of waiting out their backoff.
//! - A kind that was served and vanishes from an answer is not dropped on
//!   that word alone: an API server that has just restarted lists its
//!   CRD-backed groups a moment after it answers. Its CRD is read: still
//!   there (and not being deleted), the kind stays as it was and discovery
//!   asks again every `retry`; gone, the kind is absent (its objects went
//!   with it). When the CRD cannot be read, the kind stays for
//!   [`VANISH_GRACE`]. Core kinds never vanish.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ambit_config::Kind;
use http_body_util::{BodyExt, Limited};
use hyper::http;
use kube::Client;
use kube::discovery::ApiResource;
use serde::Deserialize;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::kinds::WatchSpec;

/// Deadline of one discovery request.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a kind that vanished from discovery while its CRD cannot be
/// read is kept as it was.
const VANISH_GRACE: Duration = Duration::from_secs(60);
/// Largest discovery document read (a cluster with hundreds of CRDs
/// answers ~1 MB).
const MAX_BODY: usize = 16 << 20;
const AGGREGATED_ACCEPT: &str = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json;g=apidiscovery.k8s.io;v=v2beta1;as=APIGroupDiscoveryList";

/// Why discovery failed.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("API discovery ({what}) failed: {source}; check that the API server is reachable")]
    Request {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "API discovery ({what}) did not answer within {limit:?}; the API server is slow or unreachable"
    )]
    Timeout { what: String, limit: Duration },
    #[error("API discovery ({what}) answered HTTP {code}: {body}")]
    Status {
        what: String,
        code: u16,
        body: String,
    },
    #[error("API discovery ({what}) answered something that is not a discovery document: {reason}")]
    Malformed { what: String, reason: String },
}

/// The resource each kind is served as; `None`: absent.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServedKinds {
    by_kind: BTreeMap<Kind, Option<ApiResource>>,
}

impl ServedKinds {
    /// The resource `kind` is served as, `None` when it is absent or was
    /// not asked about.
    pub fn get(&self, kind: Kind) -> Option<&ApiResource> {
        self.by_kind.get(&kind).and_then(Option::as_ref)
    }

    /// Whether discovery answered for `kind` (served or absent).
    pub fn knows(&self, kind: Kind) -> bool {
        self.by_kind.contains_key(&kind)
    }

    /// Records `kind` as served as `ar`.
    fn set(&mut self, kind: Kind, ar: Option<ApiResource>) {
        self.by_kind.insert(kind, ar);
    }

    /// Every kind asked about, with what it is served as.
    pub fn iter(&self) -> impl Iterator<Item = (Kind, Option<&ApiResource>)> {
        self.by_kind.iter().map(|(k, r)| (*k, r.as_ref()))
    }

    /// Picks, for each spec, the first version `served(group, version,
    /// plural)` says is there.
    fn pick(specs: &[WatchSpec], served: impl Fn(&str, &str, &str) -> bool) -> ServedKinds {
        let by_kind = specs
            .iter()
            .map(|s| {
                let version = if s.group.is_empty() {
                    s.versions.first().copied()
                } else {
                    s.versions
                        .iter()
                        .copied()
                        .find(|v| served(s.group, v, s.plural))
                };
                (s.kind, version.map(|v| s.at(v)))
            })
            .collect();
        ServedKinds { by_kind }
    }
}

/// `APIGroupDiscoveryList`, only the fields read.
#[derive(Debug, Deserialize)]
struct GroupDiscoveryList {
    kind: String,
    #[serde(default)]
    items: Vec<GroupDiscovery>,
}

#[derive(Debug, Deserialize)]
struct GroupDiscovery {
    metadata: GroupMeta,
    #[serde(default)]
    versions: Vec<VersionDiscovery>,
}

#[derive(Debug, Deserialize)]
struct GroupMeta {
    #[serde(default)]
    name: String,
}

#[derive(Debug, Deserialize)]
struct VersionDiscovery {
    version: String,
    #[serde(default)]
    resources: Vec<ResourceDiscovery>,
}

#[derive(Debug, Deserialize)]
struct ResourceDiscovery {
    resource: String,
}

/// `APIResourceList` of one group version, only the fields read.
#[derive(Debug, Deserialize)]
struct ResourceList {
    #[serde(default)]
    resources: Vec<ResourceDiscovery>,
}

/// One GET: the status code, the `ETag`, the body (empty on `304`).
async fn get(
    client: &Client,
    path: &str,
    accept: &str,
    etag: Option<&str>,
) -> Result<(u16, Option<String>, Vec<u8>), DiscoveryError> {
    let what = format!("GET {path}");
    let mut req = http::Request::get(path).header(http::header::ACCEPT, accept);
    if let Some(tag) = etag {
        req = req.header(http::header::IF_NONE_MATCH, tag);
    }
    let req = req
        .body(kube::client::Body::empty())
        .map_err(|e| DiscoveryError::Malformed {
            what: what.clone(),
            reason: e.to_string(),
        })?;
    let exchange = async {
        let res = client.send(req).await?;
        let code = res.status().as_u16();
        let tag = res
            .headers()
            .get(http::header::ETAG)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = Limited::new(res.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(kube::Error::Service)?
            .to_bytes()
            .to_vec();
        Ok::<_, kube::Error>((code, tag, body))
    };
    match tokio::time::timeout(CALL_TIMEOUT, exchange).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(source)) => Err(DiscoveryError::Request { what, source }),
        Err(_) => Err(DiscoveryError::Timeout {
            what,
            limit: CALL_TIMEOUT,
        }),
    }
}

fn status_error(what: String, code: u16, body: &[u8]) -> DiscoveryError {
    let text = String::from_utf8_lossy(body);
    DiscoveryError::Status {
        what,
        code,
        body: text.trim().chars().take(200).collect(),
    }
}

/// What one aggregated discovery answered.
enum Aggregated {
    /// The document, parsed, with its `ETag`.
    Fresh(ServedKinds, Option<String>),
    /// `304 Not Modified`: what was known still holds.
    Unchanged,
    /// The API server does not offer aggregated discovery.
    Unsupported,
}

async fn aggregated(
    client: &Client,
    specs: &[WatchSpec],
    etag: Option<&str>,
) -> Result<Aggregated, DiscoveryError> {
    let (code, tag, body) = get(client, "/apis", AGGREGATED_ACCEPT, etag).await?;
    match code {
        304 => return Ok(Aggregated::Unchanged),
        200 => {}
        406 | 415 => return Ok(Aggregated::Unsupported),
        _ => return Err(status_error("GET /apis".into(), code, &body)),
    }
    // An API server without aggregated discovery answers the legacy
    // `APIGroupList` to the same request.
    let Ok(list) = serde_json::from_slice::<GroupDiscoveryList>(&body) else {
        return Ok(Aggregated::Unsupported);
    };
    if list.kind != "APIGroupDiscoveryList" {
        return Ok(Aggregated::Unsupported);
    }
    let served = ServedKinds::pick(specs, |group, version, plural| {
        list.items.iter().any(|g| {
            g.metadata.name == group
                && g.versions.iter().any(|v| {
                    v.version == version && v.resources.iter().any(|r| r.resource == plural)
                })
        })
    });
    Ok(Aggregated::Fresh(served, tag))
}

/// Group by group, for API servers without aggregated discovery: one
/// `APIResourceList` per group version a spec could use.
async fn legacy(client: &Client, specs: &[WatchSpec]) -> Result<ServedKinds, DiscoveryError> {
    let mut lists: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for spec in specs.iter().filter(|s| !s.group.is_empty()) {
        for version in &spec.versions {
            let key = (spec.group.to_string(), version.to_string());
            if lists.contains_key(&key) {
                continue;
            }
            let path = format!("/apis/{}/{version}", spec.group);
            let (code, _, body) = get(client, &path, "application/json", None).await?;
            let resources = match code {
                200 => serde_json::from_slice::<ResourceList>(&body)
                    .map_err(|e| DiscoveryError::Malformed {
                        what: format!("GET {path}"),
                        reason: e.to_string(),
                    })?
                    .resources
                    .into_iter()
                    .map(|r| r.resource)
                    .collect(),
                404 => Vec::new(),
                _ => return Err(status_error(format!("GET {path}"), code, &body)),
            };
            lists.insert(key, resources);
        }
    }
    Ok(ServedKinds::pick(specs, |group, version, plural| {
        lists
            .get(&(group.to_string(), version.to_string()))
            .is_some_and(|r| r.iter().any(|p| p == plural))
    }))
}

/// Whether a kind's CRD exists.
enum CrdState {
    Present,
    /// Not found, or being deleted.
    Gone,
}

async fn crd_state(client: &Client, spec: &WatchSpec) -> Result<CrdState, DiscoveryError> {
    let path = format!(
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{}",
        spec.qualified_plural()
    );
    let (code, _, body) = get(client, &path, "application/json", None).await?;
    match code {
        404 => Ok(CrdState::Gone),
        200 => {
            let deleting = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .is_some_and(|v| !v["metadata"]["deletionTimestamp"].is_null());
            Ok(if deleting {
                CrdState::Gone
            } else {
                CrdState::Present
            })
        }
        _ => Err(status_error(format!("GET {path}"), code, &body)),
    }
}

/// Asks the API server once which version of each kind it serves.
pub async fn discover(client: &Client, specs: &[WatchSpec]) -> Result<ServedKinds, DiscoveryError> {
    match aggregated(client, specs, None).await? {
        Aggregated::Fresh(served, _) => Ok(served),
        Aggregated::Unchanged | Aggregated::Unsupported => legacy(client, specs).await,
    }
}

/// How often discovery runs.
#[derive(Debug, Clone)]
pub struct DiscoveryOptions {
    /// Between two discoveries while the API server answers.
    pub poll: Duration,
    /// Between two attempts while it does not.
    pub retry: Duration,
}

impl Default for DiscoveryOptions {
    fn default() -> Self {
        Self {
            poll: Duration::from_secs(2),
            retry: Duration::from_millis(500),
        }
    }
}

/// What the discovery loop publishes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Discovered {
    /// `None` until discovery first answered.
    pub served: Option<Arc<ServedKinds>>,
    /// Bumped each time the API server answers again after failing.
    pub reachable_epoch: u64,
}

/// Runs discovery again and again; see the module documentation.
pub struct DiscoveryLoop {
    client: Client,
    specs: Vec<WatchSpec>,
    opts: DiscoveryOptions,
    tx: watch::Sender<Discovered>,
    /// Wakes the loop before its next poll.
    pub(super) now: Arc<Notify>,
}

impl DiscoveryLoop {
    pub fn new(
        client: Client,
        specs: Vec<WatchSpec>,
        opts: DiscoveryOptions,
    ) -> (DiscoveryLoop, watch::Receiver<Discovered>) {
        let (tx, rx) = watch::channel(Discovered::default());
        let lp = DiscoveryLoop {
            client,
            specs,
            opts,
            tx,
            now: Arc::new(Notify::new()),
        };
        (lp, rx)
    }

    /// Loops until every receiver is gone.
    pub async fn run(self) {
        let mut etag: Option<String> = None;
        let mut aggregated_ok = true;
        let mut failing: Option<(Instant, String)> = None;
        let mut last_legacy: Option<Instant> = None;
        let mut vanished: BTreeMap<Kind, Instant> = BTreeMap::new();
        loop {
            let answer = if aggregated_ok {
                match aggregated(&self.client, &self.specs, etag.as_deref()).await {
                    Ok(Aggregated::Fresh(served, tag)) => {
                        etag = tag;
                        Ok(Some(served))
                    }
                    Ok(Aggregated::Unchanged) => Ok(None),
                    Ok(Aggregated::Unsupported) => {
                        info!("the API server has no aggregated discovery; asking group by group");
                        aggregated_ok = false;
                        legacy(&self.client, &self.specs).await.map(Some)
                    }
                    Err(e) => Err(e),
                }
            } else if last_legacy.is_some_and(|t| t.elapsed() < self.opts.poll * 5) {
                // Group-by-group costs a request per group version: poll
                // it five times less often.
                Ok(None)
            } else {
                last_legacy = Some(Instant::now());
                legacy(&self.client, &self.specs).await.map(Some)
            };
            let wait = match answer {
                Ok(fresh) => {
                    let recovered = failing.take();
                    if let Some((since, _)) = &recovered {
                        info!(after = ?since.elapsed(), "the API server answers discovery again");
                    }
                    let fresh = match fresh {
                        Some(f) => Some(self.confirm_vanished(f, &mut vanished).await),
                        None => None,
                    };
                    if !self.publish(fresh, recovered.is_some()) {
                        return;
                    }
                    if vanished.is_empty() {
                        self.opts.poll
                    } else {
                        // Ask again in full, soon: the kinds kept as they
                        // were should be listed again in a moment.
                        etag = None;
                        last_legacy = None;
                        self.opts.retry
                    }
                }
                Err(e) => {
                    let text = e.to_string();
                    match &failing {
                        Some((_, last)) if *last == text => {
                            debug!(error = %e, "API discovery failed again")
                        }
                        _ => {
                            warn!(error = %e, "API discovery failed; retrying every {:?}", self.opts.retry)
                        }
                    }
                    let since = failing.map_or_else(Instant::now, |(s, _)| s);
                    failing = Some((since, text));
                    if self.tx.is_closed() {
                        return;
                    }
                    self.opts.retry
                }
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = self.now.notified() => {
                    // A watch saw its resource vanish: ask now, in full.
                    etag = None;
                    last_legacy = None;
                }
                () = self.tx.closed() => return,
            }
        }
    }

    /// Keeps as it was every kind that was served and is missing from
    /// `fresh` while its CRD still exists (see the module documentation);
    /// `vanished` holds since when each such kind has been missing.
    async fn confirm_vanished(
        &self,
        mut fresh: ServedKinds,
        vanished: &mut BTreeMap<Kind, Instant>,
    ) -> ServedKinds {
        let before = self.tx.borrow().served.clone();
        let Some(before) = before else {
            return fresh;
        };
        for spec in &self.specs {
            let (Some(was), None) = (before.get(spec.kind), fresh.get(spec.kind)) else {
                vanished.remove(&spec.kind);
                continue;
            };
            let since = *vanished.entry(spec.kind).or_insert_with(Instant::now);
            let keep = if !spec.optional {
                true
            } else {
                match crd_state(&self.client, spec).await {
                    Ok(CrdState::Present) => true,
                    Ok(CrdState::Gone) => false,
                    Err(e) => {
                        debug!(kind = %spec.kind, error = %e, "cannot read the CRD of a kind that vanished from discovery");
                        since.elapsed() < VANISH_GRACE
                    }
                }
            };
            if keep {
                debug!(kind = %spec.kind, missing_for = ?since.elapsed(), "a served kind is missing from discovery while its CRD is there; keeping it");
                fresh.set(spec.kind, Some(was.clone()));
            } else {
                vanished.remove(&spec.kind);
            }
        }
        fresh
    }

    /// Publishes a new answer (logging what changed) and a new epoch when
    /// the API server came back; false when nobody listens any more.
    fn publish(&self, fresh: Option<ServedKinds>, recovered: bool) -> bool {
        if self.tx.is_closed() {
            return false;
        }
        self.tx.send_if_modified(|d| {
            let mut changed = false;
            if let Some(new) = fresh
                && d.served.as_deref() != Some(&new)
            {
                log_changes(d.served.as_deref(), &new, &self.specs);
                d.served = Some(Arc::new(new));
                changed = true;
            }
            if recovered {
                d.reachable_epoch += 1;
                changed = true;
            }
            changed
        });
        true
    }
}

/// One INFO line per kind whose served version changed.
fn log_changes(old: Option<&ServedKinds>, new: &ServedKinds, specs: &[WatchSpec]) {
    for spec in specs {
        let before = old.and_then(|o| o.get(spec.kind)).map(|r| &r.api_version);
        let after = new.get(spec.kind).map(|r| &r.api_version);
        if before == after && old.is_some_and(|o| o.knows(spec.kind)) {
            continue;
        }
        match after {
            Some(av) => {
                info!(kind = %spec.kind, api_version = %av, "the API server serves this kind; watching it")
            }
            None => info!(
                kind = %spec.kind,
                resource = %spec.qualified_plural(),
                understood = ?spec.versions,
                "the API server serves none of this kind's versions: it is treated as empty (install its CRD to use it; it is picked up within seconds)"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_first_understood_version_that_is_served() {
        let specs = vec![
            WatchSpec::of(Kind::TcpRoute),
            WatchSpec::of(Kind::GrpcRoute),
            WatchSpec::of(Kind::Pod),
        ];
        // Standard channel v1.6.1: TCPRoute at v1 only; no GRPCRoute.
        let served = ServedKinds::pick(&specs, |g, v, p| {
            g == "gateway.networking.k8s.io" && v == "v1" && p == "tcproutes"
        });
        assert_eq!(
            served.get(Kind::TcpRoute).map(|r| r.api_version.as_str()),
            Some("gateway.networking.k8s.io/v1")
        );
        assert!(served.get(Kind::GrpcRoute).is_none() && served.knows(Kind::GrpcRoute));
        assert_eq!(
            served.get(Kind::Pod).map(|r| r.api_version.as_str()),
            Some("v1"),
            "the core group is always served"
        );
        // Experimental channel: only v1alpha2.
        let served = ServedKinds::pick(&specs, |_, v, _| v == "v1alpha2");
        assert_eq!(
            served.get(Kind::TcpRoute).map(|r| r.version.as_str()),
            Some("v1alpha2")
        );
    }
}
