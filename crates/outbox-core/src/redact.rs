//! Connection strings fit for logs and `Debug` output.

/// `url` with every secret replaced by `***`: the password of
/// `user:password@`, a bare userinfo (`token@host`, as NATS token auth uses),
/// and query parameters whose name contains `password`, `token` or `secret`.
/// A string without `://` and `@` is returned unchanged unless it mentions a password,
/// in which case it is replaced whole (a `host=db password=x` DSN).
///
/// ```
/// use outbox_core::redact_url;
/// assert_eq!(redact_url("postgres://app:s3cret@db:5432/app"), "postgres://app:***@db:5432/app");
/// assert_eq!(redact_url("nats://s3cret-token@127.0.0.1:4222"), "nats://***@127.0.0.1:4222");
/// assert_eq!(redact_url("sqlite://outbox.db"), "sqlite://outbox.db");
/// assert_eq!(redact_url("host=db password=x"), "<redacted>");
/// ```
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        // `user:password@host` without a scheme.
        None if url.contains('@') => (String::new(), url),
        None => {
            let lower = url.to_ascii_lowercase();
            return if lower.contains("password") || lower.contains("secret") {
                "<redacted>".to_owned()
            } else {
                url.to_owned()
            };
        }
    };
    // The userinfo ends at the last '@' before the query string (a password
    // may hold '/', '@' or ':' when it was not percent-encoded).
    // An empty authority (`sqlite:///tmp/a@b.db`) has no userinfo.
    let query_start = if rest.starts_with('/') {
        0
    } else {
        rest.find('?').unwrap_or(rest.len())
    };
    let (userinfo, rest) = match rest[..query_start].rfind('@') {
        Some(i) => (Some(&rest[..i]), &rest[i + 1..]),
        None => (None, rest),
    };
    let split = rest.find(['/', '?']).unwrap_or(rest.len());
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
}
