//! `--call URL --count N`: N calls, one every `--every`, then one JSON line
//! saying how they went — how many each server answered, by status code,
//! and how many failed — and exit 0 only when every call got a 2xx (what a
//! traffic split or a rollback is checked with).

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};

use super::net::{self, HttpTarget};

/// Makes `count` calls to `target`; the summary and whether all were 2xx.
pub async fn count_calls(
    target: &HttpTarget,
    count: u64,
    every: Duration,
    timeout: Duration,
    caller: &str,
) -> (Value, bool) {
    let mut by_server: BTreeMap<String, u64> = BTreeMap::new();
    let mut by_status: BTreeMap<String, u64> = BTreeMap::new();
    let mut failed = 0u64;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for _ in 0..count {
        tick.tick().await;
        let outcome = net::http_get(target, timeout, caller).await;
        match outcome.status() {
            Some(code) => *by_status.entry(code.to_string()).or_default() += 1,
            None => failed += 1,
        }
        if outcome.ok() {
            let server = outcome.server().unwrap_or_else(|| "-".to_string());
            *by_server.entry(server).or_default() += 1;
        } else {
            outcome.log();
        }
    }
    let ok: u64 = by_server.values().sum();
    let summary = json!({
        "url": target.to_string(),
        "calls": count,
        "ok": ok,
        "failed": failed,
        "by_server": by_server,
        "by_status": by_status,
    });
    (summary, ok == count)
}
