//! A tiny HTTP app for L7 tests, run inside a pod on the test's runtime,
//! and a keep-alive HTTP/1.1 client that calls from inside a pod. The app
//! speaks HTTP/1.1 and, to a client that opens with the HTTP/2 preface,
//! h2c (prior knowledge), on the same port.
//!
//! Every answer names the replica (`x-served-by` header and body), so a
//! test can tell which version served a request. A test switches a
//! replica's [`Behavior`] at any time: answer 200, answer a fixed status
//! (an injected 503), or wait before answering (a slow replica). The app
//! counts its requests and keeps their arrival times.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::task::{JoinHandle, JoinSet};

use crate::netbed::{self, PodNet};

/// The header naming the replica that answered.
pub const SERVED_BY: &str = "x-served-by";
/// Bound on one request of the client.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How a replica answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behavior {
    /// 200 at once.
    Ok,
    /// This status at once (e.g. 503).
    Status(u16),
    /// 200 after this long.
    Delay(Duration),
    /// 200 with a body of this many bytes (benchmarks).
    Sized(usize),
}

#[derive(Debug)]
struct State {
    name: String,
    behavior: Mutex<Behavior>,
    hits: AtomicU64,
    arrivals: Mutex<Vec<Instant>>,
    /// The `traceparent` of every request that carried one.
    traceparents: Mutex<Vec<String>>,
}

impl State {
    fn behavior(&self) -> MutexGuard<'_, Behavior> {
        self.behavior.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn arrivals(&self) -> MutexGuard<'_, Vec<Instant>> {
        self.arrivals.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running app; stops with its connections on drop.
#[derive(Debug)]
pub struct HttpApp {
    /// The pod's address and port.
    pub addr: SocketAddr,
    state: Arc<State>,
    task: JoinHandle<()>,
}

impl Drop for HttpApp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HttpApp {
    /// Serves on `0.0.0.0:port` inside `pod`, answering as `name`.
    pub fn start(pod: &PodNet, port: u16, name: &str) -> Result<HttpApp> {
        let listener = netbed::listen(pod, port)?;
        let state = Arc::new(State {
            name: name.to_string(),
            behavior: Mutex::new(Behavior::Ok),
            hits: AtomicU64::new(0),
            arrivals: Mutex::new(Vec::new()),
            traceparents: Mutex::new(Vec::new()),
        });
        let st = state.clone();
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => {
                            let st = st.clone();
                            conns.spawn(serve(stream, st.clone()));
                        }
                        Err(e) => {
                            println!("http app: accept failed: {e}");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    },
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(HttpApp {
            addr: pod.addr(port),
            state,
            task,
        })
    }

    /// The `traceparent` headers of the requests received so far.
    pub fn traceparents(&self) -> Vec<String> {
        self.state
            .traceparents
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Changes how the app answers from the next request on.
    pub fn set(&self, behavior: Behavior) {
        *self.state.behavior() = behavior;
    }

    /// Requests received so far.
    pub fn hits(&self) -> u64 {
        self.state.hits.load(Ordering::Relaxed)
    }

    /// When each request arrived, in order.
    pub fn arrivals(&self) -> Vec<Instant> {
        self.state.arrivals().clone()
    }

    /// Forgets the arrivals so far.
    pub fn clear_arrivals(&self) {
        self.state.arrivals().clear();
    }
}

/// The first bytes of an HTTP/2 connection (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serves one connection: h2c when it opens with the HTTP/2 preface,
/// HTTP/1.1 otherwise.
async fn serve(stream: tokio::net::TcpStream, st: Arc<State>) {
    let service = hyper::service::service_fn(move |req| answer(st.clone(), req));
    let io = TokioIo::new(stream);
    if opens_with_h2_preface(io.inner()).await {
        let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .serve_connection(io, service)
            .await;
    } else {
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(io, service)
            .await;
    }
}

/// Whether the first bytes the peer sends are the HTTP/2 preface; peeks,
/// so the bytes stay for the protocol's own reader.
async fn opens_with_h2_preface(stream: &tokio::net::TcpStream) -> bool {
    let mut buf = [0u8; H2_PREFACE.len()];
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    loop {
        let n = match tokio::time::timeout_at(deadline.into(), stream.peek(&mut buf)).await {
            Ok(Ok(n)) => n,
            _ => return false,
        };
        if n == 0 || buf[..n] != H2_PREFACE[..n] {
            return false;
        }
        if n == H2_PREFACE.len() {
            return true;
        }
        // A prefix of the preface so far (peek returns at once while any
        // byte is queued): look again shortly.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn answer(
    st: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::convert::Infallible> {
    st.hits.fetch_add(1, Ordering::Relaxed);
    if let Some(tp) = req
        .headers()
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
    {
        st.traceparents
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(tp.to_string());
    }
    st.arrivals().push(Instant::now());
    let behavior = *st.behavior();
    let mut body = Bytes::from(st.name.clone());
    let status = match behavior {
        Behavior::Ok => StatusCode::OK,
        Behavior::Sized(n) => {
            body = Bytes::from(vec![b'x'; n]);
            StatusCode::OK
        }
        Behavior::Status(s) => StatusCode::from_u16(s).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        Behavior::Delay(d) => {
            tokio::time::sleep(d).await;
            StatusCode::OK
        }
    };
    let mut resp = Response::new(Full::new(body));
    *resp.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(&st.name) {
        resp.headers_mut().insert(SERVED_BY, v);
    }
    Ok(resp)
}

/// One answer the client got.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    /// The `x-served-by` header (`None` when Envoy answered itself, e.g. a
    /// fault abort or a timeout).
    pub served_by: Option<String>,
    /// When the request was sent and how long the answer took.
    pub sent: Instant,
    pub latency: Duration,
}

/// A keep-alive HTTP/1.1 connection from inside a pod (captured by its
/// redirection when enrolled).
pub struct Client {
    dst: SocketAddr,
    sender: hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
    conn: JoinHandle<()>,
}

impl Drop for Client {
    fn drop(&mut self) {
        self.conn.abort();
    }
}

impl Client {
    /// Connects from `pod` to `dst`.
    pub async fn connect(pod: &PodNet, dst: SocketAddr) -> Result<Client> {
        let stream = tokio::time::timeout(REQUEST_TIMEOUT, netbed::connect(pod, dst))
            .await
            .with_context(|| format!("connecting to {dst}: no answer in {REQUEST_TIMEOUT:?}"))??;
        let (sender, conn) = tokio::time::timeout(
            REQUEST_TIMEOUT,
            hyper::client::conn::http1::handshake(TokioIo::new(stream)),
        )
        .await
        .context("HTTP/1.1 handshake timed out")?
        .context("HTTP/1.1 handshake")?;
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Client { dst, sender, conn })
    }

    /// Whether the connection can take another request.
    pub fn is_open(&self) -> bool {
        !self.sender.is_closed()
    }

    /// GET `path` with `headers`, bounded by [`REQUEST_TIMEOUT`].
    pub async fn get(&mut self, path: &str, headers: &[(&str, &str)]) -> Result<Reply> {
        self.send(hyper::Method::GET, path, headers).await
    }

    /// A `method` request for `path` (no body) with `headers`, bounded by
    /// [`REQUEST_TIMEOUT`].
    pub async fn send(
        &mut self,
        method: hyper::Method,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<Reply> {
        let mut req = Request::builder()
            .method(method.clone())
            .uri(path)
            .header(hyper::header::HOST, self.dst.to_string());
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Empty::new()).context("building the request")?;
        let sent = Instant::now();
        let fut = async {
            self.sender.ready().await?;
            let resp = self.sender.send_request(req).await?;
            let status = resp.status().as_u16();
            let served_by = resp
                .headers()
                .get(SERVED_BY)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            resp.into_body().collect().await?;
            Ok::<_, hyper::Error>((status, served_by))
        };
        let (status, served_by) = tokio::time::timeout(REQUEST_TIMEOUT, fut)
            .await
            .with_context(|| {
                format!(
                    "{method} {path} via {}: no answer in {REQUEST_TIMEOUT:?}",
                    self.dst
                )
            })?
            .with_context(|| format!("{method} {path} via {}", self.dst))?;
        Ok(Reply {
            status,
            served_by,
            sent,
            latency: sent.elapsed(),
        })
    }
}

/// `n` GETs of `path` from `pod` to `dst` over `conns` keep-alive
/// connections at once (a broken connection is replaced); every result in
/// the order each connection got it.
pub async fn many(
    pod: &PodNet,
    dst: SocketAddr,
    n: usize,
    conns: usize,
    path: &str,
    headers: &[(&str, &str)],
) -> Vec<Result<Reply>> {
    let conns = conns.clamp(1, n.max(1));
    let mut set = JoinSet::new();
    for i in 0..conns {
        let share = n / conns + usize::from(i < n % conns);
        let pod = pod.clone();
        let path = path.to_string();
        let headers: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        set.spawn(async move {
            let h: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let mut out = Vec::with_capacity(share);
            let mut client: Option<Client> = None;
            for _ in 0..share {
                out.push(once(&mut client, &pod, dst, &path, &h).await);
            }
            out
        });
    }
    let mut all = Vec::with_capacity(n);
    while let Some(r) = set.join_next().await {
        match r {
            Ok(v) => all.extend(v),
            Err(e) => all.push(Err(anyhow::anyhow!("request task failed: {e}"))),
        }
    }
    all
}

/// One request on `client`, (re)connecting when it is missing or closed.
pub async fn once(
    client: &mut Option<Client>,
    pod: &PodNet,
    dst: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<Reply> {
    if !client.as_ref().is_some_and(Client::is_open) {
        *client = Some(Client::connect(pod, dst).await?);
    }
    let Some(c) = client.as_mut() else {
        bail!("no connection to {dst}");
    };
    let r = c.get(path, headers).await;
    if r.is_err() {
        *client = None;
    }
    r
}

/// How many replies each replica served (`-` for none), and the failures.
pub fn tally(
    replies: &[Result<Reply>],
) -> (std::collections::BTreeMap<String, usize>, Vec<String>) {
    let mut by = std::collections::BTreeMap::new();
    let mut failures = Vec::new();
    for r in replies {
        match r {
            Ok(r) => {
                let who = r.served_by.clone().unwrap_or_else(|| "-".to_string());
                *by.entry(format!("{who} {}", r.status)).or_insert(0) += 1;
            }
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    (by, failures)
}
