//! Every error a client sees, in one shape: `{"error": {"code": "SCREAMING_SNAKE", "message": "…"}}`.
//!
//! Engine errors map here exhaustively, so a new kind of failure cannot slip through as a 500.
//! Storage failures are logged with their cause chain and shown only as "internal error".

use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_core::engine::EngineError;
use keel_core::store::StoreError;
use serde_json::json;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// Seconds, sent as `Retry-After` (with 429 and 503).
    pub retry_after: Option<u64>,
    /// Fields of the error object besides `code` and `message` (`firstHeldSequence` of
    /// `EVENTS_PRUNED`).
    pub fields: Option<serde_json::Map<String, serde_json::Value>>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), retry_after: None, fields: None }
    }

    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// 410 `EVENTS_PRUNED`: retention deleted events a replay asked for; the run still holds the
    /// events from `first_held` on (none when it is past `last`).
    pub fn events_pruned(first_held: i64, last: i64) -> Self {
        let message = if first_held > last {
            format!("the run's events were pruned by retention (first held sequence {first_held}: none is held)")
        } else {
            format!("the run's events before {first_held} were pruned by retention (first held sequence {first_held})")
        };
        let mut fields = serde_json::Map::new();
        fields.insert("firstHeldSequence".into(), first_held.into());
        Self { fields: Some(fields), ..Self::new(StatusCode::GONE, "EVENTS_PRUNED", message) }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    pub fn validation(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "VALIDATION_FAILED", message)
    }

    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "NOT_FOUND", "no such resource")
    }

    pub fn method_not_allowed() -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "METHOD_NOT_ALLOWED", "this method is not allowed on this resource")
    }

    /// A failure the client can do nothing about: the cause goes to the log, never to the client.
    pub fn internal(cause: &(dyn std::error::Error + 'static)) -> Self {
        tracing::error!(error = %cause, chain = %cause_chain(cause), "request failed");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL", "internal error")
    }
}

/// `outer: inner: innermost`.
fn cause_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        out.push_str(": ");
        out.push_str(&e.to_string());
        source = e.source();
    }
    out
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let status = match &e {
            EngineError::NotFound(_) => StatusCode::NOT_FOUND,
            EngineError::RunActive(_) => StatusCode::CONFLICT,
            EngineError::InterruptAlreadyResolved | EngineError::ToolCallAlreadyAnswered => StatusCode::CONFLICT,
            EngineError::InterruptExpired => StatusCode::GONE,
            EngineError::RunNotInterrupted => StatusCode::CONFLICT,
            EngineError::IdempotencyKeyInFlight => StatusCode::CONFLICT,
            EngineError::IdempotencyKeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            EngineError::Forbidden(_) => StatusCode::FORBIDDEN,
            EngineError::InvalidDecision(_)
            | EngineError::InvalidArgs(_)
            | EngineError::Invalid(_)
            | EngineError::UnknownCall(_)
            | EngineError::InvalidResult(_)
            | EngineError::UnknownAgent => StatusCode::UNPROCESSABLE_ENTITY,
            EngineError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            // nothing was written; the queue drains in milliseconds
            EngineError::Overloaded => {
                return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.code(), e.to_string()).retry_after(1)
            }
            EngineError::Store(cause) => return ApiError::internal(cause),
        };
        ApiError::new(status, e.code(), e.to_string())
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        EngineError::from(e).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut error = json!({"code": self.code, "message": self.message});
        if let (Some(fields), Some(object)) = (self.fields, error.as_object_mut()) {
            object.extend(fields);
        }
        let body = json!({ "error": error });
        let mut response = (self.status, Json(body)).into_response();
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// The codes the server answers with on its own, besides the engine's
/// ([`keel_core::engine::EngineError::CODES`]). docs/api.md lists both; a test compares.
pub const ERROR_CODES: &[&str] = &[
    "MALFORMED_JSON",
    "INVALID_CURSOR",
    "CURSOR_OUT_OF_RANGE",
    "EVENTS_PRUNED",
    "UNAUTHENTICATED",
    "INVALID_TICKET",
    "JSON_TOO_DEEP",
    "RATE_LIMITED",
    "TOO_MANY_STREAMS",
    "INVALID_QUERY",
    "INVALID_BODY",
    "NOT_FOUND",
    "METHOD_NOT_ALLOWED",
    "PAYLOAD_TOO_LARGE",
    "UNSUPPORTED_MEDIA_TYPE",
    "VALIDATION_FAILED",
    "NOT_READY",
    "UPGRADE_REQUIRED",
    "HOST_NOT_ALLOWED",
    "INTERNAL",
    // LangGraph Server's API (docs/langgraph.md).
    "UNSUPPORTED_OPTION",
    "THREAD_EXISTS",
    "ASSISTANT_NOT_FOUND",
];

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::RunId;

    #[test]
    fn engine_errors_keep_their_codes() {
        let cases = [
            (EngineError::NotFound("conversation"), 404, "CONVERSATION_NOT_FOUND"),
            (EngineError::NotFound("run"), 404, "RUN_NOT_FOUND"),
            (EngineError::RunActive(RunId::new()), 409, "RUN_ACTIVE"),
            (EngineError::InterruptAlreadyResolved, 409, "INTERRUPT_ALREADY_RESOLVED"),
            (EngineError::InterruptExpired, 410, "INTERRUPT_EXPIRED"),
            (EngineError::RunNotInterrupted, 409, "RUN_NOT_INTERRUPTED"),
            (EngineError::IdempotencyKeyInFlight, 409, "IDEMPOTENCY_KEY_IN_FLIGHT"),
            (EngineError::IdempotencyKeyReused, 422, "IDEMPOTENCY_KEY_REUSED"),
            (EngineError::Forbidden("no".into()), 403, "FORBIDDEN"),
            (EngineError::InvalidDecision("x".into()), 422, "INVALID_DECISION"),
            (EngineError::InvalidArgs("x".into()), 422, "INVALID_ARGS"),
            (EngineError::Invalid("x".into()), 422, "VALIDATION_FAILED"),
            (EngineError::ShuttingDown, 503, "SHUTTING_DOWN"),
            (EngineError::Overloaded, 503, "OVERLOADED"),
        ];
        for (e, status, code) in cases {
            let api = ApiError::from(e);
            assert_eq!(api.status.as_u16(), status, "{code}");
            assert_eq!(api.code, code);
        }
    }

    #[test]
    fn an_overloaded_store_is_a_503_to_retry_after_a_second() {
        let api = ApiError::from(StoreError::Overloaded);
        assert_eq!((api.code, api.retry_after), ("OVERLOADED", Some(1)));
        let response = api.into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[RETRY_AFTER], "1");
    }

    #[test]
    fn storage_failures_say_nothing_of_their_cause() {
        let api = ApiError::from(StoreError::Backend("no such table: runs (SELECT * FROM runs)".into()));
        assert_eq!(api.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(api.code, "INTERNAL");
        assert_eq!(api.message, "internal error");
    }
}
