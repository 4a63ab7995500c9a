//! The v1 routes, one module per resource.

pub mod ag_ui;
pub mod agents;
pub mod conversations;
pub mod health;
pub mod metrics;
pub mod runs;
pub mod ws;

use std::sync::Arc;

use keel_core::engine::Engine;
use keel_core::{Role, RunId};

use crate::error::{ApiError, ApiResult};
use crate::extract::Caller;
use crate::state::AppState;
use crate::views::{RunBody, TurnBody};

pub async fn not_found() -> ApiError {
    ApiError::not_found()
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

/// `?wait=true`: waits until the run pauses or ends after `after`, then answers with the turn.
async fn settle_turn(state: &AppState, caller: &Caller, run_id: &RunId, after: i64) -> ApiResult<TurnBody> {
    let engine = &state.engine;
    // A client that gives up waiting went away, like one that closes its stream.
    let guard = DetachGuard { engine: engine.clone(), run_id: Some(run_id.clone()) };
    tokio::select! {
        settled = engine.wait_settled(run_id, after) => { settled?; }
        () = state.shutdown.wait() => return Err(keel_core::engine::EngineError::ShuttingDown.into()),
    }
    guard.disarm();
    let view = engine.run_view(&caller.0, run_id).await?;
    let messages = engine.store().list_run_messages(run_id).await?;
    let message = messages.into_iter().rev().find(|m| m.role == Role::Assistant);
    let interrupt = view.pending_interrupt.clone();
    Ok(TurnBody { run: RunBody::from(view), message, interrupt })
}

/// Tells the engine the client went away when a waiting request is dropped before it answered.
struct DetachGuard {
    engine: Arc<Engine>,
    run_id: Option<RunId>,
}

impl DetachGuard {
    fn disarm(mut self) {
        self.run_id = None;
    }
}

impl Drop for DetachGuard {
    fn drop(&mut self) {
        let (Some(run_id), Ok(runtime)) = (self.run_id.take(), tokio::runtime::Handle::try_current()) else {
            return;
        };
        let engine = self.engine.clone();
        runtime.spawn(async move {
            if let Err(e) = engine.client_detached(&run_id).await {
                tracing::warn!(run_id = %run_id, error = %e, "handling a detached client failed");
            }
        });
    }
}
