//! Config sources: where the model's objects come from.
//!
//! The seam is small and the same for every source (the file source for
//! local mode, the Kubernetes watchers in [`kube`]):
//!
//! * a source decodes its input into [`Object`]s with `ambit_config::decode`
//!   (YAML documents, or the API server's JSON directly);
//! * it sends [`SourceUpdate`]s through a [`ModelHandle`]: upserts and
//!   deletes of objects, the current [`ConfigError`]s per scope (replacing
//!   that scope's previous errors), and `initial_sync_done: true` once its
//!   whole initial state has been sent;
//! * a rejected document never deletes anything: the last good version of
//!   an object keeps serving until a valid version or a real deletion
//!   arrives.

pub mod file;
pub mod kube;

#[cfg(test)]
mod tests;

pub use self::kube::{KUBE_SOURCE, KubeSource, KubeSourceOptions};
pub use crate::model::{Change, ConfigError, ModelHandle, Object, ObjectKey, SourceUpdate};
pub use file::{FileSource, FileSourceError, spawn_extra_file_source, spawn_file_source};

/// The `source` name the file source puts in its updates.
pub const FILE_SOURCE: &str = "file";
