//! Load benchmarks (issue 14 item 3): how the mesh holds up under many
//! connections, a high connection rate, a flood of idle connections to the
//! control plane, and a long soak with config churn. The bed is the one of
//! `ambitctl local up` (`ambitctl::local`, as `mesh.rs` uses it): the real
//! `ambit-control`, two node agents and two `ztunnel`s as processes, pods
//! wired by the CNI reference plugins chained with `ambit-cni`. `mesh/client`
//! is on node-1 and `mesh/server` on node-2, so every app connection crosses
//! both ztunnels (outbound capture → pooled HBONE → inbound delivery) and
//! each process's RSS is its own.
//!
//! ```sh
//! cargo build --release --workspace --bins          # the binaries local mode runs
//! cargo bench -p ambit-benches --bench load -- idle      # a. 10k idle connections
//! cargo bench -p ambit-benches --bench load -- rate      # b. new connections/s, open loop
//! cargo bench -p ambit-benches --bench load -- xds-idle  # c. 10k idle conns to 15012 + a ztunnel syncing
//! cargo bench -p ambit-benches --bench load -- soak --duration 30m   # d. mixed traffic + config churn
//! ```
//!
//! No phase runs `idle`, `rate` and `xds-idle`. Options (also as
//! environment variables, upper case with `_`: `CONNS=10000`):
//! `--conns N` (a, c; default 10,000), `--hold SECS` (a, c: how long the
//! idle connections are held before measuring; default 10), `--rates
//! R1,R2,..` (b; default `1000,2000,3000,5000`), `--duration D` (b: per
//! rate, default 60 s; d: default 30 min; `90`, `90s`, `5m`), `--churn
//! SECS` (d; default 3), `--sources N` (c: source addresses of the flood,
//! comma-separated list of variants; default `1,200`), `--kinds
//! tcp,tls-stalled,tls-idle` (c), `--settle SECS` (a: how long RSS is
//! followed after the last app connections closed, past the HBONE pool's
//! 60 s idle timeout; default 75), `--rounds N` (a: rounds of app
//! connections on the same ztunnels, default 2), `--direct 0` (a: skip
//! the direct HBONE connections). `LOAD_LOG_DIR=DIR` copies each bed's
//! logs there when it is taken down (e.g. `MIMALLOC_SHOW_STATS=1`'s
//! report, which the ztunnels print at exit). Needs root, `ip`, `iptables` and the
//! CNI reference plugins (prints SKIP otherwise). The bench raises its
//! RLIMIT_NOFILE to 262,144 (soft and hard) where it may (root with
//! CAP_SYS_RESOURCE), else its soft limit to the hard one, before starting
//! the bed; the bed's processes inherit it. The echo app runs in a process
//! of its own (this binary re-executed in the server pod) so the two ends
//! of 10,000 connections do not share one file limit.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "load/bed.rs"]
mod bed;
#[allow(dead_code)]
#[path = "dataplane/load.rs"]
mod dpload;
#[path = "load/idle.rs"]
mod idle;
#[path = "load/rate.rs"]
mod rate;
#[path = "load/soak.rs"]
mod soak;
#[path = "load/xds_idle.rs"]
mod xds_idle;

use std::time::Duration;

use anyhow::{Context, Result, bail};

/// Command-line and environment options.
#[derive(Debug, Clone)]
pub struct Opts {
    pub phases: Vec<String>,
    pub conns: usize,
    pub hold: Duration,
    pub rates: Vec<f64>,
    pub duration: Option<Duration>,
    pub churn: Duration,
    pub sources: Vec<usize>,
    pub kinds: Vec<String>,
    pub settle: Duration,
    /// a: rounds of app connections on the same ztunnels.
    pub rounds: usize,
    /// a: also measure direct HBONE connections (on a fresh bed).
    pub direct: bool,
}

/// `90`, `90s`, `5m`, `1h`, `1.5m`.
pub fn parse_duration(s: &str) -> Result<Duration> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num
        .parse()
        .with_context(|| format!("not a duration: {s:?}"))?;
    Ok(Duration::from_secs_f64(v * mult))
}

fn list<T: std::str::FromStr>(s: &str) -> Result<Vec<T>> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            p.trim()
                .parse()
                .map_err(|_| anyhow::anyhow!("bad list item {p:?} in {s:?}"))
        })
        .collect()
}

impl Opts {
    fn parse() -> Result<Self> {
        let mut o = Opts {
            phases: Vec::new(),
            conns: 10_000,
            hold: Duration::from_secs(10),
            rates: vec![1000.0, 2000.0, 3000.0, 5000.0],
            duration: None,
            churn: Duration::from_secs(3),
            sources: vec![1, 200],
            kinds: vec!["tcp".into(), "tls-stalled".into(), "tls-idle".into()],
            settle: Duration::from_secs(75),
            rounds: 2,
            direct: true,
        };
        let mut set = |key: &str, v: &str| -> Result<()> {
            match key {
                "conns" => o.conns = v.parse().context("--conns")?,
                "hold" => o.hold = parse_duration(v)?,
                "rates" => o.rates = list(v)?,
                "duration" => o.duration = Some(parse_duration(v)?),
                "churn" => o.churn = parse_duration(v)?,
                "sources" => o.sources = list(v)?,
                "kinds" => o.kinds = list(v)?,
                "settle" => o.settle = parse_duration(v)?,
                "rounds" => o.rounds = v.parse::<usize>().context("--rounds")?.max(1),
                "direct" => o.direct = v != "0" && v != "false" && v != "no",
                _ => bail!("unknown option --{key}"),
            }
            Ok(())
        };
        for key in [
            "conns", "hold", "rates", "duration", "churn", "sources", "kinds", "settle", "rounds",
            "direct",
        ] {
            if let Ok(v) = std::env::var(key.to_uppercase()) {
                set(key, &v)?;
            }
        }
        let mut phases = Vec::new();
        if let Ok(p) = std::env::var("LOAD_PHASE") {
            phases.extend(p.split(',').map(|s| s.trim().to_string()));
        }
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            if a == "--bench" {
                continue; // cargo bench passes it
            }
            if let Some(key) = a.strip_prefix("--") {
                let (key, value) = match key.split_once('=') {
                    Some((k, v)) => (k.to_string(), v.to_string()),
                    None => (
                        key.to_string(),
                        args.next()
                            .with_context(|| format!("--{key} needs a value"))?,
                    ),
                };
                set(&key, &value)?;
            } else {
                phases.extend(a.split(',').map(|s| s.trim().to_string()));
            }
        }
        for p in &phases {
            if !["idle", "rate", "xds-idle", "soak"].contains(&p.as_str()) {
                bail!("unknown phase {p:?}: idle, rate, xds-idle or soak");
            }
        }
        if phases.is_empty() {
            phases = vec!["idle".into(), "rate".into(), "xds-idle".into()];
        }
        o.phases = phases;
        Ok(o)
    }
}

fn main() -> Result<()> {
    if std::env::var("AMBIT_LOAD_ROLE").as_deref() == Ok(bed::ECHO_ROLE) {
        return bed::echo_main();
    }
    if std::env::args().any(|a| a == "--list") {
        return Ok(()); // `cargo test --benches` discovery
    }
    let opts = Opts::parse()?;
    if !ambit_tests::netbed::can_run("load bench") {
        return Ok(());
    }
    let Some(bins) = bed::binaries()? else {
        return Ok(());
    };
    let (soft, hard) = bed::raise_nofile(262_144)?;
    println!(
        "RLIMIT_NOFILE {soft} (hard {hard}); the bed's processes (control plane, ztunnels) inherit it"
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!("machine: {}", rt.block_on(bed::machine_state()));
    for phase in opts.phases.clone() {
        println!("\n# phase {phase}\n");
        let t = std::time::Instant::now();
        let r = rt.block_on(async {
            match phase.as_str() {
                "idle" => idle::run(&bins, &opts).await,
                "rate" => rate::run(&bins, &opts).await,
                "xds-idle" => xds_idle::run(&bins, &opts).await,
                "soak" => soak::run(&bins, &opts).await,
                _ => unreachable!("checked in Opts::parse"),
            }
        });
        println!(
            "\nphase {phase}: {} in {:.0} s; machine after: {}",
            if r.is_ok() { "done" } else { "FAILED" },
            t.elapsed().as_secs_f64(),
            rt.block_on(bed::machine_state())
        );
        r?;
    }
    Ok(())
}
