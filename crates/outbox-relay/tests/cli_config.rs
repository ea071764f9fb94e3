//! The command line users run today keeps working, and errors read well:
//! every flag, environment variable and `outbox.toml` key of the README is
//! accepted; a failed connection prints each cause once, root cause last,
//! without the password; the README's table is generated and checked.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::{Command, Output};

fn relay(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    cmd.args(args).env("RUST_LOG", "warn");
    for (var, _) in std::env::vars().filter(|(v, _)| v.starts_with("OUTBOX_")) {
        cmd.env_remove(var);
    }
    cmd
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// No `: `-separated part of an error line is printed twice.
fn assert_each_cause_once(line: &str) {
    let parts: Vec<&str> = line.split(": ").map(str::trim).collect();
    for (i, p) in parts.iter().enumerate() {
        assert!(
            !parts[i + 1..].contains(p),
            "cause {p:?} printed twice in {line:?}"
        );
    }
}

#[test]
fn missing_sqlite_directory_is_named_once() {
    let out = relay(&["status", "--store", "sqlite:///nonexistent-dir/x.db"])
        .current_dir(tempfile::tempdir().unwrap().path())
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success());
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one error line: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(err.contains("/nonexistent-dir"), "{err}");
    assert!(
        err.matches("unable to open database file").count() <= 1,
        "{err}"
    );
    assert!(err.matches("does not exist").count() <= 1, "{err}");
    assert_each_cause_once(lines[0]);
}

#[cfg(feature = "postgres")]
#[test]
fn refused_postgres_connection_names_the_root_cause_without_the_password() {
    // Nothing listens on 5999.
    let out = relay(&[
        "status",
        "--store",
        "postgres://app:secret@127.0.0.1:5999/test",
    ])
    .output()
    .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success());
    assert_eq!(
        err.to_ascii_lowercase()
            .matches("connection refused")
            .count(),
        1,
        "{err}"
    );
    assert!(!err.contains("secret"), "{err}");
    assert!(err.contains("cannot connect to the store"), "{err}");
    assert_each_cause_once(err.trim());
}

#[test]
fn unknown_and_uncompiled_backends_name_the_fix() {
    let out = relay(&["status", "--store", "mysql://u:pw0rd@h/db"])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success());
    assert!(err.contains("unknown store URL scheme \"mysql\""), "{err}");
    assert!(!err.contains("pw0rd"), "{err}");

    let out = relay(&["status", "--store", "outbox.db"]).output().unwrap();
    assert!(stderr(&out).contains("has no scheme"), "{}", stderr(&out));

    #[cfg(not(feature = "postgres"))]
    {
        let out = relay(&["status", "--store", "postgres://db/app"])
            .output()
            .unwrap();
        assert!(
            stderr(&out).contains("--features postgres"),
            "{}",
            stderr(&out)
        );
    }
}

/// Every flag and variable of the README's table before the settings were
/// derived from the descriptors (issue 9): the names users have in scripts.
const COMPATIBLE: &[(&str, Option<&str>)] = &[
    ("--store", Some("OUTBOX_STORE")),
    ("--config", Some("OUTBOX_CONFIG")),
    ("--sink", Some("OUTBOX_SINK")),
    ("--batch-size", Some("OUTBOX_BATCH_SIZE")),
    ("--poll-interval-ms", Some("OUTBOX_POLL_INTERVAL_MS")),
    ("--lock-timeout-ms", Some("OUTBOX_LOCK_TIMEOUT_MS")),
    ("--retry-base-ms", Some("OUTBOX_RETRY_BASE_MS")),
    ("--retry-cap-ms", Some("OUTBOX_RETRY_CAP_MS")),
    ("--max-attempts", Some("OUTBOX_MAX_ATTEMPTS")),
    ("--shard", Some("OUTBOX_SHARD")),
    ("--lag-alert-secs", Some("OUTBOX_LAG_ALERT_SECS")),
    ("--relay-id", Some("OUTBOX_RELAY_ID")),
    ("--drain", Some("OUTBOX_DRAIN")),
    ("--shutdown-grace-ms", Some("OUTBOX_SHUTDOWN_GRACE_MS")),
    ("--migrate", Some("OUTBOX_MIGRATE")),
    ("--metrics-addr", Some("OUTBOX_METRICS_ADDR")),
    #[cfg(feature = "postgres")]
    ("--pg-schema", Some("OUTBOX_PG_SCHEMA")),
    #[cfg(feature = "postgres")]
    ("--pg-table", Some("OUTBOX_PG_TABLE")),
    #[cfg(feature = "nats")]
    ("--nats-subject-prefix", Some("OUTBOX_NATS_SUBJECT_PREFIX")),
    #[cfg(feature = "amqp")]
    ("--amqp-exchange", Some("OUTBOX_AMQP_EXCHANGE")),
    #[cfg(feature = "kafka")]
    ("--kafka-topic-prefix", Some("OUTBOX_KAFKA_TOPIC_PREFIX")),
    #[cfg(feature = "kafka")]
    ("--kafka-property", None),
];

#[test]
fn every_documented_flag_and_variable_is_still_there() {
    let out = relay(&["run", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for (flag, env) in COMPATIBLE {
        assert!(
            help.contains(&format!("{flag} <")) || help.contains(&format!("{flag} [<")),
            "{flag} missing from run --help:\n{help}"
        );
        if let Some(env) = env {
            assert!(
                help.contains(&format!("env: {env}")),
                "{env} missing:\n{help}"
            );
        }
    }
}

#[test]
fn a_config_file_with_every_documented_key_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("outbox.db");
    let config = dir.path().join("outbox.toml");
    std::fs::write(
        &config,
        format!(
            r#"store = "sqlite://{}"
sink = "stdout"
batch_size = 50
poll_interval_ms = 100
lock_timeout_ms = 30000
retry_base_ms = 500
retry_cap_ms = 60000
max_attempts = 5
shard = "0/1"
lag_alert_secs = 60
relay_id = "relay-a"
drain = true
shutdown_grace_ms = 1000
migrate = true
metrics_addr = "127.0.0.1:9464"
pg_schema = "outbox"
pg_table = "events"
nats_subject_prefix = "app"
amqp_exchange = "orders"
kafka_topic_prefix = "app."

[kafka_properties]
"compression.type" = "lz4"
"#,
            db.display()
        ),
    )
    .unwrap();
    let cfg = config.to_str().unwrap();
    let out = relay(&["migrate", "--config", cfg]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    // Variables override the file, flags override variables.
    let flag = format!("sqlite://{}", db.display());
    let out = relay(&["status", "--config", cfg, "--store", &flag])
        .env("OUTBOX_STORE", "nope://")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let status = String::from_utf8_lossy(&out.stdout);
    assert!(status.contains("pending:"), "{status}");
    // The sink state lives in a running relay: status says how to ask it.
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("sink:") && l.contains("--relay ADDR")),
        "{status}"
    );
    let out = relay(&["status", "--config", cfg])
        .env("OUTBOX_STORE", "nope://x")
        .output()
        .unwrap();
    assert!(stderr(&out).contains("\"nope\""), "{}", stderr(&out));

    // A misspelt key is refused, naming it.
    std::fs::write(&config, "stor = \"sqlite://x.db\"\n").unwrap();
    let out = relay(&["status", "--config", cfg]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("unknown key `stor`"),
        "{}",
        stderr(&out)
    );

    // A bad value names where it came from.
    let out = relay(&["run", "--store", "sqlite::memory:", "--sink", "stdout"])
        .env("OUTBOX_SHARD", "4/2")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("OUTBOX_SHARD"), "{}", stderr(&out));
}

#[cfg(all(
    feature = "sqlite",
    feature = "postgres",
    feature = "nats",
    feature = "amqp",
    feature = "kafka"
))]
#[test]
fn config_table_check_fails_on_a_stale_table_and_write_fixes_it() {
    let dir = tempfile::tempdir().unwrap();
    let readme = dir.path().join("README.md");
    std::fs::write(
        &readme,
        "# x\n<!-- config-table:start -->\n| old |\n<!-- config-table:end -->\nafter\n",
    )
    .unwrap();
    let path = readme.to_str().unwrap();
    let out = relay(&["config-table", "--check", path]).output().unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("stale"), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("config-table --write"),
        "{}",
        stderr(&out)
    );

    let out = relay(&["config-table", "--write", path]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(&readme).unwrap();
    assert!(text.contains("| `--pg-schema SCHEMA` | `OUTBOX_PG_SCHEMA` | `pg_schema` |"));
    assert!(text.ends_with("<!-- config-table:end -->\nafter\n"));
    let out = relay(&["config-table", "--check", path]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
}
