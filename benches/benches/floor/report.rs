//! Figures of the four paths: medians over the repetitions, the table side
//! by side, ratios to the floor, and the goals met or missed.

/// The samples of one path, by measure, in the order first recorded.
#[derive(Default)]
pub struct Record {
    rows: Vec<(String, Vec<f64>)>,
}

impl Record {
    pub fn add(&mut self, key: &str, v: f64) {
        match self.rows.iter_mut().find(|(k, _)| k == key) {
            Some((_, vs)) => vs.push(v),
            None => self.rows.push((key.to_string(), vec![v])),
        }
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.rows.iter().map(|(k, _)| k.as_str())
    }

    fn samples(&self, key: &str) -> Option<&[f64]> {
        self.rows
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_slice())
    }

    /// Median of `key`, NaN when never recorded.
    pub fn median(&self, key: &str) -> f64 {
        self.samples(key).map(median).unwrap_or(f64::NAN)
    }

    /// Largest sample of `key`, NaN when never recorded.
    pub fn max(&self, key: &str) -> f64 {
        self.samples(key)
            .and_then(|v| v.iter().copied().reduce(f64::max))
            .unwrap_or(f64::NAN)
    }

    /// `median (min–max)`, or `-`.
    pub fn cell(&self, key: &str) -> String {
        let Some(v) = self.samples(key).filter(|v| !v.is_empty()) else {
            return "-".into();
        };
        let (lo, hi) = v
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(*x), hi.max(*x)));
        if v.len() == 1 {
            num(v[0])
        } else {
            format!("{} ({}–{})", num(median(v)), num(lo), num(hi))
        }
    }
}

pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(|a, b| a.total_cmp(b));
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    }
}

/// A figure with about three significant digits.
pub fn num(x: f64) -> String {
    if !x.is_finite() {
        "-".into()
    } else if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else if x.abs() >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

/// Prints the side-by-side table: one row per measure, one column per path.
pub fn table(names: &[&str], recs: &[&Record]) {
    let mut keys: Vec<&str> = Vec::new();
    for r in recs {
        for k in r.keys() {
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
    }
    println!("\n| measure | {} |", names.join(" | "));
    println!("|---|{}", "---|".repeat(names.len()));
    for k in keys {
        let cells: Vec<String> = recs.iter().map(|r| r.cell(k)).collect();
        println!("| {k} | {} |", cells.join(" | "));
    }
}

/// One goal line: what, the figure, the bound, met.
fn goal(what: &str, figure: String, bound: &str, met: Option<bool>) {
    let verdict = match met {
        Some(true) => "met",
        Some(false) => "**missed**",
        None => "n/a",
    };
    println!("| {what} | {figure} | {bound} | {verdict} |");
}

fn check(x: f64, ok: impl Fn(f64) -> bool) -> Option<bool> {
    x.is_finite().then(|| ok(x))
}

/// The goals for ztunnel, from the medians; `rate1k` is the
/// fixed rate the latency goals are stated at.
pub fn goals(plain: &Record, floor: &Record, tls: &Record, zt: &Record, rate1k: f64) {
    println!("\n| goal (ztunnel) | figure | bound | |\n|---|---|---|---|");
    let r = zt.median("bulk 1: Gbit/s") / tls.median("bulk 1: Gbit/s");
    goal(
        "bulk 1 stream vs floor+TLS",
        format!("{r:.2}×"),
        "≥ 0.9×",
        check(r, |r| r >= 0.9),
    );
    let key = "bulk 1: proxy CPU-s per GB";
    let r = zt.median(key) / tls.median(key);
    goal(
        "CPU-s per GB vs floor+TLS",
        format!("{r:.2}×"),
        "≤ 1.1×",
        check(r, |r| r <= 1.1),
    );
    let p50 = zt.median(&format!("rr {rate1k:.0}/s: p50 µs"))
        - plain.median(&format!("rr {rate1k:.0}/s: p50 µs"));
    let p99 = zt.median(&format!("rr {rate1k:.0}/s: p99 µs"))
        - plain.median(&format!("rr {rate1k:.0}/s: p99 µs"));
    goal(
        &format!("added p50 / p99 at {rate1k:.0} req/s"),
        format!("{p50:.0} / {p99:.0} µs"),
        "≤ 100 / 150 µs",
        check(p50 + p99, |_| p50 <= 100.0 && p99 <= 150.0),
    );
    let rps = zt.median("rr closed loop: req/s");
    let fl = floor.median("rr closed loop: req/s");
    goal(
        "max req/resp rate",
        format!(
            "{rps:.0}/s ({:.2}× floor, {:.2}× floor+TLS)",
            rps / fl,
            rps / tls.median("rr closed loop: req/s")
        ),
        "≥ 7,200/s or ≥ 0.9× floor",
        check(rps, |x| x >= 7200.0 || x >= 0.9 * fl),
    );
    let v = zt.median(&format!("rr {rate1k:.0}/s: proxy vCPU per 1k rps"));
    goal(
        "CPU per 1,000 rps (both ztunnels)",
        format!("{v:.3} vCPU ({:.3} each)", v / 2.0),
        "≤ 0.03 vCPU",
        check(v, |v| v <= 0.03),
    );
    let c = zt.median("new conns: per s");
    goal(
        "new connections/s, 8 at a time",
        format!("{c:.0}/s"),
        "≥ 6,700/s",
        check(c, |c| c >= 6700.0),
    );
    let b = zt.median("idle conn: KiB per connection (both ends)");
    goal(
        "memory per idle proxied connection (both ends)",
        format!("{:.1} KB ({:.1} KB each end)", b * 1.024, b * 1.024 / 2.0),
        "≤ 4 KB",
        check(b, |b| b * 1.024 <= 4.0),
    );
    let m = zt.median("idle RSS: MiB (largest end)");
    goal(
        "idle RSS per ztunnel",
        format!("{m:.1} MiB"),
        "≤ 8 MiB",
        check(m, |m| m <= 8.0),
    );
}

/// The short form's lines: a path's figures as ratios to a reference path
/// measured in the same run (noise shared by both cancels out).
pub fn ratios(title: &str, base: &Record, path: &Record) {
    println!("\n| {title} | ratio |\n|---|---|");
    for key in [
        "bulk 1: Gbit/s",
        "bulk 1: proxy CPU-s per GB",
        "bulk 4: Gbit/s",
        "rr closed loop: req/s",
        "new conns: per s",
        "new conns: proxy CPU-ms per 1k",
    ] {
        println!("| {key} | {:.2} |", path.median(key) / base.median(key));
    }
}
