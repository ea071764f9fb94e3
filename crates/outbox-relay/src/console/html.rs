//! Server-rendered HTML: an escape helper, the page layout and small pieces
//! (tables, badges, the inline SVG chart).
//!
//! Every value that comes from the store, the request or the operator goes
//! through [`esc`] (text and attribute values) or [`enc`] (URL query
//! components) before it reaches a page; the layout and the literal markup
//! are the only unescaped text. No template engine: the pages are small,
//! and `format!` with an escape helper costs no build time.

use std::fmt::Write as _;

/// `s` escaped for HTML text and double- or single-quoted attribute values.
pub(crate) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `s` percent-encoded as one query-string component.
pub(crate) fn enc(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// Who is looking: shown in the header, and whether action forms appear.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Viewer<'a> {
    /// Not known (an error page, rendered without the request's session).
    Unknown,
    /// The console has no admin token: nothing can be changed.
    ReadOnly,
    /// An admin token is configured, but this browser has no session.
    Anonymous,
    /// A logged-in operator, with the session's CSRF token for forms.
    Admin {
        /// The name given at login.
        who: &'a str,
        /// The session's CSRF token.
        csrf: &'a str,
    },
}

impl Viewer<'_> {
    /// The hidden CSRF field of a form (empty unless logged in).
    pub(crate) fn csrf_field(&self) -> String {
        match self {
            Viewer::Admin { csrf, .. } => {
                format!(r#"<input type="hidden" name="csrf" value="{}">"#, esc(csrf))
            }
            _ => String::new(),
        }
    }

    /// Whether action forms are shown.
    pub(crate) fn can_act(&self) -> bool {
        matches!(self, Viewer::Admin { .. })
    }
}

/// What a page shows around its body.
#[derive(Debug)]
pub(crate) struct Frame<'a> {
    /// The `<title>` and `<h1>`.
    pub(crate) title: &'a str,
    /// Which navigation entry is current (`overview`, `shards`, `lane`, `dead`).
    pub(crate) active: &'a str,
    /// Who is looking.
    pub(crate) viewer: Viewer<'a>,
    /// Re-fetch the page every this many seconds (the script swaps `<main>`).
    pub(crate) refresh: Option<u64>,
    /// The footer's store: its URL, password redacted (the one store), or
    /// empty.
    pub(crate) store: &'a str,
    /// Where the store's pages are (`""` for the one store, `/stores/NAME`
    /// among several): the navigation's links start with it. `None` on a
    /// page of no store (the index of stores, the login among several).
    pub(crate) base: Option<&'a str>,
    /// The store's name among several: in the title and the header.
    pub(crate) name: Option<&'a str>,
    /// The console serves several stores: the navigation starts with the
    /// index of stores (`/`).
    pub(crate) several: bool,
}

/// The path of a store's page `path` under its prefix `base`: the overview
/// (`/`) of a store among several is the prefix itself.
pub(crate) fn at(base: &str, path: &str) -> String {
    if path == "/" && !base.is_empty() {
        base.to_owned()
    } else {
        format!("{base}{path}")
    }
}

/// A whole page: header with navigation and login state, `body` inside
/// `<main>`, footer.
pub(crate) fn page(frame: &Frame<'_>, body: &str) -> String {
    let stores = frame
        .several
        .then_some(("stores", "/".to_owned(), "Stores"));
    let pages = frame.base.into_iter().flat_map(|base| {
        [
            ("overview", "/", "Overview"),
            ("shards", "/shards", "Shards &amp; relays"),
            ("lane", "/lane", "Retry lane"),
            ("dead", "/dead", "Dead letters"),
        ]
        .map(|(id, path, label)| (id, at(base, path), label))
    });
    let nav = stores
        .into_iter()
        .chain(pages)
        .map(|(id, href, label)| {
            let current = if id == frame.active {
                r#" aria-current="page""#
            } else {
                ""
            };
            format!(r#"<a href="{href}"{current}>{label}</a>"#)
        })
        .collect::<String>();
    let (name_title, name_header) = match frame.name {
        Some(name) => (
            format!("{} · ", esc(name)),
            format!(
                r#"<span class="badge" data-test="store-name">store {}</span>"#,
                esc(name)
            ),
        ),
        None => (String::new(), String::new()),
    };
    let who = match frame.viewer {
        Viewer::Unknown => String::new(),
        Viewer::ReadOnly => {
            r#"<span class="badge" title="started without an admin token">read-only</span>"#
                .to_owned()
        }
        Viewer::Anonymous => r#"<a href="/login" class="button">Log in</a>"#.to_owned(),
        Viewer::Admin { who, .. } => format!(
            r#"<form method="post" action="/logout" class="inline"><span class="who">{}</span> {}<button type="submit">Log out</button></form>"#,
            esc(who),
            frame.viewer.csrf_field()
        ),
    };
    let refresh = match frame.refresh {
        Some(secs) => format!(r#" data-refresh="{secs}""#),
        None => String::new(),
    };
    let live = if frame.refresh.is_some() {
        r#"<p class="muted small"><label><input type="checkbox" id="auto-refresh" checked> live</label> <span id="refresh-state"></span></p>"#
    } else {
        ""
    };
    format!(
        r#"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · {name_title}outbox console</title>
<link rel="stylesheet" href="/assets/console.css">
<script src="/assets/console.js" defer></script>
</head>
<body>
<header><span class="brand">outbox console</span>{name_header}<nav>{nav}</nav><span class="session">{who}</span></header>
<h1>{title}</h1>
{live}
<main{refresh}>
{body}
</main>
<footer>{store}outbox-relay {version}</footer>
</body>
</html>
"#,
        title = esc(frame.title),
        store = if frame.store.is_empty() {
            String::new()
        } else {
            format!("store <code>{}</code> · ", esc(frame.store))
        },
        version = env!("CARGO_PKG_VERSION"),
    )
}

/// A table with a header row; `rows` are already-rendered `<tr>` contents.
pub(crate) fn table(class: &str, headers: &[&str], rows: &[String]) -> String {
    let mut out = format!(r#"<div class="scroll"><table class="{class}"><thead><tr>"#);
    for h in headers {
        let _ = write!(out, "<th>{h}</th>");
    }
    out.push_str("</tr></thead><tbody>");
    for r in rows {
        let _ = write!(out, "<tr>{r}</tr>");
    }
    out.push_str("</tbody></table></div>");
    out
}

/// `12.3 s`, `4 min 5 s`, `2 h 3 min`, or `-`.
pub(crate) fn duration(secs: Option<f64>) -> String {
    let Some(s) = secs else {
        return "-".to_owned();
    };
    if s < 60.0 {
        format!("{s:.1} s")
    } else if s < 3600.0 {
        format!("{} min {} s", (s / 60.0) as u64, (s % 60.0) as u64)
    } else if s < 86_400.0 {
        format!(
            "{} h {} min",
            (s / 3600.0) as u64,
            ((s % 3600.0) / 60.0) as u64
        )
    } else {
        format!(
            "{} d {} h",
            (s / 86_400.0) as u64,
            ((s % 86_400.0) / 3600.0) as u64
        )
    }
}

/// Line colours of the charts (and their legends), in series order.
const PALETTE: &[&str] = &[
    "#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04",
];

/// One line of a chart: its name and `(seconds ago, value)` points.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    /// The legend's label.
    pub(crate) name: String,
    /// `(seconds before now, value)`.
    pub(crate) points: Vec<(f64, f64)>,
}

/// The smallest of 1, 2, 5 x 10^n at least `v` (the y-axis top).
fn nice_max(v: f64) -> f64 {
    if v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let mag = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * mag >= v {
            return m * mag;
        }
    }
    10.0 * mag
}

/// A line chart of `series` over the last `window` seconds as inline SVG
/// (no script, no external file), with a legend.
pub(crate) fn chart(title: &str, unit: &str, window: f64, series: &[Series]) -> String {
    const W: f64 = 640.0;
    const H: f64 = 170.0;
    const LEFT: f64 = 56.0;
    const BOTTOM: f64 = 22.0;
    const TOP: f64 = 8.0;
    let max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0f64, f64::max);
    let top = nice_max(max);
    let x = |ago: f64| LEFT + (W - LEFT - 4.0) * (1.0 - (ago / window).clamp(0.0, 1.0));
    let y = |v: f64| TOP + (H - TOP - BOTTOM) * (1.0 - (v / top).clamp(0.0, 1.0));
    let mut svg = format!(
        r#"<svg viewBox="0 0 {W} {H}" class="chart" role="img" aria-label="{}">"#,
        esc(title)
    );
    for i in 0..=4 {
        let v = top * f64::from(i) / 4.0;
        let yy = y(v);
        let _ = write!(
            svg,
            r##"<line x1="{LEFT}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#e5e7eb"/><text x="{}" y="{:.1}" text-anchor="end" font-size="11" fill="#6b7280">{}</text>"##,
            W - 4.0,
            LEFT - 6.0,
            yy + 4.0,
            esc(&axis_label(v, unit))
        );
    }
    for (ago, label) in [(window, "-60 min"), (window / 2.0, "-30 min"), (0.0, "now")] {
        let anchor = if ago == 0.0 { "end" } else { "middle" };
        let _ = write!(
            svg,
            r##"<text x="{:.1}" y="{}" text-anchor="{anchor}" font-size="11" fill="#6b7280">{label}</text>"##,
            x(ago).max(LEFT + 20.0),
            H - 6.0
        );
    }
    for (i, s) in series.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        let points: Vec<String> = s
            .points
            .iter()
            .map(|(ago, v)| format!("{:.1},{:.1}", x(*ago), y(*v)))
            .collect();
        if points.len() == 1 {
            let _ = write!(
                svg,
                r#"<circle cx="{}" r="2.5" fill="{colour}"/>"#,
                points[0].replacen(',', "\" cy=\"", 1)
            );
        } else if !points.is_empty() {
            let _ = write!(
                svg,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
                points.join(" ")
            );
        }
    }
    svg.push_str("</svg>");
    let legend: String = series
        .iter()
        .enumerate()
        .map(|(i, s)| {
            format!(
                r#"<li><svg width="12" height="12" aria-hidden="true"><rect width="12" height="12" fill="{}"/></svg> {}</li>"#,
                PALETTE[i % PALETTE.len()],
                esc(&s.name)
            )
        })
        .collect();
    format!(
        r#"<figure class="chart"><figcaption>{}</figcaption>{svg}<ul class="legend">{legend}</ul></figure>"#,
        esc(title)
    )
}

fn axis_label(v: f64, unit: &str) -> String {
    let n = if v >= 10_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    };
    if unit.is_empty() {
        n
    } else {
        format!("{n} {unit}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_quotes() {
        assert_eq!(
            esc(r#"<script>alert("x")</script>&'"#),
            "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&#39;"
        );
        assert_eq!(enc("a b&c=d/é"), "a+b%26c%3Dd%2F%C3%A9");
    }

    #[test]
    fn durations_read_naturally() {
        assert_eq!(duration(None), "-");
        assert_eq!(duration(Some(3.25)), "3.2 s");
        assert_eq!(duration(Some(125.0)), "2 min 5 s");
        assert_eq!(duration(Some(7_380.0)), "2 h 3 min");
        assert_eq!(duration(Some(90_000.0)), "1 d 1 h");
    }

    #[test]
    fn charts_escape_names_and_scale_to_a_nice_top() {
        assert_eq!(nice_max(0.0), 1.0);
        assert_eq!(nice_max(7.0), 10.0);
        assert_eq!(nice_max(120.0), 200.0);
        let svg = chart(
            "lag",
            "s",
            3600.0,
            &[Series {
                name: "<g>".into(),
                points: vec![(3600.0, 0.0), (0.0, 7.0)],
            }],
        );
        assert!(svg.contains("<polyline"), "{svg}");
        assert!(svg.contains("&lt;g&gt;") && !svg.contains("<g>"), "{svg}");
        assert!(svg.contains(">10 s<"), "{svg}");
    }
}
