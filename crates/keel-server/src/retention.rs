//! Replays of runs whose early events retention pruned (docs/operations.md, "Retention").

use keel_core::engine::Engine;
use keel_core::Run;

use crate::error::ApiError;

/// `Ok` when the store still holds every event after `after` of `run`; otherwise 410
/// `EVENTS_PRUNED` with the first sequence it holds. Only a finished run can have lost events, so
/// a live one costs no read.
pub async fn check_held(engine: &Engine, run: &Run, after: i64) -> Result<(), ApiError> {
    if !run.status.is_terminal() || after >= run.last_sequence() {
        return Ok(());
    }
    match engine.store().first_held_sequence(&run.id).await? {
        Some(first_held) if after + 1 < first_held => Err(ApiError::events_pruned(first_held, run.last_sequence())),
        _ => Ok(()),
    }
}
