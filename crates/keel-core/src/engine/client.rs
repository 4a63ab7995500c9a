//! The answer to a client-side tool's call (`POST /v1/runs/{id}/tool-results`): the result, or
//! the error, the client got running it. It resolves the call's `tool_call` interrupt with the
//! same conditional claim a resume uses, so of any number of answers exactly one is recorded and
//! the run continues once.

use super::resume::Replayed;
use super::*;

/// What the client says of one call it ran.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientOutcome {
    /// The call's result: checked against the tool's `result_schema`, masked and bounded like any
    /// tool result, then what the model sees.
    Result(Value),
    /// The call failed on the client: the model is told this (masked, at most 300 characters).
    Error(String),
}

/// A client's answer, after transport-level parsing.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolResultRequest {
    pub call_id: String,
    pub outcome: ClientOutcome,
    pub idempotency_key: String,
}

/// The answer to an accepted tool result, stored under its idempotency key and given again on a
/// retry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ToolResultAccepted {
    pub run_id: RunId,
    pub call_id: CallId,
    pub interrupt_id: InterruptId,
    pub status: RunStatus,
    /// `success` or `error`: what the call became.
    pub outcome: ToolOutcomeStatus,
    /// The sequence of the `resumed` event: a stream answering this request starts there.
    pub resumed_sequence: i64,
}

impl Engine {
    /// Records a client-side call's result and continues the run, in the order a resume takes:
    /// find the call and its pending interrupt, check expiry, validate the result, reserve the
    /// idempotency key, claim the interrupt (one winner), continue.
    pub async fn submit_tool_result(
        &self,
        user_id: &str,
        run_id: &RunId,
        req: ToolResultRequest,
    ) -> EngineResult<ToolResultAccepted> {
        let outcome = self.submit_tool_result_once(user_id, run_id, req).await;
        self.count_answer("tool_result", outcome)
    }

    async fn submit_tool_result_once(
        &self,
        user_id: &str,
        run_id: &RunId,
        req: ToolResultRequest,
    ) -> EngineResult<(ToolResultAccepted, Replayed)> {
        if self.is_shutting_down() {
            return Err(EngineError::ShuttingDown);
        }
        let inner = &self.inner;
        // The run, its interrupts and calls, and the caller's role: one read.
        let (run, view) = self.answer_view(user_id, run_id).await?;
        check_key(&req.idempotency_key)?;
        let agent = inner.agent_of_run(&run).ok_or(EngineError::UnknownAgent)?;
        // The call: one of this run's, of a client-side tool. The id is the client's: never echoed.
        let unknown = || EngineError::UnknownCall("callId: not a client-side tool call of this run".into());
        let call_id = CallId::parse(&req.call_id).map_err(|_| unknown())?;
        let calls = view.tool_calls;
        let call = calls.iter().find(|c| c.id == call_id).ok_or_else(unknown)?;
        if agent.tools.get(&call.name).and_then(|t| t.client_side()).is_none() {
            return Err(unknown());
        }
        // The caller as of now (the read above): a role the tool's policy denies may not answer for it.
        let role = inner.role_or_default(view.role);
        if agent.tools.get(&call.name).map(|t| t.spec().policy_for(role)).unwrap_or(Policy::Deny) == Policy::Deny {
            return Err(EngineError::Forbidden(format!(
                "your role ({}) may not answer for {}",
                role.map(|r| r.as_str()).unwrap_or("none"),
                call.name
            )));
        }
        // Its interrupt: the last `tool_call` interrupt that asked for it.
        let interrupt = view
            .interrupts
            .into_iter()
            .rev()
            .find(|i| i.kind == InterruptKind::ToolCall && i.call_ids.contains(&call_id))
            .ok_or_else(|| EngineError::UnknownCall("callId: the client has not been asked for this call".into()))?;

        // The answer, checked as it would be stored: masked, and against the result schema.
        let outcome = match &req.outcome {
            ClientOutcome::Result(value) => {
                let masked = mask_value(value);
                if let Err(v) = agent.tools.validate_result(&call.name, &masked) {
                    return Err(EngineError::InvalidResult(format!(
                        "result breaks {}'s result schema at {v}",
                        call.name
                    )));
                }
                ClientOutcome::Result(masked)
            }
            ClientOutcome::Error(message) => {
                if message.trim().is_empty() || message.contains('\0') {
                    return Err(EngineError::Invalid(
                        "error: must be a non-empty message without NUL characters".into(),
                    ));
                }
                ClientOutcome::Error(truncate(message, 300))
            }
        };

        // Expiry, then the claim, which stores its answer under the key (the same request again gets
        // the first answer: see `under_key`).
        let now = inner.clock.now();
        self.refuse_if_expired(&interrupt, now).await?;
        let hash = result_hash(run_id, &call_id, &outcome);
        let key = (req.idempotency_key.as_str(), hash.as_str());
        let claim =
            self.claim_tool_result(&run, &interrupt, (&calls, &view.facts), call, outcome, (user_id, role), key, now);
        self.under_key(user_id, &req.idempotency_key, &hash, "tool-result", claim).await
    }

    #[allow(clippy::too_many_arguments)]
    async fn claim_tool_result(
        &self,
        run: &Run,
        interrupt: &Interrupt,
        (calls, facts): (&[ToolCall], &[Fact]),
        call: &ToolCall,
        outcome: ClientOutcome,
        (user_id, role): (&str, Option<UserRole>),
        (key, request_hash): (&str, &str),
        now: Timestamp,
    ) -> EngineResult<ToolResultAccepted> {
        let inner = &self.inner;
        if interrupt.status != InterruptStatus::Pending || call.state != ToolCallState::Suspended {
            return Err(EngineError::ToolCallAlreadyAnswered);
        }
        let agent = inner.agent_of_run(run).ok_or(EngineError::UnknownAgent)?;
        let owner = inner.lease_token();
        let lease_until = now + chrono_dur(inner.config.lease_ttl);
        let mut commit = Commit::new(
            run.id.clone(),
            Fence::Acquire { owner: owner.clone(), from: vec![RunStatus::Interrupted], lease_until },
            now,
        );
        let status = match outcome {
            ClientOutcome::Result(_) => ToolOutcomeStatus::Success,
            ClientOutcome::Error(_) => ToolOutcomeStatus::Error,
        };
        // What the interrupt and `resumed` record: which call, and how it ended — never the result.
        let decision = Masked::new(json!({"toolResult": {"callId": call.id, "status": status}}));
        commit.interrupt_changes.push(InterruptChange {
            id: interrupt.id.clone(),
            to: InterruptStatus::Resolved,
            decision: Some(decision.clone()),
            note: None,
            resolved_by: Some(user_id.to_owned()),
        });
        commit.run = Some(RunChange { to: RunStatus::Running, reason: None, via: None });
        let human_wait_ms = (now - interrupt.created_at).num_milliseconds().max(0) as u64;
        commit.events.push(EventKind::Resumed {
            interrupt_id: interrupt.id.clone(),
            decision,
            note: None,
            human_wait_ms,
            resolved_by: user_id.to_owned(),
        });
        commit.events.push(EventKind::NodeFinished { node: nodes::APPROVAL.into(), duration_ms: human_wait_ms });
        let (to, result, summary, error_code) = match outcome {
            ClientOutcome::Result(value) => {
                let result = Masked::new(bound_result(value, agent.context.tool_result_max_bytes));
                (ToolCallState::Succeeded, result, Masked::from(format!("answered by the client ({user_id})")), None)
            }
            ClientOutcome::Error(message) => {
                let message = Masked::truncated(&message, 300);
                let result = Masked::new(json!({"status": "error", "code": "client_error", "error": message}));
                (ToolCallState::Failed, result, message, Some("client_error".to_owned()))
            }
        };
        commit.tool_calls.push(ToolCallChange::Update(ToolCallUpdate {
            result: Some(result.clone()),
            summary: Some(summary.clone()),
            finished_at: Some(now),
            ..ToolCallUpdate::new(&call.id, ToolCallState::Suspended, to)
        }));
        commit.messages.push(tool_message(run, &call.id, &result, now));
        commit.events.push(EventKind::ToolFinished {
            call_id: call.id.clone(),
            tool: call.name.clone(),
            status,
            summary,
            error_code,
        });
        // Every call of the step still open goes back to the tools step: another client call is
        // asked next, a settled one is skipped.
        let mut checkpoint = run.checkpoint.clone();
        checkpoint.next_step = NextStep::ExecuteTools;
        commit.checkpoint = Some(checkpoint);
        let accepted = ToolResultAccepted {
            run_id: run.id.clone(),
            call_id: call.id.clone(),
            interrupt_id: interrupt.id.clone(),
            status: RunStatus::Running,
            outcome: status,
            resumed_sequence: run.next_sequence,
        };
        commit.idempotency = Some(IdempotencyAnswer {
            user_id: user_id.to_owned(),
            key: key.to_owned(),
            request_hash: request_hash.to_owned(),
            status: 200,
            response: serde_json::to_value(&accepted).unwrap_or(Value::Null),
            expires_at: now + chrono::Duration::hours(24),
        });
        let primed = Primed::after(&commit, (calls, facts), run, user_id, role);
        let resumed_sequence = self.commit_claim(run, interrupt, commit, owner, primed).await.map_err(|e| match e {
            EngineError::InterruptAlreadyResolved => EngineError::ToolCallAlreadyAnswered,
            other => other,
        })?;
        if resumed_sequence != accepted.resumed_sequence {
            tracing::warn!(run_id = %run.id, "the resumed event's sequence differed from the run's next sequence");
            let accepted = ToolResultAccepted { resumed_sequence, ..accepted };
            let body = serde_json::to_value(&accepted).unwrap_or(Value::Null);
            inner.store.idempotency_complete(user_id, key, 200, &body).await?;
            return Ok(accepted);
        }
        Ok(accepted)
    }
}

/// An idempotency key is an opaque id of 1 to 200 characters that does not look like a secret.
pub(super) fn check_key(key: &str) -> EngineResult<()> {
    if key.is_empty() || key.len() > 200 {
        return Err(EngineError::Invalid("idempotencyKey: must be 1 to 200 characters".into()));
    }
    if looks_secret(key) {
        // It would be stored and echoed in errors and logs: an id must not be a credential.
        return Err(EngineError::Invalid(
            "idempotencyKey: looks like a secret (a key, token or password); use an opaque id".into(),
        ));
    }
    Ok(())
}

fn result_hash(run_id: &RunId, call_id: &CallId, outcome: &ClientOutcome) -> String {
    let mut h = Sha256::new();
    h.update(b"tool-result\n");
    h.update(run_id.as_str());
    h.update(b"\n");
    h.update(call_id.as_str());
    h.update(b"\n");
    match outcome {
        ClientOutcome::Result(v) => {
            h.update(b"result\n");
            h.update(v.to_string());
        }
        ClientOutcome::Error(e) => {
            h.update(b"error\n");
            h.update(e);
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}
