//! Retention: the events of finished runs are deleted once they are older than a duration, by a
//! background task of the server, in bounded batches (docs/operations.md, "Retention").

use std::time::Duration;

use keel_core::store::{PruneRule, Pruned, Store, StoreResult};
use keel_core::Timestamp;

/// How long the events of finished runs are kept, and how the pruner works through them.
#[derive(Debug, Clone, PartialEq)]
pub struct Retention {
    /// Every agent's finished runs keep their events this long after they ended (`None`: forever),
    /// unless the agent has a duration of its own in `agents`.
    pub events_after: Option<Duration>,
    /// Agents with a duration of their own (`None`: forever).
    pub agents: Vec<(String, Option<Duration>)>,
    /// How often the pruner looks.
    pub every: Duration,
    /// The most event rows one transaction deletes: a batch holds the writer (SQLite) or its rows
    /// (Postgres) only briefly, so runs keep their pace while a backlog is pruned.
    pub batch: u32,
}

impl Default for Retention {
    fn default() -> Self {
        Self { events_after: None, agents: Vec::new(), every: Duration::from_secs(600), batch: 1_000 }
    }
}

impl Retention {
    /// Whether anything is ever pruned.
    pub fn enabled(&self) -> bool {
        self.events_after.is_some() || self.agents.iter().any(|(_, d)| d.is_some())
    }

    /// The rules as of `now`: one per agent with a duration of its own, and the global one for
    /// every other agent.
    pub fn rules(&self, now: Timestamp) -> Vec<PruneRule> {
        let before = |d: &Duration| now - chrono::Duration::from_std(*d).unwrap_or(chrono::Duration::MAX);
        let mut rules: Vec<PruneRule> = self
            .agents
            .iter()
            .filter_map(|(agent, d)| {
                d.as_ref().map(|d| PruneRule {
                    finished_before: before(d),
                    agent: Some(agent.clone()),
                    except_agents: Vec::new(),
                })
            })
            .collect();
        if let Some(d) = &self.events_after {
            rules.push(PruneRule {
                finished_before: before(d),
                agent: None,
                except_agents: self.agents.iter().map(|(a, _)| a.clone()).collect(),
            });
        }
        rules
    }
}

/// Prunes everything the policy covers as of `now`, batch after batch (`dry_run`: counts it, and
/// deletes nothing). `each` is told what every batch deleted. A run pruned over several batches
/// counts once per batch in `runs`.
pub async fn prune(
    store: &dyn Store,
    retention: &Retention,
    now: Timestamp,
    dry_run: bool,
    mut each: impl FnMut(Pruned),
) -> StoreResult<Pruned> {
    let mut total = Pruned::default();
    let batch = retention.batch.max(1);
    for rule in retention.rules(now) {
        if dry_run {
            total += store.prune_events(&rule, batch, true).await?;
            continue;
        }
        loop {
            let pruned = store.prune_events(&rule, batch, false).await?;
            each(pruned);
            total += pruned;
            if pruned.events < u64::from(batch) {
                break;
            }
            // let the runs' own writes through between batches
            tokio::task::yield_now().await;
        }
    }
    Ok(total)
}
