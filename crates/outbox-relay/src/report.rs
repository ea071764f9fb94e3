//! How the binary prints an error: the chain of causes on one line, each
//! cause once, root cause last, no secret.
//!
//! `anyhow`'s `{:#}` prints every `source()` after its wrapper; when a
//! wrapper also puts its source's text in its own message (common in client
//! libraries), the same words come out twice or more. Here a cause whose text
//! was already printed is skipped, and every secret the user passed (URL
//! passwords, secret-looking properties) is replaced by `***`.

use outbox_core::redact_url;

/// `error` as one line: `cannot connect to the store: connection refused`.
pub(crate) fn render(error: &anyhow::Error, secrets: &[String]) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in error.chain() {
        let text = cause.to_string();
        let text = text.trim();
        if text.is_empty() || parts.iter().any(|p| p.contains(text)) {
            continue;
        }
        // A cause that repeats the previous part and adds to it replaces it.
        if let Some(last) = parts.last_mut() {
            if text.contains(last.as_str()) {
                *last = text.to_owned();
                continue;
            }
        }
        parts.push(text.to_owned());
    }
    scrub(&parts.join(": "), secrets)
}

/// `text` with each secret replaced by `***` (longest first, so a secret
/// that contains another is hidden whole).
pub(crate) fn scrub(text: &str, secrets: &[String]) -> String {
    let mut secrets: Vec<&String> = secrets.iter().filter(|s| s.len() >= 3).collect();
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    secrets.into_iter().fold(text.to_owned(), |text, secret| {
        text.replace(secret.as_str(), "***")
    })
}

/// The secrets of a URL (or of a comma-separated list of URLs): the
/// password of `user:password@`, also percent-decoded, and the URL itself
/// where redaction changes it (which covers a bare `token@`: a user name
/// alone is not a secret, and hiding it everywhere would garble messages).
pub(crate) fn url_secrets(url: &str) -> Vec<String> {
    let mut secrets = Vec::new();
    for one in url.split(',') {
        let rest = one.split_once("://").map_or(one, |(_, rest)| rest);
        // The userinfo ends at the last `@` before the path.
        let authority_end = rest.find('/').unwrap_or(rest.len());
        let authority = &rest[..authority_end];
        let Some(at) = authority.rfind('@') else {
            continue;
        };
        let Some((_, secret)) = authority[..at].split_once(':') else {
            continue;
        };
        if !secret.is_empty() {
            secrets.push(secret.to_owned());
            let decoded = percent_decode(secret);
            if decoded != secret {
                secrets.push(decoded);
            }
        }
    }
    if redact_url(url) != url {
        secrets.push(url.to_owned());
    }
    secrets
}

/// Whether a property name looks like it holds a secret (`sasl.password`,
/// `ssl.key.password`, `oauth.token`).
pub(crate) fn looks_secret(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["password", "secret", "token", "credential", "private"]
        .iter()
        .any(|w| name.contains(w))
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct E(&'static str, Option<Box<E>>);
    impl std::fmt::Display for E {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl std::error::Error for E {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn each_cause_once_root_last() {
        let root = E(
            "pool timed out: connection refused",
            Some(Box::new(E("connection refused", None))),
        );
        let err = anyhow::Error::new(root).context("cannot connect to the store");
        assert_eq!(
            render(&err, &[]),
            "cannot connect to the store: pool timed out: connection refused"
        );
    }

    #[test]
    fn secrets_are_scrubbed() {
        let url = "postgres://app:s%40cret@127.0.0.1:5999/test";
        let secrets = url_secrets(url);
        assert!(secrets.contains(&"s%40cret".to_owned()));
        assert!(secrets.contains(&"s@cret".to_owned()));
        let err = anyhow::anyhow!("cannot use {url} (password s@cret)");
        let text = render(&err, &secrets);
        assert!(!text.contains("cret"), "{text}");
        assert_eq!(
            url_secrets("nats://tok3n@h:4222"),
            vec!["nats://tok3n@h:4222"]
        );
        // A user name alone is not a secret (only the whole URL, if redacted).
        assert!(!url_secrets("postgres://postgres@db/app").contains(&"postgres".to_owned()));
        assert!(url_secrets("sqlite:///tmp/a@b/x.db").is_empty());
        assert!(looks_secret("sasl.password"));
        assert!(!looks_secret("compression.type"));
    }
}
