//! `GET /metrics`: the Prometheus text format. Not under `/v1` and not authenticated: scrape it on
//! a private network (see docs/operations.md).

use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::AppState;

pub const TEXT_FORMAT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Prometheus' text format.
#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "metrics",
    tag = "operations",
    security(()),
    responses((status = 200, description = "The metrics", content_type = "text/plain; version=0.0.4", body = String))
)]
pub async fn metrics(State(state): State<AppState>) -> Response {
    match state.metrics.encode(&state.engine) {
        Ok(text) => {
            let mut response = text.into_response();
            response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(TEXT_FORMAT));
            response
        }
        Err(e) => ApiError::internal(&e).into_response(),
    }
}
