//! The store conformance suite on Postgres, plus what only Postgres has: schemas, connection
//! failures, rows written by someone else, and races that SQLite's single writer never sees.
//!
//! `KEEL_TEST_POSTGRES_URL` (e.g. `postgres://postgres@127.0.0.1:5432/test`) names the database.
//! Set, every case runs on a fresh schema of its own (dropped afterwards), and a database that
//! cannot be reached fails the case. Unset, the cases do nothing and say so on stderr: they have
//! not tested anything.

use std::io::Write;
use std::sync::{Arc, Once};
use std::time::Duration;

use chrono::{DateTime, Utc};
use keel_core::domain::{Checkpoint, Fact, FactSource, Message, Role, RunStatus, ToolCallState};
use keel_core::event::EventKind;
use keel_core::ids::{MessageId, RunId};
use keel_core::store::{
    Commit, ConversationStore, Fence, IdempotencyBegin, NewRun, RunChange, RunStore, Store, StoreError, ToolCallChange,
};
use keel_store::{PostgresOptions, PostgresStore};
use sqlx::{Connection, PgConnection};

const URL_VAR: &str = "KEEL_TEST_POSTGRES_URL";

/// The database url, or `None` (said once on stderr, past the test harness's capture) when unset.
fn url() -> Option<String> {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            static SAID: Once = Once::new();
            SAID.call_once(|| {
                let _ = writeln!(
                    std::io::stderr(),
                    "keel-store: the Postgres suite is SKIPPED because {URL_VAR} is unset \
                     (set it to e.g. postgres://postgres@127.0.0.1:5432/test to run it)"
                );
            });
            None
        }
    }
}

fn new_schema_name() -> String {
    let id = RunId::new();
    format!("keel_test_{}", id.as_str().trim_start_matches(RunId::PREFIX))
}

/// Drops the case's schema when the case ends, passed or panicked.
struct SchemaGuard(PostgresStore);

impl Drop for SchemaGuard {
    fn drop(&mut self) {
        let store = self.0.clone();
        // the conformance cases run on a multi-threaded runtime, where blocking here is allowed
        let result = tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(store.drop_schema()));
        if let Err(e) = result {
            let schema = self.0.schema().unwrap_or("?");
            let _ = writeln!(std::io::stderr(), "keel-store: could not drop test schema {schema}: {e}");
        }
    }
}

/// A store on a fresh schema; panics if the variable is set and the database cannot be used.
async fn connect_fresh(url: &str) -> (PostgresStore, SchemaGuard) {
    let schema = new_schema_name();
    let store = PostgresStore::connect_with_schema(url, &schema)
        .await
        .unwrap_or_else(|e| panic!("{URL_VAR} is set, but the database cannot be used: {e}"));
    (store.clone(), SchemaGuard(store))
}

async fn fresh() -> Option<(Arc<dyn Store>, SchemaGuard)> {
    let url = url()?;
    let (store, guard) = connect_fresh(&url).await;
    Some((Arc::new(store), guard))
}

keel_store::conformance_tests!(optional fresh);

// --- Postgres only

fn now() -> DateTime<Utc> {
    DateTime::from_timestamp(1_893_499_200, 0).expect("time")
}

fn new_run(conversation_id: &keel_core::ids::ConversationId) -> NewRun {
    NewRun {
        conversation_id: conversation_id.clone(),
        agent_id: "ops".into(),
        user_id: "alice".into(),
        content: "hi".into(),
        cancel_on_disconnect: false,
        now: now(),
        events: vec![],
        enqueue: None,
        lease: None,
    }
}

/// A plain connection working in `schema`, as another program would.
async fn raw(url: &str, schema: &str) -> PgConnection {
    let mut conn = PgConnection::connect(url).await.expect("raw connection");
    sqlx::query(&format!("SET search_path TO \"{schema}\"")).execute(&mut conn).await.expect("search path");
    conn
}

async fn schema_exists(url: &str, schema: &str) -> bool {
    let mut conn = PgConnection::connect(url).await.expect("raw connection");
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM pg_namespace WHERE nspname = $1")
        .bind(schema)
        .fetch_one(&mut conn)
        .await
        .expect("count schemas");
    n == 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemas_are_isolated_reconnectable_and_dropped() {
    let Some(url) = url() else { return };
    let (a, _guard_a) = connect_fresh(&url).await;
    let (b, guard_b) = connect_fresh(&url).await;
    let conversation = a.create_conversation("alice", &"t".into(), "ops", now()).await.expect("create");
    assert!(b.list_conversations("alice", 10).await.expect("list").is_empty(), "another schema sees nothing");

    // connecting again migrates nothing and finds the data
    let schema = a.schema().expect("a schema").to_owned();
    let again = PostgresStore::connect_with_schema(&url, &schema).await.expect("reconnect");
    assert_eq!(again.get_conversation(&conversation.id).await.expect("get"), Some(conversation));
    again.close().await;

    // `connect` works in whatever schema the url's options name; such a store drops nothing
    let plain_schema = new_schema_name();
    let mut conn = PgConnection::connect(&url).await.expect("raw connection");
    sqlx::query(&format!("CREATE SCHEMA \"{plain_schema}\"")).execute(&mut conn).await.expect("create schema");
    let sep = if url.contains('?') { '&' } else { '?' };
    let plain_url = format!("{url}{sep}options=-c%20search_path%3D{plain_schema}");
    let plain = PostgresStore::connect(&plain_url).await.expect("connect");
    plain.create_conversation("bob", &"t".into(), "ops", now()).await.expect("create");
    assert!(matches!(plain.drop_schema().await, Err(StoreError::Backend(_))));
    plain.close().await;
    let tables: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = $1 AND table_name = 'runs'",
    )
    .bind(&plain_schema)
    .fetch_one(&mut conn)
    .await
    .expect("count tables");
    assert_eq!(tables, 1, "connect migrated the url's schema");
    sqlx::query(&format!("DROP SCHEMA \"{plain_schema}\" CASCADE")).execute(&mut conn).await.expect("drop");

    drop(guard_b); // drop_schema
    assert!(!schema_exists(&url, b.schema().expect("a schema")).await);
    assert!(schema_exists(&url, &schema).await);
}

#[tokio::test]
async fn an_unreachable_database_is_a_backend_error_without_the_password() {
    // needs no server: nothing listens on port 1
    let url = "postgres://keel:secret-pw@127.0.0.1:1/keel";
    for result in
        [PostgresStore::connect(url).await.map(|_| ()), PostgresStore::connect_with_schema(url, "k").await.map(|_| ())]
    {
        match result {
            Err(StoreError::Backend(message)) => {
                assert!(message.starts_with("connect to the database: "), "says what failed: {message}");
                assert!(message.to_lowercase().contains("refused"), "and why: {message}");
                assert!(!message.contains("secret-pw"), "{message}");
            }
            other => panic!("expected a backend error, got {other:?}"),
        }
    }
    let bad = PostgresStore::connect("sqlite://keel.db").await.map(|_| ());
    assert!(matches!(bad, Err(StoreError::Backend(_))), "{bad:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_row_is_a_backend_error() {
    let Some(url) = url() else { return };
    let (store, _guard) = connect_fresh(&url).await;
    let conversation = store.create_conversation("alice", &"t".into(), "ops", now()).await.expect("create");
    let started = store.start_run(new_run(&conversation.id)).await.expect("start");

    // someone else wrote rows this version cannot read
    let mut conn = raw(&url, store.schema().expect("schema")).await;
    sqlx::query("UPDATE runs SET checkpoint = '{\"nextStep\": \"secret-token-123\"}' WHERE id = $1")
        .bind(started.run.id.as_str())
        .execute(&mut conn)
        .await
        .expect("corrupt the checkpoint");
    sqlx::query("UPDATE messages SET role = 'system'").execute(&mut conn).await.expect_err("the schema checks roles");
    sqlx::query("UPDATE messages SET run_id = 'not-a-run-id'").execute(&mut conn).await.expect_err("a foreign key");
    sqlx::query("UPDATE messages SET tool_call_id = 'not-a-call-id'").execute(&mut conn).await.expect("bad id");

    match store.get_run(&started.run.id).await {
        Err(StoreError::Backend(message)) => {
            assert!(message.contains("runs.checkpoint"), "{message}");
            assert!(!message.contains("secret-token-123"), "no row content in errors: {message}");
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
    match store.list_messages(&conversation.id).await {
        Err(StoreError::Backend(message)) => assert!(message.contains("messages.tool_call_id"), "{message}"),
        other => panic!("expected a backend error, got {other:?}"),
    }
}

/// The conversation row lock makes this rare, but a run can still become active between the
/// active-run check and the insert (written by another program, or by a future code path): the
/// unique index refuses the insert, and the start reports the winner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_loses_to_the_unique_index_reports_the_winner() {
    let Some(url) = url() else { return };
    let (store, _guard) = connect_fresh(&url).await;
    let conversation = store.create_conversation("alice", &"t".into(), "ops", now()).await.expect("create");

    // another writer's active run, not committed yet (it does not lock the conversation row)
    let mut other = raw(&url, store.schema().expect("schema")).await;
    let winner = RunId::new();
    sqlx::query("BEGIN").execute(&mut other).await.expect("begin");
    sqlx::query(
        "INSERT INTO runs (id, conversation_id, user_message_id, user_id, status, checkpoint, created_at, updated_at) \
         VALUES ($1, $2, 'msg_x', 'bob', 'running', $3, $4, $4)",
    )
    .bind(winner.as_str())
    .bind(conversation.id.as_str())
    .bind(serde_json::to_value(Checkpoint::start(0)).expect("json"))
    .bind(now())
    .execute(&mut other)
    .await
    .expect("insert the other run");

    let starting = {
        let store = store.clone();
        let new = new_run(&conversation.id);
        tokio::spawn(async move { store.start_run(new).await })
    };
    // the start waits on the index entry of the uncommitted run
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!starting.is_finished(), "the start should wait for the other transaction");
    sqlx::query("COMMIT").execute(&mut other).await.expect("commit");

    match starting.await.expect("task") {
        Err(StoreError::RunActive(id)) => assert_eq!(id, winner),
        other => panic!("expected RunActive, got {other:?}"),
    }
    // the refused start left nothing behind
    assert!(store.list_messages(&conversation.id).await.expect("messages").is_empty());
    let stored = store.get_conversation(&conversation.id).await.expect("get").expect("exists");
    assert_eq!(stored.version, 0);
    let active = store.active_run(&conversation.id).await.expect("active").expect("the winner");
    assert_eq!((active.id, active.status), (winner, RunStatus::Running));
}

/// A start is one statement that sees the database as of its start. A message enqueued meanwhile
/// (it writes the conversation's row, then a waiting run, and commits while the start waits for the
/// row) is not in what the statement saw, and no unique index stands for a waiting run: the start
/// must still find it, and refuse to run ahead of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_waited_for_the_conversation_sees_the_run_enqueued_meanwhile() {
    let Some(url) = url() else { return };
    let (store, _guard) = connect_fresh(&url).await;
    let conversation = store.create_conversation("alice", &"t".into(), "ops", now()).await.expect("create");

    let mut other = raw(&url, store.schema().expect("schema")).await;
    let waiting = RunId::new();
    sqlx::query("BEGIN").execute(&mut other).await.expect("begin");
    sqlx::query("UPDATE conversations SET version = version WHERE id = $1")
        .bind(conversation.id.as_str())
        .execute(&mut other)
        .await
        .expect("lock the conversation");
    sqlx::query(
        "INSERT INTO runs (id, conversation_id, user_message_id, user_id, status, checkpoint, created_at, updated_at) \
         VALUES ($1, $2, 'msg_x', 'bob', 'waiting', $3, $4, $4)",
    )
    .bind(waiting.as_str())
    .bind(conversation.id.as_str())
    .bind(serde_json::to_value(Checkpoint::start(0)).expect("json"))
    .bind(now())
    .execute(&mut other)
    .await
    .expect("insert the waiting run");

    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut other).await.expect("pid");
    let starting = {
        let store = store.clone();
        let new = new_run(&conversation.id);
        tokio::spawn(async move { store.start_run(new).await })
    };
    // the start is blocked by the transaction that holds the conversation's row
    let mut watcher = raw(&url, store.schema().expect("schema")).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let blocked: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid)))")
                .bind(holder)
                .fetch_one(&mut watcher)
                .await
                .expect("look at the waits");
        if blocked {
            break;
        }
        assert!(!starting.is_finished(), "the start should wait for the conversation's row");
        assert!(std::time::Instant::now() < deadline, "timed out waiting for the start to wait");
        tokio::task::yield_now().await;
    }
    sqlx::query("COMMIT").execute(&mut other).await.expect("commit");

    match starting.await.expect("task") {
        Err(StoreError::RunActive(id)) => assert_eq!(id, waiting),
        other => panic!("expected RunActive naming the waiting run, got {other:?}"),
    }
    assert!(store.active_run(&conversation.id).await.expect("active").is_none(), "nothing started ahead of it");
    assert!(store.list_messages(&conversation.id).await.expect("messages").is_empty());
    assert_eq!(store.get_conversation(&conversation.id).await.expect("get").expect("exists").version, 0);

    // with nothing in the way, a start is written whole, at the conversation's next version
    let (fresh, _) = (store.create_conversation("alice", &"u".into(), "ops", now()).await.expect("create"), ());
    let new = NewRun { events: vec![EventKind::NodeStarted { node: "a".into() }], ..new_run(&fresh.id) };
    let started = store.start_run(new).await.expect("start");
    assert_eq!(started.run.checkpoint.conversation_version, 1);
    assert_eq!(store.get_run(&started.run.id).await.expect("get").expect("run"), started.run);
    assert_eq!(store.list_messages(&fresh.id).await.expect("messages"), vec![started.message.clone()]);
    assert_eq!(store.list_events(&started.run.id, 0, 10).await.expect("events"), started.events);
    assert_eq!(store.get_conversation(&fresh.id).await.expect("get").expect("exists").version, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_begins_of_one_key_start_it_once() {
    let Some(url) = url() else { return };
    let (store, _guard) = connect_fresh(&url).await;
    for round in 0..5i64 {
        let key = format!("k{round}");
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (store, key) = (store.clone(), key.clone());
                tokio::spawn(async move {
                    let at = now() + chrono::Duration::seconds(round);
                    store.idempotency_begin("alice", &key, "h", at, at + chrono::Duration::seconds(100)).await
                })
            })
            .collect();
        let mut started = 0;
        for task in tasks {
            match task.await.expect("task").expect("begin") {
                IdempotencyBegin::Started => started += 1,
                IdempotencyBegin::InFlight => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(started, 1, "round {round}");
    }
}

/// `timestamptz` keeps microseconds: what a call returns is what a read returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returned_times_equal_stored_times() {
    let Some(url) = url() else { return };
    let (store, _guard) = connect_fresh(&url).await;
    let t = now() + chrono::Duration::nanoseconds(123_456_789);
    let conversation = store.create_conversation("alice", &"t".into(), "ops", t).await.expect("create");
    assert_eq!(conversation.created_at, now() + chrono::Duration::microseconds(123_456));
    assert_eq!(store.get_conversation(&conversation.id).await.expect("get").as_ref(), Some(&conversation));
    let started = store
        .start_run(NewRun {
            now: t,
            events: vec![keel_core::event::EventKind::RunStarted {
                conversation_id: conversation.id.clone(),
                trace_id: None,
            }],
            ..new_run(&conversation.id)
        })
        .await
        .expect("start");
    assert_eq!(store.get_run(&started.run.id).await.expect("get").as_ref(), Some(&started.run));
    assert_eq!(store.list_messages(&conversation.id).await.expect("messages"), vec![started.message]);
    assert_eq!(store.list_events(&started.run.id, 0, 10).await.expect("events"), started.events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_clock_is_read_and_tracked() {
    // on a schema of its own, like every case: the database's public schema may hold anything
    let Some((store, _guard)) = fresh().await else { return };
    let db = store.db_now().await.unwrap();
    assert!((db - Utc::now()).num_seconds().abs() < 5, "the test database runs on this machine");
    let clock = keel_core::clock::StoreClock::start(store.clone(), Duration::from_secs(60)).await.unwrap();
    use keel_core::clock::Clock;
    let (before, now, after) = (store.db_now().await.unwrap(), clock.now(), store.db_now().await.unwrap());
    let slack = chrono::Duration::milliseconds(50);
    assert!(now >= before - slack && now <= after + slack, "{before} <= {now} <= {after}");
}

// --- group commit

/// Polls `done` until it holds, failing the case after 30 s.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A queued run on a conversation of its own.
async fn queued_run(store: &PostgresStore) -> RunId {
    let conversation = store.create_conversation("alice", &"t".into(), "ops", now()).await.expect("create");
    store.start_run(new_run(&conversation.id)).await.expect("start").run.id
}

/// A commit any request may make on a queued run, with `events` events.
fn on_queued(run_id: &RunId, events: usize) -> Commit {
    let mut commit = Commit::new(run_id.clone(), Fence::Unowned { from: vec![RunStatus::Queued] }, now());
    for i in 0..events {
        commit = commit.event(EventKind::NodeStarted { node: format!("e{i}") });
    }
    commit
}

/// A call of `run`'s to `restart`, in `state`, not started.
fn new_call(run: &RunId, state: ToolCallState) -> keel_core::domain::ToolCall {
    keel_core::domain::ToolCall {
        id: keel_core::ids::CallId::new(),
        run_id: run.clone(),
        name: "restart".into(),
        args: serde_json::json!({"id": "a"}).into(),
        state,
        result: None,
        summary: None,
        attempts: 0,
        started_at: None,
        finished_at: None,
    }
}

/// A transaction on another connection that holds the run row: the committers wait for it.
async fn hold_run(url: &str, store: &PostgresStore, run_id: &RunId) -> PgConnection {
    let mut conn = raw(url, store.schema().expect("schema")).await;
    sqlx::query("BEGIN").execute(&mut conn).await.expect("begin");
    sqlx::query("SELECT 1 FROM runs WHERE id = $1 FOR UPDATE")
        .bind(run_id.as_str())
        .execute(&mut conn)
        .await
        .expect("lock the run");
    conn
}

type Answer = tokio::task::JoinHandle<Result<keel_core::store::Committed, StoreError>>;

fn commit_in_background(store: &PostgresStore, commit: Commit) -> Answer {
    let store = store.clone();
    tokio::spawn(async move { store.commit(commit).await })
}

/// With the one committer held inside a group, queues `commits` (they form the next group) and
/// returns their answers once it is released.
async fn as_one_group(
    url: &str,
    store: &PostgresStore,
    commits: Vec<Commit>,
) -> Vec<Result<keel_core::store::Committed, StoreError>> {
    let blocker = queued_run(store).await;
    let mut held = hold_run(url, store, &blocker).await;
    let groups = store.commit_stats().groups;
    let blocked = commit_in_background(store, on_queued(&blocker, 1));
    eventually("the committer is inside the blocked group", || store.commit_stats().groups == groups + 1).await;
    let n = commits.len();
    let answers: Vec<Answer> = commits.into_iter().map(|c| commit_in_background(store, c)).collect();
    eventually("every commit is queued", || store.queued_commits() == n).await;
    sqlx::query("COMMIT").execute(&mut held).await.expect("release the run");
    blocked.await.expect("task").expect("the blocked commit");
    let mut results = Vec::new();
    for answer in answers {
        results.push(answer.await.expect("task"));
    }
    assert_eq!(store.commit_stats().groups, groups + 2, "the commits were written as one group");
    results
}

async fn one_committer(url: &str, queue: usize) -> (PostgresStore, SchemaGuard) {
    let schema = new_schema_name();
    let options = PostgresOptions { commit_queue: queue, committers: 1, ..PostgresOptions::default() };
    let store = PostgresStore::connect_with_schema_and(url, &schema, options).await.expect("connect");
    (store.clone(), SchemaGuard(store))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_refused_inside_a_group_fails_alone() {
    let Some(url) = url() else { return };
    let (store, _guard) = one_committer(&url, 64).await;
    let runs = [queued_run(&store).await, queued_run(&store).await, queued_run(&store).await];

    // refused by its fence: left out of the group, which commits the others
    let fenced = Commit::new(runs[1].clone(), Fence::Unowned { from: vec![RunStatus::Running] }, now())
        .event(EventKind::NodeStarted { node: "x".into() });
    let results = as_one_group(&url, &store, vec![on_queued(&runs[0], 2), fenced, on_queued(&runs[2], 3)]).await;
    assert_eq!(results[0].as_ref().expect("first").events.len(), 2);
    match &results[1] {
        Err(StoreError::Conflict(why)) => assert!(why.contains("is queued, not running"), "{why}"),
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(results[2].as_ref().expect("last").events.iter().map(|e| e.sequence).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(store.commit_stats().regrouped, 0, "a fence refusal costs the group nothing");

    // refused past its fence (a tool call it does not have): the group is written again without it
    let missing = keel_core::ids::CallId::new();
    let mut refused = on_queued(&runs[1], 1);
    refused.tool_calls.push(ToolCallChange::transition(&missing, ToolCallState::Requested, ToolCallState::Allowed));
    let results = as_one_group(&url, &store, vec![on_queued(&runs[0], 1), refused, on_queued(&runs[2], 1)]).await;
    assert_eq!(results[0].as_ref().expect("first").events[0].sequence, 3);
    match &results[1] {
        Err(StoreError::Conflict(why)) => assert!(why.contains("is not a call of run"), "{why}"),
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(results[2].as_ref().expect("last").events[0].sequence, 4);
    assert_eq!(store.commit_stats().regrouped, 1);

    // nothing of the refused commits was written; the others were, once
    assert_eq!(store.list_events(&runs[0], 0, 100).await.expect("events").len(), 3);
    assert!(store.list_events(&runs[1], 0, 100).await.expect("events").is_empty());
    assert_eq!(store.get_run(&runs[1]).await.expect("get").expect("run").next_sequence, 1);
    assert_eq!(store.list_events(&runs[2], 0, 100).await.expect("events").len(), 4);
}

/// A store of two committers, one of them held inside a group at its lock of a run row another
/// connection holds (a fact makes the commit a group: a commit of events alone goes the lone way,
/// one statement with its commit). Returns the store, the holding connection (its `COMMIT` lets
/// the group go on) and the group's answer.
async fn two_committers_one_held(
    url: &str,
    hold_queue_at_most: Duration,
) -> (PostgresStore, SchemaGuard, PgConnection, Answer) {
    let options = PostgresOptions { committers: 2, hold_queue_at_most, ..Default::default() };
    let store = PostgresStore::connect_with_schema_and(url, &new_schema_name(), options).await.expect("connect");
    let guard = SchemaGuard(store.clone());
    let blocker = queued_run(&store).await;
    let held = hold_run(url, &store, &blocker).await;
    let groups = store.commit_stats().groups;
    let mut first = on_queued(&blocker, 1);
    first.facts.push(Fact {
        key: "k".into(),
        value: "v".to_owned().into(),
        source: FactSource::ToolResult,
        updated_at: now(),
    });
    let blocked = commit_in_background(&store, first);
    eventually("a committer is inside the blocked group", || store.commit_stats().groups == groups + 1).await;
    (store, guard, held, blocked)
}

/// With two committers, the second takes the queue only once the first has nothing left of its
/// group but the `COMMIT`: the commits that come while the first writes wait, and go as the next
/// group, one group, not a few small ones as they come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_group_waits_for_the_first_ones_statements() {
    let Some(url) = url() else { return };
    // (held at a lock longer than `hold_queue_at_most`, a committer lets the others go on: not here)
    let (store, _guard, mut held, blocked) = two_committers_one_held(&url, Duration::from_secs(60)).await;
    let groups = store.commit_stats().groups;
    let runs = [queued_run(&store).await, queued_run(&store).await, queued_run(&store).await];
    // the other committer does not take what comes meanwhile: it all waits in the queue
    let answers: Vec<Answer> = runs.iter().map(|run| commit_in_background(&store, on_queued(run, 2))).collect();
    eventually("every commit is queued", || store.queued_commits() == runs.len()).await;
    assert_eq!(store.queued_commits(), runs.len(), "still queued while the first group's statements wait");
    assert_eq!(store.commit_stats().groups, groups);
    sqlx::query("COMMIT").execute(&mut held).await.expect("release the run");
    blocked.await.expect("task").expect("the blocked commit");
    for answer in answers {
        assert_eq!(answer.await.expect("task").expect("committed").events.len(), 2);
    }
    assert_eq!(store.commit_stats().groups, groups + 1, "the commits that waited went as one group");
}

/// A group held up at its lock (its run row held by another transaction) lets the other committer
/// take the queue after `hold_queue_at_most`: the commits of other runs are written meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_held_up_by_a_lock_does_not_hold_up_the_others() {
    let Some(url) = url() else { return };
    let (store, _guard, mut held, blocked) = two_committers_one_held(&url, PostgresOptions::HOLD_QUEUE_AT_MOST).await;
    let runs = [queued_run(&store).await, queued_run(&store).await];
    for run in &runs {
        let written = tokio::time::timeout(Duration::from_secs(10), store.commit(on_queued(run, 1))).await;
        assert_eq!(written.expect("written while the other group waits").expect("committed").events.len(), 1);
    }
    assert!(!blocked.is_finished(), "the held group is still waiting for its row");
    sqlx::query("COMMIT").execute(&mut held).await.expect("release the run");
    blocked.await.expect("task").expect("the blocked commit");
}

/// The events' reference to their run is not checked by the database (migration 0013: its check
/// cost a locked lookup per event); the write path keeps it. A commit for a run that does not
/// exist, alone or inside a group, is `NotFound` and writes no event, and the group's other
/// commits are written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_of_a_run_that_does_not_exist_are_never_written() {
    let Some(url) = url() else { return };
    let (store, _guard) = one_committer(&url, 64).await;
    let schema = store.schema().expect("schema").to_owned();
    let mut conn = raw(&url, &schema).await;
    let checked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid \
         JOIN pg_namespace n ON n.oid = t.relnamespace \
         WHERE n.nspname = $1 AND t.relname = 'run_events' AND c.contype = 'f'",
    )
    .bind(&schema)
    .fetch_one(&mut conn)
    .await
    .expect("constraints");
    assert_eq!(checked, 0, "run_events has no foreign key");

    let alone = store.commit(on_queued(&RunId::new(), 3)).await;
    assert!(matches!(alone, Err(StoreError::NotFound("run"))), "{alone:?}");
    let runs = [queued_run(&store).await, queued_run(&store).await];
    let results =
        as_one_group(&url, &store, vec![on_queued(&runs[0], 2), on_queued(&RunId::new(), 4), on_queued(&runs[1], 1)])
            .await;
    assert_eq!(results[0].as_ref().expect("first").events.len(), 2);
    assert!(matches!(results[1], Err(StoreError::NotFound("run"))), "{:?}", results[1]);
    assert_eq!(results[2].as_ref().expect("last").events.len(), 1);

    let orphans: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM run_events e WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.id = e.run_id)",
    )
    .fetch_one(&mut conn)
    .await
    .expect("orphans");
    assert_eq!(orphans, 0, "every event belongs to a run");
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM run_events").fetch_one(&mut conn).await.expect("count");
    // the group's three, and the one of the run that held the committer (runs start without any)
    assert_eq!(written, 3 + 1, "nothing but the runs' own events");
}

/// A commit that moves one call twice (an answer's `allowed`, then the attempt's `executing`,
/// joined into one transaction) is written inside a group like any other: each move in order, and
/// no regroup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_moved_twice_by_one_commit_is_written_in_its_group() {
    let Some(url) = url() else { return };
    let (store, _guard) = one_committer(&url, 64).await;
    let runs = [queued_run(&store).await, queued_run(&store).await];
    let call = new_call(&runs[0], ToolCallState::Asking);
    let mut insert = on_queued(&runs[0], 1);
    insert.tool_calls.push(ToolCallChange::Insert(call.clone()));
    store.commit(insert).await.expect("insert the call");

    let regrouped = store.commit_stats().regrouped;
    let mut twice = on_queued(&runs[0], 1);
    twice.tool_calls.push(ToolCallChange::transition(&call.id, ToolCallState::Asking, ToolCallState::Allowed));
    twice.tool_calls.push(ToolCallChange::Update(keel_core::store::ToolCallUpdate {
        attempts: Some(1),
        started_at: Some(now()),
        ..keel_core::store::ToolCallUpdate::new(&call.id, ToolCallState::Allowed, ToolCallState::Executing)
    }));
    let results = as_one_group(&url, &store, vec![twice, on_queued(&runs[1], 2)]).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(store.commit_stats().regrouped, regrouped, "written by the group itself");
    let stored = store.list_tool_calls(&runs[0]).await.expect("calls").pop().expect("the call");
    assert_eq!((stored.state, stored.attempts), (ToolCallState::Executing, 1));
    assert!(stored.started_at.is_some());

    // a second move from another state than the first left it in: refused, alone, and the call
    // is as it was
    let mut wrong = on_queued(&runs[0], 1);
    wrong.tool_calls.push(ToolCallChange::transition(&call.id, ToolCallState::Executing, ToolCallState::Succeeded));
    wrong.tool_calls.push(ToolCallChange::transition(&call.id, ToolCallState::Executing, ToolCallState::Failed));
    let results = as_one_group(&url, &store, vec![wrong, on_queued(&runs[1], 1)]).await;
    assert!(matches!(results[0], Err(StoreError::Conflict(_))), "{:?}", results[0]);
    assert!(results[1].is_ok(), "{:?}", results[1]);
    let stored = store.list_tool_calls(&runs[0]).await.expect("calls").pop().expect("the call");
    assert_eq!(stored.state, ToolCallState::Executing);
    assert_eq!(store.list_events(&runs[1], 0, 100).await.expect("events").len(), 3);
}

/// A commit that inserts a call and moves it (a model's call, classified in the same commit) is
/// written inside a group in one row, as the insert then the update would leave it; a move from
/// another state than the inserted one is refused, alone, as the lone path refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_inserted_and_moved_by_one_commit_is_written_in_its_group() {
    let Some(url) = url() else { return };
    let (store, _guard) = one_committer(&url, 64).await;
    let runs = [queued_run(&store).await, queued_run(&store).await, queued_run(&store).await];
    let (asked, wrong) = (new_call(&runs[0], ToolCallState::Requested), new_call(&runs[1], ToolCallState::Requested));
    let mut ask = on_queued(&runs[0], 1);
    ask.tool_calls.push(ToolCallChange::Insert(asked.clone()));
    ask.tool_calls.push(ToolCallChange::Update(keel_core::store::ToolCallUpdate {
        summary: Some("asked".into()),
        ..keel_core::store::ToolCallUpdate::new(&asked.id, ToolCallState::Requested, ToolCallState::Asking)
    }));
    let mut refused = on_queued(&runs[1], 1);
    refused.tool_calls.push(ToolCallChange::Insert(wrong.clone()));
    refused.tool_calls.push(ToolCallChange::transition(&wrong.id, ToolCallState::Allowed, ToolCallState::Executing));
    let regrouped = store.commit_stats().regrouped;
    let results = as_one_group(&url, &store, vec![ask, on_queued(&runs[2], 2)]).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert_eq!(store.commit_stats().regrouped, regrouped, "written by the group itself");
    let stored = store.list_tool_calls(&runs[0]).await.expect("calls").pop().expect("the call");
    assert_eq!((stored.state, stored.summary.as_ref().map(|s| s.as_str())), (ToolCallState::Asking, Some("asked")));

    let results = as_one_group(&url, &store, vec![refused, on_queued(&runs[2], 1)]).await;
    assert!(matches!(results[0], Err(StoreError::Conflict(_))), "{:?}", results[0]);
    assert!(results[1].is_ok(), "{:?}", results[1]);
    // refused past its fence: the group is written again without it, as any such refusal
    assert_eq!(store.commit_stats().regrouped, regrouped + 1);
    assert!(store.list_tool_calls(&runs[1]).await.expect("calls").is_empty(), "nothing of the refused commit");
    assert_eq!(store.list_events(&runs[2], 0, 100).await.expect("events").len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grouped_commit_moves_the_lease_only_with_the_status() {
    let Some(url) = url() else { return };
    let (store, _guard) = one_committer(&url, 64).await;
    let start = now();
    let lease_until = start + chrono::Duration::seconds(60);
    let mut runs = Vec::new();
    for _ in 0..2 {
        let run = queued_run(&store).await;
        let from = vec![RunStatus::Queued];
        let mut take = Commit::new(run.clone(), Fence::Acquire { owner: "w1".into(), from, lease_until }, start);
        take.run = Some(RunChange { to: RunStatus::Running, reason: None, via: None });
        store.commit(take).await.expect("take the run");
        runs.push(run);
    }
    let later = start + chrono::Duration::seconds(600);
    let lease = || Fence::Lease { owner: "w1".into(), lease_until: later };
    let same = Commit::new(runs[0].clone(), lease(), start).event(EventKind::NodeStarted { node: "a".into() });
    let mut done = Commit::new(runs[1].clone(), lease(), start).event(EventKind::NodeStarted { node: "b".into() });
    done.run = Some(RunChange { to: RunStatus::Completed, reason: None, via: None });
    for result in as_one_group(&url, &store, vec![same, done]).await {
        result.expect("commit");
    }
    let same = store.get_run(&runs[0]).await.expect("get").expect("run");
    assert_eq!((same.status, same.lease_owner.as_deref()), (RunStatus::Running, Some("w1")));
    assert_eq!(same.lease_expires_at, Some(lease_until), "the status stayed: so did the lease");
    let done = store.get_run(&runs[1]).await.expect("get").expect("run");
    assert_eq!((done.status, done.lease_owner, done.lease_expires_at), (RunStatus::Completed, None, None));
}

/// A group's commits that end their runs say whether runs wait behind them, as a lone commit's do:
/// the engine looks for the next run only when one waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grouped_end_says_whether_runs_wait_behind_it() {
    let Some(url) = url() else { return };
    let (store, _guard) = one_committer(&url, 64).await;
    let (behind, alone, going_on) = (queued_run(&store).await, queued_run(&store).await, queued_run(&store).await);
    let conversation = store.get_run(&behind).await.expect("get").expect("run").conversation_id;
    let waiting = NewRun { enqueue: Some(vec![]), content: "next".into(), ..new_run(&conversation) };
    let waiting = store.start_run(waiting).await.expect("enqueue");
    assert_eq!(waiting.run.status, RunStatus::Waiting);
    let end = |run: &RunId| {
        let mut c = on_queued(run, 1);
        c.run = Some(RunChange { to: RunStatus::Cancelled, reason: None, via: None });
        c
    };
    // a run that does not end says nothing waits, whatever waits behind it
    let going_on_behind = store.get_run(&going_on).await.expect("get").expect("run").conversation_id;
    let more = NewRun { enqueue: Some(vec![]), content: "later".into(), ..new_run(&going_on_behind) };
    store.start_run(more).await.expect("enqueue");
    let results = as_one_group(&url, &store, vec![end(&behind), end(&alone), on_queued(&going_on, 1)]).await;
    let said: Vec<bool> = results.into_iter().map(|r| r.expect("commit").waiting_behind).collect();
    assert_eq!(said, [true, false, false]);
    assert_eq!(store.commit_stats().regrouped, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_commit_queue_refuses_at_once_and_loses_nothing_accepted() {
    let Some(url) = url() else { return };
    const QUEUE: usize = 4;
    let (store, _guard) = one_committer(&url, QUEUE).await;
    let mut runs = Vec::new();
    for _ in 0..12 {
        runs.push(queued_run(&store).await);
    }
    let blocker = queued_run(&store).await;
    let mut held = hold_run(&url, &store, &blocker).await;
    let blocked = commit_in_background(&store, on_queued(&blocker, 1));
    eventually("the committer is inside the blocked group", || store.commit_stats().groups == 1).await;

    let answers: Vec<Answer> = runs.iter().map(|run| commit_in_background(&store, on_queued(run, 2))).collect();
    eventually("the queue is full and the others are answered", || {
        store.queued_commits() == QUEUE && answers.iter().filter(|a| a.is_finished()).count() == runs.len() - QUEUE
    })
    .await;
    sqlx::query("COMMIT").execute(&mut held).await.expect("release the run");
    blocked.await.expect("task").expect("the blocked commit");

    let (mut accepted, mut overloaded) = (0, 0);
    for (run, answer) in runs.iter().zip(answers) {
        let answer = answer.await.expect("task");
        let stored = store.list_events(run, 0, 100).await.expect("events").len();
        match answer {
            Ok(committed) => {
                accepted += 1;
                assert_eq!((committed.events.len(), stored), (2, 2), "an accepted commit is written");
            }
            Err(StoreError::Overloaded) => {
                overloaded += 1;
                assert_eq!(stored, 0, "a refused commit is not written");
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert_eq!((accepted, overloaded), (QUEUE, runs.len() - QUEUE));
    // the queue drained: commits are accepted again
    store.commit(on_queued(&runs[0], 1)).await.expect("accepted again");
}

/// The committers write on connections of their own: with every connection of the store's pool
/// held by readers, commits are still written at once (they used to wait for one, up to the pool's
/// acquire timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_are_written_while_every_reader_connection_is_busy() {
    let Some(url) = url() else { return };
    let (store, _guard) = one_committer(&url, 64).await;
    let runs = [queued_run(&store).await, queued_run(&store).await];
    // every connection the pool can give (the store keeps some of its own for its hot reads)
    let size = store.pool().options().get_max_connections();
    let mut held = Vec::new();
    while let Ok(conn) = tokio::time::timeout(Duration::from_millis(300), store.pool().acquire()).await {
        held.push(conn.expect("a reader connection"));
    }
    assert_eq!((store.pool().size(), store.pool().num_idle()), (size, 0), "every reader connection is held");
    for run in &runs {
        let committed = tokio::time::timeout(Duration::from_secs(5), store.commit(on_queued(run, 2)))
            .await
            .expect("a commit does not wait for a reader connection")
            .expect("commit");
        assert_eq!(committed.events.len(), 2);
    }
    drop(held);
    for run in &runs {
        assert_eq!(store.list_events(run, 0, 100).await.expect("events").len(), 2, "both commits are stored");
    }
}

/// How often `table` of `schema` was read whole, as PostgreSQL's statistics say.
async fn seq_scans(conn: &mut PgConnection, schema: &str, table: &str) -> i64 {
    sqlx::query_scalar("SELECT seq_scan FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = $2")
        .bind(schema)
        .bind(table)
        .fetch_one(conn)
        .await
        .expect("table statistics")
}

/// A store on `schema` with one committer, whose sessions are named `name` (`application_name`):
/// a test can find them in `pg_stat_activity`, end them, or wait for their statistics.
async fn named_store(url: &str, schema: &str, name: &str) -> PostgresStore {
    let separator = if url.contains('?') { '&' } else { '?' };
    PostgresStore::connect_with_schema_and(
        &format!("{url}{separator}application_name={name}"),
        schema,
        PostgresOptions { commit_queue: 64, committers: 1, ..PostgresOptions::default() },
    )
    .await
    .expect("connect")
}

/// Closes `store`, ends its sessions (named `name`) and waits until they are gone: a session sends
/// its counts to the statistics as it ends, at the latest.
async fn close_and_count(store: PostgresStore, conn: &mut PgConnection, name: &str) {
    store.close().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left: Vec<bool> =
            sqlx::query_scalar("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1")
                .bind(name)
                .fetch_all(&mut *conn)
                .await
                .expect("sessions");
        if left.is_empty() {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "the store's sessions did not end");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The committers find rows by their keys, whatever the tables' size: on a new database (tables
/// of a page, statistics not gathered), where a plan kept for the connection's life would read
/// `runs` and `tool_calls` whole at every commit, lone commits and groups read them only by index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_committers_find_rows_by_key_on_a_new_database() {
    let Some(url) = url() else { return };
    let (_, guard) = connect_fresh(&url).await;
    let schema = guard.0.schema().expect("schema").to_owned();
    let options = PostgresOptions { commit_queue: 64, committers: 1, ..PostgresOptions::default() };
    let named = |name: &str| {
        let separator = if url.contains('?') { '&' } else { '?' };
        format!("{url}{separator}application_name={name}")
    };
    let mut probe = PgConnection::connect(&url).await.expect("connect");
    // the runs started by one store, closed and counted
    let setup_name = format!("{schema}_setup");
    let setup =
        PostgresStore::connect_with_schema_and(&named(&setup_name), &schema, options.clone()).await.expect("connect");
    let runs = [queued_run(&setup).await, queued_run(&setup).await, queued_run(&setup).await];
    close_and_count(setup, &mut probe, &setup_name).await;
    let before = (seq_scans(&mut probe, &schema, "runs").await, seq_scans(&mut probe, &schema, "tool_calls").await);
    // the commits by another, whose readers read nothing
    let name = format!("{schema}_commits");
    let store = PostgresStore::connect_with_schema_and(&named(&name), &schema, options).await.expect("connect");
    let call = new_call(&runs[0], ToolCallState::Requested);
    for round in 0..3 {
        for run in &runs {
            // lone commits (events only)
            store.commit(on_queued(run, 1)).await.expect("a lone commit");
        }
        // groups of one: the call inserted, moved, and moved again
        let mut c = on_queued(&runs[0], 1);
        c.tool_calls.push(match round {
            0 => ToolCallChange::Insert(call.clone()),
            1 => ToolCallChange::transition(&call.id, ToolCallState::Requested, ToolCallState::Asking),
            _ => ToolCallChange::transition(&call.id, ToolCallState::Asking, ToolCallState::Allowed),
        });
        store.commit(c).await.expect("a grouped commit");
    }
    close_and_count(store, &mut probe, &name).await;
    let after = (seq_scans(&mut probe, &schema, "runs").await, seq_scans(&mut probe, &schema, "tool_calls").await);
    assert_eq!(after, before, "the committer read runs or tool_calls whole");
    drop(guard);
}

/// A run's commits that leave its status as it is change no indexed column of `runs`, so
/// PostgreSQL writes them as heap-only tuples (no new entry in each of the table's indexes): the
/// pruner's index names `finished_at`, which stays NULL until the run is over, not `updated_at`.
/// The commit that ends the run changes its status, and its indexes, as it must.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_runs_commits_are_heap_only_updates() {
    let Some(url) = url() else { return };
    let (_, guard) = connect_fresh(&url).await;
    let schema = guard.0.schema().expect("schema").to_owned();
    let name = format!("{schema}_hot");
    let store = named_store(&url, &schema, &name).await;
    let run = queued_run(&store).await;
    for _ in 0..10 {
        store.commit(on_queued(&run, 2)).await.expect("a commit");
    }
    let mut end = on_queued(&run, 1);
    end.run = Some(RunChange { to: RunStatus::Cancelled, reason: Some("test".into()), via: None });
    store.commit(end).await.expect("the run's end");
    let mut probe = PgConnection::connect(&url).await.expect("connect");
    close_and_count(store, &mut probe, &name).await;
    let (updates, hot): (i64, i64) = sqlx::query_as(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = 'runs'",
    )
    .bind(&schema)
    .fetch_one(&mut probe)
    .await
    .expect("table statistics");
    assert_eq!(updates, 11, "ten commits and the end, one update each");
    assert_eq!(hot, 10, "the ten commits that left the status as it was, and not the end");
    let finished: Option<DateTime<Utc>> =
        sqlx::query_scalar(&format!("SELECT finished_at FROM {schema}.runs WHERE id = $1"))
            .bind(run.as_str())
            .fetch_one(&mut probe)
            .await
            .expect("finished_at");
    assert!(finished.is_some(), "an ended run has its finish time");
    drop(guard);
}

/// Reads cut off midway (their callers stopped waiting, as a closed request does) leave nothing
/// behind for the reads after them: whichever connection those get, they see the rows as they are.
/// (The store uses a connection again untested only after a statement that ended with the
/// database's answer.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_cut_off_midway_leave_the_next_reads_right() {
    let Some(url) = url() else { return };
    let (store, guard) = connect_fresh(&url).await;
    let schema = store.schema().expect("schema").to_owned();
    let run = queued_run(&store).await;
    let conversation = store.get_run(&run).await.expect("read").expect("the run").conversation_id;
    let next = store.get_run(&run).await.expect("read").expect("the run").next_sequence;
    let mut probe = PgConnection::connect(&url).await.expect("connect");
    let mut lock = probe.begin().await.expect("begin");
    sqlx::query(&format!("LOCK TABLE {schema}.runs IN ACCESS EXCLUSIVE MODE"))
        .execute(&mut *lock)
        .await
        .expect("lock runs");
    for _ in 0..10 {
        let read = tokio::time::timeout(Duration::from_millis(50), store.get_run(&run)).await;
        assert!(read.is_err(), "a read of runs waits for the lock: {read:?}");
    }
    lock.rollback().await.expect("unlock");
    store.commit(on_queued(&run, 3)).await.expect("a commit");
    for _ in 0..20 {
        let read = store.get_run(&run).await.expect("read").expect("the run");
        assert_eq!((read.id.clone(), read.next_sequence), (run.clone(), next + 3));
        let window = store.context_window(&conversation).await.expect("the context window");
        assert_eq!(window.messages.len(), 1, "the run's message");
    }
    drop(guard);
}

/// A connection the database ended while it sat in the pool is found out before it is handed out
/// again: reads and commits after every session of the store was ended go on, on new connections.
/// (The pools hand out a connection used less than `TEST_IDLE_AFTER` ago untested, a round trip
/// saved per statement; the test covers the ones idle longer.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_ended_while_idle_are_replaced_before_use() {
    let Some(url) = url() else { return };
    let (_, guard) = connect_fresh(&url).await;
    let schema = guard.0.schema().expect("schema").to_owned();
    let name = format!("{schema}_idle");
    let store = named_store(&url, &schema, &name).await;
    let run = queued_run(&store).await;
    store.commit(on_queued(&run, 1)).await.expect("a commit");
    let next = store.get_run(&run).await.expect("read").expect("the run").next_sequence;
    let mut probe = PgConnection::connect(&url).await.expect("connect");
    let ended: Vec<bool> =
        sqlx::query_scalar("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1")
            .bind(&name)
            .fetch_all(&mut probe)
            .await
            .expect("end the sessions");
    assert!(ended.len() >= 2, "the store's reader and committer sessions were ended: {ended:?}");
    tokio::time::sleep(PostgresStore::TEST_IDLE_AFTER + Duration::from_millis(200)).await;
    for attempt in 0..3 {
        let read = store.get_run(&run).await.unwrap_or_else(|e| panic!("read {attempt} after the sessions ended: {e}"));
        assert_eq!(read.expect("the run").next_sequence, next);
    }
    store.commit(on_queued(&run, 1)).await.expect("a commit after the sessions ended");
    assert_eq!(store.get_run(&run).await.expect("read").expect("the run").next_sequence, next + 1);
    let started = queued_run(&store).await;
    assert_ne!(started, run);
    drop(guard);
}

/// The hot reads — a step's context, an answer's view, a run — find rows by their keys on a new
/// database too (tables of a page, their statistics just gathered), where a plan kept for the
/// connection's life could read `tool_calls`, `messages` or `runs` whole at every later read, however
/// large they grow: they run on connections of their own that keep each statement's first plan
/// and read indexes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hot_reads_find_rows_by_key_on_a_new_database() {
    let Some(url) = url() else { return };
    let (_, guard) = connect_fresh(&url).await;
    let schema = guard.0.schema().expect("schema").to_owned();
    let mut probe = PgConnection::connect(&url).await.expect("connect");
    // a run whose conversation holds a tool call and the message of its result
    let setup_name = format!("{schema}_setup");
    let setup = named_store(&url, &schema, &setup_name).await;
    let run = queued_run(&setup).await;
    let conversation = setup.get_run(&run).await.expect("read").expect("the run").conversation_id;
    let call = new_call(&run, ToolCallState::Requested);
    let mut commit = on_queued(&run, 1);
    commit.tool_calls.push(ToolCallChange::Insert(call.clone()));
    commit.messages.push(Message {
        id: MessageId::new(),
        conversation_id: conversation.clone(),
        run_id: Some(run.clone()),
        role: Role::Tool,
        content: "done".into(),
        tool_call_id: Some(call.id.clone()),
        created_at: now(),
    });
    setup.commit(commit).await.expect("the call and its result");
    close_and_count(setup, &mut probe, &setup_name).await;
    let tables = ["tool_calls", "messages", "runs"];
    // statistics of tables of a page, as autovacuum gathers them early on a new database: from
    // then on a whole-table read is the cheaper plan, and a plan kept would stay one
    for table in tables {
        sqlx::query(&format!("ANALYZE {schema}.{table}")).execute(&mut probe).await.expect("analyze");
    }
    let mut before = Vec::new();
    for table in tables {
        before.push(seq_scans(&mut probe, &schema, table).await);
    }
    // the reads, by another store: more than the five a statement is planned afresh for
    let name = format!("{schema}_reads");
    let store = named_store(&url, &schema, &name).await;
    for _ in 0..12 {
        let window = store.context_window(&conversation).await.expect("the context window");
        assert_eq!(window.tool_calls.len(), 1, "the call its tool message answers");
        let view = store.answer_view(&run, "alice").await.expect("the answer view");
        assert_eq!(view.tool_calls.len(), 1);
        assert!(store.get_run(&run).await.expect("read").is_some());
    }
    close_and_count(store, &mut probe, &name).await;
    let mut after = Vec::new();
    for table in tables {
        after.push(seq_scans(&mut probe, &schema, table).await);
    }
    assert_eq!(after, before, "a hot read read {tables:?} whole");
    drop(guard);
}

/// Two instances on one database: their groups take the run rows in one order, so commits on the
/// same runs from both never deadlock, and every one is written once, in contiguous sequences.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_on_one_schema_commit_the_same_runs_without_deadlock() {
    let Some(url) = url() else { return };
    let (a, _guard) = connect_fresh(&url).await;
    let b = PostgresStore::connect_with_schema(&url, a.schema().expect("schema")).await.expect("connect again");
    const RUNS: usize = 8;
    const TASKS: usize = 8;
    const ROUNDS: usize = 25;
    let mut runs = Vec::new();
    for _ in 0..RUNS {
        runs.push(queued_run(&a).await);
    }
    let runs = Arc::new(runs);
    let mut tasks = Vec::new();
    for (s, store) in [a.clone(), b.clone()].into_iter().enumerate() {
        for t in 0..TASKS {
            let (store, runs) = (store.clone(), runs.clone());
            tasks.push(tokio::spawn(async move {
                let mut failures = Vec::new();
                for i in 0..ROUNDS {
                    // each store walks the runs in the other's reverse order
                    let k = (t + i) % RUNS;
                    let run = &runs[if s == 0 { k } else { RUNS - 1 - k }];
                    let run_row = store.get_run(run).await.expect("get");
                    let mut commit = on_queued(run, 2);
                    commit.facts.push(Fact {
                        key: format!("k{}", i % 3),
                        value: format!("{s}-{t}-{i}").into(),
                        source: FactSource::ToolResult,
                        updated_at: now(),
                    });
                    commit.messages.push(Message {
                        id: MessageId::new(),
                        conversation_id: run_row.expect("run").conversation_id,
                        run_id: Some(run.clone()),
                        role: Role::Tool,
                        content: "m".into(),
                        tool_call_id: None,
                        created_at: now(),
                    });
                    if let Err(e) = store.commit(commit).await {
                        failures.push(e.to_string());
                    }
                }
                failures
            }));
        }
    }
    let mut failures = Vec::new();
    for task in tasks {
        failures.extend(task.await.expect("task"));
    }
    assert!(failures.is_empty(), "every commit is written: {failures:?}");
    let per_run = (2 * TASKS * ROUNDS / RUNS) as i64;
    for run in runs.iter() {
        let events = a.list_events(run, 0, 1000).await.expect("events");
        assert_eq!(events.iter().map(|e| e.sequence).collect::<Vec<_>>(), (1..=2 * per_run).collect::<Vec<_>>());
        let conversation = a.get_run(run).await.expect("get").expect("run").conversation_id;
        assert_eq!(a.list_messages(&conversation).await.expect("messages").len() as i64, 1 + per_run);
    }
    let (sa, sb) = (a.commit_stats(), b.commit_stats());
    assert_eq!(sa.commits + sb.commits, (2 * TASKS * ROUNDS) as u64);
    b.close().await;
}
