//! AG-UI over SSE (`POST /v1/ag-ui`), spoken over real HTTP: the mapping of a run's events, the
//! human-in-the-loop flow with resume, and refusals of bad input.

use std::time::Duration;

use keel_client::sse::SseFrame;
use reqwest::header::{ACCEPT, CONTENT_TYPE};
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::common::*;

/// A `RunAgentInput` for `thread` with these messages.
fn input(thread: &str, run: &str, messages: Value) -> Value {
    json!({"threadId": thread, "runId": run, "state": {}, "messages": messages, "tools": [], "context": [], "forwardedProps": {}})
}

fn user(id: &str, content: &str) -> Value {
    json!({"id": id, "role": "user", "content": content})
}

/// One AG-UI response: its events, with the framing checked (`data:` lines only, LF, no nulls).
async fn ag_ui(app: &TestApp, path: &str, body: &Value) -> Vec<Value> {
    let response = app
        .client
        .post(app.url(path))
        .header(ACCEPT, "text/event-stream, application/x-ndjson")
        .json(body)
        .send()
        .await
        .expect("POST");
    let mut reader = SseReader::new(response);
    assert_eq!(reader.status, StatusCode::OK);
    assert_eq!(reader.headers.get(CONTENT_TYPE).unwrap(), "text/event-stream; charset=utf-8");
    let mut events = Vec::new();
    while let Some(frame) = reader.next_frame().await {
        match frame {
            SseFrame::Event { id, event, data } => {
                assert_eq!((id, event), (None, None), "AG-UI frames are data: lines only");
                let value: Value = serde_json::from_str(&data).expect("JSON");
                assert_no_nulls(&value);
                assert!(value["type"].as_str().unwrap().chars().all(|c| c.is_ascii_uppercase() || c == '_'));
                if let Some(ts) = value.get("timestamp") {
                    assert!(ts.is_i64(), "integer milliseconds: {value}");
                }
                events.push(value);
            }
            SseFrame::Comment(_) => {}
            SseFrame::Retry(_) => panic!("no retry: in AG-UI streams"),
        }
    }
    assert!(!reader.raw.contains(&b'\r'), "LF framing");
    events
}

fn assert_no_nulls(value: &Value) {
    match value {
        Value::Null => panic!("optional fields are omitted, never null"),
        Value::Array(items) => items.iter().for_each(assert_no_nulls),
        Value::Object(map) => map.values().for_each(assert_no_nulls),
        _ => {}
    }
}

fn kinds(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

fn position(events: &[Value], kind: &str) -> usize {
    events.iter().position(|e| e["type"] == kind).unwrap_or_else(|| panic!("no {kind} in {:?}", kinds(events)))
}

#[tokio::test]
async fn a_plain_question_is_the_same_run_seen_through_ag_ui() {
    let app = TestApp::spawn().await;
    let events = ag_ui(&app, "/v1/ag-ui", &input("thread-a", "agui-1", json!([user("u1", ERRORS_PROMPT)]))).await;
    let k = kinds(&events);
    assert_eq!(k[0], "RUN_STARTED");
    assert_eq!(events[0]["threadId"], "thread-a");
    assert_eq!(events[0]["runId"], "agui-1");
    let finished = events.last().unwrap();
    assert_eq!(finished["type"], "RUN_FINISHED");
    assert_eq!(finished["outcome"], json!({"type": "success"}));
    assert_eq!((finished["threadId"].clone(), finished["runId"].clone()), (json!("thread-a"), json!("agui-1")));
    for kind in ["STEP_STARTED", "STEP_FINISHED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END"] {
        assert!(k.contains(&kind), "{kind} in {k:?}");
    }
    assert!(position(&events, "TOOL_CALL_START") < position(&events, "TOOL_CALL_ARGS"));
    assert!(position(&events, "TOOL_CALL_END") < position(&events, "TOOL_CALL_RESULT"));
    let start = &events[position(&events, "TOOL_CALL_START")];
    assert_eq!(start["toolCallName"], "get_recent_errors");
    let args: Value =
        serde_json::from_str(events[position(&events, "TOOL_CALL_ARGS")]["delta"].as_str().unwrap()).unwrap();
    assert_eq!(args["service"], "payment-api");
    let state = &events[position(&events, "STATE_SNAPSHOT")];
    assert_eq!(state["snapshot"]["facts"]["service"], "payment-api");
    let steps_open = k.iter().filter(|t| **t == "STEP_STARTED").count();
    assert_eq!(steps_open, k.iter().filter(|t| **t == "STEP_FINISHED").count(), "every step is closed");

    // A view, not another execution: the text equals the assistant message Keel stored for the run.
    let keel = &events[0]["metadata"]["keel"];
    let run = keel["runId"].as_str().unwrap();
    let conversation = keel["conversationId"].as_str().unwrap();
    let text: String =
        events.iter().filter(|e| e["type"] == "TEXT_MESSAGE_CONTENT").map(|e| e["delta"].as_str().unwrap()).collect();
    let (_, view) = app.get(&format!("/v1/conversations/{conversation}")).await;
    let stored: String = view["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "assistant" && m["runId"] == run)
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, stored);
    assert_eq!(app.run(run).await["status"], "completed");

    // The snapshot at the end is the conversation: the user message under Keel's id, then the answer.
    let snapshot = &events[events.len() - 2];
    assert_eq!(snapshot["type"], "MESSAGES_SNAPSHOT");
    let messages = snapshot["messages"].as_array().unwrap();
    assert_eq!(messages[0]["role"], "user");
    assert_eq!(messages[0]["content"], ERRORS_PROMPT);
    assert!(messages.iter().all(|m| !m.to_string().contains("\"result\"")), "never a full tool result");

    // The same thread, a new message: the same conversation, a new turn.
    let mut history = messages.clone();
    history.push(user("u2", "Continue investigating its recent error logs"));
    let second = ag_ui(&app, "/v1/ag-ui/opspilot", &input("thread-a", "agui-2", Value::Array(history))).await;
    assert_eq!(second[0]["metadata"]["keel"]["conversationId"], conversation);
    assert_ne!(second[0]["metadata"]["keel"]["runId"], run);
    assert_eq!(second.last().unwrap()["outcome"]["type"], "success");
}

/// Between the model's words no event flows, but keep-alive comments do.
#[tokio::test]
async fn keep_alives_flow_while_the_run_is_quiet() {
    let app = TestApp::with(Options {
        heartbeat: Duration::from_millis(20),
        demo_delay: Duration::from_millis(150),
        ..Options::default()
    })
    .await;
    let response = app
        .client
        .post(app.url("/v1/ag-ui"))
        .header(ACCEPT, "text/event-stream")
        .json(&input("thread-k", "agui-1", json!([user("u1", ERRORS_PROMPT)])))
        .send()
        .await
        .unwrap();
    let mut reader = SseReader::new(response);
    let mut saw_event = false;
    loop {
        match reader.next_frame().await.expect("a keep-alive before the stream ends") {
            SseFrame::Comment(text) => {
                assert_eq!(text, "keep-alive");
                assert!(saw_event, "RUN_STARTED comes first");
                break;
            }
            SseFrame::Event { .. } => saw_event = true,
            SseFrame::Retry(_) => panic!("no retry:"),
        }
    }
    reader.disconnect();
}

#[tokio::test]
async fn a_resent_input_is_not_a_new_turn() {
    let app = TestApp::spawn().await;
    let body = input("thread-r", "agui-1", json!([user("u1", ERRORS_PROMPT)]));
    let first = ag_ui(&app, "/v1/ag-ui", &body).await;
    let again = ag_ui(&app, "/v1/ag-ui", &body).await;
    assert_eq!(again[0]["metadata"], first[0]["metadata"], "the same Keel run");
    let conversation = first[0]["metadata"]["keel"]["conversationId"].as_str().unwrap();
    let (_, view) = app.get(&format!("/v1/conversations/{conversation}")).await;
    let users = view["messages"].as_array().unwrap().iter().filter(|m| m["role"] == "user").count();
    assert_eq!(users, 1, "one turn: {view}");
    assert_eq!(kinds(&again), kinds(&first), "the replay tells the same story");
}

#[tokio::test]
async fn interrupt_then_resume_continues_the_same_run_and_restarts_once() {
    let app = TestApp::spawn().await;
    let first = ag_ui(&app, "/v1/ag-ui", &input("thread-h", "agui-1", json!([user("u1", RESTART_PROMPT)]))).await;
    let k = kinds(&first);
    let n = k.len();
    assert_eq!(&k[n - 3..], ["STATE_SNAPSHOT", "MESSAGES_SNAPSHOT", "RUN_FINISHED"], "snapshots before the interrupt");
    let outcome = &first[n - 1]["outcome"];
    assert_eq!(outcome["type"], "interrupt");
    let interrupt = &outcome["interrupts"][0];
    let call_id = interrupt["toolCallId"].as_str().unwrap().to_owned();
    let interrupt_id = interrupt["id"].as_str().unwrap().to_owned();
    assert!(interrupt_id.starts_with("int_"));
    assert_eq!(interrupt["reason"], "tool_call");
    assert_eq!(interrupt["message"], "Restart pay-prod-2?");
    assert!(interrupt["responseSchema"].is_object());
    assert!(
        chrono::DateTime::parse_from_rfc3339(interrupt["expiresAt"].as_str().unwrap()).unwrap() > chrono::Utc::now()
    );
    // The waiting call was announced in this run, so the interrupt points at a call it knows.
    let announced = first.iter().any(|e| e["type"] == "TOOL_CALL_START" && e["toolCallId"] == call_id.as_str());
    assert!(announced, "{k:?}");
    let keel_run = first[0]["metadata"]["keel"]["runId"].as_str().unwrap().to_owned();
    assert_eq!(app.run(&keel_run).await["status"], "interrupted");
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0);

    // The client re-sends its whole history (the snapshot) with its answer.
    let history = first[n - 2]["messages"].clone();
    let mut resume = input("thread-h", "agui-2", history.clone());
    resume["resume"] = json!([{"interruptId": interrupt_id, "status": "resolved", "payload": {"approved": true}}]);
    let second = ag_ui(&app, "/v1/ag-ui", &resume).await;
    let k2 = kinds(&second);
    assert_eq!(&k2[..2], ["RUN_STARTED", "MESSAGES_SNAPSHOT"], "{k2:?}");
    assert_eq!(second[0]["metadata"]["keel"]["runId"], keel_run, "the same Keel run continues");
    let result = &second[position(&second, "TOOL_CALL_RESULT")];
    assert_eq!(result["toolCallId"], call_id.as_str(), "the result of the original call");
    assert_eq!(result["content"], "restarted pay-prod-2 (restart #1)");
    assert!(!k2.contains(&"TOOL_CALL_START"), "the call is not started again: {k2:?}");
    assert_eq!(second.last().unwrap()["outcome"], json!({"type": "success"}));
    assert_eq!(app.run(&keel_run).await["status"], "completed");

    // The same resume again (a retry): the first answer, nothing runs twice.
    resume["runId"] = json!("agui-3");
    let third = ag_ui(&app, "/v1/ag-ui", &resume).await;
    assert_eq!(third.last().unwrap()["outcome"]["type"], "success");
    let instance = app.instance("pay-prod-2").await;
    assert_eq!((instance["status"].clone(), instance["restartCount"].clone()), (json!("healthy"), json!(1)));

    // Another answer to the same interrupt is too late.
    resume["resume"][0]["payload"] = json!({"approved": false});
    let (status, body) = app.post("/v1/ag-ui", &resume).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(body["error"]["code"], "INTERRUPT_ALREADY_RESOLVED");
}

#[tokio::test]
async fn a_rejection_runs_nothing() {
    let app = TestApp::spawn().await;
    let first = ag_ui(&app, "/v1/ag-ui", &input("thread-n", "agui-1", json!([user("u1", RESTART_PROMPT)]))).await;
    let interrupt = first.last().unwrap()["outcome"]["interrupts"][0]["id"].clone();
    let mut resume = input("thread-n", "agui-2", json!([]));
    resume["resume"] = json!([{"interruptId": interrupt, "status": "cancelled"}]);
    let second = ag_ui(&app, "/v1/ag-ui", &resume).await;
    assert_eq!(second.last().unwrap()["outcome"]["type"], "success");
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0);
}

#[tokio::test]
async fn an_expired_interrupt_can_be_cancelled_and_the_thread_goes_on() {
    let app = TestApp::with(Options { interrupt_ttl: Duration::from_secs(1), ..Options::default() }).await;
    let first = ag_ui(&app, "/v1/ag-ui", &input("thread-x", "agui-1", json!([user("u1", RESTART_PROMPT)]))).await;
    let interrupt = first.last().unwrap()["outcome"]["interrupts"][0]["id"].clone();
    let run = first[0]["metadata"]["keel"]["runId"].as_str().unwrap().to_owned();
    app.wait_for_status(&run, "cancelled").await;

    let mut resume = input("thread-x", "agui-2", json!([]));
    resume["resume"] = json!([{"interruptId": interrupt, "status": "resolved", "payload": {"approved": true}}]);
    let (status, body) = app.post("/v1/ag-ui", &resume).await;
    assert_eq!((status, body["error"]["code"].clone()), (StatusCode::GONE, json!("INTERRUPT_EXPIRED")));
    resume["resume"] = json!([{"interruptId": interrupt, "status": "cancelled"}]);
    let cancelled = ag_ui(&app, "/v1/ag-ui", &resume).await;
    assert_eq!(kinds(&cancelled), ["RUN_STARTED", "MESSAGES_SNAPSHOT", "RUN_FINISHED"]);
    assert_eq!(cancelled.last().unwrap()["outcome"], json!({"type": "cancelled"}));
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0);
    let next = ag_ui(&app, "/v1/ag-ui", &input("thread-x", "agui-3", json!([user("u2", ERRORS_PROMPT)]))).await;
    assert_eq!(next.last().unwrap()["outcome"]["type"], "success");
}

#[tokio::test]
async fn bad_input_is_a_4xx_with_a_json_error() {
    let app = TestApp::spawn().await;
    let send = |body: String| {
        let request = app.client.post(app.url("/v1/ag-ui")).header(CONTENT_TYPE, "application/json").body(body);
        async move { to_json(request.send().await.expect("POST")).await }
    };
    let (status, body) = send("{\"threadId\": ".into()).await;
    assert_eq!((status, body["error"]["code"].clone()), (StatusCode::BAD_REQUEST, json!("MALFORMED_JSON")));
    for bad in [
        json!({"runId": "r", "messages": []}),
        json!({"threadId": "t", "runId": "r", "messages": "hi"}),
        json!({"threadId": "", "runId": "r", "messages": [user("u", "hi")]}),
        json!({"threadId": "t", "runId": "r", "messages": [{"id": "a", "role": "assistant", "content": "no user"}]}),
        json!({"threadId": "t", "runId": "r", "messages": [{"id": "u", "role": "user", "content": 42}]}),
        json!({"threadId": "t", "runId": "r", "messages": [], "resume": [{"interruptId": "int_1", "status": "maybe"}]}),
    ] {
        let (status, body) = send(bad.to_string()).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{bad} → {body}");
        assert_eq!(body["error"]["code"], "VALIDATION_FAILED", "{bad}");
        assert!(body["error"]["message"].is_string());
    }

    // Unknown interrupts, on a thread that exists and on one that does not.
    let first = ag_ui(&app, "/v1/ag-ui", &input("thread-e", "agui-1", json!([user("u1", RESTART_PROMPT)]))).await;
    let interrupt = first.last().unwrap()["outcome"]["interrupts"][0]["id"].as_str().unwrap().to_owned();
    for (thread, id) in
        [("thread-e", "int_doesnotexist"), ("thread-e", "not-an-id"), ("thread-none", interrupt.as_str())]
    {
        let mut body = input(thread, "r", json!([]));
        body["resume"] = json!([{"interruptId": id, "status": "resolved", "payload": {"approved": true}}]);
        let (status, body) = app.post("/v1/ag-ui", &body).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{thread} {id}: {body}");
        assert_eq!(body["error"]["code"], "INTERRUPT_NOT_FOUND");
    }
    // An answer that is not {approved}.
    let mut body = input("thread-e", "r", json!([]));
    body["resume"] = json!([{"interruptId": interrupt, "status": "resolved", "payload": "yes"}]);
    let (status, body) = app.post("/v1/ag-ui", &body).await;
    assert_eq!((status, body["error"]["code"].clone()), (StatusCode::UNPROCESSABLE_ENTITY, json!("VALIDATION_FAILED")));
    // A new message while the run waits for its answer.
    let (status, body) = app.post("/v1/ag-ui", &input("thread-e", "r", json!([user("u2", "hello?")]))).await;
    assert_eq!((status, body["error"]["code"].clone()), (StatusCode::CONFLICT, json!("RUN_ACTIVE")));

    // Another user's conversation is not found; so is another user's thread, which is a new one.
    let conversation = app.create_conversation().await;
    let (status, body) =
        app.post_as("mallory", "/v1/ag-ui", &input(&conversation, "r", json!([user("u", "hi")]))).await;
    assert_eq!((status, body["error"]["code"].clone()), (StatusCode::NOT_FOUND, json!("CONVERSATION_NOT_FOUND")));
    let mut body = input("thread-e", "r", json!([]));
    body["resume"] = json!([{"interruptId": interrupt, "status": "resolved", "payload": {"approved": true}}]);
    let (status, _) = app.post_as("mallory", "/v1/ag-ui", &body).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0, "nothing ran");

    let (status, body) = app.post("/v1/ag-ui/someone-else", &input("t", "r", json!([user("u", "hi")]))).await;
    assert_eq!((status, body["error"]["code"].clone()), (StatusCode::NOT_FOUND, json!("NOT_FOUND")));
    let response = app.client.post(app.url("/v1/ag-ui")).body("{}").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
}
