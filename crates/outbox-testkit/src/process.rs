//! Child processes in tests: signals, a bounded wait, and a guard that
//! never leaves a process behind.

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// Sends `signal` (`"TERM"`, `"KILL"`, `"STOP"`, `"CONT"`, ...) to process
/// `pid` with `kill(1)`; panics if it could not be sent.
pub fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .unwrap_or_else(|e| panic!("running kill -{signal} {pid}: {e}"));
    assert!(status.success(), "kill -{signal} {pid} failed: {status}");
}

/// Waits up to `bound` for `child` to exit; `None` if it is still running.
pub fn wait_timeout(child: &mut Child, bound: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + bound;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => return None,
            Err(e) => panic!("waiting for child {}: {e}", child.id()),
        }
    }
}

/// SIGTERM, then up to `bound` for a clean exit; SIGKILL after that. Returns
/// the exit status of a clean exit, `None` if the process had to be killed.
pub fn terminate(child: &mut Child, bound: Duration) -> Option<ExitStatus> {
    if let Ok(Some(status)) = child.try_wait() {
        return Some(status);
    }
    signal(child.id(), "TERM");
    match wait_timeout(child, bound) {
        Some(status) => Some(status),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            None
        }
    }
}

/// Owns a child process and kills it (SIGKILL, then waits for it) when
/// dropped, also when the test panics.
#[derive(Debug)]
pub struct ChildGuard {
    child: Option<Child>,
}

impl ChildGuard {
    /// Takes ownership of `child`.
    pub fn new(child: Child) -> Self {
        Self { child: Some(child) }
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The child.
    pub fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("child already taken")
    }

    /// Sends `sig` to the child (see [`signal`]).
    pub fn signal(&self, sig: &str) {
        signal(self.id(), sig);
    }

    /// [`terminate`] the child.
    pub fn terminate(&mut self, bound: Duration) -> Option<ExitStatus> {
        terminate(self.child(), bound)
    }

    /// Kills the child now and waits for it.
    pub fn kill(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Gives the child back without killing it.
    pub fn into_inner(mut self) -> Child {
        self.child.take().expect("child already taken")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The `nats-server` binary for tests and the chaos suite that start a
/// server of their own: `$NATS_SERVER_BIN`, else Debian's
/// `/usr/sbin/nats-server` (not on a normal user's `PATH`), else
/// `nats-server` on `PATH`.
pub fn nats_server_bin() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("NATS_SERVER_BIN") {
        return p.into();
    }
    let sbin = std::path::Path::new("/usr/sbin/nats-server");
    if sbin.is_file() {
        sbin.to_path_buf()
    } else {
        "nats-server".into()
    }
}

/// Starts [`nats_server_bin`] listening on loopback `port` with the extra
/// `args` (`-js -sd DIR`, `--tls ...`), output discarded; returns once it
/// accepts connections (panics after 20 s, naming the binary and the
/// address). The guard kills it when dropped.
pub fn start_nats_server<I, S>(port: u16, args: I) -> ChildGuard
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    use std::process::{Command, Stdio};
    let bin = nats_server_bin();
    let child = Command::new(&bin)
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "starting {} failed: {e} (set NATS_SERVER_BIN)",
                bin.display()
            )
        });
    let child = ChildGuard::new(child);
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "{} did not listen on {addr} within 20 s",
            bin.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

/// A loopback port nobody listens on right now (bound and released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free loopback port: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn terminate_waits_for_a_clean_exit_and_the_guard_kills() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        assert!(wait_timeout(&mut child, Duration::from_millis(50)).is_none());
        let status = terminate(&mut child, Duration::from_secs(5)).unwrap();
        assert!(!status.success(), "sleep ends on SIGTERM: {status}");

        let guard = ChildGuard::new(Command::new("sleep").arg("30").spawn().unwrap());
        let pid = guard.id();
        drop(guard);
        // The process is gone (kill -0 fails).
        let alive = Command::new("kill")
            .args(["-0", &pid.to_string()])
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(!alive.success());
    }
}
