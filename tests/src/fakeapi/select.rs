//! Label and field selectors as the API server reads them: `k=v`, `k==v`,
//! `k!=v`, `k`, `!k`, `k in (a,b)`, `k notin (a,b)` (labels); `path=v`,
//! `path!=v` on dotted JSON paths such as `spec.nodeName` (fields).

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
enum Term {
    Eq(String, String),
    Ne(String, String),
    Exists(String),
    Absent(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed selector; empty matches everything.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selector(Vec<Term>);

/// Splits on commas outside parentheses.
fn split_terms(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out.into_iter()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

fn set(values: &str) -> Option<Vec<String>> {
    let inner = values.trim().strip_prefix('(')?.strip_suffix(')')?;
    Some(inner.split(',').map(|v| v.trim().to_string()).collect())
}

impl Selector {
    /// Parses a selector; `Err` names the term it cannot read.
    pub fn parse(s: &str) -> Result<Selector, String> {
        let mut terms = Vec::new();
        for t in split_terms(s) {
            let term = if let Some((k, v)) = t.split_once("!=") {
                Term::Ne(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = t.split_once("==") {
                Term::Eq(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = t.split_once('=') {
                Term::Eq(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = t.split_once(" notin ") {
                Term::NotIn(k.trim().into(), set(v).ok_or(format!("bad set in {t:?}"))?)
            } else if let Some((k, v)) = t.split_once(" in ") {
                Term::In(k.trim().into(), set(v).ok_or(format!("bad set in {t:?}"))?)
            } else if let Some(k) = t.strip_prefix('!') {
                Term::Absent(k.trim().into())
            } else if t
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
            {
                Term::Exists(t.into())
            } else {
                return Err(format!("unable to parse requirement {t:?}"));
            };
            terms.push(term);
        }
        Ok(Selector(terms))
    }

    fn matches_with(&self, get: impl Fn(&str) -> Option<String>) -> bool {
        self.0.iter().all(|t| match t {
            Term::Eq(k, v) => get(k).as_deref() == Some(v.as_str()),
            Term::Ne(k, v) => get(k).as_deref() != Some(v.as_str()),
            Term::Exists(k) => get(k).is_some(),
            Term::Absent(k) => get(k).is_none(),
            Term::In(k, vs) => get(k).is_some_and(|x| vs.contains(&x)),
            Term::NotIn(k, vs) => get(k).is_none_or(|x| !vs.contains(&x)),
        })
    }

    /// As a label selector on `metadata.labels`.
    pub fn matches_labels(&self, obj: &Value) -> bool {
        let labels = &obj["metadata"]["labels"];
        self.matches_with(|k| labels.get(k).and_then(Value::as_str).map(str::to_string))
    }

    /// As a field selector on dotted paths (a missing field is `""`).
    pub fn matches_fields(&self, obj: &Value) -> bool {
        self.matches_with(|path| {
            let mut v = obj;
            for part in path.split('.') {
                v = v.get(part).unwrap_or(&Value::Null);
            }
            Some(match v {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            })
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn selectors() {
        let pod = json!({"metadata": {"name": "a", "labels": {"app": "web", "tier": "fe"}}, "spec": {"nodeName": "n1"}});
        let yes = [
            "app=web",
            "app==web,tier",
            "app in (web,db)",
            "!missing",
            "tier notin (be)",
            "",
        ];
        for s in yes {
            assert!(Selector::parse(s).unwrap().matches_labels(&pod), "{s}");
        }
        let no = ["app=db", "app!=web", "missing", "!app", "app in (db)"];
        for s in no {
            assert!(!Selector::parse(s).unwrap().matches_labels(&pod), "{s}");
        }
        let f = Selector::parse("spec.nodeName=n1,metadata.name!=b").unwrap();
        assert!(f.matches_fields(&pod));
        assert!(
            !Selector::parse("spec.nodeName=n2")
                .unwrap()
                .matches_fields(&pod)
        );
        assert!(Selector::parse("a in (b").is_err());
    }
}
