//! The Gateway API kinds of `gateway.networking.k8s.io` — [`Gateway`],
//! [`HttpRoute`], and, decoded only, [`GrpcRoute`] and [`TcpRoute`] — typed
//! as the Gateway API defines them (field names as in the API).
//!
//! `Gateway` here is the Gateway API kind (a waypoint is one, with
//! `gatewayClassName: istio-waypoint`); Istio's `networking.istio.io`
//! Gateway is a different kind, accepted and ignored by decoding. The kinds
//! are re-exported by [`crate::objects`]; their parts are reached through
//! this module (`gateway_api::HttpRouteRule`, ...).
//!
//! Values the API server would default (a backend's kind `Service`, its
//! weight 1, a match's path prefix `/`) are left as written (`None`); the
//! `effective_*` helpers apply the defaults.

use serde::Deserialize;

use crate::objects::{nullable, optional_port_number};
use crate::scalars::optional_gateway_weight;

mod gateway;
mod grpc_tcp_route;
mod http_route;

pub use gateway::*;
pub use grpc_tcp_route::*;
pub use http_route::*;

/// The API group of the Gateway API kinds.
pub const GATEWAY_API_GROUP: &str = "gateway.networking.k8s.io";

/// True for the core group, written `""` or `core`.
fn is_core_group(group: &str) -> bool {
    group.is_empty() || group == "core"
}

/// What a route attaches to: a Gateway (listener), or, for mesh (GAMMA)
/// routes, a Service.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ParentReference {
    /// `gateway.networking.k8s.io` when absent.
    #[serde(default)]
    pub group: Option<String>,
    /// `Gateway` when absent.
    #[serde(default)]
    pub kind: Option<String>,
    /// The route's namespace when absent.
    #[serde(default)]
    pub namespace: Option<String>,
    pub name: String,
    #[serde(default)]
    pub section_name: Option<String>,
    #[serde(default, deserialize_with = "optional_port_number")]
    pub port: Option<u16>,
}

impl ParentReference {
    /// The group, defaulted.
    pub fn effective_group(&self) -> &str {
        self.group.as_deref().unwrap_or(GATEWAY_API_GROUP)
    }

    /// The kind, defaulted.
    pub fn effective_kind(&self) -> &str {
        self.kind.as_deref().unwrap_or("Gateway")
    }

    /// The namespace, defaulting to the route's.
    pub fn effective_namespace<'a>(&'a self, route_namespace: &'a str) -> &'a str {
        self.namespace.as_deref().unwrap_or(route_namespace)
    }

    /// A mesh (GAMMA) parent: a core `Service`. The group must be written
    /// (`group: ""`): an absent group means `gateway.networking.k8s.io`, as
    /// the API server defaults it.
    pub fn is_service(&self) -> bool {
        self.effective_kind() == "Service" && is_core_group(self.effective_group())
    }

    /// A Gateway API `Gateway`.
    pub fn is_gateway(&self) -> bool {
        self.effective_kind() == "Gateway" && self.effective_group() == GATEWAY_API_GROUP
    }
}

/// A weighted backend of a TCP route.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackendRef {
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
}

/// A backend without weight (a mirror's target).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BackendObjectReference {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default, deserialize_with = "optional_port_number")]
    pub port: Option<u16>,
}

/// A reference to an object of the route's namespace (`ExtensionRef`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LocalObjectReference {
    #[serde(deserialize_with = "nullable")]
    pub group: String,
    #[serde(deserialize_with = "nullable")]
    pub kind: String,
    #[serde(deserialize_with = "nullable")]
    pub name: String,
}

/// Defaults shared by every backend reference.
macro_rules! backend_defaults {
    ($t:ty) => {
        impl $t {
            /// The kind, defaulted to `Service`.
            pub fn effective_kind(&self) -> &str {
                self.kind.as_deref().unwrap_or("Service")
            }

            /// The namespace, defaulting to the route's.
            pub fn effective_namespace<'a>(&'a self, route_namespace: &'a str) -> &'a str {
                self.namespace.as_deref().unwrap_or(route_namespace)
            }

            /// A core `Service` (the usual backend).
            pub fn is_service(&self) -> bool {
                self.effective_kind() == "Service"
                    && is_core_group(self.group.as_deref().unwrap_or(""))
            }
        }
    };
}

backend_defaults!(BackendRef);
backend_defaults!(BackendObjectReference);
backend_defaults!(HttpBackendRef);

impl BackendRef {
    /// The weight, defaulted to 1.
    pub fn effective_weight(&self) -> u32 {
        self.weight.unwrap_or(1)
    }
}
