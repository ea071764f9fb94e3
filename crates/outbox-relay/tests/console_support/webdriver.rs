//! A minimal W3C WebDriver client for Debian's `chromedriver` driving a
//! headless `chromium`: sessions, navigation, elements (find, click, type,
//! text), a script, the page source and screenshots. JSON over the raw
//! HTTP/1.1 of [`super::try_http`]'s kind; nothing else is needed.

use outbox_testkit::process::ChildGuard;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The W3C element reference key.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// The chromium binary (`$CHROMIUM`, default Debian's `/usr/bin/chromium`).
pub fn chromium() -> PathBuf {
    std::env::var_os("CHROMIUM").map_or_else(|| PathBuf::from("/usr/bin/chromium"), PathBuf::from)
}

/// The chromedriver binary (`$CHROMEDRIVER`, default `/usr/bin/chromedriver`).
pub fn chromedriver() -> PathBuf {
    std::env::var_os("CHROMEDRIVER")
        .map_or_else(|| PathBuf::from("/usr/bin/chromedriver"), PathBuf::from)
}

/// One request to chromedriver: the answer's `value`, or the WebDriver
/// error as `Err`.
fn call(addr: &str, method: &str, path: &str, body: Option<&Value>) -> Result<Value, String> {
    let mut s = std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .map_err(|e| e.to_string())?;
    let body = body.map(Value::to_string).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let body = read_response(&mut s).map_err(|e| format!("{method} {path}: {e}"))?;
    let v: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
    let value = v.get("value").cloned().unwrap_or(Value::Null);
    if let Some(err) = value.get("error").and_then(Value::as_str) {
        return Err(format!(
            "{err}: {}",
            value.get("message").and_then(Value::as_str).unwrap_or("")
        ));
    }
    Ok(value)
}

/// Reads one response's body: chromedriver keeps the connection open
/// (it ignores `Connection: close`), so read by `Content-Length`, or
/// chunks up to the last one.
fn read_response(s: &mut std::net::TcpStream) -> std::io::Result<String> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
        let rest = &raw[end + 4..];
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok());
        match length {
            Some(len) if rest.len() >= len => {
                return Ok(String::from_utf8_lossy(&rest[..len]).into_owned())
            }
            None if head.contains("transfer-encoding: chunked") && rest.ends_with(b"0\r\n\r\n") => {
                return Ok(dechunk(&String::from_utf8_lossy(rest)))
            }
            _ => {}
        }
    }
    let text = String::from_utf8_lossy(&raw);
    Ok(text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned())
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

/// chromedriver and one headless chromium session, both ended on drop.
pub struct Browser {
    addr: String,
    session: String,
    _driver: ChildGuard,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver on a free port and opens a headless session
    /// (1280 x 900). Panics with the install command when either binary
    /// is missing.
    pub fn start() -> Browser {
        for bin in [chromium(), chromedriver()] {
            assert!(
                bin.exists(),
                "{} is missing: `apt-get install -y chromium chromium-driver` (cargo xtask ci installs them)",
                bin.display()
            );
        }
        let addr = super::free_addr();
        let port = addr.rsplit(':').next().unwrap().to_owned();
        let mut driver = ChildGuard::new(
            Command::new(chromedriver())
                .arg(format!("--port={port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start chromedriver"),
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        while call(&addr, "GET", "/status", None)
            .ok()
            .and_then(|v| v["ready"].as_bool())
            != Some(true)
        {
            if let Some(status) = driver.child().try_wait().unwrap() {
                panic!("chromedriver exited with {status}");
            }
            assert!(Instant::now() < deadline, "chromedriver not ready in 60 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        let profile = tempfile::tempdir().unwrap();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium().to_string_lossy(),
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--disable-dev-shm-usage", "--window-size=1280,900",
                    format!("--user-data-dir={}", profile.path().display()),
                ],
            },
        }}});
        let v = call(&addr, "POST", "/session", Some(&caps)).expect("a browser session");
        let session = v["sessionId"].as_str().expect("a session id").to_owned();
        Browser {
            addr,
            session,
            _driver: driver,
            _profile: profile,
        }
    }

    fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.try_cmd(method, path, body)
            .unwrap_or_else(|e| panic!("webdriver {method} {path}: {e}"))
    }

    fn try_cmd(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let full = format!("/session/{}{path}", self.session);
        call(&self.addr, method, &full, body.as_ref())
    }

    /// Opens `url` and waits for the page to load.
    pub fn goto(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({ "url": url })));
    }

    /// The current URL.
    pub fn url(&self) -> String {
        self.cmd("GET", "/url", None)
            .as_str()
            .unwrap_or("")
            .to_owned()
    }

    /// The page's HTML as the browser has it now.
    pub fn source(&self) -> String {
        self.cmd("GET", "/source", None)
            .as_str()
            .unwrap_or("")
            .to_owned()
    }

    /// The first element matching `css`, if any.
    pub fn find(&self, css: &str) -> Option<String> {
        let full = format!("/session/{}/element", self.session);
        call(
            &self.addr,
            "POST",
            &full,
            Some(&json!({"using": "css selector", "value": css})),
        )
        .ok()
        .and_then(|v| v[ELEMENT].as_str().map(str::to_owned))
    }

    /// The first element matching `css`; panics with the page when none.
    pub fn el(&self, css: &str) -> String {
        self.find(css)
            .unwrap_or_else(|| panic!("no element {css:?} on {}:\n{}", self.url(), self.source()))
    }

    /// Runs `op` on the first element matching `css`, finding it again
    /// when the page was replaced between the lookup and the command (a
    /// navigation that a click started, or the live refresh swapping
    /// `<main>`): a stale reference is a race of the test, not a result.
    /// Panics with the page when no element matches within 30 s.
    fn on_element(&self, css: &str, op: impl Fn(&str) -> Result<Value, String>) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let Some(e) = self.find(css) else {
                // Between two pages: the next one may not be there yet.
                if Instant::now() >= deadline {
                    self.el(css);
                }
                std::thread::sleep(Duration::from_millis(50));
                continue;
            };
            match op(&e) {
                Ok(v) => return v,
                Err(err) if err.starts_with("stale element") && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(err) => panic!("webdriver on {css:?}: {err}"),
            }
        }
    }

    /// Clicks the first element matching `css` (a submit button waits for
    /// the next page).
    pub fn click(&self, css: &str) {
        self.on_element(css, |e| {
            self.try_cmd("POST", &format!("/element/{e}/click"), Some(json!({})))
        });
    }

    /// Types `text` into the first element matching `css` (cleared first).
    pub fn fill(&self, css: &str, text: &str) {
        self.on_element(css, |e| {
            self.try_cmd("POST", &format!("/element/{e}/clear"), Some(json!({})))?;
            self.try_cmd(
                "POST",
                &format!("/element/{e}/value"),
                Some(json!({ "text": text })),
            )
        });
    }

    /// The rendered text of the first element matching `css`.
    pub fn text(&self, css: &str) -> String {
        self.on_element(css, |e| {
            self.try_cmd("GET", &format!("/element/{e}/text"), None)
        })
        .as_str()
        .unwrap_or("")
        .to_owned()
    }

    /// Runs `script` (a function body; `return` gives the result).
    pub fn script(&self, script: &str) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            Some(json!({ "script": script, "args": [] })),
        )
    }

    /// Polls `check` (at most 30 s, every 100 ms) until it holds; panics
    /// with `what` and the page otherwise.
    pub fn wait_for(&self, what: &str, check: impl Fn(&Browser) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !check(self) {
            assert!(
                Instant::now() < deadline,
                "{what}: not within 30 s on {}:\n{}",
                self.url(),
                self.source()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Saves a PNG of the whole page (its full height, at most 4000 px)
    /// to `path`, 1280 px wide.
    pub fn screenshot(&self, path: &Path) {
        self.screenshot_width(path, 1280);
    }

    /// [`Browser::screenshot`] at `width` px (390: a phone).
    pub fn screenshot_width(&self, path: &Path, width: u64) {
        self.cmd(
            "POST",
            "/window/rect",
            Some(json!({"width": width, "height": 900})),
        );
        let height = self
            .script("return Math.min(4000, document.documentElement.scrollHeight);")
            .as_u64()
            .unwrap_or(900);
        self.cmd(
            "POST",
            "/window/rect",
            Some(json!({"width": width, "height": height.max(600) + 140})),
        );
        let b64 = self.cmd("GET", "/screenshot", None);
        let png = base64::Engine::decode(
            &base64::engine::general_purpose::STANDARD,
            b64.as_str().unwrap_or(""),
        )
        .expect("a base64 PNG");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(path, png).unwrap();
        self.cmd(
            "POST",
            "/window/rect",
            Some(json!({"width": 1280, "height": 900})),
        );
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = call(
            &self.addr,
            "DELETE",
            &format!("/session/{}", self.session),
            None,
        );
    }
}

/// Where `cargo xtask screenshots` wants the pages
/// (`OUTBOX_CONSOLE_SCREENSHOTS`), if it does.
pub fn screenshot_dir() -> Option<PathBuf> {
    std::env::var_os("OUTBOX_CONSOLE_SCREENSHOTS").map(PathBuf::from)
}
