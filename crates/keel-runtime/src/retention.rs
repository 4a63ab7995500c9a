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
                    finished_after: None,
                    agent: Some(agent.clone()),
                    except_agents: Vec::new(),
                })
            })
            .collect();
        if let Some(d) = &self.events_after {
            rules.push(PruneRule {
                finished_before: before(d),
                finished_after: None,
                agent: None,
                except_agents: self.agents.iter().map(|(a, _)| a.clone()).collect(),
            });
        }
        rules
    }
}

/// How far before the last pass's cutoff the next pass looks again: a run that ended (its
/// `updated_at`) before a cutoff but whose commit became visible only after the pass read is still
/// found, as long as its commit took less than this.
const RESCAN: Duration = Duration::from_secs(3600);

/// The server's pruner: [`prune`] pass after pass, each rule's scan starting where the previous
/// pass left every run empty (less [`RESCAN`]), so that a pass reads the runs that ended since,
/// not every finished run ever.
#[derive(Debug)]
pub struct Pruner {
    retention: Retention,
    /// Per rule (in the order of [`Retention::rules`]): the cutoff of the last pass that emptied
    /// every run it covered.
    done_before: Vec<Option<Timestamp>>,
}

impl Pruner {
    pub fn new(retention: Retention) -> Self {
        Self { done_before: Vec::new(), retention }
    }

    /// One pass as of `now`; `each` is told what every batch deleted.
    pub async fn pass(
        &mut self,
        store: &dyn Store,
        now: Timestamp,
        mut each: impl FnMut(Pruned),
    ) -> StoreResult<Pruned> {
        let rules = self.retention.rules(now);
        self.done_before.resize(rules.len(), None);
        let mut total = Pruned::default();
        for (rule, done_before) in rules.into_iter().zip(self.done_before.iter_mut()) {
            let rescan = chrono::Duration::from_std(RESCAN).unwrap_or(chrono::Duration::MAX);
            let rule = PruneRule { finished_after: done_before.map(|t| t - rescan), ..rule };
            total += drain(store, &rule, self.retention.batch, &mut each).await?;
            *done_before = Some(rule.finished_before);
        }
        Ok(total)
    }
}

/// Batch after batch until what `rule` covers is pruned.
async fn drain(store: &dyn Store, rule: &PruneRule, batch: u32, each: &mut impl FnMut(Pruned)) -> StoreResult<Pruned> {
    let batch = batch.max(1);
    let mut total = Pruned::default();
    loop {
        let pruned = store.prune_events(rule, batch, false).await?;
        each(pruned);
        total += pruned;
        if pruned.events < u64::from(batch) {
            return Ok(total);
        }
        // let the runs' own writes through between batches
        tokio::task::yield_now().await;
    }
}

/// Prunes everything the policy covers as of `now` (`dry_run`: counts it, and deletes nothing),
/// scanning every finished run: `keel prune`. A run pruned over several batches counts once per
/// batch in `runs`.
pub async fn prune(store: &dyn Store, retention: &Retention, now: Timestamp, dry_run: bool) -> StoreResult<Pruned> {
    let mut total = Pruned::default();
    for rule in retention.rules(now) {
        total += if dry_run {
            store.prune_events(&rule, retention.batch.max(1), true).await?
        } else {
            drain(store, &rule, retention.batch, &mut |_| {}).await?
        };
    }
    Ok(total)
}
