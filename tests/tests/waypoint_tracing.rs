//! Tracing at a real waypoint: with an OpenTelemetry provider in the mesh
//! config (`istio` ConfigMap) and a mesh-wide Telemetry selecting it,
//! upstream Envoy 1.40 reports one span per request to an OTLP/gRPC
//! collector — joining the caller's W3C trace, and handing its own span to
//! the app as the parent. Off until a Telemetry selects the provider, and
//! off again when it goes.
//!
//! ```text
//!  node-0                                           node-1
//!  orchestrator ─▶ ztunnel ══HBONE══▶ waypoint-0 (Envoy: OTel tracer) ──OTLP/gRPC──▶ otel-0 (collector,
//!  llm-v1 ◀─ ztunnel ◀══HBONE═══════════┘                                               outside the mesh)
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ambit_tests::httpapp::{Client, HttpApp};
use ambit_tests::meshbed::{MeshBed, PodSpec};
use ambit_tests::netbed;
use ambit_tests::otlp::Collector;
use anyhow::{Result, ensure};

const NS: &str = "shop";
const LLM: &str = "10.96.0.20";
const APP_PORT: u16 = 8080;
const OTLP_PORT: u16 = 4317;
/// The tracer's config type, present in a listener only when configured.
const TRACER: &str = "envoy.config.trace.v3.OpenTelemetryConfig";

fn llm() -> SocketAddr {
    SocketAddr::new(LLM.parse().unwrap(), 80)
}

fn pods() -> Vec<PodSpec> {
    vec![
        PodSpec::mesh("orchestrator-0", NS, 0, "orchestrator"),
        PodSpec::waypoint("waypoint-0", NS, 1, "waypoint"),
        PodSpec::mesh("llm-v1", NS, 0, "llm"),
        PodSpec::plain("otel-0", "observability", 1, "otel"),
    ]
}

fn mesh_yaml() -> String {
    format!(
        "apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: waypoint, namespace: {NS}}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{{name: mesh, port: 15008, protocol: HBONE}}]
---
apiVersion: v1
kind: Service
metadata:
  name: llm
  namespace: {NS}
  labels: {{istio.io/use-waypoint: waypoint}}
spec:
  clusterIP: {LLM}
  selector: {{app: llm}}
  ports: [{{name: http-api, port: 80, targetPort: {APP_PORT}}}]
---
apiVersion: v1
kind: Service
metadata: {{name: otel, namespace: observability}}
spec:
  clusterIP: 10.96.0.50
  selector: {{app: otel}}
  ports: [{{name: grpc-otlp, port: {OTLP_PORT}}}]
---
apiVersion: v1
kind: ConfigMap
metadata: {{name: istio, namespace: istio-system}}
data:
  mesh: |
    extensionProviders:
    - name: otel
      opentelemetry: {{service: otel.observability.svc.cluster.local, port: {OTLP_PORT}}}
"
    )
}

const TELEMETRY: &str = "apiVersion: telemetry.istio.io/v1
kind: Telemetry
metadata: {name: mesh-default, namespace: istio-system}
spec:
  tracing:
  - providers: [{name: otel}]
    randomSamplingPercentage: 100
";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waypoint_reports_request_spans_to_the_configured_collector() {
    if !netbed::can_run("a_waypoint_reports_request_spans_to_the_configured_collector") {
        return;
    }
    let mut bed = MeshBed::new(2, &pods()).unwrap();
    bed.start(&mesh_yaml()).await.unwrap();
    let app = HttpApp::start(bed.pod("llm-v1"), APP_PORT, "llm-v1").unwrap();
    let collector = Collector::start(bed.pod("otel-0"), OTLP_PORT).unwrap();
    let outcome = run(&mut bed, &app, &collector).await;
    if let Err(e) = outcome {
        if let Some(log) = bed.waypoint_log("waypoint-0") {
            eprintln!("---- waypoint-0: agent and Envoy log ----\n{log}");
        }
        panic!("{e:#}");
    }
    bed.shutdown().await;
}

async fn tracer_configured(bed: &MeshBed) -> Result<bool> {
    let dump = bed
        .waypoint("waypoint-0")
        .admin("/config_dump?resource=dynamic_listeners")
        .await?;
    Ok(dump.contains(TRACER))
}

async fn wait_tracer(bed: &MeshBed, want: bool) -> Result<Duration> {
    let t = Instant::now();
    ambit_tests::eventually(
        Duration::from_secs(10),
        if want {
            "the tracer in Envoy's config"
        } else {
            "the tracer gone from Envoy's config"
        },
        || async { (tracer_configured(bed).await.ok() == Some(want)).then_some(()) },
    )
    .await?;
    Ok(t.elapsed())
}

fn traceparent(trace: &str, span: &str) -> String {
    format!("00-{trace}-{span}-01")
}

async fn run(bed: &mut MeshBed, app: &HttpApp, collector: &Collector) -> Result<()> {
    bed.start_waypoint("waypoint-0").await?;
    let mut c = ambit_tests::eventually(
        Duration::from_secs(20),
        "a first request through the waypoint",
        || async {
            let mut c = Client::connect(bed.pod("orchestrator-0"), llm())
                .await
                .ok()?;
            let r = c.get("/", &[]).await.ok()?;
            (r.status == 200).then_some(c)
        },
    )
    .await?;
    // Off by default: a provider alone selects nothing.
    ensure!(
        !tracer_configured(bed).await?,
        "a tracer without any Telemetry"
    );
    let untraced = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    for _ in 0..3 {
        let tp = traceparent(untraced, "1111111111111111");
        ensure!(c.get("/", &[("traceparent", &tp)]).await?.status == 200);
    }
    // A mesh-wide Telemetry turns it on.
    bed.write_config("telemetry.yaml", TELEMETRY)?;
    let took = wait_tracer(bed, true).await?;
    println!("tracing: tracer configured {took:?} after the Telemetry was written");
    let mut c = Client::connect(bed.pod("orchestrator-0"), llm()).await?;
    let sent: Vec<(String, String)> = (0..10)
        .map(|i| {
            (
                format!("{:032x}", 0xabc0 + i),
                format!("{:016x}", 0x5150 + i),
            )
        })
        .collect();
    for (trace, span) in &sent {
        let r = c
            .get(
                "/v1/completions",
                &[("traceparent", &traceparent(trace, span))],
            )
            .await?;
        ensure!(r.status == 200, "traced request: {}", r.status);
    }
    for _ in 0..5 {
        ensure!(c.get("/health", &[]).await?.status == 200);
    }
    let spans = collector.wait_spans(15, Duration::from_secs(20)).await?;
    println!(
        "tracing: {} spans received; first: {:?}",
        spans.len(),
        spans[0]
    );
    ensure!(
        spans.iter().all(|s| s.service == "waypoint.shop"),
        "service names: {spans:?}"
    );
    ensure!(
        spans.iter().all(|s| s.trace_id() != untraced),
        "requests from before the Telemetry were traced"
    );
    let seen = app.traceparents();
    for (trace, span) in &sent {
        let mine: Vec<_> = spans.iter().filter(|s| &s.trace_id() == trace).collect();
        ensure!(mine.len() == 1, "trace {trace}: {} spans", mine.len());
        let s = mine[0];
        ensure!(
            &s.parent_span_id() == span,
            "trace {trace}: parent {}, sent {span}",
            s.parent_span_id()
        );
        ensure!(
            s.span.name == "llm.shop.svc.cluster.local:80/*",
            "trace {trace}: span name {:?}",
            s.span.name
        );
        ensure!(
            s.attribute("http.status_code").as_deref() == Some("200"),
            "trace {trace}: attributes {:?}",
            s.span.attributes
        );
        // The app got the trace with the waypoint's span as its parent.
        let want = traceparent(trace, &s.span_id());
        ensure!(seen.contains(&want), "the app never saw {want}: {seen:?}");
    }
    let fresh = spans
        .iter()
        .filter(|s| s.parent_span_id().is_empty() || s.parent_span_id() == "0000000000000000")
        .count();
    ensure!(
        fresh >= 5,
        "requests without a traceparent start traces: {fresh} root spans"
    );
    // Removing the Telemetry turns it off again.
    bed.write_config("telemetry.yaml", "")?;
    let took = wait_tracer(bed, false).await?;
    println!("tracing: tracer removed {took:?} after the Telemetry was deleted");
    Ok(())
}
