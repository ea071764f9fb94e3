//! The local services the integration tests talk to.
//!
//! PostgreSQL, RabbitMQ and NATS are machine services: xtask checks them and
//! prints the command that starts one that is down. The Kafka-protocol broker
//! (Tansu) and PgBouncer in transaction mode in front of PostgreSQL are the
//! project's own: xtask installs and starts them.

use anyhow::{bail, Result};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// A machine service the tests need.
struct Service {
    name: &'static str,
    env: &'static str,
    addr: &'static str,
    start: &'static str,
}

const SERVICES: &[Service] = &[
    Service {
        name: "PostgreSQL",
        env: "DATABASE_URL",
        addr: "127.0.0.1:5432",
        start: "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
    },
    Service {
        name: "RabbitMQ",
        env: "AMQP_URL",
        addr: "127.0.0.1:5672",
        start: "rabbitmq-server -detached",
    },
    Service {
        name: "NATS JetStream",
        env: "NATS_URL",
        addr: "127.0.0.1:4222",
        start: "start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log",
    },
];

fn up(addr: &str) -> bool {
    addr.parse::<SocketAddr>()
        .map(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok())
        .unwrap_or(false)
}

/// What `ensure_all` started; stops it when dropped.
#[derive(Debug)]
pub(crate) struct Started {
    _kafka: crate::kafka::TansuGuard,
    _pgbouncer: crate::pgbouncer::Guard,
}

/// Checks every machine service and starts the project's own ones. Fails,
/// naming the start command, when a machine service is down.
pub(crate) fn ensure_all() -> Result<Started> {
    let mut down = Vec::new();
    for s in SERVICES {
        if up(s.addr) {
            println!("{:<16} up     {} (tests read {})", s.name, s.addr, s.env);
        } else {
            println!(
                "{:<16} DOWN   {}: start it with: {}",
                s.name, s.addr, s.start
            );
            down.push(s.name);
        }
    }
    if !down.is_empty() {
        bail!("services down: {} (commands above)", down.join(", "));
    }
    ensure_prepared_transactions()?;
    let pgbouncer = crate::pgbouncer::start()?;
    crate::kafka::ensure_tansu_installed()?;
    let kafka = crate::kafka::start_tansu()?;
    println!("{}", crate::kafka::kafka_status());
    if kafka.started_here() {
        if let Some(log) = kafka.log_path() {
            println!("{:<16} started by xtask (log {})", "Tansu", log.display());
        }
    }
    Ok(Started {
        _kafka: kafka,
        _pgbouncer: pgbouncer,
    })
}

/// The test server's `max_prepared_transactions`, by `psql`.
fn max_prepared_transactions() -> Result<u32> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let out = std::process::Command::new("psql")
        .args([url.as_str(), "-Atc", "SHOW max_prepared_transactions"])
        .output()
        .map_err(|e| anyhow::anyhow!("running psql: {e}"))?;
    if !out.status.success() {
        bail!(
            "psql could not read max_prepared_transactions: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

/// Rotation must never queue behind a prepared (two-phase) transaction;
/// the test of it needs `max_prepared_transactions > 0`, which PostgreSQL
/// only reads at start. When it is 0, it is set to 16 (`ALTER SYSTEM`) and
/// the cluster restarted once, with Debian's `pg_ctlcluster` (the command
/// of [`SERVICES`]); later runs find it set.
fn ensure_prepared_transactions() -> Result<()> {
    let max = max_prepared_transactions()?;
    if max > 0 {
        println!("{:<16} max_prepared_transactions = {max}", "PostgreSQL");
        return Ok(());
    }
    println!(
        "{:<16} max_prepared_transactions = 0: setting it to 16 and restarting PostgreSQL once",
        "PostgreSQL"
    );
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let set = std::process::Command::new("psql")
        .args([
            url.as_str(),
            "-c",
            "ALTER SYSTEM SET max_prepared_transactions = 16",
        ])
        .status()?;
    if !set.success() {
        bail!("ALTER SYSTEM SET max_prepared_transactions failed");
    }
    let version = std::fs::read_dir("/etc/postgresql")?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .ok_or_else(|| anyhow::anyhow!("no cluster under /etc/postgresql"))?;
    let restart = std::process::Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect", &version, "main", "restart"])
        .status()?;
    if !restart.success() {
        bail!("pg_ctlcluster {version} main restart failed");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while max_prepared_transactions().map_or(true, |m| m == 0) {
        if std::time::Instant::now() > deadline {
            bail!("PostgreSQL did not come back with max_prepared_transactions > 0 within 60 s");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    println!(
        "{:<16} restarted, max_prepared_transactions = 16",
        "PostgreSQL"
    );
    Ok(())
}

/// `cargo xtask services`: report, start what we own, and keep it running
/// until Ctrl-C when `--hold` is given.
pub(crate) fn report_and_hold(rest: &[String]) -> Result<()> {
    let started = ensure_all()?;
    if rest.iter().any(|a| a == "--hold") {
        println!("holding the services started here; Ctrl-C to stop");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    drop(started);
    Ok(())
}
