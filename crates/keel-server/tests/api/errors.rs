//! Every error a client can get, with its status and code, and no input that makes a 5xx.

use std::time::Duration;

use reqwest::header::{ACCEPT, CONTENT_TYPE};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use crate::common::*;

fn assert_error(status: StatusCode, body: &Value, want_status: u16, want_code: &str) {
    assert_eq!(status.as_u16(), want_status, "{body}");
    assert_eq!(body["error"]["code"], want_code, "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");
}

async fn raw(
    app: &TestApp,
    method: Method,
    path: &str,
    content_type: Option<&str>,
    body: Vec<u8>,
) -> (StatusCode, Value) {
    let mut request = app.client.request(method, app.url(path)).body(body);
    if let Some(ct) = content_type {
        request = request.header(CONTENT_TYPE, ct);
    }
    to_json(request.send().await.unwrap()).await
}

#[tokio::test]
async fn input_errors() {
    let app = TestApp::spawn().await;
    let conversation = app.create_conversation().await;
    let messages = format!("/v1/conversations/{conversation}/messages");

    let (s, b) = raw(&app, Method::POST, &messages, Some("application/json"), b"{\"content\": ".to_vec()).await;
    assert_error(s, &b, 400, "MALFORMED_JSON");
    let (s, b) = raw(&app, Method::POST, "/v1/conversations", Some("application/json"), b"{nope".to_vec()).await;
    assert_error(s, &b, 400, "MALFORMED_JSON");

    let (s, b) = raw(&app, Method::POST, &messages, Some("text/plain"), b"{\"content\": \"hi\"}".to_vec()).await;
    assert_error(s, &b, 415, "UNSUPPORTED_MEDIA_TYPE");
    let (s, b) = raw(&app, Method::POST, &messages, None, b"{\"content\": \"hi\"}".to_vec()).await;
    assert_error(s, &b, 415, "UNSUPPORTED_MEDIA_TYPE");

    let big = serde_json::to_vec(&json!({"content": "x".repeat(2 * 1024 * 1024)})).unwrap();
    let (s, b) = raw(&app, Method::POST, &messages, Some("application/json"), big).await;
    assert_error(s, &b, 413, "PAYLOAD_TOO_LARGE");

    // `["hi"]` too: serde reads a struct from an array of its fields (found by scripts/fuzz-api).
    for body in
        [json!({}), json!({"content": 5}), json!({"content": ""}), json!({"content": "  "}), json!([1]), json!(["hi"])]
    {
        let (s, b) = app.post(&messages, &body).await;
        assert_error(s, &b, 422, "VALIDATION_FAILED");
    }
    let (s, b) = app.post("/v1/conversations", &json!({"title": "x".repeat(201)})).await;
    assert_error(s, &b, 422, "VALIDATION_FAILED");
    let (s, b) = app.post("/v1/conversations", &json!({"title": 3})).await;
    assert_error(s, &b, 422, "VALIDATION_FAILED");
    // No body at all is a conversation without a title.
    let (s, b) = raw(&app, Method::POST, "/v1/conversations", None, Vec::new()).await;
    assert_eq!(s, StatusCode::CREATED, "{b}");
    assert_eq!(b["title"], "New conversation");
    let (s, b) = app.post("/v1/conversations", &json!([])).await;
    assert_error(s, &b, 422, "VALIDATION_FAILED");
    // Nor is `null`, which the OpenAPI spec allows for this optional body (found by scripts/fuzz-api).
    let (s, b) = raw(&app, Method::POST, "/v1/conversations", Some("application/json"), b"null".to_vec()).await;
    assert_eq!(s, StatusCode::CREATED, "{b}");

    for authorization in ["Basic ZGVtbzpkZW1v", "Bearer ", "Bearer keel_not_a_key", "bearer"] {
        let request = app.client.get(app.url("/v1/conversations")).header("authorization", authorization);
        let response = request.send().await.unwrap();
        assert_eq!(response.headers()["www-authenticate"], "Bearer realm=\"keel\"");
        let (s, b) = to_json(response).await;
        assert_error(s, &b, 401, "UNAUTHENTICATED");
    }

    let (s, b) = app.get(&format!("{messages}?wait=maybe")).await;
    assert_error(s, &b, 405, "METHOD_NOT_ALLOWED");
    let (s, b) = app.post(&format!("{messages}?wait=maybe"), &json!({"content": "hi"})).await;
    assert_error(s, &b, 400, "INVALID_QUERY");
}

#[tokio::test]
async fn not_found_and_method_not_allowed() {
    let app = TestApp::spawn().await;
    let conversation = app.create_conversation().await;

    let (s, b) = app.get("/v1/nothing-here").await;
    assert_error(s, &b, 404, "NOT_FOUND");
    let (s, b) = app.get("/v1").await;
    assert_error(s, &b, 404, "NOT_FOUND");
    for id in ["conv_doesnotexist", "not-an-id", "run_123", "conv_..%2F..%2Fetc"] {
        let (s, b) = app.get(&format!("/v1/conversations/{id}")).await;
        assert_error(s, &b, 404, "CONVERSATION_NOT_FOUND");
    }
    let (s, b) = app.get_as("alice", &format!("/v1/conversations/{conversation}")).await;
    assert_error(s, &b, 404, "CONVERSATION_NOT_FOUND");
    let (s, b) =
        app.post_as("alice", &format!("/v1/conversations/{conversation}/messages"), &json!({"content": "hi"})).await;
    assert_error(s, &b, 404, "CONVERSATION_NOT_FOUND");
    for path in ["/v1/runs/run_nope", "/v1/runs/garbage", "/v1/runs/run_nope/events"] {
        let (s, b) = app.get(path).await;
        assert_error(s, &b, 404, "RUN_NOT_FOUND");
    }
    let run = app.send(&conversation, ERRORS_PROMPT).await;
    let (s, b) = app.get_as("alice", &format!("/v1/runs/{run}")).await;
    assert_error(s, &b, 404, "RUN_NOT_FOUND");
    let (s, b) = app.resume(&run, "int_nope", json!("approve"), "k").await;
    assert_error(s, &b, 404, "INTERRUPT_NOT_FOUND");
    // Demo reset exists only in demo mode.
    let (s, b) = app.post("/v1/demo/reset", &json!({})).await;
    assert_error(s, &b, 404, "NOT_FOUND");

    for (method, path) in [
        (Method::DELETE, "/v1/conversations".to_owned()),
        (Method::PUT, format!("/v1/conversations/{conversation}")),
        (Method::GET, format!("/v1/runs/{run}/resume")),
        (Method::POST, "/healthz".to_owned()),
    ] {
        let (s, b) = raw(&app, method, &path, None, Vec::new()).await;
        assert_error(s, &b, 405, "METHOD_NOT_ALLOWED");
    }
}

#[tokio::test]
async fn run_and_resume_conflicts() {
    let app = TestApp::spawn().await;
    let (conversation, run, interrupt) = app.interrupted_run().await;
    let messages = format!("/v1/conversations/{conversation}/messages");

    let (s, b) = app.post(&messages, &json!({"content": "hello"})).await;
    assert_error(s, &b, 409, "RUN_ACTIVE");

    // The key: required, from the body or the header, the same in both.
    let resume = format!("/v1/runs/{run}/resume");
    let (s, b) = app.post(&resume, &json!({"interruptId": interrupt, "decision": "approve"})).await;
    assert_error(s, &b, 422, "VALIDATION_FAILED");
    let (s, b) = app.post(&resume, &json!({"interruptId": interrupt, "idempotencyKey": "k"})).await;
    assert_error(s, &b, 422, "VALIDATION_FAILED");
    let (s, b) =
        app.post(&resume, &json!({"interruptId": "run_x", "decision": "approve", "idempotencyKey": "k"})).await;
    assert_error(s, &b, 422, "VALIDATION_FAILED");
    let (s, b) = app.resume(&run, &interrupt, json!("maybe"), "k").await;
    assert_error(s, &b, 422, "INVALID_DECISION");
    let (s, b) = app.resume(&run, &interrupt, json!({"edit": {"call_nope": {}}}), "k").await;
    assert_error(s, &b, 422, "INVALID_DECISION");

    let (s, first) = app.resume(&run, &interrupt, json!("approve"), "k").await;
    assert_eq!(s, StatusCode::OK, "{first}");
    assert_eq!(first["runId"], run.as_str());
    assert_eq!(first["interruptId"], interrupt.as_str());
    assert!(first["resumedSequence"].as_i64().unwrap() > 0);
    // The same request again: the first answer, nothing re-executed.
    let (s, again) = app.resume(&run, &interrupt, json!("approve"), "k").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(again, first);
    // The same key for another request.
    let (s, b) = app.resume(&run, &interrupt, json!("reject"), "k").await;
    assert_error(s, &b, 422, "IDEMPOTENCY_KEY_REUSED");
    // Another key: someone already decided.
    let (s, b) = app.resume(&run, &interrupt, json!("approve"), "k2").await;
    assert_error(s, &b, 409, "INTERRUPT_ALREADY_RESOLVED");

    app.wait_for_status(&run, "completed").await;
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 1);
    // The header works as well as the body field.
    let response = app
        .client
        .post(app.url(&resume))
        .header("idempotency-key", "k")
        .json(&json!({"interruptId": interrupt, "decision": "approve"}))
        .send()
        .await
        .unwrap();
    let (s, b) = to_json(response).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(b, first);
    let response = app
        .client
        .post(app.url(&resume))
        .header("idempotency-key", "other")
        .json(&json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": "k"}))
        .send()
        .await
        .unwrap();
    let (s, b) = to_json(response).await;
    assert_error(s, &b, 422, "VALIDATION_FAILED");
}

#[tokio::test]
async fn an_expired_interrupt_is_gone() {
    let app = TestApp::with(Options { interrupt_ttl: Duration::from_millis(300), ..Options::default() }).await;
    let (_, run, interrupt) = app.interrupted_run().await;
    // Expiry is active: the run ends without anyone calling.
    let view = app.wait_for_status(&run, "cancelled").await;
    assert_eq!(view["reason"], "interrupt_expired");
    let (s, b) = app.resume(&run, &interrupt, json!("approve"), "late").await;
    assert_error(s, &b, 410, "INTERRUPT_EXPIRED");
    assert_eq!(app.instance("pay-prod-2").await["restartCount"], 0);
}

#[tokio::test]
async fn cursor_errors() {
    let app = TestApp::spawn().await;
    let conversation = app.create_conversation().await;
    let turn = app.send_and_wait(&conversation, ERRORS_PROMPT).await;
    let run = turn["run"]["id"].as_str().unwrap();
    let last = turn["run"]["lastSequence"].as_i64().unwrap();
    for bad in ["-1", "abc", "1.0", "+3", "18446744073709551616"] {
        let (s, b) = app.get(&format!("/v1/runs/{run}/events?after={bad}")).await;
        assert_error(s, &b, 400, "INVALID_CURSOR");
        let response = app
            .client
            .get(app.url(&format!("/v1/runs/{run}/events")))
            .header("last-event-id", bad)
            .send()
            .await
            .unwrap();
        let (s, b) = to_json(response).await;
        assert_error(s, &b, 400, "INVALID_CURSOR");
    }
    let (s, b) = app.get(&format!("/v1/runs/{run}/events?after={}", last + 1)).await;
    assert_error(s, &b, 400, "CURSOR_OUT_OF_RANGE");
    let response = app
        .client
        .get(app.url(&format!("/v1/runs/{run}/events")))
        .header("last-event-id", (last + 1).to_string())
        .header(ACCEPT, "application/json")
        .send()
        .await
        .unwrap();
    let (s, b) = to_json(response).await;
    assert_error(s, &b, 400, "CURSOR_OUT_OF_RANGE");
    // The header wins over the query…
    let with_header = |query: &str| {
        let request = app.client.get(app.url(&format!("/v1/runs/{run}/events?{query}")));
        request.header("last-event-id", last.to_string()).header(ACCEPT, "application/json").send()
    };
    let (s, b) = to_json(with_header("after=0").await.unwrap()).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(b["events"], json!([]));
    // …but a malformed query is refused all the same (found by scripts/fuzz-api: it used to be
    // ignored, so a client never learnt its cursor was broken).
    let (s, b) = to_json(with_header("after=zzz").await.unwrap()).await;
    assert_error(s, &b, 400, "INVALID_CURSOR");
}

#[tokio::test]
async fn health_and_readiness() {
    let app = TestApp::spawn().await;
    let (s, b) = app.get("/healthz").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(b["status"], "ok");
    let (s, _) = app.get("/readyz").await;
    assert_eq!(s, StatusCode::OK);
}

/// Odd input of every kind gets a 4xx, never a 5xx, and never internal text.
#[tokio::test]
async fn no_input_makes_a_server_error() {
    let app = TestApp::spawn().await;
    let (_, run, interrupt) = app.interrupted_run().await;
    let bodies: Vec<Vec<u8>> = vec![
        Vec::new(),
        b"null".to_vec(),
        b"\xff\xfe\x00".to_vec(),
        b"{\"content\": \"\\ud800\"}".to_vec(),
        b"{\"interruptId\": null, \"decision\": {}, \"idempotencyKey\": \"\"}".to_vec(),
        serde_json::to_vec(&json!({"interruptId": interrupt, "decision": {"calls": {}}, "idempotencyKey": "a"})).unwrap(),
        serde_json::to_vec(&json!({"interruptId": interrupt, "decision": {"edit": {"x": 1}}, "idempotencyKey": "b"})).unwrap(),
        serde_json::to_vec(&json!({"interruptId": interrupt, "decision": "approve", "idempotencyKey": "k".repeat(300)})).unwrap(),
        serde_json::to_vec(&json!({"content": "a".repeat(40_000)})).unwrap(),
        b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[".to_vec(),
    ];
    let paths = [
        "/v1/conversations".to_owned(),
        "/v1/conversations/conv_x/messages".to_owned(),
        format!("/v1/runs/{run}/resume"),
        format!("/v1/runs/{run}/cancel?x=%zz"),
        "/v1/runs/%00/resume".to_owned(),
        "/v1/conversations/%E2%28%A1".to_owned(),
    ];
    for path in &paths {
        for body in &bodies {
            for ct in [Some("application/json"), Some("application/json; charset=latin1"), None] {
                let (s, b) = raw(&app, Method::POST, path, ct, body.clone()).await;
                assert!(s.is_client_error() || s.is_success(), "{path} {ct:?}: {s} {b}");
                if s.is_client_error() {
                    assert!(b["error"]["code"].is_string(), "{b}");
                    let text = b.to_string().to_lowercase();
                    assert!(!text.contains("sql") && !text.contains("panic"), "{b}");
                }
            }
        }
    }
}

/// A large request head is read as before the server made its HTTP/1 connections itself: hyper's
/// read buffer starts at 8 KiB and grows for a request that needs more.
#[tokio::test]
async fn a_request_head_larger_than_the_read_buffer_is_read() {
    let app = TestApp::spawn().await;
    let response = app.client.get(app.url("/v1/runs")).header("x-filler", "a".repeat(64 * 1024)).send().await;
    assert_eq!(response.unwrap().status(), StatusCode::OK);
}
