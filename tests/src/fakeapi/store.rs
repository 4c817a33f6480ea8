//! The fake API server's state: resources, objects with resourceVersions,
//! the event history watches resume from, open watches, recorded calls.

use std::collections::{BTreeMap, HashMap, VecDeque};

use bytes::Bytes;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use super::select::Selector;

/// Events kept per resource for watches to resume from; older ones are
/// compacted (a watch from before them gets `410 Gone`).
const HISTORY: usize = 20_000;

/// A resource the server serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceDef {
    pub group: String,
    pub version: String,
    pub plural: String,
    pub kind: String,
    pub namespaced: bool,
}

impl ResourceDef {
    pub fn new(api_version: &str, kind: &str, plural: &str, namespaced: bool) -> Self {
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        Self {
            group: group.into(),
            version: version.into(),
            plural: plural.into(),
            kind: kind.into(),
            namespaced,
        }
    }

    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    pub(super) fn key(&self) -> String {
        res_key(&self.group, &self.version, &self.plural)
    }
}

pub(super) fn res_key(group: &str, version: &str, plural: &str) -> String {
    format!("{group}/{version}/{plural}")
}

/// One API request, as RBAC sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ApiCall {
    /// Who called: the name set for its bearer token, else `anonymous`.
    pub identity: String,
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`.
    pub verb: String,
    pub group: String,
    pub resource: String,
    /// `status` for the status subresource, else empty.
    pub subresource: String,
    pub namespace: String,
    pub name: String,
    /// The `resourceVersion` query parameter (where a list or watch starts).
    pub resource_version: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct HistEvent {
    rv: u64,
    kind: EventType,
    obj: Value,
    prev: Option<Value>,
}

#[derive(Debug)]
pub(super) struct Resource {
    pub(super) def: ResourceDef,
    /// By (namespace, name).
    pub(super) objects: BTreeMap<(String, String), Value>,
    history: VecDeque<HistEvent>,
    /// A watch may resume from any resourceVersion ≥ this.
    oldest: u64,
}

/// An open watch.
pub(super) struct WatchSub {
    pub(super) res: String,
    pub(super) namespace: Option<String>,
    pub(super) labels: Selector,
    pub(super) fields: Selector,
    pub(super) meta_only: bool,
    pub(super) bookmarks: bool,
    pub(super) tx: mpsc::UnboundedSender<Bytes>,
}

impl WatchSub {
    fn matches(&self, obj: &Value) -> bool {
        if let Some(ns) = &self.namespace
            && obj["metadata"]["namespace"].as_str().unwrap_or("") != ns
        {
            return false;
        }
        self.labels.matches_labels(obj) && self.fields.matches_fields(obj)
    }

    /// Sends one event line; false when the watcher is gone.
    pub(super) fn send(&self, kind: &str, obj: &Value) -> bool {
        let obj = if self.meta_only {
            partial_meta(obj)
        } else {
            obj.clone()
        };
        let mut line = json!({"type": kind, "object": obj}).to_string();
        line.push('\n');
        self.tx.send(Bytes::from(line)).is_ok()
    }

    /// Replays or forwards one history event as this watch sees it: an
    /// object that starts or stops matching its selectors is ADDED or
    /// DELETED.
    fn deliver(&self, ev: &HistEvent) -> bool {
        let now = self.matches(&ev.obj);
        let before = ev.prev.as_ref().is_some_and(|p| self.matches(p));
        let kind = match (ev.kind, before, now) {
            (EventType::Deleted, _, true) => EventType::Deleted,
            (EventType::Deleted, _, false) => return true,
            (_, false, true) => EventType::Added,
            (_, true, true) => EventType::Modified,
            (_, true, false) => EventType::Deleted,
            (_, false, false) => return true,
        };
        self.send(kind.as_str(), &ev.obj)
    }
}

/// An object reduced to what a metadata-only request gets.
pub(super) fn partial_meta(obj: &Value) -> Value {
    json!({
        "apiVersion": "meta.k8s.io/v1",
        "kind": "PartialObjectMetadata",
        "metadata": obj["metadata"].clone(),
    })
}

/// What the fake answers to a TokenReview of one token.
#[derive(Debug, Clone, Default)]
pub struct TokenReviewAnswer {
    /// `system:serviceaccount:<namespace>:<name>`.
    pub username: String,
    pub uid: String,
    pub groups: Vec<String>,
    /// The audiences the token was issued for.
    pub audiences: Vec<String>,
    /// `authentication.kubernetes.io/pod-name` and friends.
    pub extra: BTreeMap<String, Vec<String>>,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) rv: u64,
    uid: u64,
    pub(super) resources: BTreeMap<String, Resource>,
    pub(super) watches: Vec<WatchSub>,
    pub(super) calls: Vec<ApiCall>,
    pub(super) identities: HashMap<String, String>,
    pub(super) reviews: HashMap<String, TokenReviewAnswer>,
    /// Answer every request with this status code (an API server outage).
    pub(super) failing: Option<u16>,
}

/// `YYYY-MM-DDTHH:MM:SSZ` for now (UTC).
pub fn rfc3339_now() -> String {
    let t = time::OffsetDateTime::now_utc();
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// Why a write failed: HTTP status, reason and message.
pub(super) type Failure = (u16, &'static str, String);

impl State {
    pub(super) fn register(&mut self, def: ResourceDef) {
        let key = def.key();
        self.resources.entry(key).or_insert_with(|| Resource {
            def,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            oldest: 0,
        });
    }

    /// Removes a resource (its CRD was deleted): its objects go, its
    /// watches end.
    pub(super) fn unregister(&mut self, key: &str) {
        self.resources.remove(key);
        self.watches.retain(|w| w.res != key);
    }

    pub(super) fn find_kind(&self, api_version: &str, kind: &str) -> Option<String> {
        self.resources
            .iter()
            .find(|(_, r)| r.def.api_version() == api_version && r.def.kind == kind)
            .map(|(k, _)| k.clone())
    }

    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    /// Records a change and forwards it to the watches of its resource.
    fn record(&mut self, res: &str, kind: EventType, obj: Value, prev: Option<Value>, rv: u64) {
        let Some(r) = self.resources.get_mut(res) else {
            return;
        };
        let ev = HistEvent {
            rv,
            kind,
            obj,
            prev,
        };
        self.watches.retain(|w| w.res != res || w.deliver(&ev));
        r.history.push_back(ev);
        while r.history.len() > HISTORY {
            if let Some(old) = r.history.pop_front() {
                r.oldest = old.rv;
            }
        }
    }

    /// Creates or replaces an object (the test's own writes and the
    /// server's create/update/patch): sets resourceVersion, uid,
    /// creationTimestamp and generation.
    pub(super) fn put(&mut self, res: &str, mut obj: Value) -> Result<Value, Failure> {
        let Some(r) = self.resources.get(res) else {
            return Err((
                404,
                "NotFound",
                format!("the server could not find the requested resource {res}"),
            ));
        };
        let def = r.def.clone();
        let ns = if def.namespaced {
            obj["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_string()
        } else {
            String::new()
        };
        let name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
        if name.is_empty() {
            return Err((422, "Invalid", "metadata.name: Required value".into()));
        }
        let prev = r.objects.get(&(ns.clone(), name.clone())).cloned();
        let rv = self.next_rv();
        if !obj.is_object() {
            return Err((400, "BadRequest", "the body is not an object".into()));
        }
        obj["apiVersion"] = json!(def.api_version());
        obj["kind"] = json!(def.kind);
        if !obj["metadata"].is_object() {
            obj["metadata"] = json!({});
        }
        let meta = &mut obj["metadata"];
        if def.namespaced {
            meta["namespace"] = json!(ns);
        }
        meta["resourceVersion"] = json!(rv.to_string());
        match &prev {
            Some(p) => {
                meta["uid"] = p["metadata"]["uid"].clone();
                meta["creationTimestamp"] = p["metadata"]["creationTimestamp"].clone();
                let gen_before = p["metadata"]["generation"].as_u64().unwrap_or(1);
                let spec_changed = without_meta_status(p) != without_meta_status(&obj);
                obj["metadata"]["generation"] = json!(gen_before + u64::from(spec_changed));
            }
            None => {
                self.uid += 1;
                meta["uid"] = json!(format!("00000000-0000-4000-8000-{:012x}", self.uid));
                meta["creationTimestamp"] = json!(rfc3339_now());
                meta["generation"] = json!(1);
            }
        }
        let kind = if prev.is_some() {
            EventType::Modified
        } else {
            EventType::Added
        };
        if let Some(r) = self.resources.get_mut(res) {
            r.objects.insert((ns, name), obj.clone());
        }
        self.record(res, kind, obj.clone(), prev, rv);
        Ok(obj)
    }

    pub(super) fn remove(&mut self, res: &str, ns: &str, name: &str) -> Result<Value, Failure> {
        let removed = self
            .resources
            .get_mut(res)
            .and_then(|r| r.objects.remove(&(ns.to_string(), name.to_string())));
        let Some(mut obj) = removed else {
            return Err((404, "NotFound", format!("{res} {ns}/{name} not found")));
        };
        let rv = self.next_rv();
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.record(res, EventType::Deleted, obj.clone(), None, rv);
        Ok(obj)
    }

    pub(super) fn get(&self, res: &str, ns: &str, name: &str) -> Option<&Value> {
        self.resources
            .get(res)?
            .objects
            .get(&(ns.to_string(), name.to_string()))
    }

    /// Opens a watch from `from` (a list's resourceVersion; `None` or 0:
    /// every current object first as ADDED). Returns false, having sent
    /// the `410 Gone` error event, when `from` is older than the history.
    pub(super) fn open_watch(&mut self, sub: WatchSub, from: Option<u64>) -> bool {
        let Some(r) = self.resources.get(&sub.res) else {
            return false;
        };
        match from {
            None | Some(0) => {
                for obj in r.objects.values() {
                    if sub.matches(obj) && !sub.send("ADDED", obj) {
                        return false;
                    }
                }
            }
            Some(rv) if rv < r.oldest => {
                let status = status_json(
                    410,
                    "Expired",
                    &format!("too old resource version: {rv} ({})", r.oldest),
                );
                let mut line = json!({"type": "ERROR", "object": status}).to_string();
                line.push('\n');
                let _ = sub.tx.send(Bytes::from(line));
                return false;
            }
            Some(rv) => {
                for ev in r.history.iter().filter(|e| e.rv > rv) {
                    if !sub.deliver(ev) {
                        return false;
                    }
                }
            }
        }
        self.watches.push(sub);
        true
    }

    /// Forgets every event so far: a watch resuming from an earlier
    /// resourceVersion gets `410 Gone` and must list again.
    pub(super) fn compact(&mut self) {
        let rv = self.rv;
        for r in self.resources.values_mut() {
            r.history.clear();
            r.oldest = rv;
        }
    }

    /// Sends a BOOKMARK with the current resourceVersion to every watch
    /// that asked for bookmarks.
    pub(super) fn bookmarks(&mut self) {
        let rv = self.rv.to_string();
        let resources = &self.resources;
        self.watches.retain(|w| {
            if !w.bookmarks {
                return true;
            }
            let (api_version, kind) = match resources.get(&w.res) {
                Some(_) if w.meta_only => ("meta.k8s.io/v1".to_string(), "PartialObjectMetadata".to_string()),
                Some(r) => (r.def.api_version(), r.def.kind.clone()),
                None => return false,
            };
            let obj = json!({"apiVersion": api_version, "kind": kind, "metadata": {"resourceVersion": rv}});
            let mut line = json!({"type": "BOOKMARK", "object": obj}).to_string();
            line.push('\n');
            w.tx.send(Bytes::from(line)).is_ok()
        });
    }
}

fn without_meta_status(v: &Value) -> Map<String, Value> {
    let mut m = v.as_object().cloned().unwrap_or_default();
    m.remove("metadata");
    m.remove("status");
    m
}

/// A `Status` object as the API server sends it.
pub(super) fn status_json(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

/// RFC 7386 JSON merge patch.
pub(super) fn merge_patch(target: &mut Value, patch: &Value) {
    let Some(p) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    if let Some(t) = target.as_object_mut() {
        for (k, v) in p {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}
