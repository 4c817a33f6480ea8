//! Ambit's node proxy (ztunnel) as a library, and [`start`] to run it all.
//!
//! ```text
//! control plane ──Delta ADS──▶ xds::XdsClient ──publish──▶ state (ArcSwap) ──▶ admin /config_dump
//!           └──CSR──▶ CA ◀── identity::CertificateManager           │ (readers never block)
//!                                   │ certs, trust bundle            ▼
//! node agent ──ZDS──▶ inpod (listeners in each pod netns) ──▶ proxy (outbound, inbound) ──HBONE──▶ peers
//!                                                               │ rbac (policy), metrics, access log
//! ```
//!
//! * [`xds`]: the workload xDS client; [`state`]: the indexed snapshots it
//!   publishes; [`control_channel`]: the gRPC channel to the control plane.
//! * [`identity`]: workload certificates (keys made here, CSRs to the CA,
//!   renewal) and the trust bundle.
//! * [`inpod`]: the per-pod listeners opened inside each enrolled pod's
//!   netns, fed by ZDS (the protocol and netns helpers are the
//!   `ambit-inpod` crate, shared with the node agent).
//! * [`proxy`]: the outbound and inbound proxies; [`hbone`]: mTLS + HTTP/2
//!   `CONNECT` tunnels and the connection pool; [`copy`]: the byte relay;
//!   [`rbac`]: L4 authorization; [`drain`]: graceful shutdown.
//! * [`metrics`] (`/metrics`) and [`admin`] (`/config_dump`, `/logging`,
//!   readiness); [`app`] wires everything together.
//! * [`agent`]: the second binary, `ambit-agent`, beside each upstream Envoy
//!   (waypoint or sidecar): the same [`identity`] manager, SDS on a unix
//!   socket, Envoy's bootstrap, supervision, readiness and merged metrics.
#![forbid(unsafe_code)]

pub mod admin;
pub mod agent;
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
pub mod splice;
pub mod state;
pub mod xds;

pub use app::{AppError, StartOptions, Ztunnel, start, start_with};
pub use config::Config;
pub use metrics::Metrics;
pub use state::{StateReader, StateSnapshot};

#[cfg(test)]
mod test_support;
