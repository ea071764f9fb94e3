//! The command line: `run` (one run), `check` (the checker again over a
//! kept run) and `inbox-consumer` (one inbox consumer process of an
//! end-to-end run).

use crate::inbox;
use crate::producer::ProducerMode;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "outbox-chaos",
    about = "The outbox reliability suite (cargo xtask chaos)"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// One run: producer, relays, consumer, faults, checker.
    Run(Box<RunArgs>),
    /// Runs the checker again over a kept run directory.
    Check {
        /// The run's directory (holds run.json, produced.jsonl, arrivals.jsonl, faults.json).
        dir: PathBuf,
    },
    /// One inbox consumer process (what `run --inbox` starts, kills and
    /// restarts): consumes the run's destination with `outbox-inbox` and
    /// writes one `effects` row per event in the inbox's transaction.
    InboxConsumer(Box<inbox::ConsumerArgs>),
}

/// The inbox consumers' database in an end-to-end run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum InboxDb {
    /// A schema of its own in the PostgreSQL database (`--database-url`).
    Postgres,
    /// A SQLite file in the run's directory.
    Sqlite,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum StoreKind {
    Postgres,
    Sqlite,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum BrokerKind {
    Nats,
    Amqp,
    Kafka,
}

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RunArgs {
    /// The store.
    #[arg(long, value_enum)]
    pub(crate) store: StoreKind,
    /// PostgreSQL mode of the relays and of the application's enqueue
    /// handle: `log` (the default) or `queue`.
    #[arg(long, default_value = "log")]
    pub(crate) pg_mode: outbox_postgres::PgMode,
    /// The broker.
    #[arg(long, value_enum)]
    pub(crate) broker: BrokerKind,
    /// The `outbox-relay` binary [default: next to this binary].
    #[arg(long)]
    pub(crate) relay_bin: Option<PathBuf>,
    /// Output directory (logs, records, report.json).
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// Relay processes.
    #[arg(long, default_value_t = 2)]
    pub(crate) relays: usize,
    /// Offered events per second.
    #[arg(long, default_value_t = 400)]
    pub(crate) rate: u32,
    /// Production time, seconds.
    #[arg(long, default_value_t = 30)]
    pub(crate) duration_s: u64,
    /// Fault plan, e.g. `kill*2,stop,broker-outage+kill` (see faults.rs), or `none`.
    #[arg(long, default_value = "kill,stop")]
    pub(crate) faults: String,
    /// Seconds before the first fault.
    #[arg(long, default_value_t = 3)]
    pub(crate) warmup_s: u64,
    /// The relays' lease (`--lock-timeout-ms`).
    #[arg(long, default_value_t = 4000)]
    pub(crate) lease_ms: u64,
    /// The relays' `--batch-size`.
    #[arg(long, default_value_t = 20)]
    pub(crate) batch_size: u32,
    /// The relays' `--max-batch-size` (batches grow to it through a
    /// backlog; one kill may duplicate up to one such batch).
    #[arg(long, default_value_t = 200)]
    pub(crate) max_batch_size: u32,
    /// The relays' `--poll-interval-ms`.
    #[arg(long, default_value_t = 100)]
    pub(crate) poll_ms: u64,
    /// SIGSTOP length beyond the lease, ms.
    #[arg(long, default_value_t = 2000)]
    pub(crate) stop_extra_ms: u64,
    /// The least time between the end of a fault step and the start of
    /// the next, seconds (0: steps only spread evenly; a step that outlasts
    /// its slot, e.g. a RabbitMQ restart, is then followed at once).
    #[arg(long, default_value_t = 0)]
    pub(crate) recovery_room_s: u64,
    /// Broker / database outage length, seconds.
    #[arg(long, default_value_t = 5)]
    pub(crate) outage_s: u64,
    /// Flap cycles per flap fault.
    #[arg(long, default_value_t = 3)]
    pub(crate) flap_cycles: u32,
    /// Down time of one flap, ms.
    #[arg(long, default_value_t = 2000)]
    pub(crate) flap_down_ms: u64,
    /// Up time between flaps, ms.
    #[arg(long, default_value_t = 3000)]
    pub(crate) flap_up_ms: u64,
    /// Longest wait for the last events after production, seconds.
    #[arg(long, default_value_t = 60)]
    pub(crate) drain_timeout_s: u64,
    /// Producer tasks (connections).
    #[arg(long, default_value_t = 4)]
    pub(crate) tasks: usize,
    /// The producer's shape: `partitioned` (each task its own keys, numbered
    /// by the task) or `contended` (PostgreSQL: every task writes every key;
    /// each transaction writes its business row, then locks the key's
    /// aggregate row and takes the key's next sequence number from it; see
    /// producer.rs).
    #[arg(long, value_enum, default_value_t = ProducerMode::Partitioned)]
    pub(crate) producer: ProducerMode,
    /// Keys per producer task (`partitioned`), or in all (`contended`).
    #[arg(long, default_value_t = 16)]
    pub(crate) keys: usize,
    /// Most events per transaction.
    #[arg(long, default_value_t = 5)]
    pub(crate) max_per_tx: usize,
    /// One transaction in N is rolled back.
    #[arg(long, default_value_t = 20)]
    pub(crate) rollback_one_in: u32,
    /// Payload padding, bytes.
    #[arg(long, default_value_t = 64)]
    pub(crate) pad: usize,
    /// Random seed [default: random].
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// PostgreSQL URL (the application's and the admin connection).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    pub(crate) database_url: String,
    /// The relays' store and the application's pool reach PostgreSQL
    /// through PgBouncer in transaction mode (`--pgbouncer-url`): the relays
    /// find the pooler themselves (`--pg-pooler` unset: `auto`), the
    /// application enqueues with `PgOutbox::with_pooler(Pooler::Transaction)`
    /// and sends its own statements unnamed, each inside a transaction.
    /// The harness's connections (set-up, faults, checker) stay direct. A
    /// flag, not the URL alone: `PGBOUNCER_URL` set for the tests must not
    /// turn every run into a pooled one.
    #[arg(long)]
    pub(crate) pgbouncer: bool,
    /// PgBouncer's URL (with `--pgbouncer`), in front of the database of
    /// `--database-url`.
    #[arg(
        long,
        env = "PGBOUNCER_URL",
        default_value = "postgres://postgres@127.0.0.1:6432/test"
    )]
    pub(crate) pgbouncer_url: String,
    /// NATS URL (a run with `broker-restart` starts its own server
    /// instead: see nats.rs).
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub(crate) nats_url: String,
    /// RabbitMQ URL (a run with `broker-restart` starts its own node
    /// instead: see rabbit.rs).
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub(crate) amqp_url: String,
    /// Kafka bootstrap servers (a run with a broker fault starts its own
    /// broker instead: see kafka.rs).
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub(crate) kafka_brokers: String,
    /// Keep the schema / stream / queue / topic and the SQLite file (of a
    /// private NATS server or RabbitMQ node, its data directory; not the
    /// topic of a private Kafka broker, which keeps it in memory).
    #[arg(long)]
    pub(crate) keep: bool,
    /// Allow the `pg-restart` fault (restarts the machine's PostgreSQL);
    /// also allows `pg-crash`.
    #[arg(long)]
    pub(crate) allow_pg_restart: bool,
    /// Allow the `pg-crash` fault (`kill -9` of a PostgreSQL backend: the
    /// machine's cluster ends every session and runs crash recovery).
    #[arg(long)]
    pub(crate) allow_pg_crash: bool,
    /// `pg-failover`: how the run's own standby follows its primary
    /// (pg_pair.rs): `sync` (a commit waits for the standby's flush) or
    /// `async`.
    #[arg(long, value_enum, default_value_t = crate::pg_pair::Replication::Sync)]
    pub(crate) pg_replication: crate::pg_pair::Replication,
    /// `tenants`: events preloaded into database t0 before the clock starts.
    #[arg(long, default_value_t = 500_000)]
    pub(crate) tenant_backlog: u64,
    /// `tenants`: how long every connection to database t1 is terminated,
    /// again and again (every 100 ms), seconds.
    #[arg(long, default_value_t = 3)]
    pub(crate) tenant_kill_s: u64,
    /// `tenants`: the p99 commit -> arrival latency, ms, the fresh events
    /// of the databases neither backlogged nor killed must stay under.
    #[arg(long, default_value_t = 500)]
    pub(crate) tenant_p99_ms: u64,
    /// Hard bound on the whole run, seconds [default: duration + faults + drain + 120].
    #[arg(long)]
    pub(crate) timeout_s: Option<u64>,
    /// End to end through the inbox: instead of the independent recorder,
    /// inbox consumer processes (`outbox-chaos inbox-consumer`) with their
    /// database here consume the destination and write one effect per
    /// event; the checker reads the effects (a duplicate effect fails).
    #[arg(long, value_enum)]
    pub(crate) inbox: Option<InboxDb>,
    /// Inbox consumer processes sharing the work (the same consumer name:
    /// one JetStream durable consumer, competing consumers on the queue,
    /// one Kafka consumer group). One by default: RELIABILITY.md says why.
    #[arg(long, default_value_t = 1)]
    pub(crate) consumers: usize,
    /// Lanes of each inbox consumer (keys in parallel).
    #[arg(long, default_value_t = 4)]
    pub(crate) consumer_lanes: usize,
    /// NATS: the inbox's durable consumer's ack wait, ms.
    #[arg(long, default_value_t = 2000)]
    pub(crate) nats_ack_wait_ms: u64,
    /// How long a `consumer-kill` keeps the consumer down, ms [default:
    /// NATS: the ack wait + 1 s (what the dead process held is then
    /// delivered again before newer messages); others: 1,000].
    #[arg(long)]
    pub(crate) consumer_pause_ms: Option<u64>,
    /// The inbox's retention window of its dedup records, seconds (at
    /// least 6: one second per slot) [default: the inbox's 7 days]. Short,
    /// many slot boundaries pass during the run while copies arrive.
    #[arg(long)]
    pub(crate) inbox_retention_s: Option<u64>,
}
