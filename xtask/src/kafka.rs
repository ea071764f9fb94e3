//! The Kafka-protocol broker for tests and the demo: Tansu
//! (<https://crates.io/crates/tansu>), run with in-memory storage on
//! 127.0.0.1:9092.
//!
//! - [`ensure_tansu_installed`] finds the `tansu` binary, or runs
//!   `cargo install tansu --locked --features dynostore` (a long build, about
//!   13-20 minutes on 2 cores) only when it is missing.
//! - [`start_tansu`] starts it in the background unless something already
//!   answers the Kafka protocol on the port, and waits (bounded) until it
//!   answers an `ApiVersions` request. The returned [`TansuGuard`] stops what
//!   it started when dropped.
//! - [`kafka_status`] is a one-line status for `cargo xtask services`.
//!
//! Readiness is probed with a hand-written Kafka `ApiVersions` v0 request
//! over a plain `TcpStream`, so xtask needs no Kafka client library.

use anyhow::{bail, Context, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the broker listens (and what it advertises).
pub(crate) const TANSU_ADDR: &str = "127.0.0.1:9092";
/// How long [`start_tansu`] waits for the broker to answer.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// The install command, shown to the user and run when the binary is missing.
const INSTALL_ARGS: &[&str] = &["install", "tansu", "--locked", "--features", "dynostore"];

/// Stops the broker [`start_tansu`] started (nothing if it was already running).
#[derive(Debug)]
pub(crate) struct TansuGuard {
    child: Option<Child>,
    log: Option<PathBuf>,
}

impl TansuGuard {
    /// Whether this guard owns a broker process it started.
    pub(crate) fn started_here(&self) -> bool {
        self.child.is_some()
    }

    /// The broker's log file, when it was started here.
    pub(crate) fn log_path(&self) -> Option<&PathBuf> {
        self.log.as_ref()
    }
}

impl Drop for TansuGuard {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let log = self.log.as_ref().map(|p| p.display().to_string());
            eprintln!(
                "xtask: stopping tansu (pid {}, log {})",
                child.id(),
                log.as_deref().unwrap_or("-")
            );
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The `tansu` binary: `$TANSU_BIN`, else `$CARGO_HOME/bin/tansu`
/// (`~/.cargo/bin/tansu`), else `tansu` on `PATH`. Runs `cargo install tansu
/// --locked --features dynostore` when none exists.
pub(crate) fn ensure_tansu_installed() -> Result<PathBuf> {
    if let Some(path) = find_tansu() {
        return Ok(path);
    }
    eprintln!(
        "xtask: tansu not found; running `cargo {}` (a release build, ~15 minutes)",
        INSTALL_ARGS.join(" ")
    );
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args(INSTALL_ARGS)
        .status()
        .context("running cargo install tansu")?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", INSTALL_ARGS.join(" "));
    }
    find_tansu()
        .context("cargo install tansu succeeded but the tansu binary is not in $CARGO_HOME/bin")
}

fn find_tansu() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TANSU_BIN") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    if let Some(p) = cargo_home.map(|h| h.join("bin").join("tansu")) {
        if p.is_file() {
            return Some(p);
        }
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("tansu"))
            .find(|p| p.is_file())
    })
}

/// Starts Tansu on 127.0.0.1:9092 with in-memory storage, unless a Kafka
/// broker already answers there. Waits until the broker answers an
/// `ApiVersions` request (at most 60 s); the guard stops the process it
/// started when dropped. Installs Tansu first if it is missing.
pub(crate) fn start_tansu() -> Result<TansuGuard> {
    let addr = tansu_addr()?;
    if probe(addr).is_ok() {
        eprintln!("xtask: a Kafka broker already answers on {addr}; using it");
        return Ok(TansuGuard {
            child: None,
            log: None,
        });
    }
    let bin = ensure_tansu_installed()?;
    let log_dir = std::env::temp_dir().join("outbox-xtask");
    std::fs::create_dir_all(&log_dir).context("creating the tansu log directory")?;
    let log_path = log_dir.join("tansu.log");
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let err_log = log.try_clone().context("cloning the tansu log handle")?;
    let url = format!("tcp://{TANSU_ADDR}");
    let child = Command::new(&bin)
        .args([
            "broker",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
            "--storage-engine",
            "memory://tansu/",
        ])
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err_log)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    eprintln!(
        "xtask: started tansu (pid {}) on {TANSU_ADDR}, log {}",
        child.id(),
        log_path.display()
    );
    // From here on the guard owns the process: any early return stops it.
    let mut guard = TansuGuard {
        child: Some(child),
        log: Some(log_path.clone()),
    };
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Some(child) = &mut guard.child {
            if let Some(status) = child.try_wait().context("checking the tansu process")? {
                guard.child = None;
                bail!(
                    "tansu exited during start-up ({status}); see {}",
                    log_path.display()
                );
            }
        }
        match probe(addr) {
            Ok(()) => return Ok(guard),
            Err(e) if Instant::now() >= deadline => {
                bail!(
                    "tansu did not answer on {addr} within {}s ({e:#}); see {}",
                    START_TIMEOUT.as_secs(),
                    log_path.display()
                );
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// One line for `cargo xtask services`: up (answers `ApiVersions`) or down,
/// with how to get it.
pub(crate) fn kafka_status() -> String {
    match tansu_addr().and_then(probe) {
        Ok(()) => format!("Kafka (Tansu)  up    {TANSU_ADDR} (answers ApiVersions)"),
        Err(e) => {
            let how = match find_tansu() {
                Some(bin) => format!(
                    "start: {} broker --listener-url tcp://{TANSU_ADDR} --advertised-listener-url tcp://{TANSU_ADDR} --storage-engine memory://tansu/ (cargo xtask ci starts it)",
                    bin.display()
                ),
                None => format!(
                    "not installed: cargo {} (cargo xtask services installs and starts it)",
                    INSTALL_ARGS.join(" ")
                ),
            };
            format!("Kafka (Tansu)  down  {TANSU_ADDR} ({e:#}); {how}")
        }
    }
}

fn tansu_addr() -> Result<SocketAddr> {
    TANSU_ADDR
        .to_socket_addrs()
        .context("resolving the Kafka address")?
        .next()
        .context("the Kafka address resolved to nothing")
}

/// Sends a Kafka `ApiVersions` v0 request and checks that a well-formed
/// answer (same correlation id, no error, at least one API) comes back.
fn probe(addr: SocketAddr) -> Result<()> {
    const API_VERSIONS: i16 = 18;
    const CORRELATION_ID: i32 = 0x6f75_7462; // "outb"
    let timeout = Duration::from_secs(2);
    let mut stream = TcpStream::connect_timeout(&addr, timeout).context("connect")?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;

    let client_id = b"outbox-xtask";
    // Request header v1: api_key, api_version, correlation_id, client_id
    // (int16 length + bytes); ApiVersions v0 has an empty body.
    let mut body = Vec::new();
    body.extend_from_slice(&API_VERSIONS.to_be_bytes());
    body.extend_from_slice(&0i16.to_be_bytes());
    body.extend_from_slice(&CORRELATION_ID.to_be_bytes());
    body.extend_from_slice(&i16::try_from(client_id.len())?.to_be_bytes());
    body.extend_from_slice(client_id);
    let mut request = i32::try_from(body.len())?.to_be_bytes().to_vec();
    request.extend_from_slice(&body);
    stream.write_all(&request).context("send ApiVersions")?;

    let mut size = [0u8; 4];
    stream.read_exact(&mut size).context("read response size")?;
    let size = usize::try_from(i32::from_be_bytes(size)).context("negative response size")?;
    if !(10..=1 << 20).contains(&size) {
        bail!("implausible ApiVersions response size {size}");
    }
    let mut response = vec![0u8; size];
    stream.read_exact(&mut response).context("read response")?;
    // Response: correlation_id int32, error_code int16, api_keys array (int32 count, ...).
    let correlation = i32::from_be_bytes([response[0], response[1], response[2], response[3]]);
    let error_code = i16::from_be_bytes([response[4], response[5]]);
    let count = i32::from_be_bytes([response[6], response[7], response[8], response[9]]);
    if correlation != CORRELATION_ID {
        bail!("ApiVersions answer has correlation id {correlation}, expected {CORRELATION_ID}");
    }
    if error_code != 0 {
        bail!("ApiVersions answered with error code {error_code}");
    }
    if count <= 0 {
        bail!("ApiVersions answered with no APIs");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn probe_fails_on_a_port_that_does_not_speak_kafka() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 64];
            let _ = s.read(&mut buf);
            s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
        });
        assert!(probe(addr).is_err());
        server.join().unwrap();
    }

    #[test]
    fn probe_accepts_a_well_formed_api_versions_answer() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut size = [0u8; 4];
            s.read_exact(&mut size).unwrap();
            let mut req = vec![0u8; i32::from_be_bytes(size) as usize];
            s.read_exact(&mut req).unwrap();
            assert_eq!(&req[0..4], &[0, 18, 0, 0], "ApiVersions v0");
            let mut resp = req[4..8].to_vec(); // echo correlation id
            resp.extend_from_slice(&0i16.to_be_bytes());
            resp.extend_from_slice(&1i32.to_be_bytes());
            resp.extend_from_slice(&[0, 18, 0, 0, 0, 3]);
            let mut framed = (resp.len() as i32).to_be_bytes().to_vec();
            framed.extend_from_slice(&resp);
            s.write_all(&framed).unwrap();
        });
        probe(addr).unwrap();
        server.join().unwrap();
    }
}
