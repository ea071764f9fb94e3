#![allow(clippy::unwrap_used, missing_docs)]
mod support;
use outbox_core::Sink;
use outbox_kafka::{KafkaConfig, KafkaPublisher};
use outbox_testkit::publisher::TcpProxy;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread")]
async fn debug_proxy() {
    tracing_subscriber::fmt()
        .with_ansi(false)
        .with_env_filter("info,librdkafka=debug")
        .init();
    let q = 19556;
    let proxy = TcpProxy::start(format!("127.0.0.1:{q}").parse().unwrap()).await;
    let mut child = std::process::Command::new("/root/.cargo/bin/tansu")
        .args([
            "broker",
            "--listener-url",
            &format!("tcp://127.0.0.1:{q}"),
            "--advertised-listener-url",
            &format!("tcp://{}", proxy.addr()),
            "--storage-engine",
            "memory://tansu/",
        ])
        .stdout(std::fs::File::create("/tmp/tb.log").unwrap())
        .stderr(std::fs::File::create("/tmp/tb.err").unwrap())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let topic = support::topic_name("dbg");
    support::create_topic(&format!("127.0.0.1:{q}"), &topic, 1).await;
    let p = KafkaPublisher::new(
        KafkaConfig::new(proxy.addr().to_string())
            .with_delivery_timeout(Duration::from_secs(3))
            .with_property("debug", "broker,protocol,msg,eos"),
    )
    .unwrap();
    let ev = |n| support::event(&topic, Some("k"), n);
    eprintln!("FIRST {:?}", p.deliver(&[ev(0)]).await);
    proxy.cut();
    eprintln!("CUT {:?}", p.deliver(&[ev(1)]).await);
    proxy.restore();
    eprintln!("RESTORED");
    for i in 0..4 {
        eprintln!("ROUND {i} {:?}", p.deliver(&[ev(2)]).await);
    }
    eprintln!("RECREATED {}", p.producers_recreated());
    let p2 = KafkaPublisher::new(
        KafkaConfig::new(proxy.addr().to_string()).with_delivery_timeout(Duration::from_secs(3)),
    )
    .unwrap();
    eprintln!("FRESH {:?}", p2.deliver(&[ev(3)]).await);
    child.kill().unwrap();
}
