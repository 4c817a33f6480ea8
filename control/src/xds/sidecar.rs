//! The sidecar generator: upstream Envoy's CDS, EDS, LDS and RDS (in that
//! ADS order) for a sidecar pod — the outbound set its namespace's sidecars
//! share (`sidecar/<namespace>`, the namespace the proxy was authorized
//! for) merged with its own inbound set (`sidecar/<namespace>/<pod>`).

use super::{Generator, Served, TypeSpec};
use crate::xds::proxy::{ProxyKind, ProxyNode};
use crate::model::sidecar::{namespace_scope, pod_scope};
use crate::model::snapshot::Snapshot;
use crate::model::waypoint::{CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE};

/// Serves sidecars their own Envoy configuration.
#[derive(Debug, Default)]
pub struct SidecarGenerator;

const TYPES: &[TypeSpec] = &[
    TypeSpec {
        type_url: CLUSTER_TYPE,
        label: "cds",
        resend_with: Some(ENDPOINT_TYPE),
    },
    TypeSpec {
        type_url: ENDPOINT_TYPE,
        label: "eds",
        resend_with: None,
    },
    TypeSpec {
        type_url: LISTENER_TYPE,
        label: "lds",
        resend_with: None,
    },
    TypeSpec {
        type_url: ROUTE_TYPE,
        label: "rds",
        resend_with: None,
    },
];

impl Generator for SidecarGenerator {
    fn kind(&self) -> ProxyKind {
        ProxyKind::Sidecar
    }

    fn types(&self) -> &'static [TypeSpec] {
        TYPES
    }

    fn generate(&self, proxy: &ProxyNode, snap: &Snapshot, type_url: &str) -> Served {
        if proxy.namespace.is_empty() || proxy.pod_name.is_empty() {
            // A sidecar that names no pod is served nothing (it waits, and
            // `/debug/connections` shows it).
            return Served::empty();
        }
        let shared = namespace_scope(&proxy.namespace);
        let own = pod_scope(&proxy.namespace, &proxy.pod_name);
        Served::merge(vec![
            Served::from_snapshot(snap, &shared, type_url),
            Served::from_snapshot(snap, &own, type_url),
        ])
    }
}
