//! YAML text through `serde-saphyr`.
//!
//! Why serde-saphyr (replacing the deprecated `serde_yaml`): it is actively
//! maintained, pure safe Rust (`#![forbid(unsafe_code)]`, no C and no
//! translated-C parser, so nothing surprising to build on a fresh machine),
//! deserializes straight into our structs without an intermediate value,
//! reports line and column for every error, and enforces parse budgets
//! (nesting depth, alias expansion, node counts) while it streams — what a
//! reader of untrusted files needs. The other maintained forks of
//! `serde_yaml` (`serde_yaml_ng`, `serde_norway`) keep the libyaml port,
//! which is slow on deeply nested flow collections and has no budgets.

use std::borrow::Cow;

use serde::de::DeserializeOwned;
use serde_saphyr::{DefaultMessageFormatter, Error, MessageFormatter, Options};

/// A YAML failure: the field path (when the failure is about a value), the
/// message with its file line, and whether a parse limit was hit.
#[derive(Debug)]
pub(super) struct YamlError {
    pub path: Option<String>,
    pub message: String,
}

/// The parser options every document is read with.
fn options() -> Options {
    let mut o = Options::default();
    // One-line messages: the location is added by `describe`.
    o.with_snippet = false;
    // YAML 1.2 booleans (`true`/`false` only), as serde_yaml read them: a
    // namespace called `n` or `no` stays a string.
    o.strict_booleans = true;
    o
}

/// Parses one document; `line_offset` lines precede `text` in its file.
pub(super) fn from_yaml<T: DeserializeOwned>(
    text: &str,
    line_offset: usize,
) -> Result<T, YamlError> {
    let mut path = None;
    serde_saphyr::with_deserializer_from_str_with_options(text, options(), |de| {
        serde_path_to_error::deserialize(de).map_err(|e| {
            let p = e.path().to_string();
            if p != "." && !p.is_empty() {
                path = Some(p);
            }
            e.into_inner()
        })
    })
    .map_err(|e| YamlError {
        path,
        message: describe(&e, line_offset),
    })
}

/// The error that caused `e` (not its snippet or alias wrappers).
fn original(e: &Error) -> &Error {
    let mut e = e.without_snippet();
    while let Error::AliasError { error, .. } = e {
        e = error.without_snippet();
    }
    e
}

/// `<what> at line <file line> column <column>`.
fn describe(e: &Error, line_offset: usize) -> String {
    let what: Cow<'_, str> = DefaultMessageFormatter.format_message(original(e));
    match e.location() {
        Some(loc) if loc.line() > 0 => format!(
            "{what} at line {} column {}",
            loc.line() as usize + line_offset,
            loc.column()
        ),
        _ => what.into_owned(),
    }
}
