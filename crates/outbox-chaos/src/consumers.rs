//! The inbox consumer processes of an end-to-end run (`run --inbox`):
//! started as `outbox-chaos inbox-consumer` (this binary), killed with
//! `kill -9` and started again by the `consumer-kill` fault, restarted
//! when they exit by themselves (reported), always killed when dropped;
//! and the reader of their business table (`effects`), which is what
//! "arrived" means in such a run.

use crate::inbox::{pg_effects, read_counts, Counts, SQLITE_EFFECTS};
use crate::record::{Arrival, Ledger};
use crate::relays::log_tail;
use anyhow::{Context as _, Result};
use std::collections::HashSet;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio::sync::watch;
use uuid::Uuid;

/// How to start one consumer process.
#[derive(Debug, Clone)]
pub(crate) struct ConsumerSpec {
    /// This binary.
    pub(crate) bin: PathBuf,
    /// `inbox-consumer` arguments without `--counts`.
    pub(crate) args: Vec<String>,
    /// Where the logs and counts files go.
    pub(crate) dir: PathBuf,
}

#[derive(Debug)]
struct Slot {
    /// `None` between a kill and its restart.
    child: Option<Child>,
    generation: u32,
}

/// The consumer processes; killed when dropped.
#[derive(Debug)]
pub(crate) struct Consumers {
    spec: ConsumerSpec,
    slots: Vec<Slot>,
}

impl Consumers {
    /// Starts `n` consumers.
    pub(crate) fn start(spec: ConsumerSpec, n: usize) -> Result<Self> {
        let mut slots = Vec::with_capacity(n);
        for i in 0..n {
            slots.push(Slot {
                child: Some(spawn(&spec, i, 0)?),
                generation: 0,
            });
        }
        Ok(Self { spec, slots })
    }

    /// How many there are.
    pub(crate) fn len(&self) -> usize {
        self.slots.len()
    }

    /// `kill -9` consumer `i` (it stays down until [`Consumers::restart`]).
    pub(crate) async fn kill(&mut self, i: usize) -> Result<()> {
        if let Some(mut child) = self.slots[i].child.take() {
            child.start_kill().context("kill -9")?;
            let _ = child.wait().await;
        }
        Ok(())
    }

    /// Starts consumer `i` again (a new generation, its own counts file).
    pub(crate) fn restart(&mut self, i: usize) -> Result<()> {
        let slot = &mut self.slots[i];
        slot.generation += 1;
        slot.child = Some(spawn(&self.spec, i, slot.generation)?);
        Ok(())
    }

    /// Consumers that exited by themselves since the last call (not the
    /// ones a fault killed): restarts each, returns a line per exit.
    pub(crate) fn reap_and_restart(&mut self) -> Result<Vec<String>> {
        let mut exits = Vec::new();
        for i in 0..self.slots.len() {
            let status = match self.slots[i].child.as_mut() {
                Some(c) => c.try_wait()?,
                None => None,
            };
            if let Some(status) = status {
                let tail = log_tail(&log_path(&self.spec.dir, i), 5);
                exits.push(format!(
                    "consumer-{i} (generation {}) exited by itself ({status}); log tail:\n{tail}",
                    self.slots[i].generation
                ));
                self.restart(i)?;
            }
        }
        Ok(exits)
    }

    /// SIGTERM to every consumer (they finish their transactions in flight
    /// and write their last counts), up to `grace` each, then kill.
    pub(crate) async fn shutdown(&mut self, grace: Duration) {
        for slot in &self.slots {
            if let Some(pid) = slot.child.as_ref().and_then(Child::id) {
                let _ = Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status()
                    .await;
            }
        }
        for slot in &mut self.slots {
            if let Some(child) = slot.child.as_mut() {
                if tokio::time::timeout(grace, child.wait()).await.is_err() {
                    let _ = child.start_kill();
                    let _ = child.wait().await;
                }
            }
        }
    }

    /// The counts of every process the run started: the sum, and whether
    /// each wrote its last counts (a process killed with `kill -9` did
    /// not: its last 500 ms are missing).
    pub(crate) fn counts(&self) -> Counts {
        sum_counts(&self.spec.dir, self.slots.iter().map(|s| s.generation))
    }
}

/// The sum of the counts files of consumers `0..` with their generations.
fn sum_counts(dir: &Path, generations: impl Iterator<Item = u32>) -> Counts {
    let mut total = Counts {
        last: true,
        ..Counts::default()
    };
    for (i, last_gen) in generations.enumerate() {
        for g in 0..=last_gen {
            let c = read_counts(&counts_path(dir, i, g)).unwrap_or_default();
            total = total.add(c);
        }
    }
    total
}

fn log_path(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("consumer-{i}.log"))
}

fn counts_path(dir: &Path, i: usize, generation: u32) -> PathBuf {
    dir.join(format!("consumer-{i}-g{generation}.counts.json"))
}

fn spawn(spec: &ConsumerSpec, i: usize, generation: u32) -> Result<Child> {
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path(&spec.dir, i))
        .context("opening the consumer log")?;
    let err = log.try_clone()?;
    Command::new(&spec.bin)
        .arg("inbox-consumer")
        .args(&spec.args)
        .arg("--counts")
        .arg(counts_path(&spec.dir, i, generation))
        .env(
            "RUST_LOG",
            std::env::var("CHAOS_CONSUMER_LOG").unwrap_or_else(|_| "info".to_owned()),
        )
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {} inbox-consumer", spec.bin.display()))
}

/// The consumers' database, as the run reads it.
#[derive(Debug, Clone)]
pub(crate) enum EffectsDb {
    /// PostgreSQL, the table in this schema.
    Postgres { pool: sqlx::PgPool, schema: String },
    /// A SQLite file.
    Sqlite { pool: sqlx::SqlitePool },
}

/// One effect row.
type Row = (i64, Uuid, String, i64, i64);

impl EffectsDb {
    /// Effect rows with a serial above `after`, in serial order.
    async fn rows_after(&self, after: i64) -> Result<Vec<Row>> {
        match self {
            Self::Postgres { pool, schema } => Ok(sqlx::query_as(&format!(
                "SELECT serial, event_id, key, seq, at_us FROM {} WHERE serial > $1 ORDER BY serial",
                pg_effects(schema)
            ))
            .bind(after)
            .fetch_all(pool)
            .await?),
            Self::Sqlite { pool } => {
                let rows: Vec<(i64, String, String, i64, i64)> = sqlx::query_as(&format!(
                    "SELECT serial, event_id, key, seq, at_us FROM {SQLITE_EFFECTS} WHERE serial > ? ORDER BY serial"
                ))
                .bind(after)
                .fetch_all(pool)
                .await?;
                rows.into_iter()
                    .map(|(s, id, k, q, at)| Ok((s, id.parse()?, k, q, at)))
                    .collect()
            }
        }
    }

    /// Every effect, in insertion (serial) order, as the checker's arrivals.
    pub(crate) async fn arrivals(&self) -> Result<Vec<Arrival>> {
        Ok(self
            .rows_after(0)
            .await
            .context("reading the effects")?
            .into_iter()
            .map(|(_, id, key, seq, at_us)| Arrival {
                id,
                key,
                seq: u64::try_from(seq).unwrap_or(0),
                at_us,
            })
            .collect())
    }
}

/// Serials a transaction may still commit below the highest one seen: a
/// serial is taken at insert time, so a row can become visible after rows
/// with higher serials (its transaction committed later). The follower
/// reads again from this far back and ignores the rows it has.
const LATE_COMMIT_MARGIN: i64 = 8192;

/// Follows the effects table until `stop`, telling the ledger of every
/// event that has an effect (the run's progress and its drain). With
/// `full` on (the drain), each pass reads the whole table, so that no late
/// commit is missed.
pub(crate) async fn follow(
    db: EffectsDb,
    ledger: Arc<Ledger>,
    full: Arc<std::sync::atomic::AtomicBool>,
    mut stop: watch::Receiver<bool>,
) {
    let mut seen: HashSet<i64> = HashSet::new();
    let mut top = 0i64;
    loop {
        let from = if full.load(std::sync::atomic::Ordering::Relaxed) {
            0
        } else {
            (top - LATE_COMMIT_MARGIN).max(0)
        };
        match db.rows_after(from).await {
            Ok(rows) => {
                for (serial, id, ..) in rows {
                    if seen.insert(serial) {
                        ledger.arrived(id);
                        top = top.max(serial);
                    }
                }
            }
            Err(e) => eprintln!("chaos: reading the effects: {e:#}"),
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(300)) => {}
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn counts_of_every_generation_are_summed() {
        let dir = std::env::temp_dir().join(format!("chaos-consumers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let w = |i, g, handled, duplicates, last| {
            let c = Counts {
                handled,
                duplicates,
                last,
                ..Counts::default()
            };
            std::fs::write(counts_path(&dir, i, g), serde_json::to_vec(&c).unwrap()).unwrap();
        };
        w(0, 0, 10, 1, false); // killed
        w(0, 1, 5, 2, true);
        w(1, 0, 7, 3, true);
        let c = sum_counts(&dir, [1, 0].into_iter());
        assert_eq!((c.handled, c.duplicates, c.last), (22, 6, false));
        let c = sum_counts(&dir, [0].into_iter());
        assert_eq!((c.handled, c.last), (10, false));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
