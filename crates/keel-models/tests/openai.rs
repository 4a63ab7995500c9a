//! `OpenAiCompatible` against a mock OpenAI-compatible server: a real axum server on 127.0.0.1:0
//! that answers each request with the next scripted reply, in the real SSE wire format, written in
//! small pieces (so reads split lines and UTF-8 characters), and records what it received.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use futures::StreamExt;
use keel_core::model::{Model, ModelChunk, ModelError, ModelMessage, ModelRequest, ModelToolCall};
use keel_core::tool::{JsonSchema, ToolSpec};
use keel_models::openai::INVALID_JSON_KEY;
use keel_models::{OpenAiCompatible, OpenAiConfig, Usage};
use serde_json::{json, Value};
use tokio::sync::mpsc;

const KEY: &str = "sk-test-0123456789abcdef";

// ------------------------------------------------------------------------------- the mock

#[derive(Clone)]
enum Piece {
    Bytes(Vec<u8>),
    /// The model takes its time (a scripted pause of the server, not of the test).
    Pause(Duration),
    /// Send nothing more, and keep the connection open.
    Hold,
    /// Keep the connection open, writing an SSE comment every 20 ms (so a closed socket is noticed).
    HoldPinging,
    /// Break the connection (the chunked body is cut off).
    Fail,
}

#[derive(Clone)]
struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    pieces: Vec<Piece>,
}

#[derive(Debug, Clone)]
struct Received {
    at: Instant,
    headers: HeaderMap,
    body: Value,
}

struct MockState {
    script: Mutex<VecDeque<Reply>>,
    received: Mutex<Vec<Received>>,
    /// The number of each request whose response body was dropped (finished or disconnected).
    closed: mpsc::UnboundedSender<usize>,
}

struct Mock {
    base_url: String,
    state: Arc<MockState>,
    closed: mpsc::UnboundedReceiver<usize>,
}

impl Mock {
    async fn start(script: Vec<Reply>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let state =
            Arc::new(MockState { script: Mutex::new(script.into()), received: Mutex::new(Vec::new()), closed: tx });
        let app = Router::new().route("/v1/chat/completions", post(handle)).with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self { base_url: format!("http://{addr}/v1"), state, closed: rx }
    }

    fn received(&self) -> Vec<Received> {
        self.state.received.lock().unwrap().clone()
    }

    fn config(&self) -> OpenAiConfig {
        let mut c = OpenAiConfig::new(&self.base_url, "gpt-test");
        c.retry_base_delay = Duration::from_millis(5);
        c.first_token_timeout = Duration::from_secs(10);
        c.idle_timeout = Duration::from_secs(10);
        c
    }

    fn model(&self) -> OpenAiCompatible {
        OpenAiCompatible::new(self.config()).unwrap()
    }
}

struct OnDrop(usize, mpsc::UnboundedSender<usize>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        let _ = self.1.send(self.0);
    }
}

async fn handle(State(state): State<Arc<MockState>>, headers: HeaderMap, body: Bytes) -> Response {
    let n = {
        let mut received = state.received.lock().unwrap();
        received.push(Received {
            at: Instant::now(),
            headers,
            body: serde_json::from_slice(&body).unwrap_or(Value::Null),
        });
        received.len() - 1
    };
    let reply = state.script.lock().unwrap().pop_front().unwrap_or_else(|| error_reply(500, "the script ran out"));
    let guard = OnDrop(n, state.closed.clone());
    let pieces = reply.pieces;
    let body = async_stream::stream! {
        let _guard = guard;
        for piece in pieces {
            match piece {
                Piece::Bytes(b) => {
                    yield Ok::<_, std::io::Error>(Bytes::from(b));
                    tokio::task::yield_now().await;
                }
                Piece::Pause(d) => tokio::time::sleep(d).await,
                Piece::Hold => futures::future::pending::<()>().await,
                Piece::HoldPinging => loop {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    yield Ok(Bytes::from_static(b": ping\n\n"));
                },
                Piece::Fail => {
                    yield Err(std::io::Error::other("the mock breaks the connection"));
                    return;
                }
            }
        }
    };
    let mut response = Response::builder().status(reply.status);
    for (k, v) in reply.headers {
        response = response.header(k, v);
    }
    response.body(Body::from_stream(body)).unwrap()
}

// ------------------------------------------------------------------------------- replies

/// Events as the wire carries them, cut into `size`-byte pieces.
fn wire(text: &str, size: usize) -> Vec<Piece> {
    text.as_bytes().chunks(size).map(|c| Piece::Bytes(c.to_vec())).collect()
}

fn events(chunks: &[Value]) -> String {
    chunks.iter().map(|c| format!("data: {c}\n\n")).collect()
}

fn sse_reply(pieces: Vec<Piece>) -> Reply {
    Reply { status: 200, headers: vec![("content-type", "text/event-stream".into())], pieces }
}

/// A complete stream: the chunks, then `[DONE]`, in 7-byte pieces.
fn sse(chunks: &[Value]) -> Reply {
    sse_reply(wire(&(events(chunks) + "data: [DONE]\n\n"), 7))
}

fn error_reply(status: u16, message: &str) -> Reply {
    Reply {
        status,
        headers: vec![("content-type", "application/json".into())],
        pieces: vec![Piece::Bytes(
            json!({"error": {"message": message, "type": "test_error", "code": null}}).to_string().into_bytes(),
        )],
    }
}

fn chunk(delta: Value, finish: Option<&str>) -> Value {
    json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-test",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
}

fn role() -> Value {
    chunk(json!({"role": "assistant", "content": ""}), None)
}

fn text(s: &str) -> Value {
    chunk(json!({"content": s}), None)
}

fn finish(reason: &str) -> Value {
    chunk(json!({}), Some(reason))
}

fn tool_start(index: usize, id: &str, name: &str) -> Value {
    chunk(
        json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
        None,
    )
}

fn tool_args(index: usize, fragment: &str) -> Value {
    chunk(json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}), None)
}

fn usage(prompt: u64, completion: u64) -> Value {
    json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}})
}

// ------------------------------------------------------------------------------- helpers

fn instance_schema() -> Value {
    json!({
        "type": "object",
        "properties": {"instanceId": {"type": "string", "minLength": 1}},
        "required": ["instanceId"],
        "additionalProperties": false
    })
}

fn request(user: &str) -> ModelRequest {
    ModelRequest {
        messages: vec![
            ModelMessage::System { content: "You are OpsPilot.".into() },
            ModelMessage::User { content: user.into() },
        ],
        tools: vec![ToolSpec::new("restart_instance", "Restart one instance.", instance_schema(), true)].into(),
        facts: Default::default(),
    }
}

/// Everything the stream yields up to its end or its first error.
async fn collect(model: &OpenAiCompatible, req: ModelRequest) -> (Vec<ModelChunk>, Option<ModelError>) {
    let mut stream = match model.stream(req).await {
        Ok(s) => s,
        Err(e) => return (Vec::new(), Some(e)),
    };
    let mut chunks = Vec::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(c) => chunks.push(c),
            Err(e) => return (chunks, Some(e)),
        }
    }
    (chunks, None)
}

fn text_of(chunks: &[ModelChunk]) -> String {
    chunks.iter().filter_map(|c| if let ModelChunk::Text(t) = c { Some(t.as_str()) } else { None }).collect()
}

fn calls_of(chunks: &[ModelChunk]) -> Vec<ModelToolCall> {
    chunks.iter().filter_map(|c| if let ModelChunk::ToolCall(tc) = c { Some(tc.clone()) } else { None }).collect()
}

fn assert_no_key(e: &ModelError) {
    let shown = format!("{e} / {e:?}");
    assert!(!shown.contains(KEY), "the key leaked: {shown}");
}

// ------------------------------------------------------------------------------- tests

#[tokio::test]
async fn text_deltas_stream_as_they_arrive() {
    // CRLF line endings, comments, a role-only first chunk, multi-byte characters cut by 3-byte pieces.
    let body = format!(
        ": OPENROUTER PROCESSING\r\n\r\n{}",
        events(&[role(), text("Hé"), text("llo, "), text("wörld 🚀"), text("!")])
    )
    .replace("\n\n", "\r\n\r\n")
        + &events(&[finish("stop"), usage(12, 5)])
        + "data: [DONE]\n\n";
    let mock = Mock::start(vec![sse_reply(wire(&body, 3))]).await;
    let model = mock.model();
    let (chunks, err) = collect(&model, request("hi")).await;
    assert_eq!(err, None);
    assert_eq!(text_of(&chunks), "Héllo, wörld 🚀!");
    assert_eq!(chunks.len(), 4, "one Text per delta: {chunks:?}");
    assert!(calls_of(&chunks).is_empty());
    assert_eq!(model.last_usage(), Some(Usage { prompt_tokens: 12, completion_tokens: 5 }));
    assert_eq!(model.total_usage(), Usage { prompt_tokens: 12, completion_tokens: 5 });
}

#[tokio::test]
async fn one_tool_call_split_over_many_chunks() {
    let mock = Mock::start(vec![sse(&[
        role(),
        text("I'll restart it. "),
        tool_start(0, "call_abc123", "restart_instance"),
        tool_args(0, "{\"inst"),
        tool_args(0, "anceId\": \"pay-"),
        tool_args(0, "prod-2\"}"),
        finish("tool_calls"),
    ])])
    .await;
    let (chunks, err) = collect(&mock.model(), request("restart pay-prod-2")).await;
    assert_eq!(err, None);
    assert_eq!(text_of(&chunks), "I'll restart it. ");
    assert_eq!(
        calls_of(&chunks),
        vec![ModelToolCall {
            id: "call_abc123".into(),
            name: "restart_instance".into(),
            arguments: json!({"instanceId": "pay-prod-2"})
        }]
    );
    assert!(matches!(chunks.last(), Some(ModelChunk::ToolCall(_))), "the call comes at the end");
}

#[tokio::test]
async fn two_parallel_tool_calls_interleaved() {
    let mock = Mock::start(vec![sse(&[
        tool_start(0, "call_a", "get_recent_errors"),
        tool_start(1, "call_b", "find_abnormal_instances"),
        tool_args(1, "{\"service\": \"order"),
        tool_args(0, "{\"service\": "),
        tool_args(0, "\"payment-api\", \"env\": \"prod\"}"),
        tool_args(1, "-api\", \"env\": \"staging\"}"),
        finish("tool_calls"),
        usage(40, 30),
    ])])
    .await;
    let (chunks, err) = collect(&mock.model(), request("look at both")).await;
    assert_eq!(err, None);
    let calls = calls_of(&chunks);
    assert_eq!(calls.len(), 2);
    assert_eq!((calls[0].id.as_str(), calls[0].name.as_str()), ("call_a", "get_recent_errors"));
    assert_eq!(calls[0].arguments, json!({"service": "payment-api", "env": "prod"}));
    assert_eq!((calls[1].id.as_str(), calls[1].name.as_str()), ("call_b", "find_abnormal_instances"));
    assert_eq!(calls[1].arguments, json!({"service": "order-api", "env": "staging"}));
}

#[tokio::test]
async fn malformed_tool_arguments_become_an_invalid_json_call() {
    let mock = Mock::start(vec![sse(&[
        tool_start(0, "call_bad", "restart_instance"),
        tool_args(0, "{\"instanceId\": \"pay-prod-2"),
        tool_args(0, "', oops"),
        finish("tool_calls"),
    ])])
    .await;
    let (chunks, err) = collect(&mock.model(), request("restart")).await;
    assert_eq!(err, None);
    let calls = calls_of(&chunks);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].name, "restart_instance");
    assert_eq!(calls[0].arguments, json!({INVALID_JSON_KEY: "{\"instanceId\": \"pay-prod-2', oops"}));
    // The engine's schema check turns it into an error for the model.
    assert!(JsonSchema::compile(&instance_schema()).unwrap().validate(&calls[0].arguments).is_err());
}

#[tokio::test]
async fn finish_length_without_tool_calls_ends_the_stream() {
    // No `[DONE]` either: the finish reason is enough.
    let mock = Mock::start(vec![sse_reply(wire(&events(&[text("The answer is cut"), finish("length")]), 11))]).await;
    let (chunks, err) = collect(&mock.model(), request("long")).await;
    assert_eq!(err, None);
    assert_eq!(chunks, vec![ModelChunk::Text("The answer is cut".into())]);
}

#[tokio::test]
async fn a_429_with_retry_after_is_retried_after_the_wait() {
    let mut limited = error_reply(429, "Rate limit reached");
    limited.headers.push(("retry-after", "1".into()));
    let mock = Mock::start(vec![limited, sse(&[text("ok"), finish("stop")])]).await;
    let (chunks, err) = collect(&mock.model(), request("hi")).await;
    assert_eq!(err, None);
    assert_eq!(text_of(&chunks), "ok");
    let got = mock.received();
    assert_eq!(got.len(), 2, "one retry");
    let waited = got[1].at - got[0].at;
    assert!(waited >= Duration::from_secs(1), "waited only {waited:?}");
    assert!(waited < Duration::from_secs(3), "waited {waited:?}");
}

#[tokio::test]
async fn server_errors_are_retried_and_then_give_up_as_transient() {
    let mock = Mock::start(vec![error_reply(502, "bad gateway"), sse(&[text("ok"), finish("stop")])]).await;
    let (chunks, err) = collect(&mock.model(), request("hi")).await;
    assert_eq!((text_of(&chunks).as_str(), err), ("ok", None));
    assert_eq!(mock.received().len(), 2);

    let mock = Mock::start(vec![error_reply(503, "overloaded"); 3]).await;
    let mut config = mock.config();
    config.max_retries = 2;
    let (chunks, err) = collect(&OpenAiCompatible::new(config).unwrap(), request("hi")).await;
    assert!(chunks.is_empty());
    match err {
        Some(ModelError::Transient(m)) => {
            assert!(m.contains("503") && m.contains("overloaded") && m.contains("3 attempts"), "{m}")
        }
        other => panic!("expected Transient, got {other:?}"),
    }
    assert_eq!(mock.received().len(), 3);
}

#[tokio::test]
async fn a_stream_broken_before_any_output_is_retried() {
    let broken = sse_reply(vec![Piece::Bytes(b": still thinking\n\n".to_vec()), Piece::Fail]);
    let mock = Mock::start(vec![broken, sse(&[text("fine"), finish("stop")])]).await;
    let (chunks, err) = collect(&mock.model(), request("hi")).await;
    assert_eq!(err, None);
    assert_eq!(text_of(&chunks), "fine");
    assert_eq!(mock.received().len(), 2);
}

#[tokio::test]
async fn an_unreachable_server_is_transient() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let mut config = OpenAiConfig::new(format!("http://{addr}/v1"), "m");
    config.api_key = Some(KEY.into());
    config.max_retries = 1;
    config.retry_base_delay = Duration::from_millis(5);
    let (_, err) = collect(&OpenAiCompatible::new(config).unwrap(), request("hi")).await;
    let err = err.expect("an error");
    assert!(
        matches!(&err, ModelError::Transient(m) if m.contains("could not reach") && m.contains("2 attempts")),
        "{err:?}"
    );
    assert_no_key(&err);
}

#[tokio::test]
async fn a_broken_connection_after_text_is_fatal_and_not_retried() {
    let mut pieces = wire(&events(&[text("Checking the "), text("instances")]), 9);
    pieces.push(Piece::Fail);
    let mock = Mock::start(vec![sse_reply(pieces), sse(&[text("again"), finish("stop")])]).await;
    let (chunks, err) = collect(&mock.model(), request("hi")).await;
    assert_eq!(text_of(&chunks), "Checking the instances");
    match err {
        Some(ModelError::Fatal(m)) => assert!(m.contains("broke off") && m.contains("not retried"), "{m}"),
        other => panic!("expected Fatal, got {other:?}"),
    }
    assert_eq!(mock.received().len(), 1, "no retry that would repeat the text");
}

#[tokio::test]
async fn garbage_after_text_is_fatal() {
    let body = events(&[text("Half an ")]) + "data: {\"choices\": [{\"delta\": oops\n\n";
    let mock = Mock::start(vec![sse_reply(wire(&body, 5)), sse(&[text("again"), finish("stop")])]).await;
    let (chunks, err) = collect(&mock.model(), request("hi")).await;
    assert_eq!(text_of(&chunks), "Half an ");
    assert!(matches!(&err, Some(ModelError::Fatal(m)) if m.contains("malformed")), "{err:?}");
    assert_eq!(mock.received().len(), 1);
}

#[tokio::test]
async fn a_stream_that_ends_early_after_text_is_fatal() {
    // Closed cleanly, but with no finish reason and no `[DONE]`.
    let mock = Mock::start(vec![sse_reply(wire(&events(&[text("Half")]), 64))]).await;
    let (chunks, err) = collect(&mock.model(), request("hi")).await;
    assert_eq!(text_of(&chunks), "Half");
    assert!(matches!(&err, Some(ModelError::Fatal(m)) if m.contains("ended before")), "{err:?}");
}

#[tokio::test]
async fn a_silent_server_hits_the_first_token_timeout() {
    let mock = Mock::start(vec![sse_reply(vec![Piece::Bytes(b": hello\n\n".to_vec()), Piece::Hold])]).await;
    let mut config = mock.config();
    config.first_token_timeout = Duration::from_millis(200);
    config.max_retries = 0;
    let started = Instant::now();
    let (chunks, err) = collect(&OpenAiCompatible::new(config).unwrap(), request("hi")).await;
    let took = started.elapsed();
    assert!(chunks.is_empty());
    assert!(
        matches!(&err, Some(ModelError::Transient(m)) if m.contains("no answer within") && m.contains("1 attempt)")),
        "{err:?}"
    );
    assert!(took >= Duration::from_millis(200) && took < Duration::from_secs(2), "took {took:?}");
}

#[tokio::test]
async fn reasoning_deltas_are_not_text_but_count_as_a_first_token() {
    let thinking = |s: &str| chunk(json!({"reasoning_content": s}), None);
    // The model thinks for longer than the first-token timeout before its first text.
    let mut pieces = wire(&events(&[role(), thinking("Let me think")]), 64);
    pieces.push(Piece::Pause(Duration::from_millis(300)));
    pieces.extend(wire(&events(&[thinking(" more"), text("42"), finish("stop")]), 64));
    let mock = Mock::start(vec![sse_reply(pieces)]).await;
    let mut config = mock.config();
    config.first_token_timeout = Duration::from_millis(150);
    config.max_retries = 0;
    let (chunks, err) = collect(&OpenAiCompatible::new(config).unwrap(), request("hi")).await;
    assert_eq!(err, None);
    assert_eq!(chunks, vec![ModelChunk::Text("42".into())]);
}

#[tokio::test]
async fn a_stalled_stream_hits_the_idle_timeout() {
    let mut pieces = wire(&events(&[text("Looking")]), 64);
    pieces.push(Piece::Hold);
    let mock = Mock::start(vec![sse_reply(pieces)]).await;
    let mut config = mock.config();
    config.idle_timeout = Duration::from_millis(200);
    let started = Instant::now();
    let (chunks, err) = collect(&OpenAiCompatible::new(config).unwrap(), request("hi")).await;
    let took = started.elapsed();
    assert_eq!(text_of(&chunks), "Looking");
    assert!(matches!(&err, Some(ModelError::Fatal(m)) if m.contains("stalled")), "{err:?}");
    assert!(took >= Duration::from_millis(200) && took < Duration::from_secs(2), "took {took:?}");
    assert_eq!(mock.received().len(), 1);
}

#[tokio::test]
async fn a_server_that_stays_open_after_the_answer_does_not_hold_it_up() {
    let mut pieces =
        wire(&events(&[text("Done."), tool_start(0, "call_x", "list_services"), finish("tool_calls")]), 64);
    pieces.push(Piece::Hold);
    let mock = Mock::start(vec![sse_reply(pieces)]).await;
    let mut config = mock.config();
    config.idle_timeout = Duration::from_millis(200);
    let started = Instant::now();
    let (chunks, err) = collect(&OpenAiCompatible::new(config).unwrap(), request("hi")).await;
    assert_eq!(err, None, "the answer was complete");
    assert_eq!(text_of(&chunks), "Done.");
    assert_eq!(calls_of(&chunks)[0].arguments, json!({}));
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn dropping_the_stream_closes_the_connection() {
    let mut pieces = wire(&events(&[text("one "), text("two ")]), 64);
    pieces.push(Piece::HoldPinging);
    let mut mock = Mock::start(vec![sse_reply(pieces)]).await;
    let model = mock.model();
    let mut stream = model.stream(request("hi")).await.unwrap();
    assert_eq!(stream.next().await, Some(Ok(ModelChunk::Text("one ".into()))));
    drop(stream);
    let closed = tokio::time::timeout(Duration::from_secs(2), mock.closed.recv()).await;
    assert_eq!(closed, Ok(Some(0)), "the server saw the connection close");
}

#[tokio::test]
async fn the_request_has_the_openai_shape() {
    let mock = Mock::start(vec![sse(&[text("ok"), finish("stop")]), sse(&[text("ok"), finish("stop")])]).await;
    let mut config = mock.config();
    config.api_key = Some(KEY.into());
    config.temperature = Some(0.25);
    config.max_tokens = Some(512);
    config.extra_headers = vec![("OpenAI-Organization".into(), "org-keel".into())];
    let call = ModelToolCall {
        id: "call_0190".into(),
        name: "restart_instance".into(),
        arguments: json!({"instanceId": "pay-prod-2"}),
    };
    let req = ModelRequest {
        messages: vec![
            ModelMessage::System { content: "You are OpsPilot.".into() },
            ModelMessage::User { content: "Restart pay-prod-2".into() },
            ModelMessage::Assistant { content: String::new(), tool_calls: vec![call.clone()] },
            ModelMessage::Tool {
                call_id: call.id.clone(),
                name: call.name.clone(),
                content: "{\"status\":\"ok\"}".into(),
            },
            ModelMessage::Assistant { content: "Restarted.".into(), tool_calls: vec![] },
            ModelMessage::User { content: "Thanks".into() },
        ],
        tools: vec![
            ToolSpec::new("restart_instance", "Restart one instance.", instance_schema(), true),
            ToolSpec::new("list_services", "List the services.", json!({}), false),
        ]
        .into(),
        facts: Default::default(),
    };
    let (_, err) = collect(&OpenAiCompatible::new(config).unwrap(), req.clone()).await;
    assert_eq!(err, None);
    let (_, err) = collect(&mock.model(), req).await;
    assert_eq!(err, None);

    let got = mock.received();
    let with_key = &got[0];
    assert_eq!(with_key.headers.get("authorization").unwrap(), &format!("Bearer {KEY}"));
    assert_eq!(with_key.headers.get("openai-organization").unwrap(), "org-keel");
    assert_eq!(with_key.headers.get("content-type").unwrap(), "application/json");
    assert_eq!(with_key.headers.get("accept").unwrap(), "text/event-stream");
    assert!(got[1].headers.get("authorization").is_none(), "no key, no Authorization header");

    let b = &with_key.body;
    assert_eq!(b["model"], "gpt-test");
    assert_eq!(b["stream"], true);
    assert_eq!(b["stream_options"], json!({"include_usage": true}));
    assert_eq!(b["temperature"], 0.25);
    assert_eq!(b["max_tokens"], 512);
    let roles: Vec<&str> = b["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "assistant", "user"]);
    assert_eq!(b["messages"][0], json!({"role": "system", "content": "You are OpsPilot."}));
    assert_eq!(
        b["messages"][2],
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_0190", "type": "function",
            "function": {"name": "restart_instance", "arguments": "{\"instanceId\":\"pay-prod-2\"}"}}]})
    );
    assert_eq!(
        b["messages"][3],
        json!({"role": "tool", "tool_call_id": "call_0190", "content": "{\"status\":\"ok\"}"})
    );
    assert_eq!(b["messages"][4], json!({"role": "assistant", "content": "Restarted."}));
    assert_eq!(
        b["tools"][0],
        json!({"type": "function", "function": {"name": "restart_instance", "description": "Restart one instance.",
            "parameters": instance_schema()}})
    );
    assert_eq!(b["tools"][1]["function"]["parameters"], json!({"type": "object", "properties": {}}));
    let b = &got[1].body;
    assert!(b.get("temperature").is_none() && b.get("max_tokens").is_none());
}

#[tokio::test]
async fn no_tools_means_no_tools_field() {
    let mock = Mock::start(vec![sse(&[text("ok"), finish("stop")])]).await;
    let mut req = request("hi");
    req.tools = std::sync::Arc::default();
    let (_, err) = collect(&mock.model(), req).await;
    assert_eq!(err, None);
    assert!(mock.received()[0].body.get("tools").is_none());
}

#[tokio::test]
async fn client_errors_are_fatal_with_the_server_message_and_not_retried() {
    let mock = Mock::start(vec![error_reply(400, "Invalid schema for function 'restart_instance'")]).await;
    let (chunks, err) = collect(&mock.model(), request("hi")).await;
    assert!(chunks.is_empty());
    match err {
        Some(ModelError::Fatal(m)) => {
            assert!(m.contains("400") && m.contains("Invalid schema for function 'restart_instance'"), "{m}")
        }
        other => panic!("expected Fatal, got {other:?}"),
    }
    assert_eq!(mock.received().len(), 1);
}

#[tokio::test]
async fn the_api_key_never_appears_in_errors() {
    // A server that echoes the key it was sent (some gateways do) in a 401 and in a 5xx.
    let echo = format!("Incorrect API key provided: {KEY}. Header was: Bearer {KEY}");
    let mock = Mock::start(vec![error_reply(401, &echo), error_reply(500, &echo), error_reply(500, &echo)]).await;
    let mut config = mock.config();
    config.api_key = Some(KEY.into());
    config.max_retries = 1;
    let model = OpenAiCompatible::new(config.clone()).unwrap();
    let (_, err) = collect(&model, request("hi")).await;
    let err = err.unwrap();
    assert!(matches!(&err, ModelError::Fatal(m) if m.contains("401") && m.contains("Incorrect API key")), "{err:?}");
    assert_no_key(&err);
    let (_, err) = collect(&model, request("hi")).await;
    let err = err.unwrap();
    assert!(matches!(err, ModelError::Transient(_)), "{err:?}");
    assert_no_key(&err);
    // Nor in the settings' or the model's Debug.
    assert!(!format!("{config:?} {model:?}").contains(KEY));
}

#[tokio::test]
async fn a_json_answer_instead_of_a_stream_is_fatal() {
    let mock = Mock::start(vec![error_reply(200, "streaming is not supported by this proxy")]).await;
    let (_, err) = collect(&mock.model(), request("hi")).await;
    assert!(
        matches!(&err, Some(ModelError::Fatal(m)) if m.contains("event stream") && m.contains("not supported by this proxy")),
        "{err:?}"
    );
}

#[tokio::test]
async fn an_error_event_mid_stream_is_reported() {
    let body = events(&[text("Par")]) + &events(&[json!({"error": {"message": "The server had an error"}})]);
    let mock = Mock::start(vec![sse_reply(wire(&body, 16))]).await;
    let (chunks, err) = collect(&mock.model(), request("hi")).await;
    assert_eq!(text_of(&chunks), "Par");
    assert!(matches!(&err, Some(ModelError::Fatal(m)) if m.contains("The server had an error")), "{err:?}");
}

#[tokio::test]
async fn an_unreachable_https_endpoint_fails_clearly() {
    // With TLS compiled in (the default build), a plain connection failure after the retries; a
    // build without a TLS backend fails at once, saying why.
    let mut config = OpenAiConfig::new("https://127.0.0.1:9/v1", "m");
    config.retry_base_delay = Duration::from_millis(5);
    let (_, err) = collect(&OpenAiCompatible::new(config).unwrap(), request("hi")).await;
    match err {
        Some(ModelError::Fatal(m)) => assert!(m.contains("TLS"), "{m}"),
        Some(ModelError::Transient(m)) => assert!(m.contains("could not"), "{m}"),
        None => panic!("expected an error"),
    }
}
