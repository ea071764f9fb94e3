//! The README's demo command, run in an empty directory.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::process::Command;

#[test]
fn demo_delivers_retries_and_dead_letters_in_an_empty_directory() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .arg("demo")
        .current_dir(dir.path())
        .output()
        .expect("cannot start outbox-relay");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "demo failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        dir.path().join("outbox-demo.db").exists(),
        "no SQLite file created"
    );

    let lines: Vec<&str> = stdout.lines().collect();
    let find = |pred: &dyn Fn(&str) -> bool| lines.iter().position(|l| pred(l));

    // Plain deliveries.
    assert!(
        lines
            .iter()
            .filter(|l| l.trim_start().starts_with("delivered  order.created"))
            .count()
            >= 5,
        "{stdout}"
    );
    assert!(
        find(&|l| l.trim_start().starts_with("delivered  order.paid")).is_some(),
        "{stdout}"
    );

    // One event retried, then delivered on its second attempt.
    let retried = find(&|l| {
        l.trim_start().starts_with("retried    order.shipped")
            && l.contains("HANDLER_TEMPORARY_FAILURE")
    })
    .unwrap_or_else(|| panic!("no retry line:\n{stdout}"));
    let id = lines[retried].split_whitespace().nth(2).unwrap();
    let redelivered = find(&|l| {
        l.trim_start().starts_with("delivered  order.shipped")
            && l.contains(id)
            && l.contains("attempt 2")
    })
    .unwrap_or_else(|| panic!("retried event {id} not delivered:\n{stdout}"));
    assert!(retried < redelivered);

    // One dead-lettered for lack of a handler, and listed at the end.
    let dead = find(&|l| {
        l.trim_start().starts_with("dead       order.refunded")
            && l.contains("HANDLER_NOT_REGISTERED")
    })
    .unwrap_or_else(|| panic!("no dead-letter line:\n{stdout}"));
    let dead_id = lines[dead].split_whitespace().nth(2).unwrap();
    let listing = find(&|l| l.starts_with("dead letters (1):")).unwrap();
    assert!(
        lines[listing + 1].starts_with(dead_id)
            && lines[listing + 1].contains("HANDLER_NOT_REGISTERED")
    );

    // The rolled-back order's event never shows.
    let phantom = stdout
        .lines()
        .find(|l| l.contains("rolled back: its event"))
        .and_then(|l| l.split_whitespace().nth(6))
        .unwrap_or_else(|| panic!("no rollback line:\n{stdout}"));
    assert!(!lines
        .iter()
        .any(|l| l.trim_start().starts_with("delivered") && l.contains(phantom)));

    assert!(
        stdout.contains("delivered: 8, retried: 1, dead: 1"),
        "{stdout}"
    );
}
