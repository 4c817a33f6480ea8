//! `ambit-agent`: the process beside each upstream Envoy (waypoint or
//! sidecar) — Istio's pilot-agent role. The private key never leaves the
//! pod: the agent makes it, sends only a CSR to the mesh CA, and hands the
//! certificate and key to Envoy over SDS on a unix socket.
//!
//! ```text
//!             CSR (key stays here)            ┌──────────── ambit-agent ─────────────┐
//!  mesh CA ◀───────────────────────── identity::CertificateManager (ztunnel's)         │
//!  (:15012)  ───── chain ────────────▶   │ cert state + trust bundle (watch)           │
//!                                        ▼                                             │
//!                                   secrets::follow ─▶ SecretSet {default, ROOTCA}     │
//!                                        │                                             │
//!  Envoy ◀─── SDS (unix socket 0600) ── sds::SdsServer                                 │
//!    │  ◀──── bootstrap.json ───────── bootstrap::render                               │
//!    │  ◀──── spawn / drain / stop ─── envoy::EnvoyProcess                             │
//!    │ ADS (Delta) over mTLS, client cert "default"                                    │
//!    ▼                                   status: :15021 /healthz/ready, :15020 merged  │
//!  control plane :15012                  metrics (agent + Envoy admin /stats)          │
//!                                       └──────────────────────────────────────────────┘
//! ```
//!
//! [`run`] wires it all: bind the agent's listeners, start the identity
//! manager and the SDS server, wait for the first certificate (readiness
//! says why while it waits, the manager retries with backoff), write the
//! bootstrap, start Envoy, then wait for a stop signal (drain Envoy, stop
//! it) or for Envoy to exit by itself (the agent exits with its status, so
//! the pod or the local supervisor restarts both).

pub mod bootstrap;
pub mod config;
pub mod envoy;
pub mod envoy_admin;
pub mod redirect;
pub mod request_metrics;
mod run;
pub mod sds;
pub mod secrets;
pub mod status;

use std::net::SocketAddr;
use std::path::PathBuf;

pub use config::{AgentConfig, EnvoyKind};
pub use run::{AgentExit, Ports, run};

use crate::identity::IdentityError;

/// Errors that stop the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A flag has a value the agent cannot use.
    #[error("invalid {flag}: {reason}")]
    Config {
        /// The flag and its environment variable.
        flag: &'static str,
        /// What is wrong and what to do.
        reason: String,
    },
    /// The state directory could not be prepared.
    #[error(
        "cannot use the state directory {path}: {source}; set --state-dir / STATE_DIR to a writable directory"
    )]
    StateDir {
        /// The directory.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// A file in the state directory could not be written.
    #[error(
        "cannot write {path}: {source}; check that --state-dir / STATE_DIR is writable and not full"
    )]
    Write {
        /// The file.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}; is another process using it? change {flag}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The flag that sets it.
        flag: &'static str,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The identity manager could not be set up (CA address, root file).
    #[error(transparent)]
    Identity(#[from] IdentityError),
    /// The SDS socket could not be created.
    #[error(transparent)]
    Sds(#[from] sds::SdsError),
    /// Envoy could not be started or waited for.
    #[error(transparent)]
    Envoy(#[from] envoy::EnvoyError),
}
