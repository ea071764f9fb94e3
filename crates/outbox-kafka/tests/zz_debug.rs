#![allow(clippy::unwrap_used, missing_docs)]
mod support;
use outbox_core::Sink;
use outbox_kafka::{KafkaConfig, KafkaPublisher};
use outbox_testkit::publisher::TcpProxy;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread")]
async fn debug_proxy() {
    tracing_subscriber::fmt()
        .with_env_filter("info,librdkafka=debug")
        .init();
    let topic = support::topic_name("dbg");
    support::create_topic("127.0.0.1:9092", &topic, 1).await;
    let proxy = TcpProxy::start("127.0.0.1:9092".parse().unwrap()).await;
    let port = 19555;
    let url = format!("tcp://127.0.0.1:{port}");
    let mut child = std::process::Command::new("/root/.cargo/bin/tansu")
        .args([
            "proxy",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
            "--origin-url",
            &format!("tcp://{}", proxy.addr()),
        ])
        .stdout(std::fs::File::create("/tmp/tproxy.log").unwrap())
        .stderr(std::fs::File::create("/tmp/tproxy.err").unwrap())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let p = KafkaPublisher::new(
        KafkaConfig::new(format!("127.0.0.1:{port}"))
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
    child.kill().unwrap();
}
