//! Random walks of valid and invalid transitions against a real store: the store applies exactly
//! the moves the state machines allow, refuses the rest, and a refused commit writes nothing.

use std::sync::Arc;

use chrono::Utc;
use keel_core::domain::{Interrupt, InterruptKind, InterruptStatus, RunStatus, ToolCall, ToolCallState};
use keel_core::event::EventKind;
use keel_core::ids::{CallId, InterruptId};
use keel_core::store::prelude::*;
use keel_core::store::{Commit, Fence, InterruptChange, NewRun, RunChange, StoreError, ToolCallChange};
use keel_store::{PostgresStore, SqliteStore};
use proptest::prelude::*;
use serde_json::json;

#[derive(Debug, Clone)]
enum Op {
    Run(RunStatus),
    Call { from: ToolCallState, to: ToolCallState },
    Interrupt(InterruptStatus),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        prop::sample::select(RunStatus::ALL.to_vec()).prop_map(Op::Run),
        (prop::sample::select(ToolCallState::ALL.to_vec()), prop::sample::select(ToolCallState::ALL.to_vec()))
            .prop_map(|(from, to)| Op::Call { from, to }),
        prop::sample::select(InterruptStatus::ALL.to_vec()).prop_map(Op::Interrupt),
    ]
}

async fn walk(store: Arc<dyn Store>, ops: Vec<Op>) {
    // Microseconds: every backend keeps at least that precision.
    let now = chrono::DateTime::from_timestamp_micros(Utc::now().timestamp_micros()).unwrap();
    let conv = store.create_conversation("u", &"walk".into(), "ops", now).await.unwrap();
    let started = store
        .start_run(NewRun {
            conversation_id: conv.id.clone(),
            agent_id: "ops".into(),
            user_id: "u".into(),
            content: "go".into(),
            cancel_on_disconnect: false,
            now,
            events: vec![EventKind::RunStarted { conversation_id: conv.id.clone(), trace_id: None }],
            enqueue: None,
            lease: None,
        })
        .await
        .unwrap();
    let run_id = started.run.id.clone();
    let call_id = CallId::new();
    let interrupt_id = InterruptId::new();
    // Any status may be the fence's: the walk tests the transition rules, not the fence.
    let any = || Fence::Unowned { from: RunStatus::ALL.to_vec() };
    let mut setup = Commit::new(run_id.clone(), any(), now);
    setup.tool_calls.push(ToolCallChange::Insert(ToolCall {
        id: call_id.clone(),
        run_id: run_id.clone(),
        name: "t".into(),
        args: json!({}).into(),
        state: ToolCallState::Requested,
        result: None,
        summary: None,
        attempts: 0,
        started_at: None,
        finished_at: None,
    }));
    setup.new_interrupts.push(Interrupt {
        id: interrupt_id.clone(),
        run_id: run_id.clone(),
        kind: InterruptKind::ConfirmAction,
        status: InterruptStatus::Pending,
        payload: json!({}).into(),
        call_ids: vec![call_id.clone()],
        created_at: now,
        expires_at: now + chrono::Duration::hours(1),
        decision: None,
        note: None,
        resolved_by: None,
        resolved_at: None,
    });
    store.commit(setup).await.unwrap();

    let (mut run, mut call, mut interrupt) = (RunStatus::Queued, ToolCallState::Requested, InterruptStatus::Pending);
    for op in ops {
        let before = store.list_events(&run_id, 0, 1000).await.unwrap().len();
        let mut c = Commit::new(run_id.clone(), any(), now).event(EventKind::NodeStarted { node: "x".into() });
        let valid = match &op {
            Op::Run(to) => {
                c.run = Some(RunChange { to: *to, reason: None, via: None });
                run.can_transition_to(*to)
            }
            Op::Call { from, to } => {
                c.tool_calls.push(ToolCallChange::transition(&call_id, *from, *to));
                *from == call && from.can_transition_to(*to)
            }
            Op::Interrupt(to) => {
                c.interrupt_changes.push(InterruptChange {
                    id: interrupt_id.clone(),
                    to: *to,
                    decision: None,
                    note: None,
                    resolved_by: None,
                });
                interrupt.can_transition_to(*to)
            }
        };
        let result = store.commit(c).await;
        let after = store.list_events(&run_id, 0, 1000).await.unwrap().len();
        match (&result, valid) {
            (Ok(_), true) => {
                assert_eq!(after, before + 1);
                match op {
                    Op::Run(to) => run = to,
                    Op::Call { to, .. } => call = to,
                    Op::Interrupt(to) => interrupt = to,
                }
            }
            (Err(StoreError::Conflict(_)), false) => assert_eq!(after, before, "a refused commit wrote an event"),
            (r, v) => panic!("{op:?} from run={run} call={call} interrupt={interrupt}: valid={v}, got {r:?}"),
        }
        // The store's view equals the model's.
        assert_eq!(store.get_run(&run_id).await.unwrap().unwrap().status, run);
        let stored_call = store.list_tool_calls(&run_id).await.unwrap().pop().unwrap();
        assert_eq!(stored_call.state, call);
        assert_eq!(store.get_interrupt(&interrupt_id).await.unwrap().unwrap().status, interrupt);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn sqlite_applies_exactly_the_allowed_moves(ops in prop::collection::vec(op(), 1..40)) {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
            let dir = tempfile::TempDir::new().unwrap();
            let store = SqliteStore::open(&dir.path().join("keel.db")).await.unwrap();
            walk(Arc::new(store), ops).await;
        });
    }

    /// The same walk on Postgres when `KEEL_TEST_POSTGRES_URL` is set (and failing if it is set
    /// but unreachable); without it, this case has nothing to test and says so in its name only.
    #[test]
    fn postgres_applies_exactly_the_allowed_moves_when_configured(ops in prop::collection::vec(op(), 1..25)) {
        let Some(url) = std::env::var("KEEL_TEST_POSTGRES_URL").ok().filter(|u| !u.trim().is_empty()) else {
            return Ok(());
        };
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
            let schema = format!("keel_walk_{}", keel_core::ids::RunId::new().as_str().trim_start_matches("run_"));
            let store = Arc::new(PostgresStore::connect_with_schema(&url, &schema).await.expect("Postgres reachable"));
            walk(store.clone(), ops).await;
            store.drop_schema().await.unwrap();
        });
    }
}
