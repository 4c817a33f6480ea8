//! A minimal OpenTelemetry collector for tests: serves OTLP/gRPC
//! `TraceService/Export` over plaintext HTTP/2 inside a pod and keeps every
//! span it receives. Messages are declared here with prost, only the
//! fields the tests read (the wire format skips the rest).

use std::sync::{Arc, Mutex};

use anyhow::Result;
use bytes::{Buf, Bytes};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::netbed::{self, PodNet};

/// The OTLP trace export method.
pub const EXPORT_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

#[derive(Clone, PartialEq, Message)]
pub struct ExportTraceServiceRequest {
    #[prost(message, repeated, tag = "1")]
    pub resource_spans: Vec<ResourceSpans>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ResourceSpans {
    #[prost(message, optional, tag = "1")]
    pub resource: Option<Resource>,
    #[prost(message, repeated, tag = "2")]
    pub scope_spans: Vec<ScopeSpans>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Resource {
    #[prost(message, repeated, tag = "1")]
    pub attributes: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ScopeSpans {
    #[prost(message, repeated, tag = "2")]
    pub spans: Vec<Span>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Span {
    #[prost(bytes = "vec", tag = "1")]
    pub trace_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub span_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "4")]
    pub parent_span_id: Vec<u8>,
    #[prost(string, tag = "5")]
    pub name: String,
    #[prost(message, repeated, tag = "9")]
    pub attributes: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct KeyValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(message, optional, tag = "2")]
    pub value: Option<AnyValue>,
}

/// `AnyValue`'s oneof, as the optional fields it is on the wire.
#[derive(Clone, PartialEq, Message)]
pub struct AnyValue {
    #[prost(string, optional, tag = "1")]
    pub string_value: Option<String>,
    #[prost(bool, optional, tag = "2")]
    pub bool_value: Option<bool>,
    #[prost(int64, optional, tag = "3")]
    pub int_value: Option<i64>,
}

/// A received span with its resource's `service.name`.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub service: String,
    pub span: Span,
}

impl ReceivedSpan {
    /// The trace id as the 32 hex digits of a `traceparent`.
    pub fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }
    pub fn span_id(&self) -> String {
        hex(&self.span.span_id)
    }
    pub fn parent_span_id(&self) -> String {
        hex(&self.span.parent_span_id)
    }
    /// A string or integer attribute, as text.
    pub fn attribute(&self, key: &str) -> Option<String> {
        attribute(&self.span.attributes, key)
    }
}

fn attribute(attrs: &[KeyValue], key: &str) -> Option<String> {
    let v = attrs.iter().find(|kv| kv.key == key)?.value.as_ref()?;
    v.string_value
        .clone()
        .or_else(|| v.int_value.map(|i| i.to_string()))
        .or_else(|| v.bool_value.map(|b| b.to_string()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[derive(Default)]
struct Received {
    spans: Mutex<Vec<ReceivedSpan>>,
    changed: Notify,
}

/// A running collector; stops on drop.
pub struct Collector {
    received: Arc<Received>,
    task: JoinHandle<()>,
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Collector {
    /// Serves OTLP/gRPC on `0.0.0.0:port` inside `pod`.
    pub fn start(pod: &PodNet, port: u16) -> Result<Collector> {
        let listener = netbed::listen(pod, port)?;
        let received = Arc::new(Received::default());
        let rx = received.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else { continue };
                        let rx = rx.clone();
                        conns.spawn(async move {
                            let service = hyper::service::service_fn(move |req| export(rx.clone(), req));
                            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(Collector { received, task })
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.received
            .spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Waits until at least `n` spans arrived; all of them then.
    pub async fn wait_spans(
        &self,
        n: usize,
        within: std::time::Duration,
    ) -> Result<Vec<ReceivedSpan>> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.received.changed.notified();
            let spans = self.spans();
            if spans.len() >= n {
                return Ok(spans);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                anyhow::bail!(
                    "the collector received {} spans within {within:?}, want {n}",
                    spans.len()
                );
            }
        }
    }
}

type ExportBody = StreamBody<
    futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, std::convert::Infallible>>>,
>;

/// One unary Export call: gRPC frames in, an empty response and
/// `grpc-status: 0` out.
async fn export(
    rx: Arc<Received>,
    req: Request<Incoming>,
) -> Result<Response<ExportBody>, std::convert::Infallible> {
    let ok = req.uri().path() == EXPORT_PATH;
    let body = req.into_body().collect().await.map(|b| b.to_bytes());
    let status = match (ok, body) {
        (true, Ok(mut bytes)) => {
            let mut spans = Vec::new();
            while bytes.remaining() >= 5 {
                let _compressed = bytes.get_u8();
                let len = bytes.get_u32() as usize;
                if bytes.remaining() < len {
                    break;
                }
                let msg = bytes.split_to(len);
                if let Ok(req) = ExportTraceServiceRequest::decode(msg) {
                    for rs in req.resource_spans {
                        let service = rs
                            .resource
                            .as_ref()
                            .and_then(|r| attribute(&r.attributes, "service.name"))
                            .unwrap_or_default();
                        for ss in rs.scope_spans {
                            spans.extend(ss.spans.into_iter().map(|span| ReceivedSpan {
                                service: service.clone(),
                                span,
                            }));
                        }
                    }
                }
            }
            rx.spans
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(spans);
            rx.changed.notify_waiters();
            "0"
        }
        (false, _) => "12",
        (true, Err(_)) => "13",
    };
    let mut trailers = hyper::HeaderMap::new();
    trailers.insert(
        "grpc-status",
        hyper::header::HeaderValue::from_static(status),
    );
    let frames = vec![
        Ok(Frame::data(Bytes::from_static(&[0, 0, 0, 0, 0]))),
        Ok(Frame::trailers(trailers)),
    ];
    let mut resp = Response::new(StreamBody::new(futures::stream::iter(frames)));
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/grpc"),
    );
    Ok(resp)
}
