//! Protobuf types wire-compatible with Istio's `istio.workload`,
//! `istio.security`, `istio.v1.auth` and `istio.workload.zds` packages.
//! Generated at build time from `proto/*.proto`; nothing else lives here.
#![allow(clippy::all, missing_docs)]

pub mod workload {
    tonic::include_proto!("istio.workload");
    pub mod zds {
        tonic::include_proto!("istio.workload.zds");
    }
}

pub mod security {
    tonic::include_proto!("istio.security");
}

pub mod auth {
    tonic::include_proto!("istio.v1.auth");
}

/// xDS type URL of `istio.workload.Address`.
pub const ADDRESS_TYPE_URL: &str = "type.googleapis.com/istio.workload.Address";
/// xDS type URL of `istio.security.Authorization`.
pub const AUTHORIZATION_TYPE_URL: &str = "type.googleapis.com/istio.security.Authorization";

/// Suffix of `system_version_info` on a Delta response that the control
/// plane split into chunks and that is not the last chunk: the type is not
/// yet fully synced. Other control planes never set it.
pub const PARTIAL_RESPONSE_MARKER: &str = "+partial";
