//! OpsPilot's simulated fleet.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_core::fleet::FleetSeed;
use serde_json::json;

use crate::error::ApiResult;
use crate::state::AppState;

pub async fn instances(State(state): State<AppState>) -> ApiResult<Response> {
    Ok(Json(state.engine.store().list_instances(None, None).await?).into_response())
}

/// Restores the seeded fleet (routed only in demo mode).
pub async fn reset(State(state): State<AppState>) -> ApiResult<Response> {
    let store = state.engine.store();
    store.seed_fleet(FleetSeed { extra_abnormal: state.config.demo_abnormal }, state.engine.now()).await?;
    let instances = store.list_instances(None, None).await?;
    Ok(Json(json!({"status": "reset", "instances": instances})).into_response())
}
