//! Opening SQLite databases: files, urls, memory, re-opening, and rows the store cannot read.

use chrono::{DateTime, Utc};
use keel_core::store::prelude::*;
use keel_core::store::{NewRun, StoreError};
use keel_store::SqliteStore;
use tempfile::TempDir;

fn now() -> DateTime<Utc> {
    DateTime::from_timestamp(1_893_499_200, 0).expect("time")
}

#[tokio::test]
async fn a_file_keeps_its_data_across_opens_and_migrations() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("nested/dir/keel.db");
    SqliteStore::migrate_only(&path).await.expect("migrate creates the file and its directory");
    assert!(path.exists());

    let store = SqliteStore::open(&path).await.expect("open");
    let conversation = store.create_conversation("alice", &"t".into(), "ops", now()).await.expect("create");
    store.close().await;

    // migrating again is a no-op; the url form opens the same file
    SqliteStore::migrate_only(&path).await.expect("migrate again");
    let url = format!("sqlite://{}", path.display());
    let store = SqliteStore::open_url(&url).await.expect("open url");
    assert_eq!(store.get_conversation(&conversation.id).await.expect("get"), Some(conversation));
    store.ping().await.expect("ping");
}

#[tokio::test]
async fn an_in_memory_database_reads_its_own_writes() {
    let store = SqliteStore::open_url("sqlite::memory:").await.expect("open");
    let conversation = store.create_conversation("alice", &"t".into(), "ops", now()).await.expect("create");
    assert_eq!(store.list_conversations("alice", 10).await.expect("list"), vec![conversation]);
}

#[tokio::test]
async fn a_bad_url_is_an_error_not_a_panic() {
    let err = SqliteStore::open_url("postgres://localhost/keel").await.expect_err("not sqlite");
    assert!(matches!(err, StoreError::Backend(_)), "{err:?}");
}

/// A conversation of alice's, and a run started on it with `events` first.
async fn run_with(
    store: &SqliteStore,
    events: Vec<keel_core::event::EventKind>,
) -> (keel_core::domain::Conversation, keel_core::store::StartedRun) {
    let conversation = store.create_conversation("alice", &"t".into(), "ops", now()).await.expect("create");
    let started = store
        .start_run(NewRun {
            conversation_id: conversation.id.clone(),
            agent_id: "ops".into(),
            user_id: "alice".into(),
            content: "hi".into(),
            cancel_on_disconnect: false,
            now: now(),
            events,
            enqueue: None,
            lease: None,
        })
        .await
        .expect("start");
    (conversation, started)
}

#[tokio::test]
async fn an_unreadable_row_is_a_backend_error() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("keel.db");
    let store = SqliteStore::open(&path).await.expect("open");
    let (conversation, started) = run_with(&store, vec![]).await;

    // someone else wrote rows this version cannot read
    let raw = rusqlite::Connection::open(&path).expect("raw connection");
    raw.execute(
        "UPDATE runs SET checkpoint = '{\"nextStep\": \"secret-token-123\"}' WHERE id = ?",
        [started.run.id.as_str()],
    )
    .expect("corrupt the checkpoint");
    raw.execute("UPDATE messages SET created_at = 'yesterday'", []).expect("corrupt a message");
    drop(raw);

    match store.get_run(&started.run.id).await {
        Err(StoreError::Backend(message)) => {
            assert!(message.contains("runs.checkpoint"), "{message}");
            assert!(!message.contains("secret-token-123"), "no row content in errors: {message}");
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
    match store.list_messages(&conversation.id).await {
        Err(StoreError::Backend(message)) => assert!(message.contains("messages.created_at"), "{message}"),
        other => panic!("expected a backend error, got {other:?}"),
    }
}

/// The migrations are recorded as the migrator of earlier versions recorded them (same table, same
/// SHA-384 checksums), so a database those versions made opens as it is.
#[tokio::test]
async fn migrations_are_recorded_with_their_checksums() {
    use sha2::{Digest, Sha384};
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("keel.db");
    SqliteStore::migrate_only(&path).await.expect("migrate");
    let raw = rusqlite::Connection::open(&path).expect("raw connection");
    let mut st =
        raw.prepare("SELECT version, success, checksum FROM _sqlx_migrations ORDER BY version").expect("query");
    let rows: Vec<(i64, bool, Vec<u8>)> = st
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .expect("rows")
        .collect::<Result<_, _>>()
        .expect("rows");
    let files = [
        include_str!("../migrations/sqlite/0001_init.sql"),
        include_str!("../migrations/sqlite/0002_credentials.sql"),
        include_str!("../migrations/sqlite/0003_ag_ui.sql"),
        include_str!("../migrations/sqlite/0004_runs_by_user.sql"),
        include_str!("../migrations/sqlite/0005_interrupt_notes.sql"),
        include_str!("../migrations/sqlite/0006_agents.sql"),
        include_str!("../migrations/sqlite/0007_run_worker.sql"),
        include_str!("../migrations/sqlite/0008_checks_without_in_lists.sql"),
        include_str!("../migrations/sqlite/0009_retention.sql"),
        include_str!("../migrations/sqlite/0010_multitask.sql"),
        include_str!("../migrations/sqlite/0011_rollback_intent.sql"),
        include_str!("../migrations/sqlite/0012_run_hidden.sql"),
        include_str!("../migrations/sqlite/0013_event_data_format.sql"),
    ];
    assert_eq!(rows.len(), files.len());
    for ((version, success, checksum), (i, sql)) in rows.iter().zip(files.iter().enumerate()) {
        assert_eq!(*version, i as i64 + 1);
        assert!(success);
        assert_eq!(checksum.as_slice(), Sha384::digest(sql.as_bytes()).as_slice(), "migration {version}");
    }
}

#[tokio::test]
async fn a_database_with_unknown_or_changed_or_failed_migrations_is_refused() {
    let cases = [
        ("INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)           VALUES (99, 'future', 1, x'00', 0)", "newer"),
        ("UPDATE _sqlx_migrations SET checksum = x'00' WHERE version = 2", "differs"),
        ("UPDATE _sqlx_migrations SET success = 0 WHERE version = 4", "failed part-way"),
    ];
    for (tamper, expected) in cases {
        let dir = TempDir::new().expect("temp dir");
        let path = dir.path().join("keel.db");
        SqliteStore::migrate_only(&path).await.expect("migrate");
        rusqlite::Connection::open(&path).expect("raw").execute(tamper, []).expect("tamper");
        match SqliteStore::open(&path).await {
            Err(StoreError::Backend(message)) => assert!(message.contains(expected), "{expected}: {message}"),
            other => panic!("{expected}: expected a refusal, got {:?}", other.map(|_| ())),
        }
    }
}

#[tokio::test]
async fn a_closed_store_answers_with_errors() {
    let dir = TempDir::new().expect("temp dir");
    let store = SqliteStore::open(&dir.path().join("keel.db")).await.expect("open");
    let clone = store.clone();
    store.close().await;
    assert!(matches!(clone.create_conversation("alice", &"t".into(), "ops", now()).await, Err(StoreError::Backend(_))));
    assert!(matches!(clone.list_conversations("alice", 10).await, Err(StoreError::Backend(_))));
}

/// Waits (up to 10 s) until the database file is larger than `size` bytes: a checkpoint copied the
/// WAL into it.
async fn the_file_grows_past(path: &std::path::Path, size: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let now = std::fs::metadata(path).expect("db file").len();
        if now > size {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "the database file stayed at {now} bytes (waited for {size})");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// The writer never checkpoints; the checkpointer thread copies the WAL into the database file on
/// its own, so the file grows (and the WAL stays bounded) while the store is open.
#[tokio::test]
async fn the_wal_is_checkpointed_while_the_store_is_open() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("keel.db");
    let store = SqliteStore::open(&path).await.expect("open");
    let before = std::fs::metadata(&path).expect("db file").len();
    for i in 0..300 {
        store.create_conversation("alice", &"x".repeat(1000 + i).into(), "ops", now()).await.expect("create");
    }
    // a few checkpoint periods
    the_file_grows_past(&path, before + 200 * 1024).await;
    assert_eq!(store.list_conversations("alice", 1000).await.expect("list").len(), 300);
}

/// A checkpoint that a reader held back is tried again though nothing new is written: the
/// checkpointer skips a tick only when the writer committed nothing since a checkpoint that copied
/// the whole WAL.
#[tokio::test]
async fn a_checkpoint_a_reader_held_back_is_done_once_it_lets_go() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("keel.db");
    let store = SqliteStore::open(&path).await.expect("open");
    store.create_conversation("alice", &"first".into(), "ops", now()).await.expect("create");
    // a reader whose snapshot is older than the writes below: no checkpoint can copy them
    let reader = rusqlite::Connection::open(&path).expect("raw connection");
    reader.execute_batch("BEGIN").expect("begin");
    let seen: i64 = reader.query_row("SELECT count(*) FROM conversations", [], |r| r.get(0)).expect("read");
    assert_eq!(seen, 1);
    let before = std::fs::metadata(&path).expect("db file").len();
    for i in 0..300 {
        store.create_conversation("alice", &"x".repeat(1000 + i).into(), "ops", now()).await.expect("create");
    }
    // no checkpoint copies these writes while the reader's older snapshot lives (the WAL keeps
    // every frame a live reader may need)
    assert!(std::fs::metadata(&path).expect("db file").len() < before + 200 * 1024, "copied past a live reader");
    reader.execute_batch("COMMIT").expect("end the read");
    drop(reader);
    // no write since: the next checkpoints copy the rest all the same
    the_file_grows_past(&path, before + 200 * 1024).await;
    assert_eq!(store.list_conversations("alice", 1000).await.expect("list").len(), 301);
}

/// Closing checkpoints the whole WAL: afterwards the -wal file is gone (or empty), and a copy of
/// the database file alone holds every row. Many rounds, each closing right after its last write,
/// while the checkpointer is busy (the race that used to lose).
#[tokio::test]
async fn after_close_the_database_file_alone_holds_every_write() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("keel.db");
    let mut expected = Vec::new();
    for round in 0..20 {
        let store = SqliteStore::open(&path).await.expect("open");
        let writes: Vec<_> = (0..40)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move {
                    let conversation =
                        store.create_conversation("alice", &format!("{round}-{i}").into(), "ops", now()).await?;
                    let started = store
                        .start_run(NewRun {
                            conversation_id: conversation.id.clone(),
                            agent_id: "ops".into(),
                            user_id: "alice".into(),
                            content: "x".repeat(2000).into(),
                            cancel_on_disconnect: false,
                            now: now(),
                            events: vec![],
                            enqueue: None,
                            lease: None,
                        })
                        .await?;
                    Ok::<_, StoreError>(started.run.id)
                })
            })
            .collect();
        for write in writes {
            expected.push(write.await.expect("the task").expect("write"));
        }
        store.close().await;

        let wal = dir.path().join("keel.db-wal");
        let wal_len = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
        assert_eq!(wal_len, 0, "round {round}: the WAL is checkpointed whole at close");

        let copy_dir = TempDir::new().expect("temp dir");
        let copy = copy_dir.path().join("keel.db");
        std::fs::copy(&path, &copy).expect("copy the database file alone");
        let raw = rusqlite::Connection::open(&copy).expect("open the copy");
        let runs: i64 = raw.query_row("SELECT COUNT(*) FROM runs", [], |r| r.get(0)).expect("count runs");
        assert_eq!(runs as usize, expected.len(), "round {round}: every run is in the file alone");
        let mut st = raw.prepare("SELECT id FROM runs").expect("query");
        let ids: std::collections::HashSet<String> =
            st.query_map([], |r| r.get(0)).expect("ids").collect::<Result<_, _>>().expect("ids");
        assert!(expected.iter().all(|id| ids.contains(id.as_str())), "round {round}: a run is missing");
    }
}

/// The constraints on statuses, roles, states and kinds still refuse what they refused, but checking
/// them builds no temporary b-tree: SQLite evaluates an `IN` list of three or more values through
/// one, built and freed at each write (migration 8 rewrote them as `=` terms joined by `OR`).
#[tokio::test]
async fn the_constraints_refuse_bad_values_without_temporary_btrees() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("keel.db");
    SqliteStore::migrate_only(&path).await.expect("migrate");
    let raw = rusqlite::Connection::open(&path).expect("raw connection");
    raw.execute_batch("PRAGMA foreign_keys = ON").expect("foreign keys");
    let writes = [
        "UPDATE runs SET status = ?1 WHERE id = ?1",
        "UPDATE tool_calls SET state = ?1 WHERE id = ?1",
        "UPDATE interrupts SET status = ?1 WHERE id = ?1",
        "INSERT INTO messages (id, conversation_id, run_id, role, content, tool_call_id, created_at) \
         VALUES (?1, ?1, NULL, ?1, ?1, NULL, ?1)",
        "INSERT INTO interrupts (id, run_id, kind, status, payload, call_ids, created_at, expires_at) \
         VALUES (?1, ?1, ?1, ?1, '{}', '[]', ?1, ?1)",
        "INSERT INTO runs (id, conversation_id, user_message_id, user_id, status, checkpoint, created_at, updated_at) \
         VALUES (?1, ?1, ?1, ?1, ?1, '{}', ?1, ?1)",
        // a new message's look for a run it comes after (in every start's transaction), and the
        // start of a waiting run
        "SELECT COALESCE((SELECT id FROM runs WHERE conversation_id = ?1 \
         AND (status = 'queued' OR status = 'running' OR status = 'interrupted') LIMIT 1), \
         (SELECT id FROM runs WHERE conversation_id = ?1 AND status = 'waiting' ORDER BY created_at, id LIMIT 1))",
        "UPDATE runs SET status = 'queued', pending_content = NULL, next_sequence = next_sequence + ?1, \
         checkpoint = ?1, updated_at = ?1 WHERE id = ?1 AND status = 'waiting'",
        // a new message's conversation version (SQLite's `RETURNING` goes through one), a run's
        // interrupts, and the calls a context's tool results answer
        "UPDATE conversations SET version = version + 1 WHERE id = ?1",
        "SELECT version FROM conversations WHERE id = ?1",
        "SELECT * FROM interrupts WHERE run_id = ?1",
        "SELECT * FROM tool_calls WHERE id = ?1",
    ];
    for sql in writes {
        let mut explain = raw.prepare(&format!("EXPLAIN {sql}")).expect("explain");
        let ops: Vec<String> =
            explain.query_map(["x"], |r| r.get(1)).expect("ops").collect::<Result<_, _>>().expect("ops");
        assert!(!ops.iter().any(|op| op == "OpenEphemeral"), "{sql} builds a temporary b-tree: {ops:?}");
    }

    raw.execute_batch(
        "INSERT INTO conversations (id, user_id, title, version, created_at) VALUES ('c', 'u', 't', 1, 'now');
         INSERT INTO runs (id, conversation_id, user_message_id, user_id, status, checkpoint, created_at, updated_at)
             VALUES ('r', 'c', 'm', 'u', 'running', '{}', 'now', 'now');",
    )
    .expect("a valid run");
    let refused = [
        "UPDATE runs SET status = 'paused' WHERE id = 'r'",
        // Keel's writer skips the checks (its values are typed in Rust); any other writer is held
        // to them
        "UPDATE runs SET checkpoint = '{not json' WHERE id = 'r'",
        "INSERT INTO messages (id, conversation_id, run_id, role, content, created_at) VALUES ('m', 'c', 'r', 'system', '', 'now')",
        "INSERT INTO tool_calls (id, run_id, conversation_id, name, args, state) VALUES ('t', 'r', 'c', 'n', '{}', 'done')",
        "INSERT INTO interrupts (id, run_id, kind, status, payload, call_ids, created_at, expires_at) \
         VALUES ('i', 'r', 'confirm', 'pending', '{}', '[]', 'now', 'now')",
        "INSERT INTO interrupts (id, run_id, kind, status, payload, call_ids, created_at, expires_at) \
         VALUES ('i', 'r', 'tool_call', 'open', '{}', '[]', 'now', 'now')",
        // a second active run of the conversation
        "INSERT INTO runs (id, conversation_id, user_message_id, user_id, status, checkpoint, created_at, updated_at) \
         VALUES ('r2', 'c', 'm2', 'u', 'queued', '{}', 'now', 'now')",
        // a run of a conversation that does not exist
        "INSERT INTO runs (id, conversation_id, user_message_id, user_id, status, checkpoint, created_at, updated_at) \
         VALUES ('r3', 'nope', 'm3', 'u', 'completed', '{}', 'now', 'now')",
    ];
    for sql in refused {
        assert!(raw.execute_batch(sql).is_err(), "accepted: {sql}");
    }
    // what they allow, they still allow; a waiting run does not hold the conversation
    raw.execute_batch(
        "INSERT INTO runs (id, conversation_id, user_message_id, user_id, status, checkpoint, created_at, updated_at)
             VALUES ('r4', 'c', 'm4', 'u', 'cancelled', '{}', 'now', 'now');
         INSERT INTO runs (id, conversation_id, user_message_id, user_id, status, checkpoint, created_at, updated_at,
                           pending_content)
             VALUES ('r5', 'c', 'm5', 'u', 'waiting', '{}', 'now', 'now', 'next, please');
         INSERT INTO runs (id, conversation_id, user_message_id, user_id, status, checkpoint, created_at, updated_at)
             VALUES ('r6', 'c', 'm6', 'u', 'rolled_back', '{}', 'now', 'now');
         INSERT INTO messages (id, conversation_id, run_id, role, content, created_at) VALUES ('m', 'c', 'r', 'tool', '', 'now');
         INSERT INTO tool_calls (id, run_id, conversation_id, name, args, state) VALUES ('t', 'r', 'c', 'n', '{}', 'suspended');
         INSERT INTO interrupts (id, run_id, kind, status, payload, call_ids, created_at, expires_at)
             VALUES ('i', 'r', 'outcome_unknown', 'expired', '{}', '[]', 'now', 'now');",
    )
    .expect("valid rows");
}

/// An event read back keeps its stored data for its frames when it was stored in this version's
/// form, and is serialized again from its kind when it was not (written before the form was
/// recorded, or in another): a frame never carries data in a form this version does not write.
#[tokio::test]
async fn stored_event_data_goes_into_frames_only_in_this_versions_form() {
    use keel_core::event::{EventKind, DATA_FORMAT};
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("keel.db");
    let store = SqliteStore::open(&path).await.expect("open");
    let events = vec![
        EventKind::NodeStarted { node: "model".into() },
        EventKind::NodeFinished { node: "model".into(), duration_ms: 7 },
    ];
    let (_, started) = run_with(&store, events).await;
    let frame = |event: &keel_core::Event| {
        let mut out = Vec::new();
        event.write_json(&mut out).expect("write");
        String::from_utf8(out).expect("utf-8")
    };
    // The same data, spaced as no version of Keel writes it: a copy would show the spaces.
    let raw = rusqlite::Connection::open(&path).expect("raw connection");
    let formats: Vec<i64> = raw
        .prepare("SELECT data_format FROM run_events WHERE run_id = ? ORDER BY sequence")
        .expect("query")
        .query_map([started.run.id.as_str()], |r| r.get(0))
        .expect("rows")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert_eq!(formats, vec![DATA_FORMAT; 2], "written in this version's form");
    raw.execute(
        "UPDATE run_events SET data = '{ \"node\" : \"model\" }' WHERE run_id = ? AND sequence = 1",
        [started.run.id.as_str()],
    )
    .expect("respace the first");
    raw.execute(
        "UPDATE run_events SET data = '{ \"node\" : \"model\", \"durationMs\" : 7 }', data_format = 0 \
         WHERE run_id = ? AND sequence = 2",
        [started.run.id.as_str()],
    )
    .expect("respace the second, from before the form was recorded");
    drop(raw);

    let events = store.list_events(&started.run.id, 0, 10).await.expect("read");
    assert_eq!(events.len(), 2);
    for event in &events {
        assert_eq!(event, &started.events[(event.sequence - 1) as usize], "the same event");
    }
    // this version's form: the stored text, as it is
    assert!(frame(&events[0]).contains("{ \"node\" : \"model\" }".trim_start_matches('{').trim_end_matches('}')));
    // another form: serialized again, as this version writes it
    assert_eq!(frame(&events[1]), serde_json::to_string(&events[1]).expect("serialize"));
    assert!(!frame(&events[1]).contains(" : "));
}
