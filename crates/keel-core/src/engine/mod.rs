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

use futures::future::BoxFuture;
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::agent::{Agent, Agents};
use crate::bus::Bus;
use crate::clock::Clock;
use crate::context::{plan as plan_context, ContextInput};
use crate::domain::{
    Conversation, Fact, FactMap, FactSource, Interrupt, InterruptKind, InterruptStatus, Message, NextStep, Role, Run,
    RunStatus, Timestamp, ToolCall, ToolCallState, UserRole,
};
use crate::event::{Event, EventKind, GraphEdge, GraphNode, ToolOutcomeStatus};
use crate::ids::{CallId, ConversationId, InterruptId, MessageId, RunId};
use crate::mask::{looks_secret, mask_value, truncate, Masked};
use crate::metrics::{new_trace_id, Metrics, RunSpanHook};
use crate::model::{ModelChunk, ModelError, ModelRequest};
use crate::store::{
    AnswerView, Commit, Committed, DueWork, Fence, IdempotencyAnswer, IdempotencyBegin, InterruptChange, NewLease,
    NewRun, RolledBack, RunChange, StartedRun, Store, StoreError, TextAppend, ToolCallChange, ToolCallUpdate,
};
use crate::stream::{run_events, Following, Known, Until};
use crate::tool::{NextAttempt, Policy, Tool, ToolContext, ToolError, ToolOutput, ToolRegistry};

mod client;
mod config;
mod decision;
mod error;
mod recent;
mod resume;
mod supervisor;
mod tools;
mod worker;

pub use client::{ClientOutcome, ToolResultAccepted, ToolResultRequest};
pub use config::{default_max_concurrent_runs, EngineConfig};
use decision::per_call;
pub use decision::{CallDecision, Decision};
pub use error::{EngineError, EngineResult};
pub use resume::{ResumeAccepted, ResumeRequest, MAX_NOTE_CHARS};
use tools::*;
use worker::*;

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

/// How many of a conversation's latest messages (tool results left out) its view shows.
pub const CONVERSATION_VIEW_MESSAGES: u32 = 100;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SendMessage {
    pub content: String,
    pub cancel_on_disconnect: bool,
}

/// What a new message does when its conversation has a run that is not over (LangGraph's
/// `multitask_strategy`):
/// - `reject` it (`RunActive`, the default);
/// - `interrupt` the runs not over — cancel the active one at its next checkpoint, keeping what it
///   did, and the waiting ones before they run — and start the new one once they have ended;
/// - `enqueue` it: it waits its turn, durably, behind the active run and the messages queued before
///   it (a run `waiting`), and starts when the runs ahead of it have ended;
/// - `rollback`: as `interrupt`, then the cancelled runs are rolled back (their messages and events
///   removed, their tool calls and interrupts kept for the audit), as if they never ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MultitaskStrategy {
    #[default]
    Reject,
    Interrupt,
    Enqueue,
    Rollback,
}

impl MultitaskStrategy {
    /// Every strategy's name, as the APIs take them.
    pub const NAMES: &'static [&'static str] = &["reject", "interrupt", "enqueue", "rollback"];

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "reject" => Some(Self::Reject),
            "interrupt" => Some(Self::Interrupt),
            "enqueue" => Some(Self::Enqueue),
            "rollback" => Some(Self::Rollback),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reject => "reject",
            Self::Interrupt => "interrupt",
            Self::Enqueue => "enqueue",
            Self::Rollback => "rollback",
        }
    }
}

/// How long `interrupt` and `rollback` wait for a run to end (a tool call in flight finishes first).
const INTERRUPT_WAIT: Duration = Duration::from_secs(60);

/// The most waiting runs of one conversation `interrupt` and `rollback` cancel in one pass.
const WAITING_CLEARED: u32 = 1000;

/// A run's first events once it starts: `run_started` (with the run's new trace id) and the graph.
fn first_events(conversation_id: &ConversationId) -> Vec<EventKind> {
    vec![EventKind::RunStarted { conversation_id: conversation_id.clone(), trace_id: Some(new_trace_id()) }, topology()]
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
    /// The runs whose messages wait their turn behind the active run (`multitaskStrategy`
    /// `enqueue`), in the order they will start. Their messages are not in `messages` yet.
    #[serde(default)]
    pub waiting_run_ids: Vec<RunId>,
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

/// Everything the engine is built from.
pub struct EngineParts {
    pub store: Arc<dyn Store>,
    /// The agents conversations talk to, each with its model and tools.
    pub agents: Agents,
    pub bus: Arc<dyn Bus>,
    pub clock: Arc<dyn Clock>,
}

struct Inner {
    store: Arc<dyn Store>,
    agents: Agents,
    bus: Arc<dyn Bus>,
    clock: Arc<dyn Clock>,
    config: EngineConfig,
    /// Every live worker task, by a serial of its own: two tasks may briefly drive for one run (a
    /// new run's worker and a claim racing for its lease; the loser stops at its first commit), and
    /// neither may hide the other from shutdown, drop or the count.
    workers: Mutex<HashMap<u64, JoinHandle<()>>>,
    next_worker: std::sync::atomic::AtomicU64,
    /// Wakes a local worker at once when its run is cancelled (the durable flag is the truth; this
    /// only saves waiting for the next model chunk).
    cancel_signals: Mutex<HashMap<RunId, Arc<tokio::sync::Notify>>>,
    /// Why a local run was asked to cancel, for its `cancelled` event. Another instance's request
    /// is reported as `cancelled_by_user`.
    cancel_reasons: Mutex<HashMap<RunId, String>>,
    shutting_down: AtomicBool,
    /// One slot per live worker, at most `max_concurrent_runs`.
    capacity: Arc<supervisor::Capacity>,
    /// The one look for every idle event stream of this process, where other processes commit
    /// (`poll_interval`); none where the bus delivers every event.
    idle: Option<Arc<crate::stream::IdleWatch>>,
    /// Conversations' owners and agents, as made or read here ([`Engine::conversation_agent`]).
    owners: Mutex<recent::Recent<ConversationId, (String, Option<String>)>>,
}

/// The most conversations whose owner and agent an engine keeps; past it, it forgets those not used
/// lately and reads them again as they come (at ~100 bytes each, a few megabytes at most).
const OWNERS_KEPT: usize = 16_384;

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
        let max_concurrent_runs = config.max_concurrent_runs;
        let idle = config
            .poll_interval
            .map(|every| crate::stream::IdleWatch::new(parts.store.clone(), every, config.metrics.clone()));
        Self {
            inner: Arc::new(Inner {
                store: parts.store,
                agents: parts.agents,
                bus: parts.bus,
                clock: parts.clock,
                config,
                workers: Mutex::new(HashMap::new()),
                next_worker: std::sync::atomic::AtomicU64::new(0),
                cancel_signals: Mutex::new(HashMap::new()),
                cancel_reasons: Mutex::new(HashMap::new()),
                shutting_down: AtomicBool::new(false),
                capacity: supervisor::Capacity::new(max_concurrent_runs),
                idle,
                owners: Mutex::new(recent::Recent::new(OWNERS_KEPT)),
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

    /// The agents this engine runs.
    pub fn agents(&self) -> &Agents {
        &self.inner.agents
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
        // Waiting runs whose turn came while no process was there to start them start first, so
        // that the claim below takes them with the rest.
        let finished = self.inner.finish_rollbacks().await?;
        if finished > 0 {
            tracing::info!(finished, "finished rollbacks the previous process left undone");
        }
        let promoted = self.inner.promote_stranded().await?;
        if promoted > 0 {
            tracing::info!(promoted, "started waiting runs whose turn came while the server was down");
        }
        let recovered = self.inner.claim_and_spawn(self.inner.config.steal_leases_on_start).await?;
        // The sweeps, every sweep interval: expired interrupts, rollbacks left undone, waiting runs
        // whose turn came but that nobody started (their conversation's run ended in a process that
        // stopped before starting the next), and runs that need a worker (queued ones another
        // instance had no slot for, released ones, expired leases). One read says which of them
        // have work, and only those run: an idle instance's sweep is that read. When a slot frees
        // while work was turned away, the claim (with the rollbacks and promotions before it) runs
        // at once.
        let inner = self.inner.clone();
        let sweeper = tokio::spawn(async move {
            let mut tick = tokio::time::interval(inner.config.sweep_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let due = tokio::select! {
                    _ = tick.tick() => None,
                    () = inner.capacity.freed() => Some(DueWork { expired_interrupts: false, ..DueWork::ALL }),
                };
                if inner.shutting_down.load(Ordering::SeqCst) {
                    break;
                }
                let due = match due {
                    Some(due) => due,
                    None => match inner.store.due_work(inner.clock.now()).await {
                        Ok(due) => due,
                        Err(e) => {
                            // Each sweep's own read says whether it has work.
                            inner.config.metrics.store_error("due_work");
                            tracing::warn!(error = %e, "looking for due work failed");
                            DueWork::ALL
                        }
                    },
                };
                inner.sweep(due).await;
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

    /// The most runs this instance drives at once (`max_concurrent_runs`).
    pub fn capacity(&self) -> usize {
        self.inner.capacity.limit()
    }

    /// The most workers that were driving runs at once in this process since it started.
    pub fn peak_workers(&self) -> usize {
        self.inner.capacity.peak()
    }

    /// Workers currently driving a run in this process.
    pub fn active_workers(&self) -> usize {
        let mut workers = self.inner.workers.lock().unwrap_or_else(|e| e.into_inner());
        workers.retain(|_, h| !h.is_finished());
        workers.len()
    }

    // ---------------------------------------------------------------- conversations

    /// A conversation with `agent_id` (the default agent when `None`); `UnknownAgent` for an id this
    /// engine does not run.
    pub async fn create_conversation(
        &self,
        user_id: &str,
        title: &str,
        agent_id: Option<&str>,
    ) -> EngineResult<Conversation> {
        let title = title.trim();
        if title.chars().count() > 200 {
            return Err(EngineError::Invalid("title: must be at most 200 characters".into()));
        }
        let agent = self.inner.agents.resolve(agent_id).ok_or(EngineError::UnknownAgent)?;
        let title = Masked::from(if title.is_empty() { "New conversation" } else { title });
        let conversation =
            self.inner.store.create_conversation(user_id, &title, &agent.id, self.inner.clock.now()).await?;
        self.remember_owner(&conversation);
        Ok(conversation)
    }

    /// The agent of `user_id`'s conversation `id` (someone else's is `NotFound`, like one that
    /// doesn't exist), for a message that starts a run. A conversation's owner and agent are fixed
    /// when it is made, and Keel deletes no conversation, so once made or read here they are known
    /// without a read (a conversation made by another instance costs one, the first time).
    async fn conversation_agent(&self, user_id: &str, id: &ConversationId) -> EngineResult<Option<String>> {
        let known = self.inner.owners.lock().unwrap_or_else(|e| e.into_inner()).get(id);
        let (owner, agent_id) = match known {
            Some(known) => known,
            None => {
                let conversation = self.conversation(user_id, id).await?;
                self.remember_owner(&conversation);
                return Ok(conversation.agent_id);
            }
        };
        if owner != user_id {
            return Err(EngineError::NotFound("conversation"));
        }
        Ok(agent_id)
    }

    fn remember_owner(&self, conversation: &Conversation) {
        let mut owners = self.inner.owners.lock().unwrap_or_else(|e| e.into_inner());
        owners.insert(conversation.id.clone(), (conversation.user_id.clone(), conversation.agent_id.clone()));
    }

    /// The agent a conversation talks to (the default one for a conversation made before agents).
    pub fn agent_of(&self, conversation: &Conversation) -> Option<Arc<Agent>> {
        self.inner.agents.resolve(conversation.agent_id.as_deref())
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
        let waiting_run_ids =
            store.waiting_runs(id, CONVERSATION_VIEW_MESSAGES).await?.into_iter().map(|r| r.id).collect();
        let messages = store.recent_messages(id, CONVERSATION_VIEW_MESSAGES).await?;
        Ok(ConversationView { conversation, facts, active_run_id, waiting_run_ids, messages })
    }

    /// Stores the user message and starts a run for it. `RunActive` while the conversation has a
    /// run that is not over (an active one, or messages waiting their turn).
    pub async fn send_message(
        &self,
        user_id: &str,
        conversation_id: &ConversationId,
        message: SendMessage,
    ) -> EngineResult<StartedRun> {
        Ok(self.start_message(user_id, conversation_id, message, false, false).await?.0)
    }

    /// The message's run, started now, or with `enqueue` created `waiting` behind the runs that are
    /// not over (its message is stored when it starts).
    async fn start_message(
        &self,
        user_id: &str,
        conversation_id: &ConversationId,
        message: SendMessage,
        enqueue: bool,
        follow: bool,
    ) -> EngineResult<(StartedRun, Option<Following>)> {
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
        let agent_id = self.conversation_agent(user_id, conversation_id).await?;
        // A conversation of an agent this server no longer runs can be read, not continued.
        let agent = self.inner.agents.resolve(agent_id.as_deref()).ok_or(EngineError::UnknownAgent)?;
        // A key or password pasted into the chat is masked before it is stored, streamed or shown to
        // the model.
        let content = Masked::from(content);
        // A run that starts at once is written leased to this instance's worker (when it has a free
        // slot), so no other instance claims it before that worker's first commit. (A run written
        // `waiting` gets no lease, and the slot is let go.)
        let reserved = self.inner.reserve_worker();
        let started = self
            .inner
            .store
            .start_run(NewRun {
                conversation_id: conversation_id.clone(),
                agent_id: agent.id.clone(),
                user_id: user_id.to_owned(),
                content,
                cancel_on_disconnect: message.cancel_on_disconnect,
                now: self.inner.clock.now(),
                events: first_events(conversation_id),
                enqueue: enqueue.then(|| vec![EventKind::RunWaiting { conversation_id: conversation_id.clone() }]),
                lease: reserved.as_ref().map(|(_, lease)| lease.clone()),
            })
            .await
            .map_err(|e| match e {
                StoreError::RunActive(id) => EngineError::RunActive(id),
                StoreError::NotFound(what) => EngineError::NotFound(what),
                other => other.into(),
            })?;
        // Subscribed before its first events are published and its worker starts: the caller's
        // stream follows the run from its first event without reading the store.
        let following = (follow && started.run.status != RunStatus::Waiting)
            .then(|| Following::new(self.inner.bus.as_ref(), &started.run.id));
        self.inner.committed(&started.run, &started.events);
        if started.run.status == RunStatus::Waiting {
            // The runs ahead of it may have ended while it was written, and their end found nothing
            // waiting: its turn is looked for now (a look that finds the active run costs one read).
            if let Err(e) = self.inner.promote_next(conversation_id).await {
                self.inner.config.metrics.store_error("promote_waiting");
                tracing::warn!(conversation_id = %conversation_id, error = %e, "looking for the next waiting run failed");
            }
            return Ok((started, None));
        }
        self.inner.start_worker(&started, reserved, worker::Primed::first_run(&started));
        Ok((started, following))
    }

    /// [`Engine::send_message`] with a strategy for a conversation whose run is not over (see
    /// [`MultitaskStrategy`]). With `Interrupt` and `Rollback`, the new run starts once the runs
    /// it replaces have ended; a run that does not end within a minute leaves `RunActive`.
    pub async fn send_message_with(
        &self,
        user_id: &str,
        conversation_id: &ConversationId,
        message: SendMessage,
        strategy: MultitaskStrategy,
    ) -> EngineResult<StartedRun> {
        Ok(self.send_message_following(user_id, conversation_id, message, strategy, false).await?.0)
    }

    /// [`Engine::send_message_with`], and with `follow`, for a run that starts now, a subscription
    /// to its events made before they were published, for [`Engine::events_following`].
    pub async fn send_message_following(
        &self,
        user_id: &str,
        conversation_id: &ConversationId,
        message: SendMessage,
        strategy: MultitaskStrategy,
        follow: bool,
    ) -> EngineResult<(StartedRun, Option<Following>)> {
        let rollback = match strategy {
            MultitaskStrategy::Reject => {
                return self.start_message(user_id, conversation_id, message, false, follow).await;
            }
            MultitaskStrategy::Enqueue => {
                return self.start_message(user_id, conversation_id, message, true, follow).await;
            }
            MultitaskStrategy::Interrupt => false,
            MultitaskStrategy::Rollback => true,
        };
        if rollback {
            // A rollback an earlier try left undone (its process stopped after the cancel) is
            // finished first, so the thread reads clean.
            self.inner.finish_rollbacks().await?;
        }
        // Another message may start a run between the clearing and the start: a few tries.
        for _ in 0..3 {
            match self.start_message(user_id, conversation_id, message.clone(), false, follow).await {
                Err(EngineError::RunActive(_)) => {}
                other => return other,
            }
            self.clear_conversation(conversation_id, rollback).await?;
        }
        self.start_message(user_id, conversation_id, message, false, follow).await
    }

    /// Cancels every run of the conversation that is not over, for a new message — the waiting ones
    /// first, so that none starts when the active one ends, then the active one — and waits until
    /// each has ended; with `rollback`, rolls each back.
    async fn clear_conversation(&self, conversation_id: &ConversationId, rollback: bool) -> EngineResult<()> {
        let store = &self.inner.store;
        let mut ended = Vec::new();
        for run in store.waiting_runs(conversation_id, WAITING_CLEARED).await? {
            self.interrupt_run(&run.id, "interrupted_by_new_message", rollback).await?;
            ended.push(run.id);
        }
        if let Some(active) = store.active_run(conversation_id).await? {
            self.interrupt_run(&active.id, "interrupted_by_new_message", rollback).await?;
            ended.push(active.id);
        }
        if rollback {
            for run_id in &ended {
                self.roll_back_ended(run_id).await?;
            }
        }
        Ok(())
    }

    /// Cancels `run_id` (with `reason`; with `roll_back`, the durable intent to roll it back) and waits
    /// until it has ended.
    async fn interrupt_run(&self, run_id: &RunId, reason: &str, roll_back: bool) -> EngineResult<()> {
        let run = self.inner.cancel(run_id, reason, roll_back).await?;
        if run.status.is_terminal() {
            return Ok(());
        }
        let events = self.events(run_id, run.last_sequence(), Until::Terminal, Known::Unknown);
        let drained = async {
            let mut events = std::pin::pin!(events);
            while let Some(e) = events.next().await {
                e?;
            }
            Ok::<_, StoreError>(())
        };
        match tokio::time::timeout(INTERRUPT_WAIT, drained).await {
            Ok(done) => Ok(done?),
            Err(_) => Err(EngineError::RunActive(run_id.clone())),
        }
    }

    /// Rolls back a run that has ended; one still going is `RunActive`.
    async fn roll_back_ended(&self, run_id: &RunId) -> EngineResult<RolledBack> {
        let rolled_back =
            self.inner.store.roll_back_run(run_id, self.inner.clock.now()).await.map_err(|e| match e {
                StoreError::Conflict(_) => EngineError::RunActive(run_id.clone()),
                other => other.into(),
            })?;
        tracing::info!(
            run_id = %run_id,
            messages = rolled_back.messages,
            events = rolled_back.events,
            summary = rolled_back.summary,
            "run rolled back"
        );
        Ok(rolled_back)
    }

    /// LangGraph's cancel with `action=rollback`: cancels the run as [`Engine::cancel`] does, waits
    /// until it has ended (at most a minute, else `RunActive`), then rolls it back: its messages
    /// and events are removed, its tool calls and interrupts kept (`rolled_back`).
    pub async fn roll_back(&self, user_id: &str, run_id: &RunId) -> EngineResult<RolledBack> {
        self.run(user_id, run_id).await?;
        self.interrupt_run(run_id, "cancelled_by_user", true).await?;
        self.roll_back_ended(run_id).await
    }

    // ---------------------------------------------------------------- runs

    /// What an answer to an interrupt of `user_id`'s run checks, in one read ([`RunStore::answer_view`]):
    /// the run, and the rest of the view; someone else's run is `NotFound`.
    pub(super) async fn answer_view(&self, user_id: &str, run_id: &RunId) -> EngineResult<(Run, AnswerView)> {
        let mut view = self.inner.store.answer_view(run_id, user_id).await?;
        match view.run.take() {
            Some(run) if run.user_id == user_id => Ok((run, view)),
            _ => Err(EngineError::NotFound("run")),
        }
    }

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
    /// [`Engine::run`]; `known` is what that read (or the write that started or resumed the run)
    /// said of it ([`Known::of`]), or [`Known::Unknown`].
    pub fn events(
        &self,
        run_id: &RunId,
        after: i64,
        until: Until,
        known: Known,
    ) -> impl Stream<Item = Result<Event, StoreError>> + Send + 'static {
        self.events_following(run_id, after, until, known, None)
    }

    /// A subscription to `run_id`'s events from now on, for [`Engine::events_following`]: make it
    /// before the write whose events a reader follows (a resume of the run).
    pub fn follow(&self, run_id: &RunId) -> Following {
        Following::new(self.inner.bus.as_ref(), run_id)
    }

    /// [`Engine::events`] from a subscription made before the write the reader follows
    /// ([`Engine::follow`], [`Engine::send_message_following`]): when it holds the event after
    /// `after`, the stream starts without reading the store. `None`: as [`Engine::events`].
    pub fn events_following(
        &self,
        run_id: &RunId,
        after: i64,
        until: Until,
        known: Known,
        following: Option<Following>,
    ) -> impl Stream<Item = Result<Event, StoreError>> + Send + 'static {
        run_events(
            self.inner.store.clone(),
            self.inner.bus.clone(),
            run_id.clone(),
            after,
            until,
            known,
            following,
            self.inner.idle.clone(),
            self.inner.config.metrics.clone(),
        )
    }

    /// Waits until the run pauses or ends; returns its events after `after` up to that point.
    pub async fn wait_settled(&self, run_id: &RunId, after: i64) -> EngineResult<Vec<Event>> {
        let mut events = Vec::new();
        let mut stream = std::pin::pin!(self.events(run_id, after, Until::PauseOrTerminal, Known::Unknown));
        while let Some(e) = stream.next().await {
            events.push(e?);
        }
        Ok(events)
    }

    /// Durable cancel: any instance sees it. A queued, paused or waiting run ends at once (a waiting
    /// one never runs: its message never joins the conversation); a running one at its worker's
    /// next step or model chunk, and a worker of this instance stops the tool calls it has in
    /// flight.
    pub async fn cancel(&self, user_id: &str, run_id: &RunId) -> EngineResult<Run> {
        self.run(user_id, run_id).await?;
        self.inner.cancel(run_id, "cancelled_by_user", false).await
    }

    /// The client streaming this run went away. The run goes on, unless its policy says cancel.
    pub async fn client_detached(&self, run_id: &RunId) -> EngineResult<()> {
        let Some(run) = self.inner.store.get_run(run_id).await? else { return Ok(()) };
        if run.cancel_on_disconnect && !run.status.is_terminal() {
            tracing::info!(run_id = %run_id, "client disconnected; cancelling as the run's policy says");
            self.inner.cancel(run_id, "client_disconnected", false).await?;
        }
        Ok(())
    }
}
