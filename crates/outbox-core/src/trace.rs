//! W3C Trace Context on outbox events (feature `otel`): the one place that
//! writes and reads the [`TRACEPARENT`] / [`TRACESTATE`] headers.
//!
//! - **Capture** (store crates, at enqueue, through
//!   [`NewEvent::capture_trace_context`](crate::event::NewEvent::capture_trace_context)):
//!   the current `tracing` span's OpenTelemetry context (through
//!   `tracing-opentelemetry`'s [`OpenTelemetrySpanExt::context`]) becomes the
//!   event's `traceparent` (and `tracestate` when it has entries). A trace
//!   header the caller set (either name, any letter case) wins: nothing is
//!   added. No valid span context (no OpenTelemetry layer, no span) -> no
//!   header.
//! - **Continue** (the relay): [`continue_trace`] makes the span an event is
//!   delivered under a child of the producer's span (its OpenTelemetry
//!   parent), [`link`] adds a link to it (the batch span).
//!
//! The format is written here rather than taken from `opentelemetry_sdk`'s
//! `TraceContextPropagator`: this crate depends on the OpenTelemetry API
//! only, never on the SDK or an exporter. [`parse_traceparent`] follows the
//! specification's parsing rules (lowercase hex, all-zero ids invalid,
//! version `ff` invalid, version `00` exactly 55 characters, a later version
//! may append `-` fields that are ignored); unknown flag bits are dropped,
//! only `sampled` is kept and written.
//!
//! ```
//! use outbox_core::trace::{self, opentelemetry::{trace::TraceContextExt, Context}};
//! use std::collections::BTreeMap;
//!
//! let from_broker = BTreeMap::from([
//!     ("traceparent".to_owned(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned()),
//!     ("tracestate".to_owned(), "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE".to_owned()),
//! ]);
//! let parent = trace::extract(&from_broker).unwrap();
//! assert_eq!(parent.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
//! assert!(parent.is_sampled() && parent.is_remote());
//!
//! let mut headers = BTreeMap::new();
//! assert!(trace::inject(&Context::new().with_remote_span_context(parent), &mut headers));
//! assert_eq!(headers, from_broker);
//! ```

use crate::headers::{TRACEPARENT, TRACESTATE};
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry::Context;
use std::collections::BTreeMap;
use std::str::FromStr;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The OpenTelemetry API this module is built on (so an application uses the
/// same version).
pub use opentelemetry;
/// The `tracing` <-> OpenTelemetry bridge this module is built on.
pub use tracing_opentelemetry;

/// Length of a version `00` `traceparent`.
const TRACEPARENT_LEN: usize = 55;

/// The `traceparent` value of `span_context` (version `00`, only the
/// `sampled` flag), or `None` when the context is not valid.
pub fn traceparent(span_context: &SpanContext) -> Option<String> {
    if !span_context.is_valid() {
        return None;
    }
    Some(format!(
        "00-{}-{}-{:02x}",
        span_context.trace_id(),
        span_context.span_id(),
        (span_context.trace_flags() & TraceFlags::SAMPLED).to_u8()
    ))
}

/// Parses a `traceparent` value: trace id, parent (span) id and flags (only
/// `sampled` kept), or `None` when it is not a valid `traceparent`.
/// Surrounding spaces and tabs are ignored.
pub fn parse_traceparent(value: &str) -> Option<(TraceId, SpanId, TraceFlags)> {
    let value = value.trim_matches([' ', '\t']);
    let b = value.as_bytes();
    if b.len() < TRACEPARENT_LEN || !b[..TRACEPARENT_LEN].is_ascii() {
        return None;
    }
    if b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
        return None;
    }
    let version = lower_hex(&value[0..2])?;
    let trace = &value[3..35];
    let span = &value[36..52];
    let flags = lower_hex(&value[53..55])?;
    match version {
        0xff => return None,
        0 if b.len() != TRACEPARENT_LEN => return None,
        // A later version may append fields, always after a '-'.
        _ if b.len() > TRACEPARENT_LEN && b[TRACEPARENT_LEN] != b'-' => return None,
        _ => {}
    }
    if !is_lower_hex(trace) || !is_lower_hex(span) {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    Some((
        trace_id,
        span_id,
        TraceFlags::new(flags) & TraceFlags::SAMPLED,
    ))
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

fn lower_hex(s: &str) -> Option<u8> {
    if is_lower_hex(s) {
        u8::from_str_radix(s, 16).ok()
    } else {
        None
    }
}

/// The value of header `name` (exact spelling first, then any letter case).
fn header<'a>(headers: &'a BTreeMap<String, String>, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .or_else(|| {
            headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v)
        })
        .map(String::as_str)
}

/// Whether `headers` already hold trace context (a `traceparent` or a
/// `tracestate` header, any letter case): the caller's then wins.
pub fn has_trace_context(headers: &BTreeMap<String, String>) -> bool {
    header(headers, TRACEPARENT).is_some() || header(headers, TRACESTATE).is_some()
}

/// The `traceparent` value and the `tracestate` value (when it has entries)
/// of `cx`'s span, or `None` when it has no valid span context.
pub fn header_values(cx: &Context) -> Option<(String, Option<String>)> {
    let span = cx.span();
    let sc = span.span_context();
    let parent = traceparent(sc)?;
    let state = sc.trace_state().header();
    Some((parent, (!state.is_empty()).then_some(state)))
}

/// Writes `cx`'s span context into `headers` unless they already hold trace
/// context ([`has_trace_context`]). Returns whether a header was written.
pub fn inject(cx: &Context, headers: &mut BTreeMap<String, String>) -> bool {
    if has_trace_context(headers) {
        return false;
    }
    let Some((parent, state)) = header_values(cx) else {
        return false;
    };
    headers.insert(TRACEPARENT.to_owned(), parent);
    if let Some(state) = state {
        headers.insert(TRACESTATE.to_owned(), state);
    }
    true
}

/// The current `tracing` span's OpenTelemetry context (empty without a
/// `tracing-opentelemetry` layer or outside any span).
pub fn current_context() -> Context {
    tracing::Span::current().context()
}

/// [`inject`] with the current `tracing` span's context.
pub fn inject_current(headers: &mut BTreeMap<String, String>) -> bool {
    inject(&current_context(), headers)
}

/// What enqueue does ([`crate::event::NewEvent::capture_trace_context`]): inject
/// the current span's context, within an event's limits on its headers
/// (`max_headers` of them, `max_header_bytes` each: a trace header that
/// would break a limit is left out rather than failing the caller's
/// enqueue, `tracestate` first, then both).
pub(crate) fn capture_current(
    headers: &mut BTreeMap<String, String>,
    max_headers: usize,
    max_header_bytes: usize,
) {
    if has_trace_context(headers) {
        return;
    }
    let Some((parent, state)) = header_values(&current_context()) else {
        return;
    };
    let fits = |name: &str, value: &str| name.len() + value.len() <= max_header_bytes;
    let room = max_headers.saturating_sub(headers.len());
    if room == 0 || !fits(TRACEPARENT, &parent) {
        tracing::debug!("no room for the traceparent header within the event limits; not captured");
        return;
    }
    headers.insert(TRACEPARENT.to_owned(), parent);
    if let Some(state) = state {
        if room >= 2 && fits(TRACESTATE, &state) {
            headers.insert(TRACESTATE.to_owned(), state);
        } else {
            tracing::debug!("no room for the tracestate header within the event limits; left out");
        }
    }
}

/// The remote span context in `headers`' `traceparent` (with its
/// `tracestate`; an invalid `tracestate` is dropped), or `None` when there
/// is no valid `traceparent`.
pub fn extract(headers: &BTreeMap<String, String>) -> Option<SpanContext> {
    let (trace_id, span_id, flags) = parse_traceparent(header(headers, TRACEPARENT)?)?;
    let state = header(headers, TRACESTATE)
        .and_then(|s| TraceState::from_str(s.trim_matches([' ', '\t'])).ok())
        .unwrap_or_default();
    Some(SpanContext::new(trace_id, span_id, flags, true, state))
}

/// An OpenTelemetry context holding [`extract`]'s remote span context
/// (empty when there is none).
pub fn extract_context(headers: &BTreeMap<String, String>) -> Context {
    match extract(headers) {
        Some(sc) => Context::new().with_remote_span_context(sc),
        None => Context::new(),
    }
}

/// Makes `span` a child of the producer's span recorded in `headers` (its
/// OpenTelemetry parent; the `tracing` parent, and so the log context, is
/// unchanged). Call it before `span` is first entered. Returns the
/// producer's trace id when `headers` hold a valid `traceparent` (the parent
/// is set only when a `tracing-opentelemetry` layer is installed and the
/// span has not started yet), `None` otherwise (the span keeps its parent).
pub fn continue_trace(span: &tracing::Span, headers: &BTreeMap<String, String>) -> Option<TraceId> {
    let parent = extract(headers)?;
    let trace_id = parent.trace_id();
    // An error only means there is no OpenTelemetry layer (nothing to set)
    // or the span started already (a caller's bug the docs warn about).
    let _ = span.set_parent(Context::new().with_remote_span_context(parent));
    Some(trace_id)
}

/// Adds a link from `span` to the producer's span recorded in `headers`.
/// Returns whether `headers` held a valid `traceparent`.
pub fn link(span: &tracing::Span, headers: &BTreeMap<String, String>) -> bool {
    match extract(headers) {
        Some(sc) => {
            span.add_link(sc);
            true
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::event::{EventLimits, NewEvent};
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing_subscriber::layer::SubscriberExt;

    // The specification's examples (W3C Trace Context, sections 3.2 and 3.3).
    const SAMPLED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    const NOT_SAMPLED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
    const STATE: &str = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE";

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn parses_the_specification_examples() {
        let (t, s, f) = parse_traceparent(SAMPLED).unwrap();
        assert_eq!(t.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(s.to_string(), "00f067aa0ba902b7");
        assert_eq!(f, TraceFlags::SAMPLED);
        let (_, _, f) = parse_traceparent(NOT_SAMPLED).unwrap();
        assert_eq!(f, TraceFlags::NOT_SAMPLED);
        assert_eq!(SAMPLED.len(), 55);
        // Level 1's example, and surrounding blanks.
        let other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        assert!(parse_traceparent(&format!(" \t{other} ")).is_some());
    }

    #[test]
    fn accepts_a_later_version_with_more_fields() {
        let (t, _, f) =
            parse_traceparent("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09-future")
                .unwrap();
        assert_eq!(t.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        // Unknown flag bits are dropped, sampled kept.
        assert_eq!(f, TraceFlags::SAMPLED);
        assert!(
            parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").is_some()
        );
    }

    #[test]
    fn refuses_what_the_specification_calls_invalid() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-",
            // all-zero trace id / parent id
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // version ff is forbidden; version 00 has exactly 55 characters
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            // a later version's extra fields follow a '-'
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            // uppercase hex
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
            "0A-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0A",
            // wrong lengths / separators / characters
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
            "00-4bf92f3577b34da6a3ce929d0e0e47zz-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-+1",
            "00-4bf92f3577b34da6a3ce929d0e0e47é-00f067aa0ba902b7-01",
        ] {
            assert_eq!(parse_traceparent(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn extract_and_inject_round_trip_with_tracestate() {
        let headers = map(&[(TRACEPARENT, SAMPLED), (TRACESTATE, STATE)]);
        let sc = extract(&headers).unwrap();
        assert!(sc.is_remote() && sc.is_sampled());
        assert_eq!(sc.trace_state().get("congo"), Some("t61rcWkgMzE"));
        let mut out = BTreeMap::new();
        assert!(inject(
            &Context::new().with_remote_span_context(sc),
            &mut out
        ));
        assert_eq!(out, headers);

        // Any letter case on the way in; an invalid tracestate is dropped.
        let headers = map(&[("TraceParent", NOT_SAMPLED), ("TRACESTATE", "not a list")]);
        let sc = extract(&headers).unwrap();
        assert!(!sc.is_sampled());
        assert!(sc.trace_state().header().is_empty());
        let mut out = BTreeMap::new();
        inject(&Context::new().with_remote_span_context(sc), &mut out);
        assert_eq!(out, map(&[(TRACEPARENT, NOT_SAMPLED)]));

        assert!(extract(&map(&[(TRACESTATE, STATE)])).is_none());
        assert!(extract(&BTreeMap::new()).is_none());
        assert!(!extract_context(&BTreeMap::new()).has_active_span());
    }

    #[test]
    fn no_valid_span_context_writes_nothing() {
        let mut headers = BTreeMap::new();
        assert!(!inject(&Context::new(), &mut headers));
        assert!(!inject_current(&mut headers));
        assert!(headers.is_empty());
    }

    /// A subscriber with the OpenTelemetry layer over an in-memory exporter.
    fn otel_subscriber() -> (impl tracing::Subscriber + Send + Sync, SdkTracerProvider) {
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(InMemorySpanExporter::default())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("test"));
        (tracing_subscriber::registry().with(layer), provider)
    }

    #[test]
    fn enqueue_captures_the_current_span_and_the_callers_header_wins() {
        let (subscriber, _provider) = otel_subscriber();
        tracing::subscriber::with_default(subscriber, || {
            // No span: no header.
            let mut outside = NewEvent::new("t", "topic", Vec::new());
            outside.capture_trace_context(&EventLimits::default());
            assert!(outside.headers().is_empty());

            let request = tracing::info_span!("request");
            let _entered = request.enter();
            let sc = request.context().span().span_context().clone();
            assert!(sc.is_valid());

            let mut captured = NewEvent::new("t", "topic", Vec::new());
            captured.capture_trace_context(&EventLimits::default());
            assert_eq!(
                captured.headers().get(TRACEPARENT),
                traceparent(&sc).as_ref()
            );
            assert_eq!(captured.headers().len(), 1, "empty tracestate: no header");

            // The caller's trace header wins, in any letter case.
            for name in ["traceparent", "Traceparent", "tracestate"] {
                let mut explicit =
                    NewEvent::new("t", "topic", Vec::new()).with_header(name, SAMPLED);
                explicit.capture_trace_context(&EventLimits::default());
                assert_eq!(explicit.headers(), &map(&[(name, SAMPLED)]));
            }

            // A full event is not pushed over its header limit.
            let limits = EventLimits {
                max_headers: 1,
                ..EventLimits::default()
            };
            let mut full = NewEvent::new("t", "topic", Vec::new()).with_header("a", "b");
            full.capture_trace_context(&limits);
            assert_eq!(full.headers(), &map(&[("a", "b")]));
            full.validate(&limits).unwrap();
        });
    }

    #[test]
    fn continue_trace_makes_the_span_a_child_of_the_producer() {
        let (subscriber, _provider) = otel_subscriber();
        tracing::subscriber::with_default(subscriber, || {
            let headers = map(&[(TRACEPARENT, SAMPLED)]);
            let span = tracing::info_span!("deliver");
            let producer = continue_trace(&span, &headers).map(|t| t.to_string());
            assert_eq!(
                producer.as_deref(),
                Some("4bf92f3577b34da6a3ce929d0e0e4736")
            );
            let sc = span.context().span().span_context().clone();
            assert_eq!(
                sc.trace_id().to_string(),
                "4bf92f3577b34da6a3ce929d0e0e4736"
            );
            assert_ne!(sc.span_id().to_string(), "00f067aa0ba902b7");

            let unrelated = tracing::info_span!("no parent");
            assert_eq!(continue_trace(&unrelated, &BTreeMap::new()), None);
            let own = unrelated.context().span().span_context().trace_id();
            assert_ne!(own.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        });
    }
}
