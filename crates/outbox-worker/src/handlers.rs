//! [`HandlerRegistry`]: a [`Sink`] that dispatches events to in-process async handlers.

use futures::stream::{self, StreamExt};
use futures::FutureExt;
use outbox_core::{DeliveryError, ErrorCode, Event, HandlerError, Outcome, Sink};
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use tokio::task::JoinHandle;
use tracing::Instrument;

type BoxFuture = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send>>;
type Handler = Arc<dyn Fn(Event) -> BoxFuture + Send + Sync>;

/// In-process handlers by event type: the Go worker's dispatch.
///
/// - an event whose type has no handler fails permanently with
///   `HANDLER_NOT_REGISTERED` (dead-lettered, never silently dropped);
/// - a handler's [`HandlerError`] maps to `HANDLER_TEMPORARY_FAILURE` or
///   `HANDLER_PERMANENT_FAILURE`;
/// - a handler that panics fails retryably with `HANDLER_PANICKED`, whether
///   it panics inside its future or synchronously, before it returns its
///   future (both caught with [`std::panic::catch_unwind`]): it is retried
///   like any retryable failure and dead-lettered after `max_attempts`; the
///   relay never dies of it.
///
/// One [`Sink::deliver`] call runs its events concurrently, at most
/// [`HandlerRegistry::with_concurrency`] at a time (default 16). By default
/// the handlers' futures are polled by the delivery itself (no task per
/// event: a handler that returns at once costs no spawn, no cross-thread
/// wake-up); a handler that burns CPU between its awaits should run on its
/// own tokio task, so several of them use several cores:
/// [`HandlerRegistry::with_task_per_event`]. Per-key
/// order is not this sink's job: the [`Relay`](crate::Relay) puts every sink
/// behind [`KeyOrder`](crate::KeyOrder), which hands it at most one event of
/// a key per call and holds back the later events of a key whose event
/// failed. Wrap it in [`KeyOrder`](crate::KeyOrder) yourself when calling it
/// by hand with several events of one key.
///
/// When a delivery is dropped (shutdown grace or the relay's delivery
/// timeout ran out), the handler tasks still running are aborted.
#[derive(Clone)]
pub struct HandlerRegistry {
    handlers: HashMap<String, Handler>,
    concurrency: usize,
    task_per_event: bool,
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
            .field("task_per_event", &self.task_per_event)
            .finish()
    }
}

impl HandlerRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self {
            handlers: HashMap::new(),
            concurrency: 16,
            task_per_event: false,
        }
    }

    /// Whether each handler future runs on its own tokio task (default
    /// `false`: the delivery polls them itself). Turn it on for handlers
    /// that do CPU-heavy work between awaits, so the runtime spreads them
    /// over its worker threads; it costs a spawn and a wake-up per event.
    /// Either way a panic is the event's `HANDLER_PANICKED` failure and a
    /// dropped delivery cancels the handlers still running.
    pub fn with_task_per_event(mut self, on: bool) -> Self {
        self.task_per_event = on;
        self
    }

    /// Most handlers running at the same time within one delivery (default
    /// 16, at least 1).
    pub fn with_concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Handles events of `event_type` with `handler` (replacing any earlier
    /// one).
    ///
    /// ```
    /// use outbox_worker::core::HandlerError;
    /// use outbox_worker::HandlerRegistry;
    ///
    /// let handlers = HandlerRegistry::new().with_handler("order.created", |event| async move {
    ///     if event.payload.is_empty() {
    ///         return Err(HandlerError::permanent("empty payload"));
    ///     }
    ///     Ok(())
    /// });
    /// assert!(handlers.contains("order.created"));
    /// ```
    pub fn with_handler<F, Fut>(mut self, event_type: impl Into<String>, handler: F) -> Self
    where
        F: Fn(Event) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        let handler: Handler = Arc::new(move |event| Box::pin(handler(event)) as BoxFuture);
        self.handlers.insert(event_type.into(), handler);
        self
    }

    /// Whether a handler is registered for `event_type`.
    pub fn contains(&self, event_type: &str) -> bool {
        self.handlers.contains_key(event_type)
    }

    /// Whether no handler is registered.
    pub fn is_empty(&self) -> bool {
        self.handlers.is_empty()
    }

    /// Runs the handler of one event (on its own task if
    /// [`task_per_event`](Self::with_task_per_event)).
    async fn handle(&self, event: Event) -> Outcome {
        let Some(handler) = self.handlers.get(&event.event_type).cloned() else {
            return Outcome::Failed(HandlerError::not_registered(&event.event_type).into());
        };
        let span = delivery_span(&event);
        // A handler may panic before it returns its future: that is the same
        // bug as a panic inside the future and is reported the same way.
        let future =
            match std::panic::catch_unwind(AssertUnwindSafe(|| span.in_scope(|| handler(event)))) {
                Ok(future) => future,
                Err(payload) => return panicked(payload.as_ref()),
            };
        let future = future.instrument(span);
        if !self.task_per_event {
            return match AssertUnwindSafe(future).catch_unwind().await {
                Ok(result) => finished(result),
                Err(payload) => panicked(payload.as_ref()),
            };
        }
        let task = AbortOnDrop(tokio::spawn(future));
        match task.join().await {
            Ok(result) => finished(result),
            Err(join) if join.is_panic() => panicked(join.into_panic().as_ref()),
            Err(_) => Outcome::Failed(DeliveryError::retryable(
                ErrorCode::HANDLER_PANICKED,
                "handler task was cancelled",
            )),
        }
    }
}

/// The span a handler runs in (`tracing::Span::current()` inside the
/// handler): `outbox_deliver`, with the event's id, type and attempt. Its
/// `tracing` parent is the relay's batch span (`outbox_batch`), so logs keep
/// the relay's context. With feature `otel` its OpenTelemetry parent is the
/// producer's span recorded in the event's `traceparent`: the handler's work
/// is part of the request that enqueued the event (a child, not a link; see
/// ARCHITECTURE.md), and `trace_id` names that trace in the logs too.
fn delivery_span(event: &Event) -> tracing::Span {
    let span = tracing::info_span!(
        "outbox_deliver",
        event_id = %event.id,
        event_type = %event.event_type,
        attempt = event.attempts,
        trace_id = tracing::field::Empty,
    );
    // Before the span is first entered.
    #[cfg(feature = "otel")]
    if let Some(trace_id) = outbox_core::trace::continue_trace(&span, &event.headers) {
        span.record("trace_id", tracing::field::display(trace_id));
    }
    span
}

/// The outcome of a handler that returned `result`.
fn finished(result: Result<(), HandlerError>) -> Outcome {
    match result {
        Ok(()) => Outcome::Delivered,
        Err(e) => Outcome::Failed(e.into()),
    }
}

/// The outcome of a handler that panicked with `payload`.
fn panicked(payload: &(dyn std::any::Any + Send)) -> Outcome {
    Outcome::Failed(HandlerError::panicked(payload).into())
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
        // `buffered` keeps the outcomes in the events' order while running up
        // to `concurrency` handlers at once.
        stream::iter(events.iter().cloned())
            .map(|event| self.handle(event))
            .buffered(self.concurrency)
            .collect()
            .await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    fn event(event_type: &str) -> Event {
        Event {
            event_type: event_type.into(),
            ..outbox_testkit::publisher::event("orders", Some("same"), Vec::new())
        }
    }

    #[tokio::test]
    async fn a_synchronous_panic_is_caught_like_an_async_one() {
        for task_per_event in [false, true] {
            panics_are_failures(task_per_event).await;
        }
    }

    async fn panics_are_failures(task_per_event: bool) {
        #[allow(unreachable_code, clippy::diverging_sub_expression)]
        let handlers = HandlerRegistry::new()
            .with_task_per_event(task_per_event)
            .with_handler("sync", |_| {
                panic!("before the future");
                async { Ok(()) }
            })
            .with_handler("async", |_| async { panic!("inside the future") })
            .with_handler("ok", |_| async { Ok(()) });
        let outcomes = handlers
            .deliver(&[event("sync"), event("async"), event("ok")])
            .await;
        let message = |o: &Outcome| match o {
            Outcome::Failed(e) => {
                assert_eq!(*e.code(), ErrorCode::HANDLER_PANICKED);
                assert!(e.is_retryable() && !e.is_sink_unavailable());
                e.message().to_owned()
            }
            other => panic!("expected a failure, got {other:?}"),
        };
        assert_eq!(message(&outcomes[0]), "handler panicked: before the future");
        assert_eq!(message(&outcomes[1]), "handler panicked: inside the future");
        assert_eq!(outcomes[2], Outcome::Delivered);
    }

    #[tokio::test]
    async fn runs_the_events_it_is_given_concurrently_up_to_the_limit() {
        for task_per_event in [false, true] {
            concurrency_is_bounded(task_per_event).await;
        }
    }

    async fn concurrency_is_bounded(task_per_event: bool) {
        let running = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let (r, p) = (Arc::clone(&running), Arc::clone(&peak));
        let handlers = HandlerRegistry::new()
            .with_task_per_event(task_per_event)
            .with_concurrency(3)
            .with_handler("slow", move |_| {
                let (r, p) = (Arc::clone(&r), Arc::clone(&p));
                async move {
                    let now = r.fetch_add(1, Ordering::SeqCst) + 1;
                    p.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    r.fetch_sub(1, Ordering::SeqCst);
                    Ok(())
                }
            });
        let events: Vec<Event> = (0..8).map(|_| event("slow")).collect();
        let outcomes = handlers.deliver(&events).await;
        assert_eq!(outcomes, vec![Outcome::Delivered; 8]);
        let peak = peak.load(Ordering::SeqCst);
        assert!((2..=3).contains(&peak), "peak concurrency {peak}");
    }

    #[tokio::test]
    async fn a_dropped_delivery_cancels_the_handlers_still_running() {
        for task_per_event in [false, true] {
            let finished = Arc::new(AtomicUsize::new(0));
            let f = Arc::clone(&finished);
            let handlers = HandlerRegistry::new()
                .with_task_per_event(task_per_event)
                .with_handler("slow", move |_| {
                    let f = Arc::clone(&f);
                    async move {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        f.fetch_add(1, Ordering::SeqCst);
                        Ok(())
                    }
                });
            let events: Vec<Event> = (0..4).map(|_| event("slow")).collect();
            let cut = tokio::time::timeout(Duration::from_millis(20), handlers.deliver(&events));
            assert!(cut.await.is_err(), "the delivery outran its timeout");
            tokio::time::sleep(Duration::from_millis(250)).await;
            assert_eq!(
                finished.load(Ordering::SeqCst),
                0,
                "a handler ran on after its delivery was dropped (task_per_event = {task_per_event})"
            );
        }
    }
}
