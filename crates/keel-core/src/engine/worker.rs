//! One run's worker: it holds the run's lease and drives it step by step from its checkpoint.

use super::*;

/// What the write that started a worker knows that the worker would otherwise read first.
#[derive(Debug, Default)]
pub(super) struct Primed {
    /// The run's tool calls as that write left them (a resume's claim).
    pub(super) calls: Option<Vec<ToolCall>>,
    /// The role of the run's user, read by that request just before (a resume by the run's own
    /// user): for the worker's first step, as fresh as its own read would be.
    pub(super) role: Option<Option<UserRole>>,
    /// The facts of the run's conversation, read by that request just before, with that write's:
    /// the worker's own writes are the only other change they can see ([`Worker::known_facts`]).
    pub(super) facts: Option<FactMap>,
    /// An answer to an interrupt not written yet: the worker writes it with its first step
    /// ([`Claim`]).
    pub(super) claim: Option<Claim>,
    /// The context of the worker's first model call, known without a read ([`Primed::first_run`]),
    /// and the role of the run's user if the start read it ([`StartedRun::user_role`]).
    pub(super) window: Option<(crate::store::ContextWindow, Option<Option<UserRole>>)>,
}

/// An answer to an interrupt (a decision, a client's result) that the request hands to the worker
/// that continues the run instead of writing it itself: the answer's conditional commit (fenced on
/// the run being `interrupted`) is held, as the worker's first commit is, and written with the
/// worker's next one — the claim of the call the decision allows (`executing`, after its
/// precheck), or the step's end — in one transaction instead of two. Until then nothing of it is
/// written or announced, and no side effect has happened: the worker makes none before that
/// transaction commits. Its outcome goes back to the request: the commit as written, or why the
/// store refused it (another tab's answer came first: the worker stops, and touches nothing).
#[derive(Debug)]
pub(super) struct Claim {
    pub(super) commit: Commit,
    pub(super) answer: tokio::sync::oneshot::Sender<Result<Committed, StoreError>>,
}

impl Primed {
    /// After an answer to an interrupt of `run` by `user_id` (whose role is `role`), committed as
    /// `commit`, with the run's calls as they were before it: the calls as the commit leaves them,
    /// and the role when the one who answered is the run's user.
    pub(super) fn after(
        commit: &Commit,
        view: (&[ToolCall], &[Fact]),
        run: &Run,
        user_id: &str,
        role: Option<UserRole>,
    ) -> Self {
        let (calls, facts) = view;
        let mut calls = calls.to_vec();
        for change in &commit.tool_calls {
            change.apply_to(&mut calls);
        }
        let mut facts = crate::domain::fact_map(facts);
        facts.extend(crate::domain::fact_map(&commit.facts));
        Primed {
            calls: Some(calls),
            role: (user_id == run.user_id).then_some(role),
            facts: Some(facts),
            claim: None,
            window: None,
        }
    }

    /// For a run its request just started: when it is its conversation's first (the start made
    /// the conversation's version 1), the conversation holds nothing but the message that started
    /// it — messages, facts and summaries are written only by runs, and every run's start, enqueue
    /// or promotion raises the version first — so that message is the first step's whole context,
    /// and the conversation has no facts. (The store says the same when asked: conformance case
    /// `a_first_runs_context_is_its_message`.) Any other run reads its context.
    pub(super) fn first_run(started: &StartedRun) -> Self {
        if started.run.checkpoint.conversation_version != 1 {
            return Self::default();
        }
        let window = crate::store::ContextWindow { messages: vec![started.message.clone()], ..Default::default() };
        Primed { facts: Some(FactMap::default()), window: Some((window, started.user_role)), ..Self::default() }
    }
}

/// `run` (a writer's view of it) as `commit` leaves it: its checkpoint and status.
pub(super) fn adopt(run: &mut Run, commit: &Commit) {
    if let Some(cp) = &commit.checkpoint {
        run.checkpoint = cp.clone();
    }
    if let Some(change) = &commit.run {
        run.status = change.to;
    }
}

/// Why a worker stopped.
#[derive(Debug)]
pub(super) enum Stop {
    /// The run paused or ended.
    Settled,
    /// Someone else holds the run now (or got it first): not ours to touch.
    NotOurs,
    /// Graceful shutdown: the run stays `running` and is continued by the next process.
    Shutdown,
}

#[derive(Debug, thiserror::Error)]
pub(super) enum WorkerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("model: {0}")]
    Model(ModelError),
    #[error("{0}")]
    Limit(String),
    #[error("the run's agent is not one this server runs")]
    UnknownAgent,
}

/// How long a worker keeps trying a commit the store refused as overloaded before the run fails.
const OVERLOAD_PATIENCE: Duration = Duration::from_secs(30);

/// One run's worker: its lease token and what it knows of the run.
pub(super) struct Worker {
    pub(super) inner: Arc<Inner>,
    /// The run's agent: its model, tools and context settings.
    pub(super) agent: Arc<Agent>,
    /// The run names an agent this process does not run: it fails at once.
    pub(super) agent_missing: bool,
    pub(super) run: Run,
    /// The lease the worker holds: taken before it started (written with a new or promoted run, by
    /// a claim, by a resume), kept alive by its renewer (and renewed by a commit that moves the
    /// run's status).
    pub(super) owner: String,
    pub(super) cancel_signal: Arc<tokio::sync::Notify>,
    /// Events, and text, that go at the front of the worker's next commit. Only for what needs no
    /// commit of its own because the next one follows at once, with no wait (no model or tool call)
    /// in between: a node starting, the last deltas of a model call. A worker that stops before its
    /// next commit loses only announcements of work that another worker does again.
    pub(super) deferred: Vec<EventKind>,
    pub(super) deferred_text: Vec<TextAppend>,
    /// A whole commit held back to be written with the worker's next one ([`Worker::hold`]).
    pub(super) held: Option<Commit>,
    /// The held commit is the worker's first: a refusal means another worker (or a cancel) got the
    /// run first, not that a lease this worker had was lost.
    pub(super) held_first: bool,
    /// The tool calls a held model commit inserts, for the tools step that follows (it can't read
    /// them back from the store before they are written).
    pub(super) planned_calls: Option<Vec<ToolCall>>,
    /// The run's user's role, read just before the worker started ([`Primed::role`]): serves its
    /// first step only.
    pub(super) primed_role: Option<Option<UserRole>>,
    /// The run's user's role as read with the last step's context, before its model call: serves
    /// the tools step that follows only where it cannot let anything happen
    /// ([`Worker::execute_tools`]).
    pub(super) context_role: Option<Option<UserRole>>,
    /// The facts of the run's conversation as the worker last read them ([`Primed::facts`], the
    /// context window) with its own writes since: no other run writes them while this one is
    /// active, so a tool's `facts_updated` is made from them without a read.
    pub(super) known_facts: Option<FactMap>,
    /// The context of the first model call, known without a read, and the role read with the
    /// run's start ([`Primed::window`]).
    pub(super) primed_window: Option<(crate::store::ContextWindow, Option<Option<UserRole>>)>,
    /// Where the outcome of the held answer's commit goes ([`Claim`]), until it is written.
    pub(super) claim_answer: Option<tokio::sync::oneshot::Sender<Result<Committed, StoreError>>>,
    /// The held answer's commit was refused: the run was never this worker's.
    pub(super) claim_refused: bool,
    /// Keeps the lease alive; started once the worker holds the lease (at once, or when the held
    /// answer that takes it is written).
    pub(super) renewer: Option<tokio::task::JoinHandle<()>>,
}

impl Worker {
    pub(super) fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    pub(super) fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    pub(super) fn new_commit(&mut self) -> Commit {
        let now = self.now();
        let lease_until = now + chrono_dur(self.inner.config.lease_ttl);
        let fence = Fence::Lease { owner: self.owner.clone(), lease_until };
        let mut commit = Commit::new(self.run.id.clone(), fence, now);
        commit.events = std::mem::take(&mut self.deferred);
        commit.text = std::mem::take(&mut self.deferred_text);
        commit
    }

    /// Keeps `commit` to be written with the worker's next commit, in one transaction, and makes
    /// the worker's view of the run what it will be once written.
    ///
    /// Only for a commit whose next one follows with no wait on anything outside — no tool call,
    /// no sleep — in between, only reads that do not depend on it: the worker's first commit (a
    /// read of the context comes next), a model call's end (the tools step's first commit, or the
    /// run's end, comes next), and the tools step's end (a read of the context, then the model
    /// call's start). The waits allowed are a model call's first moments — its start is held
    /// until the call's first text or its end, and at most `delta_flush_interval`
    /// ([`Worker::stream_model`]) — and a read-only tool call's: the attempt's claim is held until
    /// the call's result, and at most as long (`run_calls`). Neither acts on anything, so a crash
    /// before the commit costs the call, made again. Until then nothing of it is announced, and a
    /// crash loses only work the next worker does again from the same checkpoint: it costs no more
    /// than the reads in between, and saves a transaction, and its WAL pages and flush, per step.
    /// A commit held already is joined with this one ([`Commit::joins`]), or written first.
    pub(super) async fn hold(&mut self, commit: Commit) -> Result<(), StoreError> {
        let commit = self.behind_held(commit).await?;
        adopt(&mut self.run, &commit);
        self.held = Some(commit);
        Ok(())
    }

    /// Writes the held commit, if there is one, on its own: before a wait.
    pub(super) async fn flush_held(&mut self) -> Result<(), StoreError> {
        match self.held.take() {
            Some(held) => self.commit_now(held).await.map(|_| ()),
            None => Ok(()),
        }
    }

    /// Waits for `wait` (a model call's start, read-only tool calls) with the held commit, if any,
    /// kept back for at most `until`, then written on its own while `wait` goes on.
    pub(super) async fn await_holding<T>(
        &mut self,
        wait: impl std::future::Future<Output = T>,
        until: Option<tokio::time::Instant>,
    ) -> Result<T, StoreError> {
        let Some(until) = until.filter(|_| self.held.is_some()) else {
            return Ok(wait.await);
        };
        let mut wait = std::pin::pin!(wait);
        tokio::select! {
            biased;
            done = &mut wait => Ok(done),
            _ = tokio::time::sleep_until(until) => {
                self.flush_held().await?;
                Ok(wait.await)
            }
        }
    }

    /// Commits (with the held commit, if any, in front: one transaction when they can be joined),
    /// publishes, and keeps the worker's view of the run current.
    pub(super) async fn commit(&mut self, commit: Commit) -> Result<Committed, StoreError> {
        let commit = self.behind_held(commit).await?;
        self.commit_now(commit).await
    }

    /// `commit` with the held commit, if any, in front of it; or, when the two can't be joined,
    /// `commit` alone, once the held one is written.
    async fn behind_held(&mut self, commit: Commit) -> Result<Commit, StoreError> {
        match self.held.take() {
            Some(held) if held.joins(&commit) => Ok(held.then(commit)),
            Some(held) => {
                self.commit_now(held).await?;
                Ok(commit)
            }
            None => Ok(commit),
        }
    }

    /// Commits, waiting out an overloaded store: a write it refused as `Overloaded` was not
    /// written at all, so the same commit is sent again after a pause (doubling, up to
    /// [`OVERLOAD_PATIENCE`] in all) instead of failing the run.
    ///
    /// Boxed: its state (the commit, the copy the store takes, the pause's timer) would otherwise
    /// sit inside the future of every step that commits, and be copied with it (see `drive`).
    fn commit_now(&mut self, commit: Commit) -> BoxFuture<'_, Result<Committed, StoreError>> {
        Box::pin(self.write_commit(commit))
    }

    async fn write_commit(&mut self, commit: Commit) -> Result<Committed, StoreError> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(10);
        let written = loop {
            match self.store().commit(commit.clone()).await {
                Err(StoreError::Overloaded) if started.elapsed() + pause < OVERLOAD_PATIENCE => {
                    tracing::debug!(run_id = %self.run.id, pause_ms = pause.as_millis() as u64, "the store is overloaded; committing again shortly");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                other => break other,
            }
        };
        // The held answer to an interrupt was in this commit: its request learns the outcome,
        // once the events are announced.
        let answer = self.claim_answer.take();
        let committed = match (written, answer) {
            (Ok(committed), answer) => {
                self.inner.committed_by(&self.run, &committed);
                if let Some(answer) = answer {
                    let _ = answer.send(Ok(committed.clone()));
                    self.renewer = Some(self.inner.spawn_lease_renewer(self.run.id.clone(), self.owner.clone()));
                }
                committed
            }
            (Err(e), None) => return Err(e),
            (Err(e), Some(answer)) => {
                self.claim_refused = true;
                let _ = answer.send(Err(e));
                return Err(StoreError::Conflict("the answer this worker was to write was refused".into()));
            }
        };
        self.held_first = false;
        adopt(&mut self.run, &commit);
        self.run.cancel_requested = committed.cancel_requested;
        Ok(committed)
    }

    pub(super) async fn drive(&mut self) -> Result<Stop, WorkerError> {
        // The first commit moves a run written for this worker to running, or proves the lease
        // (taken before the worker started) is still held.
        let mut first = self.new_commit();
        // Records the trace id for the workers that continue the run (the first one sets it).
        first.checkpoint = Some(self.run.checkpoint.clone());
        if self.run.status == RunStatus::Queued {
            first.run = Some(RunChange { to: RunStatus::Running, reason: None, via: None });
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
        // Written with the next commit: what comes first is a read of the context (or of the
        // step's tool calls), and a refusal of the lease is seen there. Not when it discards a
        // cut-off message: the context read must not see that message.
        if first.discard_messages.is_empty() {
            self.hold(first).await?;
            self.held_first = true;
        } else {
            match self.commit(first).await {
                Ok(_) => {}
                Err(StoreError::Conflict(_)) => return Ok(Stop::NotOurs),
                Err(e) => return Err(e.into()),
            }
        }
        if self.agent_missing {
            return Err(WorkerError::UnknownAgent);
        }
        loop {
            if self.run.cancel_requested {
                self.finish_cancelled().await?;
                return Ok(Stop::Settled);
            }
            if self.inner.shutting_down.load(Ordering::SeqCst) {
                self.flush_held().await?;
                return Ok(Stop::Shutdown);
            }
            let step = self.run.checkpoint.next_step;
            let primed_role = self.primed_role.take();
            // set by a model step for the step right after it
            let context_role = self.context_role.take();
            // Each step's future is boxed: it holds its calls' state, and unboxed it would be copied
            // into this future at each step, and with this one wherever the worker's future moves
            // (they were 16, 32 and 68 KB: copying them was ~3% of a run's instructions).
            let result = match step {
                NextStep::CallModel => Box::pin(self.call_model()).await,
                NextStep::ExecuteTools => {
                    Box::pin(self.execute_tools(primed_role, context_role)).instrument(node_span(nodes::TOOLS)).await
                }
                NextStep::Finalize => Box::pin(self.finalize()).instrument(node_span(nodes::FINALIZE)).await,
                // A paused run has no worker; one that got here was resumed elsewhere.
                NextStep::AwaitInterrupt | NextStep::AwaitExternal => {
                    self.flush_held().await?;
                    return Ok(Stop::Settled);
                }
            };
            match result {
                Ok(true) => continue,
                Ok(false) => {
                    self.flush_held().await?;
                    return Ok(Stop::Settled);
                }
                Err(WorkerError::Store(StoreError::Conflict(_))) if std::mem::take(&mut self.held_first) => {
                    // The held first commit was refused: another worker took the run first.
                    return Ok(Stop::NotOurs);
                }
                Err(WorkerError::Store(StoreError::Conflict(msg))) => {
                    tracing::warn!(run_id = %self.run.id, %msg, "lost the run's lease; stopping");
                    return Ok(Stop::NotOurs);
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub(super) async fn finish_cancelled(&mut self) -> Result<(), StoreError> {
        let reason = self
            .inner
            .cancel_reasons
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&self.run.id)
            .cloned()
            .unwrap_or_else(|| "cancelled_by_user".to_owned());
        let mut c = self.new_commit();
        c.run = Some(RunChange { to: RunStatus::Cancelled, reason: Some(reason.clone()), via: None });
        let mut cp = self.run.checkpoint.clone();
        cp.streaming_message_id = None;
        c.checkpoint = Some(cp);
        c.events.push(EventKind::Cancelled { reason });
        self.commit(c).await.map(|_| ())
    }

    /// Ends the run `failed` with a generic, masked error event; the cause goes to the log only.
    pub(super) async fn fail(&mut self, error: WorkerError) {
        let (code, message) = match &error {
            WorkerError::Model(_) => ("MODEL_ERROR", "the model failed; the run was stopped".to_owned()),
            WorkerError::Limit(m) => ("MAX_ITERATIONS", m.clone()),
            WorkerError::UnknownAgent => {
                ("AGENT_NOT_FOUND", "the run's agent is not configured on this server; the run was stopped".to_owned())
            }
            WorkerError::Store(_) => ("INTERNAL", "internal error".to_owned()),
        };
        tracing::error!(run_id = %self.run.id, error = %error, "run failed");
        let mut c = self.new_commit();
        c.run = Some(RunChange { to: RunStatus::Failed, reason: Some(code.to_lowercase()), via: None });
        c.events.push(EventKind::Error { code: code.into(), message });
        if let Err(e) = self.commit(c).await {
            // The lease will expire and another worker will retry from the checkpoint.
            tracing::error!(run_id = %self.run.id, error = %e, "could not record the run's failure");
        }
    }

    // ------------------------------------------------------------ call_model

    /// Returns `Ok(true)` to go on with the next step.
    pub(super) async fn call_model(&mut self) -> Result<bool, WorkerError> {
        if self.run.checkpoint.iteration >= self.inner.config.max_iterations {
            return Err(WorkerError::Limit(format!(
                "the run stopped after {} model calls without an answer",
                self.inner.config.max_iterations
            )));
        }
        let started = Instant::now();
        let Some((request, new_summary)) =
            Box::pin(self.assemble_context()).instrument(node_span(nodes::CONTEXT)).await?
        else {
            return Ok(true);
        };
        Box::pin(self.stream_answer(request, new_summary, started)).instrument(node_span(nodes::MODEL)).await
    }

    /// The model's input for this step; `None` if the run was cancelled meanwhile.
    pub(super) async fn assemble_context(
        &mut self,
    ) -> Result<Option<(ModelRequest, Option<crate::domain::Summary>)>, WorkerError> {
        // A held answer to an interrupt can hold what the context reads (the message of a call a
        // human rejected or settled): it is written first.
        if self.claim_answer.is_some() {
            self.flush_held().await?;
        }
        // One bounded read: the summary, the turns after it, their calls, the facts; and, for an
        // agent with tools, the role its calls are classified with (one statement, not two).
        let window = if let Some((window, role)) = self.primed_window.take() {
            self.context_role = role.map(|role| self.inner.role_or_default(role));
            window
        } else if self.agent.tools.is_empty() {
            self.store().context_window(&self.run.conversation_id).await?
        } else {
            let (window, role) =
                self.store().context_window_and_role(&self.run.conversation_id, &self.run.user_id).await?;
            self.context_role = Some(self.inner.role_or_default(role));
            window
        };
        let facts = &window.facts;
        self.known_facts = Some(crate::domain::fact_map(facts));
        let agent = self.agent.clone();
        let config = &agent.context;
        let plan = plan_context(
            config,
            ContextInput {
                messages: &window.messages,
                tool_calls: &window.tool_calls,
                facts,
                summary: window.summary.as_ref(),
            },
        );
        let summary_text = match plan.summary_request() {
            Some(request) if config.summarize_with_model => match self.flush_and_summarize(request).await? {
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
            tools: self.agent.tools.specs(),
            facts: crate::domain::fact_map(facts),
        };
        Ok(Some((request, assembled.new_summary)))
    }

    /// Calls the model (retrying a transient failure once), streaming its text into the run.
    pub(super) async fn stream_answer(
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
            if self.run.cancel_requested {
                // cancelled before the call: the loop ends the run without making it
                return Ok(true);
            }
            // Held into the call's first moments: written with the call's first text, or with its
            // end if that comes first, or alone once `delta_flush_interval` has passed
            // (`stream_model`). A fast call (a model's tool call, a short answer) then costs one
            // commit instead of two; a crash before it is written costs the call, made again from
            // the same checkpoint.
            self.hold(c).await?;
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
                    let mut planned = Vec::new();
                    if tool_calls.is_empty() {
                        cp.next_step = NextStep::Finalize;
                        cp.pending_call_ids = Vec::new();
                    } else {
                        cp.next_step = NextStep::ExecuteTools;
                        cp.pending_call_ids = Vec::new();
                        for tc in tool_calls {
                            // Keel's own id, never the model's: the call id is the idempotency
                            // key a tool's service deduplicates by, so it must be unique across
                            // every run, and models number their calls (`call_0`) or repeat them.
                            // The model sees this id back in its history, which is all the
                            // protocol asks of it.
                            let id = CallId::new();
                            cp.pending_call_ids.push(id.clone());
                            let call = ToolCall {
                                id,
                                run_id: self.run.id.clone(),
                                name: truncate(&tc.name, 100),
                                args: Masked::new(tc.arguments),
                                state: ToolCallState::Requested,
                                result: None,
                                summary: None,
                                attempts: 0,
                                started_at: None,
                                finished_at: None,
                            };
                            planned.push(call.clone());
                            c.tool_calls.push(ToolCallChange::Insert(call));
                        }
                    }
                    c.checkpoint = Some(cp);
                    // Written with the next step's first commit (the tools step classifies the
                    // calls, reading only, then commits; or the run ends), which follows at once.
                    self.hold(c).await?;
                    self.planned_calls = (!planned.is_empty()).then_some(planned);
                    return Ok(true);
                }
            }
        }
    }

    /// [`Worker::summarize`], after writing the held commit: the summary is a model call, a wait.
    async fn flush_and_summarize(
        &mut self,
        messages: Vec<crate::model::ModelMessage>,
    ) -> Result<Result<Option<String>, ModelError>, StoreError> {
        self.flush_held().await?;
        Ok(self.summarize(messages).await)
    }

    /// The model's summary of older turns: a separate call without tools, its text collected.
    /// `Ok(None)` if the run was cancelled meanwhile; an error (or an empty answer) means "use the
    /// extractive summary".
    pub(super) async fn summarize(
        &self,
        messages: Vec<crate::model::ModelMessage>,
    ) -> Result<Option<String>, ModelError> {
        let request = ModelRequest { messages, tools: Arc::default(), facts: FactMap::new() };
        let call = async {
            let mut stream = self.agent.model.stream(request).await?;
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
    pub(super) async fn stream_model(
        &mut self,
        request: &ModelRequest,
        message_id: &MessageId,
    ) -> Result<StreamEnd, WorkerError> {
        let asked = Instant::now();
        let mut first_token = true;
        let flush_max = self.inner.config.delta_flush_max.max(1);
        let flush_interval = self.inner.config.delta_flush_interval;
        // A commit held from before the call (its start) waits at most as long as text does,
        // counted from the call's start: a model's answer can take a while to begin.
        let held_until = self.held.is_some().then(|| tokio::time::Instant::now() + flush_interval);
        let model = self.agent.model.clone();
        let call = self.await_holding(model.stream(request.clone()), held_until).await?;
        let mut deadline = held_until.filter(|_| self.held.is_some());
        let mut stream = match call {
            Ok(s) => s,
            Err(e) => return Ok(StreamEnd::Failed(e)),
        };
        let mut buffer: Vec<String> = Vec::new();
        let mut unsaved = UnsavedText::default();
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
    pub(super) async fn flush_text(
        &mut self,
        message_id: &MessageId,
        buffer: &mut Vec<String>,
        unsaved: &mut UnsavedText,
        last: bool,
    ) -> Result<bool, StoreError> {
        if buffer.is_empty() && (!last || unsaved.text.is_empty()) {
            // No text to write, but the commit held from before the call, if any, waits no longer.
            if let Some(held) = self.held.take() {
                return Ok(self.commit_now(held).await?.cancel_requested);
            }
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

    // ------------------------------------------------------------ finalize

    pub(super) async fn finalize(&mut self) -> Result<bool, WorkerError> {
        let mut c = self.new_commit();
        c.events.push(EventKind::NodeStarted { node: nodes::FINALIZE.into() });
        c.events.push(EventKind::NodeFinished { node: nodes::FINALIZE.into(), duration_ms: 0 });
        c.events.push(EventKind::Done { message_id: self.run.checkpoint.answer_message_id.clone() });
        c.run = Some(RunChange { to: RunStatus::Completed, reason: None, via: None });
        self.commit(c).await?;
        Ok(false)
    }
}

/// A span per node of the agent loop (`context`, `model`, `tools`, `finalize`) inside the run's.
pub(super) fn node_span(node: &'static str) -> tracing::Span {
    tracing::info_span!("node", node)
}

pub(super) enum StreamEnd {
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
pub(super) struct UnsavedText {
    pub(super) text: String,
    /// Bytes of the call's text the stored message has.
    pub(super) saved: usize,
}

impl UnsavedText {
    const MIN_APPEND: usize = 4096;

    pub(super) fn due(&self) -> bool {
        self.text.len() >= Self::MIN_APPEND.max(self.saved / 2)
    }

    /// Turns the buffered deltas into one `text_delta` event; its text waits here for its append.
    ///
    /// The deltas of one commit are stored and announced together, so a client could not see them
    /// apart: one event carries them all, and a fast model's answer costs a row, a frame and a
    /// sequence per commit instead of per token.
    pub(super) fn take_deltas(
        &mut self,
        message_id: &MessageId,
        buffer: &mut Vec<String>,
        events: &mut Vec<EventKind>,
    ) {
        let delta = match buffer.len() {
            0 => return,
            1 => buffer.pop().unwrap_or_default(),
            _ => {
                let joined = buffer.concat();
                buffer.clear();
                joined
            }
        };
        self.text.push_str(&delta);
        events.push(EventKind::TextDelta { message_id: message_id.clone(), delta });
    }

    pub(super) fn take(&mut self, message_id: &MessageId) -> TextAppend {
        let text = std::mem::take(&mut self.text);
        self.saved += text.len();
        TextAppend { message_id: message_id.clone(), text }
    }
}
