//! What an idle event stream costs the store: nothing, where the bus delivers every event (one
//! process, the local bus); a look every interval where other processes may commit. Store reads
//! are counted through the engine's metrics (`Recorder::stream_store_read`).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use futures::StreamExt;
use keel_core::engine::EngineConfig;
use keel_core::metrics::{Metrics, Recorder};
use keel_core::stream::Until;
use keel_core::{Event, RunId};
use serde_json::json;
use tempfile::TempDir;

/// Store reads of event streams, by reason.
#[derive(Default)]
struct Reads(Mutex<HashMap<String, usize>>);

impl Reads {
    fn of(&self, reason: &str) -> usize {
        self.0.lock().unwrap().get(reason).copied().unwrap_or(0)
    }
    fn total(&self) -> usize {
        self.0.lock().unwrap().values().sum()
    }
}

impl Recorder for Reads {
    fn stream_store_read(&self, reason: &str) {
        *self.0.lock().unwrap().entry(reason.to_owned()).or_default() += 1;
    }
}

async fn harness(dir: &TempDir, idle_reads: Option<Duration>) -> (Harness, Arc<Reads>) {
    let reads = Arc::new(Reads::default());
    let config = EngineConfig { poll_interval: idle_reads, metrics: Metrics::new(reads.clone()), ..engine_config() };
    (Harness::new(dir.path(), Options { config, ..Options::default() }).await, reads)
}

/// A run paused for approval, and a stream of it from its last event on, read on a task of its own;
/// the stream reads counted before that stream opened.
async fn idle_stream(h: &Harness, reads: &Reads) -> (RunId, tokio::task::JoinHandle<Vec<Event>>, usize) {
    let conv = h.conversation().await;
    let (run, events) = h.say(&conv, "restart pay-prod-2").await;
    assert_eq!(last_type(&events), "interrupt");
    let after = events.last().unwrap().sequence;
    let before = reads.total();
    let stream = h.engine.events(&run, after, Until::Terminal);
    let reader = tokio::spawn(async move { stream.map(|e| e.unwrap()).collect::<Vec<_>>().await });
    (run, reader, before)
}

async fn until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !check() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_local_bus_an_idle_stream_reads_nothing_and_still_gets_a_late_event() {
    let dir = TempDir::new().unwrap();
    let (h, reads) = harness(&dir, None).await;
    let (run, reader, before) = idle_stream(&h, &reads).await;

    // Its catch-up: one page of events (none after the cursor) and the run (not ended).
    until("the stream caught up", || reads.total() == before + 2).await;
    // Then nothing, however long it waits: 20 of the intervals the test harness used to poll at.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(reads.total(), before + 2, "an idle stream read the store");
    assert_eq!(reads.of("idle"), 0, "never an idle read");
    assert!(!reader.is_finished());

    // A late event (the approval, and the rest of the run) arrives through the bus, in order, with
    // no read of the store.
    let interrupt = h.store.pending_interrupt(&run).await.unwrap().unwrap().id;
    h.resume(&run, &interrupt, json!("approve"), "late-approval").await.unwrap();
    let events = tokio::time::timeout(Duration::from_secs(20), reader).await.expect("the run ends").unwrap();
    assert_eq!(events.first().unwrap().type_name(), "resumed");
    assert_eq!(last_type(&events), "done");
    assert!(events.windows(2).all(|w| w[1].sequence == w[0].sequence + 1), "no gap, no duplicate");
    assert_eq!(reads.total(), before + 2, "a stream that follows the bus reads nothing");
    assert_eq!(h.restart_count("pay-prod-2").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn where_others_commit_an_idle_stream_looks_every_interval() {
    let dir = TempDir::new().unwrap();
    let (h, reads) = harness(&dir, Some(Duration::from_millis(50))).await;
    let (run, reader, _) = idle_stream(&h, &reads).await;
    // Each look is a page of events and the run.
    until("three idle looks", || reads.of("idle") >= 6).await;
    let interrupt = h.store.pending_interrupt(&run).await.unwrap().unwrap().id;
    h.resume(&run, &interrupt, json!("approve"), "approval").await.unwrap();
    let events = tokio::time::timeout(Duration::from_secs(20), reader).await.expect("the run ends").unwrap();
    assert_eq!(last_type(&events), "done");
}
