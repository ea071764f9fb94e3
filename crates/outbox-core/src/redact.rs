//! Connection strings fit for logs and `Debug` output.

/// `url` with every secret replaced by `***`: the password of
/// `user:password@`, a bare userinfo (`token@host`, as NATS token auth uses),
/// and query parameters whose name contains `password`, `token` or `secret`.
/// A string without `://` and `@` is returned unchanged unless it mentions a password,
/// in which case it is replaced whole (a `host=db password=x` DSN).
/// A password that holds `@`, `?`, `#`, `/` or `:` without percent-encoding
/// is hidden whole too, and a comma-separated list of URLs
/// (`nats://a:p@h1,nats://b:q@h2`) is redacted URL by URL.
///
/// ```
/// use outbox_core::redact_url;
/// assert_eq!(redact_url("postgres://app:s3cret@db:5432/app"), "postgres://app:***@db:5432/app");
/// assert_eq!(redact_url("nats://s3cret-token@127.0.0.1:4222"), "nats://***@127.0.0.1:4222");
/// assert_eq!(redact_url("sqlite://outbox.db"), "sqlite://outbox.db");
/// assert_eq!(redact_url("host=db password=x"), "<redacted>");
/// ```
pub fn redact_url(url: &str) -> String {
    if !url.contains("://") && !url.contains('@') {
        let lower = url.to_ascii_lowercase();
        return if lower.contains("password") || lower.contains("secret") {
            "<redacted>".to_owned()
        } else {
            url.to_owned()
        };
    }
    split_url_list(url)
        .into_iter()
        .map(redact_one)
        .collect::<Vec<_>>()
        .join(",")
}

/// Splits a comma-separated list of URLs (`nats://a@h1,nats://b@h2`) at each
/// comma that starts another `scheme://`; a comma anywhere else (inside a
/// password, or a `host1,host2` list) stays in its part.
fn split_url_list(url: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut start = 0;
    for (i, _) in url.match_indices(',') {
        let next = &url[i + 1..];
        let scheme_len = next
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
            .unwrap_or(next.len());
        if scheme_len > 0 && next[scheme_len..].starts_with("://") && i >= start {
            parts.push(&url[start..i]);
            start = i + 1;
        }
    }
    parts.push(&url[start..]);
    parts
}

fn redact_one(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        // `user:password@host` without a scheme.
        None => (String::new(), url),
    };
    // The userinfo ends at the last '@': a password that was not
    // percent-encoded may hold '@', ':', '/', '?' or '#', so no delimiter
    // before the last '@' can be trusted to end it. (A URL with an '@' only
    // in its query, and no credentials, is over-redacted: hiding too much
    // beats printing a password.) An empty authority (`sqlite:///tmp/a@b.db`)
    // has no userinfo.
    let userinfo_end = if rest.starts_with('/') {
        None
    } else {
        rest.rfind('@')
    };
    let (userinfo, rest) = match userinfo_end {
        Some(i) => (Some(&rest[..i]), &rest[i + 1..]),
        None => (None, rest),
    };
    let split = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (host, tail) = rest.split_at(split);
    let authority = match userinfo {
        Some(userinfo) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{user}:***@{host}"),
            None => format!("***@{host}"),
        },
        None => host.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if is_secret_name(k) => format!("{k}=***"),
                    _ => pair.to_owned(),
                })
                .collect::<Vec<_>>()
                .join("&");
            format!("{path}?{query}")
        }
        None => tail.to_owned(),
    };
    format!("{scheme}{authority}{tail}")
}

fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.contains("password") || n.contains("token") || n.contains("secret")
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn secrets_never_survive() {
        assert_eq!(
            redact_url("postgres://app:s3cr%40t@db:5432/prod?sslmode=require&password=x2"),
            "postgres://app:***@db:5432/prod?sslmode=require&password=***"
        );
        assert_eq!(redact_url("postgres://u:p@ss@h/d"), "postgres://u:***@h/d");
        assert_eq!(redact_url("postgres://u:a/b@h/d"), "postgres://u:***@h/d");
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(
            redact_url("nats://tok@h:4222,nats://h2:4222"),
            "nats://***@h:4222,nats://h2:4222"
        );
        assert_eq!(
            redact_url("kafka://127.0.0.1:9092"),
            "kafka://127.0.0.1:9092"
        );
        assert_eq!(redact_url("stdout"), "stdout");
        assert_eq!(redact_url("sqlite:///tmp/a@b.db"), "sqlite:///tmp/a@b.db");
        assert_eq!(
            redact_url("postgres://token@db/x?sslmode=require"),
            "postgres://***@db/x?sslmode=require"
        );
        assert_eq!(redact_url("u:p@h"), "u:***@h");
        assert_eq!(redact_url("host=db password=x"), "<redacted>");
    }

    #[test]
    fn passwords_with_url_delimiters_are_hidden() {
        let cases = [
            ("postgres://u:pa?ss@h/db?x=1", "postgres://u:***@h/db?x=1"),
            ("postgres://u:pa#ss@h/db", "postgres://u:***@h/db"),
            ("postgres://u:p@ss@h/db", "postgres://u:***@h/db"),
            ("postgres://u:?@h:5432", "postgres://u:***@h:5432"),
            ("postgres://u:#@h", "postgres://u:***@h"),
            (
                "postgres://u:a?b#c@d/e@h:5432/db?sslmode=require",
                "postgres://u:***@h:5432/db?sslmode=require",
            ),
            (
                "amqp://guest:a?b@c#d@127.0.0.1:5672/%2f",
                "amqp://guest:***@127.0.0.1:5672/%2f",
            ),
            ("redis://:pw?#@h", "redis://:***@h"),
            ("nats://to?ken@h:4222", "nats://***@h:4222"),
            ("nats://to#ken@h", "nats://***@h"),
            ("u:p?x#y@h", "u:***@h"),
            (
                "nats://a:p?1@h1:4222,nats://b:p#2@h2:4222",
                "nats://a:***@h1:4222,nats://b:***@h2:4222",
            ),
            (
                "nats://a:p,1@h1:4222,tls://b:p2@h2",
                "nats://a:***@h1:4222,tls://b:***@h2",
            ),
        ];
        for (url, want) in cases {
            let got = redact_url(url);
            assert_eq!(got, want, "{url}");
            for secret in [
                "pa?ss", "pa#ss", "p@ss", "a?b", "pw?#", "to?ken", "to#ken", "p?1", "p#2", "p,1",
            ] {
                if url.contains(secret) {
                    assert!(!got.contains(secret), "{url} -> {got}");
                }
            }
        }
        // An '@' only in the query is taken for the end of a userinfo.
        assert_eq!(redact_url("postgres://h/db?user=a@b"), "postgres://***@b");
        // Nothing secret: unchanged.
        assert_eq!(
            redact_url("postgres://h/db?x=1#frag"),
            "postgres://h/db?x=1#frag"
        );
        assert_eq!(
            redact_url("nats://h1:4222,nats://h2:4222"),
            "nats://h1:4222,nats://h2:4222"
        );
    }
}
