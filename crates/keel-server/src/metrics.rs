//! The Prometheus registry: the engine's measurements (as its [`Recorder`]) and the transports'
//! (connections, events delivered, slow subscribers cut off), encoded in the text format by
//! `GET /metrics`.
//!
//! One registry per [`ServerMetrics`], not the process-global default: two servers in one process
//! (every test binary) count apart. Names carry the `keel_` prefix and their unit; labels are
//! bounded (status, node, tool, outcome, code, event type, transport, operation) — never an id.
//!
//! Transports other than SSE count their connections with [`ServerMetrics::connection_opened`]
//! (keep the guard for as long as the connection lives), [`ServerMetrics::event_delivered`] and
//! [`ServerMetrics::subscriber_dropped`], with their own `transport` label.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keel_core::engine::Engine;
use keel_core::metrics::{Metrics, Recorder};
use keel_core::RunStatus;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// Steps of a run: model calls, tool calls, nodes.
const STEP_BUCKETS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
/// Whole runs and humans: seconds to a day.
const WAIT_BUCKETS: &[f64] =
    &[0.1, 0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 4.0 * 3600.0, 24.0 * 3600.0];

/// The transport label of the SSE encoder.
pub const SSE: &str = "sse";
pub const WEBSOCKET: &str = "websocket";
pub const AG_UI: &str = "ag_ui";

/// The server's metric families. Cheap to clone (one registry behind an `Arc`).
#[derive(Clone)]
pub struct ServerMetrics(Arc<Families>);

struct Families {
    registry: Registry,
    runs_started: IntCounter,
    runs_finished: IntCounterVec,
    run_duration: HistogramVec,
    node_duration: HistogramVec,
    tool_duration: HistogramVec,
    model_first_token: Histogram,
    human_wait: Histogram,
    resumes: IntCounterVec,
    events_appended: IntCounterVec,
    events_delivered: IntCounterVec,
    active_connections: IntGaugeVec,
    subscribers_dropped: IntCounterVec,
    store_errors: IntCounterVec,
    bus_dropped: IntCounter,
    run_workers: IntGauge,
    run_capacity: IntGauge,
    run_workers_peak: IntGauge,
    stream_store_reads: IntCounterVec,
    credential_lookups: IntCounterVec,
    rate_limited: IntCounterVec,
    pruned_rows: IntCounterVec,
    /// Serialises scrapes: the bus's drop count is folded into its counter as a difference.
    scrape: Mutex<()>,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ServerMetrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let families = Families {
            runs_started: register(&registry, IntCounter::new("keel_runs_started_total", "Runs created.")),
            runs_finished: register(
                &registry,
                IntCounterVec::new(
                    Opts::new("keel_runs_finished_total", "Runs that reached a terminal status, by status."),
                    &["status"],
                ),
            ),
            run_duration: register(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "keel_run_duration_seconds",
                        "From a run's creation to its terminal status (pauses included), by status.",
                    )
                    .buckets(WAIT_BUCKETS.to_vec()),
                    &["status"],
                ),
            ),
            node_duration: register(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "keel_node_duration_seconds",
                        "Latency of each node of the agent loop (node_finished); for approval, the human's wait.",
                    )
                    .buckets(STEP_BUCKETS.to_vec()),
                    &["node"],
                ),
            ),
            tool_duration: register(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new("keel_tool_call_duration_seconds", "Tool executions, by tool and outcome.")
                        .buckets(STEP_BUCKETS.to_vec()),
                    &["tool", "outcome"],
                ),
            ),
            model_first_token: register(
                &registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "keel_model_time_to_first_token_seconds",
                        "From a model call to its first text or tool-call chunk.",
                    )
                    .buckets(STEP_BUCKETS.to_vec()),
                ),
            ),
            human_wait: register(
                &registry,
                Histogram::with_opts(
                    HistogramOpts::new("keel_human_wait_seconds", "From an interrupt to the decision that resumed it.")
                        .buckets(WAIT_BUCKETS.to_vec()),
                ),
            ),
            resumes: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "keel_resumes_total",
                        "Resume requests by outcome: OK, REPLAYED (same idempotency key) or the error code.",
                    ),
                    &["code"],
                ),
            ),
            events_appended: register(
                &registry,
                IntCounterVec::new(Opts::new("keel_events_appended_total", "Events committed, by type."), &["type"]),
            ),
            events_delivered: register(
                &registry,
                IntCounterVec::new(
                    Opts::new("keel_events_delivered_total", "Events written to clients, by transport."),
                    &["transport"],
                ),
            ),
            active_connections: register(
                &registry,
                IntGaugeVec::new(
                    Opts::new("keel_active_connections", "Open event streams, by transport."),
                    &["transport"],
                ),
            ),
            subscribers_dropped: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "keel_slow_subscribers_dropped_total",
                        "Streams cut off because the client did not keep up, by transport.",
                    ),
                    &["transport"],
                ),
            ),
            store_errors: register(
                &registry,
                IntCounterVec::new(
                    Opts::new("keel_store_errors_total", "Storage backend errors, by operation."),
                    &["operation"],
                ),
            ),
            bus_dropped: register(
                &registry,
                IntCounter::new(
                    "keel_bus_dropped_events_total",
                    "Events the bus failed to fan out (readers fell back to the store).",
                ),
            ),
            run_workers: register(&registry, IntGauge::new("keel_run_workers", "Runs this instance is driving now.")),
            run_capacity: register(
                &registry,
                IntGauge::new(
                    "keel_run_capacity",
                    "The most runs this instance drives at once (--max-concurrent-runs).",
                ),
            ),
            run_workers_peak: register(
                &registry,
                IntGauge::new("keel_run_workers_peak", "The most runs this instance drove at once since it started."),
            ),
            stream_store_reads: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "keel_stream_store_reads_total",
                        "Store reads made by event streams, by reason: catch_up, idle.",
                    ),
                    &["reason"],
                ),
            ),
            credential_lookups: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "keel_credential_lookups_total",
                        "API keys and stream tickets looked up in the store, by outcome: known, unknown, error.",
                    ),
                    &["outcome"],
                ),
            ),
            rate_limited: register(
                &registry,
                IntCounterVec::new(
                    Opts::new("keel_rate_limited_total", "Requests refused 429 RATE_LIMITED, by limit: address, user."),
                    &["limit"],
                ),
            ),
            pruned_rows: register(
                &registry,
                IntCounterVec::new(
                    Opts::new("keel_pruned_rows_total", "Rows deleted by retention, by table: run_events."),
                    &["table"],
                ),
            ),
            registry,
            scrape: Mutex::new(()),
        };
        // Series that dashboards expect to see at 0 before anything happened.
        for status in [RunStatus::Completed, RunStatus::Failed, RunStatus::Cancelled] {
            families.runs_finished.with_label_values(&[status.as_str()]);
        }
        for reason in ["catch_up", "idle"] {
            families.stream_store_reads.with_label_values(&[reason]);
        }
        for outcome in ["known", "unknown", "error"] {
            families.credential_lookups.with_label_values(&[outcome]);
        }
        for limit in ["address", "user"] {
            families.rate_limited.with_label_values(&[limit]);
        }
        families.pruned_rows.with_label_values(&["run_events"]);
        families.active_connections.with_label_values(&[SSE]);
        families.events_delivered.with_label_values(&[SSE]);
        families.subscribers_dropped.with_label_values(&[SSE]);
        Self(Arc::new(families))
    }

    /// The handle the engine records through (`EngineConfig::metrics`).
    pub fn recorder(&self) -> Metrics {
        Metrics::new(Arc::new(self.clone()))
    }

    /// Counts an open connection of `transport` until the guard drops.
    pub fn connection_opened(&self, transport: &'static str) -> ConnectionGuard {
        let gauge = self.0.active_connections.with_label_values(&[transport]);
        gauge.inc();
        ConnectionGuard(gauge)
    }

    /// An event was written to a client of `transport`.
    pub fn event_delivered(&self, transport: &'static str) {
        self.0.events_delivered.with_label_values(&[transport]).inc();
    }

    /// A client of `transport` was cut off because it did not keep up.
    pub fn subscriber_dropped(&self, transport: &'static str) {
        self.0.subscribers_dropped.with_label_values(&[transport]).inc();
    }

    /// A credential (an API key or a stream ticket) was looked up: `known`, `unknown` or `error`.
    pub fn credential_lookup(&self, outcome: &'static str) {
        self.0.credential_lookups.with_label_values(&[outcome]).inc();
    }

    /// A request was refused by the `address` or the `user` rate limit.
    pub fn rate_limited(&self, limit: &'static str) {
        self.0.rate_limited.with_label_values(&[limit]).inc();
    }

    /// Retention deleted `rows` rows of `table`.
    pub fn pruned(&self, table: &'static str, rows: u64) {
        self.0.pruned_rows.with_label_values(&[table]).inc_by(rows);
    }

    /// Every family in the Prometheus text format, with the engine's gauges read now.
    pub fn encode(&self, engine: &Engine) -> Result<String, prometheus::Error> {
        let f = &self.0;
        let _scrape = f.scrape.lock().unwrap_or_else(|e| e.into_inner());
        f.run_workers.set(i64::try_from(engine.active_workers()).unwrap_or(i64::MAX));
        f.run_capacity.set(i64::try_from(engine.capacity()).unwrap_or(i64::MAX));
        f.run_workers_peak.set(i64::try_from(engine.peak_workers()).unwrap_or(i64::MAX));
        let dropped = engine.bus_dropped_events();
        if let Some(delta) = dropped.checked_sub(f.bus_dropped.get()) {
            f.bus_dropped.inc_by(delta);
        }
        let mut out = Vec::new();
        TextEncoder::new().encode(&f.registry.gather(), &mut out)?;
        String::from_utf8(out).map_err(|e| prometheus::Error::Msg(e.to_string()))
    }
}

fn register<C: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    collector: prometheus::Result<C>,
) -> C {
    // The names and labels are constants of this file, unique and valid: a failure is a bug here,
    // caught by every test that builds a server.
    let collector = collector.expect("a valid metric family");
    registry.register(Box::new(collector.clone())).expect("a metric family registered once");
    collector
}

/// Decrements the connection gauge when the connection (the response body holding it) goes away.
pub struct ConnectionGuard(IntGauge);

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Recorder for ServerMetrics {
    fn run_started(&self) {
        self.0.runs_started.inc();
    }

    fn run_finished(&self, status: RunStatus, duration: Duration) {
        self.0.runs_finished.with_label_values(&[status.as_str()]).inc();
        self.0.run_duration.with_label_values(&[status.as_str()]).observe(duration.as_secs_f64());
    }

    fn node_finished(&self, node: &str, duration: Duration) {
        self.0.node_duration.with_label_values(&[node]).observe(duration.as_secs_f64());
    }

    fn model_first_token(&self, wait: Duration) {
        self.0.model_first_token.observe(wait.as_secs_f64());
    }

    fn tool_call(&self, tool: &str, outcome: &str, duration: Duration) {
        self.0.tool_duration.with_label_values(&[tool, outcome]).observe(duration.as_secs_f64());
    }

    fn human_wait(&self, wait: Duration) {
        self.0.human_wait.observe(wait.as_secs_f64());
    }

    fn resume(&self, code: &str) {
        self.0.resumes.with_label_values(&[code]).inc();
    }

    fn event_appended(&self, event_type: &str) {
        self.0.events_appended.with_label_values(&[event_type]).inc();
    }

    fn store_error(&self, operation: &str) {
        self.0.store_errors.with_label_values(&[operation]).inc();
    }

    fn stream_store_read(&self, reason: &str) {
        self.0.stream_store_reads.with_label_values(&[reason]).inc();
    }
}
