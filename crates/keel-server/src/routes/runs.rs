//! `/v1/runs/{id}`: state, events, resume, cancel.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_core::engine::ResumeRequest;
use keel_core::stream::Until;
use keel_core::wire::{ResumeBody, RunList, RunSummary};
use keel_core::{InterruptId, RunStatus};
use serde_json::json;

use crate::error::{ApiError, ApiResult};
use crate::extract::{accepts, cursor, ApiJson, Caller, Params, RunPath, APPLICATION_JSON, EVENT_STREAM};
use crate::sse;
use crate::state::AppState;
use crate::views::RunBody;

/// Stored events are read in pages of this many.
const PAGE: u32 = 500;
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

/// SSE replay-then-live until the run ends; with `Accept: application/json`, the stored events
/// after the cursor, at once.
pub async fn events(
    State(state): State<AppState>,
    caller: Caller,
    RunPath(id): RunPath,
    params: Params,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let after = cursor(&headers, &params)?;
    let run = state.engine.run(&caller.0, &id).await?;
    if after > run.last_sequence() {
        return Err(ApiError::bad_request(
            "CURSOR_OUT_OF_RANGE",
            format!("the run's last event is {}; the cursor is past it", run.last_sequence()),
        ));
    }
    if accepts(&headers, APPLICATION_JSON) && !accepts(&headers, EVENT_STREAM) {
        let store = state.engine.store();
        let mut events = Vec::new();
        let mut last = after;
        loop {
            let page = store.list_events(&id, last, PAGE).await?;
            let full = page.len() == PAGE as usize;
            if let Some(e) = page.last() {
                last = e.sequence;
            }
            events.extend(page);
            if !full {
                break;
            }
        }
        return Ok(Json(json!({ "events": events })).into_response());
    }
    Ok(sse::stream_run(&state, id, after, Until::Terminal))
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
    let accepted = state.engine.resume(&caller.0, &id, request).await?;
    let after = (accepted.resumed_sequence - 1).max(0);
    if accepts(&headers, EVENT_STREAM) {
        return Ok(sse::stream_run(&state, id, after, Until::PauseOrTerminal));
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
