//! The human-in-the-loop story: a run that stops for approval and continues once, exactly once.

use keel_core::event::render_text;
use keel_core::{EventKind, ToolOutcomeStatus};
use reqwest::header::ACCEPT;
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::common::*;

#[tokio::test]
async fn restart_with_approval_over_sse() {
    let app = TestApp::spawn().await;
    let conversation = app.create_conversation().await;
    assert_eq!(app.instance("pay-prod-2").await["status"], "abnormal");

    // The request's stream: from sequence 1 until the run pauses.
    let mut stream = app.send_streaming(&conversation, &json!({"content": RESTART_PROMPT})).await;
    stream.assert_sse();
    let events = stream.collect().await;
    assert!(stream.raw.starts_with(b"retry: 2000\n\n"), "retry first");
    assert_contiguous(&events, 1);
    let kinds = types(&events);
    assert_eq!(kinds[0], "run_started");
    assert_eq!(kinds[1], "graph_topology");
    assert_eq!(*kinds.last().unwrap(), "interrupt", "{kinds:?}");
    let tool_started = events
        .iter()
        .position(|e| matches!(&e.kind, EventKind::ToolStarted { tool, .. } if tool == "find_abnormal_instances"));
    let tool_finished = events
        .iter()
        .position(|e| matches!(&e.kind, EventKind::ToolFinished { tool, .. } if tool == "find_abnormal_instances"));
    assert!(tool_started.unwrap() < tool_finished.unwrap(), "{kinds:?}");
    assert!(kinds.contains(&"text_delta"));
    let EventKind::Interrupt { interrupt_id, kind, payload, .. } = &events.last().unwrap().kind else { unreachable!() };
    assert_eq!(kind.as_str(), "confirm_action");
    assert_eq!(payload["actions"][0]["tool"], "restart_instance");
    assert_eq!(payload["actions"][0]["args"]["instanceId"], "pay-prod-2");
    let run_id = events[0].run_id.to_string();

    // What a refreshed page sees.
    let run = app.run(&run_id).await;
    assert_eq!(run["status"], "interrupted");
    assert_eq!(run["conversationId"], conversation);
    assert_eq!(run["lastSequence"], events.len() as i64);
    assert_eq!(run["checkpoint"]["nextStep"], "await_interrupt");
    assert_eq!(run["pendingInterrupt"]["id"], interrupt_id.as_str());
    assert_eq!(run["pendingInterrupt"]["kind"], "confirm_action");
    assert!(run["pendingInterrupt"]["expiresAt"].is_string());
    for call in run["toolCalls"].as_array().unwrap() {
        assert!(call.get("result").is_none(), "never a full result: {call}");
    }
    let (_, view) = app.get(&format!("/v1/conversations/{conversation}")).await;
    assert_eq!(view["activeRunId"], run_id.as_str());
    assert_eq!(view["facts"]["service"], "payment-api");

    // Approve over SSE: the stream starts at `resumed` and runs to `done`.
    let response = app
        .client
        .post(app.url(&format!("/v1/runs/{run_id}/resume")))
        .header(ACCEPT, "text/event-stream")
        .json(&json!({"interruptId": interrupt_id, "decision": "approve", "idempotencyKey": "resume-1"}))
        .send()
        .await
        .unwrap();
    let mut resumed = SseReader::new(response);
    resumed.assert_sse();
    let after = resumed.collect().await;
    assert_eq!(after[0].type_name(), "resumed", "{:?}", types(&after));
    assert_contiguous(&after, after[0].sequence);
    assert!(after[0].sequence > events.len() as i64);
    assert_eq!(after.last().unwrap().type_name(), "done");
    assert!(after.iter().any(|e| matches!(&e.kind,
        EventKind::ToolFinished { tool, status, .. } if tool == "restart_instance" && *status == ToolOutcomeStatus::Success)));

    let instance = app.instance("pay-prod-2").await;
    assert_eq!(instance["status"], "healthy");
    assert_eq!(instance["restartCount"], 1);
    let run = app.run(&run_id).await;
    assert_eq!(run["status"], "completed");
    assert!(run["pendingInterrupt"].is_null());

    // The stored messages of the run are what a client renders from its events.
    let all = app.events_json(&run_id, 0).await;
    assert_contiguous(&all, 1);
    let rendered: Vec<String> = render_text(&all).into_iter().map(|(_, text)| text).collect();
    let (_, view) = app.get(&format!("/v1/conversations/{conversation}")).await;
    assert!(view["activeRunId"].is_null());
    let stored: Vec<String> = view["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "assistant" && m["runId"] == run_id.as_str())
        .map(|m| m["content"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(rendered, stored);
    assert!(stored.last().unwrap().contains("Restarted pay-prod-2"), "{stored:?}");
}

#[tokio::test]
async fn restart_with_approval_with_wait() {
    let app = TestApp::spawn().await;
    let conversation = app.create_conversation().await;
    let turn = app.send_and_wait(&conversation, RESTART_PROMPT).await;
    assert_eq!(turn["run"]["status"], "interrupted", "{turn}");
    assert_eq!(turn["interrupt"]["kind"], "confirm_action");
    assert_eq!(turn["interrupt"]["payload"]["actions"][0]["args"]["instanceId"], "pay-prod-2");
    assert_eq!(turn["interrupt"], turn["run"]["pendingInterrupt"]);
    assert_eq!(turn["message"]["role"], "assistant");
    let run = turn["run"]["id"].as_str().unwrap();
    let interrupt = turn["interrupt"]["id"].as_str().unwrap();

    let (status, done) = app
        .post(
            &format!("/v1/runs/{run}/resume?wait=true"),
            &json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": "k1"}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{done}");
    assert_eq!(done["run"]["status"], "completed", "{done}");
    assert!(done["interrupt"].is_null());
    assert!(done["message"]["content"].as_str().unwrap().contains("Restarted pay-prod-2"), "{done}");
    assert_eq!(done["resume"]["runId"], run);
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 1);
}

/// The demo story turn by turn: errors, then the abnormal instance, then "restart this".
#[tokio::test]
async fn the_demo_conversation() {
    let app = TestApp::spawn().await;
    let conversation = app.create_conversation().await;

    let turn = app.send_and_wait(&conversation, ERRORS_PROMPT).await;
    assert_eq!(turn["run"]["status"], "completed", "{turn}");
    let text = turn["message"]["content"].as_str().unwrap();
    assert!(text.contains("12"), "{text}");

    let turn = app.send_and_wait(&conversation, "Continue investigating its recent error logs").await;
    assert_eq!(turn["run"]["status"], "completed", "{turn}");
    assert!(turn["message"]["content"].as_str().unwrap().contains("pay-prod-2"), "{turn}");

    let turn = app.send_and_wait(&conversation, "Restart this abnormal instance").await;
    assert_eq!(turn["run"]["status"], "interrupted", "{turn}");
    assert_eq!(turn["interrupt"]["payload"]["actions"][0]["args"]["instanceId"], "pay-prod-2");

    let (status, body) = app.get(&format!("/v1/conversations/{conversation}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["id"], conversation);
    assert_eq!(body["title"], "troubleshoot payment-api");
    assert_eq!(body["activeRunId"], turn["run"]["id"]);
    let roles: Vec<&str> = body["messages"].as_array().unwrap().iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles.iter().filter(|r| **r == "user").count(), 3, "{roles:?}");
    assert!(!roles.contains(&"tool"));
    let (_, list) = app.get("/v1/conversations").await;
    assert_eq!(list["conversations"].as_array().unwrap().len(), 1);
    let (_, other) = app.get_as("alice", "/v1/conversations").await;
    assert_eq!(other["conversations"], json!([]));
}

/// Twenty clients sending the same resume at once: one answer for all, at once (none is told to
/// retry: the key is taken by the claim that commits, and the others get its answer), one restart.
#[tokio::test]
async fn concurrent_resumes_with_one_key_restart_once() {
    let app = std::sync::Arc::new(TestApp::spawn().await);
    let (_, run, interrupt) = app.interrupted_run().await;
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let (app, run, interrupt) = (app.clone(), run.clone(), interrupt.clone());
        tasks.push(tokio::spawn(async move { app.resume(&run, &interrupt, json!("approve"), "same-key").await }));
    }
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    let first = answers[0].clone();
    assert_eq!(first.0, StatusCode::OK, "{}", first.1);
    assert_eq!(first.1["status"], "running");
    for answer in &answers {
        assert_eq!(answer, &first);
    }
    app.wait_for_status(&run, "completed").await;
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 1);
    let restarts = app
        .events_json(&run, 0)
        .await
        .into_iter()
        .filter(|e| matches!(&e.kind, EventKind::ToolStarted { tool, .. } if tool == "restart_instance"))
        .count();
    assert_eq!(restarts, 1);
}

/// Twenty different requests: one wins, the rest are told it was already resolved.
#[tokio::test]
async fn concurrent_resumes_with_different_keys_have_one_winner() {
    let app = std::sync::Arc::new(TestApp::spawn().await);
    let (_, run, interrupt) = app.interrupted_run().await;
    let mut tasks = Vec::new();
    for i in 0..20 {
        let (app, run, interrupt) = (app.clone(), run.clone(), interrupt.clone());
        tasks.push(tokio::spawn(
            async move { app.resume(&run, &interrupt, json!("approve"), &format!("key-{i}")).await },
        ));
    }
    let mut ok = 0;
    for task in tasks {
        let (status, body) = task.await.unwrap();
        match status {
            StatusCode::OK => ok += 1,
            StatusCode::CONFLICT => assert_eq!(body["error"]["code"], "INTERRUPT_ALREADY_RESOLVED", "{body}"),
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert_eq!(ok, 1);
    app.wait_for_status(&run, "completed").await;
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 1);
}

#[tokio::test]
async fn a_rejected_restart_changes_nothing() {
    let app = TestApp::spawn().await;
    let (_, run, interrupt) = app.interrupted_run().await;
    let response = app
        .client
        .post(app.url(&format!("/v1/runs/{run}/resume?wait=true")))
        .header("idempotency-key", "from-the-header")
        .json(&json!({"interruptId": interrupt, "decision": "reject"}))
        .send()
        .await
        .unwrap();
    let (status, body) = to_json(response).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["run"]["status"], "completed");
    assert!(body["message"]["content"].as_str().unwrap().contains("did not restart"), "{body}");
    let instance = app.instance("pay-prod-2").await;
    assert_eq!(instance["status"], "abnormal");
    assert_eq!(instance["restartCount"], 0);
}

#[tokio::test]
async fn cancel_ends_a_paused_run() {
    let app = TestApp::spawn().await;
    let (conversation, run, _) = app.interrupted_run().await;
    let (status, body) = app.post(&format!("/v1/runs/{run}/cancel"), &Value::Null).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "cancelled");
    assert!(body["pendingInterrupt"].is_null());
    assert_eq!(app.events_json(&run, 0).await.last().unwrap().type_name(), "cancelled");
    // The conversation takes a new message again.
    app.send(&conversation, ERRORS_PROMPT).await;
}

#[tokio::test]
async fn demo_reset_restores_the_fleet() {
    let app = TestApp::with(Options { demo_mode: true, ..Options::default() }).await;
    let (_, run, interrupt) = app.interrupted_run().await;
    let (status, _) = app.resume(&run, &interrupt, json!("approve"), "k").await;
    assert_eq!(status, StatusCode::OK);
    app.wait_for_status(&run, "completed").await;
    assert_eq!(app.instance("pay-prod-2").await["status"], "healthy");
    let (status, body) = app.post("/v1/demo/reset", &Value::Null).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let instance = app.instance("pay-prod-2").await;
    assert_eq!(instance["status"], "abnormal");
    assert_eq!(instance["restartCount"], 0);
}
