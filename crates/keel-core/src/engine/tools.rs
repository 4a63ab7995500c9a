//! The tools step: classify each call by its tool's policy, run what is allowed (each attempt
//! committed `executing`, with its idempotency key, before the tool is called), and pause for what
//! needs a human — an approval, or a decision on a call whose outcome is unknown.

use super::*;
use crate::tool::TIMEOUT_GRACE;

/// Why a call waits for a human.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ask {
    /// Its policy says ask: approve, reject or edit.
    Approval,
    /// It may or may not have happened: retry with the same key, mark done, mark failed.
    OutcomeUnknown,
    /// A client-side tool's call, allowed: the client runs it and answers with its result.
    ClientTool,
}

/// One attempt's end, before it is recorded.
enum Attempt {
    Done(ToolOutput),
    Failed(ToolError),
}

impl Worker {
    /// One tools step. `primed_role`: the run's user's role as read just before (see [`Primed`]);
    /// `context_role`: as read with the context of the model call that made the calls.
    ///
    /// The role read with the context is older than the model's answer (a real model's call takes
    /// seconds), so it serves only when every call it classifies would be asked about: nothing
    /// runs and nothing is refused before a human answers, and the answer is authorized with the
    /// role read then ([`AnswerView`](crate::store::AnswerView)). A call that would run, or be
    /// denied, has the role read afresh, as before; so a pause for an approval costs no read of
    /// its own (`tests/role_freshness.rs`).
    pub(super) async fn execute_tools(
        &mut self,
        primed_role: Option<Option<UserRole>>,
        context_role: Option<Option<UserRole>>,
    ) -> Result<bool, WorkerError> {
        let started = Instant::now();
        let pending = self.run.checkpoint.pending_call_ids.clone();
        let all_calls = match self.planned_calls.take() {
            // the model's calls, in the held commit that the first commit below writes
            Some(planned) => planned,
            None => self.store().list_tool_calls(&self.run.id).await?,
        };
        let calls: Vec<ToolCall> =
            pending.iter().filter_map(|id| all_calls.iter().find(|c| &c.id == id).cloned()).collect();
        let role = match (primed_role, context_role) {
            (Some(role), _) => role,
            (None, Some(role)) if !calls.is_empty() && calls.iter().all(|call| self.only_asked(call, role)) => role,
            (None, _) => self.inner.role_of(&self.run.user_id).await?,
        };
        let max_attempts = self.inner.config.tool_max_attempts.max(1);

        // announced with the commit that follows the classification
        self.deferred.push(EventKind::NodeStarted { node: nodes::TOOLS.into() });

        // Classify every call that is not settled yet.
        let mut to_ask: Vec<(ToolCall, Ask)> = Vec::new();
        let mut to_run: Vec<ToolCall> = Vec::new();
        for call in calls {
            let tool = self.agent.tools.get(&call.name).cloned();
            match call.state {
                ToolCallState::Requested => {
                    let Some(tool) = tool else {
                        let reason = format!("unknown tool {}", call.name);
                        self.settle_failed(&call, ToolCallState::Requested, &reason, "unknown_tool").await?;
                        continue;
                    };
                    if call.args.get("__invalid_json").is_some() {
                        let reason = "invalid arguments: the model's arguments were not valid JSON";
                        self.settle_failed(&call, ToolCallState::Requested, reason, "invalid").await?;
                        continue;
                    }
                    if let Some(Err(e)) = self.agent.tools.validate_args(&call.name, &call.args) {
                        let reason = format!("invalid arguments: {e}");
                        self.settle_failed(&call, ToolCallState::Requested, &reason, "invalid").await?;
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
                            // Written with the call's claim (or the step's pause, for a call the
                            // client makes): only reads come in between.
                            self.hold(c).await?;
                            let call = ToolCall { state: ToolCallState::Allowed, ..call };
                            if tool.client_side().is_some() {
                                to_ask.push((call, Ask::ClientTool));
                            } else {
                                to_run.push(call);
                            }
                        }
                        Policy::Ask => to_ask.push((call, Ask::Approval)),
                    }
                }
                // Allowed (by policy or a human), or asked and not answered: the client is asked.
                ToolCallState::Allowed | ToolCallState::Suspended
                    if tool.as_ref().is_some_and(|t| t.client_side().is_some()) =>
                {
                    to_ask.push((call, Ask::ClientTool))
                }
                ToolCallState::Allowed => to_run.push(call),
                ToolCallState::Executing => {
                    // Cut off by a crash mid-attempt: it may or may not have reached the tool.
                    let idempotent = tool.as_ref().is_some_and(|t| t.spec().idempotent);
                    if idempotent && call.attempts < max_attempts {
                        tracing::info!(run_id = %self.run.id, call_id = %call.id, "retrying an idempotent call cut off by a crash");
                        to_run.push(call);
                    } else if idempotent {
                        let reason = format!("no answer after {} attempts", call.attempts);
                        self.settle_failed(&call, ToolCallState::Executing, &reason, "timeout").await?;
                    } else {
                        let mut c = self.new_commit();
                        c.tool_calls.push(ToolCallChange::transition(&call.id, call.state, ToolCallState::Unknown));
                        self.commit(c).await?;
                        to_ask.push((ToolCall { state: ToolCallState::Unknown, ..call }, Ask::OutcomeUnknown));
                    }
                }
                ToolCallState::Unknown => to_ask.push((call, Ask::OutcomeUnknown)),
                ToolCallState::Asking => to_ask.push((call, Ask::Approval)),
                ToolCallState::Denied | ToolCallState::Succeeded | ToolCallState::Failed | ToolCallState::Suspended => {
                }
            }
        }

        // Read-only calls run concurrently; calls with side effects one at a time, in order.
        let (read_only, side_effects): (Vec<ToolCall>, Vec<ToolCall>) = to_run
            .into_iter()
            .partition(|c| self.agent.tools.get(&c.name).map(|t| !t.spec().side_effect).unwrap_or(true));
        // The role read above serves until a call has run: a side effect after other calls (which
        // may have taken a while) reads it again, just before it.
        let mut role_is_fresh = read_only.is_empty();
        to_ask.extend(self.run_calls(read_only, role).await?);
        if self.run.cancel_requested {
            return Ok(true);
        }
        for call in side_effects {
            let role = if std::mem::replace(&mut role_is_fresh, false) {
                role
            } else {
                self.inner.role_of(&self.run.user_id).await?
            };
            to_ask.extend(self.run_calls(vec![call], role).await?);
            if self.run.cancel_requested {
                return Ok(true);
            }
        }

        if !to_ask.is_empty() {
            // One interrupt asks one kind of question: calls whose outcome is unknown first; calls
            // waiting for an approval are asked about once those are decided; then client-side
            // calls, one per interrupt (each is answered on its own, by its call id).
            let kind = [Ask::OutcomeUnknown, Ask::Approval, Ask::ClientTool]
                .into_iter()
                .find(|k| to_ask.iter().any(|(_, a)| a == k))
                .unwrap_or(Ask::Approval);
            let (mut asked, later): (Vec<_>, Vec<_>) = to_ask.into_iter().partition(|(_, a)| *a == kind);
            let mut later: Vec<ToolCall> = later.into_iter().map(|(c, _)| c).collect();
            if kind == Ask::ClientTool {
                later.extend(asked.split_off(1).into_iter().map(|(c, _)| c));
            }
            let asked = asked.into_iter().map(|(c, _)| c).collect();
            if kind == Ask::ClientTool {
                self.pause_for_client(asked, later, started).await?;
            } else {
                self.pause_for(asked, kind, later, started).await?;
            }
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
        // Written with the model call's start: only a read of the context comes in between.
        self.hold(c).await?;
        Ok(true)
    }

    /// Classified with `role`, `call` neither runs nor is refused for that role: it is new, and
    /// its tool's policy for `role` is to ask (or there is no such tool, which fails whatever the
    /// role; so do arguments that are not valid, whatever the policy).
    fn only_asked(&self, call: &ToolCall, role: Option<UserRole>) -> bool {
        call.state == ToolCallState::Requested
            && self.agent.tools.get(&call.name).is_none_or(|tool| tool.spec().policy_for(role) == Policy::Ask)
    }

    fn tool_context(&self, call: &ToolCall, role: Option<UserRole>) -> ToolContext {
        ToolContext {
            call_id: call.id.clone(),
            idempotency_key: call.id.to_string(),
            attempt: call.attempts.max(1),
            run_id: self.run.id.clone(),
            conversation_id: self.run.conversation_id.clone(),
            agent_id: self.agent.id.clone(),
            user_id: self.run.user_id.clone(),
            role,
            now: self.now(),
        }
    }

    /// Prechecks, then attempts each call: every attempt is claimed (`executing`, attempts + 1,
    /// conditional) in a commit before the tool is called, so a crash leaves a call that says it may
    /// have been dispatched. A call that got no answer is tried again with the same key while its
    /// tool allows and attempts remain; otherwise it is recorded, or — no answer from a tool that
    /// is not idempotent — returned for a human to decide.
    ///
    /// `role` is the caller's, read just before (by the classification, or again after other calls
    /// ran): one read per batch, not a second one right after the first.
    async fn run_calls(
        &mut self,
        calls: Vec<ToolCall>,
        role: Option<UserRole>,
    ) -> Result<Vec<(ToolCall, Ask)>, WorkerError> {
        let mut unknown = Vec::new();
        if calls.is_empty() {
            return Ok(unknown);
        }
        let max_attempts = self.inner.config.tool_max_attempts.max(1);
        let mut round: Vec<(ToolCall, Arc<dyn Tool>)> = Vec::new();
        for call in calls {
            let Some(tool) = self.agent.tools.get(&call.name).cloned() else {
                let reason = format!("unknown tool {}", call.name);
                self.settle_failed(&call, call.state, &reason, "unknown_tool").await?;
                continue;
            };
            if tool.spec().side_effect && call.state == ToolCallState::Allowed {
                // Reload the resource and re-check it (and the caller) just before the side effect.
                if let Err(e) = tool.precheck(&self.tool_context(&call, role), &call.args).await {
                    self.settle_failed(&call, ToolCallState::Allowed, &e.to_string(), &e.code()).await?;
                    continue;
                }
            }
            round.push((call, tool));
        }
        let mut backoff = self.inner.config.tool_retry_backoff;
        while !round.is_empty() {
            // Claim this round's attempts. A round of calls that change nothing (run together)
            // claims them in one commit, held until their results are written with it, or at most
            // `delta_flush_interval` while they run: an attempt of a read-only call that a crash
            // leaves unrecorded is made again, and harms nothing. A call with a side effect is
            // claimed before it is made, always; and so is any call while a human's answer that
            // allows it is not written yet: of two answers only the one written stands, and a call
            // someone asked to approve (a read of private data, say) is not made on the other.
            let read_only = self.claim_answer.is_none() && round.iter().all(|(_, tool)| !tool.spec().side_effect);
            let mut claims: Option<Commit> = None;
            let mut claimed = Vec::new();
            for (call, tool) in round.drain(..) {
                let now = self.now();
                let mut c = self.new_commit();
                let attempts = call.attempts + 1;
                c.tool_calls.push(ToolCallChange::Update(ToolCallUpdate {
                    started_at: (call.attempts == 0).then_some(now),
                    attempts: Some(attempts),
                    ..ToolCallUpdate::new(&call.id, call.state, ToolCallState::Executing)
                }));
                if call.attempts == 0 {
                    c.events.push(EventKind::ToolStarted {
                        call_id: call.id.clone(),
                        tool: call.name.clone(),
                        args_summary: args_summary(&call.args),
                    });
                }
                if read_only {
                    claims = Some(match claims.take() {
                        Some(claims) => claims.then(c),
                        None => c,
                    });
                } else {
                    self.commit(c).await?;
                }
                claimed.push((ToolCall { state: ToolCallState::Executing, attempts, ..call }, tool));
            }
            let mut held_until = None;
            if let Some(claims) = claims {
                self.hold(claims).await?;
                held_until = Some(tokio::time::Instant::now() + self.inner.config.delta_flush_interval);
            }
            let contexts: Vec<ToolContext> = claimed.iter().map(|(call, _)| self.tool_context(call, role)).collect();
            let metrics = self.inner.config.metrics.clone();
            let metrics = &metrics;
            let calls = futures::future::join_all(claimed.iter().zip(contexts.iter()).map(|((call, tool), ctx)| {
                // Ids and the tool's name only: arguments and results may hold anything.
                let span = tracing::info_span!(
                    "tool_call",
                    call_id = %call.id,
                    tool = %call.name,
                    attempt = call.attempts,
                    outcome = tracing::field::Empty,
                );
                let limit = tool.spec().timeout;
                async move {
                    let started = Instant::now();
                    let output = match tokio::time::timeout(limit + TIMEOUT_GRACE, tool.execute(ctx, &call.args)).await
                    {
                        Ok(Ok(output)) => Attempt::Done(output),
                        Ok(Err(e)) => Attempt::Failed(e),
                        Err(_) => {
                            Attempt::Failed(ToolError::Timeout(format!("no answer within {} ms", limit.as_millis())))
                        }
                    };
                    let outcome = if matches!(output, Attempt::Done(_)) { "success" } else { "error" };
                    tracing::Span::current().record("outcome", outcome);
                    metrics.tool_call(&call.name, outcome, started.elapsed());
                    output
                }
                .instrument(span)
            }));
            // A cancel of the run stops its calls in flight: their futures are dropped, which a tool
            // may pass on (an MCP tool sends `notifications/cancelled`).
            let cancel = self.cancel_signal.clone();
            let calls = async move {
                tokio::select! {
                    outcomes = calls => Some(outcomes),
                    _ = cancel.notified() => None,
                }
            };
            let outcomes = self.await_holding(calls, held_until).await?;
            let Some(outcomes) = outcomes else {
                for (call, _) in &claimed {
                    let reason = "the run was cancelled while this call ran: it was stopped, and may or may not \
                                  have taken effect";
                    self.settle_failed(call, ToolCallState::Executing, reason, "cancelled").await?;
                }
                self.run.cancel_requested = true;
                return Ok(unknown);
            };
            let mut retry = Vec::new();
            for ((call, tool), outcome) in claimed.into_iter().zip(outcomes) {
                let outcome = match outcome {
                    Attempt::Done(output) => match self.agent.tools.validate_result(&call.name, &output.result) {
                        Ok(()) => Attempt::Done(output),
                        Err(v) => Attempt::Failed(ToolError::BadResponse(format!("the result breaks its schema: {v}"))),
                    },
                    failed => failed,
                };
                match outcome {
                    Attempt::Done(output) => self.record_result(&call, output).await?,
                    Attempt::Failed(error) => match error.next(tool.spec().idempotent) {
                        NextAttempt::Retry if call.attempts < max_attempts => {
                            tracing::info!(run_id = %self.run.id, call_id = %call.id, attempt = call.attempts,
                                code = %error.code(), "the call got no answer; trying again with the same key");
                            retry.push((call, tool));
                        }
                        NextAttempt::AskHuman => {
                            let mut c = self.new_commit();
                            c.tool_calls.push(ToolCallChange::transition(&call.id, call.state, ToolCallState::Unknown));
                            self.commit(c).await?;
                            unknown.push((ToolCall { state: ToolCallState::Unknown, ..call }, Ask::OutcomeUnknown));
                        }
                        NextAttempt::Retry | NextAttempt::Fail => {
                            let reason = if matches!(error.next(true), NextAttempt::Retry) && call.attempts > 1 {
                                format!("{error} (after {} attempts)", call.attempts)
                            } else {
                                error.to_string()
                            };
                            self.settle_failed(&call, ToolCallState::Executing, &reason, &error.code()).await?;
                        }
                    },
                }
            }
            if !retry.is_empty() {
                if self.run.cancel_requested || self.inner.shutting_down.load(Ordering::SeqCst) {
                    // Left `executing`: whoever continues the run retries them (they are idempotent).
                    return Ok(unknown);
                }
                self.flush_held().await?;
                tokio::time::sleep(backoff).await;
                backoff = backoff.saturating_mul(2);
            }
            round = retry;
        }
        Ok(unknown)
    }

    async fn record_result(&mut self, call: &ToolCall, output: ToolOutput) -> Result<(), StoreError> {
        let now = self.now();
        let mut c = self.new_commit();
        let result = Masked::new(bound_result(output.result, self.agent.context.tool_result_max_bytes));
        let summary = Masked::truncated(&output.summary, 200);
        c.tool_calls.push(ToolCallChange::Update(ToolCallUpdate {
            result: Some(result.clone()),
            summary: Some(summary.clone()),
            finished_at: Some(now),
            ..ToolCallUpdate::new(&call.id, ToolCallState::Executing, ToolCallState::Succeeded)
        }));
        c.messages.push(tool_message(&self.run, &call.id, &result, now));
        c.events.push(EventKind::ToolFinished {
            call_id: call.id.clone(),
            tool: call.name.clone(),
            status: ToolOutcomeStatus::Success,
            summary,
            error_code: None,
        });
        let mut known = None;
        if !output.facts.is_empty() {
            for (key, value) in &output.facts {
                c.facts.push(Fact {
                    key: key.clone(),
                    value: Masked::fact(key, value),
                    source: FactSource::ToolResult,
                    updated_at: now,
                });
            }
            let mut facts = match self.known_facts.take() {
                Some(known) => known,
                None => crate::domain::fact_map(&self.store().list_facts(&self.run.conversation_id).await?),
            };
            facts.extend(crate::domain::fact_map(&c.facts));
            c.events.push(EventKind::FactsUpdated { facts: facts.clone() });
            known = Some(facts);
        }
        self.commit(c).await?;
        // known again once written
        if known.is_some() {
            self.known_facts = known;
        }
        Ok(())
    }

    /// Records a call that failed (or never started): the model is told why and what kind of failure
    /// it was; no fact is written.
    async fn settle_failed(
        &mut self,
        call: &ToolCall,
        from: ToolCallState,
        reason: &str,
        code: &str,
    ) -> Result<(), StoreError> {
        let now = self.now();
        let reason = Masked::truncated(reason, 300);
        let result = Masked::new(json!({"status": "error", "code": code, "error": reason}));
        let mut c = self.new_commit();
        if from == ToolCallState::Requested {
            // Never allowed: go through `allowed` so the state machine holds.
            c.tool_calls.push(ToolCallChange::transition(&call.id, from, ToolCallState::Allowed));
        }
        c.tool_calls.push(ToolCallChange::Update(ToolCallUpdate {
            result: Some(result.clone()),
            summary: Some(reason.clone()),
            finished_at: Some(now),
            ..ToolCallUpdate::new(
                &call.id,
                if from == ToolCallState::Requested { ToolCallState::Allowed } else { from },
                ToolCallState::Failed,
            )
        }));
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
            error_code: Some(code.to_owned()),
        });
        self.commit(c).await.map(|_| ())
    }

    /// Interrupt + checkpoint + `interrupted` + `interrupt` event, one transaction. `later` are calls
    /// of this step that wait for another question once this one is answered.
    async fn pause_for(
        &mut self,
        calls: Vec<ToolCall>,
        ask: Ask,
        later: Vec<ToolCall>,
        tools_started: Instant,
    ) -> Result<(), StoreError> {
        let mut c = self.new_commit();
        // the interrupt is made at the commit's time (see `commit_pause`)
        let now = c.now;
        let expires_at = now + chrono_dur(self.inner.config.interrupt_ttl);
        let mut actions = Vec::new();
        let unknown = ask == Ask::OutcomeUnknown;
        for call in calls.iter().chain(later.iter()) {
            if call.state == ToolCallState::Requested {
                c.tool_calls.push(ToolCallChange::transition(&call.id, call.state, ToolCallState::Asking));
            }
        }
        for call in &calls {
            let desc = self.agent.tools.get(&call.name).map(|t| t.describe(&call.args));
            let mut action = json!({
                "callId": call.id,
                "tool": call.name,
                "args": call.args,
                "title": desc.as_ref().map(|d| d.title.clone()),
                "risk": desc.as_ref().map(|d| d.risk.clone()),
                "description": desc.as_ref().map(|d| d.description.clone()),
            });
            if unknown {
                action["outcome"] = json!("unknown");
                action["attempts"] = json!(call.attempts);
            }
            actions.push(action);
        }
        let title = match (calls.len(), unknown) {
            (1, true) => format!(
                "{}: no answer came back. Did it happen?",
                actions[0]["title"].as_str().map(|t| t.trim_end_matches('?')).unwrap_or("The action")
            ),
            (n, true) => format!("{n} actions got no answer. Did they happen?"),
            (1, false) => actions[0]["title"].as_str().unwrap_or("Confirm the action").to_owned(),
            (n, false) => format!("Confirm {n} actions"),
        };
        let risk = if unknown {
            "The request was sent and no answer came back (a timeout, or the process stopped), so it may or may \
             not have happened. Check the target, then retry it with the same idempotency key, or say it was \
             done, or that it failed."
                .to_owned()
        } else {
            actions.iter().filter_map(|a| a["risk"].as_str()).collect::<Vec<_>>().join(" ")
        };
        let decisions =
            if unknown { json!(["retry", "mark_done", "mark_failed"]) } else { json!(["approve", "reject", "edit"]) };
        let payload = Masked::new(json!({
            "title": title, "risk": risk, "actions": actions, "outcomeUnknown": unknown, "decisions": decisions,
        }));
        let kind = if unknown { InterruptKind::OutcomeUnknown } else { InterruptKind::ConfirmAction };
        self.commit_pause(c, kind, payload, &calls, &later, expires_at, tools_started).await
    }

    /// Hands a client-side call to the client: the call starts (`executing`, its one attempt,
    /// `tool_started`) and is `suspended` until the client's answer, under a `tool_call` interrupt
    /// whose payload carries its id, name and arguments — one transaction, like any pause.
    async fn pause_for_client(
        &mut self,
        calls: Vec<ToolCall>,
        later: Vec<ToolCall>,
        tools_started: Instant,
    ) -> Result<(), StoreError> {
        let mut c = self.new_commit();
        // the interrupt is made at the commit's time (see `commit_pause`)
        let now = c.now;
        let mut actions = Vec::new();
        let mut answer_within = self.inner.config.interrupt_ttl;
        for call in &calls {
            let tool = self.agent.tools.get(&call.name);
            if let Some(within) = tool.and_then(|t| t.client_side()).and_then(|s| s.answer_within) {
                answer_within = answer_within.min(within);
            }
            if call.state == ToolCallState::Allowed {
                c.tool_calls.push(ToolCallChange::Update(ToolCallUpdate {
                    started_at: Some(now),
                    attempts: Some(call.attempts + 1),
                    ..ToolCallUpdate::new(&call.id, call.state, ToolCallState::Executing)
                }));
                c.tool_calls.push(ToolCallChange::transition(
                    &call.id,
                    ToolCallState::Executing,
                    ToolCallState::Suspended,
                ));
                c.events.push(EventKind::ToolStarted {
                    call_id: call.id.clone(),
                    tool: call.name.clone(),
                    args_summary: args_summary(&call.args),
                });
            }
            let spec = tool.map(|t| t.spec());
            actions.push(json!({
                "callId": call.id,
                "tool": call.name,
                "args": call.args,
                "description": spec.map(|s| s.description.clone()),
                "argsSchema": spec.map(|s| s.parameters.clone()),
                "resultSchema": spec.and_then(|s| s.result_schema.clone()),
            }));
        }
        for call in &later {
            if call.state == ToolCallState::Requested {
                c.tool_calls.push(ToolCallChange::transition(&call.id, call.state, ToolCallState::Asking));
            }
        }
        let expires_at = now + chrono_dur(answer_within);
        let first = calls.first();
        let payload = Masked::new(json!({
            "title": format!("Waiting for {}", first.map(|c| c.name.as_str()).unwrap_or("the client")),
            "callId": first.map(|c| c.id.clone()),
            "tool": first.map(|c| c.name.clone()),
            "args": first.map(|c| c.args.clone()),
            "actions": actions,
            "outcomeUnknown": false,
            "decisions": [],
        }));
        self.commit_pause(c, InterruptKind::ToolCall, payload, &calls, &later, expires_at, tools_started).await
    }

    /// The pause itself, whatever asks: the interrupt for `calls` with its payload, the tools node's
    /// end, the approval node's start, the `interrupt` event, the run `interrupted`, and a
    /// checkpoint that waits for the interrupt with every call of the step still open (the asked
    /// ones, and `later`, asked about next) — in the one commit `c`.
    #[allow(clippy::too_many_arguments)]
    async fn commit_pause(
        &mut self,
        mut c: Commit,
        kind: InterruptKind,
        payload: Masked<Value>,
        calls: &[ToolCall],
        later: &[ToolCall],
        expires_at: Timestamp,
        tools_started: Instant,
    ) -> Result<(), StoreError> {
        let interrupt = Interrupt {
            id: InterruptId::new(),
            run_id: self.run.id.clone(),
            kind,
            status: InterruptStatus::Pending,
            payload: payload.clone(),
            call_ids: calls.iter().map(|c| c.id.clone()).collect(),
            created_at: c.now,
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
        c.run = Some(RunChange { to: RunStatus::Interrupted, reason: None, via: None });
        let mut cp = self.run.checkpoint.clone();
        cp.next_step = NextStep::AwaitInterrupt;
        cp.pending_call_ids = interrupt.call_ids.iter().cloned().chain(later.iter().map(|c| c.id.clone())).collect();
        c.checkpoint = Some(cp);
        self.commit(c).await.map(|_| ())
    }
}

/// A client-side call that will get no answer (its interrupt expired, or the run was cancelled):
/// it failed, and the model would be told why.
pub(super) fn fail_unanswered(commit: &mut Commit, run: &Run, call: &ToolCall, reason: &str, now: Timestamp) {
    let reason = Masked::from(reason);
    let result = Masked::new(json!({"status": "error", "code": "unanswered", "error": reason}));
    commit.tool_calls.push(ToolCallChange::Update(ToolCallUpdate {
        result: Some(result.clone()),
        summary: Some(reason.clone()),
        finished_at: Some(now),
        ..ToolCallUpdate::new(&call.id, call.state, ToolCallState::Failed)
    }));
    commit.messages.push(tool_message(run, &call.id, &result, now));
    commit.events.push(EventKind::ToolFinished {
        call_id: call.id.clone(),
        tool: call.name.clone(),
        status: ToolOutcomeStatus::Error,
        summary: reason,
        error_code: Some("unanswered".to_owned()),
    });
}

/// A denied call: the synthetic result the model sees, and the events the client sees.
pub(super) fn deny_call(commit: &mut Commit, run: &Run, call: &ToolCall, reason: &str, now: Timestamp) {
    let reason = Masked::from(reason);
    let result = Masked::from(json!({"status": "denied", "reason": reason}));
    commit.tool_calls.push(ToolCallChange::Update(ToolCallUpdate {
        result: Some(result.clone()),
        summary: Some(reason.clone()),
        finished_at: Some(now),
        ..ToolCallUpdate::new(&call.id, call.state, ToolCallState::Denied)
    }));
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
        error_code: None,
    });
}

/// A call whose outcome was unknown, settled by a human: done (it happened) or failed (it did not,
/// or failed). The model is told who said so, and their note.
pub(super) fn settle_by_human(
    commit: &mut Commit,
    run: &Run,
    call: &ToolCall,
    done: bool,
    user_id: &str,
    note: Option<&str>,
    now: Timestamp,
) {
    let note = note.map(str::trim).filter(|n| !n.is_empty());
    let said = match (done, note) {
        (true, Some(n)) => format!("marked done by {user_id}: {n}"),
        (true, None) => format!("marked done by {user_id}"),
        (false, Some(n)) => format!("marked failed by {user_id}: {n}"),
        (false, None) => format!("marked failed by {user_id}"),
    };
    let summary = Masked::truncated(&said, 200);
    let result = if done {
        Masked::new(json!({"status": "done", "confirmedBy": user_id, "note": note}))
    } else {
        Masked::new(json!({"status": "error", "code": "marked_failed", "error": said}))
    };
    commit.tool_calls.push(ToolCallChange::Update(ToolCallUpdate {
        result: Some(result.clone()),
        summary: Some(summary.clone()),
        finished_at: Some(now),
        ..ToolCallUpdate::new(&call.id, call.state, if done { ToolCallState::Succeeded } else { ToolCallState::Failed })
    }));
    commit.messages.push(tool_message(run, &call.id, &result, now));
    commit.events.push(EventKind::ToolFinished {
        call_id: call.id.clone(),
        tool: call.name.clone(),
        status: if done { ToolOutcomeStatus::Success } else { ToolOutcomeStatus::Error },
        summary,
        error_code: (!done).then(|| "marked_failed".to_owned()),
    });
}

pub(super) fn tool_message(run: &Run, call_id: &CallId, result: &Masked<Value>, now: Timestamp) -> Message {
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

/// The length of `value`'s JSON text, counted as serde_json writes it (nothing is kept).
fn serialized_len(value: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // writing into a counter cannot fail, and a `Value` always serializes
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// `name(key=value, …)`-style, masked and short.
pub(super) fn args_summary(args: &Masked<Value>) -> Masked<String> {
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

/// A result no larger than `max_bytes` as JSON text: a larger one becomes an explicit marker with
/// its total size and the start of its text, so neither the store, the context nor an event grows
/// with what a tool returns.
pub fn bound_result(result: Value, max_bytes: usize) -> Value {
    // Counted, not written out: most results fit, and need no text here.
    if serialized_len(&result) <= max_bytes {
        return result;
    }
    let text = result.to_string();
    let marker = |end: usize| {
        json!({
            "truncated": true,
            "totalBytes": text.len(),
            "shownBytes": end,
            "preview": &text[..end],
            "note": "the result was larger than the agent's tool_result_max_bytes; only its start is shown",
        })
    };
    // The preview is JSON inside a string: escaping can make it longer than the text it shows, so
    // it is shortened until the whole marker fits.
    let mut end = max_bytes.saturating_sub(256).min(text.len());
    loop {
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let cut = marker(end);
        let over = cut.to_string().len().saturating_sub(max_bytes);
        if over == 0 || end == 0 {
            return cut;
        }
        end = end.saturating_sub(over.max(16));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_results_are_cut_with_a_marker() {
        let small = json!({"a": 1});
        assert_eq!(bound_result(small.clone(), 1024), small);
        let big = json!({"items": (0..5000).map(|i| format!("item-{i}")).collect::<Vec<_>>()});
        let total = big.to_string().len();
        let cut = bound_result(big, 2048);
        assert_eq!(cut["truncated"], true);
        assert_eq!(cut["totalBytes"], total);
        assert!(cut.to_string().len() <= 2048, "{}", cut.to_string().len());
        let multibyte = json!({"text": "错".repeat(3000)});
        let cut = bound_result(multibyte, 1000);
        assert!(cut["preview"].as_str().is_some());
    }

    #[test]
    fn a_result_exactly_at_the_limit_is_kept_whole() {
        for value in [
            json!(null),
            json!({"a": [1, 2.5, "x\"y\\z\n\u{1}"], "错": {"b": true}}),
            json!({"items": (0..300).map(|i| format!("item-{i}")).collect::<Vec<_>>()}),
        ] {
            let len = value.to_string().len();
            assert_eq!(serialized_len(&value), len);
            assert_eq!(bound_result(value.clone(), len), value);
            if len > 300 {
                assert_eq!(bound_result(value.clone(), len - 1)["truncated"], true);
            }
        }
    }
}
