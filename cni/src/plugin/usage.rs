//! What `ambit-cni` says to a person: `--help`, `--version`, or no
//! `CNI_COMMAND` at all. The container runtime always sets `CNI_COMMAND`
//! (and passes no arguments), so whenever it is set the plugin speaks CNI —
//! except that `--help` / `--version` typed at a terminal still get the text.

use std::ffi::OsString;

use super::Outcome;
use super::config::{OUR_VERSION, SUPPORTED_VERSIONS};
use crate::protocol::DEFAULT_AGENT_SOCKET;

/// The usage text.
pub fn usage() -> String {
    format!(
        "ambit-cni {pkg}: Ambit's chained CNI plugin (CNI spec {OUR_VERSION}; network configs with \
cniVersion {versions})

You do not run this by hand: the container runtime (containerd, CRI-O) execs it
from its CNI bin dir (e.g. /opt/cni/bin) for every pod sandbox, after the node's
primary CNI plugins, with CNI_COMMAND (ADD, DEL, CHECK, VERSION, STATUS, GC),
CNI_CONTAINERID, CNI_NETNS, CNI_IFNAME, CNI_ARGS and CNI_PATH in the environment
and the network configuration as JSON on stdin; it answers with the CNI result or
error JSON on stdout. For a Kubernetes pod it asks the node agent
(ambit-node-agent) over a unix socket, and the agent enrolls the pod in the mesh
before the answer. Without the agent an ADD fails (code 11, try again later)
unless \"allow_without_agent\" is set.

Where it goes: ambit-node-agent installs it. It copies this binary into the CNI
bin dir (--cni-bin-dir, default /opt/cni/bin) and appends an entry at the end of
\"plugins\" in the node's primary network config (--cni-conf-dir, default
/etc/cni/net.d), keeping it there while other CNIs rewrite the file:

  {{\"type\": \"ambit-cni\", \"ambit\": {{\"agent_socket\": \"{DEFAULT_AGENT_SOCKET}\"}}}}

Options in \"ambit\": agent_socket (default {DEFAULT_AGENT_SOCKET}),
agent_timeout_ms (default 5000), allow_without_agent (default false), log_file
(one JSON line per invocation).

Try it:  CNI_COMMAND=VERSION ambit-cni

Usage: ambit-cni [-h | --help | -V | --version]
",
        pkg = env!("CARGO_PKG_VERSION"),
        versions = SUPPORTED_VERSIONS.join(", "),
    )
}

/// The `--version` line.
pub fn version_line() -> String {
    format!(
        "ambit-cni {} (CNI spec {OUR_VERSION}; network configs with cniVersion {})\n",
        env!("CARGO_PKG_VERSION"),
        SUPPORTED_VERSIONS.join(", ")
    )
}

fn text(stdout: String) -> Outcome {
    Outcome {
        stdout: stdout.into_bytes(),
        ..Outcome::default()
    }
}

/// What to print for a person, or `None` when this is a CNI invocation.
/// `args` excludes the program name; `cni_command_set` is whether
/// `CNI_COMMAND` is in the environment at all (set to anything, even the
/// empty string or non-UTF-8, it is the runtime's call and CNI errors
/// apply).
pub fn for_person(
    args: &[OsString],
    cni_command_set: bool,
    stdout_is_terminal: bool,
) -> Option<Outcome> {
    let flag = match args {
        [] => None,
        [one] => Some(one.to_string_lossy()),
        _ => Some("".into()),
    };
    let asked = match flag.as_deref() {
        Some("-h" | "--help" | "help") => Some(text(usage())),
        Some("-V" | "--version") => Some(text(version_line())),
        _ => None,
    };
    if cni_command_set {
        // The runtime passes no arguments and never a terminal.
        return asked.filter(|_| stdout_is_terminal);
    }
    if args.is_empty() {
        return Some(text(usage()));
    }
    asked.or_else(|| {
        let shown: Vec<String> = args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        Some(Outcome {
            stderr: format!(
                "ambit-cni: unexpected argument(s) {shown:?}; the plugin takes none (the runtime \
                 passes everything in CNI_* variables and on stdin)\n\
                 Usage: ambit-cni [-h | --help | -V | --version]\n"
            )
            .into_bytes(),
            exit_code: 2,
            ..Outcome::default()
        })
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn args(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    fn out(o: &Outcome) -> String {
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    #[test]
    fn help_and_version_without_cni_command() {
        for flag in ["--help", "-h", "help"] {
            for tty in [true, false] {
                let o = for_person(&args(&[flag]), false, tty).unwrap();
                assert_eq!(o.exit_code, 0);
                assert!(out(&o).contains("container runtime"), "{}", out(&o));
                assert!(out(&o).contains("CNI_COMMAND"));
                assert!(out(&o).contains("/etc/cni/net.d"));
                assert!(!out(&o).trim_start().starts_with('{'), "not CNI JSON");
            }
        }
        for flag in ["--version", "-V"] {
            let o = for_person(&args(&[flag]), false, false).unwrap();
            assert_eq!(o.exit_code, 0);
            assert!(
                out(&o).starts_with(&format!("ambit-cni {}", env!("CARGO_PKG_VERSION"))),
                "{}",
                out(&o)
            );
        }
    }

    #[test]
    fn no_cni_command_and_no_arguments_is_usage() {
        let o = for_person(&[], false, false).unwrap();
        assert_eq!(o.exit_code, 0);
        assert!(out(&o).starts_with("ambit-cni "));
    }

    #[test]
    fn unknown_arguments_are_a_usage_error() {
        let o = for_person(&args(&["--frob"]), false, true).unwrap();
        assert_eq!(o.exit_code, 2);
        assert!(o.stdout.is_empty());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("--frob") && err.contains("Usage"), "{err}");
        let o = for_person(&args(&["--help", "x"]), false, true).unwrap();
        assert_eq!(o.exit_code, 2);
    }

    #[test]
    fn the_runtime_always_gets_cni() {
        // CNI_COMMAND set: no arguments, or arguments without a terminal,
        // are CNI invocations.
        assert!(for_person(&[], true, false).is_none());
        assert!(for_person(&[], true, true).is_none());
        assert!(for_person(&args(&["--help"]), true, false).is_none());
        assert!(for_person(&args(&["--frob"]), true, true).is_none());
        // A person at a terminal with CNI_COMMAND exported still gets help.
        let o = for_person(&args(&["--help"]), true, true).unwrap();
        assert_eq!(o.exit_code, 0);
    }
}
