//! The demo's own routes, added to the server's authenticated `/v1` routes: the fleet as it is now,
//! and (in demo mode only) putting it back as seeded.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use keel_server::ApiError;
use serde::Serialize;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::fleet::{Fleet, FleetError, FleetSeed, Instance, ServiceSummary};

/// The most instances the listing returns (the demo seeds tens; a bench, thousands).
const LIST_LIMIT: u32 = 10_000;

/// The tag the demo's operations are listed under in the served spec.
#[derive(utoipa::OpenApi)]
#[openapi(tags((name = "demo", description = "OpsPilot's simulated fleet (`keel demo`)")))]
struct DemoDoc;

#[derive(Clone)]
struct Demo {
    fleet: Arc<dyn Fleet>,
    seed: FleetSeed,
}

/// `POST /v1/demo/reset`'s answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct DemoReset {
    /// `reset`.
    pub status: String,
    pub instances: Vec<Instance>,
}

fn failed(e: FleetError) -> ApiError {
    ApiError::internal(&e)
}

/// The routes for a server's `/v1` (behind its authentication); `reset` is routed only when
/// `demo_mode` (`keel demo`), where it seeds `seed` again.
pub fn routes<S: Clone + Send + Sync + 'static>(
    fleet: Arc<dyn Fleet>,
    seed: FleetSeed,
    demo_mode: bool,
) -> OpenApiRouter<S> {
    let mut router =
        OpenApiRouter::with_openapi(DemoDoc::openapi()).routes(routes!(instances)).routes(routes!(services));
    if demo_mode {
        router = router.routes(routes!(reset));
    }
    router.with_state(Demo { fleet, seed })
}

/// The fleet's instances, by id.
#[utoipa::path(
    get,
    path = "/v1/demo/instances",
    operation_id = "listInstances",
    tag = "demo",
    responses((status = 200, description = "The fleet's instances", body = Vec<Instance>))
)]
async fn instances(State(demo): State<Demo>) -> Result<Response, ApiError> {
    Ok(Json(demo.fleet.instances(LIST_LIMIT).await.map_err(failed)?).into_response())
}

/// Each service in each environment: how many instances it has, how many are abnormal.
#[utoipa::path(
    get,
    path = "/v1/demo/services",
    operation_id = "listServices",
    tag = "demo",
    responses((status = 200, description = "The fleet's services", body = Vec<ServiceSummary>))
)]
async fn services(State(demo): State<Demo>) -> Result<Response, ApiError> {
    Ok(Json(demo.fleet.services().await.map_err(failed)?).into_response())
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
async fn reset(State(demo): State<Demo>) -> Result<Response, ApiError> {
    demo.fleet.seed(demo.seed, chrono::Utc::now()).await.map_err(failed)?;
    let instances = demo.fleet.instances(LIST_LIMIT).await.map_err(failed)?;
    Ok((StatusCode::OK, Json(DemoReset { status: "reset".to_owned(), instances })).into_response())
}
