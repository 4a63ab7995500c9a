//! The WebSocket transport (`GET /v1/ws`) over a real socket: the human-in-the-loop flow on one
//! connection, a reader that stops reading cut off by the send timeout, and refusals.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use keel_core::Event;
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::net::{TcpSocket, TcpStream};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::common::*;

struct Ws {
    socket: WebSocketStream<TcpStream>,
    /// Events read while waiting for a reply.
    events: Vec<Event>,
}

impl Ws {
    async fn connect(app: &TestApp, user: Option<&str>, recv_buffer: Option<u32>) -> Self {
        let tcp = TcpSocket::new_v4().expect("socket");
        if let Some(size) = recv_buffer {
            tcp.set_recv_buffer_size(size).expect("SO_RCVBUF");
        }
        let stream = tcp.connect(app.addr).await.expect("connect");
        let (socket, response) = tokio_tungstenite::client_async(app.ws_request(user), stream).await.expect("upgrade");
        assert_eq!(response.status(), 101);
        Self { socket, events: Vec::new() }
    }

    async fn send(&mut self, message: Value) {
        self.socket.send(Message::text(message.to_string())).await.expect("send");
    }

    /// The next JSON message; `None` once the connection is closed (or broken).
    async fn next(&mut self) -> Option<Value> {
        loop {
            let next = tokio::time::timeout(DEADLINE, self.socket.next()).await.expect("a message in time");
            match next {
                Some(Ok(Message::Text(text))) => return Some(serde_json::from_str(text.as_str()).expect("JSON")),
                Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => continue,
                Some(Ok(Message::Binary(_))) => panic!("the server sends text"),
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return None,
            }
        }
    }

    /// Reads until the reply to `request_id`, keeping the events read meanwhile.
    async fn reply(&mut self, request_id: &str) -> Value {
        loop {
            let message = self.next().await.expect("the connection stays open");
            if message["type"] == "reply" {
                assert_eq!(message["requestId"], request_id, "{message}");
                return message;
            }
            self.events.push(serde_json::from_value(message).expect("a native event"));
        }
    }

    /// Reads events until `done(event)`.
    async fn events_until(&mut self, done: impl Fn(&Event) -> bool) {
        if self.events.last().is_some_and(&done) {
            return;
        }
        loop {
            let message = self.next().await.expect("the connection stays open");
            assert_ne!(message["type"], "reply", "{message}");
            let event: Event = serde_json::from_value(message).expect("a native event");
            let end = done(&event);
            self.events.push(event);
            if end {
                return;
            }
        }
    }
}

#[tokio::test]
async fn restart_with_approval_over_one_socket() {
    let app = TestApp::spawn().await;
    let conversation = app.create_conversation().await;
    let mut ws = Ws::connect(&app, None, None).await;

    ws.send(json!({"type": "send", "requestId": "m1", "conversationId": conversation, "content": RESTART_PROMPT}))
        .await;
    let sent = ws.reply("m1").await;
    let run = sent["result"]["runId"].as_str().expect("runId").to_owned();
    assert!(sent["result"]["messageId"].as_str().unwrap().starts_with("msg_"));

    ws.send(json!({"type": "subscribe", "requestId": "s1", "runId": run, "after": 0})).await;
    let subscribed = ws.reply("s1").await;
    assert_eq!(subscribed["result"]["runId"], run.as_str());
    ws.events_until(Event::is_pausing).await;
    let keel_core::EventKind::Interrupt { interrupt_id, .. } = &ws.events.last().unwrap().kind else { unreachable!() };
    let interrupt = interrupt_id.to_string();
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0);

    let resume = json!({"type": "resume", "requestId": "r1", "runId": run, "interruptId": interrupt,
                        "decision": "approve", "idempotencyKey": "ws-approve-1"});
    ws.send(resume.clone()).await;
    let accepted = ws.reply("r1").await;
    assert_eq!(accepted["result"]["status"], "running", "{accepted}");
    ws.events_until(Event::is_terminal).await;
    let events = std::mem::take(&mut ws.events);
    assert_contiguous(&events, 1);
    assert_eq!(events.last().unwrap().type_name(), "done");
    assert!(types(&events).contains(&"resumed"));
    let stored = app.events_json(&run, 0).await;
    assert_eq!(events, stored, "the socket told exactly the stored story, each event once");

    // The same resume again: the first answer, nothing re-executed.
    let mut again = resume;
    again["requestId"] = json!("r2");
    ws.send(again).await;
    let replayed = ws.reply("r2").await;
    assert_eq!(replayed["result"], accepted["result"]);
    let instance = app.instance("pay-prod-2").await;
    assert_eq!((instance["status"].clone(), instance["restartCount"].clone()), (json!("healthy"), json!(1)));

    // Cancel answers with the run; an unknown run is an error reply, and the socket stays open.
    ws.send(json!({"type": "cancel", "requestId": "c1", "runId": "run_nope"})).await;
    let refused = ws.reply("c1").await;
    assert_eq!(refused["error"]["code"], "RUN_NOT_FOUND");
    let run2 = app.send(&conversation, "Restart pay-prod-3").await;
    ws.send(json!({"type": "cancel", "requestId": "c2", "runId": run2})).await;
    let cancelled = ws.reply("c2").await;
    assert_eq!(cancelled["result"]["cancelRequested"], true, "{cancelled}");
}

#[tokio::test]
async fn a_reader_that_stops_reading_is_cut_off_and_resubscribing_gets_every_missed_event_once() {
    let buffer = 8;
    let app = TestApp::with(Options {
        ws_send_timeout: Duration::from_secs(1),
        ws_buffer: buffer,
        send_buffer: Some(4096),
        ..Options::default()
    })
    .await;
    // Finished runs: their stored events are far more than the socket buffers hold.
    let mut runs = BTreeMap::new();
    for _ in 0..12 {
        let conversation = app.create_conversation().await;
        let turn = app.send_and_wait(&conversation, ERRORS_PROMPT).await;
        let run = turn["run"]["id"].as_str().unwrap().to_owned();
        let stored = app.events_json(&run, 0).await;
        runs.insert(run, stored);
    }
    let total: usize = runs.values().map(|e| serde_json::to_string(e).unwrap().len()).sum();
    assert!(total > 64 * 1024, "enough to fill the path to the client ({total} bytes)");

    let mut slow = Ws::connect(&app, None, Some(4096)).await;
    for run in runs.keys() {
        slow.send(json!({"type": "subscribe", "requestId": run, "runId": run, "after": 0})).await;
    }
    // It reads nothing now. The server's writer waits at most the send timeout, then cuts it off.
    let stats = app.state.ws.clone();
    eventually("the slow reader is cut off", || async { (stats.cut_off.load(Ordering::Relaxed) >= 1).then_some(()) })
        .await;
    eventually("its connection is gone", || async { (stats.open.load(Ordering::Relaxed) == 0).then_some(()) }).await;
    let queued = stats.max_queued.load(Ordering::Relaxed);
    assert!(queued <= buffer, "the server held at most {buffer} frames for it, not {queued}");

    // What reached it before the cut: for each run, a prefix of its events, without gaps or repeats.
    let mut seen: BTreeMap<String, Vec<Event>> = BTreeMap::new();
    while let Some(message) = slow.next().await {
        if message["type"] == "reply" {
            assert!(message.get("error").is_none(), "{message}");
            continue;
        }
        let event: Event = serde_json::from_value(message).expect("a native event");
        seen.entry(event.run_id.to_string()).or_default().push(event);
    }
    for (run, events) in &seen {
        assert_contiguous(events, 1);
        assert!(events.len() <= runs[run].len());
    }
    let missed: usize = runs.iter().map(|(run, all)| all.len() - seen.get(run).map_or(0, Vec::len)).sum();
    assert!(missed > 0, "the cut-off reader missed events");

    // Resubscribing with `after` gets every missed event, exactly once.
    let mut fresh = Ws::connect(&app, None, None).await;
    for (run, all) in &runs {
        let after = seen.get(run).map_or(0, Vec::len) as i64;
        if after as usize == all.len() {
            // every event of this run reached it before the cut: nothing to resubscribe for
            continue;
        }
        fresh.send(json!({"type": "subscribe", "requestId": run, "runId": run, "after": after})).await;
        let reply = fresh.reply(run).await;
        assert_eq!(reply["result"]["after"], after);
        fresh.events_until(Event::is_terminal).await;
        let mut got = seen.remove(run).unwrap_or_default();
        got.extend(std::mem::take(&mut fresh.events));
        assert_eq!(&got, all, "run {run}: every event once, in order");
    }
    let ids: BTreeSet<_> = runs.keys().collect();
    assert_eq!(ids.len(), 12);
}

#[tokio::test]
async fn bad_requests_get_error_replies() {
    let app = TestApp::spawn().await;
    let response = app.client.get(app.url("/v1/ws")).send().await.unwrap();
    let (status, body) = to_json(response).await;
    assert_eq!(status, StatusCode::UPGRADE_REQUIRED);
    assert_eq!(body["error"]["code"], "UPGRADE_REQUIRED");

    let (_, run, _) = app.interrupted_run().await;
    let mut ws = Ws::connect(&app, None, None).await;
    ws.socket.send(Message::text("{not json")).await.unwrap();
    let reply = ws.next().await.unwrap();
    assert_eq!(reply["error"]["code"], "MALFORMED_JSON", "{reply}");
    ws.socket.send(Message::binary(vec![1u8, 2, 3])).await.unwrap();
    assert_eq!(ws.next().await.unwrap()["error"]["code"], "VALIDATION_FAILED");
    let cases = [
        (json!({"type": "bogus", "requestId": "b1"}), "VALIDATION_FAILED"),
        (json!({"type": "subscribe", "requestId": "b2"}), "VALIDATION_FAILED"),
        (json!({"type": "subscribe", "requestId": "b3", "runId": run, "afterr": 1}), "VALIDATION_FAILED"),
        (json!({"type": "subscribe", "requestId": "b4", "runId": "run_nope"}), "RUN_NOT_FOUND"),
        (json!({"type": "subscribe", "requestId": "b5", "runId": run, "after": -1}), "INVALID_CURSOR"),
        (json!({"type": "subscribe", "requestId": "b6", "runId": run, "after": 100000}), "CURSOR_OUT_OF_RANGE"),
        (
            json!({"type": "send", "requestId": "b7", "conversationId": "conv_nope", "content": "hi"}),
            "CONVERSATION_NOT_FOUND",
        ),
        (
            json!({"type": "resume", "requestId": "b8", "runId": run, "interruptId": "int_nope", "decision": "approve", "idempotencyKey": "k"}),
            "INTERRUPT_NOT_FOUND",
        ),
        (
            json!({"type": "tool_result", "requestId": "b9", "runId": run, "callId": "call_nope", "result": {}, "idempotencyKey": "k"}),
            "UNKNOWN_CALL",
        ),
        (
            json!({"type": "tool_result", "requestId": "b10", "runId": run, "callId": "call_nope", "idempotencyKey": "k"}),
            "VALIDATION_FAILED",
        ),
    ];
    for (request, code) in cases {
        let id = request["requestId"].as_str().unwrap().to_owned();
        ws.send(request).await;
        let reply = ws.reply(&id).await;
        assert_eq!(reply["error"]["code"], code, "{reply}");
        assert!(reply["error"]["message"].is_string());
    }

    // Another user's run is not found over the socket either.
    let mut bob = Ws::connect(&app, Some("bob"), None).await;
    bob.send(json!({"type": "subscribe", "requestId": "m", "runId": run, "after": 0})).await;
    assert_eq!(bob.reply("m").await["error"]["code"], "RUN_NOT_FOUND");
    bob.send(json!({"type": "cancel", "requestId": "c", "runId": run})).await;
    assert_eq!(bob.reply("c").await["error"]["code"], "RUN_NOT_FOUND");
    let interrupt = app.run(&run).await["pendingInterrupt"]["id"].as_str().unwrap().to_owned();
    bob.send(json!({"type": "resume", "requestId": "r", "runId": run, "interruptId": interrupt,
        "decision": "approve", "idempotencyKey": "bob-1"}))
        .await;
    assert_eq!(bob.reply("r").await["error"]["code"], "RUN_NOT_FOUND");
    assert_eq!(app.run(&run).await["status"], "interrupted");
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0);
}

/// A browser's WebSocket can't send headers: a ticket from `POST /v1/ws/ticket` opens one
/// connection, once; without a key or ticket the upgrade is refused.
#[tokio::test]
async fn a_ticket_opens_one_socket_once() {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Error as WsError;
    let app = TestApp::spawn().await;
    let (_, run, _) = app.interrupted_run().await;
    let open = |query: String| {
        let url = format!("ws://{}/v1/ws{query}", app.addr);
        let addr = app.addr;
        async move {
            let stream = TcpStream::connect(addr).await.expect("connect");
            tokio_tungstenite::client_async(url.into_client_request().unwrap(), stream).await
        }
    };
    let refused = |result: Result<_, WsError>| match result {
        Err(WsError::Http(response)) => response.status().as_u16(),
        Ok(_) => panic!("the upgrade was accepted"),
        Err(other) => panic!("{other}"),
    };
    assert_eq!(refused(open(String::new()).await), 401, "no key, no ticket");

    let (status, body) = app.post("/v1/ws/ticket", &json!({})).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let ticket = body["ticket"].as_str().unwrap().to_owned();
    assert_eq!(body["url"], format!("/v1/ws?ticket={ticket}"));
    let (socket, _) = open(format!("?ticket={ticket}")).await.expect("the ticket opens the socket");
    let mut ws = Ws { socket, events: Vec::new() };
    ws.send(json!({"type": "subscribe", "requestId": "s", "runId": run, "after": 0})).await;
    assert!(ws.reply("s").await["error"].is_null(), "the socket acts as the ticket's user");
    assert_eq!(refused(open(format!("?ticket={ticket}")).await), 401, "used once");

    // A run-events ticket does not open a socket.
    let (_, body) = app.post(&format!("/v1/runs/{run}/stream-ticket"), &json!({})).await;
    assert_eq!(refused(open(format!("?ticket={}", body["ticket"].as_str().unwrap())).await), 401);
}

/// Asks the user with the client-side tool `ask_user` once, then says what it was told.
struct AsksTheUser;

#[async_trait::async_trait]
impl keel_core::model::Model for AsksTheUser {
    fn name(&self) -> &str {
        "asks-the-user"
    }

    async fn stream(
        &self,
        request: keel_core::model::ModelRequest,
    ) -> Result<keel_core::model::ModelStream, keel_core::model::ModelError> {
        use keel_core::model::{ModelChunk, ModelToolCall};
        // told the answer in this turn: the last message is the tool's
        let told = matches!(request.messages.last(), Some(keel_core::model::ModelMessage::Tool { .. }));
        let chunks = if told {
            vec![Ok(ModelChunk::Text("Thanks, noted.".into()))]
        } else {
            vec![Ok(ModelChunk::ToolCall(ModelToolCall {
                id: "call_1".into(),
                name: "ask_user".into(),
                arguments: json!({"question": "Which region?"}),
            }))]
        };
        Ok(Box::pin(futures::stream::iter(chunks)))
    }
}

/// A question only the user can answer: the engine never executes it.
struct AskUser(keel_core::tool::ToolSpec);

#[async_trait::async_trait]
impl keel_core::tool::Tool for AskUser {
    fn spec(&self) -> &keel_core::tool::ToolSpec {
        &self.0
    }

    async fn execute(
        &self,
        _ctx: &keel_core::tool::ToolContext,
        _args: &Value,
    ) -> Result<keel_core::tool::ToolOutput, keel_core::tool::ToolError> {
        panic!("a client-side tool is never executed by the server")
    }

    fn client_side(&self) -> Option<keel_core::tool::ClientSide> {
        Some(keel_core::tool::ClientSide::default())
    }
}

/// A client-side call answered over the socket: the `tool_result` message continues the run once
/// (the same message again gets the first answer; another key is refused), and the socket tells
/// the stored story.
#[tokio::test]
async fn a_client_tool_is_answered_over_the_socket_once() {
    let spec = keel_core::tool::ToolSpec::new(
        "ask_user",
        "Ask the user a question",
        json!({"type": "object", "properties": {"question": {"type": "string"}}, "required": ["question"]}),
        false,
    )
    .result_schema(json!({"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}));
    let app = TestApp::with(Options {
        model: Some(std::sync::Arc::new(AsksTheUser)),
        extra_tools: vec![std::sync::Arc::new(AskUser(spec))],
        ..Options::default()
    })
    .await;
    let conversation = app.create_conversation().await;
    let mut ws = Ws::connect(&app, None, None).await;
    ws.send(
        json!({"type": "send", "requestId": "m1", "conversationId": conversation, "content": "Where should it run?"}),
    )
    .await;
    let run = ws.reply("m1").await["result"]["runId"].as_str().expect("runId").to_owned();
    ws.send(json!({"type": "subscribe", "requestId": "s1", "runId": run, "after": 0})).await;
    ws.reply("s1").await;
    ws.events_until(Event::is_pausing).await;
    let keel_core::EventKind::Interrupt { kind, payload, .. } = &ws.events.last().unwrap().kind else {
        panic!("paused without an interrupt: {:?}", ws.events.last())
    };
    assert_eq!(kind.as_str(), "tool_call");
    let call = payload.inner()["callId"].as_str().expect("callId").to_owned();

    // A result that breaks the schema is refused, and decides nothing.
    ws.send(json!({"type": "tool_result", "requestId": "t0", "runId": run, "callId": call, "result": {"answer": 7}, "idempotencyKey": "k0"}))
        .await;
    assert_eq!(ws.reply("t0").await["error"]["code"], "INVALID_RESULT");

    let answer = json!({"type": "tool_result", "requestId": "t1", "runId": run, "callId": call,
                        "result": {"answer": "eu-west"}, "idempotencyKey": "ws-answer-1"});
    ws.send(answer.clone()).await;
    let accepted = ws.reply("t1").await;
    assert_eq!(accepted["result"]["outcome"], "success", "{accepted}");
    ws.events_until(Event::is_terminal).await;
    let events = std::mem::take(&mut ws.events);
    assert_contiguous(&events, 1);
    assert_eq!(events.last().unwrap().type_name(), "done");
    assert_eq!(events.iter().filter(|e| e.type_name() == "resumed").count(), 1);
    assert_eq!(events, app.events_json(&run, 0).await, "the socket told exactly the stored story");

    // The same answer again: the first reply; another key: already answered.
    let mut again = answer;
    again["requestId"] = json!("t2");
    ws.send(again).await;
    assert_eq!(ws.reply("t2").await["result"], accepted["result"]);
    ws.send(json!({"type": "tool_result", "requestId": "t3", "runId": run, "callId": call,
                   "result": {"answer": "us"}, "idempotencyKey": "ws-answer-2"}))
        .await;
    assert_eq!(ws.reply("t3").await["error"]["code"], "TOOL_CALL_ALREADY_ANSWERED");
    let (_, view) = app.get(&format!("/v1/runs/{run}")).await;
    assert_eq!(
        (view["status"].as_str(), view["toolCalls"][0]["state"].as_str()),
        (Some("completed"), Some("succeeded"))
    );
}

/// A subscription to a run whose events retention pruned is answered `EVENTS_PRUNED` with the first
/// sequence still held, as over HTTP; a cursor at or past it subscribes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_to_pruned_events_is_answered_events_pruned() {
    let app = TestApp::spawn().await;
    let conversation = app.create_conversation().await;
    let turn = app.send_and_wait(&conversation, "Look at the recent errors of payment-api").await;
    assert_eq!(turn["run"]["status"], "completed", "{turn}");
    let run = turn["run"]["id"].as_str().unwrap().to_owned();
    let last = turn["run"]["lastSequence"].as_i64().unwrap();
    let rule = keel_core::store::PruneRule {
        finished_before: chrono::Utc::now() + chrono::Duration::hours(1),
        finished_after: None,
        agent: None,
        except_agents: vec![],
    };
    let pruned = app.store.prune_events(&rule, 2, false).await.unwrap();
    assert_eq!(pruned.events, 2, "the first two events only");

    let mut ws = Ws::connect(&app, None, None).await;
    ws.send(json!({"type": "subscribe", "requestId": "p", "runId": run, "after": 1})).await;
    let reply = ws.reply("p").await;
    assert_eq!(reply["error"]["code"], "EVENTS_PRUNED", "{reply}");
    assert_eq!(reply["error"]["firstHeldSequence"], 3, "{reply}");
    ws.send(json!({"type": "subscribe", "requestId": "q", "runId": run, "after": 2})).await;
    let reply = ws.reply("q").await;
    assert_eq!(reply["result"]["lastSequence"], last, "from the first held event on: {reply}");
}
