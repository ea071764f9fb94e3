//! The suite's definition: which runs each mode makes and with which
//! parameters, and the fingerprint of a run list.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Quick,
    Medium,
    Full,
}

impl Mode {
    /// The mode's name, as on the command line without `--`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Quick => "quick",
            Self::Medium => "medium",
            Self::Full => "full",
        }
    }

    /// The mode named `name` (`quick`, `medium`, `full`).
    pub(crate) fn from_name(name: &str) -> Option<Self> {
        [Self::Quick, Self::Medium, Self::Full]
            .into_iter()
            .find(|m| m.name() == name)
    }
}

/// One `outbox-chaos run`.
#[derive(Debug, Clone)]
pub(crate) struct Scenario {
    pub(super) store: &'static str,
    pub(super) broker: &'static str,
    pub(super) faults: String,
    pub(super) duration_s: u64,
    pub(super) rate: u32,
    pub(super) relays: u32,
    pub(super) lease_ms: u64,
    pub(super) outage_s: u64,
    pub(super) flap_cycles: u32,
    pub(super) flap_down_ms: u64,
    pub(super) flap_up_ms: u64,
    pub(super) stop_extra_ms: u64,
    /// Least seconds between a fault step's end and the next step.
    pub(super) recovery_room_s: u64,
    pub(super) allow_pg_restart: bool,
    /// Whether the plan crashes PostgreSQL (`pg-crash`).
    pub(super) allow_pg_crash: bool,
    /// The producer's shape: `partitioned` or `contended` (see outbox-chaos's
    /// producer.rs).
    pub(super) producer: &'static str,
    /// The relays' `--max-batch-size`.
    pub(super) max_batch: u32,
    /// End to end through the inbox (`--inbox`): the consumers' database,
    /// `postgres` or `sqlite`; `None`: the independent recorder.
    pub(super) inbox: Option<&'static str>,
    /// Inbox consumer processes (`--consumers`; 1: the argument is left
    /// out).
    pub(super) consumers: u32,
    /// The inbox's retention window, seconds (`--inbox-retention-s`;
    /// `None`: the default, left out).
    pub(super) inbox_retention_s: Option<u64>,
    /// The relays and the producer reach PostgreSQL through PgBouncer in
    /// transaction mode (`--pgbouncer`; `cargo xtask services` starts it).
    pub(super) pgbouncer: bool,
    /// `pg-failover`: the run's own standby's replication, `sync` or
    /// `async` (`--pg-replication`); `None`: left out.
    pub(super) replication: Option<&'static str>,
}

/// The steps of a plan, `none` and empty ones left out.
fn plan_steps(faults: &str) -> impl Iterator<Item = &str> {
    faults
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty() && *s != "none")
}

impl Scenario {
    /// The run's name:
    /// `<pg|sq>-<broker>[-pgbouncer][-contended][-inbox-<pg|sq>]-<faults>`.
    pub(crate) fn label(&self) -> String {
        let store = if self.store == "postgres" { "pg" } else { "sq" };
        let faults: String = self
            .faults
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let producer = if self.producer == "contended" {
            "-contended"
        } else {
            ""
        };
        let mut inbox = match self.inbox {
            Some("postgres") => "-inbox-pg",
            Some(_) => "-inbox-sq",
            None => "",
        }
        .to_owned();
        if self.consumers > 1 {
            inbox.push_str(&format!("-x{}", self.consumers));
        }
        if let Some(s) = self.inbox_retention_s {
            inbox.push_str(&format!("-window{s}s"));
        }
        let pooler = if self.pgbouncer { "-pgbouncer" } else { "" };
        let replication = self.replication.map_or(String::new(), |r| format!("-{r}"));
        format!(
            "{store}-{}{pooler}{producer}{inbox}-{faults}{replication}",
            self.broker
        )
    }

    /// The run's parameters as `outbox-chaos run` arguments: everything
    /// but the paths and `--keep`. The suite's fingerprint covers these.
    pub(crate) fn args(&self) -> Vec<String> {
        let mut args: Vec<String> = [
            ("--store", self.store.to_owned()),
            ("--broker", self.broker.to_owned()),
            ("--faults", self.faults.clone()),
            ("--duration-s", self.duration_s.to_string()),
            ("--rate", self.rate.to_string()),
            ("--relays", self.relays.to_string()),
            ("--lease-ms", self.lease_ms.to_string()),
            ("--outage-s", self.outage_s.to_string()),
            ("--flap-cycles", self.flap_cycles.to_string()),
            ("--flap-down-ms", self.flap_down_ms.to_string()),
            ("--flap-up-ms", self.flap_up_ms.to_string()),
            ("--stop-extra-ms", self.stop_extra_ms.to_string()),
            ("--recovery-room-s", self.recovery_room_s.to_string()),
            ("--max-batch-size", self.max_batch.to_string()),
            ("--producer", self.producer.to_owned()),
        ]
        .into_iter()
        .flat_map(|(flag, value)| [flag.to_owned(), value])
        .collect();
        if self.allow_pg_restart {
            args.push("--allow-pg-restart".to_owned());
        }
        if self.allow_pg_crash {
            args.push("--allow-pg-crash".to_owned());
        }
        if let Some(db) = self.inbox {
            args.extend(["--inbox".to_owned(), db.to_owned()]);
        }
        if self.consumers > 1 {
            args.extend(["--consumers".to_owned(), self.consumers.to_string()]);
        }
        if let Some(s) = self.inbox_retention_s {
            args.extend(["--inbox-retention-s".to_owned(), s.to_string()]);
        }
        if self.pgbouncer {
            args.push("--pgbouncer".to_owned());
        }
        if let Some(r) = self.replication {
            args.extend(["--pg-replication".to_owned(), r.to_owned()]);
        }
        args
    }

    /// Seconds the faults take when run back to back (upper bound).
    pub(super) fn fault_time_s(&self) -> u64 {
        let mut total = 0;
        for step in plan_steps(&self.faults) {
            let (step, times) = step
                .rsplit_once('*')
                .map_or((step, 1), |(s, n)| (s, n.parse().unwrap_or(1)));
            let longest = step
                .split('+')
                .map(|k| match k.trim() {
                    "stop" => (self.lease_ms + self.stop_extra_ms) / 1000 + 1,
                    "broker-outage" | "db-outage" => self.outage_s,
                    // The slow sink set half a second before the cut.
                    "db-cut-one" => self.outage_s + 1,
                    "broker-flap" | "db-flap" => {
                        (u64::from(self.flap_cycles) * (self.flap_down_ms + self.flap_up_ms)) / 1000
                    }
                    "pg-restart" => 10,
                    // Crash recovery: 1-5 s here.
                    "pg-crash" => 8,
                    // A RabbitMQ node takes 5-10 s to stop and boot again.
                    "broker-restart" if self.broker == "amqp" => 12,
                    "broker-restart" => 2,
                    // Down for NATS's ack wait + 1 s (2 s + 1 s), else 1 s.
                    "consumer-kill" if self.broker == "nats" => 3,
                    // The rotator 2 s before, the reader's 12 s, 3 s after
                    // (outbox-chaos's faults.rs, `partition_reader`).
                    "partition-reader" => 17,
                    // Kills one second apart for the outage time.
                    "consumer-kills" => self.outage_s,
                    // A new stream leader (1-5 s), the killed node down 2 s
                    // more, its start.
                    "nats-leader-kill" => 8,
                    // The primary stopped, the standby promoted 2 s later.
                    "pg-failover" => 4,
                    _ => 1,
                })
                .max()
                .unwrap_or(0);
            total += longest * times;
        }
        total
    }

    /// Steps of the plan (`a+b` is one step, `a*3` three).
    pub(super) fn step_count(&self) -> u64 {
        plan_steps(&self.faults)
            .map(|step| {
                step.rsplit_once('*')
                    .map_or(1, |(_, n)| n.parse().unwrap_or(1))
            })
            .sum()
    }

    /// Faults the plan injects (`a+b` counts two, `a*3` three).
    pub(super) fn fault_count(&self) -> u64 {
        plan_steps(&self.faults)
            .map(|step| {
                let (step, times) = step
                    .rsplit_once('*')
                    .map_or((step, 1), |(s, n)| (s, n.parse().unwrap_or(1)));
                step.split('+').count() as u64 * times
            })
            .sum()
    }
}

/// The fault kinds of `kinds` that apply to a store: no database faults for
/// SQLite (a file). Every broker takes the broker faults (for Kafka the run
/// starts a private broker behind its proxy; a restart needs the run's own
/// broker with its data on disk: NATS and RabbitMQ).
fn faults_for(store: &str, broker: &str, kinds: &[&str]) -> Vec<String> {
    kinds
        .iter()
        .filter(|k| {
            // A broker restart runs on the run's own broker, a private
            // nats-server or RabbitMQ node (the private Kafka broker keeps
            // its log in memory: see outbox-chaos's kafka.rs).
            let db_fault = k.starts_with("db-") || k.starts_with("pg-");
            let restart_unsupported = **k == "broker-restart" && broker == "kafka";
            !(db_fault && store == "sqlite" || restart_unsupported)
        })
        .map(|k| (*k).to_owned())
        .collect()
}

/// The fault kinds every plan injects one by one (before its database
/// faults), in this order.
const SINGLE_FAULTS: &[&str] = &[
    "kill",
    "stop",
    "pg-terminate",
    "broker-outage",
    "broker-flap",
    "broker-restart",
];

/// Seconds added to a quick run per step, for the step's recovery.
const QUICK_RECOVERY_ROOM_S: u64 = 5;

/// The runs of a mode: which store x broker pairs, which faults, and the
/// parameters of each `outbox-chaos run`. `kafka`: the Kafka broker answers;
/// `pg_crash`: include the runs that crash PostgreSQL.
pub(crate) fn plan(
    mode: Mode,
    kafka: bool,
    allow_pg_restart: bool,
    pg_crash: bool,
) -> Vec<Scenario> {
    let base = |store: &'static str, broker: &'static str| Scenario {
        store,
        broker,
        faults: String::new(),
        duration_s: 30,
        rate: 400,
        relays: 2,
        lease_ms: 3000,
        outage_s: 4,
        flap_cycles: 2,
        flap_down_ms: 1000,
        flap_up_ms: 2000,
        stop_extra_ms: 1500,
        recovery_room_s: 0,
        allow_pg_restart: false,
        allow_pg_crash: false,
        producer: "partitioned",
        max_batch: match mode {
            Mode::Quick => 200,
            Mode::Medium => 500,
            Mode::Full => 1000,
        },
        inbox: None,
        consumers: 1,
        inbox_retention_s: None,
        pgbouncer: false,
        replication: None,
    };
    let mut out = Vec::new();
    match mode {
        Mode::Quick => {
            let mut pairs = vec![
                ("postgres", "nats"),
                ("postgres", "amqp"),
                ("sqlite", "nats"),
            ];
            if kafka {
                pairs.push(("postgres", "kafka"));
            }
            for (store, broker) in pairs {
                let kinds = faults_for(store, broker, &[SINGLE_FAULTS, &["db-flap"]].concat());
                let mut s = base(store, broker);
                // Every applicable fault once, then a kill during a flap.
                s.faults = format!("{},kill+broker-flap", kinds.join(","));
                // Room after each step for its recovery (the targets are at
                // most 5 s), so that the next fault does not start inside it.
                s.duration_s = 10 + s.fault_time_s() + QUICK_RECOVERY_ROOM_S * s.step_count();
                // And a step that outlasts its slot still leaves it.
                s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
                out.push(s);
            }
            // Per-key order with every task writing every key, through
            // relay kills; then the cluster's crash recovery. About 40 s
            // each, with the run's set-up.
            let mut s = base("postgres", "nats");
            s.producer = "contended";
            s.faults = "kill*2".to_owned();
            s.duration_s = 12 + s.fault_time_s() + QUICK_RECOVERY_ROOM_S * s.step_count();
            s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
            out.push(s);
            // The producer and the relays through PgBouncer in transaction
            // mode (issue 43), through relay kills: the relays' store finds
            // the pooler (unnamed statements, one transaction each), the
            // application enqueues unnamed too. The same shape as the
            // contended run, about 40 s with the set-up.
            let mut s = base("postgres", "nats");
            s.pgbouncer = true;
            s.faults = "kill*2".to_owned();
            s.duration_s = 12 + s.fault_time_s() + QUICK_RECOVERY_ROOM_S * s.step_count();
            s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
            out.push(s);
            // One relay cut from PostgreSQL (not from the broker) past its
            // lease while its sink is slow (issue 42 point 4): the others
            // take its shards over; it must stop by its own clock.
            let mut s = base("postgres", "nats");
            s.faults = "db-cut-one*2".to_owned();
            s.duration_s = 10 + s.fault_time_s() + QUICK_RECOVERY_ROOM_S * s.step_count();
            s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
            out.push(s);
            // The stream's leader killed in the run's own three-node
            // JetStream cluster (an R3 stream), twice (issue 46): the
            // relays and the consumer follow the new leader.
            let mut s = base("postgres", "nats");
            s.faults = "nats-leader-kill*2".to_owned();
            s.duration_s = 10 + s.fault_time_s() + QUICK_RECOVERY_ROOM_S * s.step_count();
            s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
            out.push(s);
            // The run's own primary stopped and its streaming standby
            // promoted under load (issue 46), synchronous then
            // asynchronous: the relays and the producer follow through
            // their multi-host URL.
            for replication in ["sync", "async"] {
                let mut s = base("postgres", "nats");
                s.faults = "pg-failover".to_owned();
                s.replication = Some(replication);
                s.duration_s = 10 + s.fault_time_s() + 2 * QUICK_RECOVERY_ROOM_S;
                s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
                out.push(s);
            }
            if pg_crash {
                let mut s = base("postgres", "nats");
                s.faults = "pg-crash".to_owned();
                s.allow_pg_crash = true;
                // The target is lease + 5 s after the database is back.
                s.duration_s = 10 + s.fault_time_s() + 2 * QUICK_RECOVERY_ROOM_S;
                s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
                out.push(s);
            }
        }
        Mode::Medium | Mode::Full => {
            let full = mode == Mode::Full;
            let mut pairs = vec![
                ("postgres", "nats"),
                ("postgres", "amqp"),
                ("sqlite", "nats"),
                ("sqlite", "amqp"),
            ];
            if kafka {
                pairs.extend([("postgres", "kafka"), ("sqlite", "kafka")]);
            }
            let mut kinds = [SINGLE_FAULTS, &["db-outage", "db-flap"]].concat();
            if allow_pg_restart {
                kinds.push("pg-restart");
            }
            for (store, broker) in pairs {
                let applicable = faults_for(store, broker, &kinds);
                for kind in &applicable {
                    let mut s = base(store, broker);
                    s.relays = 3;
                    s.lease_ms = 5000;
                    s.stop_extra_ms = 2000;
                    s.allow_pg_restart = kind == "pg-restart";
                    let times = match (kind.as_str(), full) {
                        ("broker-outage" | "db-outage", _) => 1,
                        ("pg-restart", _) => 2,
                        _ => 3,
                    };
                    if full {
                        // The outage and flap: 60 s, and 2 s every
                        // 5 s, at 2,000 events/s for the broker faults.
                        s.outage_s = 60;
                        s.flap_cycles = 6;
                        s.flap_down_ms = 2000;
                        s.flap_up_ms = 3000;
                        s.rate = if kind.starts_with("broker-") {
                            2000
                        } else {
                            1000
                        };
                    } else {
                        s.outage_s = 15;
                        s.flap_cycles = 4;
                        s.flap_down_ms = 2000;
                        s.flap_up_ms = 3000;
                        s.rate = 500;
                    }
                    s.faults = format!("{kind}*{times}");
                    s.duration_s = 10 + s.fault_time_s() + 4 * times;
                    out.push(s);
                }
                // Mixed: faults at the same time, and one after the other.
                let mut s = base(store, broker);
                s.relays = if full { 4 } else { 3 };
                s.lease_ms = 5000;
                s.rate = if full { 1000 } else { 500 };
                let pairs_of: Vec<String> = applicable
                    .iter()
                    .filter(|k| *k != "kill" && *k != "pg-restart")
                    .map(|k| format!("kill+{k}"))
                    .collect();
                let reps = if full { 2 } else { 1 };
                // (`a,b*3` would repeat only b: spell the repetition out.)
                s.faults = std::iter::repeat_n(pairs_of.join(","), reps)
                    .collect::<Vec<_>>()
                    .join(",");
                s.duration_s = 10 + s.fault_time_s() + 3 * s.fault_count();
                s.allow_pg_restart = allow_pg_restart && full;
                out.push(s);
            }
            // PostgreSQL with each broker: the contended producer alone and
            // with relay kills; pg-crash alone and with the contended
            // producer.
            let brokers: &[&'static str] = if kafka {
                &["nats", "amqp", "kafka"]
            } else {
                &["nats", "amqp"]
            };
            for broker in brokers {
                let rows: [(&str, &str); 4] = [
                    ("contended", "none"),
                    ("contended", "kill*3"),
                    ("partitioned", "pg-crash*2"),
                    ("contended", "pg-crash*2"),
                ];
                for (producer, faults) in rows {
                    let crash = faults.starts_with("pg-crash");
                    if crash && !pg_crash {
                        continue;
                    }
                    let mut s = base("postgres", broker);
                    s.producer = producer;
                    s.faults = faults.to_owned();
                    s.relays = 3;
                    s.lease_ms = 5000;
                    s.rate = if full { 1000 } else { 500 };
                    s.allow_pg_crash = crash;
                    // Room after each step for its recovery (lease + 5 s
                    // after a crash, lease + 1 s after a kill).
                    let room = if crash { 12 } else { 6 };
                    s.duration_s = (10 + s.fault_time_s() + room * s.step_count()).max(30);
                    s.recovery_room_s = 5;
                    out.push(s);
                }
            }
            // One relay cut from PostgreSQL past its lease with a slow sink
            // (relay 0 has its own proxies: NATS and RabbitMQ; a Kafka
            // client follows the broker's advertised address).
            for broker in ["nats", "amqp"] {
                let mut s = base("postgres", broker);
                s.relays = 3;
                s.lease_ms = 5000;
                s.rate = if full { 1000 } else { 500 };
                s.outage_s = if full { 30 } else { 12 };
                s.faults = "db-cut-one*3".to_owned();
                s.duration_s = 10 + s.fault_time_s() + 6 * s.step_count();
                s.recovery_room_s = 5;
                out.push(s);
            }
        }
    }
    out.push(reader_run(&base));
    out.extend(inbox_runs(mode, kafka, &base));
    out.extend(inbox_order_runs(mode, kafka, &base));
    out
}

/// The inbox's per-key order and boundary runs (issue 42's proof): on each
/// broker, one inbox consumer (PostgreSQL) `kill -9`ed every second for
/// 20 s (quick; 40 s medium and full) while events flow: each key's
/// effects must be in the key's order (0 violations), each once. And one
/// run with a short retention window (30 s: a slot boundary every 5 s, about
/// ten during the run) and two consumers of one NATS durable killed in turn
/// every second, so that copies of one event (a restarted consumer replays
/// what the other holds) are handled at once across the boundaries: each
/// effect exactly once (their order across the two is not given, so it is
/// reported only). Not shorter: a copy older than the window is handled
/// again by design, and with a consumer killed every second copies come up
/// to ~10 s after their original (a 6 s window re-applied 5,434).
fn inbox_order_runs(
    mode: Mode,
    kafka: bool,
    base: &dyn Fn(&'static str, &'static str) -> Scenario,
) -> Vec<Scenario> {
    let mut brokers = vec!["nats", "amqp"];
    // Kafka's row is out of the quick plan (CI): in its one quick run the
    // consumer restarted after 20 kills a second apart was assigned its
    // partition and then received nothing for 60 s (9,102 events not
    // applied; none out of order, none twice). Until that is understood
    // it runs in the medium and full plans only.
    if kafka && mode != Mode::Quick {
        brokers.push("kafka");
    }
    let kills_s = if mode == Mode::Quick { 20 } else { 40 };
    let mut out: Vec<Scenario> = brokers
        .into_iter()
        .map(|broker| {
            let mut s = base("postgres", broker);
            s.inbox = Some("postgres");
            s.faults = "consumer-kills".to_owned();
            s.outage_s = kills_s;
            s.duration_s = 10 + s.fault_time_s() + QUICK_RECOVERY_ROOM_S;
            s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
            s
        })
        .collect();
    let mut s = base("postgres", "nats");
    s.inbox = Some("postgres");
    s.consumers = 2;
    s.inbox_retention_s = Some(30);
    s.faults = "consumer-kills".to_owned();
    s.outage_s = kills_s;
    s.duration_s = 10 + s.fault_time_s() + QUICK_RECOVERY_ROOM_S;
    s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
    out.push(s);
    out
}

/// A `pg_dump`-like reader holding every log partition for 12 s while a
/// rotator with a 1 s interval runs (issue 42, point 3): the longest
/// no-delivery gap while the reader holds must stay under 1 s (the
/// checker's `max_gap_s`), nothing lost, no order violation. Every mode,
/// PostgreSQL + NATS.
fn reader_run(base: &dyn Fn(&'static str, &'static str) -> Scenario) -> Scenario {
    let mut s = base("postgres", "nats");
    s.faults = "partition-reader".to_owned();
    s.duration_s = 10 + s.fault_time_s() + QUICK_RECOVERY_ROOM_S;
    s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
    s
}

/// The end-to-end runs through the inbox (issue 36's proof): producer ->
/// outbox -> relays -> broker -> inbox consumers -> a business table,
/// with consumer kills, terminated consumer database connections (on
/// PostgreSQL), relay kills and (medium, full) broker cuts. The relays'
/// store is PostgreSQL; what varies is the consumers' database.
/// Quick: one run per broker, the consumer database alternating
/// (NATS + PostgreSQL, RabbitMQ + SQLite, Kafka + PostgreSQL), about
/// 40 s of production each. Medium and full: every broker with each
/// database.
fn inbox_runs(
    mode: Mode,
    kafka: bool,
    base: &dyn Fn(&'static str, &'static str) -> Scenario,
) -> Vec<Scenario> {
    let mut brokers = vec!["nats", "amqp"];
    if kafka {
        brokers.push("kafka");
    }
    let mut combos: Vec<(&'static str, &'static str)> = Vec::new();
    for (i, broker) in brokers.iter().enumerate() {
        match mode {
            // nats + pg, amqp + sqlite, kafka + pg.
            Mode::Quick => combos.push((broker, if i % 2 == 0 { "postgres" } else { "sqlite" })),
            Mode::Medium | Mode::Full => {
                combos.extend([(*broker, "postgres"), (*broker, "sqlite")]);
            }
        }
    }
    combos
        .into_iter()
        .map(|(broker, db)| {
            let mut s = base("postgres", broker);
            s.inbox = Some(db);
            let db_cut = if db == "postgres" {
                "consumer-db-cut"
            } else {
                "consumer-kill"
            };
            s.faults = match mode {
                Mode::Quick => format!("consumer-kill,kill,{db_cut},consumer-kill+kill"),
                Mode::Medium | Mode::Full => {
                    s.relays = 3;
                    s.lease_ms = 5000;
                    s.rate = if mode == Mode::Full { 1000 } else { 500 };
                    s.outage_s = 10;
                    s.flap_cycles = 3;
                    s.flap_down_ms = 2000;
                    s.flap_up_ms = 3000;
                    let reps = if mode == Mode::Full { 2 } else { 1 };
                    std::iter::repeat_n(
                        format!(
                            "consumer-kill*2,kill,{db_cut}*2,broker-flap,consumer-kill+broker-flap,consumer-kill+kill,{db_cut}+kill"
                        ),
                        reps,
                    )
                    .collect::<Vec<_>>()
                    .join(",")
                }
            };
            s.duration_s = 10 + s.fault_time_s() + QUICK_RECOVERY_ROOM_S * s.step_count();
            s.recovery_room_s = QUICK_RECOVERY_ROOM_S;
            s
        })
        .collect()
}

/// What selects a plan: the mode and the flags that add or drop runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Selection {
    /// `--quick`, `--medium` or `--full`.
    pub(crate) mode: Mode,
    /// The Kafka broker answered, so the Kafka pairs ran.
    pub(crate) kafka: bool,
    /// `--allow-pg-restart`.
    pub(crate) allow_pg_restart: bool,
    /// Not `--no-pg-crash`.
    pub(crate) pg_crash: bool,
}

impl Selection {
    /// The selection's runs.
    pub(crate) fn plan(self) -> Vec<Scenario> {
        plan(self.mode, self.kafka, self.allow_pg_restart, self.pg_crash)
    }

    /// The fingerprint of the selection's runs (see [`fingerprint`]).
    pub(crate) fn fingerprint(self) -> String {
        fingerprint(self.plan().iter().map(|s| (s.label(), s.args())))
    }
}

/// A run list's fingerprint: 64-bit FNV-1a over each run's label and
/// `outbox-chaos run` arguments, one line per run in label order, as 16 hex
/// digits. Any change to the set of runs or to one run's parameters changes
/// it; the order the runs were made in does not.
pub(crate) fn fingerprint(runs: impl IntoIterator<Item = (String, Vec<String>)>) -> String {
    let mut lines: Vec<String> = runs
        .into_iter()
        .map(|(label, args)| format!("{label}\t{}\n", args.join(" ")))
        .collect();
    lines.sort();
    format!("{:016x}", fnv1a64(lines.concat().as_bytes()))
}

/// 64-bit FNV-1a: a stable hash with no dependency (not for security).
pub(crate) fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests;
