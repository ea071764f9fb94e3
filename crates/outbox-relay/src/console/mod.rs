//! `outbox-relay console`: the operator console, a small web application
//! served by the binary (axum's HTTP/1 server, server-rendered HTML, every
//! asset embedded: no CDN, works offline, no Node build step).
//!
//! | path | page |
//! |------|------|
//! | `GET /` | overview: groups with events behind and lag, paused groups, charts of the last hour, relays' sink state (`--relay`), rotation and horizon |
//! | `GET /shards` | shards & relays: who holds which shard, lease expiry, per-shard lag |
//! | `GET /lane` | the retry lane of a group (`group`): each head (an event that failed, is scheduled for later, or is dead and blocks its key) with the events of its key waiting behind it |
//! | `GET /dead` | dead letters of a group, filtered (`type`, `code`, `key`, `older_than`, `newer_than`), paged by id (`after`, `limit`) |
//! | `GET /dead/{id}` | one dead letter: headers, payload (pretty JSON when JSON), final error, attempts |
//! | `POST /dead/confirm` | the confirmation page of a replay or purge: states the count |
//! | `POST /dead/act` | replays or purges the confirmed selection |
//! | `POST /groups/pause`, `POST /groups/resume` | pause (with a reason) or resume a group |
//! | `GET /login`, `POST /login`, `POST /logout` | the admin session |
//!
//! Over several stores (`--store NAME=URL` repeated, `--stores FILE`, as
//! `run` takes them) `GET /` is the index of the stores (each one's events
//! behind, largest lag and dead letters) and each store's pages above are
//! served under `/stores/NAME` (`/stores/NAME` its overview,
//! `/stores/NAME/dead`, ...), every link and form of them within that
//! prefix; the login, the logout and the assets stay at the root: one
//! session holds for every store. One store keeps the paths above.
//!
//! Before any handler, [`guard`] refuses a request whose `Host` the
//! console does not answer to (`421`), and, when the console has an admin
//! token, one without a live session (`303` to the login for a page,
//! `401` otherwise; the login page and the assets are open).
//!
//! Every read and change goes through the store calls the CLI uses
//! (`status`'s document, [`DeadLetterStore`], [`ControlStore`],
//! [`HeldKeyStore`](outbox_core::HeldKeyStore)); the
//! console adds no SQL. Safety ([`auth`]): read-only without an admin
//! token (every page shown, dead-letter payloads included, to whoever
//! reaches it); with one, every page and change needs a session opened
//! with the token, and every change the session's CSRF token; only the
//! console's own host names are answered; loopback only unless
//! `--allow-remote`; every
//! change is logged (target `outbox_relay::console::audit`: who, what,
//! which group, the selection, how many) and a pause records its author
//! in the store's pause note. Errors are pages with a status code and a
//! message (passwords and the token scrubbed), never a blank page.

mod auth;
mod error;
mod groups;
mod html;
mod pages;
mod params;
mod sampler;
mod samples;
mod state;
mod views;

use crate::any::AnyStore;
use crate::config::stores::StoreSpec;
use crate::config::StoreArgs;
use anyhow::{bail, Context as _};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{any, get, post};
use axum::Router;
use clap::Args;
use error::{security_headers, ConsoleError};
use outbox_core::redact_url;
use state::{Console, Index, Site};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// `console`.
#[derive(Debug, Args)]
pub(crate) struct ConsoleArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Where to serve the console. A non-loopback address needs --allow-remote.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8089")]
    listen: SocketAddr,
    /// Serve on a non-loopback --listen address (put TLS in front of it:
    /// the console speaks plain HTTP).
    #[arg(long)]
    allow_remote: bool,
    /// A file holding the admin token (at least 16 characters): without a
    /// token the console is read-only.
    #[arg(long, value_name = "FILE", conflicts_with = "admin_token_env")]
    admin_token_file: Option<PathBuf>,
    /// The environment variable holding the admin token.
    #[arg(long, value_name = "VAR")]
    admin_token_env: Option<String>,
    /// A host name the console also answers to (NAME or NAME:PORT: a
    /// proxy's or a DNS name of yours), besides its --listen address (and
    /// localhost on loopback): requests naming any other host are refused,
    /// so a web page cannot reach the console through DNS rebinding.
    /// Repeatable, or comma-separated.
    #[arg(long = "allowed-host", value_name = "NAME", value_delimiter = ',')]
    allowed_hosts: Vec<String>,
    /// A running relay's --metrics-addr (host:port): its sink state on the
    /// overview, its delivered events in the throughput chart. Repeatable.
    #[arg(long = "relay", value_name = "ADDR")]
    relays: Vec<String>,
    /// Seconds between two chart samples (the charts keep an hour).
    #[arg(long, value_name = "SECS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=600))]
    sample_secs: u64,
    /// How long an admin session lasts, in minutes.
    #[arg(long, value_name = "MIN", default_value_t = 720,
          value_parser = clap::value_parser!(u64).range(1..=10_080))]
    session_minutes: u64,
}

/// How a console is served: `console`'s flags, or the settings of
/// `run --console-addr` (the same pages beside a running relay).
#[derive(Debug)]
pub(crate) struct Serving {
    /// Where to listen.
    pub(crate) listen: SocketAddr,
    /// A non-loopback `listen` was asked for explicitly.
    pub(crate) allow_remote: bool,
    /// The admin token: `None` serves a read-only console.
    pub(crate) token: Option<String>,
    /// Host names answered besides the listen address ([`auth::Hosts`]).
    pub(crate) allowed_hosts: Vec<String>,
    /// Relays' metrics addresses whose sink state the overview shows.
    pub(crate) relays: Vec<String>,
    /// Seconds between two chart samples.
    pub(crate) sample_secs: u64,
    /// How long an admin session lasts, in minutes.
    pub(crate) session_minutes: u64,
}

impl Serving {
    /// The defaults of `console`'s flags, listening on `listen`.
    pub(crate) fn new(listen: SocketAddr) -> Self {
        Self {
            listen,
            allow_remote: false,
            token: None,
            allowed_hosts: Vec::new(),
            relays: Vec::new(),
            sample_secs: 10,
            session_minutes: 720,
        }
    }

    /// Refuses a non-loopback address unless `allow_remote`, so a console
    /// is never exposed by accident, and a malformed allowed host.
    pub(crate) fn check(&self) -> anyhow::Result<()> {
        auth::Hosts::new(self.listen.ip(), &self.allowed_hosts)?;
        if !self.listen.ip().is_loopback() && !self.allow_remote {
            bail!(
                "refusing to serve the console on {}: not a loopback address; allow it explicitly \
                 (`console --allow-remote`, `run --console-allow-remote`) and put TLS in front: \
                 the console speaks plain HTTP",
                self.listen
            );
        }
        Ok(())
    }

    /// Binds the listener ([`Serving::check`] first).
    pub(crate) async fn bind(&self) -> anyhow::Result<tokio::net::TcpListener> {
        self.check()?;
        tokio::net::TcpListener::bind(self.listen)
            .await
            .with_context(|| format!("cannot serve the console on {}", self.listen))
    }
}

/// Runs `console` until SIGINT/SIGTERM.
pub(crate) async fn run(args: ConsoleArgs, secrets: &mut Vec<String>) -> anyhow::Result<()> {
    let serving = Serving {
        listen: args.listen,
        allow_remote: args.allow_remote,
        token: load_token(
            args.admin_token_file.as_deref(),
            args.admin_token_env.as_deref(),
            secrets,
        )?,
        allowed_hosts: args.allowed_hosts,
        relays: args.relays,
        sample_secs: args.sample_secs,
        session_minutes: args.session_minutes,
    };
    // Refuse a remote address before connecting to anything.
    serving.check()?;
    if let Some(specs) = crate::config::stores::plan(&args.store.resolve()?)? {
        for spec in &specs {
            secrets.extend(spec.resolved.secrets());
        }
        let stores = open_stores(specs, secrets).await;
        let listener = serving.bind().await?;
        return serve_stores(listener, stores, serving, secrets.clone()).await;
    }
    let (store, url) = crate::open::store(&args.store, secrets).await?;
    let listener = serving.bind().await?;
    serve(listener, store, &url, serving, secrets.clone()).await
}

/// Reads the admin token from `file` or the variable `var` (at least 16
/// characters) and adds it to `secrets`, so no message ever shows it.
pub(crate) fn load_token(
    file: Option<&std::path::Path>,
    var: Option<&str>,
    secrets: &mut Vec<String>,
) -> anyhow::Result<Option<String>> {
    let token = auth::load_token(file, var)?;
    if let Some(t) = &token {
        secrets.push(t.clone());
    }
    Ok(token)
}

/// Serves the console on `listener` until SIGINT/SIGTERM. `secrets`
/// (passwords, the token) are scrubbed from every page and log line.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    store: AnyStore,
    url: &str,
    serving: Serving,
    secrets: Vec<String>,
) -> anyhow::Result<()> {
    let addr = listener.local_addr().unwrap_or(serving.listen);
    let site = site(addr, &serving, redact_url(url), false, secrets)?;
    let console = store_console(&site, &serving, store, None);
    info!(
        url = %format!("http://{addr}/"),
        store = %console.store_url,
        admin = site.auth.is_some(),
        "console: serving (read-only unless an admin token is configured)"
    );
    let app = Router::new()
        .merge(store_routes(console))
        .merge(site_routes(site.clone()));
    serve_app(listener, app, site).await
}

/// Opens the stores of `specs` at the same time: each one's store, or why
/// it could not be opened (scrubbed of `secrets`), in the order given.
pub(crate) async fn open_stores(
    specs: Vec<StoreSpec>,
    secrets: &[String],
) -> Vec<(String, Result<AnyStore, String>)> {
    let opening: Vec<_> = specs
        .into_iter()
        .map(|spec| {
            let name = spec.name.to_string();
            // A store is shown by its name, never its URL, not even in an
            // error a driver wrote.
            let mut hidden = secrets.to_vec();
            hidden.extend(spec.resolved.store_url());
            let opened =
                tokio::spawn(async move { crate::open::resolved_store(&spec.resolved).await });
            (name, hidden, opened)
        })
        .collect();
    let mut stores = Vec::with_capacity(opening.len());
    for (name, hidden, opened) in opening {
        let store = match opened.await {
            Ok(Ok((store, _url))) => Ok(store),
            Ok(Err(e)) => Err(crate::report::render(&e, &hidden)),
            Err(e) => Err(format!("opening the store failed: {e}")),
        };
        if let Err(e) = &store {
            warn!(store = %name, error = %e, "console: cannot open the store; its pages say so, the other stores are served");
        }
        stores.push((name, store));
    }
    stores
}

/// Serves the console of several stores on `listener` until SIGINT/SIGTERM:
/// the index of `stores` at `/`, each store's pages under `/stores/NAME`
/// (a store that could not be opened answers every page with why).
pub(crate) async fn serve_stores(
    listener: tokio::net::TcpListener,
    stores: Vec<(String, Result<AnyStore, String>)>,
    serving: Serving,
    secrets: Vec<String>,
) -> anyhow::Result<()> {
    let addr = listener.local_addr().unwrap_or(serving.listen);
    let site = site(addr, &serving, String::new(), true, secrets)?;
    let names: Vec<&str> = stores.iter().map(|(n, _)| n.as_str()).collect();
    info!(
        url = %format!("http://{addr}/"),
        stores = %names.join(","),
        admin = site.auth.is_some(),
        "console: serving several stores (read-only unless an admin token is configured)"
    );
    let stores: Vec<(String, Result<Arc<Console>, String>)> = stores
        .into_iter()
        .map(|(name, store)| {
            let console = store.map(|s| store_console(&site, &serving, s, Some(&name)));
            (name, console)
        })
        .collect();
    let mut app = Router::new()
        .route("/", get(pages::index))
        .with_state(Arc::new(Index {
            site: site.clone(),
            stores: stores.clone(),
        }))
        .merge(site_routes(site.clone()));
    for (name, console) in stores {
        let prefix = format!("/stores/{name}");
        app = match console {
            Ok(console) => app.nest(&prefix, store_routes(console)),
            Err(error) => {
                let down = move || {
                    let (name, error) = (name.clone(), error.clone());
                    async move { pages::store_not_open(&name, &error) }
                };
                app.route(&prefix, any(down.clone()))
                    .route(&format!("{prefix}/{{*rest}}"), any(down))
            }
        };
    }
    serve_app(listener, app, site).await
}

/// What the stores of a console share, built from `serving`.
fn site(
    addr: SocketAddr,
    serving: &Serving,
    footer: String,
    several: bool,
    secrets: Vec<String>,
) -> anyhow::Result<Arc<Site>> {
    let hosts = auth::Hosts::new(addr.ip(), &serving.allowed_hosts)?;
    if serving.token.is_none() && !addr.ip().is_loopback() {
        warn!(
            %addr,
            "console: no admin token on a non-loopback address: whoever reaches it reads every page, \
             dead-letter payloads and headers included; give it an admin token"
        );
    }
    Ok(Arc::new(Site {
        auth: serving
            .token
            .clone()
            .map(|t| auth::Auth::new(t, Duration::from_secs(serving.session_minutes * 60))),
        hosts,
        secrets,
        footer,
        several,
    }))
}

/// The console of one store (named among several: its pages under
/// `/stores/NAME`, its footer without its URL), its chart sampler started.
fn store_console(
    site: &Arc<Site>,
    serving: &Serving,
    store: AnyStore,
    name: Option<&str>,
) -> Arc<Console> {
    let console = Arc::new(Console {
        site: site.clone(),
        store,
        store_url: if name.is_some() {
            String::new()
        } else {
            site.footer.clone()
        },
        name: name.map(str::to_owned),
        base: name.map_or_else(String::new, |n| format!("/stores/{n}")),
        relays: serving.relays.clone(),
        samples: samples::Samples::default(),
        sample_secs: serving.sample_secs,
        scoped: tokio::sync::Mutex::new(HashMap::new()),
    });
    tokio::spawn(sampler::run(
        console.clone(),
        Duration::from_secs(serving.sample_secs),
    ));
    console
}

/// `app` behind the [`guard`], with the console's error pages, served on
/// `listener` until SIGINT/SIGTERM.
async fn serve_app(
    listener: tokio::net::TcpListener,
    app: Router,
    site: Arc<Site>,
) -> anyhow::Result<()> {
    let app = app
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(site, guard))
        .into_make_service_with_connect_info::<SocketAddr>();
    axum::serve(listener, app)
        .with_graceful_shutdown(crate::shutdown::signal())
        .await
        .context("the console's server failed")?;
    Ok(())
}

/// The console's own routes, the same for one store and for several: the
/// admin session and the assets.
fn site_routes(site: Arc<Site>) -> Router {
    Router::new()
        .route("/login", get(pages::login_page).post(pages::login))
        .route("/logout", post(pages::logout))
        .route("/assets/console.css", get(css))
        .route("/assets/console.js", get(js))
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(site)
}

/// The pages of one store, relative to its prefix (none for the one store).
fn store_routes(console: Arc<Console>) -> Router {
    Router::new()
        .route("/", get(pages::overview))
        .route("/shards", get(pages::shards))
        .route("/lane", get(pages::lane))
        .route("/dead", get(pages::dead_list))
        .route("/dead/confirm", post(pages::dead_confirm))
        .route("/dead/act", post(pages::dead_act))
        .route("/dead/{id}", get(pages::dead_detail))
        .route("/groups/pause", post(pages::pause))
        .route("/groups/resume", post(pages::resume))
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(console)
}

/// Runs before every handler (the fallbacks too): refuses a request that
/// names a host the console does not answer to (`421`: DNS rebinding), then,
/// with an admin token, one without a live session, except the login page
/// and the assets: a page (`GET`, `HEAD`) is redirected to the login with
/// `next` naming it, anything else gets the `401` page. Neither reads the
/// store, so neither shows anything of it.
async fn guard(State(c): State<Arc<Site>>, req: Request, next: Next) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    if !c.hosts.allows(&host) {
        warn!(host = ?host, path = %req.uri().path(), "console: request for another host name refused (DNS rebinding?)");
        let named = if host.is_empty() {
            "no host (no Host header)".to_owned()
        } else {
            format!("{host:?}")
        };
        return ConsoleError::new(
            StatusCode::MISDIRECTED_REQUEST,
            "Unknown host name",
            format!(
                "This console answers to {} only; this request named {named}. A page of another \
                 site may be trying to reach the console under its own name (DNS rebinding): \
                 nothing was read or changed. If you reach the console under this name (a proxy \
                 or a DNS name of yours), start it with --allowed-host NAME (run: \
                 console_allowed_hosts).",
                c.hosts.describe()
            ),
        )
        .into_response();
    }
    if let Some(auth) = &c.auth {
        let path = req.uri().path();
        if path != "/login" && !path.starts_with("/assets/") {
            if let Err(e) = auth::require_session(auth, req.headers()) {
                if req.method() == Method::GET || req.method() == Method::HEAD {
                    let here = req.uri().path_and_query().map_or("/", |p| p.as_str());
                    let mut r =
                        Redirect::to(&format!("/login?next={}", html::enc(here))).into_response();
                    security_headers(r.headers_mut());
                    return r;
                }
                return e.into_response();
            }
        }
    }
    next.run(req).await
}

async fn not_found() -> ConsoleError {
    ConsoleError::not_found("There is no such page in the console.")
}

async fn method_not_allowed() -> ConsoleError {
    ConsoleError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "Method not allowed",
        "This page does not take that kind of request (changes are forms sent with POST from the console's pages).",
    )
}

async fn css() -> Response {
    asset(
        "text/css; charset=utf-8",
        include_str!("assets/console.css"),
    )
}

async fn js() -> Response {
    asset(
        "text/javascript; charset=utf-8",
        include_str!("assets/console.js"),
    )
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    security_headers(h);
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}
