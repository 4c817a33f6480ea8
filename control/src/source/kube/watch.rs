//! One watch per kind: kube's `watcher` (list, then watch from the list's
//! resourceVersion with bookmarks; a `410 Gone` or an expired watch starts
//! a fresh list; a dropped connection resumes from the last version seen)
//! turned into the model's [`SourceUpdate`]s.
//!
//! Objects are decoded with `ambit_config::decode_json_value` into the
//! same typed objects the file source produces. Nothing but the keys is
//! kept here: the model's store is the cache. A relist (after `410 Gone`,
//! or the periodic one) upserts every listed object (the model drops
//! unchanged ones) and, at its end, deletes what the list no longer holds.

use std::collections::HashSet;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use ambit_config::{Change, ConfigError, Kind, Object, decode_json_value};
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt, TryStreamExt};
use kube::api::{Api, DynamicObject, ObjectMeta, PartialObjectMeta};
use kube::runtime::WatchStreamExt;
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, Event};
use kube::{Client, discovery::ApiResource};
use serde_json::{Map, Value};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::discovery::Discovered;
use super::kinds::WatchSpec;
use super::{KUBE_SOURCE, KubeSourceOptions, Shared};
use crate::model::{ModelHandle, SourceUpdate};

/// Objects per update while a list is read (one API page).
const BATCH: usize = 500;
/// The failure class of a watch that got no answer from the API server.
const UNREACHABLE: &str = "unreachable";

/// `(namespace, name)`; the namespace is empty for cluster-scoped kinds.
type Key = (String, String);

/// One object as the watch delivered it, ready to decode.
#[derive(Debug)]
pub(super) struct Raw {
    key: Key,
    value: Value,
}

fn key_of(meta: &ObjectMeta) -> Key {
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// The object as `ambit-config` decodes it: list items may lack
/// `apiVersion`/`kind`, so both are set from the watched resource.
fn object_value(obj: DynamicObject, ar: &ApiResource) -> Raw {
    let key = key_of(&obj.metadata);
    let mut map = match obj.data {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    put_head(&mut map, ar, &obj.metadata);
    Raw {
        key,
        value: Value::Object(map),
    }
}

fn meta_value(obj: PartialObjectMeta<DynamicObject>, ar: &ApiResource) -> Raw {
    let key = key_of(&obj.metadata);
    let mut map = Map::new();
    put_head(&mut map, ar, &obj.metadata);
    Raw {
        key,
        value: Value::Object(map),
    }
}

fn put_head(map: &mut Map<String, Value>, ar: &ApiResource, meta: &ObjectMeta) {
    map.insert("apiVersion".into(), Value::String(ar.api_version.clone()));
    map.insert("kind".into(), Value::String(ar.kind.clone()));
    // Serializing ObjectMeta cannot fail (string maps and plain fields);
    // an empty mapping would make decoding name the missing field.
    let meta = serde_json::to_value(meta).unwrap_or_else(|_| Value::Object(Map::new()));
    map.insert("metadata".into(), meta);
}

fn map_event<K, V>(ev: Event<K>, f: impl Fn(K) -> V) -> Event<V> {
    match ev {
        Event::Apply(o) => Event::Apply(f(o)),
        Event::Delete(o) => Event::Delete(f(o)),
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(f(o)),
        Event::InitDone => Event::InitDone,
    }
}

/// Exponential backoff with jitter between watch retries, reset by any
/// event.
#[derive(Debug, Clone)]
pub(super) struct RetryBackoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl RetryBackoff {
    pub(super) fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max: max.max(initial),
            next: initial,
        }
    }
}

impl Iterator for RetryBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        // Between half and all of the step, so watchers of many kinds (and
        // replicas) spread out and the cap is never exceeded.
        Some(base.mul_f64(0.5 + rand::random::<f64>() * 0.5))
    }
}

impl Backoff for RetryBackoff {
    fn reset(&mut self) {
        self.next = self.initial;
    }
}

type WatchStream = BoxStream<'static, Result<Event<Raw>, watcher::Error>>;

fn watch_stream(
    client: Client,
    spec: &WatchSpec,
    ar: &ApiResource,
    opts: &KubeSourceOptions,
) -> WatchStream {
    let mut cfg = watcher::Config::default().page_size(BATCH as u32);
    if let Some(t) = opts.watch_timeout_secs {
        cfg = cfg.timeout(t);
    }
    if let Some(fields) = spec.field_selector {
        cfg = cfg.fields(fields);
    }
    let backoff = RetryBackoff::new(opts.retry_initial, opts.retry_max);
    let api_resource = ar.clone();
    let ar = ar.clone();
    if spec.metadata_only {
        // `Api<PartialObjectMeta<_>>` makes metadata-only requests.
        let api: Api<PartialObjectMeta<DynamicObject>> = Api::all_with(client, &api_resource);
        watcher::watcher(api, cfg)
            .map_ok(move |ev| map_event(ev, |o| meta_value(o, &ar)))
            .backoff(backoff)
            .boxed()
    } else {
        let api: Api<DynamicObject> = Api::all_with(client, &api_resource);
        watcher::watcher(api, cfg)
            .map_ok(move |ev| map_event(ev, |o| object_value(o, &ar)))
            .backoff(backoff)
            .boxed()
    }
}

/// Why a watch of one resource ended.
enum WatchEnd {
    /// The model is gone: stop for good.
    ModelGone,
    /// Discovery changed what this kind is served as.
    Rediscovered,
    /// Time to list again (periodic relist, or the API server is back
    /// while this watch was failing).
    Restart,
}

/// The state of one kind's watch.
pub(super) struct KindWatch {
    spec: WatchSpec,
    model: ModelHandle,
    shared: Arc<Shared>,
    /// Objects whose last good version the model holds.
    known: HashSet<Key>,
    /// Objects with an error in the model's config errors.
    rejected: HashSet<Key>,
    /// While a list is read: the keys it returned so far.
    listing: Option<HashSet<Key>>,
    changes: Vec<Change>,
    errors: Vec<(String, Vec<ConfigError>)>,
    /// The first list just completed (or the kind is absent): report it
    /// after the flush.
    just_synced: bool,
    synced_once: bool,
    /// What the kind is watched as (`None`: absent, or not known yet).
    watched_as: Option<ApiResource>,
    /// Since when, and with what kind of error, the watch fails.
    failing: Option<(Instant, String)>,
}

impl KindWatch {
    pub(super) fn new(spec: WatchSpec, model: ModelHandle, shared: Arc<Shared>) -> Self {
        Self {
            spec,
            model,
            shared,
            known: HashSet::new(),
            rejected: HashSet::new(),
            listing: None,
            changes: Vec::new(),
            errors: Vec::new(),
            just_synced: false,
            synced_once: false,
            watched_as: None,
            failing: None,
        }
    }

    fn kind(&self) -> Kind {
        self.spec.kind
    }

    /// Watches until the model goes away: at the version discovery says
    /// the API server serves, or not at all while it serves none.
    pub(super) async fn run(
        mut self,
        client: Client,
        opts: KubeSourceOptions,
        mut discovered: watch::Receiver<Discovered>,
    ) {
        loop {
            let served = {
                let kind = self.kind();
                let Ok(d) = discovered
                    .wait_for(|d| d.served.as_ref().is_some_and(|s| s.knows(kind)))
                    .await
                else {
                    return;
                };
                d.served.as_ref().and_then(|s| s.get(kind)).cloned()
            };
            let end = match served {
                Some(ar) => {
                    self.watched_as = Some(ar.clone());
                    self.watch(&client, &opts, &ar, &mut discovered).await
                }
                None => {
                    self.absent();
                    if !self.flush().await {
                        return;
                    }
                    let kind = self.kind();
                    // Wait until discovery finds it.
                    let found = discovered
                        .wait_for(|d| d.served.as_ref().is_some_and(|s| s.get(kind).is_some()))
                        .await;
                    if found.is_err() {
                        return;
                    }
                    WatchEnd::Rediscovered
                }
            };
            match end {
                WatchEnd::ModelGone => {
                    debug!(kind = %self.kind(), "model stopped; watch ends");
                    return;
                }
                WatchEnd::Rediscovered | WatchEnd::Restart => {}
            }
        }
    }

    /// One watch of `ar` until discovery moves the kind, a relist is due,
    /// or the model goes.
    async fn watch(
        &mut self,
        client: &Client,
        opts: &KubeSourceOptions,
        ar: &ApiResource,
        discovered: &mut watch::Receiver<Discovered>,
    ) -> WatchEnd {
        let mut stream = pin!(watch_stream(client.clone(), &self.spec, ar, opts));
        let relist_at = opts.relist_every.map(|d| {
            let jitter = d.as_secs_f64() * rand::random::<f64>() * 0.1;
            Instant::now() + d + Duration::from_secs_f64(jitter)
        });
        let epoch = discovered.borrow().reachable_epoch;
        loop {
            let item = tokio::select! {
                item = stream.next() => item,
                () = sleep_until(relist_at) => {
                    debug!(kind = %self.kind(), "periodic relist");
                    return WatchEnd::Restart;
                }
                changed = discovered.changed() => {
                    if changed.is_err() {
                        return WatchEnd::ModelGone;
                    }
                    let d = discovered.borrow_and_update().clone();
                    let now = d.served.as_ref().and_then(|s| s.get(self.kind()));
                    if now != Some(ar) {
                        return WatchEnd::Rediscovered;
                    }
                    if d.reachable_epoch != epoch && self.failing.is_some() {
                        // The API server answers again: retry now rather
                        // than at the end of this watch's backoff.
                        return WatchEnd::Restart;
                    }
                    continue;
                }
            };
            let Some(item) = item else {
                return WatchEnd::Restart;
            };
            self.handle(item);
            // Take what is already there, up to a batch, in one update.
            while self.changes.len() + self.errors.len() < BATCH {
                match stream.next().now_or_never() {
                    Some(Some(item)) => self.handle(item),
                    _ => break,
                }
            }
            if !self.flush().await {
                return WatchEnd::ModelGone;
            }
        }
    }

    fn handle(&mut self, item: Result<Event<Raw>, watcher::Error>) {
        let event = match item {
            Ok(ev) => ev,
            Err(e) => return self.on_error(e),
        };
        if let Some((since, class)) = self.failing.take() {
            if class == UNREACHABLE {
                debug!(kind = %self.kind(), after = ?since.elapsed(), "Kubernetes watch recovered");
            } else {
                info!(kind = %self.kind(), after = ?since.elapsed(), "Kubernetes watch recovered");
            }
        }
        match event {
            Event::Init => self.listing = Some(HashSet::new()),
            Event::InitApply(raw) => {
                if let Some(seen) = &mut self.listing {
                    seen.insert(raw.key.clone());
                }
                self.apply(raw);
            }
            Event::InitDone => self.list_done(),
            Event::Apply(raw) => self.apply(raw),
            Event::Delete(raw) => self.delete(raw.key),
        }
    }

    fn scope(&self, key: &Key) -> String {
        format!("{KUBE_SOURCE}:{}/{}/{}", self.kind(), key.0, key.1)
    }

    fn apply(&mut self, raw: Raw) {
        let Raw { key, value } = raw;
        match decode_json_value(&value) {
            Ok(Some(obj)) => {
                if let Object::Pod(p) = &obj {
                    self.shared.pods.upsert(p);
                }
                self.changes.push(Change::Upsert(obj));
                if self.rejected.remove(&key) {
                    self.errors.push((self.scope(&key), Vec::new()));
                }
                self.known.insert(key);
            }
            Ok(None) => {
                debug!(kind = %self.kind(), namespace = %key.0, name = %key.1, "the decoder ignores this object");
            }
            Err(f) => {
                let kept = if self.known.contains(&key) {
                    "its last accepted version keeps serving"
                } else {
                    "it is not served"
                };
                warn!(kind = %self.kind(), namespace = %key.0, name = %key.1, error = %f.error, "rejected a Kubernetes object; {kept}");
                let err = ConfigError {
                    file: String::new(),
                    document: 0,
                    line: 0,
                    kind: self.kind().as_str().to_string(),
                    namespace: key.0.clone(),
                    name: key.1.clone(),
                    reason: format!("{}; {kept}", f.error),
                };
                self.errors.push((self.scope(&key), vec![err]));
                self.rejected.insert(key);
            }
        }
    }

    fn delete(&mut self, key: Key) {
        if self.kind() == Kind::Pod {
            self.shared.pods.remove(&key.0, &key.1);
        }
        if self.rejected.remove(&key) {
            self.errors.push((self.scope(&key), Vec::new()));
        }
        if self.known.remove(&key) {
            let (namespace, name) = key;
            self.changes
                .push(Change::Delete(ambit_config::ObjectKey::new(
                    self.kind(),
                    namespace,
                    name,
                )));
        }
    }

    /// A list ended: whatever it did not return is gone.
    fn list_done(&mut self) {
        let Some(seen) = self.listing.take() else {
            return;
        };
        let gone: Vec<Key> = self
            .known
            .iter()
            .chain(self.rejected.iter())
            .filter(|k| !seen.contains(*k))
            .cloned()
            .collect();
        if !gone.is_empty() {
            info!(kind = %self.kind(), deleted = gone.len(), "relist: objects deleted while the watch was away");
        }
        for k in gone {
            self.delete(k);
        }
        let at = self
            .watched_as
            .as_ref()
            .map_or(String::new(), |r| format!(" at {}", r.api_version));
        self.shared.set_state(self.kind(), &format!("synced{at}"));
        if !self.synced_once {
            self.synced_once = true;
            self.just_synced = true;
        }
    }

    /// Discovery says the API server serves none of this kind's versions:
    /// its objects are gone (they went with the CRD) and it counts as
    /// listed, empty.
    fn absent(&mut self) {
        self.listing = None;
        self.watched_as = None;
        self.failing = None;
        let all: Vec<Key> = self.known.iter().chain(&self.rejected).cloned().collect();
        for k in all {
            self.delete(k);
        }
        self.shared.set_state(
            self.kind(),
            "absent (the API server serves none of its versions)",
        );
        if !self.synced_once {
            self.synced_once = true;
            self.just_synced = true;
        }
    }

    fn on_error(&mut self, e: watcher::Error) {
        let status = match &e {
            watcher::Error::InitialListFailed(kube::Error::Api(s))
            | watcher::Error::WatchStartFailed(kube::Error::Api(s))
            | watcher::Error::WatchFailed(kube::Error::Api(s)) => Some(s.as_ref()),
            watcher::Error::WatchError(s) => Some(s.as_ref()),
            _ => None,
        };
        // A plain-text `404 page not found` (no Status body) is a 404 too.
        let code = status.map(|s| {
            if s.code != 0 {
                s.code
            } else if s.reason == "NotFound" {
                404
            } else if s.reason == "Forbidden" {
                403
            } else {
                0
            }
        });
        if code == Some(410) {
            // kube's watcher lists again by itself.
            info!(kind = %self.kind(), "watch expired (410 Gone); listing again");
            return;
        }
        let class = match code {
            Some(404) => {
                // The resource went away under the watch (CRD deleted or
                // a version no longer served): discovery decides now.
                self.shared.rediscover.notify_one();
                "not found".to_string()
            }
            Some(c) if c != 0 => format!("HTTP {c}"),
            _ => UNREACHABLE.to_string(),
        };
        let hint = match code {
            Some(403) => format!(
                "the control plane's ServiceAccount needs `list` and `watch` on {} (ClusterRole ambit-control in deploy/kubernetes)",
                self.spec.qualified_plural()
            ),
            Some(404) => {
                "the resource is gone; asking discovery which version is served".to_string()
            }
            _ => "retrying with backoff; check that the API server is reachable".to_string(),
        };
        // One line per change of state, not one per attempt; an unreachable
        // API server is discovery's to report (one WARN for every kind).
        match &self.failing {
            Some((_, last)) if *last == class => {
                debug!(kind = %self.kind(), error = %e, "Kubernetes watch failed again");
            }
            _ if class == UNREACHABLE => {
                debug!(kind = %self.kind(), error = %e, "Kubernetes watch failed: {hint}");
            }
            _ => warn!(kind = %self.kind(), error = %e, "Kubernetes watch failed: {hint}"),
        }
        let since = self.failing.take().map_or_else(Instant::now, |(s, _)| s);
        self.failing = Some((since, class));
        if !self.synced_once {
            self.shared
                .set_state(self.kind(), &format!("not listed yet: {e}"));
        }
    }

    /// Sends what was collected; false when the model is gone.
    async fn flush(&mut self) -> bool {
        if !self.changes.is_empty() || !self.errors.is_empty() {
            let update = SourceUpdate {
                source: KUBE_SOURCE.to_string(),
                changes: std::mem::take(&mut self.changes),
                errors: std::mem::take(&mut self.errors),
                initial_sync_done: false,
            };
            if self.model.send(update).await.is_err() {
                return false;
            }
        }
        if std::mem::take(&mut self.just_synced) {
            return self.shared.report_synced(self.kind(), &self.model).await;
        }
        true
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_cap_and_resets() {
        let mut b = RetryBackoff::new(Duration::from_millis(100), Duration::from_millis(400));
        let d: Vec<Duration> = (0..5).filter_map(|_| b.next()).collect();
        assert!(d[0] <= Duration::from_millis(100) && d[0] >= Duration::from_millis(50));
        assert!(d[4] <= Duration::from_millis(400) && d[4] >= Duration::from_millis(200));
        assert!(
            d.iter().all(|x| *x <= Duration::from_millis(400)),
            "the cap holds"
        );
        b.reset();
        assert!(b.next().is_some_and(|d| d <= Duration::from_millis(100)));
    }

    #[test]
    fn list_items_get_their_kind_from_the_watched_resource() {
        let spec = WatchSpec::of(Kind::Service);
        let obj: DynamicObject = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "shop", "resourceVersion": "7"},
            "spec": {"clusterIP": "10.0.0.1", "ports": [{"port": 80}]}
        }))
        .map_err(|e| e.to_string())
        .unwrap_or_else(|e| panic!("{e}"));
        let raw = object_value(obj, &spec.preferred());
        assert_eq!(raw.key, ("shop".to_string(), "web".to_string()));
        let decoded = decode_json_value(&raw.value);
        assert!(
            matches!(decoded, Ok(Some(Object::Service(_)))),
            "{decoded:?}"
        );
    }
}
