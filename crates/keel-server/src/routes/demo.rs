//! OpsPilot's simulated fleet.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_core::fleet::{FleetSeed, Instance};

use crate::error::ApiResult;
use crate::state::AppState;
use crate::views::DemoReset;

#[utoipa::path(
    get,
    path = "/v1/demo/instances",
    operation_id = "listInstances",
    tag = "demo",
    responses((status = 200, description = "The fleet's instances", body = Vec<Instance>))
)]
pub async fn instances(State(state): State<AppState>) -> ApiResult<Response> {
    Ok(Json(state.engine.store().list_instances(None, None).await?).into_response())
}

/// Restores the seeded fleet (routed only in demo mode).
#[utoipa::path(
    post,
    path = "/v1/demo/reset",
    operation_id = "resetDemo",
    tag = "demo",
    description = "Routed only by `keel demo`; elsewhere it is 404 `NOT_FOUND`.",
    responses((status = 200, description = "The fleet as seeded again", body = DemoReset))
)]
pub async fn reset(State(state): State<AppState>) -> ApiResult<Response> {
    let store = state.engine.store();
    store.seed_fleet(FleetSeed { extra_abnormal: state.config.demo_abnormal }, state.engine.now()).await?;
    let instances = store.list_instances(None, None).await?;
    Ok(Json(DemoReset { status: "reset".to_owned(), instances }).into_response())
}
