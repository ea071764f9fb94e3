//! [`HandlerRegistry`]: a [`Sink`] that dispatches events to in-process async handlers.

use futures::stream::{self, StreamExt};
use outbox_core::{DeliveryError, ErrorCode, Event, Outcome, Sink};
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use tokio::task::JoinHandle;

/// Why a handler could not process an event. Map your own errors to one of
/// the two kinds: [`HandlerError::retryable`] (`HANDLER_TEMPORARY_FAILURE`,
/// retried with backoff) or [`HandlerError::permanent`]
/// (`HANDLER_PERMANENT_FAILURE`, dead-lettered at once).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct HandlerError {
    retryable: bool,
    message: String,
}

impl HandlerError {
    /// A transient failure (a dependency is down, a timeout): retry later.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self {
            retryable: true,
            message: message.into(),
        }
    }

    /// A failure retrying cannot fix (malformed payload): dead-letter.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            retryable: false,
            message: message.into(),
        }
    }

    /// Whether the event should be retried.
    pub fn is_retryable(&self) -> bool {
        self.retryable
    }

    /// The message stored as the event's `last_error`.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<HandlerError> for DeliveryError {
    fn from(e: HandlerError) -> Self {
        if e.retryable {
            DeliveryError::retryable(ErrorCode::HANDLER_TEMPORARY_FAILURE, e.message)
        } else {
            DeliveryError::permanent(ErrorCode::HANDLER_PERMANENT_FAILURE, e.message)
        }
    }
}

type BoxFuture = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send>>;
type Handler = Arc<dyn Fn(Event) -> BoxFuture + Send + Sync>;

/// In-process handlers by event type: the Go worker's dispatch.
///
/// - an event whose type has no handler fails permanently with
///   `HANDLER_NOT_REGISTERED` (dead-lettered, never silently dropped);
/// - a handler's [`HandlerError`] maps to `HANDLER_TEMPORARY_FAILURE` or
///   `HANDLER_PERMANENT_FAILURE`;
/// - a handler that panics fails retryably with `HANDLER_PANICKED` (each
///   call runs in its own tokio task, so a panic is caught as a `JoinError`).
///
/// Within one batch, events with different keys run concurrently (at most
/// [`HandlerRegistry::with_concurrency`] keys at a time, default 16); events
/// with the same key (or, without a key, the same id) run one after the
/// other in claim order. When an event fails retryably, the later events of
/// its key in the same batch are not run: they are reported
/// [`crate::NOT_ATTEMPTED`] and the relay releases them, so they are handled
/// after the failed one (the store claims a key's events in order).
#[derive(Clone)]
pub struct HandlerRegistry {
    handlers: HashMap<String, Handler>,
    concurrency: usize,
}

impl Default for HandlerRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for HandlerRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut types: Vec<&str> = self.handlers.keys().map(String::as_str).collect();
        types.sort_unstable();
        f.debug_struct("HandlerRegistry")
            .field("event_types", &types)
            .field("concurrency", &self.concurrency)
            .finish()
    }
}

impl HandlerRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self {
            handlers: HashMap::new(),
            concurrency: 16,
        }
    }

    /// Most keys handled at the same time within a batch (default 16, at least 1).
    pub fn with_concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Registers `handler` for `event_type`, replacing any earlier one.
    ///
    /// ```
    /// use outbox_worker::{HandlerError, HandlerRegistry};
    ///
    /// let mut handlers = HandlerRegistry::new();
    /// handlers.register("order.created", |event| async move {
    ///     if event.payload.is_empty() {
    ///         return Err(HandlerError::permanent("empty payload"));
    ///     }
    ///     Ok(())
    /// });
    /// assert!(handlers.contains("order.created"));
    /// ```
    pub fn register<F, Fut>(&mut self, event_type: impl Into<String>, handler: F) -> &mut Self
    where
        F: Fn(Event) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        let handler: Handler = Arc::new(move |event| Box::pin(handler(event)) as BoxFuture);
        self.handlers.insert(event_type.into(), handler);
        self
    }

    /// [`HandlerRegistry::register`] in builder style.
    pub fn with_handler<F, Fut>(mut self, event_type: impl Into<String>, handler: F) -> Self
    where
        F: Fn(Event) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        self.register(event_type, handler);
        self
    }

    /// Whether a handler is registered for `event_type`.
    pub fn contains(&self, event_type: &str) -> bool {
        self.handlers.contains_key(event_type)
    }

    /// Runs the handler of one event in its own task.
    async fn handle(&self, event: Event) -> Outcome {
        let Some(handler) = self.handlers.get(&event.event_type).cloned() else {
            return Outcome::Failed(DeliveryError::permanent(
                ErrorCode::HANDLER_NOT_REGISTERED,
                format!(
                    "no handler registered for event type {:?}",
                    event.event_type
                ),
            ));
        };
        let task = AbortOnDrop(tokio::spawn(handler(event)));
        match task.join().await {
            Ok(Ok(())) => Outcome::Delivered,
            Ok(Err(e)) => Outcome::Failed(e.into()),
            Err(join) if join.is_panic() => {
                let payload = join.into_panic();
                let msg = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-text panic payload".to_owned());
                Outcome::Failed(DeliveryError::retryable(
                    ErrorCode::HANDLER_PANICKED,
                    format!("handler panicked: {msg}"),
                ))
            }
            Err(_) => Outcome::Failed(DeliveryError::retryable(
                ErrorCode::HANDLER_PANICKED,
                "handler task was cancelled",
            )),
        }
    }
}

/// Aborts the handler task if the delivery is dropped (shutdown grace expired).
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    async fn join(mut self) -> Result<T, tokio::task::JoinError> {
        (&mut self.0).await
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Sink for HandlerRegistry {
    async fn deliver(&self, events: &[Event]) -> Vec<Outcome> {
        // Group by shard key, keeping claim order inside each group.
        let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        for (i, event) in events.iter().enumerate() {
            let key = event.shard_key();
            match index.get(&key) {
                Some(&g) => groups[g].1.push(i),
                None => {
                    index.insert(key.clone(), groups.len());
                    groups.push((key, vec![i]));
                }
            }
        }
        let mut outcomes: Vec<Option<Outcome>> = vec![None; events.len()];
        let results: Vec<Vec<(usize, Outcome)>> = stream::iter(groups)
            .map(|(_, members)| async move {
                let mut out = Vec::with_capacity(members.len());
                let mut blocked = false;
                for i in members {
                    let outcome = if blocked {
                        Outcome::Failed(DeliveryError::retryable(
                            crate::NOT_ATTEMPTED,
                            "an earlier event of the same key failed in this batch",
                        ))
                    } else {
                        self.handle(events[i].clone()).await
                    };
                    if let Outcome::Failed(e) = &outcome {
                        blocked |= e.is_retryable();
                    }
                    out.push((i, outcome));
                }
                out
            })
            .buffer_unordered(self.concurrency)
            .collect()
            .await;
        for (i, outcome) in results.into_iter().flatten() {
            outcomes[i] = Some(outcome);
        }
        outcomes
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    Outcome::Failed(DeliveryError::retryable(
                        ErrorCode::HANDLER_PANICKED,
                        "handler produced no outcome",
                    ))
                })
            })
            .collect()
    }
}
