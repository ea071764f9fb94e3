//! Keys are validated at enqueue, the same on every store: a control
//! character (CR, LF, NUL, ...) in the key, the event type, the topic or a
//! header is refused with `ValidationError::ControlCharacter` naming the
//! field, so no event can inject a header into a broker message; a batch
//! holding one such event writes nothing. Written once, generic over the
//! store ([`App`]), run on SQLite and PostgreSQL.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_core::{EventField, NewEvent, ValidationError};
use outbox_tests::{App, OutboxRows, PostgresApp, SqliteApp};

fn ok(n: u32) -> NewEvent {
    NewEvent::new(
        "order.created",
        "orders",
        format!("{{\"n\":{n}}}").into_bytes(),
    )
    .with_key(format!("order-{n}"))
}

async fn control_characters_are_refused_at_enqueue<A: App>() {
    let app = A::start().await;
    let cases: Vec<(NewEvent, EventField, u32)> = vec![
        (
            ok(1).with_key("order-1\r\nOutbox-Event-Type: forged"),
            EventField::Key,
            0x0D,
        ),
        (ok(2).with_key("order-2\n"), EventField::Key, 0x0A),
        (ok(3).with_key("order\u{0}3"), EventField::Key, 0),
        (
            NewEvent::new("order.created\r\nX: y", "orders", b"{}".to_vec()),
            EventField::EventType,
            0x0D,
        ),
        (
            NewEvent::new("order.created", "orders\n", b"{}".to_vec()),
            EventField::Topic,
            0x0A,
        ),
        (
            ok(4).with_header("x-tenant", "acme\r\nOutbox-Key: forged"),
            EventField::HeaderValue("x-tenant".into()),
            0x0D,
        ),
    ];
    for (event, field, code) in cases {
        let got = app.try_enqueue(vec![ok(100), event]).await;
        match got {
            Err(ValidationError::ControlCharacter {
                field: f, code: c, ..
            }) => assert_eq!((f, c), (field.clone(), code), "{}", A::NAME),
            other => panic!(
                "{}: {field} with U+{code:04X}: expected ControlCharacter, got {other:?}",
                A::NAME
            ),
        }
    }
    assert_eq!(
        app.outbox_rows().await,
        OutboxRows { events: 0, dead: 0 },
        "{}: a refused batch writes nothing",
        A::NAME
    );
    // Printable keys with spaces and non-ASCII letters are fine.
    let ids = app
        .try_enqueue(vec![ok(5).with_key("customer 42 / Zoë")])
        .await
        .unwrap();
    assert_eq!(ids.len(), 1);
    assert_eq!(app.outbox_rows().await.events, 1);
    app.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sqlite_refuses_control_characters() {
    control_characters_are_refused_at_enqueue::<SqliteApp>().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_refuses_control_characters() {
    control_characters_are_refused_at_enqueue::<PostgresApp>().await;
}
