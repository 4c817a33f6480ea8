//! Ambit's node proxy (ztunnel) as a library: the xDS client, the state it
//! feeds, the admin/stats/readiness servers, and [`start`] to run them all.
//!
//! ```text
//! control plane ──Delta ADS──▶ xds::XdsClient ──publish──▶ state (ArcSwap)
//!                                                          │
//!                        admin /config_dump, data path ◀───┘ (readers never block)
//! ```
#![forbid(unsafe_code)]

pub mod admin;
pub mod app;
pub mod config;
pub mod control_channel;
pub mod copy;
pub mod drain;
pub mod hbone;
pub mod identity;
pub mod inpod;
pub mod metrics;
pub mod proxy;
pub mod rbac;
pub mod state;
pub mod xds;

pub use app::{AppError, StartOptions, Ztunnel, start, start_with};
pub use config::Config;
pub use metrics::Metrics;
pub use state::{StateReader, StateSnapshot};

#[cfg(test)]
mod test_support;
