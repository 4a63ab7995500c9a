//! What both stores answer when a commit's fence matches no row, from the run row as it is.

use keel_core::domain::RunStatus;
use keel_core::store::{Commit, Fence, StoreError};

/// Why the fence matched the run row (`status`, `lease_owner`) not: the run is not in the state the
/// writer expects, or its status may not follow into the commit's new one (the fence's `UPDATE`
/// checks both at once; this tells them apart).
pub(crate) fn refusal(c: &Commit, status: &str, lease_owner: Option<&str>) -> StoreError {
    let current = RunStatus::parse(status);
    let fenced = match (&c.fence, current) {
        (Fence::Lease { owner, .. }, Some(s)) => s.is_active() && lease_owner == Some(owner.as_str()),
        (Fence::Acquire { from, .. } | Fence::Unowned { from }, Some(s)) => from.contains(&s),
        (_, None) => false,
    };
    if let (true, Some(from), Some(change)) = (fenced, current, &c.run) {
        return StoreError::Conflict(format!("run {}: {from} -> {} is not allowed", c.run_id, change.to));
    }
    StoreError::Conflict(match &c.fence {
        Fence::Lease { .. } => format!("run {} ({status}) is not leased by this worker", c.run_id),
        Fence::Acquire { from, .. } | Fence::Unowned { from } => {
            let from: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
            format!("run {} is {status}, not {}", c.run_id, from.join(" or "))
        }
    })
}
