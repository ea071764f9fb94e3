//! `tls://` against a real NATS server with TLS: the test makes a private
//! CA and a server certificate (`outbox_testkit::tls::TestPki`), starts its
//! own `nats-server` (JetStream on, TLS required, a free loopback port;
//! `NATS_SERVER_BIN`, default `/usr/sbin/nats-server` or `nats-server` on
//! `PATH`) and proves that a publisher trusting that CA publishes, and that
//! one trusting another CA fails with an error that names TLS: `connect`
//! with `NatsError::Connect` of kind `Tls` (not retried), a lazy
//! publisher with sink-unavailable outcomes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_core::{Outcome, Sink};
use outbox_nats::{NatsConfig, NatsError, NatsPublisher, NatsTls};
use outbox_testkit::process::{free_port, start_nats_server, ChildGuard};
use outbox_testkit::publisher::{assert_unavailable, event};
use outbox_testkit::tls::TestPki;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// A `nats-server` of this test alone, with TLS and JetStream.
struct TlsServer {
    _child: ChildGuard,
    addr: SocketAddr,
    _store: tempfile::TempDir,
}

impl TlsServer {
    fn start(pki: &TestPki) -> Self {
        let port = free_port();
        let store = tempfile::tempdir().unwrap();
        let args: Vec<&std::ffi::OsStr> = vec![
            "-js".as_ref(),
            "-sd".as_ref(),
            store.path().as_os_str(),
            "--tls".as_ref(),
            "--tlscert".as_ref(),
            pki.cert.as_os_str(),
            "--tlskey".as_ref(),
            pki.key.as_os_str(),
        ];
        let child = start_nats_server(port, args);
        Self {
            _child: child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            _store: store,
        }
    }

    fn config(&self, ca: &std::path::Path) -> NatsConfig {
        NatsConfig::from_url(&format!("tls://localhost:{}", self.addr.port()))
            .unwrap()
            .with_tls(NatsTls {
                required: true,
                root_certificates: vec![ca.to_owned()],
                client_certificate: None,
            })
            .with_subject_prefix("tls-test")
            .with_connect_timeout(Duration::from_secs(3))
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn tls_with_the_servers_ca_publishes_and_a_wrong_ca_fails_naming_tls() {
    let pki = TestPki::new("outbox NATS test CA");
    let server = TlsServer::start(&pki);

    // The right CA: connected over TLS, published, acknowledged, stored.
    let publisher = NatsPublisher::connect(server.config(&pki.ca).with_connect_attempts(3))
        .await
        .expect("TLS connection with the server's CA");
    let info = publisher.client().server_info();
    assert!(info.tls_required, "the server requires TLS: {info:?}");
    publisher
        .ensure_stream("TLS_TEST", &["tls-test.orders"])
        .await
        .unwrap();
    let events: Vec<_> = (0..3)
        .map(|i| event("orders", Some("k"), format!("over tls {i}").into_bytes()))
        .collect();
    assert_eq!(
        publisher.deliver(&events).await,
        vec![Outcome::Delivered; 3]
    );
    let stream = publisher.jetstream().get_stream("TLS_TEST").await.unwrap();
    for (seq, e) in (1u64..).zip(&events) {
        let m = outbox_testkit::nats::received(&stream.get_raw_message(seq).await.unwrap());
        assert_eq!(m.payload, e.payload);
        assert_eq!(m.event_id(), Some(e.id));
    }

    // Another CA: `connect` fails at once (not retried) with a TLS error.
    let other = TestPki::new("some other CA");
    let started = Instant::now();
    let err = NatsPublisher::connect(server.config(&other.ca).with_connect_attempts(5))
        .await
        .expect_err("a certificate the CA did not sign is refused");
    match &err {
        NatsError::Connect { kind, .. } => {
            assert_eq!(
                *kind,
                outbox_nats::async_nats::ConnectErrorKind::Tls,
                "{err}"
            )
        }
        other => panic!("expected a connect error, got {other:?}"),
    }
    assert!(
        !err.is_retryable(),
        "a TLS trust failure is not retried: {err}"
    );
    assert!(err.to_string().contains("TLS"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "not retried five times with backoff"
    );

    // A lazy publisher with the wrong CA: every outcome is the sink's
    // failure, and its message names the TLS problem.
    let lazy = NatsPublisher::lazy(server.config(&other.ca)).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let outcomes = lazy.deliver(&events).await;
        for o in &outcomes {
            assert_unavailable(o, "wrong CA");
        }
        let Outcome::Failed(e) = &outcomes[0] else {
            unreachable!()
        };
        if e.message().contains("TLS") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the outcome never named the TLS problem: {e}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
