//! Liveness and readiness.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::ApiError;
use crate::state::AppState;

/// The process answers.
pub async fn healthz() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

/// The store answers too.
pub async fn readyz(State(state): State<AppState>) -> Response {
    match state.engine.store().ping().await {
        Ok(()) if !state.engine.is_shutting_down() => Json(json!({"status": "ready"})).into_response(),
        Ok(()) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "SHUTTING_DOWN", "the server is shutting down")
            .into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "readiness check: the store does not answer");
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "NOT_READY", "the store is not reachable").into_response()
        }
    }
}
