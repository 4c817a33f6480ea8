//! `gateway.networking.k8s.io` HTTPRoute: HTTP rules attached to Gateways
//! or, in the mesh (GAMMA), to Services.

use std::time::Duration;

use serde::Deserialize;

use super::{BackendObjectReference, LocalObjectReference, ParentReference};
use crate::objects::{ObjectMeta, nullable, optional_port_number};
use crate::scalars::{
    CheckOnDecode, ScalarError, check_regex, checked_list, checked_option,
    optional_gateway_duration, optional_gateway_weight, optional_whole_percent,
};

/// Why a part of an HTTPRoute is unusable. Every message ends with what to
/// do.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HttpRouteError {
    #[error("a {0} filter needs its {1} field; add it or change the type")]
    MissingFilterBody(&'static str, &'static str),
    #[error("a {0} filter must not set {1}; remove it or change the type")]
    ExtraFilterBody(&'static str, &'static str),
    #[error("a path modifier of type {0} needs {1}; add it")]
    MissingPathValue(&'static str, &'static str),
    #[error("path {0:?} does not start with '/'; write an absolute path such as \"/api\"")]
    RelativePath(String),
    #[error(
        "backendRequest ({backend:?}) is longer than request ({request:?}); make backendRequest at most request"
    )]
    BackendTimeoutTooLong {
        backend: Duration,
        request: Duration,
    },
    #[error(transparent)]
    Scalar(#[from] ScalarError),
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRoute {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub spec: HttpRouteSpec,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRouteSpec {
    #[serde(deserialize_with = "nullable")]
    pub parent_refs: Vec<ParentReference>,
    #[serde(deserialize_with = "nullable")]
    pub hostnames: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub rules: Vec<HttpRouteRule>,
}

impl HttpRoute {
    /// Every backend the rules send traffic to (mirrors excluded).
    pub fn backend_refs(&self) -> impl Iterator<Item = &HttpBackendRef> {
        self.spec.rules.iter().flat_map(|r| &r.backend_refs)
    }

    /// The Services this route is attached to (mesh routes, GAMMA).
    pub fn service_parents(&self) -> impl Iterator<Item = &ParentReference> {
        self.spec.parent_refs.iter().filter(|p| p.is_service())
    }
}

/// One rule: matches (any of them), filters, and weighted backends.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRouteRule {
    pub name: Option<String>,
    /// Empty matches every request (path prefix `/`).
    #[serde(deserialize_with = "nullable")]
    pub matches: Vec<HttpRouteMatch>,
    #[serde(deserialize_with = "nullable")]
    pub filters: Vec<HttpRouteFilter>,
    #[serde(deserialize_with = "nullable")]
    pub backend_refs: Vec<HttpBackendRef>,
    #[serde(deserialize_with = "checked_option")]
    pub timeouts: Option<HttpRouteTimeouts>,
}

/// Conditions on a request; all must hold.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRouteMatch {
    /// Path prefix `/` when absent ([`Self::effective_path`]).
    pub path: Option<HttpPathMatch>,
    #[serde(deserialize_with = "checked_list")]
    pub headers: Vec<HttpHeaderMatch>,
    #[serde(deserialize_with = "checked_list")]
    pub query_params: Vec<HttpQueryParamMatch>,
    pub method: Option<HttpMethod>,
}

impl HttpRouteMatch {
    /// The path match, defaulted to prefix `/`.
    pub fn effective_path(&self) -> HttpPathMatch {
        self.path.clone().unwrap_or_default()
    }
}

/// A path match: `{type: PathPrefix, value: /api}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "HttpPathMatchFields")]
pub struct HttpPathMatch {
    pub type_: PathMatchType,
    pub value: String,
}

impl Default for HttpPathMatch {
    fn default() -> Self {
        HttpPathMatch {
            type_: PathMatchType::PathPrefix,
            value: "/".to_string(),
        }
    }
}

/// How a path is matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum PathMatchType {
    Exact,
    PathPrefix,
    RegularExpression,
}

/// A path match as written (defaults: `PathPrefix`, `/`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct HttpPathMatchFields {
    #[serde(rename = "type")]
    type_: Option<PathMatchType>,
    value: Option<String>,
}

impl TryFrom<HttpPathMatchFields> for HttpPathMatch {
    type Error = HttpRouteError;
    fn try_from(f: HttpPathMatchFields) -> Result<Self, HttpRouteError> {
        let type_ = f.type_.unwrap_or(PathMatchType::PathPrefix);
        let value = f.value.unwrap_or_else(|| "/".to_string());
        match type_ {
            PathMatchType::RegularExpression => check_regex(&value)?,
            _ if !value.starts_with('/') => return Err(HttpRouteError::RelativePath(value)),
            _ => {}
        }
        Ok(HttpPathMatch { type_, value })
    }
}

/// How a header or query parameter value is matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum ValueMatchType {
    #[default]
    Exact,
    RegularExpression,
}

/// A header match (the name is case-insensitive).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpHeaderMatch {
    #[serde(rename = "type", default, deserialize_with = "nullable")]
    pub type_: ValueMatchType,
    pub name: String,
    pub value: String,
}

/// A query parameter match (the name is case-sensitive).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpQueryParamMatch {
    #[serde(rename = "type", default, deserialize_with = "nullable")]
    pub type_: ValueMatchType,
    pub name: String,
    pub value: String,
}

impl CheckOnDecode for HttpHeaderMatch {
    type Error = HttpRouteError;
    fn check(&self) -> Result<(), HttpRouteError> {
        check_value_match(self.type_, &self.value)
    }
}

impl CheckOnDecode for HttpQueryParamMatch {
    type Error = HttpRouteError;
    fn check(&self) -> Result<(), HttpRouteError> {
        check_value_match(self.type_, &self.value)
    }
}

fn check_value_match(type_: ValueMatchType, value: &str) -> Result<(), HttpRouteError> {
    if type_ == ValueMatchType::RegularExpression {
        check_regex(value)?;
    }
    Ok(())
}

/// An HTTP method.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum HttpMethod {
    Get,
    Head,
    Post,
    Put,
    Delete,
    Connect,
    Options,
    Trace,
    Patch,
}

/// What a filter does, with its settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "HttpRouteFilterFields")]
pub enum HttpRouteFilter {
    RequestHeaderModifier(HttpHeaderFilter),
    ResponseHeaderModifier(HttpHeaderFilter),
    RequestRedirect(HttpRequestRedirectFilter),
    UrlRewrite(HttpUrlRewriteFilter),
    RequestMirror(HttpRequestMirrorFilter),
    /// Decoded only.
    Cors(HttpCorsFilter),
    /// An implementation-specific filter (decoded only).
    ExtensionRef(LocalObjectReference),
}

/// The filter types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
enum HttpRouteFilterType {
    RequestHeaderModifier,
    ResponseHeaderModifier,
    RequestRedirect,
    #[serde(rename = "URLRewrite")]
    UrlRewrite,
    RequestMirror,
    #[serde(rename = "CORS")]
    Cors,
    ExtensionRef,
}

/// A filter as written: its type and the one body that type takes.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct HttpRouteFilterFields {
    #[serde(rename = "type")]
    type_: HttpRouteFilterType,
    #[serde(default)]
    request_header_modifier: Option<HttpHeaderFilter>,
    #[serde(default)]
    response_header_modifier: Option<HttpHeaderFilter>,
    #[serde(default)]
    request_redirect: Option<HttpRequestRedirectFilter>,
    #[serde(default)]
    url_rewrite: Option<HttpUrlRewriteFilter>,
    #[serde(default)]
    request_mirror: Option<HttpRequestMirrorFilter>,
    #[serde(default)]
    cors: Option<HttpCorsFilter>,
    #[serde(default)]
    extension_ref: Option<LocalObjectReference>,
}

impl TryFrom<HttpRouteFilterFields> for HttpRouteFilter {
    type Error = HttpRouteError;
    fn try_from(f: HttpRouteFilterFields) -> Result<Self, HttpRouteError> {
        use HttpRouteFilterType as T;
        let bodies = [
            (
                T::RequestHeaderModifier,
                "requestHeaderModifier",
                f.request_header_modifier.is_some(),
            ),
            (
                T::ResponseHeaderModifier,
                "responseHeaderModifier",
                f.response_header_modifier.is_some(),
            ),
            (
                T::RequestRedirect,
                "requestRedirect",
                f.request_redirect.is_some(),
            ),
            (T::UrlRewrite, "urlRewrite", f.url_rewrite.is_some()),
            (
                T::RequestMirror,
                "requestMirror",
                f.request_mirror.is_some(),
            ),
            (T::Cors, "cors", f.cors.is_some()),
            (T::ExtensionRef, "extensionRef", f.extension_ref.is_some()),
        ];
        let type_name = type_name(f.type_);
        if let Some((_, field, _)) = bodies.iter().find(|(t, _, set)| *set && *t != f.type_) {
            return Err(HttpRouteError::ExtraFilterBody(type_name, field));
        }
        let missing = || {
            let field = bodies
                .iter()
                .find(|(t, _, _)| *t == f.type_)
                .map_or("", |(_, field, _)| *field);
            HttpRouteError::MissingFilterBody(type_name, field)
        };
        Ok(match f.type_ {
            T::RequestHeaderModifier => HttpRouteFilter::RequestHeaderModifier(
                f.request_header_modifier.ok_or_else(missing)?,
            ),
            T::ResponseHeaderModifier => HttpRouteFilter::ResponseHeaderModifier(
                f.response_header_modifier.ok_or_else(missing)?,
            ),
            T::RequestRedirect => {
                HttpRouteFilter::RequestRedirect(f.request_redirect.ok_or_else(missing)?)
            }
            T::UrlRewrite => HttpRouteFilter::UrlRewrite(f.url_rewrite.ok_or_else(missing)?),
            T::RequestMirror => {
                HttpRouteFilter::RequestMirror(f.request_mirror.ok_or_else(missing)?)
            }
            T::Cors => HttpRouteFilter::Cors(f.cors.ok_or_else(missing)?),
            T::ExtensionRef => HttpRouteFilter::ExtensionRef(f.extension_ref.ok_or_else(missing)?),
        })
    }
}

fn type_name(t: HttpRouteFilterType) -> &'static str {
    match t {
        HttpRouteFilterType::RequestHeaderModifier => "RequestHeaderModifier",
        HttpRouteFilterType::ResponseHeaderModifier => "ResponseHeaderModifier",
        HttpRouteFilterType::RequestRedirect => "RequestRedirect",
        HttpRouteFilterType::UrlRewrite => "URLRewrite",
        HttpRouteFilterType::RequestMirror => "RequestMirror",
        HttpRouteFilterType::Cors => "CORS",
        HttpRouteFilterType::ExtensionRef => "ExtensionRef",
    }
}

/// Headers to overwrite, to append and to remove.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpHeaderFilter {
    #[serde(deserialize_with = "nullable")]
    pub set: Vec<HttpHeader>,
    #[serde(deserialize_with = "nullable")]
    pub add: Vec<HttpHeader>,
    #[serde(deserialize_with = "nullable")]
    pub remove: Vec<String>,
}

/// A header name and value.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct HttpHeader {
    pub name: String,
    pub value: String,
}

/// Answer with a redirect.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRequestRedirectFilter {
    pub scheme: Option<String>,
    pub hostname: Option<String>,
    pub path: Option<HttpPathModifier>,
    #[serde(deserialize_with = "optional_port_number")]
    pub port: Option<u16>,
    /// 302 when absent.
    pub status_code: Option<u16>,
}

/// Rewrite the host and/or path before forwarding.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpUrlRewriteFilter {
    pub hostname: Option<String>,
    pub path: Option<HttpPathModifier>,
}

/// A path rewrite.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "HttpPathModifierFields")]
pub enum HttpPathModifier {
    ReplaceFullPath(String),
    /// Replaces the prefix the rule matched (`PathPrefix` matches only).
    ReplacePrefixMatch(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
enum HttpPathModifierType {
    ReplaceFullPath,
    ReplacePrefixMatch,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct HttpPathModifierFields {
    #[serde(rename = "type")]
    type_: HttpPathModifierType,
    #[serde(default)]
    replace_full_path: Option<String>,
    #[serde(default)]
    replace_prefix_match: Option<String>,
}

impl TryFrom<HttpPathModifierFields> for HttpPathModifier {
    type Error = HttpRouteError;
    fn try_from(f: HttpPathModifierFields) -> Result<Self, HttpRouteError> {
        match f.type_ {
            HttpPathModifierType::ReplaceFullPath => f
                .replace_full_path
                .map(HttpPathModifier::ReplaceFullPath)
                .ok_or(HttpRouteError::MissingPathValue(
                    "ReplaceFullPath",
                    "replaceFullPath",
                )),
            HttpPathModifierType::ReplacePrefixMatch => f
                .replace_prefix_match
                .map(HttpPathModifier::ReplacePrefixMatch)
                .ok_or(HttpRouteError::MissingPathValue(
                    "ReplacePrefixMatch",
                    "replacePrefixMatch",
                )),
        }
    }
}

/// Mirror requests to another backend.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRequestMirrorFilter {
    pub backend_ref: BackendObjectReference,
    /// Share of requests mirrored (all when neither this nor `fraction`).
    #[serde(default, deserialize_with = "optional_whole_percent")]
    pub percent: Option<u32>,
    #[serde(default)]
    pub fraction: Option<Fraction>,
}

/// A share of requests: `numerator / denominator` (denominator 100 when
/// absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct Fraction {
    pub numerator: u32,
    #[serde(default)]
    pub denominator: Option<u32>,
}

/// Cross-origin resource sharing (decoded only).
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpCorsFilter {
    #[serde(deserialize_with = "nullable")]
    pub allow_origins: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub allow_methods: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub allow_headers: Vec<String>,
    #[serde(deserialize_with = "nullable")]
    pub expose_headers: Vec<String>,
    pub allow_credentials: Option<bool>,
    pub max_age: Option<u32>,
}

/// A weighted backend of an HTTP (or gRPC) rule, with its own filters.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpBackendRef {
    /// Core (`""`) when absent.
    #[serde(default)]
    pub group: Option<String>,
    /// `Service` when absent.
    #[serde(default)]
    pub kind: Option<String>,
    pub name: String,
    /// The route's namespace when absent.
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default, deserialize_with = "optional_port_number")]
    pub port: Option<u16>,
    /// 1 when absent; 0 to 1,000,000.
    #[serde(default, deserialize_with = "optional_gateway_weight")]
    pub weight: Option<u32>,
    #[serde(default, deserialize_with = "nullable")]
    pub filters: Vec<HttpRouteFilter>,
}

impl HttpBackendRef {
    /// The weight, defaulted to 1.
    pub fn effective_weight(&self) -> u32 {
        self.weight.unwrap_or(1)
    }
}

/// Timeouts of a rule (Gateway API durations; `0s` disables).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpRouteTimeouts {
    /// The whole request, retries included.
    #[serde(deserialize_with = "optional_gateway_duration")]
    pub request: Option<Duration>,
    /// One try towards a backend.
    #[serde(deserialize_with = "optional_gateway_duration")]
    pub backend_request: Option<Duration>,
}

impl CheckOnDecode for HttpRouteTimeouts {
    type Error = HttpRouteError;
    fn check(&self) -> Result<(), HttpRouteError> {
        match (self.request, self.backend_request) {
            (Some(request), Some(backend)) if !request.is_zero() && backend > request => {
                Err(HttpRouteError::BackendTimeoutTooLong { backend, request })
            }
            _ => Ok(()),
        }
    }
}
