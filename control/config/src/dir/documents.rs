//! One config file's text: split into documents at `---` / `...` marker
//! lines, each decoded into an object, errors carrying the file, the
//! document's index and its first line.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use crate::change::ConfigError;
use crate::decode::{DecodeFailure, decode_yaml_document};
use crate::objects::{Object, ObjectKey};

/// One document of a file.
#[derive(Debug, Clone, PartialEq)]
pub struct Document<'t> {
    /// 0-based index among the file's non-empty documents.
    pub index: usize,
    /// 1-based line of the document's first content line.
    pub line: usize,
    /// Number of file lines before `text`.
    pub offset: usize,
    pub text: Cow<'t, str>,
}

/// A `---` document marker (optionally followed by content) or a `...`
/// document end marker; returns what follows the marker on the line.
fn marker(line: &str) -> Option<&str> {
    if line == "..." || line.starts_with("...") && line[3..].starts_with(char::is_whitespace) {
        return Some("");
    }
    let rest = line.strip_prefix("---")?;
    if rest.is_empty() || rest.starts_with(char::is_whitespace) {
        Some(rest)
    } else {
        None
    }
}

fn is_content(line: &str) -> bool {
    let t = line.trim();
    !t.is_empty() && !t.starts_with('#')
}

/// A document being collected by [`split_documents`].
#[derive(Default)]
struct Chunk {
    /// Byte offset of the body.
    start: usize,
    /// Line index of the chunk's first line.
    offset: usize,
    /// Line index of the first content line.
    first: Option<usize>,
    /// Content that followed the `---` marker on its line.
    head: Option<String>,
}

fn push_document<'t>(text: &'t str, docs: &mut Vec<Document<'t>>, c: Chunk, end: usize) {
    let Some(first) = c.first else {
        return;
    };
    let body = &text[c.start.min(end)..end];
    let text = match c.head {
        Some(h) => Cow::Owned(format!("{h}\n{body}")),
        None => Cow::Borrowed(body),
    };
    docs.push(Document {
        index: docs.len(),
        line: first + 1,
        offset: c.offset,
        text,
    });
}

/// Splits a file into documents at marker lines; empty and comment-only
/// documents are dropped.
pub fn split_documents(text: &str) -> Vec<Document<'_>> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut docs = Vec::new();
    let mut cur = Chunk::default();
    let mut pos = 0usize;
    for (i, raw) in text.split_inclusive('\n').enumerate() {
        let line = raw.trim_end_matches(['\n', '\r']);
        if let Some(rest) = marker(line) {
            push_document(text, &mut docs, std::mem::take(&mut cur), pos);
            cur.start = pos + raw.len();
            cur.offset = i + 1;
            if is_content(rest) {
                // `--- {inline: doc}`: keep the content, blank the marker.
                cur.head = Some(format!("   {rest}"));
                cur.offset = i;
                cur.first = Some(i);
            }
        } else if cur.first.is_none() && is_content(line) {
            cur.first = Some(i);
        }
        pos += raw.len();
    }
    push_document(text, &mut docs, cur, pos);
    docs
}

/// The result of parsing one file.
#[derive(Debug, Default)]
pub struct ParsedFile {
    /// Accepted objects with the index and first line of their document.
    pub objects: Vec<(Object, usize, usize)>,
    pub errors: Vec<ConfigError>,
    /// Keys of rejected documents whose identity could be read.
    pub rejected: Vec<ObjectKey>,
    /// Some rejected document's identity could not be read.
    pub unidentified: bool,
}

/// Parses the text of one file (`path` is only used in errors).
pub fn parse_file(path: &Path, text: &str) -> ParsedFile {
    let file = path.display().to_string();
    let mut out = ParsedFile::default();
    let mut seen: HashMap<ObjectKey, (usize, usize)> = HashMap::new();
    for doc in split_documents(text) {
        let err = |f: Box<DecodeFailure>| {
            let f = *f;
            let keeps = if f.key.is_some() {
                "the last accepted version of this object, if any, keeps serving"
            } else {
                "every object this file defined before keeps serving"
            };
            ConfigError {
                file: file.clone(),
                document: doc.index,
                line: doc.line,
                kind: f.kind,
                namespace: f.namespace,
                name: f.name,
                reason: format!("{} ({keeps})", f.error),
            }
        };
        match decode_yaml_document(&doc.text, doc.offset) {
            Ok(None) => {}
            Ok(Some(obj)) => {
                let key = obj.key();
                if let Some((d, l)) = seen.get(&key) {
                    out.errors.push(ConfigError {
                        file: file.clone(),
                        document: doc.index,
                        line: doc.line,
                        kind: key.kind.to_string(),
                        namespace: key.namespace.clone(),
                        name: key.name.clone(),
                        reason: format!("duplicate of document {d} (line {l}) in the same file; this copy is ignored — remove one of them"),
                    });
                    continue;
                }
                seen.insert(key, (doc.index, doc.line));
                out.objects.push((obj, doc.index, doc.line));
            }
            Err(f) => {
                match &f.key {
                    Some(k) => out.rejected.push(k.clone()),
                    None => out.unidentified = true,
                }
                out.errors.push(err(f));
            }
        }
    }
    out
}

/// Parses the text of one file: the accepted objects and the errors of the
/// rejected documents (with file, document index, line and identity).
pub fn parse_documents(path: &Path, text: &str) -> (Vec<Object>, Vec<ConfigError>) {
    let p = parse_file(path, text);
    (p.objects.into_iter().map(|(o, _, _)| o).collect(), p.errors)
}
