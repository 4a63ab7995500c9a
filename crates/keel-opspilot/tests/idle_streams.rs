//! What an idle event stream costs the store: nothing, where the bus delivers every event (one
//! process, the local bus); where other processes may commit, a share of one look per process per
//! interval, which wakes only the streams behind. Store reads are counted through the engine's
//! metrics (`Recorder::stream_store_read`).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use futures::StreamExt;
use keel_core::agent::{Agent, Agents};
use keel_core::bus::LocalBus;
use keel_core::engine::{Engine, EngineConfig, EngineParts};
use keel_core::engine::{MultitaskStrategy, SendMessage};
use keel_core::metrics::{Metrics, Recorder};
use keel_core::stream::{Known, Until};
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

/// A run paused for approval.
async fn paused_run(h: &Harness) -> (RunId, i64) {
    let conv = h.conversation().await;
    let (run, events) = h.say(&conv, "restart pay-prod-2").await;
    assert_eq!(last_type(&events), "interrupt");
    (run, events.last().unwrap().sequence)
}

/// A stream of `run` after `after`, read on a task of its own.
fn open_stream(h: &Harness, run: &RunId, after: i64) -> tokio::task::JoinHandle<Vec<Event>> {
    let stream = h.engine.events(run, after, Until::Terminal, Known::Unknown);
    tokio::spawn(async move { stream.map(|e| e.unwrap()).collect::<Vec<_>>().await })
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
    let (run, after) = paused_run(&h).await;
    let before = reads.total();
    let reader = open_stream(&h, &run, after);

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
async fn where_others_commit_one_look_serves_every_idle_stream_and_wakes_the_one_behind() {
    let dir = TempDir::new().unwrap();
    let (h, reads) = harness(&dir, Some(Duration::from_millis(50))).await;
    let mut runs = Vec::new();
    for _ in 0..5 {
        runs.push(paused_run(&h).await);
    }
    let before = reads.of("catch_up");
    let mut streams: Vec<_> = runs.iter().map(|(run, after)| (run.clone(), open_stream(&h, run, *after))).collect();
    // Each stream's catch-up: a page of events (none after its cursor) and its run (not ended).
    until("every stream caught up", || reads.of("catch_up") == before + 10).await;
    let caught_up = reads.of("catch_up");

    // Idle: the process looks once an interval for all five streams; no stream reads on its own.
    let looks = reads.of("idle");
    until("three more looks", || reads.of("idle") >= looks + 3).await;
    assert_eq!(reads.of("catch_up"), caught_up, "no stream read while idle");

    // Another process (an engine of its own over the same database, with a bus of its own)
    // cancels one run: this process's bus never hears of it, the look does, and wakes that
    // stream alone, which reads the `cancelled` event from the store.
    let other = h.other_engine();
    let (run, reader) = streams.remove(2);
    other.cancel("demo", &run).await.unwrap();
    let events = tokio::time::timeout(Duration::from_secs(20), reader).await.expect("the stream ends").unwrap();
    assert_eq!(last_type(&events), "cancelled");
    assert_eq!(reads.of("catch_up"), caught_up + 1, "one stream caught up: one page, which ended it");
    for (_, reader) in &streams {
        assert!(!reader.is_finished(), "the others still wait");
    }
}

/// A stream that subscribed before the write it follows — the request that starts the run, the
/// one that resumes it — reads nothing: its subscription holds the next event, and the bus brings
/// the rest, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_subscribed_before_the_start_or_the_resume_reads_nothing() {
    let dir = TempDir::new().unwrap();
    let (h, reads) = harness(&dir, None).await;
    let conv = h.conversation().await;
    let before = reads.total();
    let send = SendMessage { content: "restart pay-prod-2".into(), cancel_on_disconnect: false };
    let (started, following) =
        h.engine.send_message_following("demo", &conv, send, MultitaskStrategy::Reject, true).await.unwrap();
    assert!(following.is_some(), "a run that starts now is followed");
    let run = started.run.id;
    let stream = h.engine.events_following(&run, 0, Until::PauseOrTerminal, Known::Active, following);
    let events: Vec<Event> = stream.map(|e| e.unwrap()).collect().await;
    assert_eq!(events.first().unwrap().sequence, 1);
    assert_eq!(last_type(&events), "interrupt");
    assert!(events.windows(2).all(|w| w[1].sequence == w[0].sequence + 1), "no gap, no duplicate");
    assert_eq!(reads.total(), before, "the message's stream read the store");

    let interrupt = h.store.pending_interrupt(&run).await.unwrap().unwrap().id;
    let following = h.engine.follow(&run);
    let accepted = h.resume(&run, &interrupt, json!("approve"), "followed").await.unwrap();
    let after = accepted.resumed_sequence - 1;
    let stream = h.engine.events_following(&run, after, Until::Terminal, Known::Active, Some(following));
    let events: Vec<Event> = stream.map(|e| e.unwrap()).collect().await;
    assert_eq!(events.first().unwrap().type_name(), "resumed");
    assert_eq!(last_type(&events), "done");
    assert!(events.windows(2).all(|w| w[1].sequence == w[0].sequence + 1), "no gap, no duplicate");
    assert_eq!(reads.total(), before, "the resume's stream read the store");
    assert_eq!(h.restart_count("pay-prod-2").await, 1);
}

/// A subscription that holds nothing after the cursor — a replayed answer wrote nothing — is no
/// reason to skip the store: the stream catches up from it, and has every event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followed_stream_with_nothing_new_reads_what_is_stored() {
    let dir = TempDir::new().unwrap();
    let (h, reads) = harness(&dir, None).await;
    let (run, _) = paused_run(&h).await;
    let interrupt = h.store.pending_interrupt(&run).await.unwrap().unwrap().id;
    let accepted = h.resume(&run, &interrupt, json!("approve"), "once").await.unwrap();
    let all = h.engine.wait_settled(&run, accepted.resumed_sequence - 1).await.unwrap();
    assert_eq!(last_type(&all), "done");
    // the same answer again: replayed, nothing written, nothing published
    let following = h.engine.follow(&run);
    let again = h.resume(&run, &interrupt, json!("approve"), "once").await.unwrap();
    assert_eq!(again.resumed_sequence, accepted.resumed_sequence);
    let before = reads.of("catch_up");
    let after = again.resumed_sequence - 1;
    let stream = h.engine.events_following(&run, after, Until::Terminal, Known::Active, Some(following));
    let events: Vec<Event> = tokio::time::timeout(Duration::from_secs(20), stream.map(|e| e.unwrap()).collect())
        .await
        .expect("the stream ends");
    let stored: Vec<i64> = all.iter().map(|e| e.sequence).filter(|s| *s > after).collect();
    assert_eq!(events.iter().map(|e| e.sequence).collect::<Vec<_>>(), stored);
    assert!(reads.of("catch_up") > before, "it read the store");
}

/// An engine of another process over the harness's database: its own bus, never started (it takes
/// no runs), for what it commits.
trait OtherEngine {
    fn other_engine(&self) -> Engine;
}

impl OtherEngine for Harness {
    fn other_engine(&self) -> Engine {
        let model = Arc::new(keel_models::DemoModel::new(Duration::ZERO));
        let agent = Agent::new(keel_opspilot::AGENT_ID, "OpsPilot", model, keel_opspilot::SYSTEM_PROMPT).unwrap();
        let parts = EngineParts {
            store: self.store.clone(),
            agents: Agents::single(agent),
            bus: Arc::new(LocalBus::default()),
            clock: self.clock.clone(),
        };
        Engine::new(parts, EngineConfig::default())
    }
}
