//! Network namespaces and links, with `ip` (iproute2).
//!
//! ```text
//!  <name>-lan: bridge lan0 ─────────────┬──────────────────── ...
//!                                        │ veth n<i> ↔ eth0
//!  <name>-<node>: eth0 172.31.0.(i+1)/24, cni0 <subnet>.1/24, ip_forward=1,
//!                 <subnet of node j> via 172.31.0.(j+1) for every other node j
//!                       │ (the CNI bridge plugin adds a veth per pod on cni0)
//!  <name>-<ns>-<pod>: eth0 <podIP>/24, default via <subnet>.1
//! ```

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Mutex;

use super::LocalError;
use super::plan::NodePlan;

/// Where `ip netns` keeps named namespaces.
pub const NETNS_DIR: &str = "/var/run/netns";

/// The file of named namespace `name`.
pub fn path(name: &str) -> std::path::PathBuf {
    std::path::Path::new(NETNS_DIR).join(name)
}

/// Serialises `ip netns add/del` within the process: the first `add` sets
/// up the shared mount of [`NETNS_DIR`], which races with itself.
static NETNS_LOCK: Mutex<()> = Mutex::new(());

/// Runs `cmd` (program first); returns stdout, or an error naming the
/// command with its exit status and stderr.
pub fn run(cmd: &[&str]) -> Result<String, LocalError> {
    let shown = cmd.join(" ");
    let Some((program, args)) = cmd.split_first() else {
        return Err(LocalError::Command {
            cmd: shown,
            status: "not run".into(),
            stderr: "empty command".into(),
        });
    };
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| LocalError::Command {
            cmd: shown.clone(),
            status: "not started".into(),
            stderr: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(LocalError::Command {
            cmd: shown,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `ip ARGS...`.
pub fn ip(args: &[&str]) -> Result<(), LocalError> {
    let mut cmd = vec!["ip"];
    cmd.extend_from_slice(args);
    run(&cmd).map(drop)
}

/// Creates netns `name` with `lo` up.
pub fn add(name: &str) -> Result<(), LocalError> {
    {
        let _guard = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        ip(&["netns", "add", name])?;
    }
    ip(&["-n", name, "link", "set", "lo", "up"])
}

/// Deletes netns `name` (its links go with it).
pub fn delete(name: &str) -> Result<(), LocalError> {
    let _guard = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    ip(&["netns", "del", name])
}

/// Every named netns (what `ip netns list` shows).
pub fn list() -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(NETNS_DIR)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect();
    out.sort();
    out
}

/// Whether netns `name` exists.
pub fn exists(name: &str) -> bool {
    Path::new(NETNS_DIR).join(name).exists()
}

/// Writes `value` to `/proc/sys/<key>` as seen from inside netns `ns`.
pub fn sysctl(ns: &str, key: &str, value: &str) -> Result<(), LocalError> {
    let script = format!("echo {value} > /proc/sys/{key}");
    run(&["ip", "netns", "exec", ns, "sh", "-c", &script]).map(drop)
}

/// The lan: netns `lan` with bridge `lan0`.
pub fn make_lan(lan: &str) -> Result<(), LocalError> {
    ip(&["-n", lan, "link", "add", "lan0", "type", "bridge"])?;
    ip(&["-n", lan, "link", "set", "lan0", "up"])
}

/// Node `node` in netns `ns` (already created): its veth into the lan,
/// `cni0` with the gateway address, forwarding on.
pub fn make_node(lan: &str, ns: &str, node: &NodePlan) -> Result<(), LocalError> {
    let port = format!("n{}", node.index);
    let lan_cidr = format!("{}/24", node.lan_ip);
    let gw_cidr = format!("{}/24", node.gateway);
    ip(&[
        "-n", lan, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", ns,
    ])?;
    ip(&["-n", lan, "link", "set", &port, "master", "lan0", "up"])?;
    ip(&["-n", ns, "addr", "add", &lan_cidr, "dev", "eth0"])?;
    ip(&["-n", ns, "link", "set", "eth0", "up"])?;
    ip(&["-n", ns, "link", "add", "cni0", "type", "bridge"])?;
    ip(&["-n", ns, "addr", "add", &gw_cidr, "dev", "cni0"])?;
    ip(&["-n", ns, "link", "set", "cni0", "up"])?;
    sysctl(ns, "net/ipv4/ip_forward", "1")
}

/// In `ns` (node `from`), a route to `to`'s pod subnet via its lan address.
pub fn route_to(ns: &str, to: &NodePlan) -> Result<(), LocalError> {
    let subnet = to.subnet_cidr();
    let via = to.lan_ip.to_string();
    ip(&["-n", ns, "route", "add", &subnet, "via", &via])
}

/// The TCP ports listening inside netns `ns` (from its `/proc/net/tcp`).
pub fn listening_ports(ns: &str) -> Vec<u16> {
    let Ok(text) = run(&["ip", "netns", "exec", ns, "cat", "/proc/net/tcp"]) else {
        return Vec::new();
    };
    // `sl local_address rem_address st ...`; st 0A = LISTEN.
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let local = f.nth(1)?;
            let st = f.nth(1)?;
            (st == "0A").then_some(())?;
            u16::from_str_radix(local.rsplit_once(':')?.1, 16).ok()
        })
        .collect()
}
