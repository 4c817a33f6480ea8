//! Sidecar xDS size and build cost: a generated mesh of 1,000 services in
//! 20 namespaces (10,000 pods), one namespace of which runs sidecars (its
//! 500 pods carry the injection status annotation). For one sidecar of it:
//! resources and bytes per type its Envoy is served, with the default
//! visibility (its namespace and the root namespaces) and with none (an
//! Istio `Sidecar` in the root namespace with `egress.hosts: ['*/*']`), and
//! the snapshot build time with the sidecar sets in it.
//!
//! In process (the real translator and generator; no network).
//! Run: `cargo bench -p ambit-benches --bench sidecar_xds`.
//! Sizes: `PODS`, `SERVICES` environment variables.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use ambit_config::parse_documents;
use ambit_control::model::waypoint::{CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE};
use ambit_control::model::{ModelOptions, Snapshot, Store, build_snapshot};
use ambit_control::xds::sidecar::SidecarGenerator;
use ambit_control::xds::{Generator, ProxyNode};
use envoy_types::pb::envoy::config::core::v3::Node;

const NAMESPACES: usize = 20;
/// The namespace whose pods run sidecars (not ambient).
const SIDECAR_NS: usize = 1;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The mesh as YAML: namespaces (even ones ambient), services with two
/// HTTP ports, pods behind them; the sidecar namespace's pods injected.
fn mesh_yaml(pods: usize, services: usize) -> String {
    let (pods_per_ns, svcs_per_ns) = (pods / NAMESPACES, services / NAMESPACES);
    let mut y = String::new();
    for ns in 0..NAMESPACES {
        let ambient = if ns % 2 == 0 {
            "\n  labels: {istio.io/dataplane-mode: ambient}"
        } else {
            ""
        };
        let _ = write!(
            y,
            "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: ns-{ns}{ambient}\n"
        );
        for s in 0..svcs_per_ns {
            let app = ns * svcs_per_ns + s;
            let _ = write!(
                y,
                "---\napiVersion: v1\nkind: Service\nmetadata: {{name: svc-{app}, namespace: ns-{ns}}}\n\
                 spec:\n  clusterIP: 10.96.{}.{}\n  selector: {{app: svc-{app}}}\n  ports:\n  \
                 - {{name: http, port: 80, targetPort: 8080}}\n  - {{name: http-admin, port: 9090}}\n",
                app / 250,
                app % 250
            );
        }
        for p in 0..pods_per_ns {
            let i = ns * pods_per_ns + p;
            let app = ns * svcs_per_ns + p % svcs_per_ns.max(1);
            let injected = if ns == SIDECAR_NS {
                "\n  annotations: {sidecar.istio.io/status: '{}'}"
            } else {
                ""
            };
            let _ = write!(
                y,
                "---\napiVersion: v1\nkind: Pod\nmetadata:\n  name: pod-{i}\n  namespace: ns-{ns}\n  \
                 labels: {{app: svc-{app}, version: v1}}{injected}\nspec:\n  nodeName: node-{}\n  \
                 serviceAccountName: sa-{app}\nstatus:\n  podIP: 10.{}.{}.{}\n",
                i % 50,
                100 + i / 62500,
                (i / 250) % 250,
                i % 250
            );
        }
    }
    y
}

const NO_SCOPING: &str = "---
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: istio-system}
spec:
  egress:
  - hosts: ['*/*']
";

fn build(text: &str) -> (Snapshot, Duration) {
    let (objects, errors) = parse_documents(Path::new("mesh.yaml"), text);
    assert!(errors.is_empty(), "{errors:#?}");
    let store = Store::from_objects(objects);
    let opts = ModelOptions::default();
    let mut times = Vec::new();
    let mut snap = build_snapshot(&store, &Snapshot::default(), &opts);
    for _ in 0..5 {
        let t = Instant::now();
        snap = build_snapshot(&store, &Snapshot::default(), &opts);
        times.push(t.elapsed());
    }
    times.sort();
    (snap, times[times.len() / 2])
}

/// (resources, bytes) per type one sidecar of the sidecar namespace is served.
fn served(snap: &Snapshot, pod: usize, sa: &str) -> Vec<(&'static str, usize, usize)> {
    use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
    let claim = Value {
        kind: Some(Kind::StringValue(sa.to_string())),
    };
    let proxy = ProxyNode::from_node(Some(&Node {
        id: format!(
            "sidecar~10.100.0.{pod}~pod-{pod}.ns-{SIDECAR_NS}~ns-{SIDECAR_NS}.svc.cluster.local"
        ),
        metadata: Some(Struct {
            fields: [("SERVICE_ACCOUNT".to_string(), claim)]
                .into_iter()
                .collect(),
        }),
        ..Default::default()
    }));
    [
        ("cds", CLUSTER_TYPE),
        ("eds", ENDPOINT_TYPE),
        ("lds", LISTENER_TYPE),
        ("rds", ROUTE_TYPE),
    ]
    .into_iter()
    .map(|(label, ty)| {
        let s = SidecarGenerator.generate(&proxy, snap, ty);
        let bytes = s.set.by_name.values().map(|r| r.body.value.len()).sum();
        (label, s.set.by_name.len(), bytes)
    })
    .collect()
}

fn main() {
    let pods = env_usize("PODS", 10_000);
    let services = env_usize("SERVICES", 1_000);
    let mesh = mesh_yaml(pods, services);
    let pods_per_ns = pods / NAMESPACES;
    let sidecar_pod = SIDECAR_NS * pods_per_ns;
    println!(
        "{pods} pods, {services} services in {NAMESPACES} namespaces; {pods_per_ns} sidecar pods in ns-{SIDECAR_NS}"
    );
    let (base, base_time) = build(&mesh.replace(
        "annotations: {sidecar.istio.io/status: '{}'}",
        "annotations: {}",
    ));
    println!(
        "snapshot build without sidecars, median of 5: {:.1} ms",
        base_time.as_secs_f64() * 1e3
    );
    drop(base);
    for (label, text) in [
        ("default visibility (own namespace + root)", mesh.clone()),
        ("no scoping (Sidecar egress */*)", mesh.clone() + NO_SCOPING),
    ] {
        let (snap, t) = build(&text);
        // The first pod of the sidecar namespace runs as its first app's account.
        let sa = format!("sa-{}", SIDECAR_NS * (services / NAMESPACES));
        let per_type = served(&snap, sidecar_pod, &sa);
        let (n, bytes): (usize, usize) = per_type
            .iter()
            .fold((0, 0), |a, (_, n, b)| (a.0 + n, a.1 + b));
        println!(
            "{label}: snapshot build with {pods_per_ns} sidecars {:.1} ms; one sidecar is served {n} resources, {:.1} KiB",
            t.as_secs_f64() * 1e3,
            bytes as f64 / 1024.0
        );
        for (ty, n, b) in per_type {
            println!("  {ty}: {n} resources, {:.1} KiB", b as f64 / 1024.0);
        }
    }
}
