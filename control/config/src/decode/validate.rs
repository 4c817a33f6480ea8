//! Checks of decoded objects that serde cannot express (IP syntax of string
//! fields, required port numbers; the security kinds' checks are in
//! `policy.rs`), and the derived fields they fill (service VIPs, endpoint
//! IPs).

use std::net::IpAddr;

use tracing::debug;

use crate::objects::{Cidr, Object};

/// Checks what serde cannot and fills derived fields.
pub(super) fn validate(obj: &mut Object) -> Result<(), String> {
    match obj {
        Object::Service(s) => {
            let mut vips = Vec::new();
            let mut all: Vec<&str> = Vec::new();
            if !s.spec.cluster_ip.is_empty() {
                all.push(&s.spec.cluster_ip);
            }
            all.extend(s.spec.cluster_ips.iter().map(String::as_str));
            for (i, ip) in all.into_iter().enumerate() {
                if ip == "None" || ip.is_empty() {
                    continue;
                }
                let parsed: IpAddr = ip.parse().map_err(|_| {
                    let field = if i == 0 && !s.spec.cluster_ip.is_empty() {
                        "spec.clusterIP".to_string()
                    } else {
                        "spec.clusterIPs".to_string()
                    };
                    format!("{field}: {ip:?} is not a valid IP address; use an IP, \"None\" for a headless service, or leave it out")
                })?;
                if !vips.contains(&parsed) {
                    vips.push(parsed);
                }
            }
            if s.is_headless() {
                vips.clear();
            }
            s.spec.vips = vips;
            for (i, p) in s.spec.ports.iter().enumerate() {
                if p.port == 0 {
                    return Err(format!(
                        "spec.ports[{i}].port is missing; every service port needs a number (1-65535)"
                    ));
                }
            }
            if s.spec.ports.len() > 1 && s.spec.ports.iter().any(|p| p.name.is_empty()) {
                return Err("spec.ports: every port needs a name when a Service has more than one port; add `name:` to each".to_string());
            }
        }
        Object::EndpointSlice(es) => {
            let fqdn = es.address_type == "FQDN";
            for (i, ep) in es.endpoints.iter_mut().enumerate() {
                ep.ips.clear();
                if fqdn {
                    continue;
                }
                for a in &ep.addresses {
                    let ip: IpAddr = a.parse().map_err(|_| {
                        format!("endpoints[{i}].addresses: {a:?} is not a valid IP address; use an IP (or addressType: FQDN for host names)")
                    })?;
                    ep.ips.push(ip);
                }
            }
        }
        Object::ServiceEntry(se) => {
            if se.spec.hosts.is_empty() {
                return Err(
                    "spec.hosts is empty; a ServiceEntry needs at least one host".to_string(),
                );
            }
            if se.spec.workload_selector.is_some() && !se.spec.endpoints.is_empty() {
                return Err(
                    "spec.workloadSelector and spec.endpoints are both set; use only one of them"
                        .to_string(),
                );
            }
            let mut vips = Vec::new();
            for a in &se.spec.addresses {
                let c: Cidr = a
                    .parse()
                    .map_err(|e| format!("spec.addresses: {e}; list virtual IPs or CIDRs"))?;
                if c.is_host() {
                    vips.push(c.addr);
                } else {
                    debug!(address = %a, "ServiceEntry CIDR address is not a single VIP; it is not used as a service address");
                }
            }
            se.spec.vips = vips;
            for (i, p) in se.spec.ports.iter().enumerate() {
                if p.number == 0 {
                    return Err(format!(
                        "spec.ports[{i}].number is missing; every ServiceEntry port needs a number (1-65535)"
                    ));
                }
            }
        }
        Object::Pod(p) => {
            for (i, c) in p.spec.containers.iter().enumerate() {
                for (j, cp) in c.ports.iter().enumerate() {
                    if cp.container_port == 0 {
                        return Err(format!(
                            "spec.containers[{i}].ports[{j}].containerPort is missing; add the port number"
                        ));
                    }
                }
            }
        }
        Object::AuthorizationPolicy(ap) => super::policy::validate_policy(ap)?,
        Object::PeerAuthentication(pa) => super::policy::validate_peer_authentication(pa)?,
        Object::Telemetry(t) => validate_telemetry(t)?,
        Object::MeshConfig(m) => decode_mesh_config(m)?,
        // The traffic kinds check themselves while deserializing (their
        // errors carry the line); cross-object checks are the control
        // plane's and `ambitctl analyze`'s.
        Object::Namespace(_)
        | Object::WorkloadEntry(_)
        | Object::VirtualService(_)
        | Object::DestinationRule(_)
        | Object::Sidecar(_)
        | Object::Gateway(_)
        | Object::HttpRoute(_)
        | Object::GrpcRoute(_)
        | Object::TcpRoute(_)
        | Object::Node(_) => {}
    }
    Ok(())
}

fn check_sampling(at: &str, value: Option<f64>) -> Result<(), String> {
    match value {
        Some(v) if !(0.0..=100.0).contains(&v) => Err(format!(
            "{at}: {v} is not a percentage; use a value from 0 to 100 (0.01 steps)"
        )),
        _ => Ok(()),
    }
}

fn validate_telemetry(t: &crate::objects::Telemetry) -> Result<(), String> {
    for (i, tr) in t.spec.tracing.iter().enumerate() {
        check_sampling(
            &format!("spec.tracing[{i}].randomSamplingPercentage"),
            tr.random_sampling_percentage,
        )?;
        if let Some(j) = tr.providers.iter().position(|p| p.name.is_empty()) {
            return Err(format!(
                "spec.tracing[{i}].providers[{j}].name is missing; name an extensionProvider of the mesh config"
            ));
        }
    }
    Ok(())
}

/// Decodes the mesh configuration YAML held in `data.mesh`.
fn decode_mesh_config(m: &mut crate::objects::MeshConfigMap) -> Result<(), String> {
    use crate::objects::{MESH_CONFIG_KEY, MeshConfig};
    let Some(text) = m.data.get(MESH_CONFIG_KEY) else {
        m.mesh = MeshConfig::default();
        return Ok(());
    };
    let mesh: MeshConfig = super::yaml::from_yaml(text, 0).map_err(|e| {
        let at = e.path.map(|p| format!(" at {p}")).unwrap_or_default();
        format!(
            "data.{MESH_CONFIG_KEY}{at}: {} (lines counted from the start of the mesh text); fix the mesh configuration",
            e.message
        )
    })?;
    check_sampling(
        "data.mesh defaultConfig.tracing.sampling",
        mesh.default_config
            .tracing
            .as_ref()
            .and_then(|t| t.sampling),
    )?;
    for (i, p) in mesh.extension_providers.iter().enumerate() {
        let at = format!("data.mesh extensionProviders[{i}]");
        if p.name.is_empty() {
            return Err(format!("{at}.name is missing; every provider needs a name"));
        }
        if p.opentelemetry
            .as_ref()
            .is_some_and(|o| o.service.is_empty() || o.port == 0)
        {
            return Err(format!(
                "{at}.opentelemetry needs service and port (the collector's OTLP/gRPC port, usually 4317)"
            ));
        }
    }
    m.mesh = mesh;
    Ok(())
}
