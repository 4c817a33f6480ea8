//! Request telemetry of a waypoint's HTTP service chains, from upstream
//! Envoy alone (no Istio stats extension):
//!
//! * **Istio's request metrics** come from Envoy's `stats` access logger,
//!   which adds to a counter and three histograms per finished request,
//!   tagged by command operators: the caller's identity and baggage from
//!   the filter state the HBONE listener shares ([`super::authz::PEER_PRINCIPAL`],
//!   [`PEER_BAGGAGE`]), the endpoint's workload from its metadata
//!   ([`ENDPOINT_METADATA`]), the service from literals (one chain per
//!   service port), response code, flags, gRPC status and route name. The
//!   counting happens in Envoy's worker, in process: no per-request RPC.
//!   Envoy exposes them as `envoy_istio_*`; the agent beside it serves them
//!   as `istio_*` on 15020 and expands the baggage into `source_workload`,
//!   `source_workload_namespace`, `source_app` and `source_version`.
//! * **Denials** by an RBAC filter are counted per policy
//!   (`ambit_requests_denied_total{policy}` on 15020) from the response
//!   code details Envoy records (`rbac_access_denied_matched_policy[...]`).
//! * **One JSON access-log line per request** on Envoy's stdout.
//!
//! Cardinality is bounded twice: every tag is either a literal, a value
//! from a closed set, or a mesh identity/workload; and the stats scope caps
//! how many series it holds (further ones are not recorded).

use envoy_types::pb::envoy::config::accesslog::v3::{
    AccessLog, AccessLogFilter, ComparisonFilter, StatusCodeFilter, access_log,
    access_log_filter::FilterSpecifier, comparison_filter::Op,
};
use envoy_types::pb::envoy::config::core::v3::{
    RuntimeUInt32, SubstitutionFormatString, substitution_format_string::Format,
};
use envoy_types::pb::envoy::extensions::access_loggers::file::v3::{
    FileAccessLog, file_access_log::AccessLogFormat,
};
use envoy_types::pb::envoy::extensions::access_loggers::stats::v3::{
    Config as StatsLog,
    config::{Counter, Histogram, Stat, Tag, histogram::Unit},
};
use envoy_types::pb::envoy::r#type::v3::Scope;
use envoy_types::pb::google::protobuf::{Struct, UInt64Value, Value, value::Kind};

use super::authz::PEER_PRINCIPAL;
use super::envoy::{any, stable_map, u32_value};
use super::{BoundPort, BoundService, Protocol};

/// Filter-state key holding the caller's `baggage` (its ztunnel's CONNECT
/// header: namespace, workload, app, version).
pub const PEER_BAGGAGE: &str = "io.ambit.peer_baggage";
/// Endpoint metadata namespace naming the workload behind an endpoint.
pub const ENDPOINT_METADATA: &str = "ambit";
/// The stats scope of the request metrics (`envoy_istio_*` in Envoy's
/// Prometheus output).
const ISTIO_SCOPE: &str = "istio";
/// ... and of the denial counter.
const AMBIT_SCOPE: &str = "ambit";
/// Series a scope may hold: generous for a mesh, bounded against a client
/// that varies what it can.
const MAX_SERIES: u32 = 20_000;

/// The access logs of one HTTP service chain.
pub fn access_logs(svc: &BoundService, port: &BoundPort) -> Vec<AccessLog> {
    let denials = vec![
        tag("reporter", "waypoint"),
        tag(
            "source_principal",
            &format!("%FILTER_STATE({PEER_PRINCIPAL}:PLAIN)%"),
        ),
        tag("destination_service", &svc.hostname),
    ];
    request_logs(istio_tags(svc, port), Some(denials), &svc.hostname)
}

/// Istio's request metrics tagged `metric_tags`, the denial counter tagged
/// `denial_tags` (plus `policy`) when given, and the JSON line naming
/// `destination_service` (a literal or a command operator). Sidecars use
/// it with their own tags.
pub(crate) fn request_logs(
    metric_tags: Vec<Tag>,
    denial_tags: Option<Vec<Tag>>,
    destination_service: &str,
) -> Vec<AccessLog> {
    let mut out = vec![access_log(
        "envoy.access_loggers.stats",
        any(&request_metrics(metric_tags)),
        None,
    )];
    if let Some(tags) = denial_tags {
        out.push(access_log(
            "envoy.access_loggers.stats",
            any(&denials(tags)),
            Some(status_is(403)),
        ));
    }
    out.push(access_log(
        "envoy.access_loggers.file",
        any(&json_lines(destination_service)),
        None,
    ));
    out
}

fn access_log(
    name: &str,
    config: envoy_types::pb::google::protobuf::Any,
    filter: Option<AccessLogFilter>,
) -> AccessLog {
    AccessLog {
        name: name.to_string(),
        filter,
        config_type: Some(access_log::ConfigType::TypedConfig(config)),
    }
}

fn status_is(code: u32) -> AccessLogFilter {
    AccessLogFilter {
        filter_specifier: Some(FilterSpecifier::StatusCodeFilter(StatusCodeFilter {
            comparison: Some(ComparisonFilter {
                op: Op::Eq as i32,
                value: Some(RuntimeUInt32 {
                    default_value: code,
                    runtime_key: "ambit.denied_status".to_string(),
                }),
            }),
        })),
    }
}

pub(crate) fn tag(name: &str, value_format: &str) -> Tag {
    Tag {
        name: name.to_string(),
        value_format: value_format.to_string(),
        rules: None,
    }
}

fn scope(prefix: &str) -> Scope {
    Scope {
        max_counters: Some(u32_value(MAX_SERIES)),
        max_histograms: Some(u32_value(MAX_SERIES)),
        max_gauges: Some(u32_value(0)),
        prefix: prefix.to_string(),
        sharing_name: String::new(),
        ..Default::default()
    }
}

/// The labels of Istio's request metrics, as Envoy command operators.
fn istio_tags(svc: &BoundService, port: &BoundPort) -> Vec<Tag> {
    let upstream = |key: &str| format!("%UPSTREAM_METADATA({ENDPOINT_METADATA}:{key})%");
    let protocol = if port.protocol == Protocol::Grpc {
        "grpc"
    } else {
        "http"
    };
    vec![
        tag("reporter", "waypoint"),
        tag(
            "source_principal",
            &format!("%FILTER_STATE({PEER_PRINCIPAL}:PLAIN)%"),
        ),
        tag(
            "source_baggage",
            &format!("%FILTER_STATE({PEER_BAGGAGE}:PLAIN)%"),
        ),
        tag("destination_workload", &upstream("workload")),
        tag("destination_workload_namespace", &upstream("namespace")),
        tag("destination_principal", &upstream("principal")),
        tag("destination_app", &upstream("app")),
        tag("destination_version", &upstream("version")),
        tag("destination_service", &svc.hostname),
        tag("destination_service_name", &svc.name),
        tag("destination_service_namespace", &svc.namespace),
        tag("request_protocol", protocol),
        tag("response_code", "%RESPONSE_CODE%"),
        tag("grpc_response_status", "%GRPC_STATUS(NUMBER)%"),
        tag("response_flags", "%RESPONSE_FLAGS%"),
        tag("connection_security_policy", "mutual_tls"),
        tag("route_name", "%ROUTE_NAME%"),
    ]
}

/// `istio_requests_total`, `istio_request_duration_milliseconds`,
/// `istio_request_bytes`, `istio_response_bytes`.
fn request_metrics(tags: Vec<Tag>) -> StatsLog {
    let stat = |name: &str| Stat {
        name: name.to_string(),
        tags: tags.clone(),
    };
    let histogram = |name: &str, unit: Unit, value: &str| Histogram {
        stat: Some(stat(name)),
        unit: unit as i32,
        value_format: value.to_string(),
    };
    StatsLog {
        stats_scope: Some(scope(ISTIO_SCOPE)),
        counters: vec![Counter {
            stat: Some(stat("requests_total")),
            value_fixed: Some(UInt64Value { value: 1 }),
            ..Default::default()
        }],
        histograms: vec![
            histogram(
                "request_duration_milliseconds",
                Unit::Milliseconds,
                "%DURATION%",
            ),
            histogram("request_bytes", Unit::Bytes, "%BYTES_RECEIVED%"),
            histogram("response_bytes", Unit::Bytes, "%BYTES_SENT%"),
        ],
        ..Default::default()
    }
}

/// `ambit_requests_denied_total{policy}` for 403s (the agent keeps those an
/// RBAC filter answered and names the policy).
fn denials(mut tags: Vec<Tag>) -> StatsLog {
    tags.insert(1.min(tags.len()), tag("policy", "%RESPONSE_CODE_DETAILS%"));
    StatsLog {
        stats_scope: Some(scope(AMBIT_SCOPE)),
        counters: vec![Counter {
            stat: Some(Stat {
                name: "requests_denied_total".to_string(),
                tags,
            }),
            value_fixed: Some(UInt64Value { value: 1 }),
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// One JSON object per request on Envoy's stdout.
fn json_lines(destination_service: &str) -> FileAccessLog {
    let fields = [
        ("start_time", "%START_TIME%".to_string()),
        ("method", "%REQ(:METHOD)%".to_string()),
        ("path", "%REQ(:PATH)%".to_string()),
        ("authority", "%REQ(:AUTHORITY)%".to_string()),
        ("protocol", "%PROTOCOL%".to_string()),
        ("response_code", "%RESPONSE_CODE%".to_string()),
        ("response_flags", "%RESPONSE_FLAGS%".to_string()),
        (
            "response_code_details",
            "%RESPONSE_CODE_DETAILS%".to_string(),
        ),
        ("duration_ms", "%DURATION%".to_string()),
        (
            "upstream_service_time_ms",
            "%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%".to_string(),
        ),
        ("bytes_received", "%BYTES_RECEIVED%".to_string()),
        ("bytes_sent", "%BYTES_SENT%".to_string()),
        (
            "upstream_host",
            "%UPSTREAM_METADATA(tunnel:destination)%".to_string(),
        ),
        ("upstream_cluster", "%UPSTREAM_CLUSTER%".to_string()),
        ("route_name", "%ROUTE_NAME%".to_string()),
        ("destination_service", destination_service.to_string()),
        ("source_address", "%DOWNSTREAM_REMOTE_ADDRESS%".to_string()),
        (
            "source_principal",
            format!("%FILTER_STATE({PEER_PRINCIPAL}:PLAIN)%"),
        ),
        (
            "destination_principal",
            format!("%UPSTREAM_METADATA({ENDPOINT_METADATA}:principal)%"),
        ),
        ("request_id", "%REQ(X-REQUEST-ID)%".to_string()),
        ("traceparent", "%REQ(TRACEPARENT)%".to_string()),
        (
            "audit",
            "%DYNAMIC_METADATA(envoy.common:access_log_hint)%".to_string(),
        ),
    ];
    let json = Struct {
        fields: stable_map(fields.into_iter().map(|(k, v)| {
            (
                k.to_string(),
                Value {
                    kind: Some(Kind::StringValue(v)),
                },
            )
        })),
    };
    FileAccessLog {
        path: "/dev/stdout".to_string(),
        access_log_format: Some(AccessLogFormat::LogFormat(SubstitutionFormatString {
            format: Some(Format::JsonFormat(json)),
            ..Default::default()
        })),
    }
}
