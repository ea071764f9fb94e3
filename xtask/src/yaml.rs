//! `deploy/`'s YAML files read into `serde_json::Value` (so the checks read
//! the rules the way they read the dashboard), with yaml-rust2, a
//! maintained YAML 1.2 parser. Every scalar becomes a string (the checks
//! compare text: `for: 5m`, `severity: page`), an empty value `null`; a
//! file that does not parse, or holds several documents, is an error naming
//! the line.

use serde_json::{Map, Value};
use yaml_rust2::{Yaml, YamlLoader};

/// Parses `text`; the error names the 1-based line.
pub(crate) fn parse(text: &str) -> Result<Value, String> {
    let docs = YamlLoader::load_from_str(text)
        .map_err(|e| format!("line {}: {}", e.marker().line(), e.info()))?;
    match docs.as_slice() {
        [] => Ok(Value::Null),
        [doc] => to_json(doc),
        [_, ..] => Err("line 1: several documents in one file".to_owned()),
    }
}

fn to_json(y: &Yaml) -> Result<Value, String> {
    Ok(match y {
        Yaml::Null => Value::Null,
        Yaml::String(s) | Yaml::Real(s) => Value::String(s.clone()),
        Yaml::Integer(i) => Value::String(i.to_string()),
        Yaml::Boolean(b) => Value::String(b.to_string()),
        Yaml::Array(items) => Value::Array(items.iter().map(to_json).collect::<Result<_, _>>()?),
        Yaml::Hash(map) => {
            let mut out = Map::new();
            for (k, v) in map {
                let key = match k {
                    Yaml::String(s) | Yaml::Real(s) => s.clone(),
                    Yaml::Integer(i) => i.to_string(),
                    Yaml::Boolean(b) => b.to_string(),
                    other => return Err(format!("a mapping key that is not a scalar: {other:?}")),
                };
                out.insert(key, to_json(v)?);
            }
            Value::Object(out)
        }
        Yaml::Alias(_) | Yaml::BadValue => {
            return Err(format!("a value the checks cannot read: {y:?}"))
        }
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_the_block_subset() {
        let text = r#"
# comment
---
groups:
  - name: g # trailing comment
    rules:
    - alert: A
      expr: up{job="x"} == 0
      for: 5m
      labels:
        severity: 'it''s'
      annotations:
        summary: "a \"b\" {{ $labels.instance }}"
        description: >-
          one
          two

          three
        note: |
          x
            y
    - record: r
      expr: sum(x)
empty: []
nothing:
list:
- a
- "b: c"
"#;
        let v = parse(text).unwrap();
        assert_eq!(
            v,
            json!({
                "groups": [{
                    "name": "g",
                    "rules": [
                        {
                            "alert": "A",
                            "expr": "up{job=\"x\"} == 0",
                            "for": "5m",
                            "labels": {"severity": "it's"},
                            "annotations": {
                                "summary": "a \"b\" {{ $labels.instance }}",
                                "description": "one two\nthree",
                                "note": "x\n  y\n"
                            }
                        },
                        {"record": "r", "expr": "sum(x)"}
                    ]
                }],
                "empty": [],
                "nothing": null,
                "list": ["a", "b: c"]
            })
        );
    }

    #[test]
    fn refuses_what_does_not_parse_naming_the_line() {
        for (text, line) in [
            ("a:\n  b: 1\n c: 2\n", "line 3"),
            ("a: \"open\n", "line "),
            ("a: 1\n---\nb: 2\n", "line 1: several documents"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.starts_with(line), "{text:?}: {e}");
        }
    }
}
