//! In-pod redirection (SPEC §4): the iptables rules and policy routing the
//! node agent installs inside each enrolled pod's network namespace, for
//! IPv4 and IPv6 alike (`family.rs` holds what differs per family).
//!
//! Commands (`ip`, `iptables-save`/`-restore`, `ip6tables-save`/`-restore`)
//! run as children of a short-lived thread that has entered the pod's
//! namespace ([`PodNetns::run_in`]), so any namespace path works
//! (`/var/run/netns/X`, `/proc/PID/ns/net`) and the agent's own threads
//! never move. Every public function blocks its thread (call it from
//! `spawn_blocking`) and finishes within the operation timeout
//! ([`set_operation_timeout`]): children run under
//! [`crate::subprocess::run`], killed at the deadline, and the `-restore`
//! tools wait at most [`XTABLES_WAIT_SECS`] for the xtables lock (`-w`;
//! `-save` takes no lock and has no `-w`).
//!
//! ```text
//! nat    PREROUTING -> AMBIT_PRERT       probe source, :15008, lo: RETURN; TCP -> REDIRECT :15006
//! nat    OUTPUT     -> AMBIT_OUTPUT      marked 0x539, loopback, -o lo: RETURN; TCP -> REDIRECT :15001
//! mangle PREROUTING -> AMBIT_MANGLE_PRERT  marked 0x539 (ztunnel's own sockets, looped over lo)
//!                                          -> connmark 0x111
//! mangle OUTPUT     -> AMBIT_MANGLE_OUT    marked 0x539: RETURN; connmark 0x111 -> restore mark
//! ip -4 rule fwmark 0x111/0xfff pref 32764 lookup 133;  table 133: local 0.0.0.0/0 dev lo
//! ip -6 rule fwmark 0x111/0xfff pref 32764 lookup 133;  table 133: local ::/0 dev lo
//! ```
//!
//! The same chains exist in `iptables` and `ip6tables`; only the loopback
//! range (`127.0.0.0/8`, `::1/128`) and the probe source
//! ([`PROBE_SOURCE`], [`PROBE_SOURCE_V6`]) differ. Both families are
//! installed for every enrolled pod, also one with only IPv4 addresses
//! (harmless: no IPv6 traffic matches), so a pod that gains an address of
//! the other family, or a dual-stack pod, is never partly outside the mesh.
//! A pod is never half-captured: when one family fails to install, what was
//! installed is removed again and the install fails ([`install`]);
//! [`is_installed`] is true only when both families are complete. Only a
//! kernel without IPv6 at all (no `/proc/sys/net/ipv6`) gets IPv4 alone.
//!
//! The connmark is set in mangle PREROUTING, which only ztunnel's
//! connections *into* the pod reach with their mark (they loop over `lo`;
//! packets from other namespaces arrive with mark 0). So the app's replies to
//! a transparent (original-source) delivery carry 0x111 and route back to
//! ztunnel's local socket, while ztunnel's outbound connections from the pod
//! never get a connmark and are never rerouted.

mod family;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ambit_inpod::PodNetns;

pub use family::{Family, Programs};

/// Why the redirection could not be read or changed.
#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    #[error("cannot open the pod network namespace {path}: {reason}")]
    Netns { path: PathBuf, reason: String },
    #[error("cannot run `{command}` in {netns}: {source} (are iproute2 and iptables installed?)")]
    Spawn {
        command: String,
        netns: String,
        #[source]
        source: std::io::Error,
    },
    #[error("in {netns}: {source}")]
    Child {
        netns: String,
        #[source]
        source: crate::subprocess::SubprocessError,
    },
    #[error("`{command}` failed in {netns} ({status}): {stderr}")]
    Failed {
        command: String,
        netns: String,
        status: String,
        stderr: String,
    },
    /// One family could not be installed; the whole redirection was rolled
    /// back so the pod is not half-captured.
    #[error(
        "installing the {family} redirection in {netns} failed, so the redirection of both \
         families was removed again (a pod is never half-captured) and the pod is not enrolled: \
         {source}{rollback}"
    )]
    Install {
        family: Family,
        netns: String,
        #[source]
        source: Box<RedirectError>,
        /// Empty when the rollback worked; otherwise what it left behind.
        rollback: String,
    },
}

type Result<T> = std::result::Result<T, RedirectError>;

/// A pod namespace the commands run in, and the deadline of the operation
/// (install, remove, check) they belong to.
struct Ns {
    netns: PodNetns,
    shown: String,
    deadline: Instant,
}

/// Default bound on one operation (every child it runs together).
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(4);
/// Seconds the `-restore` tools wait for the xtables lock (`-w`).
pub const XTABLES_WAIT_SECS: u64 = 2;

static OPERATION_TIMEOUT_MS: AtomicU64 = AtomicU64::new(4_000);

/// Sets the bound on one operation for the whole process (the node agent's
/// `--command-timeout-ms`).
pub fn set_operation_timeout(timeout: Duration) {
    let ms = u64::try_from(timeout.as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    OPERATION_TIMEOUT_MS.store(ms, Ordering::Relaxed);
}

/// The bound on one operation in force.
pub fn operation_timeout() -> Duration {
    Duration::from_millis(OPERATION_TIMEOUT_MS.load(Ordering::Relaxed))
}

impl Ns {
    fn open(path: &Path) -> Result<Self> {
        let netns = PodNetns::open(path).map_err(|e| RedirectError::Netns {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Ok(Self {
            netns,
            shown: path.display().to_string(),
            deadline: Instant::now() + operation_timeout(),
        })
    }
}

/// `SO_MARK` of ztunnel's sockets inside pods (Istio's value), the one
/// ztunnel sets (shared through `ambit-inpod`). Matched with [`MARK_MASK`].
pub use ambit_inpod::ZTUNNEL_MARK;
/// Connmark given to connections ztunnel delivers into the pod; restored
/// into the app's reply packets so they route to ztunnel's local socket.
pub const DELIVERY_MARK: u32 = 0x111;
/// Mask of the mark bits Ambit uses.
pub const MARK_MASK: u32 = 0xfff;
/// Policy-routing table with `local 0.0.0.0/0 dev lo` (and `local ::/0 dev lo`).
pub const ROUTE_TABLE: u32 = 133;
/// Priority of the `fwmark 0x111/0xfff lookup 133` rule (both families).
pub const RULE_PRIORITY: u32 = 32764;
/// Source address of kubelet probes after the node agent's SNAT; never redirected.
pub const PROBE_SOURCE: &str = "169.254.7.127";
/// The IPv6 probe source, never redirected: the address Istio's CNI agent
/// uses for the same purpose (SNAT of kubelet probes), kept for interop.
pub const PROBE_SOURCE_V6: &str = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff";

/// ztunnel's in-pod listener ports the rules redirect to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedirectPorts {
    /// Captured outbound TCP (15001).
    pub outbound: u16,
    /// Captured inbound plaintext TCP (15006).
    pub inbound_plaintext: u16,
    /// Inbound HBONE (15008), exempt from redirection.
    pub inbound_hbone: u16,
}

impl Default for RedirectPorts {
    fn default() -> Self {
        Self {
            outbound: 15001,
            inbound_plaintext: 15006,
            inbound_hbone: 15008,
        }
    }
}

/// One Ambit-owned chain and the builtin chain that jumps to it.
struct Chain {
    table: &'static str,
    builtin: &'static str,
    name: &'static str,
}

const CHAINS: [Chain; 4] = [
    Chain {
        table: "mangle",
        builtin: "PREROUTING",
        name: "AMBIT_MANGLE_PRERT",
    },
    Chain {
        table: "mangle",
        builtin: "OUTPUT",
        name: "AMBIT_MANGLE_OUT",
    },
    Chain {
        table: "nat",
        builtin: "PREROUTING",
        name: "AMBIT_PRERT",
    },
    Chain {
        table: "nat",
        builtin: "OUTPUT",
        name: "AMBIT_OUTPUT",
    },
];

const TABLES: [&str; 2] = ["mangle", "nat"];

/// The IPv4 rules inside Ambit's chains as `(table, line)`, spelled exactly
/// as `iptables-save` prints them; [`Family::rule_lines`] for either family.
pub fn rule_lines(ports: &RedirectPorts) -> Vec<(&'static str, String)> {
    Family::V4.rule_lines(ports)
}

/// The jumps from the builtin chains into Ambit's chains, as `(table, line)`
/// (the same in both families).
pub fn jump_lines() -> Vec<(&'static str, String)> {
    CHAINS
        .iter()
        .map(|c| (c.table, format!("-A {} -j {}", c.builtin, c.name)))
        .collect()
}

/// The families installed in every pod: both, unless the kernel has no IPv6.
pub fn families() -> Vec<Family> {
    if Path::new("/proc/sys/net/ipv6").exists() {
        vec![Family::V4, Family::V6]
    } else {
        vec![Family::V4]
    }
}

/// Installs (or repairs) the redirection of both families in network
/// namespace `netns` (its nsfs path, e.g. `/var/run/netns/NAME`).
/// Idempotent: re-running replaces the content of Ambit's chains in one
/// `iptables-restore` transaction per family (no window without
/// redirection) and leaves exactly one jump from each builtin chain. If a
/// family fails, everything is removed again and the error says so.
pub fn install(netns: &Path, ports: &RedirectPorts) -> Result<()> {
    install_with(netns, ports, &Programs::default())
}

/// [`install`] running `programs` (e.g. the `-legacy` iptables variants).
pub fn install_with(netns: &Path, ports: &RedirectPorts, programs: &Programs) -> Result<()> {
    let ns = &Ns::open(netns)?;
    let families = families();
    for (i, &f) in families.iter().enumerate() {
        let Err(e) = family::install(ns, f, ports, programs) else {
            continue;
        };
        // Undo this family's partial work and every family installed before.
        let rollback: Vec<String> = families[..=i]
            .iter()
            .filter_map(|&g| family::remove(ns, g, programs).err())
            .map(|e| e.to_string())
            .collect();
        let rollback = if rollback.is_empty() {
            String::new()
        } else {
            format!(
                "; removing it again also failed, so the pod may be half-captured: {} \
                 (run the node agent's uninstall or delete the pod)",
                rollback.join("; ")
            )
        };
        return Err(RedirectError::Install {
            family: f,
            netns: ns.shown.clone(),
            source: Box::new(e),
            rollback,
        });
    }
    Ok(())
}

/// Installs a sidecar pod's capture (`ambit_inpod::sidecar_capture`: its
/// app's TCP to the pod's Envoy on 15001/15006) for both families in
/// `netns`, in node-agent redirection mode: the node agent does what the
/// `istio-init` init container would, so the pod needs no NET_ADMIN.
/// Idempotent. The pod is not enrolled: its Envoy, not ztunnel, is its proxy.
pub fn install_sidecar(
    netns: &Path,
    ports: &ambit_inpod::sidecar_capture::SidecarPorts,
) -> Result<()> {
    let ns = &Ns::open(netns)?;
    let programs = Programs::default();
    for f in families() {
        family::install_sidecar(ns, f, ports, &programs)?;
    }
    Ok(())
}

/// Removes every trace of the redirection of both families from `netns`:
/// the jumps, Ambit's chains, the ip rules and the routes. Succeeds when
/// nothing is installed. A family that fails does not stop the other from
/// being removed; the first error is returned.
pub fn remove(netns: &Path) -> Result<()> {
    remove_with(netns, &Programs::default())
}

/// [`remove`] running `programs`.
pub fn remove_with(netns: &Path, programs: &Programs) -> Result<()> {
    let ns = &Ns::open(netns)?;
    let mut first = None;
    for f in families() {
        if let Err(e) = family::remove(ns, f, programs) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// Whether the redirection is fully in place in `netns` for both families:
/// every jump and chain, the ip rules and the routes. A partial install
/// (of one family, or one family only) reads as `false`.
pub fn is_installed(netns: &Path) -> Result<bool> {
    is_installed_with(netns, &Programs::default())
}

/// [`is_installed`] running `programs`.
pub fn is_installed_with(netns: &Path, programs: &Programs) -> Result<bool> {
    let ns = &Ns::open(netns)?;
    for f in families() {
        if !family::is_installed(ns, f, programs)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The lines of one table's section of an `iptables-save` dump.
fn table_lines<'a>(saved: &'a str, table: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    let header = format!("*{table}");
    saved
        .lines()
        .map(str::trim_end)
        .skip_while(move |l| *l != header)
        .skip(1)
        .take_while(|l| *l != "COMMIT")
}

fn count_in_table(saved: &str, table: &str, line: &str) -> usize {
    table_lines(saved, table).filter(|l| *l == line).count()
}

fn chain_exists(saved: &str, table: &str, chain: &str) -> bool {
    let decl = format!(":{chain} ");
    table_lines(saved, table).any(|l| l.starts_with(&decl))
}

/// Runs `program args` inside the namespace, feeding `stdin`, killed at the
/// operation's deadline; returns stdout, or an error naming the command
/// with its exit status and stderr (or the timeout).
fn run(netns: &Ns, program: &str, args: &[&str], stdin: Option<&str>) -> Result<String> {
    let command = format!("{program} {}", args.join(" "));
    let spawn_err = |source| RedirectError::Spawn {
        command: command.clone(),
        netns: netns.shown.clone(),
        source,
    };
    let child_err = |source| RedirectError::Child {
        netns: netns.shown.clone(),
        source,
    };
    let left = netns.deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(child_err(crate::subprocess::SubprocessError::TimedOut {
            command,
            timeout: operation_timeout(),
        }));
    }
    // A child inherits the namespace of the thread that forks it.
    let out = netns
        .netns
        .run_in(|| {
            Ok(crate::subprocess::run(
                Command::new(program).args(args),
                &command,
                stdin.map(str::as_bytes),
                left,
            ))
        })
        .map_err(spawn_err)?
        .map_err(child_err)?;
    if !out.status.success() {
        return Err(RedirectError::Failed {
            command,
            netns: netns.shown.clone(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
