//! The cases. Each takes a fresh harness.

mod claim;
mod dead_letters;
mod enqueue;
mod held;
mod order;
mod settle;
mod support;

pub use self::claim::*;
pub use self::dead_letters::*;
pub use self::enqueue::*;
pub use self::held::*;
pub use self::order::*;
pub use self::settle::*;
