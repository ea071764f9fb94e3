//! Which librdkafka properties hold secrets.

/// Whether a librdkafka property holds a secret and must never be printed:
/// any name containing `password`, `secret`, `jaas` or `oauthbearer.config`,
/// and private key material (`ssl.key.pem`).
pub fn is_secret_property(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [
        "password",
        "secret",
        "jaas",
        "oauthbearer.config",
        "ssl.key.pem",
    ]
    .iter()
    .any(|s| n.contains(s))
}
