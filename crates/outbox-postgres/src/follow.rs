//! A pool of the application's own that follows a primary that moves:
//! [`PgHosts::connect_pool`]. The stores follow their hosts inside their
//! own statements (`hosts.rs`, [`Failover`]); a pool handed to code that
//! runs its own statements (the application's, the inbox's `PgInbox`)
//! follows them from outside: a task asks the server the pool is on for
//! its role every `CHECK_EVERY` and re-points the pool when it does not
//! answer or no longer fits, and a connection opened before the pool was
//! re-pointed is closed instead of being handed out again.

use crate::error::StoreError;
use crate::hosts::{Failover, PgHosts};
use crate::pool::first_fitting_host;
use sqlx::postgres::{PgPool, PgPoolOptions};
use std::sync::Arc;
use std::time::Duration;

/// How often a followed pool asks its server for its role.
pub(crate) const CHECK_EVERY: Duration = Duration::from_millis(500);
/// How long the server gets to answer that question.
const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

impl PgHosts {
    /// A pool that follows these hosts, for statements the stores do not
    /// run: the application's own, or a consumer's (`outbox_inbox::PgInbox`
    /// takes a pool). The first host that fits
    /// [`PgHosts::target_session_attrs`] is connected to (probed in the
    /// URL's order, again until `connect_timeout` while none does, as the
    /// stores do); from then on a task asks the pool's server for its role
    /// every half second and, when it does not answer within a second
    /// or no longer fits (a standby, a read-only primary), probes the
    /// hosts and points the pool at the one that fits (one WARN line). A
    /// connection opened before that is closed when it next leaves the
    /// pool, so a statement after a failover runs on the new primary; a
    /// statement that was running on the old one fails, as it would
    /// without the pool (retry it; the inbox does).
    ///
    /// `options` are the pool's own settings (size, timeouts); its
    /// `before_acquire` hook is this function's. One host without
    /// `target_session_attrs` is connected to as the driver does, with no
    /// task. The task ends when the pool is closed ([`PgPool::close`]).
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), outbox_postgres::StoreError> {
    /// use outbox_postgres::{sqlx::postgres::PgPoolOptions, PgHosts};
    /// use std::time::Duration;
    /// let hosts = PgHosts::parse(
    ///     "postgres://app@10.0.0.1:5432,10.0.0.2:5432/orders?target_session_attrs=read-write",
    /// )?;
    /// let pool = hosts
    ///     .connect_pool(PgPoolOptions::new().max_connections(8), Duration::from_secs(10))
    ///     .await?;
    /// # drop(pool); Ok(()) }
    /// ```
    pub async fn connect_pool(
        &self,
        options: PgPoolOptions,
        connect_timeout: Duration,
    ) -> Result<PgPool, StoreError> {
        let (connect, current) = first_fitting_host(self, connect_timeout).await?;
        if !self.follows() {
            return Ok(options.connect_lazy_with(connect));
        }
        let failover = Failover::new(self.clone(), current);
        let gate = Arc::clone(&failover);
        let pool = options
            .before_acquire(move |_, meta| {
                let keep = !gate.opened_before_repoint(meta.age);
                Box::pin(async move { Ok(keep) })
            })
            .connect_lazy_with(connect);
        let followed = pool.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(CHECK_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                if followed.is_closed() {
                    return;
                }
                failover.check(&followed, CHECK_TIMEOUT).await;
            }
        });
        Ok(pool)
    }
}
