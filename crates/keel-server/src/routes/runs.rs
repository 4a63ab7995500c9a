//! `/v1/runs/{id}`: state, events, resume, cancel.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_core::engine::ResumeRequest;
use keel_core::stream::Until;
use keel_core::wire::{ResumeBody, RunList, RunSummary};
use keel_core::{InterruptId, RunStatus, TicketScope};
use serde_json::json;

use crate::auth::issue_ticket;
use crate::error::{ApiError, ApiResult};
use crate::extract::{accepts, cursor, ApiJson, Caller, Params, RunPath, APPLICATION_JSON, EVENT_STREAM};
use crate::sse;
use crate::state::AppState;
use crate::views::RunBody;

/// `GET /v1/runs`: runs listed without `?limit=`, and the most one page may hold.
const DEFAULT_RUNS: u32 = 20;
const MAX_RUNS: u32 = 100;

/// The caller's runs, newest first: `?limit=` (1 to 100, default 20), `?status=` (one run status).
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

pub async fn get(State(state): State<AppState>, caller: Caller, RunPath(id): RunPath) -> ApiResult<Response> {
    let view = state.engine.run_view(&caller.0, &id).await?;
    Ok(Json(RunBody::from(view)).into_response())
}

/// SSE replay-then-live until the run ends; with `Accept: application/json`, one page of the stored
/// events after the cursor (`?limit=`, at most the configured page size), at once.
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
    if json {
        let events = state.engine.store().list_events(&id, after, limit).await?;
        let last = events.last().map_or(after, |e| e.sequence);
        return Ok(Json(json!({ "events": events, "hasMore": last < run.last_sequence() })).into_response());
    }
    let permit = state.limits.streams.acquire(&caller.0)?;
    Ok(sse::stream_run(&state, permit, id, after, Until::Terminal))
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
pub async fn stream_ticket(State(state): State<AppState>, caller: Caller, RunPath(id): RunPath) -> ApiResult<Response> {
    state.engine.run(&caller.0, &id).await?;
    let ttl = state.config.stream_ticket_ttl;
    let engine = &state.engine;
    let ticket =
        issue_ticket(engine.store().as_ref(), &caller.0, TicketScope::RunEvents, Some(id.clone()), engine.now(), ttl)
            .await?;
    let body = json!({
        "ticket": ticket.secret,
        "expiresAt": ticket.expires_at,
        "url": format!("/v1/runs/{id}/events?ticket={}", ticket.secret),
    });
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// The engine's `ResumeAccepted`; with `Accept: text/event-stream` the run's events from `resumed`
/// until it pauses or ends; with `?wait=true` the turn as JSON once it pauses or ends.
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
    let header_key = match headers.get("idempotency-key") {
        Some(v) => Some(v.to_str().map_err(|_| ApiError::validation("Idempotency-Key: must be visible ASCII"))?),
        None => None,
    };
    let idempotency_key = match (body.idempotency_key.as_deref(), header_key) {
        (Some(body), Some(header)) if body != header => {
            return Err(ApiError::validation("idempotencyKey and the Idempotency-Key header differ"))
        }
        (Some(key), _) | (None, Some(key)) => key.to_owned(),
        (None, None) => {
            return Err(ApiError::validation("idempotencyKey: required (in the body or an Idempotency-Key header)"))
        }
    };
    let request = ResumeRequest { interrupt_id, decision, idempotency_key };
    // A stream's slot is taken before the resume, so a refused stream resumes nothing.
    let permit = if accepts(&headers, EVENT_STREAM) { Some(state.limits.streams.acquire(&caller.0)?) } else { None };
    let accepted = state.engine.resume(&caller.0, &id, request).await?;
    let after = (accepted.resumed_sequence - 1).max(0);
    if let Some(permit) = permit {
        return Ok(sse::stream_run(&state, permit, id, after, Until::PauseOrTerminal));
    }
    if wait {
        let turn = super::settle_turn(&state, &caller, &id, after).await?;
        let mut body = serde_json::to_value(turn).map_err(|e| ApiError::internal(&e))?;
        body["resume"] = serde_json::to_value(&accepted).map_err(|e| ApiError::internal(&e))?;
        return Ok(Json(body).into_response());
    }
    Ok((StatusCode::OK, Json(accepted)).into_response())
}

/// Durable cancel; answers with the run as it is now.
pub async fn cancel(State(state): State<AppState>, caller: Caller, RunPath(id): RunPath) -> ApiResult<Response> {
    state.engine.cancel(&caller.0, &id).await?;
    let view = state.engine.run_view(&caller.0, &id).await?;
    Ok(Json(RunBody::from(view)).into_response())
}
