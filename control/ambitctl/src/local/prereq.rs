//! What `local up` needs on the host, each missing piece named with the
//! package or build step that provides it.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Stdio};

use super::LocalError;
use super::cni::{PLUGINS, REFERENCE_PLUGINS};

/// The binaries `local up` runs, from the bin dir.
pub const BINARIES: [&str; 6] = [
    "ambit-control",
    "ztunnel",
    "ambit-node-agent",
    "ambit-cni",
    "ambit-demo",
    "ambit-agent",
];

/// The waypoint controller's program (`ambitctl local waypoint-controller`),
/// also from the bin dir. Not in [`BINARIES`]: those are recognised as the
/// cluster's by their command line, and a user's `ambitctl local status
/// --state-dir ...` must not be (the controller carries the state dir in
/// its environment, which is how `down` finds it).
pub const CONTROLLER_BINARY: &str = "ambitctl";

/// Checks root, `ip`, `iptables`, the reference CNI plugins and the
/// binaries in `bin_dir`; the first missing one is the error.
pub fn prerequisites(bin_dir: &Path) -> Result<(), LocalError> {
    let uid = std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid());
    if uid != 0 {
        return Err(LocalError::NotRoot { uid });
    }
    for (tool, flag, package) in [("ip", "-V", "iproute2"), ("iptables", "-V", "iptables")] {
        let ok = Command::new(tool)
            .arg(flag)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return Err(LocalError::MissingTool { tool, package });
        }
    }
    for p in PLUGINS {
        let path = Path::new(REFERENCE_PLUGINS).join(p);
        if !path.exists() {
            return Err(LocalError::MissingPlugin { path });
        }
    }
    for name in BINARIES.iter().copied().chain([CONTROLLER_BINARY]) {
        if !bin_dir.join(name).is_file() {
            return Err(LocalError::MissingBinary {
                name,
                bin_dir: bin_dir.to_path_buf(),
            });
        }
    }
    Ok(())
}
