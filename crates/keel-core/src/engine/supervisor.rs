//! What drives workers: claiming runs that need one, the sweeper (interrupt expiry, orphaned
//! runs), leases, cancellation, and publishing what was committed.

use std::sync::atomic::AtomicUsize;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::*;

/// The runs one instance drives at once: one slot per live worker, at most
/// [`EngineConfig::max_concurrent_runs`]. A run this instance has no slot for is not driven here:
/// it stays claimable (`queued`, or `running` without a lease) for any instance with a free slot.
pub(super) struct Capacity {
    limit: usize,
    permits: Arc<Semaphore>,
    /// The most slots held at once since the engine was made.
    peak: AtomicUsize,
    /// Work was turned away for want of a slot (a run left queued, a resume released, a claim that
    /// took every free slot): the next slot to be freed wakes the claimer at once.
    saturated: AtomicBool,
    /// Wakes the claimer before its next tick.
    wake: Notify,
}

/// A live worker's slot; dropping it frees the slot (and wakes the claimer if work was waiting).
pub(super) struct Slot {
    permit: Option<OwnedSemaphorePermit>,
    capacity: Arc<Capacity>,
}

impl Capacity {
    pub(super) fn new(limit: usize) -> Arc<Self> {
        let limit = limit.clamp(1, Semaphore::MAX_PERMITS);
        Arc::new(Self {
            limit,
            permits: Arc::new(Semaphore::new(limit)),
            peak: AtomicUsize::new(0),
            saturated: AtomicBool::new(false),
            wake: Notify::new(),
        })
    }

    /// A free slot for work in hand, or `None`: the work is turned away, and the claimer is told to
    /// look for it again when a slot frees.
    pub(super) fn try_take(self: &Arc<Self>) -> Option<Slot> {
        let slot = self.take_free();
        if slot.is_none() {
            self.saturated.store(true, Ordering::SeqCst);
        }
        slot
    }

    /// A free slot, or `None`.
    fn take_free(self: &Arc<Self>) -> Option<Slot> {
        let permit = self.permits.clone().try_acquire_owned().ok()?;
        self.peak.fetch_max(self.held(), Ordering::SeqCst);
        Some(Slot { permit: Some(permit), capacity: self.clone() })
    }

    pub(super) fn limit(&self) -> usize {
        self.limit
    }

    /// Slots held now.
    pub(super) fn held(&self) -> usize {
        self.limit - self.permits.available_permits()
    }

    /// Resolves when a slot was freed while work was waiting for one.
    pub(super) async fn freed(&self) {
        self.wake.notified().await
    }

    pub(super) fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The slot is free before the claimer is woken, so the claimer can take it.
        drop(self.permit.take());
        if self.capacity.saturated.load(Ordering::SeqCst) {
            self.capacity.wake.notify_one();
        }
    }
}

/// The most runs one claim takes.
const CLAIM_BATCH: usize = 50;

impl Inner {
    /// After a commit of `run`: publishes its events and measures what they announce. When they end
    /// the run, the conversation's next waiting run, if any, is started ([`Inner::promote_next`],
    /// on a task of its own).
    pub(super) fn committed(self: &Arc<Self>, run: &Run, events: &[Event]) {
        self.announce(run, events, events.iter().any(Event::is_terminal));
    }

    /// [`Inner::committed`] for a store commit, which says whether runs wait behind the run it
    /// ended: none — the common case — costs no look.
    pub(super) fn committed_by(self: &Arc<Self>, run: &Run, committed: &Committed) {
        self.announce(run, &committed.events, committed.waiting_behind);
    }

    fn announce(self: &Arc<Self>, run: &Run, events: &[Event], look_for_waiting: bool) {
        self.bus.publish(events);
        let metrics = &self.config.metrics;
        let ms = Duration::from_millis;
        let run_created_at = run.created_at;
        if look_for_waiting {
            self.spawn_promotion(run.conversation_id.clone());
        }
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

    pub(super) fn lease_token(&self) -> String {
        format!("{}:{}", self.config.instance_id, uuid::Uuid::now_v7().simple())
    }

    pub(super) fn lease_until(&self) -> Timestamp {
        self.clock.now() + chrono_dur(self.config.lease_ttl)
    }

    pub(super) async fn role_of(&self, user_id: &str) -> Result<Option<UserRole>, StoreError> {
        Ok(self.role_or_default(self.store.user_role(user_id).await?))
    }

    /// A user's role as the engine acts on it: the stored one, or the configured default.
    pub(super) fn role_or_default(&self, stored: Option<UserRole>) -> Option<UserRole> {
        stored.or(self.config.default_role)
    }

    /// Drives `run` — as it is stored: this instance just wrote it, leased to `owner` — on a task of
    /// its own, which holds `slot` until the worker stops.
    pub(super) fn spawn_worker(self: &Arc<Self>, mut run: Run, owner: String, slot: Slot, primed: Primed) {
        if self.shutting_down.load(Ordering::SeqCst) {
            // Let go of the lease it was written or claimed with: the next process takes it at once.
            let store = self.store.clone();
            tokio::spawn(async move { store.release_lease(&run.id, &owner).await });
            return;
        }
        let inner = self.clone();
        let key = self.next_worker.fetch_add(1, Ordering::Relaxed);
        // Boxed: the worker's future is large (every step's state), and a task moves its future
        // by value a few times on the way in unless it is behind a pointer.
        let handle = tokio::spawn(Box::pin(async move {
            let _slot = slot;
            let run_id = run.id.clone();
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
            inner.clone().work(run, owner, primed).instrument(span).await;
        }));
        let mut workers = self.workers.lock().unwrap_or_else(|e| e.into_inner());
        workers.retain(|_, h| !h.is_finished());
        workers.insert(key, handle);
    }

    /// The trace id a run's `run_started` carries (its first event, or its second after a
    /// `run_waiting`), or a new one for a run from before trace ids.
    pub(super) async fn trace_id_of(&self, run_id: &RunId) -> String {
        let first = self.store.list_events(run_id, 0, 2).await.unwrap_or_default();
        first
            .into_iter()
            .find_map(|e| match e.kind {
                EventKind::RunStarted { trace_id, .. } => Some(trace_id),
                _ => None,
            })
            .flatten()
            .unwrap_or_else(new_trace_id)
    }

    /// A free slot for a run this instance is about to make `queued` (a new message's, a promoted
    /// one's), and the lease the run is written with so that no other instance claims it before
    /// its worker starts; `None` at capacity: the run is written without a lease, for this
    /// instance once a slot frees or for any other instance's claim.
    pub(super) fn reserve_worker(self: &Arc<Self>) -> Option<(Slot, NewLease)> {
        let slot = self.capacity.try_take()?;
        Some((slot, NewLease { owner: self.lease_token(), until: self.lease_until() }))
    }

    /// Drives a run just written `queued` here, with the slot and lease [`Inner::reserve_worker`]
    /// gave (`None`: it waits, queued, for a claim).
    pub(super) fn start_worker(
        self: &Arc<Self>,
        started: &StartedRun,
        reserved: Option<(Slot, NewLease)>,
        primed: Primed,
    ) {
        let Some((slot, lease)) = reserved else {
            tracing::debug!(run_id = %started.run.id, "at capacity; the run waits, queued");
            return;
        };
        let mut run = started.run.clone();
        // The trace id is its `run_started`'s, which the worker's first commit records.
        if run.checkpoint.trace_id.is_none() {
            run.checkpoint.trace_id = started.events.iter().find_map(|e| match &e.kind {
                EventKind::RunStarted { trace_id, .. } => trace_id.clone(),
                _ => None,
            });
        }
        self.spawn_worker(run, lease.owner, slot, primed);
    }

    /// [`Inner::promote_next`] on a task of its own (after a run's end: the commit that ended it is
    /// answered without waiting for the next run to start).
    fn spawn_promotion(self: &Arc<Self>, conversation_id: ConversationId) {
        if self.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        let inner = self.clone();
        tokio::spawn(async move {
            if let Err(e) = inner.promote_next(&conversation_id).await {
                inner.config.metrics.store_error("promote_waiting");
                tracing::warn!(conversation_id = %conversation_id, error = %e, "starting the next waiting run failed");
            }
        });
    }

    /// Starts the conversation's oldest waiting run if nothing runs in it any more, and drives it.
    /// Nothing waiting — the common case — costs one read (of an index empty but for waiting runs);
    /// the promotion itself is one conditional transaction, so of the instances that look at once
    /// one starts the run. `true` if this call started one.
    pub(super) async fn promote_next(self: &Arc<Self>, conversation_id: &ConversationId) -> Result<bool, StoreError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Ok(false);
        }
        if self.store.waiting_runs(conversation_id, 1).await?.is_empty() {
            return Ok(false);
        }
        if self.store.active_run(conversation_id).await?.is_some() {
            return Ok(false);
        }
        let now = self.clock.now();
        let reserved = self.reserve_worker();
        let lease = reserved.as_ref().map(|(_, lease)| lease.clone());
        let Some(started) =
            self.store.promote_waiting(conversation_id, first_events(conversation_id), lease, now).await?
        else {
            return Ok(false);
        };
        tracing::info!(run_id = %started.run.id, conversation_id = %conversation_id, "a waiting run's turn came; starting it");
        self.committed(&started.run, &started.events);
        self.start_worker(&started, reserved, Primed::default());
        Ok(true)
    }

    /// Rolls back the runs cancelled for a rollback that have ended but were not rolled back (a
    /// process that stopped between the cancel and the rollback, or whose caller gave up waiting):
    /// what recovery, every sweep and a message sent with `rollback` do first. Nothing due — the
    /// common case — costs one read of an index empty but for those.
    pub(super) async fn finish_rollbacks(self: &Arc<Self>) -> Result<usize, StoreError> {
        let mut done = 0;
        for run_id in self.store.rollbacks_due(CLAIM_BATCH as u32).await? {
            let rolled_back = self.store.roll_back_run(&run_id, self.clock.now()).await?;
            tracing::info!(
                run_id = %run_id,
                messages = rolled_back.messages,
                events = rolled_back.events,
                "a rollback left undone finished"
            );
            done += 1;
        }
        Ok(done)
    }

    /// Starts the waiting runs whose turn came while nobody was there to start them (a process that
    /// stopped between a run's end and the next one's start): what recovery and every sweep do.
    pub(super) async fn promote_stranded(self: &Arc<Self>) -> Result<usize, StoreError> {
        let mut started = 0;
        for conversation_id in self.store.stranded_conversations(CLAIM_BATCH as u32).await? {
            if self.promote_next(&conversation_id).await? {
                started += 1;
            }
        }
        Ok(started)
    }

    /// The agent that runs `run`: its own, or the default for a run made before agents.
    pub(super) fn agent_of_run(&self, run: &Run) -> Option<Arc<Agent>> {
        self.agents.resolve(run.agent_id.as_deref())
    }

    /// One worker's life: drive the run from its checkpoint until it pauses, ends or is not ours.
    pub(super) async fn work(self: Arc<Self>, run: Run, owner: String, primed: Primed) {
        let inner = self;
        let run_id = run.id.clone();
        let cancel_signal = Arc::new(tokio::sync::Notify::new());
        inner.cancel_signals.lock().unwrap_or_else(|e| e.into_inner()).insert(run_id.clone(), cancel_signal.clone());
        // A worker that writes an answer first holds the lease once that is written.
        let renewer = primed.claim.is_none().then(|| inner.spawn_lease_renewer(run_id.clone(), owner.clone()));
        // A run of an agent this process does not run (a config that dropped it) fails at its first
        // step, with a clear code, instead of running as another agent.
        let (agent, agent_missing) = match inner.agent_of_run(&run) {
            Some(agent) => (agent, false),
            None => (inner.agents.default_agent(), true),
        };
        let mut worker = Worker {
            inner: inner.clone(),
            agent,
            agent_missing,
            run,
            owner,
            cancel_signal,
            deferred: Vec::new(),
            deferred_text: Vec::new(),
            held: None,
            held_first: false,
            planned_calls: primed.calls,
            primed_role: primed.role,
            context_role: None,
            primed_window: primed.window,
            known_facts: primed.facts,
            claim_answer: None,
            claim_refused: false,
            renewer,
        };
        if let Some(claim) = primed.claim {
            // Written with the first commit below (which then joins the worker's next one); `run`
            // is already as the claim leaves it.
            worker.held = Some(claim.commit);
            worker.claim_answer = Some(claim.answer);
        }
        // Boxed: the worker's future stays small (see `Worker::drive`).
        let outcome = match Box::pin(worker.drive()).await {
            Ok(Stop::Settled) => "settled",
            Ok(Stop::NotOurs) => "not_ours",
            Ok(Stop::Shutdown) => {
                let _ = inner.store.release_lease(&worker.run.id, &worker.owner).await;
                "shutdown"
            }
            // The answer it was to write was refused (its request says why): nothing was ours.
            Err(_) if worker.claim_refused => "not_ours",
            Err(e) => {
                if let WorkerError::Store(_) = e {
                    inner.config.metrics.store_error("worker");
                }
                Box::pin(worker.fail(e)).await;
                "failed"
            }
        };
        tracing::Span::current().record("outcome", outcome);
        if let Some(renewer) = worker.renewer.take() {
            renewer.abort();
        }
        inner.cancel_signals.lock().unwrap_or_else(|e| e.into_inner()).remove(&run_id);
        inner.cancel_reasons.lock().unwrap_or_else(|e| e.into_inner()).remove(&run_id);
    }

    /// Keeps the lease alive while the worker waits on a slow model or tool. A renewal that fails
    /// means the lease was lost; the worker's next commit is then refused by its fence.
    pub(super) fn spawn_lease_renewer(self: &Arc<Self>, run_id: RunId, owner: String) -> JoinHandle<()> {
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

    pub(super) async fn claim_and_spawn(self: &Arc<Self>, steal: bool) -> Result<usize, StoreError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Ok(0);
        }
        // Whatever was turned away before now is looked for by this claim; a refusal from here on
        // sets the flag again.
        self.capacity.saturated.store(false, Ordering::SeqCst);
        let mut total = 0;
        loop {
            // Never more runs than free slots: the rest stay claimable by any instance.
            let mut slots: Vec<Slot> = Vec::new();
            while slots.len() < CLAIM_BATCH {
                match self.capacity.take_free() {
                    Some(slot) => slots.push(slot),
                    None => break,
                }
            }
            if slots.is_empty() {
                // Full: whatever is claimable waits for a slot here, or for another instance.
                self.capacity.saturated.store(true, Ordering::SeqCst);
                return Ok(total);
            }
            let want = slots.len();
            let owner = self.lease_token();
            let now = self.clock.now();
            let claimed = self.store.claim_runs(&owner, now, self.lease_until(), steal, want as u32).await?;
            let n = claimed.len();
            for (run, slot) in claimed.into_iter().zip(slots.drain(..)) {
                tracing::info!(run_id = %run.id, step = %run.checkpoint.next_step, "continuing run from its checkpoint");
                self.spawn_worker(run, owner.clone(), slot, Primed::default());
            }
            total += n;
            if n < want {
                // Nothing more to claim (the unused slots are free again).
                return Ok(total);
            }
            if want < CLAIM_BATCH {
                // Every free slot was taken: more may be waiting once one frees.
                self.capacity.saturated.store(true, Ordering::SeqCst);
                return Ok(total);
            }
        }
    }

    /// Runs the sweeps `due` names, in order: expired interrupts, rollbacks left undone, stranded
    /// waiting runs (so the claim after them takes those runs too), claims. A sweep that fails is
    /// logged and counted; the next still runs.
    pub(super) async fn sweep(self: &Arc<Self>, due: DueWork) {
        let metrics = &self.config.metrics;
        if due.expired_interrupts {
            if let Err(e) = self.sweep_expired().await {
                metrics.store_error("sweep_expired");
                tracing::warn!(error = %e, "interrupt expiry sweep failed");
            }
        }
        if due.rollbacks {
            if let Err(e) = self.finish_rollbacks().await {
                metrics.store_error("finish_rollbacks");
                tracing::warn!(error = %e, "finishing rollbacks left undone failed");
            }
        }
        if due.stranded {
            if let Err(e) = self.promote_stranded().await {
                metrics.store_error("promote_waiting");
                tracing::warn!(error = %e, "starting stranded waiting runs failed");
            }
        }
        if due.claimable {
            if let Err(e) = self.claim_and_spawn(false).await {
                metrics.store_error("claim_runs");
                tracing::warn!(error = %e, "claiming runs failed");
            }
        }
    }

    pub(super) async fn sweep_expired(self: &Arc<Self>) -> EngineResult<usize> {
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
    pub(super) async fn expire(self: &Arc<Self>, interrupt: &Interrupt) -> EngineResult<bool> {
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
        for call in calls.iter().filter(|c| interrupt.call_ids.contains(&c.id) && c.state == ToolCallState::Suspended) {
            fail_unanswered(&mut commit, &run, call, "the client did not answer before the request expired", now);
        }
        commit.run = Some(RunChange { to: RunStatus::Cancelled, reason: Some("interrupt_expired".into()), via: None });
        commit.events.push(EventKind::Cancelled { reason: "interrupt_expired".into() });
        match self.store.commit(commit).await {
            Ok(c) => {
                tracing::info!(run_id = %run.id, interrupt_id = %interrupt.id, "interrupt expired; run cancelled");
                self.committed_by(&run, &c);
                Ok(true)
            }
            Err(StoreError::Conflict(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Cancels a run (with `reason`): a queued, paused or waiting one at once, a running one at its
    /// worker's next commit (the durable flag; a worker of this instance is woken at once). With
    /// `roll_back`, the intent to roll it back once it has ended is written with the flag.
    pub(super) async fn cancel(self: &Arc<Self>, run_id: &RunId, reason: &str, roll_back: bool) -> EngineResult<Run> {
        let now = self.clock.now();
        let run = self.store.request_cancel(run_id, now, roll_back).await?;
        if let Some(signal) = self.cancel_signals.lock().unwrap_or_else(|e| e.into_inner()).get(run_id) {
            self.cancel_reasons.lock().unwrap_or_else(|e| e.into_inner()).insert(run_id.clone(), reason.to_owned());
            signal.notify_one();
        }
        if !matches!(run.status, RunStatus::Queued | RunStatus::Interrupted | RunStatus::Waiting) {
            // Running: its worker sees the flag at its next commit. Terminal: nothing to do.
            return Ok(run);
        }
        // A waiting run never ran: it ends here, and its message never joins the conversation.
        let from = vec![RunStatus::Queued, RunStatus::Interrupted, RunStatus::Waiting];
        let mut commit = Commit::new(run.id.clone(), Fence::Unowned { from }, now);
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
            for call in
                calls.iter().filter(|c| interrupt.call_ids.contains(&c.id) && c.state == ToolCallState::Suspended)
            {
                fail_unanswered(&mut commit, &run, call, "the run was cancelled before the client answered", now);
            }
        }
        commit.run = Some(RunChange { to: RunStatus::Cancelled, reason: Some(reason.to_owned()), via: None });
        commit.events.push(EventKind::Cancelled { reason: reason.to_owned() });
        match self.store.commit(commit).await {
            Ok(c) => self.committed_by(&run, &c),
            // It started or resumed meanwhile: the flag is set, its worker ends it.
            Err(StoreError::Conflict(_)) => {}
            Err(e) => return Err(e.into()),
        }
        Ok(self.store.get_run(run_id).await?.unwrap_or(run))
    }
}
