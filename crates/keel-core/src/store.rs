//! The storage contract.
//!
//! One trait, implemented by every backend and checked by one conformance suite. Every state change
//! and the events that announce it go through [`Store::commit`], one transaction each: the run row is
//! the fence (its lease owner or its status must be what the writer expects) and the sequence
//! counter (the store assigns event sequences inside the transaction, so they are contiguous).

use async_trait::async_trait;
use serde_json::Value;

use crate::domain::{
    ApiKey, Checkpoint, Conversation, Fact, Interrupt, InterruptStatus, Message, Run, RunStatus, StreamTicket, Summary,
    Timestamp, ToolCall, ToolCallState, User, UserRole,
};
use crate::event::{Event, EventKind};
use crate::ids::{CallId, ConversationId, InterruptId, MessageId, RunId};
use crate::mask::Masked;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0} not found")]
    NotFound(&'static str),
    /// The conversation already has a run that is not over: a queued, running or interrupted one, or
    /// messages waiting their turn (the id is the active run's, else the oldest waiting one's).
    #[error("conversation already has an active run {0}")]
    RunActive(RunId),
    /// A conditional write matched nothing: the writer lost its lease, or another request moved the
    /// row first. Nothing of the commit was applied.
    #[error("conflict: {0}")]
    Conflict(String),
    /// A duplicate key where one must be unique (an id reused).
    #[error("duplicate: {0}")]
    Duplicate(String),
    #[error("storage backend error: {0}")]
    Backend(String),
    /// The store has more writes waiting than it queues; this one was refused at once and nothing
    /// of it was written (the writes already accepted are unaffected). Retry shortly.
    #[error("the store is overloaded: too many writes are waiting")]
    Overloaded,
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Who may write a commit, checked against the run row inside the transaction.
#[derive(Debug, Clone, PartialEq)]
pub enum Fence {
    /// The run's worker: `lease_owner` must equal `owner`. A commit that moves the run's status
    /// renews the lease to `lease_until` (or releases it, for a paused or finished run); one that
    /// leaves the status as it is leaves the lease as it is, which the worker's renewer keeps.
    Lease { owner: String, lease_until: Timestamp },
    /// Take the lease of a run nobody works on: status must be one of `from`; the lease becomes
    /// `owner` until `lease_until`. Used by resume.
    Acquire { owner: String, from: Vec<RunStatus>, lease_until: Timestamp },
    /// A run nobody works on (queued or interrupted), changed by any request: status must be one of
    /// `from`. Used by cancel and interrupt expiry.
    Unowned { from: Vec<RunStatus> },
}

/// A status move; `from` is checked by the fence, so only `to` is given. Terminal and paused
/// statuses release the lease.
#[derive(Debug, Clone, PartialEq)]
pub struct RunChange {
    pub to: RunStatus,
    pub reason: Option<String>,
    /// Two moves written as one ([`Commit::then`]): the run passes through `via` on its way to
    /// `to`, so the store checks that its status may move to `via` (and `via` to `to`). A
    /// worker's first commit, which starts a queued run, joined with a later one that pauses or
    /// ends it.
    pub via: Option<RunStatus>,
}

impl RunChange {
    /// The status the run must be able to move to from where it is: `via`, or else `to`.
    pub fn first_move(&self) -> RunStatus {
        self.via.unwrap_or(self.to)
    }

    /// Whether the move is allowed from `status`: through `via`, when there is one.
    pub fn allowed_from(&self, status: RunStatus) -> bool {
        match self.via {
            Some(via) => status.can_transition_to(via) && via.can_transition_to(self.to),
            None => status.can_transition_to(self.to),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum ToolCallChange {
    Insert(ToolCall),
    /// Conditional on the current state being `from`.
    Update(ToolCallUpdate),
}

/// A tool call's move from one state to another, with what it sets on the way (`None`: unchanged).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallUpdate {
    pub id: CallId,
    pub from: ToolCallState,
    pub to: ToolCallState,
    /// Replaces the args (an approved edit).
    pub args: Option<Masked<Value>>,
    pub result: Option<Masked<Value>>,
    pub summary: Option<Masked<String>>,
    /// Attempts started, counting the one this move starts.
    pub attempts: Option<u32>,
    pub started_at: Option<Timestamp>,
    pub finished_at: Option<Timestamp>,
}

impl ToolCallUpdate {
    /// `from → to`, nothing else changed.
    pub fn new(id: &CallId, from: ToolCallState, to: ToolCallState) -> Self {
        Self {
            id: id.clone(),
            from,
            to,
            args: None,
            result: None,
            summary: None,
            attempts: None,
            started_at: None,
            finished_at: None,
        }
    }

    /// Joins `next`, a later move of the same call, into this one: one move from this one's `from`
    /// to `next`'s `to`, with `next`'s values over this one's — what the two leave one after the
    /// other. `false`, and nothing joined, when `next` is another call's or does not start where
    /// this one ends.
    pub fn then(&mut self, next: &ToolCallUpdate) -> bool {
        if next.id != self.id || next.from != self.to {
            return false;
        }
        self.to = next.to;
        self.args = next.args.clone().or_else(|| self.args.take());
        self.result = next.result.clone().or_else(|| self.result.take());
        self.summary = next.summary.clone().or_else(|| self.summary.take());
        self.attempts = next.attempts.or(self.attempts);
        self.started_at = next.started_at.or(self.started_at);
        self.finished_at = next.finished_at.or(self.finished_at);
        true
    }
}

impl ToolCallChange {
    pub fn transition(id: &CallId, from: ToolCallState, to: ToolCallState) -> Self {
        ToolCallChange::Update(ToolCallUpdate::new(id, from, to))
    }

    /// What the store makes of `calls` (a run's, in order, as they were before the commit) once
    /// this change is written: an insert adds its call at the end; an update moves a call that is
    /// in its `from` state and sets what it sets. For a writer that knows the calls it just
    /// changed and need not read them back.
    pub fn apply_to(&self, calls: &mut Vec<ToolCall>) {
        match self {
            ToolCallChange::Insert(call) => calls.push(call.clone()),
            ToolCallChange::Update(u) => {
                let Some(call) = calls.iter_mut().find(|c| c.id == u.id && c.state == u.from) else { return };
                call.state = u.to;
                if let Some(args) = &u.args {
                    call.args = args.clone();
                }
                if let Some(result) = &u.result {
                    call.result = Some(result.clone());
                }
                if let Some(summary) = &u.summary {
                    call.summary = Some(summary.clone());
                }
                if let Some(attempts) = u.attempts {
                    call.attempts = attempts;
                }
                if let Some(at) = u.started_at {
                    call.started_at = Some(at);
                }
                if let Some(at) = u.finished_at {
                    call.finished_at = Some(at);
                }
            }
        }
    }
}

/// Conditional on the interrupt being `pending` (and, for `resolved`, not past its expiry at `now`).
#[derive(Debug, Clone, PartialEq)]
pub struct InterruptChange {
    pub id: InterruptId,
    pub to: InterruptStatus,
    pub decision: Option<Masked<Value>>,
    pub note: Option<Masked<String>>,
    pub resolved_by: Option<String>,
}

/// Text the model streamed, appended to an assistant message of the run (created on first append).
#[derive(Debug, Clone, PartialEq)]
pub struct TextAppend {
    pub message_id: MessageId,
    pub text: String,
}

/// One transaction of a run's writer.
#[derive(Debug, Clone, PartialEq)]
pub struct Commit {
    pub run_id: RunId,
    pub fence: Fence,
    pub now: Timestamp,
    pub run: Option<RunChange>,
    pub checkpoint: Option<Checkpoint>,
    pub text: Vec<TextAppend>,
    /// Messages inserted whole (tool results).
    pub messages: Vec<Message>,
    /// Assistant messages of a model call that was cut off: deleted, so that the stored messages
    /// equal what a client renders after `text_discarded`.
    pub discard_messages: Vec<MessageId>,
    pub tool_calls: Vec<ToolCallChange>,
    pub new_interrupts: Vec<Interrupt>,
    pub interrupt_changes: Vec<InterruptChange>,
    /// Upserted into the run's conversation.
    pub facts: Vec<Fact>,
    pub summary: Option<Summary>,
    /// Sequenced in order after the run's last event.
    pub events: Vec<EventKind>,
    /// The answer of the request that made this commit, stored under its idempotency key in the
    /// same transaction: a crash can't separate the effect of a request from the answer a retry
    /// gets, and the key is taken by the request whose effect commits, not before.
    pub idempotency: Option<IdempotencyAnswer>,
}

/// Stores a request's answer under its idempotency key, `done`: a free key (never used, or expired
/// at the commit's `now`) is taken, a key this same request began ([`RunStore::idempotency_begin`]:
/// in flight, with the same `request_hash`) is completed; any other — an answer stored already —
/// refuses the whole commit with `Conflict`.
#[derive(Debug, Clone, PartialEq)]
pub struct IdempotencyAnswer {
    pub user_id: String,
    pub key: String,
    pub request_hash: String,
    pub status: u16,
    pub response: Value,
    pub expires_at: Timestamp,
}

impl Commit {
    pub fn new(run_id: RunId, fence: Fence, now: Timestamp) -> Self {
        Self {
            run_id,
            fence,
            now,
            run: None,
            checkpoint: None,
            text: Vec::new(),
            messages: Vec::new(),
            discard_messages: Vec::new(),
            tool_calls: Vec::new(),
            new_interrupts: Vec::new(),
            interrupt_changes: Vec::new(),
            facts: Vec::new(),
            summary: None,
            events: Vec::new(),
            idempotency: None,
        }
    }

    pub fn event(mut self, kind: EventKind) -> Self {
        self.events.push(kind);
        self
    }

    /// Whether `next` can be written in one transaction with this commit ([`Commit::then`]): the
    /// same run, and at most one of them moves its status — or this one starts the run (a move to
    /// `running`) and `next` moves it on from there, which the joined commit writes as one move
    /// through `running` ([`RunChange::via`]).
    pub fn joins(&self, next: &Commit) -> bool {
        self.run_id == next.run_id
            && match (&self.run, &next.run) {
                (None, _) | (_, None) => true,
                (Some(first), Some(second)) => {
                    first.via.is_none()
                        && first.to == RunStatus::Running
                        && second.via.is_none()
                        && RunStatus::Running.can_transition_to(second.to)
                }
            }
    }

    /// This commit and `next` as one, as if `next` were made right after this one: `next`'s events,
    /// text, rows and changes follow this one's; `next`'s status move, checkpoint, summary and time
    /// win where it has them; the fence is this one's (the first commit of a worker takes the
    /// lease), renewed to `next`'s lease time. Check [`Commit::joins`] first.
    pub fn then(mut self, next: Commit) -> Commit {
        debug_assert!(self.joins(&next), "commits that can't be joined");
        match (&mut self.fence, &next.fence) {
            (Fence::Lease { lease_until, .. }, Fence::Lease { lease_until: later, .. })
            | (Fence::Acquire { lease_until, .. }, Fence::Lease { lease_until: later, .. }) => *lease_until = *later,
            _ => {}
        }
        self.now = next.now;
        self.run = match (self.run, next.run) {
            (Some(first), Some(second)) => Some(RunChange { via: Some(first.to), ..second }),
            (first, second) => second.or(first),
        };
        self.checkpoint = next.checkpoint.or(self.checkpoint);
        self.text.extend(next.text);
        self.messages.extend(next.messages);
        self.discard_messages.extend(next.discard_messages);
        self.tool_calls.extend(next.tool_calls);
        self.new_interrupts.extend(next.new_interrupts);
        self.interrupt_changes.extend(next.interrupt_changes);
        self.facts.extend(next.facts);
        self.summary = next.summary.or(self.summary);
        self.events.extend(next.events);
        self.idempotency = next.idempotency.or(self.idempotency);
        self
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Committed {
    /// The events as written, with their sequences.
    pub events: Vec<Event>,
    /// The run's durable cancel flag, as of this commit: a worker checks it after every write.
    pub cancel_requested: bool,
    /// The commit ended the run and its conversation has runs waiting their turn (`enqueue`): the
    /// next one may start. A store that does not look says `true` whenever the run ended.
    pub waiting_behind: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NewRun {
    pub conversation_id: ConversationId,
    /// The conversation's agent, copied onto the run so its workers need not read the conversation.
    pub agent_id: String,
    pub user_id: String,
    pub content: Masked<String>,
    pub cancel_on_disconnect: bool,
    pub now: Timestamp,
    /// The run's first events (`run_started`, `graph_topology`), written with it when it starts at
    /// once.
    pub events: Vec<EventKind>,
    /// `Some`: a message that waits its turn (LangGraph's `enqueue`). While the conversation has a
    /// run that is not over (an active one, or others waiting already), the new run is created
    /// `waiting` behind them, with these first events (`run_waiting`), instead of being refused
    /// with `RunActive`; its message is kept on the run and joins the conversation when the run
    /// starts ([`RunStore::promote_waiting`]). With nothing ahead of it, it starts at once, as
    /// without.
    pub enqueue: Option<Vec<EventKind>>,
    /// `Some`: the run is created leased to the worker that will drive it at once (an instance
    /// with a free slot), so that no other instance's claim takes it before that worker's first
    /// commit. `None`: it is created `queued` with no lease, for whichever instance claims it first.
    /// A run created `waiting` has no lease either way.
    pub lease: Option<NewLease>,
}

/// What [`RunStore::answer_view`] reads.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AnswerView {
    pub run: Option<Run>,
    /// The run's interrupts, oldest first.
    pub interrupts: Vec<Interrupt>,
    /// The run's tool calls, in order, without their results (`result` is `None`): an answer
    /// acts on the calls it is asked about, which have none yet, and a finished call's result can
    /// be large.
    pub tool_calls: Vec<ToolCall>,
    /// The role stored for the user (`None`: none is).
    pub role: Option<UserRole>,
    /// The facts of the run's conversation: what a tool's result adds to, for its
    /// `facts_updated` (an interrupted run's conversation changes only by that run).
    pub facts: Vec<Fact>,
}

/// The lease a run gets when it is created or started ([`NewRun::lease`],
/// [`RunStore::promote_waiting`]): it stays `queued`, held by `owner` until `until`.
#[derive(Debug, Clone, PartialEq)]
pub struct NewLease {
    pub owner: String,
    pub until: Timestamp,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StartedRun {
    /// The user message; for a run created `waiting`, the message as it will be stored when the
    /// run starts (under this id), not yet in the conversation.
    pub message: Message,
    pub run: Run,
    pub events: Vec<Event>,
    /// The role of the run's user as the start read it, with the rows it wrote (`None`: not read,
    /// as by a promotion). The engine's first step classifies its tool calls with it where no call
    /// can run or be refused by it, as it does the role read with a step's context
    /// ([`Store::context_window_and_role`]).
    pub user_role: Option<Option<UserRole>>,
}

/// Which of the engine's periodic sweeps have work, from one read ([`RunStore::due_work`]). Each
/// flag is `true` exactly when the sweep's own read would find something at that instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DueWork {
    /// A pending interrupt past its expiry: [`RunStore::due_interrupts`].
    pub expired_interrupts: bool,
    /// A rollback left undone: [`RunStore::rollbacks_due`].
    pub rollbacks: bool,
    /// A waiting run whose turn came: [`RunStore::stranded_conversations`].
    pub stranded: bool,
    /// A run that needs a worker: what [`RunStore::claim_runs`] takes without `steal`.
    pub claimable: bool,
}

impl DueWork {
    /// Every sweep, as if each had work: what the engine runs when it cannot tell.
    pub const ALL: DueWork = DueWork { expired_interrupts: true, rollbacks: true, stranded: true, claimable: true };
}

/// What [`RunStore::roll_back_run`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RolledBack {
    /// The run's messages deleted (its user message, the assistant's text, its tool results).
    pub messages: u64,
    /// The run's events deleted.
    pub events: u64,
    /// The conversation's summary was deleted: it covered one of those messages.
    pub summary: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub enum IdempotencyBegin {
    /// The key is new: the caller does the work, then calls `idempotency_complete`.
    Started,
    /// Another request with this key is still being processed.
    InFlight,
    /// The key was used with the same request: this was its answer.
    Done { status: u16, response: Value },
    /// The key was used with a different request.
    Mismatch,
}

/// Runs and everything a run's writers change: leases, the commit, events, interrupts, tool calls,
/// and the idempotency keys of requests that act on runs.
#[async_trait]
pub trait RunStore: Send + Sync {
    /// Stores the user message, bumps the conversation's version and creates a `queued` run with its
    /// first events, in one transaction. `RunActive` (naming the active run, or the oldest waiting
    /// one) if the conversation has a run that is not over — unless [`NewRun::enqueue`] asks to
    /// wait: then the run is created `waiting` behind them, and nothing else is written.
    async fn start_run(&self, new: NewRun) -> StoreResult<StartedRun>;
    async fn get_run(&self, id: &RunId) -> StoreResult<Option<Run>>;
    /// The conversation's queued, running or interrupted run (at most one).
    async fn active_run(&self, conversation_id: &ConversationId) -> StoreResult<Option<Run>>;
    /// The conversation's `waiting` runs, oldest first (the order they start in), at most `limit`.
    async fn waiting_runs(&self, conversation_id: &ConversationId, limit: u32) -> StoreResult<Vec<Run>>;
    /// Starts the conversation's oldest `waiting` run when the conversation has no active run, in
    /// one transaction: `waiting → queued` (conditional, so of concurrent promoters one wins), its
    /// message stored (the conversation's version bumped, the run's checkpoint made from it) and
    /// `events` (`run_started`, `graph_topology`) appended after its `run_waiting`. `None` when there
    /// is nothing to start: no waiting run, an active run, or another promoter got there first.
    /// With `lease`, the started run is leased to the worker that will drive it, as
    /// [`NewRun::lease`] does.
    async fn promote_waiting(
        &self,
        conversation_id: &ConversationId,
        events: Vec<EventKind>,
        lease: Option<NewLease>,
        now: Timestamp,
    ) -> StoreResult<Option<StartedRun>>;
    /// Conversations (at most `limit`) that have a `waiting` run and no active one: runs whose turn
    /// came while nobody promoted them (a crash between a run's end and the promotion).
    async fn stranded_conversations(&self, limit: u32) -> StoreResult<Vec<ConversationId>>;
    /// Rolls back a finished run (`completed`, `failed` or `cancelled`), in one transaction, so that
    /// its conversation reads as if it never ran: its messages and events are deleted (the run
    /// records, as retention does, that it holds no event), the conversation's summary too when it
    /// covers one of those messages, its checkpoint is reset, and it becomes `rolled_back`. Its row,
    /// tool calls and interrupts stay: the audit of what it did. A run rolled back already: nothing
    /// more is removed. `Conflict` for a run that is not over; `NotFound` for none.
    async fn roll_back_run(&self, run_id: &RunId, now: Timestamp) -> StoreResult<RolledBack>;
    /// Claims up to `limit` runs that need a worker — `queued` or `running`, with no lease or an
    /// expired one (or any lease, when `steal`): a run created leased to its worker is not taken
    /// before that lease expires — for `owner` until `lease_until`; queued runs become running.
    /// Returns the claimed runs.
    async fn claim_runs(
        &self,
        owner: &str,
        now: Timestamp,
        lease_until: Timestamp,
        steal: bool,
        limit: u32,
    ) -> StoreResult<Vec<Run>>;
    /// Which of the periodic sweeps ([`RunStore::due_interrupts`], [`RunStore::rollbacks_due`],
    /// [`RunStore::stranded_conversations`], [`RunStore::claim_runs`] without `steal`) would find
    /// work at `now`, in one read: an idle instance's sweep is this read alone, and only the sweeps
    /// it names run. Writes nothing.
    async fn due_work(&self, now: Timestamp) -> StoreResult<DueWork>;
    /// Extends the lease; `false` if `owner` no longer holds it.
    async fn renew_lease(&self, run_id: &RunId, owner: &str, lease_until: Timestamp) -> StoreResult<bool>;
    /// Lets go of the lease without changing the status (graceful shutdown): another worker may
    /// continue the run from its checkpoint at once.
    async fn release_lease(&self, run_id: &RunId, owner: &str) -> StoreResult<()>;
    /// Sets the durable cancel flag of a run that is not over (an active or a waiting one), and with
    /// `roll_back` the intent to roll it back once it has ended (see [`RunStore::rollbacks_due`]), in
    /// one write; returns the run as it is now.
    async fn request_cancel(&self, run_id: &RunId, now: Timestamp, roll_back: bool) -> StoreResult<Run>;
    /// Runs (at most `limit`) cancelled with the intent to roll them back that have ended and are
    /// not rolled back yet ([`RunStore::roll_back_run`] clears the intent): what a crash between a
    /// rollback's cancel and the rollback leaves. One read of an index empty but for those.
    async fn rollbacks_due(&self, limit: u32) -> StoreResult<Vec<RunId>>;
    /// Hides a run that is over (`completed`, `failed`, `cancelled` or `rolled_back`) from the
    /// LangGraph API (`runs.delete`): sets its [`Run::hidden_at`] to `now`, in one conditional write.
    /// Nothing else changes — its row, events, tool calls and interrupts stay, the audit of what it
    /// did. `true` when this call hid it; `false` when it was hidden already (nothing written, the
    /// first `hidden_at` kept). `Conflict` for a run that is not over; `NotFound` for none.
    async fn hide_run(&self, run_id: &RunId, now: Timestamp) -> StoreResult<bool>;
    /// One transaction: see [`Commit`]. On any error nothing was written.
    async fn commit(&self, commit: Commit) -> StoreResult<Committed>;
    /// The runs of `user_id`, newest first (by creation, then id), at most `limit`; only those with
    /// `status` when given.
    async fn list_runs(&self, user_id: &str, status: Option<RunStatus>, limit: u32) -> StoreResult<Vec<Run>>;
    /// The last event sequence of each of these runs that exists (in no particular order): what
    /// one look for every idle event stream of a process reads. A backend answers it with one
    /// query; this default reads the runs one by one.
    async fn last_sequences(&self, ids: &[RunId]) -> StoreResult<Vec<(RunId, i64)>> {
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(run) = self.get_run(id).await? {
                out.push((run.id.clone(), run.last_sequence()));
            }
        }
        Ok(out)
    }

    /// Events with `sequence > after`, ascending, at most `limit`.
    async fn list_events(&self, run_id: &RunId, after: i64, limit: u32) -> StoreResult<Vec<Event>>;

    async fn get_interrupt(&self, id: &InterruptId) -> StoreResult<Option<Interrupt>>;
    async fn pending_interrupt(&self, run_id: &RunId) -> StoreResult<Option<Interrupt>>;
    /// Pending interrupts whose `expires_at <= now`.
    async fn due_interrupts(&self, now: Timestamp, limit: u32) -> StoreResult<Vec<Interrupt>>;
    /// Every interrupt of the run, whatever its status, oldest first.
    async fn list_interrupts(&self, run_id: &RunId) -> StoreResult<Vec<Interrupt>>;

    async fn list_tool_calls(&self, run_id: &RunId) -> StoreResult<Vec<ToolCall>>;
    /// What an answer to one of the run's interrupts (a resume, a client tool's result) checks
    /// before its claim, read at once — one statement on PostgreSQL, one read on SQLite: the run,
    /// its interrupts (oldest first), its tool calls (in order), and the stored role of the user
    /// who answers. A run that does not exist: `run` is `None` and the rest empty.
    async fn answer_view(&self, run_id: &RunId, user_id: &str) -> StoreResult<AnswerView>;
    /// Every call of every run of the conversation, in the order they were requested, but those of
    /// rolled-back runs (no longer part of the conversation; [`RunStore::list_tool_calls`] of the run
    /// still has them).
    async fn list_conversation_tool_calls(&self, conversation_id: &ConversationId) -> StoreResult<Vec<ToolCall>>;
    /// Calls of the tool `name` waiting for a human (`asking`), over every run: what a tool looks at
    /// to leave out the resources another run is about to act on.
    async fn asking_calls(&self, name: &str) -> StoreResult<Vec<ToolCall>>;

    // idempotency keys (scoped per user)
    async fn idempotency_begin(
        &self,
        user_id: &str,
        key: &str,
        request_hash: &str,
        now: Timestamp,
        expires_at: Timestamp,
    ) -> StoreResult<IdempotencyBegin>;
    /// What the key holds for the request `request_hash`, read only: its answer (`Done`), another
    /// request's (`Mismatch`), a request begun and not answered (`InFlight`), or `None` when the
    /// key is free (never used, or expired at `now`). Never `Started`.
    async fn idempotency_find(
        &self,
        user_id: &str,
        key: &str,
        request_hash: &str,
        now: Timestamp,
    ) -> StoreResult<Option<IdempotencyBegin>>;
    async fn idempotency_complete(&self, user_id: &str, key: &str, status: u16, response: &Value) -> StoreResult<()>;
    /// Forgets an in-flight key whose request failed before it had an answer, so a retry can proceed.
    async fn idempotency_abandon(&self, user_id: &str, key: &str) -> StoreResult<()>;
    /// Forgets every in-flight key (their requests died with a previous process). Only for a store
    /// one process opens, at start-up; shared stores let in-flight keys expire instead.
    async fn abandon_all_in_flight_keys(&self) -> StoreResult<u64>;

    // retention (docs/operations.md, "Retention")
    /// Deletes the events of finished runs (`completed`, `failed`, `cancelled`) that `rule` covers,
    /// the runs that finished first first, at most `max_events` rows in one transaction, and records
    /// per run the first sequence it still holds. Never touches a queued, running or interrupted
    /// run, nor messages, runs, tool calls or interrupts. With `dry_run`, deletes nothing and counts
    /// everything the rule covers (no bound).
    async fn prune_events(&self, rule: &PruneRule, max_events: u32, dry_run: bool) -> StoreResult<Pruned>;
    /// The first event sequence the run still holds, once retention pruned any of its events (the
    /// run's next sequence when all are gone); `None` while it holds all of them.
    async fn first_held_sequence(&self, run_id: &RunId) -> StoreResult<Option<i64>>;
    /// Every run of the conversation, oldest first (exports).
    async fn list_conversation_runs(&self, conversation_id: &ConversationId) -> StoreResult<Vec<Run>>;
    /// The conversation's newest runs, newest first (by creation, then id), at most `limit`: a
    /// bounded read, by the index on the conversation's runs, whatever the conversation's length.
    async fn newest_conversation_runs(&self, conversation_id: &ConversationId, limit: u32) -> StoreResult<Vec<Run>>;
}

/// Which finished runs a retention rule covers: those whose last change (their end) came before
/// `finished_before` (and, when given, at or after `finished_after`), of the agent `agent` or, when
/// `None`, of any agent but those of `except_agents` (the agents with a rule of their own). Runs
/// made before agents (no agent) follow the rule without an agent.
#[derive(Debug, Clone, PartialEq)]
pub struct PruneRule {
    pub finished_before: Timestamp,
    /// A lower bound a pruner that already emptied the earlier runs passes, so that its scan does
    /// not walk them again at every pass.
    pub finished_after: Option<Timestamp>,
    pub agent: Option<String>,
    pub except_agents: Vec<String>,
}

/// What a prune deleted (or, dry, would delete).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Runs that lost events.
    pub runs: u64,
    /// Event rows.
    pub events: u64,
}

impl std::ops::AddAssign for Pruned {
    fn add_assign(&mut self, other: Self) {
        self.runs += other.runs;
        self.events += other.events;
    }
}

/// Conversations and what their context is made of: messages, facts, the summary.
#[async_trait]
pub trait ConversationStore: Send + Sync {
    /// A conversation of `user_id` with `agent_id` (which the engine checked exists).
    async fn create_conversation(
        &self,
        user_id: &str,
        title: &Masked<String>,
        agent_id: &str,
        now: Timestamp,
    ) -> StoreResult<Conversation>;
    async fn get_conversation(&self, id: &ConversationId) -> StoreResult<Option<Conversation>>;
    /// Newest first.
    async fn list_conversations(&self, user_id: &str, limit: u32) -> StoreResult<Vec<Conversation>>;
    /// In the order they were written. The whole history: for exports and tests, not a hot path.
    async fn list_messages(&self, conversation_id: &ConversationId) -> StoreResult<Vec<Message>>;
    /// The last `limit` messages that are not tool results, in the order they were written: what
    /// a conversation's view shows. One indexed read, whatever the conversation's length.
    async fn recent_messages(&self, conversation_id: &ConversationId, limit: u32) -> StoreResult<Vec<Message>>;
    /// The messages of one run, in the order they were written.
    async fn list_run_messages(&self, run_id: &RunId) -> StoreResult<Vec<Message>>;
    /// The conversation as it stood once `run_id` wrote its last message: see [`MessagesThrough`].
    /// Empty for a run that wrote none (or another conversation's). One bounded read, by the
    /// `run_id` and `(conversation_id, seq)` indexes, whatever the conversation's length.
    async fn messages_through_run(
        &self,
        conversation_id: &ConversationId,
        run_id: &RunId,
        limit: u32,
    ) -> StoreResult<MessagesThrough>;
    /// What a step's context is made of: see [`ContextWindow`].
    async fn context_window(&self, conversation_id: &ConversationId) -> StoreResult<ContextWindow>;
    async fn list_facts(&self, conversation_id: &ConversationId) -> StoreResult<Vec<Fact>>;
    async fn get_summary(&self, conversation_id: &ConversationId) -> StoreResult<Option<Summary>>;
    /// Conversations, oldest first, of `user_id` when given, and with a run that changed at or after
    /// `since` when given (audit exports).
    async fn find_conversations(
        &self,
        user_id: Option<&str>,
        since: Option<Timestamp>,
    ) -> StoreResult<Vec<Conversation>>;
}

/// What one step's context is assembled from, read in bounded work rather than in proportion to
/// the conversation's length: the stored summary, the messages after the last one it covers (every
/// message while there is none), the calls that those messages' tool results answer, and the facts.
///
/// The window stays small because the context plan keeps it so: while there is no summary the
/// whole history fits the budget (the step that would exceed it writes the first summary), and
/// after that every step that finds the turns past the summary over budget extends the summary
/// over all but the most recent of them. So a step reads about one budget of messages, whether the
/// conversation has ten turns or ten thousand.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ContextWindow {
    pub summary: Option<Summary>,
    /// In the order they were written.
    pub messages: Vec<Message>,
    /// In the order they were requested; without their results (`result` is `None`): the context
    /// gives the model each result as its tool message, and a result, which can be large, is not
    /// read and parsed again at every step.
    pub tool_calls: Vec<ToolCall>,
    /// By key.
    pub facts: Vec<Fact>,
}

/// What [`ConversationStore::messages_through_run`] reads: the newest `limit` messages of the
/// conversation up to and including a run's last one, and the calls their tool results answer —
/// a thread's state after that run (LangGraph's history).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MessagesThrough {
    /// Newest first.
    pub messages: Vec<Message>,
    /// In the order they were requested.
    pub tool_calls: Vec<ToolCall>,
}

/// Users, their API keys and stream tickets (only hashes of secrets are stored).
#[async_trait]
pub trait IdentityStore: Send + Sync {
    async fn user_role(&self, user_id: &str) -> StoreResult<Option<UserRole>>;
    async fn set_user_role(&self, user_id: &str, role: UserRole) -> StoreResult<()>;
    /// Every user, by id.
    async fn list_users(&self) -> StoreResult<Vec<User>>;
    /// Stores a key for an existing user (`NotFound("user")` otherwise); `Duplicate` if the hash or
    /// id is taken.
    async fn insert_api_key(&self, key: &ApiKey) -> StoreResult<()>;
    /// The user holding the key with this hash, unless the key is revoked.
    async fn api_key_user(&self, key_hash: &str) -> StoreResult<Option<String>>;
    /// Keys that are not revoked, over all users.
    async fn count_active_api_keys(&self) -> StoreResult<u64>;
    /// Revokes every key of the user; returns how many were active.
    async fn revoke_api_keys(&self, user_id: &str, now: Timestamp) -> StoreResult<u64>;
    /// Stores a ticket, and forgets tickets that expired more than an hour before `now`.
    async fn insert_stream_ticket(&self, ticket: &StreamTicket, now: Timestamp) -> StoreResult<()>;
    /// Uses a ticket: `Some` exactly once, for an unexpired ticket with this hash; `None` for one that
    /// is unknown, used or expired. One conditional update, so two concurrent uses can't both win.
    async fn redeem_stream_ticket(&self, ticket_hash: &str, now: Timestamp) -> StoreResult<Option<StreamTicket>>;
}

/// Ids that clients choose, bound to Keel's: an AG-UI `threadId` to a conversation, a client's
/// message id to the message stored for it. The protocol layers own their namespaces
/// (`ag_ui.thread`, …); `scope` is what an id is unique within (a user, a conversation).
#[async_trait]
pub trait BindingStore: Send + Sync {
    /// What `external_id` is bound to in `namespace` and `scope`.
    async fn binding(&self, namespace: &str, scope: &str, external_id: &str) -> StoreResult<Option<String>>;
    /// Binds `external_id` to `value` unless it is bound already; returns the value it is bound to
    /// now (the first binding wins a race).
    async fn bind(
        &self,
        namespace: &str,
        scope: &str,
        external_id: &str,
        value: &str,
        now: Timestamp,
    ) -> StoreResult<String>;
}

/// Everything a backend stores, each concern behind its own trait: a component takes the one it
/// needs (`Arc<dyn RunStore>`, …), the backend implements them all.
#[async_trait]
pub trait Store: RunStore + ConversationStore + IdentityStore + BindingStore + 'static {
    /// The store answers (readiness).
    async fn ping(&self) -> StoreResult<()>;
    /// The database's clock. Instances sharing a database take lease and expiry times from it
    /// (through [`crate::clock::StoreClock`]), so a skewed instance clock can't steal live leases.
    async fn db_now(&self) -> StoreResult<Timestamp>;
    /// [`ConversationStore::context_window`] and [`IdentityStore::user_role`] of `user_id`, read
    /// together: a step that may have to classify tool calls reads the role with its context
    /// (the backends do it in one statement or one read transaction; this default reads both).
    async fn context_window_and_role(
        &self,
        conversation_id: &ConversationId,
        user_id: &str,
    ) -> StoreResult<(ContextWindow, Option<UserRole>)> {
        Ok((self.context_window(conversation_id).await?, self.user_role(user_id).await?))
    }
}

/// Every store trait, for code that calls a concrete backend's methods (`use
/// keel_core::store::prelude::*;`).
pub mod prelude {
    pub use super::{BindingStore, ConversationStore, IdentityStore, RunStore, Store};
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Checkpoint, NextStep};

    fn at(secs: i64) -> Timestamp {
        chrono::DateTime::from_timestamp(secs, 0).unwrap()
    }

    #[test]
    fn two_moves_of_a_call_join_as_one_from_the_first_state_to_the_last() {
        let id = CallId::new();
        let mut first = ToolCallUpdate {
            summary: Some("asked".into()),
            ..ToolCallUpdate::new(&id, ToolCallState::Asking, ToolCallState::Allowed)
        };
        let second = ToolCallUpdate {
            attempts: Some(1),
            started_at: Some(at(5)),
            ..ToolCallUpdate::new(&id, ToolCallState::Allowed, ToolCallState::Executing)
        };
        assert!(first.then(&second));
        assert_eq!((first.from, first.to), (ToolCallState::Asking, ToolCallState::Executing));
        assert_eq!(first.summary.as_ref().map(|s| s.as_str()), Some("asked"), "kept where the later move sets nothing");
        assert_eq!((first.attempts, first.started_at), (Some(1), Some(at(5))));
        // not from where it ends, or another call's: nothing joined
        let before = first.clone();
        assert!(!first.then(&ToolCallUpdate::new(&id, ToolCallState::Allowed, ToolCallState::Failed)));
        assert!(!first.then(&ToolCallUpdate::new(&CallId::new(), ToolCallState::Executing, ToolCallState::Failed)));
        assert_eq!(first, before);
    }

    #[test]
    fn a_change_applied_to_calls_is_what_the_store_makes_of_them() {
        let run = RunId::new();
        let call = |name: &str, state| ToolCall {
            id: CallId::new(),
            run_id: run.clone(),
            name: name.into(),
            args: Masked::new(serde_json::json!({"n": 1})),
            state,
            result: None,
            summary: None,
            attempts: 0,
            started_at: None,
            finished_at: None,
        };
        let (approved, rejected, settled) = (
            call("restart", ToolCallState::Asking),
            call("delete", ToolCallState::Asking),
            call("lookup", ToolCallState::Succeeded),
        );
        let mut calls = vec![approved.clone(), rejected.clone(), settled.clone()];
        let edited = Masked::new(serde_json::json!({"n": 2}));
        ToolCallChange::Update(ToolCallUpdate {
            args: Some(edited.clone()),
            ..ToolCallUpdate::new(&approved.id, ToolCallState::Asking, ToolCallState::Allowed)
        })
        .apply_to(&mut calls);
        ToolCallChange::Update(ToolCallUpdate {
            result: Some(Masked::new(serde_json::json!({"status": "denied"}))),
            summary: Some(Masked::from("rejected".to_owned())),
            finished_at: Some(at(5)),
            ..ToolCallUpdate::new(&rejected.id, ToolCallState::Asking, ToolCallState::Denied)
        })
        .apply_to(&mut calls);
        // conditional, as in the store: a call not in `from` is left as it is
        ToolCallChange::transition(&settled.id, ToolCallState::Asking, ToolCallState::Allowed).apply_to(&mut calls);
        let added = call("notify", ToolCallState::Requested);
        ToolCallChange::Insert(added.clone()).apply_to(&mut calls);

        assert_eq!(calls.len(), 4);
        assert_eq!((calls[0].state, &calls[0].args), (ToolCallState::Allowed, &edited));
        assert_eq!(calls[0].result, None, "what an update does not set stays");
        assert_eq!((calls[1].state, calls[1].finished_at), (ToolCallState::Denied, Some(at(5))));
        assert_eq!(calls[1].summary.as_ref().map(|s| s.as_str()), Some("rejected"));
        assert_eq!(calls[2], settled);
        assert_eq!(calls[3], added);
    }

    #[test]
    fn a_joined_commit_is_the_first_then_the_second() {
        let run = RunId::new();
        let acquire = Fence::Acquire { owner: "w".into(), from: vec![RunStatus::Queued], lease_until: at(10) };
        let mut first =
            Commit::new(run.clone(), acquire, at(1)).event(EventKind::NodeStarted { node: "context".into() });
        first.run = Some(RunChange { to: RunStatus::Running, reason: None, via: None });
        first.checkpoint = Some(Checkpoint::start(1));
        let mut second = Commit::new(run.clone(), Fence::Lease { owner: "w".into(), lease_until: at(20) }, at(2))
            .event(EventKind::NodeStarted { node: "model".into() });
        let mut cp = Checkpoint::start(1);
        cp.next_step = NextStep::Finalize;
        second.checkpoint = Some(cp.clone());
        assert!(first.joins(&second));

        let joined = first.then(second);
        // the first takes the lease, renewed to the second's time; the second's state wins
        assert!(matches!(joined.fence, Fence::Acquire { lease_until, .. } if lease_until == at(20)));
        assert_eq!(joined.now, at(2));
        assert_eq!(joined.run.as_ref().map(|c| c.to), Some(RunStatus::Running));
        assert_eq!(joined.checkpoint, Some(cp));
        let nodes: Vec<_> = joined
            .events
            .iter()
            .map(|e| match e {
                EventKind::NodeStarted { node } => node.as_str(),
                _ => "other",
            })
            .collect();
        assert_eq!(nodes, ["context", "model"]);
    }

    #[test]
    fn a_start_joined_with_a_pause_moves_through_running() {
        let lease = || Fence::Lease { owner: "w".into(), lease_until: at(10) };
        let run = RunId::new();
        let mut start = Commit::new(run.clone(), lease(), at(1));
        start.run = Some(RunChange { to: RunStatus::Running, reason: None, via: None });
        let mut pause = Commit::new(run.clone(), lease(), at(2));
        pause.run = Some(RunChange { to: RunStatus::Interrupted, reason: None, via: None });
        assert!(start.joins(&pause));
        let joined = start.then(pause);
        let change = joined.run.expect("a status move");
        assert_eq!((change.via, change.to), (Some(RunStatus::Running), RunStatus::Interrupted));
        assert_eq!(change.first_move(), RunStatus::Running);
        assert!(change.allowed_from(RunStatus::Queued));
        // the run may not enter `running` from where it is: the move is refused
        assert!(!change.allowed_from(RunStatus::Completed));
        assert!(!change.allowed_from(RunStatus::Running));
    }

    #[test]
    fn two_status_moves_or_two_runs_do_not_join() {
        let lease = || Fence::Lease { owner: "w".into(), lease_until: at(10) };
        let run = RunId::new();
        let moving = |to| {
            let mut c = Commit::new(run.clone(), lease(), at(1));
            c.run = Some(RunChange { to, reason: None, via: None });
            c
        };
        // only a start (a move to running) is joined with the move after it
        assert!(!moving(RunStatus::Interrupted).joins(&moving(RunStatus::Running)));
        assert!(!moving(RunStatus::Cancelled).joins(&moving(RunStatus::Completed)));
        // and only with a move running may make
        assert!(!moving(RunStatus::Running).joins(&moving(RunStatus::Running)));
        assert!(!moving(RunStatus::Running).joins(&moving(RunStatus::Queued)));
        // two joined moves are not joined with a third
        let twice = moving(RunStatus::Running).then(moving(RunStatus::Interrupted));
        assert!(!twice.joins(&moving(RunStatus::Running)));
        assert!(!Commit::new(run.clone(), lease(), at(1)).joins(&Commit::new(RunId::new(), lease(), at(2))));
    }
}
