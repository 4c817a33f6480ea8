//! What the redirection does per IP family: the rules (the same chains in
//! `iptables` and `ip6tables`; loopback range and probe source differ), the
//! policy rule and the `local` route, and installing, removing and checking
//! one family in a pod namespace.

use ambit_inpod::sidecar_capture::SidecarPorts;

use super::{
    CHAINS, DELIVERY_MARK, MARK_MASK, Ns, PROBE_SOURCE, PROBE_SOURCE_V6, ROUTE_TABLE,
    RULE_PRIORITY, RedirectError, RedirectPorts, Result, TABLES, ZTUNNEL_MARK, chain_exists,
    count_in_table, run,
};

/// An IP family the redirection is installed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    V4,
    V6,
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

impl Family {
    /// `ip`'s family flag.
    fn ip_flag(self) -> &'static str {
        match self {
            Family::V4 => "-4",
            Family::V6 => "-6",
        }
    }

    /// Every address of the family, as the `local` route's prefix.
    fn any(self) -> &'static str {
        match self {
            Family::V4 => "0.0.0.0/0",
            Family::V6 => "::/0",
        }
    }

    /// The loopback range, as `iptables-save` prints it.
    fn loopback(self) -> &'static str {
        match self {
            Family::V4 => "127.0.0.0/8",
            Family::V6 => "::1/128",
        }
    }

    /// The probe source as a host prefix, as `iptables-save` prints it.
    fn probe_source(self) -> String {
        match self {
            Family::V4 => format!("{PROBE_SOURCE}/32"),
            Family::V6 => format!("{PROBE_SOURCE_V6}/128"),
        }
    }

    /// The rules inside Ambit's chains as `(table, line)`, spelled exactly
    /// as `iptables-save` / `ip6tables-save` print them (so a save can be
    /// checked line by line).
    pub fn rule_lines(self, ports: &RedirectPorts) -> Vec<(&'static str, String)> {
        let mark = format!("0x{ZTUNNEL_MARK:x}/0x{MARK_MASK:x}");
        let conn = format!("0x{DELIVERY_MARK:x}/0x{MARK_MASK:x}");
        let mask = format!("0x{MARK_MASK:x}");
        vec![
            (
                "mangle",
                format!(
                    "-A AMBIT_MANGLE_PRERT -m mark --mark {mark} -j CONNMARK --set-xmark {conn}"
                ),
            ),
            (
                "mangle",
                format!("-A AMBIT_MANGLE_OUT -m mark --mark {mark} -j RETURN"),
            ),
            (
                "mangle",
                format!(
                    "-A AMBIT_MANGLE_OUT -m connmark --mark {conn} -j CONNMARK --restore-mark \
                     --nfmask {mask} --ctmask {mask}"
                ),
            ),
            (
                "nat",
                format!("-A AMBIT_PRERT -s {} -p tcp -j RETURN", self.probe_source()),
            ),
            (
                "nat",
                format!(
                    "-A AMBIT_PRERT -p tcp -m tcp --dport {} -j RETURN",
                    ports.inbound_hbone
                ),
            ),
            ("nat", "-A AMBIT_PRERT -i lo -j RETURN".to_string()),
            (
                "nat",
                format!(
                    "-A AMBIT_PRERT -p tcp -j REDIRECT --to-ports {}",
                    ports.inbound_plaintext
                ),
            ),
            (
                "nat",
                format!("-A AMBIT_OUTPUT -p tcp -m mark --mark {mark} -j RETURN"),
            ),
            (
                "nat",
                format!("-A AMBIT_OUTPUT -d {} -j RETURN", self.loopback()),
            ),
            ("nat", "-A AMBIT_OUTPUT -o lo -j RETURN".to_string()),
            (
                "nat",
                format!(
                    "-A AMBIT_OUTPUT -p tcp -j REDIRECT --to-ports {}",
                    ports.outbound
                ),
            ),
        ]
    }
}

/// The programs the redirection runs. The defaults are the ones on `PATH`
/// (`iptables` is iptables-nft on current distributions); a node whose
/// other rules live in the legacy backend names the `-legacy` variants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Programs {
    pub ip: String,
    pub iptables_save: String,
    pub iptables_restore: String,
    pub ip6tables_save: String,
    pub ip6tables_restore: String,
}

impl Default for Programs {
    fn default() -> Self {
        Self {
            ip: "ip".into(),
            iptables_save: "iptables-save".into(),
            iptables_restore: "iptables-restore".into(),
            ip6tables_save: "ip6tables-save".into(),
            ip6tables_restore: "ip6tables-restore".into(),
        }
    }
}

impl Programs {
    fn save(&self, f: Family) -> &str {
        match f {
            Family::V4 => &self.iptables_save,
            Family::V6 => &self.ip6tables_save,
        }
    }

    fn restore(&self, f: Family) -> &str {
        match f {
            Family::V4 => &self.iptables_restore,
            Family::V6 => &self.ip6tables_restore,
        }
    }
}

/// One family's commands in one namespace.
struct Fam<'a> {
    ns: &'a Ns,
    f: Family,
    p: &'a Programs,
}

impl Fam<'_> {
    /// `ip -4|-6 ARGS`.
    fn ip(&self, args: &[&str]) -> Result<String> {
        let mut full = vec![self.f.ip_flag()];
        full.extend_from_slice(args);
        run(self.ns, &self.p.ip, &full, None)
    }

    fn save(&self) -> Result<String> {
        run(self.ns, self.p.save(self.f), &[], None)
    }

    fn restore(&self, script: &str) -> Result<()> {
        let wait = super::XTABLES_WAIT_SECS.to_string();
        run(
            self.ns,
            self.p.restore(self.f),
            &["-w", &wait, "--noflush"],
            Some(script),
        )
        .map(|_| ())
    }

    fn rule_present(&self) -> Result<bool> {
        let rules = self.ip(&["rule", "show"])?;
        let want = format!("fwmark 0x{DELIVERY_MARK:x}/0x{MARK_MASK:x} lookup {ROUTE_TABLE}");
        let pref = format!("{RULE_PRIORITY}:");
        Ok(rules
            .lines()
            .any(|l| l.starts_with(&pref) && l.contains(&want)))
    }

    /// `ip rule add|del fwmark 0x111/0xfff pref 32764 lookup 133`.
    fn rule(&self, op: &str) -> Result<String> {
        let mark = format!("0x{DELIVERY_MARK:x}/0x{MARK_MASK:x}");
        let (pref, table) = (RULE_PRIORITY.to_string(), ROUTE_TABLE.to_string());
        self.ip(&["rule", op, "fwmark", &mark, "pref", &pref, "lookup", &table])
    }

    fn route_present(&self) -> Result<bool> {
        let table = ROUTE_TABLE.to_string();
        match self.ip(&["route", "show", "table", &table]) {
            Ok(routes) => Ok(routes
                .lines()
                .any(|l| l.starts_with("local default dev lo"))),
            // A table that never had a route does not exist yet.
            Err(RedirectError::Failed { stderr, .. }) if stderr.contains("does not exist") => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// `ip route replace|del local <any> dev lo table 133`.
    fn route(&self, op: &str) -> Result<String> {
        let table = ROUTE_TABLE.to_string();
        self.ip(&[
            "route",
            op,
            "local",
            self.f.any(),
            "dev",
            "lo",
            "table",
            &table,
        ])
    }
}

/// Installs (or rewrites) a sidecar pod's capture for one family; see
/// [`super::install_sidecar`].
pub(super) fn install_sidecar(
    ns: &Ns,
    f: Family,
    ports: &SidecarPorts,
    p: &Programs,
) -> Result<()> {
    use ambit_inpod::sidecar_capture::{IpFamily, jumps_present, nat_rules};
    let fam = Fam { ns, f, p };
    let family = match f {
        Family::V4 => IpFamily::V4,
        Family::V6 => IpFamily::V6,
    };
    let saved = fam.save()?;
    fam.restore(&nat_rules(ports, family, !jumps_present(&saved)))
}

/// Installs (or repairs) one family; see [`super::install`].
pub(super) fn install(ns: &Ns, f: Family, ports: &RedirectPorts, p: &Programs) -> Result<()> {
    let fam = Fam { ns, f, p };
    // Routing first: it only matters once the mangle rules mark replies.
    if !fam.rule_present()? {
        fam.rule("add")?;
    }
    fam.route("replace")?;

    let saved = fam.save()?;
    let rules = f.rule_lines(ports);
    let mut script = String::new();
    for table in TABLES {
        script.push_str(&format!("*{table}\n"));
        // With --noflush, declaring an existing user chain flushes it.
        for c in CHAINS.iter().filter(|c| c.table == table) {
            script.push_str(&format!(":{} - [0:0]\n", c.name));
        }
        for (_, line) in rules.iter().filter(|(t, _)| *t == table) {
            script.push_str(line);
            script.push('\n');
        }
        for c in CHAINS.iter().filter(|c| c.table == table) {
            let jump = format!("-A {} -j {}", c.builtin, c.name);
            match count_in_table(&saved, table, &jump) {
                0 => script.push_str(&format!("{jump}\n")),
                n => {
                    for _ in 1..n {
                        script.push_str(&format!("-D {} -j {}\n", c.builtin, c.name));
                    }
                }
            }
        }
        script.push_str("COMMIT\n");
    }
    fam.restore(&script)
}

/// Removes one family's jumps, chains, rule and route; see [`super::remove`].
pub(super) fn remove(ns: &Ns, f: Family, p: &Programs) -> Result<()> {
    let fam = Fam { ns, f, p };
    let saved = fam.save()?;
    let mut script = String::new();
    for table in TABLES {
        let mut body = String::new();
        for c in CHAINS.iter().filter(|c| c.table == table) {
            let jump = format!("-A {} -j {}", c.builtin, c.name);
            for _ in 0..count_in_table(&saved, table, &jump) {
                body.push_str(&format!("-D {} -j {}\n", c.builtin, c.name));
            }
        }
        for c in CHAINS.iter().filter(|c| c.table == table) {
            if chain_exists(&saved, table, c.name) {
                body.push_str(&format!("-F {0}\n-X {0}\n", c.name));
            }
        }
        if !body.is_empty() {
            script.push_str(&format!("*{table}\n{body}COMMIT\n"));
        }
    }
    if !script.is_empty() {
        fam.restore(&script)?;
    }

    // `ip rule add` refuses duplicates, but be thorough if someone added more.
    for _ in 0..16 {
        if !fam.rule_present()? {
            break;
        }
        fam.rule("del")?;
    }
    if fam.route_present()? {
        fam.route("del")?;
    }
    Ok(())
}

/// Whether one family is fully in place; see [`super::is_installed`].
pub(super) fn is_installed(ns: &Ns, f: Family, p: &Programs) -> Result<bool> {
    let fam = Fam { ns, f, p };
    let saved = fam.save()?;
    let chains = CHAINS.iter().all(|c| {
        chain_exists(&saved, c.table, c.name)
            && count_in_table(&saved, c.table, &format!("-A {} -j {}", c.builtin, c.name)) > 0
    });
    Ok(chains && fam.rule_present()? && fam.route_present()?)
}
