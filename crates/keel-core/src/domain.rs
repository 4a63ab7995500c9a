//! The records Keel keeps and the state machines that govern them.
//!
//! Every status change goes through one `transition` function per machine, so the allowed moves
//! are written down exactly once; the stores turn each move into a conditional update on the
//! `from` state, so a move that lost a race is refused, never applied.

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ids::{CallId, ConversationId, InterruptId, MessageId, RunId};
use crate::mask::Masked;

pub type Timestamp = DateTime<Utc>;

/// A move a state machine does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{machine}: {from} -> {to} is not an allowed transition")]
pub struct InvalidTransition {
    pub machine: &'static str,
    pub from: String,
    pub to: String,
}

macro_rules! string_enum {
    ($(#[$doc:meta])* $name:ident { $($variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
        #[serde(rename_all = "snake_case")]
        pub enum $name { $($variant),+ }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }

            pub fn parse(s: &str) -> Option<Self> {
                match s { $($text => Some($name::$variant),)+ _ => None }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

string_enum!(
    /// `(waiting →) queued → running → (interrupted → running)* → completed | failed | cancelled
    /// (→ rolled_back)`. A run `waiting` is a message queued behind the conversation's active run
    /// (LangGraph's `enqueue`); a `rolled_back` run is one whose messages and events were removed
    /// (LangGraph's `rollback`), its tool calls and interrupts kept for the audit.
    RunStatus {
        Queued => "queued",
        Running => "running",
        Interrupted => "interrupted",
        Completed => "completed",
        Failed => "failed",
        Cancelled => "cancelled",
        Waiting => "waiting",
        RolledBack => "rolled_back",
    }
);

impl RunStatus {
    /// The run state machine, in one place.
    pub fn can_transition_to(self, to: RunStatus) -> bool {
        use RunStatus::*;
        matches!(
            (self, to),
            (Queued, Running)
                | (Queued, Cancelled)
                | (Queued, Failed)
                | (Running, Interrupted)
                | (Running, Completed)
                | (Running, Failed)
                | (Running, Cancelled)
                | (Interrupted, Running)
                | (Interrupted, Cancelled)
                | (Interrupted, Failed)
                // its turn came (the active run ended), or it was cancelled before it ran
                | (Waiting, Queued)
                | (Waiting, Cancelled)
                // a finished run removed from its conversation
                | (Completed, RolledBack)
                | (Failed, RolledBack)
                | (Cancelled, RolledBack)
        )
    }

    pub fn transition(self, to: RunStatus) -> Result<RunStatus, InvalidTransition> {
        if self.can_transition_to(to) {
            Ok(to)
        } else {
            Err(InvalidTransition { machine: "run", from: self.to_string(), to: to.to_string() })
        }
    }

    /// The states from which `to` may be entered.
    pub fn sources_of(to: RunStatus) -> Vec<RunStatus> {
        RunStatus::ALL.iter().copied().filter(|from| from.can_transition_to(to)).collect()
    }

    /// The run is over: nothing runs in it any more (completed, failed, cancelled, or rolled back).
    /// A finished run may still be rolled back, once; nothing follows `rolled_back`.
    pub fn is_terminal(self) -> bool {
        matches!(self, RunStatus::Completed | RunStatus::Failed | RunStatus::Cancelled | RunStatus::RolledBack)
    }

    /// Queued, running or interrupted: the run holds its conversation (one at a time), and a new
    /// message either waits behind it, replaces it or is refused.
    pub fn is_active(self) -> bool {
        matches!(self, RunStatus::Queued | RunStatus::Running | RunStatus::Interrupted)
    }
}

string_enum!(
    /// What an interrupt asks a human: to confirm actions; to pick an option; to provide values; what
    /// became of an action whose outcome is unknown (retry it with the same key, or say it was done,
    /// or that it failed); to run a client-side tool and give its result.
    InterruptKind {
        ConfirmAction => "confirm_action",
        SelectOption => "select_option",
        ProvideInput => "provide_input",
        OutcomeUnknown => "outcome_unknown",
        ToolCall => "tool_call",
    }
);

string_enum!(
    InterruptStatus {
        Pending => "pending",
        Resolved => "resolved",
        Expired => "expired",
        Cancelled => "cancelled",
    }
);

impl InterruptStatus {
    pub fn can_transition_to(self, to: InterruptStatus) -> bool {
        use InterruptStatus::*;
        matches!((self, to), (Pending, Resolved) | (Pending, Expired) | (Pending, Cancelled))
    }

    pub fn transition(self, to: InterruptStatus) -> Result<InterruptStatus, InvalidTransition> {
        if self.can_transition_to(to) {
            Ok(to)
        } else {
            Err(InvalidTransition { machine: "interrupt", from: self.to_string(), to: to.to_string() })
        }
    }
}

string_enum!(
    /// A tool call's life: `requested` by the model; `asking` a human, `allowed` or `denied` by policy or
    /// decision; `executing`; then `succeeded`, `failed`, `suspended` (waiting for an external result) or
    /// `unknown` (a non-idempotent call cut off by a crash: a human decides).
    ToolCallState {
        Requested => "requested",
        Asking => "asking",
        Allowed => "allowed",
        Denied => "denied",
        Executing => "executing",
        Succeeded => "succeeded",
        Failed => "failed",
        Suspended => "suspended",
        Unknown => "unknown",
    }
);

impl ToolCallState {
    pub fn can_transition_to(self, to: ToolCallState) -> bool {
        use ToolCallState::*;
        matches!(
            (self, to),
            (Requested, Asking)
                | (Requested, Allowed)
                | (Requested, Denied)
                | (Asking, Allowed)
                | (Asking, Denied)
                // a precheck that fails after approval: the call never starts
                | (Allowed, Failed)
                | (Allowed, Executing)
                | (Executing, Succeeded)
                | (Executing, Failed)
                | (Executing, Suspended)
                | (Executing, Unknown)
                // recovery of an idempotent call: run it again
                | (Executing, Executing)
                | (Suspended, Succeeded)
                | (Suspended, Failed)
                // a human decides what to do with a call whose outcome is unknown: run it again with
                // the same key, or record that it was done, or that it failed
                | (Unknown, Allowed)
                | (Unknown, Denied)
                | (Unknown, Succeeded)
                | (Unknown, Failed)
        )
    }

    pub fn transition(self, to: ToolCallState) -> Result<ToolCallState, InvalidTransition> {
        if self.can_transition_to(to) {
            Ok(to)
        } else {
            Err(InvalidTransition { machine: "tool_call", from: self.to_string(), to: to.to_string() })
        }
    }

    /// The call has its final result.
    pub fn is_settled(self) -> bool {
        matches!(self, ToolCallState::Succeeded | ToolCallState::Failed | ToolCallState::Denied)
    }
}

string_enum!(
    Role { User => "user", Assistant => "assistant", Tool => "tool" }
);

string_enum!(
    /// What a user may do. `viewer`: read-only tools; `operator`: may approve side effects.
    UserRole { Viewer => "viewer", Operator => "operator", Admin => "admin" }
);

string_enum!(
    FactSource { ToolResult => "tool_result", UserConfirmed => "user_confirmed" }
);

string_enum!(
    /// Where a run continues from.
    NextStep {
        CallModel => "call_model",
        ExecuteTools => "execute_tools",
        AwaitInterrupt => "await_interrupt",
        AwaitExternal => "await_external",
        Finalize => "finalize",
    }
);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Conversation {
    pub id: ConversationId,
    pub user_id: String,
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub title: Masked<String>,
    /// The agent the conversation talks to; `None` for a conversation made before agents, which
    /// talks to the default agent.
    #[serde(default)]
    pub agent_id: Option<String>,
    /// Bumps on every message, so a resume notices a conversation that changed while it waited.
    pub version: i64,
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Message {
    pub id: MessageId,
    pub conversation_id: ConversationId,
    pub run_id: Option<RunId>,
    pub role: Role,
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub content: Masked<String>,
    pub tool_call_id: Option<CallId>,
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Fact {
    pub key: String,
    pub value: Masked<String>,
    pub source: FactSource,
    pub updated_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    pub conversation_id: ConversationId,
    pub through_message_id: MessageId,
    pub text: Masked<String>,
}

/// The minimal state a run needs to continue, written with every state change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    pub next_step: NextStep,
    /// Model calls made so far; bounded by the engine's `max_iterations`.
    pub iteration: u32,
    /// The calls the next step works on.
    #[serde(default)]
    pub pending_call_ids: Vec<CallId>,
    /// The conversation's version when this checkpoint was written.
    pub conversation_version: i64,
    /// The assistant message a model call is streaming into, while it streams. A run recovered with
    /// this set knows that message was cut off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streaming_message_id: Option<MessageId>,
    /// The last assistant message with text: what `done` points at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer_message_id: Option<MessageId>,
    /// The run's trace id (also on `run_started`): every worker that continues the run joins its
    /// spans to this trace. Set by the first worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
}

impl Checkpoint {
    pub fn start(conversation_version: i64) -> Self {
        Self {
            next_step: NextStep::CallModel,
            iteration: 0,
            pending_call_ids: Vec::new(),
            conversation_version,
            streaming_message_id: None,
            answer_message_id: None,
            trace_id: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Run {
    pub id: RunId,
    pub conversation_id: ConversationId,
    pub user_message_id: MessageId,
    pub user_id: String,
    /// The agent that runs it (its conversation's); `None` for a run made before agents.
    #[serde(default)]
    pub agent_id: Option<String>,
    pub status: RunStatus,
    pub reason: Option<String>,
    pub cancel_on_disconnect: bool,
    pub cancel_requested: bool,
    /// The sequence the next event of this run gets; `last_sequence = next_sequence - 1`.
    pub next_sequence: i64,
    pub lease_owner: Option<String>,
    pub lease_expires_at: Option<Timestamp>,
    /// The instance that holds or last held the run's lease ([`lease_holder`] of the owner token);
    /// kept when the lease is let go, so a finished run says where it ran. `None` until leased
    /// (written leased, or claimed).
    #[serde(default)]
    pub worker: Option<String>,
    pub checkpoint: Checkpoint,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    /// When the run was hidden from the LangGraph API (`runs.delete`, [`RunStore::hide_run`]); Keel
    /// keeps it, with its events, for its own API and audit. `None` for a run shown.
    ///
    /// [`RunStore::hide_run`]: crate::store::RunStore::hide_run
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_at: Option<Timestamp>,
}

impl Run {
    pub fn last_sequence(&self) -> i64 {
        self.next_sequence - 1
    }
}

/// The instance named by a lease owner token (`instance_id:unique`): the part before its last
/// colon, or the whole token when it has none.
pub fn lease_holder(owner: &str) -> &str {
    owner.rsplit_once(':').map_or(owner, |(instance, _)| instance)
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Interrupt {
    pub id: InterruptId,
    pub run_id: RunId,
    pub kind: InterruptKind,
    pub status: InterruptStatus,
    /// What the human sees; masked (no secrets, no raw tool results).
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub payload: Masked<Value>,
    pub call_ids: Vec<CallId>,
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: Timestamp,
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub expires_at: Timestamp,
    #[cfg_attr(feature = "openapi", schema(value_type = Option<serde_json::Value>))]
    pub decision: Option<Masked<Value>>,
    /// What the human who decided wrote with the decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub note: Option<Masked<String>>,
    pub resolved_by: Option<String>,
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub resolved_at: Option<Timestamp>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolCall {
    pub id: CallId,
    pub run_id: RunId,
    pub name: String,
    /// Masked like everything a model or a user supplies: a tool never receives a secret from the
    /// model; what it needs comes from its own configuration.
    pub args: Masked<Value>,
    pub state: ToolCallState,
    /// The full result as the model sees it. Never streamed: events carry `summary`.
    pub result: Option<Masked<Value>>,
    pub summary: Option<Masked<String>>,
    /// Attempts started so far (each committed `executing` before the tool is called).
    #[serde(default)]
    pub attempts: u32,
    pub started_at: Option<Timestamp>,
    pub finished_at: Option<Timestamp>,
}

/// Facts as the API and the model see them: key → value.
pub type FactMap = BTreeMap<String, String>;

pub fn fact_map(facts: &[Fact]) -> FactMap {
    facts.iter().map(|f| (f.key.clone(), f.value.as_str().to_owned())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_runs_go_nowhere_but_to_a_rollback() {
        for from in [RunStatus::Completed, RunStatus::Failed, RunStatus::Cancelled, RunStatus::RolledBack] {
            for to in RunStatus::ALL {
                let allowed = *to == RunStatus::RolledBack && from != RunStatus::RolledBack;
                assert_eq!(from.transition(*to).is_ok(), allowed, "{from} -> {to}");
            }
        }
    }

    #[test]
    fn a_waiting_run_is_neither_active_nor_over() {
        let waiting = RunStatus::Waiting;
        assert!(!waiting.is_active() && !waiting.is_terminal());
        assert_eq!(RunStatus::sources_of(RunStatus::Queued), vec![RunStatus::Waiting]);
        assert_eq!(
            RunStatus::sources_of(RunStatus::RolledBack),
            vec![RunStatus::Completed, RunStatus::Failed, RunStatus::Cancelled]
        );
    }

    #[test]
    fn string_forms_round_trip() {
        for s in ToolCallState::ALL {
            assert_eq!(ToolCallState::parse(s.as_str()), Some(*s));
        }
        assert_eq!(RunStatus::parse("bogus"), None);
    }

    #[test]
    fn sources_follow_the_machine() {
        assert_eq!(RunStatus::sources_of(RunStatus::Interrupted), vec![RunStatus::Running]);
        assert!(RunStatus::sources_of(RunStatus::Waiting).is_empty());
    }
}

string_enum!(
    /// What a stream ticket opens: one run's event stream, or one WebSocket connection.
    TicketScope { RunEvents => "run_events", WebSocket => "websocket" }
);

/// A user the server knows, with how many API keys it holds that are not revoked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct User {
    pub id: String,
    pub role: UserRole,
    pub active_keys: u64,
}

/// An API key as stored: the SHA-256 of the key, never the key itself (it is shown once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    /// Public, for listing and revoking: `key_` and the first hex digits of the hash.
    pub id: String,
    pub user_id: String,
    pub key_hash: String,
    pub created_at: Timestamp,
    pub revoked_at: Option<Timestamp>,
}

/// A short-lived, single-use ticket, stored by the SHA-256 of its secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamTicket {
    pub ticket_hash: String,
    pub user_id: String,
    pub scope: TicketScope,
    /// The run whose events it opens (scope `run_events`).
    pub run_id: Option<RunId>,
    pub expires_at: Timestamp,
    pub used_at: Option<Timestamp>,
}
