//! [`SendWindow`]: pipelined sends with a bounded number in flight.

use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use outbox_core::{DeliveryError, Outcome};
use std::future::Future;

/// What sending one item gave: a result already (refused before it reached
/// the broker), or the future of its acknowledgement.
#[derive(Debug)]
pub enum Sent<O, F> {
    /// Final without an acknowledgement (refused locally, or not sent).
    Done(O),
    /// Handed to the broker; the future resolves with the acknowledgement.
    InFlight(F),
}

/// A per-item result a [`SendWindow`] can reason about: whether it says the
/// sink is unavailable, and how to report an item that was not sent
/// because of that. [`Outcome`] is one; a publisher that must look at all
/// acknowledgements together before deciding (AMQP returns) uses its own.
pub trait WindowResult: Sized {
    /// The sink-level failure this result reports, if it does.
    fn sink_unavailable(&self) -> Option<&DeliveryError>;
    /// The result of an item that was not sent because the sink became
    /// unavailable earlier in the batch.
    fn not_sent(error: DeliveryError) -> Self;
}

impl WindowResult for Outcome {
    fn sink_unavailable(&self) -> Option<&DeliveryError> {
        match self {
            Outcome::Failed(e) if e.is_sink_unavailable() => Some(e),
            _ => None,
        }
    }

    fn not_sent(error: DeliveryError) -> Self {
        Outcome::Failed(error)
    }
}

/// Sends a batch pipelined: each item is handed to the broker without
/// waiting for the previous one's acknowledgement, at most `max_in_flight`
/// acknowledgements are outstanding (a slot frees as soon as any of them
/// arrives), and all of them are awaited before the batch returns. Results
/// come back in the items' order, one per item.
///
/// When a result reports the sink unavailable
/// ([`WindowResult::sink_unavailable`]), the items not yet sent are not
/// sent: they get that same failure ([`WindowResult::not_sent`]), which is
/// nobody's attempt. Items already in flight are still awaited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWindow {
    max_in_flight: usize,
}

impl SendWindow {
    /// A window of at most `max_in_flight` outstanding acknowledgements (at least 1).
    pub fn new(max_in_flight: usize) -> Self {
        Self {
            max_in_flight: max_in_flight.max(1),
        }
    }

    /// The bound.
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    /// Sends every item of `items` with `send` and awaits the acknowledgements.
    pub async fn run<'i, T, O, F, S, SF>(&self, items: &'i [T], mut send: S) -> Vec<O>
    where
        S: FnMut(&'i T) -> SF,
        SF: Future<Output = Sent<O, F>>,
        F: Future<Output = O>,
        O: WindowResult,
    {
        let mut results: Vec<Option<O>> =
            std::iter::repeat_with(|| None).take(items.len()).collect();
        let mut in_flight = FuturesUnordered::new();
        let mut stop: Option<DeliveryError> = None;
        for (i, item) in items.iter().enumerate() {
            // Collect what has already been acknowledged, then wait for a
            // slot if the window is full.
            while let Some(Some((j, o))) = in_flight.next().now_or_never() {
                settle(&mut results, &mut stop, j, o);
            }
            while stop.is_none() && in_flight.len() >= self.max_in_flight {
                if let Some((j, o)) = in_flight.next().await {
                    settle(&mut results, &mut stop, j, o);
                }
            }
            if let Some(e) = &stop {
                results[i] = Some(O::not_sent(e.clone()));
                continue;
            }
            match send(item).await {
                Sent::Done(o) => settle(&mut results, &mut stop, i, o),
                Sent::InFlight(ack) => in_flight.push(ack.map(move |o| (i, o))),
            }
        }
        while let Some((j, o)) = in_flight.next().await {
            settle(&mut results, &mut stop, j, o);
        }
        let fallback = || {
            DeliveryError::unavailable(
                outbox_core::ErrorCode::PUBLISH_CONNECTION_LOST,
                "no result for this event (internal error)",
            )
        };
        results
            .into_iter()
            .map(|o| o.unwrap_or_else(|| O::not_sent(fallback())))
            .collect()
    }
}

/// Records result `o` of item `i`; the first sink-level failure stops the sends.
fn settle<O: WindowResult>(
    results: &mut [Option<O>],
    stop: &mut Option<DeliveryError>,
    i: usize,
    o: O,
) {
    if stop.is_none() {
        *stop = o.sink_unavailable().cloned();
    }
    results[i] = Some(o);
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::ErrorCode;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    fn unavailable() -> Outcome {
        Outcome::Failed(DeliveryError::unavailable(
            ErrorCode::PUBLISH_CONNECTION_LOST,
            "down",
        ))
    }

    #[tokio::test(start_paused = true)]
    async fn results_keep_item_order_and_in_flight_stays_bounded() {
        let items: Vec<u64> = (0..50).collect();
        let live = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let outcomes = SendWindow::new(8)
            .run(&items, |n| {
                let (live, peak) = (live.clone(), peak.clone());
                async move {
                    let now = live.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    // Later items are acknowledged sooner: completion order
                    // differs from item order.
                    let delay = Duration::from_millis(100 - *n);
                    Sent::InFlight(async move {
                        tokio::time::sleep(delay).await;
                        live.fetch_sub(1, Ordering::SeqCst);
                        if n % 7 == 3 {
                            Outcome::Failed(DeliveryError::permanent(
                                ErrorCode::PUBLISH_TOO_LARGE,
                                n.to_string(),
                            ))
                        } else {
                            Outcome::Delivered
                        }
                    })
                }
            })
            .await;
        assert_eq!(outcomes.len(), 50);
        for (n, o) in items.iter().zip(&outcomes) {
            match o {
                Outcome::Failed(e) => assert_eq!((n % 7, e.message()), (3, n.to_string().as_str())),
                o => assert!(o.is_delivered() && n % 7 != 3, "{n}: {o:?}"),
            }
        }
        assert_eq!(peak.load(Ordering::SeqCst), 8, "window bound");
    }

    #[tokio::test]
    async fn after_the_sink_is_unavailable_the_rest_is_not_sent() {
        let items: Vec<u32> = (0..10).collect();
        let sent = AtomicUsize::new(0);
        let outcomes = SendWindow::new(4)
            .run(&items, |n| {
                sent.fetch_add(1, Ordering::SeqCst);
                async move {
                    if *n == 2 {
                        Sent::Done(unavailable())
                    } else {
                        Sent::InFlight(futures::future::ready(Outcome::Delivered))
                    }
                }
            })
            .await;
        assert_eq!(sent.load(Ordering::SeqCst), 3, "items after #2 not sent");
        assert!(outcomes[..2].iter().all(Outcome::is_delivered));
        for o in &outcomes[2..] {
            assert_eq!(o, &unavailable());
        }
    }

    #[tokio::test]
    async fn an_unavailable_acknowledgement_stops_the_sends_too() {
        let items: Vec<u32> = (0..6).collect();
        let sent = AtomicUsize::new(0);
        let outcomes = SendWindow::new(1)
            .run(&items, |n| {
                sent.fetch_add(1, Ordering::SeqCst);
                let o = if *n == 1 {
                    unavailable()
                } else {
                    Outcome::Delivered
                };
                async move { Sent::InFlight(futures::future::ready(o)) }
            })
            .await;
        assert_eq!(sent.load(Ordering::SeqCst), 2);
        assert!(outcomes[0].is_delivered());
        assert!(outcomes[1..].iter().all(|o| o == &unavailable()));
    }

    #[tokio::test]
    async fn empty_batch() {
        let none: [u8; 0] = [];
        let outcomes: Vec<Outcome> = SendWindow::new(0)
            .run(&none, |_| async {
                Sent::<_, futures::future::Ready<Outcome>>::Done(Outcome::Delivered)
            })
            .await;
        assert!(outcomes.is_empty());
    }
}
