//! Ambit's config: everything a config source produces, shared by the control
//! plane (`ambit-control`) and the node agent (`ambit-cni`).
//!
//! * [`objects`]: the lean typed Kubernetes and Istio objects ([`Object`],
//!   [`Kind`], [`ObjectKey`]) and the labels the mesh reads;
//! * [`networking`] and [`gateway_api`]: the traffic kinds (VirtualService,
//!   DestinationRule, Sidecar; Gateway, HTTPRoute, GRPCRoute, TCPRoute) and
//!   their parts, with [`scalars`]: typed durations, percentages, weights
//!   and regexes checked while decoding;
//! * [`decode`]: one YAML document, JSON bytes or a JSON value into an
//!   [`Object`], with errors that say what is wrong, where and what to do;
//! * [`dir`]: the config-directory reader — the file walk, the document
//!   splitter, and [`ConfigDir`], the stateful reader that re-parses only
//!   changed files, keeps the last good version of rejected documents and
//!   turns a directory into [`Change`]s plus per-file [`ConfigError`]s;
//! * [`enroll`]: the ambient enrollment rule;
//! * [`limits`]: the bounds on file size, document size, nesting and alias
//!   expansion that keep a hostile file from stalling a reader.
//!
//! This crate depends on no main crate and on no async runtime: callers wrap
//! [`ConfigDir`] in whatever watching they need (inotify in the control
//! plane, polling in the node agent).

#![forbid(unsafe_code)]

mod change;
pub mod decode;
pub mod dir;
pub mod enroll;
pub mod gateway_api;
mod istio;
pub mod limits;
pub mod networking;
mod node;
pub mod objects;
pub mod scalars;
mod telemetry;

pub use change::{Change, ConfigError};
pub use decode::{
    DecodeError, DecodeFailure, decode_json, decode_json_value, decode_yaml_document,
};
pub use dir::{ConfigDir, DirUpdate, config_files, parse_documents};
pub use enroll::{is_enrolled, wants_sidecar_capture};
pub use objects::{Kind, Object, ObjectKey};
