//! Values written as SQL literals, for the statements sent with the simple
//! query protocol (no parameters): [`PgOutbox::commit_with`]'s
//! `INSERT ...; COMMIT AND CHAIN`.
//!
//! Every literal is correct whatever `standard_conforming_strings` says:
//! text is an escape string (`E'...'`, where a backslash always escapes, so
//! each one is doubled, and a quote is doubled), bytea is hex inside an
//! escape string (`E'\\x..'`), JSON is text cast to `jsonb`, a time is a
//! fixed ISO 8601 form in UTC, a UUID its hyphenated form. The connection's
//! client encoding is UTF-8 (sqlx sets it at connect), in which no byte of
//! a multi-byte character is a quote or a backslash. PostgreSQL's text
//! cannot hold NUL: a text with one is refused ([`NulByte`]), as the
//! event's validation already refuses it in every text field.
//!
//! [`PgOutbox::commit_with`]: crate::PgOutbox::commit_with

use chrono::{DateTime, Utc};
use std::fmt::Write as _;
use uuid::Uuid;

/// A NUL character at byte `at` of a text: PostgreSQL's text cannot hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NulByte {
    /// Its byte offset in the text.
    pub(crate) at: usize,
}

/// Appends `text` as an escape string literal, `E'...'`.
pub(crate) fn push_text(out: &mut String, text: &str) -> Result<(), NulByte> {
    out.reserve(text.len() + 3);
    out.push_str("E'");
    for (at, c) in text.char_indices() {
        match c {
            '\0' => return Err(NulByte { at }),
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("''"),
            c => out.push(c),
        }
    }
    out.push('\'');
    Ok(())
}

/// Appends `text` as a literal, or `NULL` for `None`.
pub(crate) fn push_opt_text(out: &mut String, text: Option<&str>) -> Result<(), NulByte> {
    match text {
        Some(text) => push_text(out, text),
        None => {
            out.push_str("NULL");
            Ok(())
        }
    }
}

/// Appends `bytes` as a `bytea` literal in hex: `E'\\x0aff'::bytea`.
pub(crate) fn push_bytea(out: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.reserve(bytes.len() * 2 + 14);
    out.push_str("E'\\\\x");
    for b in bytes {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0x0f)]));
    }
    out.push_str("'::bytea");
}

/// Appends JSON text as a `jsonb` literal: `E'{..}'::jsonb`.
pub(crate) fn push_jsonb(out: &mut String, json: &str) -> Result<(), NulByte> {
    push_text(out, json)?;
    out.push_str("::jsonb");
    Ok(())
}

/// Appends a UUID literal: `'0190..-..'::uuid`.
pub(crate) fn push_uuid(out: &mut String, id: Uuid) {
    // The hyphenated form is hex digits and hyphens only.
    let _ = write!(out, "'{}'::uuid", id.hyphenated());
}

/// Appends an integer literal.
pub(crate) fn push_i64(out: &mut String, n: i64) {
    // A negative literal is parenthesized so it never follows an operator.
    if n < 0 {
        let _ = write!(out, "({n})");
    } else {
        let _ = write!(out, "{n}");
    }
}

/// Appends a time as a `timestamptz` literal in UTC with microseconds
/// (what PostgreSQL keeps; the bound parameter of `enqueue` truncates to
/// microseconds the same way): `'2024-05-01T10:00:00.000000+00:00'::timestamptz`.
/// Times are validated to the years 1970-9999 before they get here.
pub(crate) fn push_timestamptz(out: &mut String, at: DateTime<Utc>) {
    let _ = write!(
        out,
        "'{}'::timestamptz",
        at.format("%Y-%m-%dT%H:%M:%S%.6f+00:00")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> String {
        let mut out = String::new();
        push_text(&mut out, s).unwrap();
        out
    }

    #[test]
    fn text_doubles_quotes_and_backslashes() {
        assert_eq!(text(""), "E''");
        assert_eq!(text("plain"), "E'plain'");
        assert_eq!(text("it's"), "E'it''s'");
        assert_eq!(text("a\\b"), "E'a\\\\b'");
        assert_eq!(text("\\'"), "E'\\\\'''");
        assert_eq!(text("'; DROP TABLE x; --"), "E'''; DROP TABLE x; --'");
        assert_eq!(text("naïve ✓ 日本 🦀"), "E'naïve ✓ 日本 🦀'");
    }

    #[test]
    fn text_refuses_nul_with_its_offset() {
        let mut out = String::new();
        assert_eq!(push_text(&mut out, "ab\0c"), Err(NulByte { at: 2 }));
        assert_eq!(push_opt_text(&mut out, Some("é\0")), Err(NulByte { at: 2 }));
        let mut out = String::new();
        push_opt_text(&mut out, None).unwrap();
        assert_eq!(out, "NULL");
    }

    #[test]
    fn other_literals() {
        let mut out = String::new();
        push_bytea(&mut out, &[0x00, 0x0a, 0xff, b'\'', b'\\']);
        assert_eq!(out, "E'\\\\x000aff275c'::bytea");
        out.clear();
        push_bytea(&mut out, &[]);
        assert_eq!(out, "E'\\\\x'::bytea");
        out.clear();
        push_i64(&mut out, -5);
        push_i64(&mut out, 4_294_967_295);
        assert_eq!(out, "(-5)4294967295");
        out.clear();
        let at = DateTime::parse_from_rfc3339("2024-05-01T10:00:00.123456789Z")
            .unwrap()
            .with_timezone(&Utc);
        push_timestamptz(&mut out, at);
        assert_eq!(out, "'2024-05-01T10:00:00.123456+00:00'::timestamptz");
        out.clear();
        push_uuid(&mut out, Uuid::nil());
        assert_eq!(out, "'00000000-0000-0000-0000-000000000000'::uuid");
        out.clear();
        push_jsonb(&mut out, r#"{"a":"it's \"q\" \\"}"#).unwrap();
        assert_eq!(out, r#"E'{"a":"it''s \\"q\\" \\\\"}'::jsonb"#);
    }

    /// Undoes [`push_text`] as PostgreSQL's lexer reads an escape string
    /// (only `\\` and `''` can occur in what it writes); `None` when the
    /// literal is not one well-formed escape string.
    fn parse_escape_string(lit: &str) -> Option<String> {
        let body = lit.strip_prefix("E'")?;
        let mut out = String::new();
        let mut chars = body.chars();
        loop {
            match chars.next()? {
                '\\' => out.push(chars.next()?),
                '\'' => match chars.next() {
                    Some('\'') => out.push('\''),
                    // The closing quote must be the last character.
                    None => return Some(out),
                    Some(_) => return None,
                },
                c => out.push(c),
            }
        }
    }

    /// Property: for many generated strings over an alphabet rich in quotes,
    /// backslashes and multi-byte characters, the literal is one escape
    /// string that reads back as the input, and any NUL is refused.
    #[test]
    fn text_round_trips_through_the_lexer_rules() {
        const ALPHABET: &[char] = &[
            '\'', '\\', '"', 'a', 'Z', ' ', ';', '-', '$', 'é', '日', '🦀', '\u{7f}', '\u{2028}',
            'E', 'x', '0',
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            // xorshift64*: deterministic, so a failure reproduces.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            state.wrapping_mul(0x2545_f491_4f6c_dd1d)
        };
        for _ in 0..20_000 {
            let len = usize::try_from(next() % 24).unwrap_or(0);
            let s: String = (0..len)
                .map(|_| ALPHABET[usize::try_from(next()).unwrap_or(0) % ALPHABET.len()])
                .collect();
            let lit = text(&s);
            assert_eq!(
                parse_escape_string(&lit).as_deref(),
                Some(s.as_str()),
                "{lit}"
            );
            let with_nul = format!("{s}\0");
            let mut out = String::new();
            assert_eq!(
                push_text(&mut out, &with_nul),
                Err(NulByte { at: s.len() }),
                "{s:?}"
            );
        }
    }
}
