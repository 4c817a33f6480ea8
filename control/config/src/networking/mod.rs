//! Istio's traffic-management kinds of `networking.istio.io` —
//! [`VirtualService`], [`DestinationRule`] and [`Sidecar`] — typed as Istio
//! defines them (field names as in the API, so Istio YAML decodes as is).
//!
//! Their parts keep Istio's message names (`HttpRoute` is the
//! `istio.networking.v1.HTTPRoute` of a VirtualService's `http` list); the
//! Gateway API kinds of the same names live in [`crate::gateway_api`]. The
//! kinds themselves are re-exported by [`crate::objects`].
//!
//! Decoding rejects only what makes an object unusable on its own (a bad
//! duration, a negative weight, a percentage out of range, two forms of a
//! one-of set, an invalid regex); checks across objects (a route to an
//! undefined subset, two VirtualServices for one host, weights that do not
//! sum to 100) are the control plane's and `ambitctl analyze`'s.

use serde::Deserialize;

use crate::objects::port_number;

mod destination_rule;
mod sidecar;
mod virtual_service;

pub use destination_rule::*;
pub use sidecar::*;
pub use virtual_service::*;

/// A port of a destination or a traffic policy (`{number: 8080}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
pub struct PortSelector {
    #[serde(deserialize_with = "port_number")]
    pub number: u16,
}
