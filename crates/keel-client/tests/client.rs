//! The HTTP client against a scripted fake server (raw HTTP/1.1 over TCP): request shapes, error
//! decoding, and the resuming event stream — reconnects with `Last-Event-ID`, no duplicates, bounded
//! retries, and the end at the terminal event.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use keel_client::{decision, ClientError, KeelClient, ListRuns, ReconnectPolicy};
use keel_core::{ConversationId, Event, EventKind, InterruptId, RunId, RunStatus};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Debug, Clone)]
struct Request {
    method: String,
    path: String,
    headers: HashMap<String, String>,
    body: String,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(&name.to_ascii_lowercase()).map(String::as_str)
    }

    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap()
    }
}

#[derive(Clone)]
struct Reply {
    /// Written and flushed one piece at a time (on a no-delay socket), so the client sees several reads.
    pieces: Vec<Vec<u8>>,
    /// Keep the connection open afterwards (until the test ends) instead of closing it.
    hold: bool,
}

const SSE_HEAD: &str = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n\
                        Cache-Control: no-cache, no-transform\r\nConnection: close\r\n\r\n";

/// A close-delimited SSE response, in 5-byte pieces.
fn sse(body: &str) -> Reply {
    let mut pieces = vec![SSE_HEAD.as_bytes().to_vec()];
    pieces.extend(body.as_bytes().chunks(5).map(<[u8]>::to_vec));
    Reply { pieces, hold: false }
}

fn sse_hold(body: &str) -> Reply {
    Reply { hold: true, ..sse(body) }
}

/// A chunked SSE response cut off before its last chunk: the client's body read fails.
fn sse_chunked_truncated(body: &str) -> Reply {
    let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
    let chunk = format!("{:x}\r\n{body}\r\n", body.len());
    Reply { pieces: vec![head.as_bytes().to_vec(), chunk.into_bytes(), b"10\r\nid: 99\n".to_vec()], hold: false }
}

fn reply(status: u16, content_type: &str, body: &str) -> Reply {
    let text = format!(
        "HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    Reply { pieces: vec![text.into_bytes()], hold: false }
}

fn json_reply(status: u16, body: Value) -> Reply {
    reply(status, "application/json", &body.to_string())
}

fn error_reply(status: u16, code: &str, message: &str) -> Reply {
    json_reply(status, json!({ "error": { "code": code, "message": message } }))
}

struct FakeServer {
    base: String,
    requests: Arc<Mutex<Vec<Request>>>,
}

impl FakeServer {
    /// Serves the n-th connection with `script[n]` (the last entry repeats).
    async fn start(script: Vec<Reply>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let log = requests.clone();
        tokio::spawn(async move {
            let mut n = 0;
            loop {
                let (socket, _) = listener.accept().await.unwrap();
                let reply = script[n.min(script.len() - 1)].clone();
                n += 1;
                let log = log.clone();
                tokio::spawn(async move { serve(socket, reply, log).await });
            }
        });
        Self { base, requests }
    }

    fn requests(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }

    fn last_event_ids(&self) -> Vec<String> {
        self.requests().iter().map(|r| r.header("last-event-id").unwrap_or("-").to_owned()).collect()
    }
}

async fn serve(mut socket: TcpStream, reply: Reply, log: Arc<Mutex<Vec<Request>>>) {
    socket.set_nodelay(true).unwrap();
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let head_end = loop {
        let n = socket.read(&mut tmp).await.unwrap();
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8(buf[..head_end].to_vec()).unwrap();
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next().unwrap().split(' ');
    let method = request_line.next().unwrap().to_owned();
    let path = request_line.next().unwrap().to_owned();
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let len: usize = headers.get("content-length").map_or(0, |v| v.parse().unwrap());
    while buf.len() < head_end + len {
        let n = socket.read(&mut tmp).await.unwrap();
        buf.extend_from_slice(&tmp[..n]);
    }
    let body = String::from_utf8(buf[head_end..head_end + len].to_vec()).unwrap();
    log.lock().unwrap().push(Request { method, path, headers, body });

    for piece in &reply.pieces {
        if socket.write_all(piece).await.is_err() {
            return;
        }
        let _ = socket.flush().await;
        tokio::task::yield_now().await;
    }
    if reply.hold {
        // Hold the connection open, silent, until the test's runtime shuts down.
        std::future::pending::<()>().await;
    }
    let _ = socket.shutdown().await;
}

fn run_id() -> RunId {
    RunId::parse("run_1").unwrap()
}

/// One SSE frame of run_1, as the server frames it.
fn frame(sequence: i64, kind: &str) -> String {
    let fields = match kind {
        "run_started" => json!({ "conversationId": "conv_1" }),
        "text_delta" => json!({ "messageId": "msg_1", "delta": format!("支付服务出现错误 {sequence}") }),
        "done" => json!({ "messageId": "msg_1" }),
        "cancelled" => json!({ "reason": "user" }),
        _ => json!({ "node": "call_model" }),
    };
    let mut data = fields;
    data["type"] = json!(kind);
    data["runId"] = json!("run_1");
    data["sequence"] = json!(sequence);
    data["ts"] = json!("2025-01-01T00:00:00Z");
    format!("id: {sequence}\nevent: {kind}\ndata: {data}\n\n")
}

fn fast() -> ReconnectPolicy {
    ReconnectPolicy {
        max_attempts: 5,
        initial_backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(20),
        idle_timeout: Duration::from_secs(5),
    }
}

async fn collect(client: &KeelClient, after: i64) -> Vec<Result<Event, ClientError>> {
    let stream = client.events(&run_id(), after);
    tokio::time::timeout(Duration::from_secs(20), stream.collect::<Vec<_>>()).await.expect("the stream ends")
}

fn sequences(items: &[Result<Event, ClientError>]) -> Vec<i64> {
    items.iter().map(|r| r.as_ref().expect("no error").sequence).collect()
}

#[tokio::test]
async fn events_reconnect_with_last_event_id_and_never_repeat() {
    let server = FakeServer::start(vec![
        // retry: 10 → reconnect after 10 ms; then events 1..3 and the connection closes
        sse(&format!(
            "retry: 10\n: keep-alive\n{}{}{}",
            frame(1, "run_started"),
            frame(2, "node_started"),
            frame(3, "text_delta")
        )),
        // a replay that overlaps what was delivered, then half an event, then close
        sse(&format!(
            "{}{}: keep-alive\n{}{}",
            frame(2, "node_started"),
            frame(3, "text_delta"),
            frame(4, "text_delta"),
            &frame(5, "text_delta")[..30]
        )),
        // chunked, cut off mid-body: a transport error
        sse_chunked_truncated(&frame(5, "text_delta")),
        // CRLF framing this time, replaying from 4
        sse(&format!("{}{}{}", frame(4, "text_delta"), frame(5, "text_delta"), frame(6, "done")).replace('\n', "\r\n")),
    ])
    .await;
    let client =
        KeelClient::new(format!("{}/", server.base)).with_api_key("keel_alice").unwrap().reconnect_policy(fast());
    let items = collect(&client, 0).await;
    assert_eq!(sequences(&items), vec![1, 2, 3, 4, 5, 6]);
    let last = items.last().unwrap().as_ref().unwrap();
    assert!(matches!(last.kind, EventKind::Done { .. }));
    match &items[2].as_ref().unwrap().kind {
        EventKind::TextDelta { delta, .. } => assert_eq!(delta, "支付服务出现错误 3"),
        other => panic!("{other:?}"),
    }
    assert_eq!(server.last_event_ids(), vec!["0", "3", "4", "5"]);
    for r in server.requests() {
        assert_eq!(r.method, "GET");
        assert_eq!(r.path, "/v1/runs/run_1/events");
        assert_eq!(r.header("authorization"), Some("Bearer keel_alice"));
        assert_eq!(r.header("accept"), Some("text/event-stream"));
    }
}

#[tokio::test]
async fn events_start_after_the_cursor() {
    let server = FakeServer::start(vec![sse(&format!(
        "{}{}{}",
        frame(3, "node_started"),
        frame(4, "node_started"),
        frame(5, "cancelled")
    ))])
    .await;
    let client = KeelClient::new(&server.base).reconnect_policy(fast());
    let items = collect(&client, 3).await;
    assert_eq!(sequences(&items), vec![4, 5], "sequence 3 is at or before the cursor");
    assert_eq!(server.last_event_ids(), vec!["3"]);
    assert_eq!(server.requests()[0].header("authorization"), None);
}

#[tokio::test]
async fn the_terminal_event_ends_the_stream_even_if_the_connection_stays_open() {
    let server = FakeServer::start(vec![sse_hold(&format!(
        "{}{}: keep-alive\n{}",
        frame(1, "run_started"),
        frame(2, "done"),
        frame(3, "node_started")
    ))])
    .await;
    let client = KeelClient::new(&server.base).reconnect_policy(fast());
    let items = collect(&client, 0).await;
    assert_eq!(sequences(&items), vec![1, 2]);
    assert_eq!(server.requests().len(), 1);
}

#[tokio::test]
async fn a_silent_connection_is_dropped_and_resumed() {
    let server = FakeServer::start(vec![
        sse_hold(&frame(1, "run_started")),
        sse(&format!("{}{}", frame(1, "run_started"), frame(2, "done"))),
    ])
    .await;
    let policy = ReconnectPolicy { idle_timeout: Duration::from_millis(300), ..fast() };
    let client = KeelClient::new(&server.base).reconnect_policy(policy);
    let items = collect(&client, 0).await;
    assert_eq!(sequences(&items), vec![1, 2]);
    assert_eq!(server.last_event_ids(), vec!["0", "1"]);
}

#[tokio::test]
async fn a_gap_reconnects_from_the_last_delivered_event() {
    let server = FakeServer::start(vec![
        sse(&format!("{}{}", frame(1, "run_started"), frame(3, "node_started"))),
        sse(&format!("{}{}", frame(2, "node_started"), frame(3, "done"))),
    ])
    .await;
    let client = KeelClient::new(&server.base).reconnect_policy(fast());
    let items = collect(&client, 0).await;
    assert_eq!(sequences(&items), vec![1, 2, 3]);
    assert_eq!(server.last_event_ids(), vec!["0", "1"]);
}

#[tokio::test]
async fn gives_up_after_the_bounded_number_of_reconnects() {
    let server = FakeServer::start(vec![error_reply(503, "UNAVAILABLE", "draining")]).await;
    let policy = ReconnectPolicy { max_attempts: 2, ..fast() };
    let client = KeelClient::new(&server.base).reconnect_policy(policy);
    let items = collect(&client, 0).await;
    assert_eq!(items.len(), 1);
    match &items[0] {
        Err(ClientError::ReconnectsExhausted { attempts: 2, last_sequence: 0, last }) => {
            assert_eq!(last.code(), Some("UNAVAILABLE"));
            assert_eq!(last.status().map(|s| s.as_u16()), Some(503));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(server.requests().len(), 3, "the first connection and two reconnects");
}

#[tokio::test]
async fn progress_resets_the_reconnect_budget_but_replays_do_not() {
    // one new event per connection: every reconnect makes progress, so max_attempts 1 is enough
    let server = FakeServer::start(vec![
        sse(&frame(1, "run_started")),
        sse(&format!("{}{}", frame(1, "run_started"), frame(2, "node_started"))),
        sse(&frame(3, "node_started")),
        sse(&frame(4, "done")),
    ])
    .await;
    let policy = ReconnectPolicy { max_attempts: 1, ..fast() };
    let client = KeelClient::new(&server.base).reconnect_policy(policy.clone());
    assert_eq!(sequences(&collect(&client, 0).await), vec![1, 2, 3, 4]);
    assert_eq!(server.last_event_ids(), vec!["0", "1", "2", "3"]);

    // a server that only ever replays what was delivered: no progress, so it gives up
    let server = FakeServer::start(vec![sse(&frame(1, "run_started"))]).await;
    let client = KeelClient::new(&server.base).reconnect_policy(policy);
    let items = collect(&client, 0).await;
    assert_eq!(items.len(), 2);
    assert_eq!(items[0].as_ref().unwrap().sequence, 1);
    match &items[1] {
        Err(ClientError::ReconnectsExhausted { attempts: 1, last_sequence: 1, last }) => {
            assert!(matches!(**last, ClientError::StreamEnded), "{last:?}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(server.requests().len(), 2);
}

#[tokio::test]
async fn a_client_error_ends_the_stream_at_once() {
    let server = FakeServer::start(vec![error_reply(400, "CURSOR_OUT_OF_RANGE", "after 99 is past 4")]).await;
    let client = KeelClient::new(&server.base).reconnect_policy(fast());
    let items = collect(&client, 99).await;
    assert_eq!(items.len(), 1);
    match &items[0] {
        Err(ClientError::Api { status, code, message }) => {
            assert_eq!(status.as_u16(), 400);
            assert_eq!(code, "CURSOR_OUT_OF_RANGE");
            assert_eq!(message, "after 99 is past 4");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(server.requests().len(), 1);
    assert_eq!(server.last_event_ids(), vec!["99"]);
}

#[tokio::test]
async fn undecodable_event_data_ends_the_stream() {
    let server = FakeServer::start(vec![sse(&format!("{}data: not json\n\n", frame(1, "run_started")))]).await;
    let client = KeelClient::new(&server.base).reconnect_policy(fast());
    let items = collect(&client, 0).await;
    assert_eq!(items.len(), 2);
    assert!(matches!(items[1], Err(ClientError::Decode { .. })), "{:?}", items[1]);
}

#[tokio::test]
async fn an_event_of_another_run_is_a_protocol_error() {
    let other = frame(1, "run_started").replace("run_1", "run_2");
    let server = FakeServer::start(vec![sse(&other)]).await;
    let client = KeelClient::new(&server.base).reconnect_policy(fast());
    let items = collect(&client, 0).await;
    assert!(matches!(items[..], [Err(ClientError::Protocol(_))]), "{items:?}");
}

#[tokio::test]
async fn a_non_sse_response_is_a_protocol_error() {
    let server = FakeServer::start(vec![json_reply(200, json!([]))]).await;
    let client = KeelClient::new(&server.base).reconnect_policy(fast());
    let items = collect(&client, 0).await;
    assert!(matches!(items[..], [Err(ClientError::Protocol(_))]), "{items:?}");
    assert_eq!(server.requests().len(), 1);
}

/// A `GET /v1/runs/{id}` body of run_1, as the server writes it.
fn run_body(status: &str) -> Value {
    json!({
        "id": "run_1", "conversationId": "conv_1", "userMessageId": "msg_0", "status": status, "reason": null,
        "cancelOnDisconnect": false, "cancelRequested": false, "lastSequence": 9,
        "checkpoint": {"nextStep": "await_interrupt", "iteration": 1, "pendingCallIds": ["call_1"], "conversationVersion": 1},
        "pendingInterrupt": null,
        "toolCalls": [{"id": "call_1", "name": "restart_instance", "state": "asking", "summary": null,
                       "startedAt": null, "finishedAt": null}],
        "interrupts": [{"id": "int_1", "runId": "run_1", "kind": "confirm_action", "status": "resolved",
                        "payload": {"title": "Restart pay-prod-2?"}, "callIds": ["call_1"],
                        "createdAt": "2025-01-01T00:00:00Z", "expiresAt": "2025-01-01T00:15:00Z",
                        "decision": "approve", "resolvedBy": "alice", "resolvedAt": "2025-01-01T00:01:00Z"}],
        "createdAt": "2025-01-01T00:00:00Z", "updatedAt": "2025-01-01T00:01:00Z"
    })
}

fn resume_answer() -> Value {
    json!({"runId": "run_1", "interruptId": "int_1", "status": "running", "decision": "approve", "resumedSequence": 10})
}

#[tokio::test]
async fn http_methods_send_the_contract_shapes() {
    let server = FakeServer::start(vec![
        json_reply(
            201,
            json!({ "id": "conv_1", "title": "troubleshoot payment-api", "createdAt": "2025-01-01T00:00:00Z" }),
        ),
        json_reply(202, json!({ "messageId": "msg_1", "runId": "run_1" })),
        json_reply(200, run_body("interrupted")),
        json_reply(200, resume_answer()),
        json_reply(200, run_body("cancelled")),
        json_reply(
            200,
            json!({ "id": "conv_1", "userId": "alice", "title": "t", "version": 1, "createdAt": "2025-01-01T00:00:00Z",
                    "facts": {"service": "payment-api"}, "activeRunId": null, "messages": [] }),
        ),
        json_reply(
            200,
            json!({"runs": [{"id": "run_1", "conversationId": "conv_1", "status": "completed", "reason": null,
                             "lastSequence": 12, "createdAt": "2025-01-01T00:00:00Z", "updatedAt": "2025-01-01T00:00:00Z"}]}),
        ),
    ])
    .await;
    let client = KeelClient::new(&server.base).with_api_key("keel_alice").unwrap();

    let conv = client.create_conversation("troubleshoot payment-api").await.unwrap();
    assert_eq!(conv.id.as_str(), "conv_1");
    assert_eq!(conv.title.as_deref(), Some("troubleshoot payment-api"));

    let sent = client.send_message(&conv.id, "Restart the abnormal instance of payment-api").await.unwrap();
    assert_eq!(sent.message_id.as_str(), "msg_1");
    assert_eq!(sent.run_id, run_id());

    let run = client.get_run(&sent.run_id).await.unwrap();
    assert_eq!(run.last_sequence, 9);
    assert_eq!(run.status, RunStatus::Interrupted);
    assert_eq!(run.tool_calls[0].name, "restart_instance");
    assert_eq!(run.interrupts[0].resolved_by.as_deref(), Some("alice"));

    let interrupt = InterruptId::parse("int_1").unwrap();
    let resumed =
        client.resume_with_key(&sent.run_id, &interrupt, decision::approve(), "resume_int_1_1").await.unwrap();
    assert_eq!(resumed.status, RunStatus::Running);
    assert_eq!(resumed.resumed_sequence, 10);

    assert_eq!(client.cancel(&sent.run_id).await.unwrap().status, RunStatus::Cancelled);

    let got = client.get_conversation(&conv.id).await.unwrap();
    assert_eq!(got.conversation.id, conv.id);
    assert_eq!(got.facts["service"], "payment-api");

    let runs = client.list_runs(ListRuns { status: Some(RunStatus::Completed), limit: Some(5) }).await.unwrap();
    assert_eq!(runs.runs[0].last_sequence, 12);

    let reqs = server.requests();
    let shapes: Vec<(&str, &str)> = reqs.iter().map(|r| (r.method.as_str(), r.path.as_str())).collect();
    assert_eq!(
        shapes,
        vec![
            ("POST", "/v1/conversations"),
            ("POST", "/v1/conversations/conv_1/messages"),
            ("GET", "/v1/runs/run_1"),
            ("POST", "/v1/runs/run_1/resume"),
            ("POST", "/v1/runs/run_1/cancel"),
            ("GET", "/v1/conversations/conv_1"),
            ("GET", "/v1/runs?status=completed&limit=5"),
        ]
    );
    assert_eq!(reqs[0].json(), json!({ "title": "troubleshoot payment-api" }));
    assert_eq!(
        reqs[1].json(),
        json!({ "content": "Restart the abnormal instance of payment-api", "cancelOnDisconnect": false })
    );
    assert_eq!(
        reqs[3].json(),
        json!({ "interruptId": "int_1", "decision": "approve", "idempotencyKey": "resume_int_1_1" })
    );
    for r in &reqs {
        assert_eq!(r.header("authorization"), Some("Bearer keel_alice"), "{} {}", r.method, r.path);
    }
}

#[tokio::test]
async fn an_api_key_is_sent_as_a_bearer_token_everywhere_and_never_shown() {
    let server = FakeServer::start(vec![
        json_reply(200, run_body("completed")),
        sse(&format!("{}{}", frame(1, "run_started"), frame(2, "done"))),
    ])
    .await;
    let client = KeelClient::new(&server.base).with_api_key("keel_secret_123").unwrap().reconnect_policy(fast());
    client.get_run(&run_id()).await.unwrap();
    assert_eq!(sequences(&collect(&client, 0).await), vec![1, 2]);
    for r in server.requests() {
        assert_eq!(r.header("authorization"), Some("Bearer keel_secret_123"), "{} {}", r.method, r.path);
    }
    let shown = format!("{client:?}");
    assert!(!shown.contains("keel_secret_123"), "{shown}");
    assert!(matches!(KeelClient::new(&server.base).with_api_key("a\nb"), Err(ClientError::Protocol(_))));
}

#[tokio::test]
async fn resume_makes_its_own_key_and_retries_with_it() {
    let server = FakeServer::start(vec![
        error_reply(503, "SHUTTING_DOWN", "draining"),
        error_reply(409, "IDEMPOTENCY_KEY_IN_FLIGHT", "still processing"),
        json_reply(200, resume_answer()),
        json_reply(200, resume_answer()),
        error_reply(409, "INTERRUPT_ALREADY_RESOLVED", "resolved by another request"),
    ])
    .await;
    let client = KeelClient::new(&server.base).reconnect_policy(fast());
    let interrupt = InterruptId::parse("int_1").unwrap();
    let accepted = client.resume(&run_id(), &interrupt, decision::approve()).await.unwrap();
    assert_eq!(accepted.interrupt_id, interrupt);
    // a second decision is a new request: a new key, and a conflict is not retried
    client.resume(&run_id(), &interrupt, decision::approve()).await.unwrap();
    let err = client.resume(&run_id(), &interrupt, decision::reject()).await.unwrap_err();
    assert_eq!(err.code(), Some("INTERRUPT_ALREADY_RESOLVED"));

    let keys: Vec<String> =
        server.requests().iter().map(|r| r.json()["idempotencyKey"].as_str().unwrap().to_owned()).collect();
    assert_eq!(keys.len(), 5, "three tries of the first, one of each other: {keys:?}");
    assert!(keys[0].starts_with("keel-client-int_1-"), "{keys:?}");
    assert_eq!(keys[0], keys[1]);
    assert_eq!(keys[1], keys[2]);
    assert_ne!(keys[2], keys[3]);
    assert_ne!(keys[3], keys[4]);
    let bodies: Vec<Value> = server.requests().iter().map(Request::json).collect();
    assert_eq!(bodies[0], bodies[2], "a retry sends the same body");
    assert_eq!(bodies[4]["decision"], "reject");
}

#[tokio::test]
async fn resume_gives_up_after_the_bounded_number_of_retries() {
    let server = FakeServer::start(vec![error_reply(503, "SHUTTING_DOWN", "draining")]).await;
    let client = KeelClient::new(&server.base).reconnect_policy(ReconnectPolicy { max_attempts: 2, ..fast() });
    let err = client.resume(&run_id(), &InterruptId::parse("int_1").unwrap(), decision::approve()).await.unwrap_err();
    assert_eq!(err.code(), Some("SHUTTING_DOWN"));
    assert_eq!(server.requests().len(), 3);
}

#[tokio::test]
async fn api_errors_carry_status_code_and_message() {
    let server = FakeServer::start(vec![
        error_reply(409, "RUN_ACTIVE", "a run is already active in this conversation"),
        reply(502, "text/html", "<html>Bad Gateway</html>"),
        error_reply(410, "INTERRUPT_EXPIRED", "expired at 12:00"),
    ])
    .await;
    let client = KeelClient::new(&server.base);
    let conv = ConversationId::parse("conv_1").unwrap();

    let err = client.send_message(&conv, "hi").await.unwrap_err();
    assert_eq!(err.status().map(|s| s.as_u16()), Some(409));
    assert_eq!(err.code(), Some("RUN_ACTIVE"));
    assert!(!err.is_retryable());
    assert_eq!(err.to_string(), "HTTP 409 Conflict RUN_ACTIVE: a run is already active in this conversation");

    let err = client.get_run(&run_id()).await.unwrap_err();
    match &err {
        ClientError::Api { status, code, message } => {
            assert_eq!(status.as_u16(), 502);
            assert_eq!(code, "HTTP_502");
            assert_eq!(message, "<html>Bad Gateway</html>");
        }
        other => panic!("{other:?}"),
    }
    assert!(err.is_retryable());

    let interrupt = InterruptId::parse("int_1").unwrap();
    let err = client.resume_with_key(&run_id(), &interrupt, json!({ "select": "a" }), "k").await.unwrap_err();
    assert_eq!(err.code(), Some("INTERRUPT_EXPIRED"));
}

#[tokio::test]
async fn a_typed_response_of_the_wrong_shape_is_a_decode_error() {
    let server = FakeServer::start(vec![json_reply(202, json!({ "messageId": "msg_1" }))]).await;
    let client = KeelClient::new(&server.base);
    let err = client.send_message(&ConversationId::parse("conv_1").unwrap(), "hi").await.unwrap_err();
    assert!(matches!(err, ClientError::Decode { .. }), "{err:?}");
}

#[tokio::test]
async fn a_read_cut_off_before_its_answer_is_sent_again_but_a_write_is_not() {
    let cut = Reply { pieces: vec![], hold: false };
    let server = FakeServer::start(vec![cut.clone(), json_reply(200, run_body("completed"))]).await;
    let client = KeelClient::new(&server.base).reconnect_policy(fast());
    assert_eq!(client.get_run(&run_id()).await.unwrap().status, RunStatus::Completed);
    assert_eq!(server.requests().len(), 2);

    // a message sent twice would start two runs: its failure is the caller's to handle
    let server = FakeServer::start(vec![cut, json_reply(202, json!({ "messageId": "msg_1", "runId": "run_1" }))]).await;
    let client = KeelClient::new(&server.base).reconnect_policy(fast());
    let err = client.send_message(&ConversationId::parse("conv_1").unwrap(), "hi").await.unwrap_err();
    assert!(matches!(err, ClientError::Http(_)), "{err:?}");
    assert_eq!(server.requests().len(), 1);
}

#[tokio::test]
async fn agents_a_chosen_agent_and_a_note_send_the_contract_shapes() {
    let server = FakeServer::start(vec![
        json_reply(
            200,
            json!({"agents": [
                {"id": "helper", "name": "Helper", "description": "", "default": false, "suggestions": [], "tools": []},
                {"id": "ops", "name": "Ops", "description": "Restarts services.", "default": true,
                 "suggestions": ["Is checkout healthy?"],
                 "tools": [{"name": "restart_service", "description": "Restart a service", "sideEffect": true,
                            "idempotent": true, "policies": {"viewer": "deny", "operator": "ask"}}]}
            ]}),
        ),
        json_reply(
            201,
            json!({ "id": "conv_1", "title": "checkout", "agentId": "ops", "createdAt": "2025-01-01T00:00:00Z" }),
        ),
        error_reply(422, "UNKNOWN_AGENT", "agentId: this server runs no such agent (GET /v1/agents lists them)"),
        json_reply(200, resume_answer()),
        json_reply(200, resume_answer()),
    ])
    .await;
    let client = KeelClient::new(&server.base).reconnect_policy(fast());

    let list = client.list_agents().await.unwrap();
    assert_eq!(list.agents.len(), 2);
    let ops = list.default_agent().expect("a default");
    assert_eq!((ops.id.as_str(), ops.suggestions.as_slice()), ("ops", &["Is checkout healthy?".to_owned()][..]));
    assert!(ops.tools[0].side_effect);

    let conv = client.create_conversation_with_agent("checkout", "ops").await.unwrap();
    assert_eq!(conv.agent_id.as_deref(), Some("ops"));
    let err = client.create_conversation_with_agent("checkout", "nobody").await.unwrap_err();
    assert_eq!((err.status().map(|s| s.as_u16()), err.code()), (Some(422), Some("UNKNOWN_AGENT")));
    assert!(!err.is_retryable());

    let interrupt = InterruptId::parse("int_1").unwrap();
    client.resume_with_note(&run_id(), &interrupt, json!("mark_done"), Some("it restarted at 12:03")).await.unwrap();
    client.resume_with_note(&run_id(), &interrupt, decision::reject(), None).await.unwrap();

    let reqs = server.requests();
    let shapes: Vec<(&str, &str)> = reqs.iter().map(|r| (r.method.as_str(), r.path.as_str())).collect();
    assert_eq!(
        shapes,
        vec![
            ("GET", "/v1/agents"),
            ("POST", "/v1/conversations"),
            ("POST", "/v1/conversations"),
            ("POST", "/v1/runs/run_1/resume"),
            ("POST", "/v1/runs/run_1/resume"),
        ]
    );
    assert_eq!(reqs[1].json(), json!({ "title": "checkout", "agentId": "ops" }));
    assert_eq!(reqs[2].json(), json!({ "title": "checkout", "agentId": "nobody" }));
    let with_note = reqs[3].json();
    assert_eq!(with_note["interruptId"], "int_1");
    assert_eq!(with_note["decision"], "mark_done");
    assert_eq!(with_note["note"], "it restarted at 12:03");
    assert!(with_note["idempotencyKey"].as_str().unwrap().starts_with("keel-client-int_1-"), "{with_note}");
    let without = reqs[4].json();
    assert!(without.get("note").is_none(), "no note, no field: {without}");
    assert_ne!(with_note["idempotencyKey"], without["idempotencyKey"]);
}

#[tokio::test]
async fn a_resume_with_a_note_is_retried_with_the_same_key_and_note() {
    let server =
        FakeServer::start(vec![error_reply(503, "SHUTTING_DOWN", "draining"), json_reply(200, resume_answer())]).await;
    let client = KeelClient::new(&server.base).reconnect_policy(fast());
    let interrupt = InterruptId::parse("int_1").unwrap();
    client.resume_with_note(&run_id(), &interrupt, decision::approve(), Some("looks fine")).await.unwrap();
    let bodies: Vec<Value> = server.requests().iter().map(Request::json).collect();
    assert_eq!(bodies.len(), 2);
    assert_eq!(bodies[0], bodies[1], "the retry is the same request: key, decision and note");
    assert_eq!(bodies[1]["note"], "looks fine");
}
