//! A real Kubernetes API server for tests: kube-apiserver v1.36 on etcd,
//! started by the kit in `../shared/kube` (`up.sh`), one per test, each on
//! its own ports and state directory, stopped and purged when dropped
//! (also when the test fails).
//!
//! Everything the API server does is the real thing (schema validation,
//! server-side apply, RBAC, TokenRequest/TokenReview, discovery, status
//! subresources); nothing else of a cluster runs: a Deployment stays at 0
//! replicas, a Pod stays Pending unless a test writes its status.
//!
//! The kit is found at `$AMBIT_KUBE_KIT`, else `<workspace>/../shared/kube`.
//! A missing kit fails the test with what to do: it is never skipped.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::Duration;

use ambit_control::ControlConfig;
use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use kube::{Client, Config};
use serde_json::Value;

use crate::workspace_root;

static AUDIT_SEQ: AtomicU16 = AtomicU16::new(0);

/// How long `up.sh` may take (first run unpacks the binaries).
const START_LIMIT: Duration = Duration::from_secs(180);

/// The Gateway API CRDs `up.sh` installs (Istio's come with all but
/// [`Crds::None`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crds {
    /// Gateway API v1.6.1 standard channel: TCPRoute at `v1` only.
    Standard,
    /// v1.6.1 experimental channel: `v1alpha2` routes too.
    Experimental,
    /// v1.2.1 standard channel: no TCPRoute at all.
    V1_2_1,
    /// No CRDs at all (not even Istio's).
    None,
}

impl Crds {
    fn arg(self) -> &'static str {
        match self {
            Crds::Standard => "standard",
            Crds::Experimental => "experimental",
            Crds::V1_2_1 => "v1.2.1",
            Crds::None => "none",
        }
    }
}

/// Where the kit is.
pub fn kit() -> Result<PathBuf> {
    let dir = std::env::var_os("AMBIT_KUBE_KIT")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared/kube"));
    if !dir.join("up.sh").is_file() {
        bail!(
            "the Kubernetes test kit is not at {} (no up.sh): check out the shared folder beside the repository or set AMBIT_KUBE_KIT",
            dir.display()
        );
    }
    Ok(dir)
}

/// A port `p` with `p`, `p - 4000` and `p - 3999` free (the API server
/// and etcd's client and peer ports), different for every caller.
fn free_ports() -> Result<u16> {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 40_000 + (std::process::id() % 500) as u16 * 20;
    for _ in 0..2_000 {
        // Even ports only: p - 3999 of one is never p - 4000 of the next.
        let n = NEXT.fetch_add(2, Ordering::Relaxed) % 10_000;
        let p = 40_000 + (base - 40_000 + n) % 10_000;
        let free = [p, p - 4000, p - 3999]
            .iter()
            .all(|q| TcpListener::bind(("127.0.0.1", *q)).is_ok());
        if free {
            return Ok(p);
        }
    }
    bail!("no free port triple for an API server in 40000-49999")
}

/// One running API server.
pub struct KubeApiServer {
    kit: PathBuf,
    pub port: u16,
    /// The kit's state directory (pki, logs, pids, kubeconfig).
    pub state: PathBuf,
    /// The admin's kubeconfig (group `system:masters`).
    pub kubeconfig: PathBuf,
    /// `https://127.0.0.1:<port>`.
    pub server: String,
    keep: bool,
    audit_dir: Option<PathBuf>,
    /// The extra kube-apiserver flags it runs with.
    args: String,
}

impl std::fmt::Debug for KubeApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeApiServer")
            .field("server", &self.server)
            .finish()
    }
}

impl KubeApiServer {
    /// Starts one with `crds`.
    pub async fn start(crds: Crds) -> Result<Self> {
        Self::start_with(crds, "").await
    }

    /// Starts one with `crds` that writes an audit log of every request
    /// (metadata level: who, what, the answer's code); see
    /// [`Self::audit_events`].
    pub async fn start_audited(crds: Crds) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "ambit-test-audit-{}-{}",
            std::process::id(),
            AUDIT_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        let policy = dir.join("policy.yaml");
        std::fs::write(
            &policy,
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n- level: Metadata\n",
        )?;
        let args = format!(
            "--audit-policy-file={} --audit-log-path={} --audit-log-format=json --audit-log-mode=blocking",
            policy.display(),
            dir.join("audit.log").display()
        );
        let mut me = Self::start_with(crds, &args).await?;
        me.audit_dir = Some(dir);
        me.args = args;
        Ok(me)
    }

    /// Every audit event so far (only with [`Self::start_audited`]).
    pub fn audit_events(&self) -> Result<Vec<Value>> {
        let dir = self
            .audit_dir
            .as_ref()
            .context("this API server was not started with an audit log")?;
        let text = std::fs::read_to_string(dir.join("audit.log")).context("the audit log")?;
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect())
    }

    /// Starts one with `crds` and extra kube-apiserver flags (e.g. an
    /// audit policy).
    pub async fn start_with(crds: Crds, apiserver_args: &str) -> Result<Self> {
        let kit = kit()?;
        let port = free_ports()?;
        let state = std::env::temp_dir().join(format!("ambit-test-kube-{port}"));
        let _ = std::fs::remove_dir_all(&state);
        let me = KubeApiServer {
            kubeconfig: state.join("kubeconfig"),
            server: format!("https://127.0.0.1:{port}"),
            kit,
            port,
            state,
            keep: std::env::var_os("AMBIT_KEEP_KUBE").is_some(),
            audit_dir: None,
            args: apiserver_args.to_string(),
        };
        // From here on, Drop stops whatever up.sh started.
        me.up(crds, apiserver_args).await?;
        Ok(me)
    }

    fn script(&self, name: &str) -> Command {
        let mut c = Command::new("bash");
        c.arg(self.kit.join(name))
            .env("KUBE_PORT", self.port.to_string())
            .env("KUBE_STATE", &self.state)
            .stdin(Stdio::null());
        c
    }

    async fn up(&self, crds: Crds, apiserver_args: &str) -> Result<()> {
        let mut cmd = self.script("up.sh");
        cmd.args(["--crds", crds.arg()])
            .env("KUBE_APISERVER_ARGS", apiserver_args);
        run_bounded(cmd, START_LIMIT, "up.sh").await
    }

    /// Starts the API server again after [`Self::stop_apiserver`] (same
    /// etcd, same state, same flags); returns once it is ready.
    pub async fn restart_apiserver(&self) -> Result<()> {
        self.up(Crds::None, &self.args).await
    }

    /// Kills the API server process (etcd keeps running), as a crash or an
    /// upgrade would; returns once it is gone.
    pub fn stop_apiserver(&self) -> Result<()> {
        let pid_file = self.state.join("kube-apiserver.pid");
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .with_context(|| format!("reading {}", pid_file.display()))?
            .trim()
            .parse()
            .context("the API server's PID file")?;
        let pid = nix::unistd::Pid::from_raw(pid);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL)
            .context("killing the API server")?;
        for _ in 0..200 {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        bail!("the API server (pid {pid}) did not exit")
    }

    /// The API server's log (for failure messages).
    pub fn log_tail(&self) -> String {
        let text =
            std::fs::read_to_string(self.state.join("logs/kube-apiserver.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// The admin's client.
    pub async fn client(&self) -> Result<Client> {
        client_from(&self.kubeconfig).await
    }

    /// A token of ServiceAccount `ns/sa` from the TokenRequest API, for
    /// `audience` (the API server's own when `None`), bound to pod
    /// `ns/<pod>` when given.
    pub async fn token(
        &self,
        ns: &str,
        sa: &str,
        audience: Option<&str>,
        pod: Option<(&str, &str)>,
    ) -> Result<String> {
        let api: Api<ServiceAccount> = Api::namespaced(self.client().await?, ns);
        let req = TokenRequest {
            spec: TokenRequestSpec {
                audiences: audience.map(|a| vec![a.to_string()]).unwrap_or_default(),
                expiration_seconds: Some(3600),
                bound_object_ref: pod.map(|(name, uid)| BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(name.into()),
                    uid: Some(uid.into()),
                }),
            },
            ..TokenRequest::default()
        };
        let answer = tokio::time::timeout(
            Duration::from_secs(10),
            api.create_token_request(sa, &PostParams::default(), &req),
        )
        .await
        .map_err(|_| anyhow!("TokenRequest for {ns}/{sa}: no answer"))?
        .with_context(|| format!("TokenRequest for {ns}/{sa}"))?;
        answer
            .status
            .map(|s| s.token)
            .ok_or_else(|| anyhow!("TokenRequest for {ns}/{sa}: no token in the answer"))
    }

    /// A kubeconfig that authenticates as ServiceAccount `ns/sa` (an API
    /// server token), written to `out`.
    pub async fn kubeconfig_for(&self, ns: &str, sa: &str, out: &Path) -> Result<PathBuf> {
        let token = self.token(ns, sa, None, None).await?;
        let ca = std::fs::read(self.state.join("pki/ca.crt")).context("the kit's CA")?;
        use base64::Engine;
        let ca = base64::engine::general_purpose::STANDARD.encode(ca);
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster: {{server: \"{}\", certificate-authority-data: \"{ca}\"}}\nusers:\n- name: {ns}-{sa}\n  user: {{token: \"{token}\"}}\ncontexts:\n- name: test\n  context: {{cluster: test, user: {ns}-{sa}, namespace: {ns}}}\ncurrent-context: test\n",
            self.server
        );
        std::fs::write(out, text).with_context(|| format!("writing {}", out.display()))?;
        Ok(out.to_path_buf())
    }

    /// Server-side applies `doc` as the admin (field manager `test`).
    pub async fn apply(&self, doc: &Value) -> Result<DynamicObject> {
        apply_as(&self.client().await?, doc).await
    }
}

impl KubeApiServer {
    /// Installs Ambit's manifests as the admin, as `ambitctl install`
    /// does (the workloads stay at 0 replicas: nothing runs pods here).
    pub async fn install_ambit(&self) -> Result<()> {
        let docs = ambitctl::install::render(&ambitctl::install::Values::default())?;
        ambitctl::install::apply(&self.client().await?, &docs).await?;
        Ok(())
    }

    /// Creates pod `ns/name` on `node` (ServiceAccount `sa`) and writes its
    /// status through the status subresource as the kubelet would:
    /// Running, Ready, at `ip`. Returns its uid.
    pub async fn running_pod(
        &self,
        ns: &str,
        name: &str,
        sa: &str,
        node: &str,
        ip: &str,
        labels: Value,
    ) -> Result<String> {
        let doc = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {
                "nodeName": node,
                "serviceAccountName": sa,
                "automountServiceAccountToken": false,
                "containers": [{"name": "app", "image": "example.test/app:1",
                                "ports": [{"containerPort": 8080}]}],
            },
        });
        let created = self.apply(&doc).await?;
        let status = serde_json::json!({"status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "hostIP": "192.0.2.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        }});
        let (api, _) = api_of(&self.client().await?, &doc)?;
        tokio::time::timeout(
            Duration::from_secs(10),
            api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)),
        )
        .await
        .map_err(|_| anyhow!("writing the status of pod {ns}/{name}: no answer"))?
        .with_context(|| format!("writing the status of pod {ns}/{name}"))?;
        created
            .metadata
            .uid
            .ok_or_else(|| anyhow!("pod {ns}/{name} has no uid"))
    }

    /// A ztunnel pod `ambit-system/<name>` running on `node` at `ip`, and a
    /// token bound to it (audience `istio-ca`), as the DaemonSet projects it.
    pub async fn ztunnel_pod(&self, name: &str, node: &str, ip: &str) -> Result<String> {
        let uid = self
            .running_pod(
                "ambit-system",
                name,
                "ztunnel",
                node,
                ip,
                serde_json::json!({"app": "ztunnel"}),
            )
            .await?;
        self.token(
            "ambit-system",
            "ztunnel",
            Some("istio-ca"),
            Some((name, &uid)),
        )
        .await
    }

    /// Deletes pod `ns/name` at once, as the kubelet finishes a deletion
    /// (`--grace-period=0`): no kubelet runs here to end a graceful one.
    pub async fn delete_pod(&self, ns: &str, name: &str) -> Result<()> {
        let api: Api<Pod> = Api::namespaced(self.client().await?, ns);
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        };
        tokio::time::timeout(Duration::from_secs(10), api.delete(name, &params))
            .await
            .map_err(|_| anyhow!("deleting pod {ns}/{name}: no answer"))?
            .with_context(|| format!("deleting pod {ns}/{name}"))?;
        Ok(())
    }

    /// Merge-patches the object `doc` names (apiVersion, kind, metadata)
    /// with `patch`, as the admin.
    pub async fn patch(&self, doc: &Value, patch: &Value) -> Result<DynamicObject> {
        let (api, name) = api_of(&self.client().await?, doc)?;
        tokio::time::timeout(
            Duration::from_secs(10),
            api.patch(&name, &PatchParams::default(), &Patch::Merge(patch)),
        )
        .await
        .map_err(|_| anyhow!("patching {}: no answer", describe(doc)))?
        .with_context(|| format!("patching {}", describe(doc)))
    }

    /// The object `doc` names, as the API server holds it now.
    pub async fn get(&self, doc: &Value) -> Result<Option<Value>> {
        let (api, name) = api_of(&self.client().await?, doc)?;
        let obj = tokio::time::timeout(Duration::from_secs(10), api.get_opt(&name))
            .await
            .map_err(|_| anyhow!("reading {}: no answer", describe(doc)))?
            .with_context(|| format!("reading {}", describe(doc)))?;
        Ok(obj.map(|o| serde_json::to_value(o).unwrap_or(Value::Null)))
    }

    /// Applies `docs` as a user and the kubelet would: Namespaces first,
    /// then the rest; for each Pod its ServiceAccount (no controller makes
    /// `default` here), an image for each container (the local demo leaves
    /// it out), and its `status` through the status subresource.
    pub async fn apply_as_a_cluster(&self, docs: &[Value]) -> Result<()> {
        let mut docs = docs.to_vec();
        docs.sort_by_key(|d| d["kind"] != "Namespace");
        let client = self.client().await?;
        for d in &docs {
            if d["kind"] != "Pod" {
                self.apply(d).await?;
                continue;
            }
            let ns = d["metadata"]["namespace"]
                .as_str()
                .context("a pod's namespace")?;
            let name = d["metadata"]["name"].as_str().context("a pod's name")?;
            let sa = d["spec"]["serviceAccountName"]
                .as_str()
                .unwrap_or("default");
            self.apply(
                &serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": sa, "namespace": ns}}),
            )
            .await?;
            let mut pod = d.clone();
            let status = pod.as_object_mut().and_then(|o| o.remove("status"));
            if pod["spec"]["containers"]
                .as_array()
                .is_none_or(Vec::is_empty)
            {
                pod["spec"]["containers"] = serde_json::json!([{"name": "app"}]);
            }
            if let Some(cs) = pod["spec"]["containers"].as_array_mut() {
                for c in cs {
                    c["image"] = serde_json::json!("example.test/demo:1");
                }
            }
            self.apply(&pod).await?;
            if let Some(status) = status {
                let (api, _) = api_of(&client, &pod)?;
                tokio::time::timeout(
                    Duration::from_secs(10),
                    api.patch_status(
                        name,
                        &PatchParams::default(),
                        &Patch::Merge(&serde_json::json!({"status": status})),
                    ),
                )
                .await
                .map_err(|_| anyhow!("writing the status of pod {ns}/{name}: no answer"))?
                .with_context(|| format!("writing the status of pod {ns}/{name}"))?;
            }
        }
        Ok(())
    }

    /// The configuration of a control plane replica in Kubernetes mode,
    /// as ServiceAccount `ambit-system/ambit-control` (a kubeconfig with
    /// its own token, written in `dir`), with the tests' short Lease.
    pub async fn control_config(&self, dir: &Path, replica: &str) -> Result<ControlConfig> {
        let kc = self
            .kubeconfig_for(
                "ambit-system",
                "ambit-control",
                &dir.join(format!("control-{replica}.kubeconfig")),
            )
            .await?;
        Ok(ControlConfig::for_kube_tests(
            kc,
            dir.join(format!("data-{replica}")),
            replica,
        ))
    }

    /// Applies every CRD of a JSON file of the kit (`crds/istio.json`, ...)
    /// with the kit's own script, which waits until they are established.
    pub async fn apply_kit_crds(&self, file: &str) -> Result<()> {
        let mut cmd = Command::new("python3");
        cmd.arg(self.kit.join("apply-crds.py"))
            .arg(&self.server)
            .arg(self.state.join("pki/ca.crt"))
            .arg(self.state.join("admin.token"))
            .arg(self.kit.join("crds").join(file))
            .stdin(Stdio::null());
        run_bounded(cmd, Duration::from_secs(60), "apply-crds.py").await
    }
}

/// Server-side apply of one document through `client`, its resource named
/// by the document's apiVersion and kind.
pub async fn apply_as(client: &Client, doc: &Value) -> Result<DynamicObject> {
    let (api, name) = api_of(client, doc)?;
    tokio::time::timeout(
        Duration::from_secs(10),
        api.patch(
            &name,
            &PatchParams::apply("test").force(),
            &Patch::Apply(doc),
        ),
    )
    .await
    .map_err(|_| anyhow!("applying {}: no answer", describe(doc)))?
    .with_context(|| format!("applying {}", describe(doc)))
}

fn describe(doc: &Value) -> String {
    format!(
        "{} {}/{}",
        doc["kind"].as_str().unwrap_or("?"),
        doc["metadata"]["namespace"].as_str().unwrap_or(""),
        doc["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// The API of a document's kind and its name.
pub fn api_of(client: &Client, doc: &Value) -> Result<(Api<DynamicObject>, String)> {
    let api_version = doc["apiVersion"].as_str().context("no apiVersion")?;
    let kind = doc["kind"].as_str().context("no kind")?;
    let name = doc["metadata"]["name"].as_str().context("no name")?;
    // English plural of the lower-case kind, as CRDs and core kinds name
    // their resources (`serviceentries`, `gateways`).
    let lower = kind.to_ascii_lowercase();
    let plural = match lower.strip_suffix('y') {
        Some(stem) if !stem.ends_with(['a', 'e', 'i', 'o', 'u']) => format!("{stem}ies"),
        _ => format!("{lower}s"),
    };
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let ar = ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: api_version.into(),
        kind: kind.into(),
        plural,
    };
    let api = match doc["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    Ok((api, name.to_string()))
}

/// A client from a kubeconfig file.
pub async fn client_from(kubeconfig: &Path) -> Result<Client> {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    let mut cfg =
        Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await?;
    cfg.connect_timeout = Some(Duration::from_secs(5));
    cfg.read_timeout = Some(Duration::from_secs(30));
    Ok(Client::try_from(cfg)?)
}

/// Runs a kit script on a blocking thread, bounded by `limit`; its output
/// goes into the error when it fails.
async fn run_bounded(cmd: Command, limit: Duration, what: &str) -> Result<()> {
    let what = what.to_string();
    tokio::task::spawn_blocking(move || crate::cluster::run_checked(cmd, limit, &what).map(drop))
        .await
        .context("the kit script's thread")?
}

impl Drop for KubeApiServer {
    fn drop(&mut self) {
        if self.keep {
            eprintln!(
                "AMBIT_KEEP_KUBE: leaving the API server at {} (state {})",
                self.server,
                self.state.display()
            );
            return;
        }
        let mut cmd = self.script("down.sh");
        cmd.arg("--purge");
        if let Err(e) = crate::cluster::run_checked(cmd, Duration::from_secs(30), "down.sh") {
            eprintln!("stopping the API server at {}: {e:#}", self.server);
        }
        if let Some(dir) = &self.audit_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
