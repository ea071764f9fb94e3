//! The layered configuration's unit tests: precedence, parsing, refusals.

use super::*;

fn resolved(file: &str) -> anyhow::Result<Resolved> {
    let table: toml::Table = toml::from_str(file)?;
    Ok(Resolved {
        layer: file_layer(table, Path::new("outbox.toml"))?,
        file: Some(PathBuf::from("outbox.toml")),
        store_flags: Vec::new(),
    })
}

#[test]
fn missing_store_names_the_fix() {
    let err = resolved("").unwrap().store_url().unwrap_err().to_string();
    assert!(err.contains("--store sqlite://"), "{err}");
    assert!(err.contains("OUTBOX_STORE"), "{err}");
    assert!(err.contains("outbox.toml"), "{err}");
}

#[test]
fn unknown_config_keys_are_rejected() {
    let err = resolved("stor = \"x\"").unwrap_err();
    assert!(err.to_string().contains("stor"), "{err}");
    let ok =
        resolved("store = \"sqlite://a.db\"\nbatch_size = 5\nshard = \"1/4\"\nsink = \"stdout\"")
            .unwrap();
    let cfg = run_config(&ok).unwrap();
    assert_eq!(cfg.options.batch_size(), 5);
    assert_eq!(cfg.options.shard().to_string(), "1/4");
}

#[test]
fn batches_grow_to_a_thousand_unless_told_otherwise() {
    let cfg = |file: &str| run_config(&resolved(file).unwrap());
    let d = cfg("sink = \"stdout\"").unwrap();
    assert_eq!(
        (d.options.batch_size(), d.options.max_batch_size()),
        (20, 1000)
    );
    // A batch size above the default maximum raises the maximum with it.
    let big = cfg("sink = \"stdout\"\nbatch_size = 5000").unwrap();
    assert_eq!(big.options.max_batch_size(), 5000);
    let flat = cfg("sink = \"stdout\"\nbatch_size = 50\nmax_batch_size = 50").unwrap();
    assert_eq!(flat.options.max_batch_size(), 50);
    let err = cfg("sink = \"stdout\"\nbatch_size = 50\nmax_batch_size = 10").unwrap_err();
    assert!(
        format!("{err:#}").contains("max batch size (10) must be at least the batch size (50)"),
        "{err:#}"
    );
}

#[test]
fn a_delivery_timeout_longer_than_the_lease_is_refused_at_start() {
    let cfg = |file: &str| run_config(&resolved(file).unwrap());
    // Unset: it follows the lease, whatever the lease is.
    let short = cfg("sink = \"stdout\"\nlock_timeout_ms = 10000").unwrap();
    assert_eq!(short.options.delivery_timeout(), Duration::from_secs(10));
    let ok = cfg("sink = \"stdout\"\nlock_timeout_ms = 10000\ndelivery_timeout_ms = 4000").unwrap();
    assert_eq!(ok.options.delivery_timeout(), Duration::from_secs(4));
    let err = cfg("sink = \"stdout\"\ndelivery_timeout_ms = 300000").unwrap_err();
    let message = format!("{err:#}");
    assert!(
        message.contains("delivery timeout (300s) must not be longer than the lock timeout (60s)")
            && message.contains("lower delivery_timeout or raise lock_timeout"),
        "{message}"
    );
}

#[test]
fn a_configured_relay_id_gets_a_per_process_suffix() {
    // Two `run`s with the same configured id (two processes): two lease
    // owners, one configured name for display.
    let r = resolved("sink = \"stdout\"\nrelay_id = \"relay-a\"").unwrap();
    let (first, second) = (run_config(&r).unwrap(), run_config(&r).unwrap());
    let (a, b) = (first.options.relay_id(), second.options.relay_id());
    assert_ne!(a, b);
    for id in [a, b] {
        assert!(id.as_str().starts_with("relay-a#"), "{id}");
        assert_eq!(id.as_str().len(), "relay-a#".len() + 6, "{id}");
        assert_eq!(id.configured(), "relay-a");
    }
    // Not configured: the generated default, unique already, no suffix.
    let d = run_config(&resolved("sink = \"stdout\"").unwrap()).unwrap();
    assert!(d.options.relay_id().as_str().starts_with("relay-"));
    assert!(!d.options.relay_id().as_str().contains('#'));
}

#[test]
fn wire_format_is_parsed_and_refused_for_local_sinks() {
    let cfg = |file: &str| run_config(&resolved(file).unwrap());
    let nats = "sink = \"nats://127.0.0.1:4222\"\n";
    assert_eq!(cfg(nats).unwrap().wire_format, WireFormat::Headers);
    assert_eq!(
        cfg(&format!("{nats}wire_format = \"envelope\""))
            .unwrap()
            .wire_format,
        WireFormat::Envelope
    );
    let err = cfg(&format!("{nats}wire_format = \"json\""))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`wire_format` in outbox.toml") && err.contains("\"json\""),
        "{err}"
    );
    let err = cfg("sink = \"stdout\"\nwire_format = \"envelope\"")
        .unwrap_err()
        .to_string();
    assert!(err.contains("broker sinks only"), "{err}");
    // The default format is accepted by every sink.
    assert!(cfg("sink = \"jsonl:x.jsonl\"\nwire_format = \"headers\"").is_ok());
}

#[test]
fn cloudevents_formats_need_a_valid_source() {
    let cfg = |file: &str| run_config(&resolved(file).unwrap());
    let nats = "sink = \"nats://127.0.0.1:4222\"\n";
    for format in ["cloudevents", "cloudevents-json"] {
        let err = cfg(&format!("{nats}wire_format = \"{format}\""))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`wire_format` in outbox.toml")
                && err.contains("--cloudevents-source")
                && err.contains("URI-reference"),
            "{err}"
        );
        let ok = cfg(&format!(
            "{nats}wire_format = \"{format}\"\ncloudevents_source = \"/orders\""
        ))
        .unwrap();
        assert_eq!(ok.wire_format.as_str(), format);
        assert_eq!(ok.cloudevents_source.unwrap().as_str(), "/orders");
        let err = cfg(&format!(
            "{nats}wire_format = \"{format}\"\ncloudevents_source = \"not a uri\""
        ))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("`cloudevents_source` in outbox.toml") && err.contains("character"),
            "{err}"
        );
        let err = cfg(&format!(
            "sink = \"stdout\"\nwire_format = \"{format}\"\ncloudevents_source = \"/o\""
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("broker sinks only"), "{err}");
    }
}

#[test]
fn bad_values_name_their_source() {
    let r = resolved("sink = \"stdout\"\nbatch_size = \"lots\"").unwrap();
    let err = run_config(&r).unwrap_err().to_string();
    assert!(err.contains("`batch_size` in outbox.toml"), "{err}");
}

#[cfg(feature = "postgres")]
#[test]
fn group_names_and_starts_are_checked_naming_their_source() {
    let r = resolved("group = \"a b\"").unwrap();
    let err = r.scope().unwrap_err().to_string();
    assert!(err.contains("`group` in outbox.toml"), "{err}");
    assert!(err.contains("' ' at position 1"), "{err}");
    let r = resolved("start_from = \"yesterday\"").unwrap();
    let err = r.scope().unwrap_err().to_string();
    assert!(
        err.contains("`start_from`") && err.contains("`now`"),
        "{err}"
    );
    let r = resolved("group = \"exports\"\nstart_from = \"now\"").unwrap();
    let scope = r.scope().unwrap();
    assert_eq!(scope.named(), Some("exports"));
    assert!(scope.start_now);
    assert_eq!(
        resolved("group = \"default\"")
            .unwrap()
            .scope()
            .unwrap()
            .named(),
        None
    );
}

#[test]
fn relay_defaults_are_the_library_defaults() {
    let d = RelayOptions::default();
    let default = |name: &str| {
        RELAY
            .iter()
            .find(|s| s.name() == name)
            .and_then(|s| s.default())
            .unwrap_or_else(|| panic!("{name} has no default"))
            .to_owned()
    };
    let ms = |dur: Duration| dur.as_millis().to_string();
    assert_eq!(default("batch_size"), d.batch_size().to_string());
    assert_eq!(default("poll_interval_ms"), ms(d.poll_interval()));
    assert_eq!(default("lock_timeout_ms"), ms(d.lock_timeout()));
    assert_eq!(default("retry_base_ms"), ms(d.retry().base()));
    assert_eq!(default("retry_cap_ms"), ms(d.retry().cap()));
    assert_eq!(
        default("max_attempts"),
        d.retry().max_attempts().to_string()
    );
    assert_eq!(default("shard"), d.shard().to_string());
    assert_eq!(
        default("lag_alert_secs"),
        d.lag_alert().as_secs().to_string()
    );
    assert_eq!(default("drain"), d.drain().to_string());
    assert_eq!(default("shutdown_grace_ms"), ms(d.shutdown_grace()));
    // It follows the lease.
    assert_eq!(default("delivery_timeout_ms"), "lock_timeout_ms");
    assert_eq!(d.delivery_timeout(), d.lock_timeout());
}
