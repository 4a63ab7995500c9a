//! `/v1/runs/{id}`: state, events, resume, cancel.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_core::engine::{
    ClientOutcome, Decision, EngineError, ResumeAccepted, ResumeRequest, ToolResultAccepted, ToolResultRequest,
};
use keel_core::stream::{Known, Until};
use keel_core::wire::{ResumeBody, RunList, RunSummary, ToolResultBody};
use keel_core::{InterruptId, RunId, RunStatus, TicketScope};
use serde_json::Value;

use crate::auth::ticket_created;
use crate::error::{ApiError, ApiResult};
use crate::extract::{accepts, cursor, ApiJson, Caller, Params, RunPath, APPLICATION_JSON, EVENT_STREAM};
use crate::openapi::RunEventFrame;
use crate::sse;
use crate::state::AppState;
use crate::views::{ErrorBody, EventPage, ResumedTurn, RunBody, TicketBody};

/// `GET /v1/runs`: runs listed without `?limit=`, and the most one page may hold.
const DEFAULT_RUNS: u32 = 20;
const MAX_RUNS: u32 = 100;

/// The caller's runs, newest first: `?limit=` (1 to 100, default 20), `?status=` (one run status).
#[utoipa::path(
    get,
    path = "/v1/runs",
    operation_id = "listRuns",
    tag = "runs",
    params(
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 100, description = "At most this many runs (default 20)"),
        ("status" = Option<RunStatus>, Query, description = "Only runs in this status"),
    ),
    responses(
        (status = 200, description = "The caller's runs, newest first", body = RunList),
        (status = 400, description = "`INVALID_QUERY`", body = ErrorBody),
    )
)]
pub async fn list(State(state): State<AppState>, caller: Caller, params: Params) -> ApiResult<Response> {
    let limit = match params.0.get("limit") {
        None => DEFAULT_RUNS,
        Some(raw) => match raw.parse::<u32>() {
            Ok(n) if (1..=MAX_RUNS).contains(&n) => n,
            _ => {
                return Err(ApiError::bad_request(
                    "INVALID_QUERY",
                    format!("limit: must be an integer from 1 to {MAX_RUNS}"),
                ))
            }
        },
    };
    let status = match params.0.get("status") {
        None => None,
        Some(raw) => Some(RunStatus::parse(raw).ok_or_else(|| {
            let all: Vec<&str> = RunStatus::ALL.iter().map(|s| s.as_str()).collect();
            ApiError::bad_request("INVALID_QUERY", format!("status: must be one of {}", all.join(", ")))
        })?),
    };
    let runs = state.engine.store().list_runs(&caller.0, status, limit).await?;
    Ok(Json(RunList { runs: runs.into_iter().map(RunSummary::from).collect() }).into_response())
}

/// The run's state and its history of decisions; never a tool's full result.
#[utoipa::path(
    get,
    path = "/v1/runs/{id}",
    operation_id = "getRun",
    tag = "runs",
    params(("id" = RunId, Path, description = "The run")),
    responses(
        (status = 200, description = "The run", body = RunBody),
        (status = 404, description = "`RUN_NOT_FOUND`: no such run of the caller's", body = ErrorBody),
    )
)]
pub async fn get(State(state): State<AppState>, caller: Caller, RunPath(id): RunPath) -> ApiResult<Response> {
    let view = state.engine.run_view(&caller.0, &id).await?;
    Ok(Json(RunBody::from(view)).into_response())
}

/// SSE replay-then-live until the run ends; with `Accept: application/json`, one page of the stored
/// events after the cursor (`?limit=`, at most the configured page size), at once.
#[utoipa::path(
    get,
    path = "/v1/runs/{id}/events",
    operation_id = "runEvents",
    tag = "runs",
    security(("bearer" = []), ("ticket" = [])),
    params(
        ("id" = RunId, Path, description = "The run"),
        ("Last-Event-ID" = Option<String>, Header, pattern = "^[0-9]+$",
            description = "Events after this sequence; wins over `after`"),
        ("after" = Option<i64>, Query, minimum = 0, description = "Events after this sequence (default 0)"),
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 1000,
            description = "JSON only: at most this many events; at most the server's page size, 1,000 unless configured (`--replay-page-max`)"),
        ("ticket" = Option<String>, Query, description = "A stream ticket instead of an API key"),
    ),
    responses(
        (status = 200, description = "SSE (the default): the stored events, then live ones until the run ends. \
            With `Accept: application/json`: one page of stored events",
            content(
                (RunEventFrame = "text/event-stream"),
                (EventPage = "application/json"),
            )),
        (status = 400, description = "`INVALID_CURSOR`, `CURSOR_OUT_OF_RANGE`, `INVALID_QUERY`", body = ErrorBody),
        (status = 404, description = "`RUN_NOT_FOUND`", body = ErrorBody),
        (status = 410, description = "`EVENTS_PRUNED`: retention deleted events after the cursor; \
            `error.firstHeldSequence` is the first the run still holds", body = ErrorBody),
    )
)]
pub async fn events(
    State(state): State<AppState>,
    caller: Caller,
    RunPath(id): RunPath,
    params: Params,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let after = cursor(&headers, &params)?;
    let json = accepts(&headers, APPLICATION_JSON) && !accepts(&headers, EVENT_STREAM);
    let limit = page_limit(&params, state.config.replay_page_max)?;
    let run = state.engine.run(&caller.0, &id).await?;
    if after > run.last_sequence() {
        return Err(ApiError::bad_request(
            "CURSOR_OUT_OF_RANGE",
            format!("the run's last event is {}; the cursor is past it", run.last_sequence()),
        ));
    }
    crate::retention::check_held(&state.engine, &run, after).await?;
    if json {
        let events = state.engine.store().list_events(&id, after, limit).await?;
        let last = events.last().map_or(after, |e| e.sequence);
        return Ok(Json(EventPage { events, has_more: last < run.last_sequence() }).into_response());
    }
    let permit = state.limits.streams.acquire(&caller.0)?;
    Ok(sse::stream_run(&state, permit, id, after, Until::Terminal, Known::of(&run), None))
}

/// `?limit=N`, 1 to `max`; absent is `max`.
fn page_limit(params: &Params, max: u32) -> Result<u32, ApiError> {
    let Some(raw) = params.0.get("limit") else { return Ok(max) };
    match raw.parse::<u32>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(ApiError::bad_request("INVALID_QUERY", format!("limit: must be an integer from 1 to {max}"))),
    }
}

/// A short-lived, single-use ticket that opens this run's event stream without a key:
/// `GET /v1/runs/{id}/events?ticket=…`, for an `EventSource`, which can't send headers.
#[utoipa::path(
    post,
    path = "/v1/runs/{id}/stream-ticket",
    operation_id = "createStreamTicket",
    tag = "runs",
    params(("id" = RunId, Path, description = "The run")),
    responses(
        (status = 201, description = "A ticket for `GET /v1/runs/{id}/events?ticket=…`", body = TicketBody),
        (status = 404, description = "`RUN_NOT_FOUND`", body = ErrorBody),
    )
)]
pub async fn stream_ticket(State(state): State<AppState>, caller: Caller, RunPath(id): RunPath) -> ApiResult<Response> {
    state.engine.run(&caller.0, &id).await?;
    let path = format!("/v1/runs/{id}/events");
    ticket_created(&state, &caller, TicketScope::RunEvents, Some(id), &path).await
}

/// The engine's `ResumeAccepted`; with `Accept: text/event-stream` the run's events from `resumed`
/// until it pauses or ends; with `?wait=true` the turn as JSON once it pauses or ends.
#[utoipa::path(
    post,
    path = "/v1/runs/{id}/resume",
    operation_id = "resumeRun",
    tag = "runs",
    params(
        ("id" = RunId, Path, description = "The run"),
        ("wait" = Option<bool>, Query, description = "Answer with the turn once the run pauses or ends"),
        ("Idempotency-Key" = Option<String>, Header, description = "Instead of `idempotencyKey` in the body"),
    ),
    request_body = ResumeBody,
    responses(
        (status = 200, description = "The resume's answer; `?wait=true`: the turn with it; \
            `Accept: text/event-stream`: the run's events from `resumed` until it pauses or ends",
            content(
                (ResumeOrTurn = "application/json"),
                (RunEventFrame = "text/event-stream"),
            )),
        (status = 400, description = "`MALFORMED_JSON`, `JSON_TOO_DEEP`, `INVALID_BODY`, `INVALID_QUERY`", body = ErrorBody),
        (status = 413, description = "`PAYLOAD_TOO_LARGE`", body = ErrorBody),
        (status = 415, description = "`UNSUPPORTED_MEDIA_TYPE`: the body is not declared JSON", body = ErrorBody),
        (status = 403, description = "`FORBIDDEN`: the caller's role may not decide this", body = ErrorBody),
        (status = 404, description = "`RUN_NOT_FOUND`", body = ErrorBody),
        (status = 409, description = "`RUN_NOT_INTERRUPTED`, `INTERRUPT_ALREADY_RESOLVED`, `IDEMPOTENCY_KEY_IN_FLIGHT`", body = ErrorBody),
        (status = 410, description = "`INTERRUPT_EXPIRED`", body = ErrorBody),
        (status = 422, description = "`VALIDATION_FAILED`, `INVALID_DECISION`, `INVALID_ARGS`, `IDEMPOTENCY_KEY_REUSED`", body = ErrorBody),
    )
)]
pub async fn resume(
    State(state): State<AppState>,
    caller: Caller,
    RunPath(id): RunPath,
    params: Params,
    headers: HeaderMap,
    ApiJson(body): ApiJson<ResumeBody>,
) -> ApiResult<Response> {
    let wait = params.flag("wait")?;
    let interrupt_id = InterruptId::parse(&body.interrupt_id)
        .map_err(|_| ApiError::validation("interruptId: must be an interrupt id (int_…)"))?;
    let decision = match body.decision {
        Some(d) if !d.is_null() => d,
        _ => return Err(ApiError::validation("decision: required")),
    };
    let idempotency_key = idempotency_key(body.idempotency_key.as_deref(), &headers)?;
    let decision = Decision::parse(&decision).map_err(|e| ApiError::from(EngineError::InvalidDecision(e)))?;
    let request = ResumeRequest { interrupt_id, decision, idempotency_key, note: body.note };
    // A stream's slot is taken before the resume, so a refused stream resumes nothing.
    let permit = sse::permit_if_streaming(&state, &caller, &headers)?;
    // Subscribed before the claim is written: the stream follows from `resumed` without a read.
    let following = permit.as_ref().map(|_| state.engine.follow(&id));
    let accepted = state.engine.resume(&caller.0, &id, request).await?;
    let after = (accepted.resumed_sequence - 1).max(0);
    if let Some(permit) = permit {
        // just resumed: not over
        return Ok(sse::stream_run(&state, permit, id, after, Until::PauseOrTerminal, Known::Active, following));
    }
    if wait {
        let turn = super::settle_turn(&state, &caller, &id, after).await?;
        return Ok(Json(ResumeOrTurn::Turn(Box::new(ResumedTurn { turn, resume: accepted }))).into_response());
    }
    Ok((StatusCode::OK, Json(ResumeOrTurn::Accepted(accepted))).into_response())
}

/// The key of a resume or a tool result: in the body or an `Idempotency-Key` header (both: equal).
fn idempotency_key(in_body: Option<&str>, headers: &HeaderMap) -> Result<String, ApiError> {
    let header_key = match headers.get("idempotency-key") {
        Some(v) => Some(v.to_str().map_err(|_| ApiError::validation("Idempotency-Key: must be visible ASCII"))?),
        None => None,
    };
    match (in_body, header_key) {
        (Some(body), Some(header)) if body != header => {
            Err(ApiError::validation("idempotencyKey and the Idempotency-Key header differ"))
        }
        (Some(key), _) | (None, Some(key)) => Ok(key.to_owned()),
        (None, None) => {
            Err(ApiError::validation("idempotencyKey: required (in the body or an Idempotency-Key header)"))
        }
    }
}

/// The result of a client-side tool's call (a `tool_call` interrupt), or the error the client got
/// running it; the run continues once, whoever sends it how often. Same negotiation as a resume.
#[utoipa::path(
    post,
    path = "/v1/runs/{id}/tool-results",
    operation_id = "submitToolResult",
    tag = "runs",
    params(
        ("id" = RunId, Path, description = "The run"),
        ("wait" = Option<bool>, Query, description = "Answer with the turn once the run pauses or ends"),
        ("Idempotency-Key" = Option<String>, Header, description = "Instead of `idempotencyKey` in the body"),
    ),
    request_body = ToolResultBody,
    responses(
        (status = 200, description = "The answer; `?wait=true`: the turn with it; \
            `Accept: text/event-stream`: the run's events from `resumed` until it pauses or ends",
            content(
                (ToolResultOrTurn = "application/json"),
                (RunEventFrame = "text/event-stream"),
            )),
        (status = 400, description = "`MALFORMED_JSON`, `JSON_TOO_DEEP`, `INVALID_BODY`, `INVALID_QUERY`", body = ErrorBody),
        (status = 413, description = "`PAYLOAD_TOO_LARGE`", body = ErrorBody),
        (status = 415, description = "`UNSUPPORTED_MEDIA_TYPE`: the body is not declared JSON", body = ErrorBody),
        (status = 403, description = "`FORBIDDEN`: the caller's role may not use this tool", body = ErrorBody),
        (status = 404, description = "`RUN_NOT_FOUND`", body = ErrorBody),
        (status = 409, description = "`TOOL_CALL_ALREADY_ANSWERED` (another answer, or a cancel, came first), `RUN_NOT_INTERRUPTED`, `IDEMPOTENCY_KEY_IN_FLIGHT`", body = ErrorBody),
        (status = 410, description = "`INTERRUPT_EXPIRED`: the client answered too late; the run was cancelled", body = ErrorBody),
        (status = 422, description = "`VALIDATION_FAILED`, `UNKNOWN_CALL`, `INVALID_RESULT` (names the JSON path), `IDEMPOTENCY_KEY_REUSED`", body = ErrorBody),
    )
)]
pub async fn tool_result(
    State(state): State<AppState>,
    caller: Caller,
    RunPath(id): RunPath,
    params: Params,
    headers: HeaderMap,
    ApiJson(body): ApiJson<ToolResultBody>,
) -> ApiResult<Response> {
    let wait = params.flag("wait")?;
    let outcome = client_outcome(body.result, body.error)?;
    let idempotency_key = idempotency_key(body.idempotency_key.as_deref(), &headers)?;
    let request = ToolResultRequest { call_id: body.call_id, outcome, idempotency_key };
    // A stream's slot is taken before the answer, so a refused stream answers nothing.
    let permit = sse::permit_if_streaming(&state, &caller, &headers)?;
    let following = permit.as_ref().map(|_| state.engine.follow(&id));
    let accepted = state.engine.submit_tool_result(&caller.0, &id, request).await?;
    let after = (accepted.resumed_sequence - 1).max(0);
    if let Some(permit) = permit {
        // just resumed: not over
        return Ok(sse::stream_run(&state, permit, id, after, Until::PauseOrTerminal, Known::Active, following));
    }
    if wait {
        let turn = super::settle_turn(&state, &caller, &id, after).await?;
        return Ok(
            Json(ToolResultOrTurn::Turn(Box::new(ToolResultTurn { turn, tool_result: accepted }))).into_response()
        );
    }
    Ok((StatusCode::OK, Json(ToolResultOrTurn::Accepted(accepted))).into_response())
}

/// A tool result's `result` or `error`: exactly one (the WebSocket's `tool_result` too).
pub(crate) fn client_outcome(result: Option<Value>, error: Option<String>) -> Result<ClientOutcome, ApiError> {
    match (result, error) {
        (Some(result), None) if !result.is_null() => Ok(ClientOutcome::Result(result)),
        (None, Some(error)) if (1..=2000).contains(&error.chars().count()) => Ok(ClientOutcome::Error(error)),
        (None, Some(_)) => Err(ApiError::validation("error: must be 1 to 2000 characters")),
        _ => Err(ApiError::validation("result or error: exactly one is required (a result is not null)")),
    }
}

/// What `POST /v1/runs/{id}/tool-results` answers with as JSON.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[serde(untagged)]
enum ToolResultOrTurn {
    Accepted(ToolResultAccepted),
    Turn(Box<ToolResultTurn>),
}

/// `?wait=true`: the turn once the run pauses or ends, and the tool result's answer.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
struct ToolResultTurn {
    #[serde(flatten)]
    turn: keel_core::wire::TurnBody,
    tool_result: ToolResultAccepted,
}

/// Durable cancel; answers with the run as it is now.
#[utoipa::path(
    post,
    path = "/v1/runs/{id}/cancel",
    operation_id = "cancelRun",
    tag = "runs",
    params(("id" = RunId, Path, description = "The run")),
    responses(
        (status = 200, description = "The run as it is now", body = RunBody),
        (status = 404, description = "`RUN_NOT_FOUND`", body = ErrorBody),
        (status = 409, description = "`RUN_ACTIVE` and the like: the run can't be cancelled now", body = ErrorBody),
    )
)]
pub async fn cancel(State(state): State<AppState>, caller: Caller, RunPath(id): RunPath) -> ApiResult<Response> {
    state.engine.cancel(&caller.0, &id).await?;
    let view = state.engine.run_view(&caller.0, &id).await?;
    Ok(Json(RunBody::from(view)).into_response())
}

/// What `POST /v1/runs/{id}/resume` answers with as JSON.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[serde(untagged)]
enum ResumeOrTurn {
    Accepted(ResumeAccepted),
    Turn(Box<ResumedTurn>),
}
