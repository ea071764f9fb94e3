//! The HTTP endpoints of `run --metrics-addr ADDR`, all on one listener:
//!
//! | path       | answer |
//! |------------|--------|
//! | `/metrics` | the Prometheus text of the relay's metrics (feature `prometheus`) |
//! | `/healthz` | `200 ok` while the process runs (liveness) |
//! | `/readyz`  | `200` when the store answered the relay's last claim or settlement (and none has been waiting 15 s or more; a failed lease renewal also counts), the sink's breaker is closed and the relay holds shard leases (below); `503` otherwise, with a short JSON body naming the sink state, the store state, the leases and their last errors or reason (passwords scrubbed). A relay whose consumer group is paused (`outbox-relay pause`) is ready (`200`, `"paused": true`: the pause is deliberate) as long as it can read its control row |
//!
//! **Leases held** (PostgreSQL event log; other stores have no shard
//! leases and no `"leases"` field). The body's `"leases"` is what the relay
//! held at its last claim, from the store's memory
//! ([`PgLogStore::lease_holding`](outbox_postgres::PgLogStore::lease_holding)):
//! a probe costs no query.
//!
//! | field | relay group (no `--shard`) | static `--shard i/N` |
//! |-------|----------------------------|----------------------|
//! | `kind` | `"relay_group"` | `"static"` |
//! | `shards` | the virtual shards whose lease it holds | `[i]` while it holds its shard's lease, else `[]` |
//! | `shard` | - | `"i/N"` |
//! | `shards_held`, `fair_share`, `total` | how many it holds, its fair share (0 when the group has more relays than shards), the virtual shard count | 1 or 0, 1, `N` |
//! | `state` | `ok` (it holds one, or its share is 0), `waiting` (holds none of a share of at least one, for less than the grace), `starved` (for longer: **not ready**) | `ok`, or `standby` (another relay holds shard `i`; still ready) |
//! | `held_none_secs`, `grace_secs` | how long it has held none of its share (when it holds none), the grace | same |
//! | `reason` | when starved: `holds 0 of its fair share of 32 shards for 65.1 s` | - |
//!
//! The grace is the lock timeout plus twice the poll interval (at least
//! 1 s each): a relay that joins holds none until the others gave back
//! theirs (a rebalance interval or two), and one that replaces a killed
//! relay until the killed relay's leases run out (a lock timeout), so
//! neither a join, a rebalance nor a restart flips readiness; a relay that
//! holds none for longer is kept out by another relay that does not give
//! its shards back (stuck above its share, or claiming without
//! rebalancing). A static relay without its lease is a standby (a second
//! relay of the same shard, e.g. a rolling update's new one): reported,
//! but ready, or the update that waits for it would never finish.
//!
//! The Prometheus exporter's own listener answers every path with the
//! metrics, so it cannot share its port with other routes; this module
//! renders the recorder's text itself: an axum [`Router`] (the console's
//! crate), each connection served by hyper's HTTP/1.1 server under it.
//! `GET` and `HEAD` only (`405` with `Allow: GET, HEAD` otherwise), a query
//! string is ignored, one request per connection (`Connection: close`),
//! `Cache-Control: no-store` on every answer.
//!
//! **Limits.** The listener must not let a client (a port scanner, a
//! half-dead load balancer, a slow-loris) hold the process's file
//! descriptors or tasks:
//!
//! | limit | value | then |
//! |-------|-------|------|
//! | connections open at once | 64 ([`MAX_CONNECTIONS`](server::MAX_CONNECTIONS)) | a connection accepted beyond it is closed at once, unanswered (logged at WARN at most once a minute, with the count) |
//! | reading the request head (request line and headers) | 5 s ([`READ_TIMEOUT`](server::READ_TIMEOUT)) from the accept, in all: a client that trickles a byte at a time gets no more time than a silent one | the connection is closed unanswered |
//! | the request head's size | 8 KiB | `431`, closed |
//! | writing the response (and closing) | 5 s ([`WRITE_TIMEOUT`](server::WRITE_TIMEOUT)) from the head's end | the connection is closed |
//!
//! Closing over-limit connections at once, rather than leaving them in the
//! kernel's accept queue until a slot frees: a prober gets a prompt
//! failure it can retry instead of a hang behind every queued idle
//! connection, and the process never holds more than the cap. An answer
//! takes microseconds, so 64 slots are only all taken by connections that
//! send nothing, and those are gone after the read timeout: the endpoints
//! answer again within 5 s of such a flood stopping.
//!
//! The limits are the connection's, not the request's, so they live in
//! the accept loop and around each hyper connection ([`server`]), not in
//! tower layers: a tower `ConcurrencyLimit` counts requests in flight (an
//! idle connection holds none) and queues rather than refuses, and
//! tower-http's request timeout answers `408`, where a silent or trickling
//! client is closed unanswered here.
//!
//! `outbox-relay status --relay ADDR` and the console read other relays'
//! endpoints through hyper's client ([`client`]).

mod client;
mod endpoints;
mod leases;
mod probe;
mod server;
mod stores;

#[cfg(feature = "console")]
pub(crate) use self::client::get_text;
pub(crate) use self::client::relay_status;
pub(crate) use self::endpoints::{Endpoints, Render};
pub(crate) use self::leases::{lease_grace, lease_source};
pub(crate) use self::probe::Watched;
use self::server::{serve_on, Limits};
pub(crate) use self::stores::{spawn_stores, StoreSlot};
use tokio::net::TcpListener;

/// Serves `endpoints` on `listener` until the runtime stops, within the
/// default [`Limits`].
pub(crate) fn spawn(listener: TcpListener, endpoints: Endpoints) {
    serve_on(listener, Limits::default(), endpoints.into_router());
}
