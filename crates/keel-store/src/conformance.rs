//! What every [`Store`] backend must do, written once.
//!
//! Each case takes a fresh, empty store and panics when the backend gets something wrong. Times are
//! explicit (every store method takes `now`), so no case sleeps or reads the wall clock. A backend
//! runs every case as its own test with [`conformance_tests!`](crate::conformance_tests):
//!
//! ```text
//! // async fn fresh() -> (Arc<dyn Store>, impl Sized): a new empty store and whatever keeps it alive
//! keel_store::conformance_tests!(fresh);
//! ```

use std::collections::BTreeSet;
use std::sync::Arc;

use chrono::DateTime;
use keel_core::domain::{
    ApiKey, Checkpoint, Conversation, Fact, FactSource, Interrupt, InterruptKind, InterruptStatus, Message, NextStep,
    Role, Run, RunStatus, StreamTicket, Summary, TicketScope, Timestamp, ToolCall, ToolCallState, User, UserRole,
};
use keel_core::event::{Event, EventKind, GraphNode, ToolOutcomeStatus};
use keel_core::ids::{CallId, ConversationId, InterruptId, MessageId, RunId};
use keel_core::mask::Masked;
use keel_core::store::{
    AnswerView, Commit, ContextWindow, DueWork, Fence, IdempotencyAnswer, IdempotencyBegin, InterruptChange,
    MessagesThrough, NewLease, NewRun, PruneRule, Pruned, RunChange, StartedRun, Store, StoreError, StoreResult,
    TextAppend, ToolCallChange, ToolCallUpdate,
};
use serde_json::json;

/// Runs every conformance case as a `#[tokio::test]` of the calling crate (which needs `tokio`).
/// `$fresh` is an `async fn() -> (Arc<dyn Store>, G)`: a new, empty store, and a guard kept alive
/// for the case (a temporary directory, a schema to drop).
#[macro_export]
macro_rules! conformance_tests {
    ($fresh:path) => {
        $crate::conformance_tests!(@list [] $fresh);
    };
    // A backend the environment may not provide: `$fresh` returns an `Option`, and a case whose
    // `$fresh` returns `None` ends at once (`$fresh` says on stderr why it did not run).
    (optional $fresh:path) => {
        $crate::conformance_tests!(@list [optional] $fresh);
    };
    (@list [$($optional:ident)?] $fresh:path) => {
        $crate::conformance_tests!(@cases [$($optional)?] $fresh;
            conversations_are_per_user_and_newest_first,
            start_run_writes_message_run_and_first_events,
            start_run_needs_a_conversation,
            one_active_run_per_conversation,
            concurrent_starts_create_one_run,
            sequences_are_contiguous_across_commits,
            a_fenced_out_commit_writes_nothing,
            concurrent_commits_each_get_their_own_answer,
            acquire_wins_exactly_once_under_contention,
            concurrent_acquires_record_their_worker,
            run_changes_follow_the_state_machine,
            a_start_and_a_pause_in_one_commit_move_through_running,
            expired_interrupt_cannot_be_resolved,
            interrupt_is_resolved_once,
            an_answer_view_is_the_run_its_interrupts_calls_and_the_role,
            tool_call_updates_are_conditional,
            a_refused_part_rolls_back_the_whole_commit,
            tool_call_attempts_are_counted,
            text_appends_build_one_message_and_discard_removes_it,
            messages_facts_and_summary_are_written_by_commit,
            duplicate_ids_are_refused,
            claim_runs_takes_queued_and_expired_not_live,
            a_run_written_leased_is_not_claimed_while_its_lease_lives,
            concurrent_claimers_never_share_a_run,
            leases_renew_and_release,
            last_sequences_of_many_runs_in_one_read,
            cancel_request_is_seen_by_the_next_commit,
            idempotency_keys,
            an_answer_commits_with_the_change_it_reports,
            asking_calls_lists_the_calls_waiting_for_a_human,
            due_interrupts_are_pending_and_past_expiry,
            due_work_names_the_sweeps_that_have_work,
            conversation_tool_calls_span_runs,
            the_context_window_starts_after_the_summary,
            a_first_runs_context_is_its_message,
            messages_through_a_run_are_the_conversation_as_it_stood,
            the_calls_a_window_answers_come_in_the_order_they_were_made,
            user_roles,
            api_keys_map_hashes_to_users_until_revoked,
            stream_tickets_are_redeemed_once_before_expiry,
            runs_are_listed_per_user_newest_first,
            interrupts_of_a_run_are_listed_with_their_history,
            bindings_keep_the_first_value,
            conversations_and_runs_keep_their_agent,
            retention_prunes_the_events_of_finished_runs_only,
            retention_rules_are_per_agent_and_bounded,
            exports_find_conversations_and_their_runs,
            enqueued_messages_wait_and_start_in_order,
            concurrent_promoters_start_one_waiting_run,
            a_waiting_run_is_cancelled_without_running,
            a_rollback_removes_messages_and_events_and_keeps_the_audit,
            a_rollback_removes_the_summary_that_covers_the_run,
            only_a_run_that_is_over_is_hidden_once,
        );
    };
    (@cases [] $fresh:path; $($case:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let (store, _guard) = $fresh().await;
                $crate::conformance::$case(store).await;
            }
        )+
    };
    (@cases [optional] $fresh:path; $($case:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let Some((store, _guard)) = $fresh().await else { return };
                $crate::conformance::$case(store).await;
            }
        )+
    };
}

pub type SharedStore = Arc<dyn Store>;

// --- fixtures

/// The suite's epoch (2030-01-01T12:00:00Z) plus `secs` seconds.
pub fn at(secs: i64) -> Timestamp {
    DateTime::from_timestamp(1_893_499_200 + secs, 0).expect("a representable time")
}

fn first_events(conversation_id: &ConversationId) -> Vec<EventKind> {
    vec![
        EventKind::RunStarted { conversation_id: conversation_id.clone(), trace_id: None },
        EventKind::GraphTopology {
            nodes: vec![GraphNode { id: "call_model".into(), label: "Call model".into() }],
            edges: vec![],
        },
    ]
}

fn node(name: &str) -> EventKind {
    EventKind::NodeStarted { node: name.into() }
}

fn lease(owner: &str, lease_until: Timestamp) -> Fence {
    Fence::Lease { owner: owner.into(), lease_until }
}

fn acquire(owner: &str, from: RunStatus, lease_until: Timestamp) -> Fence {
    Fence::Acquire { owner: owner.into(), from: vec![from], lease_until }
}

fn to(status: RunStatus) -> Option<RunChange> {
    Some(RunChange { to: status, reason: None, via: None })
}

async fn conversation(store: &SharedStore, user: &str) -> Conversation {
    store.create_conversation(user, &"look into order ord-2".into(), "ops", at(0)).await.expect("create conversation")
}

async fn start(store: &SharedStore, conversation: &Conversation, now: Timestamp) -> StartedRun {
    store
        .start_run(NewRun {
            conversation_id: conversation.id.clone(),
            agent_id: conversation.agent_id.clone().unwrap_or_else(|| "ops".into()),
            user_id: conversation.user_id.clone(),
            content: "Cancel order ord-2".into(),
            cancel_on_disconnect: false,
            now,
            events: first_events(&conversation.id),
            enqueue: None,
            lease: None,
        })
        .await
        .expect("start run")
}

/// A new conversation with a queued run.
async fn queued(store: &SharedStore) -> (Conversation, Run) {
    let conversation = conversation(store, "alice").await;
    let started = start(store, &conversation, at(1)).await;
    (conversation, started.run)
}

/// A new conversation with a run that `owner` works on (leased until `at(60)`).
async fn running(store: &SharedStore, owner: &str) -> (Conversation, Run) {
    let (conversation, run) = queued(store).await;
    let mut c = Commit::new(run.id.clone(), acquire(owner, RunStatus::Queued, at(60)), at(2));
    c.run = to(RunStatus::Running);
    c.events.push(node("call_model"));
    store.commit(c).await.expect("take the queued run");
    (conversation, get_run(store, &run.id).await)
}

fn interrupt(run_id: &RunId, call_ids: Vec<CallId>, expires_at: Timestamp) -> Interrupt {
    Interrupt {
        id: InterruptId::new(),
        run_id: run_id.clone(),
        kind: InterruptKind::ConfirmAction,
        status: InterruptStatus::Pending,
        payload: json!({"title": "Cancel ord-2?", "risk": "medium"}).into(),
        call_ids,
        created_at: at(3),
        expires_at,
        decision: None,
        note: None,
        resolved_by: None,
        resolved_at: None,
    }
}

/// A new conversation with a run paused on a pending interrupt that expires at `expires_at`.
async fn interrupted(store: &SharedStore, expires_at: Timestamp) -> (Conversation, Run, Interrupt) {
    let (conversation, run) = running(store, "w1").await;
    let pending = interrupt(&run.id, vec![], expires_at);
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(3));
    c.run = to(RunStatus::Interrupted);
    c.new_interrupts.push(pending.clone());
    c.events.push(EventKind::Interrupt {
        interrupt_id: pending.id.clone(),
        kind: pending.kind,
        payload: pending.payload.clone(),
        expires_at,
    });
    store.commit(c).await.expect("pause the run");
    (conversation, get_run(store, &run.id).await, pending)
}

fn resolve(interrupt: &Interrupt, by: &str) -> InterruptChange {
    InterruptChange {
        id: interrupt.id.clone(),
        to: InterruptStatus::Resolved,
        decision: Some(json!("approve").into()),
        note: None,
        resolved_by: Some(by.into()),
    }
}

fn resumed(interrupt: &Interrupt, by: &str) -> EventKind {
    EventKind::Resumed {
        interrupt_id: interrupt.id.clone(),
        decision: json!("approve").into(),
        note: None,
        human_wait_ms: 1000,
        resolved_by: by.into(),
    }
}

fn tool_call(run_id: &RunId, name: &str, order_id: &str, state: ToolCallState) -> ToolCall {
    ToolCall {
        id: CallId::new(),
        run_id: run_id.clone(),
        name: name.into(),
        args: json!({"orderId": order_id}).into(),
        state,
        result: None,
        summary: None,
        attempts: 0,
        started_at: None,
        finished_at: None,
    }
}

fn fact(key: &str, value: &str, source: FactSource, updated_at: Timestamp) -> Fact {
    Fact { key: key.into(), value: value.into(), source, updated_at }
}

async fn get_run(store: &SharedStore, id: &RunId) -> Run {
    store.get_run(id).await.expect("get run").expect("the run exists")
}

async fn events(store: &SharedStore, run_id: &RunId) -> Vec<Event> {
    store.list_events(run_id, 0, 10_000).await.expect("list events")
}

async fn sequences(store: &SharedStore, run_id: &RunId) -> Vec<i64> {
    events(store, run_id).await.iter().map(|e| e.sequence).collect()
}

async fn commit_ok(store: &SharedStore, c: Commit) -> keel_core::store::Committed {
    store.commit(c).await.expect("commit")
}

fn assert_conflict<T: std::fmt::Debug>(result: StoreResult<T>) {
    match result {
        Err(StoreError::Conflict(_)) => {}
        other => panic!("expected a conflict, got {other:?}"),
    }
}

/// Everything a commit on a run could have written.
#[derive(Debug, PartialEq)]
struct Snapshot {
    run: Run,
    events: Vec<Event>,
    messages: Vec<Message>,
    tool_calls: Vec<ToolCall>,
    facts: Vec<Fact>,
    summary: Option<Summary>,
    pending_interrupt: Option<Interrupt>,
}

async fn snapshot(store: &SharedStore, conversation_id: &ConversationId, run_id: &RunId) -> Snapshot {
    let mut facts = store.list_facts(conversation_id).await.expect("facts");
    facts.sort_by(|a, b| a.key.cmp(&b.key));
    Snapshot {
        run: get_run(store, run_id).await,
        events: events(store, run_id).await,
        messages: store.list_messages(conversation_id).await.expect("messages"),
        tool_calls: store.list_tool_calls(run_id).await.expect("tool calls"),
        facts,
        summary: store.get_summary(conversation_id).await.expect("summary"),
        pending_interrupt: store.pending_interrupt(run_id).await.expect("pending interrupt"),
    }
}

/// A commit that touches everything: refused, it must leave no trace.
fn everything(run: &Run, conversation_id: &ConversationId, fence: Fence, call: &ToolCall) -> Commit {
    let mut c = Commit::new(run.id.clone(), fence, at(10));
    c.run = to(RunStatus::Completed);
    c.checkpoint = Some(Checkpoint { next_step: NextStep::Finalize, ..run.checkpoint.clone() });
    c.text.push(TextAppend { message_id: MessageId::new(), text: "Cancelled.".into() });
    c.messages.push(Message {
        id: MessageId::new(),
        conversation_id: conversation_id.clone(),
        run_id: Some(run.id.clone()),
        role: Role::Tool,
        content: "{\"ok\":true}".into(),
        tool_call_id: Some(call.id.clone()),
        created_at: at(10),
    });
    c.tool_calls.push(ToolCallChange::transition(&call.id, call.state, ToolCallState::Allowed));
    c.tool_calls.push(ToolCallChange::Insert(tool_call(&run.id, "get_order", "ord-1", ToolCallState::Requested)));
    c.new_interrupts.push(interrupt(&run.id, vec![call.id.clone()], at(500)));
    c.facts.push(fact("order", "ord-2", FactSource::ToolResult, at(10)));
    c.summary = Some(Summary {
        conversation_id: conversation_id.clone(),
        through_message_id: run.user_message_id.clone(),
        text: "asked to cancel an order".into(),
    });
    c.events.push(node("finalize"));
    c.events.push(EventKind::Done { message_id: None });
    c
}

// --- the cases

pub async fn conversations_are_per_user_and_newest_first(store: SharedStore) {
    let mut created = Vec::new();
    for secs in [10, 30, 20] {
        created.push(
            store.create_conversation("alice", &format!("t{secs}").into(), "ops", at(secs)).await.expect("create"),
        );
    }
    let bobs = store.create_conversation("bob", &"bob's".into(), "ops", at(40)).await.expect("create");

    let listed = store.list_conversations("alice", 10).await.expect("list");
    let titles: Vec<_> = listed.iter().map(|c| c.title.as_str()).collect();
    assert_eq!(titles, vec!["t30", "t20", "t10"]);
    assert!(listed.iter().all(|c| c.user_id == "alice" && c.version == 0));
    assert_eq!(store.list_conversations("alice", 2).await.expect("list").len(), 2);
    assert_eq!(store.list_conversations("bob", 10).await.expect("list"), vec![bobs]);
    assert!(store.list_conversations("carol", 10).await.expect("list").is_empty());

    assert_eq!(store.get_conversation(&created[0].id).await.expect("get"), Some(created[0].clone()));
    assert_eq!(store.get_conversation(&ConversationId::new()).await.expect("get"), None);
    store.ping().await.expect("ping");
}

pub async fn start_run_writes_message_run_and_first_events(store: SharedStore) {
    let conversation = conversation(&store, "alice").await;
    let started = start(&store, &conversation, at(5)).await;

    let run = &started.run;
    assert_eq!(run.status, RunStatus::Queued);
    assert_eq!(run.conversation_id, conversation.id);
    assert_eq!(run.user_id, "alice");
    assert_eq!(run.next_sequence, 3, "two first events");
    assert_eq!(run.checkpoint, Checkpoint::start(1));
    assert_eq!((run.lease_owner.as_ref(), run.cancel_requested), (None, false));
    assert_eq!(&get_run(&store, &run.id).await, run);
    assert_eq!(store.active_run(&conversation.id).await.expect("active run").as_ref(), Some(run));

    let message = &started.message;
    assert_eq!((message.role, message.run_id.as_ref()), (Role::User, Some(&run.id)));
    assert_eq!(message.id, run.user_message_id);
    assert_eq!(store.list_messages(&conversation.id).await.expect("messages"), vec![message.clone()]);

    assert_eq!(started.events.iter().map(|e| e.sequence).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(started.events[0].type_name(), "run_started");
    assert!(started.events.iter().all(|e| e.ts == at(5) && e.run_id == run.id));
    assert_eq!(events(&store, &run.id).await, started.events);

    let stored = store.get_conversation(&conversation.id).await.expect("get").expect("exists");
    assert_eq!(stored.version, 1);

    // a second turn, once the first is over, sees the conversation one version later
    let mut c = Commit::new(run.id.clone(), Fence::Unowned { from: vec![RunStatus::Queued] }, at(6));
    c.run = Some(RunChange { to: RunStatus::Cancelled, reason: Some("user".into()), via: None });
    commit_ok(&store, c).await;
    let second = start(&store, &conversation, at(7)).await;
    assert_eq!(second.run.checkpoint.conversation_version, 2);
    assert_eq!(store.list_messages(&conversation.id).await.expect("messages").len(), 2);
}

pub async fn start_run_needs_a_conversation(store: SharedStore) {
    let result = store
        .start_run(NewRun {
            conversation_id: ConversationId::new(),
            agent_id: "ops".into(),
            user_id: "alice".into(),
            content: "hello".into(),
            cancel_on_disconnect: true,
            now: at(1),
            events: vec![],
            enqueue: None,
            lease: None,
        })
        .await;
    assert!(matches!(result, Err(StoreError::NotFound("conversation"))), "{result:?}");
}

pub async fn one_active_run_per_conversation(store: SharedStore) {
    let (conversation, first) = queued(&store).await;
    let refused = store
        .start_run(NewRun {
            conversation_id: conversation.id.clone(),
            agent_id: "ops".into(),
            user_id: "alice".into(),
            content: "again".into(),
            cancel_on_disconnect: false,
            now: at(2),
            events: first_events(&conversation.id),
            enqueue: None,
            lease: None,
        })
        .await;
    match refused {
        Err(StoreError::RunActive(id)) => assert_eq!(id, first.id),
        other => panic!("expected RunActive, got {other:?}"),
    }
    // the refused turn left nothing behind
    assert_eq!(store.list_messages(&conversation.id).await.expect("messages").len(), 1);
    let version = store.get_conversation(&conversation.id).await.expect("get").expect("exists").version;
    assert_eq!(version, 1);

    // running and interrupted runs hold the conversation too
    let mut c = Commit::new(first.id.clone(), acquire("w1", RunStatus::Queued, at(60)), at(3));
    c.run = to(RunStatus::Running);
    commit_ok(&store, c).await;
    let mut c = Commit::new(first.id.clone(), lease("w1", at(60)), at(4));
    c.run = to(RunStatus::Interrupted);
    commit_ok(&store, c).await;
    let err = store
        .start_run(NewRun {
            conversation_id: conversation.id.clone(),
            agent_id: "ops".into(),
            user_id: "alice".into(),
            content: "again".into(),
            cancel_on_disconnect: false,
            now: at(5),
            events: vec![],
            enqueue: None,
            lease: None,
        })
        .await
        .expect_err("interrupted run is active");
    assert!(matches!(err, StoreError::RunActive(ref id) if *id == first.id), "{err:?}");

    // once it is over, the conversation takes a new run
    let mut c = Commit::new(first.id.clone(), Fence::Unowned { from: vec![RunStatus::Interrupted] }, at(6));
    c.run = to(RunStatus::Cancelled);
    commit_ok(&store, c).await;
    assert_eq!(store.active_run(&conversation.id).await.expect("active"), None);
    let second = start(&store, &conversation, at(7)).await;
    assert_ne!(second.run.id, first.id);
    assert_eq!(store.active_run(&conversation.id).await.expect("active").map(|r| r.id), Some(second.run.id));
}

pub async fn concurrent_starts_create_one_run(store: SharedStore) {
    let conversation = conversation(&store, "alice").await;
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let store = store.clone();
            let conversation_id = conversation.id.clone();
            tokio::spawn(async move {
                store
                    .start_run(NewRun {
                        conversation_id,
                        agent_id: "ops".into(),
                        user_id: "alice".into(),
                        content: format!("message {i}").into(),
                        cancel_on_disconnect: false,
                        now: at(i),
                        events: vec![],
                        enqueue: None,
                        lease: None,
                    })
                    .await
            })
        })
        .collect();
    let mut started = Vec::new();
    let mut refused = Vec::new();
    for task in tasks {
        match task.await.expect("task") {
            Ok(s) => started.push(s),
            Err(StoreError::RunActive(id)) => refused.push(id),
            Err(e) => panic!("unexpected error {e:?}"),
        }
    }
    assert_eq!(started.len(), 1);
    assert_eq!(refused.len(), 9);
    assert!(refused.iter().all(|id| *id == started[0].run.id));
    assert_eq!(store.list_messages(&conversation.id).await.expect("messages").len(), 1);
}

pub async fn sequences_are_contiguous_across_commits(store: SharedStore) {
    let (_, run) = running(&store, "w1").await;
    let mut expected_next = run.next_sequence;
    let mut written = events(&store, &run.id).await;
    for i in 0..40i64 {
        let mut c = Commit::new(run.id.clone(), lease("w1", at(60 + i)), at(10 + i));
        for d in 0..(i % 4) {
            c.events.push(EventKind::TextDelta { message_id: MessageId::new(), delta: format!("{i}.{d}") });
        }
        let committed = commit_ok(&store, c).await;
        let seqs: Vec<_> = committed.events.iter().map(|e| e.sequence).collect();
        assert_eq!(seqs, (expected_next..expected_next + i % 4).collect::<Vec<_>>());
        assert!(committed.events.iter().all(|e| e.ts == at(10 + i)));
        expected_next += i % 4;
        written.extend(committed.events);
    }
    let stored = events(&store, &run.id).await;
    let n = i64::try_from(stored.len()).expect("count");
    assert_eq!(stored.iter().map(|e| e.sequence).collect::<Vec<_>>(), (1..=n).collect::<Vec<_>>());
    assert_eq!(stored, written, "stored events are the events as committed");
    assert_eq!(get_run(&store, &run.id).await.next_sequence, n + 1);

    let page = store.list_events(&run.id, 5, 3).await.expect("page");
    assert_eq!(page.iter().map(|e| e.sequence).collect::<Vec<_>>(), vec![6, 7, 8]);
    assert!(store.list_events(&run.id, n, 10).await.expect("tail").is_empty());

    // one commit of many events (a backend may write them in several statements)
    let mut c = Commit::new(run.id.clone(), lease("w1", at(200)), at(100));
    for d in 0..150 {
        c.events.push(EventKind::TextDelta { message_id: MessageId::new(), delta: format!("many.{d}") });
    }
    let committed = commit_ok(&store, c).await;
    assert_eq!(committed.events.iter().map(|e| e.sequence).collect::<Vec<_>>(), (n + 1..=n + 150).collect::<Vec<_>>());
    assert_eq!(store.list_events(&run.id, n, 1_000).await.expect("the big commit"), committed.events);
}

pub async fn a_fenced_out_commit_writes_nothing(store: SharedStore) {
    let (conversation, run) = running(&store, "w1").await;
    let call = tool_call(&run.id, "cancel_order", "ord-2", ToolCallState::Requested);
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(5));
    c.tool_calls.push(ToolCallChange::Insert(call.clone()));
    c.facts.push(fact("customer", "acme", FactSource::ToolResult, at(5)));
    commit_ok(&store, c).await;
    let before = snapshot(&store, &conversation.id, &run.id).await;

    // another worker, a lease taken from a status the run is not in, an unowned write on a running run
    let fences = [
        lease("w2", at(120)),
        acquire("w2", RunStatus::Interrupted, at(120)),
        Fence::Unowned { from: vec![RunStatus::Queued, RunStatus::Interrupted] },
        Fence::Acquire { owner: "w2".into(), from: vec![], lease_until: at(120) },
    ];
    for fence in fences {
        assert_conflict(store.commit(everything(&run, &conversation.id, fence, &call)).await);
        assert_eq!(snapshot(&store, &conversation.id, &run.id).await, before);
    }
    let missing = store.commit(Commit::new(RunId::new(), lease("w1", at(60)), at(5)).event(node("x"))).await;
    assert!(matches!(missing, Err(StoreError::NotFound("run"))), "{missing:?}");

    // the same commit by the lease holder goes through, all of it
    commit_ok(&store, everything(&run, &conversation.id, lease("w1", at(60)), &call)).await;
    let after = snapshot(&store, &conversation.id, &run.id).await;
    assert_eq!(after.run.status, RunStatus::Completed);
    assert_eq!(after.run.checkpoint.next_step, NextStep::Finalize);
    assert_eq!(after.events.len(), before.events.len() + 2);
    assert_eq!(after.messages.len(), before.messages.len() + 2);
    assert_eq!(after.tool_calls.len(), 2);
    assert_eq!(after.tool_calls[0].state, ToolCallState::Allowed);
    assert_eq!(after.facts.len(), 2);
    assert!(after.summary.is_some());
    assert!(after.pending_interrupt.is_some());
}

/// Many commits at once, to different runs, some of them refused (fenced out, or with a part that
/// no longer applies): each caller gets its own answer, the refused ones write nothing and the
/// others all of theirs. A store that groups concurrent commits into one transaction (SQLite's
/// writer) must keep them apart.
pub async fn concurrent_commits_each_get_their_own_answer(store: SharedStore) {
    const RUNS: usize = 48;
    let mut runs = Vec::new();
    for _ in 0..RUNS {
        let (conversation, run) = running(&store, "w1").await;
        let call = tool_call(&run.id, "cancel_order", "ord-1", ToolCallState::Requested);
        let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(5));
        c.tool_calls.push(ToolCallChange::Insert(call.clone()));
        commit_ok(&store, c).await;
        let before = snapshot(&store, &conversation.id, &run.id).await;
        runs.push((conversation, run, before, MessageId::new(), call));
    }
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Kind {
        FencedOut,
        PartRefused,
        Accepted,
    }
    let kind = |i: usize| match i % 3 {
        0 => Kind::FencedOut,
        1 => Kind::PartRefused,
        _ => Kind::Accepted,
    };
    const ROUNDS: i64 = 3;
    for round in 0..ROUNDS {
        let start = Arc::new(tokio::sync::Barrier::new(RUNS));
        let tasks: Vec<_> = runs
            .iter()
            .enumerate()
            .map(|(i, (_, run, _, message_id, call))| {
                let owner = if kind(i) == Kind::FencedOut { "w2" } else { "w1" };
                let mut c = Commit::new(run.id.clone(), lease(owner, at(120)), at(10 + round));
                c.text.push(TextAppend { message_id: message_id.clone(), text: format!("r{round} ") });
                c.facts.push(fact("round", &round.to_string(), FactSource::ToolResult, at(10 + round)));
                let deltas = 1 + (i + round as usize) % 4;
                for d in 0..deltas {
                    c.events.push(EventKind::TextDelta { message_id: message_id.clone(), delta: format!("{d}") });
                }
                // the run's call moves on, once
                if round == 0 {
                    c.tool_calls.push(ToolCallChange::transition(
                        &call.id,
                        ToolCallState::Requested,
                        ToolCallState::Allowed,
                    ));
                }
                if kind(i) == Kind::PartRefused {
                    // no such call: refusing it must undo the move before it too
                    c.tool_calls.push(ToolCallChange::transition(
                        &CallId::new(),
                        ToolCallState::Requested,
                        ToolCallState::Allowed,
                    ));
                }
                let store = store.clone();
                let start = start.clone();
                tokio::spawn(async move {
                    start.wait().await;
                    (store.commit(c).await, deltas)
                })
            })
            .collect();
        for (i, task) in tasks.into_iter().enumerate() {
            let (answer, deltas) = task.await.expect("task");
            let run = &runs[i].1;
            match (kind(i), answer) {
                (Kind::FencedOut | Kind::PartRefused, Err(StoreError::Conflict(_))) => {}
                (Kind::Accepted, Ok(committed)) => {
                    let stored = events(&store, &run.id).await;
                    let first = stored.len() as i64 - deltas as i64 + 1;
                    let seqs: Vec<_> = committed.events.iter().map(|e| e.sequence).collect();
                    assert_eq!(seqs, (first..first + deltas as i64).collect::<Vec<_>>(), "run {i}, round {round}");
                    assert_eq!(stored[stored.len() - deltas..], committed.events[..]);
                }
                (k, answer) => panic!("run {i} ({k:?}), round {round}: unexpected answer {answer:?}"),
            }
        }
    }
    for (i, (conversation, run, before, message_id, _)) in runs.iter().enumerate() {
        let after = snapshot(&store, &conversation.id, &run.id).await;
        if kind(i) != Kind::Accepted {
            assert_eq!(&after, before, "refused run {i} left a trace");
            continue;
        }
        assert_eq!(after.tool_calls[0].state, ToolCallState::Allowed, "run {i}");
        // grouped or not, a commit that leaves the status as it is leaves the lease as it is
        assert_eq!(after.run.lease_expires_at, Some(at(60)), "run {i}");
        let n = after.run.last_sequence();
        assert_eq!(sequences(&store, &run.id).await, (1..=n).collect::<Vec<_>>(), "run {i}");
        let written: usize = (0..ROUNDS).map(|round| 1 + (i + round as usize) % 4).sum();
        assert_eq!(after.events.len(), before.events.len() + written, "run {i}");
        let text = after.messages.iter().find(|m| &m.id == message_id).expect("the run's text");
        assert_eq!(text.content, "r0 r1 r2 ", "run {i}");
        assert_eq!(after.facts.iter().find(|f| f.key == "round").map(|f| f.value.as_str()), Some("2"));
    }
}

pub async fn acquire_wins_exactly_once_under_contention(store: SharedStore) {
    let (_, run, pending) = interrupted(&store, at(300)).await;
    let before = get_run(&store, &run.id).await;
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let store = store.clone();
            let run_id = run.id.clone();
            let pending = pending.clone();
            tokio::spawn(async move {
                let owner = format!("worker-{i}");
                let mut c = Commit::new(run_id, acquire(&owner, RunStatus::Interrupted, at(160)), at(100));
                c.run = to(RunStatus::Running);
                c.interrupt_changes.push(resolve(&pending, &owner));
                c.events.push(resumed(&pending, &owner));
                c.events.push(node("execute_tools"));
                (owner, store.commit(c).await)
            })
        })
        .collect();
    let mut winners = Vec::new();
    for task in tasks {
        let (owner, result) = task.await.expect("task");
        match result {
            Ok(committed) => winners.push((owner, committed)),
            Err(StoreError::Conflict(_)) => {}
            Err(e) => panic!("unexpected error {e:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one resume wins");
    let (owner, committed) = &winners[0];
    let seqs: Vec<_> = committed.events.iter().map(|e| e.sequence).collect();
    assert_eq!(seqs, vec![before.next_sequence, before.next_sequence + 1]);

    let after = get_run(&store, &run.id).await;
    assert_eq!(after.status, RunStatus::Running);
    assert_eq!(after.lease_owner.as_ref(), Some(owner));
    assert_eq!(after.lease_expires_at, Some(at(160)));
    let n = after.last_sequence();
    assert_eq!(sequences(&store, &run.id).await, (1..=n).collect::<Vec<_>>());
    let resolved = store.get_interrupt(&pending.id).await.expect("get").expect("exists");
    assert_eq!(resolved.status, InterruptStatus::Resolved);
    assert_eq!(resolved.resolved_by.as_ref(), Some(owner));
}

/// Many runs taken at once, each by an instance of its own (a store that writes concurrent commits
/// together, as PostgreSQL's committers do, must keep each run's worker): every run names the
/// instance that acquired it.
pub async fn concurrent_acquires_record_their_worker(store: SharedStore) {
    const RUNS: usize = 24;
    let mut runs = Vec::new();
    for _ in 0..RUNS {
        runs.push(queued(&store).await.1);
    }
    let start = Arc::new(tokio::sync::Barrier::new(RUNS));
    let tasks: Vec<_> = runs
        .iter()
        .enumerate()
        .map(|(i, run)| {
            let (store, start, run_id) = (store.clone(), start.clone(), run.id.clone());
            tokio::spawn(async move {
                let owner = format!("instance-{}:{i}", i % 3);
                let mut c = Commit::new(run_id, acquire(&owner, RunStatus::Queued, at(60)), at(2));
                c.run = to(RunStatus::Running);
                c.events.push(node("x"));
                start.wait().await;
                store.commit(c).await
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task").expect("commit");
    }
    for (i, run) in runs.iter().enumerate() {
        let run = get_run(&store, &run.id).await;
        let expected = format!("instance-{}", i % 3);
        assert_eq!((run.status, run.worker.as_deref()), (RunStatus::Running, Some(expected.as_str())), "run {i}");
    }
}

/// Two moves written as one (a worker's start joined with its pause or its end, `RunChange::via`):
/// the run may enter `via` from where it is, so a queued run leased to the worker pauses or ends
/// in one commit; a run already running, or over, refuses the commit and keeps what it had. Several
/// at once, so PostgreSQL's committers check them in a group as well as alone.
pub async fn a_start_and_a_pause_in_one_commit_move_through_running(store: SharedStore) {
    let through = |to: RunStatus| Some(RunChange { to, reason: None, via: Some(RunStatus::Running) });
    let mut leased = Vec::new();
    for _ in 0..3 {
        let conversation = conversation(&store, "alice").await;
        let started = store
            .start_run(NewRun {
                conversation_id: conversation.id.clone(),
                agent_id: "ops".into(),
                user_id: conversation.user_id.clone(),
                content: "Cancel order ord-2".into(),
                cancel_on_disconnect: false,
                now: at(1),
                events: first_events(&conversation.id),
                enqueue: None,
                lease: Some(NewLease { owner: "w1".into(), until: at(60) }),
            })
            .await
            .expect("start a leased run");
        assert_eq!(started.run.status, RunStatus::Queued);
        leased.push(started.run);
    }
    let (_, running_run) = running(&store, "w1").await;
    let commit = |run: &Run, to: RunStatus| {
        let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(5));
        c.run = through(to);
        c.events = vec![node("context"), node("model"), node("tools")];
        c
    };
    let commits = [
        commit(&leased[0], RunStatus::Interrupted),
        commit(&leased[1], RunStatus::Completed),
        commit(&leased[2], RunStatus::Interrupted),
        // running already: it may not enter `running` again
        commit(&running_run, RunStatus::Interrupted),
    ];
    let start = Arc::new(tokio::sync::Barrier::new(commits.len()));
    let tasks: Vec<_> = commits
        .into_iter()
        .map(|c| {
            let (store, start) = (store.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                store.commit(c).await
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.expect("task"));
    }
    let mut outcomes = outcomes.into_iter();
    for (run, to) in leased.iter().zip([RunStatus::Interrupted, RunStatus::Completed, RunStatus::Interrupted]) {
        let committed = outcomes.next().expect("an outcome").expect("a queued run moves through running");
        assert_eq!(committed.events.len(), 3);
        let now = get_run(&store, &run.id).await;
        assert_eq!(
            (now.status, now.lease_owner, now.lease_expires_at),
            (to, None, None),
            "released when paused or over"
        );
        assert_eq!(store.list_events(&run.id, 0, 100).await.expect("events").len(), 5);
    }
    assert_conflict(outcomes.next().expect("an outcome"));
    assert_eq!(get_run(&store, &running_run.id).await, running_run);
    assert_eq!(store.list_events(&running_run.id, 0, 100).await.expect("events").len(), 3);

    // a finished run refuses it too
    assert_conflict(store.commit(commit(&leased[1], RunStatus::Completed)).await);
}

pub async fn run_changes_follow_the_state_machine(store: SharedStore) {
    // a refused move rolls back the lease its fence took
    let (_, queued_run) = queued(&store).await;
    let mut c = Commit::new(queued_run.id.clone(), acquire("w1", RunStatus::Queued, at(60)), at(2));
    c.run = to(RunStatus::Completed);
    c.events.push(node("x"));
    assert_conflict(store.commit(c).await);
    assert_eq!(get_run(&store, &queued_run.id).await, queued_run);

    let (conversation, run) = running(&store, "w1").await;
    for bad in [RunStatus::Queued, RunStatus::Running] {
        let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(5));
        c.run = to(bad);
        assert_conflict(store.commit(c).await);
    }
    assert_eq!(get_run(&store, &run.id).await, run);

    // pausing lets go of the lease
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(5));
    c.run = to(RunStatus::Interrupted);
    commit_ok(&store, c).await;
    let paused = get_run(&store, &run.id).await;
    assert_eq!((paused.status, paused.lease_owner, paused.lease_expires_at), (RunStatus::Interrupted, None, None));
    assert_conflict(store.commit(Commit::new(run.id.clone(), lease("w1", at(60)), at(6)).event(node("x"))).await);

    let mut c = Commit::new(run.id.clone(), acquire("w2", RunStatus::Interrupted, at(90)), at(7));
    c.run = to(RunStatus::Running);
    commit_ok(&store, c).await;
    let resumed = get_run(&store, &run.id).await;
    assert_eq!((resumed.status, resumed.lease_owner.as_deref()), (RunStatus::Running, Some("w2")));
    assert_eq!(resumed.worker.as_deref(), Some(keel_core::domain::lease_holder("w2")), "the acquiring worker");

    // finishing lets go of it too, and records the reason
    let mut c = Commit::new(run.id.clone(), lease("w2", at(90)), at(8));
    c.run = Some(RunChange { to: RunStatus::Failed, reason: Some("model unavailable".into()), via: None });
    commit_ok(&store, c).await;
    let failed = get_run(&store, &run.id).await;
    assert_eq!((failed.status, failed.reason.as_deref()), (RunStatus::Failed, Some("model unavailable")));
    assert_eq!((failed.lease_owner.as_deref(), failed.lease_expires_at), (None, None));
    assert_eq!(failed.updated_at, at(8));
    assert_eq!(store.active_run(&conversation.id).await.expect("active"), None);

    // nothing moves a finished run
    let all_statuses = RunStatus::ALL.to_vec();
    for fence in [lease("w2", at(90)), Fence::Unowned { from: all_statuses.clone() }] {
        let mut c = Commit::new(run.id.clone(), fence, at(9));
        c.run = to(RunStatus::Running);
        assert_conflict(store.commit(c).await);
    }
    assert_eq!(get_run(&store, &run.id).await, failed);
}

pub async fn expired_interrupt_cannot_be_resolved(store: SharedStore) {
    let (conversation, run, pending) = interrupted(&store, at(300)).await;
    let before = snapshot(&store, &conversation.id, &run.id).await;
    for now in [at(300), at(301)] {
        let mut c = Commit::new(run.id.clone(), acquire("w2", RunStatus::Interrupted, at(400)), now);
        c.run = to(RunStatus::Running);
        c.interrupt_changes.push(resolve(&pending, "alice"));
        c.events.push(resumed(&pending, "alice"));
        assert_conflict(store.commit(c).await);
        assert_eq!(snapshot(&store, &conversation.id, &run.id).await, before);
    }

    // expiry itself goes through: interrupt expired, run cancelled
    let mut c = Commit::new(run.id.clone(), Fence::Unowned { from: vec![RunStatus::Interrupted] }, at(301));
    c.run = Some(RunChange { to: RunStatus::Cancelled, reason: Some("interrupt expired".into()), via: None });
    c.interrupt_changes.push(InterruptChange {
        id: pending.id.clone(),
        to: InterruptStatus::Expired,
        decision: None,
        note: None,
        resolved_by: None,
    });
    c.events.push(EventKind::Cancelled { reason: "interrupt expired".into() });
    commit_ok(&store, c).await;
    let expired = store.get_interrupt(&pending.id).await.expect("get").expect("exists");
    assert_eq!((expired.status, expired.resolved_at), (InterruptStatus::Expired, Some(at(301))));
    assert_eq!(get_run(&store, &run.id).await.status, RunStatus::Cancelled);
    assert_eq!(store.pending_interrupt(&run.id).await.expect("pending"), None);
}

/// What an answer to an interrupt reads in one go is what the separate reads give: the run, its
/// interrupts (a resolved one too, oldest first), its calls in order, and the answering user's
/// stored role, and the facts of its conversation (not another's); nothing for a run that does not
/// exist, and no role for a user without one.
pub async fn an_answer_view_is_the_run_its_interrupts_calls_and_the_role(store: SharedStore) {
    let (conversation, run, first) = interrupted(&store, at(300)).await;
    // another conversation's fact
    let (_, other, _) = interrupted(&store, at(300)).await;
    let mut c = Commit::new(other.id.clone(), Fence::Unowned { from: vec![RunStatus::Interrupted] }, at(9));
    c.facts.push(fact("order", "ord-9", FactSource::ToolResult, at(9)));
    commit_ok(&store, c).await;
    // the first interrupt answered, a second one asked, in one commit each
    let mut c = Commit::new(run.id.clone(), acquire("w2", RunStatus::Interrupted, at(400)), at(10));
    c.run = to(RunStatus::Running);
    c.interrupt_changes.push(resolve(&first, "alice"));
    c.events.push(resumed(&first, "alice"));
    commit_ok(&store, c).await;
    let looked_up = ToolCall {
        result: Some(Masked::new(json!({"order": "ord-2", "status": "late"}))),
        ..tool_call(&run.id, "get_order", "ord-2", ToolCallState::Succeeded)
    };
    let call = tool_call(&run.id, "refund_order", "ord-2", ToolCallState::Asking);
    let second = Interrupt { created_at: at(11), ..interrupt(&run.id, vec![call.id.clone()], at(300)) };
    let mut c = Commit::new(run.id.clone(), lease("w2", at(400)), at(11));
    c.run = to(RunStatus::Interrupted);
    c.tool_calls.push(ToolCallChange::Insert(looked_up));
    c.tool_calls.push(ToolCallChange::Insert(call));
    c.new_interrupts.push(second);
    c.facts.push(fact("order", "ord-2", FactSource::ToolResult, at(11)));
    c.facts.push(fact("customer", "acme", FactSource::ToolResult, at(11)));
    commit_ok(&store, c).await;
    store.set_user_role("alice", UserRole::Operator).await.expect("role");

    let view = store.answer_view(&run.id, "alice").await.expect("view");
    assert_eq!(view.run, Some(get_run(&store, &run.id).await));
    assert_eq!(view.interrupts, store.list_interrupts(&run.id).await.expect("interrupts"));
    assert_eq!(view.interrupts.len(), 2);
    assert_eq!(view.interrupts[0].status, InterruptStatus::Resolved);
    let calls = store.list_tool_calls(&run.id).await.expect("calls");
    assert!(calls.iter().any(|c| c.result.is_some()));
    assert_eq!(view.tool_calls, calls.iter().map(without_result).collect::<Vec<_>>(), "the calls, not their results");
    assert_eq!(view.role, Some(UserRole::Operator));
    let facts = store.list_facts(&conversation.id).await.expect("facts");
    assert_eq!(facts.len(), 2);
    assert_eq!(keel_core::domain::fact_map(&view.facts), keel_core::domain::fact_map(&facts));

    assert_eq!(store.answer_view(&run.id, "nobody").await.expect("view").role, None);
    assert_eq!(
        store.answer_view(&RunId::new(), "alice").await.expect("view"),
        AnswerView { role: Some(UserRole::Operator), ..AnswerView::default() }
    );
}

pub async fn interrupt_is_resolved_once(store: SharedStore) {
    let (conversation, run, pending) = interrupted(&store, at(300)).await;
    assert_eq!(store.pending_interrupt(&run.id).await.expect("pending"), Some(pending.clone()));
    assert_eq!(store.get_interrupt(&pending.id).await.expect("get"), Some(pending.clone()));

    let mut c = Commit::new(run.id.clone(), acquire("w2", RunStatus::Interrupted, at(400)), at(299));
    c.run = to(RunStatus::Running);
    c.interrupt_changes.push(resolve(&pending, "alice"));
    c.events.push(resumed(&pending, "alice"));
    commit_ok(&store, c).await;
    let resolved = store.get_interrupt(&pending.id).await.expect("get").expect("exists");
    assert_eq!(resolved.status, InterruptStatus::Resolved);
    assert_eq!(resolved.decision, Some(json!("approve").into()));
    assert_eq!(resolved.resolved_by.as_deref(), Some("alice"));
    assert_eq!(resolved.resolved_at, Some(at(299)));
    assert_eq!(store.pending_interrupt(&run.id).await.expect("pending"), None);

    // a second decision, even by the lease holder, and a move back to pending, are refused
    let before = snapshot(&store, &conversation.id, &run.id).await;
    for change in [
        resolve(&pending, "bob"),
        InterruptChange { to: InterruptStatus::Cancelled, ..resolve(&pending, "bob") },
        InterruptChange { to: InterruptStatus::Pending, ..resolve(&pending, "bob") },
        resolve(&Interrupt { id: InterruptId::new(), ..pending.clone() }, "bob"),
    ] {
        let mut c = Commit::new(run.id.clone(), lease("w2", at(400)), at(299));
        c.interrupt_changes.push(change);
        c.events.push(resumed(&pending, "bob"));
        assert_conflict(store.commit(c).await);
    }
    assert_eq!(snapshot(&store, &conversation.id, &run.id).await, before);
    let still = store.get_interrupt(&pending.id).await.expect("get").expect("exists");
    assert_eq!(still, resolved);
}

pub async fn tool_call_updates_are_conditional(store: SharedStore) {
    let (conversation, run) = running(&store, "w1").await;
    let call = tool_call(&run.id, "cancel_order", "ord-2", ToolCallState::Requested);
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(5));
    c.tool_calls.push(ToolCallChange::Insert(call.clone()));
    commit_ok(&store, c).await;
    assert_eq!(store.list_tool_calls(&run.id).await.expect("calls"), vec![call.clone()]);
    let before = snapshot(&store, &conversation.id, &run.id).await;

    let refused = [
        // the state is not what the writer thinks
        ToolCallChange::transition(&call.id, ToolCallState::Asking, ToolCallState::Allowed),
        // the state machine does not allow the move
        ToolCallChange::transition(&call.id, ToolCallState::Requested, ToolCallState::Executing),
        ToolCallChange::transition(&call.id, ToolCallState::Requested, ToolCallState::Succeeded),
        // no such call in this run
        ToolCallChange::transition(&CallId::new(), ToolCallState::Requested, ToolCallState::Allowed),
    ];
    for change in refused {
        let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(6));
        c.tool_calls.push(change);
        c.events.push(node("execute_tools"));
        assert_conflict(store.commit(c).await);
        assert_eq!(snapshot(&store, &conversation.id, &run.id).await, before);
    }

    let steps = [
        ToolCallChange::transition(&call.id, ToolCallState::Requested, ToolCallState::Asking),
        ToolCallChange::Update(ToolCallUpdate {
            args: Some(json!({"orderId": "ord-3"}).into()),
            ..ToolCallUpdate::new(&call.id, ToolCallState::Asking, ToolCallState::Allowed)
        }),
        ToolCallChange::Update(ToolCallUpdate {
            started_at: Some(at(7)),
            attempts: Some(1),
            ..ToolCallUpdate::new(&call.id, ToolCallState::Allowed, ToolCallState::Executing)
        }),
        ToolCallChange::Update(ToolCallUpdate {
            result: Some(json!({"status": "cancelled", "refund": 12}).into()),
            summary: Some("ord-3 cancelled".into()),
            finished_at: Some(at(8)),
            ..ToolCallUpdate::new(&call.id, ToolCallState::Executing, ToolCallState::Succeeded)
        }),
    ];
    for step in steps {
        let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(7));
        c.tool_calls.push(step);
        commit_ok(&store, c).await;
    }
    let done = store.list_tool_calls(&run.id).await.expect("calls").remove(0);
    assert_eq!(done.state, ToolCallState::Succeeded);
    assert_eq!(done.args, json!({"orderId": "ord-3"}), "the approved edit replaced the args");
    assert_eq!(done.result, Some(json!({"status": "cancelled", "refund": 12}).into()));
    assert_eq!(done.summary.as_ref().map(|s| s.as_str()), Some("ord-3 cancelled"));
    assert_eq!((done.started_at, done.finished_at), (Some(at(7)), Some(at(8))));
    assert_eq!(done.attempts, 1);
}

/// A commit whose last part is refused leaves nothing of its earlier parts.
pub async fn a_refused_part_rolls_back_the_whole_commit(store: SharedStore) {
    let (conversation, run) = running(&store, "w1").await;
    let call = tool_call(&run.id, "cancel_order", "ord-1", ToolCallState::Executing);
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(5));
    c.tool_calls.push(ToolCallChange::Insert(call.clone()));
    commit_ok(&store, c).await;
    let before = snapshot(&store, &conversation.id, &run.id).await;

    let mut c = Commit::new(run.id.clone(), lease("w1", at(120)), at(6));
    c.tool_calls.push(ToolCallChange::Update(ToolCallUpdate {
        result: Some(json!({"ok": true}).into()),
        summary: Some("cancelled".into()),
        finished_at: Some(at(6)),
        ..ToolCallUpdate::new(&call.id, ToolCallState::Executing, ToolCallState::Succeeded)
    }));
    c.facts.push(fact("order", "ord-1", FactSource::ToolResult, at(6)));
    c.events.push(EventKind::ToolFinished {
        call_id: call.id.clone(),
        tool: "cancel_order".into(),
        status: ToolOutcomeStatus::Success,
        summary: "cancelled".into(),
        error_code: None,
    });
    // last, and refused: the call is no longer executing once the first change applies
    c.tool_calls.push(ToolCallChange::transition(&call.id, ToolCallState::Executing, ToolCallState::Unknown));
    assert_conflict(store.commit(c).await);
    assert_eq!(snapshot(&store, &conversation.id, &run.id).await, before);
}

/// Each attempt of a call is counted, and the count survives being read back.
pub async fn tool_call_attempts_are_counted(store: SharedStore) {
    let (_, run) = running(&store, "w1").await;
    let call = tool_call(&run.id, "cancel_order", "ord-4", ToolCallState::Allowed);
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(5));
    c.tool_calls.push(ToolCallChange::Insert(call.clone()));
    commit_ok(&store, c).await;
    for (attempt, from) in [(1, ToolCallState::Allowed), (2, ToolCallState::Executing), (3, ToolCallState::Executing)] {
        let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(5 + attempt));
        c.tool_calls.push(ToolCallChange::Update(ToolCallUpdate {
            attempts: Some(attempt as u32),
            ..ToolCallUpdate::new(&call.id, from, ToolCallState::Executing)
        }));
        commit_ok(&store, c).await;
        let stored = store.list_tool_calls(&run.id).await.expect("calls").remove(0);
        assert_eq!((stored.state, stored.attempts), (ToolCallState::Executing, attempt as u32));
    }
    // a move that does not say leaves the count alone
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(20));
    c.tool_calls.push(ToolCallChange::transition(&call.id, ToolCallState::Executing, ToolCallState::Unknown));
    commit_ok(&store, c).await;
    let stored = store.list_tool_calls(&run.id).await.expect("calls").remove(0);
    assert_eq!((stored.state, stored.attempts), (ToolCallState::Unknown, 3));
}

pub async fn text_appends_build_one_message_and_discard_removes_it(store: SharedStore) {
    let (conversation, run) = running(&store, "w1").await;
    let answer = MessageId::new();
    let append = |id: &MessageId, text: &str| TextAppend { message_id: id.clone(), text: text.into() };

    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(5));
    c.text.push(append(&answer, "Hel"));
    commit_ok(&store, c).await;
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(6));
    c.text.push(append(&answer, "lo"));
    c.text.push(append(&answer, ", world"));
    commit_ok(&store, c).await;

    let messages = store.list_messages(&conversation.id).await.expect("messages");
    assert_eq!(messages.len(), 2);
    let m = &messages[1];
    assert_eq!((m.id.clone(), m.role, m.content.as_str()), (answer.clone(), Role::Assistant, "Hello, world"));
    assert_eq!((m.run_id.as_ref(), &m.conversation_id), (Some(&run.id), &conversation.id));
    assert_eq!(m.created_at, at(5), "created by the first append");

    // a cut-off model call: its message goes, the earlier one stays
    let cut = MessageId::new();
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(7));
    c.text.push(append(&cut, "I will resta"));
    commit_ok(&store, c).await;
    assert_eq!(store.list_messages(&conversation.id).await.expect("messages").len(), 3);
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(8));
    c.discard_messages.push(cut.clone());
    c.discard_messages.push(MessageId::new()); // never created: nothing to do
    c.events.push(EventKind::TextDiscarded { message_id: cut, reason: "recovered".into() });
    commit_ok(&store, c).await;
    let after: Vec<_> =
        store.list_messages(&conversation.id).await.expect("messages").into_iter().map(|m| m.id).collect();
    assert_eq!(after, vec![run.user_message_id.clone(), answer]);

    // text never goes into a message that is not this run's assistant message
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(9));
    c.text.push(append(&run.user_message_id, "!"));
    assert_conflict(store.commit(c).await);
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(9));
    c.discard_messages.push(run.user_message_id.clone());
    commit_ok(&store, c).await;
    let messages = store.list_messages(&conversation.id).await.expect("messages");
    assert_eq!(messages[0].content, "Cancel order ord-2", "the user message stays");
    assert_eq!(messages.len(), 2);
}

pub async fn messages_facts_and_summary_are_written_by_commit(store: SharedStore) {
    let (conversation, run) = running(&store, "w1").await;
    let call = tool_call(&run.id, "get_order", "ord-2", ToolCallState::Succeeded);
    let tool_message = Message {
        id: MessageId::new(),
        conversation_id: conversation.id.clone(),
        run_id: Some(run.id.clone()),
        role: Role::Tool,
        content: "{\"status\":\"abnormal\"}".into(),
        tool_call_id: Some(call.id.clone()),
        created_at: at(5),
    };
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(5));
    c.tool_calls.push(ToolCallChange::Insert(call));
    c.messages.push(tool_message.clone());
    c.facts.push(fact("customer", "acme", FactSource::ToolResult, at(5)));
    c.facts.push(fact("env", "prod", FactSource::ToolResult, at(5)));
    c.summary = Some(Summary {
        conversation_id: conversation.id.clone(),
        through_message_id: run.user_message_id.clone(),
        text: "first".into(),
    });
    commit_ok(&store, c).await;
    assert_eq!(store.list_messages(&conversation.id).await.expect("messages")[1], tool_message);

    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(6));
    c.facts.push(fact("customer", "globex", FactSource::UserConfirmed, at(6)));
    c.summary = Some(Summary {
        conversation_id: conversation.id.clone(),
        through_message_id: tool_message.id.clone(),
        text: "second".into(),
    });
    commit_ok(&store, c).await;

    let mut facts = store.list_facts(&conversation.id).await.expect("facts");
    facts.sort_by(|a, b| a.key.cmp(&b.key));
    assert_eq!(
        facts,
        vec![
            fact("customer", "globex", FactSource::UserConfirmed, at(6)),
            fact("env", "prod", FactSource::ToolResult, at(5)),
        ]
    );
    let summary = store.get_summary(&conversation.id).await.expect("summary").expect("exists");
    assert_eq!((summary.text.as_str(), &summary.through_message_id), ("second", &tool_message.id));

    // facts belong to their conversation
    let other = store.create_conversation("alice", &"other".into(), "ops", at(0)).await.expect("create");
    assert!(store.list_facts(&other.id).await.expect("facts").is_empty());
    assert_eq!(store.get_summary(&other.id).await.expect("summary"), None);
}

pub async fn duplicate_ids_are_refused(store: SharedStore) {
    let (conversation, run) = running(&store, "w1").await;
    let call = tool_call(&run.id, "get_order", "ord-2", ToolCallState::Requested);
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(5));
    c.tool_calls.push(ToolCallChange::Insert(call.clone()));
    commit_ok(&store, c).await;
    let before = snapshot(&store, &conversation.id, &run.id).await;

    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(6)).event(node("x"));
    c.tool_calls.push(ToolCallChange::Insert(call));
    assert!(matches!(store.commit(c).await, Err(StoreError::Duplicate(_))));

    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(6)).event(node("x"));
    c.messages.push(Message {
        id: run.user_message_id.clone(),
        conversation_id: conversation.id.clone(),
        run_id: Some(run.id.clone()),
        role: Role::Tool,
        content: "{}".into(),
        tool_call_id: None,
        created_at: at(6),
    });
    assert!(matches!(store.commit(c).await, Err(StoreError::Duplicate(_))));
    assert_eq!(snapshot(&store, &conversation.id, &run.id).await, before);
}

pub async fn claim_runs_takes_queued_and_expired_not_live(store: SharedStore) {
    let mut runs = Vec::new();
    for secs in 1..=4 {
        let conversation = conversation(&store, "alice").await;
        runs.push(start(&store, &conversation, at(secs)).await.run);
    }
    // a finished run is never claimed
    let mut c = Commit::new(runs[3].id.clone(), Fence::Unowned { from: vec![RunStatus::Queued] }, at(5));
    c.run = to(RunStatus::Cancelled);
    commit_ok(&store, c).await;
    let ids = |claimed: &[Run]| claimed.iter().map(|r| r.id.clone()).collect::<Vec<_>>();

    let first = store.claim_runs("w1", at(10), at(70), false, 2).await.expect("claim");
    assert_eq!(ids(&first), vec![runs[0].id.clone(), runs[1].id.clone()], "oldest first, at most limit");
    for r in &first {
        assert_eq!(
            (r.status, r.lease_owner.as_deref(), r.lease_expires_at),
            (RunStatus::Running, Some("w1"), Some(at(70)))
        );
        assert_eq!(&get_run(&store, &r.id).await, r);
    }
    let second = store.claim_runs("w2", at(10), at(70), false, 10).await.expect("claim");
    assert_eq!(ids(&second), vec![runs[2].id.clone()]);
    assert!(store.claim_runs("w3", at(69), at(130), false, 10).await.expect("claim").is_empty(), "leases are live");

    let stolen = store.claim_runs("w3", at(20), at(200), true, 1).await.expect("steal");
    assert_eq!(ids(&stolen), vec![runs[0].id.clone()]);
    assert_eq!(stolen[0].lease_owner.as_deref(), Some("w3"));

    // at the expiry instant the lease is gone
    let expired = store.claim_runs("w4", at(70), at(130), false, 10).await.expect("claim");
    assert_eq!(ids(&expired), vec![runs[1].id.clone(), runs[2].id.clone()]);
    assert!(expired.iter().all(|r| r.lease_owner.as_deref() == Some("w4")));

    // a paused run waits for a human, not for a worker
    let mut c = Commit::new(runs[2].id.clone(), lease("w4", at(130)), at(71));
    c.run = to(RunStatus::Interrupted);
    commit_ok(&store, c).await;
    let rest = store.claim_runs("w5", at(1000), at(1060), true, 10).await.expect("claim");
    assert_eq!(ids(&rest), vec![runs[0].id.clone(), runs[1].id.clone()]);
    assert_eq!(get_run(&store, &runs[2].id).await.status, RunStatus::Interrupted);
    assert_eq!(get_run(&store, &runs[3].id).await.status, RunStatus::Cancelled);
}

/// A run written leased to the worker that will drive it (a new message's, a promoted one's) stays
/// `queued` and is that worker's: no claim takes it while the lease lives, its worker's first
/// commit (a lease fence) moves it to `running`, and once the lease ends (its instance died before
/// that commit) a claim takes it.
pub async fn a_run_written_leased_is_not_claimed_while_its_lease_lives(store: SharedStore) {
    let leased = |owner: &str, until: Timestamp| Some(NewLease { owner: owner.into(), until });
    let write = |conversation: Conversation, owner: &'static str, now: Timestamp| {
        let store = store.clone();
        async move {
            store
                .start_run(NewRun {
                    conversation_id: conversation.id.clone(),
                    agent_id: "ops".into(),
                    user_id: conversation.user_id.clone(),
                    content: "restart it".into(),
                    cancel_on_disconnect: false,
                    now,
                    events: first_events(&conversation.id),
                    enqueue: None,
                    lease: leased(owner, at(60)),
                })
                .await
                .expect("start a leased run")
        }
    };
    let first = write(conversation(&store, "alice").await, "a:1", at(1)).await.run;
    let second = write(conversation(&store, "alice").await, "a:2", at(2)).await.run;
    for run in [&first, &second] {
        assert_eq!(run.status, RunStatus::Queued);
        assert_eq!(run.lease_expires_at, Some(at(60)));
        assert_eq!(run.worker.as_deref(), Some("a"));
        assert_eq!(&get_run(&store, &run.id).await, run, "the run as written is the run as stored");
    }
    assert_eq!(first.lease_owner.as_deref(), Some("a:1"));
    assert!(store.claim_runs("b:1", at(10), at(70), false, 10).await.expect("claim").is_empty(), "leases live");
    // only its lease's holder writes on it
    let mut c = Commit::new(first.id.clone(), lease("b:1", at(70)), at(11));
    c.run = to(RunStatus::Running);
    assert!(matches!(store.commit(c).await, Err(StoreError::Conflict(_))), "not b's lease");
    let mut c = Commit::new(first.id.clone(), lease("a:1", at(70)), at(11));
    c.run = to(RunStatus::Running);
    commit_ok(&store, c).await;
    let running = get_run(&store, &first.id).await;
    assert_eq!((running.status, running.lease_owner.as_deref()), (RunStatus::Running, Some("a:1")));
    // the second's instance died before its first commit: at the lease's end a claim takes it
    assert!(store.claim_runs("b:1", at(59), at(120), false, 10).await.expect("claim").is_empty());
    let claimed = store.claim_runs("b:1", at(60), at(120), false, 10).await.expect("claim");
    assert_eq!(claimed.iter().map(|r| r.id.clone()).collect::<Vec<_>>(), vec![second.id.clone()]);
    assert_eq!((claimed[0].status, claimed[0].lease_owner.as_deref()), (RunStatus::Running, Some("b:1")));

    // a waiting run promoted with a lease: the same
    let conversation = conversation(&store, "alice").await;
    let active = start(&store, &conversation, at(3)).await.run;
    let waiting = enqueue(&store, &conversation, "then this", at(4)).await.run;
    assert_eq!(
        (waiting.status, waiting.lease_owner.as_deref()),
        (RunStatus::Waiting, None),
        "a waiting run has no lease"
    );
    end_queued(&store, &active.id, at(5)).await;
    let promoted = store
        .promote_waiting(&conversation.id, first_events(&conversation.id), leased("c:1", at(100)), at(6))
        .await
        .expect("promote")
        .expect("it starts");
    assert_eq!(promoted.run.id, waiting.id);
    assert_eq!(
        (promoted.run.status, promoted.run.lease_owner.as_deref(), promoted.run.worker.as_deref()),
        (RunStatus::Queued, Some("c:1"), Some("c"))
    );
    assert_eq!(promoted.run.lease_expires_at, Some(at(100)));
    let ids = |claimed: Vec<Run>| claimed.into_iter().map(|r| r.id).collect::<Vec<_>>();
    // the first run's worker stopped committing (its lease ran to 70): that one is taken, not this
    let claimed = store.claim_runs("b:2", at(99), at(160), false, 10).await.expect("claim");
    assert_eq!(ids(claimed), vec![first.id.clone()]);
    let claimed = store.claim_runs("b:2", at(100), at(160), false, 10).await.expect("claim");
    assert_eq!(ids(claimed), vec![waiting.id.clone()]);
}

pub async fn concurrent_claimers_never_share_a_run(store: SharedStore) {
    let mut all = BTreeSet::new();
    for secs in 0..12 {
        let conversation = conversation(&store, "alice").await;
        all.insert(start(&store, &conversation, at(secs)).await.run.id);
    }
    let tasks: Vec<_> = (0..4)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let owner = format!("w{i}");
                let mut mine = Vec::new();
                // bounded: a store that hands out live leases again must fail, not hang
                for _ in 0..20 {
                    let claimed = store.claim_runs(&owner, at(100), at(160), false, 2).await.expect("claim");
                    if claimed.is_empty() {
                        break;
                    }
                    assert!(claimed.iter().all(|r| r.lease_owner.as_deref() == Some(owner.as_str())));
                    mine.extend(claimed.into_iter().map(|r| r.id));
                }
                mine
            })
        })
        .collect();
    let mut claimed = Vec::new();
    for task in tasks {
        claimed.extend(task.await.expect("task"));
    }
    assert_eq!(claimed.len(), all.len(), "every run claimed exactly once");
    assert_eq!(claimed.into_iter().collect::<BTreeSet<_>>(), all);
}

pub async fn leases_renew_and_release(store: SharedStore) {
    let (_, run) = queued(&store).await;
    assert_eq!(run.worker, None, "never claimed");
    store.claim_runs("w1", at(10), at(70), false, 1).await.expect("claim");
    assert_eq!(get_run(&store, &run.id).await.worker.as_deref(), Some("w1"));

    assert!(!store.renew_lease(&run.id, "w2", at(100)).await.expect("renew"));
    assert!(store.renew_lease(&run.id, "w1", at(100)).await.expect("renew"));
    assert_eq!(get_run(&store, &run.id).await.lease_expires_at, Some(at(100)));
    assert!(store.claim_runs("w2", at(80), at(140), false, 10).await.expect("claim").is_empty(), "renewed");

    // a commit that leaves the status as it is leaves the lease as it is (the renewer keeps it)
    let mut c = Commit::new(run.id.clone(), lease("w1", at(500)), at(20));
    c.events = vec![EventKind::NodeStarted { node: "model".into() }];
    commit_ok(&store, c).await;
    let after = get_run(&store, &run.id).await;
    assert_eq!((after.status, after.lease_owner.as_deref()), (RunStatus::Running, Some("w1")));
    assert_eq!(after.lease_expires_at, Some(at(100)), "not moved by a commit without a status change");
    // and another owner's commit is still refused
    assert_conflict(store.commit(Commit::new(run.id.clone(), lease("w2", at(500)), at(21))).await);

    store.release_lease(&run.id, "w2").await.expect("release by another");
    assert_eq!(get_run(&store, &run.id).await.lease_owner.as_deref(), Some("w1"));
    store.release_lease(&run.id, "w1").await.expect("release");
    let released = get_run(&store, &run.id).await;
    assert_eq!((released.status, released.lease_owner, released.lease_expires_at), (RunStatus::Running, None, None));
    assert_eq!(released.worker.as_deref(), Some("w1"), "the worker is who held it last");
    assert!(!store.renew_lease(&run.id, "w1", at(120)).await.expect("renew"), "released");

    // a released run is claimable at once; the worker is the instance of the owner token
    let claimed = store.claim_runs("b:claim-2", at(81), at(141), false, 10).await.expect("claim");
    assert_eq!(claimed.iter().map(|r| &r.id).collect::<Vec<_>>(), vec![&run.id]);
    assert_eq!(claimed[0].worker.as_deref(), Some("b"));

    let mut c = Commit::new(run.id.clone(), lease("b:claim-2", at(141)), at(82));
    c.run = to(RunStatus::Completed);
    commit_ok(&store, c).await;
    assert!(!store.renew_lease(&run.id, "b:claim-2", at(200)).await.expect("renew"), "finished");
    let finished = get_run(&store, &run.id).await;
    assert_eq!((finished.lease_owner, finished.worker.as_deref()), (None, Some("b")), "kept after the end");

    // a commit that acquires the run names its worker too
    let (_, run) = running(&store, "host-a:1:token").await;
    assert_eq!(run.worker.as_deref(), Some("host-a:1"), "up to the token's last colon");
}

pub async fn last_sequences_of_many_runs_in_one_read(store: SharedStore) {
    assert!(store.last_sequences(&[]).await.expect("none").is_empty());
    let (_, a) = running(&store, "w1").await;
    let (_, b) = queued(&store).await;
    commit_ok(&store, Commit::new(a.id.clone(), lease("w1", at(60)), at(5)).event(node("x")).event(node("y"))).await;
    let unknown = RunId::new();
    let mut got = store.last_sequences(&[a.id.clone(), unknown, b.id.clone()]).await.expect("read");
    got.sort();
    let mut want = vec![
        (a.id.clone(), get_run(&store, &a.id).await.last_sequence()),
        (b.id.clone(), get_run(&store, &b.id).await.last_sequence()),
    ];
    want.sort();
    assert_eq!(got, want, "the known runs, each with its last sequence");
    assert_eq!(got.iter().find(|(id, _)| *id == a.id).map(|(_, s)| *s), Some(a.last_sequence() + 2));
}

pub async fn cancel_request_is_seen_by_the_next_commit(store: SharedStore) {
    let (_, run) = running(&store, "w1").await;
    let committed = commit_ok(&store, Commit::new(run.id.clone(), lease("w1", at(60)), at(5)).event(node("a"))).await;
    assert!(!committed.cancel_requested);

    let flagged = store.request_cancel(&run.id, at(6), false).await.expect("cancel");
    assert!(flagged.cancel_requested);
    assert_eq!(flagged.status, RunStatus::Running, "the worker cancels, not the request");
    assert_eq!(get_run(&store, &run.id).await, flagged);
    let committed = commit_ok(&store, Commit::new(run.id.clone(), lease("w1", at(60)), at(7)).event(node("b"))).await;
    assert!(committed.cancel_requested);

    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(8));
    c.run = to(RunStatus::Cancelled);
    c.events.push(EventKind::Cancelled { reason: "user".into() });
    assert!(commit_ok(&store, c).await.cancel_requested);

    // a queued run is flagged too; a missing one is not found
    let (_, waiting) = queued(&store).await;
    assert!(store.request_cancel(&waiting.id, at(9), false).await.expect("cancel").cancel_requested);
    let missing = store.request_cancel(&RunId::new(), at(9), false).await;
    assert!(matches!(missing, Err(StoreError::NotFound("run"))), "{missing:?}");

    // a finished run is returned as it is
    let (_, done) = running(&store, "w1").await;
    let mut c = Commit::new(done.id.clone(), lease("w1", at(60)), at(10));
    c.run = to(RunStatus::Completed);
    commit_ok(&store, c).await;
    let finished = store.request_cancel(&done.id, at(11), false).await.expect("cancel");
    assert_eq!((finished.status, finished.cancel_requested), (RunStatus::Completed, false));
}

/// The answer stored under an idempotency key commits with the changes it reports, or not at all;
/// it takes a free key, completes the same request's in-flight one, and is refused by an answer
/// stored already.
pub async fn an_answer_commits_with_the_change_it_reports(store: SharedStore) {
    let (_, run) = running(&store, "w").await;
    // an answer is kept 1,000 after its commit
    let answer = |key: &str, hash: &str, now: i64| IdempotencyAnswer {
        user_id: "alice".into(),
        key: key.into(),
        request_hash: hash.into(),
        status: 200,
        response: json!({"ok": key, "hash": hash}),
        expires_at: at(now + 1000),
    };
    let commit = |now: i64, key: &str, hash: &str| {
        let mut c = Commit::new(run.id.clone(), lease("w", at(5000)), at(now)).event(node("x"));
        c.idempotency = Some(answer(key, hash, now));
        c
    };
    let find = |key: &'static str, hash: &'static str, now: i64| {
        let store = store.clone();
        async move { store.idempotency_find("alice", key, hash, at(now)).await.expect("find") }
    };
    assert_eq!(find("k", "h", 1).await, None);

    // A free key: taken, with its answer, in the same transaction as the event.
    let before = sequences(&store, &run.id).await;
    commit_ok(&store, commit(1, "k", "h")).await;
    assert_eq!(sequences(&store, &run.id).await.len(), before.len() + 1);
    let done = IdempotencyBegin::Done { status: 200, response: json!({"ok": "k", "hash": "h"}) };
    assert_eq!(find("k", "h", 2).await, Some(done.clone()));
    assert_eq!(find("k", "other", 2).await, Some(IdempotencyBegin::Mismatch));
    // keys are per user
    assert_eq!(store.idempotency_find("bob", "k", "h", at(2)).await.expect("find"), None);

    // A key holding an answer, the same request's or another's: the whole commit is refused, its
    // event too, and the answer stays.
    let before = sequences(&store, &run.id).await;
    assert_conflict(store.commit(commit(3, "k", "h")).await);
    assert_conflict(store.commit(commit(3, "k", "other")).await);
    assert_eq!(sequences(&store, &run.id).await, before);
    assert_eq!(find("k", "h", 4).await, Some(done));

    // The same request's in-flight key is completed; another request's is not.
    assert_eq!(store.idempotency_begin("alice", "b", "h", at(5), at(30)).await.unwrap(), IdempotencyBegin::Started);
    assert_eq!(find("b", "h", 6).await, Some(IdempotencyBegin::InFlight));
    assert_conflict(store.commit(commit(6, "b", "other")).await);
    commit_ok(&store, commit(7, "b", "h")).await;
    // Answered keys keep the answer's expiry (1007), not the in-flight one (30).
    assert_eq!(
        find("b", "h", 31).await,
        Some(IdempotencyBegin::Done { status: 200, response: json!({"ok": "b", "hash": "h"}) })
    );

    // An expired key (taken at 1, kept until 1001) is free again: found as nothing, and taken by
    // the next answer.
    assert!(find("k", "h", 1000).await.is_some());
    assert_eq!(find("k", "h", 1001).await, None);
    commit_ok(&store, commit(1001, "k", "later")).await;
    assert_eq!(find("k", "h", 1002).await, Some(IdempotencyBegin::Mismatch));
    let later = IdempotencyBegin::Done { status: 200, response: json!({"ok": "k", "hash": "later"}) };
    assert_eq!(find("k", "later", 1002).await, Some(later));
}

pub async fn idempotency_keys(store: SharedStore) {
    let begin = |user: &'static str, key: &'static str, hash: &'static str, now: i64| {
        let store = store.clone();
        async move { store.idempotency_begin(user, key, hash, at(now), at(now + 100)).await.expect("begin") }
    };
    assert_eq!(begin("alice", "k1", "h1", 0).await, IdempotencyBegin::Started);
    assert_eq!(begin("alice", "k1", "h1", 1).await, IdempotencyBegin::InFlight);
    assert_eq!(begin("alice", "k1", "h2", 1).await, IdempotencyBegin::Mismatch);
    // keys are per user
    assert_eq!(begin("bob", "k1", "h2", 1).await, IdempotencyBegin::Started);

    let response = json!({"runId": "run_1", "status": "running"});
    store.idempotency_complete("alice", "k1", 202, &response).await.expect("complete");
    assert_eq!(begin("alice", "k1", "h1", 2).await, IdempotencyBegin::Done { status: 202, response: response.clone() });
    assert_eq!(begin("alice", "k1", "h2", 2).await, IdempotencyBegin::Mismatch);

    // abandoning forgets an in-flight key, never an answered one
    store.idempotency_abandon("bob", "k1").await.expect("abandon");
    assert_eq!(begin("bob", "k1", "h3", 3).await, IdempotencyBegin::Started);
    store.idempotency_abandon("alice", "k1").await.expect("abandon");
    assert_eq!(begin("alice", "k1", "h1", 4).await, IdempotencyBegin::Done { status: 202, response });

    // an expired key starts afresh, whatever it held (the first one expires at 100)
    assert_eq!(begin("alice", "k1", "h9", 100).await, IdempotencyBegin::Started);
    assert_eq!(begin("alice", "k1", "h1", 101).await, IdempotencyBegin::Mismatch);
    assert_eq!(begin("alice", "k1", "h9", 101).await, IdempotencyBegin::InFlight);

    // A new process of an embedded store forgets in-flight keys, never answered ones.
    assert_eq!(begin("carol", "k1", "h1", 101).await, IdempotencyBegin::Started);
    store.idempotency_complete("carol", "k1", 200, &json!({"answered": true})).await.expect("complete");
    assert_eq!(begin("dave", "k1", "h1", 101).await, IdempotencyBegin::Started);
    // in flight now: alice's (h9), bob's (h3), dave's; carol's is answered
    assert_eq!(store.abandon_all_in_flight_keys().await.expect("abandon all"), 3);
    assert_eq!(begin("dave", "k1", "h1", 102).await, IdempotencyBegin::Started);
    assert_eq!(
        begin("carol", "k1", "h1", 102).await,
        IdempotencyBegin::Done { status: 200, response: json!({"answered": true}) }
    );

    let missing = store.idempotency_complete("alice", "never", 200, &json!({})).await;
    assert!(matches!(missing, Err(StoreError::NotFound(_))), "{missing:?}");
}

pub async fn asking_calls_lists_the_calls_waiting_for_a_human(store: SharedStore) {
    assert!(store.asking_calls("cancel_order").await.expect("asking").is_empty());
    let (_, first) = running(&store, "w1").await;
    let (_, second) = running(&store, "w2").await;
    let later = tool_call(&second.id, "cancel_order", "ord-7", ToolCallState::Requested);
    let calls = [
        (&first, tool_call(&first.id, "cancel_order", "ord-2", ToolCallState::Asking), "w1"),
        (&first, tool_call(&first.id, "cancel_order", "ord-3", ToolCallState::Allowed), "w1"),
        (&first, tool_call(&first.id, "get_order", "ord-1", ToolCallState::Asking), "w1"),
        (&second, tool_call(&second.id, "cancel_order", "ord-2", ToolCallState::Asking), "w2"),
        (&second, later.clone(), "w2"),
    ];
    for (run, call, owner) in calls {
        let mut c = Commit::new(run.id.clone(), lease(owner, at(60)), at(5));
        c.tool_calls.push(ToolCallChange::Insert(call));
        commit_ok(&store, c).await;
    }
    let orders = |calls: Vec<ToolCall>| {
        let mut v: Vec<String> = calls.iter().map(|c| c.args["orderId"].as_str().unwrap().to_owned()).collect();
        v.sort();
        v
    };
    let asking = store.asking_calls("cancel_order").await.expect("asking");
    assert!(asking.iter().all(|c| c.state == ToolCallState::Asking && c.name == "cancel_order"));
    assert_eq!(orders(asking), vec!["ord-2", "ord-2"], "one per call, over runs");

    let mut c = Commit::new(second.id.clone(), lease("w2", at(60)), at(6));
    c.tool_calls.push(ToolCallChange::transition(&later.id, ToolCallState::Requested, ToolCallState::Asking));
    commit_ok(&store, c).await;
    assert_eq!(orders(store.asking_calls("cancel_order").await.expect("asking")), vec!["ord-2", "ord-2", "ord-7"]);
    assert_eq!(orders(store.asking_calls("get_order").await.expect("asking")), vec!["ord-1"]);
}

/// [`RunStore::due_work`] names a sweep exactly when the sweep's own read would find work: an
/// expired interrupt, a rollback left undone, a stranded waiting run, a run that needs a worker.
pub async fn due_work_names_the_sweeps_that_have_work(store: SharedStore) {
    let due = |now: i64| {
        let store = store.clone();
        async move { store.due_work(at(now)).await.expect("due work") }
    };
    let nothing = DueWork::default();
    let claimable = DueWork { claimable: true, ..nothing };
    assert_eq!(due(0).await, nothing, "an empty store");

    // a queued run without a lease needs a worker; a live lease keeps it, an expired one frees it
    let (conversation, run) = queued(&store).await;
    assert_eq!(due(1).await, claimable);
    let claimed = store.claim_runs("w1", at(1), at(60), false, 10).await.expect("claim");
    assert_eq!(claimed.len(), 1);
    assert_eq!(due(59).await, nothing, "a live lease");
    assert_eq!(due(60).await, claimable, "at the expiry instant the lease is gone");

    // a paused run waits for a human: due once its interrupt expires, not before
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(2));
    c.run = to(RunStatus::Interrupted);
    let pending = interrupt(&run.id, vec![], at(100));
    c.new_interrupts.push(pending.clone());
    commit_ok(&store, c).await;
    assert_eq!(due(99).await, nothing);
    assert_eq!(due(100).await, DueWork { expired_interrupts: true, ..nothing });
    assert_eq!(store.due_interrupts(at(100), 10).await.expect("due").len(), 1);

    // answered in time: nothing more; cancelled with its rollback asked for, the rollback is due
    let mut c = Commit::new(run.id.clone(), acquire("w2", RunStatus::Interrupted, at(160)), at(99));
    c.run = to(RunStatus::Running);
    c.interrupt_changes.push(resolve(&pending, "alice"));
    commit_ok(&store, c).await;
    assert_eq!(due(150).await, nothing);
    store.request_cancel(&run.id, at(150), true).await.expect("request cancel");
    assert_eq!(due(150).await, nothing, "not ended yet: no rollback due");
    let mut c = Commit::new(run.id.clone(), lease("w2", at(160)), at(151));
    c.run = to(RunStatus::Cancelled);
    commit_ok(&store, c).await;
    assert_eq!(due(152).await, DueWork { rollbacks: true, ..nothing });
    store.roll_back_run(&run.id, at(152)).await.expect("roll back");
    assert_eq!(due(153).await, nothing, "the rollback clears the intent");

    // a waiting run whose turn came while nobody started it is stranded; started, it needs a worker
    let first = start(&store, &conversation, at(154)).await;
    enqueue(&store, &conversation, "second", at(155)).await;
    assert_eq!(due(156).await, claimable, "the active run needs a worker; the waiting one waits");
    end_queued(&store, &first.run.id, at(157)).await;
    assert_eq!(due(158).await, DueWork { stranded: true, ..nothing });
    assert_eq!(store.stranded_conversations(10).await.expect("stranded"), vec![conversation.id.clone()]);
    let promoted = store
        .promote_waiting(&conversation.id, first_events(&conversation.id), None, at(158))
        .await
        .expect("promote")
        .expect("the waiting run starts");
    assert_eq!(due(159).await, claimable);
    end_queued(&store, &promoted.run.id, at(160)).await;
    assert_eq!(due(161).await, nothing);
}

pub async fn due_interrupts_are_pending_and_past_expiry(store: SharedStore) {
    let mut pending = Vec::new();
    for expires in [100, 200, 300] {
        let (_, run, interrupt) = interrupted(&store, at(expires)).await;
        pending.push((run, interrupt));
    }
    let due = |now: i64, limit: u32| {
        let store = store.clone();
        async move {
            let due = store.due_interrupts(at(now), limit).await.expect("due");
            assert!(due.iter().all(|i| i.status == InterruptStatus::Pending && i.expires_at <= at(now)));
            due.into_iter().map(|i| i.id).collect::<BTreeSet<_>>()
        }
    };
    let ids = |which: &[usize]| which.iter().map(|&i| pending[i].1.id.clone()).collect::<BTreeSet<_>>();
    assert!(due(99, 10).await.is_empty());
    assert_eq!(due(100, 10).await, ids(&[0]), "due at its expiry instant");
    assert_eq!(due(250, 10).await, ids(&[0, 1]));
    assert_eq!(due(1000, 2).await.len(), 2);

    // resolved in time: never due
    let (run, interrupt) = &pending[1];
    let mut c = Commit::new(run.id.clone(), acquire("w9", RunStatus::Interrupted, at(260)), at(199));
    c.run = to(RunStatus::Running);
    c.interrupt_changes.push(resolve(interrupt, "alice"));
    commit_ok(&store, c).await;
    assert_eq!(due(1000, 10).await, ids(&[0, 2]));
}

pub async fn conversation_tool_calls_span_runs(store: SharedStore) {
    let (conversation, first) = running(&store, "w1").await;
    let a = tool_call(&first.id, "list_orders", "ord-2", ToolCallState::Succeeded);
    let b = tool_call(&first.id, "find_late_orders", "ord-2", ToolCallState::Succeeded);
    let mut c = Commit::new(first.id.clone(), lease("w1", at(60)), at(5));
    c.tool_calls.push(ToolCallChange::Insert(a.clone()));
    c.tool_calls.push(ToolCallChange::Insert(b.clone()));
    c.run = to(RunStatus::Completed);
    commit_ok(&store, c).await;

    let second = start(&store, &conversation, at(6)).await.run;
    let d = tool_call(&second.id, "cancel_order", "ord-2", ToolCallState::Requested);
    let mut c = Commit::new(second.id.clone(), acquire("w2", RunStatus::Queued, at(60)), at(7));
    c.run = to(RunStatus::Running);
    c.tool_calls.push(ToolCallChange::Insert(d.clone()));
    commit_ok(&store, c).await;

    // a call handed to another run's commit is refused
    let mut c = Commit::new(second.id.clone(), lease("w2", at(60)), at(8));
    c.tool_calls.push(ToolCallChange::Insert(tool_call(&first.id, "get_order", "x", ToolCallState::Requested)));
    assert_conflict(store.commit(c).await);

    let listed = store.list_conversation_tool_calls(&conversation.id).await.expect("calls");
    assert_eq!(listed, vec![a.clone(), b.clone(), d.clone()]);
    assert_eq!(store.list_tool_calls(&first.id).await.expect("calls"), vec![a, b]);
    assert_eq!(store.list_tool_calls(&second.id).await.expect("calls"), vec![d]);
    let other = store.create_conversation("alice", &"other".into(), "ops", at(0)).await.expect("create");
    assert!(store.list_conversation_tool_calls(&other.id).await.expect("calls").is_empty());
}

fn message(run: &Run, role: Role, content: &str, call: Option<&CallId>, secs: i64) -> Message {
    Message {
        id: MessageId::new(),
        conversation_id: run.conversation_id.clone(),
        run_id: Some(run.id.clone()),
        role,
        content: content.into(),
        tool_call_id: call.cloned(),
        created_at: at(secs),
    }
}

/// A conversation of two turns: the first run (completed) read order ord-2 (call `a`, its result,
/// the answer, with `facts`); the second (running, `w2`'s) cancelled it (call `b`, its result).
struct TwoTurns {
    conversation: Conversation,
    first: Run,
    user_1: Message,
    a: ToolCall,
    result_a: Message,
    answer_1: Message,
    second: StartedRun,
    user_2: Message,
    b: ToolCall,
    result_b: Message,
}

async fn two_turns(store: &SharedStore, facts: Vec<Fact>) -> TwoTurns {
    let (conversation, first) = running(store, "w1").await;
    let user_1 = store.list_messages(&conversation.id).await.expect("messages").remove(0);
    let a = tool_call(&first.id, "get_order", "ord-2", ToolCallState::Succeeded);
    let result_a = message(&first, Role::Tool, "{\"status\":\"late\"}", Some(&a.id), 3);
    let answer_1 = message(&first, Role::Assistant, "ord-2 is late", None, 4);
    let mut c = Commit::new(first.id.clone(), lease("w1", at(60)), at(4));
    c.tool_calls.push(ToolCallChange::Insert(a.clone()));
    c.messages.extend([result_a.clone(), answer_1.clone()]);
    c.facts.extend(facts);
    c.run = to(RunStatus::Completed);
    commit_ok(store, c).await;

    let second = start(store, &conversation, at(5)).await;
    let user_2 = second.message.clone();
    let b = tool_call(&second.run.id, "cancel_order", "ord-2", ToolCallState::Succeeded);
    let result_b = message(&second.run, Role::Tool, "{\"cancelled\":true}", Some(&b.id), 7);
    let mut c = Commit::new(second.run.id.clone(), acquire("w2", RunStatus::Queued, at(60)), at(7));
    c.run = to(RunStatus::Running);
    c.tool_calls.push(ToolCallChange::Insert(b.clone()));
    c.messages.push(result_b.clone());
    commit_ok(store, c).await;
    TwoTurns { conversation, first, user_1, a, result_a, answer_1, second, user_2, b, result_b }
}

/// A call as the context window reads it: without its result (its tool message holds it).
fn without_result(call: &ToolCall) -> ToolCall {
    ToolCall { result: None, ..call.clone() }
}

/// A conversation's first run (the start made its version 1) finds nothing in its context but the
/// message it started with, exactly as the start answered it (the engine's first step uses that
/// answer instead of a read); the context read with a role reads the same window, and the role.
pub async fn a_first_runs_context_is_its_message(store: SharedStore) {
    let first = conversation(&store, "alice").await;
    // a time finer than the database keeps: the answer is the time as stored
    let now = at(5) + chrono::Duration::nanoseconds(123_456_789);
    let started = start(&store, &first, now).await;
    assert_eq!(started.run.checkpoint.conversation_version, 1);
    assert_eq!(started.user_role, Some(None), "the start read the user's role: none yet");
    let expected = ContextWindow { messages: vec![started.message.clone()], ..Default::default() };
    assert_eq!(store.context_window(&first.id).await.expect("window"), expected);
    let read = store.context_window_and_role(&first.id, "alice").await.expect("window and role");
    assert_eq!(read, (expected.clone(), None), "no role yet");
    store.set_user_role("alice", UserRole::Viewer).await.expect("role");
    let read = store.context_window_and_role(&first.id, "alice").await.expect("window and role");
    assert_eq!(read, (expected.clone(), Some(UserRole::Viewer)));
    let read = store.context_window_and_role(&first.id, "bob").await.expect("window and role");
    assert_eq!(read, (expected, None), "another user's role: none");

    // a start reads the role as it is then, whichever way it starts; a run that waits reads none
    let other = conversation(&store, "alice").await;
    assert_eq!(start(&store, &other, at(6)).await.user_role, Some(Some(UserRole::Viewer)));
    let third = conversation(&store, "alice").await;
    let at_once = enqueue(&store, &third, "nothing ahead", at(7)).await;
    assert_eq!((at_once.run.status, at_once.user_role), (RunStatus::Queued, Some(Some(UserRole::Viewer))));
    let waits = enqueue(&store, &third, "behind it", at(8)).await;
    assert_eq!((waits.run.status, waits.user_role), (RunStatus::Waiting, None));
}

/// The context's read: every message while there is no summary; once there is one, only the
/// messages after the last it covers and the calls those answer; the facts either way. And the
/// two other bounded message reads: a conversation's latest messages, a run's messages.
pub async fn the_context_window_starts_after_the_summary(store: SharedStore) {
    let facts = vec![
        fact("order", "ord-2", FactSource::ToolResult, at(4)),
        fact("customer", "cus-7", FactSource::UserConfirmed, at(4)),
    ];
    let TwoTurns { conversation, first, user_1, a, result_a, answer_1, second, user_2, b, result_b } =
        two_turns(&store, facts).await;

    let window = store.context_window(&conversation.id).await.expect("window");
    assert_eq!(window.summary, None);
    assert_eq!(
        window.messages,
        vec![user_1.clone(), result_a.clone(), answer_1.clone(), user_2.clone(), result_b.clone()],
        "no summary: every message"
    );
    assert_eq!(window.tool_calls, vec![without_result(&a), without_result(&b)], "the calls, not their results");
    let facts = vec![
        fact("customer", "cus-7", FactSource::UserConfirmed, at(4)),
        fact("order", "ord-2", FactSource::ToolResult, at(4)),
    ];
    assert_eq!(window.facts, facts, "by key");

    // a summary through the first turn: the window starts after it
    let summary = Summary {
        conversation_id: conversation.id.clone(),
        through_message_id: answer_1.id.clone(),
        text: "ord-2 was late".into(),
    };
    let mut c = Commit::new(second.run.id.clone(), lease("w2", at(60)), at(8));
    c.summary = Some(summary.clone());
    commit_ok(&store, c).await;
    let window = store.context_window(&conversation.id).await.expect("window");
    assert_eq!(window.summary, Some(summary));
    assert_eq!(window.messages, vec![user_2.clone(), result_b.clone()]);
    assert_eq!(window.tool_calls, vec![without_result(&b)], "only the calls the window's results answer");
    assert_eq!(window.facts, facts);

    // the latest messages that are not tool results, in order; a run's own messages
    let recent = store.recent_messages(&conversation.id, 2).await.expect("recent");
    assert_eq!(recent, vec![answer_1.clone(), user_2.clone()]);
    assert_eq!(store.recent_messages(&conversation.id, 100).await.expect("recent").len(), 3);
    assert_eq!(store.list_run_messages(&first.id).await.expect("run messages"), vec![user_1, result_a, answer_1]);
    assert_eq!(store.list_run_messages(&second.run.id).await.expect("run messages"), vec![user_2, result_b]);

    // another conversation's window is empty
    let other = store.create_conversation("alice", &"other".into(), "ops", at(0)).await.expect("create");
    assert_eq!(store.context_window(&other.id).await.expect("window"), ContextWindow::default());
    assert!(store.recent_messages(&other.id, 10).await.expect("recent").is_empty());
}

/// The calls a window's tool results answer come in the order they were made, whatever the order
/// of their results (calls run side by side finish in any order).
pub async fn the_calls_a_window_answers_come_in_the_order_they_were_made(store: SharedStore) {
    let conversation = conversation(&store, "alice").await;
    let run = start(&store, &conversation, at(1)).await.run;
    // made (and written) in the reverse of their ids' order, which is the order ids are minted in
    let mut calls: Vec<ToolCall> = (0..5)
        .map(|i| ToolCall {
            result: Some(Masked::new(json!({"order": format!("ord-{i}"), "status": "late"}))),
            ..tool_call(&run.id, "get_order", &format!("ord-{i}"), ToolCallState::Succeeded)
        })
        .collect();
    calls.reverse();
    let mut c = Commit::new(run.id.clone(), acquire("w1", RunStatus::Queued, at(60)), at(2));
    c.run = to(RunStatus::Running);
    c.tool_calls.extend(calls.iter().cloned().map(ToolCallChange::Insert));
    commit_ok(&store, c).await;
    // their results in another order still
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(3));
    for (i, call) in calls.iter().cycle().skip(2).take(calls.len()).enumerate() {
        c.messages.push(message(&run, Role::Tool, "{}", Some(&call.id), 3 + i as i64));
    }
    commit_ok(&store, c).await;

    let window = store.context_window(&conversation.id).await.expect("window");
    assert_eq!(window.messages.len(), 6, "the user's message and the five results");
    assert_eq!(
        window.tool_calls,
        calls.iter().map(without_result).collect::<Vec<_>>(),
        "the calls, in order, without their results (their tool messages hold them)"
    );
    let through = store.messages_through_run(&conversation.id, &run.id, 100).await.expect("through");
    assert_eq!(through.tool_calls, calls, "a thread's state has the results");
}

/// A thread's state after a run: the newest messages up to that run's last one, newest first, with
/// the calls their results answer; later runs' messages are not in it; bounded by `limit`.
pub async fn messages_through_a_run_are_the_conversation_as_it_stood(store: SharedStore) {
    let TwoTurns { conversation, first, user_1, a, result_a, answer_1, second, user_2, b, result_b } =
        two_turns(&store, Vec::new()).await;

    let through_first = store.messages_through_run(&conversation.id, &first.id, 100).await.expect("through");
    assert_eq!(through_first.messages, vec![answer_1.clone(), result_a.clone(), user_1.clone()]);
    assert_eq!(through_first.tool_calls, vec![a.clone()], "not the next run's calls");
    let through_second = store.messages_through_run(&conversation.id, &second.run.id, 100).await.expect("through");
    assert_eq!(
        through_second.messages,
        vec![result_b.clone(), user_2.clone(), answer_1.clone(), result_a.clone(), user_1.clone()]
    );
    assert_eq!(through_second.tool_calls, vec![a.clone(), b.clone()]);

    // bounded: the newest `limit`, and only the calls their results answer
    let two = store.messages_through_run(&conversation.id, &second.run.id, 2).await.expect("through");
    assert_eq!(two.messages, vec![result_b, user_2]);
    assert_eq!(two.tool_calls, vec![b]);
    let one = store.messages_through_run(&conversation.id, &first.id, 1).await.expect("through");
    assert_eq!(one.messages, vec![answer_1]);
    assert!(one.tool_calls.is_empty());

    // a run that wrote nothing, another conversation: empty
    let waiting = enqueue(&store, &conversation, "later", at(8)).await.run;
    assert_eq!(
        store.messages_through_run(&conversation.id, &waiting.id, 10).await.expect("through"),
        MessagesThrough::default()
    );
    let other = store.create_conversation("alice", &"other".into(), "ops", at(0)).await.expect("create");
    assert_eq!(
        store.messages_through_run(&other.id, &first.id, 10).await.expect("through"),
        MessagesThrough::default()
    );
}

pub async fn user_roles(store: SharedStore) {
    assert_eq!(store.user_role("alice").await.expect("role"), None);
    store.set_user_role("alice", UserRole::Viewer).await.expect("set");
    assert_eq!(store.user_role("alice").await.expect("role"), Some(UserRole::Viewer));
    store.set_user_role("alice", UserRole::Operator).await.expect("set");
    assert_eq!(store.user_role("alice").await.expect("role"), Some(UserRole::Operator));
    assert_eq!(store.user_role("bob").await.expect("role"), None);
}

fn api_key(id: &str, user: &str, hash: &str) -> ApiKey {
    ApiKey { id: id.into(), user_id: user.into(), key_hash: hash.into(), created_at: at(0), revoked_at: None }
}

pub async fn api_keys_map_hashes_to_users_until_revoked(store: SharedStore) {
    assert_eq!(store.count_active_api_keys().await.expect("count"), 0);
    // a key needs a user
    match store.insert_api_key(&api_key("key_0", "nobody", "h0")).await {
        Err(StoreError::NotFound("user")) => {}
        other => panic!("a key for an unknown user: {other:?}"),
    }
    store.set_user_role("alice", UserRole::Operator).await.expect("role");
    store.set_user_role("bob", UserRole::Viewer).await.expect("role");
    store.insert_api_key(&api_key("key_1", "alice", "h1")).await.expect("key");
    store.insert_api_key(&api_key("key_2", "alice", "h2")).await.expect("key");
    store.insert_api_key(&api_key("key_3", "bob", "h3")).await.expect("key");
    match store.insert_api_key(&api_key("key_4", "bob", "h1")).await {
        Err(StoreError::Duplicate(_)) => {}
        other => panic!("a reused hash: {other:?}"),
    }
    assert_eq!(store.api_key_user("h1").await.expect("get").as_deref(), Some("alice"));
    assert_eq!(store.api_key_user("h3").await.expect("get").as_deref(), Some("bob"));
    assert_eq!(store.api_key_user("h9").await.expect("get"), None);
    assert_eq!(store.count_active_api_keys().await.expect("count"), 3);
    assert_eq!(
        store.list_users().await.expect("users"),
        vec![
            User { id: "alice".into(), role: UserRole::Operator, active_keys: 2 },
            User { id: "bob".into(), role: UserRole::Viewer, active_keys: 1 },
        ]
    );

    assert_eq!(store.revoke_api_keys("alice", at(10)).await.expect("revoke"), 2);
    assert_eq!(store.revoke_api_keys("alice", at(11)).await.expect("revoke again"), 0);
    assert_eq!(store.api_key_user("h1").await.expect("get"), None);
    assert_eq!(store.api_key_user("h2").await.expect("get"), None);
    assert_eq!(store.api_key_user("h3").await.expect("get").as_deref(), Some("bob"));
    assert_eq!(store.count_active_api_keys().await.expect("count"), 1);
}

pub async fn stream_tickets_are_redeemed_once_before_expiry(store: SharedStore) {
    let run = RunId::new();
    let ticket = |hash: &str, expires: i64| StreamTicket {
        ticket_hash: hash.into(),
        user_id: "alice".into(),
        scope: TicketScope::RunEvents,
        run_id: Some(run.clone()),
        expires_at: at(expires),
        used_at: None,
    };
    store.insert_stream_ticket(&ticket("t1", 60), at(0)).await.expect("ticket");
    store.insert_stream_ticket(&ticket("t2", 60), at(0)).await.expect("ticket");
    store
        .insert_stream_ticket(&StreamTicket { scope: TicketScope::WebSocket, run_id: None, ..ticket("t3", 60) }, at(0))
        .await
        .expect("ticket");
    match store.insert_stream_ticket(&ticket("t1", 60), at(0)).await {
        Err(StoreError::Duplicate(_)) => {}
        other => panic!("a reused ticket: {other:?}"),
    }

    // exactly one of many concurrent uses wins
    let mut uses = Vec::new();
    for _ in 0..16 {
        let store = store.clone();
        uses.push(tokio::spawn(async move { store.redeem_stream_ticket("t1", at(1)).await }));
    }
    let mut won = Vec::new();
    for u in uses {
        if let Some(t) = u.await.expect("join").expect("redeem") {
            won.push(t);
        }
    }
    assert_eq!(won.len(), 1, "one use of a single-use ticket");
    assert_eq!(won[0].user_id, "alice");
    assert_eq!(won[0].scope, TicketScope::RunEvents);
    assert_eq!(won[0].run_id.as_ref(), Some(&run));
    assert_eq!(won[0].used_at, Some(at(1)));

    // expired: refused (at the expiry instant too)
    assert_eq!(store.redeem_stream_ticket("t2", at(60)).await.expect("redeem"), None);
    assert_eq!(store.redeem_stream_ticket("nope", at(1)).await.expect("redeem"), None);
    let ws = store.redeem_stream_ticket("t3", at(59)).await.expect("redeem").expect("a websocket ticket");
    assert_eq!((ws.scope, ws.run_id), (TicketScope::WebSocket, None));

    // tickets long expired are forgotten when a new one is stored
    store.insert_stream_ticket(&ticket("t4", 10_000), at(5_000)).await.expect("ticket");
    store.insert_stream_ticket(&ticket("t2", 20_000), at(5_000)).await.expect("t2's hash is free again");
}

// --- run history

pub async fn runs_are_listed_per_user_newest_first(store: SharedStore) {
    let mut alices = Vec::new();
    for secs in [10, 30, 20] {
        let conversation =
            store.create_conversation("alice", &format!("t{secs}").into(), "ops", at(secs)).await.expect("create");
        alices.push(start(&store, &conversation, at(secs)).await.run);
    }
    let bobs = conversation(&store, "bob").await;
    let bob_run = start(&store, &bobs, at(40)).await.run;
    // the run of t20 is cancelled
    let mut c = Commit::new(alices[2].id.clone(), Fence::Unowned { from: vec![RunStatus::Queued] }, at(50));
    c.run = Some(RunChange { to: RunStatus::Cancelled, reason: Some("user".into()), via: None });
    commit_ok(&store, c).await;

    let ids = |runs: Vec<Run>| runs.into_iter().map(|r| r.id).collect::<Vec<_>>();
    let listed = store.list_runs("alice", None, 10).await.expect("list");
    assert!(listed.iter().all(|r| r.user_id == "alice"));
    assert_eq!(ids(listed), vec![alices[1].id.clone(), alices[2].id.clone(), alices[0].id.clone()]);
    assert_eq!(
        ids(store.list_runs("alice", None, 2).await.expect("list")),
        vec![alices[1].id.clone(), alices[2].id.clone()]
    );
    assert_eq!(
        ids(store.list_runs("alice", Some(RunStatus::Queued), 10).await.expect("list")),
        vec![alices[1].id.clone(), alices[0].id.clone()]
    );
    let cancelled = store.list_runs("alice", Some(RunStatus::Cancelled), 10).await.expect("list");
    assert_eq!(cancelled.len(), 1);
    assert_eq!(cancelled[0].id, alices[2].id);
    assert_eq!(cancelled[0].reason.as_deref(), Some("user"));
    assert!(store.list_runs("alice", Some(RunStatus::Completed), 10).await.expect("list").is_empty());
    assert_eq!(ids(store.list_runs("bob", None, 10).await.expect("list")), vec![bob_run.id]);
    assert!(store.list_runs("carol", None, 10).await.expect("list").is_empty());
}

pub async fn interrupts_of_a_run_are_listed_with_their_history(store: SharedStore) {
    let (_, run, first) = interrupted(&store, at(300)).await;
    let (_, other_run, other) = interrupted(&store, at(300)).await;

    // alice approves the first; the run pauses again on a second one
    let mut c = Commit::new(run.id.clone(), acquire("w2", RunStatus::Interrupted, at(400)), at(7));
    c.run = to(RunStatus::Running);
    c.interrupt_changes.push(resolve(&first, "alice"));
    c.events.push(resumed(&first, "alice"));
    commit_ok(&store, c).await;
    let second = Interrupt { created_at: at(8), ..interrupt(&run.id, vec![], at(500)) };
    let mut c = Commit::new(run.id.clone(), lease("w2", at(400)), at(8));
    c.run = to(RunStatus::Interrupted);
    c.new_interrupts.push(second.clone());
    commit_ok(&store, c).await;

    let listed = store.list_interrupts(&run.id).await.expect("list");
    assert_eq!(listed.iter().map(|i| i.id.clone()).collect::<Vec<_>>(), vec![first.id.clone(), second.id.clone()]);
    assert_eq!(listed[0].status, InterruptStatus::Resolved);
    assert_eq!(listed[0].decision, Some(json!("approve").into()));
    assert_eq!(listed[0].resolved_by.as_deref(), Some("alice"));
    assert_eq!(listed[0].resolved_at, Some(at(7)));
    assert_eq!(listed[1], second);
    assert_eq!(store.list_interrupts(&other_run.id).await.expect("list"), vec![other]);
    assert!(store.list_interrupts(&RunId::new()).await.expect("list").is_empty());
}

/// A client-chosen id is bound once: the first value wins, per namespace and scope.
pub async fn bindings_keep_the_first_value(store: SharedStore) {
    assert_eq!(store.binding("ag_ui.thread", "alice", "thread-1").await.expect("get"), None);
    assert_eq!(store.bind("ag_ui.thread", "alice", "thread-1", "conv_a", at(1)).await.expect("bind"), "conv_a");
    // the first binding wins; a second one answers with it
    assert_eq!(store.bind("ag_ui.thread", "alice", "thread-1", "conv_b", at(2)).await.expect("bind"), "conv_a");
    assert_eq!(store.binding("ag_ui.thread", "alice", "thread-1").await.expect("get"), Some("conv_a".into()));
    // per scope and per namespace
    assert_eq!(store.binding("ag_ui.thread", "bob", "thread-1").await.expect("get"), None);
    assert_eq!(store.binding("ag_ui.message", "alice", "thread-1").await.expect("get"), None);
    assert_eq!(store.bind("ag_ui.message", "alice", "thread-1", "msg_1", at(3)).await.expect("bind"), "msg_1");
    // concurrent binds: one value, the same for every caller
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move { store.bind("race", "s", "x", &format!("v{i}"), at(4)).await.expect("bind") })
        })
        .collect();
    let mut seen = BTreeSet::new();
    for t in tasks {
        seen.insert(t.await.expect("task"));
    }
    assert_eq!(seen.len(), 1, "{seen:?}");
}

/// A conversation keeps the agent it was made with, and its runs carry it.
pub async fn conversations_and_runs_keep_their_agent(store: SharedStore) {
    let ops = store.create_conversation("alice", &"a".into(), "ops", at(0)).await.expect("create");
    let billing = store.create_conversation("alice", &"b".into(), "billing", at(0)).await.expect("create");
    assert_eq!(ops.agent_id.as_deref(), Some("ops"));
    let read = store.get_conversation(&billing.id).await.expect("get").expect("exists");
    assert_eq!(read.agent_id.as_deref(), Some("billing"));
    let listed = store.list_conversations("alice", 10).await.expect("list");
    assert!(listed.iter().any(|c| c.id == billing.id && c.agent_id.as_deref() == Some("billing")));
    let started = start(&store, &billing, at(1)).await;
    assert_eq!(started.run.agent_id.as_deref(), Some("billing"));
    assert_eq!(get_run(&store, &started.run.id).await.agent_id.as_deref(), Some("billing"));
}

/// A run of a new conversation with `agent` that ran and ended `completed` at `at(ended)`, with
/// `steps` node events after its first two.
async fn finished(store: &SharedStore, agent: &str, ended: i64, steps: usize) -> Run {
    let conversation = store.create_conversation("alice", &"done".into(), agent, at(0)).await.expect("create");
    let run = start(store, &conversation, at(1)).await.run;
    let mut c = Commit::new(run.id.clone(), acquire("w1", RunStatus::Queued, at(ended + 60)), at(2));
    c.run = to(RunStatus::Running);
    for _ in 0..steps {
        c.events.push(node("call_model"));
    }
    commit_ok(store, c).await;
    let mut c = Commit::new(run.id.clone(), lease("w1", at(ended + 60)), at(ended));
    c.run = to(RunStatus::Completed);
    commit_ok(store, c).await;
    get_run(store, &run.id).await
}

fn rule(before: i64, agent: Option<&str>, except: &[&str]) -> PruneRule {
    PruneRule {
        finished_before: at(before),
        finished_after: None,
        agent: agent.map(str::to_owned),
        except_agents: except.iter().map(|a| (*a).to_owned()).collect(),
    }
}

pub async fn retention_prunes_the_events_of_finished_runs_only(store: SharedStore) {
    let done = finished(&store, "ops", 10, 3).await;
    assert_eq!(done.last_sequence(), 5);
    let (_, queued_run) = queued(&store).await;
    let (_, running_run) = running(&store, "w2").await;
    let (_, paused, pending) = interrupted(&store, at(1_000)).await;
    let held = |run: &Run| run.last_sequence();
    let before: Vec<usize> =
        [&queued_run, &running_run, &paused].iter().map(|r| usize::try_from(held(r)).expect("a sequence")).collect();

    // Ended after the cutoff: nothing.
    assert_eq!(store.prune_events(&rule(10, None, &[]), 100, false).await.expect("prune"), Pruned::default());
    // The dry run counts and deletes nothing.
    let dry = store.prune_events(&rule(11, None, &[]), 100, true).await.expect("dry run");
    assert_eq!(dry, Pruned { runs: 1, events: 5 });
    assert_eq!(events(&store, &done.id).await.len(), 5);
    assert_eq!(store.first_held_sequence(&done.id).await.expect("read"), None, "nothing pruned yet");

    let pruned = store.prune_events(&rule(11, None, &[]), 100, false).await.expect("prune");
    assert_eq!(pruned, Pruned { runs: 1, events: 5 });
    assert!(events(&store, &done.id).await.is_empty());
    assert_eq!(store.first_held_sequence(&done.id).await.expect("read"), Some(6), "its next sequence: none held");
    // The run, its message and its conversation stay.
    let kept = get_run(&store, &done.id).await;
    assert_eq!((kept.status, kept.last_sequence()), (RunStatus::Completed, 5));
    assert_eq!(store.list_run_messages(&done.id).await.expect("messages").len(), 1);
    // Queued, running and interrupted runs are whole, and so is the interrupt.
    for (run, count) in [&queued_run, &running_run, &paused].iter().zip(before) {
        assert_eq!(events(&store, &run.id).await.len(), count, "{:?} kept its events", run.status);
        assert_eq!(store.first_held_sequence(&run.id).await.expect("read"), None);
    }
    assert_eq!(store.list_interrupts(&paused.id).await.expect("interrupts")[0].id, pending.id);
    // Nothing left to prune.
    assert_eq!(store.prune_events(&rule(11, None, &[]), 100, true).await.expect("dry run"), Pruned::default());
    assert_eq!(store.prune_events(&rule(11, None, &[]), 100, false).await.expect("prune"), Pruned::default());
}

pub async fn retention_rules_are_per_agent_and_bounded(store: SharedStore) {
    let ops = finished(&store, "ops", 10, 6).await;
    let billing = finished(&store, "billing", 10, 1).await;
    // The global rule leaves out the agents with a rule of their own.
    let global = rule(100, None, &["billing"]);
    assert_eq!(store.prune_events(&global, 1_000, true).await.expect("dry run"), Pruned { runs: 1, events: 8 });
    // Bounded: three rows a batch, the oldest events first, what is held one contiguous range.
    assert_eq!(store.prune_events(&global, 3, false).await.expect("prune"), Pruned { runs: 1, events: 3 });
    assert_eq!(store.first_held_sequence(&ops.id).await.expect("read"), Some(4));
    assert_eq!(sequences(&store, &ops.id).await, [4, 5, 6, 7, 8]);
    assert_eq!(store.list_events(&ops.id, 0, 2).await.expect("list")[0].sequence, 4);
    assert_eq!(store.prune_events(&global, 3, false).await.expect("prune"), Pruned { runs: 1, events: 3 });
    assert_eq!(store.prune_events(&global, 3, false).await.expect("prune"), Pruned { runs: 1, events: 2 });
    assert_eq!(store.first_held_sequence(&ops.id).await.expect("read"), Some(9));
    assert_eq!(store.prune_events(&global, 3, false).await.expect("prune"), Pruned::default());
    assert_eq!(events(&store, &billing.id).await.len(), 3, "billing has its own rule");
    // billing's own rule: a shorter or longer duration, its runs only.
    assert_eq!(store.prune_events(&rule(5, Some("billing"), &[]), 100, false).await.expect("prune"), Pruned::default());
    let pruned = store.prune_events(&rule(100, Some("billing"), &[]), 100, false).await.expect("prune");
    assert_eq!(pruned, Pruned { runs: 1, events: 3 });
    assert_eq!(store.first_held_sequence(&billing.id).await.expect("read"), Some(4));
    // A lower bound leaves out the runs that ended before it.
    let late = finished(&store, "ops", 50, 0).await;
    let bounded = PruneRule { finished_after: Some(at(40)), ..rule(100, None, &["billing"]) };
    assert_eq!(store.prune_events(&bounded, 100, true).await.expect("dry run"), Pruned { runs: 1, events: 2 });
    let early = finished(&store, "ops", 30, 0).await;
    assert_eq!(store.prune_events(&bounded, 100, false).await.expect("prune"), Pruned { runs: 1, events: 2 });
    assert_eq!(store.first_held_sequence(&late.id).await.expect("read"), Some(3));
    assert_eq!(events(&store, &early.id).await.len(), 2, "ended before the bound");
}

pub async fn exports_find_conversations_and_their_runs(store: SharedStore) {
    let first = finished(&store, "ops", 10, 0).await;
    let bob = store.create_conversation("bob", &"bob's".into(), "ops", at(0)).await.expect("create");
    let second = start(&store, &store.get_conversation(&first.conversation_id).await.unwrap().unwrap(), at(20)).await;
    let runs = store.list_conversation_runs(&first.conversation_id).await.expect("runs");
    assert_eq!(runs.iter().map(|r| r.id.clone()).collect::<Vec<_>>(), [first.id.clone(), second.run.id.clone()]);
    let newest = store.newest_conversation_runs(&first.conversation_id, 1).await.expect("newest");
    assert_eq!(newest.len(), 1);
    assert_eq!(newest[0].id, second.run.id);
    let newest = store.newest_conversation_runs(&first.conversation_id, 10).await.expect("newest");
    assert_eq!(newest.iter().map(|r| r.id.clone()).collect::<Vec<_>>(), [second.run.id.clone(), first.id.clone()]);
    assert!(store.newest_conversation_runs(&bob.id, 10).await.expect("newest").is_empty());
    let all = store.find_conversations(None, None).await.expect("find");
    assert_eq!(all.len(), 2);
    let alice = store.find_conversations(Some("alice"), None).await.expect("find");
    assert_eq!(alice.iter().map(|c| &c.id).collect::<Vec<_>>(), [&first.conversation_id]);
    assert!(store.find_conversations(Some("bob"), None).await.expect("find").iter().any(|c| c.id == bob.id));
    // Since: a conversation with a run that changed then or later.
    let recent = store.find_conversations(None, Some(at(15))).await.expect("find");
    assert_eq!(recent.iter().map(|c| &c.id).collect::<Vec<_>>(), [&first.conversation_id]);
    assert!(store.find_conversations(None, Some(at(100))).await.expect("find").is_empty());
}

// --- multitask: enqueue and rollback

/// A message for `conversation` that waits its turn when a run is not over (`enqueue`).
async fn enqueue(store: &SharedStore, conversation: &Conversation, content: &str, now: Timestamp) -> StartedRun {
    store
        .start_run(NewRun {
            conversation_id: conversation.id.clone(),
            agent_id: "ops".into(),
            user_id: conversation.user_id.clone(),
            content: content.into(),
            cancel_on_disconnect: false,
            now,
            events: first_events(&conversation.id),
            enqueue: Some(vec![EventKind::RunWaiting { conversation_id: conversation.id.clone() }]),
            lease: None,
        })
        .await
        .expect("enqueue a message")
}

/// Ends a queued run (cancelled, as nobody works on it).
async fn end_queued(store: &SharedStore, run_id: &RunId, now: Timestamp) -> keel_core::store::Committed {
    let mut c = Commit::new(run_id.clone(), Fence::Unowned { from: vec![RunStatus::Queued] }, now);
    c.run = to(RunStatus::Cancelled);
    c.events.push(EventKind::Cancelled { reason: "cancelled_by_user".into() });
    commit_ok(store, c).await
}

async fn contents(store: &SharedStore, conversation_id: &ConversationId) -> Vec<String> {
    let messages = store.list_messages(conversation_id).await.expect("messages");
    messages.iter().map(|m| m.content.as_str().to_owned()).collect()
}

/// Enqueued messages wait behind the active run (a `waiting` run with a `run_waiting` event; the
/// message kept off the conversation, its version unchanged), hold back a message that would not
/// wait, and start one at a time, oldest first, once nothing runs: their messages join the
/// conversation in that order, each with a new version.
pub async fn enqueued_messages_wait_and_start_in_order(store: SharedStore) {
    let (conversation, first) = queued(&store).await;
    let mut waiting = Vec::new();
    for (n, text) in ["second", "third", "fourth"].into_iter().enumerate() {
        let started = enqueue(&store, &conversation, text, at(2 + n as i64)).await;
        assert_eq!(started.run.status, RunStatus::Waiting);
        assert_eq!(started.run.user_message_id, started.message.id);
        assert_eq!(started.message.content.as_str(), text);
        assert_eq!(started.events.len(), 1);
        assert_eq!((started.events[0].sequence, started.events[0].type_name()), (1, "run_waiting"));
        assert_eq!(get_run(&store, &started.run.id).await, started.run);
        waiting.push(started);
    }
    assert_eq!(contents(&store, &conversation.id).await, ["Cancel order ord-2"], "waiting messages are not in it");
    let version = |store: SharedStore, id: ConversationId| async move {
        store.get_conversation(&id).await.expect("get").expect("exists").version
    };
    assert_eq!(version(store.clone(), conversation.id.clone()).await, 1);
    let ids = |runs: Vec<Run>| runs.into_iter().map(|r| r.id).collect::<Vec<_>>();
    let order: Vec<RunId> = waiting.iter().map(|s| s.run.id.clone()).collect();
    assert_eq!(ids(store.waiting_runs(&conversation.id, 10).await.expect("waiting")), order);
    assert_eq!(ids(store.waiting_runs(&conversation.id, 1).await.expect("waiting")), order[..1]);
    // a waiting run is not claimable, and does not hold the conversation
    assert_eq!(store.active_run(&conversation.id).await.expect("active").map(|r| r.id), Some(first.id.clone()));
    let claimed = store.claim_runs("w0", at(5), at(60), false, 10).await.expect("claim");
    assert_eq!(ids(claimed), vec![first.id.clone()]);
    let mut c = Commit::new(first.id.clone(), Fence::Unowned { from: vec![RunStatus::Running] }, at(5));
    c.run = to(RunStatus::Cancelled);
    // the commit that ends the active run says runs wait behind it
    assert!(commit_ok(&store, c).await.waiting_behind);

    // nothing runs and messages wait: a message that would not wait is refused, naming the oldest
    let refused = store
        .start_run(NewRun {
            conversation_id: conversation.id.clone(),
            agent_id: "ops".into(),
            user_id: "alice".into(),
            content: "me first".into(),
            cancel_on_disconnect: false,
            now: at(6),
            events: first_events(&conversation.id),
            enqueue: None,
            lease: None,
        })
        .await;
    assert!(matches!(refused, Err(StoreError::RunActive(ref id)) if *id == order[0]), "{refused:?}");
    assert_eq!(store.stranded_conversations(10).await.expect("stranded"), vec![conversation.id.clone()]);

    // one at a time, in order: each starts once the one before it is over
    for (n, expected) in waiting.iter().enumerate() {
        let now = at(10 + 10 * n as i64);
        let promoted = store
            .promote_waiting(&conversation.id, first_events(&conversation.id), None, now)
            .await
            .expect("promote")
            .expect("a waiting run starts");
        assert_eq!(promoted.run.id, expected.run.id);
        assert_eq!(promoted.run.status, RunStatus::Queued);
        assert_eq!(promoted.message, Message { created_at: promoted.message.created_at, ..expected.message.clone() });
        assert_eq!(promoted.run.checkpoint.conversation_version, 2 + n as i64);
        assert_eq!(version(store.clone(), conversation.id.clone()).await, 2 + n as i64);
        let types: Vec<(i64, &str)> = promoted.events.iter().map(|e| (e.sequence, e.type_name())).collect();
        assert_eq!(types, [(2, "run_started"), (3, "graph_topology")]);
        assert_eq!(sequences(&store, &expected.run.id).await, [1, 2, 3]);
        assert_eq!(get_run(&store, &expected.run.id).await, promoted.run);
        assert_eq!(store.active_run(&conversation.id).await.expect("active").map(|r| r.id), Some(promoted.run.id));
        // while it is active, nothing else starts
        let again = store.promote_waiting(&conversation.id, first_events(&conversation.id), None, now).await;
        assert!(matches!(again, Ok(None)), "{again:?}");
        assert!(store.stranded_conversations(10).await.expect("stranded").is_empty());
        // the last one's end finds nothing waiting
        assert_eq!(end_queued(&store, &expected.run.id, now).await.waiting_behind, n + 1 < waiting.len());
    }
    assert_eq!(contents(&store, &conversation.id).await, ["Cancel order ord-2", "second", "third", "fourth"]);
    let nothing = store.promote_waiting(&conversation.id, first_events(&conversation.id), None, at(50)).await;
    assert!(matches!(nothing, Ok(None)), "{nothing:?}");
    assert!(store.stranded_conversations(10).await.expect("stranded").is_empty());

    // with nothing ahead of it, an enqueued message starts at once, like any
    let now_run = enqueue(&store, &conversation, "fifth", at(60)).await;
    assert_eq!(now_run.run.status, RunStatus::Queued);
    assert_eq!(now_run.events.iter().map(|e| e.type_name()).collect::<Vec<_>>(), ["run_started", "graph_topology"]);
    assert_eq!(contents(&store, &conversation.id).await.last().map(String::as_str), Some("fifth"));
    assert_eq!(version(store.clone(), conversation.id.clone()).await, 5);
    let missing = ConversationId::new();
    assert!(matches!(
        store.promote_waiting(&missing, first_events(&missing), None, at(61)).await,
        Err(StoreError::NotFound("conversation"))
    ));
}

/// Of promoters racing for one conversation (instances that saw its run end), exactly one starts
/// its oldest waiting run; the others find the run active and start nothing.
pub async fn concurrent_promoters_start_one_waiting_run(store: SharedStore) {
    let (conversation, first) = queued(&store).await;
    let oldest = enqueue(&store, &conversation, "second", at(2)).await;
    enqueue(&store, &conversation, "third", at(3)).await;
    end_queued(&store, &first.id, at(4)).await;
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            let id = conversation.id.clone();
            tokio::spawn(async move { store.promote_waiting(&id, first_events(&id), None, at(5)).await })
        })
        .collect();
    let mut started = Vec::new();
    for task in tasks {
        if let Some(s) = task.await.expect("task").expect("promote") {
            started.push(s.run.id);
        }
    }
    assert_eq!(started, vec![oldest.run.id.clone()], "exactly one promoter wins, with the oldest");
    assert_eq!(store.active_run(&conversation.id).await.expect("active").map(|r| r.id), Some(oldest.run.id.clone()));
    assert_eq!(store.waiting_runs(&conversation.id, 10).await.expect("waiting").len(), 1);
    assert_eq!(contents(&store, &conversation.id).await, ["Cancel order ord-2", "second"]);
    assert_eq!(sequences(&store, &oldest.run.id).await, [1, 2, 3]);
}

/// A waiting run is cancelled without ever running: the cancel flag is set on it, it ends
/// `cancelled` from `waiting`, its message never joins the conversation, and the next one starts
/// in its place.
pub async fn a_waiting_run_is_cancelled_without_running(store: SharedStore) {
    let (conversation, first) = queued(&store).await;
    let doomed = enqueue(&store, &conversation, "never mind", at(2)).await;
    let next = enqueue(&store, &conversation, "this one", at(3)).await;
    let flagged = store.request_cancel(&doomed.run.id, at(4), true).await.expect("request cancel");
    assert!(flagged.cancel_requested);
    assert_eq!(flagged.status, RunStatus::Waiting);
    assert!(store.rollbacks_due(10).await.expect("due").is_empty(), "not ended yet: not due");
    // a lease fence never writes on a waiting run: nobody works on it
    assert_conflict(store.commit(Commit::new(doomed.run.id.clone(), lease("w1", at(60)), at(4))).await);
    let mut c = Commit::new(doomed.run.id.clone(), Fence::Unowned { from: vec![RunStatus::Waiting] }, at(4));
    c.run = to(RunStatus::Cancelled);
    c.events.push(EventKind::Cancelled { reason: "cancelled_by_user".into() });
    let committed = commit_ok(&store, c).await;
    assert_eq!(committed.events[0].sequence, 2);
    assert_eq!(get_run(&store, &doomed.run.id).await.status, RunStatus::Cancelled);
    // its rollback was asked for with the cancel: due once it ended, until it is done
    assert_eq!(store.rollbacks_due(10).await.expect("due"), vec![doomed.run.id.clone()]);
    store.roll_back_run(&doomed.run.id, at(4)).await.expect("roll back");
    assert!(store.rollbacks_due(10).await.expect("due").is_empty(), "the rollback clears the intent");
    // waiting may only become queued or cancelled
    let mut c = Commit::new(next.run.id.clone(), Fence::Unowned { from: vec![RunStatus::Waiting] }, at(5));
    c.run = to(RunStatus::Completed);
    assert_conflict(store.commit(c).await);

    end_queued(&store, &first.id, at(6)).await;
    let promoted =
        store.promote_waiting(&conversation.id, first_events(&conversation.id), None, at(7)).await.expect("promote");
    assert_eq!(promoted.map(|s| s.run.id), Some(next.run.id));
    assert_eq!(contents(&store, &conversation.id).await, ["Cancel order ord-2", "this one"]);
}

/// A run that ran — text, a tool call and its result, an interrupt, events — is rolled back once
/// it is over: its messages and events are gone (a replay is told they are, as after retention),
/// its checkpoint names nothing it did, a summary of earlier turns stays, and its row, tool calls
/// and interrupts stay (the audit), out of the conversation's calls. Only a finished run is rolled
/// back; a second rollback removes nothing more.
pub async fn a_rollback_removes_messages_and_events_and_keeps_the_audit(store: SharedStore) {
    let (conversation, before) = running(&store, "w1").await;
    let answer = message(&before, Role::Assistant, "ord-2 is late", None, 3);
    let mut c = Commit::new(before.id.clone(), lease("w1", at(60)), at(3));
    c.messages.push(answer.clone());
    c.summary = Some(Summary {
        conversation_id: conversation.id.clone(),
        through_message_id: answer.id.clone(),
        text: "ord-2 is late".into(),
    });
    c.run = to(RunStatus::Completed);
    c.events.push(EventKind::Done { message_id: Some(answer.id.clone()) });
    commit_ok(&store, c).await;
    let kept_messages = store.list_messages(&conversation.id).await.expect("messages");

    let run = start(&store, &conversation, at(4)).await.run;
    let call = tool_call(&run.id, "cancel_order", "ord-2", ToolCallState::Asking);
    let asked = interrupt(&run.id, vec![call.id.clone()], at(500));
    let streamed = MessageId::new();
    let mut c = Commit::new(run.id.clone(), acquire("w2", RunStatus::Queued, at(60)), at(5));
    c.run = to(RunStatus::Running);
    c.text.push(TextAppend { message_id: streamed.clone(), text: "Cancelling ord-2.".into() });
    c.tool_calls.push(ToolCallChange::Insert(call.clone()));
    c.messages.push(message(&run, Role::Tool, "{\"asked\":true}", Some(&call.id), 5));
    c.facts.push(fact("order", "ord-2", FactSource::ToolResult, at(5)));
    c.checkpoint = Some(Checkpoint {
        pending_call_ids: vec![call.id.clone()],
        answer_message_id: Some(streamed.clone()),
        trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".into()),
        ..run.checkpoint.clone()
    });
    c.events.push(node("model"));
    commit_ok(&store, c).await;
    let mut c = Commit::new(run.id.clone(), lease("w2", at(60)), at(6));
    c.run = to(RunStatus::Interrupted);
    c.new_interrupts.push(asked.clone());
    commit_ok(&store, c).await;

    // not over: refused, and nothing removed
    assert_conflict(store.roll_back_run(&run.id, at(7)).await);
    assert_eq!(store.list_run_messages(&run.id).await.expect("messages").len(), 3);
    assert!(matches!(store.roll_back_run(&RunId::new(), at(7)).await, Err(StoreError::NotFound("run"))));

    let mut c = Commit::new(run.id.clone(), Fence::Unowned { from: vec![RunStatus::Interrupted] }, at(8));
    c.run = to(RunStatus::Cancelled);
    c.interrupt_changes.push(InterruptChange {
        id: asked.id.clone(),
        to: InterruptStatus::Cancelled,
        decision: None,
        note: None,
        resolved_by: None,
    });
    c.tool_calls.push(ToolCallChange::transition(&call.id, ToolCallState::Asking, ToolCallState::Denied));
    c.events.push(EventKind::Cancelled { reason: "interrupted_by_new_message".into() });
    commit_ok(&store, c).await;
    let next_sequence = get_run(&store, &run.id).await.next_sequence;
    assert!(next_sequence > 3);

    let removed = store.roll_back_run(&run.id, at(9)).await.expect("roll back");
    assert_eq!(removed.messages, 3, "the user message, the streamed text, the tool result");
    assert_eq!(removed.events as i64, next_sequence - 1);
    assert!(!removed.summary, "the summary covers an earlier run only");

    // the conversation reads as if it never ran
    assert_eq!(store.list_messages(&conversation.id).await.expect("messages"), kept_messages);
    assert!(store.list_run_messages(&run.id).await.expect("messages").is_empty());
    let window = store.context_window(&conversation.id).await.expect("window");
    assert!(window.messages.iter().all(|m| m.run_id.as_ref() != Some(&run.id)));
    assert!(window.summary.is_some());
    assert!(store.list_conversation_tool_calls(&conversation.id).await.expect("calls").is_empty());
    assert!(events(&store, &run.id).await.is_empty());
    assert_eq!(store.first_held_sequence(&run.id).await.expect("first held"), Some(next_sequence));

    // the audit stays: the run, its calls and interrupts
    let rolled_back = get_run(&store, &run.id).await;
    assert_eq!(rolled_back.status, RunStatus::RolledBack);
    assert_eq!(rolled_back.reason, None, "the reason it ended with");
    assert_eq!(rolled_back.next_sequence, next_sequence);
    assert_eq!(rolled_back.lease_owner, None);
    assert!(rolled_back.checkpoint.pending_call_ids.is_empty());
    assert_eq!(rolled_back.checkpoint.answer_message_id, None);
    assert_eq!(rolled_back.checkpoint.trace_id.as_deref(), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
    let calls = store.list_tool_calls(&run.id).await.expect("calls");
    assert_eq!(calls.iter().map(|c| (c.id.clone(), c.state)).collect::<Vec<_>>(), [(call.id, ToolCallState::Denied)]);
    let interrupts = store.list_interrupts(&run.id).await.expect("interrupts");
    assert_eq!(interrupts.iter().map(|i| i.status).collect::<Vec<_>>(), [InterruptStatus::Cancelled]);
    let listed = store.list_runs("alice", Some(RunStatus::RolledBack), 10).await.expect("runs");
    assert_eq!(listed.into_iter().map(|r| r.id).collect::<Vec<_>>(), vec![run.id.clone()]);
    assert_eq!(store.list_facts(&conversation.id).await.expect("facts").len(), 1, "facts stay");

    // once is enough; a rolled-back run is over, and its conversation takes a new run
    assert_eq!(store.roll_back_run(&run.id, at(10)).await.expect("again"), Default::default());
    assert_eq!(get_run(&store, &run.id).await, rolled_back);
    let mut c = Commit::new(run.id.clone(), Fence::Unowned { from: vec![RunStatus::Cancelled] }, at(10));
    c.run = to(RunStatus::Cancelled);
    assert_conflict(store.commit(c).await);
    assert_eq!(store.active_run(&conversation.id).await.expect("active"), None);
    start(&store, &conversation, at(11)).await;
}

/// A summary that covers a message of the rolled-back run (it was extended during that run) is
/// removed with it: the next step summarises again from what is left.
pub async fn a_rollback_removes_the_summary_that_covers_the_run(store: SharedStore) {
    let (conversation, run) = running(&store, "w1").await;
    let answer = message(&run, Role::Assistant, "ord-2 is late", None, 3);
    let mut c = Commit::new(run.id.clone(), lease("w1", at(60)), at(3));
    c.messages.push(answer.clone());
    c.summary = Some(Summary {
        conversation_id: conversation.id.clone(),
        through_message_id: run.user_message_id.clone(),
        text: "asked about ord-2".into(),
    });
    c.run = to(RunStatus::Failed);
    commit_ok(&store, c).await;
    let removed = store.roll_back_run(&run.id, at(4)).await.expect("roll back");
    assert_eq!((removed.messages, removed.summary), (2, true));
    assert_eq!(store.get_summary(&conversation.id).await.expect("summary"), None);
    assert_eq!(store.context_window(&conversation.id).await.expect("window"), ContextWindow::default());
}

/// `hide_run` (LangGraph's `runs.delete`): only a run that is over is hidden, by one conditional
/// write that changes nothing but `hidden_at`; hiding it again is refused the same way each time,
/// the first `hidden_at` kept.
pub async fn only_a_run_that_is_over_is_hidden_once(store: SharedStore) {
    // not over: refused, nothing written
    let (conversation, queued_run) = queued(&store).await;
    let waiting = enqueue(&store, &conversation, "after that", at(2)).await;
    let (_, running_run) = running(&store, "w2").await;
    let (_, paused, _) = interrupted(&store, at(1_000)).await;
    for run in [&queued_run, &waiting.run, &running_run, &paused] {
        assert_conflict(store.hide_run(&run.id, at(5)).await);
        assert_eq!(get_run(&store, &run.id).await.hidden_at, None, "{}", run.status);
    }
    assert!(matches!(store.hide_run(&RunId::new(), at(5)).await, Err(StoreError::NotFound("run"))));

    // over: hidden once; the row, its events and its place in the lists stay
    let done = finished(&store, "ops", 10, 2).await;
    assert_eq!(done.hidden_at, None);
    let before = events(&store, &done.id).await;
    assert!(store.hide_run(&done.id, at(20)).await.expect("hide"));
    let hidden = get_run(&store, &done.id).await;
    assert_eq!(hidden, Run { hidden_at: Some(at(20)), ..done.clone() }, "nothing but hidden_at changes");
    assert_eq!(events(&store, &done.id).await, before);
    let newest = store.newest_conversation_runs(&done.conversation_id, 10).await.expect("newest");
    assert_eq!(newest, vec![hidden.clone()]);
    assert!(store.list_runs("alice", None, 100).await.expect("runs").contains(&hidden));

    // again: refused, the first hidden_at kept
    assert!(!store.hide_run(&done.id, at(21)).await.expect("hide again"));
    assert_eq!(get_run(&store, &done.id).await, hidden);

    // failed, cancelled and rolled back are over too
    end_queued(&store, &queued_run.id, at(6)).await;
    assert!(store.hide_run(&queued_run.id, at(7)).await.expect("hide a cancelled run"));
    store.roll_back_run(&queued_run.id, at(8)).await.expect("roll back a hidden run");
    let rolled_back = get_run(&store, &queued_run.id).await;
    assert_eq!((rolled_back.status, rolled_back.hidden_at), (RunStatus::RolledBack, Some(at(7))));
    let (_, failing) = running(&store, "w3").await;
    let mut c = Commit::new(failing.id.clone(), lease("w3", at(60)), at(9));
    c.run = to(RunStatus::Failed);
    commit_ok(&store, c).await;
    assert!(store.hide_run(&failing.id, at(10)).await.expect("hide a failed run"));
    store.roll_back_run(&failing.id, at(11)).await.expect("roll back");
    let (_, other) = queued(&store).await;
    end_queued(&store, &other.id, at(12)).await;
    store.roll_back_run(&other.id, at(13)).await.expect("roll back");
    assert!(store.hide_run(&other.id, at(14)).await.expect("hide a rolled-back run"));
}
