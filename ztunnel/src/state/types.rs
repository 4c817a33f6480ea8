//! Validated, data-path-friendly forms of the xDS resources, converted from
//! the `istio.workload` / `istio.security` protobuf messages.
//!
//! Conversion is where bad input is caught: an IP that is not 4 or 16 bytes,
//! a port above 65535, an enum value this ztunnel does not know. The xDS
//! client NACKs such a resource and keeps everything else.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use ambit_proto::security as xsec;
use ambit_proto::workload as xds;

use super::StateError;

/// An IP qualified by its network: the key of the workload and VIP indexes
/// and the on-demand resource name `network/ip`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NetworkAddress {
    /// Network name; empty for the default network.
    pub network: Arc<str>,
    /// The address.
    pub ip: IpAddr,
}

impl NetworkAddress {
    /// `ip` on `network`.
    pub fn new(network: impl Into<Arc<str>>, ip: IpAddr) -> Self {
        Self {
            network: network.into(),
            ip,
        }
    }
}

impl fmt::Display for NetworkAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.ip)
    }
}

/// A service port and the port the backend listens on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortMapping {
    /// Port clients connect to on the service VIP.
    pub service_port: u16,
    /// Port on the workload; 0 means "same as the service's target port".
    pub target_port: u16,
}

/// Tunnel a workload accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TunnelProtocol {
    /// HBONE (mTLS + HTTP/2 CONNECT) on port 15008.
    Hbone,
    /// Plain TCP: the workload is not in the mesh.
    Tcp,
}

/// Health reported by the control plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HealthStatus {
    /// Ready to receive traffic.
    Healthy,
    /// Not ready; only used when load balancing allows all endpoints.
    Unhealthy,
}

/// Where a waypoint or network gateway is reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GatewayDestination {
    /// A service, by `namespace` and `hostname`.
    Hostname {
        /// Namespace of the service.
        namespace: String,
        /// Fully qualified host name of the service.
        hostname: String,
    },
    /// A fixed address.
    Address(NetworkAddress),
}

/// A waypoint or network gateway.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayAddress {
    /// Where it is.
    pub destination: GatewayDestination,
    /// Its HBONE port (15008 by default in Istio).
    pub hbone_mtls_port: u16,
}

/// Locality of a workload.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Locality {
    /// Region.
    pub region: String,
    /// Zone.
    pub zone: String,
    /// Sub-zone.
    pub subzone: String,
}

/// One workload (a pod, a WorkloadEntry, ...), keyed by `uid`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    /// Mesh-wide unique key, e.g. `Kubernetes//Pod/ns/name`.
    pub uid: Arc<str>,
    /// Name (pod name).
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Addresses on `network`.
    pub ips: Vec<IpAddr>,
    /// Host name, for workloads addressed by name only.
    pub hostname: String,
    /// Network; empty for the default network.
    pub network: Arc<str>,
    /// Tunnel it accepts.
    pub protocol: TunnelProtocol,
    /// SPIFFE trust domain.
    pub trust_domain: String,
    /// Service account.
    pub service_account: String,
    /// Waypoint its traffic goes through, if any.
    pub waypoint: Option<GatewayAddress>,
    /// Gateway to reach it from another network, if any.
    pub network_gateway: Option<GatewayAddress>,
    /// Node it runs on.
    pub node: String,
    /// `service.istio.io/canonical-name`.
    pub canonical_name: String,
    /// `service.istio.io/canonical-revision`.
    pub canonical_revision: String,
    /// Kind of the controller that owns it.
    pub workload_type: xds::WorkloadType,
    /// Name of the controller that owns it.
    pub workload_name: String,
    /// Whether it speaks HBONE itself (no ztunnel in front).
    pub native_tunnel: bool,
    /// Services it backs, by `namespace/hostname`, with port overrides.
    pub services: BTreeMap<String, Vec<PortMapping>>,
    /// Authorization policies (`namespace/name`) that select it.
    pub authorization_policies: Vec<String>,
    /// Health.
    pub status: HealthStatus,
    /// Cluster it belongs to.
    pub cluster_id: String,
    /// Locality, if known.
    pub locality: Option<Locality>,
    /// Whether it shares the node's network namespace.
    pub host_network: bool,
    /// Load-balancing weight; 1 when unset.
    pub capacity: u32,
}

/// One service, keyed by `namespace/hostname`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    /// Name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Fully qualified host name.
    pub hostname: String,
    /// Virtual IPs, per network.
    pub vips: Vec<NetworkAddress>,
    /// Port mappings.
    pub ports: Vec<PortMapping>,
    /// Identities its backends may present.
    pub subject_alt_names: Vec<String>,
    /// Waypoint its traffic goes through, if any.
    pub waypoint: Option<GatewayAddress>,
    /// Load-balancing settings as received.
    pub load_balancing: Option<xds::LoadBalancing>,
    /// IP families it serves.
    pub ip_families: xds::IpFamilies,
}

impl Service {
    /// The index key `namespace/hostname`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.hostname)
    }
}

/// A resource of type `istio.workload.Address`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    /// A workload (boxed, like the service: both are large).
    Workload(Box<Workload>),
    /// A service.
    Service(Box<Service>),
}

/// An IP prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpNet {
    /// Network address.
    pub ip: IpAddr,
    /// Prefix length.
    pub prefix_len: u8,
}

impl fmt::Display for IpNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.ip, self.prefix_len)
    }
}

/// A string matcher of an authorization rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StringMatch {
    /// Equal to.
    Exact(String),
    /// Starts with.
    Prefix(String),
    /// Ends with.
    Suffix(String),
    /// Any non-empty value.
    Presence,
}

/// One match of a clause; set fields must all hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RbacMatch {
    /// Source namespaces.
    pub namespaces: Vec<StringMatch>,
    /// Excluded source namespaces.
    pub not_namespaces: Vec<StringMatch>,
    /// Source identities.
    pub principals: Vec<StringMatch>,
    /// Excluded source identities.
    pub not_principals: Vec<StringMatch>,
    /// Source prefixes.
    pub source_ips: Vec<IpNet>,
    /// Excluded source prefixes.
    pub not_source_ips: Vec<IpNet>,
    /// Destination prefixes.
    pub destination_ips: Vec<IpNet>,
    /// Excluded destination prefixes.
    pub not_destination_ips: Vec<IpNet>,
    /// Destination ports.
    pub destination_ports: Vec<u16>,
    /// Excluded destination ports.
    pub not_destination_ports: Vec<u16>,
}

/// An L4 authorization policy, keyed by `namespace/name`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Authorization {
    /// Name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Which workloads it applies to.
    pub scope: xsec::Scope,
    /// Allow or deny.
    pub action: xsec::Action,
    /// Rules → clauses → matches: any rule, every clause, any match.
    pub rules: Vec<Vec<Vec<RbacMatch>>>,
}

impl Authorization {
    /// The index key `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

// ---- conversion from protobuf ----

fn ip_from_bytes(bytes: &[u8], what: &str) -> Result<IpAddr, StateError> {
    match bytes.len() {
        4 => {
            let mut a = [0u8; 4];
            a.copy_from_slice(bytes);
            Ok(IpAddr::from(a))
        }
        16 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(bytes);
            Ok(IpAddr::from(a))
        }
        len => Err(StateError::InvalidIp {
            what: what.to_string(),
            len,
        }),
    }
}

fn port(value: u32, what: &str) -> Result<u16, StateError> {
    u16::try_from(value).map_err(|_| StateError::InvalidPort {
        what: what.to_string(),
        port: value,
    })
}

fn required(value: &str, kind: &'static str, field: &'static str) -> Result<(), StateError> {
    if value.is_empty() {
        return Err(StateError::MissingField { kind, field });
    }
    Ok(())
}

fn port_mappings(ports: &[xds::Port], what: &str) -> Result<Vec<PortMapping>, StateError> {
    ports
        .iter()
        .map(|p| {
            let service_port = port(p.service_port, what)?;
            if service_port == 0 {
                return Err(StateError::InvalidPort {
                    what: what.to_string(),
                    port: 0,
                });
            }
            Ok(PortMapping {
                service_port,
                target_port: port(p.target_port, what)?,
            })
        })
        .collect()
}

fn network_address(a: &xds::NetworkAddress, what: &str) -> Result<NetworkAddress, StateError> {
    Ok(NetworkAddress::new(
        a.network.as_str(),
        ip_from_bytes(&a.address, what)?,
    ))
}

fn gateway(g: &xds::GatewayAddress, what: &str) -> Result<GatewayAddress, StateError> {
    use xds::gateway_address::Destination;
    let destination = match &g.destination {
        Some(Destination::Hostname(h)) => GatewayDestination::Hostname {
            namespace: h.namespace.clone(),
            hostname: h.hostname.clone(),
        },
        Some(Destination::Address(a)) => GatewayDestination::Address(network_address(a, what)?),
        None => {
            return Err(StateError::MissingField {
                kind: "gateway address",
                field: "destination",
            });
        }
    };
    Ok(GatewayAddress {
        destination,
        hbone_mtls_port: port(g.hbone_mtls_port, what)?,
    })
}

fn known_enum<E: TryFrom<i32>>(value: i32, field: &'static str) -> Result<E, StateError> {
    E::try_from(value).map_err(|_| StateError::UnknownEnum { field, value })
}

impl TryFrom<&xds::Workload> for Workload {
    type Error = StateError;

    fn try_from(w: &xds::Workload) -> Result<Self, StateError> {
        required(&w.uid, "workload", "uid")?;
        let ips = w
            .addresses
            .iter()
            .map(|a| ip_from_bytes(a, "workload address"))
            .collect::<Result<Vec<_>, _>>()?;
        let mut services = BTreeMap::new();
        for (key, list) in &w.services {
            if !key.contains('/') {
                return Err(StateError::InvalidServiceKey(key.clone()));
            }
            let what = format!("port of service {key}");
            services.insert(key.clone(), port_mappings(&list.ports, &what)?);
        }
        let protocol = match known_enum(w.tunnel_protocol, "tunnel_protocol")? {
            xds::TunnelProtocol::Hbone => TunnelProtocol::Hbone,
            xds::TunnelProtocol::None => TunnelProtocol::Tcp,
        };
        let status = match known_enum(w.status, "status")? {
            xds::WorkloadStatus::Healthy => HealthStatus::Healthy,
            xds::WorkloadStatus::Unhealthy => HealthStatus::Unhealthy,
        };
        let network_mode: xds::NetworkMode = known_enum(w.network_mode, "network_mode")?;
        Ok(Workload {
            uid: Arc::from(w.uid.as_str()),
            name: w.name.clone(),
            namespace: w.namespace.clone(),
            ips,
            hostname: w.hostname.clone(),
            network: Arc::from(w.network.as_str()),
            protocol,
            trust_domain: w.trust_domain.clone(),
            service_account: w.service_account.clone(),
            waypoint: w
                .waypoint
                .as_ref()
                .map(|g| gateway(g, "waypoint"))
                .transpose()?,
            network_gateway: w
                .network_gateway
                .as_ref()
                .map(|g| gateway(g, "network gateway"))
                .transpose()?,
            node: w.node.clone(),
            canonical_name: w.canonical_name.clone(),
            canonical_revision: w.canonical_revision.clone(),
            workload_type: known_enum(w.workload_type, "workload_type")?,
            workload_name: w.workload_name.clone(),
            native_tunnel: w.native_tunnel,
            services,
            authorization_policies: w.authorization_policies.clone(),
            status,
            cluster_id: w.cluster_id.clone(),
            locality: w.locality.as_ref().map(|l| Locality {
                region: l.region.clone(),
                zone: l.zone.clone(),
                subzone: l.subzone.clone(),
            }),
            host_network: network_mode == xds::NetworkMode::HostNetwork,
            capacity: w.capacity.unwrap_or(1),
        })
    }
}

impl TryFrom<&xds::Service> for Service {
    type Error = StateError;

    fn try_from(s: &xds::Service) -> Result<Self, StateError> {
        required(&s.namespace, "service", "namespace")?;
        required(&s.hostname, "service", "hostname")?;
        let vips = s
            .addresses
            .iter()
            .map(|a| network_address(a, "service VIP"))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Service {
            name: s.name.clone(),
            namespace: s.namespace.clone(),
            hostname: s.hostname.clone(),
            vips,
            ports: port_mappings(&s.ports, "service port")?,
            subject_alt_names: s.subject_alt_names.clone(),
            waypoint: s
                .waypoint
                .as_ref()
                .map(|g| gateway(g, "waypoint"))
                .transpose()?,
            load_balancing: s.load_balancing.clone(),
            ip_families: known_enum(s.ip_families, "ip_families")?,
        })
    }
}

impl TryFrom<&xds::Address> for Address {
    type Error = StateError;

    fn try_from(a: &xds::Address) -> Result<Self, StateError> {
        match &a.r#type {
            Some(xds::address::Type::Workload(w)) => Ok(Address::Workload(Box::new(w.try_into()?))),
            Some(xds::address::Type::Service(s)) => Ok(Address::Service(Box::new(s.try_into()?))),
            None => Err(StateError::EmptyAddress),
        }
    }
}

fn string_matches(list: &[xsec::StringMatch]) -> Result<Vec<StringMatch>, StateError> {
    use xsec::string_match::MatchType;
    list.iter()
        .map(|m| match &m.match_type {
            Some(MatchType::Exact(s)) => Ok(StringMatch::Exact(s.clone())),
            Some(MatchType::Prefix(s)) => Ok(StringMatch::Prefix(s.clone())),
            Some(MatchType::Suffix(s)) => Ok(StringMatch::Suffix(s.clone())),
            Some(MatchType::Presence(())) => Ok(StringMatch::Presence),
            None => Err(StateError::MissingField {
                kind: "string match",
                field: "match_type",
            }),
        })
        .collect()
}

fn prefixes(list: &[xsec::Address], what: &str) -> Result<Vec<IpNet>, StateError> {
    list.iter()
        .map(|a| {
            let ip = ip_from_bytes(&a.address, what)?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            if a.length > max {
                return Err(StateError::InvalidPrefix { ip, len: a.length });
            }
            Ok(IpNet {
                ip,
                prefix_len: a.length as u8,
            })
        })
        .collect()
}

fn ports(list: &[u32], what: &str) -> Result<Vec<u16>, StateError> {
    list.iter().map(|p| port(*p, what)).collect()
}

fn rbac_match(m: &xsec::Match) -> Result<RbacMatch, StateError> {
    Ok(RbacMatch {
        namespaces: string_matches(&m.namespaces)?,
        not_namespaces: string_matches(&m.not_namespaces)?,
        principals: string_matches(&m.principals)?,
        not_principals: string_matches(&m.not_principals)?,
        source_ips: prefixes(&m.source_ips, "source_ips")?,
        not_source_ips: prefixes(&m.not_source_ips, "not_source_ips")?,
        destination_ips: prefixes(&m.destination_ips, "destination_ips")?,
        not_destination_ips: prefixes(&m.not_destination_ips, "not_destination_ips")?,
        destination_ports: ports(&m.destination_ports, "destination_ports")?,
        not_destination_ports: ports(&m.not_destination_ports, "not_destination_ports")?,
    })
}

impl TryFrom<&xsec::Authorization> for Authorization {
    type Error = StateError;

    fn try_from(a: &xsec::Authorization) -> Result<Self, StateError> {
        required(&a.name, "authorization", "name")?;
        let rules = a
            .rules
            .iter()
            .map(|r| {
                r.clauses
                    .iter()
                    .map(|c| c.matches.iter().map(rbac_match).collect())
                    .collect()
            })
            .collect::<Result<Vec<Vec<Vec<RbacMatch>>>, StateError>>()?;
        Ok(Authorization {
            name: a.name.clone(),
            namespace: a.namespace.clone(),
            scope: known_enum(a.scope, "scope")?,
            action: known_enum(a.action, "action")?,
            rules,
        })
    }
}
