//! The waypoint generator: upstream Envoy's CDS, EDS, LDS and RDS (in that
//! ADS order) for a waypoint, from the model's scope
//! `waypoint/<namespace>/<gateway>` — the namespace the proxy was
//! authorized for, the Gateway its pod label names.

use super::generator::{Generator, Served, TypeSpec};
use super::proxy::{ProxyKind, ProxyNode};
use crate::model::snapshot::Snapshot;
use crate::model::waypoint::{CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE, ROUTE_TYPE, scope};

/// Serves waypoints their own Envoy configuration.
#[derive(Debug, Default)]
pub struct WaypointGenerator;

/// Upstream Envoy's types in ADS order; sidecars are served the same.
pub(super) const ENVOY_TYPES: &[TypeSpec] = &[
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

impl Generator for WaypointGenerator {
    fn kind(&self) -> ProxyKind {
        ProxyKind::Waypoint
    }

    fn types(&self) -> &'static [TypeSpec] {
        ENVOY_TYPES
    }

    fn generate(&self, proxy: &ProxyNode, snap: &Snapshot, type_url: &str) -> Served {
        match proxy.gateway_name() {
            Some(gateway) => {
                Served::from_snapshot(snap, &scope(&proxy.namespace, gateway), type_url)
            }
            // A router pod that names no Gateway is served nothing (it waits,
            // and `/debug/connections` shows it).
            None => Served::empty(),
        }
    }
}
