//! Bounded work per instance: an engine drives at most `max_concurrent_runs` runs at once; the
//! runs it has no slot for wait, claimable, and are run as slots free — a resumed one included,
//! exactly once.

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::*;
use keel_core::engine::{EngineConfig, SendMessage};
use keel_core::model::{Model, ModelError, ModelMessage, ModelRequest, ModelStream};
use keel_core::{RunId, RunStatus};
use keel_models::DemoModel;
use serde_json::json;
use tempfile::TempDir;
use tokio::sync::Semaphore;

/// The demo model, except that a call for a user message containing "hold" waits until `gate` is
/// open (has a permit, which each call hands back): the run stays in its model call, holding its
/// slot, until the test opens the gate.
struct GatedModel {
    gate: Arc<Semaphore>,
    inner: DemoModel,
}

#[async_trait]
impl Model for GatedModel {
    fn name(&self) -> &str {
        "gated"
    }
    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ModelError> {
        let holds = request
            .messages
            .iter()
            .rev()
            .find_map(|m| match m {
                ModelMessage::User { content } => Some(content.contains("hold")),
                _ => None,
            })
            .unwrap_or(false);
        if holds {
            drop(self.gate.acquire().await.map_err(|e| ModelError::Fatal(e.to_string()))?);
        }
        self.inner.stream(request).await
    }
}

async fn harness(dir: &TempDir, cap: usize) -> (Harness, Arc<Semaphore>) {
    let gate = Arc::new(Semaphore::new(0));
    let model = Arc::new(GatedModel { gate: gate.clone(), inner: DemoModel::new(Duration::ZERO) });
    let config = EngineConfig { max_concurrent_runs: cap, ..engine_config() };
    let h = Harness::new(dir.path(), Options { model, config, ..Options::default() }).await;
    (h, gate)
}

async fn start(h: &Harness, text: &str) -> RunId {
    let conv = h.conversation().await;
    let send = SendMessage { content: text.into(), cancel_on_disconnect: false };
    h.engine.send_message("demo", &conv, send).await.unwrap().run.id
}

async fn statuses(h: &Harness, runs: &[RunId]) -> Vec<RunStatus> {
    let mut out = Vec::new();
    for run in runs {
        out.push(h.store.get_run(run).await.unwrap().unwrap().status);
    }
    out
}

/// Polls `check` every 20 ms until it holds; panics with `what` after 20 s.
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_runs_at_most_the_cap_at_once_and_every_run_completes() {
    let dir = TempDir::new().unwrap();
    let (h, gate) = harness(&dir, 4).await;
    assert_eq!(h.engine.capacity(), 4);
    let mut runs = Vec::new();
    for i in 0..50 {
        runs.push(start(&h, &format!("hold {i}: look at the recent errors of payment-api")).await);
    }

    // Every model call waits at the gate: four runs hold the four slots, the rest wait queued.
    until("four runs are running", || async { h.engine.active_workers() == 4 }).await;
    let now = statuses(&h, &runs).await;
    assert_eq!(now.iter().filter(|s| **s == RunStatus::Running).count(), 4, "{now:?}");
    assert_eq!(now.iter().filter(|s| **s == RunStatus::Queued).count(), 46, "{now:?}");
    for run in &runs {
        let run = h.store.get_run(run).await.unwrap().unwrap();
        if run.status == RunStatus::Running {
            assert_eq!(run.worker.as_deref(), Some(h.engine.config().instance_id.as_str()));
        } else {
            assert_eq!(run.worker, None, "a queued run was never claimed");
        }
    }

    // Let them all go: each run that ends frees a slot, which claims the next queued run.
    gate.add_permits(1);
    until("all 50 runs completed", || async { statuses(&h, &runs).await.iter().all(|s| *s == RunStatus::Completed) })
        .await;
    assert_eq!(h.engine.peak_workers(), 4, "never more than the cap at once");
    for run in &runs {
        let run = h.store.get_run(run).await.unwrap().unwrap();
        assert_eq!(
            run.worker.as_deref(),
            Some(h.engine.config().instance_id.as_str()),
            "the worker stays after the end"
        );
        assert_eq!(run.lease_owner, None);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_at_capacity_is_let_go_and_continued_once_a_slot_frees() {
    let dir = TempDir::new().unwrap();
    let (h, gate) = harness(&dir, 1).await;

    // A run pauses for approval: a paused run holds no slot.
    let conv = h.conversation().await;
    let (paused, events) = h.say(&conv, "restart pay-prod-2").await;
    assert_eq!(last_type(&events), "interrupt");
    let (interrupt, _) = interrupt_of(&events);

    // Another run takes the one slot and holds it. Its run leased (to the worker it was written
    // for, or to a claim once the paused run's worker let go of the slot) says it holds the slot;
    // one worker alive says the paused run's worker is gone (it may still be finishing when the
    // `interrupt` event arrives, and would count as the one).
    let holder = start(&h, "hold: look at the recent errors of payment-api").await;
    until("the holder runs", || async {
        let leased = h.store.get_run(&holder).await.unwrap().unwrap().lease_owner.is_some();
        leased && h.engine.active_workers() == 1
    })
    .await;

    // The approval is committed, but this instance has no slot for the run: it is let go, running
    // with no lease, for the first free slot.
    let accepted = h.resume(&paused, &interrupt, json!("approve"), "approve-at-capacity").await.unwrap();
    assert_eq!(accepted.status, RunStatus::Running);
    let run = h.store.get_run(&paused).await.unwrap().unwrap();
    assert_eq!((run.status, run.lease_owner.as_deref()), (RunStatus::Running, None), "released, not driven");
    assert_eq!(h.restart_count("pay-prod-2").await, 0, "nothing ran yet");
    assert_eq!(h.engine.active_workers(), 1);

    // The holder ends; its slot claims the resumed run, which restarts the instance once.
    gate.add_permits(1);
    let after = h.settle(&paused, accepted.resumed_sequence - 1).await;
    assert_eq!(last_type(&after), "done", "{after:?}");
    assert_eq!(h.restart_count("pay-prod-2").await, 1, "the approved restart ran exactly once");
    assert_eq!(h.store.get_run(&holder).await.unwrap().unwrap().status, RunStatus::Completed);
    assert_eq!(h.engine.peak_workers(), 1);
    assert_contiguous(&h.all_events(&paused).await);
}

/// A run this instance starts is written leased to the worker it starts for it, so another
/// instance's claim can't take it in the moment before that worker's first commit (which is held
/// until its next one); a run it has no slot for is written with no lease, for any instance to claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_started_here_is_leased_to_its_worker_from_the_start() {
    let dir = TempDir::new().unwrap();
    let (h, gate) = harness(&dir, 1).await;
    let instance = h.engine.config().instance_id.clone();
    let claim = |owner: &'static str| {
        let store = h.store.clone();
        let now = keel_core::clock::Clock::now(&*h.clock);
        async move { store.claim_runs(owner, now, now + chrono::Duration::seconds(60), false, 10).await.unwrap() }
    };

    let first = start(&h, "hold: look at the recent errors of payment-api").await;
    // at once: its worker may not have written anything yet
    let run = h.store.get_run(&first).await.unwrap().unwrap();
    assert!(matches!(run.status, RunStatus::Queued | RunStatus::Running), "{:?}", run.status);
    assert_eq!(run.worker.as_deref(), Some(instance.as_str()));
    assert!(run.lease_owner.as_deref().is_some_and(|owner| owner.starts_with(&format!("{instance}:"))));
    assert!(claim("other:1").await.is_empty(), "another instance's claim takes nothing");

    // The one slot is taken: the next run is written with no lease, and is anyone's to claim.
    let second = start(&h, "hold: and the recent errors of checkout").await;
    let queued = h.store.get_run(&second).await.unwrap().unwrap();
    assert_eq!(
        (queued.status, queued.lease_owner.as_deref(), queued.worker.as_deref()),
        (RunStatus::Queued, None, None)
    );
    let claimed = claim("other:1").await;
    assert_eq!(claimed.iter().map(|r| r.id.clone()).collect::<Vec<_>>(), vec![second.clone()]);

    // The first run's worker goes on as the lease's holder.
    gate.add_permits(1);
    until("the first run completed", || async {
        statuses(&h, std::slice::from_ref(&first)).await == [RunStatus::Completed]
    })
    .await;
}
