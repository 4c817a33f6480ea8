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
use serde_saphyr::budget::BudgetBreach;
use serde_saphyr::granit_parser::ErrorKind;
use serde_saphyr::options::AliasLimits;
use serde_saphyr::{
    Budget, DefaultMessageFormatter, Error, ExternalMessageSource, MessageFormatter, Options,
};

use crate::limits::{MAX_ALIAS_EVENTS, MAX_ALIASES, MAX_DEPTH, MAX_NODES};

/// A YAML failure: the field path (when the failure is about a value), the
/// message with its file line, and whether a parse limit was hit.
#[derive(Debug)]
pub(super) struct YamlError {
    pub path: Option<String>,
    pub message: String,
    /// A parse limit ([`crate::limits`]) was hit; `message` names it.
    pub limit: bool,
}

/// The parser options every document is read with.
fn options() -> Options {
    let mut o = Options::default();
    // One-line messages: the location is added by `describe`.
    o.with_snippet = false;
    // YAML 1.2 booleans (`true`/`false` only), as serde_yaml read them: a
    // namespace called `n` or `no` stays a string.
    o.strict_booleans = true;
    let mut budget = Budget::default();
    budget.max_depth = MAX_DEPTH;
    // Flow collections (`{a: {a: ...`) are counted by the scanner, which
    // looks ahead of the depth budget; one more level and both agree.
    budget.flow_nesting_limit = MAX_DEPTH + 1;
    budget.max_nodes = MAX_NODES;
    budget.max_aliases = MAX_ALIASES;
    o.budget = Some(budget);
    let mut aliases = AliasLimits::default();
    aliases.max_total_replayed_events = MAX_ALIAS_EVENTS;
    o.alias_limits = aliases;
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
    .map_err(|e| match limit_hit(&e) {
        Some(limit) => YamlError {
            path: None,
            message: at(limit, &e, line_offset),
            limit: true,
        },
        None => YamlError {
            path,
            message: describe(&e, line_offset),
            limit: false,
        },
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

/// Which limit of [`crate::limits`] `e` reports, in words, if any.
fn limit_hit(e: &Error) -> Option<String> {
    let depth = || {
        format!("mappings and lists nest deeper than {MAX_DEPTH} levels (the nesting-depth limit)")
    };
    let aliases = || {
        format!(
            "aliases expand to more than {MAX_ALIAS_EVENTS} parser events (the alias-expansion limit; a YAML alias bomb?)"
        )
    };
    Some(match original(e) {
        Error::Budget { breach, .. } => match breach {
            BudgetBreach::Depth { .. } => depth(),
            BudgetBreach::Nodes { .. } => format!(
                "the document has more than {MAX_NODES} nodes, alias copies included (the node limit)"
            ),
            BudgetBreach::Aliases { .. } => {
                format!("the document uses more than {MAX_ALIASES} aliases (the alias limit)")
            }
            BudgetBreach::AliasAnchorRatio { aliases, anchors } => format!(
                "the document uses {aliases} aliases for {anchors} anchors (the alias-to-anchor ratio limit; a YAML alias bomb?)"
            ),
            other => format!("a parser budget was exceeded ({other:?})"),
        },
        Error::AliasReplayLimitExceeded { .. }
        | Error::AliasExpansionLimitExceeded { .. }
        | Error::AliasReplayStackDepthExceeded { .. } => aliases(),
        Error::ExternalMessage { source, .. } if matches!(&**source, ExternalMessageSource::Parser(se) if *se.kind() == ErrorKind::RecursionLimitExceeded) => {
            depth()
        }
        _ => return None,
    })
}

/// `<what> at line <file line> column <column>`.
fn describe(e: &Error, line_offset: usize) -> String {
    let what: Cow<'_, str> = DefaultMessageFormatter.format_message(original(e));
    at(what.into_owned(), e, line_offset)
}

fn at(what: String, e: &Error, line_offset: usize) -> String {
    match e.location() {
        Some(loc) if loc.line() > 0 => format!(
            "{what} at line {} column {}",
            loc.line() as usize + line_offset,
            loc.column()
        ),
        _ => what,
    }
}
