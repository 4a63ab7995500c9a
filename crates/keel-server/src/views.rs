//! The JSON shapes of responses that are not a domain record as it is (see
//! docs/api.md). Most live in [`keel_core::wire`], shared with the client; the ones here
//! are the server's own. Fields may be added, none may be renamed. Handlers serialize these types,
//! and the OpenAPI spec is derived from them, so the two can't disagree.

use keel_core::engine::ResumeAccepted;
use keel_core::{Conversation, Event, Timestamp};
use serde::Serialize;
use utoipa::ToSchema;

pub use keel_core::wire::{MessageAccepted, RunBody, RunList, RunSummary, ToolCallBody, TurnBody};

/// `GET /v1/conversations`: the caller's conversations.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ConversationList {
    pub conversations: Vec<Conversation>,
}

/// `GET /v1/runs/{id}/events` with `Accept: application/json`: one page of stored events.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct EventPage {
    pub events: Vec<Event>,
    /// More events follow the last one of this page: ask again with `?after=` its `sequence`.
    pub has_more: bool,
}

/// A short-lived, single-use stream ticket (`POST /v1/runs/{id}/stream-ticket`, `POST /v1/ws/ticket`).
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TicketBody {
    /// `kst_…`: pass it as `?ticket=`; it opens one stream, once.
    pub ticket: String,
    #[schema(value_type = String, format = DateTime)]
    pub expires_at: Timestamp,
    /// The path with the ticket in its query, ready to open.
    pub url: String,
}

/// `POST /v1/runs/{id}/resume?wait=true`: the turn once the run paused or ended, with the resume's
/// answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResumedTurn {
    #[serde(flatten)]
    pub turn: TurnBody,
    pub resume: ResumeAccepted,
}

/// `GET /v1/agents`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AgentList {
    pub agents: Vec<keel_core::agent::AgentInfo>,
}

/// `GET /healthz`, `GET /readyz`: `ok`, `ready`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct HealthStatus {
    pub status: String,
}

/// Every error response: `{"error": {"code", "message"}}`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// `SCREAMING_SNAKE`, stable: docs/api.md lists every code.
    #[schema(pattern = "^[A-Z][A-Z_]*$")]
    pub code: String,
    /// For people; may change.
    pub message: String,
}
