//! A human's decision on a pending interrupt: authorize, check expiry, reserve the idempotency
//! key, claim the interrupt with one conditional commit, continue the run.

use super::*;

/// A resume request, after transport-level parsing.
#[derive(Debug, Clone, PartialEq)]
pub struct ResumeRequest {
    pub interrupt_id: InterruptId,
    pub decision: Decision,
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
    #[cfg_attr(feature = "openapi", schema(value_type = serde_json::Value))]
    pub decision: Masked<Value>,
    /// The sequence of the `resumed` event: a stream answering this resume starts there.
    pub resumed_sequence: i64,
}

/// Whether a resume's answer is the stored answer of an earlier request with the same key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Replayed(pub(super) bool);

impl Engine {
    /// A human's decision on a pending interrupt, in the order that makes it safe: authorize the
    /// current caller, check expiry, validate the decision, claim the interrupt with a conditional
    /// update (one winner) that stores its answer under the idempotency key, then continue the
    /// run. The side effects happen in the worker, after a precheck and a conditional claim of
    /// each call.
    pub async fn resume(&self, user_id: &str, run_id: &RunId, req: ResumeRequest) -> EngineResult<ResumeAccepted> {
        let outcome = self.resume_once(user_id, run_id, req).await;
        self.count_answer("resume", outcome)
    }

    /// Counts an answer to an interrupt (a decision, a client tool's result) in the metrics: a
    /// replay, a success, or its error code; a store failure under `op` too.
    pub(super) fn count_answer<T>(&self, op: &'static str, outcome: EngineResult<(T, Replayed)>) -> EngineResult<T> {
        let metrics = &self.inner.config.metrics;
        match &outcome {
            Ok((_, Replayed(true))) => metrics.resume("REPLAYED"),
            Ok(_) => metrics.resume("OK"),
            Err(e) => {
                if let EngineError::Store(StoreError::Backend(_)) = e {
                    metrics.store_error(op);
                }
                metrics.resume(e.code())
            }
        }
        outcome.map(|(accepted, _)| accepted)
    }

    pub(super) async fn resume_once(
        &self,
        user_id: &str,
        run_id: &RunId,
        req: ResumeRequest,
    ) -> EngineResult<(ResumeAccepted, Replayed)> {
        if self.is_shutting_down() {
            return Err(EngineError::ShuttingDown);
        }
        let inner = &self.inner;
        // The run, its interrupts and calls, and the caller's role: one read.
        let (run, view) = self.answer_view(user_id, run_id).await?;
        let Some(interrupt) = view.interrupts.into_iter().find(|i| i.id == req.interrupt_id) else {
            return Err(EngineError::NotFound("interrupt"));
        };
        super::client::check_key(&req.idempotency_key)?;
        if let Some(note) = &req.note {
            if note.chars().count() > MAX_NOTE_CHARS || note.contains('\0') {
                return Err(EngineError::Invalid(format!(
                    "note: must be at most {MAX_NOTE_CHARS} characters, without NUL characters"
                )));
            }
        }
        let calls = view.tool_calls;
        let agent = inner.agent_of_run(&run).ok_or(EngineError::UnknownAgent)?;
        let decisions = per_call(&interrupt, &req.decision, &calls, &agent.tools)?;

        // 1. Authorize the caller as of now (the read above), not as of when the run started:
        //    anything but a rejection needs a role the tool's policy does not deny.
        let role = inner.role_or_default(view.role);
        for (call_id, decision) in &decisions {
            if *decision == CallDecision::Reject {
                continue;
            }
            let Some(call) = calls.iter().find(|c| &c.id == call_id) else { continue };
            let allowed = agent.tools.get(&call.name).map(|t| t.spec().policy_for(role)).unwrap_or(Policy::Deny);
            if allowed == Policy::Deny {
                return Err(EngineError::Forbidden(format!(
                    "your role ({}) may not decide on {}",
                    role.map(|r| r.as_str()).unwrap_or("none"),
                    call.name
                )));
            }
        }

        // 2. Expiry.
        let now = inner.clock.now();
        self.refuse_if_expired(&interrupt, now).await?;

        // 3. The claim, whose transaction stores the answer under the idempotency key (a repeat of
        //    this request gets that answer: `under_key`).
        let hash = request_hash(run_id, &req.interrupt_id, &req.decision.to_value(), req.note.as_deref());
        let view = (calls.as_slice(), view.facts.as_slice());
        let claim = self.claim_and_continue(&run, &interrupt, &req, &hash, decisions, view, user_id, role, now);
        self.under_key(user_id, &req.idempotency_key, &hash, "resume", claim).await
    }

    /// An interrupt past its expiry is expired (if nobody did it yet) and refused.
    pub(super) async fn refuse_if_expired(&self, interrupt: &Interrupt, now: Timestamp) -> EngineResult<()> {
        if interrupt.status == InterruptStatus::Expired
            || (interrupt.status == InterruptStatus::Pending && interrupt.expires_at <= now)
        {
            if interrupt.status == InterruptStatus::Pending {
                self.inner.expire(interrupt).await?;
            }
            return Err(EngineError::InterruptExpired);
        }
        Ok(())
    }

    /// An answer to an interrupt (a decision, a client's result) under its idempotency key: the
    /// same request again gets the stored first answer, another under the same key is refused, and
    /// a `claim` that fails leaves the key free for a retry to be evaluated afresh.
    ///
    /// Nothing is written before the claim: its commit stores the answer under the key
    /// ([`Commit::idempotency`]), taking the key only if it is free, so the request whose effect
    /// commits is the one that holds the key, and a crash leaves the key either free or answered,
    /// never reserved. A claim that fails — the interrupt answered already, the run moved on, the
    /// key holding an answer — looks the key up (one read): the same request's stored answer is
    /// the reply (a retry, a double click, a second tab sending the same decision), another
    /// request's is `IDEMPOTENCY_KEY_REUSED`, and a free key leaves the claim's own error.
    pub(super) async fn under_key<T: serde::de::DeserializeOwned>(
        &self,
        user_id: &str,
        key: &str,
        hash: &str,
        what: &str,
        claim: impl std::future::Future<Output = EngineResult<T>>,
    ) -> EngineResult<(T, Replayed)> {
        let refused = match claim.await {
            Ok(accepted) => return Ok((accepted, Replayed(false))),
            Err(e) => e,
        };
        // Not a decision on the request: no answer to look for.
        if matches!(refused, EngineError::ShuttingDown | EngineError::Overloaded) {
            return Err(refused);
        }
        let now = self.inner.clock.now();
        match self.inner.store.idempotency_find(user_id, key, hash, now).await? {
            Some(IdempotencyBegin::Done { response, .. }) => serde_json::from_value(response)
                .map(|accepted| (accepted, Replayed(true)))
                .map_err(|e| EngineError::Store(StoreError::Backend(format!("stored {what} answer: {e}")))),
            Some(IdempotencyBegin::Mismatch) => Err(EngineError::IdempotencyKeyReused),
            // begun by a request of an earlier version, not answered yet
            Some(IdempotencyBegin::InFlight) => Err(EngineError::IdempotencyKeyInFlight),
            Some(IdempotencyBegin::Started) | None => Err(refused),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn claim_and_continue(
        &self,
        run: &Run,
        interrupt: &Interrupt,
        req: &ResumeRequest,
        request_hash: &str,
        decisions: BTreeMap<CallId, CallDecision>,
        (calls, facts): (&[ToolCall], &[Fact]),
        user_id: &str,
        role: Option<UserRole>,
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
        let decision = Masked::new(req.decision.to_value());
        let note = req.note.as_deref().map(str::trim).filter(|n| !n.is_empty()).map(Masked::from);
        commit.interrupt_changes.push(InterruptChange {
            id: interrupt.id.clone(),
            to: InterruptStatus::Resolved,
            decision: Some(decision.clone()),
            note: note.clone(),
            resolved_by: Some(user_id.to_owned()),
        });
        commit.run = Some(RunChange { to: RunStatus::Running, reason: None, via: None });
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
                // A retry runs the call again with the same idempotency key.
                CallDecision::Approve | CallDecision::Retry => {
                    commit.tool_calls.push(ToolCallChange::transition(call_id, call.state, ToolCallState::Allowed))
                }
                CallDecision::MarkDone => {
                    settle_by_human(&mut commit, run, call, true, user_id, req.note.as_deref(), now)
                }
                CallDecision::MarkFailed => {
                    settle_by_human(&mut commit, run, call, false, user_id, req.note.as_deref(), now)
                }
                CallDecision::Edit(args) => commit.tool_calls.push(ToolCallChange::Update(ToolCallUpdate {
                    args: Some(Masked::from(args)),
                    ..ToolCallUpdate::new(call_id, call.state, ToolCallState::Allowed)
                })),
                CallDecision::Reject => {
                    let reason = format!("rejected by {user_id}; it did not run");
                    deny_call(&mut commit, run, call, &reason, now);
                }
            }
        }
        // The step's other open calls (asked about next, or client-side calls not asked yet) stay
        // pending after the decided ones.
        pending.extend(run.checkpoint.pending_call_ids.iter().filter(|id| !interrupt.call_ids.contains(id)).cloned());
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
            request_hash: request_hash.to_owned(),
            status: 200,
            response: serde_json::to_value(&accepted).unwrap_or(Value::Null),
            expires_at: now + chrono::Duration::hours(24),
        });

        let primed = Primed::after(&commit, (calls, facts), run, user_id, role);
        let resumed_sequence = self.commit_claim(run, interrupt, commit, owner, primed).await?;
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

    /// Commits a claim of `interrupt` (a commit fenced on the run being `interrupted`, which
    /// resolves the interrupt), then continues the run in a worker. Of concurrent claims exactly
    /// one commits; the others get the error that says why. Answers the `resumed` event's sequence.
    ///
    /// With a free slot here, the worker that continues the run writes the claim, in one
    /// transaction with its first step's commit ([`Claim`]), and this waits for that write; at
    /// capacity, the claim is written here and the run let go for an instance with a free slot.
    pub(super) async fn commit_claim(
        &self,
        run: &Run,
        interrupt: &Interrupt,
        commit: Commit,
        owner: String,
        primed: Primed,
    ) -> EngineResult<i64> {
        let inner = &self.inner;
        // A slot for the worker that continues the run, taken before the claim so that a run this
        // instance has no room for is not left leased to it.
        let written = match inner.capacity.try_take() {
            Some(slot) => {
                // The run as the claim leaves it, for its worker (which then need not read it back).
                let mut resumed = run.clone();
                adopt(&mut resumed, &commit);
                resumed.lease_owner = Some(owner.clone());
                let (answer, outcome) = tokio::sync::oneshot::channel();
                let primed = Primed { claim: Some(Claim { commit, answer }), ..primed };
                inner.spawn_worker(resumed, owner, slot, primed);
                // No answer: the worker was not started (a shutdown began), or stopped before
                // writing anything. Nothing of the claim was written either way.
                outcome.await.map_err(|_| EngineError::ShuttingDown)?
            }
            None => {
                let written = inner.store.commit(commit).await;
                if let Ok(committed) = &written {
                    inner.committed_by(run, committed);
                    // At capacity: the decision is committed (once), and the run is let go as it
                    // would be at a shutdown — `running` with no lease — so the first instance
                    // with a free slot claims it and continues from the checkpoint. Should letting
                    // go fail, the lease expires and the run is claimed then.
                    tracing::info!(run_id = %run.id, "at capacity; the resumed run is left for a free slot");
                    if let Err(e) = inner.store.release_lease(&run.id, &owner).await {
                        inner.config.metrics.store_error("resume");
                        tracing::warn!(run_id = %run.id, error = %e, "letting go of a resumed run failed; it waits for its lease to expire");
                    }
                }
                written
            }
        };
        let committed = match written {
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
        let resumed_sequence = committed
            .events
            .iter()
            .find(|e| matches!(e.kind, EventKind::Resumed { .. }))
            .map(|e| e.sequence)
            .unwrap_or_default();
        Ok(resumed_sequence)
    }
}

pub(super) fn request_hash(run_id: &RunId, interrupt_id: &InterruptId, decision: &Value, note: Option<&str>) -> String {
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
