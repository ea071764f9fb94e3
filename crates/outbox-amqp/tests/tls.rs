//! `amqps://` against the machine's RabbitMQ. The shared broker has no TLS
//! listener and must not be restarted under the other tests, but RabbitMQ
//! can open one at run time: the test makes a private CA and a server
//! certificate (`outbox_testkit::tls::TestPki`), asks the running node for
//! a TLS listener on a free loopback port with
//! `rabbitmqctl eval 'rabbit_networking:start_ssl_listener(...)'`, and
//! closes it again afterwards (`stop_tcp_listener`). So it needs
//! `rabbitmqctl` (`RABBITMQCTL`, default `/usr/sbin/rabbitmqctl` or on
//! `PATH`) with the rights to talk to the node behind `AMQP_URL`: the local
//! broker, run by the same machine (root in CI). Nothing else about the
//! broker changes, and its plain listener is untouched.
//!
//! It proves that a publisher trusting the CA publishes over TLS (the
//! messages are read back through the plain listener), and that one
//! trusting another CA fails naming the certificate problem: `connect`
//! with an error, a lazy publisher with sink-unavailable outcomes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use outbox_amqp::{AmqpPublisher, AmqpTls};
use outbox_core::{EventId, Outcome, Sink};
use outbox_testkit::amqp::AmqpFixture;
use outbox_testkit::broker::Received;
use outbox_testkit::publisher::{assert_unavailable, event};
use outbox_testkit::tls::TestPki;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn rabbitmqctl() -> PathBuf {
    if let Some(p) = std::env::var_os("RABBITMQCTL") {
        return PathBuf::from(p);
    }
    let sbin = PathBuf::from("/usr/sbin/rabbitmqctl");
    if sbin.is_file() {
        sbin
    } else {
        PathBuf::from("rabbitmqctl")
    }
}

fn eval(expr: &str) -> String {
    let out = Command::new(rabbitmqctl())
        .args(["eval", expr])
        .output()
        .unwrap_or_else(|e| panic!("running rabbitmqctl (set RABBITMQCTL): {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "rabbitmqctl eval {expr}: {text}");
    text
}

/// A TLS listener opened on the running broker; closed on drop.
struct TlsListener {
    addr: SocketAddr,
}

impl TlsListener {
    fn open(pki: &TestPki) -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let path = |p: &std::path::Path| p.to_str().expect("UTF-8 path").to_owned();
        let out = eval(&format!(
            "rabbit_networking:start_ssl_listener({{\"127.0.0.1\", {port}}}, \
             [{{certfile, \"{}\"}}, {{keyfile, \"{}\"}}, {{cacertfile, \"{}\"}}, \
             {{verify, verify_none}}, {{fail_if_no_peer_cert, false}}], 1).",
            path(&pki.cert),
            path(&pki.key),
            path(&pki.ca),
        ));
        assert!(out.trim_end().ends_with("ok"), "start_ssl_listener: {out}");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "no TLS listener on {addr}");
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { addr }
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        let _ = Command::new(rabbitmqctl())
            .args([
                "eval",
                &format!(
                    "rabbit_networking:stop_tcp_listener({{\"127.0.0.1\", {}}}).",
                    self.addr.port()
                ),
            ])
            .output();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn amqps_with_the_brokers_ca_publishes_and_a_wrong_ca_fails_naming_the_certificate() {
    let fixture = std::sync::Arc::new(AmqpFixture::new().await);
    let pki = TestPki::new("outbox RabbitMQ test CA");
    let listener = TlsListener::open(&pki);
    let result = tokio::spawn({
        let uri = format!("amqps://guest:guest@localhost:{}/%2f", listener.addr.port());
        let f = fixture.clone();
        async move {
            let tls = |ca: PathBuf| AmqpTls {
                ca_certificate: Some(ca),
                client_identity: None,
            };
            // The right CA: published over TLS, confirmed, in the queue.
            let publisher =
                AmqpPublisher::connect(f.config_for(&uri).with_tls(tls(pki.ca.clone())))
                    .await
                    .expect("amqps with the broker's CA");
            let events: Vec<_> = (0..3)
                .map(|i| event(&f.topic(), Some("k"), format!("over tls {i}").into_bytes()))
                .collect();
            assert_eq!(
                publisher.deliver(&events).await,
                vec![Outcome::Delivered; 3]
            );
            let got: Vec<Option<EventId>> =
                f.next(3).await.iter().map(Received::event_id).collect();
            let sent: Vec<Option<EventId>> = events.iter().map(|e| Some(e.id)).collect();
            assert_eq!(got, sent);
            publisher.close().await;

            // Another CA: refused, naming the certificate.
            let other = TestPki::new("some other CA");
            let wrong = f
                .config_for(&uri)
                .with_tls(tls(other.ca.clone()))
                .with_connect_attempts(1)
                .with_connect_timeout(Duration::from_secs(5));
            let err = AmqpPublisher::connect(wrong.clone())
                .await
                .expect_err("a certificate the CA did not sign is refused");
            let text = err.to_string().to_ascii_lowercase();
            assert!(text.contains("certificate"), "{err}");
            let lazy = AmqpPublisher::lazy(wrong);
            let outcomes = lazy.deliver(&events).await;
            for o in &outcomes {
                assert_unavailable(o, "wrong CA");
            }
            let Outcome::Failed(e) = &outcomes[0] else {
                unreachable!()
            };
            assert!(
                e.message().to_ascii_lowercase().contains("certificate"),
                "{e}"
            );
        }
    })
    .await;
    fixture.cleanup().await;
    drop(listener);
    if let Err(e) = result {
        std::panic::resume_unwind(e.into_panic());
    }
}
