//! The JSON shapes of responses that are not a domain record as it is (see DESIGN.md, "The
//! contract, by example"). Fields may be added; none may be renamed.

use keel_core::engine::RunView;
use keel_core::{
    CallId, Checkpoint, ConversationId, Interrupt, Message, MessageId, RunId, RunStatus, Timestamp, ToolCallState,
};
use serde::Serialize;

/// `GET /v1/runs/{id}`: what a refreshed page needs. Never a tool's full result.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunBody {
    pub id: RunId,
    pub conversation_id: ConversationId,
    pub user_message_id: MessageId,
    pub status: RunStatus,
    pub reason: Option<String>,
    pub cancel_on_disconnect: bool,
    pub cancel_requested: bool,
    pub last_sequence: i64,
    /// The run's trace id (from its first worker on): its spans and log lines carry it.
    pub trace_id: Option<String>,
    pub checkpoint: Checkpoint,
    pub pending_interrupt: Option<Interrupt>,
    pub tool_calls: Vec<ToolCallBody>,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolCallBody {
    pub id: CallId,
    pub name: String,
    pub state: ToolCallState,
    pub summary: Option<String>,
    pub started_at: Option<Timestamp>,
    pub finished_at: Option<Timestamp>,
}

impl From<RunView> for RunBody {
    fn from(view: RunView) -> Self {
        let RunView { run, pending_interrupt, tool_calls } = view;
        Self {
            last_sequence: run.last_sequence(),
            trace_id: run.checkpoint.trace_id.clone(),
            id: run.id,
            conversation_id: run.conversation_id,
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
                    id: c.id,
                    name: c.name,
                    state: c.state,
                    summary: c.summary,
                    started_at: c.started_at,
                    finished_at: c.finished_at,
                })
                .collect(),
            created_at: run.created_at,
            updated_at: run.updated_at,
        }
    }
}

/// `?wait=true`: the turn once its run paused or ended.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnBody {
    pub run: RunBody,
    /// The run's last assistant message, if it wrote one.
    pub message: Option<Message>,
    /// The decision the run waits for, if it paused.
    pub interrupt: Option<Interrupt>,
}
