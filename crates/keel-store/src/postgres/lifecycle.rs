//! The data lifecycle on Postgres: retention (pruning the events of finished runs in bounded
//! batches) and the exports' reads. Backups are Postgres's own (`pg_dump`, docs/operations.md).

use keel_core::domain::{Conversation, Run, Timestamp};
use keel_core::ids::{ConversationId, RunId};
use keel_core::store::{PruneRule, Pruned, StoreResult};
use sqlx::Row;

use super::{all, conversation_from, db, run_from, PostgresStore};

/// The runs `rule` covers that still hold events: (id, first held sequence, next sequence), the
/// runs that ended first first. `$1` the cutoff, `$2` the agent or NULL, `$3` the agents excluded
/// when `$2` is NULL, `$4` the lower bound or NULL. A run's `finished_at` is its `updated_at` once
/// it is over (`completed`, `failed`, `cancelled`) and NULL before (a generated column: the index
/// on it leaves a running run's commits free to be written as heap-only tuples, migration 0012).
const COVERED: &str = "SELECT r.id, COALESCE(p.first_held_sequence, 1) AS first_held, r.next_sequence \
     FROM runs r LEFT JOIN run_prunes p ON p.run_id = r.id \
     WHERE r.finished_at < $1 AND ($4::timestamptz IS NULL OR r.finished_at >= $4) \
       AND (CASE WHEN $2::text IS NULL \
                 THEN r.agent_id IS NULL OR NOT (r.agent_id = ANY($3::text[])) \
                 ELSE r.agent_id = $2 END) \
       AND COALESCE(p.first_held_sequence, 1) < r.next_sequence \
     ORDER BY r.finished_at, r.id";

impl PostgresStore {
    pub(super) async fn prune(&self, rule: &PruneRule, max_events: u32, dry_run: bool) -> StoreResult<Pruned> {
        if dry_run {
            let rows = sqlx::query(COVERED)
                .bind(rule.finished_before)
                .bind(rule.agent.as_deref())
                .bind(&rule.except_agents)
                .bind(rule.finished_after)
                .fetch_all(self.pool())
                .await
                .map_err(db("count prunable events"))?;
            let mut pruned = Pruned::default();
            for row in rows {
                let first: i64 = row.try_get("first_held").map_err(db("count prunable events"))?;
                let next: i64 = row.try_get("next_sequence").map_err(db("count prunable events"))?;
                pruned.runs += 1;
                pruned.events += (next - first) as u64;
            }
            return Ok(pruned);
        }
        // One transaction per batch; the runs it prunes are locked, and those another instance's
        // pruner holds are skipped, so two pruners never wait on each other.
        let mut tx = self.pool().begin().await.map_err(db("prune events"))?;
        let rows = sqlx::query(&format!("{COVERED} LIMIT $5 FOR UPDATE OF r SKIP LOCKED"))
            .bind(rule.finished_before)
            .bind(rule.agent.as_deref())
            .bind(&rule.except_agents)
            .bind(rule.finished_after)
            .bind(i64::from(max_events))
            .fetch_all(&mut *tx)
            .await
            .map_err(db("find prunable runs"))?;
        let mut budget = i64::from(max_events);
        let mut pruned = Pruned::default();
        for row in rows {
            if budget <= 0 {
                break;
            }
            let run_id: String = row.try_get("id").map_err(db("find prunable runs"))?;
            let first: i64 = row.try_get("first_held").map_err(db("find prunable runs"))?;
            let next: i64 = row.try_get("next_sequence").map_err(db("find prunable runs"))?;
            // The oldest events first: what is held stays one contiguous range.
            let upto = next.min(first + budget);
            let deleted = sqlx::query("DELETE FROM run_events WHERE run_id = $1 AND sequence < $2")
                .bind(&run_id)
                .bind(upto)
                .execute(&mut *tx)
                .await
                .map_err(db("prune events"))?
                .rows_affected();
            sqlx::query(
                "INSERT INTO run_prunes (run_id, first_held_sequence, pruned_at) VALUES ($1, $2, now()) \
                 ON CONFLICT (run_id) DO UPDATE SET first_held_sequence = $2, pruned_at = now()",
            )
            .bind(&run_id)
            .bind(upto)
            .execute(&mut *tx)
            .await
            .map_err(db("record a prune"))?;
            budget -= upto - first;
            pruned.runs += 1;
            pruned.events += deleted;
        }
        tx.commit().await.map_err(db("prune events"))?;
        Ok(pruned)
    }

    pub(super) async fn first_held(&self, run_id: &RunId) -> StoreResult<Option<i64>> {
        sqlx::query_scalar("SELECT first_held_sequence FROM run_prunes WHERE run_id = $1")
            .bind(run_id.as_str())
            .fetch_optional(self.pool())
            .await
            .map_err(db("read the first held event"))
    }

    pub(super) async fn conversation_runs(&self, conversation_id: &ConversationId) -> StoreResult<Vec<Run>> {
        let rows = sqlx::query("SELECT * FROM runs WHERE conversation_id = $1 ORDER BY created_at, id")
            .bind(conversation_id.as_str())
            .fetch_all(self.pool())
            .await
            .map_err(db("list a conversation's runs"))?;
        all(&rows, run_from)
    }

    pub(super) async fn newest_runs(&self, conversation_id: &ConversationId, limit: u32) -> StoreResult<Vec<Run>> {
        let rows =
            sqlx::query("SELECT * FROM runs WHERE conversation_id = $1 ORDER BY created_at DESC, id DESC LIMIT $2")
                .bind(conversation_id.as_str())
                .bind(i64::from(limit))
                .fetch_all(self.pool())
                .await
                .map_err(db("list a conversation's newest runs"))?;
        all(&rows, run_from)
    }

    pub(super) async fn conversations_for(
        &self,
        user_id: Option<&str>,
        since: Option<Timestamp>,
    ) -> StoreResult<Vec<Conversation>> {
        let rows = sqlx::query(
            "SELECT * FROM conversations c WHERE ($1::text IS NULL OR c.user_id = $1) \
             AND ($2::timestamptz IS NULL OR EXISTS \
                  (SELECT 1 FROM runs r WHERE r.conversation_id = c.id AND r.updated_at >= $2)) \
             ORDER BY c.created_at, c.id",
        )
        .bind(user_id)
        .bind(since)
        .fetch_all(self.pool())
        .await
        .map_err(db("find conversations"))?;
        all(&rows, conversation_from)
    }
}
