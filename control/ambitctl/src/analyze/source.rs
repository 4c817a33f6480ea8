//! Where `analyze` gets objects: a [`Source`] yields [`Document`]s, each the
//! decoded object (or why it was rejected), its raw JSON form (for the
//! unknown-field and label checks) and where it was written.
//!
//! Files and directories ([`Files`]), the live local mesh ([`LocalMesh`],
//! the directory its control plane serves) and a Kubernetes cluster
//! (`cluster.rs`: objects listed from the API server, each a
//! [`Document::from_json`]) are the sources.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::config::{DecodeError, DecodeFailure, Object, decode_json_value, decode_yaml_document};
use crate::config::{MAX_FILE_BYTES, config_files, split_documents};

use super::AnalyzeError;
use super::message::Origin;

/// One document of a source.
#[derive(Debug, Clone)]
pub struct Document {
    pub origin: Option<Origin>,
    /// The document's text (files), to find the line of a field.
    pub text: Option<String>,
    /// Lines of the file before `text`.
    pub offset: usize,
    /// The document as JSON, when it parses at all.
    pub raw: Option<serde_json::Value>,
    /// The object (`None`: a kind the mesh does not use), or why the
    /// decoder rejected it.
    pub decoded: Result<Option<Object>, Box<DecodeFailure>>,
}

impl Document {
    /// A document of a YAML file: `offset` lines precede `text` in `file`,
    /// whose content starts at `line`.
    pub fn from_yaml(file: &str, line: usize, offset: usize, text: &str) -> Self {
        let decoded = decode_yaml_document(text, offset);
        // The lenient parse only after the decoder's limits passed.
        let raw = match &decoded {
            Err(f) if matches!(f.error, DecodeError::Limit(_) | DecodeError::Syntax(_)) => None,
            _ => serde_saphyr::from_str::<serde_json::Value>(text).ok(),
        };
        Self {
            origin: Some(Origin {
                file: file.to_string(),
                line,
            }),
            text: Some(text.to_string()),
            offset,
            raw,
            decoded,
        }
    }

    /// An object as the API server sends it (cluster mode).
    pub fn from_json(value: serde_json::Value) -> Self {
        Self {
            origin: None,
            text: None,
            offset: 0,
            decoded: decode_json_value(&value),
            raw: Some(value),
        }
    }

    /// A file that cannot be read as config at all.
    fn unreadable(file: &Path, why: String) -> Self {
        Self {
            origin: Some(Origin {
                file: file.display().to_string(),
                line: 1,
            }),
            text: None,
            offset: 0,
            raw: None,
            decoded: Err(Box::new(DecodeFailure {
                key: None,
                kind: String::new(),
                namespace: String::new(),
                name: String::new(),
                error: DecodeError::Invalid(why),
            })),
        }
    }

    /// The 1-based line of the first line at or after the document's start
    /// that holds the mapping key `key` (`key:` or `- key:`); the document's
    /// start when none does.
    pub fn line_of(&self, key: &str) -> Option<usize> {
        let origin = self.origin.as_ref()?;
        let text = self.text.as_deref()?;
        let first = text
            .lines()
            .position(|l| {
                let t = l.trim_start().trim_start_matches("- ").trim_start();
                t.strip_prefix(key)
                    .is_some_and(|rest| rest.trim_start().starts_with(':'))
                    || t.strip_prefix(&format!("\"{key}\""))
                        .is_some_and(|rest| rest.trim_start().starts_with(':'))
            })
            .map(|i| i + 1);
        Some(first.map_or(origin.line, |i| self.offset + i))
    }
}

/// The documents of one YAML file's text, named `file` in messages.
pub fn documents_from_text(file: &str, text: &str) -> Vec<Document> {
    split_documents(text)
        .into_iter()
        .map(|d| Document::from_yaml(file, d.line, d.offset, &d.text))
        .collect()
}

/// Anything `analyze` can read objects from.
pub trait Source {
    /// For messages: `files a.yaml, dir/`, `local mesh ambit (dir)`.
    fn describe(&self) -> String;
    /// Every document, in a stable order.
    fn documents(&self) -> Result<Vec<Document>, AnalyzeError>;
}

/// YAML files and directories (read recursively, `*.yaml`/`*.yml`, hidden
/// names skipped — as the control plane reads its config directory).
#[derive(Debug, Clone)]
pub struct Files {
    pub paths: Vec<PathBuf>,
}

impl Files {
    pub fn new(paths: impl IntoIterator<Item = impl Into<PathBuf>>) -> Self {
        Self {
            paths: paths.into_iter().map(Into::into).collect(),
        }
    }
}

impl Source for Files {
    fn describe(&self) -> String {
        let names: Vec<String> = self.paths.iter().map(|p| p.display().to_string()).collect();
        format!("files {}", names.join(", "))
    }

    fn documents(&self) -> Result<Vec<Document>, AnalyzeError> {
        let mut out = Vec::new();
        for path in &self.paths {
            let meta = std::fs::metadata(path).map_err(|e| AnalyzeError::Read {
                path: path.clone(),
                source: e,
            })?;
            let files: Vec<PathBuf> = if meta.is_dir() {
                config_files(path).into_iter().collect()
            } else {
                vec![path.clone()]
            };
            for file in files {
                read_file(&file, &mut out)?;
            }
        }
        Ok(out)
    }
}

fn read_file(file: &Path, out: &mut Vec<Document>) -> Result<(), AnalyzeError> {
    let read = |e| AnalyzeError::Read {
        path: file.to_path_buf(),
        source: e,
    };
    let f = std::fs::File::open(file).map_err(read)?;
    let mut bytes = Vec::new();
    f.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        out.push(Document::unreadable(
            file,
            format!(
                "the file is larger than {MAX_FILE_BYTES} bytes (the control plane's file-size limit) and would not be loaded; split it into smaller files"
            ),
        ));
        return Ok(());
    }
    let Ok(text) = String::from_utf8(bytes) else {
        out.push(Document::unreadable(
            file,
            "the file is not valid UTF-8 and would not be loaded; save it as UTF-8".into(),
        ));
        return Ok(());
    };
    out.extend(documents_from_text(&file.display().to_string(), &text));
    Ok(())
}

/// The config of a running local mesh (`ambitctl local up`): the directory
/// its control plane serves, named by the cluster's state.
#[derive(Debug, Clone)]
pub struct LocalMesh {
    pub name: String,
    pub state_dir: Option<PathBuf>,
}

impl LocalMesh {
    fn config_dir(&self) -> Result<PathBuf, AnalyzeError> {
        let cluster = crate::local::LocalCluster::open(&self.name, self.state_dir.as_deref())
            .map_err(|e| AnalyzeError::Local(Box::new(e)))?;
        Ok(cluster.state.config_dir.clone())
    }
}

impl Source for LocalMesh {
    fn describe(&self) -> String {
        match self.config_dir() {
            Ok(dir) => format!("local mesh {} ({})", self.name, dir.display()),
            Err(_) => format!("local mesh {}", self.name),
        }
    }

    fn documents(&self) -> Result<Vec<Document>, AnalyzeError> {
        Files::new([self.config_dir()?]).documents()
    }
}
