//! Conformance suites for `outbox` backends, written once and run against
//! every implementation (as luno/workflow's adaptertest does): a new backend
//! passes the same tests or it is not done.
//!
//! - [`store`]: the [`Store`](outbox_core::Store) +
//!   [`DeadLetterStore`](outbox_core::DeadLetterStore) suite. A store crate
//!   implements [`store::StoreHarness`] in its test file and invokes
//!   [`store_conformance_tests!`]; each case becomes its own `#[test]` named
//!   `conformance::<case>`.
//! - [`publisher`]: the broker [`Sink`](outbox_core::Sink) suite. A publisher
//!   crate invokes [`publisher_conformance_tests!`] with a
//!   [`publisher::PublisherHarness`]: the NATS and RabbitMQ fixtures are
//!   harnesses themselves; Kafka's test file builds its own (it needs a
//!   dedicated broker for the proxy case).
//!
//! One fixture per broker (its topology for one test, a configured
//! publisher, a consumer reading back what arrived), shared by that
//! broker's conformance suite and the end-to-end tests, each behind a
//! feature so that a crate pulls in only the broker it tests: `nats`
//! (`nats::NatsFixture`), `amqp` (`amqp::AmqpFixture`), `kafka`
//! (`kafka::KafkaFixture`); [`broker::Received`] is a message as any of
//! them reads it.
//!
//! Helpers every integration test may use: [`proxy::TcpProxy`] (a TCP
//! forwarder that can cut and refuse connections, for broker and database
//! outages), [`process`] (signals, bounded waits, a guard that kills a
//! child process), [`logs::LogCapture`] (what `tracing` logged),
//! [`tls::TestPki`] (a CA and a server certificate made by the test),
//! [`sink::CountingSink`] and [`sink::fast_retry`] for relays under test.
//!
//! This crate is test support: it panics on failures by design.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[cfg(feature = "amqp")]
pub mod amqp;
pub mod broker;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod logs;
#[cfg(feature = "nats")]
pub mod nats;
pub mod process;
pub mod proxy;
pub mod publisher;
pub mod sink;
pub mod store;
pub mod tls;

/// Runtime glue for the macros. Not public API.
#[doc(hidden)]
pub mod __private {
    use std::future::Future;

    /// Runs `fut` to completion on a fresh multi-thread tokio runtime, as
    /// `#[tokio::test(flavor = "multi_thread")]` would, without requiring the
    /// calling crate to enable tokio's macros.
    pub fn block_on<F: Future>(fut: F) -> F::Output {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("build tokio runtime")
            .block_on(fut)
    }
}
