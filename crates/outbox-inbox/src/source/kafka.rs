//! [`KafkaSource`]: a consumer-group member that commits, per partition,
//! only the offsets below which every message is acknowledged.
//!
//! | option | default |
//! |---|---|
//! | brokers | required (`host:port,host2:port`, as [`outbox_kafka::KafkaConfig`]) |
//! | group id | required |
//! | topics | required (at least one) |
//! | `auto.offset.reset` | `earliest` (a new group reads each partition from the start) |
//! | commit interval | 200 ms (commits are asynchronous; [`Source::close`] commits synchronously) |
//! | any other librdkafka property | [`KafkaSourceConfig::with_property`] (SASL/SSL, `session.timeout.ms`, ...; secrets are redacted in `Debug` as in [`outbox_kafka::is_secret_property`]) |
//!
//! `enable.auto.commit` and `enable.auto.offset.store` are always `false`:
//! the source alone decides what is committed.
//!
//! Acknowledgements arrive in any order (the consumer handles different
//! keys of one partition in parallel), while Kafka keeps one committed
//! position per partition. The source keeps, per partition, the offsets it
//! handed out and that are not acknowledged yet; the position it commits is
//! the lowest of them (everything below is acknowledged), or the offset
//! after the last one received when none is outstanding. So after a restart
//! the first unacknowledged message comes again, and with it every later
//! one, acknowledged or not: the inbox absorbs those copies.
//!
//! On a rebalance the partitions taken away are committed as far as they
//! are acknowledged and their bookkeeping is dropped; their unacknowledged
//! messages go to the partition's new owner. A token from before that
//! (its partition has since been revoked, maybe assigned again) is ignored.
//!
//! A process that is killed does not leave the group: its member stays
//! until the session timeout, holding its partitions. On Tansu 0.6 that
//! can strand partitions for good (issue 42): when a heartbeat finds
//! members past their session timeout, its coordinator drops them but
//! keeps the group's generation and assignment (no rebalance), so the
//! partitions the leader had given them are assigned to no live member;
//! a survivor's rejoin with unchanged metadata gets the same generation
//! and its old assignment back. A plain rdkafka consumer of the group is
//! stranded the same way; static membership (`group.instance.id`) did
//! not help there (its joins and syncs pause 3 s each and the member was
//! revoked and assigned again every 6 s without consuming).
//! `tests/crash_order.rs` reproduces it (ignored while it fails).
//!
//! Headers are Kafka's record headers, values read as UTF-8 (lossy);
//! [`RawMessage::timestamp`] is the record timestamp;
//! [`RawMessage::redelivered`] is always `false` (Kafka does not tell) and
//! [`RawMessage::behind`] `None` (the high watermark is a broker request
//! away, not cached where this crate can read it).

use super::{Position, RawMessage, Received, Source, SourceError};
use futures::FutureExt;
use outbox_kafka::rdkafka;
use outbox_kafka::{is_secret_property, TracingContext};
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Properties the source sets itself; a conflicting value is refused.
const FIXED: &[(&str, &str)] = &[
    ("enable.auto.commit", "false"),
    ("enable.auto.offset.store", "false"),
];

/// Where and how a [`KafkaSource`] consumes. `Debug` redacts secret
/// properties.
#[derive(Clone)]
pub struct KafkaSourceConfig {
    brokers: String,
    group_id: String,
    topics: Vec<String>,
    properties: BTreeMap<String, String>,
    commit_interval: Duration,
}

impl fmt::Debug for KafkaSourceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let props: BTreeMap<&str, &str> = self
            .properties
            .iter()
            .map(|(k, v)| {
                let v = if is_secret_property(k) {
                    "<redacted>"
                } else {
                    v.as_str()
                };
                (k.as_str(), v)
            })
            .collect();
        f.debug_struct("KafkaSourceConfig")
            .field("brokers", &outbox_core::redact_url(&self.brokers))
            .field("group_id", &self.group_id)
            .field("topics", &self.topics)
            .field("properties", &props)
            .field("commit_interval", &self.commit_interval)
            .finish()
    }
}

impl KafkaSourceConfig {
    /// Consumes `topics` on `brokers` (`host:port,host2:port`) as a member
    /// of consumer group `group_id`.
    pub fn new<S: Into<String>>(
        brokers: impl Into<String>,
        group_id: impl Into<String>,
        topics: impl IntoIterator<Item = S>,
    ) -> Self {
        let mut properties = BTreeMap::new();
        properties.insert("auto.offset.reset".to_owned(), "earliest".to_owned());
        properties.insert("client.id".to_owned(), "outbox-inbox".to_owned());
        Self {
            brokers: brokers.into(),
            group_id: group_id.into(),
            topics: topics.into_iter().map(Into::into).collect(),
            properties,
            commit_interval: Duration::from_millis(200),
        }
    }

    /// Sets any librdkafka consumer property (see librdkafka's
    /// CONFIGURATION.md), e.g. `security.protocol`, `sasl.username`,
    /// `sasl.password`, `session.timeout.ms`.
    pub fn with_property(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.insert(name.into(), value.into());
        self
    }

    /// Where a group without a committed offset starts: `earliest` (the
    /// default) or `latest`.
    pub fn with_auto_offset_reset(self, reset: impl Into<String>) -> Self {
        self.with_property("auto.offset.reset", reset)
    }

    /// How often acknowledged offsets are committed at most (default 200 ms).
    pub fn with_commit_interval(mut self, interval: Duration) -> Self {
        self.commit_interval = interval;
        self
    }

    /// The consumer group.
    pub fn group_id(&self) -> &str {
        &self.group_id
    }

    /// The topics.
    pub fn topics(&self) -> &[String] {
        &self.topics
    }

    /// Checks the broker list, group, topics and fixed properties.
    pub fn validate(&self) -> Result<(), SourceError> {
        if self.brokers.trim().is_empty() {
            return Err(SourceError::Config("no Kafka broker given".into()));
        }
        if self.brokers.contains('@') {
            return Err(SourceError::Config(
                "credentials are not accepted in the broker list; set sasl.username and sasl.password properties".into(),
            ));
        }
        if self.group_id.trim().is_empty() {
            return Err(SourceError::Config("the consumer group id is empty".into()));
        }
        if self.topics.is_empty() {
            return Err(SourceError::Config("no topic to consume".into()));
        }
        for t in &self.topics {
            let ok = !t.is_empty()
                && t.len() <= 249
                && t.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
            if !ok {
                return Err(SourceError::Config(format!(
                    "topic {t:?} is not a valid Kafka topic name"
                )));
            }
        }
        for (name, required) in FIXED {
            if let Some(v) = self.properties.get(*name) {
                if !v.eq_ignore_ascii_case(required) {
                    return Err(SourceError::Config(format!(
                        "the inbox source requires {name}={required}: it commits offsets itself"
                    )));
                }
            }
        }
        match self.properties.get("auto.offset.reset").map(String::as_str) {
            None | Some("earliest" | "latest" | "smallest" | "largest" | "beginning" | "end") => {}
            Some(other) => {
                return Err(SourceError::Config(format!(
                    "auto.offset.reset={other:?}: expected earliest or latest"
                )))
            }
        }
        Ok(())
    }

    /// The rdkafka configuration. Holds secrets in clear: not logged.
    fn client_config(&self) -> ClientConfig {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &self.brokers);
        cc.set("group.id", &self.group_id);
        // Back within a second of a returning broker (librdkafka's default
        // cap is 10 s); a property given explicitly wins.
        cc.set("reconnect.backoff.max.ms", "1000");
        for (k, v) in &self.properties {
            cc.set(k, v);
        }
        for (k, v) in FIXED {
            cc.set(*k, *v);
        }
        cc
    }
}

/// Acknowledges one record: its topic, partition and offset (and the
/// assignment of the partition it came with).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaToken {
    topic: String,
    partition: i32,
    offset: i64,
    epoch: u64,
}

impl KafkaToken {
    /// The record's topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The record's partition.
    pub fn partition(&self) -> i32 {
        self.partition
    }

    /// The record's offset.
    pub fn offset(&self) -> i64 {
        self.offset
    }
}

/// One assigned partition's bookkeeping.
#[derive(Debug)]
struct Part {
    /// Bumped each time the partition's bookkeeping starts afresh.
    epoch: u64,
    /// The first offset received in this epoch: everything below was
    /// handled before (the group's committed position, or the reset point).
    low: i64,
    /// One past the highest offset received.
    high: i64,
    /// Received and not acknowledged.
    outstanding: BTreeSet<i64>,
    /// The last position committed (or asked to be).
    committed: i64,
}

impl Part {
    fn new(epoch: u64, offset: i64) -> Self {
        Self {
            epoch,
            low: offset,
            high: offset,
            outstanding: BTreeSet::new(),
            committed: offset,
        }
    }

    /// The position to commit: every offset below it is acknowledged.
    fn position(&self) -> i64 {
        self.outstanding.first().copied().unwrap_or(self.high)
    }
}

/// Every assigned partition's bookkeeping, shared with the rebalance
/// callbacks.
#[derive(Debug, Default)]
struct Book {
    parts: HashMap<(String, i32), Part>,
    epochs: u64,
}

impl Book {
    /// Records a received offset; the epoch its token carries.
    fn received(&mut self, topic: &str, partition: i32, offset: i64) -> u64 {
        let key = (topic.to_owned(), partition);
        let fresh = match self.parts.get(&key) {
            None => true,
            // Below the epoch's start: the consumer was rewound (an offset
            // reset). Offsets from there on come again; start afresh so
            // nothing between the two is ever committed unseen.
            Some(p) => offset < p.low,
        };
        if fresh {
            self.epochs += 1;
            self.parts
                .insert(key.clone(), Part::new(self.epochs, offset));
        }
        match self.parts.get_mut(&key) {
            Some(p) => {
                p.outstanding.insert(offset);
                p.high = p.high.max(offset + 1);
                p.epoch
            }
            None => 0,
        }
    }

    /// Marks a token acknowledged; tokens of a past epoch are ignored.
    fn acked(&mut self, token: &KafkaToken) {
        if let Some(p) = self.parts.get_mut(&(token.topic.clone(), token.partition)) {
            if p.epoch == token.epoch {
                p.outstanding.remove(&token.offset);
            }
        }
    }

    /// The positions that moved past their last commit (all of them when
    /// `all`), marked committed.
    fn take_commits(&mut self, all: bool) -> Option<TopicPartitionList> {
        let mut tpl = TopicPartitionList::new();
        let mut any = false;
        for ((topic, partition), p) in &mut self.parts {
            let pos = p.position();
            let moved = pos > p.committed || (all && pos > p.low);
            if moved
                && tpl
                    .add_partition_offset(topic, *partition, Offset::Offset(pos))
                    .is_ok()
            {
                p.committed = pos;
                any = true;
            }
        }
        any.then_some(tpl)
    }

    /// Drops the partitions in `tpl`, returning what to commit for them.
    fn revoke(&mut self, tpl: &TopicPartitionList) -> Option<TopicPartitionList> {
        let mut commit = TopicPartitionList::new();
        let mut any = false;
        for e in tpl.elements() {
            if let Some(p) = self.parts.remove(&(e.topic().to_owned(), e.partition())) {
                let pos = p.position();
                if pos > p.low
                    && commit
                        .add_partition_offset(e.topic(), e.partition(), Offset::Offset(pos))
                        .is_ok()
                {
                    any = true;
                }
            }
        }
        any.then_some(commit)
    }
}

fn lock(book: &Mutex<Book>) -> MutexGuard<'_, Book> {
    // The bookkeeping stays consistent under a panic elsewhere: every
    // update is a single insert or remove.
    book.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The consumer's callbacks: librdkafka's logs to `tracing`, rebalances to
/// the bookkeeping.
struct SourceContext {
    book: Arc<Mutex<Book>>,
}

impl ClientContext for SourceContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        TracingContext.log(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        TracingContext.error(error, reason);
    }
}

impl ConsumerContext for SourceContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let commit = lock(&self.book).revoke(tpl);
            tracing::info!(partitions = tpl.count(), "Kafka source: partitions revoked");
            if let Some(commit) = commit {
                // Asynchronous: the callback runs on the consumer's poll;
                // the commit goes out before the group rejoins.
                if let Err(e) = consumer.commit(&commit, CommitMode::Async) {
                    tracing::debug!(error = %e, "Kafka source: commit on revoke failed");
                }
            }
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                tracing::info!(
                    partitions = tpl.count(),
                    "Kafka source: partitions assigned"
                );
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "Kafka source: rebalance failed"),
            Rebalance::Revoke(_) => {}
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        if let Err(e) = result {
            // A later commit (or the one on close) covers it; the worst
            // case is a redelivery, absorbed by the inbox.
            tracing::debug!(error = %e, "Kafka source: offset commit failed");
        }
    }
}

/// Consumes Kafka topics in a consumer group. See the [module docs](self).
pub struct KafkaSource {
    config: KafkaSourceConfig,
    consumer: Arc<StreamConsumer<SourceContext>>,
    book: Arc<Mutex<Book>>,
    last_commit: Instant,
}

impl fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaSource")
            .field("group_id", &self.config.group_id)
            .field("topics", &self.config.topics)
            .finish_non_exhaustive()
    }
}

impl KafkaSource {
    /// Creates the consumer and subscribes. librdkafka connects in the
    /// background: an unreachable broker shows up later as an empty
    /// [`Source::recv`]; an invalid configuration fails here with
    /// [`SourceError::Config`], a topic that does not exist on the first
    /// [`Source::recv`] that hears about it.
    pub fn new(config: KafkaSourceConfig) -> Result<Self, SourceError> {
        config.validate()?;
        let book = Arc::new(Mutex::new(Book::default()));
        let context = SourceContext { book: book.clone() };
        let consumer: StreamConsumer<SourceContext> = config
            .client_config()
            .create_with_context(context)
            .map_err(|e| SourceError::Config(format!("Kafka consumer: {e}")))?;
        let topics: Vec<&str> = config.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|e| SourceError::Config(format!("subscribing to {topics:?}: {e}")))?;
        tracing::info!(group = %config.group_id, topics = ?config.topics, "Kafka source subscribed");
        Ok(Self {
            config,
            consumer: Arc::new(consumer),
            book,
            last_commit: Instant::now(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &KafkaSourceConfig {
        &self.config
    }

    /// Commits (asynchronously) what moved, at most every commit interval.
    fn maybe_commit(&mut self) {
        if self.last_commit.elapsed() < self.config.commit_interval {
            return;
        }
        self.last_commit = Instant::now();
        let tpl = lock(&self.book).take_commits(false);
        if let Some(tpl) = tpl {
            if let Err(e) = self.consumer.commit(&tpl, CommitMode::Async) {
                tracing::debug!(error = %e, "Kafka source: offset commit not sent");
            }
        }
    }

    fn received(&self, m: &BorrowedMessage<'_>) -> Received<KafkaToken> {
        let mut headers = Vec::new();
        if let Some(hs) = m.headers() {
            for h in hs.iter() {
                let value = h.value.map(String::from_utf8_lossy).unwrap_or_default();
                headers.push((h.key.to_owned(), value.into_owned()));
            }
        }
        let epoch = lock(&self.book).received(m.topic(), m.partition(), m.offset());
        Received {
            message: RawMessage {
                headers,
                body: m.payload().unwrap_or_default().to_vec(),
                destination: m.topic().to_owned(),
                timestamp: m
                    .timestamp()
                    .to_millis()
                    .and_then(chrono::DateTime::from_timestamp_millis),
                redelivered: false,
                behind: None,
            },
            token: KafkaToken {
                topic: m.topic().to_owned(),
                partition: m.partition(),
                offset: m.offset(),
                epoch,
            },
        }
    }
}

/// A consumer error: a missing topic or refused access is the
/// configuration's; anything else passes.
fn classify(e: &KafkaError) -> SourceError {
    let config = matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::UnknownTopicOrPartition
                | RDKafkaErrorCode::UnknownTopic
                | RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::GroupAuthorizationFailed
                | RDKafkaErrorCode::InvalidGroupId
        )
    );
    if config {
        SourceError::Config(format!("Kafka consumer: {e}"))
    } else {
        SourceError::Unavailable(format!("Kafka consumer: {e}"))
    }
}

impl Source for KafkaSource {
    type Token = KafkaToken;

    async fn recv(
        &mut self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Received<KafkaToken>>, SourceError> {
        self.maybe_commit();
        if max == 0 {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        match tokio::time::timeout(wait, self.consumer.recv()).await {
            Err(_) => return Ok(out),
            Ok(Err(e)) => return Err(classify(&e)),
            Ok(Ok(m)) => out.push(self.received(&m)),
        }
        while out.len() < max {
            match self.consumer.recv().now_or_never() {
                Some(Ok(m)) => out.push(self.received(&m)),
                Some(Err(e)) => {
                    tracing::debug!(error = %e, got = out.len(), "Kafka source: batch ended early");
                    break;
                }
                None => break,
            }
        }
        Ok(out)
    }

    async fn ack(&mut self, tokens: Vec<KafkaToken>) -> Result<(), SourceError> {
        {
            let mut book = lock(&self.book);
            for t in &tokens {
                book.acked(t);
            }
        }
        self.maybe_commit();
        Ok(())
    }

    async fn close(self) -> Result<(), SourceError> {
        let Self { consumer, book, .. } = self;
        let tpl = lock(&book).take_commits(true);
        // A synchronous commit and leaving the group block on the broker:
        // off the async threads.
        let done = tokio::task::spawn_blocking(move || {
            let committed = match tpl {
                Some(tpl) => consumer.commit(&tpl, CommitMode::Sync),
                None => Ok(()),
            };
            // Dropping the last handle leaves the group (rd_kafka_consumer_close).
            drop(consumer);
            committed
        })
        .await
        .map_err(|e| SourceError::Unavailable(format!("Kafka close did not finish: {e}")))?;
        done.map_err(|e| SourceError::Unavailable(format!("Kafka final commit failed: {e}")))
    }

    fn describe(&self) -> String {
        format!(
            "kafka:{}/{}",
            self.config.topics.join(","),
            self.config.group_id
        )
    }

    fn position(token: &KafkaToken) -> Option<Position> {
        let offset = u64::try_from(token.offset).ok()?;
        let mut log = token.topic.as_bytes().to_vec();
        log.push(0);
        log.extend_from_slice(&token.partition.to_be_bytes());
        Some(Position {
            log: outbox_core::fnv1a_64(&log),
            offset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(book: &Book, partition: i32, offset: i64) -> KafkaToken {
        KafkaToken {
            topic: "t".into(),
            partition,
            offset,
            epoch: book.parts[&("t".to_owned(), partition)].epoch,
        }
    }

    fn position(book: &Book, partition: i32) -> i64 {
        book.parts[&("t".to_owned(), partition)].position()
    }

    #[test]
    fn commits_the_highest_contiguously_acked_offset() {
        let mut book = Book::default();
        for o in 10..15 {
            book.received("t", 0, o);
        }
        assert_eq!(position(&book, 0), 10);
        // Out of order: 11, 13, 14 acked; 10 and 12 not.
        for o in [11, 13, 14] {
            let t = token(&book, 0, o);
            book.acked(&t);
        }
        assert_eq!(position(&book, 0), 10, "nothing below 10 is missing, 10 is");
        assert!(book.take_commits(false).is_none());
        let t = token(&book, 0, 10);
        book.acked(&t);
        assert_eq!(position(&book, 0), 12);
        let tpl = book.take_commits(false).unwrap();
        assert_eq!(
            tpl.find_partition("t", 0).unwrap().offset(),
            Offset::Offset(12)
        );
        assert!(book.take_commits(false).is_none(), "already committed");
        let t = token(&book, 0, 12);
        book.acked(&t);
        assert_eq!(position(&book, 0), 15, "all acked: one past the last");
    }

    #[test]
    fn revoked_partitions_are_forgotten_and_old_tokens_ignored() {
        let mut book = Book::default();
        book.received("t", 0, 0);
        book.received("t", 0, 1);
        let old = token(&book, 0, 0);
        let mut revoked = TopicPartitionList::new();
        revoked.add_partition("t", 0);
        assert!(book.revoke(&revoked).is_none(), "nothing acked: no commit");
        assert!(book.parts.is_empty());
        // Assigned again: redelivered from 0.
        book.received("t", 0, 0);
        book.acked(&old);
        assert_eq!(
            position(&book, 0),
            0,
            "a token of the old assignment is ignored"
        );
        let new = token(&book, 0, 0);
        book.acked(&new);
        assert_eq!(position(&book, 0), 1);
        let commit = book.revoke(&revoked).unwrap();
        assert_eq!(
            commit.find_partition("t", 0).unwrap().offset(),
            Offset::Offset(1)
        );
    }

    #[test]
    fn a_rewind_starts_afresh() {
        let mut book = Book::default();
        book.received("t", 1, 50);
        let t = token(&book, 1, 50);
        book.acked(&t);
        assert_eq!(position(&book, 1), 51);
        book.received("t", 1, 40);
        assert_eq!(position(&book, 1), 40, "never past an offset seen again");
    }

    #[test]
    fn config_validation_and_debug() {
        let c = KafkaSourceConfig::new("127.0.0.1:9092", "g", ["orders"])
            .with_property("sasl.password", "hunter2");
        assert!(c.validate().is_ok());
        assert!(!format!("{c:?}").contains("hunter2"));
        let bad = c.clone().with_property("enable.auto.commit", "true");
        assert!(matches!(bad.validate(), Err(SourceError::Config(_))));
        let no_topics = KafkaSourceConfig::new("b:1", "g", Vec::<String>::new());
        assert!(no_topics.validate().is_err());
        assert!(KafkaSourceConfig::new("b:1", "", ["t"]).validate().is_err());
        assert!(KafkaSourceConfig::new("b:1", "g", ["bad topic"])
            .validate()
            .is_err());
        assert!(c.with_auto_offset_reset("sometimes").validate().is_err());
    }
}
