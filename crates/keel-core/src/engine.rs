//! The durable agent loop.
//!
//! A run is driven by one worker at a time — the holder of its lease — step by step from its
//! checkpoint: `call_model → execute_tools → (await_interrupt → execute_tools)* → … → finalize`.
//! Every step ends in one [`Commit`]: its state change, its checkpoint and the events that announce
//! them, in one transaction, before anything is published. A worker that dies anywhere leaves a
//! checkpoint another worker continues from.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::bus::Bus;
use crate::clock::Clock;
use crate::context::{plan as plan_context, ContextConfig, ContextInput};
use crate::domain::{
    Conversation, Fact, FactMap, FactSource, Interrupt, InterruptKind, InterruptStatus, Message, NextStep, Role, Run,
    RunStatus, Timestamp, ToolCall, ToolCallState, UserRole,
};
use crate::event::{Event, EventKind, GraphEdge, GraphNode, ToolOutcomeStatus};
use crate::ids::{CallId, ConversationId, InterruptId, MessageId, RunId};
use crate::mask::{looks_secret, mask_value, truncate, Masked};
use crate::metrics::{new_trace_id, Metrics, RunSpanHook};
use crate::model::{Model, ModelChunk, ModelError, ModelRequest};
use crate::store::{
    Commit, Committed, Fence, IdempotencyAnswer, IdempotencyBegin, InterruptChange, NewRun, RunChange, StartedRun,
    Store, StoreError, TextAppend, ToolCallChange,
};
use crate::stream::{run_events, Until};
use crate::tool::{validate_args, Policy, Tool, ToolContext, ToolError, ToolOutput, ToolRegistry};

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
    pub delta_flush_interval: Duration,
    /// … or this many, whichever comes first.
    pub delta_flush_max: usize,
    /// Take over runs whose lease is held by someone else at start-up. Right for an embedded store
    /// that only one process opens; wrong for a shared one.
    pub steal_leases_on_start: bool,
    /// How often expired interrupts are swept and orphaned runs looked for.
    pub sweep_interval: Duration,
    /// How often an idle event reader re-reads the store.
    pub poll_interval: Duration,
    /// Retries of a model call that failed transiently.
    pub model_retries: u32,
    /// The role of a user the store does not know.
    pub default_role: Option<UserRole>,
    /// How long an idempotency key stays reserved by a request that never finished (its process
    /// died): until then a retry is told `IDEMPOTENCY_KEY_IN_FLIGHT`, after it the retry proceeds.
    pub idempotency_in_flight_ttl: Duration,
    pub context: ContextConfig,
    /// The longest user message accepted, in characters.
    pub max_message_chars: usize,
    /// Where the engine's measurements go (the server's Prometheus registry); nowhere by default.
    pub metrics: Metrics,
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
            poll_interval: Duration::from_secs(1),
            // Model clients retry before the first token themselves; this is one more try on top.
            model_retries: 1,
            default_role: None,
            idempotency_in_flight_ttl: Duration::from_secs(30),
            context: ContextConfig::default(),
            max_message_chars: 32_000,
            metrics: Metrics::default(),
            run_span_hook: None,
        }
    }
}

/// The engine's failures, each with a stable code the API shows.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0} not found")]
    NotFound(&'static str),
    #[error("the conversation already has an active run ({0}); resume, wait for or cancel it first")]
    RunActive(RunId),
    #[error("the interrupt was already resolved")]
    InterruptAlreadyResolved,
    #[error("the interrupt expired")]
    InterruptExpired,
    #[error("the run is not waiting for a decision")]
    RunNotInterrupted,
    #[error("a request with this idempotency key is still being processed; retry later")]
    IdempotencyKeyInFlight,
    #[error("this idempotency key was used with a different request")]
    IdempotencyKeyReused,
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    InvalidDecision(String),
    #[error("{0}")]
    InvalidArgs(String),
    #[error("{0}")]
    Invalid(String),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("storage failed: {0}")]
    Store(#[from] StoreError),
}

impl EngineError {
    /// Every code [`EngineError::code`] can return (the API docs list them; a test compares).
    pub const CODES: &'static [&'static str] = &[
        "CONVERSATION_NOT_FOUND",
        "RUN_NOT_FOUND",
        "INTERRUPT_NOT_FOUND",
        "NOT_FOUND",
        "RUN_ACTIVE",
        "INTERRUPT_ALREADY_RESOLVED",
        "INTERRUPT_EXPIRED",
        "RUN_NOT_INTERRUPTED",
        "IDEMPOTENCY_KEY_IN_FLIGHT",
        "IDEMPOTENCY_KEY_REUSED",
        "FORBIDDEN",
        "INVALID_DECISION",
        "INVALID_ARGS",
        "VALIDATION_FAILED",
        "SHUTTING_DOWN",
        "INTERNAL",
    ];

    pub fn code(&self) -> &'static str {
        match self {
            EngineError::NotFound("conversation") => "CONVERSATION_NOT_FOUND",
            EngineError::NotFound("run") => "RUN_NOT_FOUND",
            EngineError::NotFound("interrupt") => "INTERRUPT_NOT_FOUND",
            EngineError::NotFound(_) => "NOT_FOUND",
            EngineError::RunActive(_) => "RUN_ACTIVE",
            EngineError::InterruptAlreadyResolved => "INTERRUPT_ALREADY_RESOLVED",
            EngineError::InterruptExpired => "INTERRUPT_EXPIRED",
            EngineError::RunNotInterrupted => "RUN_NOT_INTERRUPTED",
            EngineError::IdempotencyKeyInFlight => "IDEMPOTENCY_KEY_IN_FLIGHT",
            EngineError::IdempotencyKeyReused => "IDEMPOTENCY_KEY_REUSED",
            EngineError::Forbidden(_) => "FORBIDDEN",
            EngineError::InvalidDecision(_) => "INVALID_DECISION",
            EngineError::InvalidArgs(_) => "INVALID_ARGS",
            EngineError::Invalid(_) => "VALIDATION_FAILED",
            EngineError::ShuttingDown => "SHUTTING_DOWN",
            EngineError::Store(_) => "INTERNAL",
        }
    }
}

pub type EngineResult<T> = Result<T, EngineError>;

/// The nodes of the agent loop, as drawn by clients (`graph_topology`).
pub mod nodes {
    pub const CONTEXT: &str = "context";
    pub const MODEL: &str = "model";
    pub const TOOLS: &str = "tools";
    pub const APPROVAL: &str = "approval";
    pub const FINALIZE: &str = "finalize";
}

fn topology() -> EventKind {
    let node = |id: &str, label: &str| GraphNode { id: id.into(), label: label.into() };
    let edge = |from: &str, to: &str| GraphEdge { from: from.into(), to: to.into() };
    EventKind::GraphTopology {
        nodes: vec![
            node(nodes::CONTEXT, "Assemble context"),
            node(nodes::MODEL, "Call model"),
            node(nodes::TOOLS, "Execute tools"),
            node(nodes::APPROVAL, "Await approval"),
            node(nodes::FINALIZE, "Finalize"),
        ],
        edges: vec![
            edge(nodes::CONTEXT, nodes::MODEL),
            edge(nodes::MODEL, nodes::TOOLS),
            edge(nodes::TOOLS, nodes::APPROVAL),
            edge(nodes::APPROVAL, nodes::TOOLS),
            edge(nodes::TOOLS, nodes::CONTEXT),
            edge(nodes::MODEL, nodes::FINALIZE),
        ],
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SendMessage {
    pub content: String,
    pub cancel_on_disconnect: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ConversationView {
    #[serde(flatten)]
    pub conversation: Conversation,
    #[cfg_attr(feature = "openapi", schema(inline))]
    pub facts: FactMap,
    pub active_run_id: Option<RunId>,
    pub messages: Vec<Message>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunView {
    pub run: Run,
    pub pending_interrupt: Option<Interrupt>,
    pub tool_calls: Vec<ToolCall>,
    /// Every interrupt of the run, oldest first.
    #[serde(default)]
    pub interrupts: Vec<Interrupt>,
}

/// A resume request, after transport-level parsing.
#[derive(Debug, Clone, PartialEq)]
pub struct ResumeRequest {
    pub interrupt_id: InterruptId,
    /// `"approve"`, `"reject"`, `{"edit": {callId: args}}`, `{"calls": {callId: "approve" | "reject" |
    /// {"edit": args}}}`, `{"select": option}`, `{"provide": values}`.
    pub decision: Value,
    pub idempotency_key: String,
    /// What the human writes with the decision (at most [`MAX_NOTE_CHARS`]); stored masked.
    pub note: Option<String>,
}

/// The longest note a resume may carry, in characters.
pub const MAX_NOTE_CHARS: usize = 2000;

/// The answer to an accepted resume, stored under its idempotency key and given again on a retry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ResumeAccepted {
    pub run_id: RunId,
    pub interrupt_id: InterruptId,
    pub status: RunStatus,
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub decision: Masked<Value>,
    /// The sequence of the `resumed` event: a stream answering this resume starts there.
    pub resumed_sequence: i64,
}

/// Whether a resume's answer is the stored answer of an earlier request with the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Replayed(bool);

/// What a human decided for one call.
#[derive(Debug, Clone, PartialEq)]
enum CallDecision {
    Approve,
    Reject,
    Edit(Value),
}

/// Everything the engine is built from.
pub struct EngineParts {
    pub store: Arc<dyn Store>,
    pub model: Arc<dyn Model>,
    pub tools: ToolRegistry,
    pub bus: Arc<dyn Bus>,
    pub clock: Arc<dyn Clock>,
}

struct Inner {
    store: Arc<dyn Store>,
    model: Arc<dyn Model>,
    tools: ToolRegistry,
    bus: Arc<dyn Bus>,
    clock: Arc<dyn Clock>,
    config: EngineConfig,
    workers: Mutex<HashMap<RunId, JoinHandle<()>>>,
    /// Wakes a local worker at once when its run is cancelled (the durable flag is the truth; this
    /// only saves waiting for the next model chunk).
    cancel_signals: Mutex<HashMap<RunId, Arc<tokio::sync::Notify>>>,
    /// Why a local run was asked to cancel, for its `cancelled` event. Another instance's request
    /// is reported as `cancelled_by_user`.
    cancel_reasons: Mutex<HashMap<RunId, String>>,
    shutting_down: AtomicBool,
}

/// The engine. Dropping it aborts its workers at once, as a crash would; [`Engine::shutdown`] lets
/// them reach a checkpoint first.
pub struct Engine {
    inner: Arc<Inner>,
    background: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        for h in self.background.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            h.abort();
        }
        for (_, h) in self.inner.workers.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            h.abort();
        }
    }
}

fn chrono_dur(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

impl Engine {
    pub fn new(parts: EngineParts, config: EngineConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                store: parts.store,
                model: parts.model,
                tools: parts.tools,
                bus: parts.bus,
                clock: parts.clock,
                config,
                workers: Mutex::new(HashMap::new()),
                cancel_signals: Mutex::new(HashMap::new()),
                cancel_reasons: Mutex::new(HashMap::new()),
                shutting_down: AtomicBool::new(false),
            }),
            background: Mutex::new(Vec::new()),
        }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// The engine's clock (tests move it; the binary uses the wall clock).
    pub fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// Recovers the runs left by a dead process (continuing each from its checkpoint), then starts
    /// the background sweeper (interrupt expiry, orphaned runs). Returns how many runs it took over.
    pub async fn start(&self) -> EngineResult<usize> {
        if self.inner.config.steal_leases_on_start {
            // The previous process is gone: so are the requests it was answering. Their keys are
            // released, so a client's retry is evaluated now instead of after the in-flight TTL.
            let released = self.inner.store.abandon_all_in_flight_keys().await?;
            if released > 0 {
                tracing::info!(released, "released idempotency keys of requests the previous process never answered");
            }
        }
        let recovered = self.inner.claim_and_spawn(self.inner.config.steal_leases_on_start).await?;
        let inner = self.inner.clone();
        let sweeper = tokio::spawn(async move {
            let mut tick = tokio::time::interval(inner.config.sweep_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if inner.shutting_down.load(Ordering::SeqCst) {
                    break;
                }
                if let Err(e) = inner.sweep_expired().await {
                    inner.config.metrics.store_error("sweep_expired");
                    tracing::warn!(error = %e, "interrupt expiry sweep failed");
                }
                if let Err(e) = inner.claim_and_spawn(false).await {
                    inner.config.metrics.store_error("claim_runs");
                    tracing::warn!(error = %e, "claiming orphaned runs failed");
                }
            }
        });
        self.background.lock().unwrap_or_else(|e| e.into_inner()).push(sweeper);
        Ok(recovered)
    }

    /// Expires every pending interrupt past its `expires_at` (its run ends `cancelled` with reason
    /// `interrupt_expired`). The background sweeper calls this; tests may call it directly.
    pub async fn sweep_expired(&self) -> EngineResult<usize> {
        self.inner.sweep_expired().await
    }

    /// Stops taking work and lets every worker reach its next checkpoint, release its lease and
    /// stop. Runs continue from there when a process starts again.
    pub async fn shutdown(&self, grace: Duration) {
        self.inner.shutting_down.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + grace;
        loop {
            let live = {
                let mut workers = self.inner.workers.lock().unwrap_or_else(|e| e.into_inner());
                workers.retain(|_, h| !h.is_finished());
                workers.len()
            };
            if live == 0 || Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutting_down.load(Ordering::SeqCst)
    }

    /// Events the bus failed to fan out (see [`Bus::dropped_events`]).
    pub fn bus_dropped_events(&self) -> u64 {
        self.inner.bus.dropped_events()
    }

    /// Workers currently driving a run in this process.
    pub fn active_workers(&self) -> usize {
        let mut workers = self.inner.workers.lock().unwrap_or_else(|e| e.into_inner());
        workers.retain(|_, h| !h.is_finished());
        workers.len()
    }

    // ---------------------------------------------------------------- conversations

    pub async fn create_conversation(&self, user_id: &str, title: &str) -> EngineResult<Conversation> {
        let title = title.trim();
        if title.chars().count() > 200 {
            return Err(EngineError::Invalid("title: must be at most 200 characters".into()));
        }
        let title = Masked::from(if title.is_empty() { "New conversation" } else { title });
        Ok(self.inner.store.create_conversation(user_id, &title, self.inner.clock.now()).await?)
    }

    pub async fn list_conversations(&self, user_id: &str) -> EngineResult<Vec<Conversation>> {
        Ok(self.inner.store.list_conversations(user_id, 100).await?)
    }

    /// The conversation of `user_id`; someone else's is `NotFound`, like one that doesn't exist.
    pub async fn conversation(&self, user_id: &str, id: &ConversationId) -> EngineResult<Conversation> {
        match self.inner.store.get_conversation(id).await? {
            Some(c) if c.user_id == user_id => Ok(c),
            _ => Err(EngineError::NotFound("conversation")),
        }
    }

    pub async fn conversation_view(&self, user_id: &str, id: &ConversationId) -> EngineResult<ConversationView> {
        let conversation = self.conversation(user_id, id).await?;
        let store = &self.inner.store;
        let facts = crate::domain::fact_map(&store.list_facts(id).await?);
        let active_run_id = store.active_run(id).await?.map(|r| r.id);
        let messages = store.list_messages(id).await?.into_iter().filter(|m| m.role != Role::Tool).collect::<Vec<_>>();
        let skip = messages.len().saturating_sub(100);
        Ok(ConversationView { conversation, facts, active_run_id, messages: messages.into_iter().skip(skip).collect() })
    }

    /// Stores the user message and starts a run for it. `RunActive` while the conversation has one.
    pub async fn send_message(
        &self,
        user_id: &str,
        conversation_id: &ConversationId,
        message: SendMessage,
    ) -> EngineResult<StartedRun> {
        if self.is_shutting_down() {
            return Err(EngineError::ShuttingDown);
        }
        let content = message.content.trim();
        if content.is_empty() {
            return Err(EngineError::Invalid("content: must not be empty".into()));
        }
        if content.contains('\0') {
            return Err(EngineError::Invalid("content: must not contain NUL characters".into()));
        }
        let max = self.inner.config.max_message_chars;
        if content.chars().count() > max {
            return Err(EngineError::Invalid(format!("content: must be at most {max} characters")));
        }
        self.conversation(user_id, conversation_id).await?;
        // A key or password pasted into the chat is masked before it is stored, streamed or shown to
        // the model.
        let content = Masked::from(content);
        let started = self
            .inner
            .store
            .start_run(NewRun {
                conversation_id: conversation_id.clone(),
                user_id: user_id.to_owned(),
                content,
                cancel_on_disconnect: message.cancel_on_disconnect,
                now: self.inner.clock.now(),
                events: vec![
                    EventKind::RunStarted { conversation_id: conversation_id.clone(), trace_id: Some(new_trace_id()) },
                    topology(),
                ],
            })
            .await
            .map_err(|e| match e {
                StoreError::RunActive(id) => EngineError::RunActive(id),
                StoreError::NotFound(what) => EngineError::NotFound(what),
                other => EngineError::Store(other),
            })?;
        self.inner.committed(started.run.created_at, &started.events);
        self.inner.spawn_worker(started.run.id.clone(), Lease::Acquire(vec![RunStatus::Queued]));
        Ok(started)
    }

    // ---------------------------------------------------------------- runs

    /// The run of `user_id`; someone else's is `NotFound`.
    pub async fn run(&self, user_id: &str, run_id: &RunId) -> EngineResult<Run> {
        match self.inner.store.get_run(run_id).await? {
            Some(r) if r.user_id == user_id => Ok(r),
            _ => Err(EngineError::NotFound("run")),
        }
    }

    pub async fn run_view(&self, user_id: &str, run_id: &RunId) -> EngineResult<RunView> {
        let run = self.run(user_id, run_id).await?;
        let pending_interrupt = self.inner.store.pending_interrupt(run_id).await?;
        let tool_calls = self.inner.store.list_tool_calls(run_id).await?;
        let interrupts = self.inner.store.list_interrupts(run_id).await?;
        Ok(RunView { run, pending_interrupt, tool_calls, interrupts })
    }

    /// The run's events after `after`, stored then live, until `until`. Check ownership first with
    /// [`Engine::run`].
    pub fn events(
        &self,
        run_id: &RunId,
        after: i64,
        until: Until,
    ) -> impl Stream<Item = Result<Event, StoreError>> + Send + 'static {
        run_events(
            self.inner.store.clone(),
            self.inner.bus.clone(),
            run_id.clone(),
            after,
            until,
            self.inner.config.poll_interval,
        )
    }

    /// Waits until the run pauses or ends; returns its events after `after` up to that point.
    pub async fn wait_settled(&self, run_id: &RunId, after: i64) -> EngineResult<Vec<Event>> {
        let mut events = Vec::new();
        let mut stream = std::pin::pin!(self.events(run_id, after, Until::PauseOrTerminal));
        while let Some(e) = stream.next().await {
            events.push(e?);
        }
        Ok(events)
    }

    /// Durable cancel: any instance sees it. A queued or paused run ends at once; a running one at
    /// its worker's next step or model chunk.
    pub async fn cancel(&self, user_id: &str, run_id: &RunId) -> EngineResult<Run> {
        self.run(user_id, run_id).await?;
        self.inner.cancel(run_id, "cancelled_by_user").await
    }

    /// The client streaming this run went away. The run goes on, unless its policy says cancel.
    pub async fn client_detached(&self, run_id: &RunId) -> EngineResult<()> {
        let Some(run) = self.inner.store.get_run(run_id).await? else { return Ok(()) };
        if run.cancel_on_disconnect && run.status.is_active() {
            tracing::info!(run_id = %run_id, "client disconnected; cancelling as the run's policy says");
            self.inner.cancel(run_id, "client_disconnected").await?;
        }
        Ok(())
    }

    /// A human's decision on a pending interrupt, in the order that makes it safe: authorize the
    /// current caller, check expiry, validate the decision, reserve the idempotency key, claim the
    /// interrupt with a conditional update (one winner), then continue the run. The side effects
    /// happen in the worker, after a precheck and a conditional claim of each call.
    pub async fn resume(&self, user_id: &str, run_id: &RunId, req: ResumeRequest) -> EngineResult<ResumeAccepted> {
        let outcome = self.resume_once(user_id, run_id, req).await;
        let metrics = &self.inner.config.metrics;
        match &outcome {
            Ok((_, Replayed(true))) => metrics.resume("REPLAYED"),
            Ok(_) => metrics.resume("OK"),
            Err(e) => {
                if let EngineError::Store(StoreError::Backend(_)) = e {
                    metrics.store_error("resume");
                }
                metrics.resume(e.code())
            }
        }
        outcome.map(|(accepted, _)| accepted)
    }

    async fn resume_once(
        &self,
        user_id: &str,
        run_id: &RunId,
        req: ResumeRequest,
    ) -> EngineResult<(ResumeAccepted, Replayed)> {
        if self.is_shutting_down() {
            return Err(EngineError::ShuttingDown);
        }
        let inner = &self.inner;
        let store = &inner.store;
        let run = self.run(user_id, run_id).await?;
        let interrupt = match store.get_interrupt(&req.interrupt_id).await? {
            Some(i) if i.run_id == run.id => i,
            _ => return Err(EngineError::NotFound("interrupt")),
        };
        if req.idempotency_key.is_empty() || req.idempotency_key.len() > 200 {
            return Err(EngineError::Invalid("idempotencyKey: must be 1 to 200 characters".into()));
        }
        if looks_secret(&req.idempotency_key) {
            // It would be stored and echoed in errors and logs: an id must not be a credential.
            return Err(EngineError::Invalid(
                "idempotencyKey: looks like a secret (a key, token or password); use an opaque id".into(),
            ));
        }
        if let Some(note) = &req.note {
            if note.chars().count() > MAX_NOTE_CHARS || note.contains('\0') {
                return Err(EngineError::Invalid(format!(
                    "note: must be at most {MAX_NOTE_CHARS} characters, without NUL characters"
                )));
            }
        }
        let calls = store.list_tool_calls(run_id).await?;
        let decisions = parse_decision(&interrupt, &req.decision, &calls, &inner.tools)?;

        // 1. Authorize the caller as of now, not as of when the run started.
        let role = inner.role_of(user_id).await?;
        for (call_id, decision) in &decisions {
            if *decision == CallDecision::Reject {
                continue;
            }
            let Some(call) = calls.iter().find(|c| &c.id == call_id) else { continue };
            let allowed = inner.tools.get(&call.name).map(|t| t.spec().policy_for(role)).unwrap_or(Policy::Deny);
            if allowed == Policy::Deny {
                return Err(EngineError::Forbidden(format!(
                    "your role ({}) may not approve {}",
                    role.map(|r| r.as_str()).unwrap_or("none"),
                    call.name
                )));
            }
        }

        // 2. Expiry.
        let now = inner.clock.now();
        if interrupt.status == InterruptStatus::Expired
            || (interrupt.status == InterruptStatus::Pending && interrupt.expires_at <= now)
        {
            if interrupt.status == InterruptStatus::Pending {
                inner.expire(&interrupt).await?;
            }
            return Err(EngineError::InterruptExpired);
        }

        // 3. The idempotency key: the same request again gets the first answer.
        let hash = request_hash(run_id, &req.interrupt_id, &req.decision, req.note.as_deref());
        let in_flight_until = now + chrono_dur(inner.config.idempotency_in_flight_ttl);
        match store.idempotency_begin(user_id, &req.idempotency_key, &hash, now, in_flight_until).await? {
            IdempotencyBegin::Done { response, .. } => {
                return serde_json::from_value(response)
                    .map(|accepted| (accepted, Replayed(true)))
                    .map_err(|e| EngineError::Store(StoreError::Backend(format!("stored resume answer: {e}"))));
            }
            IdempotencyBegin::InFlight => return Err(EngineError::IdempotencyKeyInFlight),
            IdempotencyBegin::Mismatch => return Err(EngineError::IdempotencyKeyReused),
            IdempotencyBegin::Started => {}
        }

        // The answer is stored under the key in the claim's own transaction.
        let outcome = self.claim_and_continue(&run, &interrupt, &req, decisions, &calls, user_id, now).await;
        if outcome.is_err() {
            // Nothing happened under this key: let a retry be evaluated afresh.
            store.idempotency_abandon(user_id, &req.idempotency_key).await?;
        }
        outcome.map(|accepted| (accepted, Replayed(false)))
    }

    #[allow(clippy::too_many_arguments)]
    async fn claim_and_continue(
        &self,
        run: &Run,
        interrupt: &Interrupt,
        req: &ResumeRequest,
        decisions: BTreeMap<CallId, CallDecision>,
        calls: &[ToolCall],
        user_id: &str,
        now: Timestamp,
    ) -> EngineResult<ResumeAccepted> {
        let inner = &self.inner;
        if interrupt.status != InterruptStatus::Pending {
            return Err(EngineError::InterruptAlreadyResolved);
        }
        // 4. Claim: the interrupt (pending, unexpired) and the run (interrupted) in one conditional
        //    commit. Of concurrent resumes exactly one matches; the rest find nothing to update.
        let owner = inner.lease_token();
        let lease_until = now + chrono_dur(inner.config.lease_ttl);
        let mut commit = Commit::new(
            run.id.clone(),
            Fence::Acquire { owner: owner.clone(), from: vec![RunStatus::Interrupted], lease_until },
            now,
        );
        let decision = Masked::from(&req.decision);
        let note = req.note.as_deref().map(str::trim).filter(|n| !n.is_empty()).map(Masked::from);
        commit.interrupt_changes.push(InterruptChange {
            id: interrupt.id.clone(),
            to: InterruptStatus::Resolved,
            decision: Some(decision.clone()),
            note: note.clone(),
            resolved_by: Some(user_id.to_owned()),
        });
        commit.run = Some(RunChange { to: RunStatus::Running, reason: None });
        let human_wait_ms = (now - interrupt.created_at).num_milliseconds().max(0) as u64;
        commit.events.push(EventKind::Resumed {
            interrupt_id: interrupt.id.clone(),
            decision: decision.clone(),
            note,
            human_wait_ms,
            resolved_by: user_id.to_owned(),
        });
        commit.events.push(EventKind::NodeFinished { node: nodes::APPROVAL.into(), duration_ms: human_wait_ms });
        let mut pending = Vec::new();
        for call_id in &interrupt.call_ids {
            let Some(call) = calls.iter().find(|c| &c.id == call_id) else { continue };
            pending.push(call_id.clone());
            match decisions.get(call_id).unwrap_or(&CallDecision::Reject) {
                CallDecision::Approve => {
                    commit.tool_calls.push(ToolCallChange::transition(call_id, call.state, ToolCallState::Allowed))
                }
                CallDecision::Edit(args) => commit.tool_calls.push(ToolCallChange::Update {
                    id: call_id.clone(),
                    from: call.state,
                    to: ToolCallState::Allowed,
                    args: Some(Masked::from(args)),
                    result: None,
                    summary: None,
                    started_at: None,
                    finished_at: None,
                }),
                CallDecision::Reject => {
                    let reason = format!("rejected by {user_id}; it did not run");
                    deny_call(&mut commit, run, call, &reason, now);
                }
            }
        }
        let mut checkpoint = run.checkpoint.clone();
        checkpoint.next_step = NextStep::ExecuteTools;
        checkpoint.pending_call_ids = pending;
        commit.checkpoint = Some(checkpoint);
        // `resumed` is the commit's first event. Nobody writes to an interrupted run without moving
        // it out of `interrupted` (which fails this commit's fence), so its sequence is known now.
        let accepted = ResumeAccepted {
            run_id: run.id.clone(),
            interrupt_id: interrupt.id.clone(),
            status: RunStatus::Running,
            decision: decision.clone(),
            resumed_sequence: run.next_sequence,
        };
        commit.idempotency = Some(IdempotencyAnswer {
            user_id: user_id.to_owned(),
            key: req.idempotency_key.clone(),
            status: 200,
            response: serde_json::to_value(&accepted).unwrap_or(Value::Null),
            expires_at: now + chrono::Duration::hours(24),
        });

        let committed = match inner.store.commit(commit).await {
            Ok(c) => c,
            Err(StoreError::Conflict(_)) => {
                // Lost the race, or expired meanwhile: say which.
                let current = inner.store.get_interrupt(&interrupt.id).await?;
                return Err(match current.map(|i| i.status) {
                    Some(InterruptStatus::Expired) => EngineError::InterruptExpired,
                    Some(InterruptStatus::Pending) if interrupt.expires_at <= inner.clock.now() => {
                        EngineError::InterruptExpired
                    }
                    Some(InterruptStatus::Pending) => EngineError::RunNotInterrupted,
                    _ => EngineError::InterruptAlreadyResolved,
                });
            }
            Err(e) => return Err(e.into()),
        };
        inner.committed(run.created_at, &committed.events);
        let resumed_sequence = committed
            .events
            .iter()
            .find(|e| matches!(e.kind, EventKind::Resumed { .. }))
            .map(|e| e.sequence)
            .unwrap_or_default();
        inner.spawn_worker(run.id.clone(), Lease::Held(owner));
        if resumed_sequence != accepted.resumed_sequence {
            // Can't happen under the fence; if it ever does, the stored answer is corrected.
            tracing::warn!(run_id = %run.id, "the resumed event's sequence differed from the run's next sequence");
            let accepted = ResumeAccepted { resumed_sequence, ..accepted };
            let body = serde_json::to_value(&accepted).unwrap_or(Value::Null);
            inner.store.idempotency_complete(user_id, &req.idempotency_key, 200, &body).await?;
            return Ok(accepted);
        }
        Ok(accepted)
    }
}

fn request_hash(run_id: &RunId, interrupt_id: &InterruptId, decision: &Value, note: Option<&str>) -> String {
    let mut h = Sha256::new();
    h.update(run_id.as_str());
    h.update(b"\n");
    h.update(interrupt_id.as_str());
    h.update(b"\n");
    // serde_json maps are ordered, so equal decisions hash equally whatever their key order.
    h.update(decision.to_string());
    if let Some(note) = note {
        h.update(b"\nnote\n");
        h.update(note);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Turns the API's decision shapes into one decision per call of the interrupt, validating edits
/// against the tool's schema.
fn parse_decision(
    interrupt: &Interrupt,
    decision: &Value,
    calls: &[ToolCall],
    tools: &ToolRegistry,
) -> EngineResult<BTreeMap<CallId, CallDecision>> {
    let all = |d: CallDecision| interrupt.call_ids.iter().map(|id| (id.clone(), d.clone())).collect();
    let parse_one = |v: &Value| -> EngineResult<CallDecision> {
        match v {
            Value::String(s) if s == "approve" => Ok(CallDecision::Approve),
            Value::String(s) if s == "reject" => Ok(CallDecision::Reject),
            Value::Object(o) if o.len() == 1 && o.contains_key("edit") => Ok(CallDecision::Edit(o["edit"].clone())),
            _ => Err(EngineError::InvalidDecision(
                "a call's decision must be \"approve\", \"reject\" or {\"edit\": {…args}}".into(),
            )),
        }
    };
    // The key is the client's: it is checked, never repeated in the error.
    let check_id = |field: &str, raw: &str| -> EngineResult<CallId> {
        CallId::parse(raw)
            .ok()
            .filter(|id| interrupt.call_ids.contains(id))
            .ok_or_else(|| EngineError::InvalidDecision(format!("{field}: a key is not a call of this interrupt")))
    };
    let mut out: BTreeMap<CallId, CallDecision> = match (interrupt.kind, decision) {
        (InterruptKind::ConfirmAction, Value::String(s)) if s == "approve" => all(CallDecision::Approve),
        (InterruptKind::ConfirmAction, Value::String(s)) if s == "reject" => all(CallDecision::Reject),
        (InterruptKind::ConfirmAction, Value::Object(o)) if o.len() == 1 && o.contains_key("edit") => {
            let Some(edits) = o["edit"].as_object() else {
                return Err(EngineError::InvalidDecision("edit: must map call ids to arguments".into()));
            };
            let mut out: BTreeMap<CallId, CallDecision> = all(CallDecision::Approve);
            for (raw, args) in edits {
                out.insert(check_id("decision.edit", raw)?, CallDecision::Edit(args.clone()));
            }
            out
        }
        (InterruptKind::ConfirmAction, Value::Object(o)) if o.len() == 1 && o.contains_key("calls") => {
            let Some(per_call) = o["calls"].as_object() else {
                return Err(EngineError::InvalidDecision("calls: must map call ids to decisions".into()));
            };
            let mut out = BTreeMap::new();
            for (raw, d) in per_call {
                out.insert(check_id("decision.calls", raw)?, parse_one(d)?);
            }
            if let Some(missing) = interrupt.call_ids.iter().find(|id| !out.contains_key(*id)) {
                return Err(EngineError::InvalidDecision(format!("calls: no decision for {missing}")));
            }
            out
        }
        (InterruptKind::SelectOption, Value::Object(o)) if o.contains_key("select") => {
            return Err(EngineError::InvalidDecision("select decisions are not supported by this run's tools".into()))
        }
        (InterruptKind::ProvideInput, Value::Object(o)) if o.contains_key("provide") => {
            return Err(EngineError::InvalidDecision("provide decisions are not supported by this run's tools".into()))
        }
        (kind, _) => {
            return Err(EngineError::InvalidDecision(format!(
                "not a valid decision for a {kind} interrupt; expected \"approve\", \"reject\", {{\"edit\": …}} or {{\"calls\": …}}"
            )))
        }
    };
    for (call_id, d) in out.iter_mut() {
        if let CallDecision::Edit(args) = d {
            let call = calls.iter().find(|c| &c.id == call_id).ok_or(EngineError::NotFound("tool call"))?;
            let tool =
                tools.get(&call.name).ok_or_else(|| EngineError::InvalidArgs(format!("unknown tool {}", call.name)))?;
            // What would be stored is what is checked: the edit, masked.
            *args = mask_value(args);
            validate_args(&tool.spec().parameters, args)
                .map_err(|e| EngineError::InvalidArgs(format!("edited arguments of {call_id}: {e}")))?;
            if *args == *call.args {
                *d = CallDecision::Approve;
            }
        }
    }
    Ok(out)
}

/// A denied call: the synthetic result the model sees, and the events the client sees.
fn deny_call(commit: &mut Commit, run: &Run, call: &ToolCall, reason: &str, now: Timestamp) {
    let reason = Masked::from(reason);
    let result = Masked::from(json!({"status": "denied", "reason": reason}));
    commit.tool_calls.push(ToolCallChange::Update {
        id: call.id.clone(),
        from: call.state,
        to: ToolCallState::Denied,
        args: None,
        result: Some(result.clone()),
        summary: Some(reason.clone()),
        started_at: None,
        finished_at: Some(now),
    });
    commit.messages.push(tool_message(run, &call.id, &result, now));
    commit.events.push(EventKind::ToolStarted {
        call_id: call.id.clone(),
        tool: call.name.clone(),
        args_summary: args_summary(&call.args),
    });
    commit.events.push(EventKind::ToolFinished {
        call_id: call.id.clone(),
        tool: call.name.clone(),
        status: ToolOutcomeStatus::Denied,
        summary: reason,
    });
}

fn tool_message(run: &Run, call_id: &CallId, result: &Masked<Value>, now: Timestamp) -> Message {
    Message {
        id: MessageId::new(),
        conversation_id: run.conversation_id.clone(),
        run_id: Some(run.id.clone()),
        role: Role::Tool,
        content: result.to_text(),
        tool_call_id: Some(call_id.clone()),
        created_at: now,
    }
}

/// `restart_instance(instanceId=pay-prod-2)`-style, masked and short.
fn args_summary(args: &Masked<Value>) -> Masked<String> {
    let text = match args.as_object() {
        Some(o) => o
            .iter()
            .map(|(k, v)| format!("{k}={}", v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string())))
            .collect::<Vec<_>>()
            .join(", "),
        None => args.to_string(),
    };
    Masked::truncated(&text, 200)
}

/// How a worker holds its run.
#[derive(Debug, Clone)]
enum Lease {
    /// Already holds the lease (from a claim or a resume).
    Held(String),
    /// Takes it with the first commit, from one of these statuses.
    Acquire(Vec<RunStatus>),
}

/// Why a worker stopped.
#[derive(Debug)]
enum Stop {
    /// The run paused or ended.
    Settled,
    /// Someone else holds the run now (or the acquire lost): not ours to touch.
    NotOurs,
    /// Graceful shutdown: the run stays `running` and is continued by the next process.
    Shutdown,
}

#[derive(Debug, thiserror::Error)]
enum WorkerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("model: {0}")]
    Model(ModelError),
    #[error("{0}")]
    Limit(String),
}

/// One run's worker: its lease token and what it knows of the run.
struct Worker {
    inner: Arc<Inner>,
    run: Run,
    owner: String,
    /// The first commit takes the lease.
    acquire: Option<Vec<RunStatus>>,
    cancel_signal: Arc<tokio::sync::Notify>,
    /// Events, and text, that go at the front of the worker's next commit. Only for what needs no
    /// commit of its own because the next one follows at once, with no wait (no model or tool call)
    /// in between: a node starting, the last deltas of a model call. A worker that stops before its
    /// next commit loses only announcements of work that another worker does again.
    deferred: Vec<EventKind>,
    deferred_text: Vec<TextAppend>,
}

impl Inner {
    /// After a commit: publishes its events and measures what they announce.
    fn committed(&self, run_created_at: Timestamp, events: &[Event]) {
        self.bus.publish(events);
        let metrics = &self.config.metrics;
        let ms = Duration::from_millis;
        for event in events {
            metrics.event_appended(event.type_name());
            match &event.kind {
                EventKind::RunStarted { .. } => metrics.run_started(),
                EventKind::NodeFinished { node, duration_ms } => metrics.node_finished(node, ms(*duration_ms)),
                EventKind::Resumed { human_wait_ms, .. } => metrics.human_wait(ms(*human_wait_ms)),
                EventKind::Done { .. } | EventKind::Error { .. } | EventKind::Cancelled { .. } => {
                    let status = match event.kind {
                        EventKind::Done { .. } => RunStatus::Completed,
                        EventKind::Error { .. } => RunStatus::Failed,
                        _ => RunStatus::Cancelled,
                    };
                    let age = (event.ts - run_created_at).to_std().unwrap_or_default();
                    metrics.run_finished(status, age);
                }
                _ => {}
            }
        }
    }

    fn lease_token(&self) -> String {
        format!("{}:{}", self.config.instance_id, uuid::Uuid::now_v7().simple())
    }

    fn lease_until(&self) -> Timestamp {
        self.clock.now() + chrono_dur(self.config.lease_ttl)
    }

    async fn role_of(&self, user_id: &str) -> Result<Option<UserRole>, StoreError> {
        Ok(self.store.user_role(user_id).await?.or(self.config.default_role))
    }

    fn spawn_worker(self: &Arc<Self>, run_id: RunId, lease: Lease) {
        if self.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        let inner = self.clone();
        let key = run_id.clone();
        let handle = tokio::spawn(async move {
            let Ok(Some(mut run)) = inner.store.get_run(&run_id).await else {
                tracing::warn!(run_id = %run_id, "run vanished before its worker started");
                return;
            };
            let trace_id = match run.checkpoint.trace_id.clone() {
                Some(id) => id,
                None => inner.trace_id_of(&run_id).await,
            };
            let span = tracing::info_span!(
                "run",
                run_id = %run_id,
                trace_id = %trace_id,
                step = %run.checkpoint.next_step,
                outcome = tracing::field::Empty,
            );
            if let Some(hook) = &inner.config.run_span_hook {
                hook.call(&span, &trace_id);
            }
            run.checkpoint.trace_id = Some(trace_id);
            inner.clone().work(run, lease).instrument(span).await;
        });
        let mut workers = self.workers.lock().unwrap_or_else(|e| e.into_inner());
        workers.retain(|_, h| !h.is_finished());
        workers.insert(key, handle);
    }

    /// The trace id a run's first event carries, or a new one for a run from before trace ids.
    async fn trace_id_of(&self, run_id: &RunId) -> String {
        match self.store.list_events(run_id, 0, 1).await.as_deref() {
            Ok([Event { kind: EventKind::RunStarted { trace_id: Some(id), .. }, .. }]) => id.clone(),
            _ => new_trace_id(),
        }
    }

    /// One worker's life: drive the run from its checkpoint until it pauses, ends or is not ours.
    async fn work(self: Arc<Self>, run: Run, lease: Lease) {
        let inner = self;
        let run_id = run.id.clone();
        let (owner, acquire) = match lease {
            Lease::Held(owner) => (owner, None),
            Lease::Acquire(from) => (inner.lease_token(), Some(from)),
        };
        let cancel_signal = Arc::new(tokio::sync::Notify::new());
        inner.cancel_signals.lock().unwrap_or_else(|e| e.into_inner()).insert(run_id.clone(), cancel_signal.clone());
        let renewer = inner.spawn_lease_renewer(run_id.clone(), owner.clone());
        let mut worker = Worker {
            inner: inner.clone(),
            run,
            owner,
            acquire,
            cancel_signal,
            deferred: Vec::new(),
            deferred_text: Vec::new(),
        };
        let outcome = match worker.drive().await {
            Ok(Stop::Settled) => "settled",
            Ok(Stop::NotOurs) => "not_ours",
            Ok(Stop::Shutdown) => {
                let _ = inner.store.release_lease(&worker.run.id, &worker.owner).await;
                "shutdown"
            }
            Err(e) => {
                if let WorkerError::Store(_) = e {
                    inner.config.metrics.store_error("worker");
                }
                worker.fail(e).await;
                "failed"
            }
        };
        tracing::Span::current().record("outcome", outcome);
        renewer.abort();
        inner.cancel_signals.lock().unwrap_or_else(|e| e.into_inner()).remove(&run_id);
        inner.cancel_reasons.lock().unwrap_or_else(|e| e.into_inner()).remove(&run_id);
    }

    /// Keeps the lease alive while the worker waits on a slow model or tool. A renewal that fails
    /// means the lease was lost; the worker's next commit is then refused by its fence.
    fn spawn_lease_renewer(self: &Arc<Self>, run_id: RunId, owner: String) -> JoinHandle<()> {
        let inner = self.clone();
        tokio::spawn(async move {
            let period = (inner.config.lease_ttl / 3).max(Duration::from_millis(100));
            loop {
                tokio::time::sleep(period).await;
                match inner.store.renew_lease(&run_id, &owner, inner.lease_until()).await {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        inner.config.metrics.store_error("renew_lease");
                        tracing::warn!(run_id = %run_id, error = %e, "lease renewal failed")
                    }
                }
            }
        })
    }

    async fn claim_and_spawn(self: &Arc<Self>, steal: bool) -> Result<usize, StoreError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Ok(0);
        }
        let mut total = 0;
        loop {
            let owner = self.lease_token();
            let now = self.clock.now();
            let claimed = self.store.claim_runs(&owner, now, self.lease_until(), steal, 50).await?;
            let n = claimed.len();
            for run in claimed {
                tracing::info!(run_id = %run.id, step = %run.checkpoint.next_step, "continuing run from its checkpoint");
                self.spawn_worker(run.id, Lease::Held(owner.clone()));
            }
            total += n;
            if n < 50 {
                return Ok(total);
            }
        }
    }

    async fn sweep_expired(&self) -> EngineResult<usize> {
        let due = self.store.due_interrupts(self.clock.now(), 100).await?;
        let mut n = 0;
        for interrupt in due {
            if self.expire(&interrupt).await? {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Expires a pending interrupt and cancels its run; `false` if a resume or cancel got there first.
    async fn expire(&self, interrupt: &Interrupt) -> EngineResult<bool> {
        let Some(run) = self.store.get_run(&interrupt.run_id).await? else { return Ok(false) };
        let now = self.clock.now();
        let mut commit = Commit::new(run.id.clone(), Fence::Unowned { from: vec![RunStatus::Interrupted] }, now);
        commit.interrupt_changes.push(InterruptChange {
            id: interrupt.id.clone(),
            to: InterruptStatus::Expired,
            decision: None,
            note: None,
            resolved_by: None,
        });
        let calls = self.store.list_tool_calls(&run.id).await?;
        for call in calls.iter().filter(|c| interrupt.call_ids.contains(&c.id) && c.state == ToolCallState::Asking) {
            deny_call(&mut commit, &run, call, "the approval request expired; it did not run", now);
        }
        commit.run = Some(RunChange { to: RunStatus::Cancelled, reason: Some("interrupt_expired".into()) });
        commit.events.push(EventKind::Cancelled { reason: "interrupt_expired".into() });
        match self.store.commit(commit).await {
            Ok(c) => {
                tracing::info!(run_id = %run.id, interrupt_id = %interrupt.id, "interrupt expired; run cancelled");
                self.committed(run.created_at, &c.events);
                Ok(true)
            }
            Err(StoreError::Conflict(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    async fn cancel(&self, run_id: &RunId, reason: &str) -> EngineResult<Run> {
        let now = self.clock.now();
        let run = self.store.request_cancel(run_id, now).await?;
        if let Some(signal) = self.cancel_signals.lock().unwrap_or_else(|e| e.into_inner()).get(run_id) {
            self.cancel_reasons.lock().unwrap_or_else(|e| e.into_inner()).insert(run_id.clone(), reason.to_owned());
            signal.notify_one();
        }
        if !matches!(run.status, RunStatus::Queued | RunStatus::Interrupted) {
            // Running: its worker sees the flag at its next commit. Terminal: nothing to do.
            return Ok(run);
        }
        let mut commit =
            Commit::new(run.id.clone(), Fence::Unowned { from: vec![RunStatus::Queued, RunStatus::Interrupted] }, now);
        if let Some(interrupt) = self.store.pending_interrupt(run_id).await? {
            commit.interrupt_changes.push(InterruptChange {
                id: interrupt.id.clone(),
                to: InterruptStatus::Cancelled,
                decision: None,
                note: None,
                resolved_by: None,
            });
            let calls = self.store.list_tool_calls(run_id).await?;
            for call in calls.iter().filter(|c| interrupt.call_ids.contains(&c.id) && c.state == ToolCallState::Asking)
            {
                deny_call(&mut commit, &run, call, "the run was cancelled; it did not run", now);
            }
        }
        commit.run = Some(RunChange { to: RunStatus::Cancelled, reason: Some(reason.to_owned()) });
        commit.events.push(EventKind::Cancelled { reason: reason.to_owned() });
        match self.store.commit(commit).await {
            Ok(c) => self.committed(run.created_at, &c.events),
            // It started or resumed meanwhile: the flag is set, its worker ends it.
            Err(StoreError::Conflict(_)) => {}
            Err(e) => return Err(e.into()),
        }
        Ok(self.store.get_run(run_id).await?.unwrap_or(run))
    }
}

impl Worker {
    fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    fn new_commit(&mut self) -> Commit {
        let now = self.now();
        let lease_until = now + chrono_dur(self.inner.config.lease_ttl);
        let fence = match self.acquire.take() {
            Some(from) => Fence::Acquire { owner: self.owner.clone(), from, lease_until },
            None => Fence::Lease { owner: self.owner.clone(), lease_until },
        };
        let mut commit = Commit::new(self.run.id.clone(), fence, now);
        commit.events = std::mem::take(&mut self.deferred);
        commit.text = std::mem::take(&mut self.deferred_text);
        commit
    }

    /// Commits, publishes, and keeps the worker's view of the run current.
    async fn commit(&mut self, commit: Commit) -> Result<Committed, StoreError> {
        let checkpoint = commit.checkpoint.clone();
        let status = commit.run.as_ref().map(|c| c.to);
        let committed = self.store().commit(commit).await?;
        self.inner.committed(self.run.created_at, &committed.events);
        if let Some(cp) = checkpoint {
            self.run.checkpoint = cp;
        }
        if let Some(s) = status {
            self.run.status = s;
        }
        self.run.cancel_requested = committed.cancel_requested;
        Ok(committed)
    }

    async fn drive(&mut self) -> Result<Stop, WorkerError> {
        // The first commit takes the lease (queued → running), or proves we still hold it.
        let mut first = self.new_commit();
        // Records the trace id for the workers that continue the run (the first one sets it).
        first.checkpoint = Some(self.run.checkpoint.clone());
        if self.run.status == RunStatus::Queued {
            first.run = Some(RunChange { to: RunStatus::Running, reason: None });
        }
        // A model call cut off by a crash: its text is dropped and the call is made again.
        if let Some(cut) = self.run.checkpoint.streaming_message_id.clone() {
            first.discard_messages.push(cut.clone());
            first.events.push(EventKind::TextDiscarded {
                message_id: cut,
                reason: "the model call was interrupted and is retried".into(),
            });
            let mut cp = self.run.checkpoint.clone();
            cp.streaming_message_id = None;
            cp.next_step = NextStep::CallModel;
            first.checkpoint = Some(cp);
        }
        match self.commit(first).await {
            Ok(_) => {}
            Err(StoreError::Conflict(_)) => return Ok(Stop::NotOurs),
            Err(e) => return Err(e.into()),
        }
        loop {
            if self.run.cancel_requested {
                self.finish_cancelled().await?;
                return Ok(Stop::Settled);
            }
            if self.inner.shutting_down.load(Ordering::SeqCst) {
                return Ok(Stop::Shutdown);
            }
            let step = self.run.checkpoint.next_step;
            let result = match step {
                NextStep::CallModel => self.call_model().await,
                NextStep::ExecuteTools => self.execute_tools().instrument(node_span(nodes::TOOLS)).await,
                NextStep::Finalize => self.finalize().instrument(node_span(nodes::FINALIZE)).await,
                // A paused run has no worker; one that got here was resumed elsewhere.
                NextStep::AwaitInterrupt | NextStep::AwaitExternal => return Ok(Stop::Settled),
            };
            match result {
                Ok(true) => continue,
                Ok(false) => return Ok(Stop::Settled),
                Err(WorkerError::Store(StoreError::Conflict(msg))) => {
                    tracing::warn!(run_id = %self.run.id, %msg, "lost the run's lease; stopping");
                    return Ok(Stop::NotOurs);
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn finish_cancelled(&mut self) -> Result<(), StoreError> {
        let reason = self
            .inner
            .cancel_reasons
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&self.run.id)
            .cloned()
            .unwrap_or_else(|| "cancelled_by_user".to_owned());
        let mut c = self.new_commit();
        c.run = Some(RunChange { to: RunStatus::Cancelled, reason: Some(reason.clone()) });
        let mut cp = self.run.checkpoint.clone();
        cp.streaming_message_id = None;
        c.checkpoint = Some(cp);
        c.events.push(EventKind::Cancelled { reason });
        self.commit(c).await.map(|_| ())
    }

    /// Ends the run `failed` with a generic, masked error event; the cause goes to the log only.
    async fn fail(&mut self, error: WorkerError) {
        let (code, message) = match &error {
            WorkerError::Model(_) => ("MODEL_ERROR", "the model failed; the run was stopped".to_owned()),
            WorkerError::Limit(m) => ("MAX_ITERATIONS", m.clone()),
            WorkerError::Store(_) => ("INTERNAL", "internal error".to_owned()),
        };
        tracing::error!(run_id = %self.run.id, error = %error, "run failed");
        let mut c = self.new_commit();
        c.run = Some(RunChange { to: RunStatus::Failed, reason: Some(code.to_lowercase()) });
        c.events.push(EventKind::Error { code: code.into(), message });
        if let Err(e) = self.commit(c).await {
            // The lease will expire and another worker will retry from the checkpoint.
            tracing::error!(run_id = %self.run.id, error = %e, "could not record the run's failure");
        }
    }

    // ------------------------------------------------------------ call_model

    /// Returns `Ok(true)` to go on with the next step.
    async fn call_model(&mut self) -> Result<bool, WorkerError> {
        if self.run.checkpoint.iteration >= self.inner.config.max_iterations {
            return Err(WorkerError::Limit(format!(
                "the run stopped after {} model calls without an answer",
                self.inner.config.max_iterations
            )));
        }
        let started = Instant::now();
        let Some((request, new_summary)) = self.assemble_context().instrument(node_span(nodes::CONTEXT)).await? else {
            return Ok(true);
        };
        self.stream_answer(request, new_summary, started).instrument(node_span(nodes::MODEL)).await
    }

    /// The model's input for this step; `None` if the run was cancelled meanwhile.
    async fn assemble_context(
        &mut self,
    ) -> Result<Option<(ModelRequest, Option<crate::domain::Summary>)>, WorkerError> {
        let store = self.store().clone();
        let conv = &self.run.conversation_id;
        let messages = store.list_messages(conv).await?;
        let calls = store.list_conversation_tool_calls(conv).await?;
        let facts = store.list_facts(conv).await?;
        let summary = store.get_summary(conv).await?;
        let config = &self.inner.config.context;
        let plan = plan_context(
            config,
            ContextInput { messages: &messages, tool_calls: &calls, facts: &facts, summary: summary.as_ref() },
        );
        let summary_text = match plan.summary_request() {
            Some(request) if config.summarize_with_model => match self.summarize(request).await {
                Ok(Some(text)) => Some(text),
                Ok(None) => {
                    self.run.cancel_requested = true;
                    return Ok(None);
                }
                Err(e) => {
                    tracing::warn!(run_id = %self.run.id, error = %e, "the summary call failed; using the extractive summary");
                    plan.extractive_summary()
                }
            },
            _ => plan.extractive_summary(),
        };
        let assembled = plan.render(summary_text);
        let request = ModelRequest {
            messages: assembled.messages,
            tools: self.inner.tools.specs(),
            facts: crate::domain::fact_map(&facts),
        };
        Ok(Some((request, assembled.new_summary)))
    }

    /// Calls the model (retrying a transient failure once), streaming its text into the run.
    async fn stream_answer(
        &mut self,
        request: ModelRequest,
        new_summary: Option<crate::domain::Summary>,
        started: Instant,
    ) -> Result<bool, WorkerError> {
        let mut attempt = 0;
        loop {
            let message_id = MessageId::new();
            let mut c = self.new_commit();
            c.summary = new_summary.clone();
            if attempt == 0 {
                c.events.push(EventKind::NodeStarted { node: nodes::CONTEXT.into() });
                c.events.push(EventKind::NodeFinished {
                    node: nodes::CONTEXT.into(),
                    duration_ms: started.elapsed().as_millis() as u64,
                });
                c.events.push(EventKind::NodeStarted { node: nodes::MODEL.into() });
            }
            let mut cp = self.run.checkpoint.clone();
            cp.streaming_message_id = Some(message_id.clone());
            c.checkpoint = Some(cp);
            self.commit(c).await?;
            let model_started = Instant::now();
            let call_span = tracing::info_span!(
                "model_call",
                message_id = %message_id,
                attempt,
                outcome = tracing::field::Empty,
            );
            let end = self.stream_model(&request, &message_id).instrument(call_span.clone()).await?;
            call_span.record(
                "outcome",
                match &end {
                    StreamEnd::Completed { .. } => "completed",
                    StreamEnd::Failed(_) => "failed",
                    StreamEnd::Cancelled => "cancelled",
                },
            );
            match end {
                StreamEnd::Cancelled => return Ok(true),
                StreamEnd::Failed(ModelError::Transient(e)) if attempt < self.inner.config.model_retries => {
                    tracing::warn!(run_id = %self.run.id, error = %e, attempt, "model call failed; retrying");
                    attempt += 1;
                    let mut c = self.new_commit();
                    c.discard_messages.push(message_id.clone());
                    c.events.push(EventKind::TextDiscarded {
                        message_id,
                        reason: "the model call failed and is retried".into(),
                    });
                    let mut cp = self.run.checkpoint.clone();
                    cp.streaming_message_id = None;
                    c.checkpoint = Some(cp);
                    self.commit(c).await?;
                    tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await;
                    continue;
                }
                StreamEnd::Failed(e) => return Err(WorkerError::Model(e)),
                StreamEnd::Completed { text_len, tool_calls } => {
                    let mut c = self.new_commit();
                    let mut cp = self.run.checkpoint.clone();
                    cp.streaming_message_id = None;
                    cp.iteration += 1;
                    if text_len > 0 {
                        cp.answer_message_id = Some(message_id.clone());
                    }
                    c.events.push(EventKind::NodeFinished {
                        node: nodes::MODEL.into(),
                        duration_ms: model_started.elapsed().as_millis() as u64,
                    });
                    if tool_calls.is_empty() {
                        cp.next_step = NextStep::Finalize;
                        cp.pending_call_ids = Vec::new();
                    } else {
                        cp.next_step = NextStep::ExecuteTools;
                        cp.pending_call_ids = Vec::new();
                        for tc in tool_calls {
                            let id = CallId::from_model(&tc.id);
                            cp.pending_call_ids.push(id.clone());
                            c.tool_calls.push(ToolCallChange::Insert(ToolCall {
                                id,
                                run_id: self.run.id.clone(),
                                name: truncate(&tc.name, 100),
                                args: Masked::new(tc.arguments),
                                state: ToolCallState::Requested,
                                result: None,
                                summary: None,
                                started_at: None,
                                finished_at: None,
                            }));
                        }
                    }
                    c.checkpoint = Some(cp);
                    self.commit(c).await?;
                    return Ok(true);
                }
            }
        }
    }

    /// The model's summary of older turns: a separate call without tools, its text collected.
    /// `Ok(None)` if the run was cancelled meanwhile; an error (or an empty answer) means "use the
    /// extractive summary".
    async fn summarize(&self, messages: Vec<crate::model::ModelMessage>) -> Result<Option<String>, ModelError> {
        let request = ModelRequest { messages, tools: Vec::new(), facts: FactMap::new() };
        let call = async {
            let mut stream = self.inner.model.stream(request).await?;
            let mut text = String::new();
            while let Some(chunk) = stream.next().await {
                if let ModelChunk::Text(delta) = chunk? {
                    text.push_str(&delta);
                }
            }
            if text.trim().is_empty() {
                return Err(ModelError::Fatal("the summary was empty".into()));
            }
            Ok(text)
        };
        tokio::select! {
            text = call => text.map(Some),
            _ = self.cancel_signal.notified() => Ok(None),
        }
    }

    /// Streams one model call, committing text in groups.
    async fn stream_model(&mut self, request: &ModelRequest, message_id: &MessageId) -> Result<StreamEnd, WorkerError> {
        let asked = Instant::now();
        let mut first_token = true;
        let mut stream = match self.inner.model.stream(request.clone()).await {
            Ok(s) => s,
            Err(e) => return Ok(StreamEnd::Failed(e)),
        };
        let flush_max = self.inner.config.delta_flush_max.max(1);
        let flush_interval = self.inner.config.delta_flush_interval;
        let mut buffer: Vec<String> = Vec::new();
        let mut unsaved = UnsavedText::default();
        let mut deadline: Option<tokio::time::Instant> = None;
        let mut text_len = 0usize;
        let mut tool_calls = Vec::new();
        loop {
            let far = tokio::time::Instant::now() + Duration::from_secs(3600);
            let next = tokio::select! {
                item = stream.next() => Some(item),
                _ = tokio::time::sleep_until(deadline.unwrap_or(far)) => None,
                _ = self.cancel_signal.notified() => {
                    // Stop reading the model at once: dropping the stream ends its request.
                    self.flush_text(message_id, &mut buffer, &mut unsaved, true).await?;
                    self.run.cancel_requested = true;
                    return Ok(StreamEnd::Cancelled);
                }
            };
            if first_token && matches!(next, Some(Some(Ok(_)))) {
                first_token = false;
                self.inner.config.metrics.model_first_token(asked.elapsed());
            }
            match next {
                // The flush deadline passed.
                None => {
                    if self.flush_text(message_id, &mut buffer, &mut unsaved, false).await? {
                        return Ok(StreamEnd::Cancelled);
                    }
                    deadline = None;
                }
                Some(Some(Ok(ModelChunk::Text(delta)))) => {
                    // NUL can't be stored by every backend (Postgres text refuses it).
                    let delta = if delta.contains('\0') { delta.replace('\0', "") } else { delta };
                    if delta.is_empty() {
                        continue;
                    }
                    text_len += delta.len();
                    buffer.push(delta);
                    if deadline.is_none() {
                        deadline = Some(tokio::time::Instant::now() + flush_interval);
                    }
                    if buffer.len() >= flush_max {
                        if self.flush_text(message_id, &mut buffer, &mut unsaved, false).await? {
                            return Ok(StreamEnd::Cancelled);
                        }
                        deadline = None;
                    }
                }
                Some(Some(Ok(ModelChunk::ToolCall(tc)))) => tool_calls.push(tc),
                Some(Some(Err(e))) => {
                    self.flush_text(message_id, &mut buffer, &mut unsaved, true).await?;
                    return Ok(StreamEnd::Failed(e));
                }
                Some(None) => {
                    // The last deltas, and the text not yet stored, go in the commit that ends the
                    // call, which the caller makes at once.
                    unsaved.take_deltas(message_id, &mut buffer, &mut self.deferred);
                    if !unsaved.text.is_empty() {
                        self.deferred_text.push(unsaved.take(message_id));
                    }
                    return Ok(StreamEnd::Completed { text_len, tool_calls });
                }
            }
        }
    }

    /// One transaction for the buffered deltas. Returns whether the run was asked to cancel.
    ///
    /// The deltas' events are stored at once; their text is appended to the stored message only
    /// once enough has gathered (see [`UnsavedText`]) and always when the call ends (`last`), or
    /// when the run is asked to cancel, so the stored message equals the text of its events whenever
    /// the model call is over. A crash in between loses nothing: the message of a call that was cut
    /// off is discarded (`text_discarded`) and the call made again.
    async fn flush_text(
        &mut self,
        message_id: &MessageId,
        buffer: &mut Vec<String>,
        unsaved: &mut UnsavedText,
        last: bool,
    ) -> Result<bool, StoreError> {
        if buffer.is_empty() && (!last || unsaved.text.is_empty()) {
            return Ok(self.run.cancel_requested);
        }
        let mut c = self.new_commit();
        unsaved.take_deltas(message_id, buffer, &mut c.events);
        if last || unsaved.due() {
            c.text.push(unsaved.take(message_id));
        }
        let committed = self.commit(c).await?;
        if committed.cancel_requested && !unsaved.text.is_empty() {
            // the call ends here: the rest of its text goes in now
            let mut c = self.new_commit();
            c.text.push(unsaved.take(message_id));
            self.commit(c).await?;
        }
        Ok(committed.cancel_requested)
    }

    // ------------------------------------------------------------ execute_tools

    async fn execute_tools(&mut self) -> Result<bool, WorkerError> {
        let started = Instant::now();
        let pending = self.run.checkpoint.pending_call_ids.clone();
        let all_calls = self.store().list_tool_calls(&self.run.id).await?;
        let calls: Vec<ToolCall> =
            pending.iter().filter_map(|id| all_calls.iter().find(|c| &c.id == id).cloned()).collect();
        let role = self.inner.role_of(&self.run.user_id).await?;

        // announced with the commit that follows the classification
        self.deferred.push(EventKind::NodeStarted { node: nodes::TOOLS.into() });

        // Classify every call that is not settled yet.
        let mut to_ask: Vec<(ToolCall, bool)> = Vec::new(); // (call, outcome unknown)
        let mut to_run: Vec<ToolCall> = Vec::new();
        for call in calls {
            let tool = self.inner.tools.get(&call.name).cloned();
            match call.state {
                ToolCallState::Requested => {
                    let Some(tool) = tool else {
                        self.settle_failed(&call, ToolCallState::Requested, &format!("unknown tool {}", call.name))
                            .await?;
                        continue;
                    };
                    if call.args.get("__invalid_json").is_some() {
                        let reason = "invalid arguments: the model's arguments were not valid JSON";
                        self.settle_failed(&call, ToolCallState::Requested, reason).await?;
                        continue;
                    }
                    if let Err(e) = validate_args(&tool.spec().parameters, &call.args) {
                        self.settle_failed(&call, ToolCallState::Requested, &format!("invalid arguments: {e}")).await?;
                        continue;
                    }
                    match tool.spec().policy_for(role) {
                        Policy::Deny => {
                            let now = self.now();
                            let mut c = self.new_commit();
                            let reason = format!(
                                "not allowed for role {}; it did not run",
                                role.map(|r| r.as_str()).unwrap_or("none")
                            );
                            deny_call(&mut c, &self.run, &call, &reason, now);
                            self.commit(c).await?;
                        }
                        Policy::Allow => {
                            let mut c = self.new_commit();
                            c.tool_calls.push(ToolCallChange::transition(&call.id, call.state, ToolCallState::Allowed));
                            self.commit(c).await?;
                            to_run.push(ToolCall { state: ToolCallState::Allowed, ..call });
                        }
                        Policy::Ask => to_ask.push((call, false)),
                    }
                }
                ToolCallState::Allowed => to_run.push(call),
                ToolCallState::Executing => {
                    // Cut off by a crash mid-execution.
                    if tool.as_ref().is_some_and(|t| t.spec().idempotent) {
                        tracing::info!(run_id = %self.run.id, call_id = %call.id, "retrying an idempotent call cut off by a crash");
                        to_run.push(call);
                    } else {
                        let mut c = self.new_commit();
                        c.tool_calls.push(ToolCallChange::transition(&call.id, call.state, ToolCallState::Unknown));
                        self.commit(c).await?;
                        to_ask.push((ToolCall { state: ToolCallState::Unknown, ..call }, true));
                    }
                }
                ToolCallState::Unknown => to_ask.push((call, true)),
                ToolCallState::Asking => to_ask.push((call, false)),
                ToolCallState::Denied | ToolCallState::Succeeded | ToolCallState::Failed | ToolCallState::Suspended => {
                }
            }
        }

        // Read-only calls run concurrently; calls with side effects one at a time, in order.
        let (read_only, side_effects): (Vec<ToolCall>, Vec<ToolCall>) = to_run
            .into_iter()
            .partition(|c| self.inner.tools.get(&c.name).map(|t| !t.spec().side_effect).unwrap_or(true));
        self.run_calls(read_only).await?;
        for call in side_effects {
            self.run_calls(vec![call]).await?;
            if self.run.cancel_requested {
                return Ok(true);
            }
        }

        if !to_ask.is_empty() {
            self.pause_for(to_ask, started).await?;
            return Ok(false);
        }
        let mut c = self.new_commit();
        c.events.push(EventKind::NodeFinished {
            node: nodes::TOOLS.into(),
            duration_ms: started.elapsed().as_millis() as u64,
        });
        let mut cp = self.run.checkpoint.clone();
        cp.next_step = NextStep::CallModel;
        cp.pending_call_ids = Vec::new();
        c.checkpoint = Some(cp);
        self.commit(c).await?;
        Ok(true)
    }

    fn tool_context(&self, call: &ToolCall, role: Option<UserRole>) -> ToolContext {
        ToolContext {
            call_id: call.id.clone(),
            run_id: self.run.id.clone(),
            conversation_id: self.run.conversation_id.clone(),
            user_id: self.run.user_id.clone(),
            role,
            now: self.now(),
            store: self.inner.store.clone(),
        }
    }

    /// Prechecks, claims (`allowed → executing`, conditional), executes and records each call.
    async fn run_calls(&mut self, calls: Vec<ToolCall>) -> Result<(), WorkerError> {
        if calls.is_empty() {
            return Ok(());
        }
        let role = self.inner.role_of(&self.run.user_id).await?;
        let mut claimed: Vec<(ToolCall, Arc<dyn Tool>)> = Vec::new();
        for call in calls {
            let Some(tool) = self.inner.tools.get(&call.name).cloned() else {
                self.settle_failed(&call, call.state, &format!("unknown tool {}", call.name)).await?;
                continue;
            };
            if tool.spec().side_effect && call.state == ToolCallState::Allowed {
                // Reload the resource and re-check it (and the caller) just before the side effect.
                if let Err(e) = tool.precheck(&self.tool_context(&call, role), &call.args).await {
                    self.settle_failed(&call, ToolCallState::Allowed, &e.to_string()).await?;
                    continue;
                }
            }
            let now = self.now();
            let mut c = self.new_commit();
            c.tool_calls.push(ToolCallChange::Update {
                id: call.id.clone(),
                from: call.state,
                to: ToolCallState::Executing,
                args: None,
                result: None,
                summary: None,
                started_at: Some(now),
                finished_at: None,
            });
            c.events.push(EventKind::ToolStarted {
                call_id: call.id.clone(),
                tool: call.name.clone(),
                args_summary: args_summary(&call.args),
            });
            self.commit(c).await?;
            claimed.push((ToolCall { state: ToolCallState::Executing, ..call }, tool));
        }
        let contexts: Vec<ToolContext> = claimed.iter().map(|(call, _)| self.tool_context(call, role)).collect();
        let metrics = &self.inner.config.metrics;
        let outputs = futures::future::join_all(claimed.iter().zip(contexts.iter()).map(|((call, tool), ctx)| {
            // Ids and the tool's name only: arguments and results may hold anything.
            let span = tracing::info_span!(
                "tool_call",
                call_id = %call.id,
                tool = %call.name,
                outcome = tracing::field::Empty,
            );
            async move {
                let started = Instant::now();
                let output = tool.execute(ctx, &call.args).await;
                let outcome = if output.is_ok() { "success" } else { "error" };
                tracing::Span::current().record("outcome", outcome);
                metrics.tool_call(&call.name, outcome, started.elapsed());
                output
            }
            .instrument(span)
        }))
        .await;
        for ((call, _), output) in claimed.into_iter().zip(outputs) {
            self.record_result(&call, output).await?;
        }
        Ok(())
    }

    async fn record_result(
        &mut self,
        call: &ToolCall,
        output: Result<ToolOutput, ToolError>,
    ) -> Result<(), StoreError> {
        let output = match output {
            Ok(o) => o,
            Err(e) => return self.settle_failed(call, ToolCallState::Executing, &e.to_string()).await,
        };
        let now = self.now();
        let mut c = self.new_commit();
        let result = Masked::from(&output.result);
        let summary = Masked::truncated(&output.summary, 200);
        c.tool_calls.push(ToolCallChange::Update {
            id: call.id.clone(),
            from: ToolCallState::Executing,
            to: ToolCallState::Succeeded,
            args: None,
            result: Some(result.clone()),
            summary: Some(summary.clone()),
            started_at: None,
            finished_at: Some(now),
        });
        c.messages.push(tool_message(&self.run, &call.id, &result, now));
        c.effects = output.effects.clone();
        c.events.push(EventKind::ToolFinished {
            call_id: call.id.clone(),
            tool: call.name.clone(),
            status: ToolOutcomeStatus::Success,
            summary,
        });
        if !output.facts.is_empty() {
            let new_facts: Vec<(String, Masked<String>)> =
                output.facts.iter().map(|(key, value)| (key.clone(), Masked::fact(key, value))).collect();
            for (key, value) in &new_facts {
                c.facts.push(Fact {
                    key: key.clone(),
                    value: value.clone(),
                    source: FactSource::ToolResult,
                    updated_at: now,
                });
            }
            let mut facts = crate::domain::fact_map(&self.store().list_facts(&self.run.conversation_id).await?);
            facts.extend(new_facts.into_iter().map(|(k, v)| (k, v.into_inner())));
            c.events.push(EventKind::FactsUpdated { facts });
        }
        match self.commit(c).await {
            Ok(_) => Ok(()),
            // The world changed between the precheck and the effect: nothing was applied.
            Err(StoreError::EffectRefused(reason)) => {
                self.settle_failed(call, ToolCallState::Executing, &format!("not done: {reason}")).await
            }
            Err(e) => Err(e),
        }
    }

    /// Records a call that failed (or never started): the model is told why; no fact is written.
    async fn settle_failed(&mut self, call: &ToolCall, from: ToolCallState, reason: &str) -> Result<(), StoreError> {
        let now = self.now();
        let reason = Masked::truncated(reason, 300);
        let result = Masked::from(json!({"status": "error", "error": reason}));
        let mut c = self.new_commit();
        if from == ToolCallState::Requested {
            // Never allowed: go through `allowed` so the state machine holds.
            c.tool_calls.push(ToolCallChange::transition(&call.id, from, ToolCallState::Allowed));
        }
        c.tool_calls.push(ToolCallChange::Update {
            id: call.id.clone(),
            from: if from == ToolCallState::Requested { ToolCallState::Allowed } else { from },
            to: ToolCallState::Failed,
            args: None,
            result: Some(result.clone()),
            summary: Some(reason.clone()),
            started_at: None,
            finished_at: Some(now),
        });
        c.messages.push(tool_message(&self.run, &call.id, &result, now));
        if from != ToolCallState::Executing {
            c.events.push(EventKind::ToolStarted {
                call_id: call.id.clone(),
                tool: call.name.clone(),
                args_summary: args_summary(&call.args),
            });
        }
        c.events.push(EventKind::ToolFinished {
            call_id: call.id.clone(),
            tool: call.name.clone(),
            status: ToolOutcomeStatus::Error,
            summary: reason,
        });
        self.commit(c).await.map(|_| ())
    }

    /// Interrupt + checkpoint + `interrupted` + `interrupt` event, one transaction.
    async fn pause_for(&mut self, calls: Vec<(ToolCall, bool)>, tools_started: Instant) -> Result<(), StoreError> {
        let now = self.now();
        let expires_at = now + chrono_dur(self.inner.config.interrupt_ttl);
        let mut c = self.new_commit();
        let mut actions = Vec::new();
        let mut any_unknown = false;
        for (call, unknown) in &calls {
            any_unknown |= *unknown;
            if call.state == ToolCallState::Requested {
                c.tool_calls.push(ToolCallChange::transition(&call.id, call.state, ToolCallState::Asking));
            }
            let desc = self.inner.tools.get(&call.name).map(|t| t.describe(&call.args));
            let mut action = json!({
                "callId": call.id,
                "tool": call.name,
                "args": call.args,
                "title": desc.as_ref().map(|d| d.title.clone()),
                "risk": desc.as_ref().map(|d| d.risk.clone()),
                "description": desc.as_ref().map(|d| d.description.clone()),
            });
            if *unknown {
                action["outcome"] = json!("unknown");
            }
            actions.push(action);
        }
        let title = match (calls.len(), any_unknown) {
            (_, true) => "An action was interrupted; its outcome is unknown".to_owned(),
            (1, false) => actions[0]["title"].as_str().unwrap_or("Confirm the action").to_owned(),
            (n, false) => format!("Confirm {n} actions"),
        };
        let risk = if any_unknown {
            "The process stopped while this action was running, so it may or may not have happened. Check \
             the target before approving it again."
                .to_owned()
        } else {
            actions.iter().filter_map(|a| a["risk"].as_str()).collect::<Vec<_>>().join(" ")
        };
        let payload =
            Masked::new(json!({"title": title, "risk": risk, "actions": actions, "outcomeUnknown": any_unknown}));
        let interrupt = Interrupt {
            id: InterruptId::new(),
            run_id: self.run.id.clone(),
            kind: InterruptKind::ConfirmAction,
            status: InterruptStatus::Pending,
            payload: payload.clone(),
            call_ids: calls.iter().map(|(c, _)| c.id.clone()).collect(),
            created_at: now,
            expires_at,
            decision: None,
            note: None,
            resolved_by: None,
            resolved_at: None,
        };
        c.events.push(EventKind::NodeFinished {
            node: nodes::TOOLS.into(),
            duration_ms: tools_started.elapsed().as_millis() as u64,
        });
        c.events.push(EventKind::NodeStarted { node: nodes::APPROVAL.into() });
        c.events.push(EventKind::Interrupt {
            interrupt_id: interrupt.id.clone(),
            kind: interrupt.kind,
            payload,
            expires_at,
        });
        c.new_interrupts.push(interrupt.clone());
        c.run = Some(RunChange { to: RunStatus::Interrupted, reason: None });
        let mut cp = self.run.checkpoint.clone();
        cp.next_step = NextStep::AwaitInterrupt;
        cp.pending_call_ids = interrupt.call_ids.clone();
        c.checkpoint = Some(cp);
        self.commit(c).await.map(|_| ())
    }

    // ------------------------------------------------------------ finalize

    async fn finalize(&mut self) -> Result<bool, WorkerError> {
        let mut c = self.new_commit();
        c.events.push(EventKind::NodeStarted { node: nodes::FINALIZE.into() });
        c.events.push(EventKind::NodeFinished { node: nodes::FINALIZE.into(), duration_ms: 0 });
        c.events.push(EventKind::Done { message_id: self.run.checkpoint.answer_message_id.clone() });
        c.run = Some(RunChange { to: RunStatus::Completed, reason: None });
        self.commit(c).await?;
        Ok(false)
    }
}

/// A span per node of the agent loop (`context`, `model`, `tools`, `finalize`) inside the run's.
fn node_span(node: &'static str) -> tracing::Span {
    tracing::info_span!("node", node)
}

enum StreamEnd {
    Completed { text_len: usize, tool_calls: Vec<crate::model::ModelToolCall> },
    Failed(ModelError),
    Cancelled,
}

/// Text of a model call that its events carry but the stored message does not yet.
///
/// Appending to a stored message rewrites it (in SQLite and Postgres alike), so appending every
/// few deltas would make a long answer cost the square of its length: 100,000 words were ~3,000
/// rewrites of a message growing to ~700 KB. The text is appended once it is at least
/// [`UnsavedText::MIN_APPEND`] bytes and half of what is stored already, so the bytes rewritten stay
/// a small multiple of the answer's length; and always at the end of the call.
#[derive(Debug, Default)]
struct UnsavedText {
    text: String,
    /// Bytes of the call's text the stored message has.
    saved: usize,
}

impl UnsavedText {
    const MIN_APPEND: usize = 4096;

    fn due(&self) -> bool {
        self.text.len() >= Self::MIN_APPEND.max(self.saved / 2)
    }

    /// Turns the buffered deltas into `text_delta` events; their text waits here for its append.
    fn take_deltas(&mut self, message_id: &MessageId, buffer: &mut Vec<String>, events: &mut Vec<EventKind>) {
        for delta in buffer.drain(..) {
            self.text.push_str(&delta);
            events.push(EventKind::TextDelta { message_id: message_id.clone(), delta });
        }
    }

    fn take(&mut self, message_id: &MessageId) -> TextAppend {
        let text = std::mem::take(&mut self.text);
        self.saved += text.len();
        TextAppend { message_id: message_id.clone(), text }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_code_is_listed() {
        let all = [
            EngineError::NotFound("conversation"),
            EngineError::NotFound("run"),
            EngineError::NotFound("interrupt"),
            EngineError::NotFound("tool call"),
            EngineError::RunActive(RunId::new()),
            EngineError::InterruptAlreadyResolved,
            EngineError::InterruptExpired,
            EngineError::RunNotInterrupted,
            EngineError::IdempotencyKeyInFlight,
            EngineError::IdempotencyKeyReused,
            EngineError::Forbidden(String::new()),
            EngineError::InvalidDecision(String::new()),
            EngineError::InvalidArgs(String::new()),
            EngineError::Invalid(String::new()),
            EngineError::ShuttingDown,
            EngineError::Store(StoreError::Backend(String::new())),
        ];
        let codes: std::collections::BTreeSet<_> = all.iter().map(EngineError::code).collect();
        let listed: std::collections::BTreeSet<_> = EngineError::CODES.iter().copied().collect();
        assert_eq!(codes, listed);
    }
}
