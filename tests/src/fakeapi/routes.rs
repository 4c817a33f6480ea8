//! HTTP: routing a request to the store, list and watch responses, writes.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::lock;
use super::select::Selector;
use super::store::{
    ApiCall, Failure, ResourceDef, State, WatchSub, merge_patch, partial_meta, res_key, status_json,
};

type Body = BoxBody<Bytes, Infallible>;
type Shared = Arc<Mutex<State>>;

/// Largest request body accepted.
const MAX_BODY: usize = 8 << 20;

pub(super) async fn serve(listener: TcpListener, state: Shared) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let st = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let st = st.clone();
                async move { Ok::<_, Infallible>(handle(st, req).await) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn full(code: u16, body: &Value) -> Response<Body> {
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *resp.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

fn fail((code, reason, message): Failure) -> Response<Body> {
    full(code, &status_json(code, reason, &message))
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(q: Option<&str>) -> HashMap<String, String> {
    q.unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

/// What a request addresses.
struct Target {
    res: String,
    def: ResourceDef,
    namespace: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

fn parse_path(s: &State, path: &str) -> Result<Target, Failure> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let not_found = || {
        (
            404,
            "NotFound",
            format!("the server could not find the requested resource ({path})"),
        )
    };
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(not_found()),
    };
    let namespaced_path = rest.len() >= 3
        && rest[0] == "namespaces"
        && s.resources.contains_key(&res_key(group, version, rest[2]));
    let (namespace, plural, name, sub) = if namespaced_path {
        (Some(rest[1]), rest[2], rest.get(3), rest.get(4))
    } else if let Some(plural) = rest.first() {
        (None, *plural, rest.get(1), rest.get(2))
    } else {
        return Err(not_found());
    };
    let res = res_key(group, version, plural);
    let def = s.resources.get(&res).ok_or_else(not_found)?.def.clone();
    Ok(Target {
        res,
        def,
        namespace: namespace.map(str::to_string),
        name: name.map(|n| n.to_string()),
        sub: sub.map(|n| n.to_string()),
    })
}

/// `GET /apis` as aggregated discovery (`APIGroupDiscoveryList`): every
/// group version the fake serves now, with its resources.
fn aggregated_discovery(s: &State) -> Value {
    let mut groups: std::collections::BTreeMap<&str, std::collections::BTreeMap<&str, Vec<Value>>> =
        std::collections::BTreeMap::new();
    for r in s.resources.values() {
        if r.def.group.is_empty() {
            continue;
        }
        groups
            .entry(&r.def.group)
            .or_default()
            .entry(&r.def.version)
            .or_default()
            .push(json!({
                "resource": r.def.plural,
                "responseKind": {"group": r.def.group, "version": r.def.version, "kind": r.def.kind},
                "scope": if r.def.namespaced { "Namespaced" } else { "Cluster" },
                "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
            }));
    }
    let items: Vec<Value> = groups
        .into_iter()
        .map(|(group, versions)| {
            json!({
                "metadata": {"name": group},
                "versions": versions.into_iter().map(|(v, resources)| json!({
                    "version": v, "resources": resources, "freshness": "Current",
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2",
           "metadata": {}, "items": items})
}

fn verb(method: &Method, t: &Target, q: &HashMap<String, String>) -> &'static str {
    let watch = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    match (method.as_str(), t.name.is_some()) {
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("GET", true) => "get",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => "unknown",
    }
}

async fn handle(state: Shared, req: Request<Incoming>) -> Response<Body> {
    let method = req.method().clone();
    let uri = req.uri().clone();
    let q = parse_query(uri.query());
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let (auth, accept, content_type) = (
        header("authorization"),
        header("accept"),
        header("content-type"),
    );
    let body = match method {
        Method::POST | Method::PUT | Method::PATCH => {
            match Limited::new(req.into_body(), MAX_BODY).collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return fail((400, "BadRequest", format!("reading the body: {e}"))),
            }
        }
        _ => Bytes::new(),
    };
    let mut s = lock(&state);
    if method == Method::GET && uri.path().trim_end_matches('/') == "/apis" {
        return full(200, &aggregated_discovery(&s));
    }
    let target = match parse_path(&s, uri.path()) {
        Ok(t) => t,
        Err(f) => return fail(f),
    };
    let token = auth
        .strip_prefix("Bearer ")
        .unwrap_or("")
        .trim()
        .to_string();
    let identity = if token.is_empty() {
        "anonymous".to_string()
    } else {
        s.identities
            .get(&token)
            .cloned()
            .unwrap_or_else(|| "unknown".to_string())
    };
    let verb = verb(&method, &target, &q);
    let call = ApiCall {
        identity,
        verb: verb.to_string(),
        group: target.def.group.clone(),
        resource: target.def.plural.clone(),
        subresource: target.sub.clone().unwrap_or_default(),
        namespace: target.namespace.clone().unwrap_or_default(),
        name: target.name.clone().unwrap_or_default(),
        resource_version: q.get("resourceVersion").cloned().unwrap_or_default(),
    };
    // A server-side apply that creates its object needs `create` as well
    // (a real API server authorizes both).
    let creates = verb == "patch"
        && content_type.contains("apply-patch")
        && target.sub.is_none()
        && get(&s, &target, false).is_err();
    if creates {
        s.calls.push(ApiCall {
            verb: "create".to_string(),
            ..call.clone()
        });
    }
    s.calls.push(call);
    if let Some(code) = s.failing {
        return fail((
            code,
            "ServiceUnavailable",
            "the fake API server is failing on purpose".into(),
        ));
    }
    let meta_only = accept.contains("as=PartialObjectMetadata");
    let parsed = || -> Result<Value, Failure> {
        serde_json::from_slice(&body)
            .map_err(|e| (400, "BadRequest", format!("the body is not JSON: {e}")))
    };
    let result = match verb {
        "list" => list(&s, &target, &q, meta_only),
        "watch" => return watch(&mut s, &target, &q, meta_only),
        "get" => get(&s, &target, meta_only),
        "create" => parsed()
            .and_then(|b| create(&mut s, &target, b))
            .map(|v| (201, v)),
        "update" => parsed()
            .and_then(|b| update(&mut s, &target, b))
            .map(|v| (200, v)),
        "patch" => parsed()
            .and_then(|b| patch(&mut s, &target, b, &content_type))
            .map(|v| (200, v)),
        "delete" => {
            let (ns, name) = key(&target);
            s.remove(&target.res, &ns, &name).map(|v| (200, v))
        }
        _ => Err((
            405,
            "MethodNotAllowed",
            format!("{method} is not supported here"),
        )),
    };
    match result {
        Ok((code, v)) => full(code, &v),
        Err(f) => fail(f),
    }
}

fn key(t: &Target) -> (String, String) {
    let ns = if t.def.namespaced {
        t.namespace.clone().unwrap_or_default()
    } else {
        String::new()
    };
    (ns, t.name.clone().unwrap_or_default())
}

fn selectors(q: &HashMap<String, String>) -> Result<(Selector, Selector), Failure> {
    let parse = |k: &str| {
        Selector::parse(q.get(k).map_or("", String::as_str))
            .map_err(|e| (400, "BadRequest", format!("{k}: {e}")))
    };
    Ok((parse("labelSelector")?, parse("fieldSelector")?))
}

fn list(
    s: &State,
    t: &Target,
    q: &HashMap<String, String>,
    meta_only: bool,
) -> Result<(u16, Value), Failure> {
    let (labels, fields) = selectors(q)?;
    let r = s
        .resources
        .get(&t.res)
        .ok_or((404, "NotFound", format!("no resource {}", t.res)))?;
    let after = q.get("continue").filter(|c| !c.is_empty()).map(|c| {
        let (ns, name) = c.split_once('|').unwrap_or(("", c));
        (ns.to_string(), name.to_string())
    });
    let limit = q
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    let mut items = Vec::new();
    let mut more = None;
    for ((ns, name), obj) in &r.objects {
        if after.as_ref().is_some_and(|a| (ns, name) <= (&a.0, &a.1)) {
            continue;
        }
        if t.namespace.as_ref().is_some_and(|want| want != ns) {
            continue;
        }
        if !labels.matches_labels(obj) || !fields.matches_fields(obj) {
            continue;
        }
        if limit.is_some_and(|l| items.len() >= l) {
            more = items.last().map(|last: &Value| {
                format!(
                    "{}|{}",
                    last["metadata"]["namespace"].as_str().unwrap_or(""),
                    last["metadata"]["name"].as_str().unwrap_or("")
                )
            });
            break;
        }
        items.push(if meta_only {
            partial_meta(obj)
        } else {
            obj.clone()
        });
    }
    let (api_version, kind) = if meta_only {
        (
            "meta.k8s.io/v1".to_string(),
            "PartialObjectMetadataList".to_string(),
        )
    } else {
        (t.def.api_version(), format!("{}List", t.def.kind))
    };
    let mut metadata = json!({"resourceVersion": s.rv.to_string()});
    if let Some(c) = more {
        metadata["continue"] = json!(c);
    }
    Ok((
        200,
        json!({"apiVersion": api_version, "kind": kind, "metadata": metadata, "items": items}),
    ))
}

fn watch(
    s: &mut State,
    t: &Target,
    q: &HashMap<String, String>,
    meta_only: bool,
) -> Response<Body> {
    let (labels, fields) = match selectors(q) {
        Ok(x) => x,
        Err(f) => return fail(f),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let sub = WatchSub {
        res: t.res.clone(),
        namespace: t.namespace.clone(),
        labels,
        fields,
        meta_only,
        bookmarks: q.get("allowWatchBookmarks").is_some_and(|b| b == "true"),
        tx,
    };
    let from = q
        .get("resourceVersion")
        .filter(|v| !v.is_empty())
        .and_then(|v| v.parse::<u64>().ok());
    s.open_watch(sub, from);
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .unwrap_or(1800);
    let stream = UnboundedReceiverStream::new(rx)
        .map(|b| Ok::<_, Infallible>(Frame::data(b)))
        .take_until(tokio::time::sleep(Duration::from_secs(timeout)));
    let mut resp = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

fn get(s: &State, t: &Target, meta_only: bool) -> Result<(u16, Value), Failure> {
    let (ns, name) = key(t);
    let obj = s.get(&t.res, &ns, &name).ok_or((
        404,
        "NotFound",
        format!("{} \"{name}\" not found", t.def.plural),
    ))?;
    Ok((
        200,
        if meta_only {
            partial_meta(obj)
        } else {
            obj.clone()
        },
    ))
}

fn create(s: &mut State, t: &Target, mut body: Value) -> Result<Value, Failure> {
    if t.def.plural == "tokenreviews" {
        return Ok(token_review(s, &body));
    }
    if t.def.namespaced {
        body["metadata"]["namespace"] = json!(t.namespace.clone().unwrap_or_default());
    }
    let name = body["metadata"]["name"].as_str().unwrap_or("").to_string();
    let ns = body["metadata"]["namespace"]
        .as_str()
        .unwrap_or("")
        .to_string();
    if s.get(&t.res, &ns, &name).is_some() {
        return Err((
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", t.def.plural),
        ));
    }
    s.put(&t.res, body)
}

fn check_rv(current: &Value, body: &Value) -> Result<(), Failure> {
    let want = body["metadata"]["resourceVersion"].as_str().unwrap_or("");
    if !want.is_empty() && current["metadata"]["resourceVersion"].as_str() != Some(want) {
        return Err((
            409,
            "Conflict",
            "Operation cannot be fulfilled: the object has been modified; please apply your changes to the latest version and try again".into(),
        ));
    }
    Ok(())
}

fn update(s: &mut State, t: &Target, mut body: Value) -> Result<Value, Failure> {
    let (ns, name) = key(t);
    let current = s.get(&t.res, &ns, &name).cloned().ok_or((
        404,
        "NotFound",
        format!("{} \"{name}\" not found", t.def.plural),
    ))?;
    check_rv(&current, &body)?;
    if t.sub.as_deref() == Some("status") {
        let mut next = current;
        next["status"] = body["status"].take();
        return s.put(&t.res, next);
    }
    body["metadata"]["name"] = json!(name);
    if t.def.namespaced {
        body["metadata"]["namespace"] = json!(ns);
    }
    s.put(&t.res, body)
}

fn patch(s: &mut State, t: &Target, body: Value, content_type: &str) -> Result<Value, Failure> {
    let (ns, name) = key(t);
    let current = s.get(&t.res, &ns, &name).cloned();
    let apply = content_type.starts_with("application/apply-patch");
    if !apply && !content_type.contains("merge-patch") {
        return Err((
            415,
            "UnsupportedMediaType",
            format!("the fake supports merge and apply patches, not {content_type:?}"),
        ));
    }
    let mut next = match current {
        Some(c) => {
            check_rv(&c, &body)?;
            c
        }
        None if apply && t.sub.is_none() => {
            let mut obj = body;
            obj["metadata"]["name"] = json!(name);
            if t.def.namespaced {
                obj["metadata"]["namespace"] = json!(ns);
            }
            return s.put(&t.res, obj);
        }
        None => {
            return Err((
                404,
                "NotFound",
                format!("{} \"{name}\" not found", t.def.plural),
            ));
        }
    };
    if t.sub.as_deref() == Some("status") {
        merge_patch(&mut next["status"], &body["status"]);
    } else {
        let mut body = body;
        if let Some(m) = body["metadata"].as_object_mut() {
            m.remove("resourceVersion");
        }
        merge_patch(&mut next, &body);
    }
    s.put(&t.res, next)
}

/// A TokenReview: authenticated when the token is known and, if the
/// request names audiences, was issued for one of them.
fn token_review(s: &State, body: &Value) -> Value {
    let token = body["spec"]["token"].as_str().unwrap_or("");
    let wanted: Vec<String> = body["spec"]["audiences"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let status = match s.reviews.get(token) {
        None => json!({"authenticated": false, "error": "invalid bearer token"}),
        Some(a) => {
            let granted: Vec<&String> = if wanted.is_empty() {
                a.audiences.iter().collect()
            } else {
                a.audiences.iter().filter(|x| wanted.contains(x)).collect()
            };
            if granted.is_empty() {
                json!({"authenticated": false, "error": "token audiences are invalid for the target audiences"})
            } else {
                json!({
                    "authenticated": true,
                    "user": {"username": a.username, "uid": a.uid, "groups": a.groups, "extra": a.extra},
                    "audiences": granted,
                })
            }
        }
    };
    json!({
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "metadata": {"creationTimestamp": null},
        "spec": body["spec"].clone(),
        "status": status,
    })
}
