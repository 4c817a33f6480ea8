//! CPU time and RSS of proxy pods' Envoy and agent, read from /proc:
//! every process in the pod's network namespace with that command name.
//! CPU is the sum of the threads' run time (`/proc/<pid>/task/*/schedstat`,
//! nanoseconds), so short runs at low rates are not lost in 10 ms ticks.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Meters the proxy pods (waypoints, sidecars) in `netns`, summed; nothing
/// for paths without one.
pub struct Meter {
    netns: Vec<PathBuf>,
}

/// One reading.
pub struct Sample {
    envoy: Proc,
    agent: Proc,
}

#[derive(Default, Clone, Copy)]
struct Proc {
    cpu_ns: u64,
    rss_kib: u64,
}

/// What the pod's processes used over a run.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    pub envoy_cpu_secs: f64,
    pub agent_cpu_secs: f64,
    /// At the end of the run.
    pub envoy_rss_mib: f64,
    pub agent_rss_mib: f64,
}

impl Usage {
    /// vCPU used per 1,000 requests a second: CPU seconds per second,
    /// divided by thousands of requests per second (= CPU seconds per
    /// 1,000 requests).
    pub fn per_k_rps(cpu_secs: f64, requests: usize) -> f64 {
        if requests == 0 {
            return 0.0;
        }
        cpu_secs / (requests as f64 / 1000.0)
    }
}

impl Meter {
    pub fn new(netns: Vec<PathBuf>) -> Meter {
        Meter { netns }
    }

    pub fn sample(&self) -> Option<Sample> {
        if self.netns.is_empty() {
            return None;
        }
        let sum = |comm: &str| {
            self.netns
                .iter()
                .map(|ns| read(ns, comm))
                .fold(Proc::default(), |a, b| Proc {
                    cpu_ns: a.cpu_ns + b.cpu_ns,
                    rss_kib: a.rss_kib + b.rss_kib,
                })
        };
        Some(Sample {
            envoy: sum("envoy"),
            agent: sum("ambit-agent"),
        })
    }

    pub fn usage(before: Option<Sample>, after: Option<Sample>) -> Option<Usage> {
        let (b, a) = (before?, after?);
        let secs = |x: u64, y: u64| y.saturating_sub(x) as f64 / 1e9;
        Some(Usage {
            envoy_cpu_secs: secs(b.envoy.cpu_ns, a.envoy.cpu_ns),
            agent_cpu_secs: secs(b.agent.cpu_ns, a.agent.cpu_ns),
            envoy_rss_mib: a.envoy.rss_kib as f64 / 1024.0,
            agent_rss_mib: a.agent.rss_kib as f64 / 1024.0,
        })
    }
}

/// CPU and RSS of the processes named `comm` in `netns`.
fn read(netns: &Path, comm: &str) -> Proc {
    let Ok(ns) = std::fs::metadata(netns) else {
        return Proc::default();
    };
    let mut sum = Proc::default();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let p = entry.path();
        let same_ns = std::fs::metadata(p.join("ns/net")).is_ok_and(|m| m.ino() == ns.ino());
        if !same_ns
            || std::fs::read_to_string(p.join("comm"))
                .unwrap_or_default()
                .trim()
                != comm
        {
            continue;
        }
        sum.cpu_ns += cpu_ns(&p);
        sum.rss_kib += std::fs::read_to_string(p.join("status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.split_whitespace().next()?.parse().ok())
            })
            .unwrap_or(0);
    }
    sum
}

/// Run time of every live thread of process `p` (its first schedstat field).
fn cpu_ns(p: &Path) -> u64 {
    let mut ns = 0;
    for task in std::fs::read_dir(p.join("task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        ns += std::fs::read_to_string(task.path().join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
    }
    ns
}
