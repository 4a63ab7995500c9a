//! Opening SQLite databases: files, urls, memory, re-opening, and rows the store cannot read.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use keel_core::store::{NewRun, Store, StoreError};
use keel_store::SqliteStore;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{ConnectOptions, Connection};
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
    let conversation = store.create_conversation("alice", "t", now()).await.expect("create");
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
    let conversation = store.create_conversation("alice", "t", now()).await.expect("create");
    assert_eq!(store.list_conversations("alice", 10).await.expect("list"), vec![conversation]);
}

#[tokio::test]
async fn a_bad_url_is_an_error_not_a_panic() {
    let err = SqliteStore::open_url("postgres://localhost/keel").await.expect_err("not sqlite");
    assert!(matches!(err, StoreError::Backend(_)), "{err:?}");
}

#[tokio::test]
async fn an_unreadable_row_is_a_backend_error() {
    let dir = TempDir::new().expect("temp dir");
    let path = dir.path().join("keel.db");
    let store = SqliteStore::open(&path).await.expect("open");
    let conversation = store.create_conversation("alice", "t", now()).await.expect("create");
    let started = store
        .start_run(NewRun {
            conversation_id: conversation.id.clone(),
            user_id: "alice".into(),
            content: "hi".into(),
            cancel_on_disconnect: false,
            now: now(),
            events: vec![],
        })
        .await
        .expect("start");

    // someone else wrote rows this version cannot read
    let mut raw = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))
        .expect("options")
        .connect()
        .await
        .expect("raw connection");
    sqlx::query("UPDATE runs SET checkpoint = '{\"nextStep\": \"secret-token-123\"}' WHERE id = ?")
        .bind(started.run.id.as_str())
        .execute(&mut raw)
        .await
        .expect("corrupt the checkpoint");
    sqlx::query("UPDATE messages SET created_at = 'yesterday'").execute(&mut raw).await.expect("corrupt a message");
    raw.close().await.expect("close");

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
