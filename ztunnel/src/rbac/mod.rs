//! L4 authorization: which inbound connections a workload accepts.
//!
//! Policies arrive as `istio.security.Authorization` (converted to
//! [`Authorization`] by the state). The connection handlers describe each
//! inbound connection as a [`ConnectionAttrs`] — the source identity comes
//! only from a verified peer certificate — and ask a [`PolicyIndex`] (built
//! once per state generation, cached by [`PolicyCache`]) for a [`Decision`].
//!
//! Semantics are Istio's ztunnel's:
//!
//! * the policies that apply to a workload are the GLOBAL ones, the
//!   NAMESPACE ones of its namespace and the ones its
//!   `authorization_policies` names (WORKLOAD_SELECTOR);
//! * any matching DENY denies; otherwise, when at least one ALLOW applies
//!   the connection must match one of them; with no ALLOW it is allowed;
//! * a policy matches when any rule matches (no rules: never), a rule when
//!   every clause matches (no clauses: always), a clause when any of its
//!   matches matches (no matches: always), and a match when every field it
//!   sets holds (a match that sets nothing never matches);
//! * principals are compared with the peer's SPIFFE id without
//!   `spiffe://` (`cluster.local/ns/foo/sa/bar`), namespaces with the
//!   namespace of that id; a plaintext peer has neither, so it never
//!   matches `principals`, and matches `namespaces` only through matchers
//!   that accept the empty string; negated fields hold when no value matches.
//!
//! ```text
//! state publish ──▶ PolicyCache::index(snapshot) ──▶ Arc<PolicyIndex> (per generation)
//! inbound conn  ──▶ PolicyIndex::evaluate(dst workload, ConnectionAttrs) ──▶ Decision
//! ```
//!
//! Evaluation takes no lock and allocates nothing.

mod index;

#[cfg(test)]
mod tests;

use std::fmt;
use std::net::IpAddr;
use std::ops::Range;
use std::sync::Arc;

use crate::identity::{Identity, IdentityError};
use crate::state::{Authorization, IpNet, RbacMatch, StringMatch};

pub use self::index::{PolicyCache, PolicyIndex};

/// The reason given when ALLOW policies apply and none matched.
pub const NO_ALLOW_MATCH: &str = "no ALLOW policy matched";

/// The verified identity of a connection's peer, prepared for matching.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PeerIdentity {
    /// `<trust-domain>/ns/<namespace>/sa/<service-account>` (the SPIFFE id
    /// without `spiffe://`, the form principals are written in).
    principal: Box<str>,
    /// Where the namespace is in `principal`.
    namespace: Range<usize>,
}

impl PeerIdentity {
    /// The identity of `id`.
    pub fn new(id: &Identity) -> Self {
        let principal = format!(
            "{}/ns/{}/sa/{}",
            id.trust_domain, id.namespace, id.service_account
        );
        let start = id.trust_domain.len() + "/ns/".len();
        Self {
            principal: principal.into_boxed_str(),
            namespace: start..start + id.namespace.len(),
        }
    }

    /// Parses a SPIFFE id `spiffe://td/ns/<ns>/sa/<sa>`.
    pub fn from_spiffe(uri: &str) -> Result<Self, IdentityError> {
        uri.parse::<Identity>().map(|id| Self::new(&id))
    }

    /// `<trust-domain>/ns/<namespace>/sa/<service-account>`.
    pub fn principal(&self) -> &str {
        &self.principal
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        self.principal.get(self.namespace.clone()).unwrap_or("")
    }
}

impl From<&Identity> for PeerIdentity {
    fn from(id: &Identity) -> Self {
        Self::new(id)
    }
}

impl fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", Identity::SCHEME, self.principal)
    }
}

/// What policy sees of one inbound connection.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConnectionAttrs {
    /// Source address (IPv4-mapped IPv6 addresses are compared as IPv4).
    pub src_ip: IpAddr,
    /// The peer's identity, only from a verified peer certificate; `None`
    /// for plaintext.
    pub src_identity: Option<PeerIdentity>,
    /// Destination address (as the client addressed the workload).
    pub dst_ip: IpAddr,
    /// Destination port.
    pub dst_port: u16,
}

impl ConnectionAttrs {
    /// A plaintext connection.
    pub fn plaintext(src_ip: IpAddr, dst_ip: IpAddr, dst_port: u16) -> Self {
        Self {
            src_ip,
            src_identity: None,
            dst_ip,
            dst_port,
        }
    }

    /// A connection whose peer proved `identity` with its certificate.
    pub fn mtls(src_ip: IpAddr, identity: PeerIdentity, dst_ip: IpAddr, dst_port: u16) -> Self {
        Self {
            src_ip,
            src_identity: Some(identity),
            dst_ip,
            dst_port,
        }
    }
}

/// Why a connection was denied.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DenyReason {
    /// A DENY policy matched; its key `namespace/name`.
    Policy(Arc<str>),
    /// ALLOW policies apply to the workload and none matched.
    NoAllowMatch,
}

impl DenyReason {
    /// The policy key, or [`NO_ALLOW_MATCH`]: the label for logs and metrics.
    pub fn as_str(&self) -> &str {
        match self {
            DenyReason::Policy(key) => key,
            DenyReason::NoAllowMatch => NO_ALLOW_MATCH,
        }
    }
}

impl fmt::Display for DenyReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The verdict on one connection.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Decision {
    /// Let it through.
    Allow,
    /// Refuse (or close) it.
    Deny {
        /// The DENY policy that matched, or why no ALLOW did.
        policy: DenyReason,
    },
}

impl Decision {
    /// Whether the connection may proceed.
    pub fn is_allowed(&self) -> bool {
        matches!(self, Decision::Allow)
    }
}

/// The connection, normalized once per evaluation.
pub(crate) struct Conn<'a> {
    src_ip: IpAddr,
    dst_ip: IpAddr,
    dst_port: u16,
    /// Principal without `spiffe://`, `None` for plaintext.
    principal: Option<&'a str>,
    /// Peer namespace, `""` for plaintext.
    namespace: &'a str,
}

impl<'a> Conn<'a> {
    pub(crate) fn new(c: &'a ConnectionAttrs) -> Self {
        Self {
            src_ip: c.src_ip.to_canonical(),
            dst_ip: c.dst_ip.to_canonical(),
            dst_port: c.dst_port,
            principal: c.src_identity.as_ref().map(PeerIdentity::principal),
            namespace: c.src_identity.as_ref().map_or("", PeerIdentity::namespace),
        }
    }
}

/// Whether `policy` matches the connection (any rule).
pub(crate) fn policy_matches(policy: &Authorization, conn: &Conn<'_>) -> bool {
    policy.rules.iter().any(|rule| {
        rule.iter()
            .all(|clause| clause.is_empty() || clause.iter().any(|m| match_holds(m, conn)))
    })
}

/// Positive values: empty, or any matches. Negative: empty, or none matches.
fn field<T>(pos: &[T], neg: &[T], mut pred: impl FnMut(&T) -> bool) -> bool {
    (pos.is_empty() || pos.iter().any(&mut pred)) && !neg.iter().any(pred)
}

fn match_is_empty(m: &RbacMatch) -> bool {
    m.namespaces.is_empty()
        && m.not_namespaces.is_empty()
        && m.principals.is_empty()
        && m.not_principals.is_empty()
        && m.source_ips.is_empty()
        && m.not_source_ips.is_empty()
        && m.destination_ips.is_empty()
        && m.not_destination_ips.is_empty()
        && m.destination_ports.is_empty()
        && m.not_destination_ports.is_empty()
}

fn match_holds(m: &RbacMatch, conn: &Conn<'_>) -> bool {
    if match_is_empty(m) {
        // Istio's ztunnel: a match that sets nothing matches nothing.
        return false;
    }
    field(&m.destination_ports, &m.not_destination_ports, |p| {
        *p == conn.dst_port
    }) && field(&m.destination_ips, &m.not_destination_ips, |n| {
        net_contains(n, conn.dst_ip)
    }) && field(&m.source_ips, &m.not_source_ips, |n| {
        net_contains(n, conn.src_ip)
    }) && field(&m.principals, &m.not_principals, |s| {
        conn.principal.is_some_and(|p| string_matches(s, p))
    }) && field(&m.namespaces, &m.not_namespaces, |s| {
        string_matches(s, conn.namespace)
    })
}

/// Whether `value` satisfies `m`.
pub fn string_matches(m: &StringMatch, value: &str) -> bool {
    match m {
        StringMatch::Exact(s) => value == s,
        StringMatch::Prefix(s) => value.starts_with(s.as_str()),
        StringMatch::Suffix(s) => value.ends_with(s.as_str()),
        StringMatch::Presence => !value.is_empty(),
    }
}

/// Whether `ip` is inside `net`; addresses of the other family never are.
/// `ip` must already be canonical (IPv4-mapped IPv6 turned into IPv4).
pub fn net_contains(net: &IpNet, ip: IpAddr) -> bool {
    match (net.ip.to_canonical(), ip) {
        (IpAddr::V4(n), IpAddr::V4(a)) if net.ip.is_ipv4() => {
            let len = u32::from(net.prefix_len.min(32));
            let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
            u32::from(n) & mask == u32::from(a) & mask
        }
        (IpAddr::V6(n), IpAddr::V6(a)) => {
            let len = u32::from(net.prefix_len.min(128));
            let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
            u128::from(n) & mask == u128::from(a) & mask
        }
        (IpAddr::V4(n), IpAddr::V4(a)) => {
            // An IPv4-mapped IPv6 prefix (::ffff:a.b.c.d/96+n).
            let len = u32::from(net.prefix_len.clamp(96, 128)) - 96;
            let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
            u32::from(n) & mask == u32::from(a) & mask
        }
        _ => false,
    }
}
