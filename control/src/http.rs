//! A minimal HTTP/1 server for the monitoring endpoints: one synchronous
//! handler function, no framework.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::debug;

pub type Handler = Arc<dyn Fn(&Request<Incoming>) -> Response<Full<Bytes>> + Send + Sync>;

/// Serves `handler` on `listener` until `shutdown` turns true.
pub async fn serve(listener: TcpListener, handler: Handler, mut shutdown: watch::Receiver<bool>) {
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    debug!("monitoring listener accept failed: {e}");
                    continue;
                }
            },
            _ = shutdown.wait_for(|s| *s) => return,
        };
        let handler = handler.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let resp = handler(&req);
                async move { Ok::<_, Infallible>(resp) }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                debug!(%peer, "monitoring connection ended: {e}");
            }
        });
    }
}

/// A response with `status`, content type and body.
pub fn respond(
    status: StatusCode,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
        resp.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    resp
}

/// A pretty-printed JSON response.
pub fn json<T: serde::Serialize>(value: &T) -> Response<Full<Bytes>> {
    match serde_json::to_vec_pretty(value) {
        Ok(body) => respond(StatusCode::OK, "application/json", body),
        Err(e) => respond(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            format!("could not encode JSON: {e}\n"),
        ),
    }
}
