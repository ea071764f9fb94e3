//! Metric names the inbox records through the `metrics` facade (the
//! application installs the exporter). Every series carries the label
//! `consumer`.

/// Messages whose handler ran and committed (counter).
pub const HANDLED: &str = "outbox_inbox_handled_total";
/// Messages recognised as handled before (redeliveries, relay duplicates)
/// and only acknowledged (counter).
pub const DUPLICATES: &str = "outbox_inbox_duplicates_total";
/// Messages stored behind an earlier held-back message of their key (counter).
pub const PARKED: &str = "outbox_inbox_parked_total";
/// Failed handler attempts that will be retried (counter).
pub const RETRIES: &str = "outbox_inbox_retries_total";
/// Messages moved to the dead letters, by `code` (counter).
pub const DEAD: &str = "outbox_inbox_dead_total";
/// Failures of the inbox's own database or of the broker source, by `what`
/// (`store`, `source`): retried, never an attempt (counter).
pub const FAULTS: &str = "outbox_inbox_faults_total";
/// Age of the last handled message: now minus its creation time, seconds
/// (gauge; the end-to-end lag from the producer's commit).
pub const LAG_SECONDS: &str = "outbox_inbox_lag_seconds";
/// Messages behind the last received one at the broker, where the broker
/// tells (gauge).
pub const BEHIND: &str = "outbox_inbox_behind_messages";
/// Duration of one lane transaction (histogram, seconds).
pub const BATCH_SECONDS: &str = "outbox_inbox_batch_seconds";
/// Messages applied after a later message of their key had been applied,
/// by the broker's order (JetStream stream sequence, Kafka offset within
/// one partition), as seen by this process (counter). Competing consumers
/// of one NATS durable or RabbitMQ queue can apply a key's messages out of
/// order across processes; RabbitMQ gives no position, so nothing is
/// counted there. Each one is also logged (warn).
pub const OUT_OF_ORDER: &str = "outbox_inbox_out_of_order_total";
