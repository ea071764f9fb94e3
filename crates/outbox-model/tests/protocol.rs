//! Every interleaving of the event-log protocol at small sizes, in CI.
//!
//! The `fixed_*` tests explore the protocol as `outbox-postgres` implements
//! it and must pass exhaustively. The other tests run deliberately broken
//! variants (or conditions the protocol does not cover) and must find a
//! counterexample: a checker that cannot fail proves nothing. Each test
//! prints its state count, depth and time (`--nocapture` to see them).

// Test helpers: they panic on failure and print what they explored.
#![allow(clippy::expect_used, clippy::print_stdout)]

use outbox_model::{
    check, CommitModes, Config, Counterexample, Durability, Invariant, Outcome, Producer, Recovery,
    SharedSnapshots,
};

fn run(name: &str, config: Config) -> Outcome {
    let outcome = check(config).expect("the configuration fits the model");
    println!("{name}: {outcome}");
    outcome
}

fn passes(name: &str, config: Config) {
    let outcome = run(name, config);
    assert!(outcome.passed(), "{name}: {outcome}");
}

fn fails(name: &str, config: Config, invariant: Invariant) -> Counterexample {
    let outcome = run(name, config);
    let c = outcome
        .counterexample
        .unwrap_or_else(|| panic!("{name}: no counterexample found"));
    assert_eq!(c.violation.invariant, invariant, "{name}: {c}");
    c
}

fn contains(c: &Counterexample, text: &str) -> bool {
    c.trace.iter().any(|line| line.contains(text))
}

/// Two producers contending on one key (each may write a business row,
/// taking its xid, before it waits for the key's lock), one relay, one
/// database crash anywhere, batch size 1.
#[test]
fn fixed_protocol_survives_a_database_crash() {
    passes(
        "crash, 1 relay, 2x1 events",
        Config::default().with_crashes(1).with_claims(3),
    );
}

/// A transaction with events of two keys, another on the first key, batches
/// of two (windows cut inside a transaction), one crash.
#[test]
fn fixed_protocol_two_keys_batch_of_two_with_a_crash() {
    passes(
        "crash, 1 relay, [k0,k1]+[k0], batch 2",
        Config::default()
            .with_producers(vec![Producer::new(&[0, 1]), Producer::new(&[0])])
            .with_batch(2)
            .with_crashes(1)
            .with_claims(3),
    );
}

/// Two relays; the holder may pause past its lease at any point (mid-batch
/// included), the other takes over while the old holder still publishes.
#[test]
fn fixed_protocol_lease_takeover_between_two_relays() {
    passes(
        "takeover, 2 relays, 2x1 events",
        Config::default()
            .with_relays(2)
            .with_lease_expiries(1)
            .with_claims(3)
            .with_aborts(false),
    );
}

/// A crash and a takeover in the same run.
#[test]
fn fixed_protocol_crash_and_takeover() {
    passes(
        "crash + takeover, 2 relays",
        Config::default()
            .with_producers(vec![
                Producer::new(&[0]),
                Producer::new(&[0]).with_business_write(false),
            ])
            .with_relays(2)
            .with_lease_expiries(1)
            .with_crashes(1)
            .with_claims(2)
            .with_aborts(false),
    );
}

/// Two events of one key in one transaction (insertion order inside a
/// transaction), batches of two, a takeover.
#[test]
fn fixed_protocol_one_transaction_two_events_of_a_key() {
    passes(
        "takeover, [k0,k0]+[k0], batch 2",
        Config::default()
            .with_producers(vec![
                Producer::new(&[0, 0]),
                Producer::new(&[0]).with_business_write(false),
            ])
            .with_relays(2)
            .with_lease_expiries(1)
            .with_batch(2)
            .with_claims(3)
            .with_aborts(false),
    );
}

/// Empty claims may settle the position they reached (the store's idle
/// progress), so stored floors move without deliveries; one crash.
#[test]
fn fixed_protocol_with_idle_progress_settles() {
    passes(
        "crash, idle settles",
        Config::default()
            .with_producers(vec![
                Producer::new(&[0]),
                Producer::new(&[0]).with_business_write(false),
            ])
            .with_idle_settles(true)
            .with_crashes(1)
            .with_claims(3)
            .with_aborts(false),
    );
}

/// If the claim's commit were flushed (it writes no WAL today, so it is
/// not), events of asynchronously committing producers could not be lost
/// after their delivery: see `async_producer_commits_*` below.
#[test]
fn fixed_protocol_with_flushing_claims_and_async_producers() {
    passes(
        "crash, async producers, sync claims",
        Config::default()
            .with_producer_commits(CommitModes::Both)
            .with_claim_commit(Durability::Sync)
            .with_crashes(1)
            .with_claims(3),
    );
}

/// Relay groups share a round's snapshot between sets; with the proposed
/// fix (the shared snapshot is only used in the incarnation it was taken
/// in) a crash anywhere in the round loses nothing.
#[test]
fn fixed_protocol_shared_snapshots_per_incarnation() {
    passes(
        "crash, shared snapshots per incarnation",
        Config::default()
            .with_shared_snapshots(SharedSnapshots::PerIncarnation)
            .with_crashes(1)
            .with_claims(3)
            .with_aborts(false),
    );
}

/// BROKEN: a relay group's round sharing a snapshot without its
/// incarnation (what `claim_dynamic` did before the shared snapshot carried
/// its token): a claim that found a new incarnation re-acquires and retries
/// with the snapshot (and its floor) from before the crash, and its new
/// position passes a transaction of the new incarnation.
#[test]
fn shared_snapshot_kept_across_a_crash_skips_an_event() {
    let c = fails(
        "shared snapshots unchecked",
        Config::default()
            .with_shared_snapshots(SharedSnapshots::Unchecked)
            .with_crashes(1)
            .with_claims(3),
        Invariant::NoSkip,
    );
    assert!(contains(&c, "from the shared snapshot"), "{c}");
    assert!(contains(&c, "DATABASE CRASH"), "{c}");
}

/// BROKEN: the old `(txid, seq)` order inside a window. A transaction that
/// took its xid (business row) before waiting for the key's lock is read
/// before the one it waited for.
#[test]
fn order_by_txid_breaks_per_key_order() {
    let c = fails(
        "order_by_txid",
        Config::default().with_order_by_txid(true),
        Invariant::KeyOrder,
    );
    assert!(contains(&c, "business row"), "{c}");
}

/// BROKEN: relays keep their in-memory windows across a crash restart.
/// Xids are handed out again below the xmax of those windows, so a new
/// transaction looks already passed.
#[test]
fn no_incarnation_check_skips_an_event_after_a_crash() {
    let c = fails(
        "no_incarnation_check",
        Config::default()
            .with_no_incarnation_check(true)
            .with_crashes(1),
        Invariant::NoSkip,
    );
    assert!(contains(&c, "DATABASE CRASH"), "{c}");
}

/// BROKEN: settles not fenced by the epoch: the old holder published its
/// batch, paused past its lease (its own clock leaves it only the settle),
/// and its settle reaches the database after the takeover: it moves the
/// cursor the new holder owns.
#[test]
fn no_fencing_lets_a_stale_relay_move_the_cursor() {
    let c = fails(
        "no_fencing",
        Config::default()
            .with_relays(2)
            .with_lease_expiries(1)
            .with_no_fencing(true),
        Invariant::Fencing,
    );
    assert!(contains(&c, "runs out"), "{c}");
}

/// A LIMIT OF THE REAL PROTOCOL: a producer committing with
/// `synchronous_commit = off` is visible before its commit is flushed; a
/// claim (whose own commit is not flushed either) reads it, the relay
/// publishes it, and a crash loses the transaction. The event was
/// delivered, its transaction never happened.
#[test]
fn async_producer_commits_are_delivered_then_lost() {
    let c = fails(
        "async producers",
        Config::default()
            .with_producer_commits(CommitModes::Both)
            .with_crashes(1),
        Invariant::NoPhantom,
    );
    assert!(contains(&c, "(Async)"), "{c}");
}

/// AN ASSUMPTION OF THE REAL PROTOCOL: seq floors stored in the cursor are
/// only safe because PostgreSQL never hands out again a sequence value
/// that was handed out before a flush (`nextval` WAL-logs before it
/// returns). With a recovery that restarts the sequence after the highest
/// durably *committed* seq, a stored floor lies above new events.
#[test]
fn floors_need_sequence_values_to_survive_a_crash() {
    let c = fails(
        "last durable commit recovery",
        Config::default()
            .with_producers(vec![
                Producer::new(&[0]).with_business_write(false),
                Producer::new(&[0]).with_business_write(false),
            ])
            .with_aborts(false)
            .with_recovery(Recovery::LastDurableCommit)
            .with_idle_settles(true)
            .with_crashes(1)
            .with_claims(3),
        Invariant::NoSkip,
    );
    assert!(contains(&c, "floors 1/1"), "{c}");
}

/// Why the incarnation check exists: claims commit without a flush. With
/// flushing claims every window a relay holds would only name xids that
/// survive a crash, and the broken variant would pass.
#[test]
fn no_incarnation_check_is_only_needed_because_claims_do_not_flush() {
    passes(
        "no_incarnation_check, sync claims",
        Config::default()
            .with_no_incarnation_check(true)
            .with_claim_commit(Durability::Sync)
            .with_crashes(1)
            .with_claims(3),
    );
}

/// A relay cut from the database (it still reaches the broker, and its
/// lease runs out only while it is cut): its own clock ends its lease
/// before the database's does, so it stops publishing and the relay that
/// takes over never sees its key's newer events followed by a stale copy.
#[test]
fn fixed_protocol_relay_cut_from_the_database_stops_by_its_clock() {
    passes("cut from the database, 2 relays", cut_relay());
}

fn cut_relay() -> Config {
    Config::default()
        .with_producers(vec![
            Producer::new(&[0]),
            Producer::new(&[0]).with_business_write(false),
        ])
        .with_relays(2)
        .with_partitions(1)
        .with_pauses(false)
        .with_lease_expiries(1)
        .with_claims(3)
        .with_aborts(false)
}

/// BROKEN: no lease clock in the relay (a failed renewal only logs): the
/// relay cut from the database publishes the rest of its batch after the
/// new holder delivered the key's newer event, and nothing delivers that
/// event again: a stale copy last.
#[test]
fn no_lease_clock_delivers_a_stale_copy_after_the_new_holder() {
    let c = fails(
        "no lease clock",
        cut_relay().with_no_lease_clock(true),
        Invariant::StaleCopy,
    );
    assert!(contains(&c, "is cut from the database"), "{c}");
    assert!(contains(&c, "without a lease clock it goes on"), "{c}");
}

/// The outbox moves to another cluster whose xid counter and sequence are
/// below the stored positions (a switchover, a restore): the relays refuse
/// to take a lease until the operator re-anchors, and nothing is skipped.
#[test]
fn fixed_protocol_refuses_positions_of_another_cluster() {
    passes(
        "move to another cluster",
        Config::default()
            .with_producers(vec![
                Producer::new(&[0]),
                Producer::new(&[0]).with_business_write(false),
            ])
            .with_moves(1)
            .with_claims(3),
    );
}

/// The move with two relays, one holding the lease (and a batch) across
/// it.
#[test]
fn fixed_protocol_move_with_two_relays() {
    passes(
        "move, 2 relays",
        Config::default()
            .with_producers(vec![
                Producer::new(&[0]),
                Producer::new(&[0]).with_business_write(false),
            ])
            .with_relays(2)
            .with_moves(1)
            .with_claims(3)
            .with_aborts(false),
    );
}

/// BROKEN: positions not tied to their cluster: after the move a relay
/// resumes from the old cluster's stored snapshot, under which the new
/// cluster's first transactions look already delivered.
#[test]
fn no_identity_check_skips_an_event_after_a_move() {
    let c = fails(
        "no identity check",
        Config::default()
            .with_moves(1)
            .with_claims(3)
            .with_no_identity_check(true),
        Invariant::NoSkip,
    );
    assert!(contains(&c, "THE LOG MOVES"), "{c}");
}

/// Larger sizes, not run by default (minutes in a debug build, about 1.5 GB
/// each): `cargo test -p outbox-model --release -- --ignored --nocapture`.
#[test]
#[ignore = "minutes and gigabytes; run with --release -- --ignored"]
fn larger_sizes() {
    passes(
        "crash, 5 claims",
        Config::default().with_crashes(1).with_claims(5),
    );
    passes(
        "two crashes, 4 claims",
        Config::default().with_crashes(2).with_claims(4),
    );
    passes(
        "crash, [k0,k1]+[k1,k0], batch 2, 4 claims",
        Config::default()
            .with_producers(vec![Producer::new(&[0, 1]), Producer::new(&[1, 0])])
            .with_batch(2)
            .with_crashes(1)
            .with_claims(4),
    );
    passes(
        "two crashes, async producers, sync claims, 4 claims",
        Config::default()
            .with_producer_commits(CommitModes::Both)
            .with_claim_commit(Durability::Sync)
            .with_crashes(2)
            .with_claims(4),
    );
    passes(
        "cut from the database + crash, 2 relays",
        cut_relay().with_crashes(1),
    );
    passes(
        "move + crash, 2 relays",
        Config::default()
            .with_relays(2)
            .with_moves(1)
            .with_crashes(1)
            .with_claims(3)
            .with_aborts(false),
    );
    passes(
        "cut (pauses too) + move, 2 relays, 2 claims",
        cut_relay().with_pauses(true).with_moves(1).with_claims(2),
    );
    passes(
        "crash, shared snapshots per incarnation, 4 claims",
        Config::default()
            .with_shared_snapshots(SharedSnapshots::PerIncarnation)
            .with_crashes(1)
            .with_claims(4),
    );
}
