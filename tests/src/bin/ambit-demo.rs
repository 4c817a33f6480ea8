//! `ambit-demo`: the small workload app `ambitctl local up` runs inside each demo
//! pod's network namespace (and the end-to-end tests run as their workloads).
//!
//! One process can, all at once:
//! - serve HTTP/1.1 on `--http PORT` (any path answers a JSON description of itself
//!   and of the TCP peer it saw; `GET /healthz` answers `ok`), first calling every
//!   `--forward URL` and nesting their answers under `calls`;
//! - echo raw TCP on `--tcp PORT` (until EOF, then close the write side);
//! - call `--call URL` / `--tcp-call HOST:PORT` every `--every` and log one line per
//!   call, or with `--once` call each once, print JSON and exit 0/1;
//! - hold one TCP connection to an echo server (`--hold HOST:PORT --for DURATION`),
//!   a line each `--every`, print JSON and exit 0/1.
//!
//! Logs go to stdout (stderr with `--once`, whose JSON owns stdout), one line per
//! request, connection and call.
#![forbid(unsafe_code)]

#[path = "ambit_demo/count.rs"]
mod count;
#[path = "ambit_demo/hold.rs"]
mod hold;
#[path = "ambit_demo/net.rs"]
mod net;

use std::io::IsTerminal;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::Parser;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{info, warn};

use net::{CallOutcome, HttpTarget, Ms, TcpOutcome, TcpTarget, describe_io};

const EXAMPLES: &str = "\
Examples:
  # the vector-db: an HTTP server
  ambit-demo --name vector-db-0 --namespace ai-inference --http 6333
  # the orchestrator: serves 8080 and, per request, calls embedding (which calls vector-db)
  ambit-demo --http 8080 --forward http://10.96.0.11:9000/embed --forward http://10.96.0.20/generate
  # a raw TCP echo server
  ambit-demo --tcp 7000
  # the legacy client: calls every 2s and logs each result (refusals included)
  ambit-demo --call http://10.96.0.10/ask --tcp-call 10.96.0.40:7000 --every 2s
  # one-shot check (exit 0 if every call got a 2xx / a correct echo, else 1)
  ambit-demo --call http://10.96.0.10/ask --once
  # 1000 calls, one every 10ms: how many each server answered, as JSON
  ambit-demo --call http://llm.ai/ --count 1000 --every 10ms
  # one connection kept 20s, a line echoed every 100ms (exit 0 if none was lost)
  ambit-demo --hold 10.96.0.40:7000 --for 20s --every 100ms

Exit status: 0 on success or SIGTERM/ctrl-c; 1 when a --once call failed; 2 on bad
arguments or a port that cannot be bound.";

/// The demo workload: HTTP and raw-TCP servers and periodic clients in one process.
#[derive(Parser, Debug)]
#[command(
    name = "ambit-demo",
    version,
    about = "Ambit's demo workload: HTTP and raw-TCP servers and periodic clients in one process",
    after_help = EXAMPLES
)]
struct Args {
    /// Name shown in responses and logs [default: $POD_NAME, else the hostname].
    #[arg(long, env = "POD_NAME", value_name = "NAME")]
    name: Option<String>,

    /// Namespace shown in responses.
    #[arg(
        long,
        env = "POD_NAMESPACE",
        value_name = "NS",
        default_value = "default"
    )]
    namespace: String,

    /// Serve HTTP/1.1 on this port (repeatable; 0 picks a free port, logged at start).
    #[arg(long = "http", value_name = "PORT")]
    http: Vec<u16>,

    /// Serve a raw TCP echo on this port (repeatable; 0 picks a free port).
    #[arg(long = "tcp", value_name = "PORT")]
    tcp: Vec<u16>,

    /// Address the servers listen on.
    #[arg(long, value_name = "IP", default_value = "0.0.0.0")]
    bind: IpAddr,

    /// Per HTTP request served, first GET this URL and include the result in
    /// `calls` (repeatable; called concurrently; a failed call makes the answer 502).
    #[arg(long = "forward", value_name = "URL", value_parser = HttpTarget::parse)]
    forward: Vec<HttpTarget>,

    /// GET this URL every --every and log the result (repeatable).
    #[arg(long = "call", value_name = "URL", value_parser = HttpTarget::parse)]
    call: Vec<HttpTarget>,

    /// Send a line to this TCP echo server every --every and expect it back (repeatable).
    #[arg(long = "tcp-call", value_name = "HOST:PORT", value_parser = TcpTarget::parse)]
    tcp_call: Vec<TcpTarget>,

    /// Period of --call / --tcp-call (e.g. 2s, 500ms, 1m).
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = net::parse_duration)]
    every: Duration,

    /// Timeout of each outgoing call, --forward included.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = net::parse_duration)]
    timeout: Duration,

    /// Make each --call / --tcp-call once, print the results as JSON on stdout and
    /// exit 0 if all succeeded, else 1.
    #[arg(long)]
    once: bool,

    /// With one --call: make this many calls (one every --every), print how
    /// many each server answered as JSON and exit (0: all were 2xx).
    #[arg(long, value_name = "N")]
    count: Option<u64>,

    /// Hold one TCP connection to this echo server for --for, sending a
    /// line every --every; print JSON and exit (0: every line came back).
    #[arg(long, value_name = "HOST:PORT", value_parser = TcpTarget::parse)]
    hold: Option<TcpTarget>,

    /// How long --hold keeps its connection.
    #[arg(long = "for", value_name = "DURATION", default_value = "10s", value_parser = net::parse_duration)]
    hold_for: Duration,
}

/// What request handlers and clients share.
struct App {
    name: String,
    namespace: String,
    forward: Vec<HttpTarget>,
    timeout: Duration,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = Args::parse();
    init_logging(args.once);
    match run(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ambit-demo: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn init_logging(once: bool) {
    use tracing_subscriber::fmt::writer::BoxMakeWriter;
    let (writer, ansi) = if once {
        (
            BoxMakeWriter::new(std::io::stderr),
            std::io::stderr().is_terminal(),
        )
    } else {
        (
            BoxMakeWriter::new(std::io::stdout),
            std::io::stdout().is_terminal(),
        )
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(ansi)
        .with_target(false)
        .init();
}

async fn run(args: Args) -> Result<ExitCode> {
    if let Some(n) = args.count {
        let [target] = args.call.as_slice() else {
            bail!("--count needs exactly one --call URL");
        };
        let caller = args.name.clone().unwrap_or_else(hostname);
        let (summary, ok) = count::count_calls(target, n, args.every, args.timeout, &caller).await;
        println!("{summary}");
        return Ok(if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        });
    }
    if let Some(target) = &args.hold {
        let out = hold::hold(target, args.hold_for, args.every, args.timeout).await;
        println!("{}", out.to_json(target));
        return Ok(if out.ok() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        });
    }
    if !args.forward.is_empty() && args.http.is_empty() {
        bail!("--forward is made per HTTP request served: it needs --http PORT");
    }
    if args.http.is_empty()
        && args.tcp.is_empty()
        && args.call.is_empty()
        && args.tcp_call.is_empty()
    {
        bail!("nothing to do: give at least one of --http, --tcp, --call, --tcp-call (see --help)");
    }
    if args.once && args.call.is_empty() && args.tcp_call.is_empty() {
        bail!("--once needs at least one --call URL or --tcp-call HOST:PORT");
    }
    if args.every.is_zero() {
        bail!("--every must be more than 0");
    }

    // Handlers first, so a SIGTERM that follows the "listening" lines is never fatal.
    let mut shutdown = std::pin::pin!(shutdown_signal()?);

    let app = Arc::new(App {
        name: args.name.clone().unwrap_or_else(hostname),
        namespace: args.namespace.clone(),
        forward: args.forward.clone(),
        timeout: args.timeout,
    });
    info!(name = %app.name, namespace = %app.namespace, "ambit-demo starting");

    for &port in &args.http {
        let listener = bind(args.bind, port, "HTTP").await?;
        tokio::spawn(serve_http(listener, app.clone()));
    }
    for &port in &args.tcp {
        let listener = bind(args.bind, port, "TCP").await?;
        tokio::spawn(serve_tcp(listener));
    }

    if args.once {
        let round = tokio::select! {
            round = call_round(&app, &args.call, &args.tcp_call, 0) => round,
            signal = &mut shutdown => {
                info!(signal, "shutting down");
                return Ok(ExitCode::SUCCESS);
            }
        };
        let ok = round.0.iter().all(CallOutcome::ok) && round.1.iter().all(TcpOutcome::ok);
        let out = json!({
            "service": app.name,
            "namespace": app.namespace,
            "ok": ok,
            "calls": round.0.iter().map(CallOutcome::to_json).collect::<Vec<_>>(),
            "tcp_calls": round.1.iter().map(TcpOutcome::to_json).collect::<Vec<_>>(),
        });
        println!(
            "{}",
            serde_json::to_string_pretty(&out).context("encoding the results")?
        );
        return Ok(if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        });
    }

    if !args.call.is_empty() || !args.tcp_call.is_empty() {
        for target in &args.call {
            info!(url = %target, every = %humantime(args.every), "calling");
        }
        for target in &args.tcp_call {
            info!(addr = %target, every = %humantime(args.every), "tcp-calling");
        }
        let client = call_loop(
            app.clone(),
            args.call.clone(),
            args.tcp_call.clone(),
            args.every,
        );
        tokio::spawn(client);
    }

    let signal = shutdown.await;
    info!(signal, "shutting down");
    Ok(ExitCode::SUCCESS)
}

/// Resolves on SIGTERM or SIGINT with the signal's name; installed before it is awaited.
fn shutdown_signal() -> Result<impl std::future::Future<Output = &'static str>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    })
}

async fn bind(ip: IpAddr, port: u16, what: &str) -> Result<TcpListener> {
    let addr = SocketAddr::new(ip, port);
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the {what} port {addr}"))?;
    let local = listener
        .local_addr()
        .with_context(|| format!("reading the {what} port {addr}"))?;
    info!(addr = %local, "listening {}", what.to_ascii_lowercase());
    Ok(listener)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
        .unwrap_or_else(|| "ambit-demo".to_string())
}

fn humantime(d: Duration) -> String {
    if d.subsec_millis() == 0 && d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// Sleeps a little after a failed `accept` (e.g. out of file descriptors) so the loop
/// does not spin; the listener itself stays usable.
async fn accept_backoff(what: &str, e: &std::io::Error) {
    warn!(error = %e, "{what} accept failed");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

// ---- HTTP server ----

async fn serve_http(listener: TcpListener, app: Arc<App>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                accept_backoff("http", &e).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let app = app.clone();
                async move { Ok::<_, std::convert::Infallible>(handle_http(&app, peer, req).await) }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                warn!(peer = %peer, error = ?net::describe_hyper(&e), "http connection failed");
            }
        });
    }
}

async fn handle_http(app: &App, peer: SocketAddr, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let start = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();

    let (status, body, content_type, calls) = if path == "/healthz" {
        (
            StatusCode::OK,
            Bytes::from_static(b"ok"),
            "text/plain; charset=utf-8",
            0,
        )
    } else {
        let calls = futures::future::join_all(
            app.forward
                .iter()
                .map(|t| net::http_get(t, app.timeout, &app.name)),
        )
        .await;
        let status = if calls.iter().all(CallOutcome::ok) {
            StatusCode::OK
        } else {
            // Say which hop broke: the access line below only counts the calls.
            for failed in calls.iter().filter(|c| !c.ok()) {
                failed.log_as("forward");
            }
            StatusCode::BAD_GATEWAY
        };
        let doc = json!({
            "service": app.name,
            "namespace": app.namespace,
            "path": path,
            "peer": peer.to_string(),
            "calls": calls.iter().map(CallOutcome::to_json).collect::<Vec<_>>(),
        });
        let mut text = doc.to_string();
        text.push('\n');
        (status, Bytes::from(text), "application/json", calls.len())
    };

    info!(
        method = %method,
        path = %path,
        peer = %peer,
        status = status.as_u16(),
        calls,
        ms = %Ms(start.elapsed()),
        "http"
    );
    let mut resp = Response::new(Full::new(body));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    // Which replica answered, as the L7 tests' app says it
    // (`ambit_tests::httpapp::SERVED_BY`): a canary split is countable.
    if let Ok(v) = HeaderValue::from_str(&app.name) {
        resp.headers_mut().insert("x-served-by", v);
    }
    resp
}

// ---- TCP echo server ----

async fn serve_tcp(listener: TcpListener) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                accept_backoff("tcp", &e).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(echo(stream, peer));
    }
}

/// Echoes until EOF, then closes the write side; logs one line per connection.
async fn echo(mut stream: TcpStream, peer: SocketAddr) {
    let start = Instant::now();
    let mut bytes: u64 = 0;
    let mut buf = vec![0u8; 16 * 1024];
    let result: std::io::Result<()> = async {
        loop {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            stream.write_all(buf.get(..n).unwrap_or_default()).await?;
            bytes += n as u64;
        }
        stream.shutdown().await
    }
    .await;
    match result {
        Ok(()) => info!(peer = %peer, bytes, ms = %Ms(start.elapsed()), "tcp echo"),
        Err(e) => warn!(
            peer = %peer,
            bytes,
            ms = %Ms(start.elapsed()),
            error = ?describe_io(&e),
            "tcp echo"
        ),
    }
}

// ---- clients ----

/// One round of calls: every URL and every TCP target, concurrently, each logged.
async fn call_round(
    app: &App,
    calls: &[HttpTarget],
    tcp_calls: &[TcpTarget],
    seq: u64,
) -> (Vec<CallOutcome>, Vec<TcpOutcome>) {
    let http = futures::future::join_all(
        calls
            .iter()
            .map(|t| net::http_get(t, app.timeout, &app.name)),
    );
    let tcp = futures::future::join_all(
        tcp_calls
            .iter()
            .map(|t| net::tcp_check(t, app.timeout, &app.name, seq)),
    );
    let (http, tcp) = tokio::join!(http, tcp);
    for outcome in &http {
        outcome.log();
    }
    for outcome in &tcp {
        outcome.log();
    }
    (http, tcp)
}

async fn call_loop(
    app: Arc<App>,
    calls: Vec<HttpTarget>,
    tcp_calls: Vec<TcpTarget>,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    loop {
        tick.tick().await;
        call_round(&app, &calls, &tcp_calls, seq).await;
        seq += 1;
    }
}
