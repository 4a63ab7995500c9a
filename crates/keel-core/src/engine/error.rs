//! The engine's failures, each with a stable code the API shows.

use super::*;

/// The engine's failures, each with a stable code the API shows.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0} not found")]
    NotFound(&'static str),
    #[error("the conversation already has an active run ({0}); resume, wait for or cancel it first")]
    RunActive(RunId),
    #[error("the interrupt was already resolved")]
    InterruptAlreadyResolved,
    #[error("the interrupt expired")]
    InterruptExpired,
    #[error("the run is not waiting for a decision")]
    RunNotInterrupted,
    #[error("a request with this idempotency key is still being processed; retry later")]
    IdempotencyKeyInFlight,
    #[error("this idempotency key was used with a different request")]
    IdempotencyKeyReused,
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    InvalidDecision(String),
    #[error("{0}")]
    InvalidArgs(String),
    #[error("{0}")]
    Invalid(String),
    /// A tool result for a call that is not a client-side call of the run, or was not asked for.
    #[error("{0}")]
    UnknownCall(String),
    /// A client-side call's result that breaks the tool's result schema (names the JSON path).
    #[error("{0}")]
    InvalidResult(String),
    #[error("the tool call was already answered")]
    ToolCallAlreadyAnswered,
    #[error("agentId: this server runs no such agent (GET /v1/agents lists them)")]
    UnknownAgent,
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The store refused a write because too many are waiting ([`StoreError::Overloaded`]).
    #[error("the server is overloaded; retry shortly")]
    Overloaded,
    #[error("storage failed: {0}")]
    Store(#[source] StoreError),
}

impl From<StoreError> for EngineError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Overloaded => EngineError::Overloaded,
            other => EngineError::Store(other),
        }
    }
}

impl EngineError {
    /// Every code [`EngineError::code`] can return (the API docs list them; a test compares).
    pub const CODES: &'static [&'static str] = &[
        "CONVERSATION_NOT_FOUND",
        "RUN_NOT_FOUND",
        "INTERRUPT_NOT_FOUND",
        "NOT_FOUND",
        "RUN_ACTIVE",
        "INTERRUPT_ALREADY_RESOLVED",
        "INTERRUPT_EXPIRED",
        "RUN_NOT_INTERRUPTED",
        "IDEMPOTENCY_KEY_IN_FLIGHT",
        "IDEMPOTENCY_KEY_REUSED",
        "FORBIDDEN",
        "INVALID_DECISION",
        "INVALID_ARGS",
        "VALIDATION_FAILED",
        "UNKNOWN_CALL",
        "INVALID_RESULT",
        "TOOL_CALL_ALREADY_ANSWERED",
        "UNKNOWN_AGENT",
        "SHUTTING_DOWN",
        "OVERLOADED",
        "INTERNAL",
    ];

    pub fn code(&self) -> &'static str {
        match self {
            EngineError::NotFound("conversation") => "CONVERSATION_NOT_FOUND",
            EngineError::NotFound("run") => "RUN_NOT_FOUND",
            EngineError::NotFound("interrupt") => "INTERRUPT_NOT_FOUND",
            EngineError::NotFound(_) => "NOT_FOUND",
            EngineError::RunActive(_) => "RUN_ACTIVE",
            EngineError::InterruptAlreadyResolved => "INTERRUPT_ALREADY_RESOLVED",
            EngineError::InterruptExpired => "INTERRUPT_EXPIRED",
            EngineError::RunNotInterrupted => "RUN_NOT_INTERRUPTED",
            EngineError::IdempotencyKeyInFlight => "IDEMPOTENCY_KEY_IN_FLIGHT",
            EngineError::IdempotencyKeyReused => "IDEMPOTENCY_KEY_REUSED",
            EngineError::Forbidden(_) => "FORBIDDEN",
            EngineError::InvalidDecision(_) => "INVALID_DECISION",
            EngineError::InvalidArgs(_) => "INVALID_ARGS",
            EngineError::Invalid(_) => "VALIDATION_FAILED",
            EngineError::UnknownCall(_) => "UNKNOWN_CALL",
            EngineError::InvalidResult(_) => "INVALID_RESULT",
            EngineError::ToolCallAlreadyAnswered => "TOOL_CALL_ALREADY_ANSWERED",
            EngineError::UnknownAgent => "UNKNOWN_AGENT",
            EngineError::ShuttingDown => "SHUTTING_DOWN",
            EngineError::Overloaded => "OVERLOADED",
            EngineError::Store(_) => "INTERNAL",
        }
    }
}

pub type EngineResult<T> = Result<T, EngineError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn every_error_code_is_listed() {
        let all = [
            EngineError::NotFound("conversation"),
            EngineError::NotFound("run"),
            EngineError::NotFound("interrupt"),
            EngineError::NotFound("tool call"),
            EngineError::RunActive(RunId::new()),
            EngineError::InterruptAlreadyResolved,
            EngineError::InterruptExpired,
            EngineError::RunNotInterrupted,
            EngineError::IdempotencyKeyInFlight,
            EngineError::IdempotencyKeyReused,
            EngineError::Forbidden(String::new()),
            EngineError::InvalidDecision(String::new()),
            EngineError::InvalidArgs(String::new()),
            EngineError::Invalid(String::new()),
            EngineError::UnknownCall(String::new()),
            EngineError::InvalidResult(String::new()),
            EngineError::ToolCallAlreadyAnswered,
            EngineError::UnknownAgent,
            EngineError::ShuttingDown,
            EngineError::Overloaded,
            EngineError::Store(StoreError::Backend(String::new())),
        ];
        let codes: std::collections::BTreeSet<_> = all.iter().map(EngineError::code).collect();
        let listed: std::collections::BTreeSet<_> = EngineError::CODES.iter().copied().collect();
        assert_eq!(codes, listed);
    }
}
