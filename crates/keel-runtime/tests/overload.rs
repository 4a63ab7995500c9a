//! An overloaded SQLite writer (a queue of one waiting write) under a burst of runs: a request the
//! store refuses is answered `Overloaded` and wrote nothing; every run it accepted completes —
//! a worker waits out a refused commit instead of failing its run.

use std::sync::Arc;
use std::time::Duration;

use keel_core::engine::{EngineError, SendMessage};
use keel_core::{RunStatus, UserRole};
use keel_models::DemoModel;
use keel_runtime::{Agent, Backend, Builder};
use keel_store::{SqliteOptions, SqliteStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_runs_complete_while_the_writer_refuses_the_overflow() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = SqliteStore::open_with(&dir.path().join("keel.db"), SqliteOptions { write_queue: 1 }).await.unwrap();
    let agent = Agent::new("plain", "Plain", Arc::new(DemoModel::new(Duration::ZERO)), "You answer.").unwrap();
    let keel = Builder::new(Backend::Sqlite(sqlite)).agent(agent).start().await.unwrap();
    let engine = keel.engine().clone();
    // The engine's own start-up writes may hold the queue of one: a refused write is tried again.
    loop {
        match engine.store().set_user_role("u", UserRole::Operator).await {
            Ok(()) => break,
            Err(keel_core::store::StoreError::Overloaded) => tokio::time::sleep(Duration::from_millis(5)).await,
            Err(e) => panic!("{e}"),
        }
    }

    let mut conversations = Vec::new();
    while conversations.len() < 200 {
        match engine.create_conversation("u", "burst", None).await {
            Ok(c) => conversations.push(c.id),
            Err(EngineError::Overloaded) => tokio::time::sleep(Duration::from_millis(5)).await,
            Err(e) => panic!("{e}"),
        }
    }
    // Bursts of 40 at once, one after the other, while the runs of the earlier bursts commit: the
    // writer holds one group and queues one more write; the rest are refused.
    let mut accepted = Vec::new();
    let mut refused = 0;
    for burst in conversations.chunks(40) {
        let sends = burst.iter().map(|conv| {
            let engine = engine.clone();
            async move {
                engine
                    .send_message("u", conv, SendMessage { content: "hello".into(), cancel_on_disconnect: false })
                    .await
            }
        });
        for result in futures::future::join_all(sends).await {
            match result {
                Ok(started) => accepted.push(started.run.id),
                Err(EngineError::Overloaded) => refused += 1,
                Err(e) => panic!("only Overloaded may refuse a message: {e}"),
            }
        }
    }
    assert!(refused > 0, "a queue of one must refuse some of 40 writes at once");
    assert!(!accepted.is_empty());

    // Every accepted run ends completed, though its workers' commits met the same full queue.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for run in &accepted {
        loop {
            let status = engine.store().get_run(run).await.unwrap().unwrap().status;
            if status.is_terminal() {
                assert_eq!(status, RunStatus::Completed, "run {run}");
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "run {run} is still {status:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // A refused message left nothing behind: the conversations without a run have no message.
    let mut with_messages = 0;
    for conv in &conversations {
        if !engine.store().list_messages(conv).await.unwrap().is_empty() {
            with_messages += 1;
        }
    }
    assert_eq!(with_messages, accepted.len());
}
