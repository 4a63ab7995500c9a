//! Two `keel demo` processes (OpsPilot's fleet is shared through the database) on one Postgres (and Redis, when configured): a run started on A is
//! streamed from B; A killed with SIGKILL mid-run or while the run waits for approval → B continues
//! it from its checkpoint, its stream shows no gap and no duplicate, and a side effect runs once.
//!
//! Needs `KEEL_TEST_POSTGRES_URL`; uses `KEEL_TEST_REDIS_URL` for the bus when set (without it the
//! instances see each other's events by polling the store). Without Postgres the test says it is
//! skipped and does nothing.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use keel_client::sse::{SseFrame, SseParser};
use keel_core::store::prelude::*;
use keel_core::{Event, EventKind};
use keel_opspilot::{Fleet, PostgresFleet};
use keel_store::PostgresStore;
use serde_json::{json, Value};

const KEEL: &str = env!("CARGO_BIN_EXE_keel");

struct Instance {
    child: Child,
    base: String,
}

impl Instance {
    fn start(name: &str, db: &str, dir: &std::path::Path, bus: Option<String>) -> Self {
        let mut cmd = Command::new(KEEL);
        for (key, _) in std::env::vars() {
            if key.starts_with("KEEL_") {
                cmd.env_remove(key);
            }
        }
        cmd.args(["demo", "--listen", "127.0.0.1:0", "--db", db, "--lease-ttl", "2s", "--instance-id", name])
            // One user drives everything here; the per-user limits are tested in keel-server.
            .args([
                "--demo-delay-ms",
                "40",
                "--rate-limit",
                "0",
                "--rate-limit-per-address",
                "0",
                "--max-streams-per-user",
                "0",
            ])
            .arg("--data-dir")
            .arg(dir.join(name))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(redis) = bus {
            cmd.args(["--bus", &redis]);
        }
        let mut child = cmd.spawn().expect("start keel serve");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).expect("the address line");
        let base = line.trim().rsplit(' ').next().unwrap().trim_end_matches('/').to_owned();
        assert!(base.starts_with("http://127.0.0.1:"), "{line}");
        Self { child, base }
    }

    fn kill(&mut self) {
        // SIGKILL: no graceful shutdown, no lease released.
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn post(http: &reqwest::Client, url: String, body: Value) -> Value {
    let r = http.post(url).json(&body).send().await.unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    r.json().await.unwrap()
}

/// Reads a run's SSE stream from `base` until its terminal event (or `until_pause`), asserting
/// that the sequences it sees are exactly `after+1, after+2, …`.
async fn read_stream(http: &reqwest::Client, base: &str, run: &str, after: i64, until_pause: bool) -> Vec<Event> {
    let response = http
        .get(format!("{base}/v1/runs/{run}/events"))
        .header("Last-Event-ID", after.to_string())
        .send()
        .await
        .unwrap();
    let mut body = response.bytes_stream();
    let mut parser = SseParser::new();
    let mut events: Vec<Event> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Some(chunk) = tokio::time::timeout_at(deadline.into(), body.next()).await.expect("stream within 60 s") {
        for frame in parser.push(&chunk.unwrap()) {
            if let SseFrame::Event { data, .. } = frame {
                let event: Event = serde_json::from_str(&data).unwrap();
                let expected = after + events.len() as i64 + 1;
                assert_eq!(event.sequence, expected, "a gap or a duplicate on {base}: {}", event.type_name());
                let end = event.is_terminal() || (until_pause && event.is_pausing());
                events.push(event);
                if end {
                    return events;
                }
            }
        }
    }
    panic!(
        "the stream on {base} ended before the run did: {:?}",
        events.iter().map(Event::type_name).collect::<Vec<_>>()
    );
}

/// A fresh schema on the test database, and the `--db` URL that selects it.
async fn database() -> Option<(PostgresStore, String)> {
    let Some(url) = std::env::var("KEEL_TEST_POSTGRES_URL").ok().filter(|u| !u.trim().is_empty()) else {
        eprintln!("multi_instance: SKIPPED, KEEL_TEST_POSTGRES_URL is unset");
        return None;
    };
    let schema = format!("keel_multi_{}", keel_core::RunId::new().as_str().trim_start_matches("run_"));
    let setup = PostgresStore::connect_with_schema(&url, &schema).await.expect("Postgres is reachable");
    let sep = if url.contains('?') { '&' } else { '?' };
    Some((setup, format!("{url}{sep}options=-c%20search_path%3D{schema}")))
}

fn redis_url() -> Option<String> {
    std::env::var("KEEL_TEST_REDIS_URL").ok().filter(|u| !u.is_empty())
}

/// Waits, with a deadline, until the run has at least `n` events of type `ty`.
async fn wait_for_events(store: &PostgresStore, run: &str, ty: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let events = store.list_events(&run.parse().unwrap(), 0, 10_000).await.unwrap();
        if events.iter().filter(|e| e.type_name() == ty).count() >= n {
            return;
        }
        assert!(Instant::now() < deadline, "{n} {ty} events within 20 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_survives_its_instance_being_killed() {
    let Some((setup, db)) = database().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();

    let mut a = Instance::start("a", &db, dir.path(), redis_url());
    let b = Instance::start("b", &db, dir.path(), redis_url());

    // 1. Started on A, streamed from B, with A killed mid-answer: B continues it.
    let conv = post(&http, format!("{}/v1/conversations", a.base), json!({"title": "multi"})).await;
    let conv = conv["id"].as_str().unwrap().to_owned();
    // An answer of 100 numbered words (4 s at 40 ms a word): a loaded machine's test still kills A
    // with most of it to come, as it may not with a short one.
    let sent = post(
        &http,
        format!("{}/v1/conversations/{conv}/messages", a.base),
        json!({"content": "benchmark: stream 100 words"}),
    )
    .await;
    let run = sent["runId"].as_str().unwrap().to_owned();
    wait_for_events(&setup, &run, "text_delta", 1).await;
    let reader = {
        let (http, base, run) = (http.clone(), b.base.clone(), run.clone());
        tokio::spawn(async move { read_stream(&http, &base, &run, 0, false).await })
    };
    a.kill();
    let events = reader.await.unwrap();
    assert_eq!(events.last().unwrap().type_name(), "done");
    assert!(
        events.iter().any(|e| matches!(e.kind, EventKind::TextDiscarded { .. })),
        "the cut-off text is discarded: {:?}",
        events.iter().map(|e| (e.sequence, e.type_name(), e.ts)).collect::<Vec<_>>()
    );
    let text = keel_core::event::render_text(&events);
    assert_eq!(text.len(), 1, "{text:?}");
    let words: Vec<String> = (1..=100).map(|i| format!("w{i}")).collect();
    assert_eq!(text[0].1.split_whitespace().collect::<Vec<_>>(), words, "no duplicated or missing text");

    // 2. A run paused on a new A, A killed while it waits: the approval sent to B completes it once.
    let mut a = Instance::start("a2", &db, dir.path(), redis_url());
    let conv = post(&http, format!("{}/v1/conversations", a.base), json!({})).await;
    let conv = conv["id"].as_str().unwrap().to_owned();
    let turn = post(
        &http,
        format!("{}/v1/conversations/{conv}/messages?wait=true", a.base),
        json!({"content": "restart pay-prod-2"}),
    )
    .await;
    let run = turn["run"]["id"].as_str().unwrap().to_owned();
    let interrupt = turn["interrupt"]["id"].as_str().unwrap().to_owned();
    a.kill();
    let decision = json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": "multi-1"});
    let accepted = post(&http, format!("{}/v1/runs/{run}/resume", b.base), decision.clone()).await;
    let from = accepted["resumedSequence"].as_i64().unwrap() - 1;
    let events = read_stream(&http, &b.base, &run, from, false).await;
    assert_eq!(events.last().unwrap().type_name(), "done");
    let again = post(&http, format!("{}/v1/runs/{run}/resume", b.base), decision).await;
    assert_eq!(again, accepted, "the same key gets the same answer");
    let pay = PostgresFleet::open(&setup).await.unwrap().instance("pay-prod-2").await.unwrap().unwrap();
    assert_eq!((pay.status.as_str(), pay.restart_count), ("healthy", 1), "restarted exactly once");

    // 3. The whole of run 2 replays from B with contiguous sequences.
    let all = read_stream(&http, &b.base, &run, 0, false).await;
    assert!(all.iter().any(|e| e.type_name() == "interrupt"));

    drop(b);
    setup.drop_schema().await.unwrap();
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill").args([sig, &child.id().to_string()]).status().unwrap().success();
    assert!(ok, "kill {sig}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_worker_cannot_write_after_its_lease_is_taken() {
    let Some((setup, db)) = database().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let a = Instance::start("a", &db, dir.path(), redis_url());
    let b = Instance::start("b", &db, dir.path(), redis_url());
    let conv = post(&http, format!("{}/v1/conversations", a.base), json!({})).await;
    let conv = conv["id"].as_str().unwrap().to_owned();
    let sent =
        post(&http, format!("{}/v1/conversations/{conv}/messages", a.base), json!({"content": "what can you do?"}))
            .await;
    let run = sent["runId"].as_str().unwrap().to_owned();
    wait_for_events(&setup, &run, "text_delta", 1).await;

    // A stalls past its lease (2 s); B takes the run over and finishes it.
    signal(&a.child, "-STOP");
    let events = read_stream(&http, &b.base, &run, 0, false).await;
    assert_eq!(events.last().unwrap().type_name(), "done");
    let finished = events.len();

    // A wakes up in the middle of its model call and tries to go on writing: every write is fenced.
    signal(&a.child, "-CONT");
    let settle = Instant::now() + Duration::from_secs(2);
    while Instant::now() < settle {
        let stored = setup.list_events(&run.parse().unwrap(), 0, 10_000).await.unwrap();
        assert_eq!(stored.len(), finished, "the stale worker appended an event");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = http.get(format!("{}/v1/runs/{run}", a.base)).send().await.unwrap().json::<Value>().await.unwrap();
    assert_eq!(status["status"], "completed");
    drop((a, b));
    setup.drop_schema().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_resumes_spread_over_two_instances_restart_once() {
    let Some((setup, db)) = database().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let a = Instance::start("a", &db, dir.path(), redis_url());
    let b = Instance::start("b", &db, dir.path(), redis_url());
    let conv = post(&http, format!("{}/v1/conversations", a.base), json!({})).await;
    let conv = conv["id"].as_str().unwrap().to_owned();
    let turn = post(
        &http,
        format!("{}/v1/conversations/{conv}/messages?wait=true", a.base),
        json!({"content": "restart pay-prod-2"}),
    )
    .await;
    let run = turn["run"]["id"].as_str().unwrap().to_owned();
    let interrupt = turn["interrupt"]["id"].as_str().unwrap().to_owned();
    let mut tasks = Vec::new();
    for i in 0..100 {
        let base = if i % 2 == 0 { a.base.clone() } else { b.base.clone() };
        let (http, run, interrupt) = (http.clone(), run.clone(), interrupt.clone());
        tasks.push(tokio::spawn(async move {
            let body = json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": format!("race-{i}")});
            http.post(format!("{base}/v1/runs/{run}/resume")).json(&body).send().await.unwrap().status().as_u16()
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 1, "{statuses:?}");
    assert_eq!(statuses.iter().filter(|s| **s == 409).count(), 99, "{statuses:?}");
    let events = read_stream(&http, &b.base, &run, 0, false).await;
    assert_eq!(events.last().unwrap().type_name(), "done");
    assert_eq!(
        PostgresFleet::open(&setup).await.unwrap().instance("pay-prod-2").await.unwrap().unwrap().restart_count,
        1
    );
    drop((a, b));
    setup.drop_schema().await.unwrap();
}

/// A private Redis the test may stop.
struct PrivateRedis(Child, u16);

impl PrivateRedis {
    fn start() -> Option<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .ok()?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server came up");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(Self(child, port))
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_arrives_when_redis_goes_away_midway() {
    let Some((setup, db)) = database().await else { return };
    if redis_url().is_none() {
        eprintln!("multi_instance: the Redis-down case is SKIPPED, KEEL_TEST_REDIS_URL is unset");
        return;
    }
    let redis = PrivateRedis::start().expect("redis-server is installed (it serves KEEL_TEST_REDIS_URL)");
    let url = format!("redis://127.0.0.1:{}", redis.1);
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let a = Instance::start("a", &db, dir.path(), Some(url.clone()));
    let b = Instance::start("b", &db, dir.path(), Some(url));
    let conv = post(&http, format!("{}/v1/conversations", a.base), json!({})).await;
    let conv = conv["id"].as_str().unwrap().to_owned();
    let sent =
        post(&http, format!("{}/v1/conversations/{conv}/messages", a.base), json!({"content": "what can you do?"}))
            .await;
    let run = sent["runId"].as_str().unwrap().to_owned();
    let reader = {
        let (http, base, run) = (http.clone(), b.base.clone(), run.clone());
        tokio::spawn(async move { read_stream(&http, &base, &run, 0, false).await })
    };
    wait_for_events(&setup, &run, "text_delta", 1).await;
    drop(redis);
    let events = reader.await.unwrap();
    assert_eq!(events.last().unwrap().type_name(), "done");
    let stored = setup.list_events(&run.parse().unwrap(), 0, 10_000).await.unwrap();
    assert_eq!(events, stored, "B's stream is exactly what was committed");
    drop((a, b));
    setup.drop_schema().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_side_effect_is_not_rerun_and_cancel_reaches_the_holder() {
    let Some((setup, db)) = database().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let mut a = Instance::start("a", &db, dir.path(), redis_url());
    let b = Instance::start("b", &db, dir.path(), redis_url());

    // Cancel sent to B while A runs the run: A's worker sees the durable flag and stops.
    let conv = post(&http, format!("{}/v1/conversations", a.base), json!({})).await;
    let conv = conv["id"].as_str().unwrap().to_owned();
    let sent =
        post(&http, format!("{}/v1/conversations/{conv}/messages", a.base), json!({"content": "what can you do?"}))
            .await;
    let run = sent["runId"].as_str().unwrap().to_owned();
    wait_for_events(&setup, &run, "text_delta", 1).await;
    post(&http, format!("{}/v1/runs/{run}/cancel", b.base), json!({})).await;
    let events = read_stream(&http, &b.base, &run, 0, false).await;
    assert_eq!(events.last().unwrap().type_name(), "cancelled");

    // The restart completes on A; A dies while the model writes the answer; B finishes the run
    // from its checkpoint without restarting again.
    let turn = post(
        &http,
        format!("{}/v1/conversations/{conv}/messages?wait=true", a.base),
        json!({"content": "restart pay-prod-2"}),
    )
    .await;
    let run = turn["run"]["id"].as_str().unwrap().to_owned();
    let interrupt = turn["interrupt"]["id"].as_str().unwrap().to_owned();
    let decision = json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": "k"});
    post(&http, format!("{}/v1/runs/{run}/resume", a.base), decision).await;
    wait_for_events(&setup, &run, "tool_finished", 1).await;
    a.kill();
    assert_eq!(
        PostgresFleet::open(&setup).await.unwrap().instance("pay-prod-2").await.unwrap().unwrap().restart_count,
        1
    );
    let events = read_stream(&http, &b.base, &run, 0, false).await;
    assert_eq!(events.last().unwrap().type_name(), "done");
    let restarts = events
        .iter()
        .filter(|e| matches!(&e.kind, EventKind::ToolStarted { tool, .. } if tool == "restart_instance"))
        .count();
    assert_eq!(restarts, 1, "the restart ran once");
    assert_eq!(
        PostgresFleet::open(&setup).await.unwrap().instance("pay-prod-2").await.unwrap().unwrap().restart_count,
        1
    );
    let answer = keel_core::event::render_text(&events).pop().unwrap().1;
    assert!(answer.contains("Restarted pay-prod-2"), "{answer}");
    drop(b);
    setup.drop_schema().await.unwrap();
}

/// Messages enqueued on two instances behind a run that waits for approval: the queue is in the
/// database, so it outlives the instance that took one of them (killed), and once the approval is
/// given on the other the queued runs start there, one after the other, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueued_run_outlives_its_instance_and_starts_in_order() {
    let Some((setup, db)) = database().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::new();
    let mut a = Instance::start("a", &db, dir.path(), redis_url());
    let b = Instance::start("b", &db, dir.path(), redis_url());

    let conv = post(&http, format!("{}/v1/conversations", a.base), json!({})).await;
    let conv = conv["id"].as_str().unwrap().to_owned();
    let turn = post(
        &http,
        format!("{}/v1/conversations/{conv}/messages?wait=true", a.base),
        json!({"content": "restart pay-prod-2"}),
    )
    .await;
    let paused = turn["run"]["id"].as_str().unwrap().to_owned();
    let interrupt = turn["interrupt"]["id"].as_str().unwrap().to_owned();
    let mut queued = Vec::new();
    for (base, content) in [(&a.base, "list the services"), (&b.base, "what can you do?")] {
        let body = json!({"content": content, "multitaskStrategy": "enqueue"});
        let sent = post(&http, format!("{base}/v1/conversations/{conv}/messages"), body).await;
        assert_eq!(sent["status"], "waiting", "{sent}");
        queued.push(sent["runId"].as_str().unwrap().to_owned());
    }
    a.kill();

    let decision = json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": "multi-enqueue"});
    post(&http, format!("{}/v1/runs/{paused}/resume", b.base), decision).await;
    for run in &queued {
        let events = read_stream(&http, &b.base, run, 0, false).await;
        let types: Vec<&str> = events.iter().map(Event::type_name).collect();
        assert_eq!(types[..2], ["run_waiting", "run_started"], "{types:?}");
        assert_eq!(types.last(), Some(&"done"), "{types:?}");
    }
    let messages = setup.list_messages(&conv.parse().unwrap()).await.unwrap();
    let mut order: Vec<String> = Vec::new();
    for m in messages {
        let run = m.run_id.unwrap().to_string();
        if order.last() != Some(&run) {
            assert!(!order.contains(&run), "the runs' messages interleave");
            order.push(run);
        }
    }
    assert_eq!(order, [paused, queued[0].clone(), queued[1].clone()]);

    drop(b);
    setup.drop_schema().await.unwrap();
}
