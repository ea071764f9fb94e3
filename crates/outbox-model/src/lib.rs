//! An exhaustive model checker of the event-log protocol: this commit adds
//! its explicit-state explorer and PostgreSQL-style snapshots.

pub mod explore;
pub mod snapshot;

pub use explore::{explore, Counterexample, Invariant, Model, Outcome, Violation};
