//! `/config_dump`: the state as JSON, shaped like Istio's ztunnel dump so
//! `istioctl`-style tooling and `ambitctl ztunnel-config` can read it.
//!
//! Top-level keys: `workloads`, `services`, `policies`, `certificates`.
//! Lists are sorted by key so two dumps of the same state are identical.

use std::collections::BTreeMap;

use ambit_proto::security as xsec;
use ambit_proto::workload as xds;
use serde::Serialize;

use crate::identity::CertificateDump;

use crate::state::{
    Authorization, EndpointSet, GatewayAddress, GatewayDestination, HealthStatus, IpNet, Locality,
    PortMapping, RbacMatch, Service, StateSnapshot, StringMatch, TunnelProtocol, Workload,
};

/// The whole dump.
#[derive(Debug, Serialize)]
pub struct ConfigDump<'a> {
    workloads: Vec<WorkloadDump<'a>>,
    services: Vec<ServiceDump<'a>>,
    policies: Vec<PolicyDump<'a>>,
    /// One entry per identity the certificate manager holds or fetches.
    certificates: Vec<CertificateDump>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct GatewayDump {
    destination: String,
    hbone_mtls_port: u16,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct LocalityDump<'a> {
    region: &'a str,
    zone: &'a str,
    subzone: &'a str,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct WorkloadDump<'a> {
    uid: &'a str,
    name: &'a str,
    namespace: &'a str,
    workload_ips: Vec<String>,
    #[serde(skip_serializing_if = "str::is_empty")]
    hostname: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    waypoint: Option<GatewayDump>,
    #[serde(skip_serializing_if = "Option::is_none")]
    network_gateway: Option<GatewayDump>,
    protocol: &'static str,
    service_account: &'a str,
    node: &'a str,
    network: &'a str,
    canonical_name: &'a str,
    canonical_revision: &'a str,
    workload_type: &'static str,
    workload_name: &'a str,
    status: &'static str,
    cluster_id: &'a str,
    trust_domain: &'a str,
    native_tunnel: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    locality: Option<LocalityDump<'a>>,
    capacity: u32,
    /// `namespace/hostname` → service port → target port.
    services: BTreeMap<&'a str, BTreeMap<u16, u16>>,
    authorization_policies: &'a [String],
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct EndpointDump<'a> {
    workload_uid: &'a str,
    service: &'a str,
    port: BTreeMap<u16, u16>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct ServiceDump<'a> {
    name: &'a str,
    namespace: &'a str,
    hostname: &'a str,
    vips: Vec<String>,
    ports: BTreeMap<u16, u16>,
    endpoints: BTreeMap<&'a str, EndpointDump<'a>>,
    subject_alt_names: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    waypoint: Option<GatewayDump>,
    ip_families: &'static str,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct MatchDump<'a> {
    namespaces: Vec<StringMatchDump<'a>>,
    not_namespaces: Vec<StringMatchDump<'a>>,
    principals: Vec<StringMatchDump<'a>>,
    not_principals: Vec<StringMatchDump<'a>>,
    source_ips: Vec<String>,
    not_source_ips: Vec<String>,
    destination_ips: Vec<String>,
    not_destination_ips: Vec<String>,
    destination_ports: &'a [u16],
    not_destination_ports: &'a [u16],
}

/// `{"Exact": "x"}`, `{"Prefix": "x"}`, `{"Suffix": "x"}` or `"Presence"`.
#[derive(Debug, Serialize)]
enum StringMatchDump<'a> {
    Exact(&'a str),
    Prefix(&'a str),
    Suffix(&'a str),
    Presence,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct PolicyDump<'a> {
    name: &'a str,
    namespace: &'a str,
    scope: &'static str,
    action: &'static str,
    rules: Vec<Vec<Vec<MatchDump<'a>>>>,
}

fn gateway(g: &GatewayAddress) -> GatewayDump {
    let destination = match &g.destination {
        GatewayDestination::Hostname {
            namespace,
            hostname,
        } => format!("{namespace}/{hostname}"),
        GatewayDestination::Address(a) => a.to_string(),
    };
    GatewayDump {
        destination,
        hbone_mtls_port: g.hbone_mtls_port,
    }
}

fn ports(list: &[PortMapping]) -> BTreeMap<u16, u16> {
    list.iter()
        .map(|p| (p.service_port, p.target_port))
        .collect()
}

fn workload_type(t: xds::WorkloadType) -> &'static str {
    match t {
        xds::WorkloadType::Deployment => "deployment",
        xds::WorkloadType::Cronjob => "cronjob",
        xds::WorkloadType::Pod => "pod",
        xds::WorkloadType::Job => "job",
    }
}

fn workload(w: &Workload) -> WorkloadDump<'_> {
    WorkloadDump {
        uid: &w.uid,
        name: &w.name,
        namespace: &w.namespace,
        workload_ips: w.ips.iter().map(|ip| ip.to_string()).collect(),
        hostname: &w.hostname,
        waypoint: w.waypoint.as_ref().map(gateway),
        network_gateway: w.network_gateway.as_ref().map(gateway),
        protocol: match w.protocol {
            TunnelProtocol::Hbone => "HBONE",
            TunnelProtocol::Tcp => "TCP",
        },
        service_account: &w.service_account,
        node: &w.node,
        network: &w.network,
        canonical_name: &w.canonical_name,
        canonical_revision: &w.canonical_revision,
        workload_type: workload_type(w.workload_type),
        workload_name: &w.workload_name,
        status: match w.status {
            HealthStatus::Healthy => "Healthy",
            HealthStatus::Unhealthy => "Unhealthy",
        },
        cluster_id: &w.cluster_id,
        trust_domain: &w.trust_domain,
        native_tunnel: w.native_tunnel,
        locality: w.locality.as_ref().map(|l: &Locality| LocalityDump {
            region: &l.region,
            zone: &l.zone,
            subzone: &l.subzone,
        }),
        capacity: w.capacity,
        services: w
            .services
            .iter()
            .map(|(k, v)| (k.as_str(), ports(v)))
            .collect(),
        authorization_policies: &w.authorization_policies,
    }
}

fn service<'a>(s: &'a Service, endpoints: Option<&'a EndpointSet>) -> ServiceDump<'a> {
    ServiceDump {
        name: &s.name,
        namespace: &s.namespace,
        hostname: &s.hostname,
        vips: s.vips.iter().map(|v| v.to_string()).collect(),
        ports: ports(&s.ports),
        endpoints: endpoints
            .into_iter()
            .flatten()
            .map(|(uid, e)| {
                (
                    &**uid,
                    EndpointDump {
                        workload_uid: &e.workload_uid,
                        service: &e.service,
                        port: ports(&e.ports),
                    },
                )
            })
            .collect(),
        subject_alt_names: &s.subject_alt_names,
        waypoint: s.waypoint.as_ref().map(gateway),
        ip_families: match s.ip_families {
            xds::IpFamilies::Automatic => "Automatic",
            xds::IpFamilies::Ipv4Only => "IPv4",
            xds::IpFamilies::Ipv6Only => "IPv6",
            xds::IpFamilies::Dual => "Dual",
        },
    }
}

fn string_matches(list: &[StringMatch]) -> Vec<StringMatchDump<'_>> {
    list.iter()
        .map(|m| match m {
            StringMatch::Exact(s) => StringMatchDump::Exact(s),
            StringMatch::Prefix(s) => StringMatchDump::Prefix(s),
            StringMatch::Suffix(s) => StringMatchDump::Suffix(s),
            StringMatch::Presence => StringMatchDump::Presence,
        })
        .collect()
}

fn nets(list: &[IpNet]) -> Vec<String> {
    list.iter().map(|n| n.to_string()).collect()
}

fn rbac_match(m: &RbacMatch) -> MatchDump<'_> {
    MatchDump {
        namespaces: string_matches(&m.namespaces),
        not_namespaces: string_matches(&m.not_namespaces),
        principals: string_matches(&m.principals),
        not_principals: string_matches(&m.not_principals),
        source_ips: nets(&m.source_ips),
        not_source_ips: nets(&m.not_source_ips),
        destination_ips: nets(&m.destination_ips),
        not_destination_ips: nets(&m.not_destination_ips),
        destination_ports: &m.destination_ports,
        not_destination_ports: &m.not_destination_ports,
    }
}

fn policy(p: &Authorization) -> PolicyDump<'_> {
    PolicyDump {
        name: &p.name,
        namespace: &p.namespace,
        scope: match p.scope {
            xsec::Scope::Global => "Global",
            xsec::Scope::Namespace => "Namespace",
            xsec::Scope::WorkloadSelector => "WorkloadSelector",
        },
        action: match p.action {
            xsec::Action::Allow => "Allow",
            xsec::Action::Deny => "Deny",
        },
        rules: p
            .rules
            .iter()
            .map(|clauses| {
                clauses
                    .iter()
                    .map(|matches| matches.iter().map(rbac_match).collect())
                    .collect()
            })
            .collect(),
    }
}

/// The dump of `snapshot`, ready to serialize.
pub fn config_dump(snapshot: &StateSnapshot, certificates: Vec<CertificateDump>) -> ConfigDump<'_> {
    let mut workloads: Vec<_> = snapshot.workloads().map(|w| workload(w)).collect();
    workloads.sort_by(|a, b| a.uid.cmp(b.uid));

    let mut services: Vec<_> = snapshot
        .services()
        .map(|s| {
            let key = s.key();
            (key, s)
        })
        .collect();
    services.sort_by(|a, b| a.0.cmp(&b.0));
    let services = services
        .into_iter()
        .map(|(key, s)| service(s, snapshot.endpoint_set(&key)))
        .collect();

    let mut policies: Vec<_> = snapshot.authorizations().map(|p| policy(p)).collect();
    policies.sort_by(|a, b| (a.namespace, a.name).cmp(&(b.namespace, b.name)));

    ConfigDump {
        workloads,
        services,
        policies,
        certificates,
    }
}
