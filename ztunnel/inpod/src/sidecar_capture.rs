//! A sidecar pod's traffic capture as `iptables-restore` input: the nat
//! rules the injected init container (`ambit-agent redirect`) or the node
//! agent (node-agent redirection, as istio-cni does for sidecars) install
//! inside the pod's network namespace, the same for IPv4 and IPv6:
//!
//! ```text
//! PREROUTING -> AMBIT_SIDECAR_IN        proxy ports (15008, 15020, 15021): RETURN
//!                                       other TCP -> AMBIT_SIDECAR_IN_REDIR -> REDIRECT :15006
//! OUTPUT     -> AMBIT_SIDECAR_OUT       from 127.0.0.6 / ::6 over lo (Envoy's inbound
//!                                       passthrough): RETURN
//!                                       Envoy (uid) over lo to the pod's own address:
//!                                       -> AMBIT_SIDECAR_IN_REDIR (inbound chains apply)
//!                                       the app over lo, Envoy's uid or gid, loopback: RETURN
//!                                       other TCP -> AMBIT_SIDECAR_OUT_REDIR -> REDIRECT :15001
//! ```
//!
//! Pure text: running the programs is the caller's (each side has its own
//! way of running children in a namespace, with deadlines).

const IN: &str = "AMBIT_SIDECAR_IN";
const IN_REDIR: &str = "AMBIT_SIDECAR_IN_REDIR";
const OUT: &str = "AMBIT_SIDECAR_OUT";
const OUT_REDIR: &str = "AMBIT_SIDECAR_OUT_REDIR";

/// The ports and the proxy identity the capture is made for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidecarPorts {
    /// The uid (and gid) Envoy runs as; its own connections are not captured.
    pub proxy_uid: u32,
    /// Where outbound connections go (Envoy's virtualOutbound).
    pub outbound_port: u16,
    /// Where inbound connections go (Envoy's virtualInbound).
    pub inbound_port: u16,
    /// Inbound ports left alone (the proxy's own: HBONE, metrics, readiness).
    pub exclude_inbound_ports: Vec<u16>,
}

impl Default for SidecarPorts {
    fn default() -> Self {
        SidecarPorts {
            proxy_uid: 1337,
            outbound_port: 15001,
            inbound_port: 15006,
            exclude_inbound_ports: vec![15008, 15020, 15021],
        }
    }
}

/// An address family's loopback and inbound-passthrough source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    fn loopback(self) -> &'static str {
        match self {
            IpFamily::V4 => "127.0.0.1/32",
            IpFamily::V6 => "::1/128",
        }
    }

    /// The source Envoy binds for inbound passthrough connections.
    fn passthrough_source(self) -> &'static str {
        match self {
            IpFamily::V4 => "127.0.0.6/32",
            IpFamily::V6 => "::6/128",
        }
    }
}

/// Whether `saved` (`iptables-save -t nat` output) already jumps from
/// PREROUTING and OUTPUT to the capture chains.
pub fn jumps_present(saved: &str) -> bool {
    saved.contains(&format!("-A PREROUTING -p tcp -j {IN}"))
        && saved.contains(&format!("-A OUTPUT -p tcp -j {OUT}"))
}

/// The nat table rules for `family`, as `iptables-restore --noflush`
/// input: the chains are rewritten whole; `with_jumps` adds the jumps from
/// PREROUTING and OUTPUT (only when [`jumps_present`] says they are
/// missing, so running it again changes nothing).
pub fn nat_rules(ports: &SidecarPorts, family: IpFamily, with_jumps: bool) -> String {
    let uid = ports.proxy_uid;
    let lo = family.loopback();
    let mut r = String::from("*nat\n");
    for chain in [IN, IN_REDIR, OUT, OUT_REDIR] {
        r += &format!(":{chain} - [0:0]\n");
    }
    if with_jumps {
        r += &format!("-A PREROUTING -p tcp -j {IN}\n-A OUTPUT -p tcp -j {OUT}\n");
    }
    for port in &ports.exclude_inbound_ports {
        r += &format!("-A {IN} -p tcp --dport {port} -j RETURN\n");
    }
    r += &format!("-A {IN} -p tcp -j {IN_REDIR}\n");
    r += &format!(
        "-A {IN_REDIR} -p tcp -j REDIRECT --to-ports {}\n",
        ports.inbound_port
    );
    let src = family.passthrough_source();
    r += &format!("-A {OUT} -s {src} -o lo -j RETURN\n");
    r += &format!("-A {OUT} ! -d {lo} -o lo -m owner --uid-owner {uid} -j {IN_REDIR}\n");
    r += &format!("-A {OUT} -o lo -m owner ! --uid-owner {uid} -j RETURN\n");
    r += &format!("-A {OUT} -m owner --uid-owner {uid} -j RETURN\n");
    r += &format!("-A {OUT} -m owner --gid-owner {uid} -j RETURN\n");
    r += &format!("-A {OUT} -d {lo} -j RETURN\n");
    r += &format!("-A {OUT} -p tcp -j {OUT_REDIR}\n");
    r += &format!(
        "-A {OUT_REDIR} -p tcp -j REDIRECT --to-ports {}\n",
        ports.outbound_port
    );
    r += "COMMIT\n";
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_exempt_the_proxy_and_its_ports_in_both_families() {
        let ports = SidecarPorts::default();
        let v4 = nat_rules(&ports, IpFamily::V4, true);
        assert!(v4.contains("-A AMBIT_SIDECAR_IN -p tcp --dport 15021 -j RETURN"));
        assert!(v4.contains("-A AMBIT_SIDECAR_OUT -m owner --uid-owner 1337 -j RETURN"));
        assert!(v4.contains("REDIRECT --to-ports 15001"));
        assert!(v4.contains("-A AMBIT_SIDECAR_OUT -s 127.0.0.6/32 -o lo -j RETURN"));
        assert!(jumps_present(&v4));
        let v6 = nat_rules(&ports, IpFamily::V6, false);
        assert!(v6.contains("-A AMBIT_SIDECAR_OUT -s ::6/128 -o lo -j RETURN"));
        assert!(!v6.contains("-A PREROUTING"), "jumps only when asked");
        assert!(!jumps_present(&v6));
    }
}
