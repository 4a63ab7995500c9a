//! The engine's settings.

use super::*;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Names this process in leases and logs.
    pub instance_id: String,
    /// How long a human has to decide.
    pub interrupt_ttl: Duration,
    pub lease_ttl: Duration,
    /// Model calls per run before it fails with `MAX_ITERATIONS`.
    pub max_iterations: u32,
    /// Text deltas are committed in groups: at most this long after the first buffered one …
    /// (and a commit held before a model call, or before read-only tool calls, waits at most this
    /// long for the call's first text or the calls' results, to be written with them).
    pub delta_flush_interval: Duration,
    /// … or this many, whichever comes first.
    pub delta_flush_max: usize,
    /// Take over runs whose lease is held by someone else at start-up. Right for an embedded store
    /// that only one process opens; wrong for a shared one.
    pub steal_leases_on_start: bool,
    /// How often expired interrupts are swept and orphaned runs looked for.
    pub sweep_interval: Duration,
    /// How often the process looks for events committed by another process that the bus did not
    /// bring: one query for the last sequences of every run an idle stream follows, waking only
    /// the streams behind (`stream::IdleWatch`). `None` where the bus delivers every event (one
    /// process with the local bus): an idle stream then reads nothing, and the store only on a gap.
    pub poll_interval: Option<Duration>,
    /// Retries of a model call that failed transiently.
    pub model_retries: u32,
    /// The role of a user the store does not know.
    pub default_role: Option<UserRole>,
    /// Attempts of one tool call before it fails (or, without an answer from a tool that is not
    /// idempotent, before a human is asked): the first and the retries with the same key.
    pub tool_max_attempts: u32,
    /// The pause before the second attempt; doubled before each next one.
    pub tool_retry_backoff: Duration,
    /// The longest user message accepted, in characters.
    pub max_message_chars: usize,
    /// Where the engine's measurements go (the server's Prometheus registry); nowhere by default.
    pub metrics: Metrics,
    /// The most runs this instance drives at once. A run it has no room for stays claimable
    /// (`queued`, or `running` without a lease) for any instance with a free slot.
    pub max_concurrent_runs: usize,
    /// Links each `run` span to the run's trace (an OpenTelemetry exporter); none by default.
    pub run_span_hook: Option<RunSpanHook>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            instance_id: format!("keel-{}", uuid::Uuid::now_v7().simple()),
            interrupt_ttl: Duration::from_secs(15 * 60),
            lease_ttl: Duration::from_secs(30),
            max_iterations: 8,
            delta_flush_interval: Duration::from_millis(5),
            delta_flush_max: 128,
            steal_leases_on_start: false,
            sweep_interval: Duration::from_secs(1),
            poll_interval: Some(Duration::from_secs(1)),
            // Model clients retry before the first token themselves; this is one more try on top.
            model_retries: 1,
            default_role: None,
            tool_max_attempts: 3,
            tool_retry_backoff: Duration::from_millis(200),
            max_message_chars: 32_000,
            metrics: Metrics::default(),
            max_concurrent_runs: default_max_concurrent_runs(),
            run_span_hook: None,
        }
    }
}

/// 64 runs per core. A worker spends almost all its time waiting — on the model's stream, a tool, the
/// store — so the cap is not about CPU time but about what a run holds while it waits (a task, its
/// context, an HTTP connection to the model) and about the bursts one instance takes on before
/// others get a share: with more than this many runs in flight, the rest wait queued for any
/// instance. See docs/operations.md, "Capacity".
pub fn default_max_concurrent_runs() -> usize {
    64 * std::thread::available_parallelism().map_or(1, |n| n.get())
}
