//! `/v1/conversations`: create, list own, read one, send a message.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_core::engine::{ConversationView, MultitaskStrategy, SendMessage};
use keel_core::stream::{Known, Until};
use keel_core::wire::{CreateConversation, MessageAccepted, PostMessage};
use keel_core::{Conversation, ConversationId};

use crate::error::ApiResult;
use crate::extract::{ApiJson, Caller, ConversationPath, OptionalJson, Params};
use crate::openapi::RunEventFrame;
use crate::sse;
use crate::state::AppState;
use crate::views::{ConversationList, ErrorBody, TurnBody};

#[utoipa::path(
    post,
    path = "/v1/conversations",
    operation_id = "createConversation",
    tag = "conversations",
    request_body(content = Option<CreateConversation>, description = "May be empty"),
    responses(
        (status = 201, description = "The new conversation", body = Conversation),
        (status = 400, description = "`MALFORMED_JSON`, `JSON_TOO_DEEP`, `INVALID_BODY`", body = ErrorBody),
        (status = 413, description = "`PAYLOAD_TOO_LARGE`", body = ErrorBody),
        (status = 415, description = "`UNSUPPORTED_MEDIA_TYPE`: the body is not declared JSON", body = ErrorBody),
        (status = 422, description = "`VALIDATION_FAILED`, `UNKNOWN_AGENT`", body = ErrorBody),
    )
)]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    OptionalJson(body): OptionalJson<CreateConversation>,
) -> ApiResult<Response> {
    let conversation = state
        .engine
        .create_conversation(&caller.0, body.title.as_deref().unwrap_or(""), body.agent_id.as_deref())
        .await?;
    Ok((StatusCode::CREATED, Json(conversation)).into_response())
}

/// The caller's conversations.
#[utoipa::path(
    get,
    path = "/v1/conversations",
    operation_id = "listConversations",
    tag = "conversations",
    responses((status = 200, description = "The caller's conversations", body = ConversationList))
)]
pub async fn list(State(state): State<AppState>, caller: Caller) -> ApiResult<Response> {
    let conversations = state.engine.list_conversations(&caller.0).await?;
    Ok(Json(ConversationList { conversations }).into_response())
}

/// The conversation with its facts, its active run and its last 100 messages.
#[utoipa::path(
    get,
    path = "/v1/conversations/{id}",
    operation_id = "getConversation",
    tag = "conversations",
    params(("id" = ConversationId, Path, description = "The conversation")),
    responses(
        (status = 200, description = "The conversation", body = ConversationView),
        (status = 404, description = "`CONVERSATION_NOT_FOUND`: no such conversation of the caller's", body = ErrorBody),
    )
)]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    ConversationPath(id): ConversationPath,
) -> ApiResult<Response> {
    Ok(Json(state.engine.conversation_view(&caller.0, &id).await?).into_response())
}

/// `202 {messageId, runId}`; with `Accept: text/event-stream` the run's events from the start until
/// it pauses or ends; with `?wait=true` the turn as JSON once it pauses or ends.
#[utoipa::path(
    post,
    path = "/v1/conversations/{id}/messages",
    operation_id = "postMessage",
    tag = "conversations",
    params(
        ("id" = ConversationId, Path, description = "The conversation"),
        ("wait" = Option<bool>, Query, description = "Answer with the turn once the run pauses or ends"),
    ),
    request_body = PostMessage,
    responses(
        (status = 202, description = "The run started (`queued`), or waits its turn (`waiting`, `multitaskStrategy` `enqueue`)", body = MessageAccepted),
        (status = 200, description = "`?wait=true`: the turn; `Accept: text/event-stream`: the run's events until it pauses or ends",
            content(
                (TurnBody = "application/json"),
                (RunEventFrame = "text/event-stream"),
            )),
        (status = 400, description = "`MALFORMED_JSON`, `JSON_TOO_DEEP`, `INVALID_BODY`, `INVALID_QUERY`", body = ErrorBody),
        (status = 413, description = "`PAYLOAD_TOO_LARGE`", body = ErrorBody),
        (status = 415, description = "`UNSUPPORTED_MEDIA_TYPE`: the body is not declared JSON", body = ErrorBody),
        (status = 404, description = "`CONVERSATION_NOT_FOUND`", body = ErrorBody),
        (status = 409, description = "`RUN_ACTIVE`: the conversation has a run that is not over (and `multitaskStrategy` is `reject`, or the run to replace did not end within 60 s)", body = ErrorBody),
        (status = 422, description = "`VALIDATION_FAILED` (also: an unknown `multitaskStrategy`), `UNKNOWN_AGENT`", body = ErrorBody),
    )
)]
pub async fn post_message(
    State(state): State<AppState>,
    caller: Caller,
    ConversationPath(id): ConversationPath,
    params: Params,
    headers: HeaderMap,
    ApiJson(body): ApiJson<PostMessage>,
) -> ApiResult<Response> {
    let wait = params.flag("wait")?;
    let strategy = multitask_strategy(body.multitask_strategy.as_deref())?;
    let message = SendMessage { content: body.content, cancel_on_disconnect: body.cancel_on_disconnect };
    // A stream's slot is taken before the run starts, so a refused stream starts nothing.
    let permit = sse::permit_if_streaming(&state, &caller, &headers)?;
    let follow = permit.is_some();
    let (started, following) = state.engine.send_message_following(&caller.0, &id, message, strategy, follow).await?;
    let run_id = started.run.id;
    if let Some(permit) = permit {
        // just started (or waiting its turn): not over
        return Ok(sse::stream_run(&state, permit, run_id, 0, Until::PauseOrTerminal, Known::Active, following));
    }
    if wait {
        return Ok(Json(super::settle_turn(&state, &caller, &run_id, 0).await?).into_response());
    }
    let accepted = MessageAccepted { message_id: started.message.id, run_id, status: Some(started.run.status) };
    Ok((StatusCode::ACCEPTED, Json(accepted)).into_response())
}

/// `multitaskStrategy`: absent is `reject`. Another value is refused naming the field and the
/// strategies (never echoing the value).
pub(crate) fn multitask_strategy(raw: Option<&str>) -> Result<MultitaskStrategy, crate::error::ApiError> {
    let Some(raw) = raw else { return Ok(MultitaskStrategy::Reject) };
    MultitaskStrategy::parse(raw).ok_or_else(|| {
        crate::error::ApiError::validation(format!(
            "multitaskStrategy: must be one of {}",
            MultitaskStrategy::NAMES.join(", ")
        ))
    })
}
