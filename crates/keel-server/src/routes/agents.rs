//! `GET /v1/agents`: the agents this server runs.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::error::ApiResult;
use crate::extract::Caller;
use crate::state::AppState;
use crate::views::AgentList;

/// Every agent, with its tools and their policies; `default` marks the one a conversation that
/// names none talks to.
#[utoipa::path(
    get,
    path = "/v1/agents",
    operation_id = "listAgents",
    tag = "agents",
    responses((status = 200, description = "The agents this server runs", body = AgentList))
)]
pub async fn list(State(state): State<AppState>, _caller: Caller) -> ApiResult<Response> {
    Ok(Json(AgentList { agents: state.engine.agents().infos() }).into_response())
}
