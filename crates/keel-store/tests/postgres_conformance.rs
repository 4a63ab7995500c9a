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
use keel_core::domain::{Checkpoint, RunStatus};
use keel_core::ids::RunId;
use keel_core::store::{ConversationStore, IdempotencyBegin, NewRun, RunStore, Store, StoreError};
use keel_store::PostgresStore;
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
