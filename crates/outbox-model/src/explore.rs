//! A small explicit-state explorer: breadth-first search over every state a
//! [`Model`] can reach, with a set of visited states, a state check after
//! every new state and the shortest trace to the first violation.
//!
//! Breadth-first, so a counterexample is as short as one can be (in steps),
//! and exhaustive: a run that ends without a counterexample and without
//! hitting the state limit has checked every interleaving of the model.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::time::{Duration, Instant};

/// A transition system to explore.
pub trait Model {
    /// A state: everything that decides what can happen next. Two equal
    /// states are explored once.
    type State: Clone + Eq + Hash;
    /// One atomic step of one actor.
    type Action: Copy + fmt::Debug;

    /// The initial state.
    fn initial(&self) -> Self::State;

    /// Pushes every action enabled in `state` onto `out`.
    fn actions(&self, state: &Self::State, out: &mut Vec<Self::Action>);

    /// The state after `action`, or the invariant the step itself breaks
    /// (some invariants are about what happens, e.g. a delivery, not about a
    /// state). Writes a line describing the step to `log` when it is on.
    fn step(
        &self,
        state: &Self::State,
        action: Self::Action,
        log: &mut Log,
    ) -> Result<Self::State, Violation>;

    /// Checks the invariants of one reachable state (including, for states
    /// where the run is complete, what must hold at its end).
    fn check(&self, state: &Self::State, log: &mut Log) -> Result<(), Violation>;
}

/// Where a step writes what it did, for counterexample traces. Off while
/// exploring (no formatting cost), on while replaying a trace.
#[derive(Debug, Default)]
pub struct Log {
    on: bool,
    lines: Vec<String>,
}

impl Log {
    /// A log that records nothing.
    pub fn off() -> Self {
        Log::default()
    }

    /// A log that records every note.
    pub fn on() -> Self {
        Log {
            on: true,
            lines: Vec::new(),
        }
    }

    /// Whether notes are recorded.
    pub fn is_on(&self) -> bool {
        self.on
    }

    /// Records the line `note` builds (only called when the log is on).
    pub fn note(&mut self, note: impl FnOnce() -> String) {
        if self.on {
            self.lines.push(note());
        }
    }

    /// The recorded lines.
    pub fn lines(&self) -> &[String] {
        &self.lines
    }

    /// Takes the recorded lines out.
    pub fn take(&mut self) -> Vec<String> {
        std::mem::take(&mut self.lines)
    }
}

/// Which property a [`Violation`] breaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Invariant {
    /// 1. The stored position passed an event of a committed transaction
    ///    that was never delivered, or a complete run ends with a committed
    ///    event undelivered.
    NoSkip,
    /// 1. An event of an aborted or crash-lost transaction was delivered.
    NoPhantom,
    /// 2. An event was delivered before the first delivery of an event of
    ///    its key that committed before it was inserted (the first copies
    ///    of a key's events arrive out of the key's order).
    KeyOrder,
    /// 2. A complete run delivered a copy of an older event of a key after
    ///    the last delivery of a newer one: a stale copy, not part of a
    ///    replay that delivers the newer event again.
    StaleCopy,
    /// 3. A settle by a relay with a stale epoch moved the stored position,
    ///    or two relays' settles succeeded under one epoch.
    Fencing,
    /// The relays could not drain a quiescent state in a bounded number of
    /// steps (a liveness check of complete runs).
    Drain,
    /// The model left its bounds (more xids than a snapshot holds, ...): a
    /// configuration too large for the model, not a protocol failure.
    Bound,
}

impl fmt::Display for Invariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Invariant::NoSkip => "no skip",
            Invariant::NoPhantom => "no phantom delivery",
            Invariant::KeyOrder => "per-key order",
            Invariant::StaleCopy => "per-key order (no stale copy)",
            Invariant::Fencing => "fencing",
            Invariant::Drain => "drain terminates",
            Invariant::Bound => "model bound",
        })
    }
}

/// A broken invariant and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// The invariant.
    pub invariant: Invariant,
    /// What exactly happened.
    pub detail: String,
}

impl Violation {
    /// A violation of `invariant`.
    pub fn new(invariant: Invariant, detail: impl Into<String>) -> Self {
        Violation {
            invariant,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} violated: {}", self.invariant, self.detail)
    }
}

/// The shortest run found that breaks an invariant.
#[derive(Clone, Debug)]
pub struct Counterexample {
    /// What broke.
    pub violation: Violation,
    /// One line per step from the initial state, then the lines of the
    /// final check (e.g. the drain of a complete run).
    pub trace: Vec<String>,
}

impl fmt::Display for Counterexample {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.violation)?;
        for line in &self.trace {
            writeln!(f, "  {line}")?;
        }
        Ok(())
    }
}

/// What an exploration did.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// Distinct states reached (and checked).
    pub states: usize,
    /// Transitions taken (including those to states already seen).
    pub transitions: usize,
    /// The longest shortest path, in steps.
    pub depth: usize,
    /// Wall-clock time of the exploration.
    pub elapsed: Duration,
    /// True when the state limit stopped the search: then it was NOT
    /// exhaustive.
    pub truncated: bool,
    /// The first violation found, with its trace.
    pub counterexample: Option<Counterexample>,
}

impl Outcome {
    /// Exhaustive and no violation.
    pub fn passed(&self) -> bool {
        !self.truncated && self.counterexample.is_none()
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} states, {} transitions, depth {}, {:.2?}{}",
            self.states,
            self.transitions,
            self.depth,
            self.elapsed,
            if self.truncated { " (TRUNCATED)" } else { "" }
        )?;
        if let Some(c) = &self.counterexample {
            write!(f, "\n{c}")?;
        }
        Ok(())
    }
}

/// A word-at-a-time multiplicative hash (rustc's FxHash): std's SipHash
/// costs more than a whole step in a debug build. Models hash their states
/// as a few `u64` words (see `Hash for protocol::State`).
#[derive(Debug, Default)]
struct WordHasher(u64);

impl WordHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for WordHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.add(u64::from(*b));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
}

type Visited<S> = HashMap<S, u32, BuildHasherDefault<WordHasher>>;

/// How a state was first reached: its parent's index and the action.
struct Node<A> {
    parent: u32,
    action: Option<A>,
    depth: u32,
}

/// Explores every state of `model` reachable from its initial state,
/// breadth-first, stopping at the first violation or after `max_states`
/// distinct states (then [`Outcome::truncated`] is set).
pub fn explore<M: Model>(model: &M, max_states: usize) -> Outcome {
    let start = Instant::now();
    let init = model.initial();
    let mut outcome = Outcome {
        states: 1,
        transitions: 0,
        depth: 0,
        elapsed: Duration::ZERO,
        truncated: false,
        counterexample: None,
    };
    let mut nodes: Vec<Node<M::Action>> = vec![Node {
        parent: u32::MAX,
        action: None,
        depth: 0,
    }];
    if let Err(violation) = model.check(&init, &mut Log::off()) {
        outcome.counterexample = Some(replay(model, &nodes, 0, None, violation));
        outcome.elapsed = start.elapsed();
        return outcome;
    }
    let mut visited: Visited<M::State> = HashMap::default();
    visited.insert(init.clone(), 0);
    let mut queue = VecDeque::from([(init, 0u32)]);
    let mut actions = Vec::new();
    while let Some((state, index)) = queue.pop_front() {
        actions.clear();
        model.actions(&state, &mut actions);
        for &action in &actions {
            outcome.transitions += 1;
            let next = match model.step(&state, action, &mut Log::off()) {
                Ok(next) => next,
                Err(violation) => {
                    outcome.counterexample =
                        Some(replay(model, &nodes, index, Some(action), violation));
                    break;
                }
            };
            if visited.contains_key(&next) {
                continue;
            }
            let depth = nodes[index as usize].depth + 1;
            let Ok(next_index) = u32::try_from(nodes.len()) else {
                outcome.truncated = true;
                break;
            };
            nodes.push(Node {
                parent: index,
                action: Some(action),
                depth,
            });
            outcome.depth = outcome.depth.max(depth as usize);
            if let Err(violation) = model.check(&next, &mut Log::off()) {
                outcome.counterexample = Some(replay(model, &nodes, next_index, None, violation));
                break;
            }
            visited.insert(next.clone(), next_index);
            queue.push_back((next, next_index));
            if nodes.len() >= max_states {
                outcome.truncated = true;
                break;
            }
        }
        if outcome.counterexample.is_some() || outcome.truncated {
            break;
        }
    }
    outcome.states = nodes.len();
    outcome.elapsed = start.elapsed();
    outcome
}

/// Rebuilds the trace to node `index` (plus `last`, the step that broke an
/// invariant, if any) by replaying its actions with the log on.
fn replay<M: Model>(
    model: &M,
    nodes: &[Node<M::Action>],
    index: u32,
    last: Option<M::Action>,
    violation: Violation,
) -> Counterexample {
    let mut path: Vec<M::Action> = last.into_iter().collect();
    let mut at = index;
    while let Some(node) = nodes.get(at as usize) {
        if let Some(action) = node.action {
            path.push(action);
        }
        at = node.parent;
    }
    path.reverse();
    let mut trace = Vec::new();
    let mut state = model.initial();
    for (n, action) in path.iter().enumerate() {
        let mut log = Log::on();
        let result = model.step(&state, *action, &mut log);
        let text = log.take().join("; ");
        trace.push(format!("{:>3}. {text}", n + 1));
        match result {
            Ok(next) => state = next,
            Err(v) => {
                trace.push(format!("     => {v}"));
                return Counterexample { violation, trace };
            }
        }
    }
    let mut log = Log::on();
    if let Err(v) = model.check(&state, &mut log) {
        for line in log.take() {
            trace.push(format!("     {line}"));
        }
        trace.push(format!("     => {v}"));
    }
    Counterexample { violation, trace }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two counters that each go up to 3; the check fails at (3, 3).
    struct Counters {
        bad: (u8, u8),
    }

    impl Model for Counters {
        type State = (u8, u8);
        type Action = u8;

        fn initial(&self) -> (u8, u8) {
            (0, 0)
        }

        fn actions(&self, s: &(u8, u8), out: &mut Vec<u8>) {
            if s.0 < 3 {
                out.push(0);
            }
            if s.1 < 3 {
                out.push(1);
            }
        }

        fn step(&self, s: &(u8, u8), a: u8, log: &mut Log) -> Result<(u8, u8), Violation> {
            log.note(|| format!("bump {a}"));
            Ok(if a == 0 {
                (s.0 + 1, s.1)
            } else {
                (s.0, s.1 + 1)
            })
        }

        fn check(&self, s: &(u8, u8), _log: &mut Log) -> Result<(), Violation> {
            if *s == self.bad {
                return Err(Violation::new(Invariant::NoSkip, "reached"));
            }
            Ok(())
        }
    }

    #[test]
    fn visits_each_state_once() {
        let outcome = explore(&Counters { bad: (9, 9) }, 1_000);
        assert!(outcome.passed());
        assert_eq!(outcome.states, 16);
        assert_eq!(outcome.transitions, 24);
        assert_eq!(outcome.depth, 6);
    }

    #[test]
    fn finds_a_shortest_trace() {
        let outcome = explore(&Counters { bad: (2, 1) }, 1_000);
        let c = outcome.counterexample.expect("reachable");
        assert_eq!(c.trace.len(), 4, "{c}");
        assert!(c.trace[3].contains("reached"));
    }

    #[test]
    fn reports_truncation() {
        let outcome = explore(&Counters { bad: (9, 9) }, 5);
        assert!(outcome.truncated);
        assert!(!outcome.passed());
    }
}
