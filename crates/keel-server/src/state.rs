//! What every handler shares: the engine, the server's settings and the shutdown signal.

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

use keel_core::engine::Engine;
use tokio::sync::watch;

use crate::auth::AuthMode;
use crate::host::AllowedHosts;
use crate::limits::{AddressLimiter, RateLimiter, StreamLimiter};
use crate::metrics::ServerMetrics;

/// The HTTP layer's settings. The engine's own settings live in `keel_core::engine::EngineConfig`.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// A `: keep-alive` comment is written after this long without an event.
    pub heartbeat: Duration,
    /// The `retry:` an EventSource waits before it reconnects.
    pub sse_retry_ms: u64,
    /// The largest request body accepted.
    pub body_limit: usize,
    /// A reader that does not take a frame within this long is cut off; it reconnects with
    /// `Last-Event-ID` and catches up from the store.
    pub sse_send_timeout: Duration,
    /// Frames buffered per SSE response before the writer waits on the reader.
    pub sse_buffer: usize,
    /// How callers are authenticated.
    pub auth: AuthMode,
    /// Requests per second per user (a token bucket); 0 turns the limit off.
    pub rate_limit_per_second: f64,
    /// Requests a user may make at once before the rate applies.
    pub rate_limit_burst: u32,
    /// Requests per second per client address (the socket's peer), checked before authentication;
    /// 0 turns the limit off.
    pub rate_limit_per_address: f64,
    /// Requests one address may make at once before its rate applies.
    pub rate_burst_per_address: u32,
    /// Open streams (SSE responses and WebSocket connections) per user; 0 turns the cap off.
    pub max_streams_per_user: usize,
    /// The deepest nesting of arrays and objects a JSON body may have.
    pub json_max_depth: usize,
    /// The most events one `GET /v1/runs/{id}/events` JSON page holds.
    pub replay_page_max: u32,
    /// How long a stream ticket can be used.
    pub stream_ticket_ttl: Duration,
    /// A WebSocket client that does not take a frame within this long is cut off; it resubscribes
    /// with `after` and catches up from the store.
    pub ws_send_timeout: Duration,
    /// Frames queued per WebSocket connection (events of all its subscriptions and replies).
    pub ws_buffer: usize,
    /// When set, only requests whose `Host` is one of these names are served; others get 403
    /// `HOST_NOT_ALLOWED` ([`crate::host`]). Set for a server without keys on loopback.
    pub allowed_hosts: Option<AllowedHosts>,
    /// The reverse proxies in front of the server: a request from one is counted, by the
    /// per-address limit, under the client address its `X-Forwarded-For` names.
    pub trusted_proxies: crate::limits::TrustedProxies,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            heartbeat: Duration::from_secs(15),
            sse_retry_ms: 2000,
            body_limit: 1024 * 1024,
            sse_send_timeout: Duration::from_secs(30),
            sse_buffer: 64,
            auth: AuthMode::SingleUser("demo".to_owned()),
            rate_limit_per_second: 50.0,
            rate_limit_burst: 200,
            rate_limit_per_address: 200.0,
            rate_burst_per_address: 400,
            max_streams_per_user: 64,
            json_max_depth: 32,
            replay_page_max: 1000,
            stream_ticket_ttl: Duration::from_secs(60),
            ws_send_timeout: Duration::from_secs(5),
            ws_buffer: 64,
            allowed_hosts: None,
            trusted_proxies: crate::limits::TrustedProxies::default(),
        }
    }
}

/// Tells long-lived responses (SSE streams, `?wait=true`) that the server is stopping, so a graceful
/// shutdown is not held up by a stream that would otherwise run until its run ends.
#[derive(Debug, Clone)]
pub(crate) struct Shutdown(Arc<watch::Sender<bool>>);

impl Shutdown {
    fn new() -> Self {
        Self(Arc::new(watch::channel(false).0))
    }

    pub(crate) fn trigger(&self) {
        self.0.send_replace(true);
    }

    /// Resolves once [`Shutdown::trigger`] was called (at once if it already was).
    pub(crate) fn wait(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.0.subscribe();
        async move {
            // An error means the sender is gone, which only happens when the server is.
            let _ = rx.wait_for(|stopping| *stopping).await;
        }
    }
}

/// WebSocket counters, shared by every connection of a server.
#[derive(Debug, Default)]
pub struct WsStats {
    /// Connections open now.
    pub open: AtomicUsize,
    /// Connections cut off because their client did not keep up.
    pub cut_off: AtomicU64,
    /// The most frames any connection had queued at once (never more than `ws_buffer`).
    pub max_queued: AtomicUsize,
}

#[derive(Clone)]
pub struct AppState {
    pub engine: Arc<Engine>,
    pub config: Arc<ServerConfig>,
    pub limits: Arc<Limits>,
    /// The Prometheus registry of `GET /metrics`. Transports count their connections here
    /// ([`ServerMetrics::connection_opened`]).
    pub metrics: ServerMetrics,
    pub ws: Arc<WsStats>,
    pub(crate) shutdown: Shutdown,
    /// The OpenAPI spec of the routes served (set when the router is built).
    pub(crate) spec: Arc<std::sync::OnceLock<String>>,
}

/// The limits' state, shared by every request.
#[derive(Debug)]
pub struct Limits {
    /// Per client address, before authentication.
    pub address: AddressLimiter,
    pub rate: RateLimiter,
    pub streams: StreamLimiter,
}

impl AppState {
    /// With a registry of its own, which sees only what the transports count; give the engine's
    /// with [`AppState::with_metrics`] to serve the engine's measurements too.
    pub fn new(engine: Arc<Engine>, config: ServerConfig) -> Self {
        let limits = Limits {
            address: AddressLimiter::new(
                config.rate_limit_per_address,
                config.rate_burst_per_address,
                AddressLimiter::MAX_KEYS,
            ),
            rate: RateLimiter::new(config.rate_limit_per_second, config.rate_limit_burst),
            streams: StreamLimiter::new(config.max_streams_per_user),
        };
        Self {
            engine,
            config: Arc::new(config),
            limits: Arc::new(limits),
            metrics: ServerMetrics::new(),
            ws: Arc::default(),
            shutdown: Shutdown::new(),
            spec: Arc::default(),
        }
    }

    /// Serves `metrics`: the registry whose [`ServerMetrics::recorder`] the engine was built with.
    pub fn with_metrics(mut self, metrics: ServerMetrics) -> Self {
        self.metrics = metrics;
        self
    }
}
