//! The JSON bodies of the HTTP API (v1) that are not a domain record as it is, shared by the server
//! (`keel-server`, which serializes them) and the client (`keel-client`, which deserializes them),
//! so both sides agree by construction. Shapes follow docs/api.md: fields
//! may be added (with `#[serde(default)]`, so an older server still decodes); none may be renamed.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::domain::{Checkpoint, Interrupt, Message, Run, RunStatus, Timestamp, ToolCallState};
use crate::engine::RunView;
use crate::ids::{CallId, ConversationId, MessageId, RunId};

// --- requests

/// `POST /v1/conversations` (an empty body is fine).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct CreateConversation {
    /// At most 200 characters once trimmed; empty or absent is "New conversation".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// The agent the conversation talks to (`GET /v1/agents`); the default agent when absent. An
    /// unknown one is 422 `UNKNOWN_AGENT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
}

/// `POST /v1/conversations/{id}/messages`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PostMessage {
    /// Not empty once trimmed; no NUL characters; at most 32,000 characters unless the server is
    /// configured otherwise (`--max-message-chars`).
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 32000))]
    pub content: String,
    /// Cancel the run when the client streaming it goes away.
    #[serde(default)]
    pub cancel_on_disconnect: bool,
    /// While the conversation has a run that is not over: `reject` (409 `RUN_ACTIVE`, the
    /// default), `interrupt` (that run is cancelled, keeping what it did, and this message's run
    /// starts once it has ended), `enqueue` (this message waits its turn, durably, and its run
    /// starts once the runs ahead of it have ended) or `rollback` (as `interrupt`, then the
    /// cancelled run's messages and events are removed; its tool calls and interrupts are kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multitask_strategy: Option<String>,
}

/// `POST /v1/runs/{id}/resume`. Loosely typed on purpose: the server validates each field itself so
/// that a bad one gets its own 422 message, not a generic decoding error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ResumeBody {
    #[cfg_attr(feature = "openapi", schema(pattern = "^int_[A-Za-z0-9_-]{1,64}$"))]
    pub interrupt_id: String,
    /// `"approve"`, `"reject"`, `{"edit": {callId: args}}` (a `confirm_action`); `"retry"`,
    /// `"mark_done"`, `"mark_failed"` (an `outcome_unknown`); `{"calls": {callId: decision}}` (either);
    /// `{"select": …}`, `{"provide": …}`.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(schema_with = decision_schema, required = true))]
    pub decision: Option<Value>,
    /// May come from an `Idempotency-Key` header instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 200))]
    pub idempotency_key: Option<String>,
    /// Why, in the decider's words: stored (masked) with the decision and shown with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(max_length = 2000))]
    pub note: Option<String>,
}

/// `POST /v1/runs/{id}/tool-results`: a client-side call's result, or the error the client got
/// running it (exactly one). Loosely typed on purpose, like [`ResumeBody`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ToolResultBody {
    /// The call (`callId` of the `tool_call` interrupt's payload).
    #[cfg_attr(feature = "openapi", schema(pattern = "^call_[A-Za-z0-9_-]{1,64}$"))]
    pub call_id: String,
    /// The call's result (any JSON but `null`), checked against the tool's `result_schema`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// What went wrong on the client (1 to 2,000 characters); the model is told.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(max_length = 2000))]
    pub error: Option<String>,
    /// May come from an `Idempotency-Key` header instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 200))]
    pub idempotency_key: Option<String>,
}

/// A decision is a string or an object; `null` or a missing one is refused (422).
#[cfg(feature = "openapi")]
fn decision_schema() -> utoipa::openapi::schema::Object {
    use utoipa::openapi::schema::{ObjectBuilder, SchemaType, Type};
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::String, Type::Object]))
        .description(Some(
            "`\"approve\"`, `\"reject\"`, `{\"edit\": {callId: args}}`, `\"retry\"`, `\"mark_done\"`, \
             `\"mark_failed\"`, `{\"calls\": {…}}`, `{\"select\": …}`, `{\"provide\": …}` (docs/api.md, \"Decisions\").",
        ))
        .build()
}

// --- responses

/// `POST /v1/conversations/{id}/messages` → 202.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct MessageAccepted {
    pub message_id: MessageId,
    pub run_id: RunId,
    /// The run's status: `queued` (it starts now), or `waiting` (`multitaskStrategy` `enqueue`:
    /// it waits its turn behind the conversation's run, and its message joins the conversation when
    /// it starts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<RunStatus>,
}

/// `GET /v1/runs/{id}`: what a refreshed page needs, and the run's history of decisions. Never a
/// tool's full result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RunBody {
    pub id: RunId,
    pub conversation_id: ConversationId,
    /// The agent it runs (its conversation's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    pub user_message_id: MessageId,
    pub status: RunStatus,
    pub reason: Option<String>,
    pub cancel_on_disconnect: bool,
    pub cancel_requested: bool,
    pub last_sequence: i64,
    /// The instance (its `--instance-id`) that holds the run's lease, or held it last: where the
    /// run runs or ran (from the start, for a run its instance starts at once). `null` while it
    /// waits, queued, for an instance with a free slot.
    #[serde(default)]
    pub worker: Option<String>,
    /// The run's trace id (from its first worker on): its spans and log lines carry it.
    #[serde(default)]
    pub trace_id: Option<String>,
    pub checkpoint: Checkpoint,
    pub pending_interrupt: Option<Interrupt>,
    pub tool_calls: Vec<ToolCallBody>,
    /// Every interrupt of the run, oldest first, with its status, decision, `resolvedBy` and
    /// `resolvedAt`: who decided what, when.
    #[serde(default)]
    pub interrupts: Vec<Interrupt>,
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: Timestamp,
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub updated_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ToolCallBody {
    pub id: CallId,
    pub name: String,
    pub state: ToolCallState,
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub summary: Option<crate::mask::Masked<String>>,
    /// Attempts started (each with the call's one idempotency key).
    #[serde(default)]
    pub attempts: u32,
    /// Why a failed call failed, as `tool_finished.errorCode` says it (`timeout`, `http_500`,
    /// `marked_failed`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub started_at: Option<Timestamp>,
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub finished_at: Option<Timestamp>,
}

impl From<RunView> for RunBody {
    fn from(view: RunView) -> Self {
        let RunView { run, pending_interrupt, tool_calls, interrupts } = view;
        Self {
            last_sequence: run.last_sequence(),
            trace_id: run.checkpoint.trace_id.clone(),
            worker: run.worker,
            id: run.id,
            conversation_id: run.conversation_id,
            agent_id: run.agent_id,
            user_message_id: run.user_message_id,
            status: run.status,
            reason: run.reason,
            cancel_on_disconnect: run.cancel_on_disconnect,
            cancel_requested: run.cancel_requested,
            checkpoint: run.checkpoint,
            pending_interrupt,
            tool_calls: tool_calls
                .into_iter()
                .map(|c| ToolCallBody {
                    error_code: (c.state == ToolCallState::Failed)
                        .then(|| c.result.as_ref().and_then(|r| r["code"].as_str().map(str::to_owned)))
                        .flatten(),
                    id: c.id,
                    name: c.name,
                    state: c.state,
                    summary: c.summary,
                    attempts: c.attempts,
                    started_at: c.started_at,
                    finished_at: c.finished_at,
                })
                .collect(),
            interrupts,
            created_at: run.created_at,
            updated_at: run.updated_at,
        }
    }
}

/// `?wait=true`: the turn once its run paused or ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TurnBody {
    pub run: RunBody,
    /// The run's last assistant message, if it wrote one.
    pub message: Option<Message>,
    /// The decision the run waits for, if it paused.
    pub interrupt: Option<Interrupt>,
}

/// `GET /v1/runs`: the caller's runs, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RunList {
    pub runs: Vec<RunSummary>,
}

/// One run of `GET /v1/runs`: its state, without checkpoint, calls or interrupts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RunSummary {
    pub id: RunId,
    pub conversation_id: ConversationId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    pub status: RunStatus,
    pub reason: Option<String>,
    pub last_sequence: i64,
    /// The instance that runs or ran it (see `RunBody::worker`).
    #[serde(default)]
    pub worker: Option<String>,
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: Timestamp,
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub updated_at: Timestamp,
}

impl From<Run> for RunSummary {
    fn from(run: Run) -> Self {
        Self {
            last_sequence: run.last_sequence(),
            id: run.id,
            conversation_id: run.conversation_id,
            agent_id: run.agent_id,
            status: run.status,
            reason: run.reason,
            worker: run.worker,
            created_at: run.created_at,
            updated_at: run.updated_at,
        }
    }
}
