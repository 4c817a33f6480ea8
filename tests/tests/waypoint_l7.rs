//! L7 authorization and request telemetry at a real waypoint: the
//! seed's "only the orchestrator may call the LLM, and only on its
//! completion path" as AuthorizationPolicies bound to the waypoint, enforced
//! by upstream Envoy 1.40; Istio's request metrics on the waypoint's merged
//! metrics port (15020) for an 80/20 canary; one JSON access-log line per
//! request with the caller's and the endpoint's identities.
//!
//! ```text
//!  node-0                                      node-1
//!  orchestrator, batch ─▶ ztunnel ══HBONE══▶ waypoint-0 (agent + Envoy: RBAC, routes, stats)
//!                                              ══HBONE══▶ ztunnel ─▶ llm-v2
//!  llm-v1 ◀─ ztunnel ◀══HBONE═════════════════┘
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ambit_tests::httpapp::{Client, HttpApp, Reply};
use ambit_tests::meshbed::{MeshBed, PodSpec, metric_sum};
use ambit_tests::netbed;
use anyhow::{Context, Result, ensure};
use hyper::Method;

const NS: &str = "shop";
const LLM: &str = "10.96.0.20";
const APP_PORT: u16 = 8080;
const LLM_HOST: &str = "llm.shop.svc.cluster.local";
const ORCHESTRATOR_ID: &str = "spiffe://cluster.local/ns/shop/sa/orchestrator";

fn llm() -> SocketAddr {
    SocketAddr::new(LLM.parse().unwrap(), 80)
}

fn pods() -> Vec<PodSpec> {
    vec![
        PodSpec::mesh("orchestrator-0", NS, 0, "orchestrator"),
        PodSpec::mesh("batch-0", NS, 0, "batch"),
        PodSpec::waypoint("waypoint-0", NS, 1, "waypoint"),
        PodSpec::mesh("llm-v1", NS, 0, "llm"),
        PodSpec::mesh("llm-v2", NS, 1, "llm").version("v2"),
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
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {{name: llm, namespace: {NS}}}
spec:
  host: llm
  subsets:
  - {{name: v1, labels: {{version: v1}}}}
  - {{name: v2, labels: {{version: v2}}}}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{name: llm, namespace: {NS}}}
spec:
  hosts: [llm]
  http:
  - name: canary
    route:
    - {{destination: {{host: llm, subset: v1}}, weight: 80}}
    - {{destination: {{host: llm, subset: v2}}, weight: 20}}
---
"
    )
}

/// The policies: the orchestrator may POST under /v1/, the batch job may
/// GET outside /v1/ with its key (`batch` false: that rule is gone), and
/// nobody may touch /v1/admin (DENY wins over the ALLOW).
fn policies(batch: bool) -> String {
    let batch_rule = if batch {
        "  - from: [{source: {principals: [cluster.local/ns/shop/sa/batch]}}]
    to: [{operation: {methods: [GET], notPaths: [\"/v1/*\"]}}]
    when: [{key: \"request.headers[x-batch-key]\", values: [k1]}]
"
    } else {
        ""
    };
    format!(
        "apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: llm-callers, namespace: {NS}}}
spec:
  targetRefs: [{{kind: Service, group: \"\", name: llm}}]
  action: ALLOW
  rules:
  - from: [{{source: {{principals: [cluster.local/ns/shop/sa/orchestrator]}}}}]
    to: [{{operation: {{methods: [POST], paths: [\"/v1/*\"]}}}}]
{batch_rule}---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: no-admin, namespace: {NS}}}
spec:
  targetRefs: [{{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}}]
  action: DENY
  rules:
  - to: [{{operation: {{paths: [\"/v1/admin*\"]}}}}]
"
    )
}

async fn request(
    bed: &MeshBed,
    from: &str,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<Reply> {
    let mut c = Client::connect(bed.pod(from), llm()).await?;
    c.send(method, path, headers).await
}

async fn waypoint_metrics(bed: &MeshBed) -> Result<String> {
    let (status, body) = bed
        .waypoint("waypoint-0")
        .get("metrics", "/stats/prometheus")
        .await?;
    ensure!(status == 200, "the waypoint's 15020 answered {status}");
    Ok(body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn l7_policy_and_request_metrics_at_a_real_waypoint() {
    if !netbed::can_run("l7_policy_and_request_metrics_at_a_real_waypoint") {
        return;
    }
    let started = Instant::now();
    let mut bed = MeshBed::new(2, &pods()).unwrap();
    bed.write_config("authz.yaml", &policies(true)).unwrap();
    bed.start(&mesh_yaml()).await.unwrap();
    let apps = [
        HttpApp::start(bed.pod("llm-v1"), APP_PORT, "llm-v1").unwrap(),
        HttpApp::start(bed.pod("llm-v2"), APP_PORT, "llm-v2").unwrap(),
    ];
    let outcome = run(&mut bed, &apps).await;
    if let Err(e) = outcome {
        if let Some(log) = bed.waypoint_log("waypoint-0") {
            eprintln!("---- waypoint-0: agent and Envoy log ----\n{log}");
        }
        panic!("{e:#}");
    }
    println!("waypoint L7: total runtime {:?}", started.elapsed());
    bed.shutdown().await;
}

async fn run(bed: &mut MeshBed, apps: &[HttpApp; 2]) -> Result<()> {
    let t = Instant::now();
    bed.start_waypoint("waypoint-0").await?;
    println!("waypoint-0 ready in {:?}", t.elapsed());
    ambit_tests::eventually(
        Duration::from_secs(20),
        "the orchestrator's first completion via the waypoint",
        || async {
            let r = request(bed, "orchestrator-0", Method::POST, "/v1/completions", &[]).await;
            r.ok().filter(|r| r.status == 200)
        },
    )
    .await?;
    who_may_call_what(bed).await?;
    policy_edit_applies_on_a_live_connection(bed).await?;
    canary_metrics(bed, apps).await?;
    access_log_names_both_sides(bed)?;
    Ok(())
}

/// A request (from, method, path, headers) and the status it must get.
type Case<'a> = (&'a str, Method, &'a str, &'a [(&'a str, &'a str)], u16);

/// Allowed 200, denied 403 `RBAC: access denied`, each denial counted with
/// the policy that decided it.
async fn who_may_call_what(bed: &MeshBed) -> Result<()> {
    let key = [("x-batch-key", "k1")];
    let cases: [Case; 7] = [
        ("orchestrator-0", Method::POST, "/v1/completions", &[], 200),
        ("orchestrator-0", Method::GET, "/v1/completions", &[], 403),
        ("orchestrator-0", Method::POST, "/v1/admin/reset", &[], 403),
        ("batch-0", Method::GET, "/health", &key, 200),
        ("batch-0", Method::GET, "/health", &[], 403),
        ("batch-0", Method::GET, "/v1/completions", &key, 403),
        ("batch-0", Method::POST, "/v1/completions", &key, 403),
    ];
    let before = waypoint_metrics(bed).await?;
    for (from, method, path, headers, want) in &cases {
        let r = request(bed, from, method.clone(), path, headers).await?;
        println!("authz: {from} {method} {path} {headers:?} -> {}", r.status);
        ensure!(
            r.status == *want,
            "{from} {method} {path} {headers:?}: got {}, want {want}",
            r.status
        );
        if *want == 403 {
            ensure!(r.served_by.is_none(), "a denial reached the app");
        }
    }
    let after = waypoint_metrics(bed).await?;
    let denied = |policy: &str| {
        let labels = [("policy", policy), ("destination_service", LLM_HOST)];
        metric_sum(&after, "ambit_requests_denied_total", &labels)
            - metric_sum(&before, "ambit_requests_denied_total", &labels)
    };
    // DENY wins: the admin path is refused by no-admin although the
    // orchestrator's ALLOW rule matches it; the rest match no ALLOW rule.
    let (no_admin, none) = (denied("shop/no-admin"), denied("none"));
    println!("authz: denials counted: shop/no-admin {no_admin}, no ALLOW matched {none}");
    ensure!(
        no_admin == 1.0 && none == 4.0,
        "denials by policy: no-admin {no_admin} (want 1), none {none} (want 4)"
    );
    Ok(())
}

/// A policy edit reaches the next request on an open keep-alive connection
/// within 1 s of the YAML write (RDS), and the connection stays up.
async fn policy_edit_applies_on_a_live_connection(bed: &MeshBed) -> Result<()> {
    let key = [("x-batch-key", "k1")];
    let mut c = Client::connect(bed.pod("batch-0"), llm()).await?;
    let r = c.send(Method::GET, "/health", &key).await?;
    ensure!(r.status == 200, "before the edit: {}", r.status);
    let written = Instant::now();
    bed.write_config("authz.yaml", &policies(false))?;
    let mut requests = 0;
    let took = loop {
        let r = c
            .send(Method::GET, "/health", &key)
            .await
            .context("the keep-alive connection broke during the policy edit")?;
        requests += 1;
        if r.status == 403 {
            break written.elapsed();
        }
        ensure!(
            written.elapsed() < Duration::from_secs(5),
            "the edit did not apply within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!(
        "authz: policy edit applied to the live connection {took:?} after the write ({requests} requests on it)"
    );
    ensure!(
        took <= Duration::from_secs(1),
        "the edit took {took:?} (> 1 s)"
    );
    ensure!(c.is_open(), "the connection was closed by the edit");
    bed.write_config("authz.yaml", &policies(true))?;
    Ok(())
}

/// 2,000 completions through the 80/20 canary: `istio_requests_total` by
/// version equals what each version's app served, with Istio's labels;
/// byte and duration histograms count every request.
async fn canary_metrics(bed: &MeshBed, apps: &[HttpApp; 2]) -> Result<()> {
    const N: usize = 2_000;
    const CONNS: usize = 8;
    let before = settled_metrics(bed).await?;
    let hits_before = [apps[0].hits(), apps[1].hits()];
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..CONNS {
        let pod = bed.pod("orchestrator-0").clone();
        set.spawn(async move {
            let mut c = Client::connect(&pod, llm()).await?;
            let mut codes = Vec::with_capacity(N / CONNS);
            for _ in 0..N / CONNS {
                codes.push(c.send(Method::POST, "/v1/completions", &[]).await?.status);
            }
            Ok::<_, anyhow::Error>(codes)
        });
    }
    let mut ok = 0;
    while let Some(r) = set.join_next().await {
        ok += r??.iter().filter(|s| **s == 200).count();
    }
    ensure!(ok == N, "{ok} of {N} completions succeeded");
    let after = settled_metrics(bed).await?;
    let delta = |name: &str, labels: &[(&str, &str)]| {
        metric_sum(&after, name, labels) - metric_sum(&before, name, labels)
    };
    let base = [
        ("reporter", "waypoint"),
        ("source_workload", "orchestrator-0"),
        ("source_workload_namespace", NS),
        ("source_principal", ORCHESTRATOR_ID),
        ("destination_service", LLM_HOST),
        ("destination_service_name", "llm"),
        ("request_protocol", "http"),
        ("response_code", "200"),
        ("connection_security_policy", "mutual_tls"),
        ("route_name", "canary"),
    ];
    let mut by_version = Vec::new();
    for (i, version) in ["v1", "v2"].iter().enumerate() {
        let mut labels = base.to_vec();
        labels.push(("destination_version", version));
        labels.push((
            "destination_workload",
            if i == 0 { "llm-v1" } else { "llm-v2" },
        ));
        let counted = delta("istio_requests_total", &labels);
        let served = (apps[i].hits() - hits_before[i]) as f64;
        println!(
            "metrics: {version}: istio_requests_total +{counted}, the app served {served} ({:.1} %)",
            100.0 * counted / N as f64
        );
        ensure!(
            counted == served,
            "{version}: counted {counted}, served {served}"
        );
        by_version.push(counted);
    }
    let share = by_version[1] / N as f64;
    ensure!(
        (share - 0.20).abs() <= 0.03,
        "v2 got {:.1} % (want 20 ± 3 %)",
        share * 100.0
    );
    let all = [("reporter", "waypoint"), ("destination_service", LLM_HOST)];
    let total = delta("istio_requests_total", &all);
    ensure!(
        total == N as f64,
        "istio_requests_total rose by {total}, want {N}"
    );
    // Each app answers with its own name: 6 bytes a response, no request
    // body. Envoy's histogram sums are approximate (log-linear bins, ~1 %).
    let resp_bytes = delta("istio_response_bytes_sum", &all);
    let req_bytes = delta("istio_request_bytes_sum", &all);
    println!(
        "metrics: response bytes {resp_bytes} (want {}), request bytes {req_bytes}",
        6 * N
    );
    let want = (6 * N) as f64;
    ensure!(
        (resp_bytes - want).abs() <= want * 0.02 && req_bytes == 0.0,
        "bytes do not match what was sent"
    );
    let unknown_security = after
        .lines()
        .filter(|l| l.starts_with("istio_requests_total{"))
        .filter(|l| !l.contains("connection_security_policy=\"mutual_tls\""))
        .count();
    ensure!(unknown_security == 0, "a request series is not mutual_tls");
    Ok(())
}

/// The waypoint's metrics once every request counted has reached the
/// histograms too (they are merged every second; counters are current).
async fn settled_metrics(bed: &MeshBed) -> Result<String> {
    let all = [("reporter", "waypoint"), ("destination_service", LLM_HOST)];
    ambit_tests::eventually(
        Duration::from_secs(5),
        "the request histograms to count what istio_requests_total counts",
        || async {
            let text = waypoint_metrics(bed).await.ok()?;
            let requests = metric_sum(&text, "istio_requests_total", &all);
            [
                "istio_request_duration_milliseconds_count",
                "istio_request_bytes_count",
                "istio_response_bytes_count",
            ]
            .iter()
            .all(|h| metric_sum(&text, h, &all) == requests)
            .then_some(text)
        },
    )
    .await
}

/// One JSON line per request on Envoy's stdout, naming both identities.
fn access_log_names_both_sides(bed: &MeshBed) -> Result<()> {
    let log = bed.waypoint("waypoint-0").log();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| l.find('{').map(|i| &l[i..]))
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|v: &serde_json::Value| v.get("route_name").is_some())
        .collect();
    let completions = lines
        .iter()
        .filter(|v| v["path"] == "/v1/completions" && v["response_code"] == 200)
        .count();
    let sample = lines
        .iter()
        .find(|v| v["path"] == "/v1/completions" && v["response_code"] == 200)
        .context("no access-log line for a completion")?;
    println!("access log: {completions} completion lines; one: {sample}");
    ensure!(sample["source_principal"] == ORCHESTRATOR_ID, "{sample}");
    let dst = sample["destination_principal"].as_str().unwrap_or("");
    ensure!(dst == "spiffe://cluster.local/ns/shop/sa/llm", "{sample}");
    ensure!(
        sample["method"] == "POST" && sample["route_name"] == "canary",
        "{sample}"
    );
    let denied = lines
        .iter()
        .find(|v| v["path"] == "/v1/admin/reset")
        .context("no access-log line for the denied admin call")?;
    let details = denied["response_code_details"].as_str().unwrap_or("");
    ensure!(
        denied["response_code"] == 403 && details.contains("no-admin"),
        "{denied}"
    );
    Ok(())
}
