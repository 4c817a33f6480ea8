//! In-pod redirection (SPEC §4): the iptables rules and policy routing the
//! node agent installs inside each enrolled pod's network namespace.
//!
//! Commands (`ip`, `iptables-save`, `iptables-restore`) run as children of a
//! short-lived thread that has entered the pod's namespace
//! ([`PodNetns::run_in`]), so any namespace path works (`/var/run/netns/X`,
//! `/proc/PID/ns/net`) and the agent's own threads never move. Every public
//! function blocks its thread (call it from `spawn_blocking`) and finishes
//! within the operation timeout ([`set_operation_timeout`]): children run
//! under [`crate::subprocess::run`], killed at the deadline, and
//! `iptables-restore` waits at most [`XTABLES_WAIT_SECS`] for the xtables
//! lock (`-w`; `iptables-save` takes no lock and has no `-w`).
//!
//! ```text
//! nat    PREROUTING -> AMBIT_PRERT       probe source, :15008, lo: RETURN; TCP -> REDIRECT :15006
//! nat    OUTPUT     -> AMBIT_OUTPUT      marked 0x539, 127/8, -o lo: RETURN; TCP -> REDIRECT :15001
//! mangle PREROUTING -> AMBIT_MANGLE_PRERT  marked 0x539 (ztunnel's own sockets, looped over lo)
//!                                          -> connmark 0x111
//! mangle OUTPUT     -> AMBIT_MANGLE_OUT    marked 0x539: RETURN; connmark 0x111 -> restore mark
//! ip rule fwmark 0x111/0xfff pref 32764 lookup 133;  table 133: local 0.0.0.0/0 dev lo
//! ```
//!
//! The connmark is set in mangle PREROUTING, which only ztunnel's
//! connections *into* the pod reach with their mark (they loop over `lo`;
//! packets from other namespaces arrive with mark 0). So the app's replies to
//! a transparent (original-source) delivery carry 0x111 and route back to
//! ztunnel's local socket, while ztunnel's outbound connections from the pod
//! never get a connmark and are never rerouted.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ambit_inpod::PodNetns;

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
/// Seconds `iptables-restore` waits for the xtables lock (`-w`).
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
/// Policy-routing table with `local 0.0.0.0/0 dev lo`.
pub const ROUTE_TABLE: u32 = 133;
/// Priority of the `fwmark 0x111/0xfff lookup 133` rule.
pub const RULE_PRIORITY: u32 = 32764;
/// Source address of kubelet probes after the node agent's SNAT; never redirected.
pub const PROBE_SOURCE: &str = "169.254.7.127";

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

/// The rules inside Ambit's chains as `(table, line)`, spelled exactly as
/// `iptables-save` prints them (so a save can be checked line by line).
pub fn rule_lines(ports: &RedirectPorts) -> Vec<(&'static str, String)> {
    let mark = format!("0x{ZTUNNEL_MARK:x}/0x{MARK_MASK:x}");
    let conn = format!("0x{DELIVERY_MARK:x}/0x{MARK_MASK:x}");
    let mask = format!("0x{MARK_MASK:x}");
    vec![
        (
            "mangle",
            format!("-A AMBIT_MANGLE_PRERT -m mark --mark {mark} -j CONNMARK --set-xmark {conn}"),
        ),
        (
            "mangle",
            format!("-A AMBIT_MANGLE_OUT -m mark --mark {mark} -j RETURN"),
        ),
        (
            "mangle",
            format!(
                "-A AMBIT_MANGLE_OUT -m connmark --mark {conn} -j CONNMARK --restore-mark \
                 --nfmask {mask} --ctmask {mask}"
            ),
        ),
        (
            "nat",
            format!("-A AMBIT_PRERT -s {PROBE_SOURCE}/32 -p tcp -j RETURN"),
        ),
        (
            "nat",
            format!(
                "-A AMBIT_PRERT -p tcp -m tcp --dport {} -j RETURN",
                ports.inbound_hbone
            ),
        ),
        ("nat", "-A AMBIT_PRERT -i lo -j RETURN".to_string()),
        (
            "nat",
            format!(
                "-A AMBIT_PRERT -p tcp -j REDIRECT --to-ports {}",
                ports.inbound_plaintext
            ),
        ),
        (
            "nat",
            format!("-A AMBIT_OUTPUT -p tcp -m mark --mark {mark} -j RETURN"),
        ),
        (
            "nat",
            "-A AMBIT_OUTPUT -d 127.0.0.0/8 -j RETURN".to_string(),
        ),
        ("nat", "-A AMBIT_OUTPUT -o lo -j RETURN".to_string()),
        (
            "nat",
            format!(
                "-A AMBIT_OUTPUT -p tcp -j REDIRECT --to-ports {}",
                ports.outbound
            ),
        ),
    ]
}

/// The jumps from the builtin chains into Ambit's chains, as `(table, line)`.
pub fn jump_lines() -> Vec<(&'static str, String)> {
    CHAINS
        .iter()
        .map(|c| (c.table, format!("-A {} -j {}", c.builtin, c.name)))
        .collect()
}

/// Installs (or repairs) the redirection in network namespace `netns`
/// (its nsfs path, e.g. `/var/run/netns/NAME`). Idempotent: re-running replaces the
/// content of Ambit's chains in one `iptables-restore` transaction (no window
/// without redirection) and leaves exactly one jump from each builtin chain.
pub fn install(netns: &Path, ports: &RedirectPorts) -> Result<()> {
    let netns = &Ns::open(netns)?;
    // Routing first: it only matters once the mangle rules mark replies.
    if !rule_present(netns)? {
        ip_rule(netns, "add")?;
    }
    ip(
        netns,
        &[
            "route",
            "replace",
            "local",
            "0.0.0.0/0",
            "dev",
            "lo",
            "table",
            &ROUTE_TABLE.to_string(),
        ],
    )?;

    let saved = iptables_save(netns)?;
    let rules = rule_lines(ports);
    let mut script = String::new();
    for table in TABLES {
        script.push_str(&format!("*{table}\n"));
        // With --noflush, declaring an existing user chain flushes it.
        for c in CHAINS.iter().filter(|c| c.table == table) {
            script.push_str(&format!(":{} - [0:0]\n", c.name));
        }
        for (_, line) in rules.iter().filter(|(t, _)| *t == table) {
            script.push_str(line);
            script.push('\n');
        }
        for c in CHAINS.iter().filter(|c| c.table == table) {
            let jump = format!("-A {} -j {}", c.builtin, c.name);
            match count_in_table(&saved, table, &jump) {
                0 => script.push_str(&format!("{jump}\n")),
                n => {
                    for _ in 1..n {
                        script.push_str(&format!("-D {} -j {}\n", c.builtin, c.name));
                    }
                }
            }
        }
        script.push_str("COMMIT\n");
    }
    iptables_restore(netns, &script)
}

/// Removes every trace of the redirection from `netns`: the jumps, Ambit's
/// chains, the ip rule and the route. Succeeds when nothing is installed.
pub fn remove(netns: &Path) -> Result<()> {
    let netns = &Ns::open(netns)?;
    let saved = iptables_save(netns)?;
    let mut script = String::new();
    for table in TABLES {
        let mut body = String::new();
        for c in CHAINS.iter().filter(|c| c.table == table) {
            let jump = format!("-A {} -j {}", c.builtin, c.name);
            for _ in 0..count_in_table(&saved, table, &jump) {
                body.push_str(&format!("-D {} -j {}\n", c.builtin, c.name));
            }
        }
        for c in CHAINS.iter().filter(|c| c.table == table) {
            if chain_exists(&saved, table, c.name) {
                body.push_str(&format!("-F {0}\n-X {0}\n", c.name));
            }
        }
        if !body.is_empty() {
            script.push_str(&format!("*{table}\n{body}COMMIT\n"));
        }
    }
    if !script.is_empty() {
        iptables_restore(netns, &script)?;
    }

    // `ip rule add` refuses duplicates, but be thorough if someone added more.
    for _ in 0..16 {
        if !rule_present(netns)? {
            break;
        }
        ip_rule(netns, "del")?;
    }
    if route_present(netns)? {
        ip(
            netns,
            &[
                "route",
                "del",
                "local",
                "0.0.0.0/0",
                "dev",
                "lo",
                "table",
                &ROUTE_TABLE.to_string(),
            ],
        )?;
    }
    Ok(())
}

/// Whether the redirection is fully in place in `netns`: every jump and
/// chain, the ip rule and the route. A partial install reads as `false`.
pub fn is_installed(netns: &Path) -> Result<bool> {
    let netns = &Ns::open(netns)?;
    let saved = iptables_save(netns)?;
    let chains = CHAINS.iter().all(|c| {
        chain_exists(&saved, c.table, c.name)
            && count_in_table(&saved, c.table, &format!("-A {} -j {}", c.builtin, c.name)) > 0
    });
    Ok(chains && rule_present(netns)? && route_present(netns)?)
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

fn rule_present(netns: &Ns) -> Result<bool> {
    let rules = ip(netns, &["rule", "show"])?;
    let want = format!("fwmark 0x{DELIVERY_MARK:x}/0x{MARK_MASK:x} lookup {ROUTE_TABLE}");
    let pref = format!("{RULE_PRIORITY}:");
    Ok(rules
        .lines()
        .any(|l| l.starts_with(&pref) && l.contains(&want)))
}

fn route_present(netns: &Ns) -> Result<bool> {
    let table = ROUTE_TABLE.to_string();
    match run(netns, "ip", &["route", "show", "table", &table], None) {
        Ok(routes) => Ok(routes
            .lines()
            .any(|l| l.starts_with("local default dev lo"))),
        // A table that never had a route does not exist yet.
        Err(RedirectError::Failed { stderr, .. }) if stderr.contains("does not exist") => Ok(false),
        Err(e) => Err(e),
    }
}

/// `ip rule add|del fwmark 0x111/0xfff pref 32764 lookup 133`.
fn ip_rule(netns: &Ns, op: &str) -> Result<String> {
    let mark = format!("0x{DELIVERY_MARK:x}/0x{MARK_MASK:x}");
    let (pref, table) = (RULE_PRIORITY.to_string(), ROUTE_TABLE.to_string());
    ip(
        netns,
        &["rule", op, "fwmark", &mark, "pref", &pref, "lookup", &table],
    )
}

fn ip(netns: &Ns, args: &[&str]) -> Result<String> {
    run(netns, "ip", args, None)
}

fn iptables_save(netns: &Ns) -> Result<String> {
    run(netns, "iptables-save", &[], None)
}

fn iptables_restore(netns: &Ns, script: &str) -> Result<()> {
    let wait = XTABLES_WAIT_SECS.to_string();
    run(
        netns,
        "iptables-restore",
        &["-w", &wait, "--noflush"],
        Some(script),
    )
    .map(|_| ())
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
