//! A waypoint's HTTP routes: one route configuration per HTTP service
//! port, named `<hostname>:<port>`, whose virtual host answers to every
//! name the service is reached by.

use envoy_types::pb::envoy::config::route::v3::{
    Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, route::Action,
    route_action::ClusterSpecifier, route_match::PathSpecifier,
};

use super::{BoundService, ROUTE_TYPE, WaypointPlan, cluster_name};
use crate::model::snapshot::XdsResource;

/// The route configuration name of one HTTP service port.
pub fn route_name(hostname: &str, port: u16) -> String {
    format!("{hostname}:{port}")
}

/// Every route configuration of the waypoint.
pub fn routes(plan: &WaypointPlan) -> Vec<XdsResource> {
    let mut out = Vec::new();
    for svc in &plan.services {
        for port in svc.ports.iter().filter(|p| p.protocol.is_http()) {
            let name = route_name(&svc.hostname, port.port);
            let rc = RouteConfiguration {
                name: name.clone(),
                virtual_hosts: vec![VirtualHost {
                    name: name.clone(),
                    domains: domains(svc, port.port),
                    routes: vec![default_route(&cluster_name(port.port, "", &svc.hostname))],
                    ..Default::default()
                }],
                ..Default::default()
            };
            out.push(XdsResource::new(ROUTE_TYPE, name, Vec::new(), &rc));
        }
    }
    out
}

/// Every `Host` a client may send for the service: the hostname and its
/// short forms, each VIP, with and without the port.
fn domains(svc: &BoundService, port: u16) -> Vec<String> {
    let mut names = vec![svc.hostname.clone()];
    if let Some(short) = svc.hostname.strip_suffix(".svc.cluster.local") {
        names.push(format!("{short}.svc"));
        names.push(short.to_string());
        if short.ends_with(&format!(".{}", svc.namespace)) {
            names.push(svc.name.clone());
        }
    }
    names.extend(svc.vips.iter().map(|ip| match ip {
        std::net::IpAddr::V4(a) => a.to_string(),
        std::net::IpAddr::V6(a) => format!("[{a}]"),
    }));
    let mut out = Vec::with_capacity(names.len() * 2);
    for n in names {
        out.push(format!("{n}:{port}"));
        out.push(n);
    }
    out.sort();
    out.dedup();
    out
}

/// Everything to the service's default cluster.
fn default_route(cluster: &str) -> Route {
    Route {
        name: "default".to_string(),
        r#match: Some(RouteMatch {
            path_specifier: Some(PathSpecifier::Prefix("/".to_string())),
            ..Default::default()
        }),
        action: Some(Action::Route(RouteAction {
            cluster_specifier: Some(ClusterSpecifier::Cluster(cluster.to_string())),
            ..Default::default()
        })),
        ..Default::default()
    }
}
