//! Bounds on what one config file or document may make a reader do, so a
//! broken or hostile file is rejected in milliseconds instead of stalling
//! every reader of the directory (a 500 KB file of mappings nested 100,000
//! deep used to take a minute of CPU). Each rejection names the limit hit.
//!
//! The numbers leave ample room for real Kubernetes objects: the API server
//! stores objects of at most about 1.5 MiB, and even CRDs with large
//! OpenAPI schemas nest a few dozen levels and hold tens of thousands of
//! nodes.

/// Largest config file read, checked before reading: 16 MiB.
pub const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;
/// Largest document decoded (a YAML document or a JSON object), checked
/// before parsing: 2 MiB.
pub const MAX_DOCUMENT_BYTES: usize = 2 * 1024 * 1024;
/// Deepest nesting of mappings and lists in a YAML document: 64 levels.
pub const MAX_DEPTH: usize = 64;
/// Most YAML nodes (scalars, mappings, lists — alias copies included) in
/// one document: 250,000.
pub const MAX_NODES: usize = 250_000;
/// Most alias uses (`*name`) in one document: 1,000.
pub const MAX_ALIASES: usize = 1_000;
/// Most parser events that alias expansion may add to one document: 100,000
/// (an alias bomb's nine-fold growth per level stops here).
pub const MAX_ALIAS_EVENTS: usize = 100_000;
