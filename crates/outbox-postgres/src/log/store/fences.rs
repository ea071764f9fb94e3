//! The fences a claim passes before it hands out events under a lease:
//! the schema version this library knows, the order sequence's cache, and
//! the database the stored positions belong to (`log/anchor.rs`).
//!
//! They run at a store's first claim, whenever a cursor lease is newly
//! taken (a new epoch: after a migration that bumped every epoch, the
//! relay re-checks the schema version before it reads under the new
//! lease), and at least every [`RECHECK_EVERY`](super::guard::RECHECK_EVERY) (a pool repointed at a
//! restored copy keeps its leases). A refusal drops the lease held in
//! memory: nothing claimed under it is settled.

use super::context::Ctx;
use super::cursor::CursorState;
use crate::error::StoreError;
use crate::log::anchor;

/// Runs the fences for cursor state `st`; on a refusal (or an error) the
/// lease held in memory is dropped.
pub(super) async fn check(ctx: &Ctx, st: &mut CursorState) -> Result<(), StoreError> {
    match run(ctx).await {
        Ok(()) => {
            ctx.guard.passed(true);
            st.guarded_epoch = st.epoch();
            Ok(())
        }
        Err(e) => {
            ctx.guard.passed(false);
            if matches!(e, StoreError::Refused(_)) {
                tracing::error!(group = %ctx.group, error = %e, "refusing to claim");
            }
            ctx.cursors.lose(st);
            st.guarded_epoch = None;
            Err(e)
        }
    }
}

/// [`check`] when `st` holds a lease the fences have not passed under yet
/// (newly taken: a new epoch).
pub(super) async fn check_new_lease(ctx: &Ctx, st: &mut CursorState) -> Result<(), StoreError> {
    if st.epoch().is_some() && st.guarded_epoch != st.epoch() {
        check(ctx, st).await?;
    }
    Ok(())
}

/// The fences themselves, on one connection.
pub(super) async fn run(ctx: &Ctx) -> Result<(), StoreError> {
    let mut tx = ctx.db.begin().await?;
    anchor::check_schema(tx.conn(), &ctx.names).await?;
    anchor::check_identity(tx.conn(), &ctx.names).await?;
    tx.commit().await?;
    Ok(())
}
