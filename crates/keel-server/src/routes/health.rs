//! Liveness and readiness.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::error::ApiError;
use crate::state::AppState;
use crate::views::{ErrorBody, HealthStatus};

/// The process answers.
#[utoipa::path(
    get,
    path = "/healthz",
    operation_id = "healthz",
    tag = "operations",
    security(()),
    responses((status = 200, description = "`ok`", body = HealthStatus))
)]
pub async fn healthz() -> Response {
    Json(HealthStatus { status: "ok".to_owned() }).into_response()
}

/// The store answers too.
#[utoipa::path(
    get,
    path = "/readyz",
    operation_id = "readyz",
    tag = "operations",
    security(()),
    responses(
        (status = 200, description = "`ready`", body = HealthStatus),
        (status = 503, description = "`NOT_READY`: the store does not answer; `SHUTTING_DOWN`", body = ErrorBody),
    )
)]
pub async fn readyz(State(state): State<AppState>) -> Response {
    match state.engine.store().ping().await {
        Ok(()) if !state.engine.is_shutting_down() => Json(HealthStatus { status: "ready".to_owned() }).into_response(),
        Ok(()) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "SHUTTING_DOWN", "the server is shutting down")
            .into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "readiness check: the store does not answer");
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "NOT_READY", "the store is not reachable").into_response()
        }
    }
}
