//! `ambitctl`, the Ambit command line, as a library: one module per command
//! family doing that family's work, so tests and benches drive the very code
//! the binary runs. The binary (`src/main.rs`, with one flags-and-printing
//! module per family in `src/commands/`) only parses flags, calls these and
//! prints.
//!
//! Families: [`local`] (a whole mesh on this host, SPEC §5) and
//! [`analyze`] (config mistakes before they bite); each has a module here
//! and one in `src/commands/` of the same name.
//!
//! This crate is the only one besides `tests` and `benches` that may depend
//! on every Ambit crate (control, ztunnel, cni; SPEC §1). It depends on what
//! it uses: the control plane's config types, all reached through
//! [`config`](crate::config) (crate-private).
#![forbid(unsafe_code)]

pub mod analyze;
pub mod authn;
mod config;
pub mod http;
pub mod install;
pub mod kube_inject;
pub mod local;
pub mod metrics;
pub mod proxy_config;
pub mod proxy_status;
pub mod table;
pub mod ztunnel_config;
