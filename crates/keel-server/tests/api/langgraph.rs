//! LangGraph Server's API under `/langgraph` (docs/langgraph.md), over HTTP against the real
//! server: the SDK's key header and per-user isolation, the error shapes (unknown and unsupported
//! options named in a 422), a resume sent twice that continues once, the thread's history, and a
//! join with `Last-Event-ID` that has no gap and no duplicate. The real SDKs run in CI (e2e/langgraph/).

use keel_client::sse::SseFrame;
use reqwest::header::ACCEPT;
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::common::*;

const ASSISTANT: &str = "opspilot";

fn restart_input() -> Value {
    json!({"messages": [{"role": "user", "content": RESTART_PROMPT}]})
}

/// A LangGraph stream part: `(event, data, id)`.
type Part = (String, Value, Option<String>);

async fn parts(response: reqwest::Response) -> Vec<Part> {
    let mut reader = SseReader::new(response);
    reader.assert_sse();
    let mut out = Vec::new();
    while let Some(frame) = reader.next_frame().await {
        if let SseFrame::Event { id, event, data } = frame {
            out.push((event.expect("an event name"), serde_json::from_str(&data).expect("JSON data"), id));
        }
    }
    out
}

async fn stream(app: &TestApp, thread: &str, body: Value) -> Vec<Part> {
    let response = app
        .client
        .post(app.url(&format!("/langgraph/threads/{thread}/runs/stream")))
        .header(ACCEPT, "text/event-stream")
        .json(&body)
        .send()
        .await
        .expect("POST runs/stream");
    parts(response).await
}

async fn join(app: &TestApp, thread: &str, run: &str, last_event_id: Option<&str>) -> Vec<Part> {
    let mut request =
        app.client.get(app.url(&format!(
            "/langgraph/threads/{thread}/runs/{run}/stream?stream_mode=updates&stream_mode=messages-tuple"
        )));
    if let Some(id) = last_event_id {
        request = request.header("last-event-id", id);
    }
    parts(request.send().await.expect("GET runs/{id}/stream")).await
}

async fn thread(app: &TestApp) -> String {
    let (status, body) = app.post("/langgraph/threads", &json!({})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    body["thread_id"].as_str().expect("thread_id").to_owned()
}

fn interrupt_of(parts: &[Part]) -> Value {
    parts
        .iter()
        .find_map(|(event, data, _)| (event == "updates").then(|| data.get("__interrupt__")).flatten())
        .unwrap_or_else(|| panic!("no __interrupt__ in {:?}", parts.iter().map(|p| &p.0).collect::<Vec<_>>()))[0]
        .clone()
}

#[tokio::test]
async fn the_sdk_key_header_authenticates_and_threads_are_the_callers() {
    let app = TestApp::spawn().await;
    let plain = reqwest::Client::new();
    let url = app.url("/langgraph/assistants/search");
    let anonymous = plain.post(&url).json(&json!({})).send().await.unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    let key = app.bearer("alice").trim_start_matches("Bearer ").to_owned();
    let (status, body) =
        to_json(plain.post(&url).header("x-api-key", &key).json(&json!({})).send().await.unwrap()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body[0]["assistant_id"], ASSISTANT);
    assert_eq!(body[0]["graph_id"], ASSISTANT);
    let wrong = plain.post(&url).header("x-api-key", "keel_nope").json(&json!({})).send().await.unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);

    // alice's thread (a client-chosen id) is not bob's, under the same id or Keel's.
    let threads = app.url("/langgraph/threads");
    let created = plain
        .post(&threads)
        .header("x-api-key", &key)
        .json(&json!({"thread_id": "6f1c2c1e-0000-4000-8000-000000000001", "metadata": {"team": "a"}}))
        .send()
        .await
        .unwrap();
    let (status, thread) = to_json(created).await;
    assert_eq!(status, StatusCode::OK, "{thread}");
    assert_eq!(thread["thread_id"], "6f1c2c1e-0000-4000-8000-000000000001");
    assert_eq!(thread["metadata"]["team"], "a");
    let (status, _) = app.get_as("bob", "/langgraph/threads/6f1c2c1e-0000-4000-8000-000000000001").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, again) =
        app.post_as("alice", "/langgraph/threads", &json!({"thread_id": "6f1c2c1e-0000-4000-8000-000000000001"})).await;
    assert_eq!((status, again["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("THREAD_EXISTS")));
    let (status, same) = app
        .post_as(
            "alice",
            "/langgraph/threads",
            &json!({"thread_id": "6f1c2c1e-0000-4000-8000-000000000001", "if_exists": "do_nothing"}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{same}");
    let (_, found) = app.post_as("bob", "/langgraph/threads/search", &json!({"metadata": {"team": "a"}})).await;
    assert_eq!(found, json!([]));
}

#[tokio::test]
async fn unknown_and_unsupported_options_are_named_in_a_422() {
    let app = TestApp::spawn().await;
    let thread = thread(&app).await;
    let runs = format!("/langgraph/threads/{thread}/runs");
    let cases = [
        (json!({"assistant_id": ASSISTANT, "input": restart_input(), "webhook": "https://example.com"}), "webhook"),
        (json!({"assistant_id": ASSISTANT, "input": restart_input(), "surprise": 1}), "surprise (unknown)"),
        (
            json!({"assistant_id": ASSISTANT, "input": restart_input(), "interrupt_before": ["tools"]}),
            "interrupt_before",
        ),
        (json!({"assistant_id": ASSISTANT, "input": restart_input(), "stream_mode": "events"}), "events"),
        (json!({"assistant_id": ASSISTANT, "input": {"messages": [], "todo": 1}}), "input.todo"),
        (json!({"assistant_id": ASSISTANT, "command": {"goto": "tools"}}), "command.goto"),
    ];
    for (body, named) in cases {
        let (status, error) = app.post(&runs, &body).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}: {error}");
        assert_eq!(error["error"]["code"], "UNSUPPORTED_OPTION", "{error}");
        assert!(error["error"]["message"].as_str().unwrap().contains(named), "{named}: {error}");
    }
    // The defaults the SDKs always send are accepted.
    let body = json!({"assistant_id": ASSISTANT, "input": restart_input(), "stream_subgraphs": false,
                      "stream_resumable": false, "config": {}, "metadata": {}});
    let (status, run) = app.post(&runs, &body).await;
    assert_eq!(status, StatusCode::OK, "{run}");
    assert!(["pending", "running"].contains(&run["status"].as_str().unwrap()), "{run}");
    assert_eq!(run["thread_id"], thread.as_str());

    let (status, error) = app.post(&runs, &json!({"input": restart_input()})).await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("VALIDATION_FAILED"))
    );
    let (status, error) = app.post(&runs, &json!({"assistant_id": "nobody", "input": restart_input()})).await;
    assert_eq!((status, error["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("ASSISTANT_NOT_FOUND")));
    let (status, error) = app
        .post(
            "/langgraph/threads/conv_00000000000000000000000000000000/runs",
            &json!({"assistant_id": ASSISTANT, "input": restart_input()}),
        )
        .await;
    assert_eq!((status, error["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("CONVERSATION_NOT_FOUND")));
    // reject (the default) on a busy thread: Keel's RUN_ACTIVE.
    let (status, error) = app.post(&runs, &json!({"assistant_id": ASSISTANT, "input": restart_input()})).await;
    assert_eq!((status, error["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("RUN_ACTIVE")));
}

#[tokio::test]
async fn a_resume_sent_twice_continues_once() {
    let app = TestApp::spawn().await;
    let thread = thread(&app).await;
    let first =
        stream(&app, &thread, json!({"assistant_id": ASSISTANT, "input": restart_input(), "stream_mode": ["updates"]}))
            .await;
    assert_eq!(first[0].0, "metadata");
    assert_eq!(first.last().unwrap().0, "end");
    let interrupt = interrupt_of(&first);
    assert_eq!(interrupt["value"]["action_requests"][0]["args"], json!({"instanceId": "pay-prod-2"}));
    assert!(interrupt["value"]["review_configs"][0]["args_schema"].is_object(), "{interrupt}");
    let run = first[0].1["run_id"].as_str().unwrap().to_owned();

    // The thread's state shows it, with its id.
    let (_, state) = app.get(&format!("/langgraph/threads/{thread}/state")).await;
    assert_eq!(state["next"], json!(["approval"]));
    assert_eq!(state["interrupts"][0]["id"], interrupt["id"]);

    // A decision list of the wrong length is refused, naming the rule; nothing ran.
    let wait = format!("/langgraph/threads/{thread}/runs/wait");
    let (status, error) =
        app.post(&wait, &json!({"assistant_id": ASSISTANT, "command": {"resume": {"decisions": []}}})).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{error}");
    assert!(error["error"]["message"].as_str().unwrap().contains("1 expected"), "{error}");

    // The resume, keyed by the interrupt's id, twice: one restart, the same values.
    let id = interrupt["id"].as_str().unwrap();
    let resume = json!({"assistant_id": ASSISTANT, "command": {"resume": {id: {"decisions": [{"type": "approve"}]}}}});
    let (status, once) = app.post(&wait, &resume).await;
    assert_eq!(status, StatusCode::OK, "{once}");
    assert!(once.get("__interrupt__").is_none(), "{once}");
    let (status, twice) = app.post(&wait, &resume).await;
    assert_eq!(status, StatusCode::OK, "{twice}");
    assert_eq!(once, twice);
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 1);
    // Another decision under the key derived from the run and the interrupt is refused.
    let (status, error) = app.post(&wait, &json!({"assistant_id": ASSISTANT, "command": {"resume": "reject"}})).await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("IDEMPOTENCY_KEY_REUSED"))
    );
    let (_, got) = app.get(&format!("/langgraph/threads/{thread}/runs/{run}")).await;
    assert_eq!(got["status"], "success");
    let (_, listed) = app.get(&format!("/langgraph/threads/{thread}/runs")).await;
    assert_eq!(listed.as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn a_resume_under_the_requests_idempotency_key() {
    let app = TestApp::spawn().await;
    let thread = thread(&app).await;
    let first =
        stream(&app, &thread, json!({"assistant_id": ASSISTANT, "input": restart_input(), "stream_mode": "updates"}))
            .await;
    let _ = interrupt_of(&first);
    let body = json!({"assistant_id": ASSISTANT, "command": {"resume": {"decisions": [
        {"type": "edit", "edited_action": {"name": "restart_instance", "args": {"instanceId": "pay-prod-2"}}}]}}});
    let send = || {
        app.client
            .post(app.url(&format!("/langgraph/threads/{thread}/runs/wait")))
            .header("idempotency-key", "edit-once")
            .json(&body)
            .send()
    };
    let (status, once) = to_json(send().await.unwrap()).await;
    assert_eq!(status, StatusCode::OK, "{once}");
    let (status, twice) = to_json(send().await.unwrap()).await;
    assert_eq!((status, &once), (StatusCode::OK, &twice));
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 1);
}

#[tokio::test]
async fn a_join_with_last_event_id_has_no_gap_and_no_duplicate() {
    let app = TestApp::spawn().await;
    let thread = thread(&app).await;
    let (status, run) = app
        .post(
            &format!("/langgraph/threads/{thread}/runs"),
            &json!({"assistant_id": ASSISTANT, "input": restart_input()}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{run}");
    let run = run["run_id"].as_str().unwrap().to_owned();
    let whole = join(&app, &thread, &run, Some("0")).await;
    assert_eq!(whole.first().unwrap().0, "metadata");
    assert_eq!(whole.last().unwrap().0, "end");
    assert!(whole.iter().any(|p| p.0 == "messages"), "token chunks");
    let without_metadata =
        |ps: &[Part]| ps.iter().filter(|p| p.0 != "metadata").map(|p| (p.0.clone(), p.1.clone())).collect::<Vec<_>>();
    // Cut after every part with an id (`end` has none; an SSE parser carries the previous one to
    // it): what follows it is exactly the rest.
    let ids: Vec<(usize, String)> = whole
        .iter()
        .enumerate()
        .filter(|(_, p)| p.0 != "end")
        .filter_map(|(n, p)| p.2.clone().map(|id| (n, id)))
        .collect();
    assert!(ids.len() > 5, "{ids:?}");
    for (n, id) in ids {
        let tail = join(&app, &thread, &run, Some(&id)).await;
        assert_eq!(without_metadata(&tail), without_metadata(&whole[n + 1..]), "after id {id}");
    }
    // After the last part: the run waits for a human, the stream is over at once.
    let last = &whole[whole.len() - 2].2.clone().unwrap();
    let rest = join(&app, &thread, &run, Some(last)).await;
    assert_eq!(rest.iter().map(|p| p.0.as_str()).collect::<Vec<_>>(), ["metadata", "end"]);
    let (status, error) = to_json(
        app.client
            .get(app.url(&format!("/langgraph/threads/{thread}/runs/{run}/stream")))
            .header("last-event-id", "99999")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, error["error"]["code"].as_str()), (StatusCode::BAD_REQUEST, Some("CURSOR_OUT_OF_RANGE")));
}

#[tokio::test]
async fn multitask_interrupt_cancels_the_active_run_in_both_apis() {
    let app = TestApp::spawn().await;
    // Keel's own API.
    let (conversation, run, _) = app.interrupted_run().await;
    let messages = format!("/v1/conversations/{conversation}/messages");
    let (status, error) =
        app.post(&messages, &json!({"content": "list the services", "multitaskStrategy": "eventually"})).await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("VALIDATION_FAILED"))
    );
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("multitaskStrategy") && message.contains("enqueue"), "{error}");
    assert!(!message.contains("eventually"), "the value sent is not echoed: {error}");
    let (status, error) = app.post(&messages, &json!({"content": "list the services"})).await;
    assert_eq!((status, error["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("RUN_ACTIVE")));
    let (status, accepted) =
        app.post(&messages, &json!({"content": "list the services", "multitaskStrategy": "interrupt"})).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{accepted}");
    assert_ne!(accepted["runId"], run.as_str());
    let old = app.run(&run).await;
    assert_eq!(old["status"], "cancelled", "{old}");
    assert_eq!(old["reason"], "interrupted_by_new_message", "{old}");
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0);

    // LangGraph's: the interrupted run reads `interrupted`, with its reason.
    let thread = thread(&app).await;
    let runs = format!("/langgraph/threads/{thread}/runs");
    let (_, first) = app.post(&runs, &json!({"assistant_id": ASSISTANT, "input": restart_input()})).await;
    let first = first["run_id"].as_str().unwrap().to_owned();
    app.wait_for_status(&first, "interrupted").await;
    let ask = json!({"assistant_id": ASSISTANT, "input": {"messages": [{"role": "user", "content": "list the services"}]},
                     "multitask_strategy": "interrupt"});
    let (status, second) = app.post(&runs, &ask).await;
    assert_eq!(status, StatusCode::OK, "{second}");
    assert_eq!(second["multitask_strategy"], "interrupt");
    let (_, old) = app.get(&format!("{runs}/{first}")).await;
    assert_eq!(old["status"], "interrupted");
    assert_eq!(old["cancel_reason"], "interrupted_by_new_message", "{old}");
    let (status, values) = app.get(&format!("{runs}/{}/join", second["run_id"].as_str().unwrap())).await;
    assert_eq!(status, StatusCode::OK, "{values}");
    assert_eq!(values["messages"].as_array().unwrap().last().unwrap()["type"], "ai");
}

#[tokio::test]
async fn values_and_messages_modes_and_on_disconnect_cancel() {
    let app = TestApp::spawn().await;
    let first = thread(&app).await;
    let body = json!({"assistant_id": ASSISTANT, "input": restart_input(), "stream_mode": ["values", "messages"]});
    let all = stream(&app, &first, body).await;
    let events: Vec<&str> = all.iter().map(|p| p.0.as_str()).collect();
    assert_eq!(events[..2], ["metadata", "values"], "{events:?}");
    assert_eq!(all[1].1["messages"][0]["type"], "human");
    assert_eq!(all[1].1["messages"][0]["content"], RESTART_PROMPT);
    assert!(events.contains(&"messages/metadata") && events.contains(&"messages/partial"), "{events:?}");
    assert!(events.contains(&"messages/complete"), "{events:?}");
    let last_values = all.iter().rev().find(|p| p.0 == "values").unwrap();
    assert_eq!(last_values.1["__interrupt__"][0]["value"]["action_requests"][0]["name"], "restart_instance");
    assert_eq!(last_values.1["facts"]["service"], "payment-api");

    // `on_disconnect: cancel`: the client goes away, the run is cancelled.
    let other = thread(&app).await;
    let response = app
        .client
        .post(app.url(&format!("/langgraph/threads/{other}/runs/stream")))
        .header(ACCEPT, "text/event-stream")
        .json(&json!({"assistant_id": ASSISTANT, "input": restart_input(), "on_disconnect": "cancel"}))
        .send()
        .await
        .unwrap();
    let mut reader = SseReader::new(response);
    let Some(SseFrame::Event { data, .. }) = reader.next_frame().await else { panic!("metadata first") };
    let run = serde_json::from_str::<Value>(&data).unwrap()["run_id"].as_str().unwrap().to_owned();
    reader.disconnect();
    let cancelled = app.wait_for_status(&run, "cancelled").await;
    assert_eq!(cancelled["reason"], "client_disconnected", "{cancelled}");
}

#[tokio::test]
async fn a_server_without_keys_ignores_the_sdk_key_header() {
    // The SDKs send whatever key the environment holds (LANGSMITH_API_KEY…) as `x-api-key`.
    let server = keel_server::ServerConfig {
        auth: keel_server::auth::AuthMode::SingleUser("demo".into()),
        ..keel_server::ServerConfig::default()
    };
    let app = TestApp::with(Options { server, ..Options::default() }).await;
    let response = reqwest::Client::new()
        .post(app.url("/langgraph/assistants/search"))
        .header("x-api-key", "lsv2_not_a_keel_key")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    let (status, body) = to_json(response).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body[0]["assistant_id"], ASSISTANT);
}

#[tokio::test]
async fn multitask_interrupt_stops_a_running_run_at_its_next_checkpoint() {
    // Slow words: the first run is still streaming when the second message comes.
    let app = TestApp::with(Options { demo_delay: std::time::Duration::from_millis(40), ..Options::default() }).await;
    let thread = thread(&app).await;
    let runs = format!("/langgraph/threads/{thread}/runs");
    let (_, first) = app.post(&runs, &json!({"assistant_id": ASSISTANT, "input": restart_input()})).await;
    let first = first["run_id"].as_str().unwrap().to_owned();
    app.wait_for_run(&first, "streaming", |r| r["status"] == "running" && r["lastSequence"].as_i64() > Some(4)).await;
    let ask = json!({"assistant_id": ASSISTANT, "input": {"messages": [{"role": "user", "content": "list the services"}]},
                     "multitask_strategy": "interrupt"});
    let (status, second) = app.post(&runs, &ask).await;
    assert_eq!(status, StatusCode::OK, "{second}");
    let old = app.run(&first).await;
    assert_eq!(old["status"], "cancelled", "{old}");
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0);
    let (status, values) = app.get(&format!("{runs}/{}/join", second["run_id"].as_str().unwrap())).await;
    assert_eq!(status, StatusCode::OK, "{values}");
    let (_, listed) = app.get(&runs).await;
    let statuses: Vec<&str> = listed.as_array().unwrap().iter().map(|r| r["status"].as_str().unwrap()).collect();
    assert_eq!(statuses, ["success", "interrupted"], "{listed}");
}

#[tokio::test]
async fn searches_and_lists_sort_and_select_or_refuse_what_they_cannot() {
    let app = TestApp::spawn().await;
    let (status, body) = app
        .post(
            "/langgraph/assistants/search",
            &json!({"sort_by": "name", "sort_order": "desc", "select": ["assistant_id"]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let list = body.as_array().expect("a list");
    assert!(!list.is_empty());
    assert!(list.iter().all(|a| a.as_object().unwrap().keys().eq(["assistant_id"])), "{body}");
    let (status, body) = app.post("/langgraph/assistants/search", &json!({"sort_by": "metadata"})).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("sort_by"), "{body}");
    let (status, body) = app.post("/langgraph/assistants/search", &json!({"sort_order": "sideways"})).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");

    // A thread's runs, newest first, with only the selected fields.
    let thread = thread(&app).await;
    let body =
        json!({"assistant_id": ASSISTANT, "input": {"messages": [{"role": "user", "content": "what can you do?"}]}});
    for _ in 0..2 {
        let (status, run) = app.post(&format!("/langgraph/threads/{thread}/runs/wait"), &body).await;
        assert_eq!(status, StatusCode::OK, "{run}");
    }
    let (status, runs) = app.get(&format!("/langgraph/threads/{thread}/runs?select=run_id,status")).await;
    assert_eq!(status, StatusCode::OK, "{runs}");
    let runs = runs.as_array().expect("a list");
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert!(runs.iter().all(|r| r.as_object().unwrap().len() == 2 && r["status"] == "success"), "{runs:?}");
    assert!(runs[0]["run_id"].as_str() > runs[1]["run_id"].as_str(), "newest first: {runs:?}");
}

/// An unknown strategy is refused by name (the option, and the strategies there are), on both APIs.
#[tokio::test]
async fn an_unknown_multitask_strategy_is_a_422_naming_the_option() {
    let app = TestApp::spawn().await;
    let thread = thread(&app).await;
    for strategy in [json!("eventually"), json!(3), json!("")] {
        let body = json!({"assistant_id": ASSISTANT, "input": restart_input(), "multitask_strategy": strategy});
        let (status, error) = app.post(&format!("/langgraph/threads/{thread}/runs"), &body).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{strategy}: {error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("multitask_strategy") && message.contains("reject, interrupt, enqueue, rollback"),
            "{error}"
        );
    }
    let conversation = app.create_conversation().await;
    let (status, error) = app
        .post(
            &format!("/v1/conversations/{conversation}/messages"),
            &json!({"content": "hi", "multitaskStrategy": "Enqueue"}),
        )
        .await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("VALIDATION_FAILED"))
    );
    let (status, error) = app
        .post(&format!("/v1/conversations/{conversation}/messages"), &json!({"content": "hi", "multitaskStrategy": 1}))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{error}");
    // a refused message started nothing
    let (_, view) = app.get(&format!("/v1/conversations/{conversation}")).await;
    assert_eq!((view["activeRunId"].clone(), view["waitingRunIds"].clone()), (Value::Null, json!([])), "{view}");
}

/// `enqueue` on Keel's API: a message sent while a run waits for approval is answered 202 with
/// its run `waiting`; a stream of it shows `run_waiting` and stays open through the wait; a
/// waiting run can be cancelled without running; once the approval is given the queue runs, in
/// order.
#[tokio::test]
async fn multitask_enqueue_waits_its_turn_on_keels_api() {
    let app = TestApp::spawn().await;
    let (conversation, paused, interrupt) = app.interrupted_run().await;
    let messages = format!("/v1/conversations/{conversation}/messages");
    let enqueue = |content: &str| json!({"content": content, "multitaskStrategy": "enqueue"});

    // streamed: the first event says it waits
    let mut streamed = app.send_streaming(&conversation, &enqueue("Look at the recent errors of payment-api")).await;
    streamed.assert_sse();
    let first = streamed.next_event().await.expect("the first event");
    assert_eq!(first.kind.type_name(), "run_waiting", "{first:?}");
    let first_run = first.run_id.to_string();
    let (status, second) = app.post(&messages, &enqueue("list the services")).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{second}");
    assert_eq!(second["status"], "waiting", "{second}");
    let second = second["runId"].as_str().unwrap().to_owned();
    let (_, doomed) = app.post(&messages, &enqueue("never mind")).await;
    let doomed = doomed["runId"].as_str().unwrap().to_owned();

    let (_, view) = app.get(&format!("/v1/conversations/{conversation}")).await;
    assert_eq!(view["activeRunId"], paused.as_str());
    assert_eq!(view["waitingRunIds"], json!([first_run, second, doomed]), "{view}");
    let shown = view["messages"].as_array().unwrap();
    assert!(shown.iter().all(|m| m["runId"] == paused.as_str()), "the waiting messages are not in it: {view}");
    let waiting = app.run(&second).await;
    assert_eq!((waiting["status"].as_str(), waiting["worker"].clone()), (Some("waiting"), Value::Null), "{waiting}");
    let (_, listed) = app.get("/v1/runs?status=waiting").await;
    assert_eq!(listed["runs"].as_array().unwrap().len(), 3, "{listed}");
    let events = app.events_json(&second, 0).await;
    assert_eq!(events.iter().map(|e| e.type_name()).collect::<Vec<_>>(), ["run_waiting"]);
    // a reject-by-default message is still refused while they wait
    let (status, error) = app.post(&messages, &json!({"content": "me first"})).await;
    assert_eq!((status, error["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("RUN_ACTIVE")));

    // one of them is cancelled before it runs
    let (status, cancelled) = app.post(&format!("/v1/runs/{doomed}/cancel"), &json!({})).await;
    assert_eq!(status, StatusCode::OK, "{cancelled}");
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");

    let (status, answer) = app.resume(&paused, &interrupt, json!("approve"), "enqueue-approve").await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    // the stream that waited goes on to the end of its run
    let mut types = vec![first.kind.type_name()];
    while let Some(event) = streamed.next_event().await {
        types.push(event.kind.type_name());
    }
    assert_eq!(types[..3], ["run_waiting", "run_started", "graph_topology"], "{types:?}");
    assert_eq!(types.last(), Some(&"done"), "{types:?}");
    app.wait_for_status(&second, "completed").await;
    assert_eq!(app.run(&doomed).await["status"], "cancelled", "it never ran");
    let (_, view) = app.get(&format!("/v1/conversations/{conversation}")).await;
    let users: Vec<&str> = view["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(users, [RESTART_PROMPT, "Look at the recent errors of payment-api", "list the services"]);
    assert_eq!(view["waitingRunIds"], json!([]));
}

/// `enqueue` on LangGraph's API: the run is created `pending` behind the busy thread, listed and
/// read as such, and joined once the thread's run was resumed: it runs and succeeds.
#[tokio::test]
async fn multitask_enqueue_waits_its_turn_on_langgraphs_api() {
    let app = TestApp::spawn().await;
    let thread = thread(&app).await;
    let runs = format!("/langgraph/threads/{thread}/runs");
    let (_, first) = app.post(&runs, &json!({"assistant_id": ASSISTANT, "input": restart_input()})).await;
    let first = first["run_id"].as_str().unwrap().to_owned();
    app.wait_for_status(&first, "interrupted").await;
    let ask = json!({"assistant_id": ASSISTANT, "input": {"messages": [{"role": "user", "content": "list the services"}]},
                     "multitask_strategy": "enqueue"});
    let (status, queued) = app.post(&runs, &ask).await;
    assert_eq!(status, StatusCode::OK, "{queued}");
    assert_eq!((queued["status"].as_str(), queued["multitask_strategy"].as_str()), (Some("pending"), Some("enqueue")));
    let queued = queued["run_id"].as_str().unwrap().to_owned();
    let (_, read) = app.get(&format!("{runs}/{queued}")).await;
    assert_eq!(read["status"], "pending", "{read}");
    let (_, listed) = app.get(&format!("{runs}?status=pending")).await;
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    let (_, state) = app.get(&format!("/langgraph/threads/{thread}")).await;
    assert_eq!(state["status"], "interrupted", "the thread's run waits for a human: {state}");

    // a join waits through the queue
    let join = {
        let client = app.client.clone();
        let url = app.url(&format!("{runs}/{queued}/join"));
        tokio::spawn(async move { to_json(client.get(url).send().await.unwrap()).await })
    };
    let resume = json!({"assistant_id": ASSISTANT, "command": {"resume": "approve"}});
    let (status, _) = app.post(&format!("{runs}/wait"), &resume).await;
    assert_eq!(status, StatusCode::OK);
    let (status, values) = join.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{values}");
    let messages = values["messages"].as_array().unwrap();
    assert_eq!(messages.iter().filter(|m| m["type"] == "human").count(), 2, "{values}");
    assert_eq!(messages.last().unwrap()["type"], "ai");
    let (_, read) = app.get(&format!("{runs}/{queued}")).await;
    assert_eq!(read["status"], "success", "{read}");
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 1);
}

/// `rollback` on both APIs, and LangGraph's cancel with `action=rollback`: the run replaced is
/// cancelled and removed — its messages gone from the conversation and the thread, its events
/// gone (Keel's API: 410), LangGraph's API: 404 — while Keel's run view keeps it, `rolled_back`,
/// with its tool calls and decisions.
#[tokio::test]
async fn multitask_rollback_removes_the_run_in_both_apis() {
    let app = TestApp::spawn().await;
    // Keel's own API.
    let (conversation, run, _) = app.interrupted_run().await;
    let messages = format!("/v1/conversations/{conversation}/messages");
    let (status, accepted) =
        app.post(&messages, &json!({"content": "list the services", "multitaskStrategy": "rollback"})).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{accepted}");
    assert_eq!(accepted["status"], "queued");
    app.wait_for_status(accepted["runId"].as_str().unwrap(), "completed").await;
    let old = app.run(&run).await;
    assert_eq!(old["status"], "rolled_back", "{old}");
    let calls: Vec<(&str, &str)> = old["toolCalls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["name"].as_str().unwrap(), c["state"].as_str().unwrap()))
        .collect();
    assert_eq!(
        calls,
        [("find_abnormal_instances", "succeeded"), ("restart_instance", "denied")],
        "the audit keeps its calls"
    );
    assert_eq!(old["interrupts"][0]["status"], "cancelled", "{old}");
    let (status, error) = app.get(&format!("/v1/runs/{run}/events")).await;
    assert_eq!((status, error["error"]["code"].as_str()), (StatusCode::GONE, Some("EVENTS_PRUNED")), "{error}");
    let (_, view) = app.get(&format!("/v1/conversations/{conversation}")).await;
    let contents: Vec<&str> =
        view["messages"].as_array().unwrap().iter().map(|m| m["content"].as_str().unwrap()).collect();
    assert_eq!(contents[0], "list the services", "{view}");
    assert!(view["messages"].as_array().unwrap().iter().all(|m| m["runId"] != run.as_str()), "{view}");
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0);
    let (_, listed) = app.get("/v1/runs?status=rolled_back").await;
    assert_eq!(listed["runs"][0]["id"], run.as_str(), "{listed}");

    // LangGraph's: `multitask_strategy: rollback`.
    let thread = thread(&app).await;
    let runs = format!("/langgraph/threads/{thread}/runs");
    let (_, first) = app.post(&runs, &json!({"assistant_id": ASSISTANT, "input": restart_input()})).await;
    let first = first["run_id"].as_str().unwrap().to_owned();
    app.wait_for_status(&first, "interrupted").await;
    let ask = json!({"assistant_id": ASSISTANT, "input": {"messages": [{"role": "user", "content": "list the services"}]},
                     "multitask_strategy": "rollback"});
    let (status, values) = app.post(&format!("{runs}/wait"), &ask).await;
    assert_eq!(status, StatusCode::OK, "{values}");
    let humans: Vec<&Value> = values["messages"].as_array().unwrap().iter().filter(|m| m["type"] == "human").collect();
    assert_eq!(humans.len(), 1, "{values}");
    assert_eq!(humans[0]["content"], "list the services");
    assert!(
        values["messages"].as_array().unwrap().iter().all(|m| m["tool_calls"].as_array().is_none_or(|c| c.is_empty())
            || m["tool_calls"][0]["name"] != "restart_instance"),
        "{values}"
    );
    let (status, _) = app.get(&format!("{runs}/{first}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "a rolled-back run is gone, as LangGraph deletes it");
    let (_, listed) = app.get(&runs).await;
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(app.run(&first).await["status"], "rolled_back");

    // LangGraph's cancel with `action=rollback`.
    let (_, third) = app.post(&runs, &json!({"assistant_id": ASSISTANT, "input": restart_input()})).await;
    let third = third["run_id"].as_str().unwrap().to_owned();
    app.wait_for_status(&third, "interrupted").await;
    let (status, error) = app.post(&format!("{runs}/{third}/cancel?action=sideways"), &json!({})).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{error}");
    assert!(error["error"]["message"].as_str().unwrap().contains("action"), "{error}");
    let (status, body) = app.post(&format!("{runs}/{third}/cancel?action=rollback"), &json!({})).await;
    assert_eq!((status, body), (StatusCode::NO_CONTENT, Value::Null));
    for path in [format!("{runs}/{third}"), format!("{runs}/{third}/join"), format!("{runs}/{third}/stream")] {
        let (status, _) = app.get(&path).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
    }
    let (status, _) = app.post(&format!("{runs}/{third}/cancel?action=rollback"), &json!({})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, state) = app.get(&format!("/langgraph/threads/{thread}/state")).await;
    let humans: Vec<&Value> =
        state["values"]["messages"].as_array().unwrap().iter().filter(|m| m["type"] == "human").collect();
    assert_eq!(humans.len(), 1, "only the message that replaced the first: {state}");
    assert_eq!(state["next"], json!([]), "{state}");
    let (_, thread_object) = app.get(&format!("/langgraph/threads/{thread}")).await;
    assert_eq!(thread_object["status"], "idle", "{thread_object}");
    let old = app.run(&third).await;
    assert_eq!((old["status"].as_str(), old["reason"].as_str()), (Some("rolled_back"), Some("cancelled_by_user")));
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0);
}

fn human_contents(state: &Value) -> Vec<String> {
    state["values"]["messages"]
        .as_array()
        .unwrap_or_else(|| panic!("no values.messages in {state}"))
        .iter()
        .filter(|m| m["type"] == "human")
        .map(|m| m["content"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test]
async fn the_history_is_one_state_per_run_newest_first() {
    let app = TestApp::spawn().await;
    let thread = thread(&app).await;
    let runs = format!("/langgraph/threads/{thread}/runs");
    let ask = |content: &str| json!({"assistant_id": ASSISTANT, "input": {"messages": [{"role": "user", "content": content}]}});
    let mut run_ids = Vec::new();
    for content in ["list the services", "Look at the recent errors of payment-api"] {
        let (_, run) = app.post(&runs, &ask(content)).await;
        let id = run["run_id"].as_str().unwrap().to_owned();
        app.wait_for_status(&id, "completed").await;
        run_ids.push(id);
    }
    let (_, paused) = app.post(&runs, &json!({"assistant_id": ASSISTANT, "input": restart_input()})).await;
    let paused = paused["run_id"].as_str().unwrap().to_owned();
    app.wait_for_status(&paused, "interrupted").await;
    run_ids.push(paused);
    run_ids.reverse(); // newest first

    let history_path = format!("/langgraph/threads/{thread}/history");
    let (status, history) = app.post(&history_path, &json!({"limit": 10})).await;
    assert_eq!(status, StatusCode::OK, "{history}");
    let states = history.as_array().unwrap();
    assert_eq!(states.len(), 3, "{history}");
    let checkpoint_ids: Vec<&str> = states.iter().map(|s| s["checkpoint"]["checkpoint_id"].as_str().unwrap()).collect();
    for (id, run) in checkpoint_ids.iter().zip(&run_ids) {
        assert!(id.starts_with(&format!("{run}:")), "{id} names {run}");
        assert_eq!(
            states.iter().find(|s| s["checkpoint"]["checkpoint_id"] == *id).unwrap()["metadata"]["run_id"],
            run.as_str()
        );
    }
    for s in states {
        assert_eq!(s["checkpoint"]["thread_id"], thread.as_str());
        assert_eq!(s["checkpoint"]["checkpoint_ns"], "");
        assert_eq!(s["metadata"]["source"], "loop");
        assert!(s["metadata"]["step"].as_i64().unwrap() > 0, "{s}");
        assert!(s["created_at"].is_string(), "{s}");
    }
    // each state is the thread as it was after its run
    assert_eq!(human_contents(&states[2]), ["list the services"]);
    assert_eq!(human_contents(&states[1]), ["list the services", "Look at the recent errors of payment-api"]);
    assert_eq!(human_contents(&states[0]).len(), 3);
    assert!(states[1]["values"]["messages"].as_array().unwrap().last().unwrap()["type"] == "ai", "{}", states[1]);
    // the paused run waits in `approval`; the finished ones wait on nothing
    assert_eq!(states[0]["next"], json!(["approval"]), "{}", states[0]);
    assert_eq!(states[0]["tasks"][0]["name"], "approval");
    assert!(states[0]["interrupts"][0]["id"].as_str().unwrap().starts_with("int_"), "{}", states[0]);
    for s in &states[1..] {
        assert_eq!((&s["next"], &s["tasks"], &s["interrupts"]), (&json!([]), &json!([]), &json!([])), "{s}");
    }
    // parents: each state's is the one after the run before it
    assert_eq!(states[0]["parent_checkpoint"], states[1]["checkpoint"]);
    assert_eq!(states[1]["parent_checkpoint"], states[2]["checkpoint"]);
    assert_eq!(states[2]["parent_checkpoint"], Value::Null);
    // the first is the current state
    let (_, current) = app.get(&format!("/langgraph/threads/{thread}/state")).await;
    assert_eq!(current["checkpoint"], states[0]["checkpoint"]);
    assert_eq!(current["values"], states[0]["values"]);
    assert_eq!(current["next"], states[0]["next"]);

    // `limit`, and the default (GET too)
    let (_, one) = app.post(&history_path, &json!({"limit": 1})).await;
    assert_eq!(one, json!([states[0]]));
    let (_, all) = app.post(&history_path, &json!({})).await;
    assert_eq!(all, history);
    let (_, two) = app.get(&format!("{history_path}?limit=2")).await;
    assert_eq!(two, json!(states[..2]));
    // `before`: the states older than a checkpoint (an object, or its id alone)
    let (_, older) = app.post(&history_path, &json!({"before": states[0]["checkpoint"]})).await;
    assert_eq!(older, json!(states[1..]));
    let (_, older) = app.post(&history_path, &json!({"before": checkpoint_ids[1], "limit": 5})).await;
    assert_eq!(older, json!(states[2..]));
    let (_, older) = app.get(&format!("{history_path}?before={}", checkpoint_ids[0])).await;
    assert_eq!(older, json!(states[1..]));
    let (_, none) = app.post(&history_path, &json!({"before": checkpoint_ids[2]})).await;
    assert_eq!(none, json!([]));
    // `checkpoint`: that one state; `metadata`: the states whose metadata has those values
    let (_, that) = app.post(&history_path, &json!({"checkpoint": states[1]["checkpoint"]})).await;
    assert_eq!(that, json!([states[1]]));
    let (_, that) = app.post(&history_path, &json!({"metadata": {"run_id": run_ids[2]}})).await;
    assert_eq!(that, json!([states[2]]));
    let (_, none) = app.post(&history_path, &json!({"metadata": {"source": "input"}})).await;
    assert_eq!(none, json!([]));
    // `threads.get_state` at a checkpoint
    let (status, at) = app.get(&format!("/langgraph/threads/{thread}/state/{}", checkpoint_ids[1])).await;
    assert_eq!((status, &at), (StatusCode::OK, &states[1]));
    let (status, at) = app
        .post(&format!("/langgraph/threads/{thread}/state/checkpoint"), &json!({"checkpoint": states[2]["checkpoint"]}))
        .await;
    assert_eq!((status, &at), (StatusCode::OK, &states[2]));
    let unknown = "run_00000000000000000000000000000000:4";
    let (status, _) = app.get(&format!("/langgraph/threads/{thread}/state/{unknown}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, none) = app.post(&history_path, &json!({"checkpoint": {"checkpoint_id": unknown}})).await;
    assert_eq!(none, json!([]));

    // bad input: 422 naming the field
    let cases = [
        (json!({"limit": 0}), "limit"),
        (json!({"limit": 101}), "limit"),
        (json!({"limit": "ten"}), "limit"),
        (json!({"before": 5}), "before"),
        (json!({"before": "nope"}), "before"),
        (json!({"checkpoint": "an id alone"}), "checkpoint"),
        (json!({"checkpoint": {"checkpoint_id": 5}}), "checkpoint.checkpoint_id"),
        (
            json!({"checkpoint": {"checkpoint_ns": "sub", "checkpoint_id": checkpoint_ids[0]}}),
            "checkpoint.checkpoint_ns",
        ),
        (json!({"metadata": []}), "metadata"),
        (json!({"select": ["values"]}), "select"),
        (json!({"surprise": 1}), "surprise"),
    ];
    for (body, named) in cases {
        let (status, error) = app.post(&history_path, &body).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}: {error}");
        assert!(error["error"]["message"].as_str().unwrap().contains(named), "{named}: {error}");
    }
    for query in ["limit=0", "limit=x", "before=nope", "surprise=1"] {
        let (status, error) = app.get(&format!("{history_path}?{query}")).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{query}: {error}");
    }
    let (status, _) = app.post("/langgraph/threads/nobody/history", &json!({})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

async fn delete(client: &reqwest::Client, app: &TestApp, path: &str) -> (StatusCode, Value) {
    to_json(client.delete(app.url(path)).send().await.expect("DELETE")).await
}

#[tokio::test]
async fn a_deleted_run_is_gone_from_this_api_and_kept_by_keels() {
    let app = TestApp::spawn().await;
    let thread = thread(&app).await;
    let runs = format!("/langgraph/threads/{thread}/runs");
    let ask =
        json!({"assistant_id": ASSISTANT, "input": {"messages": [{"role": "user", "content": "list the services"}]}});
    let (_, done) = app.post(&runs, &ask).await;
    let done = done["run_id"].as_str().unwrap().to_owned();
    app.wait_for_status(&done, "completed").await;
    let (_, paused) = app.post(&runs, &json!({"assistant_id": ASSISTANT, "input": restart_input()})).await;
    let paused = paused["run_id"].as_str().unwrap().to_owned();
    app.wait_for_status(&paused, "interrupted").await;
    let state_path = format!("/langgraph/threads/{thread}/state");
    let history_path = format!("/langgraph/threads/{thread}/history");
    let (_, state_before) = app.get(&state_path).await;
    let (_, history_before) = app.post(&history_path, &json!({})).await;
    assert_eq!(history_before.as_array().unwrap().len(), 2, "{history_before}");

    // a run not over: 409 RUN_ACTIVE, and it stays
    let (status, error) = delete(&app.client, &app, &format!("{runs}/{paused}")).await;
    assert_eq!((status, error["error"]["code"].as_str()), (StatusCode::CONFLICT, Some("RUN_ACTIVE")), "{error}");
    let (status, _) = app.get(&format!("{runs}/{paused}")).await;
    assert_eq!(status, StatusCode::OK);
    // another user's: 404, and it stays
    let (status, error) = delete(&app.client_for("bob"), &app, &format!("{runs}/{done}")).await;
    assert_eq!((status, error["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("CONVERSATION_NOT_FOUND")));
    let (status, _) = app.get(&format!("{runs}/{done}")).await;
    assert_eq!(status, StatusCode::OK);

    // a finished run: 204, then gone from this API — get, join, stream, cancel, list
    let (status, body) = delete(&app.client, &app, &format!("{runs}/{done}")).await;
    assert_eq!((status, body), (StatusCode::NO_CONTENT, Value::Null));
    for path in [format!("{runs}/{done}"), format!("{runs}/{done}/join"), format!("{runs}/{done}/stream")] {
        let (status, error) = app.get(&path).await;
        assert_eq!((status, error["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("RUN_NOT_FOUND")), "{path}");
    }
    let (status, _) = app.post(&format!("{runs}/{done}/cancel"), &json!({})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, listed) = app.get(&runs).await;
    let listed: Vec<&str> = listed.as_array().unwrap().iter().map(|r| r["run_id"].as_str().unwrap()).collect();
    assert_eq!(listed, [paused.as_str()]);
    // again: 404
    let (status, _) = delete(&app.client, &app, &format!("{runs}/{done}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    // the thread is unchanged, as in LangGraph (a run's record goes, the thread's checkpoints
    // stay): its values (the deleted run's messages stay), its state, its history, and the
    // deleted run's own state by its checkpoint
    let (_, state_after) = app.get(&state_path).await;
    assert_eq!(state_after, state_before);
    assert_eq!(human_contents(&state_after), ["list the services", RESTART_PROMPT]);
    let (_, history_after) = app.post(&history_path, &json!({})).await;
    assert_eq!(history_after, history_before);
    let deleted_checkpoint = history_before[1]["checkpoint"]["checkpoint_id"].as_str().unwrap();
    let (status, at_deleted) = app.get(&format!("/langgraph/threads/{thread}/state/{deleted_checkpoint}")).await;
    assert_eq!(status, StatusCode::OK, "{at_deleted}");
    assert_eq!(at_deleted, history_before[1]);

    // Keel keeps it: the run, its events, on Keel's own API
    let kept = app.run(&done).await;
    assert_eq!(kept["status"], "completed", "{kept}");
    let (status, events) = app.get(&format!("/v1/runs/{done}/events")).await;
    assert_eq!(status, StatusCode::OK, "{events}");
    let (_, own) = app.get("/v1/runs").await;
    assert!(own["runs"].as_array().unwrap().iter().any(|r| r["id"] == done.as_str()), "{own}");

    // once the paused run is over, it can be deleted too; the thread has no run left here
    let (status, _) = app.post(&format!("{runs}/{paused}/cancel?wait=true"), &json!({})).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = delete(&app.client, &app, &format!("{runs}/{paused}")).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (_, listed) = app.get(&runs).await;
    assert_eq!(listed, json!([]));
    let (_, thread_object) = app.get(&format!("/langgraph/threads/{thread}")).await;
    assert_eq!(thread_object["status"], "idle", "{thread_object}");
    assert_eq!(human_contents(&json!({"values": thread_object["values"]})), ["list the services", RESTART_PROMPT]);
}
