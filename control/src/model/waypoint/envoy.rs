//! Small builders for the Envoy messages every waypoint resource uses:
//! config sources (ADS, the agent's SDS), TLS contexts with SPIFFE
//! validation, durations and `Any` packing. Only upstream Envoy extensions.

use envoy_types::pb::envoy::config::core::v3::{
    AggregatedConfigSource, ApiConfigSource, ApiVersion, ConfigSource, GrpcService,
    TransportSocket,
    api_config_source::ApiType,
    config_source::ConfigSourceSpecifier,
    grpc_service::{EnvoyGrpc, TargetSpecifier},
    transport_socket::ConfigType,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, CommonTlsContext, DownstreamTlsContext, SdsSecretConfig,
    SubjectAltNameMatcher, TlsParameters, UpstreamTlsContext,
    common_tls_context::{CombinedCertificateValidationContext, ValidationContextType},
    subject_alt_name_matcher::SanType,
    tls_parameters::TlsProtocol,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, string_matcher::MatchPattern};
use envoy_types::pb::google::protobuf::{Any, BoolValue, Duration as PbDuration, UInt32Value};
use prost::{Message, Name};

/// The agent's SDS cluster (a unix socket, in the bootstrap the agent renders).
pub const SDS_CLUSTER: &str = "sds-grpc";
/// SDS name of the proxy's own certificate and key.
pub const SECRET_CERTIFICATE: &str = "default";
/// SDS name of the mesh trust bundle.
pub const SECRET_ROOTS: &str = "ROOTCA";

/// One hasher state for every map this module builds: the maps of Envoy's
/// messages are `HashMap`s whose iteration (hence encoding) order depends on
/// the hasher's keys, and a resource's version is a hash of its bytes.
static MAP_STATE: std::sync::LazyLock<std::hash::RandomState> =
    std::sync::LazyLock::new(std::hash::RandomState::new);

/// A map for an Envoy message field whose encoding is the same every time
/// it holds the same entries (within one process): entries are inserted in
/// key order into a map of that exact capacity with the shared hasher
/// state, so equal resources get equal bytes and keep their version.
pub fn stable_map<V>(
    entries: impl IntoIterator<Item = (String, V)>,
) -> std::collections::HashMap<String, V> {
    let sorted: std::collections::BTreeMap<String, V> = entries.into_iter().collect();
    let mut map =
        std::collections::HashMap::with_capacity_and_hasher(sorted.len(), MAP_STATE.clone());
    map.extend(sorted);
    map
}

/// Packs a message into an `Any`.
pub fn any<M: Message + Name>(msg: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: msg.encode_to_vec(),
    }
}

/// A protobuf `UInt32Value`.
pub fn u32_value(value: u32) -> UInt32Value {
    UInt32Value { value }
}

/// A protobuf `BoolValue`.
pub fn bool_value(value: bool) -> BoolValue {
    BoolValue { value }
}

/// A protobuf duration.
pub fn duration(d: std::time::Duration) -> PbDuration {
    PbDuration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

/// Resources that come over the same ADS stream.
pub fn ads() -> ConfigSource {
    ConfigSource {
        resource_api_version: ApiVersion::V3 as i32,
        config_source_specifier: Some(ConfigSourceSpecifier::Ads(AggregatedConfigSource {})),
        ..Default::default()
    }
}

/// A secret the agent beside Envoy serves over SDS.
pub fn sds(name: &str) -> SdsSecretConfig {
    SdsSecretConfig {
        name: name.to_string(),
        sds_config: Some(ConfigSource {
            resource_api_version: ApiVersion::V3 as i32,
            config_source_specifier: Some(ConfigSourceSpecifier::ApiConfigSource(
                ApiConfigSource {
                    api_type: ApiType::Grpc as i32,
                    transport_api_version: ApiVersion::V3 as i32,
                    grpc_services: vec![GrpcService {
                        target_specifier: Some(TargetSpecifier::EnvoyGrpc(EnvoyGrpc {
                            cluster_name: SDS_CLUSTER.to_string(),
                            ..Default::default()
                        })),
                        ..Default::default()
                    }],
                    set_node_on_first_message_only: true,
                    ..Default::default()
                },
            )),
            ..Default::default()
        }),
    }
}

/// Peer certificate validation: chains to the mesh roots (SDS) and carries
/// a URI SAN matching `san`.
fn mesh_validation(san: MatchPattern) -> ValidationContextType {
    ValidationContextType::CombinedValidationContext(CombinedCertificateValidationContext {
        default_validation_context: Some(CertificateValidationContext {
            match_typed_subject_alt_names: vec![SubjectAltNameMatcher {
                san_type: SanType::Uri as i32,
                matcher: Some(StringMatcher {
                    match_pattern: Some(san),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        validation_context_sds_secret_config: Some(sds(SECRET_ROOTS)),
        ..Default::default()
    })
}

/// HBONE's TLS: 1.3, ALPN h2, our certificate from SDS.
fn hbone_common(validation: ValidationContextType) -> CommonTlsContext {
    CommonTlsContext {
        tls_params: Some(TlsParameters {
            tls_minimum_protocol_version: TlsProtocol::TlSv13 as i32,
            tls_maximum_protocol_version: TlsProtocol::TlSv13 as i32,
            ..Default::default()
        }),
        alpn_protocols: vec!["h2".to_string()],
        tls_certificate_sds_secret_configs: vec![sds(SECRET_CERTIFICATE)],
        validation_context_type: Some(validation),
        ..Default::default()
    }
}

/// The HBONE server side: a client certificate from any identity of the
/// trust domain is required.
pub fn hbone_server_tls(trust_domain: &str) -> TransportSocket {
    let ctx = DownstreamTlsContext {
        common_tls_context: Some(hbone_common(mesh_validation(MatchPattern::Prefix(
            format!("spiffe://{trust_domain}/"),
        )))),
        require_client_certificate: Some(bool_value(true)),
        ..Default::default()
    };
    TransportSocket {
        name: "envoy.transport_sockets.tls".to_string(),
        config_type: Some(ConfigType::TypedConfig(any(&ctx))),
    }
}

/// The HBONE client side: the peer must be exactly `spiffe_id`.
pub fn hbone_client_tls(spiffe_id: &str) -> TransportSocket {
    let ctx = UpstreamTlsContext {
        common_tls_context: Some(hbone_common(mesh_validation(MatchPattern::Exact(
            spiffe_id.to_string(),
        )))),
        ..Default::default()
    };
    TransportSocket {
        name: "envoy.transport_sockets.tls".to_string(),
        config_type: Some(ConfigType::TypedConfig(any(&ctx))),
    }
}
