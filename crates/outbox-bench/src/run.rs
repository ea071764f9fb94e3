//! The measured loops: the real relay, the store and broker ceilings, and
//! the naive baseline.

use crate::probe::{Meter, Usage};
use crate::setup::claimed_event;
use anyhow::{bail, Context, Result};
use outbox_core::{
    ClaimRequest, Event, EventId, Outcome, RelayId, Resolution, Settlement, ShardSpec, Sink, Store,
};
use outbox_postgres::PgStore;
use outbox_worker::{Progress, Relay, RelayOptions, RelaySummary};
use sqlx::Row;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

/// What one measured drain did.
#[derive(Debug, Clone)]
pub(crate) struct Drained {
    /// Events delivered (and marked done, for the loops with a store).
    pub(crate) delivered: u64,
    /// Wall time, CPU and peak RSS of this process meanwhile.
    pub(crate) usage: Usage,
    /// Whether the time cap stopped it before it was done.
    pub(crate) capped: bool,
    /// The first delivery failure seen, if any.
    pub(crate) error: Option<String>,
}

impl Drained {
    /// Events per second.
    pub(crate) fn rate(&self) -> f64 {
        if self.usage.wall_s > 0.0 {
            self.delivered as f64 / self.usage.wall_s
        } else {
            0.0
        }
    }

    /// A note for the report when the run was cut short or saw failures.
    pub(crate) fn note(&self) -> Option<String> {
        let mut parts = Vec::new();
        if self.capped {
            parts.push(format!(
                "stopped at the time cap after {} events",
                self.delivered
            ));
        }
        if let Some(e) = &self.error {
            parts.push(format!("delivery failures, first: {e}"));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// The relay options used by every scenario: the product defaults, with the
/// batch size given and a short poll interval (drains never wait; latency
/// runs are woken by LISTEN/NOTIFY).
pub(crate) fn relay_options(batch: u32, shard: ShardSpec, name: &str) -> RelayOptions {
    relay_options_id(batch, shard, &format!("bench-{name}-{}", shard.index()))
}

/// [`relay_options`] with the relay id given (relays of a relay group all
/// claim [`ShardSpec::ALL`], so the shard cannot tell them apart).
pub(crate) fn relay_options_id(batch: u32, shard: ShardSpec, id: &str) -> RelayOptions {
    RelayOptions::default()
        .with_batch_size(batch)
        .with_shard(shard)
        .with_poll_interval(Duration::from_millis(500))
        .with_relay_id(RelayId::new(id))
}

/// One relay of a [`group_drain`]: its store (a clone of a shared one, or
/// its own instance on its own pool as a separate process would have), the
/// shard it claims, and its id.
pub(crate) struct Member<St> {
    pub(crate) store: St,
    pub(crate) shard: ShardSpec,
    pub(crate) id: String,
}

/// Runs `relays` real relays (shard `i` of `relays` each) over `store` and
/// `sink` until `expected` events were delivered or `cap` passed; the clock
/// stops at the last delivery, then the relays are shut down.
pub(crate) async fn relay_drain<St, Si>(
    store: St,
    sink: Arc<Si>,
    batch: u32,
    relays: u32,
    expected: u64,
    cap: Duration,
) -> Result<Drained>
where
    St: Store + Clone,
    Si: Sink,
{
    let mut members = Vec::new();
    for i in 0..relays {
        let shard = ShardSpec::new(i, relays).context("shard spec")?;
        members.push(Member {
            store: store.clone(),
            shard,
            id: format!("bench-drain-{}", shard.index()),
        });
    }
    let (d, ()) = group_drain(members, sink, batch, expected, cap, async {}).await?;
    Ok(d)
}

/// Runs one real relay per member over `sink` until `expected` events were
/// delivered (by all of them together) or `cap` passed; the clock stops at
/// the last delivery. Then `linger` is awaited with the relays still
/// running (e.g. until a relay group has settled), then the relays are shut
/// down gracefully.
pub(crate) async fn group_drain<St, Si, L>(
    members: Vec<Member<St>>,
    sink: Arc<Si>,
    batch: u32,
    expected: u64,
    cap: Duration,
    linger: L,
) -> Result<(Drained, L::Output)>
where
    St: Store,
    Si: Sink,
    L: Future,
{
    let delivered = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(std::sync::Mutex::new(None::<String>));
    let done = Arc::new(Notify::new());
    // Set before the relays are told to stop: events released at shutdown
    // (only when the time cap cut the drain) are not failures.
    let stopping = Arc::new(AtomicBool::new(false));
    let (stop_tx, stop_rx) = watch::channel(false);
    let meter = Meter::start();
    let mut handles = Vec::new();
    for m in members {
        let (count, done, failures, stopping) = (
            Arc::clone(&delivered),
            Arc::clone(&done),
            Arc::clone(&failures),
            Arc::clone(&stopping),
        );
        let record = move |failures: &std::sync::Mutex<Option<String>>, what: String| {
            if let Ok(mut f) = failures.lock() {
                f.get_or_insert(what);
            }
        };
        let relay = Relay::new(
            m.store,
            Arc::clone(&sink),
            relay_options_id(batch, m.shard, &m.id),
        )?
        .with_listener(move |p| match p {
            Progress::Delivered { .. } if count.fetch_add(1, Ordering::Relaxed) + 1 == expected => {
                done.notify_one();
            }
            Progress::Retried { error, .. } | Progress::Dead { error, .. } => {
                record(&failures, error.to_string());
            }
            Progress::Rejected { reason, .. } => {
                record(&failures, format!("settlement rejected: {reason}"));
            }
            Progress::LeaseLost { ids } => {
                record(&failures, format!("lease lost on {} events", ids.len()));
            }
            Progress::Released { ids } if !stopping.load(Ordering::Relaxed) => {
                record(
                    &failures,
                    format!("{} events released unattempted", ids.len()),
                );
            }
            _ => {}
        });
        let mut stop = stop_rx.clone();
        handles.push(tokio::spawn(relay.run(async move {
            let _ = stop.wait_for(|s| *s).await;
        })));
    }
    let capped = if expected == 0 {
        false
    } else {
        tokio::time::timeout(cap, done.notified()).await.is_err()
    };
    let usage = meter.stop();
    let lingered = linger.await;
    stopping.store(true, Ordering::Relaxed);
    let _ = stop_tx.send(true);
    for h in handles {
        h.await.context("relay task")?;
    }
    let error = failures.lock().ok().and_then(|f| f.clone());
    Ok((
        Drained {
            delivered: delivered.load(Ordering::Relaxed).min(expected),
            usage,
            capped,
            error,
        },
        lingered,
    ))
}

/// A relay running in a task until it is stopped (gracefully: it settles
/// its batch and leaves its relay group) or killed (its task aborted, as a
/// `kill -9` would: no settlement, no leave, its leases run out).
pub(crate) struct Running {
    stop: watch::Sender<bool>,
    task: JoinHandle<RelaySummary>,
}

impl Running {
    /// Starts a relay over `store` and `sink`; every delivery adds one to
    /// `delivered`.
    pub(crate) fn start<St: Store, Si: Sink>(
        store: St,
        sink: Arc<Si>,
        options: RelayOptions,
        delivered: Arc<AtomicU64>,
    ) -> Result<Self> {
        let relay = Relay::new(store, sink, options)?.with_listener(move |p| {
            if let Progress::Delivered { .. } = p {
                delivered.fetch_add(1, Ordering::Relaxed);
            }
        });
        let (stop, mut rx) = watch::channel(false);
        let task = tokio::spawn(relay.run(async move {
            let _ = rx.wait_for(|s| *s).await;
        }));
        Ok(Self { stop, task })
    }

    /// Asks the relay to stop gracefully; [`Running::join`] waits for it.
    pub(crate) fn signal_stop(&self) {
        let _ = self.stop.send(true);
    }

    /// Waits until the relay has stopped (after [`Running::signal_stop`]).
    pub(crate) async fn join(self) -> Result<()> {
        self.task.await.context("relay task")?;
        Ok(())
    }

    /// Stops the relay gracefully and waits for it.
    pub(crate) async fn stop(self) -> Result<()> {
        self.signal_stop();
        self.join().await
    }

    /// Aborts the relay's task and waits until it is gone (its store
    /// dropped with it).
    pub(crate) async fn kill(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

/// The store's raw rate: claim a batch, settle it at once as all delivered
/// (one `settle` call), repeat (no sink, no broker), until the store is
/// empty, `expected` events, or `cap`.
pub(crate) async fn store_ceiling<St: Store>(
    store: &St,
    batch: u32,
    expected: u64,
    cap: Duration,
) -> Result<Drained> {
    let req = ClaimRequest {
        relay_id: RelayId::new("bench-store-ceiling"),
        batch_size: batch,
        lease: Duration::from_secs(60),
        shard: ShardSpec::ALL,
    };
    let meter = Meter::start();
    let mut delivered = 0u64;
    let mut capped = false;
    while delivered < expected {
        if meter.elapsed() > cap {
            capped = true;
            break;
        }
        let claim = store.claim(&req).await.context("claim")?;
        if claim.events.is_empty() {
            break;
        }
        let settlement = claim.events.iter().fold(Settlement::new(), |s, e| {
            s.with(e.id, Resolution::Delivered)
        });
        let report = store
            .settle(claim.token, &settlement)
            .await
            .context("settle")?;
        if let Some(r) = report.rejected.first() {
            bail!(
                "settle rejected {} events, first {}: {}",
                report.rejected.len(),
                r.id,
                r.reason
            );
        }
        if !report.fenced.is_empty() {
            bail!("settle fenced {} events", report.fenced.len());
        }
        delivered += report.applied;
    }
    Ok(Drained {
        delivered,
        usage: meter.stop(),
        capped,
        error: None,
    })
}

/// The broker's raw rate with no database: the publisher's pipelined
/// `deliver` on batches of `batch` in-memory events, `total` events in all.
pub(crate) async fn sink_ceiling<Si: Sink>(
    sink: &Si,
    topic: &str,
    batch: u32,
    total: u64,
    cap: Duration,
) -> Result<Drained> {
    let batch = u64::from(batch.max(1));
    let batches: Vec<Vec<Event>> = (0..total.div_ceil(batch))
        .map(|b| {
            (b * batch..((b + 1) * batch).min(total))
                .map(|i| claimed_event(topic, i))
                .collect()
        })
        .collect();
    // Warm up (connection, metadata, stream lookup) outside the clock.
    let warm: Vec<Event> = (0..batch.min(100))
        .map(|i| claimed_event(topic, i))
        .collect();
    let _ = sink.deliver(&warm).await;
    let meter = Meter::start();
    let mut delivered = 0u64;
    let mut capped = false;
    let mut error = None;
    for events in &batches {
        if meter.elapsed() > cap {
            capped = true;
            break;
        }
        for o in sink.deliver(events).await {
            match o {
                Outcome::Delivered => delivered += 1,
                Outcome::Failed(e) => {
                    error.get_or_insert_with(|| e.to_string());
                }
                other => {
                    error.get_or_insert_with(|| format!("{other:?}"));
                }
            }
        }
    }
    Ok(Drained {
        delivered,
        usage: meter.stop(),
        capped,
        error,
    })
}

/// The naive outbox, labelled as such: in one transaction claim ONE event
/// (`FOR UPDATE SKIP LOCKED LIMIT 1`), deliver it and await the ack, delete
/// it, commit; repeat until `duration` passed or the table is empty.
pub(crate) async fn naive<Si: Sink>(
    store: &PgStore,
    sink: &Si,
    duration: Duration,
) -> Result<Drained> {
    let table = format!(
        "\"{}\".\"{}\"",
        store.outbox().schema().as_str(),
        store.outbox().table().as_str()
    );
    let select = format!(
        "SELECT id, key, event_type, topic, payload, headers::text, created_at, attempts \
         FROM {table} WHERE delivered_at IS NULL AND next_attempt_at <= now() \
         ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED"
    );
    let delete = format!("DELETE FROM {table} WHERE id = $1");
    let meter = Meter::start();
    let mut delivered = 0u64;
    let mut error = None;
    while meter.elapsed() < duration {
        let mut tx = store.pool().begin().await?;
        let Some(row) = sqlx::query(&select).fetch_optional(&mut *tx).await? else {
            break;
        };
        let id: uuid::Uuid = row.try_get(0)?;
        let headers: String = row.try_get(5)?;
        let attempts: i32 = row.try_get(7)?;
        let created_at: chrono::DateTime<chrono::Utc> = row.try_get(6)?;
        let event = Event {
            id: EventId::from_uuid(id),
            key: row.try_get(1)?,
            event_type: row.try_get(2)?,
            topic: row.try_get(3)?,
            payload: row.try_get(4)?,
            headers: serde_json::from_str::<BTreeMap<String, String>>(&headers)?,
            created_at,
            attempts: u32::try_from(attempts).unwrap_or(0) + 1,
            next_attempt_at: created_at,
            last_error: None,
        };
        let outcome = sink.deliver(std::slice::from_ref(&event)).await;
        match outcome.first() {
            Some(Outcome::Delivered) => {
                sqlx::query(&delete).bind(id).execute(&mut *tx).await?;
                tx.commit().await?;
                delivered += 1;
            }
            Some(Outcome::Failed(e)) => {
                error.get_or_insert_with(|| e.to_string());
                tx.rollback().await?;
            }
            Some(other) => {
                error.get_or_insert_with(|| format!("{other:?}"));
                tx.rollback().await?;
            }
            None => {
                tx.rollback().await?;
            }
        }
    }
    Ok(Drained {
        delivered,
        usage: meter.stop(),
        capped: false,
        error,
    })
}
