//! What every handler reads: the [`Site`] (the admin session and the host
//! names, one for every store served), the [`Console`] of a store (its
//! store, its samples, where its pages are) with the store calls pages
//! make through it, and who is asking ([`Seen`]).

use super::auth;
use super::error::ConsoleError;
use super::html::{Frame, Viewer};
use super::samples;
use crate::any::AnyStore;
use axum::http::{HeaderMap, StatusCode};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tracing::warn;

/// The longest a page waits for the store before it says the store did
/// not answer (the pool's own acquire timeout is 30 s).
pub(super) const STORE_TIMEOUT: Duration = Duration::from_secs(5);

/// The audit log's target: one INFO line per change.
pub(super) const AUDIT: &str = "outbox_relay::console::audit";

/// What the stores served by one console share: one admin session (a
/// login holds for every store), the host names, the secrets.
#[derive(Debug)]
pub(crate) struct Site {
    pub(super) auth: Option<auth::Auth>,
    /// The host names it answers to.
    pub(super) hosts: auth::Hosts,
    /// Passwords and the token: scrubbed from every message shown or logged.
    pub(super) secrets: Vec<String>,
    /// The footer of its own pages (the login): the one store's URL,
    /// password redacted, or empty among several stores.
    pub(super) footer: String,
    /// It serves several stores: an index of them at `/`, each store's
    /// pages under `/stores/NAME`.
    pub(super) several: bool,
}

impl Site {
    /// The frame of a page of no store in particular (the login, the
    /// index of stores).
    pub(super) fn frame<'a>(
        &'a self,
        title: &'a str,
        active: &'a str,
        seen: &'a Seen,
        refresh: Option<u64>,
    ) -> Frame<'a> {
        Frame {
            title,
            active,
            viewer: seen.viewer(),
            refresh,
            store: &self.footer,
            base: (!self.several).then_some(""),
            name: None,
            several: self.several,
        }
    }
}

/// The index of a console over several stores: each store by name, with
/// its console or why it could not be opened at start.
#[derive(Debug)]
pub(crate) struct Index {
    pub(super) site: Arc<Site>,
    pub(super) stores: Vec<(String, Result<Arc<Console>, String>)>,
}

/// What the handlers of one store's pages read.
#[derive(Debug)]
pub(crate) struct Console {
    pub(super) site: Arc<Site>,
    pub(super) store: AnyStore,
    /// The footer's store: its URL, password redacted (the one store), or
    /// empty among several (a store is named, never shown by its URL).
    pub(super) store_url: String,
    /// Its name among several stores.
    pub(super) name: Option<String>,
    /// The prefix of its pages' paths: `""` for the one store (today's
    /// paths), `/stores/NAME` among several. Every link and form of its
    /// pages starts with it.
    pub(super) base: String,
    pub(super) relays: Vec<String>,
    pub(super) samples: samples::Samples,
    pub(super) sample_secs: u64,
    /// The event log as seen by each other group, opened on first use
    /// (only the event log has other groups).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(super) scoped: tokio::sync::Mutex<HashMap<String, AnyStore>>,
}

/// A store call failed: `503`, with the error (scrubbed), logged.
fn store_down(console: &Console, what: &str, e: impl Into<anyhow::Error>) -> ConsoleError {
    let e: anyhow::Error = e.into();
    let text = crate::report::render(&e, &console.site.secrets);
    warn!(error = %text, "console: {what}");
    ConsoleError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "The store did not answer",
        format!("{what}: {text}. The page works again once the store answers; reload it."),
    )
}

/// The session of a request, as a [`Viewer`] (owned parts).
pub(super) struct Seen {
    who: Option<(String, String)>,
    admin: bool,
}

impl Seen {
    pub(super) fn of(site: &Site, headers: &HeaderMap) -> Self {
        let who = site.auth.as_ref().and_then(|a| match a.session(headers) {
            auth::SessionState::Live(s) => Some((s.who, s.csrf)),
            _ => None,
        });
        Self {
            who,
            admin: site.auth.is_some(),
        }
    }

    pub(super) fn viewer(&self) -> Viewer<'_> {
        match (&self.who, self.admin) {
            (Some((who, csrf)), _) => Viewer::Admin { who, csrf },
            (None, true) => Viewer::Anonymous,
            (None, false) => Viewer::ReadOnly,
        }
    }
}

impl Console {
    pub(super) fn frame<'a>(
        &'a self,
        title: &'a str,
        active: &'a str,
        seen: &'a Seen,
        refresh: Option<u64>,
    ) -> Frame<'a> {
        Frame {
            title,
            active,
            viewer: seen.viewer(),
            refresh,
            store: &self.store_url,
            base: Some(&self.base),
            name: self.name.as_deref(),
            several: self.site.several,
        }
    }

    /// The groups a page may name: the event log's groups (and the
    /// console's own `--group`), or `default`.
    pub(super) async fn group_names(&self) -> Result<Vec<String>, ConsoleError> {
        #[cfg(feature = "postgres")]
        if let AnyStore::PgLog(log) = &self.store {
            let mut names = self
                .call("cannot read the consumer groups", log.group_names())
                .await?;
            if !names.iter().any(|n| n == log.group()) {
                names.push(log.group().to_owned());
                names.sort();
            }
            return Ok(names);
        }
        Ok(vec![self.store.group().to_owned()])
    }

    /// `group`, checked: a `404` page names the known groups otherwise.
    pub(super) async fn known_group(&self, group: &str) -> Result<(), ConsoleError> {
        let names = self.group_names().await?;
        if names.iter().any(|n| n == group) {
            return Ok(());
        }
        Err(ConsoleError::not_found(format!(
            "There is no consumer group {group:?} in this outbox (groups: {}). A group exists once \
             a relay of it has claimed; to pause one before that, start the console with --group {group}.",
            names.join(", ")
        )))
    }

    /// The store as consumer group `group` reads it (its dead letters).
    pub(super) async fn store_for(&self, group: &str) -> Result<AnyStore, ConsoleError> {
        self.known_group(group).await?;
        if group == self.store.group() {
            return Ok(self.store.clone());
        }
        #[cfg(feature = "postgres")]
        if let AnyStore::PgLog(log) = &self.store {
            let mut scoped = self.scoped.lock().await;
            if let Some(s) = scoped.get(group) {
                return Ok(s.clone());
            }
            let name = outbox_postgres::GroupName::new(group).map_err(|e| {
                ConsoleError::new(
                    StatusCode::BAD_REQUEST,
                    "Invalid group",
                    format!("group {group:?}: {e}"),
                )
            })?;
            let s = AnyStore::PgLog(
                self.call("cannot open the consumer group", log.for_group(&name))
                    .await?,
            );
            scoped.insert(group.to_owned(), s.clone());
            return Ok(s);
        }
        Err(ConsoleError::not_found(format!(
            "There is no consumer group {group:?} in this outbox."
        )))
    }

    pub(super) async fn status(&self) -> Result<serde_json::Value, ConsoleError> {
        self.call(
            "cannot read the outbox's status",
            crate::status::collect(&self.store, &self.store_url, &self.relays),
        )
        .await
    }

    /// Awaits a store call for at most [`STORE_TIMEOUT`]: its error, or
    /// its silence, is a `503` page saying `what` failed.
    pub(super) async fn call<T, E: Into<anyhow::Error>>(
        &self,
        what: &str,
        call: impl std::future::Future<Output = Result<T, E>>,
    ) -> Result<T, ConsoleError> {
        match tokio::time::timeout(STORE_TIMEOUT, call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(store_down(self, what, e)),
            Err(_) => Err(store_down(
                self,
                what,
                anyhow::anyhow!("no answer within {} s", STORE_TIMEOUT.as_secs()),
            )),
        }
    }
}
