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
//!   crate implements [`publisher::PublisherHarness`] and invokes
//!   [`publisher_conformance_tests!`].
//!
//! This crate is test support: it panics on failures by design.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod publisher;
pub mod store;

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
