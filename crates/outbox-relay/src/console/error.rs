//! The console's error page ([`ConsoleError`]) and the headers every page
//! it serves carries (its security headers, `Retry-After`). Below the
//! pages, the parameters and the admin session, which all answer with it.

use super::html::{self, esc, Frame, Viewer};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use std::time::Duration;

/// A page that explains what went wrong, with its status code.
#[derive(Debug)]
pub(crate) struct ConsoleError {
    pub(crate) status: StatusCode,
    pub(crate) title: String,
    pub(crate) detail: String,
    login: bool,
    retry_after: Option<Duration>,
}

impl ConsoleError {
    /// An error page.
    pub(crate) fn new(
        status: StatusCode,
        title: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            status,
            title: title.into(),
            detail: detail.into(),
            login: false,
            retry_after: None,
        }
    }

    /// Adds `Retry-After` (whole seconds, rounded up).
    pub(crate) fn with_retry_after(mut self, wait: Duration) -> Self {
        self.retry_after = Some(wait);
        self
    }

    /// Adds a link to the login page.
    pub(crate) fn with_login(mut self) -> Self {
        self.login = true;
        self
    }

    /// A change asked of a console without an admin token.
    pub(crate) fn read_only() -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "Read-only console",
            "This console was started without an admin token, so nothing can be changed from it. \
             Restart it with --admin-token-file FILE or --admin-token-env VAR to allow changes.",
        )
    }

    pub(super) fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "Not found", detail)
    }
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let frame = Frame {
            title: &self.title,
            active: "",
            viewer: Viewer::Unknown,
            refresh: None,
            store: "",
            // An error page knows no store: the one store's navigation.
            base: Some(""),
            name: None,
            several: false,
        };
        let login = if self.login {
            r#"<p><a href="/login" class="button">Log in</a></p>"#
        } else {
            ""
        };
        let body = format!(
            r#"<section class="error" data-test="error"><p><strong>{} {}</strong></p><p data-test="error-detail">{}</p>{login}<p><a href="/">Back to the overview</a></p></section>"#,
            self.status.as_u16(),
            esc(self.status.canonical_reason().unwrap_or("")),
            esc(&self.detail),
        );
        let mut r = html_response(self.status, html::page(&frame, &body));
        if let Some(wait) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(whole_secs(wait)));
        }
        r
    }
}

/// `200 text/html` with the console's security headers.
pub(super) fn html_response(status: StatusCode, body: String) -> Response {
    let mut r = (status, body).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    security_headers(h);
    r
}

pub(super) fn security_headers(h: &mut HeaderMap) {
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // `same-origin`, not `no-referrer`: with `no-referrer` browsers send
    // `Origin: null` on form posts, which [`auth::same_origin`] refuses.
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
}

/// `d` in whole seconds, rounded up, at least 1: a wait announced in
/// seconds that has passed once they have.
pub(crate) fn whole_secs(d: Duration) -> u64 {
    (d.as_secs() + u64::from(d.subsec_nanos() > 0)).max(1)
}
