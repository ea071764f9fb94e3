//! The handlers of the console's pages and forms (routes: the module docs
//! of [`super`]). Each reads through [`Console`]'s store calls, renders with
//! [`views`], and answers a [`ConsoleError`] page when something is wrong.

use super::error::{html_response, whole_secs, ConsoleError};
use super::html::{self, esc};
use super::params::{DeadParams, Params};
use super::state::{Console, Index, Seen, Site, AUDIT};
use super::{auth, views};
use axum::body::Bytes;
use axum::extract::{ConnectInfo, Path as UrlPath, RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use outbox_core::{
    ControlStore, DeadLetterFilter, DeadLetterQuery, DeadLetterStore, EventId, HeldKeyStore,
    PauseNote,
};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use tracing::{info, warn};

/// The index of a console over several stores: each store by name (a
/// link to its pages) with its headline, read from every store at once; a
/// store that does not answer says so in its row.
pub(super) async fn index(State(ix): State<Arc<Index>>, headers: HeaderMap) -> Response {
    let reads: Vec<_> = ix
        .stores
        .iter()
        .map(|(_, console)| {
            let console = console.clone();
            tokio::spawn(async move {
                match console {
                    Ok(c) => c.status().await.map_err(|e| e.detail),
                    Err(e) => Err(format!(
                        "could not be opened when the console started ({e}); restart the console once it is up"
                    )),
                }
            })
        })
        .collect();
    let mut rows = Vec::with_capacity(reads.len());
    for ((name, _), read) in ix.stores.iter().zip(reads) {
        let read = read
            .await
            .unwrap_or_else(|e| Err(format!("the read of this store failed: {e}")));
        rows.push(views::IndexRow {
            name: name.clone(),
            status: read,
        });
    }
    let seen = Seen::of(&ix.site, &headers);
    html_response(
        StatusCode::OK,
        html::page(
            &ix.site.frame("Stores", "stores", &seen, Some(5)),
            &views::index(&rows),
        ),
    )
}

/// Every page of a store that could not be opened when the console started.
pub(super) fn store_not_open(name: &str, error: &str) -> ConsoleError {
    ConsoleError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "The store did not answer",
        format!(
            "Store {name} could not be opened when the console started: {error}. Restart the console once it is up; the other stores are served."
        ),
    )
}

pub(super) async fn overview(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
) -> Result<Response, ConsoleError> {
    let doc = c.status().await?;
    let mut paused = BTreeMap::new();
    for g in super::groups::groups_of(&doc) {
        let p = c
            .call("cannot read the pause state", c.store.paused(&g.name))
            .await?;
        paused.insert(g.name, p);
    }
    let seen = Seen::of(&c.site, &headers);
    let body = views::overview(
        &c.base,
        &doc,
        &paused,
        &c.samples,
        c.sample_secs,
        &seen.viewer(),
    );
    Ok(html_response(
        StatusCode::OK,
        html::page(&c.frame("Overview", "overview", &seen, Some(5)), &body),
    ))
}

pub(super) async fn shards(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
) -> Result<Response, ConsoleError> {
    let doc = c.status().await?;
    let seen = Seen::of(&c.site, &headers);
    Ok(html_response(
        StatusCode::OK,
        html::page(
            &c.frame("Shards & relays", "shards", &seen, Some(5)),
            &views::shards(&doc),
        ),
    ))
}

/// Most heads the retry lane page lists.
const LANE_LIMIT: u32 = 200;

pub(super) async fn lane(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Response, ConsoleError> {
    let p = Params::parse(query.as_deref().unwrap_or("").as_bytes());
    let group = p.get("group").unwrap_or(c.store.group()).to_owned();
    let store = c.store_for(&group).await?;
    let held = c
        .call("cannot read the retry lane", store.held_keys(LANE_LIMIT))
        .await?;
    let groups = c.group_names().await?;
    let seen = Seen::of(&c.site, &headers);
    Ok(html_response(
        StatusCode::OK,
        html::page(
            &c.frame("Retry lane", "lane", &seen, Some(5)),
            &views::lane(&c.base, &group, &groups, &held),
        ),
    ))
}

pub(super) async fn dead_list(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Result<Response, ConsoleError> {
    let p = Params::parse(query.as_deref().unwrap_or("").as_bytes());
    let params = DeadParams::parse(&p, c.store.group())?;
    let store = c.store_for(&params.group).await?;
    let filter = params.filter();
    let total = c
        .call("cannot count the dead letters", store.count_dead(&filter))
        .await?;
    let query = DeadLetterQuery {
        filter,
        limit: params.limit + 1,
        after: params.after,
    };
    let mut rows = c
        .call("cannot list the dead letters", store.list_dead(&query))
        .await?;
    let next = if rows.len() > params.limit as usize {
        rows.truncate(params.limit as usize);
        rows.last().map(|d| d.event.id)
    } else {
        None
    };
    let groups = c.group_names().await?;
    let seen = Seen::of(&c.site, &headers);
    let body = views::dead_list(
        &c.base,
        &params,
        &groups,
        total,
        &rows,
        next,
        &seen.viewer(),
    );
    Ok(html_response(
        StatusCode::OK,
        html::page(&c.frame("Dead letters", "dead", &seen, None), &body),
    ))
}

pub(super) async fn dead_detail(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    UrlPath(id): UrlPath<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, ConsoleError> {
    let p = Params::parse(query.as_deref().unwrap_or("").as_bytes());
    let group = p.get("group").unwrap_or(c.store.group()).to_owned();
    let id: EventId = id.parse().map_err(|_| {
        ConsoleError::new(
            StatusCode::BAD_REQUEST,
            "Invalid event id",
            format!("{id:?} is not an event id (a UUID)."),
        )
    })?;
    let store = c.store_for(&group).await?;
    let query = DeadLetterQuery {
        filter: DeadLetterFilter::ids([id]),
        limit: 1,
        after: None,
    };
    let found = c
        .call("cannot read the dead letter", store.list_dead(&query))
        .await?;
    let Some(d) = found.first() else {
        return Err(ConsoleError::not_found(format!(
            "Group {group:?} has no dead letter with id {id} (replayed or purged since?)."
        )));
    };
    let seen = Seen::of(&c.site, &headers);
    let title = format!("Dead letter {id}");
    Ok(html_response(
        StatusCode::OK,
        html::page(
            &c.frame(&title, "dead", &seen, None),
            &views::dead_detail(&c.base, &group, d, &seen.viewer()),
        ),
    ))
}

/// `do=retry:selected` etc.: replay or purge, and whether "all matching".
fn action(p: &Params) -> Result<(bool, bool), ConsoleError> {
    match p.get("do") {
        Some("retry:selected") => Ok((true, false)),
        Some("retry:all") => Ok((true, true)),
        Some("purge:selected") => Ok((false, false)),
        Some("purge:all") => Ok((false, true)),
        other => Err(ConsoleError::new(
            StatusCode::BAD_REQUEST,
            "Unknown action",
            format!(
                "action {:?}: the console replays (retry) or purges the selected or all matching dead letters",
                other.unwrap_or("")
            ),
        )),
    }
}

/// The form's selection: with "selected", at least one id.
fn selection(c: &Console, p: &Params, all: bool) -> Result<DeadParams, ConsoleError> {
    let mut params = DeadParams::parse(p, c.store.group())?;
    if all {
        params.ids.clear();
    } else if params.ids.is_empty() {
        return Err(ConsoleError::new(
            StatusCode::BAD_REQUEST,
            "Nothing selected",
            "Select at least one dead letter (the boxes on the left), or use \"all matching\".",
        ));
    }
    Ok(params)
}

pub(super) async fn dead_confirm(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let p = Params::parse(&body);
    auth::authorize(c.site.auth.as_ref(), &c.site.hosts, &headers, p.get("csrf"))?;
    let (retry, all) = action(&p)?;
    let params = selection(&c, &p, all)?;
    let store = c.store_for(&params.group).await?;
    let filter = params.filter();
    let count = c
        .call("cannot count the dead letters", store.count_dead(&filter))
        .await?;
    let seen = Seen::of(&c.site, &headers);
    let title = if retry {
        "Replay dead letters?"
    } else {
        "Purge dead letters?"
    };
    let body = if count == 0 {
        format!(
            r#"<p data-test="confirm-count">No dead letter of group {} matches ({}): nothing to do.</p><p><a href="{}/dead?{}">Back</a></p>"#,
            esc(&params.group),
            esc(&params.describe()),
            c.base,
            esc(&params.query(None))
        )
    } else {
        views::confirm(
            &views::Confirm {
                base: &c.base,
                retry,
                all,
                count,
                params: &params,
            },
            &seen.viewer(),
        )
    };
    Ok(html_response(
        StatusCode::OK,
        html::page(&c.frame(title, "dead", &seen, None), &body),
    ))
}

pub(super) async fn dead_act(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let p = Params::parse(&body);
    let session = auth::authorize(c.site.auth.as_ref(), &c.site.hosts, &headers, p.get("csrf"))?;
    let (retry, all) = action(&p)?;
    let params = selection(&c, &p, all)?;
    let expected: u64 = p
        .get("expected")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| {
            ConsoleError::new(
                StatusCode::BAD_REQUEST,
                "Not confirmed",
                "A replay or purge needs its confirmation page first (the form carries the count you confirmed).",
            )
        })?;
    let store = c.store_for(&params.group).await?;
    let filter = params.filter();
    // "All matching" may have grown since the confirmation (new dead
    // letters): never touch more than the operator saw.
    if all {
        let now = c
            .call("cannot count the dead letters", store.count_dead(&filter))
            .await?;
        if now > expected {
            return Err(ConsoleError::new(
                StatusCode::CONFLICT,
                "The selection changed",
                format!(
                    "{now} dead letters match now, {expected} when you confirmed: nothing was changed. Go back to the list and confirm again."
                ),
            ));
        }
    }
    let verb = if retry { "replay" } else { "purge" };
    let what = format!("cannot {verb} the dead letters");
    let done = if retry {
        c.call(&what, store.retry_dead(&filter)).await?
    } else {
        c.call(&what, store.purge_dead(&filter)).await?
    };
    info!(
        target: AUDIT,
        who = %session.who,
        action = verb,
        group = %params.group,
        selection = %params.describe(),
        confirmed = expected,
        changed = done,
        "console: {verb} of dead letters"
    );
    let seen = Seen::of(&c.site, &headers);
    let text = if retry {
        format!("Replayed {done} dead letter(s) of group {}: they are pending again and the relays deliver them.", params.group)
    } else {
        format!("Purged {done} dead letter(s) of group {}.", params.group)
    };
    let body = format!(
        r#"<p class="big" data-test="done">{}</p>{}<p><a href="{base}/dead?{}">Back to the dead letters</a> · <a href="{overview}">Overview</a></p>"#,
        esc(&text),
        if done != expected {
            format!(
                r#"<p class="muted">You confirmed {expected}; {done} still matched (others changed meanwhile).</p>"#
            )
        } else {
            String::new()
        },
        esc(&params.query(None)),
        base = c.base,
        overview = html::at(&c.base, "/"),
    );
    Ok(html_response(
        StatusCode::OK,
        html::page(&c.frame("Done", "dead", &seen, None), &body),
    ))
}

pub(super) async fn pause(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    set_paused(c, headers, body, true).await
}

pub(super) async fn resume(
    State(c): State<Arc<Console>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    set_paused(c, headers, body, false).await
}

async fn set_paused(
    c: Arc<Console>,
    headers: HeaderMap,
    body: Bytes,
    pause: bool,
) -> Result<Response, ConsoleError> {
    let p = Params::parse(&body);
    let session = auth::authorize(c.site.auth.as_ref(), &c.site.hosts, &headers, p.get("csrf"))?;
    let Some(group) = p.get("group") else {
        return Err(ConsoleError::new(
            StatusCode::BAD_REQUEST,
            "No group",
            "Name the consumer group to pause or resume.",
        ));
    };
    c.known_group(group).await?;
    let reason = p.get("reason").map(str::to_owned);
    if pause && reason.is_none() {
        return Err(ConsoleError::new(
            StatusCode::BAD_REQUEST,
            "A reason is needed",
            "Say why the group is paused: the reason is shown by the console, `outbox-relay status` and the relays' /readyz.",
        ));
    }
    if reason.as_ref().is_some_and(|r| r.chars().count() > 500) {
        return Err(ConsoleError::new(
            StatusCode::BAD_REQUEST,
            "Reason too long",
            "Keep the reason under 500 characters.",
        ));
    }
    let mut note = PauseNote::new().with_by(format!("{} (console)", session.who));
    if let Some(r) = &reason {
        note = note.with_reason(r.clone());
    }
    let what = if pause { "pause" } else { "resume" };
    let changed = c
        .call(
            &format!("cannot {what} the consumer group"),
            c.store.set_paused(group, pause, &note),
        )
        .await?;
    info!(
        target: AUDIT,
        who = %session.who,
        action = what,
        group = %group,
        reason = reason.as_deref().unwrap_or(""),
        changed,
        "console: {what} of a consumer group"
    );
    let text = match (pause, changed) {
        (true, true) => format!("Paused consumer group {group}: its relays stop claiming within about a second (what they claimed is delivered and settled)."),
        (true, false) => format!("Consumer group {group} was already paused: its first pause (time, author, reason) is kept."),
        (false, true) => format!("Resumed consumer group {group}: its relays claim again within about a second."),
        (false, false) => format!("Consumer group {group} was not paused."),
    };
    let seen = Seen::of(&c.site, &headers);
    let body = format!(
        r#"<p class="big" data-test="done">{}</p><p><a href="{}">Back to the overview</a></p>"#,
        esc(&text),
        html::at(&c.base, "/")
    );
    Ok(html_response(
        StatusCode::OK,
        html::page(
            &c.frame(
                if pause { "Paused" } else { "Resumed" },
                "overview",
                &seen,
                None,
            ),
            &body,
        ),
    ))
}

pub(super) async fn login_page(
    State(c): State<Arc<Site>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    let p = Params::parse(query.as_deref().unwrap_or("").as_bytes());
    let seen = Seen::of(&c, &headers);
    let body = if c.auth.is_none() {
        r#"<p>This console is read-only: it was started without an admin token (<code>--admin-token-file</code> or <code>--admin-token-env</code>).</p>"#.to_owned()
    } else {
        login_form("", auth::local_path(p.get("next")))
    };
    html_response(
        StatusCode::OK,
        html::page(&c.frame("Log in", "", &seen, None), &body),
    )
}

/// The login form; after the login, the browser goes on to `next`.
fn login_form(name: &str, next: &str) -> String {
    format!(
        r#"<form method="post" action="/login" class="login">
<input type="hidden" name="next" value="{}">
<label>Your name (recorded with every change) <input name="who" value="{}" required maxlength="64" autocomplete="username"></label>
<label>Admin token <input name="token" type="password" required autocomplete="current-password"></label>
<button type="submit" data-test="login">Log in</button>
</form>"#,
        esc(next),
        esc(name)
    )
}

pub(super) async fn login(
    State(c): State<Arc<Site>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let Some(auth) = c.auth.as_ref() else {
        return Err(ConsoleError::read_only());
    };
    auth::same_origin(&headers, &c.hosts)?;
    let p = Params::parse(&body);
    let who = p.get("who").unwrap_or("");
    if who.is_empty() || who.chars().count() > 64 || who.chars().any(char::is_control) {
        return Err(ConsoleError::new(
            StatusCode::BAD_REQUEST,
            "Name needed",
            "Give your name (1 to 64 characters): it is recorded with every change you make.",
        ));
    }
    let client = peer.ip();
    match auth.try_token(client, p.get("token").unwrap_or("")) {
        auth::Attempt::Right => {}
        auth::Attempt::Wait(wait) => {
            warn!(target: AUDIT, who = %who, %client, "console: login refused (this client gave too many wrong tokens lately)");
            return Err(ConsoleError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "Too many wrong tokens",
                format!(
                    "This client ({client}) gave too many wrong admin tokens: its next login is checked in {} s \
                     (the wait doubles with each further wrong token, up to {} minutes). Logins from other \
                     clients are not affected. Nothing was changed.",
                    whole_secs(wait),
                    auth::MAX_BACKOFF.as_secs() / 60
                ),
            )
            .with_retry_after(wait));
        }
        auth::Attempt::Wrong(wait) => {
            warn!(target: AUDIT, who = %who, %client, "console: login refused (wrong admin token)");
            let then = wait.map_or(String::new(), |w| {
                format!(
                    " Too many wrong tokens from this client: its next login is checked in {} s.",
                    whole_secs(w)
                )
            });
            let mut e = ConsoleError::new(
                StatusCode::UNAUTHORIZED,
                "Wrong admin token",
                format!("That is not the console's admin token. Nothing was changed.{then}"),
            )
            .with_login();
            if let Some(w) = wait {
                e = e.with_retry_after(w);
            }
            return Err(e);
        }
    }
    let (id, _) = auth.login(who.to_owned());
    info!(target: AUDIT, who = %who, %client, "console: login");
    let mut r = Redirect::to(auth::local_path(p.get("next"))).into_response();
    if let Ok(v) = HeaderValue::from_str(&auth.set_cookie(&id)) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    Ok(r)
}

pub(super) async fn logout(
    State(c): State<Arc<Site>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    let p = Params::parse(&body);
    let session = auth::authorize(c.auth.as_ref(), &c.hosts, &headers, p.get("csrf"))?;
    if let Some(a) = c.auth.as_ref() {
        a.logout(&headers);
    }
    info!(target: AUDIT, who = %session.who, "console: logout");
    let mut r = Redirect::to("/").into_response();
    if let Ok(v) = HeaderValue::from_str(&auth::clear_cookie()) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    Ok(r)
}
