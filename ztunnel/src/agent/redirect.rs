//! `ambit-agent redirect`: the sidecar's traffic capture, programmed once by
//! the injected init container (`istio-init`) inside the pod's network
//! namespace, for IPv4 and IPv6 alike (nat table, `iptables-restore` and
//! `ip6tables-restore`):
//!
//! ```text
//! PREROUTING -> AMBIT_SIDECAR_IN        proxy ports (15008, 15020, 15021): RETURN
//!                                       other TCP -> AMBIT_SIDECAR_IN_REDIR -> REDIRECT :15006
//! OUTPUT     -> AMBIT_SIDECAR_OUT       from 127.0.0.6 / ::6 over lo (Envoy's inbound
//!                                       passthrough): RETURN
//!                                       Envoy (uid) over lo to the pod's own address:
//!                                       -> AMBIT_SIDECAR_IN_REDIR (inbound chains apply)
//!                                       the app over lo, Envoy's uid or gid, loopback: RETURN
//!                                       other TCP -> AMBIT_SIDECAR_OUT_REDIR -> REDIRECT :15001
//! ```
//!
//! Running it again changes nothing: the chains are rewritten and the jumps
//! from PREROUTING/OUTPUT are added only when missing. It runs before any
//! async runtime (a one-shot command), so it blocks; every child process is
//! killed at [`COMMAND_TIMEOUT`].

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;

/// Longest any iptables command may take (it waits up to 5 s for the
/// xtables lock itself).
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

const IN: &str = "AMBIT_SIDECAR_IN";
const IN_REDIR: &str = "AMBIT_SIDECAR_IN_REDIR";
const OUT: &str = "AMBIT_SIDECAR_OUT";
const OUT_REDIR: &str = "AMBIT_SIDECAR_OUT_REDIR";

/// Flags of `ambit-agent redirect`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "ambit-agent redirect",
    about = "Capture a sidecar pod's TCP traffic for its Envoy"
)]
pub struct RedirectArgs {
    /// The uid (and gid) Envoy runs as; its own connections are not captured.
    #[arg(long, default_value_t = 1337)]
    pub proxy_uid: u32,
    /// Where outbound connections are redirected (Envoy's virtualOutbound).
    #[arg(long, default_value_t = 15001)]
    pub outbound_port: u16,
    /// Where inbound connections are redirected (Envoy's virtualInbound).
    #[arg(long, default_value_t = 15006)]
    pub inbound_port: u16,
    /// Inbound ports left alone (the proxy's own: HBONE, metrics, readiness).
    #[arg(long, value_delimiter = ',', default_value = "15008,15020,15021")]
    pub exclude_inbound_ports: Vec<u16>,
    /// Print the rules instead of installing them.
    #[arg(long)]
    pub dry_run: bool,
}

/// Why the capture could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum RedirectError {
    #[error("cannot run `{command}`: {source} (is iptables installed in the image?)")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("`{command}` did not finish within {COMMAND_TIMEOUT:?}; killed")]
    Timeout { command: String },
}

/// One address family's programs and addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn save(self) -> &'static str {
        match self {
            Family::V4 => "iptables-save",
            Family::V6 => "ip6tables-save",
        }
    }

    fn restore(self) -> &'static str {
        match self {
            Family::V4 => "iptables-restore",
            Family::V6 => "ip6tables-restore",
        }
    }

    fn loopback(self) -> &'static str {
        match self {
            Family::V4 => "127.0.0.1/32",
            Family::V6 => "::1/128",
        }
    }

    /// The source Envoy binds for inbound passthrough connections.
    fn passthrough_source(self) -> &'static str {
        match self {
            Family::V4 => "127.0.0.6/32",
            Family::V6 => "::6/128",
        }
    }
}

/// The nat table rules for `family`, as `iptables-restore --noflush` input.
/// `with_jumps` adds the jumps from PREROUTING and OUTPUT.
pub fn rules(args: &RedirectArgs, family: Family, with_jumps: bool) -> String {
    let uid = args.proxy_uid;
    let lo = family.loopback();
    let mut r = String::from("*nat\n");
    for chain in [IN, IN_REDIR, OUT, OUT_REDIR] {
        r += &format!(":{chain} - [0:0]\n");
    }
    if with_jumps {
        r += &format!("-A PREROUTING -p tcp -j {IN}\n-A OUTPUT -p tcp -j {OUT}\n");
    }
    for port in &args.exclude_inbound_ports {
        r += &format!("-A {IN} -p tcp --dport {port} -j RETURN\n");
    }
    r += &format!("-A {IN} -p tcp -j {IN_REDIR}\n");
    r += &format!(
        "-A {IN_REDIR} -p tcp -j REDIRECT --to-ports {}\n",
        args.inbound_port
    );
    let src = family.passthrough_source();
    r += &format!("-A {OUT} -s {src} -o lo -j RETURN\n");
    r += &format!("-A {OUT} ! -d {lo} -o lo -m owner --uid-owner {uid} -j {IN_REDIR}\n");
    r += &format!("-A {OUT} -o lo -m owner ! --uid-owner {uid} -j RETURN\n");
    r += &format!("-A {OUT} -m owner --uid-owner {uid} -j RETURN\n");
    r += &format!("-A {OUT} -m owner --gid-owner {uid} -j RETURN\n");
    r += &format!("-A {OUT} -d {lo} -j RETURN\n");
    r += &format!("-A {OUT} -p tcp -j {OUT_REDIR}\n");
    r += &format!(
        "-A {OUT_REDIR} -p tcp -j REDIRECT --to-ports {}\n",
        args.outbound_port
    );
    r += "COMMIT\n";
    r
}

/// Installs the capture for both families (IPv6 only where the kernel has
/// it), or prints it with `--dry-run`.
pub fn run(args: &RedirectArgs) -> Result<(), RedirectError> {
    let mut families = vec![Family::V4];
    if std::path::Path::new("/proc/sys/net/ipv6").exists() {
        families.push(Family::V6);
    }
    for family in families {
        if args.dry_run {
            println!("# {}\n{}", family.restore(), rules(args, family, true));
            continue;
        }
        let saved = command(family.save(), &["-t", "nat"], None)?;
        let jumps_present = saved.contains(&format!("-A PREROUTING -p tcp -j {IN}"))
            && saved.contains(&format!("-A OUTPUT -p tcp -j {OUT}"));
        let input = rules(args, family, !jumps_present);
        command(family.restore(), &["--noflush", "-w", "5"], Some(&input))?;
    }
    Ok(())
}

/// Runs `program args` with `stdin`, killed at [`COMMAND_TIMEOUT`]; its stdout.
fn command(program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, RedirectError> {
    let name = format!("{program} {}", args.join(" "));
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| RedirectError::Spawn {
            command: name.clone(),
            source,
        })?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // The rules are a few hundred bytes: the pipe takes them at once.
        pipe.write_all(text.as_bytes())
            .map_err(|source| RedirectError::Spawn {
                command: name.clone(),
                source,
            })?;
    }
    // Drained while the child runs, so a large `-save` output cannot fill
    // the pipe and stall it until the deadline.
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let deadline = Instant::now() + COMMAND_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) | Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(RedirectError::Timeout { command: name });
            }
        }
    };
    let stdout = stdout.join().unwrap_or_default();
    if !status.success() {
        return Err(RedirectError::Failed {
            command: name,
            status: status.to_string(),
            stderr: String::from_utf8_lossy(&stderr.join().unwrap_or_default())
                .trim()
                .to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&stdout).into_owned())
}

/// Reads `pipe` to its end on a thread of its own.
fn drain(pipe: Option<impl Read + Send + 'static>) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut out = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut out);
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_exempt_the_proxy_and_its_ports_in_both_families() {
        let args = RedirectArgs::parse_from(["redirect"]);
        let v4 = rules(&args, Family::V4, true);
        assert!(v4.contains("-A AMBIT_SIDECAR_IN -p tcp --dport 15021 -j RETURN"));
        assert!(v4.contains("-A AMBIT_SIDECAR_OUT -m owner --uid-owner 1337 -j RETURN"));
        assert!(v4.contains("REDIRECT --to-ports 15001"));
        assert!(v4.contains("-A AMBIT_SIDECAR_OUT -s 127.0.0.6/32 -o lo -j RETURN"));
        let v6 = rules(&args, Family::V6, false);
        assert!(v6.contains("-A AMBIT_SIDECAR_OUT -s ::6/128 -o lo -j RETURN"));
        assert!(!v6.contains("-A PREROUTING"), "jumps only when asked");
    }
}
