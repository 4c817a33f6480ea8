//! The ztunnel generator: the workload API (`istio.workload.Address`,
//! `istio.security.Authorization`). Every ztunnel is served the same
//! mesh-wide sets, as Istio serves its ztunnels, so streams forward the
//! model's shared `Arc`s and its precomputed deltas.

use super::generator::{Generator, Served, TypeSpec};
use super::proxy::{ProxyKind, ProxyNode};
use crate::model::snapshot::{MESH_SCOPE, Snapshot};

/// Serves the workload API to ztunnels.
#[derive(Debug, Default)]
pub struct ZtunnelGenerator;

const TYPES: &[TypeSpec] = &[
    TypeSpec {
        type_url: ambit_proto::ADDRESS_TYPE_URL,
        label: "address",
        resend_with: None,
    },
    TypeSpec {
        type_url: ambit_proto::AUTHORIZATION_TYPE_URL,
        label: "authorization",
        resend_with: None,
    },
];

impl Generator for ZtunnelGenerator {
    fn kind(&self) -> ProxyKind {
        ProxyKind::Ztunnel
    }

    fn types(&self) -> &'static [TypeSpec] {
        TYPES
    }

    fn generate(&self, _proxy: &ProxyNode, snap: &Snapshot, type_url: &str) -> Served {
        Served::from_snapshot(snap, MESH_SCOPE, type_url)
    }
}
