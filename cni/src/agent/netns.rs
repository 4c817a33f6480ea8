//! Finding a running pod's network namespace without a CNI ADD (Kubernetes
//! mode: pods that ran before the agent, or before their namespace was
//! enrolled), the way istio-cni's node agent does.
//!
//! The container runtime does not publish a pod → netns mapping, but every
//! process of a pod sits in a cgroup whose path names the pod's uid: with
//! the systemd driver `.../kubepods-besteffort-pod<uid, '-' as '_'>.slice/...`,
//! with cgroupfs `/kubepods/besteffort/pod<uid>/<container>`. So:
//!
//! 1. scan `<proc>/<pid>/cgroup` for every pid and keep those naming the
//!    pod's uid (`hostPID` is not needed: the DaemonSet mounts the host's
//!    `/proc` at `/host/proc`);
//! 2. take the network namespace of the oldest such process (the sandbox's
//!    pause process, which lives as long as the pod) — `<proc>/<pid>/ns/net`;
//! 3. prefer a stable bind-mounted path to the same namespace (same device
//!    and inode) under the runtime's netns directories (`/var/run/netns`,
//!    `/run/netns`: containerd and CRI-O pin the pod netns there as
//!    `cni-<uuid>`), since it survives any process and is what the runtime
//!    passes as `CNI_NETNS`; fall back to the `/proc` path otherwise.
//!
//! A pod whose processes are all in the host's namespace (hostNetwork)
//! is not returned: the agent never redirects the node's own traffic.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Where to look.
#[derive(Debug, Clone)]
pub struct NetnsFinder {
    /// The host's `/proc` (mounted at `/host/proc` in the DaemonSet).
    pub proc_dir: PathBuf,
    /// Directories where the runtime pins pod namespaces.
    pub netns_dirs: Vec<PathBuf>,
}

impl Default for NetnsFinder {
    fn default() -> Self {
        Self {
            proc_dir: PathBuf::from("/proc"),
            netns_dirs: vec![PathBuf::from("/var/run/netns"), PathBuf::from("/run/netns")],
        }
    }
}

/// Why a pod's namespace could not be found.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("cannot list {path}: {source}; mount the host's /proc and pass --proc-dir")]
    Proc {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "no process of pod uid {uid} found under {proc_dir} (is the pod running on this node?)"
    )]
    NoProcess { uid: String, proc_dir: PathBuf },
    #[error("pod uid {uid} runs in the host's network namespace (hostNetwork); not enrolled")]
    HostNetwork { uid: String },
}

/// `true` when a cgroup file's text places the process in pod `uid`.
pub fn cgroup_names_pod(cgroup: &str, uid: &str) -> bool {
    if uid.is_empty() {
        return false;
    }
    let dashed = uid.to_ascii_lowercase();
    let underscored = dashed.replace('-', "_");
    cgroup.lines().any(|line| {
        let path = line.splitn(3, ':').nth(2).unwrap_or(line);
        path.split('/').any(|part| {
            // `kubepods-besteffort-pod<uid>.slice` or `pod<uid>`.
            let seg = part.strip_suffix(".slice").unwrap_or(part);
            seg.rsplit_once("pod")
                .is_some_and(|(_, id)| id == dashed || id == underscored)
        })
    })
}

impl NetnsFinder {
    /// The path of pod `uid`'s network namespace.
    pub fn find(&self, uid: &str) -> Result<PathBuf, NetnsError> {
        let entries = std::fs::read_dir(&self.proc_dir).map_err(|source| NetnsError::Proc {
            path: self.proc_dir.clone(),
            source,
        })?;
        // (start order, pid dir); the lowest pid is not always the oldest
        // (pid wrap), but the pause process is the oldest of the pod:
        // compare the start time of each candidate.
        let mut best: Option<(u64, PathBuf)> = None;
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if !name.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let dir = e.path();
            // Processes come and go while we scan: skip what vanished.
            let Ok(cgroup) = std::fs::read_to_string(dir.join("cgroup")) else {
                continue;
            };
            if !cgroup_names_pod(&cgroup, uid) {
                continue;
            }
            let started = start_time(&dir).unwrap_or(u64::MAX);
            if best.as_ref().is_none_or(|(t, _)| started < *t) {
                best = Some((started, dir));
            }
        }
        let Some((_, dir)) = best else {
            return Err(NetnsError::NoProcess {
                uid: uid.to_string(),
                proc_dir: self.proc_dir.clone(),
            });
        };
        let ns = dir.join("ns/net");
        let id = std::fs::metadata(&ns).ok().map(|m| (m.dev(), m.ino()));
        let host = std::fs::metadata(self.proc_dir.join("1/ns/net"))
            .ok()
            .map(|m| (m.dev(), m.ino()));
        if id.is_some() && id == host {
            return Err(NetnsError::HostNetwork {
                uid: uid.to_string(),
            });
        }
        if let Some(id) = id
            && let Some(pinned) = self.pinned(id)
        {
            return Ok(pinned);
        }
        Ok(ns)
    }

    /// A bind-mounted namespace file with this (device, inode).
    fn pinned(&self, id: (u64, u64)) -> Option<PathBuf> {
        self.netns_dirs.iter().find_map(|d| {
            std::fs::read_dir(d).ok()?.flatten().find_map(|e| {
                let m = std::fs::metadata(e.path()).ok()?;
                ((m.dev(), m.ino()) == id).then(|| e.path())
            })
        })
    }
}

/// The process's start time in clock ticks since boot (`stat` field 22).
fn start_time(dir: &Path) -> Option<u64> {
    let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields
    // after it start past the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "4f9c2a6e-1b7d-4c55-9a0e-3d2f1e0b9c8a";

    #[test]
    fn cgroup_paths_of_both_drivers_name_the_pod() {
        let systemd = "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod4f9c2a6e_1b7d_4c55_9a0e_3d2f1e0b9c8a.slice/cri-containerd-abc.scope\n";
        let cgroupfs =
            "12:memory:/kubepods/burstable/pod4f9c2a6e-1b7d-4c55-9a0e-3d2f1e0b9c8a/0123abcd\n";
        assert!(cgroup_names_pod(systemd, UID));
        assert!(cgroup_names_pod(cgroupfs, UID));
        assert!(!cgroup_names_pod(
            systemd,
            "4f9c2a6e-1b7d-4c55-9a0e-000000000000"
        ));
        assert!(!cgroup_names_pod("0::/user.slice/session-1.scope\n", UID));
        assert!(!cgroup_names_pod(systemd, ""));
    }

    #[test]
    fn finds_the_oldest_process_and_prefers_the_pinned_path() {
        let root = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let proc_dir = root.path().join("proc");
        let pinned_dir = root.path().join("netns");
        std::fs::create_dir_all(&pinned_dir).unwrap_or_else(|e| panic!("{e}"));
        // The "namespace" of the pod is a file; the pinned path a hard link.
        let ns_file = root.path().join("ns-of-pod");
        std::fs::write(&ns_file, "").unwrap_or_else(|e| panic!("{e}"));
        std::fs::hard_link(&ns_file, pinned_dir.join("cni-1234")).unwrap_or_else(|e| panic!("{e}"));
        let cg = format!("0::/kubepods/besteffort/pod{UID}/c1\n");
        for (pid, start, cgroup) in [
            ("1", 1, "0::/init.scope\n".to_string()),
            ("40", 900, cg.clone()),
            ("30", 500, cg.clone()),
            ("7", 100, "0::/kubepods/besteffort/podother/c\n".to_string()),
        ] {
            let d = proc_dir.join(pid);
            std::fs::create_dir_all(d.join("ns")).unwrap_or_else(|e| panic!("{e}"));
            std::fs::write(d.join("cgroup"), cgroup).unwrap_or_else(|e| panic!("{e}"));
            let stat = format!(
                "{pid} (pau se) S 1 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0\n"
            );
            std::fs::write(d.join("stat"), stat).unwrap_or_else(|e| panic!("{e}"));
        }
        std::fs::hard_link(&ns_file, proc_dir.join("30/ns/net")).unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(proc_dir.join("40/ns/net"), "").unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(proc_dir.join("1/ns/net"), "").unwrap_or_else(|e| panic!("{e}"));
        let finder = NetnsFinder {
            proc_dir: proc_dir.clone(),
            netns_dirs: vec![pinned_dir.clone()],
        };
        assert_eq!(
            finder.find(UID).unwrap_or_else(|e| panic!("{e}")),
            pinned_dir.join("cni-1234"),
            "pid 30 started first; its namespace is pinned"
        );
        let unpinned = NetnsFinder {
            proc_dir: proc_dir.clone(),
            netns_dirs: vec![],
        };
        assert_eq!(
            unpinned.find(UID).unwrap_or_else(|e| panic!("{e}")),
            proc_dir.join("30/ns/net")
        );
        assert!(matches!(
            finder.find("nope"),
            Err(NetnsError::NoProcess { .. })
        ));
    }
}
