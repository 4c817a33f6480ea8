//! `networking.istio.io` Sidecar: what a sidecar proxy listens on and which
//! hosts it may reach.

use std::fmt;
use std::str::FromStr;

use serde::Deserialize;
use serde::de::Deserializer;

use crate::objects::{
    ObjectMeta, WorkloadSelector, nullable, optional_port_number, parse_str, port_number,
};

/// Why a part of a Sidecar is unusable. Every message ends with what to do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SidecarError {
    #[error(
        "host {0:?} is not of the form namespace/host; write e.g. \"./*\", \"istio-system/*\" or \"*/api.example.com\""
    )]
    Host(String),
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Sidecar {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: SidecarSpec,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct SidecarSpec {
    /// The workloads this applies to; all of the namespace when absent.
    pub workload_selector: Option<WorkloadSelector>,
    /// Decoded only.
    #[serde(deserialize_with = "nullable")]
    pub ingress: Vec<IstioIngressListener>,
    #[serde(deserialize_with = "nullable")]
    pub egress: Vec<IstioEgressListener>,
    pub outbound_traffic_policy: Option<OutboundTrafficPolicy>,
}

/// An outbound listener and the hosts reachable through it.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct IstioEgressListener {
    /// The port listened on; every port (with `bind` unset) when absent.
    pub port: Option<SidecarPort>,
    #[serde(deserialize_with = "nullable")]
    pub bind: String,
    #[serde(deserialize_with = "nullable")]
    pub capture_mode: CaptureMode,
    #[serde(deserialize_with = "nullable")]
    pub hosts: Vec<NamespacedHost>,
}

/// An inbound listener (decoded only).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IstioIngressListener {
    pub port: SidecarPort,
    #[serde(default, deserialize_with = "nullable")]
    pub bind: String,
    #[serde(default, deserialize_with = "nullable")]
    pub capture_mode: CaptureMode,
    #[serde(default, deserialize_with = "nullable")]
    pub default_endpoint: String,
}

/// A listener port.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SidecarPort {
    #[serde(deserialize_with = "port_number")]
    pub number: u16,
    #[serde(default, deserialize_with = "nullable")]
    pub protocol: String,
    #[serde(default, deserialize_with = "nullable")]
    pub name: String,
    #[serde(default, deserialize_with = "optional_port_number")]
    pub target_port: Option<u16>,
}

/// How traffic reaches a listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum CaptureMode {
    #[default]
    Default,
    Iptables,
    None,
}

/// What happens to traffic to hosts outside the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct OutboundTrafficPolicy {
    #[serde(deserialize_with = "nullable")]
    pub mode: OutboundTrafficMode,
}

/// Outbound traffic mode; the API's zero value is `REGISTRY_ONLY`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum OutboundTrafficMode {
    #[default]
    RegistryOnly,
    AllowAny,
}

/// An egress host: `namespace/host`, where the namespace may be `*` (any),
/// `.` (the Sidecar's own) or `~` (none), and the host a DNS name, possibly
/// with a leading wildcard, or `*`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NamespacedHost {
    pub namespace: String,
    pub host: String,
}

impl FromStr for NamespacedHost {
    type Err = SidecarError;
    fn from_str(s: &str) -> Result<Self, SidecarError> {
        match s.split_once('/') {
            Some((ns, host)) if !ns.is_empty() && !host.is_empty() && !host.contains('/') => {
                Ok(NamespacedHost {
                    namespace: ns.to_string(),
                    host: host.to_string(),
                })
            }
            _ => Err(SidecarError::Host(s.to_string())),
        }
    }
}

impl fmt::Display for NamespacedHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.host)
    }
}

impl<'de> Deserialize<'de> for NamespacedHost {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parse_str(d, "a host of the form namespace/host", |s| {
            s.parse().map_err(|e: SidecarError| e.to_string())
        })
    }
}
