//! The engine with a real model client: `keel_models::OpenAiCompatible` talking to a mock
//! OpenAI-compatible server (axum on 127.0.0.1:0, the real SSE wire format in small pieces) that
//! records every request. The OpsPilot approval flow end to end; a 200-turn conversation whose
//! prompts stay within the context budget, with model-written summaries; the fallback when the
//! summary call fails; and secrets in a tool result that reach no prompt, event or row.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::Response;
use axum::routing::post;
use axum::serve::ListenerExt;
use axum::Router;
use common::*;
use keel_core::context::{estimate_tokens, ContextConfig, SUMMARIZER_PROMPT, SUMMARY_LABEL};
use keel_core::engine::SendMessage;
use keel_core::model::{Model, ModelChunk, ModelError, ModelMessage, ModelRequest, ModelStream};
use keel_core::tool::{Tool, ToolContext, ToolError, ToolOutput, ToolSpec};
use keel_core::{ConversationId, RunId, RunStatus};
use keel_models::{OpenAiCompatible, OpenAiConfig};
use serde_json::{json, Value};
use tempfile::TempDir;

// ------------------------------------------------------------------------------- the mock server

/// What the mock answers to one request.
enum Reply {
    /// These chunks as server-sent events, then `[DONE]`.
    Sse(Vec<Value>),
    /// An error status with an OpenAI-style error body.
    Error(u16, &'static str),
}

type Responder = Box<dyn Fn(&Value) -> Reply + Send + Sync>;

struct MockState {
    received: Mutex<Vec<Value>>,
    respond: Responder,
}

struct Mock {
    base_url: String,
    state: Arc<MockState>,
}

impl Mock {
    /// A server that answers each request with `respond(body)`.
    async fn start(respond: impl Fn(&Value) -> Reply + Send + Sync + 'static) -> Self {
        let state = Arc::new(MockState { received: Mutex::new(Vec::new()), respond: Box::new(respond) });
        let app = Router::new().route("/v1/chat/completions", post(handle)).with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Without it, Nagle's algorithm holds each small piece until the client's delayed ACK.
        let listener = listener.tap_io(|tcp| tcp.set_nodelay(true).unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self { base_url: format!("http://{addr}/v1"), state }
    }

    fn received(&self) -> Vec<Value> {
        self.state.received.lock().unwrap().clone()
    }

    fn main_requests(&self) -> Vec<Value> {
        self.received().into_iter().filter(|b| !is_summary_request(b)).collect()
    }

    fn summary_requests(&self) -> Vec<Value> {
        self.received().into_iter().filter(is_summary_request).collect()
    }

    fn model(&self) -> Arc<OpenAiCompatible> {
        let mut config = OpenAiConfig::new(&self.base_url, "gpt-test");
        config.api_key = Some("sk-test-key-0123456789".into());
        config.max_retries = 0;
        config.first_token_timeout = Duration::from_secs(10);
        config.idle_timeout = Duration::from_secs(10);
        Arc::new(OpenAiCompatible::new(config).unwrap())
    }
}

async fn handle(State(state): State<Arc<MockState>>, body: Bytes) -> Response {
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let reply = (state.respond)(&body);
    state.received.lock().unwrap().push(body);
    match reply {
        Reply::Sse(chunks) => {
            let mut wire: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
            wire.push_str("data: [DONE]\n\n");
            // Small pieces, so reads split lines (and tool-call arguments arrive in fragments anyway).
            let pieces: Vec<Result<Bytes, std::io::Error>> =
                wire.as_bytes().chunks(7).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
            Response::builder()
                .status(200)
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(futures::stream::iter(pieces)))
                .unwrap()
        }
        Reply::Error(status, message) => Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Body::from(json!({"error": {"message": message, "type": "test_error"}}).to_string()))
            .unwrap(),
    }
}

fn chunk(delta: Value, finish: Option<&str>) -> Value {
    json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-test",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
}

/// A text answer, in a few deltas.
fn text_reply(text: &str) -> Reply {
    let mut chunks = vec![chunk(json!({"role": "assistant", "content": ""}), None)];
    let words: Vec<&str> = text.split_inclusive(' ').collect();
    for part in words.chunks(3) {
        chunks.push(chunk(json!({"content": part.concat()}), None));
    }
    chunks.push(chunk(json!({}), Some("stop")));
    Reply::Sse(chunks)
}

/// One tool call, its arguments split across chunks.
fn tool_call_reply(id: &str, name: &str, argument_pieces: &[&str]) -> Reply {
    let mut chunks = vec![
        chunk(json!({"role": "assistant", "content": null}), None),
        chunk(
            json!({"tool_calls": [{"index": 0, "id": id, "type": "function",
                "function": {"name": name, "arguments": ""}}]}),
            None,
        ),
    ];
    for piece in argument_pieces {
        chunks.push(chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}), None));
    }
    chunks.push(chunk(json!({}), Some("tool_calls")));
    Reply::Sse(chunks)
}

// ------------------------------------------------------------------------------- reading requests

fn messages(body: &Value) -> &[Value] {
    body["messages"].as_array().map(Vec::as_slice).unwrap_or(&[])
}

fn is_summary_request(body: &Value) -> bool {
    messages(body).first().and_then(|m| m["content"].as_str()).is_some_and(|c| c.starts_with(SUMMARIZER_PROMPT))
}

fn content(message: &Value) -> &str {
    message["content"].as_str().unwrap_or("")
}

fn system(body: &Value) -> &str {
    content(&messages(body)[0])
}

/// The prompt's size as the engine estimates it: every message's content, and the name and
/// arguments of every tool call (the tool specs are not part of the budget).
fn prompt_tokens(body: &Value) -> usize {
    messages(body)
        .iter()
        .map(|m| {
            let calls = m["tool_calls"].as_array().map(Vec::as_slice).unwrap_or(&[]);
            estimate_tokens(content(m))
                + calls
                    .iter()
                    .map(|c| {
                        let f = &c["function"];
                        estimate_tokens(&format!("{}{}", f["name"].as_str().unwrap(), f["arguments"].as_str().unwrap()))
                    })
                    .sum::<usize>()
        })
        .sum()
}

/// The conversation part of a prompt (after the system message) as (role, content).
fn turns(body: &Value) -> Vec<(String, String)> {
    messages(body)[1..].iter().map(|m| (m["role"].as_str().unwrap().to_owned(), content(m).to_owned())).collect()
}

/// The number in the last `Question N:` of a text.
fn last_question(text: &str) -> Option<usize> {
    text.match_indices("Question ").filter_map(|(i, _)| number_at(&text[i + "Question ".len()..])).last()
}

fn first_question(text: &str) -> Option<usize> {
    text.match_indices("Question ").find_map(|(i, _)| number_at(&text[i + "Question ".len()..]))
}

fn number_at(text: &str) -> Option<usize> {
    let digits: String = text.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

fn question(i: usize) -> String {
    format!("Question {i}: is pay-prod-{} healthy right now?", i % 7)
}

fn answer(i: usize) -> String {
    format!("Answer {i}: pay-prod-{} looks healthy.", i % 7)
}

/// Answers a main request with `Answer N` for the last `Question N`; a summary request with a
/// summary that names the last question it covers.
fn conversation_responder(body: &Value) -> Reply {
    let last_user = messages(body).iter().rev().find(|m| m["role"] == "user").map(content).unwrap_or("");
    if is_summary_request(body) {
        let covered = last_question(last_user).expect("a summary request carries questions");
        return text_reply(&format!("The user asked questions 0 to {covered}; each was answered."));
    }
    match last_question(last_user) {
        Some(i) => text_reply(&answer(i)),
        None => text_reply("ok"),
    }
}

fn small_context(budget: usize) -> ContextConfig {
    ContextConfig {
        context_budget_tokens: budget,
        summary_max_chars: 600,
        summarize_with_model: true,
        ..opspilot_context()
    }
}

async fn talk(h: &Harness, conv: &ConversationId, turns: std::ops::Range<usize>) -> Vec<RunId> {
    let mut runs = Vec::new();
    for i in turns {
        let (run, events) = h.say(conv, &question(i)).await;
        assert_eq!(last_type(&events), "done", "turn {i}");
        assert_eq!(text(&events), answer(i), "turn {i}");
        runs.push(run);
    }
    runs
}

// ------------------------------------------------------------------------------- the tests

#[tokio::test]
async fn restart_with_approval_through_the_openai_client() {
    let main_calls = Arc::new(AtomicUsize::new(0));
    let calls = main_calls.clone();
    let mock = Mock::start(move |body| {
        assert!(!is_summary_request(body), "a short conversation needs no summary");
        match calls.fetch_add(1, Ordering::SeqCst) {
            0 => tool_call_reply("call_restart1", "restart_instance", &["{\"instan", "ceId\": \"pay-", "prod-2\"}"]),
            _ => text_reply("Restarted pay-prod-2; it is healthy again."),
        }
    })
    .await;
    let dir = TempDir::new().unwrap();
    let h = Harness::new(dir.path(), Options { model: mock.model(), ..Default::default() }).await;
    let conv = h.conversation().await;

    let (run, events) = h.say(&conv, "Restart pay-prod-2").await;
    assert_eq!(last_type(&events), "interrupt");
    let (interrupt, payload) = interrupt_of(&events);
    assert_eq!(payload["actions"][0]["tool"], "restart_instance");
    // The call's id is Keel's own (it is the idempotency key), not the model's.
    let call_id = payload["actions"][0]["callId"].as_str().unwrap().to_owned();
    assert!(call_id.starts_with("call_") && call_id != "call_restart1", "{call_id}");
    assert_eq!(payload["actions"][0]["args"], json!({"instanceId": "pay-prod-2"}));
    assert_eq!(h.engine.run("demo", &run).await.unwrap().status, RunStatus::Interrupted);
    assert_eq!(h.restart_count("pay-prod-2").await, 0, "nothing happens before approval");
    assert_eq!(mock.received().len(), 1);

    let after = h.decide(&run, &interrupt, json!("approve")).await;
    assert_eq!(last_type(&after), "done");
    assert_eq!(text(&after), "Restarted pay-prod-2; it is healthy again.");
    assert_eq!(h.engine.run("demo", &run).await.unwrap().status, RunStatus::Completed);
    assert_eq!(h.restart_count("pay-prod-2").await, 1);
    assert_contiguous(&h.all_events(&run).await);

    let received = mock.received();
    assert_eq!(received.len(), 2);
    // The first request: the system prompt, the user's message and the tools.
    let first = &received[0];
    assert_eq!(first["model"], "gpt-test");
    assert_eq!(first["stream"], true);
    assert_eq!(messages(first).last().unwrap()["content"], "Restart pay-prod-2");
    let tools: Vec<&str> =
        first["tools"].as_array().unwrap().iter().map(|t| t["function"]["name"].as_str().unwrap()).collect();
    assert!(tools.contains(&"restart_instance"), "{tools:?}");
    // The second: the call as the model made it, then its result under the same id (Keel's).
    let second = messages(&received[1]);
    let n = second.len();
    let call = &second[n - 2];
    assert_eq!(call["role"], "assistant");
    assert_eq!(call["tool_calls"][0]["id"], call_id.as_str());
    assert_eq!(call["tool_calls"][0]["function"]["name"], "restart_instance");
    let args: Value = serde_json::from_str(call["tool_calls"][0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"instanceId": "pay-prod-2"}));
    let result = &second[n - 1];
    assert_eq!(result["role"], "tool");
    assert_eq!(result["tool_call_id"], call_id.as_str());
    assert!(content(result).contains("pay-prod-2"), "{result}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_turns_stay_within_the_budget_with_model_summaries() {
    const BUDGET: usize = 800;
    const TURNS: usize = 200;
    let mock = Mock::start(conversation_responder).await;
    let dir = TempDir::new().unwrap();
    let h =
        Harness::new(dir.path(), Options { model: mock.model(), context: small_context(BUDGET), ..Default::default() })
            .await;
    let conv = h.conversation().await;
    talk(&h, &conv, 0..TURNS).await;

    // A step reads what its context uses, not the history: the turns after the summary.
    let history = h.store.list_messages(&conv).await.unwrap().len();
    let window = h.store.context_window(&conv).await.unwrap();
    assert_eq!(history, 2 * TURNS);
    assert!(window.summary.is_some());
    assert!(
        window.messages.len() <= 2 * 20,
        "the context reads {} of {history} messages: more than a budget's worth",
        window.messages.len()
    );

    let received = mock.received();
    for (i, body) in received.iter().enumerate() {
        let tokens = prompt_tokens(body);
        assert!(tokens <= BUDGET, "request {i} has {tokens} tokens, over the budget of {BUDGET}");
    }
    let main = mock.main_requests();
    assert_eq!(main.len(), TURNS, "one main call per turn");
    let summaries = mock.summary_requests();
    assert!(
        (3..=TURNS / 8).contains(&summaries.len()),
        "{} summary calls for {TURNS} turns: one only when enough new history has fallen out",
        summaries.len()
    );
    for s in &summaries {
        assert!(s.get("tools").is_none(), "a summary call offers no tools");
    }

    // Each summary call gets the previous summary and only what fell out since: nothing twice,
    // nothing skipped.
    let mut covered: Option<usize> = None;
    for s in &summaries {
        let ask = content(&messages(s)[1]);
        let new_part = ask.split("Turns to add to it:\n").nth(1).unwrap();
        let (from, to) = (first_question(new_part).unwrap(), last_question(new_part).unwrap());
        match covered {
            None => {
                assert_eq!(from, 0);
                assert!(!ask.contains("Previous summary:"));
            }
            Some(c) => {
                assert_eq!(from, c + 1, "{ask}");
                assert!(ask.contains(&format!("Previous summary:\nThe user asked questions 0 to {c};")), "{ask}");
            }
        }
        assert!(to >= from + 5, "a summary call covers several turns ({from}..={to})");
        covered = Some(to);
    }

    let mut summarised = false;
    for (i, body) in main.iter().enumerate() {
        let conversation = turns(body);
        // The current question, verbatim and last.
        assert_eq!(conversation.last().unwrap(), &("user".to_owned(), question(i)), "turn {i}");
        // Every turn shown is verbatim and in order; together with the summary, nothing is missing.
        let first = first_question(&conversation[0].1).unwrap();
        let expected: Vec<(String, String)> = (first..i)
            .flat_map(|k| [("user".to_owned(), question(k)), ("assistant".to_owned(), answer(k))])
            .chain([("user".to_owned(), question(i))])
            .collect();
        assert_eq!(conversation, expected, "turn {i}");
        let sys = system(body);
        if first == 0 {
            assert!(!summarised, "turn {i}: a summary, once there, stays");
            assert!(!sys.contains(SUMMARY_LABEL), "turn {i}");
        } else {
            summarised = true;
            let marked = format!("{SUMMARY_LABEL}\nThe user asked questions 0 to {};", first - 1);
            assert!(sys.contains(&marked), "turn {i}: {sys}");
            assert!(first + 5 <= i, "turn {i}: the last turns stay verbatim (from {first})");
        }
    }
    assert!(summarised);
    let stored = h.store.get_summary(&conv).await.unwrap().expect("a stored summary");
    assert!(stored.text.starts_with("The user asked questions 0 to "), "{}", stored.text);
    assert!(h.store.list_facts(&conv).await.unwrap().is_empty(), "a summary is never a fact");
}

#[tokio::test]
async fn a_failing_summary_call_falls_back_to_the_extractive_summary() {
    let mock = Mock::start(|body| {
        if is_summary_request(body) {
            Reply::Error(400, "summaries are not available")
        } else {
            conversation_responder(body)
        }
    })
    .await;
    let dir = TempDir::new().unwrap();
    let h =
        Harness::new(dir.path(), Options { model: mock.model(), context: small_context(500), ..Default::default() })
            .await;
    let conv = h.conversation().await;
    let runs = talk(&h, &conv, 0..30).await;
    for run in &runs {
        assert_eq!(h.engine.run("demo", run).await.unwrap().status, RunStatus::Completed);
    }
    assert!(!mock.summary_requests().is_empty(), "the summary was asked for");
    let last = mock.main_requests().pop().unwrap();
    let sys = system(&last);
    assert!(sys.contains(&format!("{SUMMARY_LABEL}\n- ")), "{sys}");
    assert!(sys.contains("- User asked: Question "), "{sys}");
    assert!(sys.contains("- Assistant answered: Answer "), "{sys}");
    let stored = h.store.get_summary(&conv).await.unwrap().unwrap();
    assert!(stored.text.contains("- User asked: Question "), "{}", stored.text);
    assert!(prompt_tokens(&last) <= 500);
}

/// Answers like the mock server's conversation; a summary call never answers.
struct StuckSummaries {
    summary_started: tokio::sync::Notify,
}

#[async_trait]
impl Model for StuckSummaries {
    fn name(&self) -> &str {
        "stuck-summaries"
    }

    async fn stream(&self, request: ModelRequest) -> Result<ModelStream, ModelError> {
        if request.tools.is_empty() {
            self.summary_started.notify_one();
            return Ok(Box::pin(futures::stream::pending()));
        }
        let last_user = request.messages.iter().rev().find_map(|m| match m {
            ModelMessage::User { content } => Some(content.clone()),
            _ => None,
        });
        let text = last_question(last_user.as_deref().unwrap_or("")).map(answer).unwrap_or_else(|| "ok".into());
        Ok(Box::pin(futures::stream::iter([Ok(ModelChunk::Text(text))])))
    }
}

#[tokio::test]
async fn a_run_waiting_for_its_summary_can_be_cancelled() {
    let model = Arc::new(StuckSummaries { summary_started: tokio::sync::Notify::new() });
    let dir = TempDir::new().unwrap();
    let h =
        Harness::new(dir.path(), Options { model: model.clone(), context: small_context(400), ..Default::default() })
            .await;
    let conv = h.conversation().await;
    let mut i = 0;
    let run = loop {
        assert!(i < 50, "a summary was needed by now");
        let started = h
            .engine
            .send_message("demo", &conv, SendMessage { content: question(i), cancel_on_disconnect: false })
            .await
            .unwrap();
        let settled = h.engine.wait_settled(&started.run.id, 0);
        tokio::select! {
            events = settled => assert_eq!(last_type(&events.unwrap()), "done", "turn {i}"),
            _ = model.summary_started.notified() => break started.run.id,
        }
        i += 1;
    };
    h.engine.cancel("demo", &run).await.unwrap();
    let events = h.settle(&run, 0).await;
    assert_eq!(last_type(&events), "cancelled");
    assert_eq!(h.engine.run("demo", &run).await.unwrap().status, RunStatus::Cancelled);
    assert!(h.store.get_summary(&conv).await.unwrap().is_none(), "no summary was stored");
}

/// A tool that reads a database's settings and, carelessly, hands back its credentials.
struct ReadDbConfig {
    spec: ToolSpec,
}

impl ReadDbConfig {
    fn new() -> Self {
        Self {
            spec: ToolSpec::new(
                "read_db_config",
                "Reads the settings of the payments database.",
                json!({"type": "object", "properties": {}, "additionalProperties": false}),
                false,
            ),
        }
    }
}

#[async_trait]
impl Tool for ReadDbConfig {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn execute(&self, _ctx: &ToolContext, _args: &Value) -> Result<ToolOutput, ToolError> {
        Ok(ToolOutput {
            result: json!({
                "host": "db",
                "password": "hunter2",
                "auth": "Bearer sk-live-123",
                "dsn": "postgres://admin:pw@db/x",
                "log": ["connected to postgres://admin:pw@db/x", "login with password=hunter2 and key sk-live-123"],
            }),
            summary: "read the settings of postgres://admin:pw@db/x (password=hunter2, Bearer sk-live-123)".into(),
            facts: vec![
                ("db_dsn".into(), "postgres://admin:pw@db/x".into()),
                ("db_auth".into(), "Bearer sk-live-123".into()),
                ("db_password".into(), "hunter2".into()),
            ],
        })
    }
}

#[tokio::test]
async fn secrets_in_a_tool_result_reach_no_prompt_event_or_row() {
    const SECRETS: &[&str] = &["hunter2", "sk-live-123", "admin:pw"];
    let main_calls = Arc::new(AtomicUsize::new(0));
    let calls = main_calls.clone();
    let mock = Mock::start(move |body| {
        if is_summary_request(body) {
            // The worst summariser: it repeats everything it was given.
            let ask = content(&messages(body)[1]).to_owned();
            return text_reply(&ask);
        }
        match calls.fetch_add(1, Ordering::SeqCst) {
            0 => tool_call_reply("call_db1", "read_db_config", &["{", "}"]),
            1 => text_reply("The payments database is on host db."),
            _ => conversation_responder(body),
        }
    })
    .await;
    let tools: Tools =
        Arc::new(|fleet, calls| keel_opspilot::registry(fleet, calls).with(Arc::new(ReadDbConfig::new())));
    let dir = TempDir::new().unwrap();
    let h = Harness::new(
        dir.path(),
        Options { model: mock.model(), tools, context: small_context(700), ..Default::default() },
    )
    .await;
    let conv = h.conversation().await;
    let (first_run, events) = h.say(&conv, "Which database does payments use?").await;
    assert_eq!(last_type(&events), "done");
    assert_eq!(text(&events), "The payments database is on host db.");
    // Enough turns afterwards for the tool result to be summarised by the model.
    let mut runs = vec![first_run.clone()];
    runs.extend(talk(&h, &conv, 0..40).await);

    // The tool ran, and what reached the model was its masked result.
    let second = &mock.main_requests()[1];
    let result = messages(second).iter().find(|m| m["role"] == "tool").expect("the tool result");
    let call = messages(second).iter().find(|m| m["role"] == "assistant" && m["tool_calls"].is_array()).unwrap();
    assert_eq!(result["tool_call_id"], call["tool_calls"][0]["id"], "the result answers the call");
    let shown: Value = serde_json::from_str(content(result)).unwrap();
    assert_eq!(shown["password"], "***");
    assert_eq!(shown["auth"], "Bearer ***");
    assert_eq!(shown["dsn"], "postgres://***@db/x");
    assert_eq!(shown["host"], "db");
    assert!(system(second).contains("- db_dsn: postgres://***@db/x"), "{}", system(second));
    let summaries = mock.summary_requests();
    assert!(
        summaries.iter().any(|s| content(&messages(s)[1]).contains("Tool result (read_db_config)")),
        "the tool result was summarised"
    );

    let leaks = |what: &str, text: &str| {
        for secret in SECRETS {
            assert!(!text.contains(secret), "{secret:?} leaked into {what}: {text}");
        }
    };
    for (i, body) in mock.received().iter().enumerate() {
        leaks(&format!("request {i}"), &body.to_string());
    }
    for run in &runs {
        let events = h.all_events(run).await;
        assert!(!events.is_empty());
        leaks("the events", &serde_json::to_string(&events).unwrap());
        let calls = h.store.list_tool_calls(run).await.unwrap();
        leaks("the tool calls", &serde_json::to_string(&calls).unwrap());
    }
    let calls = h.store.list_tool_calls(&first_run).await.unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].result.as_ref().unwrap()["password"], "***");
    assert!(calls[0].summary.as_ref().unwrap().contains("postgres://***@db/x"));
    leaks("the messages", &serde_json::to_string(&h.store.list_messages(&conv).await.unwrap()).unwrap());
    let facts = keel_core::fact_map(&h.store.list_facts(&conv).await.unwrap());
    leaks("the facts", &serde_json::to_string(&facts).unwrap());
    assert_eq!(facts.get("db_dsn").map(String::as_str), Some("postgres://***@db/x"));
    assert_eq!(facts.get("db_auth").map(String::as_str), Some("Bearer ***"));
    assert_eq!(facts.get("db_password").map(String::as_str), Some("***"));
    let summary = h.store.get_summary(&conv).await.unwrap().expect("a stored summary");
    leaks("the summary", &summary.text);
    let view = h.engine.conversation_view("demo", &conv).await.unwrap();
    leaks("the conversation view", &serde_json::to_string(&view).unwrap());
}
