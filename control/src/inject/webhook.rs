//! The mutating admission webhook (`admission.k8s.io/v1` AdmissionReview
//! over HTTPS, `POST /inject`), answering with the injection patch.
//!
//! Which namespaces and pods reach it is the MutatingWebhookConfiguration's
//! job (`deploy/kubernetes/06-sidecar-injector.yaml`): pods of namespaces
//! labelled `istio-injection=enabled`, and pods labelled
//! `sidecar.istio.io/inject=true` in namespaces without that label, never
//! ambient ones. The webhook then applies the pod-level rules of
//! [`super::decide`] (opt-out, host network, already injected) as if the
//! namespace had asked: a pod that reached it was selected.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use k8s_openapi::api::core::v1::Pod;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tracing::{debug, info, warn};

use super::{Decision, InjectSettings, NAMESPACE_LABEL, decide, injection_patch};

/// Largest AdmissionReview accepted (a pod with big inline env is ~100 KB).
const MAX_BODY: usize = 8 << 20;
/// Connections served at once.
const MAX_CONNECTIONS: usize = 256;
/// A TLS handshake, and the request headers, must arrive within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The API server waits 10 s by default; a request is not worth more.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a review could not be answered.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("the request body is not an admission.k8s.io/v1 AdmissionReview: {0}")]
    NotAReview(serde_json::Error),
    #[error("the AdmissionReview has no request")]
    NoRequest,
}

#[derive(Debug, Deserialize)]
struct Review {
    request: Option<ReviewRequest>,
}

#[derive(Debug, Deserialize)]
struct ReviewRequest {
    uid: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    operation: String,
    kind: Option<GroupVersionKind>,
    object: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct GroupVersionKind {
    #[serde(default)]
    group: String,
    #[serde(default)]
    kind: String,
}

/// Answers one AdmissionReview body: allowed, with the injection patch when
/// the pod gets a sidecar. A pod object that cannot be read is refused with
/// the reason (the API server shows it to whoever created the pod).
pub fn review(body: &[u8], settings: &InjectSettings) -> Result<Value, WebhookError> {
    let review: Review = serde_json::from_slice(body).map_err(WebhookError::NotAReview)?;
    let req = review.request.ok_or(WebhookError::NoRequest)?;
    let is_pod = req
        .kind
        .as_ref()
        .is_some_and(|k| k.group.is_empty() && k.kind == "Pod");
    let mut response = json!({"uid": req.uid, "allowed": true});
    if !is_pod || req.operation != "CREATE" {
        return Ok(envelope(response));
    }
    let pod: Pod = match req.object.map(serde_json::from_value).transpose() {
        Ok(Some(pod)) => pod,
        Ok(None) => return Ok(envelope(response)),
        Err(e) => {
            response["allowed"] = json!(false);
            response["status"] = json!({
                "code": 400,
                "message": format!("ambit sidecar injector: the pod cannot be read: {e}"),
            });
            return Ok(envelope(response));
        }
    };
    let selected = BTreeMap::from([(NAMESPACE_LABEL.to_string(), "enabled".to_string())]);
    let name = pod
        .metadata
        .name
        .clone()
        .or_else(|| pod.metadata.generate_name.clone())
        .unwrap_or_default();
    match decide(&pod, &selected) {
        Decision::Skip(reason) => {
            debug!(namespace = %req.namespace, pod = %name, "not injected: {reason}");
        }
        Decision::Inject => match injection_patch(&pod, settings)
            .and_then(|ops| serde_json::to_vec(&ops).map_err(crate::inject::PatchError::from))
        {
            Ok(patch) => {
                response["patchType"] = json!("JSONPatch");
                response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(patch));
                info!(namespace = %req.namespace, pod = %name, "sidecar injected");
            }
            Err(e) => {
                response["allowed"] = json!(false);
                response["status"] =
                    json!({"code": 500, "message": format!("ambit sidecar injector: {e}")});
            }
        },
    }
    Ok(envelope(response))
}

fn envelope(response: Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": response,
    })
}

/// Serves the webhook over TLS on `listener` until `shutdown` turns true.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    settings: Arc<InjectSettings>,
    mut shutdown: watch::Receiver<bool>,
) {
    // The gRPC listener's config offers h2; this server speaks HTTP/1.1,
    // which the API server's webhook client uses when offered only that.
    let mut tls = (*tls).clone();
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = shutdown.wait_for(|s| *s) => return,
        };
        let (tcp, peer) = match accepted {
            Ok(c) => c,
            Err(e) => {
                warn!("injection webhook: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            debug!(%peer, "injection webhook: {MAX_CONNECTIONS} connections open, refusing one");
            continue;
        };
        let acceptor = acceptor.clone();
        let settings = settings.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return debug!(%peer, "injection webhook: TLS handshake failed: {e}"),
                Err(_) => return debug!(%peer, "injection webhook: TLS handshake timed out"),
            };
            let svc = service_fn(move |req| handle(req, settings.clone()));
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HANDSHAKE_TIMEOUT)
                .serve_connection(TokioIo::new(tls), svc);
            if let Err(e) = conn.await {
                debug!(%peer, "injection webhook connection ended: {e}");
            }
        });
    }
}

async fn handle(
    req: Request<Incoming>,
    settings: Arc<InjectSettings>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.uri().path() != "/inject" {
        return Ok(text(
            StatusCode::NOT_FOUND,
            "the injection webhook serves POST /inject\n",
        ));
    }
    if req.method() != Method::POST {
        return Ok(text(
            StatusCode::METHOD_NOT_ALLOWED,
            "POST an AdmissionReview to /inject\n",
        ));
    }
    let body = Limited::new(req.into_body(), MAX_BODY).collect();
    let body = match tokio::time::timeout(REQUEST_TIMEOUT, body).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) => {
            return Ok(text(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("reading the AdmissionReview failed (at most {MAX_BODY} bytes): {e}\n"),
            ));
        }
        Err(_) => {
            return Ok(text(
                StatusCode::REQUEST_TIMEOUT,
                "the AdmissionReview body was too slow\n",
            ));
        }
    };
    Ok(match review(&body, &settings) {
        Ok(v) => crate::http::json(&v),
        Err(e) => text(StatusCode::BAD_REQUEST, format!("{e}\n")),
    })
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    crate::http::respond(status, "text/plain", body)
}
