//! Debian's `chromedriver` driving a headless `chromium`, through
//! fantoccini (a maintained W3C WebDriver client) over plain HTTP on
//! loopback. Ours is only what the tests share: finding and starting the
//! two binaries, the session's capabilities, and explicit waits that panic
//! with the page when their condition does not hold within [`WAIT`].

use fantoccini::elements::Element;
use fantoccini::error::CmdError;
use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use outbox_testkit::process::ChildGuard;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;
use tokio::time::{interval, timeout};

/// How long a wait gives its condition.
const WAIT: Duration = Duration::from_secs(30);
/// How often a wait checks its condition again.
const POLL: Duration = Duration::from_millis(100);

/// The chromium binary (`$CHROMIUM`, default Debian's `/usr/bin/chromium`).
pub fn chromium() -> PathBuf {
    std::env::var_os("CHROMIUM").map_or_else(|| PathBuf::from("/usr/bin/chromium"), PathBuf::from)
}

/// The chromedriver binary (`$CHROMEDRIVER`, default `/usr/bin/chromedriver`).
pub fn chromedriver() -> PathBuf {
    std::env::var_os("CHROMEDRIVER")
        .map_or_else(|| PathBuf::from("/usr/bin/chromedriver"), PathBuf::from)
}

/// chromedriver and one headless chromium session, both ended on drop.
pub struct Browser {
    client: Client,
    // Dropped after `Drop::drop` ended the session: chromium quits first.
    _driver: ChildGuard,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver on a free port and opens a headless session
    /// (1280 x 900). Panics with the install command when either binary
    /// is missing.
    pub async fn start() -> Browser {
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
        let listening = timeout(Duration::from_secs(60), async {
            let mut tick = interval(POLL);
            while tokio::net::TcpStream::connect(&addr).await.is_err() {
                if let Some(status) = driver.child().try_wait().unwrap() {
                    panic!("chromedriver exited with {status}");
                }
                tick.tick().await;
            }
        })
        .await;
        assert!(listening.is_ok(), "chromedriver not listening in 60 s");
        let profile = tempfile::tempdir().unwrap();
        let caps = json!({
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
        });
        let Value::Object(caps) = caps else {
            unreachable!("capabilities are an object")
        };
        let client = ClientBuilder::new(HttpConnector::new())
            .capabilities(caps)
            .connect(&format!("http://{addr}"))
            .await
            .expect("a browser session");
        Browser {
            client,
            _driver: driver,
            _profile: profile,
        }
    }

    /// Panics with `what`, the current URL and the page.
    async fn fail(&self, what: &str) -> ! {
        let url = self.client.current_url().await.map(String::from);
        let source = self.client.source().await.unwrap_or_default();
        panic!("{what} on {url:?}:\n{source}")
    }

    /// Opens `url` and waits for the page to load.
    pub async fn goto(&self, url: &str) {
        if let Err(e) = self.client.goto(url).await {
            self.fail(&format!("opening {url}: {e}")).await
        }
    }

    /// The current URL.
    pub async fn url(&self) -> String {
        self.client.current_url().await.unwrap().into()
    }

    /// The page's HTML as the browser has it now.
    pub async fn source(&self) -> String {
        self.client.source().await.unwrap()
    }

    /// The first element matching `css` now, if any (no wait).
    pub async fn find(&self, css: &str) -> Option<Element> {
        match self.client.find(Locator::Css(css)).await {
            Ok(e) => Some(e),
            Err(e) if e.is_no_such_element() => None,
            Err(e) => panic!("webdriver finding {css:?}: {e}"),
        }
    }

    /// Runs `op` on the first element matching `css`, waiting for it to
    /// appear (a click may have started a navigation). A reference gone
    /// stale between the lookup and `op` (the next page, or the live
    /// refresh swapping `<main>`) is a race of the test, not a result: the
    /// element is found again. Panics with the page after [`WAIT`].
    async fn on<T>(&self, css: &str, op: impl AsyncFn(Element) -> Result<T, CmdError>) -> T {
        let done = timeout(WAIT, async {
            loop {
                let e = self
                    .client
                    .wait()
                    .at_most(WAIT)
                    .every(POLL)
                    .for_element(Locator::Css(css))
                    .await?;
                match op(e).await {
                    Err(e) if e.is_stale_element_reference() => {}
                    done => return done,
                }
            }
        })
        .await;
        match done {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => self.fail(&format!("webdriver on {css:?}: {e}")).await,
            Err(_) => self.fail(&format!("{css:?} not usable in 30 s")).await,
        }
    }

    /// Clicks the first element matching `css`.
    pub async fn click(&self, css: &str) {
        self.on(css, async |e| e.click().await).await;
    }

    /// Types `text` into the first element matching `css` (cleared first).
    pub async fn fill(&self, css: &str, text: &str) {
        self.on(css, async |e| {
            e.clear().await?;
            e.send_keys(text).await
        })
        .await;
    }

    /// The rendered text of the first element matching `css`.
    pub async fn text(&self, css: &str) -> String {
        self.on(css, async |e| e.text().await).await
    }

    /// Runs `script` (a function body; `return` gives the result).
    pub async fn script(&self, script: &str) -> Value {
        match self.client.execute(script, Vec::new()).await {
            Ok(v) => v,
            Err(e) => self.fail(&format!("script {script:?}: {e}")).await,
        }
    }

    /// Waits (fantoccini's `wait().for_element`) for an element matching
    /// `css`; panics with `what` and the page after [`WAIT`].
    pub async fn wait_for_element(&self, what: &str, css: &str) -> Element {
        let found = self
            .client
            .wait()
            .at_most(WAIT)
            .every(POLL)
            .for_element(Locator::Css(css))
            .await;
        match found {
            Ok(e) => e,
            Err(e) => self.fail(&format!("{what} ({css:?}): {e}")).await,
        }
    }

    /// Checks `check` until it holds (every [`POLL`], at most [`WAIT`]);
    /// panics with `what` and the page otherwise.
    pub async fn wait_for(&self, what: &str, check: impl AsyncFn(&Browser) -> bool) {
        let held = timeout(WAIT, async {
            let mut tick = interval(POLL);
            while !check(self).await {
                tick.tick().await;
            }
        })
        .await;
        if held.is_err() {
            self.fail(&format!("{what}: not within 30 s")).await
        }
    }

    /// Saves a PNG of the whole page (its full height, at most 4000 px)
    /// to `path`, 1280 px wide.
    pub async fn screenshot(&self, path: &Path) {
        self.screenshot_width(path, 1280).await;
    }

    /// [`Browser::screenshot`] at `width` px (390: a phone).
    pub async fn screenshot_width(&self, path: &Path, width: u32) {
        self.client.set_window_size(width, 900).await.unwrap();
        let height = self
            .script("return Math.min(4000, document.documentElement.scrollHeight);")
            .await
            .as_u64()
            .map_or(900, |h| u32::try_from(h).unwrap());
        self.client
            .set_window_size(width, height.max(600) + 140)
            .await
            .unwrap();
        let png = self.client.screenshot().await.unwrap();
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(path, png).unwrap();
        self.client.set_window_size(1280, 900).await.unwrap();
    }
}

impl Drop for Browser {
    /// Ends the session (chromium quits) before chromedriver is killed.
    /// fantoccini would only send that from a task of its own once the last
    /// `Client` is gone, racing the kill; the tests run on a multi-thread
    /// runtime, where this thread may block for it.
    fn drop(&mut self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if rt.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
            return;
        }
        let close = timeout(Duration::from_secs(10), self.client.clone().close());
        let _ = tokio::task::block_in_place(|| rt.block_on(close));
    }
}

/// Where `cargo xtask screenshots` wants the pages
/// (`OUTBOX_CONSOLE_SCREENSHOTS`), if it does.
pub fn screenshot_dir() -> Option<PathBuf> {
    std::env::var_os("OUTBOX_CONSOLE_SCREENSHOTS").map(PathBuf::from)
}
