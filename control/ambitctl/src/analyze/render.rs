//! How a [`Report`] is printed: a table for people, JSON or YAML for tools.
//! The formats are stable (golden files in `tests/golden/`).

use serde::Serialize;

use super::Report;
use crate::table::Table;

/// The machine-readable form: the messages and a summary.
#[derive(Serialize)]
struct Out<'r> {
    messages: &'r [super::Message],
    summary: Summary,
}

#[derive(Serialize)]
struct Summary {
    documents: usize,
    objects: usize,
    errors: usize,
    warnings: usize,
    infos: usize,
    suppressed: usize,
}

fn summary(r: &Report) -> Summary {
    let count = |s| r.messages.iter().filter(|m| m.severity == s).count();
    Summary {
        documents: r.documents,
        objects: r.objects,
        errors: count(super::Severity::Error),
        warnings: count(super::Severity::Warning),
        infos: count(super::Severity::Info),
        suppressed: r.suppressed,
    }
}

/// One row per message, then a summary line.
pub fn render_table(r: &Report) -> String {
    let s = summary(r);
    if r.messages.is_empty() {
        return format!(
            "✔ No validation issues found ({} documents, {} objects{}).\n",
            s.documents,
            s.objects,
            if s.suppressed > 0 {
                format!(", {} suppressed", s.suppressed)
            } else {
                String::new()
            }
        );
    }
    let mut t = Table::new(&["SEVERITY", "CODE", "RESOURCE", "WHERE", "MESSAGE"]);
    for m in &r.messages {
        t.row(vec![
            m.severity.to_string(),
            m.code.to_string(),
            m.resource.to_string(),
            m.origin
                .as_ref()
                .map_or_else(|| "-".into(), ToString::to_string),
            m.message.clone(),
        ]);
    }
    let mut out = t.render();
    out.push_str(&format!(
        "\n{} error(s), {} warning(s), {} info ({} documents, {} objects{}).\n",
        s.errors,
        s.warnings,
        s.infos,
        s.documents,
        s.objects,
        if s.suppressed > 0 {
            format!(", {} suppressed", s.suppressed)
        } else {
            String::new()
        }
    ));
    out
}

pub fn render_json(r: &Report) -> Result<String, serde_json::Error> {
    serde_json::to_string_pretty(&Out {
        messages: &r.messages,
        summary: summary(r),
    })
    .map(|s| s + "\n")
}

pub fn render_yaml(r: &Report) -> Result<String, serde_saphyr::SerializeError> {
    serde_saphyr::to_string(&Out {
        messages: &r.messages,
        summary: summary(r),
    })
}
