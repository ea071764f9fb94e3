//! `blocked-keys`: the queue table's (`PgStore`) claim when the heads of
//! many keys are blocked, the case its parking of blocked keys exists for.
//!
//! A backlog over [`BLOCKED_KEYS`] keys, then [`DUE`] due events (half
//! without a key, half on fresh keys). Two ways the heads get blocked:
//!
//! - in retry backoff: one relay claims every key's head and settles them
//!   all as retries an hour away, which parks their keys' later events;
//! - leased: one relay claims every key's head and holds the lease; the
//!   other relay's claims park the later events as they meet them.
//!
//! Each is compared with a claim of the same batch on a table that holds
//! only the due events. A claim that returns a blocked event fails the
//! scenario (per-key order would be broken). The event log has no such
//! case: a key's later events wait in the log behind its head, read past
//! by the snapshot window, so this scenario runs the queue table only.

use super::Ctx;
use crate::report::Row;
use crate::setup::{pg_store, EVENT_TYPE, PAYLOAD_BYTES};
use anyhow::{bail, Result};
use outbox_core::{
    ClaimRequest, ErrorCode, LastError, NewEvent, RelayId, Resolution, Settlement, ShardSpec, Store,
};
use outbox_postgres::PgStore;
use std::time::{Duration, Instant};

/// Keys whose heads are blocked.
const BLOCKED_KEYS: u32 = 200;
/// Due events enqueued behind the blocked backlog.
const DUE: u64 = 2_000;
/// Events per claim of the due events.
const BATCH: u32 = 250;
/// Event type of the due events (a claim of anything else is a failure).
const DUE_TYPE: &str = "bench.due";
/// The most claims the leased case makes before giving up.
const MAX_CLAIMS: u32 = 400;

fn req(relay: &str, n: u32) -> ClaimRequest {
    ClaimRequest {
        relay_id: RelayId::new(relay),
        batch_size: n,
        lease: Duration::from_secs(600),
        shard: ShardSpec::ALL,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Enqueues `n` events over [`BLOCKED_KEYS`] keys, 5,000 per transaction.
async fn load_blocked(store: &PgStore, n: u64) -> Result<()> {
    let mut from = 0;
    while from < n {
        let to = (from + 5_000).min(n);
        let events = (from..to).map(|i| {
            NewEvent::new(EVENT_TYPE, "bench", vec![b'x'; PAYLOAD_BYTES])
                .with_key(format!("key-{}", i % u64::from(BLOCKED_KEYS)))
        });
        let mut tx = store.pool().begin().await?;
        store.outbox().enqueue_batch(&mut tx, events).await?;
        tx.commit().await?;
        from = to;
    }
    Ok(())
}

/// Enqueues the [`DUE`] events and runs `ANALYZE` on the table.
async fn enqueue_due(store: &PgStore) -> Result<()> {
    let events = (0..DUE).map(|i| {
        let e = NewEvent::new(DUE_TYPE, "bench", vec![b'y'; PAYLOAD_BYTES]);
        if i % 2 == 0 {
            e
        } else {
            e.with_key(format!("fresh-{i}"))
        }
    });
    let mut tx = store.pool().begin().await?;
    store.outbox().enqueue_batch(&mut tx, events).await?;
    tx.commit().await?;
    let outbox = store.outbox();
    sqlx::raw_sql(&format!(
        "ANALYZE {}.{}",
        outbox.schema().quoted(),
        outbox.table().quoted()
    ))
    .execute(store.pool())
    .await?;
    Ok(())
}

/// Events parked (held back behind their key's blocked head).
async fn parked(store: &PgStore) -> Result<i64> {
    let outbox = store.outbox();
    Ok(sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {}.{} WHERE parked",
        outbox.schema().quoted(),
        outbox.table().quoted()
    ))
    .fetch_one(store.pool())
    .await?)
}

/// Claims `rounds` batches of due events (settling each as delivered) and
/// returns each claim's time; fails if a claim returns a blocked event.
async fn claim_due(store: &PgStore, rounds: u32) -> Result<Vec<Duration>> {
    let mut times = Vec::new();
    for _ in 0..rounds {
        let started = Instant::now();
        let c = store.claim(&req("relay-b", BATCH)).await?;
        times.push(started.elapsed());
        if let Some(e) = c.events.iter().find(|e| e.event_type != DUE_TYPE) {
            bail!("a claim returned {} of a blocked key", e.id);
        }
        let s = c.events.iter().fold(Settlement::new(), |s, e| {
            s.with(e.id, Resolution::Delivered)
        });
        store.settle(c.token, &s).await?;
    }
    Ok(times)
}

/// The longest of `times`, in ms.
fn max_ms(times: &[Duration]) -> f64 {
    ms(times.iter().max().copied().unwrap_or_default())
}

impl Ctx {
    /// `blocked-keys`: see the module docs.
    pub(super) async fn blocked_keys(&mut self) -> Result<()> {
        let n = self.sizes.blocked_backlog;
        let params = |row: Row| {
            row.param("store", "queue")
                .param("backlog", n)
                .param("blocked_keys", BLOCKED_KEYS)
                .param("due", DUE)
                .param("batch", BATCH)
        };

        // Baseline: only the due events in the table.
        let store = pg_store(&self.services, &mut self.res, "blk_base", false, false, 2).await?;
        enqueue_due(&store).await?;
        let base = max_ms(&claim_due(&store, 3).await?);
        store.pool().close().await;
        self.rows.push(params(Row::new(
            "blocked-keys",
            "claim of due events, nothing blocked (max of 3)",
            base,
            "ms",
        )));

        // Heads in retry backoff.
        let store = pg_store(&self.services, &mut self.res, "blk_retry", false, false, 2).await?;
        load_blocked(&store, n).await?;
        let heads = store.claim(&req("relay-a", BLOCKED_KEYS)).await?;
        if heads.events.len() != BLOCKED_KEYS as usize {
            bail!(
                "claimed {} heads, expected {BLOCKED_KEYS}",
                heads.events.len()
            );
        }
        let retry = heads.events.iter().fold(Settlement::new(), |s, e| {
            s.with(
                e.id,
                Resolution::Retry {
                    delay: Duration::from_secs(3600),
                    error: LastError {
                        code: ErrorCode::HANDLER_TEMPORARY_FAILURE,
                        message: "down".into(),
                    },
                },
            )
        });
        let started = Instant::now();
        store.settle(heads.token, &retry).await?;
        let settle = ms(started.elapsed());
        let parked_n = parked(&store).await?;
        self.rows.push(
            params(Row::new(
                "blocked-keys",
                "heads in retry backoff: settle of the retries (parks their keys' later events)",
                settle,
                "ms",
            ))
            .detail("parked", parked_n),
        );
        enqueue_due(&store).await?;
        let claim = max_ms(&claim_due(&store, 3).await?);
        self.rows.push(
            params(Row::new(
                "blocked-keys",
                "heads in retry backoff: claim of due events (max of 3)",
                claim,
                "ms",
            ))
            .against("nothing blocked", base),
        );
        store.pool().close().await;

        // Heads leased by another relay: the claims park what they meet.
        let store = pg_store(&self.services, &mut self.res, "blk_lease", false, false, 2).await?;
        load_blocked(&store, n).await?;
        let heads = store.claim(&req("relay-a", BLOCKED_KEYS)).await?;
        if heads.events.len() != BLOCKED_KEYS as usize {
            bail!(
                "claimed {} heads, expected {BLOCKED_KEYS}",
                heads.events.len()
            );
        }
        enqueue_due(&store).await?;
        let started = Instant::now();
        let mut claims = 0u32;
        loop {
            let c = store.claim(&req("relay-b", BATCH)).await?;
            claims += 1;
            if let Some(e) = c.events.iter().find(|e| e.event_type != DUE_TYPE) {
                bail!("a claim returned {} of a leased key", e.id);
            }
            let got = c.events.len();
            let s = c.events.iter().fold(Settlement::new(), |s, e| {
                s.with(e.id, Resolution::Delivered)
            });
            store.settle(c.token, &s).await?;
            if got == BATCH as usize || claims >= MAX_CLAIMS {
                break;
            }
        }
        let parking = ms(started.elapsed());
        let mut row = params(Row::new(
            "blocked-keys",
            "heads leased: claims until the first full batch of due events (all claims)",
            parking,
            "ms",
        ))
        .detail("claims", claims)
        .detail("parked", parked(&store).await?);
        if claims >= MAX_CLAIMS {
            row = row.note(format!("no full batch after {MAX_CLAIMS} claims"));
        }
        self.rows.push(row);
        let claim = max_ms(&claim_due(&store, 3).await?);
        self.rows.push(
            params(Row::new(
                "blocked-keys",
                "heads leased, later events parked: claim of due events (max of 3)",
                claim,
                "ms",
            ))
            .against("nothing blocked", base),
        );
        store.pool().close().await;
        Ok(())
    }
}
