//! Reading Prometheus text exposition (ztunnel's `/metrics`): samples with
//! their labels, for `ztunnel-config connections` and `authn tls-check`.

use std::collections::BTreeMap;

/// One sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Every sample of metric `name` in `text` (comments and other metrics
/// skipped; malformed lines ignored).
pub fn samples(text: &str, name: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(parse_line)
        .filter(|s| s.name == name)
        .collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    let (name, rest) = match line.find('{') {
        Some(i) => (&line[..i], &line[i..]),
        None => {
            let (n, v) = line.split_once(' ')?;
            return Some(Sample {
                name: n.to_string(),
                labels: BTreeMap::new(),
                value: v.split_whitespace().next()?.parse().ok()?,
            });
        }
    };
    let mut labels = BTreeMap::new();
    let mut chars = rest[1..].char_indices().peekable();
    let body = &rest[1..];
    let mut end = None;
    let mut key_start = 0;
    while let Some((i, c)) = chars.next() {
        match c {
            '}' => {
                end = Some(i);
                break;
            }
            '=' => {
                let key = body[key_start..i].trim_matches([',', ' ']).to_string();
                // A quoted value with \" and \\ escapes.
                let Some((_, '"')) = chars.next() else {
                    return None;
                };
                let mut value = String::new();
                loop {
                    match chars.next()? {
                        (_, '\\') => match chars.next()? {
                            (_, 'n') => value.push('\n'),
                            (_, c) => value.push(c),
                        },
                        (_, '"') => break,
                        (_, c) => value.push(c),
                    }
                }
                labels.insert(key, value);
                key_start = chars.peek().map_or(body.len(), |(j, _)| *j);
            }
            _ => {}
        }
    }
    let value = body[end? + 1..].split_whitespace().next()?.parse().ok()?;
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_labels_and_values() {
        let text = "# HELP x\nistio_tcp_connections_opened_total{reporter=\"destination\",a=\"b,c\",q=\"x\\\"y\"} 3\nother 1\n";
        let s = samples(text, "istio_tcp_connections_opened_total");
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].labels["reporter"], "destination");
        assert_eq!(s[0].labels["a"], "b,c");
        assert_eq!(s[0].labels["q"], "x\"y");
        assert_eq!(s[0].value, 3.0);
        assert_eq!(samples(text, "other")[0].value, 1.0);
    }
}
