//! `ambitctl`: the Ambit command line (SPEC §6). This file parses flags and
//! dispatches to one module per command family in `commands/`; each of
//! those calls the library's module of the same name (`ambitctl::<family>`,
//! which does the work) and prints the result.
//!
//! A new family (`analyze`, `proxy-status`, `proxy-config`,
//! `ztunnel-config`, `authn`, `install`) is a variant of [`Command`], a
//! module `commands/<family>.rs` with its flags and printing, and the
//! library module `src/<family>/` with its work.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod commands;

#[derive(Debug, Parser)]
#[command(name = "ambitctl", version, about = "Ambit command line")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The command families, one module each in `commands/`.
#[derive(Debug, Subcommand)]
enum Command {
    /// A whole mesh on this host: nodes and pods as network namespaces,
    /// the control plane, node agents, ztunnels and demo apps as
    /// background processes. Needs root.
    #[command(subcommand)]
    Local(commands::local::LocalCmd),
    /// Finds config mistakes before they bite, in files or the live mesh.
    Analyze(commands::analyze::AnalyzeArgs),
    /// Every connected proxy and whether it took what it was sent.
    ProxyStatus(commands::proxy_status::ProxyStatusArgs),
    /// What an Envoy (waypoint or sidecar) holds: routes, clusters,
    /// listeners, endpoints, secrets.
    ProxyConfig(commands::proxy_config::ProxyConfigArgs),
    /// What a ztunnel holds: workloads, services, policies, certificates,
    /// and the connections it carried.
    ZtunnelConfig(commands::ztunnel_config::ZtunnelConfigArgs),
    /// Adds the Envoy sidecar to pods and pod templates in a file, as the
    /// injection webhook would.
    KubeInject(commands::kube_inject::KubeInjectArgs),
    /// Authentication checks.
    #[command(subcommand)]
    Authn(commands::authn::AuthnCmd),
    /// Installs the mesh on a Kubernetes cluster (server-side apply of
    /// deploy/kubernetes), or prints it with --dry-run.
    Install(commands::install::InstallArgs),
    /// Removes the mesh from a Kubernetes cluster, leaving every node's CNI
    /// configuration as it was before.
    Uninstall(commands::install::UninstallArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Local(cmd) => commands::local::run(cmd),
        Command::Analyze(args) => commands::analyze::run(args),
        Command::ProxyStatus(args) => commands::proxy_status::run(args),
        Command::ProxyConfig(args) => commands::proxy_config::run(args),
        Command::ZtunnelConfig(args) => commands::ztunnel_config::run(args),
        Command::KubeInject(args) => commands::kube_inject::run(args),
        Command::Authn(cmd) => commands::authn::run(cmd),
        Command::Install(args) => commands::install::install(args),
        Command::Uninstall(args) => commands::install::uninstall(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            // The library's error messages already carry their causes.
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::{Cli, Command};
    use crate::commands::local::LocalCmd;

    #[test]
    fn flags_are_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn local_up_defaults_to_the_demo_config() {
        let cli = Cli::try_parse_from(["ambitctl", "local", "up"]);
        assert!(
            matches!(
                cli,
                Ok(Cli {
                    command: Command::Local(LocalCmd::Up { ref dir, timeout_secs: 30, .. })
                }) if dir.as_os_str() == "deploy/local/demo"
            ),
            "{cli:?}"
        );
    }

    #[test]
    fn local_exec_takes_the_command_after_the_separator() {
        let cli = Cli::try_parse_from([
            "ambitctl", "local", "exec", "--name", "demo", "ns/pod", "--", "ip", "addr",
        ]);
        assert!(
            matches!(
                cli,
                Ok(Cli {
                    command: Command::Local(LocalCmd::Exec { ref pod, ref cmd, .. })
                }) if pod == "ns/pod" && cmd == &["ip", "addr"]
            ),
            "{cli:?}"
        );
    }
}
