//! A database made by the previous release (Keel 0.1, before agents) opens and upgrades with
//! `keel migrate`, and keeps what it held; a database migrated by a newer Keel is refused with a
//! clear message. The fixtures are that release's migrations, as it shipped them, and the rows it
//! wrote (tests/fixtures/v0.1).

use std::path::Path;
use std::process::Command;

use keel_core::store::prelude::*;
use keel_store::{PostgresStore, SqliteStore};
use sha2::{Digest, Sha384};

const KEEL: &str = env!("CARGO_BIN_EXE_keel");

/// (version, description, file) of the 0.1 migrations, as its migrator recorded them.
const V01: &[(i64, &str, &str)] = &[
    (1, "init", "0001_init.sql"),
    (2, "credentials", "0002_credentials.sql"),
    (3, "ag ui", "0003_ag_ui.sql"),
    (4, "runs by user", "0004_runs_by_user.sql"),
];

fn fixture(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v0.1").join(path))
        .unwrap_or_else(|e| panic!("fixture {path}: {e}"))
}

fn keel_migrate(db: &str) -> std::process::Output {
    let mut cmd = Command::new(KEEL);
    for (key, _) in std::env::vars() {
        if key.starts_with("KEEL_") {
            cmd.env_remove(key);
        }
    }
    let dir = tempfile::tempdir().unwrap();
    cmd.args(["migrate", "--db", db, "--data-dir"]).arg(dir.path()).env("RUST_LOG", "warn").output().unwrap()
}

/// What the upgraded database must still say, whatever the backend.
async fn holds_what_it_held(store: &dyn Store) {
    let conversation = store.get_conversation(&"conv_0old".parse().unwrap()).await.unwrap().expect("the conversation");
    assert_eq!(conversation.title, "Restart the abnormal instance of payment-api");
    assert_eq!(conversation.agent_id, None, "made before agents: the default agent's");
    let messages = store.list_messages(&conversation.id).await.unwrap();
    assert_eq!(messages.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(), ["msg_0user", "msg_0tool", "msg_0answer"]);
    let run = store.get_run(&"run_0old".parse().unwrap()).await.unwrap().expect("the run");
    assert_eq!((run.status.as_str(), run.agent_id.as_deref(), run.last_sequence()), ("completed", None, 5));
    let events = store.list_events(&run.id, 0, 100).await.unwrap();
    assert_eq!(events.len(), 5);
    assert_eq!(events.last().unwrap().type_name(), "done");
    let interrupts = store.list_interrupts(&run.id).await.unwrap();
    assert_eq!(interrupts.len(), 1);
    assert_eq!((interrupts[0].kind.as_str(), interrupts[0].resolved_by.as_deref()), ("confirm_action", Some("alice")));
    assert_eq!(interrupts[0].note, None);
    let calls = store.list_tool_calls(&run.id).await.unwrap();
    assert_eq!((calls[0].state.as_str(), calls[0].attempts), ("succeeded", 1), "a started call was attempted once");
    // AG-UI's thread and message bindings moved into the bindings table.
    assert_eq!(store.binding("ag_ui.thread", "alice", "thread-7").await.unwrap().as_deref(), Some("conv_0old"));
    assert_eq!(
        store.binding("ag_ui.message", "conv_0old", "client-msg-1").await.unwrap().as_deref(),
        Some("msg_0user")
    );
    assert_eq!(
        store
            .api_key_user("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
            .await
            .unwrap()
            .as_deref(),
        Some("alice")
    );
    assert_eq!(store.user_role("alice").await.unwrap().map(|r| r.as_str()), Some("operator"));
    // Retention works on the upgraded schema: the old run's events can be pruned.
    let rule = keel_core::store::PruneRule {
        finished_before: chrono::Utc::now(),
        finished_after: None,
        agent: None,
        except_agents: vec![],
    };
    let would = store.prune_events(&rule, 1_000, true).await.unwrap();
    assert_eq!((would.runs, would.events), (1, 5), "the old run, dry");
    assert_eq!(store.first_held_sequence(&run.id).await.unwrap(), None);
    // The conversation goes on.
    let started = store
        .start_run(keel_core::store::NewRun {
            conversation_id: conversation.id.clone(),
            agent_id: "opspilot".into(),
            user_id: "alice".into(),
            content: "and now?".into(),
            cancel_on_disconnect: false,
            now: chrono::Utc::now(),
            events: vec![],
            enqueue: None,
            lease: None,
        })
        .await
        .unwrap();
    assert_eq!(started.run.agent_id.as_deref(), Some("opspilot"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_database_of_the_previous_release_upgrades() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keel.db");
    {
        let conn = keel_store::rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "PRAGMA journal_mode = WAL; PRAGMA foreign_keys = ON;
             CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY, description TEXT NOT NULL,
                 installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP, success BOOLEAN NOT NULL,
                 checksum BLOB NOT NULL, execution_time BIGINT NOT NULL);",
        )
        .unwrap();
        for (version, description, file) in V01 {
            let sql = fixture(&format!("sqlite/{file}"));
            conn.execute_batch(&sql).unwrap();
            conn.execute(
                "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES (?, ?, 1, ?, 1)",
                keel_store::rusqlite::params![version, description, Sha384::digest(sql.as_bytes()).as_slice()],
            )
            .unwrap();
        }
        conn.execute_batch(&fixture("data.sql")).unwrap();
    }
    let url = format!("sqlite://{}", path.display());
    let migrated = keel_migrate(&url);
    assert!(migrated.status.success(), "{}", String::from_utf8_lossy(&migrated.stderr));
    let store = SqliteStore::open(&path).await.unwrap();
    let tables: Vec<String> = store
        .read_with(|c| {
            let mut st = c.prepare("SELECT name FROM sqlite_master WHERE type = 'table'").unwrap();
            let rows = st.query_map([], |r| r.get(0)).unwrap();
            Ok(rows.collect::<Result<Vec<String>, _>>().unwrap())
        })
        .await
        .unwrap();
    for gone in ["instances", "error_logs", "ag_ui_threads", "ag_ui_messages"] {
        assert!(!tables.iter().any(|t| t == gone), "{gone} left Keel's schema: {tables:?}");
    }
    holds_what_it_held(&store).await;
    store.close().await;
    // Migrating again changes nothing.
    assert!(keel_migrate(&url).status.success());

    // A database a newer Keel migrated is refused, saying so.
    {
        let conn = keel_store::rusqlite::Connection::open(&path).unwrap();
        conn.execute(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES (99, 'future', 1, x'00', 1)",
            [],
        )
        .unwrap();
    }
    let refused = keel_migrate(&url);
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("version 99") && stderr.contains("newer Keel"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_database_of_the_previous_release_upgrades() {
    let Some(url) = std::env::var("KEEL_TEST_POSTGRES_URL").ok().filter(|u| !u.trim().is_empty()) else {
        eprintln!("upgrade: the Postgres case is SKIPPED because KEEL_TEST_POSTGRES_URL is unset");
        return;
    };
    use keel_store::sqlx::{Connection, Executor, PgConnection};
    let schema = format!("keel_upgrade_{}", keel_core::RunId::new().as_str().trim_start_matches("run_"));
    let mut conn =
        PgConnection::connect(&url).await.expect("KEEL_TEST_POSTGRES_URL is set, but Postgres is unreachable");
    conn.execute(format!("CREATE SCHEMA \"{schema}\"").as_str()).await.unwrap();
    conn.execute(format!("SET search_path TO \"{schema}\"").as_str()).await.unwrap();
    conn.execute(
        "CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY, description TEXT NOT NULL,
            installed_on TIMESTAMPTZ NOT NULL DEFAULT now(), success BOOLEAN NOT NULL, checksum BYTEA NOT NULL,
            execution_time BIGINT NOT NULL)",
    )
    .await
    .unwrap();
    for (version, description, file) in V01 {
        let sql = fixture(&format!("postgres/{file}"));
        conn.execute(sql.as_str()).await.unwrap();
        keel_store::sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES ($1, $2, true, $3, 1)",
        )
        .bind(version)
        .bind(description)
        .bind(Sha384::digest(sql.as_bytes()).to_vec())
        .execute(&mut conn)
        .await
        .unwrap();
    }
    conn.execute(fixture("data.sql").as_str()).await.unwrap();
    let sep = if url.contains('?') { '&' } else { '?' };
    let db = format!("{url}{sep}options=-c%20search_path%3D{schema}");
    let migrated = keel_migrate(&db);
    assert!(migrated.status.success(), "{}", String::from_utf8_lossy(&migrated.stderr));
    let store = PostgresStore::connect_with_schema(&url, &schema).await.unwrap();
    holds_what_it_held(&store).await;
    let gone: i64 = keel_store::sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = $1 \
         AND table_name IN ('instances', 'error_logs', 'ag_ui_threads', 'ag_ui_messages')",
    )
    .bind(&schema)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(gone, 0, "the demo's and AG-UI's old tables left Keel's schema");

    keel_store::sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES (99, 'future', true, '\\x00', 1)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let refused = keel_migrate(&db);
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("version 99") && stderr.contains("newer Keel"), "{stderr}");
    store.drop_schema().await.unwrap();
}
