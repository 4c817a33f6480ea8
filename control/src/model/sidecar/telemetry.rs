//! Request telemetry of a sidecar's HTTP chains: Istio's request metrics
//! with `reporter="source"` on the outbound side and
//! `reporter="destination"` on the inbound side, the denial counter, and
//! one JSON access-log line per request (the waypoint's loggers, see
//! `model/waypoint/telemetry.rs`, with a sidecar's tags).
//!
//! The outbound configuration is shared by every sidecar of a namespace,
//! so it cannot name the pod: the reporting pod's own labels
//! (`source_*` outbound, `destination_*` inbound) are added by the agent
//! beside Envoy, which knows which pod it serves, when it serves the stats
//! on 15020. What Envoy tags is what only it knows per request: the
//! callee's workload and service from the chosen endpoint's metadata
//! ([`ENDPOINT_METADATA`]), the caller's identity from its certificate or
//! its HBONE tunnel, the response.

use envoy_types::pb::envoy::config::accesslog::v3::AccessLog;

use super::InboundPort;
use crate::model::waypoint::Protocol;
use crate::model::waypoint::authz::PEER_PRINCIPAL;
use crate::model::waypoint::telemetry::{ENDPOINT_METADATA, PEER_BAGGAGE, request_logs, tag};

/// Endpoint metadata keys (under [`ENDPOINT_METADATA`]) naming the
/// service an endpoint was chosen for.
pub const SERVICE_KEYS: [&str; 3] = ["service", "service_name", "service_namespace"];

/// How a caller reached an inbound chain, which says who it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    /// mTLS straight to the sidecar: the peer certificate's URI SAN.
    Tls,
    /// An HBONE tunnel: the identity (and baggage) its termination recorded.
    Hbone,
    /// Plaintext (PERMISSIVE or DISABLE): unknown.
    Plaintext,
}

fn protocol_name(protocol: Protocol) -> &'static str {
    if protocol == Protocol::Grpc {
        "grpc"
    } else {
        "http"
    }
}

/// The access logs of an outbound HTTP chain (`reporter="source"`).
pub fn outbound_logs(protocol: Protocol) -> Vec<AccessLog> {
    let upstream = |key: &str| format!("%UPSTREAM_METADATA({ENDPOINT_METADATA}:{key})%");
    let tags = vec![
        tag("reporter", "source"),
        tag("destination_workload", &upstream("workload")),
        tag("destination_workload_namespace", &upstream("namespace")),
        tag("destination_principal", &upstream("principal")),
        tag("destination_app", &upstream("app")),
        tag("destination_version", &upstream("version")),
        tag("destination_service", &upstream(SERVICE_KEYS[0])),
        tag("destination_service_name", &upstream(SERVICE_KEYS[1])),
        tag("destination_service_namespace", &upstream(SERVICE_KEYS[2])),
        tag("request_protocol", protocol_name(protocol)),
        tag("response_code", "%RESPONSE_CODE%"),
        tag("grpc_response_status", "%GRPC_STATUS(NUMBER)%"),
        tag("response_flags", "%RESPONSE_FLAGS%"),
        // What the source knows of the connection's security: Istio's
        // sidecars report `unknown` here too.
        tag("connection_security_policy", "unknown"),
        tag("route_name", "%ROUTE_NAME%"),
    ];
    request_logs(tags, None, &upstream(SERVICE_KEYS[0]))
}

/// The access logs of an inbound HTTP chain (`reporter="destination"`).
pub fn inbound_logs(port: &InboundPort, caller: Caller) -> Vec<AccessLog> {
    let principal = match caller {
        Caller::Tls => "%DOWNSTREAM_PEER_URI_SAN%".to_string(),
        Caller::Hbone => format!("%FILTER_STATE({PEER_PRINCIPAL}:PLAIN)%"),
        // Envoy refuses an empty tag value; the agent reads `-` as unknown.
        Caller::Plaintext => "-".to_string(),
    };
    let baggage = match caller {
        Caller::Hbone => format!("%FILTER_STATE({PEER_BAGGAGE}:PLAIN)%"),
        Caller::Tls | Caller::Plaintext => "-".to_string(),
    };
    let security = match caller {
        Caller::Tls | Caller::Hbone => "mutual_tls",
        Caller::Plaintext => "none",
    };
    let service = port.service.as_ref();
    let hostname = service.map_or("unknown", |s| s.hostname.as_str());
    let tags = vec![
        tag("reporter", "destination"),
        tag("source_principal", &principal),
        tag("source_baggage", &baggage),
        tag("destination_service", hostname),
        tag(
            "destination_service_name",
            service.map_or("unknown", |s| s.name.as_str()),
        ),
        tag(
            "destination_service_namespace",
            service.map_or("unknown", |s| s.namespace.as_str()),
        ),
        tag("request_protocol", protocol_name(port.protocol)),
        tag("response_code", "%RESPONSE_CODE%"),
        tag("grpc_response_status", "%GRPC_STATUS(NUMBER)%"),
        tag("response_flags", "%RESPONSE_FLAGS%"),
        tag("connection_security_policy", security),
        tag("route_name", "%ROUTE_NAME%"),
    ];
    let denials = vec![
        tag("reporter", "destination"),
        tag("source_principal", &principal),
        tag("destination_service", hostname),
    ];
    request_logs(tags, Some(denials), hostname)
}
