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
    /// After a commit: publishes its events and measures what they announce.
    pub(super) fn committed(&self, run_created_at: Timestamp, events: &[Event]) {
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

    pub(super) fn lease_token(&self) -> String {
        format!("{}:{}", self.config.instance_id, uuid::Uuid::now_v7().simple())
    }

    pub(super) fn lease_until(&self) -> Timestamp {
        self.clock.now() + chrono_dur(self.config.lease_ttl)
    }

    pub(super) async fn role_of(&self, user_id: &str) -> Result<Option<UserRole>, StoreError> {
        Ok(self.store.user_role(user_id).await?.or(self.config.default_role))
    }

    /// Drives `run_id` on a task of its own, which holds `slot` until the worker stops.
    pub(super) fn spawn_worker(self: &Arc<Self>, run_id: RunId, lease: Lease, slot: Slot) {
        if self.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        let inner = self.clone();
        let key = self.next_worker.fetch_add(1, Ordering::Relaxed);
        // Boxed: the worker's future is large (every step's state), and a task moves its future
        // by value a few times on the way in unless it is behind a pointer.
        let handle = tokio::spawn(Box::pin(async move {
            let _slot = slot;
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
        }));
        let mut workers = self.workers.lock().unwrap_or_else(|e| e.into_inner());
        workers.retain(|_, h| !h.is_finished());
        workers.insert(key, handle);
    }

    /// The trace id a run's first event carries, or a new one for a run from before trace ids.
    pub(super) async fn trace_id_of(&self, run_id: &RunId) -> String {
        match self.store.list_events(run_id, 0, 1).await.as_deref() {
            Ok([Event { kind: EventKind::RunStarted { trace_id: Some(id), .. }, .. }]) => id.clone(),
            _ => new_trace_id(),
        }
    }

    /// The agent that runs `run`: its own, or the default for a run made before agents.
    pub(super) fn agent_of_run(&self, run: &Run) -> Option<Arc<Agent>> {
        self.agents.resolve(run.agent_id.as_deref())
    }

    /// One worker's life: drive the run from its checkpoint until it pauses, ends or is not ours.
    pub(super) async fn work(self: Arc<Self>, run: Run, lease: Lease) {
        let inner = self;
        let run_id = run.id.clone();
        let (owner, acquire) = match lease {
            Lease::Held(owner) => (owner, None),
            Lease::Acquire(from) => (inner.lease_token(), Some(from)),
        };
        let cancel_signal = Arc::new(tokio::sync::Notify::new());
        inner.cancel_signals.lock().unwrap_or_else(|e| e.into_inner()).insert(run_id.clone(), cancel_signal.clone());
        let renewer = inner.spawn_lease_renewer(run_id.clone(), owner.clone());
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
            acquire,
            cancel_signal,
            deferred: Vec::new(),
            deferred_text: Vec::new(),
            held: None,
            held_acquires: false,
            planned_calls: None,
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
                self.spawn_worker(run.id, Lease::Held(owner.clone()), slot);
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

    pub(super) async fn sweep_expired(&self) -> EngineResult<usize> {
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
    pub(super) async fn expire(&self, interrupt: &Interrupt) -> EngineResult<bool> {
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

    pub(super) async fn cancel(&self, run_id: &RunId, reason: &str) -> EngineResult<Run> {
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
            for call in
                calls.iter().filter(|c| interrupt.call_ids.contains(&c.id) && c.state == ToolCallState::Suspended)
            {
                fail_unanswered(&mut commit, &run, call, "the run was cancelled before the client answered", now);
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
