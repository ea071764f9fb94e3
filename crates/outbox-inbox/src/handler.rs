//! The application's side: a [`Handler`] runs inside the inbox's
//! transaction, so its writes commit together with the record that the
//! message was handled, or not at all. It reports a failure as the outbox's
//! [`HandlerError`]: [`HandlerError::retryable`] is retried with the inbox's
//! [`RetryPolicy`](outbox_core::RetryPolicy) (`HANDLER_TEMPORARY_FAILURE`),
//! [`HandlerError::permanent`] goes to the inbox's dead letters at once
//! (`HANDLER_PERMANENT_FAILURE`), and the handler's writes are rolled back
//! either way. A database error through `?` is retryable: the inbox's own
//! transaction is what failed (a terminated connection, a deadlock, a
//! serialization failure), not the message.

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::{ErrorCode, HandlerError, InboundMessage};
use sqlx::Transaction;
use std::collections::HashMap;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

/// Applies one message inside the inbox's transaction on database `DB`.
///
/// Write the effects through `tx` (`sqlx::query(..).execute(&mut **tx)`);
/// never commit or roll it back: the inbox commits it together with the
/// record of the message, or rolls everything back when the handler fails.
/// A handler runs at most once per committed effect, but may run again
/// after a failure or a crash before the commit, so anything it does
/// outside `tx` (an HTTP call) must itself be idempotent.
pub trait Handler<DB: sqlx::Database>: Send + Sync + 'static {
    /// Applies `message` through `tx`.
    fn handle<'a>(
        &'a self,
        message: &'a InboundMessage,
        tx: &'a mut Transaction<'static, DB>,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
}

/// A [`Handler`] from a function or closure:
///
/// ```ignore
/// handler_fn(|msg, tx| Box::pin(async move {
///     sqlx::query("INSERT INTO credits (id) VALUES ($1)").bind(msg.id.as_uuid()).execute(&mut **tx).await?;
///     Ok(())
/// }))
/// ```
pub fn handler_fn<DB, F>(f: F) -> FnHandler<F>
where
    DB: sqlx::Database,
    F: for<'a> Fn(
            &'a InboundMessage,
            &'a mut Transaction<'static, DB>,
        ) -> BoxFuture<'a, Result<(), HandlerError>>
        + Send
        + Sync
        + 'static,
{
    FnHandler(f)
}

/// The [`Handler`] [`handler_fn`] makes.
pub struct FnHandler<F>(F);

impl<F> fmt::Debug for FnHandler<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnHandler")
    }
}

impl<DB, F> Handler<DB> for FnHandler<F>
where
    DB: sqlx::Database,
    F: for<'a> Fn(
            &'a InboundMessage,
            &'a mut Transaction<'static, DB>,
        ) -> BoxFuture<'a, Result<(), HandlerError>>
        + Send
        + Sync
        + 'static,
{
    fn handle<'a>(
        &'a self,
        message: &'a InboundMessage,
        tx: &'a mut Transaction<'static, DB>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        (self.0)(message, tx)
    }
}

/// Handlers by event type. A message whose type has no handler is
/// dead-lettered with `HANDLER_NOT_REGISTERED`, never dropped.
pub struct HandlerRegistry<DB: sqlx::Database> {
    by_type: HashMap<String, Arc<dyn Handler<DB>>>,
}

impl<DB: sqlx::Database> Default for HandlerRegistry<DB> {
    fn default() -> Self {
        Self {
            by_type: HashMap::new(),
        }
    }
}

impl<DB: sqlx::Database> fmt::Debug for HandlerRegistry<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut types: Vec<&str> = self.by_type.keys().map(String::as_str).collect();
        types.sort_unstable();
        f.debug_struct("HandlerRegistry")
            .field("event_types", &types)
            .finish()
    }
}

impl<DB: sqlx::Database> HandlerRegistry<DB> {
    /// No handlers yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Handles messages of `event_type` with `handler` (replacing any
    /// earlier one).
    pub fn with_handler(
        mut self,
        event_type: impl Into<String>,
        handler: impl Handler<DB>,
    ) -> Self {
        self.by_type.insert(event_type.into(), Arc::new(handler));
        self
    }
}

impl<DB: sqlx::Database> Handler<DB> for HandlerRegistry<DB> {
    fn handle<'a>(
        &'a self,
        message: &'a InboundMessage,
        tx: &'a mut Transaction<'static, DB>,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        match self.by_type.get(&message.event_type) {
            Some(h) => h.handle(message, tx),
            None => Box::pin(async move { Err(HandlerError::not_registered(&message.event_type)) }),
        }
    }
}

/// A handler's failure with its stable code, as stored with a retry or a
/// dead letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// `HANDLER_TEMPORARY_FAILURE`, `HANDLER_PERMANENT_FAILURE`,
    /// `HANDLER_NOT_REGISTERED`, `HANDLER_PANICKED` or `UNDECODABLE`.
    pub code: ErrorCode,
    /// What went wrong.
    pub message: String,
    /// Whether another attempt may succeed.
    pub retryable: bool,
}

impl From<HandlerError> for Failure {
    fn from(e: HandlerError) -> Self {
        Self {
            code: e.code().clone(),
            retryable: e.is_retryable(),
            message: e.message().to_owned(),
        }
    }
}

/// Runs `handler`, turning a panic (synchronous or inside the future) into
/// a retryable `HANDLER_PANICKED` error: a panicking handler never takes the
/// consumer down.
pub(crate) async fn run_handler<DB: sqlx::Database, H: Handler<DB> + ?Sized>(
    handler: &H,
    message: &InboundMessage,
    tx: &mut Transaction<'static, DB>,
) -> Result<(), HandlerError> {
    let fut = match std::panic::catch_unwind(AssertUnwindSafe(move || {
        let tx = tx;
        handler.handle(message, tx)
    })) {
        Ok(fut) => fut,
        Err(p) => return Err(HandlerError::panicked(&*p)),
    };
    match AssertUnwindSafe(fut).catch_unwind().await {
        Ok(r) => r,
        Err(p) => Err(HandlerError::panicked(&*p)),
    }
}
