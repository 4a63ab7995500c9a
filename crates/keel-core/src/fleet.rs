//! The OpsPilot fleet as the store keeps it.
//!
//! The fleet lives in the same database as runs so that a side effect and the tool result that
//! records it commit in one transaction (see [`crate::store::Commit::effects`]).

use serde::{Deserialize, Serialize};

use crate::domain::Timestamp;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Instance {
    pub id: String,
    pub service: String,
    pub env: String,
    /// `healthy` or `abnormal`.
    pub status: String,
    pub restart_count: i64,
    pub release: String,
    pub previous_release: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ErrorLogEntry {
    pub service: String,
    pub env: String,
    pub instance_id: String,
    pub status_code: i64,
    pub message: String,
    pub at: Timestamp,
}

/// A side effect on the fleet, applied by the store inside the commit that records the tool result.
/// Each carries the condition it needs; if the condition no longer holds, the whole commit is refused
/// with [`crate::store::StoreError::EffectRefused`] and nothing is written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "effect", rename_all = "snake_case", rename_all_fields = "camelCase")]
pub enum Effect {
    /// `abnormal → healthy`, `restart_count + 1`; refused unless the instance is still abnormal.
    RestartInstance { instance_id: String },
    /// Every instance of `service` in `env` goes from `from_release` back to its previous release;
    /// refused unless they are all still on `from_release`.
    RollbackRelease { service: String, env: String, from_release: String },
}

/// How the demo fleet is seeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FleetSeed {
    /// Extra abnormal instances per service and environment, on top of the one seeded `pay-prod-2`.
    pub extra_abnormal: u32,
}
