//! `ambit-agent redirect`: the sidecar's traffic capture, programmed once by
//! the injected init container (`istio-init`) inside the pod's network
//! namespace, for IPv4 and IPv6 alike (nat table, `iptables-restore` and
//! `ip6tables-restore`). The rules are `ambit_inpod::sidecar_capture`'s
//! (the node agent installs the same ones in node-agent redirection mode).
//!
//! Running it again changes nothing: the chains are rewritten and the jumps
//! from PREROUTING/OUTPUT are added only when missing. It runs before any
//! async runtime (a one-shot command), so it blocks; every child process is
//! killed at [`COMMAND_TIMEOUT`].

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ambit_inpod::sidecar_capture::{IpFamily, SidecarPorts, jumps_present, nat_rules};
use clap::Parser;

/// Longest any iptables command may take (it waits up to 5 s for the
/// xtables lock itself).
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

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

impl RedirectArgs {
    fn ports(&self) -> SidecarPorts {
        SidecarPorts {
            proxy_uid: self.proxy_uid,
            outbound_port: self.outbound_port,
            inbound_port: self.inbound_port,
            exclude_inbound_ports: self.exclude_inbound_ports.clone(),
        }
    }
}

/// `(iptables-save, iptables-restore)` of a family.
fn programs(family: IpFamily) -> (&'static str, &'static str) {
    match family {
        IpFamily::V4 => ("iptables-save", "iptables-restore"),
        IpFamily::V6 => ("ip6tables-save", "ip6tables-restore"),
    }
}

/// Installs the capture for both families (IPv6 only where the kernel has
/// it), or prints it with `--dry-run`.
pub fn run(args: &RedirectArgs) -> Result<(), RedirectError> {
    let mut families = vec![IpFamily::V4];
    if std::path::Path::new("/proc/sys/net/ipv6").exists() {
        families.push(IpFamily::V6);
    }
    let ports = args.ports();
    for family in families {
        let (save, restore) = programs(family);
        if args.dry_run {
            println!("# {restore}\n{}", nat_rules(&ports, family, true));
            continue;
        }
        let saved = command(save, &["-t", "nat"], None)?;
        let input = nat_rules(&ports, family, !jumps_present(&saved));
        command(restore, &["--noflush", "-w", "5"], Some(&input))?;
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
    fn the_flags_become_the_capture_ports() {
        let args = RedirectArgs::parse_from(["redirect", "--exclude-inbound-ports", "15008,9000"]);
        let ports = args.ports();
        assert_eq!(ports.exclude_inbound_ports, vec![15008, 9000]);
        assert_eq!(
            (ports.proxy_uid, ports.outbound_port, ports.inbound_port),
            (1337, 15001, 15006)
        );
    }
}
