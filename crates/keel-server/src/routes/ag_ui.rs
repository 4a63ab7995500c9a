//! `POST /v1/ag-ui` (and `/v1/ag-ui/{agent}`): AG-UI 1.0 over SSE, a view of a Keel run.
//!
//! A `RunAgentInput` either starts a turn (its last user message is new to Keel), answers the
//! interrupt a previous AG-UI run ended with (`resume`), or answers a frontend tool's call (a `tool`
//! message at its end), through the same engine calls as the REST routes. The response maps the
//! run's stored-then-live events (`Engine::events`, the source of the native SSE stream) through
//! [`crate::ag_ui::Mapper`]. docs/ag-ui.md has the details.

use std::collections::HashMap;
use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::response::Response;
use futures::StreamExt;
use keel_core::engine::{Decision, EngineError, ResumeRequest, SendMessage, ToolResultAccepted, ToolResultRequest};
use keel_core::stream::{Known, Until};
use keel_core::{CallId, Conversation, ConversationId, Event, EventKind, MessageId, RunId};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::SendTimeoutError;
use tokio_stream::wrappers::ReceiverStream;

use crate::ag_ui::input::{self, ResumeStatus, RunAgentInput};
use crate::ag_ui::{needs_snapshot, Lookup, Mapper, Snapshot};
use crate::error::{ApiError, ApiResult};
use crate::extract::{ApiJson, Caller};
use crate::limits::StreamPermit;
use crate::openapi::AgUiEventFrame;
use crate::sse;
use crate::state::AppState;
use crate::views::ErrorBody;

/// The namespaces of the ids AG-UI clients choose ([`keel_core::store::BindingStore`]): a
/// `threadId` per user, bound to a conversation; a client's message id per conversation, bound to
/// the message Keel stored for it.
pub const THREADS: &str = "ag_ui.thread";
pub const MESSAGES: &str = "ag_ui.message";

#[utoipa::path(
    post,
    path = "/v1/ag-ui",
    operation_id = "agUiRun",
    tag = "streams",
    request_body(content = RunAgentInput, description = "AG-UI's `RunAgentInput`; the fields Keel does not read are accepted and ignored"),
    responses(
        (status = 200, description = "AG-UI events over SSE, until the run pauses or ends", content_type = "text/event-stream", body = AgUiEventFrame),
        (status = 400, description = "`MALFORMED_JSON`, `JSON_TOO_DEEP`, `INVALID_BODY`", body = ErrorBody),
        (status = 413, description = "`PAYLOAD_TOO_LARGE`", body = ErrorBody),
        (status = 415, description = "`UNSUPPORTED_MEDIA_TYPE`: the body is not declared JSON", body = ErrorBody),
        (status = 404, description = "`NOT_FOUND`: the thread is another user's; an unknown interrupt", body = ErrorBody),
        (status = 409, description = "`RUN_ACTIVE`, `RUN_NOT_INTERRUPTED`, `INTERRUPT_ALREADY_RESOLVED`, `TOOL_CALL_ALREADY_ANSWERED`", body = ErrorBody),
        (status = 410, description = "`INTERRUPT_EXPIRED`", body = ErrorBody),
        (status = 422, description = "`VALIDATION_FAILED`, `INVALID_DECISION`, `INVALID_ARGS`, `INVALID_RESULT` (a frontend tool's result)", body = ErrorBody),
        (status = 403, description = "`FORBIDDEN`: the caller's role may not decide this", body = ErrorBody),
    )
)]
pub async fn run(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(input): ApiJson<RunAgentInput>,
) -> ApiResult<Response> {
    start(state, caller, input, None).await
}

/// The same, for the agent named in the path (`GET /v1/agents` lists them): a new thread's
/// conversation talks to it; an existing thread keeps its conversation's agent.
#[utoipa::path(
    post,
    path = "/v1/ag-ui/{agent}",
    operation_id = "agUiRunAgent",
    tag = "streams",
    params(("agent" = String, Path, description = "An agent's id (`GET /v1/agents`)")),
    request_body(content = RunAgentInput, description = "AG-UI's `RunAgentInput`; the fields Keel does not read are accepted and ignored"),
    responses(
        (status = 200, description = "AG-UI events over SSE, until the run pauses or ends", content_type = "text/event-stream", body = AgUiEventFrame),
        (status = 400, description = "`MALFORMED_JSON`, `JSON_TOO_DEEP`, `INVALID_BODY`", body = ErrorBody),
        (status = 413, description = "`PAYLOAD_TOO_LARGE`", body = ErrorBody),
        (status = 415, description = "`UNSUPPORTED_MEDIA_TYPE`: the body is not declared JSON", body = ErrorBody),
        (status = 404, description = "`NOT_FOUND`: no such agent; the thread is another user's; an unknown interrupt", body = ErrorBody),
        (status = 409, description = "`RUN_ACTIVE`, `RUN_NOT_INTERRUPTED`, `INTERRUPT_ALREADY_RESOLVED`, `TOOL_CALL_ALREADY_ANSWERED`", body = ErrorBody),
        (status = 410, description = "`INTERRUPT_EXPIRED`", body = ErrorBody),
        (status = 422, description = "`VALIDATION_FAILED` (also: the thread's conversation talks to another agent), `INVALID_DECISION`, `INVALID_ARGS`, `INVALID_RESULT` (a frontend tool's result)", body = ErrorBody),
        (status = 403, description = "`FORBIDDEN`: the caller's role may not decide this", body = ErrorBody),
    )
)]
pub async fn run_agent(
    State(state): State<AppState>,
    caller: Caller,
    Path(agent): Path<String>,
    ApiJson(input): ApiJson<RunAgentInput>,
) -> ApiResult<Response> {
    if state.engine.agents().get(&agent).is_none() {
        return Err(ApiError::not_found());
    }
    start(state, caller, input, Some(agent)).await
}

async fn start(state: AppState, caller: Caller, input: RunAgentInput, agent: Option<String>) -> ApiResult<Response> {
    input.validate().map_err(ApiError::validation)?;
    // A stream's slot is taken before anything happens, so a refused stream starts nothing.
    let permit = state.limits.streams.acquire(&caller.0)?;
    let engine = state.engine.clone();
    let store = engine.store().clone();
    let resume = input.resume.as_deref().unwrap_or_default();
    if !resume.is_empty() {
        // Answers to the interrupt a previous AG-UI run of this thread ended with.
        let not_found = || ApiError::from(EngineError::NotFound("interrupt"));
        let conversation =
            thread_conversation(&state, &caller, &input, agent.as_deref(), false).await?.ok_or_else(not_found)?;
        let mut entries = Vec::new();
        let mut keel_interrupt = None;
        for (i, entry) in resume.iter().enumerate() {
            let (interrupt, call) = input::parse_interrupt_id(&entry.interrupt_id).ok_or_else(not_found)?;
            if *keel_interrupt.get_or_insert_with(|| interrupt.clone()) != interrupt {
                return Err(ApiError::validation("resume: the entries answer different interrupts"));
            }
            entries.push((i, entry, call));
        }
        let Some(interrupt_id) = keel_interrupt else { return Err(not_found()) };
        let interrupt = store.get_interrupt(&interrupt_id).await?.ok_or_else(not_found)?;
        let run = match engine.run(&caller.0, &interrupt.run_id).await {
            Ok(run) if run.conversation_id == conversation.id => run,
            Ok(_) | Err(EngineError::NotFound(_)) => return Err(not_found()),
            Err(e) => return Err(e.into()),
        };
        let decision = input::decision(&entries, &interrupt.call_ids).map_err(ApiError::validation)?;
        let note = input::note(&entries).map_err(ApiError::validation)?;
        // The same answer (decision and note) is the same request.
        let answer = match &note {
            Some(note) => json!({"decision": decision, "note": note}),
            None => decision.clone(),
        };
        let idempotency_key = input::idempotency_key(&interrupt.id, &answer);
        let decision = Decision::parse(&decision).map_err(ApiError::validation)?;
        let request = ResumeRequest { interrupt_id: interrupt.id.clone(), decision, idempotency_key, note };
        let accepted = match engine.resume(&caller.0, &run.id, request).await {
            Ok(accepted) => accepted,
            Err(EngineError::InterruptExpired) if resume.iter().all(|e| e.status == ResumeStatus::Cancelled) => {
                // AG-UI lets a client only cancel an expired interrupt, and Keel already cancelled
                // its run: the answer is that run's end, and the thread is free for a new turn.
                let run = engine.run(&caller.0, &run.id).await?;
                let after = (run.last_sequence() - 1).max(0);
                return Ok(stream(&state, permit, &input, conversation.id, run.id, after, None));
            }
            Err(e) => return Err(e.into()),
        };
        let snapshot = snapshot(&state, &conversation.id).await?;
        let after = (accepted.resumed_sequence - 1).max(0);
        return Ok(stream(&state, permit, &input, conversation.id, run.id, after, Some(snapshot)));
    }

    if let Some(answered) = tool_answer(&state, &caller, &input, agent.as_deref()).await? {
        let (conversation, run_id, accepted) = answered;
        let snapshot = snapshot(&state, &conversation).await?;
        let after = (accepted.resumed_sequence - 1).max(0);
        return Ok(stream(&state, permit, &input, conversation, run_id, after, Some(snapshot)));
    }

    let conversation =
        thread_conversation(&state, &caller, &input, agent.as_deref(), true).await?.ok_or_else(ApiError::not_found)?;
    let (client_id, content) = input
        .last_user_message()
        .map_err(ApiError::validation)?
        .ok_or_else(|| ApiError::validation("messages: no user message to answer"))?;
    if let Some(run_id) = seen_run(&state, &conversation.id, client_id).await? {
        // The same input again (a retry, a client re-sending its history): the run it started.
        return Ok(stream(&state, permit, &input, conversation.id, run_id, 0, None));
    }
    let started =
        engine.send_message(&caller.0, &conversation.id, SendMessage { content, cancel_on_disconnect: false }).await?;
    store.bind(MESSAGES, conversation.id.as_str(), client_id, started.message.id.as_str(), engine.now()).await?;
    Ok(stream(&state, permit, &input, conversation.id, started.run.id, 0, None))
}

/// A frontend tool's answer: the input ends with `tool` messages, and one of them (the newest)
/// answers a client-side call of the thread's conversation. It goes through
/// `Engine::submit_tool_result` with a key derived from the call and the answer, so the same
/// input again gets the first answer and continues nothing twice.
async fn tool_answer(
    state: &AppState,
    caller: &Caller,
    input: &RunAgentInput,
    agent: Option<&str>,
) -> ApiResult<Option<(ConversationId, RunId, ToolResultAccepted)>> {
    if input.trailing_tool_messages().next().is_none() {
        return Ok(None);
    }
    let Some(conversation) = thread_conversation(state, caller, input, agent, false).await? else { return Ok(None) };
    let engine = &state.engine;
    let Some(agent) = engine.agent_of(&conversation) else { return Ok(None) };
    let calls = engine.store().list_conversation_tool_calls(&conversation.id).await?;
    for message in input.trailing_tool_messages() {
        let Some(tool_call_id) = &message.tool_call_id else { continue };
        let Some(call) = calls.iter().find(|c| c.id.as_str() == tool_call_id) else { continue };
        if agent.tools.get(&call.name).and_then(|t| t.client_side()).is_none() {
            continue;
        }
        let (result, error) = message.tool_outcome().map_err(ApiError::validation)?;
        let idempotency_key = input::tool_answer_key(&call.id, &result, &error);
        let outcome = super::runs::client_outcome(result, error)?;
        let request = ToolResultRequest { call_id: call.id.to_string(), outcome, idempotency_key };
        let accepted = engine.submit_tool_result(&caller.0, &call.run_id, request).await?;
        return Ok(Some((conversation.id.clone(), call.run_id.clone(), accepted)));
    }
    Ok(None)
}

/// The conversation of `threadId`: a Keel conversation id as it is; any other thread id through its
/// binding for this user, created on first use (when `create`) with `agent` (the default agent when
/// `None`). A thread whose conversation talks to another agent than the path names is refused.
async fn thread_conversation(
    state: &AppState,
    caller: &Caller,
    input: &RunAgentInput,
    agent: Option<&str>,
    create: bool,
) -> ApiResult<Option<Conversation>> {
    let engine = &state.engine;
    let store = engine.store();
    let found = if let Ok(id) = ConversationId::parse(&input.thread_id) {
        Some(engine.conversation(&caller.0, &id).await?)
    } else if let Some(id) = store.binding(THREADS, &caller.0, &input.thread_id).await? {
        let id = ConversationId::parse(&id).map_err(|e| ApiError::internal(&e))?;
        Some(engine.conversation(&caller.0, &id).await?)
    } else {
        None
    };
    if let Some(conversation) = found {
        let talks_to = engine.agent_of(&conversation).map(|a| a.id.clone());
        if agent.is_some() && talks_to.as_deref() != agent {
            return Err(ApiError::validation("threadId: the thread's conversation talks to another agent"));
        }
        return Ok(Some(conversation));
    }
    if !create {
        return Ok(None);
    }
    let title = match input.last_user_message() {
        Ok(Some((_, text))) => keel_core::mask::truncate(text.trim(), 80),
        _ => String::new(),
    };
    let created = engine.create_conversation(&caller.0, &title, agent).await?;
    // Two first requests of one thread race: both create, the first binding wins, the other
    // conversation stays empty.
    let bound = store.bind(THREADS, &caller.0, &input.thread_id, created.id.as_str(), engine.now()).await?;
    let bound = ConversationId::parse(&bound).map_err(|e| ApiError::internal(&e))?;
    Ok(Some(engine.conversation(&caller.0, &bound).await?))
}

/// The run a user message Keel has already stored started, if `client_id` names one: an id
/// recorded for this conversation, or a Keel message id (as the snapshots show them).
async fn seen_run(state: &AppState, conversation: &ConversationId, client_id: &str) -> ApiResult<Option<RunId>> {
    let store = state.engine.store();
    let message_id = match store.binding(MESSAGES, conversation.as_str(), client_id).await? {
        Some(id) => MessageId::parse(&id).map_err(|e| ApiError::internal(&e))?,
        None => match MessageId::parse(client_id) {
            Ok(id) => id,
            Err(_) => return Ok(None),
        },
    };
    let messages = store.list_messages(conversation).await?;
    Ok(messages.into_iter().find(|m| m.id == message_id).and_then(|m| m.run_id))
}

async fn snapshot(state: &AppState, conversation: &ConversationId) -> Result<Snapshot, keel_core::store::StoreError> {
    let store = state.engine.store();
    let messages = store.list_messages(conversation).await?;
    let calls = store.list_conversation_tool_calls(conversation).await?;
    let facts = store.list_facts(conversation).await?;
    Ok(Snapshot::build(&messages, &calls, &facts))
}

/// `data: <one line of JSON>`, blank line: AG-UI's framing (no `event:`, no `id:`).
pub fn frame(event: &Value) -> Bytes {
    Bytes::from(format!("data: {event}\n\n"))
}

fn stream(
    state: &AppState,
    permit: StreamPermit,
    input: &RunAgentInput,
    conversation: ConversationId,
    run_id: RunId,
    after: i64,
    opening: Option<Snapshot>,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(state.config.sse_buffer.max(1));
    let mapper = Mapper::new(&input.thread_id, &input.run_id);
    let state = state.clone();
    // Counted open on /metrics for as long as the body lives.
    let open = state.metrics.connection_opened(crate::metrics::AG_UI);
    tokio::spawn(async move {
        feed(state, tx, mapper, conversation, run_id, after, opening).await;
        drop(permit);
    });
    let body = ReceiverStream::new(rx).map(move |frame| {
        let _open = &open;
        Ok::<_, Infallible>(frame)
    });
    sse::sse_response(Body::from_stream(body))
}

#[derive(Debug)]
enum End {
    Finished,
    Detached,
    TooSlow,
}

async fn feed(
    state: AppState,
    tx: mpsc::Sender<Bytes>,
    mut mapper: Mapper,
    conversation: ConversationId,
    run_id: RunId,
    after: i64,
    opening: Option<Snapshot>,
) {
    let engine = state.engine.clone();
    let timeout = state.config.sse_send_timeout;
    let send = |frame: Bytes| {
        let tx = tx.clone();
        async move {
            match tx.send_timeout(frame, timeout).await {
                Ok(()) => None,
                Err(SendTimeoutError::Closed(_)) => Some(End::Detached),
                Err(SendTimeoutError::Timeout(_)) => Some(End::TooSlow),
            }
        }
    };
    let end = async {
        let now = engine.now().timestamp_millis();
        let keel = json!({"runId": run_id, "conversationId": conversation});
        if let Some(end) = send(frame(&mapper.run_started(now, keel))).await {
            return end;
        }
        if let Some(snapshot) = &opening {
            if let Some(end) = send(frame(&mapper.opening_snapshot(snapshot, now))).await {
                return end;
            }
        }
        let events = engine.events(&run_id, after, Until::PauseOrTerminal, Known::Unknown);
        tokio::pin!(events);
        let shutdown = state.shutdown.wait();
        tokio::pin!(shutdown);
        let heartbeat = state.config.heartbeat.max(Duration::from_millis(1));
        let mut keep_alive = tokio::time::interval_at(tokio::time::Instant::now() + heartbeat, heartbeat);
        keep_alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut args: HashMap<CallId, Value> = HashMap::new();
        loop {
            let frames = tokio::select! {
                biased;
                () = tx.closed() => return End::Detached,
                () = &mut shutdown => {
                    let now = engine.now().timestamp_millis();
                    mapper.fail("SHUTTING_DOWN", "the server is stopping; the run goes on and can be read again", now)
                }
                next = events.next() => match next {
                    None => {
                        let now = engine.now().timestamp_millis();
                        mapper.fail("INTERNAL", "the run's events ended early", now)
                    }
                    Some(Err(e)) => {
                        tracing::error!(run_id = %run_id, error = %e, "reading the run's events for AG-UI failed");
                        mapper.fail("INTERNAL", "internal error", engine.now().timestamp_millis())
                    }
                    Some(Ok(event)) => match map(&state, &mut mapper, &conversation, &event, &mut args).await {
                        Ok(frames) => frames,
                        Err(e) => {
                            tracing::error!(run_id = %run_id, error = %e, "reading a snapshot for AG-UI failed");
                            mapper.fail("INTERNAL", "internal error", engine.now().timestamp_millis())
                        }
                    },
                },
                _ = keep_alive.tick() => {
                    if let Some(end) = send(Bytes::from_static(sse::KEEP_ALIVE)).await {
                        return end;
                    }
                    continue;
                }
            };
            if !frames.is_empty() {
                keep_alive.reset();
            }
            for f in &frames {
                if let Some(end) = send(frame(f)).await {
                    return end;
                }
            }
            if mapper.is_finished() {
                return End::Finished;
            }
        }
    }
    .await;
    drop(tx);
    match end {
        End::Detached => {
            tracing::debug!(run_id = %run_id, "AG-UI client went away");
            if let Err(e) = engine.client_detached(&run_id).await {
                tracing::warn!(run_id = %run_id, error = %e, "handling a detached client failed");
            }
        }
        End::TooSlow => tracing::info!(run_id = %run_id, "AG-UI client too slow to drain its buffer; cut off"),
        End::Finished => {}
    }
}

/// Looks up what the mapper needs for `event` (a call's arguments, the conversation's snapshot),
/// then maps it.
async fn map(
    state: &AppState,
    mapper: &mut Mapper,
    conversation: &ConversationId,
    event: &Event,
    args: &mut HashMap<CallId, Value>,
) -> Result<Vec<Value>, keel_core::store::StoreError> {
    let call_id = match &event.kind {
        EventKind::ToolStarted { call_id, .. } | EventKind::ToolFinished { call_id, .. } => Some(call_id),
        _ => None,
    };
    if let Some(call_id) = call_id {
        if !args.contains_key(call_id) {
            for call in state.engine.store().list_tool_calls(&event.run_id).await? {
                args.insert(call.id, call.args.into_inner());
            }
        }
    }
    let snapshot = if needs_snapshot(event) { Some(snapshot(state, conversation).await?) } else { None };
    let lookup = Lookup { args: call_id.and_then(|c| args.get(c)), snapshot: snapshot.as_ref() };
    Ok(mapper.map(event, lookup))
}
