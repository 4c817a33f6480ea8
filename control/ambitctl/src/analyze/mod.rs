//! `ambitctl analyze`: finds config mistakes before they bite, over files,
//! directories or the live local mesh (a [`Source`]).
//!
//! Every document goes through the decoder the control plane serves with
//! (`ambit_config`); what it rejects is a message with the file and line.
//! The accepted objects then go through the checks of `checks/` and through
//! the control plane's own translation (`ambit_control::model`), whose
//! findings — the ones no check here already reports — become messages too.
//! Each message has a stable code (Istio's `IST0xxx` where Istio has the
//! same check, `AMB0xxx` for Ambit's; [`message::ALL`]), a severity, the
//! resource, its file and line, and says what to do.
//!
//! A resource annotated `galley.istio.io/analyze-suppress: CODE[,CODE]`
//! (or `*`) suppresses those messages about itself, as with istioctl; so
//! does `--suppress CODE[=Kind namespace/name]`.

use std::collections::HashMap;
use std::path::PathBuf;

use ambit_config::objects::{Kind, ObjectKey};
use ambit_control::model::Store;

use crate::config::Object;

mod checks;
mod cluster;
pub mod message;
mod render;
mod source;

pub use cluster::Cluster;
pub use message::{Code, Message, Origin, Resource, Severity};
pub use render::{render_json, render_table, render_yaml};
pub use source::{Document, Files, LocalMesh, Source, documents_from_text};

/// The annotation that suppresses messages about its resource (Istio's).
pub const SUPPRESS_ANNOTATION: &str = "galley.istio.io/analyze-suppress";

/// Why `analyze` could not run (not: what it found).
#[derive(Debug, thiserror::Error)]
pub enum AnalyzeError {
    #[error("cannot read {}: {source}; check the path and its permissions", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Local(Box<crate::local::LocalError>),
    #[error(
        "invalid --suppress {0:?}: use CODE (e.g. AMB0006) or CODE=Kind namespace/name (e.g. \"IST0127=AuthorizationPolicy shop/*\")"
    )]
    BadSuppression(String),
    #[error("{0}")]
    Cluster(String),
}

/// A `--suppress` rule: a code, optionally limited to resources matching
/// `Kind namespace/name` (`*` at the end matches any rest).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suppression {
    pub code: String,
    pub resource: Option<String>,
}

impl std::str::FromStr for Suppression {
    type Err = AnalyzeError;
    fn from_str(s: &str) -> Result<Self, AnalyzeError> {
        let (code, resource) = match s.split_once('=') {
            Some((c, r)) => (c.trim(), Some(r.trim().to_string())),
            None => (s.trim(), None),
        };
        let ok = code == "*" || message::ALL.iter().any(|c| c.id == code);
        if !ok || resource.as_deref().is_some_and(str::is_empty) {
            return Err(AnalyzeError::BadSuppression(s.to_string()));
        }
        Ok(Self {
            code: code.to_string(),
            resource,
        })
    }
}

impl Suppression {
    fn matches(&self, m: &Message) -> bool {
        if self.code != "*" && self.code != m.code {
            return false;
        }
        match &self.resource {
            None => true,
            Some(pattern) => glob(pattern, &m.resource.to_string()),
        }
    }
}

fn glob(pattern: &str, text: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => text.starts_with(prefix),
        None => pattern == text,
    }
}

/// What the analysis found.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Report {
    /// What was read (for the summary line).
    pub sources: Vec<String>,
    /// Documents read, objects of modelled kinds accepted.
    pub documents: usize,
    pub objects: usize,
    /// Sorted: severity (worst first), file, line, code.
    pub messages: Vec<Message>,
    /// Messages suppressed by annotation or `--suppress`.
    pub suppressed: usize,
}

impl Report {
    /// The worst severity reported.
    pub fn worst(&self) -> Option<Severity> {
        self.messages.iter().map(|m| m.severity).max()
    }

    /// True when a message is at least as bad as `threshold`.
    pub fn fails(&self, threshold: Severity) -> bool {
        self.worst().is_some_and(|w| w >= threshold)
    }
}

/// Analyzes every document of `sources` together.
pub fn analyze(
    sources: &[&dyn Source],
    suppressions: &[Suppression],
) -> Result<Report, AnalyzeError> {
    let mut docs = Vec::new();
    let mut names = Vec::new();
    for s in sources {
        names.push(s.describe());
        docs.extend(s.documents()?);
    }
    let mut report = analyze_documents(docs, suppressions);
    report.sources = names;
    Ok(report)
}

/// Analyzes documents from any source.
pub fn analyze_documents(docs: Vec<Document>, suppressions: &[Suppression]) -> Report {
    let documents = docs.len();
    let (mesh, mut messages) = Mesh::build(docs);
    checks::run(&mesh, &mut messages);
    let before = messages.len();
    messages.retain(|m| !mesh.suppressed(m) && !suppressions.iter().any(|s| s.matches(m)));
    let suppressed = before - messages.len();
    messages.sort_by(|a, b| {
        (b.severity, &a.origin, a.code, &a.resource, &a.message).cmp(&(
            a.severity,
            &b.origin,
            b.code,
            &b.resource,
            &b.message,
        ))
    });
    messages.dedup();
    Report {
        sources: Vec::new(),
        documents,
        objects: mesh.objects.len(),
        messages,
        suppressed,
    }
}

/// The accepted objects, indexed for the checks.
pub(crate) struct Mesh {
    /// First definitions, in document order.
    pub objects: Vec<Object>,
    /// The documents they came from, by key.
    pub docs: HashMap<ObjectKey, Document>,
    /// The control plane's store of the same objects.
    pub store: Store,
    /// Codes suppressed per resource by annotation.
    suppress: HashMap<(String, String, String), Vec<String>>,
}

impl Mesh {
    /// Decodes the documents; rejected and duplicate ones become messages.
    fn build(docs: Vec<Document>) -> (Mesh, Vec<Message>) {
        let mut messages = Vec::new();
        let mut objects = Vec::new();
        let mut by_key: HashMap<ObjectKey, Document> = HashMap::new();
        let mut suppress = HashMap::new();
        for doc in docs {
            if let Some(codes) = doc
                .raw
                .as_ref()
                .and_then(|r| r.pointer("/metadata/annotations"))
                .and_then(|a| a.get(SUPPRESS_ANNOTATION))
                .and_then(|v| v.as_str())
            {
                let (kind, ns, name) = raw_identity(&doc);
                suppress.insert(
                    (kind, ns, name),
                    codes.split(',').map(|c| c.trim().to_string()).collect(),
                );
            }
            match &doc.decoded {
                Ok(None) => {}
                Ok(Some(obj)) => {
                    let key = obj.key();
                    if let Some(first) = by_key.get(&key) {
                        let at = first
                            .origin
                            .as_ref()
                            .map_or_else(|| "the cluster".to_string(), ToString::to_string);
                        messages.push(Message::new(
                            message::DUPLICATE_OBJECT,
                            resource_of(&key),
                            doc.origin.clone(),
                            format!(
                                "{} is already defined at {at}; the control plane serves that definition and ignores this one — remove one of the two",
                                resource_of(&key)
                            ),
                        ));
                        continue;
                    }
                    objects.push(obj.clone());
                    by_key.insert(key, doc);
                }
                Err(f) => {
                    let text = f.error.to_string();
                    // The decoder names the failing line: point there.
                    let origin = doc.origin.clone().map(|mut o| {
                        if let Some(l) = line_in(&text) {
                            o.line = l;
                        }
                        o
                    });
                    messages.push(Message::new(
                        message::SCHEMA,
                        Resource {
                            kind: f.kind.clone(),
                            namespace: f.namespace.clone(),
                            name: f.name.clone(),
                        },
                        origin,
                        text,
                    ));
                }
            }
        }
        let store = Store::from_objects(objects.clone());
        (
            Mesh {
                objects,
                docs: by_key,
                store,
                suppress,
            },
            messages,
        )
    }

    fn suppressed(&self, m: &Message) -> bool {
        let r = &m.resource;
        self.suppress
            .get(&(r.kind.clone(), r.namespace.clone(), r.name.clone()))
            .is_some_and(|codes| codes.iter().any(|c| c == "*" || c == m.code))
    }

    /// A message about the object `key`, at its document's start.
    pub fn msg(&self, code: Code, key: &ObjectKey, text: String) -> Message {
        let origin = self.docs.get(key).and_then(|d| d.origin.clone());
        Message::new(code, resource_of(key), origin, text)
    }

    /// A message about `key` at the line of `field` in its document.
    pub fn msg_at(&self, code: Code, key: &ObjectKey, field: &str, text: String) -> Message {
        let doc = self.docs.get(key);
        let origin = doc.and_then(|d| {
            let line = d.line_of(field)?;
            d.origin.as_ref().map(|o| Origin {
                file: o.file.clone(),
                line,
            })
        });
        let origin = origin.or_else(|| doc.and_then(|d| d.origin.clone()));
        Message::new(code, resource_of(key), origin, text)
    }

    /// The objects of one kind.
    pub fn of_kind(&self, kind: Kind) -> impl Iterator<Item = &Object> {
        self.objects.iter().filter(move |o| o.kind() == kind)
    }

    /// Namespace labels (empty when the Namespace is not in view).
    pub fn ns_labels(&self, ns: &str) -> &crate::config::Labels {
        self.store.namespace_labels(ns)
    }

    /// Pods in view by namespace.
    pub fn pods(&self) -> impl Iterator<Item = (&str, &ambit_config::objects::Pod)> {
        self.store
            .spaces()
            .flat_map(|(ns, o)| o.pods.values().map(move |p| (ns, p)))
            .filter(|(_, p)| !p.is_terminal())
    }

    /// Namespaces with their objects.
    pub fn spaces(
        &self,
    ) -> impl Iterator<Item = (&str, &ambit_control::model::store::NamespaceObjects)> {
        self.store.spaces()
    }

    /// Every object with its raw document, in document order.
    pub fn with_docs(&self) -> impl Iterator<Item = (&Object, &Document)> {
        self.objects
            .iter()
            .filter_map(|o| self.docs.get(&o.key()).map(|d| (o, d)))
    }
}

/// `N` of the first `at line N` in a decoder message.
fn line_in(text: &str) -> Option<usize> {
    let rest = &text[text.find("at line ")? + "at line ".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok().filter(|l| *l > 0)
}

pub(crate) fn resource_of(key: &ObjectKey) -> Resource {
    Resource {
        kind: key.kind.to_string(),
        namespace: key.namespace.clone(),
        name: key.name.clone(),
    }
}

/// `kind`, `namespace` (defaulted like the decoder), `name` from the raw
/// document, for suppression by annotation.
fn raw_identity(doc: &Document) -> (String, String, String) {
    if let Ok(Some(o)) = &doc.decoded {
        let k = o.key();
        return (k.kind.to_string(), k.namespace, k.name);
    }
    let get = |p: &str| {
        doc.raw
            .as_ref()
            .and_then(|r| r.pointer(p))
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    };
    (
        get("/kind"),
        get("/metadata/namespace"),
        get("/metadata/name"),
    )
}
