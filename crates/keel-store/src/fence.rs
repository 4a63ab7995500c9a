//! The fence's checks as both stores word their refusals: against the run row read back after a
//! fence `UPDATE` matched nothing, and, in PostgreSQL's group commit, against the locked row.

use keel_core::domain::RunStatus;
use keel_core::store::{Commit, Fence, StoreError};

/// Whether `c` may write on the run row as it is (`status`, `lease_owner`): its fence, then its
/// status move; the refusal says which failed.
pub(crate) fn check(c: &Commit, status: RunStatus, lease_owner: Option<&str>) -> Result<(), StoreError> {
    let fenced = match &c.fence {
        Fence::Lease { owner, .. } => status.is_active() && lease_owner == Some(owner.as_str()),
        Fence::Acquire { from, .. } | Fence::Unowned { from } => from.contains(&status),
    };
    if !fenced {
        return Err(not_fenced(c, status.as_str()));
    }
    match &c.run {
        Some(change) if !change.allowed_from(status) => Err(StoreError::Conflict(match change.via {
            Some(via) => format!("run {}: {status} -> {via} -> {} is not allowed", c.run_id, change.to),
            None => format!("run {}: {status} -> {} is not allowed", c.run_id, change.to),
        })),
        _ => Ok(()),
    }
}

/// Why a fence `UPDATE` matched the row (read back as `status`, `lease_owner`) not. A row that
/// passes the checks now changed in between: it is refused as not fenced.
pub(crate) fn refusal(c: &Commit, status: &str, lease_owner: Option<&str>) -> StoreError {
    match RunStatus::parse(status).map(|s| check(c, s, lease_owner)) {
        Some(Err(refused)) => refused,
        Some(Ok(())) | None => not_fenced(c, status),
    }
}

fn not_fenced(c: &Commit, status: &str) -> StoreError {
    StoreError::Conflict(match &c.fence {
        Fence::Lease { .. } => format!("run {} ({status}) is not leased by this worker", c.run_id),
        Fence::Acquire { from, .. } | Fence::Unowned { from } => {
            let from: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
            format!("run {} is {status}, not {}", c.run_id, from.join(" or "))
        }
    })
}
