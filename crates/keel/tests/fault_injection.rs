//! Fault injection against the real binary: `keel demo` on SQLite in a temp `--data-dir` (the fleet
//! is seeded only into an empty database, so it is not re-seeded when it comes back), killed with
//! SIGKILL and restarted on the same data.
//!
//! - `runs_survive_sigkill_at_random_points`: the approval flow ("restart pay-prod-aN", "Restart
//!   the abnormal instance of payment-api" → interrupt → approve → done) and plain questions, with
//!   the server killed at a random point — after a random number of `text_delta`s of the question or
//!   of the answer, on a `tool_started` (before its `tool_finished` when the kill is fast enough),
//!   right after the `interrupt`, after some events of the resume's stream, a random number of µs
//!   after the approval is sent, or a random number of ms after the message is sent. After each
//!   restart: every run settles within a deadline (an interrupted one is approved to finish it);
//!   what a client saw live is in the store unchanged; the stored events (`GET /v1/runs/{id}/events`
//!   as JSON) are 1..N, with one `run_started` at 1, one terminal event and nothing after it, every
//!   `tool_finished` after its `tool_started` (or denied / refused) and no call finished twice, each
//!   interrupt resolved at most once; the rendered text (`render_text`) tells no fragment twice and
//!   ends with the stored answer; the fleet's `restartCount`s equal the successful
//!   `restart_instance` calls the runs report. A final pass on a fresh process re-checks every run.
//! - `a_retried_approval_is_answered_after_a_crash`: the same approval (same idempotency key) sent
//!   again after the server died while handling it must be answered: the first answer when the
//!   approval was committed (it is stored under the key in the claim's own transaction), a fresh
//!   evaluation when it was lost (a store one process opens forgets its in-flight keys when it
//!   starts). The random suite checks this too: a key that stays in flight is reported ("STUCK
//!   KEY"), and that run is settled with another key so that its other invariants are still checked.
//! - `a_slow_reader_neither_slows_the_run_nor_grows_the_server`: readers taking ~1 event/s on a
//!   2,000-event run.
//!
//! The kill points come from a seeded RNG; the seed is printed (and is in every failure message),
//! so a failure reproduces with `KEEL_FAULT_SEED=<seed>`. The number of iterations comes from
//! `KEEL_FAULT_ITERATIONS` (default 20: a few seconds). A long soak:
//!
//! ```sh
//! KEEL_FAULT_ITERATIONS=500 cargo test -p keel --test fault_injection -- --nocapture
//! ```

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use keel_client::sse::{SseFrame, SseParser};
use keel_core::event::{render_text, ToolOutcomeStatus};
use keel_core::{Event, EventKind};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

const KEEL: &str = env!("CARGO_BIN_EXE_keel");

/// The tests take turns: on a small machine one's load would skew the other's timings.
static EXCLUSIVE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Server {
    child: Child,
    base: String,
}

impl Server {
    fn start(dir: &Path, abnormal: usize, delay_ms: u64) -> Self {
        let mut cmd = Command::new(KEEL);
        for (key, _) in std::env::vars() {
            if key.starts_with("KEEL_") {
                cmd.env_remove(key);
            }
        }
        // The suite is one user doing the work of many (hundreds of runs, polled): the per-user
        // limits are off here; keel-server's security tests cover them.
        cmd.args(["demo", "--listen", "127.0.0.1:0", "--demo-delay-ms", &delay_ms.to_string()])
            .args(["--rate-limit", "0", "--rate-limit-per-address", "0", "--max-streams-per-user", "0"])
            .args(["--demo-abnormal", &abnormal.to_string(), "--data-dir"])
            .arg(dir)
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("start keel serve");
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).expect("the address line");
        let base = line.trim().rsplit(' ').next().unwrap().trim_end_matches('/').to_owned();
        assert!(base.starts_with("http://127.0.0.1:"), "{line}");
        Self { child, base }
    }

    /// SIGKILL: no graceful shutdown, nothing flushed, no lease released.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Where an iteration pulls the plug.
#[derive(Debug, Clone, Copy)]
enum KillPoint {
    /// After this many `text_delta`s on the message's stream.
    WhileStreamingText(usize),
    /// As soon as a `tool_started` is seen (before its `tool_finished`, if we are fast enough): the
    /// message stream's first tool, or (`in_resume`) the approved `restart_instance`.
    BetweenToolStartedAndFinished { in_resume: bool },
    /// As soon as the `interrupt` event arrives.
    RightAfterInterrupt,
    /// After approving, once this many events of the resume's stream have arrived.
    DuringResume(usize),
    /// After approving, after this many `text_delta`s of the answer.
    WhileStreamingAnswer(usize),
    /// Approve, and kill this many µs after sending the resume, whatever its answer.
    ResumeInFlight(u64),
    /// This many ms after the message is sent.
    AfterDelay(u64),
}

impl KillPoint {
    fn in_resume(self) -> bool {
        matches!(
            self,
            KillPoint::BetweenToolStartedAndFinished { in_resume: true }
                | KillPoint::DuringResume(_)
                | KillPoint::WhileStreamingAnswer(_)
                | KillPoint::ResumeInFlight(_)
        )
    }
}

const QUESTIONS: [&str; 3] = ["what can you do?", "Look at the recent errors of payment-api", "hello"];

fn pick(rng: &mut StdRng, next_instance: &mut usize) -> (String, KillPoint) {
    if rng.gen_bool(0.3) {
        let message = QUESTIONS[rng.gen_range(0..QUESTIONS.len())].to_owned();
        let kill = match rng.gen_range(0..3) {
            0 => KillPoint::WhileStreamingText(rng.gen_range(1..15)),
            1 => KillPoint::BetweenToolStartedAndFinished { in_resume: false },
            _ => KillPoint::AfterDelay(rng.gen_range(0..150)),
        };
        return (message, kill);
    }
    let message = if rng.gen_bool(0.3) {
        "Restart the abnormal instance of payment-api".to_owned()
    } else {
        *next_instance += 1;
        format!("restart pay-prod-a{}", *next_instance)
    };
    let kill = match rng.gen_range(0..8) {
        0 => KillPoint::WhileStreamingText(rng.gen_range(1..8)),
        1 => KillPoint::BetweenToolStartedAndFinished { in_resume: false },
        2 | 3 => KillPoint::BetweenToolStartedAndFinished { in_resume: true },
        4 => KillPoint::RightAfterInterrupt,
        5 => KillPoint::DuringResume(rng.gen_range(1..6)),
        6 => KillPoint::WhileStreamingAnswer(rng.gen_range(1..10)),
        _ => KillPoint::ResumeInFlight(rng.gen_range(0..25_000)),
    };
    (message, kill)
}

async fn post(http: &reqwest::Client, url: String, body: Value) -> (u16, Value) {
    let r = http.post(url).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn get(http: &reqwest::Client, url: String) -> Value {
    let r = http.get(url).header("Accept", "application/json").send().await.unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    r.json().await.unwrap()
}

/// Reads an SSE response, calling `stop` on each event; returns the events and whether `stop` fired.
/// A stream that breaks (the server died) just ends.
async fn read_sse(response: reqwest::Response, mut stop: impl FnMut(&Event, &[Event]) -> bool) -> (Vec<Event>, bool) {
    let mut body = response.bytes_stream();
    let mut parser = SseParser::new();
    let mut events: Vec<Event> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Ok(Some(Ok(chunk))) = tokio::time::timeout_at(deadline.into(), body.next()).await {
        for frame in parser.push(&chunk) {
            if let SseFrame::Event { data, .. } = frame {
                let event: Event = serde_json::from_str(&data).unwrap();
                if let Some(last) = events.last() {
                    assert_eq!(event.sequence, last.sequence + 1, "a live stream shows no gap and no duplicate");
                }
                let hit = stop(&event, &events);
                events.push(event);
                if hit {
                    return (events, true);
                }
            }
        }
    }
    (events, false)
}

struct Tracked {
    run: String,
    conversation: String,
    what: String,
    /// The answer to the approval the client sent before the crash and retried after it.
    resume: Option<Value>,
}

/// What a client saw before the crash.
struct Driven {
    conversation: String,
    /// Empty when the stream told nothing before the kill.
    run: String,
    /// The approval it sent, if it sent one.
    resume: Option<Value>,
    /// The events its streams delivered.
    seen: Vec<Event>,
}

/// One iteration's traffic, up to the kill.
async fn drive(
    http: &reqwest::Client,
    server: &mut Server,
    message: &str,
    kill: KillPoint,
    iteration: usize,
) -> Driven {
    let base = server.base.clone();
    let (status, conv) = post(http, format!("{base}/v1/conversations"), json!({})).await;
    assert_eq!(status, 201);
    let conv = conv["id"].as_str().unwrap().to_owned();
    let request = http
        .post(format!("{base}/v1/conversations/{conv}/messages"))
        .header("Accept", "text/event-stream")
        .json(&json!({"content": message}));
    if let KillPoint::AfterDelay(ms) = kill {
        let sent = tokio::spawn(request.send());
        tokio::time::sleep(Duration::from_millis(ms)).await;
        server.kill();
        let _ = sent.await;
        // The run may or may not have been created; the conversation tells.
        return Driven { conversation: conv, run: String::new(), resume: None, seen: Vec::new() };
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let (mut events, fired) = read_sse(response, |e, seen| match (kill, &e.kind) {
        (KillPoint::WhileStreamingText(n), EventKind::TextDelta { .. }) => {
            seen.iter().filter(|s| matches!(s.kind, EventKind::TextDelta { .. })).count() + 1 >= n
        }
        (KillPoint::BetweenToolStartedAndFinished { in_resume: false }, EventKind::ToolStarted { .. }) => true,
        (KillPoint::RightAfterInterrupt, EventKind::Interrupt { .. }) => true,
        _ => false,
    })
    .await;
    let run = events.first().map(|e| e.run_id.as_str().to_owned()).unwrap_or_default();
    if fired {
        server.kill();
        return Driven { conversation: conv, run, resume: None, seen: events };
    }
    let interrupt = events.iter().rev().find_map(|e| match &e.kind {
        EventKind::Interrupt { interrupt_id, .. } => Some(interrupt_id.as_str().to_owned()),
        _ => None,
    });
    let mut resume = None;
    if let (true, Some(interrupt)) = (kill.in_resume(), interrupt) {
        let body =
            json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": format!("it-{iteration}")});
        resume = Some(body.clone());
        let url = format!("{base}/v1/runs/{run}/resume");
        if let KillPoint::ResumeInFlight(us) = kill {
            let sent = tokio::spawn(http.post(url).json(&body).send());
            tokio::time::sleep(Duration::from_micros(us)).await;
            server.kill();
            let _ = sent.await;
        } else {
            let response = http.post(url).header("Accept", "text/event-stream").json(&body).send().await.unwrap();
            assert_eq!(response.status().as_u16(), 200, "the approval is accepted");
            let (more, _) = read_sse(response, |e, seen| match (kill, &e.kind) {
                (KillPoint::DuringResume(n), _) => seen.len() + 1 >= n,
                (KillPoint::WhileStreamingAnswer(n), EventKind::TextDelta { .. }) => {
                    seen.iter().filter(|s| matches!(s.kind, EventKind::TextDelta { .. })).count() + 1 >= n
                }
                (KillPoint::BetweenToolStartedAndFinished { .. }, EventKind::ToolStarted { tool, .. }) => {
                    tool == "restart_instance"
                }
                _ => false,
            })
            .await;
            events.extend(more);
        }
    }
    server.kill();
    Driven { conversation: conv, run, resume, seen: events }
}

/// The client retries its approval after the crash with the same key: it must get one answer (the
/// first one, if that was committed; else a fresh evaluation), not a key stuck "in flight" for good.
/// `Err` describes a stuck key: what the run and its interrupt look like meanwhile.
async fn retry_resume(http: &reqwest::Client, base: &str, run: &str, body: &Value, ctx: &str) -> Result<Value, String> {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let (status, answer) = post(http, format!("{base}/v1/runs/{run}/resume"), body.clone()).await;
        match status {
            200 => return Ok(answer),
            409 if answer["error"]["code"] == "IDEMPOTENCY_KEY_IN_FLIGHT" => {
                if Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                let state = get(http, format!("{base}/v1/runs/{run}")).await;
                let events = events_of(http, base, run).await;
                let claimed = events.iter().any(|e| {
                    matches!(&e.kind, EventKind::Resumed { interrupt_id, .. } if body["interruptId"] == interrupt_id.as_str())
                });
                return Err(format!(
                    "{ctx}: the approval {body} of {run}, sent as the server was killed, is still answered \
                     409 IDEMPOTENCY_KEY_IN_FLIGHT 1 s after the restart (the key is kept 24 h); the run is {} and \
                     the interrupt {}",
                    state["status"],
                    if claimed {
                        "was claimed (its resumed event is stored)"
                    } else {
                        "was not claimed (still pending)"
                    }
                ));
            }
            _ => panic!("{ctx}: retrying the approval {body} of {run} after the restart: {status} {answer}"),
        }
    }
}

/// Every stored event of the run, page by page.
async fn events_of(http: &reqwest::Client, base: &str, run: &str) -> Vec<Event> {
    let mut events: Vec<Event> = Vec::new();
    loop {
        let after = events.last().map_or(0, |e| e.sequence);
        let body = get(http, format!("{base}/v1/runs/{run}/events?after={after}")).await;
        events.extend(serde_json::from_value::<Vec<Event>>(body["events"].clone()).unwrap());
        if body["hasMore"] != true {
            return events;
        }
    }
}

/// Waits for the run to end; an interrupted one is approved (once per interrupt) to finish it.
async fn settle(http: &reqwest::Client, base: &str, run: &str, ctx: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut approved: HashSet<String> = HashSet::new();
    loop {
        let state = get(http, format!("{base}/v1/runs/{run}")).await;
        match state["status"].as_str().unwrap_or("") {
            "completed" | "failed" | "cancelled" => return state,
            "interrupted" => {
                if let Some(interrupt) = state["pendingInterrupt"]["id"].as_str() {
                    if approved.insert(interrupt.to_owned()) {
                        let body = json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": format!("settle-{interrupt}")});
                        let (status, answer) = post(http, format!("{base}/v1/runs/{run}/resume"), body).await;
                        assert!(
                            status == 200 || status == 409,
                            "{ctx}: approving {interrupt} of {run} after the restart: {status} {answer}"
                        );
                    }
                }
            }
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "{ctx}: run {run} still {} 20 s after the restart: {state}",
            state["status"]
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The invariants of one settled run. Returns the instances it restarted successfully.
async fn check_run(http: &reqwest::Client, base: &str, t: &Tracked, state: &Value, ctx: &str) -> Vec<String> {
    let run = &t.run;
    let events = events_of(http, base, run).await;
    let names: Vec<&str> = events.iter().map(Event::type_name).collect();
    let ctx = format!("{ctx}, run {run} ({}): {names:?}", t.what);
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.sequence, i as i64 + 1, "{ctx}: sequences are 1..N without gaps or duplicates");
    }
    assert!(
        matches!(events.first().map(|e| &e.kind), Some(EventKind::RunStarted { .. })),
        "{ctx}: starts with run_started"
    );
    assert_eq!(names.iter().filter(|n| **n == "run_started").count(), 1, "{ctx}: one run_started");
    let terminal: Vec<usize> = events.iter().enumerate().filter(|(_, e)| e.is_terminal()).map(|(i, _)| i).collect();
    assert_eq!(terminal, vec![events.len() - 1], "{ctx}: exactly one terminal event, the last");
    let expected_status = match events.last().unwrap().kind {
        EventKind::Done { .. } => "completed",
        EventKind::Error { .. } => "failed",
        _ => "cancelled",
    };
    assert_eq!(state["status"], expected_status, "{ctx}: the run's status agrees with its events");
    assert_eq!(state["lastSequence"], events.len() as i64, "{ctx}: lastSequence");

    let mut started: HashMap<String, String> = HashMap::new();
    let mut finished: HashSet<String> = HashSet::new();
    let mut interrupts: HashSet<String> = HashSet::new();
    let mut resolved: HashSet<String> = HashSet::new();
    let mut restarted = Vec::new();
    for e in &events {
        match &e.kind {
            EventKind::ToolStarted { call_id, args_summary, .. } => {
                started.insert(call_id.as_str().to_owned(), args_summary.as_str().to_owned());
            }
            EventKind::ToolFinished { call_id, tool, status, .. } => {
                let id = call_id.as_str().to_owned();
                assert!(
                    started.contains_key(&id) || matches!(status, ToolOutcomeStatus::Denied | ToolOutcomeStatus::Error),
                    "{ctx}: tool_finished {id} ({status:?}) without an earlier tool_started"
                );
                assert!(finished.insert(id.clone()), "{ctx}: call {id} finished twice");
                if tool == "restart_instance" && *status == ToolOutcomeStatus::Success {
                    let args = &started[&id];
                    let instance = args.strip_prefix("instanceId=").unwrap_or(args).to_owned();
                    restarted.push(instance);
                }
            }
            EventKind::Interrupt { interrupt_id, .. } => {
                interrupts.insert(interrupt_id.as_str().to_owned());
            }
            EventKind::Resumed { interrupt_id, decision, .. } => {
                let id = interrupt_id.as_str().to_owned();
                assert!(interrupts.contains(&id), "{ctx}: resumed {id} before its interrupt");
                assert!(resolved.insert(id.clone()), "{ctx}: interrupt {id} resolved twice");
                assert_eq!(decision, &json!("approve"), "{ctx}: only approvals are sent");
            }
            _ => {}
        }
    }
    assert!(restarted.len() <= 1, "{ctx}: one run restarted {restarted:?}");
    if let Some(answer) = &t.resume {
        let at = answer["resumedSequence"].as_i64().unwrap_or(0);
        let event = events.get((at - 1).max(0) as usize).map(|e| &e.kind);
        assert!(
            matches!(event, Some(EventKind::Resumed { interrupt_id, .. }) if answer["interruptId"] == interrupt_id.as_str()),
            "{ctx}: the retried approval's answer {answer} points at its resumed event"
        );
        assert_eq!(answer["decision"], "approve", "{ctx}: {answer}");
    }

    // The rendered text: no fragment told twice, and equal to the stored assistant messages.
    let text = render_text(&events);
    let all: String = text.iter().map(|(_, t)| t.as_str()).collect::<Vec<_>>().join("\n");
    for (_, message) in &text {
        let first = message.split_inclusive(". ").next().unwrap_or(message);
        assert_eq!(all.matches(first).count(), 1, "{ctx}: {first:?} is told more than once in {all:?}");
    }
    if all.contains("I'm OpsPilot") {
        assert_eq!(all.matches("I'm OpsPilot").count(), 1, "{ctx}: {all:?}");
    }
    let conversation = get(http, format!("{base}/v1/conversations/{}", t.conversation)).await;
    let stored: Vec<&str> = conversation["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "assistant" && m["runId"].as_str() == Some(run))
        .map(|m| m["content"].as_str().unwrap_or(""))
        .collect();
    let rendered: Vec<&str> = text.iter().map(|(_, t)| t.as_str()).filter(|t| !t.is_empty()).collect();
    if let Some(last) = stored.last() {
        assert_eq!(rendered.last(), Some(last), "{ctx}: the rendered answer is the stored one");
    }
    restarted
}

async fn restart_counts(http: &reqwest::Client, base: &str) -> HashMap<String, i64> {
    let fleet = get(http, format!("{base}/v1/demo/instances")).await;
    let list = fleet.as_array().cloned().or_else(|| fleet["instances"].as_array().cloned()).unwrap();
    list.iter().map(|i| (i["id"].as_str().unwrap().to_owned(), i["restartCount"].as_i64().unwrap())).collect()
}

fn env_number(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_survive_sigkill_at_random_points() {
    let iterations = env_number("KEEL_FAULT_ITERATIONS").unwrap_or(20) as usize;
    let seed = env_number("KEEL_FAULT_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    let _alone = EXCLUSIVE.lock().await;
    println!("fault_injection: seed {seed} (KEEL_FAULT_SEED={seed} reproduces), {iterations} iterations");
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let abnormal = iterations + 2;
    let mut server = Server::start(dir.path(), abnormal, 3);
    let initial = restart_counts(&http, &server.base).await;
    let mut next_instance = 0;
    let mut tracked: Vec<Tracked> = Vec::new();
    let mut restarted: HashMap<String, i64> = HashMap::new();
    let started = Instant::now();
    let mut outcomes: HashMap<String, usize> = HashMap::new();
    let mut discarded = 0;
    let mut outcome_unknown = 0;
    let mut stuck_keys = 0;

    for iteration in 0..iterations {
        let (message, kill) = pick(&mut rng, &mut next_instance);
        let ctx = format!("seed {seed}, iteration {iteration}, {message:?}, kill {kill:?}");
        let Driven { conversation: conv, mut run, resume, seen } =
            drive(&http, &mut server, &message, kill, iteration).await;
        server = Server::start(dir.path(), abnormal, 3);
        if run.is_empty() {
            // Killed before the stream told us the run: the conversation knows it, if it was made.
            let c = get(&http, format!("{}/v1/conversations/{conv}", server.base)).await;
            let from_messages = c["messages"].as_array().and_then(|m| m.iter().find_map(|m| m["runId"].as_str()));
            match c["activeRunId"].as_str().or(from_messages) {
                Some(r) => run = r.to_owned(),
                None => {
                    // No run yet; the message may not have been taken. Nothing to check.
                    continue;
                }
            }
        }
        // Stored before sent: whatever a client saw before the crash is in the store, unchanged.
        let stored = events_of(&http, &server.base, &run).await;
        for e in &seen {
            let at = stored.get(e.sequence as usize - 1);
            assert_eq!(
                at,
                Some(e),
                "{ctx}: the client saw event {} before the crash; the store has {at:?}",
                e.sequence
            );
        }
        let mut t = Tracked { run, conversation: conv, what: format!("{message:?}, kill {kill:?}"), resume: None };
        if let Some(body) = resume {
            match retry_resume(&http, &server.base, &t.run, &body, &ctx).await {
                Ok(answer) => t.resume = Some(answer),
                // Asserted by `a_retried_approval_is_answered_after_a_crash`; here the run is
                // settled with another key and the other invariants are checked.
                Err(stuck) => {
                    println!("  STUCK KEY: {stuck}");
                    stuck_keys += 1;
                }
            }
        }
        let state = settle(&http, &server.base, &t.run, &ctx).await;
        for instance in check_run(&http, &server.base, &t, &state, &ctx).await {
            *restarted.entry(instance).or_default() += 1;
        }
        let events = events_of(&http, &server.base, &t.run).await;
        let count = |ty: &str| events.iter().filter(|e| e.type_name() == ty).count();
        let unknown = events
            .iter()
            .filter(|e| matches!(&e.kind, EventKind::Interrupt { payload, .. } if payload["outcomeUnknown"] == true))
            .count();
        println!(
            "  {iteration}: {message:?} kill {kill:?} -> {} ({} events, {} discarded, {} interrupts, {unknown} outcome-unknown)",
            state["status"].as_str().unwrap_or("?"),
            events.len(),
            count("text_discarded"),
            count("interrupt"),
        );
        *outcomes.entry(state["status"].as_str().unwrap_or("?").to_owned()).or_default() += 1;
        discarded += usize::from(count("text_discarded") > 0);
        outcome_unknown += usize::from(unknown > 0);
        tracked.push(t);

        let counts = restart_counts(&http, &server.base).await;
        for (id, count) in &counts {
            let expected = initial.get(id).copied().unwrap_or(0) + restarted.get(id).copied().unwrap_or(0);
            assert_eq!(*count, expected, "{ctx}: {id} restarted {count} times, the runs report {expected}");
        }
    }

    // Once more over everything, on a fresh process: the stored story did not change.
    server.kill();
    server = Server::start(dir.path(), abnormal, 3);
    let mut again: HashMap<String, i64> = HashMap::new();
    for t in &tracked {
        let ctx = format!("seed {seed}, final pass");
        let state = settle(&http, &server.base, &t.run, &ctx).await;
        for instance in check_run(&http, &server.base, t, &state, &ctx).await {
            *again.entry(instance).or_default() += 1;
        }
    }
    assert_eq!(again, restarted, "seed {seed}: the final pass sees the same restarts");
    let counts = restart_counts(&http, &server.base).await;
    for (id, count) in &counts {
        let expected = initial.get(id).copied().unwrap_or(0) + restarted.get(id).copied().unwrap_or(0);
        assert_eq!(*count, expected, "seed {seed}: {id} restarted {count} times, the runs report {expected}");
    }
    println!(
        "fault_injection: {} runs checked ({outcomes:?}, {discarded} with discarded text, {outcome_unknown} re-asked with outcomeUnknown, {stuck_keys} approvals whose key stayed in flight), {} restarts, {:.1} s",
        tracked.len(),
        restarted.values().sum::<i64>(),
        started.elapsed().as_secs_f64()
    );
}

/// Starts a run whose answer is one `text_delta` per abnormal instance (thousands of events) and
/// waits for it to complete; returns how long it took and the server's peak RSS meanwhile.
/// What a long run measured.
struct LongRun {
    took: Duration,
    /// Peak RSS in KiB, and the RSS once a third of the run was written.
    peak_kib: u64,
    third_kib: u64,
    events: Vec<Event>,
    /// The most events one slow reader took.
    read: usize,
}

async fn long_run(http: &reqwest::Client, server: &Server, slow_readers: usize) -> LongRun {
    let base = &server.base;
    let (_, conv) = post(http, format!("{base}/v1/conversations"), json!({})).await;
    let conv = conv["id"].as_str().unwrap().to_owned();
    let started = Instant::now();
    let (status, sent) = post(
        http,
        format!("{base}/v1/conversations/{conv}/messages"),
        json!({"content": format!("benchmark: stream {LONG_RUN_EVENTS} words")}),
    )
    .await;
    assert_eq!(status, 202, "{sent}");
    let run = sent["runId"].as_str().unwrap().to_owned();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..slow_readers)
        .map(|_| {
            let addr = base.trim_start_matches("http://").to_owned();
            let (run, stop) = (run.clone(), stop.clone());
            std::thread::spawn(move || slow_read(&addr, &run, &stop))
        })
        .collect();
    let (mut peak, mut third) = (0, None);
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let rss = server.rss_kib().unwrap_or(0);
        peak = peak.max(rss);
        let state = get(http, format!("{base}/v1/runs/{run}")).await;
        if state["status"] == "completed" {
            break;
        }
        if third.is_none() && state["lastSequence"].as_u64().unwrap_or(0) as usize >= LONG_RUN_EVENTS / 3 {
            third = Some(rss);
        }
        assert!(Instant::now() < deadline, "the long run completes within 40 s: {}", state["status"]);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let read = readers.into_iter().map(|r| r.join().unwrap()).max().unwrap_or(0);
    let events = events_of(http, base, &run).await;
    assert_eq!(events.last().unwrap().type_name(), "done");
    LongRun { took, peak_kib: peak, third_kib: third.unwrap_or(peak), events, read }
}

/// A reader that takes about one event per second: 200 bytes a second off a raw socket (HTTP/1.0,
/// so the body is the bare SSE stream). Returns how many events it read, having checked they are
/// 1, 2, 3, ….
fn slow_read(addr: &str, run: &str, stop: &std::sync::atomic::AtomicBool) -> usize {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(stream, "GET /v1/runs/{run}/events HTTP/1.0\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n").unwrap();
    let mut parser = SseParser::new();
    let mut head = Vec::new();
    let mut body_started = false;
    let mut seen = 0;
    let mut buf = [0u8; 200];
    let mut take = |bytes: &[u8], seen: &mut usize| {
        for frame in parser.push(bytes) {
            if let SseFrame::Event { data, .. } = frame {
                let event: Event = serde_json::from_str(&data).unwrap();
                assert_eq!(event.sequence, *seen as i64 + 1, "the slow reader sees no gap");
                *seen += 1;
            }
        }
    };
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let n = match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if body_started {
            take(&buf[..n], &mut seen);
            std::thread::sleep(Duration::from_secs(1));
            continue;
        }
        head.extend_from_slice(&buf[..n]);
        let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
        let text = String::from_utf8_lossy(&head[..end]).to_lowercase();
        assert!(text.starts_with("http/1.") && text.contains(" 200"), "{text}");
        assert!(!text.contains("chunked"), "{text}");
        body_started = true;
        let rest = head.split_off(end + 4);
        take(&rest, &mut seen);
    }
    seen
}

/// How many slow readers watch the run: buffering the whole stream for each would be
/// `READERS × stream` of memory.
const READERS: usize = 24;

/// About how many events the long run writes (one per abnormal instance, plus a few). Long enough
/// that holding the stream for every reader (the bound below is a fraction of that) stands well
/// above the allocator's noise on a loaded machine (~4 MiB seen at 2,000 events).
const LONG_RUN_EVENTS: usize = 6000;

/// Readers taking about one event a second while the run writes hundreds a second (the demo model
/// at `--demo-delay-ms 1`, one `text_delta` per word of a 6,000-word answer) neither slow the run down
/// nor make the server hold the run for them: the run completes in about the time it takes
/// unobserved, and the server's RSS (`VmRSS`) stays near what it is without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_neither_slows_the_run_nor_grows_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let _alone = EXCLUSIVE.lock().await;
    let server = Server::start(dir.path(), 0, 1);
    let alone = long_run(&http, &server, 0).await;
    let watched = long_run(&http, &server, READERS).await;
    let stream_kib = alone.events.iter().map(|e| serde_json::to_string(e).unwrap().len() + 40).sum::<usize>() / 1024;
    let events = alone.events.len();
    // What the server's memory grew by over the last two thirds of the run: buffers that are bounded
    // are full by then; a server that held the stream for each reader would still be growing.
    let late = |r: &LongRun| r.peak_kib.saturating_sub(r.third_kib);
    println!(
        "slow readers: {events} events ({stream_kib} KiB of SSE); unobserved {:.2} s, RSS {} KiB at a third, \
         peak {} KiB; with {READERS} slow readers (each read at most {} events) {:.2} s, RSS {} KiB at a third, \
         peak {} KiB",
        alone.took.as_secs_f64(),
        alone.third_kib,
        alone.peak_kib,
        watched.read,
        watched.took.as_secs_f64(),
        watched.third_kib,
        watched.peak_kib,
    );
    assert!(events > 1500, "a long run: {events} events");
    assert!(
        watched.took < alone.took.mul_f64(1.5) + Duration::from_secs(1),
        "the slow readers slowed the run: {:?} against {:?}",
        watched.took,
        alone.took
    );
    // Holding the stream for every reader would add 2/3 × READERS × stream_kib over the last two
    // thirds; a quarter of that is the bound, plus what each slow connection may hold by design:
    // hyper's write buffer (at most 8 KiB + 100 × 4 KiB before it stops polling the body) and the
    // SSE channel's 64 frames, which fill up as the reader falls behind (each of at most 4 KiB of
    // events plus one ~300-byte event). And never more than 32 MiB over the unobserved peak.
    const PER_CONNECTION_KIB: usize = 408 + 64 * (4096 + 300) / 1024;
    let bound = (READERS * (stream_kib / 6 + PER_CONNECTION_KIB)) as u64;
    assert!(
        late(&watched) < late(&alone) + bound,
        "the server's memory kept growing with slow readers: +{} KiB over the last two thirds of the run, \
         against +{} KiB unobserved (bound +{bound} KiB)",
        late(&watched),
        late(&alone)
    );
    assert!(
        watched.peak_kib < alone.peak_kib + 32 * 1024,
        "the server's memory grew with slow readers: {} KiB against {} KiB",
        watched.peak_kib,
        alone.peak_kib
    );
}

/// The documented retry: "409 `IDEMPOTENCY_KEY_IN_FLIGHT` while the first is still being processed
/// — retry". When the first died with its process, the retry with the same key must be answered (the
/// first answer if the approval was committed, else evaluated afresh), not refused for the key's
/// 24 hours. The kill lands at swept delays after the approval is sent, so that some land between
/// the key being recorded and the approval being answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_approval_is_answered_after_a_crash() {
    let _alone = EXCLUSIVE.lock().await;
    const ATTEMPTS: usize = 40;
    let dir = tempfile::tempdir().unwrap();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let mut server = Server::start(dir.path(), ATTEMPTS + 2, 2);
    let mut stuck = Vec::new();
    let mut attempts = 0;
    for attempt in 0..ATTEMPTS {
        attempts += 1;
        let base = server.base.clone();
        let (_, conv) = post(&http, format!("{base}/v1/conversations"), json!({})).await;
        let conv = conv["id"].as_str().unwrap().to_owned();
        let (status, turn) = post(
            &http,
            format!("{base}/v1/conversations/{conv}/messages?wait=true"),
            json!({"content": format!("restart pay-prod-a{}", attempt + 1)}),
        )
        .await;
        assert_eq!((status, &turn["run"]["status"]), (200, &json!("interrupted")), "{turn}");
        let run = turn["run"]["id"].as_str().unwrap().to_owned();
        let interrupt = turn["interrupt"]["id"].as_str().unwrap().to_owned();
        let body =
            json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": format!("retry-{attempt}")});
        let delay = Duration::from_micros((attempt % 20) as u64 * 250);
        let sent = tokio::spawn(http.post(format!("{base}/v1/runs/{run}/resume")).json(&body).send());
        tokio::time::sleep(delay).await;
        server.kill();
        let _ = sent.await;
        server = Server::start(dir.path(), ATTEMPTS + 2, 2);
        let ctx = format!("attempt {attempt}, killed {delay:?} after sending the approval");
        if let Err(why) = retry_resume(&http, &server.base, &run, &body, &ctx).await {
            stuck.push(why);
        }
        // Enough to tell: a stuck key of each kind (the approval lost, and the approval committed).
        let kinds = ["not claimed", "was claimed"].map(|k| stuck.iter().any(|s| s.contains(k)));
        if kinds == [true, true] {
            break;
        }
        let state = settle(&http, &server.base, &run, &ctx).await;
        assert_eq!(state["status"], "completed", "{ctx}: {state}");
    }
    assert!(
        stuck.is_empty(),
        "{} of {} approvals' keys stay in flight after a crash:\n{}",
        stuck.len(),
        attempts,
        stuck.join("\n")
    );
}
