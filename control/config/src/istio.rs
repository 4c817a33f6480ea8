//! The Istio kinds of the object model (`networking.istio.io`,
//! `security.istio.io`), re-exported by [`crate::objects`].

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::Deserialize;
use serde::de::{self, Deserializer};

use crate::objects::{
    LabelSelector, Labels, ObjectMeta, check_port, nullable, optional_port_number, parse_scalar,
    parse_str, port_number,
};

// --------------------------------------------------- networking.istio.io

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServiceEntry {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: ServiceEntrySpec,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServiceEntrySpec {
    #[serde(deserialize_with = "nullable")]
    pub hosts: Vec<String>,
    /// As written: IPs or CIDRs.
    #[serde(deserialize_with = "nullable")]
    pub addresses: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub ports: Vec<ServiceEntryPort>,
    #[serde(deserialize_with = "nullable")]
    pub location: Location,
    #[serde(deserialize_with = "nullable")]
    pub resolution: Resolution,
    #[serde(deserialize_with = "nullable")]
    pub endpoints: Vec<WorkloadEntrySpec>,
    pub workload_selector: Option<WorkloadSelector>,
    #[serde(deserialize_with = "nullable")]
    pub export_to: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub subject_alt_names: Vec<String>,
    /// Virtual IPs from `addresses` that are single hosts (set by decoding).
    #[serde(skip)]
    pub vips: Vec<IpAddr>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ServiceEntryPort {
    #[serde(deserialize_with = "port_number")]
    pub number: u16,
    #[serde(deserialize_with = "nullable")]
    pub protocol: String,
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "optional_port_number")]
    pub target_port: Option<u16>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Location {
    #[default]
    MeshExternal,
    MeshInternal,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Resolution {
    #[default]
    None,
    Static,
    Dns,
    DnsRoundRobin,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WorkloadSelector {
    #[serde(deserialize_with = "nullable")]
    pub labels: Labels,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WorkloadEntry {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: WorkloadEntrySpec,
}

/// The spec of a WorkloadEntry, also used for ServiceEntry inline endpoints.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WorkloadEntrySpec {
    /// An IP, a DNS name or a `unix://` path.
    #[serde(deserialize_with = "nullable")]
    pub address: String,
    /// Port name (of the service port) -> port number on this endpoint.
    #[serde(deserialize_with = "port_map")]
    pub ports: BTreeMap<String, u16>,
    #[serde(deserialize_with = "nullable")]
    pub labels: Labels,
    #[serde(deserialize_with = "nullable")]
    pub network: String,
    #[serde(deserialize_with = "nullable")]
    pub locality: String,
    pub weight: Option<u32>,
    #[serde(deserialize_with = "nullable")]
    pub service_account: String,
}

impl WorkloadEntrySpec {
    /// The address when it is an IP.
    pub fn ip(&self) -> Option<IpAddr> {
        self.address.parse().ok()
    }
}

fn port_map<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, u16>, D::Error> {
    #[derive(Deserialize)]
    struct W(#[serde(deserialize_with = "port_number")] u16);
    let m: BTreeMap<String, W> = nullable(d)?;
    Ok(m.into_iter().map(|(k, v)| (k, v.0)).collect())
}

// ----------------------------------------------------- security.istio.io

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PeerAuthentication {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: PeerAuthenticationSpec,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PeerAuthenticationSpec {
    pub selector: Option<LabelSelector>,
    pub mtls: Option<Mtls>,
    /// Port number -> mode. Present but empty (`{}`) is rejected.
    #[serde(deserialize_with = "port_keyed")]
    pub port_level_mtls: BTreeMap<u16, Mtls>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Mtls {
    #[serde(deserialize_with = "nullable")]
    pub mode: MtlsMode,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum MtlsMode {
    #[default]
    Unset,
    Disable,
    Permissive,
    Strict,
}

fn port_keyed<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<u16, Mtls>, D::Error> {
    let Some(m) = Option::<BTreeMap<String, Mtls>>::deserialize(d)? else {
        return Ok(BTreeMap::new());
    };
    if m.is_empty() {
        return Err(de::Error::custom(
            "the map is empty; leave portLevelMtls out, or list at least one port with its mode",
        ));
    }
    m.into_iter()
        .map(|(k, v)| {
            let port = k
                .parse::<i64>()
                .map_err(|_| format!("key {k:?} is not a port number"))
                .and_then(check_port)
                .map_err(de::Error::custom)?;
            Ok((port, v))
        })
        .collect()
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct AuthorizationPolicy {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: AuthorizationPolicySpec,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct AuthorizationPolicySpec {
    pub selector: Option<LabelSelector>,
    pub target_ref: Option<PolicyTargetReference>,
    #[serde(deserialize_with = "nullable")]
    pub target_refs: Vec<PolicyTargetReference>,
    #[serde(deserialize_with = "nullable")]
    pub action: AuthorizationAction,
    pub provider: Option<ExtensionProvider>,
    /// No `rules` field and `rules: []` are read the same: the policy
    /// matches nothing — an ALLOW then allows nothing, and a DENY or CUSTOM
    /// without rules is rejected at decoding.
    #[serde(deserialize_with = "nullable")]
    pub rules: Vec<AuthorizationRule>,
}

impl AuthorizationPolicySpec {
    /// Selector labels; empty when the policy has no selector.
    pub fn selector_labels(&self) -> Option<&Labels> {
        self.selector
            .as_ref()
            .map(|s| &s.match_labels)
            .filter(|m| !m.is_empty())
    }
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PolicyTargetReference {
    #[serde(deserialize_with = "nullable")]
    pub group: String,
    #[serde(deserialize_with = "nullable")]
    pub kind: String,
    #[serde(deserialize_with = "nullable")]
    pub name: String,
    #[serde(deserialize_with = "nullable")]
    pub namespace: String,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ExtensionProvider {
    pub name: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AuthorizationAction {
    #[default]
    Allow,
    Deny,
    Audit,
    Custom,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct AuthorizationRule {
    /// Any of the sources; none given = any source. `from: []` is rejected.
    #[serde(deserialize_with = "non_empty_list")]
    pub from: Vec<RuleFrom>,
    /// Any of the operations; none given = any operation. `to: []` is
    /// rejected.
    #[serde(deserialize_with = "non_empty_list")]
    pub to: Vec<RuleTo>,
    #[serde(deserialize_with = "nullable")]
    pub when: Vec<Condition>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RuleFrom {
    #[serde(deserialize_with = "nullable")]
    pub source: Source,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RuleTo {
    #[serde(deserialize_with = "nullable")]
    pub operation: Operation,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Source {
    #[serde(deserialize_with = "nullable")]
    pub principals: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub not_principals: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub request_principals: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub not_request_principals: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub namespaces: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub not_namespaces: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub ip_blocks: Vec<Cidr>,
    #[serde(deserialize_with = "nullable")]
    pub not_ip_blocks: Vec<Cidr>,
    #[serde(deserialize_with = "nullable")]
    pub remote_ip_blocks: Vec<Cidr>,
    #[serde(deserialize_with = "nullable")]
    pub not_remote_ip_blocks: Vec<Cidr>,
    /// `sa` (in the policy's namespace) or `namespace/sa`, any trust
    /// domain; see [`service_account_ref`].
    #[serde(deserialize_with = "nullable")]
    pub service_accounts: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub not_service_accounts: Vec<String>,
    /// Decoded so that a policy using them is rejected (Ambit does not
    /// enforce them yet) instead of read as a wider policy.
    #[serde(deserialize_with = "nullable")]
    pub trust_domains: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub not_trust_domains: Vec<String>,
}

/// A `serviceAccounts` value as (namespace, service account): `ns/sa`, or a
/// bare `sa` in `policy_namespace`.
pub fn service_account_ref<'a>(value: &'a str, policy_namespace: &'a str) -> (&'a str, &'a str) {
    value.split_once('/').unwrap_or((policy_namespace, value))
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Operation {
    #[serde(deserialize_with = "nullable")]
    pub hosts: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub not_hosts: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub ports: Vec<PolicyPort>,
    #[serde(deserialize_with = "nullable")]
    pub not_ports: Vec<PolicyPort>,
    #[serde(deserialize_with = "nullable")]
    pub methods: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub not_methods: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub paths: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub not_paths: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Condition {
    #[serde(deserialize_with = "nullable")]
    pub key: String,
    #[serde(deserialize_with = "nullable")]
    pub values: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub not_values: Vec<String>,
}

/// A list that may be left out (or null) but not given empty: for
/// `from`/`to` an empty list reads ambiguously (no source, or any source?),
/// so Istio's validation refuses it and so do we.
fn non_empty_list<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    match Option::<Vec<T>>::deserialize(d)? {
        Some(v) if v.is_empty() => Err(de::Error::custom(
            "the list is empty; leave the field out to match anything, or list at least one entry",
        )),
        v => Ok(v.unwrap_or_default()),
    }
}

/// A port in an AuthorizationPolicy: Istio writes them as strings ("8080"),
/// people write numbers; both are accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyPort(pub u16);

impl<'de> Deserialize<'de> for PolicyPort {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_scalar(d, "a port number", |s| {
            s.trim()
                .parse::<i64>()
                .map_err(|_| format!("{s:?} is not a port number"))
                .and_then(check_port)
                .map(PolicyPort)
        })
    }
}

/// An IP block: `10.0.0.0/8`, or a single IP (full-length prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: IpAddr,
    pub len: u8,
}

impl Cidr {
    /// Single-host prefix (`/32` or `/128`).
    pub fn is_host(&self) -> bool {
        self.len == if self.addr.is_ipv4() { 32 } else { 128 }
    }
}

impl FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not an IP address or CIDR (e.g. 10.0.0.0/8)");
        let (ip, len) = match s.split_once('/') {
            Some((ip, len)) => (ip, Some(len)),
            None => (s, None),
        };
        let addr: IpAddr = ip.trim().parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match len {
            Some(l) => l
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|l| *l <= max)
                .ok_or_else(bad)?,
            None => max,
        };
        Ok(Cidr { addr, len })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, "an IP address or CIDR", str::parse)
    }
}
