//! Retention gives SQLite's space back: a database Keel creates is made with
//! `auto_vacuum = INCREMENTAL`, and a prune returns the pages it freed to the file system, so the
//! file shrinks instead of keeping them on its free list.

use chrono::{DateTime, Utc};
use keel_core::domain::RunStatus;
use keel_core::event::EventKind;
use keel_core::store::prelude::*;
use keel_core::store::{Commit, Fence, NewRun, PruneRule, Pruned, RunChange};
use keel_store::SqliteStore;

fn at(secs: i64) -> DateTime<Utc> {
    DateTime::from_timestamp(1_893_499_200 + secs, 0).unwrap()
}

async fn pragma(store: &SqliteStore, name: &'static str) -> i64 {
    store.read_with(move |c| Ok(c.query_row(&format!("PRAGMA {name}"), [], |r| r.get(0)).unwrap())).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pruning_gives_the_space_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keel.db");
    let store = SqliteStore::open(&path).await.unwrap();
    assert_eq!(pragma(&store, "auto_vacuum").await, 2, "incremental");
    // Twenty finished runs of two hundred 2 KB events each: about 8 MB of events.
    let text = "x".repeat(2_000);
    for _ in 0..20 {
        let conversation = store.create_conversation("alice", &"big".into(), "ops", at(0)).await.unwrap();
        let run = store
            .start_run(NewRun {
                conversation_id: conversation.id.clone(),
                agent_id: "ops".into(),
                user_id: "alice".into(),
                content: "go".into(),
                cancel_on_disconnect: false,
                now: at(1),
                events: vec![],
                enqueue: None,
                lease: None,
            })
            .await
            .unwrap()
            .run;
        let mut c = Commit::new(
            run.id.clone(),
            Fence::Acquire { owner: "w".into(), from: vec![RunStatus::Queued], lease_until: at(100) },
            at(2),
        );
        c.run = Some(RunChange { to: RunStatus::Running, reason: None, via: None });
        for _ in 0..200 {
            c.events.push(EventKind::TextDelta { message_id: run.user_message_id.clone(), delta: text.clone() });
        }
        store.commit(c).await.unwrap();
        let mut c = Commit::new(run.id.clone(), Fence::Lease { owner: "w".into(), lease_until: at(100) }, at(10));
        c.run = Some(RunChange { to: RunStatus::Completed, reason: None, via: None });
        store.commit(c).await.unwrap();
    }
    let before = pragma(&store, "page_count").await;
    let rule = PruneRule { finished_before: at(60), finished_after: None, agent: None, except_agents: vec![] };
    let mut total = Pruned::default();
    loop {
        let pruned = store.prune_events(&rule, 1_000, false).await.unwrap();
        if pruned.events == 0 {
            break;
        }
        total += pruned;
    }
    assert_eq!(total.events, 20 * 200);
    let after = pragma(&store, "page_count").await;
    assert!(after * 4 < before, "the file shrank: {before} pages before, {after} after");
    assert_eq!(pragma(&store, "freelist_count").await, 0, "no page kept on the free list");
    store.close().await;
    let size = std::fs::metadata(&path).unwrap().len();
    assert!(size < 2_000_000, "keel.db is {size} bytes after the prune");
}
