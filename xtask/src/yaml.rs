//! A small reader for the block-YAML subset `deploy/` uses, into
//! `serde_json::Value` (so the checks read the rules the way they read the
//! dashboard, without a YAML crate in the build).
//!
//! Supported: block mappings and sequences (also a sequence at its key's
//! indentation), `- key: value` items, plain, single- and double-quoted
//! scalars, block scalars (`|`, `>`, with `-` / `+` chomping), comments, a
//! leading `---`, and the empty flow collections `[]` / `{}`. Every scalar is
//! a string. Anything else (flow collections with content, anchors, aliases,
//! tags, multi-line plain scalars, tabs in indentation, duplicate keys,
//! several documents) is an error naming the line: a file this reader
//! refuses is a file the checks cannot vouch for.

use serde_json::{Map, Value};

/// Parses `text`; the error names the 1-based line.
pub(crate) fn parse(text: &str) -> Result<Value, String> {
    let mut p = Parser {
        lines: text.lines().map(str::to_owned).collect(),
        pos: 0,
    };
    p.skip_blank();
    if p.lines.get(p.pos).is_some_and(|l| l.trim_end() == "---") {
        p.pos += 1;
    }
    let Some((indent, _)) = p.peek()? else {
        return Ok(Value::Null);
    };
    let value = p.node(indent)?;
    if let Some((_, content)) = p.peek()? {
        return Err(p.err(&format!(
            "unexpected content {content:?} (bad indentation or a second document)"
        )));
    }
    Ok(value)
}

struct Parser {
    lines: Vec<String>,
    pos: usize,
}

impl Parser {
    fn err(&self, what: &str) -> String {
        format!("line {}: {what}", self.pos + 1)
    }

    /// Moves past blank and comment-only lines.
    fn skip_blank(&mut self) {
        while let Some(l) = self.lines.get(self.pos) {
            let t = l.trim_start();
            if t.is_empty() || t.starts_with('#') {
                self.pos += 1;
            } else {
                break;
            }
        }
    }

    /// The next meaningful line: its indentation and content.
    fn peek(&mut self) -> Result<Option<(usize, String)>, String> {
        self.skip_blank();
        let Some(line) = self.lines.get(self.pos) else {
            return Ok(None);
        };
        let content = line.trim_start_matches(' ');
        if content.starts_with('\t') {
            return Err(self.err("tab in indentation"));
        }
        if line.trim_end() == "---" || line.trim_end() == "..." {
            return Err(self.err("several documents are not supported"));
        }
        Ok(Some((
            line.len() - content.len(),
            content.trim_end().to_owned(),
        )))
    }

    /// A block node whose lines start at `indent`.
    fn node(&mut self, indent: usize) -> Result<Value, String> {
        match self.peek()? {
            Some((_, c)) if is_item(&c) => self.sequence(indent),
            Some(_) => self.mapping(indent),
            None => Ok(Value::Null),
        }
    }

    fn sequence(&mut self, indent: usize) -> Result<Value, String> {
        let mut items = Vec::new();
        while let Some((at, content)) = self.peek()? {
            if at < indent || !is_item(&content) {
                break;
            }
            if at > indent {
                return Err(self.err("bad indentation in a sequence"));
            }
            let rest = content[1..].trim_start();
            if rest.is_empty() {
                self.pos += 1;
                match self.peek()? {
                    Some((deeper, _)) if deeper > indent => items.push(self.node(deeper)?),
                    _ => items.push(Value::Null),
                }
                continue;
            }
            // `- rest`: the item's node starts at rest's column; rewrite the
            // line so that it reads as that node's first line.
            let col = at + (content.len() - rest.len());
            if split_key(rest).is_some() || is_item(rest) {
                self.lines[self.pos] = format!("{}{rest}", " ".repeat(col));
                items.push(self.node(col)?);
            } else {
                let rest = rest.to_owned();
                items.push(self.inline_value(&rest, indent)?);
            }
        }
        Ok(Value::Array(items))
    }

    fn mapping(&mut self, indent: usize) -> Result<Value, String> {
        let mut map = Map::new();
        while let Some((at, content)) = self.peek()? {
            if at < indent || (at == indent && is_item(&content)) {
                break;
            }
            if at > indent {
                return Err(self.err("bad indentation in a mapping"));
            }
            let Some((key, rest)) = split_key(&content) else {
                return Err(self.err(&format!("expected `key: value`, found {content:?}")));
            };
            if map.contains_key(&key) {
                return Err(self.err(&format!("duplicate key {key:?}")));
            }
            let value = if rest.is_empty() {
                self.pos += 1;
                match self.peek()? {
                    Some((deeper, _)) if deeper > indent => self.node(deeper)?,
                    // A sequence may sit at its key's indentation.
                    Some((same, c)) if same == indent && is_item(&c) => self.sequence(indent)?,
                    _ => Value::Null,
                }
            } else {
                self.inline_value(&rest, indent)?
            };
            map.insert(key, value);
        }
        Ok(Value::Object(map))
    }

    /// The value after `key:` or `- ` on the current line (then moves on).
    fn inline_value(&mut self, text: &str, indent: usize) -> Result<Value, String> {
        let first = text.chars().next().unwrap_or(' ');
        let value = match first {
            '|' | '>' => return self.block_scalar(text, indent),
            '[' | '{' => {
                let t = strip_comment(text);
                if t == "[]" {
                    Value::Array(Vec::new())
                } else if t == "{}" {
                    Value::Object(Map::new())
                } else {
                    return Err(self.err("flow collections are not supported; use block style"));
                }
            }
            '&' | '*' | '!' => {
                return Err(self.err("anchors, aliases and tags are not supported"));
            }
            _ => Value::String(self.scalar(text)?),
        };
        self.pos += 1;
        // A plain scalar continued on the next, deeper line.
        if let Some((at, _)) = self.peek()? {
            if at > indent {
                return Err(self.err(
                    "unexpected indentation (multi-line plain scalars are not supported; use `>-` or `|`)",
                ));
            }
        }
        Ok(value)
    }

    /// A quoted or plain scalar filling the rest of the line.
    fn scalar(&self, text: &str) -> Result<String, String> {
        match text.chars().next() {
            Some(q @ ('"' | '\'')) => {
                let (s, used) = quoted(text, q).map_err(|e| self.err(&e))?;
                let tail = text[used..].trim_start();
                if !tail.is_empty() && !tail.starts_with('#') {
                    return Err(self.err(&format!("text after a quoted scalar: {tail:?}")));
                }
                Ok(s)
            }
            _ => Ok(strip_comment(text).to_owned()),
        }
    }

    /// `|` / `>` with optional chomping: the following deeper lines.
    fn block_scalar(&mut self, header: &str, indent: usize) -> Result<Value, String> {
        let header = strip_comment(header);
        let (folded, chomp) = match header {
            "|" => (false, ' '),
            "|-" => (false, '-'),
            "|+" => (false, '+'),
            ">" => (true, ' '),
            ">-" => (true, '-'),
            ">+" => (true, '+'),
            other => return Err(self.err(&format!("unsupported block scalar header {other:?}"))),
        };
        self.pos += 1;
        let mut raw: Vec<String> = Vec::new();
        let mut block_indent = None;
        while let Some(line) = self.lines.get(self.pos) {
            let content = line.trim_start_matches(' ');
            let at = line.len() - content.len();
            if content.trim().is_empty() {
                raw.push(String::new());
                self.pos += 1;
                continue;
            }
            if at <= indent {
                break;
            }
            let bi = *block_indent.get_or_insert(at);
            if at < bi {
                return Err(self.err("block scalar line less indented than its first line"));
            }
            raw.push(line[bi..].trim_end().to_owned());
            self.pos += 1;
        }
        let trailing = raw.iter().rev().take_while(|l| l.is_empty()).count();
        let body = &raw[..raw.len() - trailing];
        let mut text = String::new();
        for (i, line) in body.iter().enumerate() {
            if i > 0 {
                // Folding: a break between two text lines is a space; each
                // empty line is one newline (the break before it is dropped).
                let prev_blank = body[i - 1].is_empty();
                if !folded || line.is_empty() {
                    text.push('\n');
                } else if !prev_blank {
                    text.push(' ');
                }
            }
            text.push_str(line);
        }
        match chomp {
            '-' => {}
            '+' => {
                text.push('\n');
                text.push_str(&"\n".repeat(trailing));
            }
            _ if !body.is_empty() => text.push('\n'),
            _ => {}
        }
        Ok(Value::String(text))
    }
}

/// Whether a line's content is a sequence item (`-` then a space or nothing).
fn is_item(content: &str) -> bool {
    content == "-" || content.starts_with("- ")
}

/// `key: rest` (rest without leading spaces; empty for `key:`), for a
/// plain or quoted key; `None` when the line is not a mapping entry.
fn split_key(content: &str) -> Option<(String, String)> {
    let (key, after) = match content.chars().next()? {
        q @ ('"' | '\'') => {
            let (key, used) = quoted(content, q).ok()?;
            (key, &content[used..])
        }
        _ => {
            let bytes = content.as_bytes();
            let at = (0..bytes.len())
                .find(|&i| bytes[i] == b':' && (i + 1 == bytes.len() || bytes[i + 1] == b' '))?;
            if content[..at].contains(" #") {
                return None;
            }
            (content[..at].trim_end().to_owned(), &content[at..])
        }
    };
    let rest = after.strip_prefix(':')?;
    if !(rest.is_empty() || rest.starts_with(' ')) {
        return None;
    }
    let rest = rest.trim_start();
    let rest = if rest.starts_with('#') { "" } else { rest };
    Some((key, rest.to_owned()))
}

/// A quoted scalar at the start of `text`: its value and the bytes used.
fn quoted(text: &str, q: char) -> Result<(String, usize), String> {
    let mut out = String::new();
    let mut chars = text.char_indices().skip(1).peekable();
    while let Some((i, c)) = chars.next() {
        if c == q {
            if q == '\'' && chars.peek().is_some_and(|(_, n)| *n == '\'') {
                out.push('\'');
                chars.next();
                continue;
            }
            return Ok((out, i + 1));
        }
        if c == '\\' && q == '"' {
            let Some((_, e)) = chars.next() else { break };
            out.push(match e {
                'n' => '\n',
                't' => '\t',
                '\\' => '\\',
                '"' => '"',
                '/' => '/',
                other => return Err(format!("unsupported escape \\{other}")),
            });
            continue;
        }
        out.push(c);
    }
    Err("unterminated quoted scalar (multi-line quoted scalars are not supported)".to_owned())
}

/// A plain scalar without its trailing comment.
fn strip_comment(text: &str) -> &str {
    text.find(" #").map_or(text, |i| &text[..i]).trim_end()
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
    fn refuses_what_it_does_not_understand() {
        for (text, why) in [
            ("a: 1\na: 2\n", "duplicate key"),
            ("a:\n  b: 1\n c: 2\n", "bad indentation"),
            ("a: {b: 1}\n", "flow collections"),
            ("a: &x 1\n", "anchors"),
            ("a: one\n  two\n", "multi-line plain"),
            ("a: \"open\n", "unterminated"),
            ("a:\n\t- b\n", "tab"),
            ("a: 1\n---\nb: 2\n", "several documents"),
            ("just text\n", "expected `key: value`"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
            assert!(e.starts_with("line "), "{e}");
        }
    }
}
