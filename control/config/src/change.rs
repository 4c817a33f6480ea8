//! What a config source hands on: [`Change`]s to objects and the
//! [`ConfigError`]s of the documents it rejected.

use std::fmt;

use crate::objects::{Object, ObjectKey};

/// One change to the set of objects a source serves.
#[allow(clippy::large_enum_variant)] // moved once, never stored in bulk
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    Upsert(Object),
    Delete(ObjectKey),
}

/// A rejected document, for operators: what, where, and what to do.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ConfigError {
    pub file: String,
    /// 0-based index of the document in the file.
    pub document: usize,
    /// 1-based line where the document starts.
    pub line: usize,
    pub kind: String,
    pub namespace: String,
    pub name: String,
    /// What is wrong and what to do.
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.file.is_empty() {
            // Found across objects by the model, not in one document.
            return write!(
                f,
                "{}/{}/{}: {}",
                self.kind, self.namespace, self.name, self.reason
            );
        }
        write!(
            f,
            "{}:{} (document {}) {}/{}/{}: {}",
            self.file, self.line, self.document, self.kind, self.namespace, self.name, self.reason
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn config_error_display() {
        let e = ConfigError {
            file: "dir/a.yaml".into(),
            document: 2,
            line: 17,
            kind: "Pod".into(),
            namespace: "ns".into(),
            name: "p".into(),
            reason: "bad".into(),
        };
        assert_eq!(e.to_string(), "dir/a.yaml:17 (document 2) Pod/ns/p: bad");
        assert_eq!(serde_json::to_value(&e).unwrap()["line"], 17);
    }
}
