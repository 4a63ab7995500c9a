//! The server's pruner: each pass starts where the previous one left every run empty, less an
//! hour, so a run that ended before the last cutoff but whose commit became visible only after that
//! pass is still pruned, while runs that ended long before are not read again.

use std::time::Duration;

use chrono::{DateTime, Utc};
use keel_core::domain::RunStatus;
use keel_core::event::EventKind;
use keel_core::store::prelude::*;
use keel_core::store::{Commit, Fence, NewRun, RunChange};
use keel_core::RunId;
use keel_runtime::retention::{Pruner, Retention};
use keel_store::SqliteStore;

fn at(secs: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_893_499_200 + secs, 0).unwrap()
}

/// A run of `agent` that ended at `ended`, with two events.
async fn finished(store: &SqliteStore, agent: &str, ended: DateTime<Utc>) -> RunId {
    let conversation = store.create_conversation("alice", &"t".into(), agent, at(0)).await.unwrap();
    let run = store
        .start_run(NewRun {
            conversation_id: conversation.id.clone(),
            agent_id: agent.into(),
            user_id: "alice".into(),
            content: "go".into(),
            cancel_on_disconnect: false,
            now: at(1),
            events: vec![EventKind::RunStarted { conversation_id: conversation.id.clone(), trace_id: None }],
            enqueue: None,
            lease: None,
        })
        .await
        .unwrap()
        .run;
    let lease_until = ended + chrono::Duration::seconds(60);
    let mut c = Commit::new(
        run.id.clone(),
        Fence::Acquire { owner: "w".into(), from: vec![RunStatus::Queued], lease_until },
        at(2),
    );
    c.run = Some(RunChange { to: RunStatus::Running, reason: None, via: None });
    c.events.push(EventKind::NodeStarted { node: "call_model".into() });
    store.commit(c).await.unwrap();
    let mut c = Commit::new(run.id.clone(), Fence::Lease { owner: "w".into(), lease_until }, ended);
    c.run = Some(RunChange { to: RunStatus::Completed, reason: None, via: None });
    store.commit(c).await.unwrap();
    run.id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_pass_reads_from_where_the_last_one_left_off() {
    let store = SqliteStore::open_url("sqlite::memory:").await.unwrap();
    let retention = Retention {
        events_after: Some(Duration::from_secs(10)),
        agents: vec![("keep".into(), None)],
        every: Duration::from_secs(1),
        batch: 1,
    };
    let mut pruner = Pruner::new(retention);
    let old = finished(&store, "ops", at(100)).await;
    let kept = finished(&store, "keep", at(100)).await;
    let mut batches = 0;
    let pruned = pruner.pass(&store, at(1_000), |_| batches += 1).await.unwrap();
    assert_eq!(pruned.events, 2);
    assert_eq!(batches, 3, "one event a batch, and the one that found nothing");
    assert_eq!(store.first_held_sequence(&old).await.unwrap(), Some(3));
    assert_eq!(store.list_events(&kept, 0, 10).await.unwrap().len(), 2, "an agent that keeps everything");

    // Ended 30 minutes before the last pass's cutoff, seen only now: within the rescan.
    let late = finished(&store, "ops", at(1_000 - 10 - 1_800)).await;
    // Ended two hours before it: not read again (it would have been pruned by an earlier pass).
    let early = finished(&store, "ops", at(1_000 - 10 - 7_200)).await;
    let pruned = pruner.pass(&store, at(2_000), |_| {}).await.unwrap();
    assert_eq!(pruned.events, 2);
    assert_eq!(store.first_held_sequence(&late).await.unwrap(), Some(3));
    assert_eq!(store.first_held_sequence(&early).await.unwrap(), None);
    // `keel prune` scans everything.
    let all = keel_runtime::retention::prune(
        &store,
        &Retention { events_after: Some(Duration::from_secs(10)), ..Retention::default() },
        at(2_000),
        false,
    )
    .await
    .unwrap();
    assert_eq!(all.events, 4, "early's two, and keep's: the CLI's policy here has no rule for it");
    store.close().await;
}

/// A reader catching up on a finished run whose oldest events are pruned under it never gets a
/// story with a hole: its stream ends at the hole (its reconnect is then answered 410).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_never_replays_across_a_pruned_hole() {
    use futures::StreamExt;
    let store = SqliteStore::open_url("sqlite::memory:").await.unwrap();
    let run = finished(&store, "ops", at(100)).await;
    let rule = keel_core::store::PruneRule {
        finished_before: at(1_000),
        finished_after: None,
        agent: None,
        except_agents: vec![],
    };
    assert_eq!(store.prune_events(&rule, 1, false).await.unwrap().events, 1);
    let shared: std::sync::Arc<dyn keel_core::store::Store> = std::sync::Arc::new(store.clone());
    let read = |after: i64| {
        keel_core::stream::run_events(
            shared.clone(),
            std::sync::Arc::new(keel_core::bus::LocalBus::default()),
            run.clone(),
            after,
            keel_core::stream::Until::Terminal,
            keel_core::stream::Known::Unknown,
            None,
            None,
            keel_core::metrics::Metrics::noop(),
        )
        .map(|e| e.unwrap().sequence)
        .collect::<Vec<_>>()
    };
    assert_eq!(read(0).await, Vec::<i64>::new(), "the hole is at the start");
    assert_eq!(read(1).await, [2], "from the first held event on: the rest");
    store.close().await;
}
