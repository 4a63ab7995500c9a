//! The multitask strategies of a message sent while its conversation's run is not over, on the
//! engine: `enqueue` (a durable, ordered queue of runs `waiting`) and `rollback` (the runs replaced
//! are removed from the conversation, their calls and decisions kept).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use keel_core::engine::{MultitaskStrategy, SendMessage};
use keel_core::store::{Commit, Fence, RunChange, StartedRun};
use keel_core::{ConversationId, EventKind, InterruptStatus, Role, RunId, RunStatus, ToolCallState};
use keel_models::DemoModel;
use serde_json::json;
use tempfile::TempDir;

/// A message of `demo`'s with a strategy.
async fn send(h: &Harness, conv: &ConversationId, text: &str, strategy: MultitaskStrategy) -> StartedRun {
    h.engine
        .send_message_with("demo", conv, SendMessage { content: text.into(), cancel_on_disconnect: false }, strategy)
        .await
        .unwrap()
}

/// The run ids of the conversation's messages, in the order they were written, each once.
async fn message_runs(h: &Harness, conv: &ConversationId) -> Vec<RunId> {
    let mut runs: Vec<RunId> = Vec::new();
    for m in h.store.list_messages(conv).await.unwrap() {
        let run = m.run_id.unwrap();
        if runs.last() != Some(&run) {
            assert!(!runs.contains(&run), "the messages of {run} are interleaved with another run's");
            runs.push(run);
        }
    }
    runs
}

async fn user_messages(h: &Harness, conv: &ConversationId) -> Vec<String> {
    let messages = h.store.list_messages(conv).await.unwrap();
    messages.into_iter().filter(|m| m.role == Role::User).map(|m| m.content.as_str().to_owned()).collect()
}

async fn status(h: &Harness, run: &RunId) -> RunStatus {
    h.store.get_run(run).await.unwrap().unwrap().status
}

const QUEUED: [&str; 3] =
    ["Look at the recent errors of payment-api", "list the services", "Which instance of checkout-api is abnormal?"];

/// Three messages sent while a run waits for approval wait their turn, in order, and run one after
/// the other once the approval is given: each its own run, its message joining the conversation
/// when it starts, so the conversation reads turn after turn.
#[tokio::test]
async fn three_messages_enqueued_behind_a_paused_run_run_in_order_after_it_is_resolved() {
    let dir = TempDir::new().unwrap();
    let h = Harness::new(dir.path(), Options::default()).await;
    let conv = h.conversation().await;
    let (paused, ev) = h.say(&conv, "Restart the abnormal instance of payment-api").await;
    assert_eq!(last_type(&ev), "interrupt");

    let mut waiting = Vec::new();
    for text in QUEUED {
        let started = send(&h, &conv, text, MultitaskStrategy::Enqueue).await;
        assert_eq!(started.run.status, RunStatus::Waiting);
        assert_eq!(started.events.iter().map(|e| e.type_name()).collect::<Vec<_>>(), ["run_waiting"]);
        waiting.push(started.run.id);
    }
    let view = h.engine.conversation_view("demo", &conv).await.unwrap();
    assert_eq!(view.active_run_id, Some(paused.clone()));
    assert_eq!(view.waiting_run_ids, waiting);
    assert_eq!(user_messages(&h, &conv).await, ["Restart the abnormal instance of payment-api"]);
    // nothing starts while the approval waits: what a sweep looks at finds nothing to start
    assert!(h.store.stranded_conversations(10).await.unwrap().is_empty());
    let none = h.store.promote_waiting(&conv, Vec::new(), None, keel_core::clock::Clock::now(&*h.clock)).await.unwrap();
    assert!(none.is_none(), "{none:?}");
    for run in &waiting {
        assert_eq!(status(&h, run).await, RunStatus::Waiting);
    }

    let (interrupt, _) = interrupt_of(&ev);
    let after = h.decide(&paused, &interrupt, json!("approve")).await;
    assert_eq!(last_type(&after), "done");
    for run in &waiting {
        let events = h.settle(run, 0).await;
        assert_eq!(last_type(&events), "done", "{run}: {events:?}");
        assert_contiguous(&events);
        let types: Vec<&str> = events.iter().take(3).map(|e| e.type_name()).collect();
        assert_eq!(types, ["run_waiting", "run_started", "graph_topology"]);
    }
    assert_eq!(h.restart_count("pay-prod-2").await, 1);
    let mut all = vec![paused];
    all.extend(waiting);
    assert_eq!(message_runs(&h, &conv).await, all, "each run's messages follow the one before's");
    let mut expected = vec!["Restart the abnormal instance of payment-api"];
    expected.extend(QUEUED);
    assert_eq!(user_messages(&h, &conv).await, expected);
    assert!(h.engine.conversation_view("demo", &conv).await.unwrap().waiting_run_ids.is_empty());
}

/// The queue is durable: waiting runs outlive the process. Whether their conversation's run is
/// still paused when the process comes back (they start once it is resolved) or ended while no
/// process was there to start them (recovery starts them), they run, in order.
#[tokio::test]
async fn waiting_runs_survive_a_crash_and_start_after_the_restart() {
    let dir = TempDir::new().unwrap();
    let h = Harness::new(dir.path(), Options::default()).await;
    let clock = h.clock.clone();
    let conv = h.conversation().await;
    let (paused, ev) = h.say(&conv, "Restart the abnormal instance of payment-api").await;
    let first = send(&h, &conv, QUEUED[0], MultitaskStrategy::Enqueue).await.run.id;
    let second = send(&h, &conv, QUEUED[1], MultitaskStrategy::Enqueue).await.run.id;
    drop(h);

    // Back, the paused run still holds the conversation: the queue waits, then runs.
    let h = Harness::open(dir.path(), clock.clone(), Arc::new(DemoModel::new(Duration::ZERO)), opspilot()).await;
    assert_eq!(status(&h, &first).await, RunStatus::Waiting);
    assert_eq!(
        h.engine.conversation_view("demo", &conv).await.unwrap().waiting_run_ids,
        [first.clone(), second.clone()]
    );
    let (interrupt, _) = interrupt_of(&ev);
    h.decide(&paused, &interrupt, json!("reject")).await;
    assert_eq!(last_type(&h.settle(&first, 0).await), "done");
    assert_eq!(last_type(&h.settle(&second, 0).await), "done");

    // A run ends and the process dies before it starts the next: the end is committed (here
    // straight to the store, as that process left it), the promotion never happened.
    let (paused, _) = h.say(&conv, "Restart the abnormal instance of payment-api").await;
    let third = send(&h, &conv, QUEUED[2], MultitaskStrategy::Enqueue).await.run.id;
    let fourth = send(&h, &conv, QUEUED[0], MultitaskStrategy::Enqueue).await.run.id;
    let mut end = Commit::new(paused.clone(), Fence::Unowned { from: vec![RunStatus::Interrupted] }, h.clock_now());
    end.run = Some(RunChange { to: RunStatus::Cancelled, reason: Some("cancelled_by_user".into()), via: None });
    end.events.push(EventKind::Cancelled { reason: "cancelled_by_user".into() });
    h.store.commit(end).await.unwrap();
    assert_eq!(status(&h, &third).await, RunStatus::Waiting, "nobody started it");
    assert_eq!(h.store.stranded_conversations(10).await.unwrap(), vec![conv.clone()]);
    drop(h);

    let h = Harness::open(dir.path(), clock, Arc::new(DemoModel::new(Duration::ZERO)), opspilot()).await;
    assert_eq!(last_type(&h.settle(&third, 0).await), "done", "recovery started it");
    assert_eq!(last_type(&h.settle(&fourth, 0).await), "done", "and the one after it");
    let runs = message_runs(&h, &conv).await;
    assert_eq!(runs[runs.len() - 2..], [third, fourth]);
    assert!(h.store.stranded_conversations(10).await.unwrap().is_empty());
}

/// A waiting run is cancelled without ever running: it ends `cancelled` at once, its message never
/// joins the conversation, and the queue goes on without it.
#[tokio::test]
async fn a_waiting_run_is_cancelled_without_running() {
    let dir = TempDir::new().unwrap();
    let h = Harness::new(dir.path(), Options::default()).await;
    let conv = h.conversation().await;
    let (paused, ev) = h.say(&conv, "Restart the abnormal instance of payment-api").await;
    let doomed = send(&h, &conv, QUEUED[0], MultitaskStrategy::Enqueue).await.run.id;
    let next = send(&h, &conv, QUEUED[1], MultitaskStrategy::Enqueue).await.run.id;

    let cancelled = h.engine.cancel("demo", &doomed).await.unwrap();
    assert_eq!(cancelled.status, RunStatus::Cancelled);
    assert_eq!((cancelled.reason.as_deref(), cancelled.worker.as_deref()), (Some("cancelled_by_user"), None));
    let events = h.all_events(&doomed).await;
    assert_eq!(events.iter().map(|e| e.type_name()).collect::<Vec<_>>(), ["run_waiting", "cancelled"]);
    // another user's waiting run is not theirs to cancel
    assert!(h.engine.cancel("mallory", &next).await.is_err());

    let (interrupt, _) = interrupt_of(&ev);
    h.decide(&paused, &interrupt, json!("reject")).await;
    assert_eq!(last_type(&h.settle(&next, 0).await), "done");
    assert_eq!(status(&h, &doomed).await, RunStatus::Cancelled, "it never ran");
    assert_eq!(user_messages(&h, &conv).await, ["Restart the abnormal instance of payment-api", QUEUED[1]]);
}

/// `rollback` on a run that waits for approval (with a message queued behind it): both are
/// cancelled and removed from the conversation — messages and events gone, the restart never
/// done — while their calls and decisions stay in the audit; then the new message runs.
#[tokio::test]
async fn rollback_removes_the_runs_it_replaces_and_keeps_their_audit() {
    let dir = TempDir::new().unwrap();
    let h = Harness::new(dir.path(), Options::default()).await;
    let conv = h.conversation().await;
    let (kept, _) = h.say(&conv, "list the services").await;
    let kept_messages = h.store.list_messages(&conv).await.unwrap();
    let (paused, _) = h.say(&conv, "Restart the abnormal instance of payment-api").await;
    let queued = send(&h, &conv, QUEUED[0], MultitaskStrategy::Enqueue).await.run.id;

    let started = send(&h, &conv, QUEUED[2], MultitaskStrategy::Rollback).await;
    assert_eq!(started.run.status, RunStatus::Queued);
    assert_eq!(last_type(&h.settle(&started.run.id, 0).await), "done");

    for run in [&paused, &queued] {
        assert_eq!(status(&h, run).await, RunStatus::RolledBack);
        assert!(h.all_events(run).await.is_empty());
        assert!(h.store.list_run_messages(run).await.unwrap().is_empty());
    }
    assert_eq!(message_runs(&h, &conv).await, [kept, started.run.id.clone()]);
    assert_eq!(h.store.list_messages(&conv).await.unwrap()[..kept_messages.len()], kept_messages[..]);
    assert_eq!(h.restart_count("pay-prod-2").await, 0);
    // the audit: what the rolled-back run asked, and that it was cancelled
    let calls = h.store.list_tool_calls(&paused).await.unwrap();
    let calls: Vec<(&str, ToolCallState)> = calls.iter().map(|c| (c.name.as_str(), c.state)).collect();
    assert_eq!(
        calls,
        [("find_abnormal_instances", ToolCallState::Succeeded), ("restart_instance", ToolCallState::Denied)]
    );
    let interrupts = h.store.list_interrupts(&paused).await.unwrap();
    assert_eq!(interrupts.iter().map(|i| i.status).collect::<Vec<_>>(), [InterruptStatus::Cancelled]);
    let run = h.store.get_run(&paused).await.unwrap().unwrap();
    assert_eq!(run.reason.as_deref(), Some("interrupted_by_new_message"));
    // gone from the conversation's calls
    let listed = h.store.list_conversation_tool_calls(&conv).await.unwrap();
    assert!(listed.iter().all(|c| c.run_id != paused), "{listed:?}");
}

/// `interrupt` clears the queue too: the runs waiting behind the active one are cancelled before
/// it (so none of them starts when it ends), and the new message runs next; what they did stays.
#[tokio::test]
async fn interrupt_cancels_the_waiting_runs_and_the_active_one() {
    let dir = TempDir::new().unwrap();
    let h = Harness::new(dir.path(), Options::default()).await;
    let conv = h.conversation().await;
    let (paused, _) = h.say(&conv, "Restart the abnormal instance of payment-api").await;
    let queued = send(&h, &conv, QUEUED[0], MultitaskStrategy::Enqueue).await.run.id;
    let started = send(&h, &conv, QUEUED[1], MultitaskStrategy::Interrupt).await;
    assert_eq!(last_type(&h.settle(&started.run.id, 0).await), "done");
    assert_eq!(status(&h, &paused).await, RunStatus::Cancelled);
    assert_eq!(status(&h, &queued).await, RunStatus::Cancelled);
    assert_eq!(message_runs(&h, &conv).await, [paused, started.run.id.clone()]);
}

/// A rollback's intent is written with its cancel: a process that stops between the cancel (the run
/// ended `cancelled`) and the rollback leaves the run to be rolled back by the next process's
/// recovery, or by the next message sent with `rollback`, so the thread reads clean either way.
#[tokio::test]
async fn a_rollback_cut_by_a_crash_is_finished_after_it() {
    let dir = TempDir::new().unwrap();
    let h = Harness::new(dir.path(), Options::default()).await;
    let clock = h.clock.clone();
    let conv = h.conversation().await;
    let (kept, _) = h.say(&conv, "list the services").await;

    // The cancel of a rollback, as a process that stopped right after it left it: the intent and
    // the run's end committed, the rollback never done.
    let cut = |h: &Harness, run: RunId| {
        let store = h.store.clone();
        let now = h.clock_now();
        async move {
            let flagged = store.request_cancel(&run, now, true).await.unwrap();
            assert!(flagged.cancel_requested);
            let mut end = Commit::new(run.clone(), Fence::Unowned { from: vec![RunStatus::Interrupted] }, now);
            end.run = Some(RunChange {
                to: RunStatus::Cancelled,
                reason: Some("interrupted_by_new_message".into()),
                via: None,
            });
            end.events.push(EventKind::Cancelled { reason: "interrupted_by_new_message".into() });
            store.commit(end).await.unwrap();
            assert_eq!(store.rollbacks_due(10).await.unwrap(), vec![run]);
        }
    };
    let (paused, _) = h.say(&conv, "Restart the abnormal instance of payment-api").await;
    cut(&h, paused.clone()).await;
    drop(h);

    // Recovery finishes it before anything else.
    let h = Harness::open(dir.path(), clock.clone(), Arc::new(DemoModel::new(Duration::ZERO)), opspilot()).await;
    assert_eq!(status(&h, &paused).await, RunStatus::RolledBack);
    assert!(h.store.list_run_messages(&paused).await.unwrap().is_empty());
    assert!(h.store.rollbacks_due(10).await.unwrap().is_empty());
    assert_eq!(message_runs(&h, &conv).await, std::slice::from_ref(&kept));

    // The message sent again with `rollback` finishes one left undone before it starts.
    let (paused, _) = h.say(&conv, "Restart the abnormal instance of payment-api").await;
    cut(&h, paused.clone()).await;
    let started = send(&h, &conv, QUEUED[1], MultitaskStrategy::Rollback).await;
    assert_eq!(status(&h, &paused).await, RunStatus::RolledBack);
    assert_eq!(last_type(&h.settle(&started.run.id, 0).await), "done");
    assert_eq!(message_runs(&h, &conv).await, [kept, started.run.id]);
    assert_eq!(user_messages(&h, &conv).await, ["list the services", QUEUED[1]]);
    assert_eq!(h.restart_count("pay-prod-2").await, 0);
}
