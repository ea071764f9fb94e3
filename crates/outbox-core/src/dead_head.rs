//! [`DeadHeadPolicy`]: what a dead letter does to the later messages of its
//! key, in the outbox's log and in the inbox alike.

/// What happens to the later messages of a key once its head message was
/// dead-lettered.
///
/// One name and one default for the outbox and the inbox (see
/// ARCHITECTURE.md, "Dead heads"). A store that cannot hold a key (the queue
/// table, SQLite's outbox) always continues.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DeadHeadPolicy {
    /// The next message of the key is delivered (the default: one poison
    /// message does not stop its aggregate; the dead letter waits alone for
    /// an operator, counted and alerted on).
    #[default]
    Continue,
    /// The key stays blocked: its later messages wait until the dead letter
    /// is replayed (then they follow it) or purged. Per-key order is never
    /// broken.
    Block,
}

#[cfg(test)]
mod tests {
    use super::DeadHeadPolicy;

    #[test]
    fn the_default_continues() {
        assert_eq!(DeadHeadPolicy::default(), DeadHeadPolicy::Continue);
    }
}
