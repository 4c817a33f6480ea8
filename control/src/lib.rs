//! Ambit control plane: config sources feed one mesh model; the model
//! publishes immutable snapshots; the xDS server streams them to proxies.
#![forbid(unsafe_code)]

pub mod app;
pub mod ca;
pub mod config;
pub mod debug;
pub mod http;
pub mod inject;
pub mod k8s;
pub mod model;
pub mod source;
pub mod tls_listener;
pub mod xds;

pub use app::{AppError, ControlPlane};
pub use config::ControlConfig;
