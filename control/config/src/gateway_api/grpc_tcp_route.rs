//! `gateway.networking.k8s.io` GRPCRoute and TCPRoute, decoded only: the
//! control plane does not translate them yet.

use serde::Deserialize;

use super::{BackendRef, HttpBackendRef, HttpHeaderMatch, HttpRouteFilter, ParentReference};
use crate::objects::{ObjectMeta, nullable};
use crate::scalars::checked_list;

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GrpcRoute {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: GrpcRouteSpec,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GrpcRouteSpec {
    #[serde(deserialize_with = "nullable")]
    pub parent_refs: Vec<ParentReference>,
    #[serde(deserialize_with = "nullable")]
    pub hostnames: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub rules: Vec<GrpcRouteRule>,
}

/// One gRPC rule. Its filters take the HTTPRoute filter types the Gateway
/// API allows for gRPC (header modifiers, mirror, extension references).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GrpcRouteRule {
    pub name: Option<String>,
    #[serde(deserialize_with = "nullable")]
    pub matches: Vec<GrpcRouteMatch>,
    #[serde(deserialize_with = "nullable")]
    pub filters: Vec<HttpRouteFilter>,
    #[serde(deserialize_with = "nullable")]
    pub backend_refs: Vec<HttpBackendRef>,
}

/// Conditions on a gRPC call; all must hold.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GrpcRouteMatch {
    pub method: Option<GrpcMethodMatch>,
    #[serde(deserialize_with = "checked_list")]
    pub headers: Vec<HttpHeaderMatch>,
}

/// A gRPC service and/or method match.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct GrpcMethodMatch {
    /// `Exact` when absent, or `RegularExpression`.
    #[serde(rename = "type")]
    pub type_: Option<String>,
    pub service: Option<String>,
    pub method: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TcpRoute {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: TcpRouteSpec,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TcpRouteSpec {
    #[serde(deserialize_with = "nullable")]
    pub parent_refs: Vec<ParentReference>,
    #[serde(deserialize_with = "nullable")]
    pub rules: Vec<TcpRouteRule>,
}

/// One TCP rule: weighted backends.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TcpRouteRule {
    pub name: Option<String>,
    #[serde(deserialize_with = "nullable")]
    pub backend_refs: Vec<BackendRef>,
}
