//! Runs the example as its README says, against the loopback PostgreSQL and
//! NATS: a schema and a JetStream stream of this test alone.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use outbox_testkit::nats::NatsFixture;
use std::process::Command;

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Runs `orders ARGS` with the test's settings; returns its stdout.
fn orders(schema: &str, prefix: &str, nats: &str, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_orders"))
        .args(args)
        .env("DATABASE_URL", database_url())
        .env("ORDERS_SCHEMA", schema)
        .env("NATS_URL", nats)
        .env("NATS_SUBJECT_PREFIX", prefix)
        .output()
        .expect("run the orders binary");
    assert!(
        out.status.success(),
        "orders {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placed_orders_reach_the_stream_in_order_with_their_event_ids() {
    let nats = NatsFixture::new().await;
    let prefix = nats
        .subject(&nats.topic())
        .strip_suffix(".orders")
        .expect("the fixture captures topic `orders`")
        .to_owned();
    let schema = format!("orders_example_{}", std::process::id());

    // Each `place` is one transaction: order row + event.
    let mut placed = Vec::new();
    for (customer, total) in [("alice", "1999"), ("bob", "500"), ("alice", "2500")] {
        let line = orders(&schema, &prefix, nats.url(), &["place", customer, total]);
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(words.len(), 4, "unexpected output {line:?}");
        placed.push((customer, total, words[1].to_owned(), words[3].to_owned()));
    }
    // Refused input names the problem, writes nothing.
    let bad = Command::new(env!("CARGO_BIN_EXE_orders"))
        .args(["place", "carol", "12.50"])
        .env("DATABASE_URL", database_url())
        .env("ORDERS_SCHEMA", &schema)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("TOTAL_CENTS must be a whole number"));

    let summary = orders(&schema, &prefix, nats.url(), &["relay", "--until-idle"]);
    assert_eq!(summary.trim(), "delivered 3 retried 0 dead 0");

    let received = nats.drain(3).await;
    assert_eq!(
        received.len(),
        3,
        "the stream holds exactly the three events"
    );
    let alice: Vec<_> = received
        .iter()
        .filter(|m| m.key.as_deref() == Some("customer-alice"))
        .map(|m| {
            serde_json::from_slice::<serde_json::Value>(&m.payload).unwrap()["total_cents"].clone()
        })
        .collect();
    assert_eq!(
        alice,
        [serde_json::json!(1999), serde_json::json!(2500)],
        "alice's orders in the order placed"
    );
    for (customer, total, order, event) in &placed {
        let m = received
            .iter()
            .find(|m| m.message_id.map(|id| id.to_string()).as_deref() == Some(event.as_str()))
            .unwrap_or_else(|| panic!("event {event} of {customer}'s order not in the stream"));
        let body: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        assert_eq!(body["order_id"].to_string(), *order);
        assert_eq!(body["total_cents"].to_string(), *total);
        assert_eq!(m.event_type.as_deref(), Some("order.placed"));
    }

    // The billing service: one invoice per order, exactly once.
    let stream = nats.stream().to_owned();
    let billed = orders(
        &schema,
        &prefix,
        nats.url(),
        &["billing", "--stream", &stream, "--until-idle"],
    );
    assert_eq!(billed.trim(), "invoiced 3 duplicates 0 dead 0");
    // The whole stream again (its consumer deleted, as after a lost
    // consumer state): every message is recognised, nothing invoiced twice.
    nats.jetstream()
        .get_stream(&stream)
        .await
        .unwrap()
        .delete_consumer("billing")
        .await
        .unwrap();
    let again = orders(
        &schema,
        &prefix,
        nats.url(),
        &["billing", "--stream", &stream, "--until-idle"],
    );
    assert_eq!(again.trim(), "invoiced 0 duplicates 3 dead 0");
    let pool = outbox_postgres::sqlx::PgPool::connect(&database_url())
        .await
        .unwrap();
    let invoices: Vec<(i64, String, i64)> = outbox_postgres::sqlx::query_as(&format!(
        "SELECT order_id, customer, total_cents FROM {schema}.invoices ORDER BY id"
    ))
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut expected: Vec<(i64, String, i64)> = placed
        .iter()
        .map(|(c, t, o, _)| (o.parse().unwrap(), (*c).to_owned(), t.parse().unwrap()))
        .collect();
    let mut got = invoices.clone();
    got.sort();
    expected.sort();
    assert_eq!(got, expected, "one invoice per order");

    nats.cleanup().await;
    let pool = outbox_postgres::sqlx::PgPool::connect(&database_url())
        .await
        .unwrap();
    outbox_postgres::sqlx::query(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
}
