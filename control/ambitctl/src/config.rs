//! The one place this crate reaches into mesh config: the typed objects,
//! the YAML parser the control plane serves with, and its enrollment rule,
//! so the CLI reads a config directory exactly as the control plane does.
//!
//! They come from `ambit_control` today. When the shared config crate
//! (`control/config`) lands, these lines and the dependency in `Cargo.toml`
//! are all that change.

pub(crate) use ambit_control::model::objects::{Labels, Object};
pub(crate) use ambit_control::model::translate::is_enrolled;
pub(crate) use ambit_control::source::file::parse_documents;
