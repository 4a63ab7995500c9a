//! What the engine measures, as calls on a [`Recorder`] it is given (`EngineConfig::metrics`).
//!
//! The engine knows nothing of Prometheus or OpenTelemetry: it says what happened (a run ended, a
//! node took this long, a human waited that long) and the server's recorder turns that into metric
//! families (`keel-server`'s `metrics` module). A handle per engine, not a process-global recorder,
//! so that two engines in one process — every test binary — count apart. The default records
//! nothing, so callers that don't care change nothing.
//!
//! Labels are bounded by construction: statuses, node names, tool names of the registry, error
//! codes, event types — never run, call or user ids.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::domain::RunStatus;

/// Receives the engine's measurements. Every method defaults to doing nothing.
#[allow(unused_variables)]
pub trait Recorder: Send + Sync + 'static {
    /// A run was created (its `run_started` event committed).
    fn run_started(&self) {}
    /// A run reached a terminal status, `duration` after it was created.
    fn run_finished(&self, status: RunStatus, duration: Duration) {}
    /// A node of the agent loop finished (`node_finished`), taking `duration`. For `approval` this is
    /// the human's wait.
    fn node_finished(&self, node: &str, duration: Duration) {}
    /// A model call produced its first chunk (text or tool call) `wait` after it was made.
    fn model_first_token(&self, wait: Duration) {}
    /// A tool ran: `outcome` is `success` or `error` (the tool's own answer, before recording).
    fn tool_call(&self, tool: &str, outcome: &str, duration: Duration) {}
    /// A human decided `wait` after the interrupt was raised.
    fn human_wait(&self, wait: Duration) {}
    /// A resume request was answered: `OK`, `REPLAYED` (the stored answer to a repeated key) or the
    /// error code it was refused with.
    fn resume(&self, code: &str) {}
    /// An event of type `event_type` was committed.
    fn event_appended(&self, event_type: &str) {}
    /// A storage operation failed with a backend error (not a conflict: those are expected).
    fn store_error(&self, operation: &str) {}
    /// Event streams read the store: `reason` is `catch_up` (a stream's page of events or its run:
    /// its first read, or one after a gap, a lagged or a closed receiver, or after the idle look
    /// found it behind) or `idle` (the process's one look at the last sequences of every run idle
    /// streams follow, where other processes commit).
    fn stream_store_read(&self, reason: &str) {}
}

struct Noop;

impl Recorder for Noop {}

/// A shared [`Recorder`]; the default records nothing.
#[derive(Clone)]
pub struct Metrics(Arc<dyn Recorder>);

impl Metrics {
    pub fn new(recorder: Arc<dyn Recorder>) -> Self {
        Self(recorder)
    }

    pub fn noop() -> Self {
        Self(Arc::new(Noop))
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::noop()
    }
}

impl std::ops::Deref for Metrics {
    type Target = dyn Recorder;

    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Metrics")
    }
}

/// Called on each `run` span right after it is created, with the run's trace id (32 hex digits): an
/// exporter links the span into that trace (the `keel` binary does, for OTLP), so every worker that
/// drives the run — before and after a pause, on any instance — shows in one trace. `tracing`
/// alone has no notion of a trace id; without a hook the id is only a span field and a log field.
#[derive(Clone)]
pub struct RunSpanHook(Arc<SpanHookFn>);

type SpanHookFn = dyn Fn(&tracing::Span, &str) + Send + Sync;

impl RunSpanHook {
    pub fn new(hook: impl Fn(&tracing::Span, &str) + Send + Sync + 'static) -> Self {
        Self(Arc::new(hook))
    }

    pub fn call(&self, span: &tracing::Span, trace_id: &str) {
        (self.0)(span, trace_id)
    }
}

impl fmt::Debug for RunSpanHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RunSpanHook")
    }
}

/// A fresh W3C trace id: 32 lowercase hex digits.
pub fn new_trace_id() -> String {
    use sha2::{Digest, Sha256};
    // A v7 uuid is unique but starts with a timestamp; hashed, ids of one instant don't look alike.
    let digest = Sha256::digest(uuid::Uuid::now_v7().as_bytes());
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}
