//! `/v1/conversations`: create, list own, read one, send a message.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_core::engine::SendMessage;
use keel_core::stream::Until;
use keel_core::wire::{CreateConversation, MessageAccepted, PostMessage};
use serde_json::json;

use crate::error::ApiResult;
use crate::extract::{accepts, ApiJson, Caller, ConversationPath, OptionalJson, Params, EVENT_STREAM};
use crate::sse;
use crate::state::AppState;

pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    OptionalJson(body): OptionalJson<CreateConversation>,
) -> ApiResult<Response> {
    let conversation = state.engine.create_conversation(&caller.0, body.title.as_deref().unwrap_or("")).await?;
    Ok((StatusCode::CREATED, Json(conversation)).into_response())
}

pub async fn list(State(state): State<AppState>, caller: Caller) -> ApiResult<Response> {
    let conversations = state.engine.list_conversations(&caller.0).await?;
    Ok(Json(json!({ "conversations": conversations })).into_response())
}

pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    ConversationPath(id): ConversationPath,
) -> ApiResult<Response> {
    Ok(Json(state.engine.conversation_view(&caller.0, &id).await?).into_response())
}

/// `202 {messageId, runId}`; with `Accept: text/event-stream` the run's events from the start until
/// it pauses or ends; with `?wait=true` the turn as JSON once it pauses or ends.
pub async fn post_message(
    State(state): State<AppState>,
    caller: Caller,
    ConversationPath(id): ConversationPath,
    params: Params,
    headers: HeaderMap,
    ApiJson(body): ApiJson<PostMessage>,
) -> ApiResult<Response> {
    let wait = params.flag("wait")?;
    let message = SendMessage { content: body.content, cancel_on_disconnect: body.cancel_on_disconnect };
    // A stream's slot is taken before the run starts, so a refused stream starts nothing.
    let permit = if accepts(&headers, EVENT_STREAM) { Some(state.limits.streams.acquire(&caller.0)?) } else { None };
    let started = state.engine.send_message(&caller.0, &id, message).await?;
    let run_id = started.run.id;
    if let Some(permit) = permit {
        return Ok(sse::stream_run(&state, permit, run_id, 0, Until::PauseOrTerminal));
    }
    if wait {
        return Ok(Json(super::settle_turn(&state, &caller, &run_id, 0).await?).into_response());
    }
    Ok((StatusCode::ACCEPTED, Json(MessageAccepted { message_id: started.message.id, run_id })).into_response())
}
